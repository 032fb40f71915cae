"""Flash attention's forward pass as a Pallas Mosaic GPU kernel (NVIDIA Hopper).

The Triton kernel (`pallas_gpu.py`) runs on every NVIDIA GPU; this one is
written for Hopper's own units: TMA copies bring K/V blocks into shared memory
through a two-slot pipeline (`plgpu.emit_pipeline`, the copy of block j+1 in
flight while block j is computed) and both matrix products are warpgroup MMAs
(`plgpu.wgmma`) from shared memory into float32 accumulators. One CTA is one
warpgroup computing 64 query rows of one head against the key blocks they can
see.

The backward pass is the Triton kernels' (`pallas_gpu._backward`): both
kernels save the same residuals (the output and the log-sum-exp, `[B, H, Tq']`
float32, -inf on rows that attend nothing), so the Mosaic forward hands them
over unchanged.

Layout:
  * q `[B, Tq', H, D]` and v `[B, Tk', Hkv, D]` are read in place; K arrives
    transposed, `[B, Hkv, D, Tk']`, so that Q K^T is a plain wgmma. Mosaic GPU
    can transpose a shared-memory operand for free on hardware, but the Pallas
    GPU interpreter (how this kernel is tested without a GPU) cannot apply
    `transpose_ref` to a wgmma operand; one O(T*D) transpose in HBM keeps a
    single code path for both.
  * The probabilities go through shared memory for the second product (wgmma
    takes its left operand from registers on hardware, not in the
    interpreter): 64 x block_k 16-bit values per step.

What it takes (everything else is `mgpu_rejects`' reason and stays with the
Triton kernel): 16-bit inputs, head dims that are multiples of 64 up to 256
with Dv == D, causal and sliding-window masks (blocks outside the reach are
never loaded), `key_value_seq_lengths` (masked by position, and the key loop
stops at the batch's length), `query_seq_lengths` (zeroed after the kernel),
grouped K/V heads, any scale, sequence lengths that are not multiples of the
blocks (zero padding, masked by position).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from attention_jax.core import masks as mask_lib
from attention_jax.variants.dense import AttentionInputs, prepare_inputs

from . import common, pallas_gpu

Array = jnp.ndarray

SUPPORTED_DTYPES = (jnp.bfloat16, jnp.float16)
HEAD_DIM_MULTIPLE = 64  # one 128-byte swizzle row of 16-bit values
MAX_HEAD_DIM = 256
BLOCK_Q = 64  # wgmma's M: one warpgroup's rows
BLOCK_MULTIPLE = 64
_SWIZZLE_BYTES = 128
_LOG2_E = math.log2(math.e)


def _smem_transforms(dtype) -> tuple:
  """The tiling and swizzle every wgmma operand in shared memory carries."""
  elements = _SWIZZLE_BYTES // jnp.dtype(dtype).itemsize
  return (plgpu.TilingTransform((8, elements)), plgpu.SwizzleTransform(_SWIZZLE_BYTES))


@dataclasses.dataclass(frozen=True)
class _Config:
  """Everything about a call that is fixed at trace time."""

  block_q: int
  block_k: int
  q_len: int  # padded Tq
  kv_len: int  # padded Tk
  true_kv_len: int
  group: int
  scale: float
  reach: common.Reach
  has_kv_lengths: bool
  max_concurrent_steps: int
  interpret: bool


def _forward_kernel(q_ref, k_t_ref, v_ref, kv_lengths_ref, out_ref, lse_ref,
                    q_smem, probs_smem, lse_smem, q_barrier, *, cfg: _Config):
  """One block of 64 queries of one head: out `[64, D]`, lse `[64]`.

  GMEM refs: q `[B, Tq', H, D]`, k_t `[B, Hkv, D, Tk']`, v `[B, Tk', Hkv, D]`,
  kv_lengths `[B]` int32 (a placeholder of zeros when the call has none),
  out like q, lse `[B, H, Tq']` float32.
  """
  bq, bk = cfg.block_q, cfg.block_k
  q_block = lax.axis_index("q_blocks")
  head = lax.axis_index("heads")
  batch = lax.axis_index("batch")
  kv_head = lax.div(head, jnp.int32(cfg.group))
  q_start = q_block * bq
  head_dim = q_smem.shape[-1]

  plgpu.copy_gmem_to_smem(q_ref.at[batch, pl.ds(q_start, bq), head], q_smem, q_barrier.at[0])

  kv_limit = jnp.int32(cfg.true_kv_len)
  if cfg.has_kv_lengths:
    kv_limit = jnp.minimum(kv_limit, kv_lengths_ref[batch])
  num_kv_blocks = cfg.kv_len // bk
  lo, hi = common.kv_block_range(q_block, bq, bk, num_kv_blocks, cfg.reach)
  hi = jnp.minimum(hi, (kv_limit + bk - 1) // bk)
  # A query block that sees no key still runs one (fully masked) step, so the
  # pipeline never has an empty grid; `lo` is clamped to a block that exists.
  lo = jnp.minimum(lo, num_kv_blocks - 1)
  num_steps = jnp.maximum(hi - lo, 1)
  # Logits are kept in base 2 (scale * log2 e folded in) so each probability is one exp2.
  logit_scale = cfg.scale * _LOG2_E

  def step(indices, k_t_smem, v_smem, carry):
    acc, row_max, row_sum = carry
    kv_block = lo + indices[0]

    def scores(acc_ref):
      plgpu.wgmma(acc_ref, q_smem, k_t_smem)
      return acc_ref[...]

    logits = pl.run_scoped(scores, plgpu.ACC((bq, bk), jnp.float32)) * logit_scale
    q_pos = q_start + lax.broadcasted_iota(jnp.int32, (bq, bk), 0)
    k_pos = kv_block * bk + lax.broadcasted_iota(jnp.int32, (bq, bk), 1)
    allowed = mask_lib.and_masks(mask_lib.length_predicate(k_pos, kv_limit),
                                 mask_lib.reach_predicate(q_pos, k_pos, cfg.reach))
    logits = jnp.where(allowed, logits, -jnp.inf)

    new_max = jnp.maximum(row_max, logits.max(axis=1))
    # A row with nothing allowed so far keeps max -inf; exponentiate against 0 then.
    safe_max = jnp.where(new_max == -jnp.inf, 0.0, new_max)
    probs = jnp.exp2(logits - lax.broadcast_in_dim(safe_max, logits.shape, [0]))
    correction = jnp.exp2(row_max - safe_max)
    row_sum = row_sum * correction + probs.sum(axis=1)
    probs_smem[...] = probs.astype(probs_smem.dtype)
    plgpu.commit_smem()

    def weighted_values(acc_ref):
      plgpu.wgmma(acc_ref, probs_smem, v_smem)
      return acc_ref[...]

    block_out = pl.run_scoped(weighted_values, plgpu.ACC((bq, head_dim), jnp.float32))
    acc = acc * lax.broadcast_in_dim(correction, acc.shape, [0]) + block_out
    return acc, new_max, row_sum

  transforms = _smem_transforms(q_smem.dtype)
  pipeline = plgpu.emit_pipeline(
      step,
      grid=(num_steps,),
      in_specs=[
          plgpu.BlockSpec((head_dim, bk), lambda j: (0, lo + j), transforms=transforms),
          plgpu.BlockSpec((bk, head_dim), lambda j: (lo + j, 0), transforms=transforms),
      ],
      max_concurrent_steps=cfg.max_concurrent_steps,
      init_carry=(jnp.zeros((bq, head_dim), jnp.float32),
                  jnp.full((bq,), -jnp.inf, jnp.float32),
                  jnp.zeros((bq,), jnp.float32)))
  plgpu.barrier_wait(q_barrier.at[0])
  acc, row_max, row_sum = pipeline(k_t_ref.at[batch, kv_head], v_ref.at[batch, :, kv_head, :])

  empty = row_sum == 0.0  # nothing to attend: output 0, lse -inf
  safe_sum = jnp.where(empty, 1.0, row_sum)
  # The query block's shared memory is free again: it stages the output.
  q_smem[...] = (acc / lax.broadcast_in_dim(safe_sum, acc.shape, [0])).astype(q_smem.dtype)
  lse_smem[...] = jnp.where(empty, -jnp.inf, (row_max + jnp.log2(safe_sum)) / _LOG2_E)
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(q_smem, out_ref.at[batch, pl.ds(q_start, bq), head])
  plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[batch, head, pl.ds(q_start, bq)])
  plgpu.wait_smem_to_gmem(0)


def _forward(cfg: _Config, q, k, v, kv_lengths):
  """out `[B, Tq', H, D]` and lse `[B, H, Tq']` float32 of padded inputs."""
  batch, _, num_heads, head_dim = q.shape
  k_t = jnp.transpose(k, (0, 2, 3, 1))  # [B, Hkv, D, Tk']
  if kv_lengths is None:
    kv_lengths = jnp.zeros((batch,), jnp.int32)
  transforms = _smem_transforms(q.dtype)
  kernel = plgpu.kernel(
      functools.partial(_forward_kernel, cfg=cfg),
      out_type=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                jax.ShapeDtypeStruct((batch, num_heads, cfg.q_len), jnp.float32)],
      grid=(cfg.q_len // cfg.block_q, num_heads, batch),
      grid_names=("q_blocks", "heads", "batch"),
      scratch_types=[
          plgpu.SMEM((cfg.block_q, head_dim), q.dtype, transforms=transforms),
          plgpu.SMEM((cfg.block_q, cfg.block_k), q.dtype, transforms=transforms),
          plgpu.SMEM((cfg.block_q,), jnp.float32),
          plgpu.Barrier(num_barriers=1),
      ],
      compiler_params=plgpu.CompilerParams(
          lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
      interpret=_interpret_params() if cfg.interpret else None,
  )
  return kernel(q, k_t, v, kv_lengths)


def _interpret_params():
  from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams  # pylint: disable=import-outside-toplevel
  return InterpretGPUParams()


# ---------------------------------------------------------------------------
# Mosaic forward, Triton backward, under one custom_vjp.
# ---------------------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _attention(cfg: _Config, triton_cfg, q, k, v, kv_lengths):
  return _forward(cfg, q, k, v, kv_lengths)[0]


def _attention_fwd(cfg, triton_cfg, q, k, v, kv_lengths):
  out, lse = _forward(cfg, q, k, v, kv_lengths)
  return out, (q, k, v, kv_lengths, out, lse)


def _attention_bwd(cfg, triton_cfg, residuals, d_out):
  q, k, v, kv_lengths, out, lse = residuals
  masks = pallas_gpu._MaskArrays(mask=None, q_segment_ids=None, kv_segment_ids=None,  # pylint: disable=protected-access
                                 kv_lengths=kv_lengths)
  dq, dk, dv, _ = pallas_gpu._backward(triton_cfg, q, k, v, None, masks, out, lse, d_out)  # pylint: disable=protected-access
  return dq, dk, dv, None


_attention.defvjp(_attention_fwd, _attention_bwd)


# ---------------------------------------------------------------------------
# Public API.
# ---------------------------------------------------------------------------


def default_block_sizes_mgpu(head_dim: int) -> common.BlockSizes:
  """Block sizes of the Mosaic forward (and of the Triton backward it uses).

  block_q is one warpgroup's 64 rows. A key block of 128 keeps two K and two V
  blocks, the query block and the probabilities at 96 KiB of shared memory for
  head dim 128 (bf16); at 256 the key block halves. The backward blocks are
  the Triton kernel's defaults. Not tuned on hardware.
  """
  triton = pallas_gpu.default_block_sizes_gpu(head_dim, jnp.bfloat16)
  return common.BlockSizes(block_q=BLOCK_Q, block_k=128 if head_dim <= 128 else 64,
                           block_q_dkv=triton.dkv[0], block_k_dkv=triton.dkv[1])


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
                         max_concurrent_steps: int = 2) -> Array:
  """Exact attention over `inputs`: Mosaic GPU forward, Triton backward; `[B, Tq, H, D]`.

  Args:
    inputs: validated arguments of `attention_jax.dot_product_attention`.
    block_sizes: `block_q` must be 64 (one warpgroup), `block_k` a multiple of
      64; the `*_dkv` fields and `block_k` also tile the Triton backward.
      `default_block_sizes_mgpu()` when None.
    interpret: run in the Pallas GPU interpreter (and the Triton backward in
      the Pallas interpreter); None means "unless the default backend is a GPU".
    max_concurrent_steps: K/V blocks in flight (shared-memory slots).

  Raises:
    ValueError: for inputs `mgpu_rejects` names, or block sizes it cannot tile.
  """
  reason = mgpu_rejects(inputs)
  if reason is not None:
    raise ValueError(reason)
  head_dim = inputs.query.shape[-1]
  if block_sizes is None:
    block_sizes = default_block_sizes_mgpu(head_dim)
  _check_block_sizes(block_sizes)
  if not isinstance(max_concurrent_steps, int) or max_concurrent_steps < 1:
    raise ValueError(f"max_concurrent_steps must be a positive int, got {max_concurrent_steps!r}.")
  if interpret is None:
    interpret = jax.default_backend() != "gpu"
  interpret = bool(interpret)

  q_len, kv_len = inputs.query.shape[1], inputs.key.shape[1]
  # The backward is the Triton kernels' (their dq blocks, these dk/dv blocks).
  # Both passes read the same padded arrays, so lengths are padded to whole
  # blocks of either kernel (all powers of two or multiples of 64).
  triton_defaults = pallas_gpu.default_block_sizes_gpu(head_dim, inputs.query.dtype)
  triton_blocks = common.BlockSizes(
      block_q=triton_defaults.block_q, block_k=triton_defaults.block_k,
      block_q_dkv=block_sizes.dkv[0], block_k_dkv=block_sizes.dkv[1])
  triton_cfg = pallas_gpu._config(inputs, triton_blocks, interpret, None, None)  # pylint: disable=protected-access
  padded_q = _round_up(q_len, math.lcm(block_sizes.block_q, triton_cfg.block_q,
                                       triton_cfg.block_q_dkv))
  padded_kv = _round_up(kv_len, math.lcm(block_sizes.block_k, triton_cfg.block_k,
                                         triton_cfg.block_k_dkv))
  triton_cfg = dataclasses.replace(triton_cfg, q_len=padded_q, kv_len=padded_kv)
  cfg = _Config(block_q=block_sizes.block_q, block_k=block_sizes.block_k,
                q_len=padded_q, kv_len=padded_kv, true_kv_len=kv_len,
                group=inputs.query.shape[2] // inputs.key.shape[2],
                scale=float(inputs.scale),
                reach=common.reach_of(inputs.is_causal, inputs.local_window_size),
                has_kv_lengths=inputs.key_value_seq_lengths is not None,
                max_concurrent_steps=max_concurrent_steps, interpret=interpret)

  dtype = inputs.query.dtype
  q = pallas_gpu._pad_to(inputs.query, 1, padded_q)  # pylint: disable=protected-access
  k = pallas_gpu._pad_to(inputs.key.astype(dtype), 1, padded_kv)  # pylint: disable=protected-access
  v = pallas_gpu._pad_to(inputs.value.astype(dtype), 1, padded_kv)  # pylint: disable=protected-access
  kv_lengths = (None if inputs.key_value_seq_lengths is None
                else jnp.asarray(inputs.key_value_seq_lengths, jnp.int32))
  out = _attention(cfg, triton_cfg, q, k, v, kv_lengths)[:, :q_len]
  if inputs.query_seq_lengths is not None:
    # Queries past their length output zeros; their cotangents, hence gradients, vanish.
    valid = mask_lib.length_predicate(jnp.arange(q_len)[None, :],
                                      inputs.query_seq_lengths[:, None])
    out = jnp.where(valid[:, :, None, None], out, jnp.zeros((), out.dtype))
  return out


def mgpu_dot_product_attention(query, key, value, bias=None, mask=None, *,
                               block_sizes: Optional[common.BlockSizes] = None,
                               interpret: Optional[bool] = None,
                               max_concurrent_steps: int = 2, **kwargs) -> Array:
  """`attention_jax.dot_product_attention` computed by the Mosaic GPU forward kernel.

  Takes every argument of `dot_product_attention` except `implementation`,
  plus the kernel options of `flash_attention_mgpu`.
  """
  inputs, unbatched = prepare_inputs(query, key, value, bias, mask, **kwargs)
  out = flash_attention_mgpu(inputs, block_sizes, interpret=interpret,
                             max_concurrent_steps=max_concurrent_steps)
  return out[0] if unbatched else out


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
  if block_sizes.block_q != BLOCK_Q:
    raise ValueError(f"the Mosaic GPU kernel needs BlockSizes.block_q={BLOCK_Q} (one warpgroup's "
                     f"rows), got {block_sizes.block_q}.")
  if block_sizes.block_k % BLOCK_MULTIPLE or block_sizes.block_k > 256:
    raise ValueError(f"the Mosaic GPU kernel needs BlockSizes.block_k to be a multiple of "
                     f"{BLOCK_MULTIPLE} up to 256, got {block_sizes.block_k}.")
  for name, value in zip(("block_q_dkv", "block_k_dkv"), block_sizes.dkv):
    if value < pallas_gpu.MIN_BLOCK or value & (value - 1):
      raise ValueError(f"the Triton backward needs block sizes that are powers of two and at "
                       f"least {pallas_gpu.MIN_BLOCK}, got BlockSizes.{name}={value}.")


def _round_up(n: int, multiple: int) -> int:
  return common.cdiv(n, multiple) * multiple
