"""Block-sparse flash attention: the blockwise loops over only the blocks a pattern allows.

A sparse pattern (`attention_jax.core.patterns`, what `local`, `block_local`,
`dilated`, `strided`, `fixed`, `longformer` and `bigbird` expose) becomes a
block layout: for each head and (query block, key block), SKIP, PARTIAL or
FULL. The kernel visits, for each query block, the key blocks that some head
does not skip (and in the backward pass, for each key block, the query blocks),
evaluates the pattern's predicate only inside PARTIAL blocks, and otherwise
runs the flash algorithm unchanged: exact softmax attention under the pattern,
at a cost proportional to the number of visited blocks. This is what TPU's
splash attention does for its masks; here one layout serves every pattern.

Causality, padding (lengths or a key mask) and segments come from the call as
in `dot_product_attention`, and are applied on top of the pattern.

Drawn patterns: BigBird's random blocks are drawn at run time, so they cannot
be part of a static pattern; `extra_blocks` adds them to the layout as FULL
blocks (in units of the kernel's blocks, which must then be BigBird's).
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import jax
import jax.numpy as jnp

from attention_jax.core import patterns
from attention_jax.core.block_mask import BlockMask
from attention_jax.core.flex_inputs import FlexInputs
from attention_jax.core.inputs import AttentionInputs

from . import blockwise, common, flex, pallas_gpu, pallas_tpu

Array = jnp.ndarray

# "blockwise": the lax loops (every backend). "pallas_gpu": the Triton kernels,
# "pallas_tpu": the Mosaic TPU kernels (each interpreted off its accelerator),
# one program per head following its own blocks.
IMPLEMENTATIONS = ("blockwise", "pallas_gpu", "pallas_tpu")


def block_sparse_attention(inputs: AttentionInputs, pattern: patterns.Pattern, *,
                           implementation: str = "blockwise",
                           block_sizes: Optional[common.BlockSizes] = None,
                           extra_blocks: Optional[Array] = None,
                           return_residual: bool = False) -> Union[Array, Tuple[Array, Array]]:
  """Exact attention under `pattern` (and the inputs' masks), `[B, Tq, H, Dv]`.

  Args:
    inputs: validated arguments of `attention_jax.dot_product_attention`
      (no `local_window_size`: a window is a `patterns.Band`).
    pattern: which pairs may attend, from positions (and heads).
    implementation: the kernel, one of `IMPLEMENTATIONS`.
    block_sizes: the kernel's blocks; one size for the forward and backward
      passes (the layout is made for it). Default: 128 x 128.
    extra_blocks: `[H, nq, r]` int32, key blocks (of `block_sizes.block_k`
      tokens) that query block n of head h also sees whole; -1 for none.
    return_residual: also return the log-sum-exp `[B, Tq, H]` float32.
  """
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}.")
  if inputs.local_window_size is not None:
    raise ValueError("block-sparse attention takes its window from the pattern (patterns.Band), "
                     f"got local_window_size={inputs.local_window_size!r}.")
  block_sizes = default_block_sizes() if block_sizes is None else block_sizes
  if block_sizes.dkv != (block_sizes.block_q, block_sizes.block_k):
    raise ValueError("block-sparse attention uses one block size for both passes (the layout "
                     f"is made for it), got {block_sizes}.")
  if implementation == "pallas_gpu":
    return _pallas_gpu(inputs, pattern, block_sizes, extra_blocks, return_residual)
  if implementation == "pallas_tpu":
    return _pallas_tpu(inputs, pattern, block_sizes, extra_blocks, return_residual)
  # The flex engine's loops with the pattern as a static mask mod, and its
  # layout (BigBird's draws included) as the block mask.
  q_len, kv_len = inputs.query.shape[1], inputs.key.shape[1]
  block_sizes = blockwise.fitted_block_sizes(block_sizes, q_len, kv_len)
  layout = layout_of(inputs, pattern, block_sizes.block_q, block_sizes.block_k, extra_blocks)
  check_layout(layout, inputs.query.shape[2], common.cdiv(q_len, block_sizes.block_q),
               common.cdiv(kv_len, block_sizes.block_k))
  block_mask = BlockMask(layout[None], pattern, (), q_len, kv_len, block_sizes.block_q,
                         block_sizes.block_k)  # [1, H|1, nq, nk]
  return flex.flex_blockwise(inputs, FlexInputs(mask_mod=pattern, block_mask=block_mask),
                             block_sizes, return_residual=return_residual)


def layout_of(inputs: AttentionInputs, pattern: patterns.Pattern, block_q: int, block_k: int,
              extra_blocks: Optional[Array]) -> Array:
  """The `[H|1, nq, nk]` layout of `pattern` (causal as the inputs say) with
  `extra_blocks` set FULL."""
  _, q_len, num_heads, _ = inputs.query.shape
  layout = jnp.asarray(patterns.block_layout(pattern, q_len, inputs.key.shape[1], block_q,
                                             block_k, is_causal=inputs.is_causal,
                                             num_heads=num_heads))
  return layout if extra_blocks is None else with_extra_blocks(layout, extra_blocks, num_heads)


def _pallas_gpu(inputs, pattern, block_sizes, extra_blocks, return_residual):
  """The Triton kernels over the layout. Their blocks are powers of two of at
  least 16 (`pallas_gpu.MIN_BLOCK`) and the layout is made for them as given."""
  num_heads = inputs.query.shape[2]
  # Blocks longer than the (power-of-two rounded) sequence would only add padding.
  fit = lambda block, length: min(block, pallas_gpu.shortest_block(length))
  block_sizes = common.BlockSizes(fit(block_sizes.block_q, inputs.query.shape[1]),
                                  fit(block_sizes.block_k, inputs.key.shape[1]))
  num_q_blocks = common.cdiv(inputs.query.shape[1], block_sizes.block_q)
  num_kv_blocks = common.cdiv(inputs.key.shape[1], block_sizes.block_k)
  layout = layout_of(inputs, pattern, block_sizes.block_q, block_sizes.block_k, extra_blocks)
  check_layout(layout, num_heads, num_q_blocks, num_kv_blocks)
  return pallas_gpu.flash_attention_gpu(inputs, block_sizes, return_residual=return_residual,
                                        pattern=pattern, block_layout=layout)


def _pallas_tpu(inputs, pattern, block_sizes, extra_blocks, return_residual):
  """The Mosaic TPU kernels over the layout: query blocks a multiple of 32, key
  blocks of 128 (`pallas_tpu`), fitted to the sequences; the grids' last axes
  as long as the most blocks a row visits."""
  q_len, kv_len = inputs.query.shape[1], inputs.key.shape[1]
  round_up = lambda n, multiple: common.cdiv(n, multiple) * multiple
  block_sizes = common.BlockSizes(
      min(block_sizes.block_q, round_up(q_len, pallas_tpu.QUERY_BLOCK_MULTIPLE)),
      min(block_sizes.block_k, round_up(kv_len, pallas_tpu.KEY_BLOCK_MULTIPLE)))
  static_layout = patterns.block_layout(pattern, q_len, kv_len, block_sizes.block_q,
                                        block_sizes.block_k, is_causal=inputs.is_causal,
                                        num_heads=inputs.query.shape[2])
  visited = static_layout != patterns.SKIP  # NumPy: the grids' lengths are static
  max_visits = (int(visited.sum(-1).max()), int(visited.sum(-2).max()))
  layout = jnp.asarray(static_layout)
  check_layout(layout, inputs.query.shape[2], common.cdiv(q_len, block_sizes.block_q),
               common.cdiv(kv_len, block_sizes.block_k))
  if extra_blocks is not None:
    layout = with_extra_blocks(layout, extra_blocks, inputs.query.shape[2])
    # Each query block gains at most r blocks; a key block may be drawn by all.
    max_visits = (max_visits[0] + extra_blocks.shape[-1], layout.shape[1])
  return pallas_tpu.flash_attention_tpu(inputs, block_sizes, return_residual=return_residual,
                                        pattern=pattern, block_layout=layout,
                                        max_visits=max_visits)


def default_block_sizes() -> common.BlockSizes:
  """128 x 128: a pattern's layout is only as fine as its blocks, so smaller
  than the dense default of 512, and still a sizeable matmul on CPU."""
  return common.BlockSizes(block_q=128, block_k=128)


def with_extra_blocks(layout: Array, extra_blocks: Array, num_heads: int) -> Array:
  """`layout` with `extra_blocks` (`[H, nq, r]`, -1 for none) set FULL, per head."""
  num_kv_blocks = layout.shape[-1]
  expected = (num_heads, layout.shape[1])
  if extra_blocks.ndim != 3 or tuple(extra_blocks.shape[:2]) != expected:
    raise ValueError(f"extra_blocks must have shape [H, nq, r] = [{expected[0]}, {expected[1]}, "
                     f"r], got {list(extra_blocks.shape)}.")
  hits = jax.nn.one_hot(extra_blocks, num_kv_blocks, dtype=jnp.int8).max(axis=2)  # -1: none
  return jnp.maximum(layout, hits * jnp.int8(patterns.FULL))


def check_layout(layout: Array, num_heads: int, num_q_blocks: int, num_kv_blocks: int):
  """A ValueError unless `layout` is `[H|1, nq, nk]` for these blocks."""
  heads_ok = layout.shape[0] in (1, num_heads)
  if layout.ndim != 3 or not heads_ok or tuple(layout.shape[1:]) != (num_q_blocks, num_kv_blocks):
    raise ValueError(f"block_layout must have shape [H|1, nq, nk] = [{num_heads}|1, "
                     f"{num_q_blocks}, {num_kv_blocks}], got {list(layout.shape)}.")
