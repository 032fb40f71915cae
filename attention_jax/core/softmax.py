"""Masked softmax that never produces NaN, nor an infinity.

A query whose every key is masked (a padded query, an empty segment, a window
that falls outside the sequence) gets all-zero weights and zero gradients. The
usual trick of filling masked logits with a large negative number gives such a
row uniform weights instead, and filling with -inf gives NaN (and trips
`jax.debug_infs`). Here masked logits are filled with a large *finite* negative
number, and a row whose maximum is that fill (nothing allowed) is exponentiated
against 0 rather than its maximum: every exponential is exp(fill) = 0, the
normaliser is 0, and it is divided out safely. (An allowed logit at or below
the fill, -2.4e38, counts as masked.)

The log-sum-exp of a row with nothing to attend (log 0) is reported as
`MASKED_LOGSUMEXP`, finite, rather than -inf.
"""

from __future__ import annotations

import functools
from typing import Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

Array = jnp.ndarray

# jax.nn's fill for masked logits, -0.7 * the largest float32: far below any real
# logit, yet finite, so that `jax.debug_infs(True)` does not fire and sums with it
# stay finite. It is also what jax.nn's residual holds for a fully masked row (the
# log-sum-exp of a row of fills, rounded), so it stands for log 0 here.
MASKED_LOGSUMEXP = float(np.float32(-0.7) * np.finfo(np.float32).max)


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
  return _softmax(logits.astype(jnp.float32), mask, axis)[0]


def masked_softmax_and_logsumexp(logits: Array, mask: Optional[Array] = None,
                                 axis: int = -1) -> Tuple[Array, Array]:
  """`masked_softmax(logits, mask, axis)` and the log-sum-exp of the allowed logits.

  Both come from one pass, and differentiating both costs what differentiating
  the weights alone does (d lse = <t, weights> is a term of d weights).

  Args:
    logits: scores, e.g. `[B, H, Tq, Tk]`.
    mask: boolean broadcastable to `logits`; True keeps an entry.
    axis: the axis to normalise over.

  Returns:
    float32 `(weights, lse)`: weights with the shape of `logits`, lse with `axis`
    removed. A row with nothing allowed has lse `MASKED_LOGSUMEXP` (finite) and
    passes it no gradient.
  """
  weights, lse = _softmax(logits.astype(jnp.float32), mask, axis)
  return weights, jnp.squeeze(lse, axis)


def logsumexp_residual(lse: Array, dtype) -> Array:
  """A float32 log-sum-exp as `dot_product_attention(return_residual=True)` returns it.

  In `dtype`, as jax.nn returns its residual in the input dtype; values below
  the dtype's finite range are clipped into it, so that `MASKED_LOGSUMEXP`
  stays finite in float16 (-65504) where jax.nn's overflows to -inf. In float32
  and bfloat16 nothing is clipped.
  """
  return jnp.maximum(lse, float(jnp.finfo(dtype).min)).astype(dtype)


@functools.partial(jax.custom_jvp, nondiff_argnums=(2,))
def _softmax(logits: Array, mask: Optional[Array], axis: int) -> Tuple[Array, Array]:
  """float32 weights and the log-sum-exp (with `axis` kept, of size 1)."""
  if mask is not None:
    # A finite fill keeps every value finite (jax.debug_infs), and exp(fill - m)
    # is 0 for any row maximum m >= 0 or from an allowed logit.
    logits = jnp.where(mask, logits, MASKED_LOGSUMEXP)
  row_max = jnp.max(logits, axis=axis, keepdims=True)
  # The maximum only stabilises the exponent. A row with nothing allowed (its
  # maximum is the fill, or -inf from a bias) exponentiates against 0 instead:
  # exp(fill) = exp(-inf) = 0, so its normaliser is 0 and its weights are 0.
  # (Per row, not per entry: masking the exponentials themselves cost ~8% of
  # dense attention's forward+backward on CPU.)
  row_max = jnp.where(jnp.isfinite(row_max) & (row_max > MASKED_LOGSUMEXP), row_max, 0.0)
  unnormalized = jnp.exp(logits - row_max)
  normalizer = jnp.sum(unnormalized, axis=axis, keepdims=True)
  empty = normalizer == 0.0
  safe_normalizer = jnp.where(empty, 1.0, normalizer)  # log(0) would be -inf
  lse = jnp.where(empty, MASKED_LOGSUMEXP, row_max + jnp.log(safe_normalizer))
  return unnormalized / safe_normalizer, lse


@_softmax.defjvp
def _softmax_jvp(axis, primals, tangents):
  """d softmax = y * (t - <t, y>) and d lse = <t, y>, written in the weights y
  alone, so reverse mode keeps one array of the logits' size (autodiff of the
  mask, the exp and the division would keep the exponentials and more). Masked
  entries get no tangent (even a NaN one from logits nobody should see); the
  mask has none."""
  logits, mask = primals
  weights, lse = _softmax(logits, mask, axis)
  tangent = tangents[0] if mask is None else jnp.where(mask, tangents[0], 0.0)
  mean = jnp.sum(tangent * weights, axis=axis, keepdims=True)
  return (weights, lse), (weights * (tangent - mean), mean)
