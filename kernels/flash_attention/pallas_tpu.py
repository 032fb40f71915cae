"""Flash attention as Pallas TPU kernels (Mosaic), forward and backward.

The algorithm is the online softmax of `blockwise.py`, tiled for the TPU:
every kernel runs over a grid whose last axis walks the blocks one side of the
attention matrix (keys for the forward and dq passes, queries for the dk/dv
pass) while the running statistics and accumulators live in float32 VMEM
scratch, initialised at the first step and written out at the last.

Layout: the wrapper transposes to `[B, H, T, D]` so that every block is a
`(rows, D)` tile. Row statistics (the log-sum-exp, delta = rowsum(dO * O), the
query segment ids) are kept replicated over the 128 lanes, `[.., T, 128]`, and
key segment ids over 8 sublanes, `[B, 8, Tk]`, so that every block is a whole
`(8, 128)` vreg tile.

Masks, as in `blockwise.py`:
  * causal / window: summarised by their reach (`common.reach_of`). The last
    grid axis only has as many steps as the widest band of blocks any row
    needs; step `s` of query block `i` visits key block `lo(i) + s`, and steps
    past the band repeat the last block, so they neither compute nor DMA.
  * key/value lengths and the padding of Tk up to a whole block: one per-batch
    length, scalar-prefetched, that masks keys in-kernel and ends the band.
  * query lengths: query blocks wholly past the length are skipped (their
    output is 0); rows past it inside a block are zeroed by the wrapper, which
    also zeroes their gradients.
  * segment ids: masked in-kernel; a block pair whose query-id and key-id
    ranges are disjoint is skipped.
  * the boolean `mask` is passed as int8 blocks, the bias as blocks in its own
    dtype; their batch and head axes may stay broadcast (size 1), their query
    and key axes are broadcast to full length (a bias is quadratic anyway: its
    gradient is a `[B, H, Tq, Tk]` float32 array, summed over the broadcast
    axes in float32).
A row with nothing to attend outputs zeros, has lse `common.EMPTY_ROW_LSE`
(finite), and passes zero gradients.

The backward pass (`common.flash_attention_vjp`) recomputes the probabilities
from the saved lse: a dq kernel over (query block, key blocks) that also writes the
logits gradient ds when there is a bias, and a dk/dv kernel over (key block,
query heads of its group, query blocks).

Block sizes (`common.BlockSizes`): `block_q` and `block_q_dkv` must be
multiples of 32 (one sublane tile of the narrowest dtype loaded along queries,
the int8 mask); `block_k` and `block_k_dkv` multiples of 128 (the lane width:
keys are the lane axis of every logits block). Blocks longer than the
(rounded-up) sequence are shortened to it.

Block-sparse and flex attention (block_sparse.py, flex.py): a layout `[B|1,
H|1, nq, nk]` (or `[H|1, nq, nk]`) of SKIP / PARTIAL / FULL blocks becomes,
per (batch row, head) and per query block (key block for the dk/dv pass), the
list of blocks to visit, scalar-prefetched; the grid's last axis is as long
as the longest list (`max_visits`: the full number of blocks when the layout
is traced). In a visited block the mask mod decides (a static pattern, or a
`mods.LiftedMod`), except where the block is FULL. flex_attention's score
changes run on each tile after the scale and bias: `softcap`, then the
lifted score_mod. A lifted mod's program is walked on the tile
(`tile_mods`, as in the Triton kernels): its non-floating arrays are
flattened into SMEM and read one entry at a time, its floating ones (the
differentiated score_mod arrays) are `[1, n]` VMEM values read by one-hot
sums at one offset; the backward kernels differentiate the score change on
the tile with `jax.vjp`, and the dq pass accumulates each program's part of
the gradients of the floating arrays in its own `[B, H, nq, 1, n]` output
block (Mosaic wants a block's last two dims whole), summed outside (no
atomics). So a compiled kernel reads a mod's arrays by the program's batch
row and head (ALiBi's `slopes[h]`, a per-head temperature, `table[h, 3]`)
and uses small ones whole; a read per query or key position (document ids,
a relative-bias table indexed by distance) is a gather Mosaic cannot do,
refused at trace time, and runs in interpret mode only. Sinks (`[H]`, one
logit per head, passed replicated over a `(8, 128)` tile) start the
forward's running max at the sink and its running sum at 1; their gradient
needs no kernel. Checked by lowering to Mosaic on CPU (no TPU here), forward
and backward.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple, Union

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from attention_jax.core import masks as mask_lib
from attention_jax.core import mods, patterns
from attention_jax.core.inputs import (AttentionInputs, attention_of_empty_sequence,
                                       prepare_inputs, returned_outputs)

from . import common, tile_mods

Array = jnp.ndarray

LANES = 128
SUBLANES = 8
# Queries are the sublane axis of every block; 32 rows are one tile of int8 (the mask),
# and a whole number of tiles of bfloat16 (16) and float32 (8).
QUERY_BLOCK_MULTIPLE = 32
KEY_BLOCK_MULTIPLE = LANES
MAX_HEAD_DIM = 256
SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))

# dot_general dimension numbers: a @ b, a @ b^T, and a^T @ b.
_NN = (((1,), (0,)), ((), ()))
_NT = (((1,), (1,)), ((), ()))
_TN = (((0,), (0,)), ((), ()))


@dataclasses.dataclass(frozen=True)
class _Static:
  """Everything about a call that is fixed at trace time."""

  block_q: int
  block_k: int
  block_q_dkv: int
  block_k_dkv: int
  q_len: int  # padded Tq: a multiple of every query block
  kv_len: int  # padded Tk
  group: int  # query heads per K/V head
  scale: float
  reach: common.Reach
  interpret: Any  # False, or pltpu.InterpretParams
  # Block-sparse attention (block_sparse.py, flex_attention): the mask mod
  # inside PARTIAL blocks (a static pattern, or a `mods.LiftedMod` over
  # `_MaskArrays.mask_consts`), the layout's batch and head counts (1 or B,
  # 1 or H), and the grid steps of the query-major and key-major passes (the
  # most blocks a row visits).
  pattern: Union[None, patterns.Pattern, mods.LiftedMod] = None
  pattern_batch: int = 1
  pattern_heads: int = 1
  sparse_steps: Tuple[int, int] = (0, 0)
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


@dataclasses.dataclass
class _MaskArrays:
  """The non-differentiable inputs that decide which pairs attend (padded layouts)."""

  q_lengths: Array  # [B] int32; Tq when not given
  kv_lengths: Array  # [B] int32; the true Tk when not given
  mask: Optional[Array]  # [B|1, H|1, Tq'|1, Tk'|1] int8
  q_segment_ids: Optional[Array]  # [B, Tq', 128] int32
  kv_segment_ids: Optional[Array]  # [B, 8, Tk'] int32
  # Block-sparse attention, scalar-prefetched (flat int32, row-major): by query
  # block (layout [Bl, Hl, nq, nk], visits [Bl, Hl, nq, nk], counts [Bl, Hl,
  # nq]) and by key block (the transposes), Bl and Hl the layout's batch rows
  # and heads.
  by_query: Optional[Tuple[Array, Array, Array]] = None
  by_key: Optional[Tuple[Array, Array, Array]] = None
  # flex_attention: the arrays a lifted mask mod closes over and the score
  # mod's arrays that are not differentiated, flat in SMEM (`_smem_array`).
  mask_consts: Tuple[Array, ...] = ()
  score_consts: Tuple[Array, ...] = ()


jax.tree_util.register_dataclass(
    _MaskArrays,
    data_fields=["q_lengths", "kv_lengths", "mask", "q_segment_ids", "kv_segment_ids",
                 "by_query", "by_key", "mask_consts", "score_consts"],
    meta_fields=[])


def _named_refs(refs: Dict[str, Any], prefix: str) -> Tuple[Any, ...]:
  """The refs of the operands named `prefix0`, `prefix1`, ... in order."""
  found = []
  while f"{prefix}{len(found)}" in refs:
    found.append(refs[f"{prefix}{len(found)}"])
  return tuple(found)


def _named_consts(refs: Dict[str, Any], prefix: str) -> Tuple[Array, ...]:
  """The values of the operands named `prefix0`, `prefix1`, ... in order."""
  return tuple(ref[...] for ref in _named_refs(refs, prefix))


def _indexed(cfg: _Static, lifted: mods.LiftedMod, flats, by_value) -> Tuple[Any, ...]:
  """A mod's arrays as `tile_mods` reads them: the floating ones (`by_value`)
  from their `[1, n]` values by one-hot sums, the others from their SMEM refs.
  Mosaic loads one SMEM entry at a time, so a compiled kernel reads them at
  one index per program (`slopes[h]`, `table[h, 3]`); per-position reads
  (`ids[b, q_idx]`) are gathers, which only the interpreter runs."""
  gathers = "value" if cfg.interpret else "none"
  return tuple(dataclasses.replace(array, gathers=gathers)
               for array in tile_mods.indexed(lifted, flats, by_value))


def _flat_visit_lists(layout: Array) -> Tuple[Array, Array, Array]:
  """`[Bl, Hl, n, m]` layout -> flat (layout, visits, counts) for scalar prefetch:
  the blocks each row visits in order (padded with skipped ones) and how many."""
  visited = layout != patterns.SKIP
  visits = jnp.argsort(~visited, axis=-1, stable=True).astype(jnp.int32)
  return (layout.astype(jnp.int32).ravel(), visits.ravel(),
          visited.sum(-1).astype(jnp.int32).ravel())


# ----------------------------------------------------------------------------
# Which block a grid step visits.


class _Coords(NamedTuple):
  """The blocks one grid step works on, and whether it has work to do.

  `fresh`: this step visits a block for the first time (steps past the band of
  visible blocks repeat the previous one). `any_visit`: the band is not empty.
  """

  batch: Array
  head: Array
  kv_head: Array
  q_block: Array
  kv_block: Array
  fresh: Array
  any_visit: Array


def _band_steps(count: int, block_range: Callable[[int], Tuple[Array, Array]]) -> int:
  """The widest band `hi - lo` over the blocks `0..count-1` (at least 1: a grid axis)."""
  with jax.ensure_compile_time_eval():  # concrete even while an outer jit traces
    widest = max(int(hi) - int(lo) for lo, hi in map(block_range, range(count)))
  return max(widest, 1)


def _visit(lo, hi, step, num_blocks):
  """Block visited at `step` of the band [lo, hi): lo + step, then held at hi - 1."""
  target = lo + step
  block = jnp.clip(jnp.minimum(target, hi - 1), 0, num_blocks - 1)
  return block, target < hi, jnp.asarray(lo) < hi


def _layout_row(cfg: _Static, batch, head):
  """The (batch row, head) of the layout that a program of (batch, head) follows."""
  return ((batch if cfg.pattern_batch > 1 else 0) * cfg.pattern_heads
          + (head if cfg.pattern_heads > 1 else 0))


def _sparse_visit(cfg: _Static, batch, head, row, step, num_rows: int, num_cols: int, live,
                  sparse_refs):
  """Block-sparse: the block that `step` of `row` visits (held at the last one
  past the row's count, so that no step past it moves a block), whether it is
  fresh, and whether the row visits any. `live`: the row has work at all."""
  _, visits_ref, counts_ref = sparse_refs
  index = _layout_row(cfg, batch, head) * num_rows + row
  count = jnp.where(live, counts_ref[index], 0)
  n = jnp.maximum(jnp.minimum(step, count - 1), 0)
  return visits_ref[index * num_cols + n], step < count, count > 0


def _query_major_coords(cfg: _Static, block_q: int, block_k: int, batch, head, q_block, step,
                        q_lengths_ref, kv_lengths_ref, *sparse_refs) -> _Coords:
  """Grid (B, H, query blocks, key steps): step `step` of query block `q_block`."""
  num_kv_blocks = cfg.kv_len // block_k
  if sparse_refs:
    live = q_block * block_q < q_lengths_ref[batch]
    kv_block, fresh, any_visit = _sparse_visit(cfg, batch, head, q_block, step,
                                               cfg.q_len // block_q,
                                               num_kv_blocks, live, sparse_refs)
    return _Coords(batch, head, head // cfg.group, q_block, kv_block, fresh, any_visit)
  lo, hi = common.kv_block_range(q_block, block_q, block_k, num_kv_blocks, cfg.reach)
  # Key blocks wholly past the valid length hold nothing to attend.
  hi = jnp.minimum(hi, common.cdiv(kv_lengths_ref[batch], block_k))
  # A query block wholly past the valid length outputs zeros: visit nothing.
  hi = jnp.where(q_block * block_q < q_lengths_ref[batch], hi, lo)
  kv_block, fresh, any_visit = _visit(lo, hi, step, num_kv_blocks)
  return _Coords(batch, head, head // cfg.group, q_block, kv_block, fresh, any_visit)


def _key_major_coords(cfg: _Static, block_q: int, block_k: int, batch, kv_head, kv_block,
                      group_index, step, q_lengths_ref, kv_lengths_ref,
                      *sparse_refs) -> _Coords:
  """Grid (B, Hkv, key blocks, G, query steps): step `step` of key block `kv_block`."""
  num_q_blocks = cfg.q_len // block_q
  if sparse_refs:
    head = kv_head * cfg.group + group_index
    live = kv_block * block_k < kv_lengths_ref[batch]
    q_block, fresh, any_visit = _sparse_visit(cfg, batch, head, kv_block, step,
                                              cfg.kv_len // block_k,
                                              num_q_blocks, live, sparse_refs)
    return _Coords(batch, head, kv_head, q_block, kv_block, fresh, any_visit)
  lo, hi = common.q_block_range(kv_block, block_q, block_k, num_q_blocks, cfg.reach)
  hi = jnp.minimum(hi, common.cdiv(q_lengths_ref[batch], block_q))
  hi = jnp.where(kv_block * block_k < kv_lengths_ref[batch], hi, lo)
  q_block, fresh, any_visit = _visit(lo, hi, step, num_q_blocks)
  head = kv_head * cfg.group + group_index
  return _Coords(batch, head, kv_head, q_block, kv_block, fresh, any_visit)


# ----------------------------------------------------------------------------
# Block specs: every operand is one of a few kinds, indexed from _Coords.


def _block_spec(kind: str, shape: Tuple[int, ...], block_q: int, block_k: int,
                coords_of: Callable[..., _Coords]) -> pl.BlockSpec:
  """The BlockSpec of an operand of `kind` and full `shape` under a grid's coords."""
  if kind == "q":  # [B, H, Tq, D]: q, dO, out, dq
    block = (None, None, block_q, shape[-1])
    index = lambda c: (c.batch, c.head, c.q_block, 0)
  elif kind == "row_stat":  # [B, H, Tq, 128]: lse, delta
    block = (None, None, block_q, LANES)
    index = lambda c: (c.batch, c.head, c.q_block, 0)
  elif kind == "kv":  # [B, Hkv, Tk, D]: k, v, dk, dv
    block = (None, None, block_k, shape[-1])
    index = lambda c: (c.batch, c.kv_head, c.kv_block, 0)
  elif kind == "pairwise":  # [B|1, H|1, Tq, Tk]: bias, mask, ds
    block = (None, None, block_q, block_k)
    index = lambda c: (c.batch if shape[0] > 1 else 0, c.head if shape[1] > 1 else 0,
                       c.q_block, c.kv_block)
  elif kind == "q_ids":  # [B, Tq, 128]
    block = (None, block_q, LANES)
    index = lambda c: (c.batch, c.q_block, 0)
  elif kind == "kv_ids":  # [B, 8, Tk]
    block = (None, SUBLANES, block_k)
    index = lambda c: (c.batch, 0, c.kv_block)
  elif kind == "whole":  # a mod's floating array `[1, n]`, whole, for every step
    return pl.BlockSpec(shape, lambda *_: (0,) * len(shape))
  elif kind == "smem":  # a mod's other array, flattened, in SMEM: read one entry at a time
    return pl.BlockSpec(memory_space=pltpu.SMEM)
  elif kind == "sink":  # [H, 8, 128]: the head's sink logit, replicated over a tile
    block = (None, SUBLANES, LANES)
    index = lambda c: (c.head, 0, 0)
  elif kind == "d_const":  # [B, H, nq, 1, n]: a program's part of a score_mod array's
    # gradient, flattened, so that the block's last two dims are the array's (Mosaic's rule)
    block = (None, None, None, 1, shape[-1])
    index = lambda c: (c.batch, c.head, c.q_block, 0, 0)
  elif kind == "untouched":  # stays in HBM, never copied in: the zeros an output aliases
    return pl.BlockSpec(memory_space=pl.ANY)
  else:
    raise AssertionError(kind)
  return pl.BlockSpec(block, lambda *grid_and_refs: index(coords_of(*grid_and_refs)))


# ----------------------------------------------------------------------------
# In-kernel helpers.


def _lanes(stat: Array, width: int) -> Array:
  """A lane-replicated `(rows, 128)` statistic widened to `(rows, width)`."""
  widened = jnp.tile(stat, (1, common.cdiv(width, LANES)))
  return widened if widened.shape[1] == width else widened[:, :width]


def _as_lane_stat(row_values: Array) -> Array:
  """`(rows,)` values replicated over 128 lanes: `(rows, 128)`."""
  return jax.lax.broadcast_in_dim(row_values, (row_values.shape[0], LANES), (0,))


def _precision(dtype):
  # float32 inputs ask the MXU for full float32 products (bfloat16 passes otherwise).
  return jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None


def _dot(a, b, dims):
  return jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32,
                             precision=_precision(a.dtype))


def _segments_overlap(refs: Dict[str, Any]) -> Array:
  """False when the block's query and key segment-id ranges are disjoint (skip it).

  The ranges are compared in float32: TPU reductions of int32 are not portable,
  and the rounding is monotone, so overlapping ranges never look disjoint.
  """
  if "q_ids" not in refs:
    return jnp.bool_(True)
  q_ids = refs["q_ids"][...].astype(jnp.float32)
  kv_ids = refs["kv_ids"][...].astype(jnp.float32)
  return (jnp.max(q_ids) >= jnp.min(kv_ids)) & (jnp.max(kv_ids) >= jnp.min(q_ids))


def _score_modifier(cfg: _Static, refs: Dict[str, Any], c: _Coords):
  """flex_attention: `(scores, float_consts, q_pos, k_pos) -> logits` (soft cap,
  then the score_mod) for the block at `c`, or None when nothing modifies the
  scores."""
  if not cfg.modifies_scores:
    return None
  other = _named_refs(refs, "score_const")

  def modify(scores, float_consts, q_pos, k_pos):
    if cfg.softcap is not None:
      scores = cfg.softcap * jnp.tanh(scores / cfg.softcap)
    if cfg.score_mod is not None:
      arrays = _indexed(cfg, cfg.score_mod, cfg.score_mod.merge(float_consts, other),
                        cfg.score_mod.merge([True] * len(float_consts), [False] * len(other)))
      scores = tile_mods.apply_on_tile(cfg.score_mod, arrays, scores, c.batch, c.head, q_pos,
                                       k_pos)
    return scores

  return modify


def _masked_logits(cfg: _Static, refs: Dict[str, Any], q: Array, k: Array, q_start, k_start,
                   kv_length, in_pattern=None, c: Optional[_Coords] = None,
                   differentiate: bool = False):
  """scale * q k^T + bias, soft-capped and score-modified (flex_attention), with
  disallowed pairs at -inf: `(bq, bk)` float32.
  `in_pattern`: `(q_pos, k_pos) -> allowed` of a block-sparse pattern, or None.
  `c`: the block's coords (for the score_mod's batch and head).
  `differentiate`: also return the modification's VJP, `d_logits -> (d_scores,
  d_float_consts)` (None without a modification)."""
  logits = _dot(q, k, _NT) * cfg.scale
  if "bias" in refs:
    logits += refs["bias"][...].astype(jnp.float32)
  shape = logits.shape
  q_pos = q_start + jax.lax.broadcasted_iota(jnp.int32, shape, 0)
  k_pos = k_start + jax.lax.broadcasted_iota(jnp.int32, shape, 1)
  modify_vjp = None
  modify = _score_modifier(cfg, refs, c)
  if modify is not None:
    float_consts = _named_consts(refs, "float_const")
    if differentiate:
      logits, modify_vjp = jax.vjp(lambda s, fc: modify(s, fc, q_pos, k_pos), logits,
                                   float_consts)
    else:
      logits = modify(logits, float_consts, q_pos, k_pos)
  # The length also masks the padding of Tk up to whole blocks (lengths <= true Tk).
  allowed = mask_lib.and_masks(mask_lib.length_predicate(k_pos, kv_length),
                               mask_lib.reach_predicate(q_pos, k_pos, cfg.reach))
  if "q_ids" in refs:
    q_ids = _lanes(refs["q_ids"][...], shape[1])
    kv_ids = refs["kv_ids"][0:1, :]
    allowed &= mask_lib.segment_predicate(q_ids, kv_ids)
  if "mask" in refs:
    allowed &= refs["mask"][...].astype(jnp.int32) != 0
  if in_pattern is not None:
    allowed &= in_pattern(q_pos, k_pos)
  logits = jnp.where(allowed, logits, -jnp.inf)
  return (logits, modify_vjp) if differentiate else logits


def _in_pattern(cfg: _Static, c: _Coords, sparse_refs, by_query: bool, refs: Dict[str, Any]):
  """Block-sparse: `(q_pos, k_pos) -> allowed` for the block at `c` (all of a
  FULL block, the mask mod's pairs in a PARTIAL one), or None without a
  pattern. `sparse_refs` are the pass's own (by query or by key block)."""
  if not sparse_refs:
    return None
  layout_ref = sparse_refs[0]
  num_q_blocks = cfg.q_len // (cfg.block_q if by_query else cfg.block_q_dkv)
  num_kv_blocks = cfg.kv_len // (cfg.block_k if by_query else cfg.block_k_dkv)
  row = _layout_row(cfg, c.batch, c.head)
  if by_query:
    index = (row * num_q_blocks + c.q_block) * num_kv_blocks + c.kv_block
  else:
    index = (row * num_kv_blocks + c.kv_block) * num_q_blocks + c.q_block
  full = layout_ref[index] == patterns.FULL
  if isinstance(cfg.pattern, mods.LiftedMod):
    consts = _named_refs(refs, "mask_const")
    arrays = _indexed(cfg, cfg.pattern, consts, [False] * len(consts))
    return lambda q_pos, k_pos: full | tile_mods.apply_on_tile(cfg.pattern, arrays, c.batch,
                                                               c.head, q_pos, k_pos)
  return lambda q_pos, k_pos: full | cfg.pattern(0, c.head, q_pos, k_pos)


def _probs_and_dlogits(cfg: _Static, refs: Dict[str, Any], c: _Coords, block_q: int,
                       block_k: int, kv_length, in_pattern=None
                       ) -> Tuple[Array, Array, Tuple[Array, ...]]:
  """Recomputed p = exp(logits - lse) and ds = p * (dO v^T - delta): `(bq, bk)`
  float32, ds taken back through the score modification (to the scaled and
  biased logits), and this block's part of the gradients of the score_mod's
  floating arrays (empty without them)."""
  logits, modify_vjp = _masked_logits(cfg, refs, refs["q"][...], refs["k"][...],
                                      c.q_block * block_q, c.kv_block * block_k, kv_length,
                                      in_pattern, c, differentiate=True)
  # A row the forward pass left empty has lse EMPTY_ROW_LSE, and its logits here
  # are not always all -inf: the forward skips a query block wholly past the
  # valid length (or the padding), and the dk/dv pass, tiled by block_q_dkv (or
  # by a block-sparse list that ignores lengths), can still visit its rows in a
  # taller block. exp(logit - EMPTY_ROW_LSE) overflows to inf there, and inf
  # times the row's dO (0) is NaN; against lse = +inf the row's probabilities
  # are exactly 0. (A comparison per row, not per pair.)
  lse = refs["lse"][...]
  lse = jnp.where(lse == common.EMPTY_ROW_LSE, jnp.inf, lse)
  probs = jnp.exp(logits - _lanes(lse, block_k))
  d_probs = _dot(refs["do"][...], refs["v"][...], _NT)
  d_logits = probs * (d_probs - _lanes(refs["delta"][...], block_k))
  d_consts = ()
  if modify_vjp is not None:  # dS of the modified logits -> of the raw ones
    d_logits, d_consts = modify_vjp(d_logits)
  return probs, d_logits, tuple(d_consts)


# ----------------------------------------------------------------------------
# Kernels. Each receives the scalar-prefetched lengths, then its operands (named by
# `names`), then its outputs and scratch.


def _sparse_and_named(cfg: _Static, refs, names: Tuple[str, ...]):
  """The kernel's refs after the lengths: the block-sparse scalars (three, or
  none), then the named operands, outputs and scratch."""
  count = 3 if cfg.pattern is not None else 0
  return refs[:count], dict(zip(names, refs[count:]))


def _forward_kernel(q_lengths_ref, kv_lengths_ref, *refs, cfg: _Static, names: Tuple[str, ...],
                    num_steps: int):
  sparse_refs, refs = _sparse_and_named(cfg, refs, names)
  out_ref, lse_ref, max_ref, sum_ref, acc_ref = (
      refs[n] for n in ("out", "lse", "row_max", "row_sum", "acc"))
  step = pl.program_id(3)
  c = _query_major_coords(cfg, cfg.block_q, cfg.block_k, *(pl.program_id(a) for a in range(3)),
                          step, q_lengths_ref, kv_lengths_ref, *sparse_refs)

  @pl.when(step == 0)
  def _init():
    if cfg.has_sinks:  # the sink is a key seen first: running max its logit, running sum 1
      max_ref[...] = jnp.broadcast_to(refs["sink"][0:1, :], max_ref.shape)
      sum_ref[...] = jnp.ones(sum_ref.shape, jnp.float32)
    else:
      max_ref[...] = jnp.full(max_ref.shape, -jnp.inf, jnp.float32)
      sum_ref[...] = jnp.zeros(sum_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

  @pl.when(c.fresh & _segments_overlap(refs))
  def _accumulate():
    v = refs["v"][...]
    logits = _masked_logits(cfg, refs, refs["q"][...], refs["k"][...], c.q_block * cfg.block_q,
                            c.kv_block * cfg.block_k, kv_lengths_ref[c.batch],
                            _in_pattern(cfg, c, sparse_refs, True, refs), c)
    prev_max = max_ref[...]
    new_max = jnp.maximum(prev_max, jnp.max(logits, axis=1)[:, None])
    # A row with nothing allowed so far keeps max -inf; exponentiate against 0 then.
    safe_max = jnp.where(new_max == -jnp.inf, 0.0, new_max)
    probs = jnp.exp(logits - _lanes(safe_max, logits.shape[1]))
    correction = jnp.exp(prev_max - safe_max)
    max_ref[...] = new_max
    sum_ref[...] = correction * sum_ref[...] + _as_lane_stat(jnp.sum(probs, axis=1))
    acc_ref[...] = (_lanes(correction, acc_ref.shape[1]) * acc_ref[...]
                    + _dot(probs.astype(v.dtype), v, _NN))

  @pl.when(step == num_steps - 1)
  def _finish():
    row_sum = sum_ref[...]
    empty = row_sum == 0.0  # nothing attended: output 0, lse finite (see EMPTY_ROW_LSE)
    if cfg.has_sinks:
      # Rows past the query length (or in the padding) attend nothing, sinks
      # neither: as if empty, so that the backward passes give them p = 0.
      q_pos = c.q_block * cfg.block_q + jax.lax.broadcasted_iota(jnp.int32, row_sum.shape, 0)
      empty |= q_pos >= q_lengths_ref[c.batch]
    safe_sum = jnp.where(empty, 1.0, row_sum)
    out_ref[...] = (acc_ref[...] * _lanes(1.0 / safe_sum, acc_ref.shape[1])).astype(out_ref.dtype)
    lse_ref[...] = jnp.where(empty, common.EMPTY_ROW_LSE, max_ref[...] + jnp.log(safe_sum))


def _dq_kernel(q_lengths_ref, kv_lengths_ref, *refs, cfg: _Static, names: Tuple[str, ...],
               num_steps: int):
  sparse_refs, refs = _sparse_and_named(cfg, refs, names)
  dq_ref, dq_acc_ref, ds_ref = refs["dq"], refs["dq_acc"], refs.get("ds")
  d_const_refs = [refs[n] for n in names if n.startswith("d_float_const")]
  step = pl.program_id(3)
  c = _query_major_coords(cfg, cfg.block_q, cfg.block_k, *(pl.program_id(a) for a in range(3)),
                          step, q_lengths_ref, kv_lengths_ref, *sparse_refs)
  overlap = _segments_overlap(refs)

  @pl.when(step == 0)
  def _init():
    dq_acc_ref[...] = jnp.zeros(dq_acc_ref.shape, jnp.float32)
    for ref in d_const_refs:  # this program's part of a score_mod array's gradient
      ref[...] = jnp.zeros(ref.shape, jnp.float32)

  @pl.when(c.fresh & overlap)
  def _accumulate():
    k = refs["k"][...]
    _, d_logits, d_consts = _probs_and_dlogits(cfg, refs, c, cfg.block_q, cfg.block_k,
                                               kv_lengths_ref[c.batch],
                                               _in_pattern(cfg, c, sparse_refs, True, refs))
    dq_acc_ref[...] += _dot(d_logits.astype(k.dtype), k, _NN)
    for ref, d in zip(d_const_refs, d_consts):
      ref[...] += d.astype(jnp.float32).reshape(ref.shape)
    if ds_ref is not None:
      ds_ref[...] = d_logits

  if ds_ref is not None:
    # The ds block of this step is written back to HBM when the block index moves on,
    # so a step that owns it must fill it: a skipped segment block, or the one block an
    # empty band maps to, is zero. (Blocks never visited keep the zeros ds is aliased to.)
    @pl.when((c.fresh & ~overlap) | ~c.any_visit)
    def _zero_ds():
      ds_ref[...] = jnp.zeros(ds_ref.shape, ds_ref.dtype)

  @pl.when(step == num_steps - 1)
  def _finish():
    dq_ref[...] = (dq_acc_ref[...] * cfg.scale).astype(dq_ref.dtype)


def _dkv_kernel(q_lengths_ref, kv_lengths_ref, *refs, cfg: _Static, names: Tuple[str, ...],
                num_steps: int):
  sparse_refs, refs = _sparse_and_named(cfg, refs, names)
  dk_ref, dv_ref, dk_acc_ref, dv_acc_ref = (refs[n] for n in ("dk", "dv", "dk_acc", "dv_acc"))
  group_index, step = pl.program_id(3), pl.program_id(4)
  c = _key_major_coords(cfg, cfg.block_q_dkv, cfg.block_k_dkv,
                        *(pl.program_id(a) for a in range(3)), group_index, step,
                        q_lengths_ref, kv_lengths_ref, *sparse_refs)

  # dk and dv of a key block sum over the query heads of its group and all query blocks.
  @pl.when((group_index == 0) & (step == 0))
  def _init():
    dk_acc_ref[...] = jnp.zeros(dk_acc_ref.shape, jnp.float32)
    dv_acc_ref[...] = jnp.zeros(dv_acc_ref.shape, jnp.float32)

  @pl.when(c.fresh & _segments_overlap(refs))
  def _accumulate():
    q, d_out = refs["q"][...], refs["do"][...]
    # (The arrays' gradients are the dq pass's.)
    probs, d_logits, _ = _probs_and_dlogits(cfg, refs, c, cfg.block_q_dkv, cfg.block_k_dkv,
                                            kv_lengths_ref[c.batch],
                                            _in_pattern(cfg, c, sparse_refs, False, refs))
    dv_acc_ref[...] += _dot(probs.astype(d_out.dtype), d_out, _TN)
    dk_acc_ref[...] += _dot(d_logits.astype(q.dtype), q, _TN)

  @pl.when((group_index == cfg.group - 1) & (step == num_steps - 1))
  def _finish():
    dk_ref[...] = (dk_acc_ref[...] * cfg.scale).astype(dk_ref.dtype)
    dv_ref[...] = dv_acc_ref[...].astype(dv_ref.dtype)


# ----------------------------------------------------------------------------
# pallas_call wrappers.


def _mask_operands(cfg: _Static, bias: Optional[Array],
                   masks: _MaskArrays) -> List[Tuple[str, str, Array]]:
  """(name, kind, array) of the optional inputs every kernel reads."""
  # Size-1 query/key axes of a bias or mask are broadcast here, inside the custom VJP, so
  # that the bias gradient is summed over them in float32 before it takes the bias dtype.
  # Every block is then a whole (bq, bk) tile, which Mosaic lays out for any dtype.
  full = lambda x: jnp.broadcast_to(x, x.shape[:2] + (cfg.q_len, cfg.kv_len))
  operands = []
  if bias is not None:
    operands.append(("bias", "pairwise", full(bias)))
  if masks.mask is not None:
    operands.append(("mask", "pairwise", full(masks.mask)))
  if masks.q_segment_ids is not None:
    operands += [("q_ids", "q_ids", masks.q_segment_ids),
                 ("kv_ids", "kv_ids", masks.kv_segment_ids)]
  operands += [(f"mask_const{i}", "smem", x) for i, x in enumerate(masks.mask_consts)]
  operands += [(f"score_const{i}", "smem", x) for i, x in enumerate(masks.score_consts)]
  return operands


def _flex_operands(x: common.FlexArrays) -> List[Tuple[str, str, Array]]:
  """(name, kind, array) of flex_attention's differentiated inputs: the sinks
  replicated over a `(8, 128)` tile per head, the score_mod's floating arrays whole."""
  operands = []
  if x.sinks is not None:
    sinks = jnp.broadcast_to(x.sinks.astype(jnp.float32)[:, None, None],
                             (x.sinks.shape[0], SUBLANES, LANES))
    operands.append(("sink", "sink", sinks))
  operands += [(f"float_const{i}", "whole", c) for i, c in enumerate(x.score_consts)]
  return operands


def _pallas(kernel, cfg: _Static, grid, semantics, coords_of, block_q, block_k,
            inputs: List[Tuple[str, str, Array]],
            outputs: List[Tuple[str, str, jax.ShapeDtypeStruct]],
            scratch: List[Tuple[str, Any]], masks: _MaskArrays, aliases=None,
            sparse: Optional[Tuple[Array, Array, Array]] = None):
  """Runs `kernel` over `grid` with named, kind-specified inputs, outputs and scratch;
  `sparse`: the pass's block-sparse scalars, prefetched after the lengths."""
  spec = lambda kind, shape: _block_spec(kind, shape, block_q, block_k, coords_of)
  names = tuple(n for n, _, _ in inputs) + tuple(n for n, _, _ in outputs) + tuple(
      n for n, _ in scratch)
  input_names = [n for n, _, _ in inputs]
  scalars = (masks.q_lengths, masks.kv_lengths) + (sparse or ())
  # Flat input indices count the scalar-prefetched arrays first.
  io_aliases = {} if aliases is None else {
      len(scalars) + input_names.index(src): [n for n, _, _ in outputs].index(dst)
      for src, dst in aliases.items()}
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=len(scalars), grid=grid,
      in_specs=[spec(kind, x.shape) for _, kind, x in inputs],
      out_specs=[spec(kind, s.shape) for _, kind, s in outputs],
      scratch_shapes=[shape for _, shape in scratch])
  return pl.pallas_call(
      functools.partial(kernel, cfg=cfg, names=names, num_steps=grid[-1]),
      grid_spec=grid_spec,
      out_shape=[s for _, _, s in outputs],
      compiler_params=pltpu.CompilerParams(dimension_semantics=semantics),
      input_output_aliases=io_aliases,
      interpret=cfg.interpret,
  )(*scalars, *(x for _, _, x in inputs))


def _query_major_grid(cfg: _Static, batch: int, num_heads: int, block_q: int, block_k: int):
  """Grid (B, H, query blocks, key steps) and its coords function."""
  num_q_blocks, num_kv_blocks = cfg.q_len // block_q, cfg.kv_len // block_k
  steps = cfg.sparse_steps[0] if cfg.pattern is not None else _band_steps(
      num_q_blocks, lambda i: common.kv_block_range(i, block_q, block_k, num_kv_blocks,
                                                    cfg.reach))
  coords_of = functools.partial(_query_major_coords, cfg, block_q, block_k)
  grid = (batch, num_heads, num_q_blocks, steps)
  return grid, ("parallel", "parallel", "parallel", "arbitrary"), coords_of


def _forward(cfg: _Static, q, k, v, bias, x: common.FlexArrays, masks: _MaskArrays):
  """out `[B, H, Tq', Dv]` (query dtype) and lse `[B, H, Tq']` float32."""
  batch, num_heads, _, _ = q.shape
  value_dim = v.shape[-1]
  bq, bk = cfg.block_q, cfg.block_k
  grid, semantics, coords_of = _query_major_grid(cfg, batch, num_heads, bq, bk)
  inputs = [("q", "q", q), ("k", "kv", k), ("v", "kv", v)] + _mask_operands(cfg, bias, masks)
  inputs += _flex_operands(x)
  outputs = [("out", "q", jax.ShapeDtypeStruct(q.shape[:3] + (value_dim,), q.dtype)),
             ("lse", "row_stat", jax.ShapeDtypeStruct(q.shape[:3] + (LANES,), jnp.float32))]
  scratch = [("row_max", pltpu.VMEM((bq, LANES), jnp.float32)),
             ("row_sum", pltpu.VMEM((bq, LANES), jnp.float32)),
             ("acc", pltpu.VMEM((bq, value_dim), jnp.float32))]
  out, lse = _pallas(_forward_kernel, cfg, grid, semantics, coords_of, bq, bk, inputs, outputs,
                     scratch, masks, sparse=masks.by_query)
  # The kernel writes the lse lane-replicated; one lane is kept (and saved for the
  # backward pass, which replicates it again for its kernels).
  return out, lse[..., 0]


def _backward(cfg: _Static, q, k, v, bias, x: common.FlexArrays, masks: _MaskArrays, lse, d_out,
              delta):
  """Gradients of q, k, v, bias (None without one) and of `x` (the sinks and
  the score_mod's floating arrays).

  lse, delta: `[B, H, Tq']` float32 (delta as `common.flash_attention_vjp` gives it).
  """
  batch, num_heads, _, head_dim = q.shape
  num_kv_heads, value_dim = k.shape[1], v.shape[-1]
  lse, delta = _lane_replicated(lse), _lane_replicated(delta)
  common_inputs = [("q", "q", q), ("k", "kv", k), ("v", "kv", v), ("do", "q", d_out),
                   ("lse", "row_stat", lse), ("delta", "row_stat", delta)]
  common_inputs += _mask_operands(cfg, bias, masks) + _flex_operands(x)

  # dq (and ds for the bias): query blocks outer, key blocks along the last axis.
  bq, bk = cfg.block_q, cfg.block_k
  grid, semantics, coords_of = _query_major_grid(cfg, batch, num_heads, bq, bk)
  inputs, outputs = list(common_inputs), [("dq", "q", jax.ShapeDtypeStruct(q.shape, q.dtype))]
  aliases = None
  if bias is not None:
    ds_shape = (batch, num_heads, cfg.q_len, cfg.kv_len)
    # Blocks outside every band are never written: they keep these zeros.
    inputs.append(("ds_zeros", "untouched", jnp.zeros(ds_shape, jnp.float32)))
    outputs.append(("ds", "pairwise", jax.ShapeDtypeStruct(ds_shape, jnp.float32)))
    aliases = {"ds_zeros": "ds"}
  # The score_mod's floating arrays: one partial gradient per program, summed below.
  num_q_blocks = cfg.q_len // bq
  outputs += [(f"d_float_const{i}", "d_const",
               jax.ShapeDtypeStruct((batch, num_heads, num_q_blocks, 1, c.size), jnp.float32))
              for i, c in enumerate(x.score_consts)]
  scratch = [("dq_acc", pltpu.VMEM((bq, head_dim), jnp.float32))]
  dq, *rest = _pallas(_dq_kernel, cfg, grid, semantics, coords_of, bq, bk, inputs, outputs,
                      scratch, masks, aliases, sparse=masks.by_query)
  ds, d_consts = rest[:1 if bias is not None else 0], rest[1 if bias is not None else 0:]

  # dk, dv: key blocks outer; the query heads of the group, then query blocks, inner.
  bq, bk = cfg.block_q_dkv, cfg.block_k_dkv
  num_q_blocks, num_kv_blocks = cfg.q_len // bq, cfg.kv_len // bk
  steps = cfg.sparse_steps[1] if cfg.pattern is not None else _band_steps(
      num_kv_blocks, lambda j: common.q_block_range(j, bq, bk, num_q_blocks, cfg.reach))
  grid = (batch, num_kv_heads, num_kv_blocks, cfg.group, steps)
  semantics = ("parallel", "parallel", "parallel", "arbitrary", "arbitrary")
  coords_of = functools.partial(_key_major_coords, cfg, bq, bk)
  outputs = [("dk", "kv", jax.ShapeDtypeStruct(k.shape, k.dtype)),
             ("dv", "kv", jax.ShapeDtypeStruct(v.shape, v.dtype))]
  scratch = [("dk_acc", pltpu.VMEM((bk, head_dim), jnp.float32)),
             ("dv_acc", pltpu.VMEM((bk, value_dim), jnp.float32))]
  dk, dv = _pallas(_dkv_kernel, cfg, grid, semantics, coords_of, bq, bk, common_inputs, outputs,
                   scratch, masks, sparse=masks.by_key)

  d_bias = None
  if bias is not None:
    d_bias = common.sum_to_shape(ds[0], bias.shape).astype(bias.dtype)
  d_sinks = None
  if x.sinks is not None:
    # The sink's probability exp(sink - lse) meets dP = 0 (it has no value):
    # dS = p_sink (0 - delta), summed over the rows each head's sink serves
    # (rows left empty, past the query length, have none).
    lse = lse[..., 0]
    p_sink = jnp.where(lse == common.EMPTY_ROW_LSE, 0.0,
                       jnp.exp(x.sinks[None, :, None].astype(jnp.float32) - lse))
    d_sinks = -jnp.sum(p_sink * delta[..., 0], axis=(0, 2)).astype(x.sinks.dtype)
  d_consts = tuple(d.sum(axis=(0, 1, 2)).reshape(c.shape).astype(c.dtype)
                   for d, c in zip(d_consts, x.score_consts))
  return dq, dk, dv, d_bias, common.FlexArrays(d_sinks, d_consts)


def _lane_replicated(x: Array) -> Array:
  """`[.., T]` as `[.., T, 128]`: the layout of the kernels' row statistics."""
  return jnp.broadcast_to(x[..., None], x.shape + (LANES,))


# (q, k, v, bias, common.FlexArrays) are differentiated, _MaskArrays is not.
_attention = common.flash_attention_vjp(_forward, _backward)


# ----------------------------------------------------------------------------
# Public API.


def default_block_sizes_tpu(head_dim: int, dtype) -> common.BlockSizes:
  """Blocks that keep a kernel's working set inside the default scoped VMEM (16 MiB).

  The largest live values are the `(block_q, block_k)` float32 logits and their
  gradients (4 of them in the backward pass) plus double-buffered `(block, D)`
  tiles, so wide heads and float32 inputs get smaller blocks: 512 x 512 for
  bfloat16 with D <= 128, down to 128 x 256 for float32 with D > 128. These are
  estimates, not measurements on a TPU. The dk/dv pass uses the same blocks.
  """
  wide = head_dim > 128
  narrow_dtype = jnp.dtype(dtype).itemsize <= 2
  block_k = 256 if wide else 512
  block_q = block_k if narrow_dtype else block_k // 2
  return common.BlockSizes(block_q=block_q, block_k=block_k)


def tpu_rejects(inputs: AttentionInputs,
                       block_sizes: Optional[common.BlockSizes] = None) -> Optional[str]:
  """Why the kernel cannot take `inputs` (and `block_sizes`), or None when it can.

  Usable as the `rejects` of `register_implementation`.
  """
  for name in ("query", "key", "value"):
    dtype = getattr(inputs, name).dtype
    if dtype not in SUPPORTED_DTYPES:
      return (f"pallas TPU flash attention supports float32 and bfloat16 inputs, got {name} of "
              f"dtype {dtype}.")
  if not inputs.query.dtype == inputs.key.dtype == inputs.value.dtype:
    return (f"query, key and value must share one dtype, got {inputs.query.dtype}, "
            f"{inputs.key.dtype} and {inputs.value.dtype}.")
  head_dim, value_dim = inputs.query.shape[-1], inputs.value.shape[-1]
  if max(head_dim, value_dim) > MAX_HEAD_DIM:
    return (f"pallas TPU flash attention supports head dims up to {MAX_HEAD_DIM}, got "
            f"query/key head dim {head_dim} and value head dim {value_dim}.")
  if block_sizes is None:
    return None
  block_q_dkv, block_k_dkv = block_sizes.dkv
  for name, value, multiple in (("block_q", block_sizes.block_q, QUERY_BLOCK_MULTIPLE),
                                ("block_q_dkv", block_q_dkv, QUERY_BLOCK_MULTIPLE),
                                ("block_k", block_sizes.block_k, KEY_BLOCK_MULTIPLE),
                                ("block_k_dkv", block_k_dkv, KEY_BLOCK_MULTIPLE)):
    if value % multiple:
      return (f"BlockSizes.{name} must be a multiple of {multiple} for the TPU kernel (query "
              f"blocks: multiples of {QUERY_BLOCK_MULTIPLE}, key blocks: of "
              f"{KEY_BLOCK_MULTIPLE}), got {value}.")
  return None


def _interpret_mode(interpret):
  """pallas_call's `interpret`: TPU interpret mode off a TPU unless told otherwise."""
  if isinstance(interpret, pltpu.InterpretParams):
    return interpret
  if interpret is None:
    interpret = jax.default_backend() != "tpu"
  return pltpu.InterpretParams() if interpret else False


def flash_attention_tpu(inputs: AttentionInputs,
                        block_sizes: Optional[common.BlockSizes] = None, *,
                        interpret: Optional[bool] = None, return_residual: bool = False,
                        pattern: Union[None, patterns.Pattern, mods.LiftedMod] = None,
                        block_layout: Optional[Array] = None,
                        max_visits: Optional[Tuple[int, int]] = None,
                        mask_consts: Tuple[Array, ...] = (),
                        score_mod: Optional[mods.LiftedMod] = None,
                        score_consts: Tuple[Array, ...] = (),
                        softcap: Optional[float] = None,
                        sinks: Optional[Array] = None
                        ) -> Union[Array, Tuple[Array, Array]]:
  """Exact attention over `inputs` with the Pallas TPU kernels: `[B, Tq, H, Dv]`.

  Args:
    inputs: validated arguments of `attention_jax.dot_product_attention`.
    block_sizes: `default_block_sizes_tpu(D, dtype)` when None; see the module
      docstring for the rule they must follow.
    interpret: run in TPU interpret mode (on CPU); None: when the default
      backend is not a TPU. A `pltpu.InterpretParams` is passed on as is (to
      shuffle the parallel grid axes, say).
    return_residual: also return the log-sum-exp `[B, Tq, H]` float32
      (differentiable; `common.EMPTY_ROW_LSE` where a query attends nothing).
    pattern, block_layout, max_visits: block-sparse attention (block_sparse.py,
      flex_attention): the mask mod evaluated in PARTIAL blocks (a static
      pattern, or a `mods.LiftedMod` closing over `mask_consts`), its
      `[H|1, nq, nk]` or `[B|1, H|1, nq, nk]` layout for `block_sizes` (one
      size for both passes, fitting the sequences as given), and the most
      blocks a query block and a key block visit (the grids' last axes; the
      full counts for a traced layout). Each program follows its own (batch
      row, head)'s blocks.
    score_mod, score_consts, softcap, sinks: flex_attention (kernels/
      flash_attention/flex.py): the logits soft-capped, then the lifted
      score_mod over its arrays (differentiated where floating), on each tile
      inside the kernels; `[H]` sink logits in the normaliser.
  """
  query, key, value = inputs.query, inputs.key, inputs.value
  batch, q_len, num_heads, head_dim = query.shape
  kv_len, num_kv_heads = key.shape[1], key.shape[2]
  if block_sizes is None:
    block_sizes = default_block_sizes_tpu(head_dim, query.dtype)
  reason = tpu_rejects(inputs, block_sizes)
  if reason is not None:
    raise ValueError(reason)
  empty = attention_of_empty_sequence(inputs, return_residual)  # Tq = 0 or Tk = 0
  if empty is not None:
    return empty

  fit = lambda block, length, multiple: min(block, _round_up(length, multiple))
  bq_dkv, bk_dkv = block_sizes.dkv
  bq, bq_dkv = (fit(b, q_len, QUERY_BLOCK_MULTIPLE) for b in (block_sizes.block_q, bq_dkv))
  bk, bk_dkv = (fit(b, kv_len, KEY_BLOCK_MULTIPLE) for b in (block_sizes.block_k, bk_dkv))
  q_multiple, kv_multiple = math.lcm(bq, bq_dkv), math.lcm(bk, bk_dkv)
  cfg = _Static(block_q=bq, block_k=bk, block_q_dkv=bq_dkv, block_k_dkv=bk_dkv,
                q_len=_round_up(q_len, q_multiple), kv_len=_round_up(kv_len, kv_multiple),
                group=num_heads // num_kv_heads, scale=float(inputs.scale),
                reach=common.reach_of(inputs.is_causal, inputs.local_window_size),
                interpret=_interpret_mode(interpret))
  sparse = {}
  if block_layout is not None:
    if (bq, bk) != (block_sizes.block_q, block_sizes.block_k) or (bq_dkv, bk_dkv) != (bq, bk):
      raise ValueError(f"block-sparse attention needs one block size for both passes, no "
                       f"longer than the sequences; got {block_sizes} for "
                       f"Tq={q_len}, Tk={kv_len}.")
    if block_layout.ndim == 3:  # [H|1, nq, nk]: the same for every batch row
      block_layout = block_layout[None]
    if max_visits is None:  # every block of a row: the grids' longest possible axes
      max_visits = block_layout.shape[3], block_layout.shape[2]
    cfg = dataclasses.replace(cfg, pattern=pattern, pattern_batch=block_layout.shape[0],
                              pattern_heads=block_layout.shape[1],
                              sparse_steps=tuple(max(1, int(n)) for n in max_visits))
    sparse = dict(by_query=_flat_visit_lists(block_layout),
                  by_key=_flat_visit_lists(block_layout.swapaxes(2, 3)),
                  mask_consts=(tuple(map(_smem_array, mask_consts))
                               if isinstance(pattern, mods.LiftedMod) else ()))

  # [B, T, H, D] -> [B, H, T, D], padded to whole blocks.
  q = common.pad_axis(query.transpose(0, 2, 1, 3), 2, q_multiple)
  k = common.pad_axis(key.transpose(0, 2, 1, 3), 2, kv_multiple)
  v = common.pad_axis(value.transpose(0, 2, 1, 3), 2, kv_multiple)
  bias = inputs.bias
  if bias is not None:
    if bias.dtype not in SUPPORTED_DTYPES:
      bias = bias.astype(jnp.float32)
    bias = _pad_pairwise(bias, q_multiple, kv_multiple)
  # flex_attention: the mods' arrays whole, floating score_mod arrays differentiated.
  float_consts, other_consts = (), ()
  if score_mod is not None:
    float_consts, other_consts = score_mod.split(score_consts)
  cfg = dataclasses.replace(cfg, softcap=None if softcap is None else float(softcap),
                            score_mod=score_mod, has_sinks=sinks is not None)
  # The floating ones (differentiated) as `[1, n]` values; the others flat in SMEM.
  masks = dataclasses.replace(_mask_arrays(inputs, q_multiple, kv_multiple), **sparse,
                              score_consts=tuple(map(_smem_array, other_consts)))
  x = common.FlexArrays(sinks=None if sinks is None else jnp.asarray(sinks, jnp.float32),
                        score_consts=tuple(jnp.reshape(c, (1, -1)) for c in float_consts))

  out, lse = _attention(cfg, (q, k, v, bias, x), masks)  # [B, H, Tq', Dv], [B, H, Tq']
  return common.attention_outputs(out[:, :, :q_len].transpose(0, 2, 1, 3),
                                  lse[:, :, :q_len].transpose(0, 2, 1),
                                  inputs.query_seq_lengths, return_residual)


def _smem_array(x: Array) -> Array:
  """A mod's array as an SMEM operand: flattened, in 32 bits (SMEM's word)."""
  x = jnp.asarray(x).reshape(-1)
  if jnp.issubdtype(x.dtype, jnp.inexact):
    return x.astype(jnp.float32)
  return x.astype(jnp.int32)


def _pad_pairwise(x: Array, q_multiple: int, kv_multiple: int) -> Array:
  """A bias or mask `[B|1, H|1, Tq|1, Tk|1]` padded to whole blocks (size-1 axes stay)."""
  return common.pad_axis(common.pad_axis(x, 2, q_multiple, broadcast=True), 3, kv_multiple,
                         broadcast=True)


def _mask_arrays(inputs: AttentionInputs, q_multiple: int, kv_multiple: int) -> _MaskArrays:
  """The masking inputs in the kernels' layouts."""
  batch, q_len = inputs.query.shape[:2]
  kv_len = inputs.key.shape[1]
  lengths = lambda given, full: (jnp.full((batch,), full, jnp.int32) if given is None
                                 else jnp.minimum(jnp.asarray(given, jnp.int32), full))
  mask = inputs.mask
  if mask is not None:
    mask = _pad_pairwise(mask.astype(jnp.int8), q_multiple, kv_multiple)
  q_ids = kv_ids = None
  if inputs.q_segment_ids is not None:
    # Edge padding keeps the id ranges of the last block tight (padding is masked anyway).
    pad_ids = lambda ids, length, multiple: jnp.pad(
        ids.astype(jnp.int32), ((0, 0), (0, _round_up(length, multiple) - length)), mode="edge")
    q_ids = pad_ids(inputs.q_segment_ids, q_len, q_multiple)
    kv_ids = pad_ids(inputs.kv_segment_ids, kv_len, kv_multiple)
    q_ids = jnp.broadcast_to(q_ids[:, :, None], q_ids.shape + (LANES,))
    kv_ids = jnp.broadcast_to(kv_ids[:, None, :], (batch, SUBLANES, kv_ids.shape[1]))
  return _MaskArrays(q_lengths=lengths(inputs.query_seq_lengths, q_len),
                     kv_lengths=lengths(inputs.key_value_seq_lengths, kv_len),
                     mask=mask, q_segment_ids=q_ids, kv_segment_ids=kv_ids)


def _round_up(n: int, multiple: int) -> int:
  return common.cdiv(n, multiple) * multiple


def tpu_dot_product_attention(query, key, value, bias=None, mask=None, *,
                              block_sizes: Optional[common.BlockSizes] = None,
                              interpret: Optional[bool] = None,
                              return_residual: bool = False, **kwargs):
  """`attention_jax.dot_product_attention` with the Pallas TPU kernels.

  Takes every argument of `dot_product_attention` except `implementation`, plus
  `block_sizes` and `interpret` (see `flash_attention_tpu`).
  """
  inputs, unbatched = prepare_inputs(query, key, value, bias, mask, **kwargs)
  return returned_outputs(flash_attention_tpu(inputs, block_sizes, interpret=interpret,
                                              return_residual=return_residual), unbatched)
