"""A ListOps run small enough for tests: `--config=tests/train/tiny_config.py`.

The data directory defaults to a folder of the working directory; tests point
it at their tmp_path with `--config.data_dir=...`.
"""

from attention_jax.train.config import default_config


def get_config(arg: str = "dot_product"):
  config = default_config(arg)
  config.task = "listops"
  config.task_options = dict(train_size=512, validation_size=64, test_size=48, max_depth=3,
                             max_args=4, min_length=8, max_length=40)
  config.data_dir = "data"
  config.model.update(num_layers=1, embed_dim=16, num_heads=2, mlp_dim=32,
                      head_mlp_dim=16, dropout_rate=0.1)
  config.num_train_steps = 24
  config.batch_size = 16
  config.eval_batch_size = 32
  config.optimizer.update(learning_rate=3e-3, warmup_steps=4, schedule="cosine")
  config.eval_every = 8
  config.log_every = 2
  config.checkpoint_every = 4
  config.keep_checkpoints = 2
  config.progress = False
  return config
