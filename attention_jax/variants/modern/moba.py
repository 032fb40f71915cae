"""Mixture of block attention (MoBA, Lu et al. 2025), `moba`.

The keys are cut into blocks of `block_size`; each query scores every block
by its mean-pooled key, s_i = q . mean(K_i) (parameter-free gating, eq. 5), and
attends to its `top_k` blocks, its own block always among them (eq. 6);
causally, blocks after its own are never chosen and its own block is causal
inside. The softmax runs over the union of the chosen blocks' keys.

Blocks are over the keys' indices (`j // block_size`), never the caller's
positions, which may restart at each packed segment: MoBA has no position
encoding of its own. With `segment_ids` a query chooses only among blocks
holding keys of its own segment, so packed segments that start on block
boundaries attend as each would alone; a block straddling a boundary is
scored by the mean of all its keys.

The choice is per query; the kernel's tiles follow it: a key block is
visited by a query block when any of its queries chose it
(`block_mask_from_blocks`), and inside a visited tile the per-query choice is
the mask. The gating costs `[Tq, Tk / block_size]` scores and the attention
top_k blocks per query, so nothing of size `Tq x Tk` exists.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from attention_jax import registry
from attention_jax.core import block_mask as block_masks
from attention_jax.core import masks as mask_lib
from attention_jax.flex import flex_attention
from attention_jax.variants import common

Array = jax.Array


def block_choice(query: Array, key: Array, *, block_size: int, top_k: int,
                 positions: Array, causal: bool,
                 key_value_seq_lengths: Optional[Array] = None,
                 segment_ids=None) -> Array:
  """Each query's chosen key blocks: `[B, H, Tq, nk]` bool.

  Args:
    query: `[B, Tq, H, D]`; key: `[B, Tk, Hkv, D]`.
    block_size, top_k: MoBA's block size and number of blocks per query.
    positions: `[B, Tq]` int, each query's index among the keys (its own
      block is positions // block_size).
    causal: blocks after a query's own are not eligible.
    key_value_seq_lengths: `[B]`; padding is left out of the means, and a
      block of padding only is never chosen.
    segment_ids: `[B, T]` or a pair `([B, Tq], [B, Tk])`; a block without a
      real key of the query's segment is never chosen.
  """
  batch, kv_len, num_kv_heads, head_dim = key.shape
  num_heads = query.shape[2]
  num_blocks = -(-kv_len // block_size)
  padded = num_blocks * block_size
  lengths = (jnp.full((batch,), kv_len) if key_value_seq_lengths is None
             else jnp.asarray(key_value_seq_lengths))
  valid = jnp.arange(padded)[None, :] < lengths[:, None]  # [B, nk * block_size]
  keys = jnp.pad(key.astype(jnp.float32), ((0, 0), (0, padded - kv_len), (0, 0), (0, 0)))
  keys = jnp.where(valid[:, :, None, None], keys, 0.0).reshape(
      batch, num_blocks, block_size, num_kv_heads, head_dim)
  counts = valid.reshape(batch, num_blocks, block_size).sum(-1)  # [B, nk]
  pooled = keys.sum(2) / jnp.maximum(counts, 1)[:, :, None, None]  # [B, nk, Hkv, D]
  pooled = common.repeat_kv_heads(pooled, num_heads)
  scores = jnp.einsum("bqhd,bkhd->bhqk", query.astype(jnp.float32), pooled)
  own = (positions // block_size)[:, None, :, None]  # [B, 1, Tq, 1]
  block = jnp.arange(num_blocks)[None, None, None, :]
  eligible = (counts > 0)[:, None, None, :]
  if segment_ids is not None:
    q_segments, kv_segments = mask_lib.split_segment_ids(segment_ids)
    common.check_per_head("segment_ids (the queries')", q_segments, (batch, query.shape[1]))
    common.check_per_head("segment_ids (the keys')", kv_segments, (batch, kv_len))
    eligible &= _holds_segment(q_segments, kv_segments, valid, block_size)[:, None]
  if causal:
    eligible &= block <= own
  scores = jnp.where(block == own, jnp.inf, jnp.where(eligible, scores, -jnp.inf))
  _, chosen = jax.lax.top_k(scores, min(top_k, num_blocks))
  picked = jnp.any(chosen[..., None] == jnp.arange(num_blocks), axis=-2)  # [B, H, Tq, nk]
  return picked & (eligible | (block == own))


def _holds_segment(q_segments: Array, kv_segments: Array, valid: Array,
                   block_size: int) -> Array:
  """`[B, Tq, nk]` bool: block k holds a real key of query q's segment.

  The segment mask would hide every key of another segment's block, so such
  a block would only take a place among the query's top_k. One key of each
  block at a time, so that nothing of size `Tq x Tk` exists.

  Args:
    q_segments: `[B, Tq]`; kv_segments: `[B, Tk]`.
    valid: `[B, nk * block_size]` bool, the real keys (block padding and
      `key_value_seq_lengths` padding False).
    block_size: keys per block.
  """
  batch, padded = valid.shape
  num_blocks = padded // block_size
  kv_segments = jnp.pad(kv_segments, ((0, 0), (0, padded - kv_segments.shape[1]))).reshape(
      batch, num_blocks, block_size)
  real = valid.reshape(batch, num_blocks, block_size)

  def holds(i, held):
    same = kv_segments[:, None, :, i] == q_segments[:, :, None]  # [B, Tq, nk]
    return held | (same & real[:, None, :, i])

  empty = jnp.zeros((batch, q_segments.shape[1], num_blocks), bool)
  return jax.lax.fori_loop(0, block_size, holds, empty)


def moba_attention(query: Array, key: Array, value: Array, bias: Optional[Array] = None,
                   mask: Optional[Array] = None, *, block_size: int = 64, top_k: int = 3,
                   is_causal: bool = False, decoding: bool = False,
                   query_positions: Optional[Array] = None,
                   query_seq_lengths: Optional[Array] = None,
                   key_value_seq_lengths: Optional[Array] = None, segment_ids=None,
                   scale: Optional[float] = None, implementation: Optional[str] = None,
                   dropout_rate: float = 0.0, dropout_rng: Optional[Array] = None) -> Array:
  """MoBA: `[B, Tq, H, Dv]`.

  Args:
    query, key, value, bias, mask, query_seq_lengths, key_value_seq_lengths,
      scale: as `dot_product_attention`.
    is_causal: causal, the queries aligned with the last keys (query i at key
      index `i + Tk - Tq`) for the block choice and the mask alike; with Tq
      != Tk, unlike `dot_product_attention`'s top-left causal mask.
    segment_ids: as `dot_product_attention`; also restrict each query's
      choice to blocks holding keys of its segment.
    block_size: keys per block (the gating's unit); also the kernel's tile.
    top_k: blocks per query, its own included (k >= 1).
    decoding: a step from a cache (causal); without is_causal,
      `query_positions` then place the queries, whose later keys the cache
      mask hides.
    query_positions: `[Tq]` or `[B, Tq]`, a decoding step's key index of each
      query (the layer passes arange(Tq) offset by the cache). A full pass
      ignores them: its queries sit at `arange(Tq) + Tk - Tq`, the keys'
      indices, whatever positions a rotary encoding was given.
    implementation: `flex_attention`'s ("blockwise" by default).
    dropout_rate, dropout_rng: dropout on the weights.
  """
  common.check_size("block_size", block_size)
  common.check_size("top_k", top_k)
  batch, q_len, num_heads = query.shape[:3]
  kv_len = key.shape[1]
  num_blocks = -(-kv_len // block_size)
  if top_k > num_blocks:
    raise ValueError(f"moba's top_k ({top_k}) must be at most the number of key blocks "
                     f"{num_blocks} (Tk = {kv_len} in blocks of {block_size}).")
  # The blocks are over the keys' indices: a full pass (the layer's first
  # decoding call too, is_causal) aligns the queries with the last keys; only
  # a step from the cache, whose causal mask the layer makes, is placed by
  # its cache indices (the layer's arange(Tq) offset by the cache), since its
  # Tq says nothing of where it sits in the cache.
  if decoding and not is_causal and query_positions is not None:
    positions = common.query_positions(query_positions, batch, q_len).astype(jnp.int32)
  else:
    positions = jnp.broadcast_to(jnp.arange(q_len) + (kv_len - q_len), (batch, q_len))
  chosen = block_choice(query, key, block_size=block_size, top_k=top_k, positions=positions,
                        causal=is_causal or decoding,
                        key_value_seq_lengths=key_value_seq_lengths, segment_ids=segment_ids)
  block_q = min(block_size, q_len)
  num_q_blocks = -(-q_len // block_q)
  by_query_block = jnp.pad(chosen, ((0, 0), (0, 0), (0, num_q_blocks * block_q - q_len),
                                    (0, 0))).reshape(batch, num_heads, num_q_blocks, block_q,
                                                     num_blocks)
  visited = jnp.any(by_query_block, axis=3)

  # Causal inside the own block at the same positions as the choice: the
  # engine's is_causal is top-left, which for Tq < Tk would hide the chosen
  # blocks.
  def mask_mod(b, h, q_idx, kv_idx):
    allowed = chosen[b, h, q_idx, kv_idx // block_size]
    return allowed & (kv_idx <= positions[b, q_idx]) if is_causal else allowed

  block_mask = block_masks.block_mask_from_blocks(mask_mod, visited, q_len, kv_len,
                                                  (block_q, block_size))
  return flex_attention(
      query, key, value, block_mask=block_mask, scale=scale, bias=bias, mask=mask,
      query_seq_lengths=query_seq_lengths,
      key_value_seq_lengths=key_value_seq_lengths, segment_ids=segment_ids,
      implementation=implementation, dropout_rate=dropout_rate, dropout_rng=dropout_rng)


registry.register(registry.VariantSpec(
    name="moba", fn=moba_attention, family="modern",
    complexity="O(T k B): k blocks of B keys per query", subquadratic=True, exact=False,
    causal=True, cross=False, steps_from_cache=True, paper="Lu et al. 2025",
    takes=("dropout", "query_positions", "decoding"),
    options=dict(
        block_size="keys per block, the unit the gating scores (and the kernel's tile)",
        top_k="blocks each query attends to, its own block included",
        scale="multiplies the logits; 1/sqrt(D) when None",
        implementation="'blockwise' (default), 'pallas_gpu', 'pallas_tpu' or 'xla' (the "
                       "dense reference)")))
