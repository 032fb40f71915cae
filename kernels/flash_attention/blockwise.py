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

from attention_jax.core import mods, patterns
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
  # A mask mod (`attention_jax.core.patterns`: a static pattern, called as it
  # is, or a `mods.LiftedMod` evaluated with `_Masks.mask_mod_consts`),
  # applied inside the blocks that `_Masks.block_layout` marks PARTIAL.
  mask_mod: Union[None, patterns.Pattern, mods.LiftedMod] = None
  # What the logits go through before the mask (flex_attention): `softcap *
  # tanh(logits / softcap)`, then the lifted score_mod.
  softcap: Optional[float] = None
  score_mod: Optional[mods.LiftedMod] = None
  # "softmax", or "sigmoid": each pair weighted by sigmoid(logit +
  # sigmoid_bias), no normalisation over keys (Ramapuram et al. 2024).
  normaliser: str = "softmax"
  sigmoid_bias: float = 0.0
  # Dropout on the weights (flex_attention; `_Masks.dropout_rng`): each tile's
  # keep mask is drawn from the rng folded with its (query block, key block),
  # so the backward redraws it; one block size for both passes.
  dropout_rate: float = 0.0

  @property
  def modifies_scores(self) -> bool:
    return self.softcap is not None or self.score_mod is not None


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
  # Block-sparse attention (block_sparse.py, flex_attention): `[B|1, H|1, nq,
  # nk]` int8, SKIP, PARTIAL or FULL per batch row, head and (query block, key
  # block) of the forward's blocks (which the backward then uses too). The
  # loops visit the blocks some row and head does not skip, in order; None:
  # every block in reach.
  block_layout: Optional[Array] = None
  # The arrays a lifted mask mod closes over, and those of the score_mod that
  # are not differentiated (integer ids, say): see `mods.LiftedMod.split`.
  mask_mod_consts: Tuple[Array, ...] = ()
  score_mod_consts: Tuple[Array, ...] = ()
  dropout_rng: Optional[Array] = None

  @property
  def has_positions(self) -> bool:
    return self.q_positions is not None


jax.tree_util.register_dataclass(
    _Masks, data_fields=["mask", "q_lengths", "kv_lengths", "q_segment_ids", "kv_segment_ids",
                         "q_positions", "kv_positions", "block_layout", "mask_mod_consts",
                         "score_mod_consts", "dropout_rng"],
    meta_fields=[])


def _visit_lists(masks: _Masks, transpose: bool) -> Optional[Tuple[Array, Array]]:
  """The blocks to visit by the layout, None without one: for each query block
  (each key block with `transpose`) the key (query) blocks that some head does
  not skip, in order and padded with skipped ones (`[n, m]` int32), and how
  many they are (`[n]`)."""
  if masks.block_layout is None:
    return None
  layout = masks.block_layout.swapaxes(-1, -2) if transpose else masks.block_layout
  visited = jnp.any(layout != patterns.SKIP, axis=(0, 1))
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


def _block_scores(cfg: _Static, masks: _Masks, q_blk, k_blk_t, bias, q_start, k_start, bq, bk):
  """One block's scaled and biased logits `[B, Hkv, G, bq, bk]` float32, before any
  score mod, the pairs that may attend (`[.., bq|1, bk]` bool, or None for all)
  and the block's indices (`_Indices`).

  k_blk_t: the key block transposed, `[B, Hkv, D, bk]`: the product's right
  operand as XLA's CPU matmuls take it (given `[bk, D]`, XLA copies it
  transposed at every step of the loop).
  """
  logits = common.einsum_float32("bhgqd,bhdk->bhgqk", q_blk, k_blk_t) * cfg.scale
  if bias is not None:
    logits += _block_of(bias, q_start, k_start, bq, bk).astype(jnp.float32)
  q_pos = _positions(masks.q_positions, q_start, bq)
  k_pos = _positions(masks.kv_positions, k_start, bk)
  index = _Indices(q_pos, k_pos, logits.shape[0], logits.shape[1:3])
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
    in_pattern = _pattern_block(cfg, masks, index, q_start // bq, k_start // bk)
    allowed = in_pattern if allowed is None else allowed & in_pattern
  return logits, allowed, index


@dataclasses.dataclass(frozen=True)
class _Indices:
  """A block's (batch, head, query, key) indices in the layout `[B, Hkv, G, bq, bk]`."""

  q_pos: Array  # [bq]
  k_pos: Array  # [bk]
  batch: int
  kv_heads_and_group: Tuple[int, int]

  def grid(self) -> Tuple[Array, Array, Array, Array]:
    """Head `[1, Hkv, G, 1, 1]`, query `[1, 1, 1, bq, 1]` and key `[1, 1, 1, 1, bk]` int32
    indices (the batch index depends on the rows evaluated: `_batch_index`)."""
    num_kv_heads, group = self.kv_heads_and_group
    head = (jnp.arange(num_kv_heads)[:, None] * group + jnp.arange(group)[None, :])
    return (head[None, :, :, None, None].astype(jnp.int32),
            self.q_pos[None, None, None, :, None].astype(jnp.int32),
            self.k_pos[None, None, None, None, :].astype(jnp.int32))


def _batch_index(batch: int) -> Array:
  return jnp.arange(batch, dtype=jnp.int32)[:, None, None, None, None]


def _modified_scores(cfg: _Static, masks: _Masks, score_consts, logits: Array,
                     index: _Indices) -> Array:
  """The logits after soft-capping and the score_mod (`cfg`), `score_consts`
  being the score_mod's differentiated arrays."""
  if cfg.softcap is not None:
    logits = cfg.softcap * jnp.tanh(logits / cfg.softcap)
  if cfg.score_mod is not None:
    consts = cfg.score_mod.merge(score_consts, masks.score_mod_consts)
    head, q_idx, k_idx = index.grid()
    logits = mods.apply(cfg.score_mod, consts, logits, _batch_index(logits.shape[0]), head,
                        q_idx, k_idx)
  return logits


def _block_logits(cfg: _Static, masks: _Masks, extras: Optional[common.FlexArrays], q_blk,
                  k_blk_t, bias, q_start, k_start, bq, bk):
  """One block's final logits `[B, Hkv, G, bq, bk]` float32: scaled, biased,
  modified (`_modified_scores`) and masked (-inf)."""
  logits, allowed, index = _block_scores(cfg, masks, q_blk, k_blk_t, bias, q_start, k_start,
                                         bq, bk)
  if cfg.modifies_scores:
    logits = _modified_scores(cfg, masks, () if extras is None else extras.score_consts, logits,
                              index)
  return logits if allowed is None else jnp.where(allowed, logits, -jnp.inf)


def _pattern_block(cfg: _Static, masks: _Masks, index: _Indices, q_block, k_block) -> Array:
  """`[B|1, Hkv|1, G|1, bq, bk]` bool: the pairs of the block that the layout's
  mask allows. A (batch row, head) that skips the block (another visits it)
  sees none of it; a FULL block is allowed whole; a PARTIAL one as the mask
  mod says, which is evaluated only when some entry of the block is PARTIAL."""
  entry = masks.block_layout[:, :, q_block, k_block]  # [B|1, H|1]
  rows, heads = entry.shape
  grouped = index.kv_heads_and_group if heads > 1 else (1, 1)
  entry = entry.reshape((rows,) + grouped + (1, 1))
  if cfg.mask_mod is None:
    return (entry != patterns.SKIP) & (entry == patterns.FULL)
  # Evaluated over the batch rows and heads the mask depends on, not the layout's.
  mask_shape = (index.batch if _mask_uses(cfg.mask_mod, 0) else 1,) + (
      index.kv_heads_and_group if _mask_uses(cfg.mask_mod, 1) else (1, 1)) + (
          index.q_pos.shape[0], index.k_pos.shape[0])
  in_mask = jax.lax.cond(jnp.any(entry == patterns.PARTIAL),
                         lambda: _evaluate_mask_mod(cfg, masks, index, mask_shape),
                         lambda: jnp.zeros(mask_shape, bool))
  return (entry != patterns.SKIP) & ((entry == patterns.FULL) | in_mask)


def _mask_uses(mask_mod, arg: int) -> bool:
  """Whether the mask depends on its batch (`arg` 0) or head (1) index."""
  if isinstance(mask_mod, mods.LiftedMod):
    return mask_mod.uses(arg)
  return arg == 1 and patterns.num_heads_of(mask_mod) > 1


def _evaluate_mask_mod(cfg: _Static, masks: _Masks, index: _Indices, mask_shape) -> Array:
  """The mask mod on the block's indices, `mask_shape` bool (index 0 on the
  batch and head axes of size 1)."""
  head, q_idx, k_idx = index.grid()
  if mask_shape[1:3] == (1, 1):
    head = jnp.zeros((1, 1, 1, 1, 1), jnp.int32)
  batch = _batch_index(mask_shape[0])
  if isinstance(cfg.mask_mod, mods.LiftedMod):
    allowed = mods.apply(cfg.mask_mod, masks.mask_mod_consts, batch, head, q_idx, k_idx)
  else:
    allowed = cfg.mask_mod(batch, head, q_idx, k_idx)
  return jnp.broadcast_to(allowed, mask_shape)


def dropout_keep(rng: Array, q_block, k_block, shape, rate: float) -> Array:
  """The tile's inverted-dropout multipliers, `shape` float32: 0, or 1 / (1 -
  rate) with probability 1 - rate; drawn from `rng` folded with the tile's
  (query block, key block), the same in the forward and backward passes."""
  tile_rng = jax.random.fold_in(jax.random.fold_in(rng, q_block), k_block)
  keep = jax.random.bernoulli(tile_rng, 1.0 - rate, shape)
  return jnp.where(keep, 1.0 / (1.0 - rate), 0.0).astype(jnp.float32)


def _dropped(cfg: _Static, masks: _Masks, weights: Array, q_block, k_block) -> Array:
  """`weights` with the tile's dropout applied (unchanged without dropout)."""
  if cfg.dropout_rate == 0.0:
    return weights
  return weights * dropout_keep(masks.dropout_rng, q_block, k_block, weights.shape,
                                cfg.dropout_rate)


def _block_of(x, q_start, k_start, bq, bk):
  """The `[.., bq|1, bk|1]` block of a bias or mask laid out `[.., Tq|1, Tk|1]`."""
  return common.slice_axis(common.slice_axis(x, 3, q_start, bq), 4, k_start, bk)


def _forward(cfg: _Static, q, k, v, bias, masks: _Masks,
             extras: Optional[common.FlexArrays] = None):
  """Returns out `[B, Hkv, G, Tq, Dv]` (query dtype) and lse `[B, Hkv, G, Tq]` float32
  (zeros with the sigmoid normaliser, which has none)."""
  bq, bk = cfg.block_q, cfg.block_k
  num_kv_blocks = cfg.kv_len // bk
  visit_lists = _visit_lists(masks, transpose=False)
  k_t = k.swapaxes(-1, -2)  # once, not once per block (see _block_scores)
  sinks = None if extras is None else extras.sinks

  def one_query_block(i):
    q_blk = jax.lax.dynamic_slice_in_dim(q, i * bq, bq, axis=3)
    stats_shape = q_blk.shape[:-1]
    acc = jnp.zeros(stats_shape + (v.shape[-1],), jnp.float32)
    if sinks is None:
      init = (jnp.full(stats_shape, -jnp.inf), jnp.zeros(stats_shape), acc)
    else:  # the sink is a key seen first: running max its logit, running sum 1
      sink = jnp.broadcast_to(sinks[None, :, :, None].astype(jnp.float32), stats_shape)
      init = (sink, jnp.ones(stats_shape), acc)

    def visit_key_block(j, carry):
      return _visit_in_reach(cfg, masks, i * bq, j * bk, bq, bk,
                             functools.partial(update, j), carry)

    def update(j, carry):
      row_max, row_sum, acc = carry
      k_blk_t = jax.lax.dynamic_slice_in_dim(k_t, j * bk, bk, axis=3)
      v_blk = jax.lax.dynamic_slice_in_dim(v, j * bk, bk, axis=2)
      logits = _block_logits(cfg, masks, extras, q_blk, k_blk_t, bias, i * bq, j * bk, bq, bk)
      if cfg.normaliser == "sigmoid":  # no normaliser: the weights add up as they are
        weights = _dropped(cfg, masks, jax.nn.sigmoid(logits + cfg.sigmoid_bias), i, j)
        return row_max, row_sum, acc + common.einsum_float32(
            "bhgqk,bhkd->bhgqd", weights.astype(v.dtype), v_blk)
      new_max = jnp.maximum(row_max, logits.max(-1))
      # A row with nothing allowed so far keeps max -inf; exponentiate against 0 then.
      safe_max = jnp.where(jnp.isfinite(new_max), new_max, 0.0)
      probs = jnp.exp(logits - safe_max[..., None])
      correction = jnp.exp(row_max - safe_max)
      row_sum = correction * row_sum + probs.sum(-1)  # the normaliser sees every weight
      acc = correction[..., None] * acc + common.einsum_float32(
          "bhgqk,bhkd->bhgqd", _dropped(cfg, masks, probs, i, j).astype(v.dtype), v_blk)
      return new_max, row_sum, acc

    lo, hi = _block_range(cfg, masks, common.kv_block_range, i, bq, bk, num_kv_blocks)
    row_max, row_sum, acc = _visit_blocks(visit_lists, lo, hi, i, visit_key_block, init)
    if cfg.normaliser == "sigmoid":
      return acc.astype(q.dtype), jnp.zeros(stats_shape)
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


def _backward(cfg: _Static, q, k, v, bias, masks: _Masks, lse, d_out, delta,
              extras: Optional[common.FlexArrays] = None):
  """Gradients of q, k, v and bias (and of `extras`, when given), recomputing
  block probabilities from lse.

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

  A score modification (softcap, score_mod) is differentiated on the block
  by `jax.vjp`: dS of the modified logits becomes dS of the raw ones (what dq,
  dk and the bias take) and the gradients of the arrays the score_mod closes
  over, summed over the blocks.

  lse, delta: `[B, Hkv, G, Tq']` float32 (delta as `common.flash_attention_vjp`
  gives it).
  """
  bq, bk = cfg.block_q_dkv, cfg.block_k_dkv
  visit_lists = _visit_lists(masks, transpose=True)
  # Every product's operands laid out as XLA's CPU matmuls take them, transposed
  # once here rather than copied at every step of the loops.
  k_t, v_t = k.swapaxes(-1, -2), v.swapaxes(-1, -2)
  q_t, d_out_t = q.swapaxes(-1, -2), d_out.swapaxes(-1, -2)
  score_consts = () if extras is None else extras.score_consts

  def dkv_of_key_block(carry, j):
    k_blk = jax.lax.dynamic_slice_in_dim(k, j * bk, bk, axis=2)
    k_blk_t = jax.lax.dynamic_slice_in_dim(k_t, j * bk, bk, axis=3)
    v_blk_t = jax.lax.dynamic_slice_in_dim(v_t, j * bk, bk, axis=3)

    def visit(i, inner):
      return _visit_in_reach(cfg, masks, i * bq, j * bk, bq, bk, functools.partial(update, i),
                             inner)

    def update(i, inner):
      dk, dv, dq, d_bias, d_consts = inner
      q_blk = jax.lax.dynamic_slice_in_dim(q, i * bq, bq, axis=3)
      q_blk_t = jax.lax.dynamic_slice_in_dim(q_t, i * bq, bq, axis=4)
      do_blk = jax.lax.dynamic_slice_in_dim(d_out, i * bq, bq, axis=3)
      do_blk_t = jax.lax.dynamic_slice_in_dim(d_out_t, i * bq, bq, axis=4)
      scores, allowed, index = _block_scores(cfg, masks, q_blk, k_blk_t, bias, i * bq, j * bk,
                                             bq, bk)
      if cfg.modifies_scores:
        scores, modify_vjp = jax.vjp(
            lambda s, c: _modified_scores(cfg, masks, c, s, index), scores, score_consts)
      logits = scores if allowed is None else jnp.where(allowed, scores, -jnp.inf)
      # With dropout, out = (Z p) v: dv takes Z p, and dP of the weights before
      # dropout is Z dP (delta = rowsum(dO out) is unchanged).
      d_probs = _dropped(cfg, masks, common.einsum_float32("bhgqd,bhdk->bhgqk", do_blk, v_blk_t),
                         i, j)
      if cfg.normaliser == "sigmoid":
        probs = jax.nn.sigmoid(logits + cfg.sigmoid_bias)  # the weights
        d_logits = d_probs * probs * (1.0 - probs)
      else:
        probs = jnp.exp(logits - jax.lax.dynamic_slice_in_dim(lse, i * bq, bq,
                                                               axis=3)[..., None])
        d_logits = probs * (d_probs - jax.lax.dynamic_slice_in_dim(delta, i * bq, bq,
                                                                   axis=3)[..., None])
      if cfg.modifies_scores:
        d_logits, d_consts_blk = modify_vjp(d_logits)
        d_consts = jax.tree.map(lambda a, b: a + b.astype(jnp.float32), d_consts, d_consts_blk)
      # dk and dv accumulate transposed, [.., D, bk]: the block's probabilities
      # and dS are then the products' right operands as they are laid out, so
      # XLA neither copies them transposed nor computes dS twice.
      dv += common.einsum_float32("bhgdq,bhgqk->bhdk", do_blk_t,
                                  _dropped(cfg, masks, probs, i, j).astype(d_out.dtype))
      dk += common.einsum_float32("bhgdq,bhgqk->bhdk", q_blk_t, d_logits.astype(q.dtype))
      dq_blk = jax.lax.dynamic_slice_in_dim(dq, i * bq, bq, axis=3) + common.einsum_float32(
          "bhgqk,bhkd->bhgqd", d_logits.astype(k.dtype), k_blk)
      dq = jax.lax.dynamic_update_slice_in_dim(dq, dq_blk, i * bq, axis=3)
      if d_bias is not None:
        d_bias = _add_block(d_bias, common.sum_to_shape(d_logits, bias.shape), i * bq, j * bk)
      return dk, dv, dq, d_bias, d_consts

    dq, d_bias, d_consts = carry
    lo, hi = _block_range(cfg, masks, common.q_block_range, j, bq, bk, cfg.q_len // bq)
    init = (jnp.zeros(k.shape[:2] + (k.shape[-1], bk), jnp.float32),
            jnp.zeros(v.shape[:2] + (v.shape[-1], bk), jnp.float32), dq, d_bias, d_consts)
    dk, dv, dq, d_bias, d_consts = _visit_blocks(visit_lists, lo, hi, j, visit, init)
    return (dq, d_bias, d_consts), (dk.swapaxes(-1, -2) * cfg.scale, dv.swapaxes(-1, -2))

  d_bias = None if bias is None else jnp.zeros(bias.shape, jnp.float32)
  dq = jnp.zeros(q.shape, jnp.float32)
  d_consts = tuple(jnp.zeros(c.shape, jnp.float32) for c in score_consts)
  (dq, d_bias, d_consts), (dk, dv) = jax.lax.scan(dkv_of_key_block, (dq, d_bias, d_consts),
                                                  jnp.arange(cfg.kv_len // bk))
  dq = (dq * cfg.scale).astype(q.dtype)
  dk = jnp.moveaxis(dk, 0, 2).reshape(k.shape).astype(k.dtype)
  dv = jnp.moveaxis(dv, 0, 2).reshape(v.shape).astype(v.dtype)
  grads = (dq, dk, dv, None if bias is None else d_bias.astype(bias.dtype))
  if extras is None:
    return grads
  d_sinks = None
  if extras.sinks is not None:
    # The sink's probability exp(sink - lse) meets dP = 0 (it has no value):
    # dS = p_sink (0 - delta), summed over the rows each head's sink serves.
    p_sink = jnp.exp(extras.sinks[None, :, :, None].astype(jnp.float32) - lse)
    d_sinks = -jnp.sum(p_sink * delta, axis=(0, 3)).astype(extras.sinks.dtype)
  d_consts = tuple(d.astype(c.dtype) for d, c in zip(d_consts, score_consts))
  return grads + (common.FlexArrays(d_sinks, d_consts),)


def _add_block(total, block, q_start, k_start):
  """`total[..., q_start:+bq, k_start:+bk] += block` (broadcast axes stay whole)."""
  starts = [0, 0, 0, 0 if total.shape[3] == 1 else q_start, 0 if total.shape[4] == 1 else k_start]
  current = jax.lax.dynamic_slice(total, starts, block.shape)
  return jax.lax.dynamic_update_slice(total, current + block, starts)


# (q, k, v, bias) are differentiated, _Masks is not.
_attention = common.flash_attention_vjp(_forward, _backward)
# flex_attention's: (q, k, v, bias, FlexArrays) are differentiated.
_flex_attention = common.flash_attention_vjp(
    lambda cfg, q, k, v, bias, extras, masks: _forward(cfg, q, k, v, bias, masks, extras),
    lambda cfg, q, k, v, bias, extras, masks, lse, d_out, delta: _backward(
        cfg, q, k, v, bias, masks, lse, d_out, delta, extras))


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
  block_sizes = fitted_block_sizes(block_sizes, q_len, kv_len)
  bq, bk = block_sizes.block_q, block_sizes.block_k
  bq_dkv, bk_dkv = block_sizes.dkv
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


def fitted_block_sizes(block_sizes: common.BlockSizes, q_len: int,
                       kv_len: int) -> common.BlockSizes:
  """The blocks the loops use: each clipped to its (rounded-up) sequence, so
  that short inputs are not over-padded."""
  fit = lambda block, length: min(block, _round_up(length, 8))
  bq_dkv, bk_dkv = block_sizes.dkv
  return common.BlockSizes(fit(block_sizes.block_q, q_len), fit(block_sizes.block_k, kv_len),
                           fit(bq_dkv, q_len), fit(bk_dkv, kv_len))


def from_blocked_layout(out: Array, lse: Array, inputs: AttentionInputs) -> Tuple[Array, Array]:
  """`[B, Hkv, G, Tq', Dv]`, `[B, Hkv, G, Tq']` -> `[B, Tq, H, Dv]`, `[B, Tq, H]`."""
  batch, q_len, num_heads, _ = inputs.query.shape
  out = out[:, :, :, :q_len].transpose(0, 3, 1, 2, 4)
  lse = lse[:, :, :, :q_len].transpose(0, 3, 1, 2)
  return (out.reshape(batch, q_len, num_heads, inputs.value.shape[-1]),
          lse.reshape(batch, q_len, num_heads))


# For ring attention's loops (ring.py) and block-sparse attention (block_sparse.py).
forward, backward, attend = _forward, _backward, _attention
flex_attend = _flex_attention  # flex.py


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
