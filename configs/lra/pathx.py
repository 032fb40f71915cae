"""Path-X (LRA): Pathfinder at 128 x 128 pixels, sequences of 16,384 tokens.

  python -m experiments.train --config=configs/lra/pathx.py:performer --workdir=runs/pathx

The settings of `pathfinder32.py` on the 128-pixel task (the LRA paper trains
Path-X like Pathfinder; every model it reports stays at chance, 50%). Presets:

- smoke: 512 / 128 / 128 "easy" images, 50 steps of batch 8; it checks that a
  variant runs at this length, it does not learn in that time.
"""

from attention_jax.train.config import default_config, parse_config_arg

PRESETS = ("smoke",)
TRAIN_EXAMPLES = 159_840


def get_config(arg: str = "dot_product"):
  variant, presets = parse_config_arg(arg, PRESETS)
  config = default_config()
  config.task = "pathfinder128"
  config.model.attention = variant
  config.model.update(num_layers=1, embed_dim=128, num_heads=4, mlp_dim=128, head_mlp_dim=128,
                      pooling="mean", position="sinusoidal", dropout_rate=0.2)
  config.batch_size = 512
  steps_per_epoch = TRAIN_EXAMPLES // config.batch_size
  config.num_train_steps = 200 * steps_per_epoch
  config.optimizer.update(learning_rate=1e-3, warmup_steps=steps_per_epoch, schedule="cosine",
                          weight_decay=0.0, grad_clip_norm=0.0)
  config.eval_every = config.checkpoint_every = 5 * steps_per_epoch

  if "smoke" in presets:
    config.task_options = dict(train_size=512, validation_size=128, test_size=128,
                               difficulty="easy")
    config.model.update(embed_dim=32, mlp_dim=64, dropout_rate=0.0)
    config.batch_size = 8
    config.eval_batch_size = 32
    config.num_train_steps = 50
    config.optimizer.update(warmup_steps=5)
    config.eval_every = config.checkpoint_every = 50
    config.log_every = 10
  return config
