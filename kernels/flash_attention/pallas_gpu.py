"""Flash attention as Pallas kernels for NVIDIA GPUs (Triton lowering).

The same online-softmax algorithm as `blockwise.py`, written as three Pallas
kernels: the forward pass (grid over query blocks, loop over key blocks), the
dq pass (same tiling, also writes the bias gradient) and the dk/dv pass (grid
over key blocks, loop over query blocks). The backward pass recomputes each
block's probabilities from the log-sum-exp the forward pass saved.

Layout: the kernels read the caller's `[B, T, H, D]` arrays directly. Every
BlockSpec squeezes the batch and head axes (`None`), and its index map picks
query head `h` and K/V head `h // G` (grouped heads, G = H // Hkv), so there is
no transpose and grouped K/V heads are never repeated in memory. The per-row
statistics (lse, delta) are `[B, H, Tq]` so that a query block's slice is
contiguous.

What Triton needs, and how the wrapper provides it:
  * every loaded or stored block has a power-of-two size: head dims are zero
    padded up to a power of two (at least 16; zero columns change no logit and
    give zero output columns), sequences are padded to whole blocks, and the
    block sizes themselves must be powers of two of at least 16;
  * keys past the true Tk are masked by position; padded queries are sliced off;
  * the boolean mask is passed as int8, lengths and segment ids as int32.

Masks: causal and window masks are evaluated from positions and also bound the
key (query) loop through `common.kv_block_range` (`q_block_range`), so blocks
outside their reach are never visited; `key_value_seq_lengths` masks keys by
position and shortens the loop; segment ids mask by equality and a block pair
whose query-id and key-id ranges are disjoint is skipped with `lax.cond`; a
boolean mask and a bias are read block by block. `query_seq_lengths` needs no
kernel support: padded query rows are zeroed after the kernel, which also zeroes
every gradient they would contribute. A query that may attend to nothing gets
output 0, lse `common.EMPTY_ROW_LSE` (finite), and zero gradients.

Block-sparse and flex attention (block_sparse.py, flex.py): a layout `[B|1,
H|1, nq, nk]` of SKIP / PARTIAL / FULL blocks, each program (query block or
key block, batch row, head) visiting the blocks its own row does not skip; in
those the mask mod (a static pattern, or a lifted mod over arrays passed
whole) decides, except where the block is FULL (the mod is computed there
too: no branch). flex_attention's score changes run on each tile after the
scale and bias: `softcap`, then the lifted score_mod, whose arrays are kernel
inputs read whole; the backward passes differentiate them on the tile with
`jax.vjp`, and the dq pass writes each program's part of the floating
arrays' gradients to its own slot of a `[B, H, nq, ...]` output, summed
outside (no atomics). Sinks (`[H]`, one logit per head) start the forward's
running max at the sink and its running sum at 1; their gradient,
`-sum(exp(sink - lse) * delta)` over rows, needs no kernel. The mods have run
in the Pallas interpreter only: a mod that indexes its arrays (ALiBi's
`slopes[h]`) is a gather, its VJP a scatter, which the Triton lowering may
refuse, and Triton loads only power-of-two shapes, which a mod's array (an
`[H, 9]` bias table) need not have. No sigmoid normaliser (flex.py refuses it).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Optional, Tuple, Union

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from attention_jax.core import masks as mask_lib
from attention_jax.core import mods, patterns
from attention_jax.core.inputs import (AttentionInputs, attention_of_empty_sequence,
                                       prepare_inputs, returned_outputs)

from . import common, tile_mods

Array = jnp.ndarray

SUPPORTED_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
MAX_HEAD_DIM = 256
MIN_BLOCK = 16  # Triton's tensor-core dots need every dimension >= 16.


@dataclasses.dataclass(frozen=True)
class _Config:
  """Everything about a call that is fixed at trace time."""

  block_q: int
  block_k: int
  block_q_dkv: int
  block_k_dkv: int
  q_len: int  # padded Tq (a multiple of every query block)
  kv_len: int  # padded Tk (a multiple of every key block)
  true_kv_len: int
  group: int  # query heads per K/V head
  scale: float
  reach: common.Reach
  interpret: bool
  num_warps: Optional[int]
  num_stages: Optional[int]
  # Block-sparse attention (block_sparse.py, flex_attention): the mask mod
  # evaluated inside the PARTIAL blocks of `_MaskArrays.layout` (a static
  # pattern, or a `mods.LiftedMod` over `_MaskArrays.mask_consts`); None
  # without one.
  pattern: Union[None, patterns.Pattern, mods.LiftedMod] = None
  # flex_attention: the logits go through `softcap * tanh(logits / softcap)`,
  # then the lifted score_mod (its floating arrays in `common.FlexArrays`, the others
  # in `_MaskArrays.score_consts`), before the mask; `has_sinks`: a sink logit
  # per head in the normaliser (`common.FlexArrays.sinks`).
  softcap: Optional[float] = None
  score_mod: Optional[mods.LiftedMod] = None
  has_sinks: bool = False

  @property
  def modifies_scores(self) -> bool:
    return self.softcap is not None or self.score_mod is not None

  @property
  def dkv_blocks(self) -> Tuple[int, int]:
    return self.block_q_dkv, self.block_k_dkv


@dataclasses.dataclass
class _MaskArrays:
  """The non-differentiable arrays that decide which pairs may attend (padded)."""

  mask: Optional[Array]  # [B|1, H|1, Tq', Tk'] int8, nonzero may attend
  q_segment_ids: Optional[Array]  # [B, Tq'] int32
  kv_segment_ids: Optional[Array]  # [B, Tk'] int32
  kv_lengths: Optional[Array]  # [B] int32
  # Block-sparse attention, per batch row and head (each program follows its
  # own (b, h) blocks): the layout `[B|1, H|1, n, m']` int32 (SKIP, PARTIAL,
  # FULL), the blocks to visit in order `[B|1, H|1, n, m']` int32 and how many
  # `[B|1, H|1, n]` int32, rows by query block (the forward and dq passes) or,
  # transposed, by key block (the dk/dv pass); m' is m padded to a power of
  # two (Triton loads).
  layout: Optional[Array] = None
  visits: Optional[Array] = None
  visit_counts: Optional[Array] = None
  # The same by key block, for the dk/dv pass (`_by_key` swaps them in).
  layout_by_key: Optional[Array] = None
  visits_by_key: Optional[Array] = None
  visit_counts_by_key: Optional[Array] = None
  # flex_attention: the arrays a lifted mask mod closes over and the score
  # mod's arrays that are not differentiated, flattened (`tile_mods.kernel_array`).
  mask_consts: Tuple[Array, ...] = ()
  score_consts: Tuple[Array, ...] = ()


jax.tree_util.register_dataclass(
    _MaskArrays, data_fields=["mask", "q_segment_ids", "kv_segment_ids", "kv_lengths",
                              "layout", "visits", "visit_counts", "layout_by_key",
                              "visits_by_key", "visit_counts_by_key", "mask_consts",
                              "score_consts"],
    meta_fields=[])


def _read(refs) -> Tuple[Array, ...]:
  return tuple(ref[...] for ref in refs)


def _for_pass(m: _MaskArrays, along_q: bool) -> _MaskArrays:
  """The mask arrays one pallas_call takes: the block-sparse lists by query
  block (`along_q`: forward, dq) or by key block (dk/dv), in the first fields."""
  if along_q:
    return dataclasses.replace(m, layout_by_key=None, visits_by_key=None,
                               visit_counts_by_key=None)
  return dataclasses.replace(m, layout=m.layout_by_key, visits=m.visits_by_key,
                             visit_counts=m.visit_counts_by_key, layout_by_key=None,
                             visits_by_key=None, visit_counts_by_key=None)


def _visit_lists(layout: Array) -> Tuple[Array, Array, Array]:
  """`[B|1, H|1, n, m]` layout -> (layout, visits, counts) of `_MaskArrays`, per
  batch row and head, the rows padded to a power of two with SKIP."""
  width = _next_power_of_two(layout.shape[-1])
  layout = _pad_to(layout.astype(jnp.int32), 3, width)
  visited = layout != patterns.SKIP
  visits = jnp.argsort(~visited, axis=-1, stable=True).astype(jnp.int32)
  return layout, visits, visited.sum(-1).astype(jnp.int32)


def _loop(lo, hi, m: _MaskArrays, body, init):
  """`body(block, carry)` over the blocks [lo, hi) of the reach, or over this
  program's visit list (block-sparse)."""
  if m.visits is None:
    return lax.fori_loop(lo, hi, body, init)
  return lax.fori_loop(0, m.visit_counts[()], lambda n, c: body(m.visits[n], c), init)


def _mask_of(cfg: _Config, m: _MaskArrays, batch, head):
  """Block-sparse: `block -> (q_pos, k_pos) -> allowed` for a block of this
  program's layout row (all of a FULL block, the mask mod's pairs in a PARTIAL
  one), or None without a layout. `batch`, `head`: the program's batch row
  and query head (read at the kernel's top level, where the interpreter gives
  program ids)."""
  if m.layout is None:
    return None
  if isinstance(cfg.pattern, mods.LiftedMod):
    arrays = tile_mods.indexed(cfg.pattern, m.mask_consts, [False] * len(m.mask_consts))
    mask = lambda q_pos, k_pos: tile_mods.apply_on_tile(cfg.pattern, arrays, batch, head,
                                                        q_pos, k_pos)
  elif cfg.pattern is not None:
    mask = lambda q_pos, k_pos: cfg.pattern(0, head, q_pos, k_pos)
  else:  # a layout alone: its FULL blocks
    mask = lambda q_pos, k_pos: jnp.zeros(jnp.broadcast_shapes(q_pos.shape, k_pos.shape), bool)

  def of_block(block):
    full = m.layout[block] == patterns.FULL
    return lambda q_pos, k_pos: full | mask(q_pos, k_pos)

  return of_block


def _score_modifier(cfg: _Config, m: _MaskArrays, x: common.FlexArrays, batch, head,
                    by_value: bool = False):
  """flex_attention: `(scores, float_values, q_pos, k_pos) -> logits` (soft cap,
  then the score_mod), or None when nothing modifies the scores.

  The score_mod reads its arrays by index (`tile_mods`): from their refs, or
  with `by_value` its floating arrays from `float_values` (their whole padded
  values, which the dq kernel differentiates; `()` otherwise).
  """
  if not cfg.modifies_scores:
    return None

  def modify(scores, float_values, q_pos, k_pos):
    if cfg.softcap is not None:
      scores = cfg.softcap * jnp.tanh(scores / cfg.softcap)
    if cfg.score_mod is not None:
      floating = float_values if by_value else x.score_consts
      flats = cfg.score_mod.merge(floating, m.score_consts)
      by_values = cfg.score_mod.merge([by_value] * len(floating),
                                      [False] * len(m.score_consts))
      arrays = tile_mods.indexed(cfg.score_mod, flats, by_values)
      scores = tile_mods.apply_on_tile(cfg.score_mod, arrays, scores, batch, head, q_pos, k_pos)
    return scores

  return modify


# ---------------------------------------------------------------------------
# Block-level helpers shared by the three kernels.
# ---------------------------------------------------------------------------


def _masked_logits(cfg: _Config, q, k, q_start, k_start, bias_blk, mask_blk, q_ids, kv_ids,
                   kv_limit, in_pattern=None, modify=None, float_consts=(),
                   differentiate: bool = False):
  """Scaled, biased, modified and masked logits of one block: `[bq, bk]` float32.

  Args:
    q: `[bq, D]`; k: `[bk, D]`; q_start, k_start: absolute first positions.
    bias_blk: `[bq, bk]` or None; mask_blk: `[bq, bk]` int8 or None.
    q_ids: `[bq]`, kv_ids: `[bk]` segment ids or None.
    kv_limit: keys at or past it are padding (true Tk, or the batch's length).
    in_pattern: `(q_pos, k_pos) -> allowed` of a block-sparse pattern, or None.
    modify: `_score_modifier`'s function (soft cap and score_mod), applied to
      the scaled and biased logits with `float_consts`, or None.
    differentiate: also return the modification's VJP, `d_logits ->
      (d_scores, d_float_consts)` (None without a modification).
  """
  logits = plgpu.dot(q, k, trans_b=True) * cfg.scale
  if bias_blk is not None:
    logits += bias_blk.astype(jnp.float32)
  q_pos = q_start + jnp.arange(q.shape[0])[:, None]
  k_pos = k_start + jnp.arange(k.shape[0])[None, :]
  allowed = mask_lib.and_masks(
      mask_lib.length_predicate(k_pos, kv_limit),
      mask_lib.reach_predicate(q_pos, k_pos, cfg.reach),
      None if q_ids is None else mask_lib.segment_predicate(q_ids[:, None], kv_ids[None, :]),
      None if mask_blk is None else mask_blk != 0,
      None if in_pattern is None else in_pattern(q_pos, k_pos))
  modify_vjp = None
  if modify is not None:
    q_idx, k_idx = q_pos.astype(jnp.int32), k_pos.astype(jnp.int32)
    if differentiate:
      logits, modify_vjp = jax.vjp(lambda s, c: modify(s, c, q_idx, k_idx), logits,
                                   tuple(float_consts))
    else:
      logits = modify(logits, tuple(float_consts), q_idx, k_idx)
  if allowed is not None:
    logits = jnp.where(allowed, logits, -jnp.inf)
  return (logits, modify_vjp) if differentiate else logits


def _kv_limit(cfg: _Config, kv_lengths_ref):
  """Keys at or past this position are masked: the true Tk or the batch's length."""
  if kv_lengths_ref is None:
    return cfg.true_kv_len
  return jnp.minimum(cfg.true_kv_len, kv_lengths_ref[()])


def _kv_blocks(cfg: _Config, q_block, block_q: int, block_k: int, kv_limit):
  """[lo, hi) of the key blocks query block `q_block` must visit."""
  lo, hi = common.kv_block_range(q_block, block_q, block_k, cfg.kv_len // block_k, cfg.reach)
  # Blocks that start at or past the last valid key hold nothing to attend.
  hi = jnp.minimum(hi, (kv_limit + block_k - 1) // block_k)
  return lo, jnp.maximum(hi, lo)


def _q_blocks(cfg: _Config, kv_block, block_q: int, block_k: int, kv_limit):
  """[lo, hi) of the query blocks that see key block `kv_block`."""
  lo, hi = common.q_block_range(kv_block, block_q, block_k, cfg.q_len // block_q, cfg.reach)
  # Explicit int32: Triton rejects a select between an i32 and a constant that
  # the lowering typed otherwise (seen on an H100, jax 0.11.2).
  lo, hi = (jnp.asarray(bound, jnp.int32) for bound in (lo, hi))
  return lo, jnp.where(kv_block * block_k < kv_limit, hi, lo)


def _segments_overlap(ids_a, ids_b):
  """Whether two blocks of segment ids can share a segment (their ranges intersect)."""
  return (jnp.min(ids_a) <= jnp.max(ids_b)) & (jnp.min(ids_b) <= jnp.max(ids_a))


def _loop_skipping_disjoint(visit: Callable, skip: Callable, overlap: Optional[Callable]):
  """A loop body that runs `visit(j, carry)` unless `overlap(j)` is False, then `skip`."""
  if overlap is None:
    return visit
  return lambda j, carry: lax.cond(overlap(j), visit, skip, j, carry)


def _pairwise_block(ref, rows, cols):
  """A `[rows, cols]` block of a bias or mask ref (None stays None)."""
  return None if ref is None else ref[rows, cols]


# ---------------------------------------------------------------------------
# Kernels.
# ---------------------------------------------------------------------------


def _forward_kernel(q_ref, k_ref, v_ref, bias_ref, m: _MaskArrays, x: common.FlexArrays, out_ref,
                    lse_ref, *, cfg: _Config):
  """One query block of one head: out `[bq, Dv]`, lse `[bq]`.

  Refs: q `[bq, D]`, k `[Tk', D]`, v `[Tk', Dv]`, bias and mask `[bq, Tk']`,
  q segment ids `[bq]`, kv segment ids `[Tk']`, kv length `[]`; flex: the
  head's sink `[]` and the mods' arrays whole.
  """
  bq, bk = cfg.block_q, cfg.block_k
  i, batch, head = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  q = q_ref[...]
  q_ids = None if m.q_segment_ids is None else m.q_segment_ids[...]
  kv_ids_of = lambda j: m.kv_segment_ids[pl.ds(j * bk, bk)]
  kv_limit = _kv_limit(cfg, m.kv_lengths)
  rows = slice(None)
  in_pattern = _mask_of(cfg, m, batch, head)
  modify = _score_modifier(cfg, m, x, batch, head)

  def visit(j, carry):
    row_max, row_sum, acc = carry
    keys = pl.ds(j * bk, bk)
    logits = _masked_logits(cfg, q, k_ref[keys, :], i * bq, j * bk,
                            _pairwise_block(bias_ref, rows, keys),
                            _pairwise_block(m.mask, rows, keys), q_ids,
                            None if q_ids is None else kv_ids_of(j), kv_limit,
                            None if in_pattern is None else in_pattern(j), modify)
    new_max = jnp.maximum(row_max, jnp.max(logits, axis=1))
    # A row with nothing allowed so far keeps max -inf; exponentiate against 0 then.
    safe_max = jnp.where(new_max == -jnp.inf, 0.0, new_max)
    probs = jnp.exp(logits - safe_max[:, None])
    correction = jnp.exp(row_max - safe_max)
    row_sum = correction * row_sum + jnp.sum(probs, axis=1)
    v = v_ref[keys, :]
    acc = correction[:, None] * acc + plgpu.dot(probs.astype(v.dtype), v)
    return new_max, row_sum, acc

  overlap = None if q_ids is None else lambda j: _segments_overlap(q_ids, kv_ids_of(j))
  body = _loop_skipping_disjoint(visit, lambda j, carry: carry, overlap)
  acc = jnp.zeros((bq, v_ref.shape[-1]), jnp.float32)
  if cfg.has_sinks:  # the sink is a key seen first: running max its logit, running sum 1
    init = (jnp.full((bq,), x.sinks[()], jnp.float32), jnp.ones((bq,), jnp.float32), acc)
  else:
    init = (jnp.full((bq,), -jnp.inf, jnp.float32), jnp.zeros((bq,), jnp.float32), acc)
  lo, hi = _kv_blocks(cfg, i, bq, bk, kv_limit)
  row_max, row_sum, acc = _loop(lo, hi, m, body, init)

  empty = row_sum == 0.0  # nothing to attend: output 0, lse finite (see EMPTY_ROW_LSE)
  safe_sum = jnp.where(empty, 1.0, row_sum)
  out_ref[...] = (acc / safe_sum[:, None]).astype(out_ref.dtype)
  lse_ref[...] = jnp.where(empty, common.EMPTY_ROW_LSE, row_max + jnp.log(safe_sum))


def _dq_kernel(q_ref, k_ref, v_ref, bias_ref, m: _MaskArrays, x: common.FlexArrays, do_ref, lse_ref,
               delta_ref, dq_ref, dbias_ref, dconst_refs, *, cfg: _Config):
  """dq `[bq, D]` of one query block of one head, its row of bias gradients, and
  this program's part of the gradients of the score_mod's floating arrays.

  Refs as in `_forward_kernel`, plus d_out `[bq, Dv]`, lse and delta `[bq]`;
  dbias `[bq, Tk']` float32 or None; dconst_refs: per floating array of the
  score_mod, float32 of its (kernel) shape, summed over programs outside.
  """
  bq, bk = cfg.block_q, cfg.block_k
  i, batch, head = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  q, d_out = q_ref[...], do_ref[...]
  lse, delta = lse_ref[...], delta_ref[...]
  q_ids = None if m.q_segment_ids is None else m.q_segment_ids[...]
  kv_ids_of = lambda j: m.kv_segment_ids[pl.ds(j * bk, bk)]
  kv_limit = _kv_limit(cfg, m.kv_lengths)
  rows = slice(None)
  in_pattern = _mask_of(cfg, m, batch, head)
  # The floating arrays whole: differentiated per tile by jax.vjp.
  modify = _score_modifier(cfg, m, x, batch, head, by_value=True)
  float_consts = _read(x.score_consts)

  def visit(j, carry):
    dq, d_consts = carry
    keys = pl.ds(j * bk, bk)
    k = k_ref[keys, :]
    logits, modify_vjp = _masked_logits(
        cfg, q, k, i * bq, j * bk, _pairwise_block(bias_ref, rows, keys),
        _pairwise_block(m.mask, rows, keys), q_ids, None if q_ids is None else kv_ids_of(j),
        kv_limit, None if in_pattern is None else in_pattern(j), modify, float_consts,
        differentiate=True)
    probs = jnp.exp(logits - lse[:, None])
    d_probs = plgpu.dot(d_out, v_ref[keys, :], trans_b=True)
    d_logits = probs * (d_probs - delta[:, None])
    if modify_vjp is not None:  # dS of the modified logits -> of the raw ones
      d_logits, d_consts_blk = modify_vjp(d_logits)
      d_consts = tuple(a + b.astype(jnp.float32) for a, b in zip(d_consts, d_consts_blk))
    if dbias_ref is not None:
      dbias_ref[:, keys] = d_logits
    return dq + plgpu.dot(d_logits.astype(k.dtype), k), d_consts

  def clear_bias_grad(j, carry):
    """Bias gradients of a block that is not visited are zero (written once)."""
    if dbias_ref is not None:
      dbias_ref[:, pl.ds(j * bk, bk)] = jnp.zeros((bq, bk), jnp.float32)
    return carry

  if dbias_ref is not None and m.visits is not None:
    # Block-sparse: the visited blocks are not a range; clear the row first,
    # block by block (a padded row need not be a power of two, as Triton's
    # arrays must).
    lax.fori_loop(0, cfg.kv_len // bk, clear_bias_grad, 0)
  overlap = None if q_ids is None else lambda j: _segments_overlap(q_ids, kv_ids_of(j))
  body = _loop_skipping_disjoint(visit, clear_bias_grad, overlap)
  lo, hi = _kv_blocks(cfg, i, bq, bk, kv_limit)
  init = (jnp.zeros((bq, q_ref.shape[-1]), jnp.float32),
          tuple(jnp.zeros(c.shape, jnp.float32) for c in float_consts))
  dq, d_consts = _loop(lo, hi, m, body, init)
  dq_ref[...] = (dq * cfg.scale).astype(dq_ref.dtype)
  for ref, d in zip(dconst_refs, d_consts):
    ref[...] = d
  if dbias_ref is not None and m.visits is None:
    lax.fori_loop(0, lo, clear_bias_grad, 0)
    lax.fori_loop(hi, cfg.kv_len // bk, clear_bias_grad, 0)


def _dkv_kernel(q_ref, k_ref, v_ref, bias_ref, m: _MaskArrays, x: common.FlexArrays, do_ref,
                lse_ref, delta_ref, dk_ref, dv_ref, *, cfg: _Config):
  """dk `[bk, D]` and dv `[bk, Dv]` of one key block, as seen by one query head.

  Refs: q `[Tq', D]`, k `[bk, D]`, v `[bk, Dv]`, bias and mask `[Tq', bk]`,
  q segment ids `[Tq']`, kv segment ids `[bk]`, d_out `[Tq', Dv]`, lse and
  delta `[Tq']`.
  """
  bq, bk = cfg.block_q_dkv, cfg.block_k_dkv
  j, batch, head = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  k, v = k_ref[...], v_ref[...]
  kv_ids = None if m.kv_segment_ids is None else m.kv_segment_ids[...]
  q_ids_of = lambda i: m.q_segment_ids[pl.ds(i * bq, bq)]
  kv_limit = _kv_limit(cfg, m.kv_lengths)
  cols = slice(None)
  in_pattern = _mask_of(cfg, m, batch, head)
  modify = _score_modifier(cfg, m, x, batch, head)

  def visit(i, carry):
    dk, dv = carry
    queries = pl.ds(i * bq, bq)
    q, d_out = q_ref[queries, :], do_ref[queries, :]
    logits, modify_vjp = _masked_logits(
        cfg, q, k, i * bq, j * bk, _pairwise_block(bias_ref, queries, cols),
        _pairwise_block(m.mask, queries, cols), None if kv_ids is None else q_ids_of(i), kv_ids,
        kv_limit, None if in_pattern is None else in_pattern(i), modify, differentiate=True)
    probs = jnp.exp(logits - lse_ref[queries][:, None])
    dv += plgpu.dot(probs.astype(d_out.dtype), d_out, trans_a=True)
    d_probs = plgpu.dot(d_out, v, trans_b=True)
    d_logits = probs * (d_probs - delta_ref[queries][:, None])
    if modify_vjp is not None:  # the arrays' gradients are the dq pass's
      d_logits, _ = modify_vjp(d_logits)
    dk += plgpu.dot(d_logits.astype(q.dtype), q, trans_a=True)
    return dk, dv

  overlap = None if kv_ids is None else lambda i: _segments_overlap(q_ids_of(i), kv_ids)
  body = _loop_skipping_disjoint(visit, lambda i, carry: carry, overlap)
  init = (jnp.zeros((bk, k_ref.shape[-1]), jnp.float32),
          jnp.zeros((bk, v_ref.shape[-1]), jnp.float32))
  lo, hi = _q_blocks(cfg, j, bq, bk, kv_limit)
  dk, dv = _loop(lo, hi, m, body, init)
  dk_ref[...] = (dk * cfg.scale).astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


# ---------------------------------------------------------------------------
# BlockSpecs. Grids are (sequence block, batch, query head).
# ---------------------------------------------------------------------------


def _head_spec(block_len: int, dim: int, kv_head: bool, group: int, blocked: bool):
  """`[B, T, H, D]` -> one head's `[block_len, D]`, blocked along T or whole."""
  head_of = (lambda h: h // group) if kv_head else (lambda h: h)
  if blocked:
    return pl.BlockSpec((None, block_len, None, dim), lambda t, b, h: (b, t, head_of(h), 0))
  return pl.BlockSpec((None, block_len, None, dim), lambda t, b, h: (b, 0, head_of(h), 0))


def _pairwise_spec(x: Optional[Array], q_block: int, k_block: int, along_q: bool):
  """`[B|1, H|1, Tq', Tk']` -> `[q_block, k_block]`, blocked along the query or key axis."""
  if x is None:
    return None
  batch_of = (lambda b: b) if x.shape[0] > 1 else (lambda b: 0)
  head_of = (lambda h: h) if x.shape[1] > 1 else (lambda h: 0)
  if along_q:
    index_map = lambda t, b, h: (batch_of(b), head_of(h), t, 0)
  else:
    index_map = lambda t, b, h: (batch_of(b), head_of(h), 0, t)
  return pl.BlockSpec((None, None, q_block, k_block), index_map)


def _ids_spec(ids: Optional[Array], block_len: int, blocked: bool):
  if ids is None:
    return None
  return pl.BlockSpec((None, block_len), lambda t, b, h: (b, t if blocked else 0))


def _mask_specs(cfg: _Config, m: _MaskArrays, bq: int, bk: int, along_q: bool) -> _MaskArrays:
  """BlockSpecs of the mask arrays for a grid over query (`along_q`) or key blocks."""
  q_block, k_block = (bq, cfg.kv_len) if along_q else (cfg.q_len, bk)
  return _MaskArrays(
      mask=_pairwise_spec(m.mask, q_block, k_block, along_q),
      q_segment_ids=_ids_spec(m.q_segment_ids, q_block, along_q),
      kv_segment_ids=_ids_spec(m.kv_segment_ids, k_block, not along_q),
      kv_lengths=None if m.kv_lengths is None else pl.BlockSpec((None,), lambda t, b, h: (b,)),
      layout=_row_spec(m.layout), visits=_row_spec(m.visits),
      visit_counts=_row_spec(m.visit_counts),
      mask_consts=tuple(_whole_spec(c) for c in m.mask_consts),
      score_consts=tuple(_whole_spec(c) for c in m.score_consts))


def _flex_specs(x: common.FlexArrays) -> common.FlexArrays:
  """The program's head's sink `[]`; the score_mod's arrays whole."""
  return common.FlexArrays(
      sinks=None if x.sinks is None else pl.BlockSpec((None,), lambda t, b, h: (h,)),
      score_consts=tuple(_whole_spec(c) for c in x.score_consts))


def _whole_spec(x: Array):
  """The whole array, for every program."""
  return pl.BlockSpec(x.shape, lambda t, b, h: (0,) * x.ndim)


def _row_spec(x: Optional[Array]):
  """`[B|1, H|1, n, m']` -> this program's row `[m']`; `[B|1, H|1, n]` -> its
  entry `[]`."""
  if x is None:
    return None
  batch_of = (lambda b: b) if x.shape[0] > 1 else (lambda b: 0)
  head_of = (lambda h: h) if x.shape[1] > 1 else (lambda h: 0)
  if x.ndim == 3:
    return pl.BlockSpec((None, None, None), lambda t, b, h: (batch_of(b), head_of(h), t))
  return pl.BlockSpec((None, None, None, x.shape[3]),
                      lambda t, b, h: (batch_of(b), head_of(h), t, 0))


def _row_stats_spec(block_len: int, blocked: bool):
  """`[B, H, Tq']` -> `[block_len]` (lse, delta)."""
  return pl.BlockSpec((None, None, block_len), lambda t, b, h: (b, h, t if blocked else 0))


def _compiler_params(cfg: _Config, head_dim: int):
  # Tuned on an H100 (benchmarks/block_sizes_gpu.json): 4 warps up to head dim
  # 128; a third pipeline stage pays at 64 only.
  num_warps = cfg.num_warps if cfg.num_warps is not None else (4 if head_dim <= 128 else 8)
  num_stages = cfg.num_stages if cfg.num_stages is not None else (3 if head_dim <= 64 else 2)
  return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


# ---------------------------------------------------------------------------
# The three pallas_calls and their custom VJP.
# ---------------------------------------------------------------------------


def _forward(cfg: _Config, q, k, v, bias, x: common.FlexArrays, m: _MaskArrays):
  """out `[B, Tq', H, Dv']` (query dtype) and lse `[B, Tq', H]` float32."""
  batch, _, num_heads, head_dim = q.shape
  value_dim = v.shape[-1]
  bq = cfg.block_q
  in_specs = [
      _head_spec(bq, head_dim, False, cfg.group, blocked=True),
      _head_spec(cfg.kv_len, head_dim, True, cfg.group, blocked=False),
      _head_spec(cfg.kv_len, value_dim, True, cfg.group, blocked=False),
      _pairwise_spec(bias, bq, cfg.kv_len, along_q=True),
      _mask_specs(cfg, _for_pass(m, along_q=True), bq, cfg.block_k, along_q=True),
      _flex_specs(x),
  ]
  out_shape = [jax.ShapeDtypeStruct(q.shape[:3] + (value_dim,), q.dtype),
               jax.ShapeDtypeStruct((batch, num_heads, cfg.q_len), jnp.float32)]
  out_specs = [_head_spec(bq, value_dim, False, cfg.group, blocked=True),
               _row_stats_spec(bq, blocked=True)]
  out, lse = pl.pallas_call(
      functools.partial(_forward_kernel, cfg=cfg),
      grid=(cfg.q_len // bq, batch, num_heads),
      in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
      compiler_params=_compiler_params(cfg, max(head_dim, value_dim)),
      interpret=cfg.interpret, name="flash_attention_forward",
  )(q, k, v, bias, _for_pass(m, along_q=True), x)
  # The kernels keep a query block's statistics contiguous ([B, H, Tq']); the
  # custom VJP wants them row by row, like out.
  return out, lse.transpose(0, 2, 1)


def _backward(cfg: _Config, q, k, v, bias, x: common.FlexArrays, m: _MaskArrays, lse, d_out, delta):
  """Gradients of q, k, v, bias (shapes and dtypes of the padded inputs) and of
  `x` (the sinks and the score_mod's floating arrays).

  lse, delta: `[B, Tq', H]` float32 (delta as `common.flash_attention_vjp` gives it).
  """
  batch, _, num_heads, head_dim = q.shape
  value_dim = v.shape[-1]
  if cfg.score_mod is not None:
    tile_mods.check_differentiable(cfg.score_mod)
  lse, delta = lse.transpose(0, 2, 1), delta.transpose(0, 2, 1)  # [B, H, Tq']
  params = _compiler_params(cfg, max(head_dim, value_dim))

  # dq (and the bias gradient): grid over query blocks.
  bq, bk = cfg.block_q, cfg.block_k
  in_specs = [
      _head_spec(bq, head_dim, False, cfg.group, blocked=True),
      _head_spec(cfg.kv_len, head_dim, True, cfg.group, blocked=False),
      _head_spec(cfg.kv_len, value_dim, True, cfg.group, blocked=False),
      _pairwise_spec(bias, bq, cfg.kv_len, along_q=True),
      _mask_specs(cfg, _for_pass(m, along_q=True), bq, bk, along_q=True),
      _flex_specs(x),
      _head_spec(bq, value_dim, False, cfg.group, blocked=True),
      _row_stats_spec(bq, blocked=True),
      _row_stats_spec(bq, blocked=True),
  ]
  num_q_blocks = cfg.q_len // bq
  # The score_mod's floating arrays: one partial gradient per program, summed below.
  d_const_shapes = tuple(jax.ShapeDtypeStruct((batch, num_heads, num_q_blocks) + c.shape,
                                              jnp.float32) for c in x.score_consts)
  d_const_specs = tuple(
      pl.BlockSpec((None, None, None) + c.shape,
                   functools.partial(lambda ndim, t, b, h: (b, h, t) + (0,) * ndim, c.ndim))
      for c in x.score_consts)
  out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype), None, d_const_shapes]
  out_specs = [_head_spec(bq, head_dim, False, cfg.group, blocked=True), None, d_const_specs]
  if bias is not None:
    # One [Tq', Tk'] gradient per (batch, head), summed over broadcast axes below.
    out_shape[1] = jax.ShapeDtypeStruct((batch, num_heads, cfg.q_len, cfg.kv_len), jnp.float32)
    out_specs[1] = pl.BlockSpec((None, None, bq, cfg.kv_len), lambda t, b, h: (b, h, t, 0))
  dq, d_bias, d_consts = pl.pallas_call(
      functools.partial(_dq_kernel, cfg=cfg),
      grid=(num_q_blocks, batch, num_heads),
      in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
      compiler_params=params, interpret=cfg.interpret, name="flash_attention_dq",
  )(q, k, v, bias, _for_pass(m, along_q=True), x, d_out, lse, delta)

  # dk and dv per query head: grid over key blocks; grouped heads are summed after.
  bq, bk = cfg.block_q_dkv, cfg.block_k_dkv
  in_specs = [
      _head_spec(cfg.q_len, head_dim, False, cfg.group, blocked=False),
      _head_spec(bk, head_dim, True, cfg.group, blocked=True),
      _head_spec(bk, value_dim, True, cfg.group, blocked=True),
      _pairwise_spec(bias, cfg.q_len, bk, along_q=False),
      _mask_specs(cfg, _for_pass(m, along_q=False), bq, bk, along_q=False),
      _flex_specs(x),
      _head_spec(cfg.q_len, value_dim, False, cfg.group, blocked=False),
      _row_stats_spec(cfg.q_len, blocked=False),
      _row_stats_spec(cfg.q_len, blocked=False),
  ]
  # Per-head partial sums stay float32 when several query heads share a K/V head.
  grad_dtype = lambda x: x.dtype if cfg.group == 1 else jnp.float32
  out_shape = [jax.ShapeDtypeStruct((batch, cfg.kv_len, num_heads, head_dim), grad_dtype(k)),
               jax.ShapeDtypeStruct((batch, cfg.kv_len, num_heads, value_dim), grad_dtype(v))]
  out_specs = [_head_spec(bk, head_dim, False, cfg.group, blocked=True),
               _head_spec(bk, value_dim, False, cfg.group, blocked=True)]
  dk, dv = pl.pallas_call(
      functools.partial(_dkv_kernel, cfg=cfg),
      grid=(cfg.kv_len // bk, batch, num_heads),
      in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
      compiler_params=params, interpret=cfg.interpret, name="flash_attention_dkv",
  )(q, k, v, bias, _for_pass(m, along_q=False), x, d_out, lse, delta)

  dk, dv = _sum_groups(dk, cfg.group, k.dtype), _sum_groups(dv, cfg.group, v.dtype)
  if bias is not None:
    d_bias = common.sum_to_shape(d_bias, bias.shape).astype(bias.dtype)
  d_sinks = None
  if x.sinks is not None:
    # The sink's probability exp(sink - lse) meets dP = 0 (it has no value):
    # dS = p_sink (0 - delta), summed over the rows each head's sink serves.
    p_sink = jnp.exp(x.sinks[None, :, None].astype(jnp.float32) - lse)  # [B, H, Tq']
    d_sinks = -jnp.sum(p_sink * delta, axis=(0, 2)).astype(x.sinks.dtype)
  d_consts = tuple(d.sum(axis=(0, 1, 2)).astype(c.dtype)
                   for d, c in zip(d_consts, x.score_consts))
  return dq, dk, dv, d_bias, common.FlexArrays(d_sinks, d_consts)


def _sum_groups(grad, group: int, dtype):
  """`[B, T, H, D]` per query head -> `[B, T, H // group, D]` per K/V head."""
  if group == 1:
    return grad
  batch, length, num_heads, dim = grad.shape
  grad = grad.reshape(batch, length, num_heads // group, group, dim)
  return grad.sum(axis=3).astype(dtype)


# (q, k, v, bias, common.FlexArrays) are differentiated, _MaskArrays is not.
_attention = common.flash_attention_vjp(_forward, _backward)


# ---------------------------------------------------------------------------
# Public API.
# ---------------------------------------------------------------------------


def default_block_sizes_gpu(head_dim: int, dtype) -> common.BlockSizes:
  """Block sizes by (padded) head dim and dtype, tuned on an H100 for bfloat16.

  `python -m experiments.tune_block_sizes` (benchmarks/block_sizes_gpu.json,
  T=8192, forward+backward): at head dim 64 query blocks of 128 and key blocks
  of 64 (with 4 warps, 3 stages); at 128 blocks of 64 x 64 (4 warps, 2
  stages), 1.45x faster than the 128 x 64 and 8 warps used before. The dk/dv
  pass keeps two float32 accumulators of its key block: 64 x 64 won at both.
  Head dim 256 halves the blocks (not tuned). float32 inputs take twice the
  registers and shared memory per element, so above head dim 64 their blocks
  halve again (never below 16).
  """
  padded = _padded_dim(head_dim)
  if padded <= 64:
    blocks = common.BlockSizes(block_q=128, block_k=64, block_q_dkv=64, block_k_dkv=64)
  elif padded <= 128:
    blocks = common.BlockSizes(block_q=64, block_k=64, block_q_dkv=64, block_k_dkv=64)
  else:
    blocks = common.BlockSizes(block_q=64, block_k=32, block_q_dkv=32, block_k_dkv=32)
  if jnp.dtype(dtype).itemsize >= 4 and padded > 64:
    halve = lambda block: max(MIN_BLOCK, block // 2)
    blocks = common.BlockSizes(*(halve(getattr(blocks, f.name))
                                 for f in dataclasses.fields(blocks)))
  return blocks


def flash_attention_gpu(inputs: AttentionInputs, block_sizes: Optional[common.BlockSizes] = None,
                        *, interpret: Optional[bool] = None, num_warps: Optional[int] = None,
                        num_stages: Optional[int] = None, return_residual: bool = False,
                        pattern: Union[None, patterns.Pattern, mods.LiftedMod] = None,
                        block_layout: Optional[Array] = None,
                        mask_consts: Tuple[Array, ...] = (),
                        score_mod: Optional[mods.LiftedMod] = None,
                        score_consts: Tuple[Array, ...] = (),
                        softcap: Optional[float] = None,
                        sinks: Optional[Array] = None
                        ) -> Union[Array, Tuple[Array, Array]]:
  """Exact attention over `inputs` with Pallas GPU kernels; `[B, Tq, H, Dv]`.

  Args:
    inputs: validated arguments of `attention_jax.dot_product_attention`.
    block_sizes: powers of two, at least 16; `default_block_sizes_gpu()` when
      None. Blocks longer than a (power-of-two rounded) sequence are shortened.
    interpret: run the kernels in the Pallas interpreter; None means "unless the
      default backend is a GPU".
    num_warps, num_stages: Triton launch parameters (4/8 warps by head dim, 2
      stages when None). Ignored by the interpreter.
    return_residual: also return the log-sum-exp `[B, Tq, H]` float32
      (differentiable; `common.EMPTY_ROW_LSE` where a query attends nothing).
    pattern, block_layout: block-sparse attention (block_sparse.py,
      flex_attention): the mask mod evaluated in PARTIAL blocks (a static
      pattern, or a `mods.LiftedMod` closing over `mask_consts`) and its
      `[H|1, nq, nk]` or `[B|1, H|1, nq, nk]` layout for `block_sizes` (one
      size for every pass, which must fit the sequences as given); each
      program visits its own (batch row, head)'s blocks.
    score_mod, score_consts, softcap, sinks: flex_attention (kernels/
      flash_attention/flex.py): the logits soft-capped, then the lifted
      score_mod over its arrays (differentiated where floating), applied on
      each tile inside the kernels; `[H]` sink logits in the normaliser.

  Raises:
    ValueError: for a dtype other than float32/bfloat16/float16, a head dim
      outside [1, 256], or block sizes that are not powers of two >= 16.
  """
  reason = gpu_rejects(inputs)
  if reason is not None:
    raise ValueError(reason)
  if block_sizes is None:
    block_sizes = default_block_sizes_gpu(
        max(inputs.query.shape[-1], inputs.value.shape[-1]), inputs.query.dtype)
  _check_block_sizes(block_sizes)
  empty = attention_of_empty_sequence(inputs, return_residual)  # Tq = 0 or Tk = 0
  if empty is not None:
    return empty
  if interpret is None:
    interpret = jax.default_backend() != "gpu"
  cfg = _config(inputs, block_sizes, bool(interpret), num_warps, num_stages)
  sparse = {}
  if block_layout is not None:
    if (cfg.block_q, cfg.block_k) != (block_sizes.block_q, block_sizes.block_k) or \
        cfg.dkv_blocks != (cfg.block_q, cfg.block_k):
      raise ValueError(f"block-sparse attention needs one block size for every pass, no "
                       f"longer than the sequences; got {block_sizes} for "
                       f"Tq={inputs.query.shape[1]}, Tk={inputs.key.shape[1]}.")
    if block_layout.ndim == 3:  # [H|1, nq, nk]: the same for every batch row
      block_layout = block_layout[None]
    cfg = dataclasses.replace(cfg, pattern=pattern)
    by_query = _visit_lists(block_layout)
    by_key = _visit_lists(block_layout.swapaxes(2, 3))
    sparse = dict(zip(("layout", "visits", "visit_counts"), by_query))
    sparse.update(zip(("layout_by_key", "visits_by_key", "visit_counts_by_key"), by_key))

  # Zero padding: whole blocks along T, a power of two (>= 16) along D.
  query, key, value = inputs.query, inputs.key, inputs.value
  pad = lambda x, length: _pad_to(_pad_to(x, 1, length), 3, _padded_dim(x.shape[3]))
  q = pad(query, cfg.q_len)
  k = pad(key.astype(query.dtype), cfg.kv_len)
  v = pad(value.astype(query.dtype), cfg.kv_len)
  bias = _padded_pairwise(inputs.bias, cfg)
  mask = _padded_pairwise(inputs.mask, cfg)
  m = _MaskArrays(
      mask=None if mask is None else mask.astype(jnp.int8),
      q_segment_ids=_padded_ids(inputs.q_segment_ids, cfg.q_len),
      kv_segment_ids=_padded_ids(inputs.kv_segment_ids, cfg.kv_len),
      kv_lengths=(None if inputs.key_value_seq_lengths is None
                  else jnp.asarray(inputs.key_value_seq_lengths, jnp.int32)), **sparse)

  # flex_attention: the mods' arrays whole, floating score_mod arrays differentiated.
  float_consts, other_consts = (), ()
  if score_mod is not None:
    float_consts, other_consts = score_mod.split(score_consts)
  cfg = dataclasses.replace(cfg, softcap=None if softcap is None else float(softcap),
                            score_mod=score_mod, has_sinks=sinks is not None)
  # Flattened (tile_mods reads them by flat offset); the floating ones padded
  # to a power of two, for the dq kernel loads them whole.
  kernel_mask_consts = (tuple(map(tile_mods.kernel_array, mask_consts))
                        if block_layout is not None else ())
  m = dataclasses.replace(m, mask_consts=kernel_mask_consts,
                          score_consts=tuple(map(tile_mods.kernel_array, other_consts)))
  x = common.FlexArrays(
      sinks=None if sinks is None else jnp.asarray(sinks, jnp.float32),
      score_consts=tuple(tile_mods.kernel_array(c, pad_to_power_of_two=True)
                         for c in float_consts))

  q_len = query.shape[1]
  out, lse = _attention(cfg, (q, k, v, bias, x), m)
  return common.attention_outputs(out[:, :q_len, :, :value.shape[-1]], lse[:, :q_len],
                                  inputs.query_seq_lengths, return_residual)


def _config(inputs: AttentionInputs, block_sizes: common.BlockSizes, interpret: bool,
            num_warps: Optional[int], num_stages: Optional[int]) -> _Config:
  """Block sizes fitted to the sequences, and the padded lengths they tile."""
  q_len, num_heads = inputs.query.shape[1:3]
  kv_len, num_kv_heads = inputs.key.shape[1:3]
  bq_dkv, bk_dkv = block_sizes.dkv
  # Blocks longer than the sequence would only add padding.
  bq, bq_dkv = (min(b, _bucket(q_len)) for b in (block_sizes.block_q, bq_dkv))
  bk, bk_dkv = (min(b, _bucket(kv_len)) for b in (block_sizes.block_k, bk_dkv))
  # Powers of two: the larger block is a multiple of the smaller.
  return _Config(block_q=bq, block_k=bk, block_q_dkv=bq_dkv, block_k_dkv=bk_dkv,
                 q_len=_round_up(q_len, max(bq, bq_dkv)),
                 kv_len=_round_up(kv_len, max(bk, bk_dkv)),
                 true_kv_len=kv_len, group=num_heads // num_kv_heads,
                 scale=float(inputs.scale),
                 reach=common.reach_of(inputs.is_causal, inputs.local_window_size),
                 interpret=interpret, num_warps=num_warps, num_stages=num_stages)


def gpu_dot_product_attention(query, key, value, bias=None, mask=None, *,
                              block_sizes: Optional[common.BlockSizes] = None,
                              interpret: Optional[bool] = None,
                              num_warps: Optional[int] = None,
                              num_stages: Optional[int] = None,
                              return_residual: bool = False, **kwargs):
  """`attention_jax.dot_product_attention` computed by the Pallas GPU kernels.

  Takes every argument of `dot_product_attention` except `implementation`, plus
  the kernel options of `flash_attention_gpu`.
  """
  inputs, unbatched = prepare_inputs(query, key, value, bias, mask, **kwargs)
  return returned_outputs(
      flash_attention_gpu(inputs, block_sizes, interpret=interpret, num_warps=num_warps,
                          num_stages=num_stages, return_residual=return_residual), unbatched)


# ---------------------------------------------------------------------------
# Validation and padding.
# ---------------------------------------------------------------------------


def gpu_rejects(inputs: AttentionInputs) -> Optional[str]:
  """None when `flash_attention_gpu` takes `inputs`, else the reason it does not.

  (The `rejects` hook of `register_implementation`; block sizes are checked
  separately, since they are not part of the inputs.)
  """
  dtype = jnp.dtype(inputs.query.dtype)
  if not any(dtype == jnp.dtype(d) for d in SUPPORTED_DTYPES):
    return f"the Pallas GPU kernel takes float32, bfloat16 or float16 inputs, got {dtype}."
  for name, dim in (("head dim", inputs.query.shape[-1]),
                    ("value head dim", inputs.value.shape[-1])):
    if not 1 <= dim <= MAX_HEAD_DIM:
      return (f"the Pallas GPU kernel supports a {name} of 1 to {MAX_HEAD_DIM} "
              f"(padded to a power of two >= {MIN_BLOCK}), got {dim}.")
  return None


def _check_block_sizes(block_sizes: common.BlockSizes) -> None:
  for field in dataclasses.fields(block_sizes):
    value = getattr(block_sizes, field.name)
    if value is not None and (value < MIN_BLOCK or value & (value - 1)):
      raise ValueError(f"the Pallas GPU kernel needs block sizes that are powers of two and at "
                       f"least {MIN_BLOCK} (Triton tiles), got BlockSizes.{field.name}={value}.")


def _next_power_of_two(n: int) -> int:
  return 1 << max(0, n - 1).bit_length()


def _padded_dim(dim: int) -> int:
  return max(MIN_BLOCK, _next_power_of_two(dim))


def shortest_block(length: int) -> int:
  """The shortest useful block for a sequence: a power of two >= 16 covering it."""
  return max(MIN_BLOCK, _next_power_of_two(length))


_bucket = shortest_block


def _round_up(n: int, multiple: int) -> int:
  return common.cdiv(n, multiple) * multiple


def _pad_to(x: Array, axis: int, size: int) -> Array:
  """Zero-pads `axis` of `x` at the end up to `size`."""
  if x.shape[axis] == size:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, size - x.shape[axis])
  return jnp.pad(x, widths)


def _padded_pairwise(x: Optional[Array], cfg: _Config) -> Optional[Array]:
  """A bias or mask `[B|1, H|1, Tq|1, Tk|1]` as `[B|1, H|1, Tq', Tk']`.

  The Tq and Tk axes are materialised (the kernels read `[block, block]` tiles):
  a broadcast axis straight to its padded length, a full one by zero (False)
  padding. Padded keys are masked by position and padded queries sliced off,
  so what lies in the padding never matters. Batch and head axes of size 1
  stay broadcast through the index maps.
  """
  if x is None:
    return None
  x = jnp.broadcast_to(x, x.shape[:2] + (cfg.q_len if x.shape[2] == 1 else x.shape[2],
                                         cfg.kv_len if x.shape[3] == 1 else x.shape[3]))
  return _pad_to(_pad_to(x, 2, cfg.q_len), 3, cfg.kv_len)


def _padded_ids(ids: Optional[Array], length: int) -> Optional[Array]:
  """Segment ids `[B, T]` padded to `length` by repeating the last id.

  Repeating (rather than a sentinel) keeps each block's id range tight, so the
  disjoint-segment skip still fires next to the padding; padded keys are masked
  by position and padded queries sliced off, so their ids never matter.
  """
  if ids is None:
    return None
  ids = jnp.asarray(ids, jnp.int32)
  return jnp.pad(ids, ((0, 0), (0, length - ids.shape[1])), mode="edge")
