"""Sequence classification: an encoder, a pooling of its outputs, a classifier head."""

from __future__ import annotations

from typing import Optional

import flax.linen as nn
import jax.numpy as jnp

from attention_jax.models.encoder import Encoder

Array = jnp.ndarray

POOLINGS = ("cls", "mean", "max")


def check_pooling(pooling: str) -> str:
  """Returns `pooling` if it is one of `POOLINGS`, else raises ValueError."""
  if pooling not in POOLINGS:
    raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}.")
  return pooling


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


class SequenceClassifier(nn.Module):
  """Logits of one label per sequence.

  Attributes:
    encoder: the (unbound) `Encoder` to run; it becomes the submodule "encoder".
    num_classes: number of labels.
    pooling: "cls" prepends a learned [CLS] embedding and reads its output;
      "mean" and "max" pool the token outputs, ignoring padded tokens.
    head_mlp_dim: if set, the head is Dense(head_mlp_dim) -> ReLU -> Dense, as in
      the Long Range Arena classifiers; a single Dense otherwise.
    dropout_rate: dropout on the pooled features.
  """

  encoder: Encoder
  num_classes: int
  pooling: str = "cls"
  head_mlp_dim: Optional[int] = None
  dropout_rate: float = 0.0

  @nn.compact
  def __call__(self, tokens: Array, *, padding_mask: Optional[Array] = None,
               deterministic: bool = True) -> Array:
    """tokens: `[B, T]` ids; padding_mask: `[B, T]` bool, True for real tokens.

    Returns:
      `[B, num_classes]` float32 logits.
    """
    check_pooling(self.pooling)
    prefix = None
    if self.pooling == "cls":
      prefix = self.param(
          "cls", nn.with_logical_partitioning(nn.initializers.zeros_init(),
                                              (None, None, "embed")),
          (1, 1, self.encoder.embed_dim), self.encoder.param_dtype)
    x = self.encoder(tokens, padding_mask=padding_mask, deterministic=deterministic,
                     prefix=prefix)  # [B, P + T, E]
    if self.pooling == "cls":
      pooled = x[:, 0]
    elif self.pooling == "mean":
      pooled = masked_mean(x, padding_mask)
    else:
      pooled = masked_max(x, padding_mask)

    pooled = nn.Dropout(self.dropout_rate)(pooled, deterministic=deterministic)
    dense = lambda features, axes, init, name: nn.Dense(
        features, dtype=self.encoder.dtype, param_dtype=self.encoder.param_dtype,
        kernel_init=nn.with_logical_partitioning(init, axes),
        bias_init=nn.with_logical_partitioning(nn.initializers.zeros_init(), axes[1:]),
        name=name)
    in_axis = "embed"
    if self.head_mlp_dim:
      pooled = nn.relu(dense(self.head_mlp_dim, ("embed", "mlp"), nn.initializers.lecun_normal(),
                             "head_hidden")(pooled))
      in_axis = "mlp"
    # A zero-initialised output layer starts at uniform predictions (loss log C),
    # as in ViT / big_vision.
    logits = dense(self.num_classes, (in_axis, "classes"), nn.initializers.zeros_init(),
                   "head")(pooled)
    return logits.astype(jnp.float32)
