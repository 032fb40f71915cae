"""Retrieval (LRA): does one AAN paper cite the other? Two documents of 4,000
bytes each, 2 classes, a dual-tower model.

  python -m experiments.train --config=configs/lra/retrieval.py:performer \\
      --config.task_options.release_dir=/path/to/lra_release/tsv_data --workdir=runs/aan

The pairs come from the LRA release's `new_aan_pairs.{train,eval,test}.tsv`,
which cannot be generated: name their folder with `task_options.release_dir`
(needed once, to prepare the data). The default is what the LRA release ran:
its base config (lra_benchmarks/matching/configs/base_match_config.py) as
lra_benchmarks/matching/train.py turns it into a model and a training run.

- Data: 4,000 bytes per document (`max_length = 4000`, the data's default).
- Model: 4 layers of width 128 (qkv_dim 128), 4 heads, MLP 512, both
  documents through one shared encoder. train.py passes the sizes, max_len,
  num_classes and classifier_pool ("CLS"); the rest are the model's defaults
  (models/transformer/transformer.py, TransformerDualEncoder): sinusoidal
  positions, dropout 0.1, attention dropout 0.1 (ours: 0, below).
- Training: batch 32, 5,000 steps, Adam (0.9, 0.98, 1e-9) with decoupled
  weight decay 0.1, no gradient clipping, "constant * linear_warmup *
  rsqrt_decay" with constant 0.05 and 8,000 warm-up steps: longer than the
  run, so the rate rises linearly to 0.05 * 5000 / 8000 / sqrt(8000) and never
  decays.
- Evaluation: the whole validation split every 100 steps.

Attention dropout is 0, not the release's 0.1: most of our variants have no
attention weights to drop and refuse a rate above 0 in training, and a
comparison should not favour those that do (docs/ARCHITECTURE.md).

What no config key expresses, on every task (docs/lra_release.md): our
weight decay skips biases and norm scales (flax's Adam decays every
parameter); our head applies dropout to the pooled features (the release's
none); the test split is scored at the best validation step (the release
scores its last state).

On this task besides: the release's dual encoder prepends no [CLS] (its
inner TransformerEncoder is built without `classifier`), so its "CLS" pooling
reads each document's first byte; we pool a learned [CLS]. Its head
(common_layers.classifier_head_dual, interaction=None: train.py passes none)
is Dense(512) -> ReLU -> Dense(256) -> ReLU -> Dense on [u, v]; ours is
Dense(head_mlp_dim=512) -> ReLU -> Dense on [u, v, u*v, u-v]. Presets:

- smoke: the first 2,000 / 256 / 256 pairs cut to 256 bytes, a 2-layer width-64
  model and 300 steps.
"""

import ml_collections

from attention_jax.train.config import attention_preset_of, default_config, parse_config_arg

PRESETS = ("smoke",)

def get_config(arg: str = "dot_product"):
  variant, presets = parse_config_arg(arg, PRESETS)
  config = default_config(variant, attention_preset_of(presets))
  config.task = "retrieval"
  # seq_len is left at the data's default, the release's 4000 (setting it would
  # file the prepared data under another folder, see trainer.task_data_dir).
  config.task_options = ml_collections.ConfigDict(
      dict(release_dir=ml_collections.config_dict.placeholder(str)))
  config.model.update(kind="dual_classifier", num_layers=4, embed_dim=128, num_heads=4,
                      mlp_dim=512, head_mlp_dim=512, pooling="cls", position="sinusoidal",
                      dropout_rate=0.1, attention_dropout_rate=0.0)  # release: 0.1, see above
  config.num_train_steps = 5000
  config.batch_size = 32
  # rsqrt: the peak is the release's constant over sqrt(warmup).
  config.optimizer.update(learning_rate=0.05 / 8000 ** 0.5, warmup_steps=8000,
                          schedule="rsqrt", weight_decay=0.1, grad_clip_norm=0.0)
  # Every evaluation is checkpointed too (the trainer keeps the best one).
  config.eval_every = config.checkpoint_every = 100

  if "smoke" in presets:
    config.task_options.update(dict(seq_len=256, train_size=2000, validation_size=256,
                                    test_size=256))
    config.model.update(num_layers=2, embed_dim=64, num_heads=4, mlp_dim=128, head_mlp_dim=128)
    config.num_train_steps = 300
    config.optimizer.update(learning_rate=1e-3, warmup_steps=30, schedule="cosine",
                            weight_decay=0.01, grad_clip_norm=1.0)
    config.eval_every = config.checkpoint_every = 100
    config.log_every = 25
  return config
