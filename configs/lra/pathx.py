"""Path-X (LRA): Pathfinder at 128 x 128 pixels, sequences of 16,384 tokens.

  python -m experiments.train --config=configs/lra/pathx.py:performer --workdir=runs/pathx

The settings of `pathfinder32.py` on the 128-pixel task (the LRA paper trains
Path-X like Pathfinder; every model it reports stays at chance, 50%). Presets:

- smoke: 512 / 128 / 128 "easy" images, 50 steps of batch 8; it checks that a
  variant runs at this length, it does not learn in that time.
"""

import pathlib

from attention_jax.train.config import attention_preset_of, load_config_module, parse_config_arg

PRESETS = ("smoke",)


def get_config(arg: str = "dot_product"):
  variant, presets = parse_config_arg(arg, PRESETS)
  # Pathfinder's settings, on the 128-pixel task.
  config = load_config_module(pathlib.Path(__file__).with_name("pathfinder32.py")).get_config(
      f"{variant},{attention_preset_of(presets)}")
  config.task = "pathfinder128"

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
