"""A small sequence classifier, named by its attention variant.

Used as `--config=configs/models/classifier.py:performer` by scripts that take an
ml_collections config file; `get_config` returns the model section every LRA
config embeds (`config.model`), with the variant filled in.
"""

import ml_collections

from attention_jax.attention_options import options_config
from attention_jax.models import default_model_config
from attention_jax.registry import get_mixer


def get_config(variant: str = "dot_product") -> ml_collections.ConfigDict:
  """The model config of `build_model` with `attention=variant`.

  Args:
    variant: a registered token mixer's name; an unknown one raises a
      ValueError that lists the valid names, a pooling or alignment module one
      that says what it is.
  """
  get_mixer(variant)
  config = ml_collections.ConfigDict()
  config.model = default_model_config()
  config.model.attention = variant
  config.model.attention_options = options_config(variant)
  return config
