"""Flash attention as Pallas Mosaic GPU kernels (NVIDIA Hopper): forward and backward.

The Triton kernels (`pallas_gpu.py`) run on every NVIDIA GPU; these are
written for Hopper's own units: TMA copies stream blocks into shared memory
through `plgpu.emit_pipeline` (the copy of step j+1 in flight while step j
computes) and every matrix product is a warpgroup MMA (`plgpu.wgmma`) from
shared memory into a float32 accumulator. A CTA is one warpgroup owning 64
rows: query rows in the forward and dq passes (a pipeline over the key blocks
they see), key rows in the dk/dv pass (a pipeline over the query blocks that
see them). The backward recomputes each block's probabilities from the saved
log-sum-exp; dk/dv are computed per query head and summed over the group.

Layout. Each product reads its operands as they lie in shared memory, so a
block that is the right-hand operand transposed comes from an array
transposed once in HBM (O(T*D) each, against the O(T^2*D) of the kernels):
K^T and V^T `[B, Hkv, D, Tk']` (S = Q K^T, dP = dO V^T) and Q^T, dO^T
`[B, H, D, Tq']` (S^T = K Q^T, dP^T = V dO^T, in the dk/dv pass). Mosaic GPU
could transpose a shared-memory operand for free on hardware, but the Pallas
GPU interpreter (how these kernels are tested without a GPU) cannot apply
`transpose_ref` to a wgmma operand; this keeps one code path for both. For the
same reason probabilities and their gradients are staged in shared memory for
the second product rather than fed to wgmma from registers. Everything else
(q, k, v, d_out and the outputs) is read and written in place in `[B, T, H, D]`.

What they take (everything else is `mgpu_rejects`' reason and stays with the
Triton kernels): 16-bit inputs, head dims that are multiples of 64 up to 256
with Dv == D, causal and sliding-window masks (blocks outside the reach are
never loaded), `key_value_seq_lengths` (masked by position; the key loop stops
at the batch's length), `query_seq_lengths` (zeroed after the kernel), grouped
K/V heads, any scale, lengths that are not multiples of the blocks (zero
padding, masked by position). A query that may attend to nothing gets output
0, lse `common.EMPTY_ROW_LSE` (finite) and zero gradients.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional, Tuple, Union

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from attention_jax.core import masks as mask_lib
from attention_jax.core.inputs import (AttentionInputs, attention_of_empty_sequence,
                                       prepare_inputs, returned_outputs)

from . import common, pallas_gpu

Array = jnp.ndarray

SUPPORTED_DTYPES = (jnp.bfloat16, jnp.float16)
HEAD_DIM_MULTIPLE = 64  # one 128-byte swizzle row of 16-bit values
MAX_HEAD_DIM = 256
BLOCK_Q = 64  # wgmma's M: one warpgroup's rows
BLOCK_MULTIPLE = 64
DQ_BLOCK_K = 64  # the dq pass streams three key-side operands: 64 keys a step
SHARED_MEMORY_BYTES = 227 * 1024  # what one CTA may opt into on an H100
_SWIZZLE_BYTES = 128
_LOG2_E = math.log2(math.e)


def _smem_transforms(dtype) -> tuple:
  """The tiling and swizzle every wgmma operand in shared memory carries."""
  elements = _SWIZZLE_BYTES // jnp.dtype(dtype).itemsize
  return (plgpu.TilingTransform((8, elements)), plgpu.SwizzleTransform(_SWIZZLE_BYTES))


@dataclasses.dataclass(frozen=True)
class _Config:
  """Everything about a call that is fixed at trace time."""

  block_q: int  # forward and dq: query rows of a CTA (one warpgroup)
  block_k: int  # forward and dq: keys of a pipeline step
  block_q_dkv: int  # dk/dv: queries of a pipeline step
  block_k_dkv: int  # dk/dv: key rows of a CTA (one warpgroup)
  q_len: int  # padded Tq
  kv_len: int  # padded Tk
  true_kv_len: int
  group: int
  scale: float
  reach: common.Reach
  has_kv_lengths: bool
  max_concurrent_steps: int
  interpret: bool


# ---------------------------------------------------------------------------
# Pieces every kernel uses.
# ---------------------------------------------------------------------------


def _matmul(lhs_smem, rhs_smem, shape):
  """`lhs @ rhs` of two shared-memory operands as one wgmma: float32 `shape`."""

  def product(acc_ref):
    plgpu.wgmma(acc_ref, lhs_smem, rhs_smem)
    return acc_ref[...]

  return pl.run_scoped(product, plgpu.ACC(shape, jnp.float32))


def _stage(smem, x):
  """Writes registers to shared memory for a wgmma or a TMA store to read."""
  smem[...] = x.astype(smem.dtype)
  plgpu.commit_smem()


def _kv_limit(cfg: _Config, kv_lengths_ref, batch):
  """Keys at or past this position are masked: the true Tk or the batch's length."""
  limit = jnp.int32(cfg.true_kv_len)
  if cfg.has_kv_lengths:
    limit = jnp.minimum(limit, kv_lengths_ref[batch])
  return limit


def _steps(lo, hi, num_blocks):
  """(first block, number of steps) of a pipeline over blocks [lo, hi).

  A block that sees nothing still runs one fully masked step, so that no
  pipeline has an empty grid; `lo` is clamped to a block that exists.
  """
  return jnp.minimum(lo, num_blocks - 1), jnp.maximum(hi - lo, 1)


def _kv_steps(cfg: _Config, q_block, block_q: int, block_k: int, kv_limit):
  """The key blocks a query block sees (causal, window, length)."""
  num_blocks = cfg.kv_len // block_k
  lo, hi = common.kv_block_range(q_block, block_q, block_k, num_blocks, cfg.reach)
  return _steps(lo, jnp.minimum(hi, (kv_limit + block_k - 1) // block_k), num_blocks)


def _q_steps(cfg: _Config, kv_block, block_q: int, block_k: int, kv_limit):
  """The query blocks that see a key block (none when it lies past the length)."""
  num_blocks = cfg.q_len // block_q
  lo, hi = common.q_block_range(kv_block, block_q, block_k, num_blocks, cfg.reach)
  return _steps(lo, jnp.where(kv_block * block_k < kv_limit, hi, lo), num_blocks)


def _allowed(q_pos, k_pos, kv_limit, reach):
  return mask_lib.and_masks(mask_lib.length_predicate(k_pos, kv_limit),
                            mask_lib.reach_predicate(q_pos, k_pos, reach))


def _positions(start, shape, axis):
  return start + lax.broadcasted_iota(jnp.int32, shape, axis)


def _pipeline_slots(cfg: _Config, fixed_bytes: int, bytes_per_slot: int, kernel: str) -> int:
  """As many pipeline slots as fit next to the fixed buffers, up to `max_concurrent_steps`.

  Lowering refuses a kernel over the SM's shared memory; choosing here keeps
  any legal block size compiling (with less overlap) and names the blocks
  when even one slot does not fit.
  """
  slots = cfg.max_concurrent_steps
  while slots > 1 and fixed_bytes + slots * bytes_per_slot > SHARED_MEMORY_BYTES:
    slots -= 1
  if fixed_bytes + bytes_per_slot > SHARED_MEMORY_BYTES:
    raise ValueError(
        f"the Mosaic GPU {kernel} kernel needs {fixed_bytes + bytes_per_slot} bytes of shared "
        f"memory at block_q={cfg.block_q}, block_k={cfg.block_k}, block_q_dkv="
        f"{cfg.block_q_dkv}, more than the {SHARED_MEMORY_BYTES} of a Hopper SM; use smaller "
        "key/query steps.")
  return slots


def _launch(kernel, cfg: _Config, slots: int, out_type, grid, grid_names, scratch_types):
  return plgpu.kernel(
      functools.partial(kernel, cfg=cfg, slots=slots), out_type=out_type, grid=grid,
      grid_names=grid_names,
      scratch_types=scratch_types,
      compiler_params=plgpu.CompilerParams(
          lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
      interpret=_interpret_params() if cfg.interpret else None)


def _interpret_params():
  """The Pallas GPU interpreter's settings (JAX 0.10 has no public name for them)."""
  try:
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    raise NotImplementedError(
        f"interpreting the Mosaic GPU kernels needs the Pallas GPU interpreter (JAX >= 0.10), "
        f"not found in JAX {jax.__version__}; run them on a Hopper GPU instead.") from e
  return InterpretGPUParams()


def _row_block_spec(rows: int, cols: int, dtype, row_of_step):
  """A `[rows, cols]` wgmma operand whose block along axis 0 moves with the step."""
  return plgpu.BlockSpec((rows, cols), lambda j: (row_of_step(j), 0),
                         transforms=_smem_transforms(dtype))


def _col_block_spec(rows: int, cols: int, dtype, col_of_step):
  """A `[rows, cols]` wgmma operand whose block along axis 1 moves with the step."""
  return plgpu.BlockSpec((rows, cols), lambda j: (0, col_of_step(j)),
                         transforms=_smem_transforms(dtype))


# ---------------------------------------------------------------------------
# Kernels.
# ---------------------------------------------------------------------------


def _forward_kernel(q_ref, k_t_ref, v_ref, kv_lengths_ref, out_ref, lse_ref,
                    q_smem, probs_smem, lse_smem, barriers, *, cfg: _Config,
                    slots: int):
  """One block of 64 queries of one head: out `[64, D]`, lse `[64]`.

  GMEM refs: q `[B, Tq', H, D]`, k_t `[B, Hkv, D, Tk']`, v `[B, Tk', Hkv, D]`,
  kv_lengths `[B]` int32 (zeros when the call has none), out like q,
  lse `[B, H, Tq']` float32 (natural log).
  """
  bq, bk = cfg.block_q, cfg.block_k
  q_block, head, batch = (lax.axis_index(n) for n in ("q_blocks", "heads", "batch"))
  kv_head = lax.div(head, jnp.int32(cfg.group))
  q_start = q_block * bq
  head_dim = q_smem.shape[-1]
  plgpu.copy_gmem_to_smem(q_ref.at[batch, pl.ds(q_start, bq), head], q_smem, barriers.at[0])
  kv_limit = _kv_limit(cfg, kv_lengths_ref, batch)
  lo, num_steps = _kv_steps(cfg, q_block, bq, bk, kv_limit)
  # Logits are kept in base 2 (scale * log2 e folded in) so each probability is one exp2.
  logit_scale = cfg.scale * _LOG2_E

  def step(indices, k_t_smem, v_smem, carry):
    acc, row_max, row_sum = carry
    k_start = (lo + indices[0]) * bk
    logits = _matmul(q_smem, k_t_smem, (bq, bk)) * logit_scale
    allowed = _allowed(_positions(q_start, (bq, bk), 0), _positions(k_start, (bq, bk), 1),
                       kv_limit, cfg.reach)
    logits = jnp.where(allowed, logits, -jnp.inf)
    new_max = jnp.maximum(row_max, logits.max(axis=1))
    # A row with nothing allowed so far keeps max -inf; exponentiate against 0 then.
    safe_max = jnp.where(new_max == -jnp.inf, 0.0, new_max)
    probs = jnp.exp2(logits - lax.broadcast_in_dim(safe_max, logits.shape, [0]))
    correction = jnp.exp2(row_max - safe_max)
    row_sum = row_sum * correction + probs.sum(axis=1)
    _stage(probs_smem, probs)
    block_out = _matmul(probs_smem, v_smem, (bq, head_dim))
    acc = acc * lax.broadcast_in_dim(correction, acc.shape, [0]) + block_out
    return acc, new_max, row_sum

  dtype = q_smem.dtype
  pipeline = plgpu.emit_pipeline(
      step, grid=(num_steps,),
      in_specs=[_col_block_spec(head_dim, bk, dtype, lambda j: lo + j),
                _row_block_spec(bk, head_dim, dtype, lambda j: lo + j)],
      max_concurrent_steps=slots,
      init_carry=(jnp.zeros((bq, head_dim), jnp.float32),
                  jnp.full((bq,), -jnp.inf, jnp.float32),
                  jnp.zeros((bq,), jnp.float32)))
  plgpu.barrier_wait(barriers.at[0])
  acc, row_max, row_sum = pipeline(k_t_ref.at[batch, kv_head], v_ref.at[batch, :, kv_head, :])

  empty = row_sum == 0.0  # nothing to attend: output 0, lse -inf
  safe_sum = jnp.where(empty, 1.0, row_sum)
  # The query block's shared memory is free again: it stages the output.
  _stage(q_smem, acc / lax.broadcast_in_dim(safe_sum, acc.shape, [0]))
  _stage(lse_smem, jnp.where(empty, common.EMPTY_ROW_LSE,
                             (row_max + jnp.log2(safe_sum)) / _LOG2_E))
  plgpu.copy_smem_to_gmem(q_smem, out_ref.at[batch, pl.ds(q_start, bq), head])
  plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[batch, head, pl.ds(q_start, bq)])
  plgpu.wait_smem_to_gmem(0)


def _dq_kernel(q_ref, do_ref, k_ref, k_t_ref, v_t_ref, lse_ref, delta_ref, kv_lengths_ref,
               dq_ref, q_smem, do_smem, d_logits_smem, lse_smem, delta_smem, barriers, *,
               cfg: _Config, slots: int):
  """dq `[64, D]` of one block of 64 queries of one head.

  GMEM refs: q, d_out `[B, Tq', H, D]`; k `[B, Tk', Hkv, D]`; k_t, v_t
  `[B, Hkv, D, Tk']`; lse and delta `[B, H, Tq']` float32; dq like q.
  """
  bq, bk = cfg.block_q, DQ_BLOCK_K
  q_block, head, batch = (lax.axis_index(n) for n in ("q_blocks", "heads", "batch"))
  kv_head = lax.div(head, jnp.int32(cfg.group))
  q_start = q_block * bq
  head_dim = q_smem.shape[-1]
  rows = pl.ds(q_start, bq)
  for i, (src, dst) in enumerate(((q_ref.at[batch, rows, head], q_smem),
                                  (do_ref.at[batch, rows, head], do_smem),
                                  (lse_ref.at[batch, head, rows], lse_smem),
                                  (delta_ref.at[batch, head, rows], delta_smem))):
    plgpu.copy_gmem_to_smem(src, dst, barriers.at[i])
  kv_limit = _kv_limit(cfg, kv_lengths_ref, batch)
  lo, num_steps = _kv_steps(cfg, q_block, bq, bk, kv_limit)
  logit_scale = cfg.scale * _LOG2_E
  for i in range(4):
    plgpu.barrier_wait(barriers.at[i])
  # A row that attends nothing has lse EMPTY_ROW_LSE, which overflows to -inf here;
  # none of its pairs is `allowed`, so its probabilities are 0 all the same.
  lse = lax.broadcast_in_dim(lse_smem[...] * _LOG2_E, (bq, bk), [0])
  delta = lax.broadcast_in_dim(delta_smem[...], (bq, bk), [0])

  def step(indices, k_t_smem, v_t_smem, k_smem, dq):
    k_start = (lo + indices[0]) * bk
    logits = _matmul(q_smem, k_t_smem, (bq, bk)) * logit_scale
    allowed = _allowed(_positions(q_start, (bq, bk), 0), _positions(k_start, (bq, bk), 1),
                       kv_limit, cfg.reach)
    probs = jnp.where(allowed, jnp.exp2(logits - lse), 0.0)
    d_probs = _matmul(do_smem, v_t_smem, (bq, bk))
    _stage(d_logits_smem, probs * (d_probs - delta))
    return dq + _matmul(d_logits_smem, k_smem, (bq, head_dim))

  dtype = q_smem.dtype
  pipeline = plgpu.emit_pipeline(
      step, grid=(num_steps,),
      in_specs=[_col_block_spec(head_dim, bk, dtype, lambda j: lo + j),
                _col_block_spec(head_dim, bk, dtype, lambda j: lo + j),
                _row_block_spec(bk, head_dim, dtype, lambda j: lo + j)],
      max_concurrent_steps=slots,
      init_carry=jnp.zeros((bq, head_dim), jnp.float32))
  dq = pipeline(k_t_ref.at[batch, kv_head], v_t_ref.at[batch, kv_head],
                k_ref.at[batch, :, kv_head, :])
  _stage(q_smem, dq * cfg.scale)
  plgpu.copy_smem_to_gmem(q_smem, dq_ref.at[batch, rows, head])
  plgpu.wait_smem_to_gmem(0)


def _dkv_kernel(k_ref, v_ref, q_ref, q_t_ref, do_ref, do_t_ref, lse_ref, delta_ref,
                kv_lengths_ref, dk_ref, dv_ref, k_smem, v_smem, probs_t_smem, d_logits_t_smem,
                barriers, *, cfg: _Config, slots: int):
  """dk and dv `[64, D]` of one block of 64 keys, as seen by one query head.

  Works on transposed blocks (keys along rows) so that every product reads
  its operands as they lie: S^T = K Q^T, dV = P^T dO, dP^T = V dO^T,
  dK = dS^T Q. GMEM refs: k, v `[B, Tk', Hkv, D]`; q, d_out `[B, Tq', H, D]`;
  q_t, d_out_t `[B, H, D, Tq']`; lse and delta `[B, H, Tq']`; dk, dv `[B, Tk', H, D]` float32 (summed over grouped
  heads by the caller).
  """
  bq, bk = cfg.block_q_dkv, cfg.block_k_dkv
  kv_block, head, batch = (lax.axis_index(n) for n in ("kv_blocks", "heads", "batch"))
  kv_head = lax.div(head, jnp.int32(cfg.group))
  k_start = kv_block * bk
  head_dim = k_smem.shape[-1]
  keys = pl.ds(k_start, bk)
  plgpu.copy_gmem_to_smem(k_ref.at[batch, keys, kv_head], k_smem, barriers.at[0])
  plgpu.copy_gmem_to_smem(v_ref.at[batch, keys, kv_head], v_smem, barriers.at[1])
  kv_limit = _kv_limit(cfg, kv_lengths_ref, batch)
  lo, num_steps = _q_steps(cfg, kv_block, bq, bk, kv_limit)
  logit_scale = cfg.scale * _LOG2_E

  def step(indices, q_t_smem, q_smem, do_t_smem, do_smem, lse_smem, delta_smem, carry):
    dk, dv = carry
    q_start = (lo + indices[0]) * bq
    logits_t = _matmul(k_smem, q_t_smem, (bk, bq)) * logit_scale
    allowed = _allowed(_positions(q_start, (bk, bq), 1), _positions(k_start, (bk, bq), 0),
                       kv_limit, cfg.reach)
    # (EMPTY_ROW_LSE overflows to -inf here; such rows have no `allowed` pair.)
    lse = lax.broadcast_in_dim(lse_smem[...] * _LOG2_E, (bk, bq), [1])
    probs_t = jnp.where(allowed, jnp.exp2(logits_t - lse), 0.0)
    _stage(probs_t_smem, probs_t)
    dv = dv + _matmul(probs_t_smem, do_smem, (bk, head_dim))
    d_probs_t = _matmul(v_smem, do_t_smem, (bk, bq))
    delta = lax.broadcast_in_dim(delta_smem[...], (bk, bq), [1])
    _stage(d_logits_t_smem, probs_t * (d_probs_t - delta))
    dk = dk + _matmul(d_logits_t_smem, q_smem, (bk, head_dim))
    return dk, dv

  dtype = k_smem.dtype
  block_of = lambda j: lo + j
  pipeline = plgpu.emit_pipeline(
      step, grid=(num_steps,),
      in_specs=[_col_block_spec(head_dim, bq, dtype, block_of),
                _row_block_spec(bq, head_dim, dtype, block_of),
                _col_block_spec(head_dim, bq, dtype, block_of),
                _row_block_spec(bq, head_dim, dtype, block_of),
                plgpu.BlockSpec((bq,), lambda j: (lo + j,)),
                plgpu.BlockSpec((bq,), lambda j: (lo + j,))],
      max_concurrent_steps=slots,
      init_carry=(jnp.zeros((bk, head_dim), jnp.float32),
                  jnp.zeros((bk, head_dim), jnp.float32)))
  plgpu.barrier_wait(barriers.at[0])
  plgpu.barrier_wait(barriers.at[1])
  dk, dv = pipeline(q_t_ref.at[batch, head], q_ref.at[batch, :, head, :],
                    do_t_ref.at[batch, head], do_ref.at[batch, :, head, :],
                    lse_ref.at[batch, head], delta_ref.at[batch, head])

  def write(dk_smem, dv_smem):
    # float32 staging lives only now, in the shared memory the pipeline released.
    _stage(dk_smem, dk * cfg.scale)
    _stage(dv_smem, dv)
    plgpu.copy_smem_to_gmem(dk_smem, dk_ref.at[batch, keys, head])
    plgpu.copy_smem_to_gmem(dv_smem, dv_ref.at[batch, keys, head])
    plgpu.wait_smem_to_gmem(0)

  pl.run_scoped(write, plgpu.SMEM((bk, head_dim), jnp.float32),
                plgpu.SMEM((bk, head_dim), jnp.float32))


# ---------------------------------------------------------------------------
# The passes, under `common.flash_attention_vjp`.
# ---------------------------------------------------------------------------


def _heads_major_transposed(x):
  """`[B, T, H, D]` -> `[B, H, D, T]`: the right-hand operand layout of a wgmma."""
  return jnp.transpose(x, (0, 2, 3, 1))


def _lengths_or_zeros(kv_lengths, batch: int):
  return jnp.zeros((batch,), jnp.int32) if kv_lengths is None else kv_lengths


def _forward(cfg: _Config, q, k, v, kv_lengths):
  """out `[B, Tq', H, D]` and lse `[B, Tq', H]` float32 of padded inputs."""
  batch, _, num_heads, head_dim = q.shape
  transforms = _smem_transforms(q.dtype)
  bq, bk, size = cfg.block_q, cfg.block_k, q.dtype.itemsize
  slots = _pipeline_slots(cfg, (bq * head_dim + bq * bk) * size + bq * 4,
                          2 * bk * head_dim * size, "forward")
  kernel = _launch(
      _forward_kernel, cfg, slots,
      out_type=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                jax.ShapeDtypeStruct((batch, num_heads, cfg.q_len), jnp.float32)],
      grid=(cfg.q_len // cfg.block_q, num_heads, batch),
      grid_names=("q_blocks", "heads", "batch"),
      scratch_types=[
          plgpu.SMEM((cfg.block_q, head_dim), q.dtype, transforms=transforms),
          plgpu.SMEM((cfg.block_q, cfg.block_k), q.dtype, transforms=transforms),
          plgpu.SMEM((cfg.block_q,), jnp.float32),
          plgpu.Barrier(num_barriers=1),
      ])
  out, lse = kernel(q, _heads_major_transposed(k), v, _lengths_or_zeros(kv_lengths, batch))
  # The kernels keep a query block's statistics contiguous ([B, H, Tq']); the
  # custom VJP wants them row by row, like out.
  return out, lse.transpose(0, 2, 1)


def _backward(cfg: _Config, q, k, v, kv_lengths, lse, d_out, delta):
  """Gradients of q, k and v (padded shapes, input dtypes).

  lse, delta: `[B, Tq', H]` float32 (delta as `common.flash_attention_vjp` gives it).
  """
  batch, _, num_heads, head_dim = q.shape
  dtype = q.dtype
  transforms = _smem_transforms(dtype)
  lse, delta = lse.transpose(0, 2, 1), delta.transpose(0, 2, 1)  # [B, H, Tq']
  d_out = d_out.astype(dtype)
  kv_lengths = _lengths_or_zeros(kv_lengths, batch)

  bq, bk, size = cfg.block_q, DQ_BLOCK_K, dtype.itemsize
  slots = _pipeline_slots(cfg, (2 * bq * head_dim + bq * bk) * size + 2 * bq * 4,
                          3 * bk * head_dim * size, "dq")
  dq = _launch(
      _dq_kernel, cfg, slots,
      out_type=jax.ShapeDtypeStruct(q.shape, dtype),
      grid=(cfg.q_len // bq, num_heads, batch), grid_names=("q_blocks", "heads", "batch"),
      scratch_types=[
          plgpu.SMEM((bq, head_dim), dtype, transforms=transforms),
          plgpu.SMEM((bq, head_dim), dtype, transforms=transforms),
          plgpu.SMEM((bq, bk), dtype, transforms=transforms),
          plgpu.SMEM((bq,), jnp.float32),
          plgpu.SMEM((bq,), jnp.float32),
          plgpu.Barrier(num_barriers=4),
      ])(q, d_out, k, _heads_major_transposed(k), _heads_major_transposed(v), lse, delta,
         kv_lengths)

  bq, bk = cfg.block_q_dkv, cfg.block_k_dkv
  # (The float32 staging of dk and dv comes after the pipeline, in its space.)
  slots = _pipeline_slots(cfg, (2 * bk * head_dim + 2 * bk * bq) * size,
                          4 * bq * head_dim * size + 2 * bq * 4, "dk/dv")
  grad_type = jax.ShapeDtypeStruct((batch, cfg.kv_len, num_heads, head_dim), jnp.float32)
  dk, dv = _launch(
      _dkv_kernel, cfg, slots,
      out_type=[grad_type, grad_type],
      grid=(cfg.kv_len // bk, num_heads, batch), grid_names=("kv_blocks", "heads", "batch"),
      scratch_types=[
          plgpu.SMEM((bk, head_dim), dtype, transforms=transforms),
          plgpu.SMEM((bk, head_dim), dtype, transforms=transforms),
          plgpu.SMEM((bk, bq), dtype, transforms=transforms),
          plgpu.SMEM((bk, bq), dtype, transforms=transforms),
          plgpu.Barrier(num_barriers=2),
      ])(k, v, q, _heads_major_transposed(q), d_out, _heads_major_transposed(d_out), lse,
         delta, kv_lengths)
  sum_groups = lambda grad: pallas_gpu._sum_groups(grad, cfg.group, dtype)  # pylint: disable=protected-access
  return dq, sum_groups(dk).astype(dtype), sum_groups(dv).astype(dtype)


# (q, k, v) are differentiated, kv_lengths is not.
_attention = common.flash_attention_vjp(_forward, _backward)


# ---------------------------------------------------------------------------
# Public API.
# ---------------------------------------------------------------------------


def default_block_sizes_mgpu(head_dim: int) -> common.BlockSizes:
  """Block sizes of the three kernels by head dim; not tuned on hardware.

  A CTA is one warpgroup: 64 query rows (forward, dq) or 64 key rows (dk/dv).
  The forward streams key blocks of 128 for head dims up to 128 (two K and two
  V blocks, the query block and the probabilities: 160 KiB of shared memory at
  head dim 128, bf16) and 64 at 256. The backward streams blocks of 64: the dq
  pass has three operands per step in flight, the dk/dv pass four.
  """
  return common.BlockSizes(block_q=BLOCK_Q, block_k=128 if head_dim <= 128 else 64,
                           block_q_dkv=64, block_k_dkv=BLOCK_Q)


def mgpu_rejects(inputs: AttentionInputs) -> Optional[str]:
  """None when `flash_attention_mgpu` takes `inputs`, else the reason it does not."""
  dtype = jnp.dtype(inputs.query.dtype)
  if not any(dtype == jnp.dtype(d) for d in SUPPORTED_DTYPES):
    return f"the Mosaic GPU kernel takes bfloat16 or float16 inputs, got {dtype}."
  head_dim, value_dim = inputs.query.shape[-1], inputs.value.shape[-1]
  if head_dim % HEAD_DIM_MULTIPLE or not 0 < head_dim <= MAX_HEAD_DIM:
    return (f"the Mosaic GPU kernel takes head dims that are multiples of {HEAD_DIM_MULTIPLE} "
            f"up to {MAX_HEAD_DIM}, got {head_dim}.")
  if value_dim != head_dim:
    return f"the Mosaic GPU kernel needs value head dim == head dim, got {value_dim} != {head_dim}."
  unsupported = [name for name, present in (
      ("bias", inputs.bias is not None), ("mask", inputs.mask is not None),
      ("segment ids", inputs.q_segment_ids is not None)) if present]
  if unsupported:
    return (f"the Mosaic GPU kernel does not take {', '.join(unsupported)} "
            "(the Triton kernel, implementation='pallas', does).")
  return None


def flash_attention_mgpu(inputs: AttentionInputs, block_sizes: Optional[common.BlockSizes] = None,
                         *, interpret: Optional[bool] = None,
                         max_concurrent_steps: int = 2,
                         return_residual: bool = False) -> Union[Array, Tuple[Array, Array]]:
  """Exact attention over `inputs` with Mosaic GPU kernels; `[B, Tq, H, D]`.

  Args:
    inputs: validated arguments of `attention_jax.dot_product_attention`.
    block_sizes: `block_q` and `block_k_dkv` must be 64 (one warpgroup's rows);
      `block_k` (the forward and dq key step) and `block_q_dkv` (the dk/dv
      query step) multiples of 64 up to 256. `default_block_sizes_mgpu()`
      when None, and for the `*_dkv` fields left None. The dq pass has query
      blocks of 64 and streams keys 64 at a time (`DQ_BLOCK_K`).
    interpret: run in the Pallas GPU interpreter; None means "unless the
      default backend is a GPU".
    max_concurrent_steps: blocks in flight per streamed operand (shared-memory
      slots), at most; a kernel takes fewer where they would not fit in
      shared memory (the backward at head dim 256).
    return_residual: also return the log-sum-exp `[B, Tq, H]` float32
      (differentiable; `common.EMPTY_ROW_LSE` where a query attends nothing).

  Raises:
    ValueError: for inputs `mgpu_rejects` names, or block sizes it cannot tile.
  """
  reason = mgpu_rejects(inputs)
  if reason is not None:
    raise ValueError(reason)
  head_dim = inputs.query.shape[-1]
  defaults = default_block_sizes_mgpu(head_dim)
  if block_sizes is None:
    block_sizes = defaults
  # Unset dk/dv blocks take this kernel's defaults, not the forward's (its
  # key rows are a warpgroup's 64, whatever the forward streams).
  block_sizes = dataclasses.replace(
      block_sizes, block_q_dkv=block_sizes.block_q_dkv or defaults.block_q_dkv,
      block_k_dkv=block_sizes.block_k_dkv or defaults.block_k_dkv)
  _check_block_sizes(block_sizes)
  if not isinstance(max_concurrent_steps, int) or max_concurrent_steps < 1:
    raise ValueError(f"max_concurrent_steps must be a positive int, got {max_concurrent_steps!r}.")
  empty = attention_of_empty_sequence(inputs, return_residual)  # Tq = 0 or Tk = 0
  if empty is not None:
    return empty
  if interpret is None:
    interpret = jax.default_backend() != "gpu"

  q_len, kv_len = inputs.query.shape[1], inputs.key.shape[1]
  block_q_dkv, block_k_dkv = block_sizes.dkv
  # Every kernel reads the same padded arrays: whole blocks of each of them.
  padded_q = _round_up(q_len, math.lcm(block_sizes.block_q, block_q_dkv))
  padded_kv = _round_up(kv_len, math.lcm(block_sizes.block_k, block_k_dkv, DQ_BLOCK_K))
  cfg = _Config(block_q=block_sizes.block_q, block_k=block_sizes.block_k,
                block_q_dkv=block_q_dkv, block_k_dkv=block_k_dkv,
                q_len=padded_q, kv_len=padded_kv, true_kv_len=kv_len,
                group=inputs.query.shape[2] // inputs.key.shape[2],
                scale=float(inputs.scale),
                reach=common.reach_of(inputs.is_causal, inputs.local_window_size),
                has_kv_lengths=inputs.key_value_seq_lengths is not None,
                max_concurrent_steps=max_concurrent_steps, interpret=bool(interpret))

  dtype = inputs.query.dtype
  pad = pallas_gpu._pad_to  # pylint: disable=protected-access
  q = pad(inputs.query, 1, padded_q)
  k = pad(inputs.key.astype(dtype), 1, padded_kv)
  v = pad(inputs.value.astype(dtype), 1, padded_kv)
  kv_lengths = (None if inputs.key_value_seq_lengths is None
                else jnp.asarray(inputs.key_value_seq_lengths, jnp.int32))
  out, lse = _attention(cfg, (q, k, v), kv_lengths)
  return common.attention_outputs(out[:, :q_len], lse[:, :q_len], inputs.query_seq_lengths,
                                  return_residual)


def mgpu_dot_product_attention(query, key, value, bias=None, mask=None, *,
                               block_sizes: Optional[common.BlockSizes] = None,
                               interpret: Optional[bool] = None,
                               max_concurrent_steps: int = 2, return_residual: bool = False,
                               **kwargs):
  """`attention_jax.dot_product_attention` computed by the Mosaic GPU kernels.

  Takes every argument of `dot_product_attention` except `implementation`,
  plus the kernel options of `flash_attention_mgpu`.
  """
  inputs, unbatched = prepare_inputs(query, key, value, bias, mask, **kwargs)
  return returned_outputs(
      flash_attention_mgpu(inputs, block_sizes, interpret=interpret,
                           max_concurrent_steps=max_concurrent_steps,
                           return_residual=return_residual), unbatched)


def is_hopper_or_newer() -> bool:
  """Whether the default backend is an NVIDIA GPU of compute capability 9.0 or newer."""
  if jax.default_backend() != "gpu":
    return False
  capability = getattr(jax.devices()[0], "compute_capability", None)
  try:
    return capability is not None and float(capability) >= 9.0
  except ValueError:
    return False


def _check_block_sizes(block_sizes: common.BlockSizes) -> None:
  block_q_dkv, block_k_dkv = block_sizes.dkv
  for name, value in (("block_q", block_sizes.block_q), ("block_k_dkv", block_k_dkv)):
    if value != BLOCK_Q:
      raise ValueError(f"the Mosaic GPU kernels need BlockSizes.{name}={BLOCK_Q} (one "
                       f"warpgroup's rows), got {value}.")
  for name, value in (("block_k", block_sizes.block_k), ("block_q_dkv", block_q_dkv)):
    if value % BLOCK_MULTIPLE or value > 256:
      raise ValueError(f"the Mosaic GPU kernels need BlockSizes.{name} to be a multiple of "
                       f"{BLOCK_MULTIPLE} up to 256, got {value}.")


def _round_up(n: int, multiple: int) -> int:
  return common.cdiv(n, multiple) * multiple
