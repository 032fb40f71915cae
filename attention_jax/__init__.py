"""attention_jax: attention variants as pure JAX functions and Flax modules.

  attention_jax.dot_product_attention   exact attention, drop-in for jax.nn's
  attention_jax.flex_attention          your score_mod and mask_mod compiled into the kernels
                                        (create_block_mask, and_masks, or_masks, mods)
  attention_jax.MultiHeadAttention      the Flax token mixer around any Q/K/V variant
  attention_jax.registry                every variant by name
  attention_jax.variant_options(name)   what a variant's config may set
  attention_jax.preset_options(name, "lra_release", task="listops")
                                        a named option set (the LRA release's settings)

Importing the package imports the pure level only (core, variants, kernels,
positional); the Flax layers and models load when first used, so a pure
function never pulls in a module and the layers can build on the registry.
"""

import importlib

from attention_jax import registry
from attention_jax.core import make_attention_mask, masked_softmax, reference_attention
from attention_jax.registry import get_variant, list_variants, preset_options, variant_options
from attention_jax import kernels  # registers the blockwise and Pallas implementations
from attention_jax.variants import (available_implementations, dot_product_attention,
                                    multi_head_attention, select_implementation)
from attention_jax.core import mods, patterns
from attention_jax.core.block_mask import BlockMask, create_block_mask
from attention_jax.core.patterns import and_masks, or_masks
from attention_jax.flex import flex_attention

__version__ = "0.1.0"

# Names served from the module level on first use (PEP 562).
_LAZY = {"MultiHeadAttention": "attention_jax.layers.attention",
         "layers": "attention_jax.layers", "models": "attention_jax.models"}


def __getattr__(name):
  if name in _LAZY:
    module = importlib.import_module(_LAZY[name])
    return module if module.__name__.endswith(name) else getattr(module, name)
  raise AttributeError(f"module 'attention_jax' has no attribute {name!r}")
