"""Blockwise-softmax (flash) attention: pure-JAX `blockwise`, and Pallas kernels.

Importing this package registers the implementations with
`attention_jax.dot_product_attention(..., implementation=...)` and the variants
`blockwise` and `flash` with the registry.
"""

from attention_jax import registry
from attention_jax.variants.dense import register_implementation

from .blockwise import blockwise_attention, blockwise_dot_product_attention, default_block_sizes
from .common import BlockSizes

# The portable fallback: never chosen by `implementation=None` over a faster one.
register_implementation("blockwise", blockwise_attention, priority=-1)

registry.register(registry.VariantSpec(
    name="blockwise", fn=blockwise_dot_product_attention, family="kernels",
    complexity="O(T^2)", subquadratic=False, exact=True, causal=True, cross=True,
    paper="Rabe & Staats 2021; Dao et al. 2022"))
