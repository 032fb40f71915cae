"""Sequence classification: an encoder, a pooling of its outputs, a classifier head;
one sequence or a pair (two towers sharing the encoder)."""

from __future__ import annotations

from typing import Optional

import flax.linen as nn
import jax.numpy as jnp

from attention_jax import axes, registry
from attention_jax.models.config import POOLING_VARIANTS, ModelConfig
from attention_jax.models.encoder import Encoder

Array = jnp.ndarray


def masked_mean(x: Array, mask: Optional[Array]) -> Array:
  """Mean over the valid positions. x: `[B, T, E]`, mask: `[B, T]` bool -> `[B, E]`.

  An all-padding row gives zeros rather than NaN.
  """
  if mask is None:
    return x.mean(axis=1)
  weights = mask[..., None].astype(x.dtype)
  return (x * weights).sum(axis=1) / jnp.maximum(weights.sum(axis=1), 1)


def masked_max(x: Array, mask: Optional[Array]) -> Array:
  """Max over the valid positions. x: `[B, T, E]`, mask: `[B, T]` bool -> `[B, E]`.

  An all-padding row gives zeros rather than -inf.
  """
  scores = x if mask is None else jnp.where(mask[..., None], x, -jnp.inf)
  # Gathering at the argmax routes the gradient to one maximum. The gradient of
  # `max` instead divides by the count of elements equal to the result, which
  # is 0 -- a NaN -- when XLA recomputes `x` with different rounding in the
  # backward pass (seen on CPU at --xla_backend_optimization_level=0).
  index = jnp.argmax(scores, axis=1)[:, None]  # [B, 1, E]
  pooled = jnp.take_along_axis(x, index, axis=1)[:, 0]
  if mask is None:
    return pooled
  return jnp.where(mask.any(axis=1, keepdims=True), pooled, 0).astype(x.dtype)


def cls_prefix(module: nn.Module, config: ModelConfig, name: str = "cls") -> Optional[Array]:
  """The learned [CLS] embedding `[1, 1, E]` for "cls" pooling (parameter
  `name` of `module`), else None.

  Initialised as a token embedding is (normal, stddev 1), not at zero: the
  prefix gets no position embedding, so a zero [CLS] would reach the first
  pre-norm LayerNorm as an all-zero vector, where the norm's derivative is
  1/sqrt(epsilon) = 1000. That made the gradient norm at initialisation ~70x
  the mean-pooling model's with dot_product and ~10^12 with gmlp and xca
  (their own normalisations of the zero token multiply it), so global-norm
  clipping scaled every other gradient to almost nothing.
  """
  if config.pooling != "cls":
    return None
  return module.param(
      name, nn.with_logical_partitioning(nn.initializers.normal(stddev=1.0),
                                         (None, None, axes.EMBED)),
      (1, 1, config.embed_dim), jnp.float32)


def pooling_module(config: ModelConfig, name: str) -> Optional[nn.Module]:
  """The registered pooling module of `config.pooling` ("attention":
  `AttentionPooling`) with `config.pooling_options`, else None. Built inside
  the calling module's compact method, so its parameters are the caller's
  (submodule `name`); both towers of a dual classifier share it."""
  if config.pooling not in POOLING_VARIANTS:
    return None
  spec = registry.get_variant(POOLING_VARIANTS[config.pooling])
  return spec.module(**config.pooling_options, dtype=config.jnp_dtype, name=name)


def encode_pooled(encoder: nn.Module, inputs: Array, padding_mask: Optional[Array],
                  prefix: Optional[Array], pooling: Optional[nn.Module],
                  deterministic: bool) -> Array:
  """Runs the (bound) encoder and pools its outputs by `encoder.config.pooling`:
  `[B, T]` ids (`Encoder`) or `[B, T, E]` vectors (`VectorEncoder`) -> `[B, F]`
  (F = E, or the pooling module's width)."""
  x = encoder(inputs, padding_mask=padding_mask, deterministic=deterministic,
              prefix=prefix)  # [B, P + T, E]
  return pool_outputs(encoder.config, x, padding_mask, pooling)


def pool_outputs(config: ModelConfig, x: Array, padding_mask: Optional[Array],
                 pooling: Optional[nn.Module]) -> Array:
  """An encoder's outputs pooled by `config.pooling`: `[B, P + T, E]` -> `[B, F]`.

  "cls" reads position 0 (the [CLS] prefix); "mean" and "max" reduce over the
  positions `padding_mask [B, T]` marks real (there is no prefix then);
  `pooling` is the registered pooling module (`pooling_module`), or None.
  """
  if pooling is not None:
    return pooling(x, mask=padding_mask)
  if config.pooling == "cls":
    return x[:, 0]
  if config.pooling == "mean":
    return masked_mean(x, padding_mask)
  return masked_max(x, padding_mask)


def classifier_head(features: Array, config: ModelConfig, deterministic: bool) -> Array:
  """Dropout, then Dense(num_classes), or Dense(head_mlp_dim) -> ReLU -> Dense.

  Called inside a compact method, so its layers belong to the calling module.
  features: `[B, F]` -> `[B, num_classes]` float32 logits.
  """
  features = nn.Dropout(config.dropout_rate)(features, deterministic=deterministic)
  dense = lambda size, names, init, name: nn.Dense(
      size, dtype=config.jnp_dtype,
      kernel_init=nn.with_logical_partitioning(init, names),
      bias_init=nn.with_logical_partitioning(nn.initializers.zeros_init(), names[1:]),
      name=name)
  in_axis = axes.EMBED
  if config.head_mlp_dim:
    features = nn.relu(dense(config.head_mlp_dim, (axes.EMBED, axes.MLP),
                             nn.initializers.lecun_normal(), "head_hidden")(features))
    in_axis = axes.MLP
  # A zero-initialised output layer starts at uniform predictions (loss log C),
  # as in ViT / big_vision.
  logits = dense(config.num_classes, (in_axis, axes.CLASSES), nn.initializers.zeros_init(),
                 "head")(features)
  return logits.astype(jnp.float32)


class SequenceClassifier(nn.Module):
  """Logits of one label per sequence: the encoder (submodule "encoder"), a
  pooling of its outputs, a head.

  `config.pooling` "cls" prepends a learned [CLS] embedding and reads its
  output; "mean" and "max" pool the token outputs, ignoring padded tokens;
  "attention" pools them with learned queries (`AttentionPooling`, submodule
  "pooling", with `config.pooling_options`), padded tokens getting weight 0.
  `config.head_mlp_dim`, if set, makes the head Dense -> ReLU -> Dense as in
  the Long Range Arena classifiers. Dropout on the pooled features is
  `config.dropout_rate`.

  Attributes:
    config: the model config.
  """

  config: ModelConfig

  @nn.compact
  def __call__(self, tokens: Array, *, padding_mask: Optional[Array] = None,
               deterministic: bool = True) -> Array:
    """tokens: `[B, T]` ids; padding_mask: `[B, T]` bool, True for real tokens.

    Returns:
      `[B, num_classes]` float32 logits.
    """
    encoder = Encoder(self.config, name="encoder")
    prefix = cls_prefix(self, self.config)
    pooling = pooling_module(self.config, "pooling")
    pooled = encode_pooled(encoder, tokens, padding_mask, prefix, pooling, deterministic)
    return classifier_head(pooled, self.config, deterministic)


class DualEncoderClassifier(nn.Module):
  """Logits of one label per pair of sequences (LRA retrieval, "two towers").

  Both sequences go through the same encoder and pooling (shared weights); the
  head sees `[u, v, u * v, u - v]` of the pooled vectors u, v, as in the Long
  Range Arena matching model, or with `config.pair_features="sentence_bert"`
  `[u, v, |u - v|]`, Sentence-BERT's classification objective (Reimers &
  Gurevych 2019), whose pooling ([CLS], mean or max) is `config.pooling`.
  As `SequenceClassifier` otherwise.

  Attributes:
    config: the model config.
  """

  config: ModelConfig

  @nn.compact
  def __call__(self, tokens: Array, tokens2: Array, *, padding_mask: Optional[Array] = None,
               padding_mask2: Optional[Array] = None, deterministic: bool = True) -> Array:
    """tokens, tokens2: `[B, T1]`, `[B, T2]` ids; padding masks as in
    `SequenceClassifier`.

    Returns:
      `[B, num_classes]` float32 logits.
    """
    encoder = Encoder(self.config, name="encoder")
    prefix = cls_prefix(self, self.config)
    pooling = pooling_module(self.config, "pooling")
    u = encode_pooled(encoder, tokens, padding_mask, prefix, pooling, deterministic)
    v = encode_pooled(encoder, tokens2, padding_mask2, prefix, pooling, deterministic)
    if self.config.pair_features == "sentence_bert":
      features = jnp.concatenate([u, v, jnp.abs(u - v)], axis=-1)  # [B, 3F]
    else:
      features = jnp.concatenate([u, v, u * v, u - v], axis=-1)  # [B, 4F]
    return classifier_head(features, self.config, deterministic)
