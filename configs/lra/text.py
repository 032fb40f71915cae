"""Text (LRA): IMDB reviews as bytes, 2 classes, 4,000 bytes per review.

  python -m experiments.train --config=configs/lra/text.py:performer --workdir=runs/text

The data comes through tensorflow-datasets (`imdb_reviews`), downloaded on
first use or read from `--config.task_options.data_dir_tfds`. The default is the
LRA release's setting (lra_benchmarks/text_classification/configs/
base_tc_config.py): 4 layers of width 256, 4 heads, MLP 1024, [CLS] pooling,
batch 32, 20,000 steps, weight decay 0.1, rsqrt schedule of base rate 0.05 with
8,000 warm-up steps (peak 0.05 / sqrt(8000)). Presets:

- smoke: the first 2,000 / 256 / 256 reviews cut to 256 bytes, a 2-layer
  width-64 model and 300 steps.
"""

import ml_collections

from attention_jax.train.config import attention_preset_of, default_config, parse_config_arg

PRESETS = ("smoke",)


def get_config(arg: str = "dot_product"):
  variant, presets = parse_config_arg(arg, PRESETS)
  config = default_config(variant, attention_preset_of(presets))
  config.task = "text"
  config.task_options = ml_collections.ConfigDict(
      dict(data_dir_tfds=ml_collections.config_dict.placeholder(str)))
  config.model.update(num_layers=4, embed_dim=256, num_heads=4, mlp_dim=1024,
                      head_mlp_dim=1024, pooling="cls", position="sinusoidal",
                      dropout_rate=0.1)
  config.num_train_steps = 20_000
  config.batch_size = 32
  config.optimizer.update(learning_rate=0.05 / 8000 ** 0.5, warmup_steps=8000,
                          schedule="rsqrt", weight_decay=0.1, grad_clip_norm=0.0)
  config.eval_every = 1000
  config.checkpoint_every = 1000

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
