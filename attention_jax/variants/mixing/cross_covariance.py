"""XCiT's cross-covariance attention (El-Nouby et al. 2021), `xca`: a Q/K/V
variant whose [D, D] weights mix the channels of each head, from queries and
keys L2-normalised along the tokens; linear in T. `MultiHeadAttention` runs
it, its temperature `[H]` an extras module.
"""

from __future__ import annotations

from typing import Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from attention_jax import registry
from attention_jax.core.softmax import masked_softmax
from attention_jax.variants import common
from attention_jax.variants.mixing import tokens

Array = jnp.ndarray


def _token_l2_normalised(x: Array) -> Array:
  """x `[B, T, H, D]` / its L2 norm over the tokens (per batch, head and channel).
  The norm is floored at 1e-6, so an all-zero channel stays zero with finite
  gradients."""
  squared_norm = jnp.sum(jnp.square(x), axis=1, keepdims=True)
  return x * jax.lax.rsqrt(jnp.maximum(squared_norm, 1e-12))


def cross_covariance_attention(
    query: Array,
    key: Array,
    value: Array,
    bias: Optional[Array] = None,
    mask: Optional[Array] = None,
    *,
    temperature: Array,
    is_causal: bool = False,
    query_seq_lengths: Optional[Array] = None,
    key_value_seq_lengths: Optional[Array] = None,
    segment_ids: Optional[Array] = None,
    dropout_rate: float = 0.0,
    dropout_rng: Optional[jax.Array] = None,
) -> Array:
  """Cross-covariance attention (El-Nouby et al. 2021, XCiT), per head:

      q^, k^ = q, k divided by their L2 norms along the tokens (per channel),
      A[i, j] = softmax_j(tau * sum_t q^[t, i] k^[t, j])       ([D, D]),
      out[t, i] = sum_j A[i, j] v[t, j],

  the paper's V A_XC(K, Q) with A_XC = softmax(K^T Q^ / tau), its learned
  temperature written as the multiplier tau. The weights mix the channels
  of each token: O(T D^2) per head, linear in T, never a T x T array.

  Padding: tokens past either length or masked by the key-padding mask have
  their q, k and v zeroed before the norms and sums (they contribute nothing)
  and output zeros.

  Args:
    query: `[B, T, H, D]`; key: `[B, T, Hkv, D]`; value: `[B, T, Hkv, D]` (one
      length T: the sums pair token t of the queries with token t of the
      keys; the value's head size is the key's, since A mixes its channels).
    bias: not supported (there are no token-token logits).
    mask: a key-padding mask `[B|1, 1, 1, T]` only.
    temperature: tau `[H]`.
    is_causal, segment_ids: not supported (every weight sums every token).
    query_seq_lengths, key_value_seq_lengths: `[B]`, padding.
    dropout_rate, dropout_rng: dropout on A.

  Returns:
    `[B, T, H, D]` in the query dtype.
  """
  common.reject_unsupported("xca", bias=bias, is_causal=is_causal, segment_ids=segment_ids)
  if jnp.ndim(query) != 4 or jnp.ndim(key) != 4 or jnp.ndim(value) != 4:
    raise ValueError(f"query, key and value must be [B, T, H, D], got shapes "
                     f"{list(jnp.shape(query))}, {list(jnp.shape(key))}, "
                     f"{list(jnp.shape(value))}.")
  if key.shape[1] != query.shape[1]:
    raise ValueError(f"xca sums over the tokens of the queries and keys together, so they need "
                     f"one length; got Tq={query.shape[1]} and Tk={key.shape[1]} (xca has no "
                     f"cross-attention form).")
  common.check_query_key_sizes("xca", query, key)
  if value.shape[-1] != key.shape[-1]:
    raise ValueError(f"xca's [D, D] weights mix the value channels, so the value head size must "
                     f"be the key's D={key.shape[-1]}, got {value.shape[-1]}.")
  num_heads, out_dtype = query.shape[2], query.dtype
  common.check_per_head("temperature", temperature, (num_heads,))
  key = common.repeat_kv_heads(key, num_heads)
  value = common.repeat_kv_heads(value, num_heads)
  valid = tokens.real_tokens("xca", query, mask, query_seq_lengths, key_value_seq_lengths)
  wide = jnp.promote_types(query.dtype, jnp.float32)
  query, key = (_token_l2_normalised(tokens.zero_padding(a.astype(wide), valid))
                for a in (query, key))
  logits = jnp.einsum("bthi,bthj->bhij", query, key) * temperature.astype(wide)[:, None, None]
  weights = common.dropout_weights(masked_softmax(logits, None), dropout_rate, dropout_rng)
  out = jnp.einsum("bhij,bthj->bthi", weights, tokens.zero_padding(value.astype(wide), valid))
  return out.astype(out_dtype)


class CrossCovarianceTemperature(nn.Module):
  """`xca`'s learned temperature tau `[H]`, initialised at 1 (XCiT's start)."""

  @nn.compact
  def __call__(self, query, key, value, deterministic: bool = True) -> dict:
    del key, value, deterministic
    return {"temperature": self.param("temperature", nn.initializers.ones_init(),
                                      (query.shape[2],))}


registry.register(registry.VariantSpec(
    name="xca", fn=cross_covariance_attention, family="mixing", complexity="O(T D^2)",
    takes=("dropout",),
    subquadratic=True, exact=False, causal=False, cross=False, paper="El-Nouby et al. 2021",
    extras=CrossCovarianceTemperature))
