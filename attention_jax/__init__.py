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
import importlib.util
import pathlib
import sys


def _import_checkout_kernels() -> None:
  """In a source checkout, `attention_jax.kernels` is the checkout's own kernels/.

  setup.cfg installs kernels/ (beside this package) as attention_jax.kernels. An
  editable install maps that name to the checkout it was installed from, so a
  second checkout run with the same environment (a clean clone making a table)
  imported its own attention_jax but the first checkout's kernels, and recorded
  its own git revision for the mix. Where this package sits in a checkout (a
  setup.cfg and kernels/ beside it), the kernels are loaded from there; an
  installed wheel has attention_jax/kernels/ inside and is left to the import
  system.
  """
  root = pathlib.Path(__file__).resolve().parent.parent
  init = root / "kernels" / "__init__.py"
  name = f"{__name__}.kernels"
  if name in sys.modules or not (root / "setup.cfg").is_file() or not init.is_file():
    return
  spec = importlib.util.spec_from_file_location(name, init,
                                                submodule_search_locations=[str(init.parent)])
  module = importlib.util.module_from_spec(spec)
  sys.modules[name] = module
  try:
    spec.loader.exec_module(module)
  except BaseException:
    del sys.modules[name]
    raise
  globals()["kernels"] = module


_import_checkout_kernels()

from attention_jax import registry  # pylint: disable=wrong-import-position
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
