"""Blockwise (online) softmax attention in pure JAX: the portable flash attention.

Queries are processed a block at a time; for each query block a loop over the
key blocks it can see keeps a running maximum `m`, normaliser `l` and output
accumulator, so no `[Tq, Tk]` array is ever built. The forward pass saves the
output and the log-sum-exp `lse = m + log(l)` (also returned, with
`return_residual`); the backward pass (`common.flash_attention_vjp`)
recomputes each block's probabilities from `lse` instead of storing them, in
one sweep over key blocks that accumulates dk and dv per key block and adds
into a whole dq (and dbias). Memory is O(T) in both directions. Blocks:
`block_q`/`block_k` tile the forward, `block_q_dkv`/`block_k_dkv` the
backward sweep.

Internal layout: query `[B, Hkv, G, Tq, D]` (G = H // Hkv query heads per K/V
head), key and value `[B, Hkv, Tk, D]`, so grouped heads share K/V blocks
without copies.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional, Tuple, Union

import jax
import jax.numpy as jnp

from attention_jax.core import patterns
from attention_jax.core.inputs import (AttentionInputs, attention_of_empty_sequence,
                                       prepare_inputs, returned_outputs)

from . import common

Array = jnp.ndarray


@dataclasses.dataclass(frozen=True)
class _Static:
  """Everything about a call that is fixed at trace time."""

  block_q: int
  block_k: int
  block_q_dkv: int
  block_k_dkv: int
  q_len: int  # padded Tq (a multiple of every query block size)
  kv_len: int  # padded Tk
  true_kv_len: int
  scale: float
  reach: common.Reach
  # A block-sparse pattern (`attention_jax.core.patterns`), applied inside the
  # blocks that `_Masks.block_layout` marks PARTIAL; None: no pattern.
  pattern: Optional[patterns.Pattern] = None


@dataclasses.dataclass
class _Masks:
  """The non-differentiable arrays that decide which pairs may attend (padded)."""

  mask: Optional[Array]  # [B|1, Hkv|1, G|1, Tq|1, Tk|1] bool
  q_lengths: Optional[Array]  # [B]
  kv_lengths: Optional[Array]  # [B]
  q_segment_ids: Optional[Array]  # [B, Tq]
  kv_segment_ids: Optional[Array]  # [B, Tk]
  # The tokens' positions in the whole sequence, [Tq] and [Tk] int32, when the
  # arrays hold a part of it out of order (a device's chunks in ring
  # attention); None: position = index. Causal masks, windows and lengths
  # apply to positions. With positions, every block is looked at and skipped
  # (`lax.cond`) when no pair in it is within reach.
  q_positions: Optional[Array] = None
  kv_positions: Optional[Array] = None
  # Block-sparse attention (block_sparse.py): `[H|1, nq, nk]` int8, SKIP,
  # PARTIAL or FULL per head and (query block, key block) of the forward's
  # blocks (which the backward then uses too). The loops visit the blocks some
  # head does not skip, in order; None: every block in reach.
  block_layout: Optional[Array] = None

  @property
  def has_positions(self) -> bool:
    return self.q_positions is not None


jax.tree_util.register_dataclass(
    _Masks, data_fields=["mask", "q_lengths", "kv_lengths", "q_segment_ids", "kv_segment_ids",
                         "q_positions", "kv_positions", "block_layout"],
    meta_fields=[])


def _visit_lists(masks: _Masks, transpose: bool) -> Optional[Tuple[Array, Array]]:
  """The blocks to visit by the layout, None without one: for each query block
  (each key block with `transpose`) the key (query) blocks that some head does
  not skip, in order and padded with skipped ones (`[n, m]` int32), and how
  many they are (`[n]`)."""
  if masks.block_layout is None:
    return None
  layout = masks.block_layout.swapaxes(1, 2) if transpose else masks.block_layout
  visited = jnp.any(layout != patterns.SKIP, axis=0)
  order = jnp.argsort(~visited, axis=-1, stable=True).astype(jnp.int32)
  return order, visited.sum(-1).astype(jnp.int32)


def _visit_blocks(visit_lists, lo, hi, row, visit, carry):
  """`visit(block, carry)` over the blocks `[lo, hi)` of the reach, or, with
  `visit_lists` (`_visit_lists`), over those listed for `row`."""
  if visit_lists is None:
    return jax.lax.fori_loop(lo, hi, visit, carry)
  order, count = visit_lists
  return jax.lax.fori_loop(0, count[row], lambda n, c: visit(order[row, n], c), carry)


def _positions(explicit: Optional[Array], start, size: int) -> Array:
  """The positions of `size` tokens from index `start`."""
  if explicit is None:
    return start + jnp.arange(size)
  return jax.lax.dynamic_slice_in_dim(explicit, start, size)


def _block_in_reach(cfg: "_Static", masks: _Masks, q_start, k_start, bq: int, bk: int) -> Array:
  """Whether some query of the block may see some key of it (explicit positions)."""
  q_pos = _positions(masks.q_positions, q_start, bq)
  k_pos = _positions(masks.kv_positions, k_start, bk)
  left, right = cfg.reach
  visible = k_start < cfg.true_kv_len
  if right is not None:
    visible &= k_pos.min() <= q_pos.max() + right
  if left is not None:
    visible &= k_pos.max() >= q_pos.min() - left
  return visible


def _visit_in_reach(cfg: "_Static", masks: _Masks, q_start, k_start, bq: int, bk: int,
                    visit, carry):
  """`visit(carry)`, skipped where the block is out of reach (explicit positions only;
  index positions skip whole ranges through `kv_block_range` instead)."""
  if not masks.has_positions:
    return visit(carry)
  return jax.lax.cond(_block_in_reach(cfg, masks, q_start, k_start, bq, bk), visit,
                      lambda c: c, carry)


def _block_range(cfg: "_Static", masks: _Masks, block_range, block, block_a: int,
                 block_b: int, num_blocks: int):
  """[lo, hi) of the blocks to visit: from the reach, or all with explicit positions."""
  if masks.has_positions:
    return 0, num_blocks
  return block_range(block, block_a, block_b, num_blocks, cfg.reach)


def _block_logits(cfg: _Static, masks: _Masks, q_blk, k_blk_t, bias, q_start, k_start, bq, bk):
  """Scaled, biased and masked logits of one block: `[B, Hkv, G, bq, bk]` float32.

  k_blk_t: the key block transposed, `[B, Hkv, D, bk]`: the product's right
  operand as XLA's CPU matmuls take it (given `[bk, D]`, XLA copies it
  transposed at every step of the loop).
  """
  logits = common.einsum_float32("bhgqd,bhdk->bhgqk", q_blk, k_blk_t) * cfg.scale
  if bias is not None:
    logits += _block_of(bias, q_start, k_start, bq, bk).astype(jnp.float32)
  q_pos = _positions(masks.q_positions, q_start, bq)
  k_pos = _positions(masks.kv_positions, k_start, bk)
  slice_ids = lambda ids, start, size: None if ids is None else jax.lax.dynamic_slice_in_dim(
      ids, start, size, axis=1)
  # No padding, nothing to mask: the where (a pass over the block) is skipped.
  padded = cfg.kv_len != cfg.true_kv_len
  allowed = common.block_mask(
      q_pos, k_pos, kv_len=cfg.true_kv_len if padded else None,
      k_index=k_start + jnp.arange(bk), reach=cfg.reach,
      q_lengths=masks.q_lengths, kv_lengths=masks.kv_lengths,
      q_segment_ids=slice_ids(masks.q_segment_ids, q_start, bq),
      kv_segment_ids=slice_ids(masks.kv_segment_ids, k_start, bk))
  allowed = None if allowed is None else allowed[:, None, None]
  if masks.mask is not None:
    block = _block_of(masks.mask, q_start, k_start, bq, bk)
    allowed = block if allowed is None else allowed & block
  if masks.block_layout is not None:
    in_pattern = _pattern_block(cfg, masks.block_layout, q_pos, k_pos, q_start // bq,
                                k_start // bk, logits.shape[1:3])
    allowed = in_pattern if allowed is None else allowed & in_pattern
  return logits if allowed is None else jnp.where(allowed, logits, -jnp.inf)


def _pattern_block(cfg: _Static, layout: Array, q_pos: Array, k_pos: Array, q_block, k_block,
                   kv_heads_and_group: Tuple[int, int]) -> Array:
  """`[1, Hkv|1, G|1, bq, bk]` bool: the pairs of the block that its heads'
  patterns allow. A head that skips the block (another head visits it) sees
  none of it; a FULL block is allowed whole; a PARTIAL one as the pattern says."""
  entry = layout[:, q_block, k_block]  # [H|1]
  heads = entry.shape[0]
  head = jnp.arange(heads)[:, None, None]
  in_pattern = (False if cfg.pattern is None else
                cfg.pattern(head, q_pos[None, :, None], k_pos[None, None, :]))
  allowed = (entry != patterns.SKIP)[:, None, None] & (
      (entry == patterns.FULL)[:, None, None] | in_pattern)  # [H|1, bq, bk]
  grouped = kv_heads_and_group if heads > 1 else (1, 1)
  return allowed.reshape((1,) + grouped + allowed.shape[1:])


def _block_of(x, q_start, k_start, bq, bk):
  """The `[.., bq|1, bk|1]` block of a bias or mask laid out `[.., Tq|1, Tk|1]`."""
  return common.slice_axis(common.slice_axis(x, 3, q_start, bq), 4, k_start, bk)


def _forward(cfg: _Static, q, k, v, bias, masks: _Masks):
  """Returns out `[B, Hkv, G, Tq, Dv]` (query dtype) and lse `[B, Hkv, G, Tq]` float32."""
  bq, bk = cfg.block_q, cfg.block_k
  num_kv_blocks = cfg.kv_len // bk
  visit_lists = _visit_lists(masks, transpose=False)
  k_t = k.swapaxes(-1, -2)  # once, not once per block (see _block_logits)

  def one_query_block(i):
    q_blk = jax.lax.dynamic_slice_in_dim(q, i * bq, bq, axis=3)
    stats_shape = q_blk.shape[:-1]
    init = (jnp.full(stats_shape, -jnp.inf), jnp.zeros(stats_shape),
            jnp.zeros(stats_shape + (v.shape[-1],), jnp.float32))

    def visit_key_block(j, carry):
      return _visit_in_reach(cfg, masks, i * bq, j * bk, bq, bk,
                             functools.partial(update, j), carry)

    def update(j, carry):
      row_max, row_sum, acc = carry
      k_blk_t = jax.lax.dynamic_slice_in_dim(k_t, j * bk, bk, axis=3)
      v_blk = jax.lax.dynamic_slice_in_dim(v, j * bk, bk, axis=2)
      logits = _block_logits(cfg, masks, q_blk, k_blk_t, bias, i * bq, j * bk, bq, bk)
      new_max = jnp.maximum(row_max, logits.max(-1))
      # A row with nothing allowed so far keeps max -inf; exponentiate against 0 then.
      safe_max = jnp.where(jnp.isfinite(new_max), new_max, 0.0)
      probs = jnp.exp(logits - safe_max[..., None])
      correction = jnp.exp(row_max - safe_max)
      row_sum = correction * row_sum + probs.sum(-1)
      acc = correction[..., None] * acc + common.einsum_float32(
          "bhgqk,bhkd->bhgqd", probs.astype(v.dtype), v_blk)
      return new_max, row_sum, acc

    lo, hi = _block_range(cfg, masks, common.kv_block_range, i, bq, bk, num_kv_blocks)
    row_max, row_sum, acc = _visit_blocks(visit_lists, lo, hi, i, visit_key_block, init)
    empty = row_sum == 0.0  # nothing to attend: output 0, lse finite (see EMPTY_ROW_LSE)
    out = acc / jnp.where(empty, 1.0, row_sum)[..., None]
    lse = jnp.where(empty, common.EMPTY_ROW_LSE,
                    row_max + jnp.log(jnp.where(empty, 1.0, row_sum)))
    return out.astype(q.dtype), lse

  out, lse = jax.lax.map(one_query_block, jnp.arange(cfg.q_len // bq))
  # [nq, B, Hkv, G, bq, ...] -> [B, Hkv, G, nq * bq, ...]
  out = jnp.moveaxis(out, 0, 3).reshape(q.shape[:3] + (cfg.q_len, v.shape[-1]))
  lse = jnp.moveaxis(lse, 0, 3).reshape(q.shape[:3] + (cfg.q_len,))
  return out, lse


def _backward(cfg: _Static, q, k, v, bias, masks: _Masks, lse, d_out, delta):
  """Gradients of q, k, v and bias, recomputing block probabilities from lse.

  One sweep: for each key block, over the query blocks that see it, dk and dv
  accumulate in the loop and dq is added into a whole `[.., Tq', D]` float32
  buffer. Each block's logits, probabilities and dP are computed once (5 block
  products; a dq sweep apart from a dk/dv sweep, as the GPU kernels do to
  avoid atomics, recomputes them: 7): 1722 -> 1321 ms for forward+backward at
  T=4096 (B1 H8 D64, float32, this 2-core CPU), one A/B run. Every product
  takes its operands as XLA's CPU matmuls want them (dk and dv accumulated
  transposed, q, dO, k and v transposed once up front), so that no block-sized
  array is copied transposed and dS is computed once: 1149 -> 682 ms, one A/B
  run (docs/ARCHITECTURE.md).

  lse, delta: `[B, Hkv, G, Tq']` float32 (delta as `common.flash_attention_vjp`
  gives it).
  """
  bq, bk = cfg.block_q_dkv, cfg.block_k_dkv
  visit_lists = _visit_lists(masks, transpose=True)
  # Every product's operands laid out as XLA's CPU matmuls take them, transposed
  # once here rather than copied at every step of the loops.
  k_t, v_t = k.swapaxes(-1, -2), v.swapaxes(-1, -2)
  q_t, d_out_t = q.swapaxes(-1, -2), d_out.swapaxes(-1, -2)

  def dkv_of_key_block(carry, j):
    k_blk = jax.lax.dynamic_slice_in_dim(k, j * bk, bk, axis=2)
    k_blk_t = jax.lax.dynamic_slice_in_dim(k_t, j * bk, bk, axis=3)
    v_blk_t = jax.lax.dynamic_slice_in_dim(v_t, j * bk, bk, axis=3)

    def visit(i, inner):
      return _visit_in_reach(cfg, masks, i * bq, j * bk, bq, bk, functools.partial(update, i),
                             inner)

    def update(i, inner):
      dk, dv, dq, d_bias = inner
      q_blk = jax.lax.dynamic_slice_in_dim(q, i * bq, bq, axis=3)
      q_blk_t = jax.lax.dynamic_slice_in_dim(q_t, i * bq, bq, axis=4)
      do_blk = jax.lax.dynamic_slice_in_dim(d_out, i * bq, bq, axis=3)
      do_blk_t = jax.lax.dynamic_slice_in_dim(d_out_t, i * bq, bq, axis=4)
      logits = _block_logits(cfg, masks, q_blk, k_blk_t, bias, i * bq, j * bk, bq, bk)
      probs = jnp.exp(logits - jax.lax.dynamic_slice_in_dim(lse, i * bq, bq, axis=3)[..., None])
      d_probs = common.einsum_float32("bhgqd,bhdk->bhgqk", do_blk, v_blk_t)
      d_logits = probs * (d_probs - jax.lax.dynamic_slice_in_dim(delta, i * bq, bq,
                                                                 axis=3)[..., None])
      # dk and dv accumulate transposed, [.., D, bk]: the block's probabilities
      # and dS are then the products' right operands as they are laid out, so
      # XLA neither copies them transposed nor computes dS twice.
      dv += common.einsum_float32("bhgdq,bhgqk->bhdk", do_blk_t, probs.astype(d_out.dtype))
      dk += common.einsum_float32("bhgdq,bhgqk->bhdk", q_blk_t, d_logits.astype(q.dtype))
      dq_blk = jax.lax.dynamic_slice_in_dim(dq, i * bq, bq, axis=3) + common.einsum_float32(
          "bhgqk,bhkd->bhgqd", d_logits.astype(k.dtype), k_blk)
      dq = jax.lax.dynamic_update_slice_in_dim(dq, dq_blk, i * bq, axis=3)
      if d_bias is not None:
        d_bias = _add_block(d_bias, common.sum_to_shape(d_logits, bias.shape), i * bq, j * bk)
      return dk, dv, dq, d_bias

    dq, d_bias = carry
    lo, hi = _block_range(cfg, masks, common.q_block_range, j, bq, bk, cfg.q_len // bq)
    init = (jnp.zeros(k.shape[:2] + (k.shape[-1], bk), jnp.float32),
            jnp.zeros(v.shape[:2] + (v.shape[-1], bk), jnp.float32), dq, d_bias)
    dk, dv, dq, d_bias = _visit_blocks(visit_lists, lo, hi, j, visit, init)
    return (dq, d_bias), (dk.swapaxes(-1, -2) * cfg.scale, dv.swapaxes(-1, -2))

  d_bias = None if bias is None else jnp.zeros(bias.shape, jnp.float32)
  dq = jnp.zeros(q.shape, jnp.float32)
  (dq, d_bias), (dk, dv) = jax.lax.scan(dkv_of_key_block, (dq, d_bias),
                                        jnp.arange(cfg.kv_len // bk))
  dq = (dq * cfg.scale).astype(q.dtype)
  dk = jnp.moveaxis(dk, 0, 2).reshape(k.shape).astype(k.dtype)
  dv = jnp.moveaxis(dv, 0, 2).reshape(v.shape).astype(v.dtype)
  return dq, dk, dv, None if bias is None else d_bias.astype(bias.dtype)


def _add_block(total, block, q_start, k_start):
  """`total[..., q_start:+bq, k_start:+bk] += block` (broadcast axes stay whole)."""
  starts = [0, 0, 0, 0 if total.shape[3] == 1 else q_start, 0 if total.shape[4] == 1 else k_start]
  current = jax.lax.dynamic_slice(total, starts, block.shape)
  return jax.lax.dynamic_update_slice(total, current + block, starts)


# (q, k, v, bias) are differentiated, _Masks is not.
_attention = common.flash_attention_vjp(_forward, _backward)


def blockwise_attention(inputs: AttentionInputs,
                        block_sizes: Optional[common.BlockSizes] = None, *,
                        return_residual: bool = False) -> Union[Array, Tuple[Array, Array]]:
  """Exact attention over `inputs` with O(T) memory; `[B, Tq, H, Dv]`.

  Args:
    inputs: validated arguments of `attention_jax.dot_product_attention`.
    block_sizes: query/key block lengths; `default_block_sizes()` when None.
      Sequences that are not a multiple of a block are padded internally.
    return_residual: also return the log-sum-exp `[B, Tq, H]` float32
      (differentiable; `common.EMPTY_ROW_LSE` where a query attends nothing).
  """
  empty = attention_of_empty_sequence(inputs, return_residual)  # Tq = 0 or Tk = 0
  if empty is not None:
    return empty
  cfg, operands, masks = blocked_layout(inputs, block_sizes)
  out, lse = _attention(cfg, operands, masks)  # [B, Hkv, G, Tq', Dv], [B, Hkv, G, Tq']
  out, lse = from_blocked_layout(out, lse, inputs)
  # query_seq_lengths are masked inside (_Masks.q_lengths): nothing left to apply.
  return common.attention_outputs(out, lse, None, return_residual)


def blocked_layout(inputs: AttentionInputs, block_sizes: Optional[common.BlockSizes] = None):
  """The static configuration, operands `(q, k, v, bias)` and masks of the loops.

  [B, T, H, D] -> q `[B, Hkv, G, Tq', D]`, k and v `[B, Hkv, Tk', D]` (G = H //
  Hkv), padded to whole blocks (Tq', Tk'); the bias and masks likewise.
  """
  query, key, value = inputs.query, inputs.key, inputs.value
  batch, q_len, num_heads, head_dim = query.shape
  kv_len, num_kv_heads = key.shape[1], key.shape[2]
  group = num_heads // num_kv_heads
  if block_sizes is None:
    block_sizes = default_block_sizes(q_len, kv_len)
  bq_dkv, bk_dkv = block_sizes.dkv
  # Clip blocks to the (rounded-up) sequence so that short inputs are not over-padded.
  fit = lambda block, length: min(block, _round_up(length, 8))
  bq, bk = fit(block_sizes.block_q, q_len), fit(block_sizes.block_k, kv_len)
  bq_dkv, bk_dkv = fit(bq_dkv, q_len), fit(bk_dkv, kv_len)
  q_multiple = _lcm(bq, bq_dkv)
  kv_multiple = _lcm(bk, bk_dkv)
  cfg = _Static(block_q=bq, block_k=bk, block_q_dkv=bq_dkv, block_k_dkv=bk_dkv,
                q_len=_round_up(q_len, q_multiple), kv_len=_round_up(kv_len, kv_multiple),
                true_kv_len=kv_len, scale=float(inputs.scale),
                reach=common.reach_of(inputs.is_causal, inputs.local_window_size))

  q = query.reshape(batch, q_len, num_kv_heads, group, head_dim).transpose(0, 2, 3, 1, 4)
  q = common.pad_axis(q, 3, q_multiple)
  k = common.pad_axis(key.transpose(0, 2, 1, 3), 2, kv_multiple)
  v = common.pad_axis(value.transpose(0, 2, 1, 3), 2, kv_multiple)
  bias = _grouped_pairwise(inputs.bias, num_kv_heads, group, q_multiple, kv_multiple)
  pad_ids = lambda ids, multiple: None if ids is None else common.pad_axis(ids, 1, multiple)
  masks = _Masks(
      mask=_grouped_pairwise(inputs.mask, num_kv_heads, group, q_multiple, kv_multiple),
      q_lengths=inputs.query_seq_lengths, kv_lengths=inputs.key_value_seq_lengths,
      q_segment_ids=pad_ids(inputs.q_segment_ids, q_multiple),
      kv_segment_ids=pad_ids(inputs.kv_segment_ids, kv_multiple))
  return cfg, (q, k, v, bias), masks


def from_blocked_layout(out: Array, lse: Array, inputs: AttentionInputs) -> Tuple[Array, Array]:
  """`[B, Hkv, G, Tq', Dv]`, `[B, Hkv, G, Tq']` -> `[B, Tq, H, Dv]`, `[B, Tq, H]`."""
  batch, q_len, num_heads, _ = inputs.query.shape
  out = out[:, :, :, :q_len].transpose(0, 3, 1, 2, 4)
  lse = lse[:, :, :, :q_len].transpose(0, 3, 1, 2)
  return (out.reshape(batch, q_len, num_heads, inputs.value.shape[-1]),
          lse.reshape(batch, q_len, num_heads))


# For ring attention's loops (ring.py) and block-sparse attention (block_sparse.py).
forward, backward, attend = _forward, _backward, _attention


def _grouped_pairwise(x: Optional[Array], num_kv_heads: int, group: int, q_multiple: int,
                      kv_multiple: int) -> Optional[Array]:
  """A bias or mask `[B|1, H|1, Tq|1, Tk|1]` as `[B|1, Hkv|1, G|1, Tq'|1, Tk'|1]`."""
  if x is None:
    return None
  heads = (num_kv_heads, group) if x.shape[1] != 1 else (1, 1)
  x = x.reshape(x.shape[:1] + heads + x.shape[2:])
  return common.pad_axis(common.pad_axis(x, 3, q_multiple, broadcast=True), 4, kv_multiple,
                         broadcast=True)


def default_block_sizes(q_len: int, kv_len: int) -> common.BlockSizes:
  """Blocks of 512: large enough that each step is a sizeable matmul on CPU."""
  del q_len, kv_len
  return common.BlockSizes(block_q=512, block_k=512)


def _round_up(n: int, multiple: int) -> int:
  return common.cdiv(n, multiple) * multiple


def _lcm(a: int, b: int) -> int:
  import math  # pylint: disable=import-outside-toplevel
  return a * b // math.gcd(a, b)


def blockwise_dot_product_attention(query, key, value, bias=None, mask=None, *,
                                    block_sizes: Optional[common.BlockSizes] = None,
                                    return_residual: bool = False, **kwargs):
  """`attention_jax.dot_product_attention` computed blockwise, with explicit block sizes.

  Takes every argument of `dot_product_attention` except `implementation`.
  """
  inputs, unbatched = prepare_inputs(query, key, value, bias, mask, **kwargs)
  return returned_outputs(blockwise_attention(inputs, block_sizes,
                                              return_residual=return_residual), unbatched)
