"""ListOps (LRA): nested MAX/MIN/MED/SM expressions, 10 classes, up to 2,000 tokens.

  python -m experiments.train --config=configs/lra/listops.py:performer --workdir=runs/lo
  python -m experiments.train --config=configs/lra/listops.py:performer,smoke --workdir=...

The default is what the LRA release ran: its base config
(lra_benchmarks/listops/configs/base_listops_config.py) as lra_benchmarks/
listops/train.py turns it into a model and a training run.

- Model: 4 layers of width 512 (qkv_dim 512), 8 heads, MLP 1024, 2,000 tokens.
  train.py passes only the sizes, max_len and num_classes, so the rest are the
  model's defaults (models/transformer/transformer.py, TransformerEncoder):
  [CLS] pooling, sinusoidal positions (learn_pos_emb=False), dropout 0.1,
  attention dropout 0.1 (ours: 0, below), untied layers; the head (models/
  layers/common_layers.py, classifier_head) is Dense(mlp_dim) -> ReLU -> Dense.
- Training: batch 32, 5,000 steps, Adam (0.9, 0.98, 1e-9) with decoupled
  weight decay 0.1, no gradient clipping; the schedule is train_utils'
  default "constant * linear_warmup * rsqrt_decay" with constant 0.05 and
  1,000 warm-up steps (train.py passes only the base rate; the config's
  `factors` and `warmup` say the same), i.e. 0.05 * min(1, s/1000) /
  sqrt(max(s, 1000)), a peak of 0.05 / sqrt(1000) at step 1,000.
- Evaluation: the whole validation split every 50 steps (eval_frequency).

Attention dropout is 0, not the release's 0.1: most of our variants have no
attention weights to drop and refuse a rate above 0 in training, and a
comparison should not favour those that do (docs/ARCHITECTURE.md).

What no config key expresses, on every task (docs/lra_release.md): our
weight decay skips biases and norm scales (flax's Adam decays every
parameter); our head applies dropout to the pooled features (the release's
none); our [CLS] gets no position embedding (the release's takes position 0
and moves the tokens to 1..T); the test split is scored at the best
validation step (the release scores its last state).

Per-variant settings belong to the variants' `lra_release` presets (e.g. the
release's Sinkhorn encoder has no [CLS] and pools by the mean, its model
default, since listops/train.py passes no pooling). Presets:

- smoke: short expressions (depth <= 4, at most 5 arguments, 100 tokens), a
  2-layer width-64 model and 600 steps; a few minutes on a 2-core CPU and
  clearly above the majority class.
- funnel: the model is a Funnel Transformer (`kind="funnel"`, models/funnel.py)
  of three stages of two blocks, the sequence halved between stages, the
  [CLS] kept apart; `:dot_product,funnel,smoke` is its smoke run.
- hierarchical: the model is a hierarchical Transformer (`kind=
  "hierarchical"`, models/hierarchical.py): chunks of 100 tokens (20 with
  smoke), each encoded by `num_layers` blocks and read at its [CLS], then 2
  blocks over the chunk vectors; `:dot_product,hierarchical,smoke` is its
  smoke run.
"""

from attention_jax.train.config import attention_preset_of, default_config, parse_config_arg

PRESETS = ("smoke", "funnel", "hierarchical")

def get_config(arg: str = "dot_product"):
  variant, presets = parse_config_arg(arg, PRESETS)
  config = default_config(variant, attention_preset_of(presets))
  config.task = "listops"
  # The classifier head's hidden layer is mlp_dim wide (classifier_head(..., mlp_dim)).
  config.model.update(num_layers=4, embed_dim=512, num_heads=8, mlp_dim=1024,
                      head_mlp_dim=1024, pooling="cls", position="sinusoidal",
                      dropout_rate=0.1, attention_dropout_rate=0.0)  # release: 0.1, see above
  config.num_train_steps = 5000
  config.batch_size = 32
  # rsqrt: the peak is the release's constant over sqrt(warmup).
  config.optimizer.update(learning_rate=0.05 / 1000 ** 0.5, warmup_steps=1000,
                          schedule="rsqrt", weight_decay=0.1, grad_clip_norm=0.0)
  # Every evaluation is checkpointed too (the trainer keeps the best one).
  config.eval_every = config.checkpoint_every = 50

  if "smoke" in presets:
    config.task_options = dict(train_size=5000, validation_size=500, test_size=500,
                               max_depth=4, max_args=5, min_length=20, max_length=100)
    config.model.update(num_layers=2, embed_dim=64, num_heads=4, mlp_dim=128, head_mlp_dim=128,
                        dropout_rate=0.0)
    config.num_train_steps = 600
    config.optimizer.update(learning_rate=2e-3, warmup_steps=60, schedule="cosine",
                            weight_decay=0.01, grad_clip_norm=1.0)
    config.eval_every = 200
    config.checkpoint_every = 200
    config.log_every = 25
  if "funnel" in presets:
    config.model.update(kind="funnel", funnel_blocks=(2, 2, 2))
  if "hierarchical" in presets:
    config.model.update(kind="hierarchical", chunk_length=20 if "smoke" in presets else 100,
                        sentence_layers=2)
  return config
