"""Layers: the parts a block is built from (the multi-head attention mixer,
feed-forward layers, norms). Blocks and the layer stack live in `attention_jax.models`."""

import dataclasses
from typing import Any, Dict, Mapping

import flax.linen as nn

from attention_jax.layers.attention import MultiHeadAttention
from attention_jax.layers.feedforward import ACTIVATIONS, FeedForward
from attention_jax.layers.moe import MixtureOfExperts
from attention_jax.layers.norms import NORMS, AdaNorm, PowerNorm, ScaleNorm, make_norm
from attention_jax.layers.product_key import ProductKeyMemory

# The feed-forward layers a block can hold, by the model config's name.
FEED_FORWARD_LAYERS = {"mlp": FeedForward, "moe": MixtureOfExperts,
                       "product_key": ProductKeyMemory}
# Fields the block sets from the model config (where the layer has them);
# every other field of a feed-forward layer is one of its options.
_FROM_MODEL_CONFIG = ("mlp_dim", "activation", "dropout_rate", "dtype")
_NOT_OPTIONS = _FROM_MODEL_CONFIG + ("param_dtype", "kernel_init", "bias_init", "use_bias",
                                     "parent", "name")


def feed_forward_options(kind: str) -> Dict[str, Any]:
  """The options of feed-forward layer `kind` with their defaults."""
  if kind not in FEED_FORWARD_LAYERS:
    raise ValueError(f"feed_forward must be one of {tuple(FEED_FORWARD_LAYERS)}, got {kind!r}.")
  return {field.name: field.default for field in dataclasses.fields(FEED_FORWARD_LAYERS[kind])
          if field.name not in _NOT_OPTIONS}


def make_feed_forward(kind: str, *, mlp_dim: int, activation: str, dropout_rate: float,
                      dtype: Any, options: Mapping[str, Any], **module_kwargs) -> nn.Module:
  """Feed-forward layer `kind` (`[B, T, E] -> [B, T, E]`) with the model
  config's sizes where it has those fields, and its `options`."""
  valid = feed_forward_options(kind)
  for key in options:
    if key not in valid:
      raise ValueError(f"feed_forward {kind!r} has no option {key!r}; its options are "
                       f"{', '.join(sorted(valid))}.")
  fields = {field.name for field in dataclasses.fields(FEED_FORWARD_LAYERS[kind])}
  shared = dict(mlp_dim=mlp_dim, activation=activation, dropout_rate=dropout_rate, dtype=dtype)
  return FEED_FORWARD_LAYERS[kind](**{k: v for k, v in shared.items() if k in fields},
                                   **options, **module_kwargs)


__all__ = ["ACTIVATIONS", "AdaNorm", "FEED_FORWARD_LAYERS", "FeedForward", "MixtureOfExperts",
           "MultiHeadAttention", "NORMS", "PowerNorm", "ProductKeyMemory", "ScaleNorm",
           "feed_forward_options", "make_feed_forward", "make_norm"]
