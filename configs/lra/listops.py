"""ListOps (LRA): nested MAX/MIN/MED/SM expressions, 10 classes, up to 2,000 tokens.

  python -m experiments.train --config=configs/lra/listops.py:performer --workdir=runs/lo
  python -m experiments.train --config=configs/lra/listops.py:performer,smoke --workdir=...

The default is the LRA release's setting (lra_benchmarks/listops/configs/
base_listops_config.py): 6 layers of width 512, 8 heads, MLP 2048, [CLS]
pooling, batch 32, 5,000 steps, Adam(W) with weight decay 0.1 and the
"constant * linear_warmup * rsqrt_decay" schedule of base rate 0.05 and 1,000
warm-up steps, i.e. a peak of 0.05 / sqrt(1000). Presets:

- smoke: short expressions (depth <= 4, at most 5 arguments, 100 tokens), a
  2-layer width-64 model and 600 steps; a few minutes on a 2-core CPU and
  clearly above the majority class.
"""

from attention_jax.train.config import attention_preset_of, default_config, parse_config_arg

PRESETS = ("smoke",)


def get_config(arg: str = "dot_product"):
  variant, presets = parse_config_arg(arg, PRESETS)
  config = default_config(variant, attention_preset_of(presets))
  config.task = "listops"
  config.model.update(num_layers=6, embed_dim=512, num_heads=8, mlp_dim=2048,
                      head_mlp_dim=2048, pooling="cls", position="sinusoidal",
                      dropout_rate=0.1)
  config.num_train_steps = 5000
  config.batch_size = 32
  config.optimizer.update(learning_rate=0.05 / 1000 ** 0.5, warmup_steps=1000,
                          schedule="rsqrt", weight_decay=0.1, grad_clip_norm=0.0)
  config.eval_every = 500
  config.checkpoint_every = 500

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
  return config
