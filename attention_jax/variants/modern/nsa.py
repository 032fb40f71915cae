"""Native sparse attention (NSA, Yuan et al. 2025), `nsa`.

Each query attends through three branches and mixes them with gates from the
layer input (eq. 5). Each branch has keys and values of its own (section
3.3.3, against shortcut learning across the branches): `MultiHeadAttention`
projects, rotates and caches three sets per K/V group
(`NSAParameters.key_value_sets`), or with `shared_key_value` one set that the
branches share:

  * compressed: the keys and values of each block of `compress_block_size`
    tokens (blocks every `compress_stride` tokens) compressed to one token
    by a learned map with intra-block positions (eq. 7); a query sees the
    compressed tokens whose blocks end at or before it;
  * selected: the key blocks of `select_block_size` with the most attention
    from the compressed branch (its weights summed over the compressed
    tokens inside each block, eq. 8-9, and over the heads of a K/V group,
    eq. 10), the top `top_n` of them, attended token by token; they count
    the initial block and `num_local_blocks` local ones (the query's own and
    the one before it), which are always selected (section 4.1: "1 initial
    block and 2 local blocks" among the 16);
  * sliding: the last `window` tokens.

    o_t = g_cmp o_cmp + g_slc o_slc + g_win o_win,   g = sigmoid(x_t W_g + b)

The selected branch runs on the flex engine with a block mask made from the
block-level choice (as MoBA's), the sliding branch with its window, so no
`Tq x Tk` array exists (the compressed branch holds `Tq x Tk / stride`).
Causal only. Decoding places each query by its position, so a step sees what
the full pass does.

Departures (docs/ARCHITECTURE.md): the compression map is one linear layer
over the block's keys plus learned positions (the paper: an MLP); the gate is
one linear layer and a sigmoid (the paper: "an MLP and sigmoid activation",
giving neither its width, depth nor activation, so any hidden layer would be
our guess; a linear gate is the MLP's common core, as phi is); a selection
block's importance sums the compressed tokens that start inside it (eq. 9 also
counts the overlapping neighbours); the blocks and the window are the paper's
(l = 32, d = 16, l' = 64, w = 512) but top_n is 4, not 16, so that sequences of
a few hundred tokens have that many blocks to choose from (one of the 4 chosen
by importance, beside the 3 forced).
"""

from __future__ import annotations

import math
from typing import Any, ClassVar, Mapping, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from attention_jax import registry
from attention_jax.core import block_mask as block_masks
from attention_jax.core.softmax import masked_softmax
from attention_jax.flex import flex_attention
from attention_jax.variants import common

Array = jax.Array
# The branches, in the order of the gates and of each K/V group's key sets.
BRANCHES = ("compressed", "selected", "sliding")


def stack_branches(compressed: Array, selected: Array, sliding: Array) -> Array:
  """Three `[B, T, Hkv, F]` (a branch's keys, or values) -> `[B, T, 3 Hkv, F]`,
  the layout `nsa_attention` takes: head 3 g + i is branch i of K/V group g,
  so a group's three sets sit together when the heads are sharded."""
  stacked = jnp.stack([compressed, selected, sliding], axis=3)  # [B, T, Hkv, 3, F]
  return stacked.reshape(stacked.shape[:2] + (-1,) + stacked.shape[4:])


def split_branches(x: Array, shared: bool) -> tuple:
  """The inverse of `stack_branches`: the compressed, selected and sliding
  branches' `[B, T, Hkv, F]`; with `shared`, `x` itself three times."""
  if shared:
    return x, x, x
  heads = x.shape[2]
  if heads % len(BRANCHES):
    raise ValueError(f"nsa's keys and values hold a set per branch ({', '.join(BRANCHES)}), "
                     f"3 Hkv heads; got {heads} heads. Pass shared_key_value=True for one set "
                     f"shared by the branches.")
  split = x.reshape(x.shape[:2] + (heads // len(BRANCHES), len(BRANCHES)) + x.shape[3:])
  return tuple(split[:, :, :, i] for i in range(len(BRANCHES)))


def compress_blocks(x: Array, weight: Array, positions: Array, block: int, stride: int) -> Array:
  """phi over blocks: `x` `[B, T, Hkv, F]` -> `[B, nc, Hkv, F']`, block i covering
  tokens i * stride .. i * stride + block - 1; positions `[block, F]` added,
  then `[block * F] @ weight [block * F, F']`."""
  batch, length, heads, features = x.shape
  count = max(0, (length - block) // stride + 1)
  index = jnp.arange(count)[:, None] * stride + jnp.arange(block)[None, :]  # [nc, block]
  blocks = x[:, index] + positions[None, None, :, None, :].astype(x.dtype)  # [B, nc, l, Hkv, F]
  blocks = jnp.moveaxis(blocks, 3, 2).reshape(batch, count, heads, block * features)
  return blocks @ weight.astype(x.dtype)


def nsa_attention(query: Array, key: Array, value: Array, bias: Optional[Array] = None,
                  mask: Optional[Array] = None, *, gates: Array, compress_key: Array,
                  compress_value: Array, key_positions: Array, value_positions: Array,
                  compress_block_size: int = 32, compress_stride: int = 16,
                  select_block_size: int = 64, top_n: int = 4, num_local_blocks: int = 2,
                  window: int = 512, shared_key_value: bool = False,
                  is_causal: bool = False, decoding: bool = False,
                  query_positions: Optional[Array] = None,
                  query_seq_lengths: Optional[Array] = None,
                  key_value_seq_lengths: Optional[Array] = None, segment_ids=None,
                  scale: Optional[float] = None,
                  implementation: Optional[str] = None) -> Array:
  """NSA: `[B, Tq, H, Dv]`.

  Args:
    query: `[B, Tq, H, D]`.
    key, value: `[B, Tk, 3 Hkv, D]`, `[B, Tk, 3 Hkv, Dv]`: each K/V group's
      compressed, selected and sliding branches' keys (values) side by side
      (`stack_branches`); `[B, Tk, Hkv, D]`, `[B, Tk, Hkv, Dv]` with
      `shared_key_value`.
    bias, segment_ids: not supported.
    mask: boolean `[B|1, 1|H, Tq, Tk]` ANDed into every branch's keys (the
      layer's decoding cache mask).
    gates: `[B, Tq, H, 3]` in (0, 1): the compressed, selected and sliding
      branches' gates.
    compress_key, compress_value: `[l * D, D]`, `[l * Dv, Dv]`, phi's weights.
    key_positions, value_positions: `[l, D]`, `[l, Dv]`, phi's intra-block positions.
    compress_block_size, compress_stride: l and d (d divides l).
    select_block_size: l' (a multiple of d); also the selected branch's tile.
    top_n: selected blocks per query, the forced ones included: the initial
      block and the `num_local_blocks` local ones (at least 1 + that many).
    num_local_blocks: the query's own selection block and the ones just before
      it, always selected (the paper: 2; 1 is the own block alone).
    window: the sliding branch's keys, the query's own included.
    shared_key_value: one set of keys and values for the three branches.
    is_causal, decoding, query_positions: the mechanism is causal; queries sit
      at `arange(Tq) + Tk - Tq`, or, in a decoding step, at `query_positions`.
    query_seq_lengths, key_value_seq_lengths: as `dot_product_attention`.
    scale: logit scale of every branch, 1/sqrt(D) when None.
    implementation: the flex engine's, for the selected and sliding branches.
  """
  common.reject_unsupported("nsa", bias=bias, segment_ids=segment_ids)
  if not (is_causal or decoding):
    raise ValueError("nsa is causal: pass is_causal=True (or decode from a cache).")
  for name, size in (("compress_block_size", compress_block_size),
                     ("compress_stride", compress_stride),
                     ("select_block_size", select_block_size), ("top_n", top_n),
                     ("num_local_blocks", num_local_blocks), ("window", window)):
    common.check_size(name, size)
  if compress_block_size % compress_stride or select_block_size % compress_stride:
    raise ValueError(f"nsa's compress_stride ({compress_stride}) must divide compress_block_size "
                     f"({compress_block_size}) and select_block_size ({select_block_size}).")
  (compress_keys, select_keys, window_keys), (compress_values, select_values, window_values) = (
      split_branches(key, shared_key_value), split_branches(value, shared_key_value))
  batch, q_len, num_heads, head_dim = query.shape
  kv_len, num_kv_heads = select_keys.shape[1], select_keys.shape[2]
  num_select = -(-kv_len // select_block_size)
  if top_n < 1 + num_local_blocks:
    raise ValueError(f"nsa's top_n ({top_n}) must be at least 1 + num_local_blocks = "
                     f"{1 + num_local_blocks}: it counts the initial block and the "
                     f"{num_local_blocks} local ones, which are always selected.")
  if top_n > num_select:
    raise ValueError(f"nsa's top_n ({top_n}) must be at most the number of selection blocks "
                     f"{num_select} (Tk = {kv_len} in blocks of {select_block_size}).")
  common.check_per_head("gates", gates, (batch, q_len, num_heads, 3))
  scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
  # A full pass aligns the queries with the last keys; a decoding step is
  # placed by its cache indices (the layer's arange(Tq) offset by the cache).
  stepping = decoding and query_positions is not None
  if stepping:
    positions = common.query_positions(query_positions, batch, q_len).astype(jnp.int32)
  else:
    positions = jnp.broadcast_to(jnp.arange(q_len) + (kv_len - q_len), (batch, q_len))
  lengths = (jnp.full((batch,), kv_len) if key_value_seq_lengths is None
             else jnp.asarray(key_value_seq_lengths))
  pair_mask = None if mask is None else jnp.asarray(mask, bool)
  if pair_mask is not None and pair_mask.ndim != 4:
    raise ValueError(f"mask must be [B|1, H|1, Tq, Tk], got shape {list(pair_mask.shape)}.")

  # Compressed branch: every query against the compressed tokens before it.
  compressed_key = compress_blocks(compress_keys, compress_key, key_positions,
                                   compress_block_size, compress_stride)
  compressed_value = compress_blocks(compress_values, compress_value, value_positions,
                                     compress_block_size, compress_stride)
  num_compressed = compressed_key.shape[1]
  block_end = jnp.arange(num_compressed) * compress_stride + compress_block_size - 1
  seen = ((block_end[None, None, :] <= positions[:, :, None])
          & (block_end[None, None, :] < lengths[:, None, None]))[:, None]  # [B, 1, Tq, nc]
  logits = jnp.einsum("bqhd,bkhd->bhqk", query.astype(jnp.float32),
                      common.repeat_kv_heads(compressed_key, num_heads).astype(jnp.float32))
  weights = masked_softmax(logits * scale, seen)  # p_cmp, [B, H, Tq, nc]
  out_compressed = jnp.einsum("bhqk,bkhd->bqhd", weights, common.repeat_kv_heads(
      compressed_value, num_heads).astype(jnp.float32))

  # Selected branch: blocks by the compressed branch's attention, shared by a group.
  owner = (jnp.arange(num_compressed) * compress_stride) // select_block_size  # [nc]
  importance = jnp.einsum("bhqc,cs->bhqs", weights,
                          jax.nn.one_hot(owner, num_select, dtype=jnp.float32))
  group = num_heads // num_kv_heads
  importance = importance.reshape(batch, num_kv_heads, group, q_len, num_select).sum(2)
  own = (positions // select_block_size)[:, None, :, None]
  block = jnp.arange(num_select)[None, None, None, :]
  eligible = (block <= own) & (block * select_block_size < lengths[:, None, None, None])
  # Section 4.1: the initial block and the local ones are always among the n
  # (the query's own and the num_local_blocks - 1 before it); top_n >= their
  # count, so the infinite scores never compete with each other.
  forced = (block == 0) | ((block <= own) & (block > own - num_local_blocks))
  scores = jnp.where(forced, jnp.inf, jnp.where(eligible, importance, -jnp.inf))
  _, top = jax.lax.top_k(scores, top_n)
  chosen = jnp.any(top[..., None] == jnp.arange(num_select), axis=-2) & (eligible | forced)
  chosen = jnp.repeat(chosen, group, axis=1)  # [B, H, Tq, ns]
  block_q = min(select_block_size, q_len)
  num_q_blocks = -(-q_len // block_q)
  visited = jnp.pad(chosen, ((0, 0), (0, 0), (0, num_q_blocks * block_q - q_len), (0, 0)))
  visited = visited.reshape(batch, num_heads, num_q_blocks, block_q, num_select).any(3)
  causal = lambda b, q_idx, kv_idx: kv_idx <= positions[b, q_idx]
  selected_mask = block_masks.block_mask_from_blocks(
      lambda b, h, q_idx, kv_idx: chosen[b, h, q_idx, kv_idx // select_block_size]
      & causal(b, q_idx, kv_idx), visited, q_len, kv_len, (block_q, select_block_size))
  common_masks = dict(mask=pair_mask, scale=scale, query_seq_lengths=query_seq_lengths,
                      key_value_seq_lengths=key_value_seq_lengths,
                      implementation=implementation)
  out_selected = flex_attention(query, select_keys, select_values, block_mask=selected_mask,
                                **common_masks)

  # Sliding branch: the last `window` keys. A full pass with as many queries as
  # keys uses the engine's window (tiles outside it skipped); the engine's is
  # top-left aligned, so fewer queries than keys, like a decoding step, are
  # placed by their positions.
  if not stepping and q_len == kv_len:
    out_window = flex_attention(query, window_keys, window_values, is_causal=True,
                                local_window_size=(window - 1, 0), **common_masks)
  else:
    out_window = flex_attention(
        query, window_keys, window_values,
        mask_mod=lambda b, h, q_idx, kv_idx: causal(b, q_idx, kv_idx)
        & (positions[b, q_idx] - kv_idx < window), **common_masks)

  gates = gates.astype(jnp.float32)
  out = (gates[..., 0:1] * out_compressed + gates[..., 1:2] * out_selected.astype(jnp.float32)
         + gates[..., 2:3] * out_window.astype(jnp.float32))
  return common.zero_padded_queries(out, query_seq_lengths).astype(query.dtype)


class NSAParameters(nn.Module):
  """NSA's arrays: the branch gates from the layer input (`reads_layer_input`)
  and phi's compression weights and intra-block positions for keys and values;
  and the key and value sets the layer projects (`key_value_sets`).

  Attributes:
    compress_block_size: l, the tokens phi compresses into one.
  """

  compress_block_size: int = 32
  reads_layer_input: ClassVar[bool] = True

  @staticmethod
  def key_value_sets(options: Mapping[str, Any]) -> int:
    """Key and value sets `MultiHeadAttention` projects per K/V group: one per
    branch, unless `options["shared_key_value"]`."""
    return 1 if options.get("shared_key_value") else len(BRANCHES)

  @nn.compact
  def __call__(self, query, key, value, deterministic: bool = True, *, inputs: Array) -> dict:
    del deterministic
    block = common.check_size("compress_block_size", self.compress_block_size)
    num_heads, head_dim, value_dim = query.shape[2], key.shape[-1], value.shape[-1]
    gate_logits = nn.Dense(num_heads * 3, name="gates")(inputs)
    gates = jax.nn.sigmoid(gate_logits.reshape(inputs.shape[:2] + (num_heads, 3)))
    init = nn.initializers.lecun_normal()
    positions = nn.initializers.normal(0.02)
    return dict(
        gates=gates,
        compress_key=self.param("compress_key", init, (block * head_dim, head_dim)),
        compress_value=self.param("compress_value", init, (block * value_dim, value_dim)),
        key_positions=self.param("key_positions", positions, (block, head_dim)),
        value_positions=self.param("value_positions", positions, (block, value_dim)))


registry.register(registry.VariantSpec(
    name="nsa", fn=nsa_attention, family="modern",
    complexity="O(T (T / d + n l' + w))", subquadratic=True, exact=False, causal=True,
    cross=False, bidirectional=False, steps_from_cache=True, paper="Yuan et al. 2025",
    extras=NSAParameters, takes=("query_positions", "decoding"),
    options=dict(
        compress_block_size="l, tokens compressed into one (the paper: 32)",
        compress_stride="d, between compressed blocks; divides l and l' (the paper: 16)",
        select_block_size="l', the selected blocks (the paper: 64)",
        top_n="n, blocks selected per query, the initial and the local ones included "
              "(the paper: 16)",
        num_local_blocks="the query's own selection block and those just before it, always "
                         "selected (the paper: 2; 1, its own only)",
        window="w, the sliding branch's keys (the paper: 512)",
        shared_key_value="one set of keys and values for the three branches (the paper: "
                         "one per branch, the layer projecting 3 Hkv key and value heads)",
        scale="multiplies every branch's logits; 1/sqrt(D) when None",
        implementation="the flex engine's for the selected and sliding branches: "
                       "'blockwise' (default), 'pallas_gpu', 'pallas_tpu' or 'xla'")))
