"""Attention kernels, installed as `attention_jax.kernels` (never a top-level `kernels`).

The flash kernels' public entry points are re-exported here, so that
`from attention_jax import kernels; kernels.blockwise_dot_product_attention(...)`
works as the README shows; `kernels.flash_attention` holds the rest.
"""

from . import flash_attention
from .flash_attention import (BlockSizes, blockwise_dot_product_attention,
                              flash_dot_product_attention, gpu_dot_product_attention,
                              mgpu_dot_product_attention, ring_attention,
                              tpu_dot_product_attention)

__all__ = [
    "BlockSizes", "blockwise_dot_product_attention", "flash_attention",
    "flash_dot_product_attention", "gpu_dot_product_attention", "mgpu_dot_product_attention",
    "ring_attention", "tpu_dot_product_attention",
]
