"""Attention variants: one module per family, pure function and Flax module side by side;
the larger families (sparse, prior, mixing) are packages of one module per mechanism.

Importing this package registers every variant in `attention_jax.registry`.
"""

from attention_jax.variants.dense import (available_implementations, dot_product_attention,
                                          register_implementation, select_implementation)
from attention_jax.variants.heads import multi_head_attention
# The families of VARIANTS.md; each registers its variants when imported.
from attention_jax.variants import (chunkwise, composed, hashing, linear, low_rank, memory, mixing,
                                    modern, pooling, prior, recurrence, scoring, sparse,
                                    structured)
