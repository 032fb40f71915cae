"""The sparse variants on the block-sparse flash kernel.

With `implementation=` set, a sparse variant hands its pattern (a
`core.patterns.Pattern`: the pairs its pure-JAX form computes, as a predicate)
to kernels/flash_attention/block_sparse.py, which visits only the blocks the
pattern allows; the pure-JAX forms stay the reference.
"""

from __future__ import annotations

from typing import Optional

import jax.numpy as jnp

from attention_jax.core import patterns
from attention_jax.variants import common
from attention_jax.variants.dense import prepare_inputs
from attention_jax.variants.sparse import engine

Array = jnp.ndarray


# block_sparse.IMPLEMENTATIONS (the kernels cannot be imported here; a test checks).
KERNEL_IMPLEMENTATIONS = ("blockwise", "pallas_gpu", "pallas_tpu")


def check_implementation(variant: str, implementation: Optional[str]):
  if implementation is not None and implementation not in KERNEL_IMPLEMENTATIONS:
    raise ValueError(f"{variant}: implementation must be None (the pure-JAX form) or one of "
                     f"{KERNEL_IMPLEMENTATIONS}, got {implementation!r}.")


def kernel_attention(variant: str, pattern: patterns.Pattern, query: Array, key: Array,
                     value: Array, bias, mask, *, implementation: str, is_causal: bool,
                     query_seq_lengths, key_value_seq_lengths, segment_ids, scale,
                     block_size: Optional[int] = None,
                     extra_blocks: Optional[Array] = None) -> Array:
  """`variant` under `pattern` through the block-sparse flash kernel
  (kernels/flash_attention/block_sparse.py), with the sparse family's input rules:
  self-attention, no bias, a key-padding mask at most."""
  # The kernels import the variants, so they are imported here, on use.
  # pylint: disable-next=import-outside-toplevel
  from attention_jax.kernels.flash_attention import block_sparse, common as kernel_common
  common.reject_unsupported(variant, bias=bias)
  length = engine.self_attention_length(variant, query, key)
  key_ok = common.key_padding(variant, mask, key_value_seq_lengths, query.shape[0], length)
  inputs, _ = prepare_inputs(
      query, key, value, None, None if key_ok is None else key_ok[:, None, None, :],
      scale=scale, is_causal=is_causal, query_seq_lengths=query_seq_lengths,
      segment_ids=segment_ids)
  block_sizes = None if block_size is None else kernel_common.BlockSizes(block_size, block_size)
  return block_sparse.block_sparse_attention(inputs, pattern, implementation=implementation,
                                             block_sizes=block_sizes, extra_blocks=extra_blocks)


def call_masks(is_causal, query_seq_lengths, key_value_seq_lengths, segment_ids, scale):
  """The masking arguments every sparse variant passes on to `kernel_attention`."""
  return dict(is_causal=is_causal, query_seq_lengths=query_seq_lengths,
              key_value_seq_lengths=key_value_seq_lengths, segment_ids=segment_ids, scale=scale)


# The option of the variants whose pattern also runs on the block-sparse flash kernel.
KERNEL_OPTION = dict(implementation="None: the pure-JAX form; 'blockwise', 'pallas_gpu' or "
                                    "'pallas_tpu': the block-sparse flash kernel (lax loops, "
                                    "Triton or Mosaic TPU), visiting only the blocks the "
                                    "pattern allows")
