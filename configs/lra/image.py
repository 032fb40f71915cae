"""Image (LRA): CIFAR-10 as 1,024 grey 8-bit pixels, 10 classes.

  python -m experiments.train --config=configs/lra/image.py:performer --workdir=runs/image

The data comes through tensorflow-datasets (`cifar10`). The default is the LRA
release's setting (lra_benchmarks/image/configs/cifar10/base_cifar10_config.py):
1 layer of width 32, 1 head, MLP 64, [CLS] pooling, learned positions, dropout
0.3, batch 256, 200 epochs of 175 steps, no weight decay or clipping, cosine
decay from 5e-4 after a one-epoch warm-up. Presets:

- smoke: 2,000 / 256 / 256 images and 300 steps of batch 32.
"""

import ml_collections

from attention_jax.train.config import attention_preset_of, default_config, parse_config_arg

PRESETS = ("smoke",)
TRAIN_EXAMPLES = 45_000


def get_config(arg: str = "dot_product"):
  variant, presets = parse_config_arg(arg, PRESETS)
  config = default_config(variant, attention_preset_of(presets))
  config.task = "image"
  config.task_options = ml_collections.ConfigDict(
      dict(data_dir_tfds=ml_collections.config_dict.placeholder(str)))
  config.model.update(num_layers=1, embed_dim=32, num_heads=1, mlp_dim=64, head_mlp_dim=64,
                      pooling="cls", position="learned", dropout_rate=0.3)
  config.batch_size = 256
  steps_per_epoch = TRAIN_EXAMPLES // config.batch_size
  config.num_train_steps = 200 * steps_per_epoch
  config.optimizer.update(learning_rate=5e-4, warmup_steps=steps_per_epoch, schedule="cosine",
                          weight_decay=0.0, grad_clip_norm=0.0)
  config.eval_every = config.checkpoint_every = 5 * steps_per_epoch

  if "smoke" in presets:
    config.task_options.update(dict(train_size=2000, validation_size=256, test_size=256))
    config.batch_size = 32
    config.num_train_steps = 300
    config.optimizer.update(learning_rate=2e-3, warmup_steps=30)
    config.eval_every = config.checkpoint_every = 100
    config.log_every = 25
  return config
