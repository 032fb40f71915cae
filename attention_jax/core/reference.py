"""The dense reference attention: the oracle every other implementation is tested against.

It is written for obviousness, not speed: inputs are upcast to float32, grouped
K/V heads are repeated explicitly, and matrix products use the highest precision.
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import jax
import jax.numpy as jnp

from attention_jax.core.softmax import masked_softmax_and_logsumexp

Array = jnp.ndarray


def reference_attention(
    query: Array,
    key: Array,
    value: Array,
    bias: Optional[Array] = None,
    mask: Optional[Array] = None,
    *,
    scale: Optional[float] = None,
    return_residual: bool = False,
) -> Union[Array, Tuple[Array, Array]]:
  """softmax(q k^T * scale + bias, masked) v, all in float32.

  Args:
    query: `[B, Tq, H, D]`.
    key: `[B, Tk, Hkv, D]` with `H % Hkv == 0` (query head h uses K/V head h // (H // Hkv)).
    value: `[B, Tk, Hkv, Dv]`.
    bias: additive, broadcastable to `[B, H, Tq, Tk]`.
    mask: boolean, broadcastable to `[B, H, Tq, Tk]`; True may attend.
    scale: logit scale; 1/sqrt(D) when None.
    return_residual: also return the log-sum-exp of each row's allowed logits.

  Returns:
    `[B, Tq, H, Dv]` float32; rows with no allowed key are zero. With
    `return_residual`, `(out, lse)` and lse `[B, Tq, H]` float32
    (`MASKED_LOGSUMEXP` on rows with no allowed key).
  """
  query, key, value = (x.astype(jnp.float32) for x in (query, key, value))
  num_heads, num_kv_heads = query.shape[2], key.shape[2]
  group = num_heads // num_kv_heads
  key = jnp.repeat(key, group, axis=2)
  value = jnp.repeat(value, group, axis=2)
  if scale is None:
    scale = query.shape[-1] ** -0.5
  highest = jax.lax.Precision.HIGHEST
  logits = jnp.einsum("bqhd,bkhd->bhqk", query, key, precision=highest) * scale
  if bias is not None:
    logits = logits + bias.astype(jnp.float32)
  weights, lse = masked_softmax_and_logsumexp(logits, mask)
  out = jnp.einsum("bhqk,bkhd->bqhd", weights, value, precision=highest)
  return (out, lse.transpose(0, 2, 1)) if return_residual else out
