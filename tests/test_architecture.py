"""Import rules between the packages (docs/ARCHITECTURE.md), read from the source with `ast`.

The kernel interface (`AttentionInputs`, `prepare_inputs`, the implementation
registry) lives in `attention_jax/core/`, so the kernels import only core and
a variant can call a kernel without an import cycle. The files are parsed, not
imported: importing any `attention_jax` module runs the package's `__init__`,
which loads every level.
"""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Each checked directory and the package it is installed as (setup.cfg maps
# `kernels/` to `attention_jax.kernels`).
PACKAGES = {"kernels": "attention_jax.kernels", "attention_jax/core": "attention_jax.core"}


def _imported_modules(source: str, module: tuple) -> set:
  """Every module `source` imports, absolute. `module` is the file's dotted
  name as parts, a package's ending in "__init__" (so that `parts[:-level]` is
  what a relative import of that level starts from). `from a import b` counts
  as `a` and `a.b`, since b may be a submodule."""
  modules = set()
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, ast.Import):
      modules.update(alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom):
      base = node.module
      if node.level:
        base = ".".join(module[:-node.level] + ((node.module,) if node.module else ()))
      modules.add(base)
      modules.update(f"{base}.{alias.name}" for alias in node.names)
  return modules


def _violations(directory: str, forbidden: tuple) -> list:
  files = sorted((ROOT / directory).rglob("*.py"))
  assert files, f"no Python files under {directory}/"
  found = []
  for path in files:
    module = (tuple(PACKAGES[directory].split("."))
              + path.relative_to(ROOT / directory).with_suffix("").parts)
    bad = [imported for imported in sorted(_imported_modules(path.read_text(), module))
           if any(imported == name or imported.startswith(name + ".") for name in forbidden)]
    # `from a.b import c, d` is reported once, as a.b.
    found += [f"{path.relative_to(ROOT)} imports {imported}" for imported in bad
              if not any(imported.startswith(other + ".") for other in bad)]
  return found


def test_kernels_import_no_variant_layer_or_model():
  """Kernels sit below the variants: they import core, never a variant, layer
  or model. (`attention_jax.registry` is allowed: it is data, and
  kernels/flash_attention/__init__.py registers the variants "blockwise" and
  "flash" there, as every pure-level file may.)"""
  assert _violations("kernels", ("attention_jax.variants", "attention_jax.layers",
                                 "attention_jax.models")) == []


def test_core_imports_no_variant_layer_model_or_kernel():
  assert _violations("attention_jax/core", ("attention_jax.variants", "attention_jax.layers",
                                            "attention_jax.models",
                                            "attention_jax.kernels")) == []


_BLOCKWISE = ("attention_jax", "kernels", "flash_attention", "blockwise")
_FLASH_INIT = ("attention_jax", "kernels", "flash_attention", "__init__")


@pytest.mark.parametrize("source, module, expected", [
    ("from attention_jax.variants.dense import prepare_inputs", _BLOCKWISE,
     "attention_jax.variants.dense"),
    ("from attention_jax import variants", _BLOCKWISE, "attention_jax.variants"),
    ("import attention_jax.models.blocks", _BLOCKWISE, "attention_jax.models.blocks"),
    ("from ...variants import common", _BLOCKWISE, "attention_jax.variants.common"),
    ("from ... import layers", _FLASH_INIT, "attention_jax.layers"),
    ("from . import ring", _FLASH_INIT, "attention_jax.kernels.flash_attention.ring"),
])
def test_the_check_sees_each_form_of_import(source, module, expected):
  """The rules are not vacuous: absolute imports, `from package import module`
  and relative ones (from a module and from a package's __init__) all count."""
  assert expected in _imported_modules(source, module)
