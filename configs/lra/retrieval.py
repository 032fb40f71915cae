"""Retrieval (LRA): does one AAN paper cite the other? Two documents of 4,000
bytes each, 2 classes, a dual-tower model.

  python -m experiments.train --config=configs/lra/retrieval.py:performer \\
      --config.task_options.release_dir=/path/to/lra_release/tsv_data --workdir=runs/aan

The pairs come from the LRA release's `new_aan_pairs.{train,eval,test}.tsv`,
which cannot be generated: name their folder with `task_options.release_dir`
(needed once, to prepare the data). The default is the LRA release's setting
(lra_benchmarks/matching/configs/base_match_config.py): 4 layers of width
128, 4 heads, MLP 512, [CLS] pooling, the head on [u, v, u*v, u-v], batch 32,
5,000 steps, weight decay 0.1, rsqrt schedule of base rate 0.05 with 8,000
warm-up steps. Presets:

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
  config.task_options = ml_collections.ConfigDict(
      dict(release_dir=ml_collections.config_dict.placeholder(str)))
  config.model.update(kind="dual_classifier", num_layers=4, embed_dim=128, num_heads=4,
                      mlp_dim=512, head_mlp_dim=512, pooling="cls", position="sinusoidal",
                      dropout_rate=0.1)
  config.num_train_steps = 5000
  config.batch_size = 32
  config.optimizer.update(learning_rate=0.05 / 8000 ** 0.5, warmup_steps=8000,
                          schedule="rsqrt", weight_decay=0.1, grad_clip_norm=0.0)
  config.eval_every = config.checkpoint_every = 500

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
