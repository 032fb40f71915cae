"""Blockwise-softmax (flash) attention: pure-JAX `blockwise`, and Pallas kernels.

Importing this package registers the implementations with
`attention_jax.dot_product_attention(..., implementation=...)` and the variants
`blockwise` and `flash` with the registry.
"""

import jax

from attention_jax import registry
from attention_jax.variants.dense import register_implementation

from .blockwise import blockwise_attention, blockwise_dot_product_attention, default_block_sizes
from .common import BlockSizes


def _blockwise_priority(inputs) -> int:
  """On CPU, blockwise beats dense XLA once the score matrix is large (see
  benchmarks/attention_cpu.json); elsewhere it is the portable fallback."""
  on_cpu = jax.default_backend() == "cpu"
  large = inputs.query.shape[1] * inputs.key.shape[1] >= BLOCKWISE_MIN_SCORES_ON_CPU
  return 1 if on_cpu and large else -1


# Tq * Tk from which `implementation=None` prefers blockwise to dense on CPU.
BLOCKWISE_MIN_SCORES_ON_CPU = 1024 * 1024
register_implementation("blockwise", blockwise_attention, priority=_blockwise_priority)

registry.register(registry.VariantSpec(
    name="blockwise", fn=blockwise_dot_product_attention, family="kernels",
    complexity="O(T^2)", subquadratic=False, exact=True, causal=True, cross=True,
    paper="Rabe & Staats 2021; Dao et al. 2022"))
