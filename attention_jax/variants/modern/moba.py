"""Mixture of block attention (MoBA, Lu et al. 2025), `moba`.

The keys are cut into blocks of `block_size`; each query scores every block
by its mean-pooled key, s_i = q . mean(K_i) (parameter-free gating, eq. 5), and
attends to its `top_k` blocks, its own block always among them (eq. 6);
causally, blocks after its own are never chosen and its own block is causal
inside. The softmax runs over the union of the chosen blocks' keys.

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
from attention_jax.flex import flex_attention
from attention_jax.variants import common

Array = jax.Array


def block_choice(query: Array, key: Array, *, block_size: int, top_k: int,
                 positions: Array, causal: bool,
                 key_value_seq_lengths: Optional[Array] = None) -> Array:
  """Each query's chosen key blocks: `[B, H, Tq, nk]` bool.

  Args:
    query: `[B, Tq, H, D]`; key: `[B, Tk, Hkv, D]`.
    block_size, top_k: MoBA's block size and number of blocks per query.
    positions: `[B, Tq]` int, each query's key index (its own block is
      positions // block_size).
    causal: blocks after a query's own are not eligible.
    key_value_seq_lengths: `[B]`; padding is left out of the means, and a
      block of padding only is never chosen.
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
  if causal:
    eligible &= block <= own
  scores = jnp.where(block == own, jnp.inf, jnp.where(eligible, scores, -jnp.inf))
  _, chosen = jax.lax.top_k(scores, min(top_k, num_blocks))
  picked = jnp.any(chosen[..., None] == jnp.arange(num_blocks), axis=-2)  # [B, H, Tq, nk]
  return picked & (eligible | (block == own))


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
    query, key, value, bias, mask, is_causal, query_seq_lengths,
      key_value_seq_lengths, segment_ids, scale: as `dot_product_attention`.
    block_size: keys per block (the gating's unit); also the kernel's tile.
    top_k: blocks per query, its own included (k >= 1).
    decoding: a step from a cache (causal); `query_positions` then place the
      queries, whose later keys the cache mask hides.
    query_positions: `[Tq]` or `[B, Tq]` key index of each query (the layer
      passes them); `arange(Tq) + Tk - Tq` when None.
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
  if query_positions is None:
    positions = jnp.broadcast_to(jnp.arange(q_len) + (kv_len - q_len), (batch, q_len))
  else:
    positions = common.query_positions(query_positions, batch, q_len).astype(jnp.int32)
  chosen = block_choice(query, key, block_size=block_size, top_k=top_k, positions=positions,
                        causal=is_causal or decoding,
                        key_value_seq_lengths=key_value_seq_lengths)
  block_q = min(block_size, q_len)
  num_q_blocks = -(-q_len // block_q)
  by_query_block = jnp.pad(chosen, ((0, 0), (0, 0), (0, num_q_blocks * block_q - q_len),
                                    (0, 0))).reshape(batch, num_heads, num_q_blocks, block_q,
                                                     num_blocks)
  visited = jnp.any(by_query_block, axis=3)
  block_mask = block_masks.block_mask_from_blocks(
      lambda b, h, q_idx, kv_idx: chosen[b, h, q_idx, kv_idx // block_size], visited,
      q_len, kv_len, (block_q, block_size))
  return flex_attention(
      query, key, value, block_mask=block_mask, scale=scale, bias=bias, mask=mask,
      is_causal=is_causal, query_seq_lengths=query_seq_lengths,
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
