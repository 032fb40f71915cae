"""Flex attention on the blockwise loops: score and mask mods compiled into the kernel.

`flex_blockwise(inputs, flex)` runs `blockwise.py`'s forward and backward
with what `FlexInputs` adds: the score_mod applied to each tile's logits
(after the scale, the bias and the soft cap), the mask_mod evaluated only
inside the tiles that the block layout marks PARTIAL, the tiles it marks
SKIP never visited, sinks in the normaliser, or the sigmoid normaliser.

The layout: the block mask's when one is given; a static mask_mod's from
NumPy at trace time; a data-dependent mask_mod without a block mask is
evaluated in every tile (make a block mask, once, to skip tiles).

`flex_pallas_gpu` runs the same on the Triton kernels (`pallas_gpu.py`,
interpreted off a GPU), softmax only; `flex_pallas_tpu` on the Mosaic TPU
kernels (`pallas_tpu.py`, interpreted off a TPU), softmax only.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple, Union

import jax
import jax.numpy as jnp
import numpy as np

from attention_jax.core import patterns
from attention_jax.core.flex_inputs import FlexInputs
from attention_jax.core.inputs import AttentionInputs, attention_of_empty_sequence

from . import blockwise, common, pallas_gpu, pallas_tpu

Array = jax.Array


def default_block_sizes() -> common.BlockSizes:
  """128 x 128, as the block-sparse kernels: a mask's layout is only as fine as its blocks."""
  return common.BlockSizes(block_q=128, block_k=128)


def flex_blockwise(inputs: AttentionInputs, flex: FlexInputs,
                   block_sizes: Optional[common.BlockSizes] = None, *,
                   return_residual: bool = False) -> Union[Array, Tuple[Array, Array]]:
  """`[B, Tq, H, Dv]` (and the log-sum-exp `[B, Tq, H]` with `return_residual`)."""
  empty = attention_of_empty_sequence(inputs, return_residual)  # Tq = 0 or Tk = 0
  if empty is not None:
    return empty
  block_sizes = _block_sizes(flex, block_sizes)
  cfg, (q, k, v, bias), masks = blockwise.blocked_layout(inputs, block_sizes)
  num_kv_heads, group = q.shape[1], q.shape[2]
  layout = _layout(inputs, flex, cfg.block_q, cfg.block_k)
  score_consts, score_other = ((), ()) if flex.lifted_score_mod is None else (
      flex.lifted_score_mod.split(flex.score_consts))
  cfg = dataclasses.replace(
      cfg, mask_mod=_mask_mod(flex),
      softcap=flex.softcap, score_mod=flex.lifted_score_mod, normaliser=flex.normaliser,
      sigmoid_bias=flex.sigmoid_bias, dropout_rate=flex.dropout_rate)
  masks = dataclasses.replace(masks, block_layout=layout, mask_mod_consts=tuple(flex.mask_consts),
                              score_mod_consts=tuple(score_other), dropout_rng=flex.dropout_rng)
  sinks = None if flex.sinks is None else flex.sinks.reshape(num_kv_heads, group)
  extras = common.FlexArrays(sinks, tuple(score_consts))
  out, lse = blockwise.flex_attend(cfg, (q, k, v, bias, extras), masks)
  out, lse = blockwise.from_blocked_layout(out, lse, inputs)
  # Queries past their lengths attend nothing, sinks neither: lse as if empty.
  return common.attention_outputs(out, lse, inputs.query_seq_lengths, return_residual)


def flex_pallas_gpu(inputs: AttentionInputs, flex: FlexInputs,
                    block_sizes: Optional[common.BlockSizes] = None, *,
                    return_residual: bool = False,
                    interpret: Optional[bool] = None) -> Union[Array, Tuple[Array, Array]]:
  """flex_attention on the Triton kernels (`pallas_gpu.py`), interpreted off a GPU.

  The score_mod and the soft cap are applied to each tile's logits inside the
  three kernels (the dq pass differentiates them per tile with `jax.vjp` and
  writes one partial gradient of the score_mod's floating arrays per program,
  summed outside: no atomics); the mask_mod decides in the tiles the layout
  marks PARTIAL, each program (batch row, head) skipping its own SKIP tiles;
  sinks enter the normaliser. Blocks: powers of two of at least 16,
  one size for every pass.
  """
  _softmax_only(flex, "pallas_gpu")
  reason = pallas_gpu.gpu_rejects(inputs)
  if reason is not None:
    raise ValueError(reason)
  empty = attention_of_empty_sequence(inputs, return_residual)  # Tq = 0 or Tk = 0
  if empty is not None:
    return empty
  block_sizes = _block_sizes(flex, block_sizes)
  q_len = inputs.query.shape[1]
  kv_len = inputs.key.shape[1]
  # Blocks longer than the (power-of-two rounded) sequence would only add
  # padding; such a block covers the whole sequence, as the mask's did.
  fit = lambda block, length: min(block, pallas_gpu.shortest_block(length))
  block_sizes = common.BlockSizes(fit(block_sizes.block_q, q_len),
                                  fit(block_sizes.block_k, kv_len))
  pallas_gpu._check_block_sizes(block_sizes)  # pylint: disable=protected-access
  layout = _layout(inputs, flex, block_sizes.block_q, block_sizes.block_k)
  return pallas_gpu.flash_attention_gpu(
      inputs, block_sizes, interpret=interpret, return_residual=return_residual,
      pattern=_mask_mod(flex) if layout is not None else None, block_layout=layout,
      mask_consts=tuple(flex.mask_consts), score_mod=flex.lifted_score_mod,
      score_consts=tuple(flex.score_consts), softcap=flex.softcap, sinks=flex.sinks)


def flex_pallas_tpu(inputs: AttentionInputs, flex: FlexInputs,
                    block_sizes: Optional[common.BlockSizes] = None, *,
                    return_residual: bool = False,
                    interpret: Optional[bool] = None) -> Union[Array, Tuple[Array, Array]]:
  """flex_attention on the Mosaic TPU kernels (`pallas_tpu.py`), interpreted off a TPU.

  As `flex_pallas_gpu`: the score_mod and the soft cap on each tile inside the
  three kernels (the dq pass differentiates them per tile with `jax.vjp` into
  one partial gradient per program, summed outside), the mask_mod in the tiles
  the layout marks PARTIAL, each (batch row, head) following its own visit
  list (scalar-prefetched), sinks in the normaliser. Blocks: query blocks a
  multiple of 32, key blocks of 128 (`pallas_tpu.QUERY_BLOCK_MULTIPLE`,
  `KEY_BLOCK_MULTIPLE`), shortened to the rounded-up sequences, one size for
  every pass. A layout known at trace time sizes the grids by the most blocks
  a row visits; a traced one (a block mask made under `jit`) by all of them.
  """
  _softmax_only(flex, "pallas_tpu")
  reason = pallas_tpu.tpu_rejects(inputs)
  if reason is not None:
    raise ValueError(reason)
  empty = attention_of_empty_sequence(inputs, return_residual)  # Tq = 0 or Tk = 0
  if empty is not None:
    return empty
  q_len = inputs.query.shape[1]
  kv_len = inputs.key.shape[1]
  round_up = lambda n, multiple: common.cdiv(n, multiple) * multiple
  # Blocks longer than the rounded-up sequence would only add padding; such a
  # block covers the whole sequence, as the mask's did.
  fit = lambda blocks: common.BlockSizes(
      min(blocks.block_q, round_up(q_len, pallas_tpu.QUERY_BLOCK_MULTIPLE)),
      min(blocks.block_k, round_up(kv_len, pallas_tpu.KEY_BLOCK_MULTIPLE)))
  mask = flex.block_mask
  if block_sizes is None and mask is not None and pallas_tpu.tpu_rejects(
      inputs, fit(common.BlockSizes(mask.block_q, mask.block_k))) is not None:
    # A mask made with blocks the TPU kernels cannot take: refused as one made
    # for other blocks than the kernel's (the default, fitted).
    _block_sizes(flex, fit(default_block_sizes()))
  block_sizes = fit(_block_sizes(flex, block_sizes))
  reason = pallas_tpu.tpu_rejects(inputs, block_sizes)
  if reason is not None:
    raise ValueError(reason)
  layout = _layout(inputs, flex, block_sizes.block_q, block_sizes.block_k)
  max_visits = None
  if layout is not None and not isinstance(layout, jax.core.Tracer):
    # Known now: the grids as long as the most blocks a row visits.
    visited = np.asarray(layout) != patterns.SKIP
    max_visits = (int(visited.sum(-1).max()), int(visited.sum(-2).max()))
  return pallas_tpu.flash_attention_tpu(
      inputs, block_sizes, interpret=interpret, return_residual=return_residual,
      pattern=_mask_mod(flex) if layout is not None else None, block_layout=layout,
      max_visits=max_visits, mask_consts=tuple(flex.mask_consts),
      score_mod=flex.lifted_score_mod, score_consts=tuple(flex.score_consts),
      softcap=flex.softcap, sinks=flex.sinks)


def _block_sizes(flex: FlexInputs, block_sizes: Optional[common.BlockSizes]) -> common.BlockSizes:
  """The kernel's blocks: as asked, else the block mask's, else the default; one
  size for both passes (the layout is made for it)."""
  mask = flex.block_mask
  if block_sizes is None:
    block_sizes = (default_block_sizes() if mask is None
                   else common.BlockSizes(mask.block_q, mask.block_k))
  if block_sizes.dkv != (block_sizes.block_q, block_sizes.block_k):
    raise ValueError("flex attention uses one block size for both passes (the layout is made "
                     f"for it), got block_sizes={block_sizes}.")
  if mask is not None and (mask.block_q, mask.block_k) != (block_sizes.block_q,
                                                           block_sizes.block_k):
    raise ValueError(f"block_mask has blocks ({mask.block_q}, {mask.block_k}), but "
                     f"block_sizes={block_sizes}; make the mask with the kernel's blocks.")
  return block_sizes


def _layout(inputs: AttentionInputs, flex: FlexInputs, block_q: int,
            block_k: int) -> Optional[Array]:
  """`[B|1, H|1, nq, nk]` int8 in the kernel's blocks, or None (no mask_mod):
  the block mask's (checked against the kernel's blocks), a static mask's
  from NumPy, or every tile PARTIAL for a data-dependent mask without one."""
  q_len, num_heads = inputs.query.shape[1:3]
  kv_len = inputs.key.shape[1]
  expected = (common.cdiv(q_len, block_q), common.cdiv(kv_len, block_k))
  if flex.block_mask is not None:
    layout = flex.block_mask.layout
    if tuple(layout.shape[2:]) != expected:
      raise ValueError(f"block_mask has {tuple(layout.shape[2:])} (query, key) blocks, the "
                       f"kernel's blocks make {expected}; make the mask with the kernel's "
                       "block sizes.")
    return layout
  if flex.mask_mod is None:
    return None
  if flex.static_mask_mod:
    return jnp.asarray(patterns.block_layout(flex.mask_mod, q_len, kv_len, block_q, block_k,
                                             num_heads=num_heads)[None])
  return jnp.full((1, 1) + expected, patterns.PARTIAL, jnp.int8)


def _softmax_only(flex: FlexInputs, implementation: str) -> None:
  if flex.normaliser != "softmax":
    raise ValueError(f"implementation={implementation!r} takes normaliser='softmax' only, got "
                     f"normaliser={flex.normaliser!r}; normaliser='sigmoid' runs on "
                     "implementation='blockwise' or 'xla'.")


def _mask_mod(flex: FlexInputs):
  """The mask mod a kernel evaluates: lifted when data-dependent, else static."""
  return flex.lifted_mask_mod if flex.lifted_mask_mod is not None else flex.mask_mod
