"""A product-key memory layer (Lample et al. 2019, "Large Memory Layers with
Product Keys"), in a block's feed-forward place.

The memory has `num_keys^2` slots, each with a value vector. Its keys are
the concatenations `[c_i, c'_j]` of two sets of `num_keys` sub-keys, so the
score of slot (i, j) for a query `[q1, q2]` is `q1 . c_i + q2 . c'_j`. The
`top_k` best slots are among the `top_k x top_k` pairs of each half's `top_k`
best sub-keys (a slot outside them is beaten by at least `top_k` of those), so
they are found by scoring `2 * num_keys` sub-keys and `top_k^2` pairs, never
the `num_keys^2` slots. The output is the softmax-weighted sum of the chosen
slots' values, summed over `num_heads` heads that share the values and each
have their own query projection and sub-keys.

The paper normalises the queries with batch norm; here a LayerNorm without
gain (`query_norm`) does that job without a running statistic.
"""

from __future__ import annotations

from typing import Any, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from attention_jax import axes
from attention_jax.layers.attention import HeadProjection

Array = jnp.ndarray
Dtype = Any


def product_key_lookup(queries: Array, sub_keys: Array, top_k: int):
  """The `top_k` best slots of a product-key memory for each query.

  Args:
    queries: `[..., H, Dk]`, Dk even: the halves `[..., :Dk/2]` and
      `[..., Dk/2:]` score against the two sub-key sets.
    sub_keys: `[2, H, n, Dk/2]`, the two sets of n sub-keys per head.
    top_k: slots per query (at most n).

  Returns:
    `(scores [..., H, k], slots [..., H, k])`, slots in [0, n^2) as i * n + j,
    best first.
  """
  num_keys = sub_keys.shape[2]
  half = queries.shape[-1] // 2
  first = jnp.einsum("...hd,hnd->...hn", queries[..., :half], sub_keys[0])
  second = jnp.einsum("...hd,hnd->...hn", queries[..., half:], sub_keys[1])
  first_scores, first_keys = jax.lax.top_k(first, top_k)  # [..., H, k]
  second_scores, second_keys = jax.lax.top_k(second, top_k)
  pair_scores = first_scores[..., :, None] + second_scores[..., None, :]  # [..., H, k, k]
  pair_slots = first_keys[..., :, None] * num_keys + second_keys[..., None, :]
  pair_scores = pair_scores.reshape(pair_scores.shape[:-2] + (top_k * top_k,))
  pair_slots = pair_slots.reshape(pair_slots.shape[:-2] + (top_k * top_k,))
  scores, best = jax.lax.top_k(pair_scores, top_k)
  return scores, jnp.take_along_axis(pair_slots, best, axis=-1)


def _symmetric_uniform(bound: float):
  """Uniform on [-bound, bound] (the paper's sub-key initialisation, bound 1/sqrt(Dk/2))."""
  def init(key, shape, dtype=jnp.float32):
    return jax.random.uniform(key, shape, dtype, -bound, bound)
  return init


class ProductKeyMemory(nn.Module):
  """`x [B, T, E] -> sum_h sum_k softmax(scores)_k * values[slot_k]`.

  Attributes:
    num_keys: sub-keys per half, n; the memory has n^2 slots.
    top_k: slots read per query and head.
    num_heads: query heads, sharing the value table.
    key_dim: the query and key width Dk (even), split in two halves.
    query_norm: normalise the queries (the paper's batch norm, here a LayerNorm).
    dropout_rate: dropout on the output.
    dtype, param_dtype: computation and parameter dtypes.
  """

  num_keys: int = 64
  top_k: int = 8
  num_heads: int = 4
  key_dim: int = 32
  query_norm: bool = True
  dropout_rate: float = 0.0
  dtype: Optional[Dtype] = None
  param_dtype: Dtype = jnp.float32

  def _check(self):
    for name in ("num_keys", "top_k", "num_heads", "key_dim"):
      value = getattr(self, name)
      if not isinstance(value, int) or value < 1:
        raise ValueError(f"ProductKeyMemory {name} must be a positive integer, got {value!r}.")
    if self.key_dim % 2:
      raise ValueError(f"ProductKeyMemory key_dim must be even (two halves), got "
                       f"{self.key_dim}.")
    if self.top_k > self.num_keys:
      raise ValueError(f"ProductKeyMemory top_k must be at most num_keys={self.num_keys}, got "
                       f"{self.top_k}.")

  @nn.compact
  def __call__(self, x: Array, deterministic: bool = True) -> Array:
    """x: `[B, T, E]` -> `[B, T, E]`."""
    self._check()
    if x.ndim != 3:
      raise ValueError(f"x must be [B, T, E], got shape {x.shape}.")
    batch, length, features = x.shape
    dtype = self.dtype or x.dtype
    # HeadProjection, not nn.DenseGeneral: DenseGeneral names the axes of its
    # flat kernel, which fails under the trainer's mesh (flax issue #3676).
    queries = HeadProjection(
        (axes.EMBED, axes.HEADS, axes.KV), (self.num_heads, self.key_dim), dtype=dtype,
        param_dtype=self.param_dtype, kernel_init=nn.initializers.xavier_uniform(),
        name="query")(x)  # [B, T, H, Dk]
    if self.query_norm:
      # Per half: each half is scored against its own sub-keys.
      halves = queries.reshape(batch, length, self.num_heads, 2, self.key_dim // 2)
      halves = nn.LayerNorm(use_scale=False, use_bias=False, dtype=jnp.float32)(halves)
      queries = halves.reshape(queries.shape)
    sub_keys = self.param(
        "sub_keys", nn.with_logical_partitioning(_symmetric_uniform((self.key_dim // 2) ** -0.5),
                                                 (None, axes.HEADS, None, axes.KV)),
        (2, self.num_heads, self.num_keys, self.key_dim // 2), self.param_dtype)
    values = self.param(
        "values", nn.with_logical_partitioning(nn.initializers.normal(features ** -0.5),
                                               (axes.PRODUCT_KEYS, axes.EMBED)),
        (self.num_keys * self.num_keys, features), self.param_dtype)
    scores, slots = product_key_lookup(queries.astype(jnp.float32),
                                       sub_keys.astype(jnp.float32), self.top_k)
    weights = jax.nn.softmax(scores, axis=-1).astype(dtype)  # [B, T, H, k]
    # [B, T, H, k, E]: the gathered rows only (an EmbeddingBag would sum them
    # as it gathers; XLA fuses the gather into the weighted sum on accelerators).
    read = jnp.take(values.astype(dtype), slots, axis=0)
    y = jnp.einsum("bthk,bthke->bte", weights, read)
    return nn.Dropout(self.dropout_rate)(y, deterministic=deterministic)
