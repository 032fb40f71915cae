"""The single list of what attention_jax implements.

Each family module in `attention_jax.variants` registers its variants here when
it is imported. The registry drives the README variant table, config
validation, and the test that every variant has a parity or property test.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

FAMILIES = ("dense", "scoring", "heads", "sparse", "hashing", "linear", "low_rank",
            "prior", "memory", "mixing", "kernels")


@dataclasses.dataclass(frozen=True)
class VariantSpec:
  """What one registered variant is.

  Attributes:
    name: the registry name (`config.model.attention = name`).
    fn: the pure function. For Q/K/V attention it takes `(query [B, Tq, H, D],
      key [B, Tk, Hkv, D], value [B, Tk, Hkv, Dv], bias=None, mask=None, **options)`
      and returns `[B, Tq, H, Dv]`.
    family: the VARIANTS.md family, which is also the file in `variants/`.
    complexity: time complexity in the sequence length, e.g. "O(T^2)".
    subquadratic: True when the variant never builds a T x T array.
    exact: True when it equals softmax attention (under its mask) exactly.
    causal: supports causal (autoregressive) masking.
    cross: supports cross-attention (Tq != Tk, keys from another sequence).
    paper: citation, "Author et al. YEAR".
    qkv: True when it is Q/K/V attention that `MultiHeadAttention(attention=name)` runs.
    mixer: the Flax module class for variants that are not Q/K/V attention.
    module_defaults: fields preset on the module (e.g. `num_kv_heads=1` for MQA).
    extras: for Q/K/V variants with arrays of their own (Linformer's
      projections, Performer's features, Synthesizer's scores): a Flax module
      class that `MultiHeadAttention` builds with the options that name its
      fields and calls as `extras(query, key, value, deterministic=...)`; the
      dict it returns is passed to `fn` as keyword arguments.
  """

  name: str
  fn: Callable[..., Any]
  family: str
  complexity: str
  subquadratic: bool
  exact: bool
  causal: bool
  cross: bool
  paper: str
  qkv: bool = True
  mixer: Optional[Callable[..., Any]] = None
  module_defaults: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  extras: Optional[Callable[..., Any]] = None

  @property
  def module(self) -> Callable[..., Any]:
    """Constructor of the variant's Flax module: `spec.module(num_heads=8, ...)`."""
    if self.mixer is not None:
      return functools.partial(self.mixer, **self.module_defaults)
    from attention_jax.layers.attention import MultiHeadAttention  # Avoids an import cycle.
    return functools.partial(MultiHeadAttention, attention=self.name, **self.module_defaults)


_REGISTRY: Dict[str, VariantSpec] = {}


def register(spec: VariantSpec) -> VariantSpec:
  """Adds `spec` to the registry; names are unique."""
  if spec.name in _REGISTRY:
    raise ValueError(f"variant {spec.name!r} is already registered.")
  if spec.family not in FAMILIES:
    raise ValueError(f"family must be one of {FAMILIES}, got {spec.family!r} for {spec.name!r}.")
  if not spec.qkv and spec.mixer is None:
    raise ValueError(f"variant {spec.name!r} is not Q/K/V attention, so it needs a mixer module.")
  _REGISTRY[spec.name] = spec
  return spec


def _load_variants() -> None:
  # Registration happens on import of the family modules.
  import attention_jax.variants  # pylint: disable=unused-import,import-outside-toplevel


def list_variants() -> Tuple[str, ...]:
  """All registered names, sorted by family (VARIANTS.md order) then name."""
  _load_variants()
  return tuple(sorted(_REGISTRY, key=lambda n: (FAMILIES.index(_REGISTRY[n].family), n)))


def get_variant(name: str) -> VariantSpec:
  """The spec registered under `name`; a ValueError lists the valid names otherwise."""
  _load_variants()
  if name not in _REGISTRY:
    raise ValueError(f"unknown attention variant {name!r}; valid names are: "
                     f"{', '.join(list_variants())}.")
  return _REGISTRY[name]


def variant_table_markdown() -> str:
  """The README's variant table, one row per registered variant."""
  rows = ["| name | family | complexity | causal | cross-attention | exact | paper |",
          "|---|---|---|---|---|---|---|"]
  yes_no = lambda flag: "yes" if flag else "no"
  for name in list_variants():
    spec = _REGISTRY[name]
    rows.append(f"| `{name}` | {spec.family} | {spec.complexity} | {yes_no(spec.causal)} | "
                f"{yes_no(spec.cross)} | {'exact' if spec.exact else 'approximate'} | "
                f"{spec.paper} |")
  return "\n".join(rows) + "\n"
