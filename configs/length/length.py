"""A small causal model trained at one length and tested at 2, 4 and 8 times
it: length generalisation (the table `configs/tables/length.py`).

  python -m experiments.train --config=configs/length/length.py:dot_product,chars,alibi ...
  python -m experiments.train --config=configs/length/length.py:dot_product,mqar,rope_yarn ...

The argument is `variant[,task][,position]`. Tasks: "chars", the character
LM of `attention_jax.data.chars` in segments of T = 64, scored in bits per
character; "mqar", multi-query associative recall at T = 32 with 2 and 4
key-value pairs, so that at longer lengths the same pairs lie farther from
their queries. Positions (`POSITIONS`): sinusoidal, learned (trained, but
refused past its table: tested at T only), rope, rope_ntk and rope_yarn (RoPE
trained plainly, scaled to each evaluation length by NTK-aware or YaRN
interpolation without fine-tuning), alibi, t5, xpos and nope (no positions:
the causal mask alone, as FoX and the recurrent mixers are run). Default:
chars, rope.

The model: 2 layers of width 64 (4 heads, MLP 256), no dropout, trained for
1,500 steps of batch 16 (chars: 1.5 M characters, under one pass over its
corpus; mqar: 1.2 passes over 20,000 examples) with AdamW at 3e-3, cosine
decay. Evaluation at T, 2T, 4T and 8T of the best checkpoint on the test
split (`config.length_eval`, `attention_jax.train.lengths`).
"""

from attention_jax.train.config import attention_preset_of, default_config, parse_config_arg

TASKS = ("chars", "mqar")
TRAIN_LENGTHS = {"chars": 64, "mqar": 32}
MULTIPLES = (2, 4, 8)
# name -> (model.position, the RoPE scaling applied at evaluation).
POSITIONS = {"sinusoidal": ("sinusoidal", None), "learned": ("learned", None),
             "rope": ("rope", None), "rope_ntk": ("rope", "ntk"), "rope_yarn": ("rope", "yarn"),
             "alibi": ("alibi", None), "t5": ("t5", None), "xpos": ("xpos", None),
             "nope": ("none", None)}


def position_overrides(name: str, train_length: int):
  """The model position and `length_eval` of position scheme `name` for a
  model trained at `train_length`: learned positions are tested at that
  length alone (they have no rows past it)."""
  position, scaling = POSITIONS[name]
  lengths = () if position == "learned" else tuple(m * train_length for m in MULTIPLES)
  return dict(model=dict(position=position),
              length_eval=dict(lengths=lengths, rope_scaling=scaling))


def get_config(arg: str = "dot_product"):
  variant, presets = parse_config_arg(arg, TASKS + tuple(POSITIONS))
  tasks = [p for p in presets if p in TASKS]
  positions = [p for p in presets if p in POSITIONS]
  if len(tasks) > 1 or len(positions) > 1:
    raise ValueError(f"config argument {arg!r} names more than one task or position; expected "
                     f"'variant[,task][,position]' with a task of {TASKS} and a position of "
                     f"{tuple(POSITIONS)}.")
  task = tasks[0] if tasks else "chars"
  train_length = TRAIN_LENGTHS[task]
  config = default_config(variant, attention_preset_of(presets))
  config.task = task
  if task == "chars":
    config.task_options = dict(train_size=2_000_000, validation_size=100_000,
                               test_size=100_000, seq_len=train_length)
  else:
    config.task_options = dict(train_size=20_000, validation_size=1_000, test_size=1_000,
                               seq_len=train_length, pair_counts=(2, 4), num_keys=64,
                               num_values=64)
  config.model.update(kind="language_model", num_layers=2, embed_dim=64, num_heads=4,
                      mlp_dim=256, dropout_rate=0.0, attention_dropout_rate=0.0)
  overrides = position_overrides(positions[0] if positions else "rope", train_length)
  config.model.update(overrides["model"])
  config.length_eval.update(overrides["length_eval"])
  config.num_train_steps = 1500
  config.batch_size = 16
  config.optimizer.update(learning_rate=3e-3, warmup_steps=100, schedule="cosine",
                          weight_decay=0.01, grad_clip_norm=1.0)
  config.eval_every = config.checkpoint_every = 500
  config.log_every = 100
  return config
