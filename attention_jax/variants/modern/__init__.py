"""The attention of 2023-2026 (VARIANTS.md K): one module per mechanism, each
with its pure function, its module and its registration:

  differential.py  two softmax maps subtracted with a learned lambda: differential

Importing this package registers the variants of every module.
"""

from attention_jax.variants.modern.differential import (DifferentialParameters,
                                                        differential_attention)
