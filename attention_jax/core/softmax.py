"""Masked softmax that never produces NaN.

A query whose every key is masked (a padded query, an empty segment, a window
that falls outside the sequence) gets all-zero weights and zero gradients. The
usual trick of filling masked logits with a large negative number gives such a
row uniform weights instead, and filling with -inf gives NaN; here the row
maximum of an all -inf row is replaced by 0, so exp(-inf) = 0 everywhere and the
normaliser is 0, which is then divided out safely.
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp

Array = jnp.ndarray


def masked_softmax(logits: Array, mask: Optional[Array] = None, axis: int = -1) -> Array:
  """Softmax of `logits` over `axis` with `mask == False` entries excluded.

  Computed in float32 whatever the input dtype. Rows with no allowed entry (or
  whose logits are all -inf, e.g. from an additive bias) return zeros.

  Args:
    logits: scores, e.g. `[B, H, Tq, Tk]`.
    mask: boolean broadcastable to `logits`; True keeps an entry.
    axis: the axis to normalise over.

  Returns:
    float32 weights with the shape of `logits`.
  """
  return _softmax(logits.astype(jnp.float32), mask, axis)


@functools.partial(jax.custom_jvp, nondiff_argnums=(2,))
def _softmax(logits: Array, mask: Optional[Array], axis: int) -> Array:
  if mask is not None:
    logits = jnp.where(mask, logits, -jnp.inf)
  row_max = jnp.max(logits, axis=axis, keepdims=True)
  # The maximum only stabilises the exponent; an all -inf row exponentiates
  # against 0 instead, which gives exp(-inf) = 0 and a zero normaliser.
  row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
  unnormalized = jnp.exp(logits - row_max)
  normalizer = jnp.sum(unnormalized, axis=axis, keepdims=True)
  return unnormalized / jnp.where(normalizer == 0.0, 1.0, normalizer)


@_softmax.defjvp
def _softmax_jvp(axis, primals, tangents):
  """d softmax = y * (t - <t, y>), written in the weights y alone, so reverse
  mode keeps one array of the logits' size (autodiff of the mask, the exp and
  the division would keep the exponentials and more). Masked entries get no
  tangent (even a NaN one from logits nobody should see); the mask has none."""
  logits, mask = primals
  weights = _softmax(logits, mask, axis)
  tangent = tangents[0] if mask is None else jnp.where(mask, tangents[0], 0.0)
  return weights, weights * (tangent - jnp.sum(tangent * weights, axis=axis, keepdims=True))
