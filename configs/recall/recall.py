"""A causal language model on a generated recall task (attention_jax.data.recall).

  python -m experiments.train --config=configs/recall/recall.py:linear,mqar,T128 --workdir=...
  python -m experiments.train --config=configs/recall/recall.py:dot_product,induction_heads ...

The argument is `variant[,task][,length]`: the task is one of "mqar"
(multi-query associative recall, the default), "induction_heads" or
"selective_copying"; the length one of T32, T64 (default), T128, T256. The model is
Zoology's small one (Arora et al. 2023 train 2 layers of width 64 to 512 on
MQAR): 2 layers, width 64, 4 heads, learned positions, no dropout, trained
on the scored tokens only (the answers; the keys, values and noise are
unpredictable by construction). MQAR trains on a mixture of 2 to T/8
key-value pairs (the largest has the pairs filling a quarter of the
sequence) and evaluation reports test accuracy per pair count
("pairs<n>_accuracy"), as Zoology's plots of accuracy against pairs.

Sizes fit a 2-core CPU: 20,000 training examples, 1,000 steps of batch 32
(1.6 epochs). Dense attention learns MQAR at T = 64 in that budget (100% by
step 1,000); at T = 128 it does not (19% after 1,500 steps), which is why the
recall table stops at 64.
"""

from attention_jax.train.config import attention_preset_of, default_config, parse_config_arg

TASKS = ("mqar", "induction_heads", "selective_copying")
LENGTHS = {"T32": 32, "T64": 64, "T128": 128, "T256": 256}


def pair_counts(seq_len: int):
  """2, 4, ... up to seq_len / 8: the pairs take at most a quarter of the sequence
  (and their queries a quarter more)."""
  counts, pairs = [], 2
  while pairs <= seq_len // 8:
    counts.append(pairs)
    pairs *= 2
  return tuple(counts)


def task_and_length(arg: str, tasks, lengths, *, default_task: str, default_length: int,
                    task_word: str = "task"):
  """`variant[,task][,length]` of a config argument: `(variant, attention
  preset, task, sequence length)`, with the defaults where one is not named.
  `lengths` maps a preset ("T64") to its length; `task_word` names the choice
  in the error (the needle config's "kind")."""
  variant, presets = parse_config_arg(arg, tuple(tasks) + tuple(lengths))
  chosen_tasks = [p for p in presets if p in tasks]
  chosen_lengths = [lengths[p] for p in presets if p in lengths]
  if len(chosen_tasks) > 1 or len(chosen_lengths) > 1:
    raise ValueError(f"config argument {arg!r} names more than one {task_word} or length; "
                     f"expected 'variant[,{task_word}][,length]' with a {task_word} of "
                     f"{tuple(tasks)} and a length of {tuple(lengths)}.")
  return (variant, attention_preset_of(presets),
          chosen_tasks[0] if chosen_tasks else default_task,
          chosen_lengths[0] if chosen_lengths else default_length)


def get_config(arg: str = "dot_product"):
  variant, attention_preset, task, seq_len = task_and_length(
      arg, TASKS, LENGTHS, default_task="mqar", default_length=64)
  config = default_config(variant, attention_preset)
  config.task = task
  config.task_options = dict(train_size=20_000, validation_size=1_000, test_size=1_000,
                             seq_len=seq_len)
  if task == "mqar":
    config.task_options.update(pair_counts=pair_counts(seq_len), num_keys=64, num_values=64)
  config.model.update(kind="language_model", num_layers=2, embed_dim=64, num_heads=4,
                      mlp_dim=128, position="learned", dropout_rate=0.0,
                      attention_dropout_rate=0.0)
  config.num_train_steps = 1000
  config.batch_size = 32
  config.optimizer.update(learning_rate=3e-3, warmup_steps=100, schedule="cosine",
                          weight_decay=0.01, grad_clip_norm=1.0)
  config.eval_every = config.checkpoint_every = 500
  config.log_every = 100
  return config
