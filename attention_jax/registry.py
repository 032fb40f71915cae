"""The single list of what attention_jax implements.

Each family module in `attention_jax.variants` registers its variants here when
it is imported. The registry drives the README variant table, the options
table of docs/variants.md, config validation, and the test that every variant
has a parity or property test.

The registry is data: it imports no Flax layer. A mixer module may be named by
its import path ("attention_jax.layers.attention:MultiHeadAttention"), which
is resolved only when a model asks for the module.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import importlib
import inspect
import re
import typing
from typing import Any, Callable, Dict, Iterable, Mapping, Optional, Tuple, Union

FAMILIES = ("dense", "scoring", "heads", "sparse", "hashing", "linear", "low_rank",
            "prior", "memory", "recurrence", "mixing", "kernels", "composed", "modern",
            "chunkwise")
# What a variant's module does, and the call it answers (`VariantSpec.role`).
# Only a "mixer" can be a block's token mixer (`get_mixer`); the others are
# section A mechanisms that attend but map no sequence to a sequence.
ROLES = {
    "mixer": "a token mixer: mixer(x [B, T, E], context=None, *, mask=None, ...) -> [B, T, E]",
    "pooling": "pool(x [B, T, E], *, mask=None [B, T]) -> [B, F]; a classifier pools with it "
               "(model.pooling='attention')",
    "alignment": "align(a [B, Ta, E], b [B, Tb, E], *, a_mask=None, b_mask=None) -> "
                 "(m_a [B, Ta, F], m_b [B, Tb, F]); call it on two encoded sequences",
}

# What a Q/K/V variant's function takes from MultiHeadAttention besides the
# masks, declared at registration (`VariantSpec.takes`): capability -> the
# keyword arguments the layer then passes. The layer reads the declaration; it
# never inspects the function.
CAPABILITIES = {
    "dropout": ("dropout_rate", "dropout_rng"),  # it has attention weights to drop
    "query_positions": ("query_positions",),  # it places each query (Luong's local-m)
    "aux_losses": ("sow_loss",),  # it adds auxiliary losses (the "losses" collection)
    "recurrent_state": ("recurrent_state",),  # it decodes from a state, not a KV cache
    # it takes a flex score_mod, applied per tile: relative positions (ALiBi,
    # T5) reach it as one instead of a [B, H, Tq, Tk] bias
    "score_mod": ("score_mod",),
    # it is told whether the layer decodes from a cache, to refuse what reads
    # token indices there (the flex variant's named mods and windows)
    "decoding": ("decoding",),
    # it is told how many features the layer's RoPE or xPos rotated, pairing
    # feature i with i + width / 2 (differential keeps each pair in one half)
    "rotary_width": ("rotary_width",),
}
# What MultiHeadAttention passes to every Q/K/V variant's function itself.
LAYER_ARGUMENTS = frozenset({"query", "key", "value", "bias", "mask", "is_causal",
                             "query_seq_lengths", "key_value_seq_lengths", "segment_ids",
                             "carry", *(name for names in CAPABILITIES.values() for name in names)})


@dataclasses.dataclass(frozen=True)
class VariantSpec:
  """What one registered variant is.

  Attributes:
    name: the registry name (`config.model.attention = name`).
    fn: the pure function. For Q/K/V attention it takes `(query [B, Tq, H, D],
      key [B, Tk, Hkv, D], value [B, Tk, Hkv, Dv], bias=None, mask=None, **options)`
      and returns `[B, Tq, H, Dv]`.
    family: the VARIANTS.md family, which is also the file (or package) in `variants/`.
    complexity: time complexity in the sequence length, e.g. "O(T^2)".
    subquadratic: True when the variant never builds a T x T array.
    exact: True when it equals softmax attention (under its mask) exactly.
    causal: supports causal (autoregressive) masking.
    cross: supports cross-attention (Tq != Tk, keys from another sequence).
    paper: citation, "Author et al. YEAR".
    qkv: True when it is Q/K/V attention that `MultiHeadAttention(attention=name)` runs.
    mixer: the Flax module class for variants that are not Q/K/V attention.
    module_defaults: fields preset on the module (e.g. `num_kv_heads=1` for MQA).
    module_options: the declared options that set a field of the module
      instead of being passed to `fn` (fixed_head_size's `head_dim`, a field
      of `MultiHeadAttention`); `models.blocks.make_mixer` routes them. Named
      explicitly, not matched by field name: an attention function's option
      may share a name with a layer field (memory_compressed's `use_bias`).
    extras: for Q/K/V variants with arrays of their own (Linformer's
      projections, Performer's features, Synthesizer's scores): a Flax module
      class that `MultiHeadAttention` builds with the options that name its
      fields and calls as `extras(query, key, value, deterministic=...)`; the
      dict it returns is passed to `fn` as keyword arguments.
    options: the options a config may set, `{name: one-line doc}` (type and
      default read from `fn`'s signature, the `extras` fields or the mixer's
      fields, in that order) or `{name: VariantOption(...)}` where they cannot
      be read. See `variant_options`.
    carries: the keys this variant reads from and writes to the carry that the
      layer stack passes from block to block (e.g. RealFormer's scores).
    initial_carry: `initial_carry(batch, length, num_heads) -> {key: array}`,
      the carry before the first layer, for variants with `carries`.
    skipped_carry: `skipped_carry(carry) -> carry`, the carry past this
      variant's block when LayerDrop skips it in training; None: unchanged.
      A count of the layers before (differential's depth) still counts it.
    presets: named option sets, `{preset name: Preset}` (see `PRESETS`);
      "method" (the paper's method with our defaults) needs no entry.
    not_decodable: why the variant cannot decode one token at a time in a
      language model (`ModelConfig.decode`, `generation.generate`), where
      `decoding_refusal` cannot tell from the other fields; None otherwise.
    takes: the `CAPABILITIES` of a Q/K/V variant's function, e.g.
      ("dropout",): what `MultiHeadAttention` passes it besides the masks.
      Checked against the function when registered: a function that names
      one of their arguments must declare it, and one that declares it must
      take it (by name or through **kwargs it passes on).
    bidirectional: the variant has a non-causal form (a query may attend to
      later keys); False for the causal-only mechanisms (stick-breaking,
      whose stick breaks from the nearest earlier key), which a model with a
      bidirectional encoder refuses.
    steps_from_cache: a self-attention-only Q/K/V variant (`cross=False`)
      whose function still takes a decoding step: fewer queries than keys,
      placed by the layer's cache mask (and `query_positions` where it
      declares them). Without it, `cross=False` means it cannot decode.
    role: what the module is, one of `ROLES`: "mixer" (every variant a
      block can run), or "pooling" / "alignment" for mechanisms that are
      not token mixers (attention pooling, ESIM's cross alignment). Those
      have `qkv=False`, their module in `mixer`, and are refused as a
      block's mixer (`get_mixer`); for pooling, `subquadratic` means that it
      never builds a T x T array, as for a mixer.
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
  mixer: Union[None, str, Callable[..., Any]] = None
  module_defaults: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  module_options: Tuple[str, ...] = ()
  extras: Optional[Callable[..., Any]] = None
  options: Mapping[str, Union[str, "VariantOption"]] = dataclasses.field(default_factory=dict)
  carries: Tuple[str, ...] = ()
  initial_carry: Optional[Callable[..., Dict[str, Any]]] = None
  skipped_carry: Optional[Callable[[Dict[str, Any]], Dict[str, Any]]] = None
  presets: Mapping[str, "Preset"] = dataclasses.field(default_factory=dict)
  role: str = "mixer"
  bidirectional: bool = True
  steps_from_cache: bool = False
  not_decodable: Optional[str] = None
  takes: Tuple[str, ...] = ()

  @property
  def in_attention_layer(self) -> bool:
    """Whether `MultiHeadAttention` runs it (Q/K/V variants, and the head
    layouts registered with it as their mixer), so that it takes
    `attention_options`."""
    return self.qkv or self.mixer == ATTENTION_MIXER

  def can(self, capability: str) -> bool:
    """Whether the function takes `capability`'s arguments (`CAPABILITIES`)."""
    if capability not in CAPABILITIES:
      raise unknown_name_error("capability", capability, CAPABILITIES)
    return capability in self.takes

  @functools.cached_property
  def option_routes(self) -> Mapping[str, Tuple[str, ...]]:
    """Where each declared option goes: `{option: places}`, the places among
    "layer" (a field of `MultiHeadAttention`, `module_options`), "extras" (a
    field of the variant's `extras` module) and "fn" (the attention function
    the layer runs). An extras field goes to the function too when the
    function names it (Performer's `kernel`). A mixer of its own (not run by
    `MultiHeadAttention`) takes every option as a field: "layer"."""
    if not self.in_attention_layer:
      return {name: ("layer",) for name in self.options}
    extras = set() if self.extras is None else {f.name for f in dataclasses.fields(self.extras)}
    fn_names = set(inspect.signature(self.fn).parameters)
    routes = {}
    for name in self.options:
      if name in self.module_options:
        routes[name] = ("layer",)
      elif name in extras:
        routes[name] = ("extras", "fn") if name in fn_names else ("extras",)
      else:
        routes[name] = ("fn",)
    return routes

  def route_options(self, options: Mapping[str, Any]) -> Dict[str, Dict[str, Any]]:
    """`options` split by where they go (`option_routes`): `{"layer": ...,
    "extras": ..., "fn": ...}`. An option routed to two places is in both; one
    the variant does not declare goes to "fn", whose signature then names it."""
    routed: Dict[str, Dict[str, Any]] = {"layer": {}, "extras": {}, "fn": {}}
    for name, value in options.items():
      for place in self.option_routes.get(name, ("fn",)):
        routed[place][name] = value
    return routed

  @functools.cached_property
  def call_arguments(self) -> Tuple[str, ...]:
    """The keywords of the function that the layer does not pass itself
    (`LAYER_ARGUMENTS`): what a caller may pass per call
    (`MultiHeadAttention(attention_arguments=...)`, e.g. a routing's rng),
    unless an option already sets it."""
    return tuple(name for name, p in inspect.signature(self.fn).parameters.items()
                 if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)
                 and name not in LAYER_ARGUMENTS)

  @property
  def mixer_class(self) -> Callable[..., Any]:
    """The Flax module class a model builds for this variant (imported on demand)."""
    mixer = self.mixer if self.mixer is not None else ATTENTION_MIXER
    return _resolve(mixer) if isinstance(mixer, str) else mixer

  @property
  def decoding_refusal(self) -> Optional[str]:
    """Why the variant cannot decode one token at a time, or None when it
    can: its module then takes `decode=True` and, fed the tokens one by one,
    gives its full causal forward pass (tested for every causal mixer)."""
    if self.not_decodable is not None:
      return self.not_decodable
    if not self.causal:
      return "it has no causal form"
    if not self.cross and self.qkv and not self.steps_from_cache:
      return ("it is self-attention only (Tq = Tk), and a decoding step is one query against "
              "the cached keys")
    if "decode" not in {f.name for f in dataclasses.fields(self.mixer_class)}:
      return f"its module {self.mixer_class.__name__} keeps no decoding cache"
    return None

  @property
  def module(self) -> Callable[..., Any]:
    """Constructor of the variant's Flax module: `spec.module(num_heads=8, ...)`."""
    if self.mixer is not None:
      return functools.partial(self.mixer_class, **self.module_defaults)
    return functools.partial(self.mixer_class, attention=self.name, **self.module_defaults)


# The module that runs every Q/K/V variant; named, not imported, so that the
# registry (and the pure functions that register into it) never import layers.
ATTENTION_MIXER = "attention_jax.layers.attention:MultiHeadAttention"


def _resolve(path: str) -> Any:
  module, _, attribute = path.partition(":")
  return getattr(importlib.import_module(module), attribute)


@dataclasses.dataclass(frozen=True)
class VariantOption:
  """One option of a variant: `config.model.attention_options.<name>`.

  Attributes:
    name: the keyword the variant's function or module takes.
    type: the Python type of a value (int, float, bool, str or tuple); None is
      always accepted where the default is None.
    default: the value used when the option is not set.
    doc: one line saying what it does.
  """

  name: str
  type: type
  default: Any
  doc: str


# The named option sets a variant may carry (../shared/DESIGN.md, "Presets for
# reproduction"). Tables name the preset each of their rows ran.
PRESETS = {
    "method": "the paper's method, with the defaults its paper documents (the option "
              "defaults of the registry)",
    "lra_release": "the settings the Long-Range-Arena release's code and per-task configs "
                   "ran (google-research/long-range-arena), including where that code does "
                   "something other than its paper describes (docs/lra_release.md)",
}


@dataclasses.dataclass(frozen=True)
class Preset:
  """One named option set of a variant.

  Attributes:
    options: `{option: value}`, every key a declared option of the variant.
    doc: what the preset changes against the defaults, and why (one or two
      sentences; docs/lra_release.md cites the release's files).
    tasks: per-task changes on top of `options`, `{task: {option: value}}`
      (the LRA release ran some variants differently on some tasks).
    variant: the registered variant the preset runs, when it is not the one
      that declares it (the release's "Synthesizer" is the Random Synthesizer
      mixed with dot-product logits, not the Dense one); `options` are then
      that variant's.
  """

  options: Mapping[str, Any]
  doc: str
  tasks: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)
  variant: Optional[str] = None


_REGISTRY: Dict[str, VariantSpec] = {}


def register(spec: VariantSpec) -> VariantSpec:
  """Adds `spec` to the registry; names are unique."""
  if spec.name in _REGISTRY:
    raise ValueError(f"variant {spec.name!r} is already registered.")
  if spec.family not in FAMILIES:
    raise ValueError(f"family must be one of {FAMILIES}, got {spec.family!r} for {spec.name!r}.")
  if spec.role not in ROLES:
    raise unknown_name_error(f"role of variant {spec.name!r}:", spec.role, ROLES)
  if spec.role != "mixer" and spec.qkv:
    raise ValueError(f"variant {spec.name!r} has role {spec.role!r}, so it is not Q/K/V "
                     f"attention that MultiHeadAttention runs: register it with qkv=False and "
                     f"its module as `mixer`.")
  if not spec.qkv and spec.mixer is None:
    raise ValueError(f"variant {spec.name!r} is not Q/K/V attention, so it needs a mixer module.")
  for option in spec.module_options:
    if option not in spec.options:
      raise ValueError(f"variant {spec.name!r} routes option {option!r} to its module "
                       f"(module_options) but does not declare it; declared: "
                       f"{', '.join(spec.options) or 'none'}.")
  for preset in spec.presets:
    if preset not in PRESETS:
      raise unknown_name_error(f"preset of variant {spec.name!r}:", preset, PRESETS)
  _check_capabilities(spec)
  _REGISTRY[spec.name] = spec
  return spec


def _check_capabilities(spec: VariantSpec) -> None:
  """`spec.takes` names known capabilities and agrees with its function."""
  for capability in spec.takes:
    if capability not in CAPABILITIES:
      raise unknown_name_error(f"capability of variant {spec.name!r}:", capability, CAPABILITIES)
  if not spec.qkv:
    if spec.takes:
      raise ValueError(f"variant {spec.name!r} is a mixer module, not a Q/K/V function the "
                       f"layer calls: its module's fields say what it takes, got "
                       f"takes={spec.takes}.")
    return
  parameters = inspect.signature(spec.fn).parameters
  passes_on = any(p.kind == p.VAR_KEYWORD for p in parameters.values())
  for capability, arguments in CAPABILITIES.items():
    named = [a for a in arguments if a in parameters]
    if named and capability not in spec.takes:
      raise ValueError(f"variant {spec.name!r}: its function takes {', '.join(named)}, so "
                       f"register it with {capability!r} in takes (got takes={spec.takes}).")
    if capability in spec.takes and not passes_on and len(named) < len(arguments):
      raise ValueError(f"variant {spec.name!r} declares {capability!r} in takes, but its "
                       f"function takes neither {', '.join(arguments)} by name nor **kwargs.")


def _load_variants() -> None:
  # Registration happens on import of the family modules.
  import attention_jax.variants  # pylint: disable=unused-import,import-outside-toplevel


def list_variants(role: Optional[str] = None) -> Tuple[str, ...]:
  """All registered names (of `role` only, when given), sorted by family
  (VARIANTS.md order) then name."""
  _load_variants()
  if role is not None and role not in ROLES:
    raise unknown_name_error("role", role, ROLES)
  names = [n for n in _REGISTRY if role is None or _REGISTRY[n].role == role]
  return tuple(sorted(names, key=lambda n: (FAMILIES.index(_REGISTRY[n].family), n)))


def did_you_mean(name: str, valid: Iterable[str]) -> str:
  """" Did you mean 'x'?" for the closest of `valid` to `name`, or ""."""
  close = difflib.get_close_matches(str(name), list(valid), n=1, cutoff=0.6)
  return f" Did you mean {close[0]!r}?" if close else ""


def unknown_name_error(what: str, name: Any, valid: Iterable[str]) -> ValueError:
  """The project's one message for a name that is not one of `valid`: the
  name, the closest valid one, and the whole list."""
  valid = list(valid)
  return ValueError(f"unknown {what} {name!r}.{did_you_mean(name, valid)} Valid names are: "
                    f"{', '.join(valid)}.")


def get_variant(name: str) -> VariantSpec:
  """The spec registered under `name`; a ValueError lists the valid names otherwise."""
  _load_variants()
  if name not in _REGISTRY:
    raise unknown_name_error("attention variant", name, list_variants())
  return _REGISTRY[name]


def get_mixer(name: str) -> VariantSpec:
  """The spec of token mixer `name`: `get_variant(name)`, and a ValueError
  saying what it is instead when its role is not "mixer" (a pooling or an
  alignment module cannot run in a block)."""
  spec = get_variant(name)
  if spec.role != "mixer":
    article = "an" if spec.role[0] in "aeiou" else "a"
    raise ValueError(f"{name!r} is {article} {spec.role} module, not a token mixer: "
                     f"{ROLES[spec.role]}. registry.list_variants('mixer') lists the token "
                     f"mixers.")
  return spec


# Annotation strings (the family files use `from __future__ import annotations`)
# of the option types a config can hold.
_TYPE_NAMES = {"int": int, "float": float, "bool": bool, "str": str, "Sequence[int]": tuple,
               "Tuple[int, int]": tuple, "Tuple[int, ...]": tuple}


def _option_type(name: str, annotation: Any, default: Any, variant: str) -> type:
  if default is not None:
    return tuple if isinstance(default, (tuple, list)) else type(default)
  if isinstance(annotation, str):
    inner = re.fullmatch(r"Optional\[(.*)\]", annotation.strip())
    annotation = inner.group(1) if inner else annotation.strip()
    if annotation in _TYPE_NAMES:
      return _TYPE_NAMES[annotation]
  else:  # A typing object: Optional[X] is Union[X, None].
    inner = [t for t in typing.get_args(annotation) if t is not type(None)]
    annotation = inner[0] if len(inner) == 1 else annotation
    if annotation in (int, float, bool, str, tuple):
      return annotation
  raise TypeError(f"variant {variant!r}: cannot read the type of option {name!r} (annotation "
                  f"{annotation!r}); declare it as VariantOption(name, type, default, doc).")


def _option_sources(spec: VariantSpec):
  """`{keyword: (annotation, default)}` of the places an option can come from.

  Raises:
    TypeError: a declared option with different defaults in two places. A
      config's option equal to the reported default is dropped
      (`ModelConfig`), so the place with the other default would silently
      keep it: one default, in one place.
  """
  sources, places = {}, {}
  for cls in (spec.mixer_class if spec.mixer is not None else None, spec.extras):
    if cls is not None:
      for field in dataclasses.fields(cls):
        if field.default is not dataclasses.MISSING:
          sources[field.name] = (field.type, field.default)
          places.setdefault(field.name, []).append((cls.__name__, field.default))
  for parameter in inspect.signature(spec.fn).parameters.values():
    if parameter.default is not inspect.Parameter.empty:
      sources[parameter.name] = (parameter.annotation, parameter.default)
      places.setdefault(parameter.name, []).append((spec.fn.__name__, parameter.default))
  for name, defaults in places.items():
    if name in spec.options and len({repr(default) for _, default in defaults}) > 1:
      where = ", ".join(f"{default!r} in {place}" for place, default in defaults)
      raise TypeError(f"variant {spec.name!r}: option {name!r} has two defaults ({where}); "
                      f"give it one, in one place, and make the others required.")
  return sources


@functools.lru_cache(maxsize=None)
def variant_options(name: str) -> Tuple[VariantOption, ...]:
  """The options `name` declares, in declaration order: each one's name, type,
  default and a line of doc. These, and only these, may be set in
  `config.model.attention_options` for this variant.

  Raises:
    ValueError: on an unknown variant name.
  """
  spec = get_variant(name)
  sources = None
  options = []
  for option_name, declared in spec.options.items():
    if isinstance(declared, VariantOption):
      options.append(declared)
      continue
    sources = _option_sources(spec) if sources is None else sources
    if option_name not in sources:
      raise TypeError(f"variant {name!r} declares option {option_name!r}, which neither its "
                      f"function nor its modules take with a default.")
    annotation, default = sources[option_name]
    options.append(VariantOption(option_name, _option_type(option_name, annotation, default,
                                                           name), default, declared))
  return tuple(options)


def check_options(name: str, options: Mapping[str, Any]) -> None:
  """Raises a ValueError naming the variant, its options and the closest one
  for each key of `options` that variant `name` does not declare."""
  declared = [option.name for option in variant_options(name)]
  for key in options:
    if key not in declared:
      listed = ", ".join(declared) if declared else "none"
      raise ValueError(f"attention variant {name!r} has no option {key!r}."
                       f"{did_you_mean(key, declared)} Its options are: {listed} "
                       f"(attention_jax.variant_options({name!r}) describes them).")


def variant_presets(name: str) -> Tuple[str, ...]:
  """The presets variant `name` has: always "method", then those it declares."""
  return ("method", *[p for p in get_variant(name).presets if p != "method"])


def preset_options(name: str, preset: str = "method",
                   task: Optional[str] = None) -> Dict[str, Any]:
  """The options preset `preset` of variant `name` sets (on task `task`, where
  the preset differs per task): `{}` for "method" unless the variant declares it.
  They are options of `preset_variant(name, preset)`.

  Raises:
    ValueError: on an unknown variant or preset, or a preset the variant lacks.
  """
  return _preset(name, preset, task)[1]


def preset_variant(name: str, preset: str = "method") -> str:
  """The registered variant that preset `preset` of `name` runs: `name` itself
  unless the preset names another (see `Preset.variant`)."""
  return _preset(name, preset, None)[0]


def _preset(name: str, preset: str, task: Optional[str]) -> Tuple[str, Dict[str, Any]]:
  spec = get_variant(name)
  if preset not in PRESETS:
    raise unknown_name_error("preset", preset, PRESETS)
  if preset not in variant_presets(name):
    raise ValueError(f"attention variant {name!r} has no preset {preset!r}; its presets are: "
                     f"{', '.join(variant_presets(name))}.")
  declared = spec.presets.get(preset)
  if declared is None:
    return name, {}
  variant = declared.variant or name
  options = dict(declared.options)
  options.update(declared.tasks.get(task, {}) if task is not None else {})
  check_options(variant, options)
  return variant, options


def options_table_markdown() -> str:
  """docs/variants.md's table: every variant's declared options."""
  rows = ["| variant | option | type | default | what it does |", "|---|---|---|---|---|"]
  for name in list_variants():
    options = variant_options(name)
    if not options:
      rows.append(f"| `{name}` | | | | no options |")
    for option in options:
      rows.append(f"| `{name}` | `{option.name}` | {option.type.__name__} | "
                  f"`{option.default!r}` | {option.doc} |")
  return "\n".join(rows) + "\n"


def presets_table_markdown() -> str:
  """docs/lra_release.md's table: every declared preset, its options per task."""
  rows = ["| variant | preset | runs | tasks | options | what it changes |",
          "|---|---|---|---|---|---|"]
  for name in list_variants():
    for preset_name, preset in get_variant(name).presets.items():
      shown = lambda options: ", ".join(f"`{k}={v!r}`" for k, v in options.items()) or "none"
      rows.append(f"| `{name}` | `{preset_name}` | `{preset.variant or name}` | all | "
                  f"{shown(preset.options)} | {preset.doc} |")
      for task, options in preset.tasks.items():
        rows.append(f"| | | | {task} | {shown(options)} | on {task}, on top of the above |")
  return "\n".join(rows) + "\n"


def variant_table_markdown() -> str:
  """The README's variant table, one row per registered variant."""
  rows = ["| name | family | complexity | causal | cross-attention | exact | decodes | paper |",
          "|---|---|---|---|---|---|---|---|"]
  yes_no = lambda flag: "yes" if flag else "no"
  for name in list_variants():
    spec = _REGISTRY[name]
    # A module that is not a token mixer says so next to its family.
    family = spec.family if spec.role == "mixer" else f"{spec.family} ({spec.role})"
    # Decodes one token at a time in the language model (why not: `decoding_refusal`).
    decodes = "-" if spec.role != "mixer" or not spec.causal else yes_no(
        spec.decoding_refusal is None)
    rows.append(f"| `{name}` | {family} | {spec.complexity} | {yes_no(spec.causal)} | "
                f"{yes_no(spec.cross)} | {'exact' if spec.exact else 'approximate'} | "
                f"{decodes} | {spec.paper} |")
  return "\n".join(rows) + "\n"
