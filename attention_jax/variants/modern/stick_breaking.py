"""Stick-breaking attention (Tan et al. 2024), `stick_breaking`.

Each query breaks a stick of length 1 over the keys before it, nearest first:
key j takes the fraction beta_ij = sigmoid(z_ij) of what the nearer keys left,

    A_ij = beta_ij prod_{j < k < i} (1 - beta_ik),   z_ij = q_i . k_j * scale,

so the weights sum to at most 1 (what is left of the stick attends to
nothing) and recency is built in: the model needs no position encoding. In
log space, log A_ij = log sigmoid(z_ij) + sum_{j < k < i} log sigmoid(-z_ik),
a sum of non-positive terms, so no exponential can overflow and no running
maximum is needed.

Two implementations: "xla" builds the `[Tq, Tk]` log-weights (the reference);
"blockwise" (the default) visits the key blocks from the last to the first,
carrying each query's sum of log sigmoid(-z) over the keys already visited,
so the cumulative sum inside a block plus that carry gives every log A; query
blocks are rematerialised, so neither pass holds a `[Tq, Tk]` array.

Causal only: the current token is excluded (the paper's "each token before
the current"), or included with `attend_current=True`.
"""

from __future__ import annotations

import math
from typing import Optional

import jax
import jax.numpy as jnp

from attention_jax import registry
from attention_jax.core import masks as mask_lib
from attention_jax.variants import common

Array = jnp.ndarray
IMPLEMENTATIONS = ("blockwise", "xla")


def stick_breaking_attention(
    query: Array,
    key: Array,
    value: Array,
    bias: Optional[Array] = None,
    mask: Optional[Array] = None,
    *,
    is_causal: bool = False,
    query_positions: Optional[Array] = None,
    query_seq_lengths: Optional[Array] = None,
    key_value_seq_lengths: Optional[Array] = None,
    segment_ids=None,
    attend_current: bool = False,
    scale: Optional[float] = None,
    implementation: Optional[str] = None,
    block_size: int = 64,
) -> Array:
  """Stick-breaking attention: `[B, Tq, H, Dv]`.

  Args:
    query: `[B, Tq, H, D]`.
    key: `[B, Tk, Hkv, D]`.
    value: `[B, Tk, Hkv, Dv]`.
    bias: not supported (positions are the stick's order).
    mask: boolean, broadcastable to `[B, H, Tq, Tk]`: keys a query may see
      (a masked key neither takes weight nor breaks the stick).
    is_causal: query i sits at key index i + Tk - Tq. Either this or
      `query_positions` must place the queries: the mechanism is causal.
    query_positions: `[Tq]` or `[B, Tq]`, each query's key index (what
      `MultiHeadAttention` passes while decoding from a cache); used when
      `is_causal` is False.
    query_seq_lengths, key_value_seq_lengths, segment_ids: as in
      `dot_product_attention`.
    attend_current: the query's own key takes the first break.
    scale: logit scale, 1/sqrt(D) when None.
    implementation: "blockwise" (default) or "xla" (the `[Tq, Tk]` reference).
    block_size: query and key block size of "blockwise".
  """
  common.reject_unsupported("stick_breaking", bias=bias)
  common.check_query_key_sizes("stick_breaking", query, key)
  implementation = implementation or "blockwise"
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"implementation must be one of {IMPLEMENTATIONS} or None, got "
                     f"{implementation!r}.")
  block_size = common.check_size("block_size", block_size)
  batch, q_len, num_heads, head_dim = query.shape
  kv_len = key.shape[1]
  if is_causal:
    positions = jnp.broadcast_to(jnp.arange(q_len) + (kv_len - q_len), (batch, q_len))
  elif query_positions is not None:
    positions = common.query_positions(query_positions, batch, q_len).astype(jnp.int32)
  else:
    raise ValueError("stick_breaking attention is causal: pass is_causal=True, or "
                     "query_positions (each query's key index) with the keys it may see, as "
                     "decoding from a cache does.")
  if mask is not None:
    mask = jnp.asarray(mask, bool)
    if mask.ndim != 4:
      raise ValueError(f"mask must be broadcastable to [B, H, Tq, Tk] with 4 dims, got shape "
                       f"{list(mask.shape)}.")
  scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
  key, value = (common.repeat_kv_heads(a, num_heads) for a in (key, value))

  def visible(q_index, k_index, q_rows, k_rows):
    """Which (query, key) pairs of these rows / columns take part: `[B, H|1, tq, tk]`."""
    q_pos = positions[:, q_rows][:, None, :, None]
    k_pos = k_index[None, None, None, :]
    ok = (k_pos <= q_pos) if attend_current else (k_pos < q_pos)
    if query_seq_lengths is not None:
      ok &= (q_index[None, :] < jnp.asarray(query_seq_lengths)[:, None])[:, None, :, None]
    if key_value_seq_lengths is not None:
      ok &= (k_index[None, :] < jnp.asarray(key_value_seq_lengths)[:, None])[:, None, None, :]
    if segment_ids is not None:
      q_seg, k_seg = mask_lib.split_segment_ids(segment_ids)
      ok &= q_seg[:, q_rows][:, None, :, None] == k_seg[:, k_rows][:, None, None, :]
    if mask is not None:  # sliced where it has rows / columns, never broadcast to [Tq, Tk]
      tile = mask if mask.shape[2] == 1 else mask[:, :, q_rows]
      ok &= tile if mask.shape[3] == 1 else tile[..., k_rows]
    return ok

  if implementation == "xla":
    out = _dense(query, key, value, visible, scale)
  else:
    out = _blockwise(query, key, value, visible, scale, block_size)
  return out.astype(query.dtype)


def _log_terms(q, k, ok, scale):
  """log sigmoid(z) (the break at j) and log sigmoid(-z) (what j leaves), zero off `ok`."""
  z = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) * scale
  return jnp.where(ok, jax.nn.log_sigmoid(z), 0.0), jnp.where(ok, jax.nn.log_sigmoid(-z), 0.0)


def _dense(query, key, value, visible, scale):
  q_len, kv_len = query.shape[1], key.shape[1]
  q_index, k_index = jnp.arange(q_len), jnp.arange(kv_len)
  ok = visible(q_index, k_index, q_index, k_index)
  log_break, log_left = _log_terms(query, key, ok, scale)
  # sum over k > j of log_left: a reversed cumulative sum, shifted by one.
  after = jnp.flip(jnp.cumsum(jnp.flip(log_left, -1), -1), -1) - log_left
  weights = jnp.where(ok, jnp.exp(log_break + after), 0.0)
  return jnp.einsum("bhqk,bkhd->bqhd", weights, value.astype(jnp.float32))


def _blockwise(query, key, value, visible, scale, block_size):
  batch, q_len, num_heads, _ = query.shape
  kv_len, value_dim = key.shape[1], value.shape[-1]
  bq, bk = min(block_size, q_len), min(block_size, kv_len)
  q_pad, k_pad = -q_len % bq, -kv_len % bk
  pad = lambda a, n: jnp.pad(a, ((0, 0), (0, n), (0, 0), (0, 0)))
  query, key, value = pad(query, q_pad), pad(key, k_pad), pad(value, k_pad)
  num_k_blocks = key.shape[1] // bk

  def one_query_block(q_start):
    q_index = q_start + jnp.arange(bq)
    q_rows = jnp.minimum(q_index, q_len - 1)  # padded rows read a real row, then drop
    q = jax.lax.dynamic_slice_in_dim(query, q_start, bq, axis=1)

    def visit(carry, k_block):  # from the last key block to the first
      left_after, acc = carry  # [B, H, bq]: sum of log sigmoid(-z) over later keys
      k_start = k_block * bk
      k_index = k_start + jnp.arange(bk)
      k_rows = jnp.minimum(k_index, kv_len - 1)
      ok = visible(q_index, k_index, q_rows, k_rows)
      ok &= (q_index < q_len)[None, None, :, None] & (k_index < kv_len)[None, None, None, :]
      k = jax.lax.dynamic_slice_in_dim(key, k_start, bk, axis=1)
      v = jax.lax.dynamic_slice_in_dim(value, k_start, bk, axis=1)
      log_break, log_left = _log_terms(q, k, ok, scale)
      inside = jnp.flip(jnp.cumsum(jnp.flip(log_left, -1), -1), -1) - log_left
      weights = jnp.where(ok, jnp.exp(log_break + inside + left_after[..., None]), 0.0)
      acc = acc + jnp.einsum("bhqk,bkhd->bqhd", weights, v.astype(jnp.float32))
      return (left_after + jnp.sum(log_left, -1), acc), None

    init = (jnp.zeros((batch, num_heads, bq), jnp.float32),
            jnp.zeros((batch, bq, num_heads, value_dim), jnp.float32))
    (_, acc), _ = jax.lax.scan(visit, init, jnp.arange(num_k_blocks), reverse=True)
    return acc

  # Each query block is recomputed in the backward pass: its scan's per-block
  # residuals ([bq, bk] each) exist for one query block at a time.
  blocks = jax.lax.map(jax.checkpoint(one_query_block), jnp.arange(0, query.shape[1], bq))
  out = jnp.moveaxis(blocks, 0, 1).reshape(batch, -1, num_heads, value_dim)
  return out[:, :q_len]


registry.register(registry.VariantSpec(
    name="stick_breaking", fn=stick_breaking_attention, family="modern",
    complexity="O(T^2) time, O(T) memory (blockwise)", subquadratic=False, exact=False,
    causal=True, cross=False, bidirectional=False, steps_from_cache=True,
    paper="Tan et al. 2024",
    takes=("query_positions",),
    options=dict(
        attend_current="the query's own key takes the first break (the paper: keys before it)",
        scale="multiplies the logits; 1/sqrt(D) when None",
        implementation="'blockwise' (default: no [T, T] array) or 'xla' (the reference)",
        block_size="query and key block size of 'blockwise'")))
