"""attention_jax: attention variants as pure JAX functions and Flax modules.

  attention_jax.dot_product_attention   exact attention, drop-in for jax.nn's
  attention_jax.MultiHeadAttention      the Flax token mixer around any Q/K/V variant
  attention_jax.registry                every variant by name
"""

from attention_jax import registry
from attention_jax.core import make_attention_mask, masked_softmax, reference_attention
from attention_jax.layers.attention import MultiHeadAttention
from attention_jax.registry import get_variant, list_variants
from attention_jax import kernels  # registers the blockwise and Pallas implementations
from attention_jax.variants import (available_implementations, dot_product_attention,
                                    multi_head_attention, select_implementation)

__version__ = "0.1.0"
