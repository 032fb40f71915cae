"""Models built from names: the encoder, the classifiers (one sequence or a pair),
the causal language model, and `build_model`."""

from __future__ import annotations

from typing import Any, Mapping, Union

import jax.numpy as jnp
import ml_collections
from flax.core import FrozenDict

from attention_jax import positional, registry
from attention_jax.layers.feedforward import check_activation
from attention_jax.layers.norms import check_norm
from attention_jax.models.classifier import (POOLINGS, DualEncoderClassifier, SequenceClassifier,
                                            check_pooling)
from attention_jax.models.encoder import Encoder
from attention_jax.models.language_model import LanguageModel

# What `build_model` makes: a classifier of one sequence, of a pair of sequences
# (retrieval), or a causal language model.
MODEL_KINDS = ("classifier", "dual_classifier", "language_model")

Model = Union[SequenceClassifier, DualEncoderClassifier, LanguageModel]


def default_model_config() -> ml_collections.ConfigDict:
  """A small classifier; every key `build_model` accepts, with its default."""
  placeholder = ml_collections.config_dict.placeholder
  return ml_collections.ConfigDict(dict(
      kind="classifier",  # one of MODEL_KINDS
      vocab_size=256,
      num_classes=2,  # classifiers only
      num_layers=2,
      embed_dim=64,
      num_heads=4,
      num_kv_heads=placeholder(int),  # None: the variant's default (all heads for MHA).
      mlp_dim=128,
      max_length=512,
      attention="dot_product",
      attention_options={},
      position="sinusoidal",
      position_options={},
      pre_norm=True,
      norm="layernorm",
      activation="gelu",
      pooling="cls",
      head_mlp_dim=placeholder(int),  # None: a linear head.
      dropout_rate=0.1,
      attention_dropout_rate=0.0,
      dtype="float32",
  ))


def _as_dict(value: Any) -> FrozenDict:
  if isinstance(value, ml_collections.ConfigDict):
    value = value.to_dict()
  return FrozenDict(value or {})


def build_model(config: Mapping[str, Any]) -> Model:
  """The model of `config.kind` from a model config; missing keys take their defaults.

  "classifier" is a `SequenceClassifier`, "dual_classifier" a
  `DualEncoderClassifier`, "language_model" a `LanguageModel` (which ignores the
  classifier keys `num_classes`, `pooling` and `head_mlp_dim`).

  Args:
    config: a `ConfigDict` (or mapping) with keys of `default_model_config()`.

  Raises:
    ValueError: on an unknown key, or an unknown kind, attention, position, norm,
      activation, pooling or dtype name.
  """
  defaults = default_model_config()
  config = dict(config.items())
  for key in config:
    if key not in defaults:
      raise ValueError(f"unknown model config key {key!r}; valid keys are: "
                       f"{', '.join(sorted(defaults.keys()))}.")
  c = {k: config.get(k, defaults[k]) for k in defaults.keys()}

  # Fail when the model is built, not at the first trace.
  if c["kind"] not in MODEL_KINDS:
    raise ValueError(f"model kind must be one of {MODEL_KINDS}, got {c['kind']!r}.")
  spec = registry.get_variant(c["attention"])
  if c["kind"] == "language_model" and not spec.causal:
    causal = [name for name in registry.list_variants() if registry.get_variant(name).causal]
    raise ValueError(f"a language model needs causal attention; attention {c['attention']!r} "
                     f"has no causal form. Causal variants: {', '.join(causal)}.")
  positional.check_position_encoding(c["position"])
  check_norm(c["norm"])
  check_activation(c["activation"])
  check_pooling(c["pooling"])
  try:
    dtype = jnp.dtype(c["dtype"])
  except TypeError as e:
    raise ValueError(f"dtype must name a JAX dtype such as 'float32' or 'bfloat16', got "
                     f"{c['dtype']!r}.") from e

  encoder = Encoder(
      vocab_size=c["vocab_size"], num_layers=c["num_layers"], embed_dim=c["embed_dim"],
      num_heads=c["num_heads"], mlp_dim=c["mlp_dim"], max_length=c["max_length"],
      position=c["position"], position_options=_as_dict(c["position_options"]),
      attention=c["attention"], attention_options=_as_dict(c["attention_options"]),
      num_kv_heads=c["num_kv_heads"], activation=c["activation"], norm=c["norm"],
      pre_norm=c["pre_norm"], dropout_rate=c["dropout_rate"],
      attention_dropout_rate=c["attention_dropout_rate"], dtype=dtype)
  if c["kind"] == "language_model":
    return LanguageModel(encoder=encoder)
  classifier = SequenceClassifier if c["kind"] == "classifier" else DualEncoderClassifier
  return classifier(encoder=encoder, num_classes=c["num_classes"], pooling=c["pooling"],
                    head_mlp_dim=c["head_mlp_dim"], dropout_rate=c["dropout_rate"])


__all__ = ["DualEncoderClassifier", "Encoder", "LanguageModel", "MODEL_KINDS", "POOLINGS",
           "SequenceClassifier", "build_model", "default_model_config"]
