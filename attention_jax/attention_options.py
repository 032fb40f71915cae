"""The attention options of a config, shaped in one place.

A variant declares its options once, at registration (`registry.VariantSpec.options`,
read back by `registry.variant_options`); where each goes inside the layer is
`VariantSpec.option_routes`. This module is everything a config does with them:

* `options_config`: the declared options at their defaults, as the ConfigDict
  `config.model.attention_options` holds, so that each can be set from the
  command line;
* `explicit_options`: the ones a config sets (not None, not the declared
  default), which is all a model passes on;
* `check_options`: every key declared by a variant in use;
* `options_of`: the subset one variant of a model declares (a model may run
  several, `layer_attention`);
* `with_preset`: a named option set (`registry.PRESETS`) completing a config's.

`models.ModelConfig` and `train.config` call these; neither filters or checks
options by itself.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, Mapping, Optional, Sequence, Tuple

import ml_collections

from attention_jax import registry


def options_config(*variants: str) -> ml_collections.ConfigDict:
  """The declared options of `variants` at their defaults (the first variant's
  default where two declare the same name); an option without a default is a
  typed placeholder, so `--config.model.attention_options.<name>=<value>` parses."""
  options = ml_collections.ConfigDict()
  for variant in variants:
    for option in registry.variant_options(variant):
      if option.name in options:
        continue
      if option.default is None:
        options[option.name] = ml_collections.config_dict.placeholder(option.type)
      else:
        options[option.name] = option.default
  return options


def explicit_options(options: Mapping[str, Any], variants: Sequence[str]) -> Dict[str, Any]:
  """`options` without those unset (None) or at the declared default of every
  one of `variants` that declares them: configs list every option so that each
  can be overridden, and only what differs is passed on."""
  defaults: Dict[str, list] = {}
  for variant in variants:
    for option in registry.variant_options(variant):
      defaults.setdefault(option.name, []).append(option.default)
  return without_defaults(options, defaults)


def without_defaults(options: Mapping[str, Any],
                     defaults: Mapping[str, Iterable[Any]]) -> Dict[str, Any]:
  """`options` without the None ones and those equal to each of their
  `defaults` (a list or tuple equals the other kind with the same items)."""
  return {name: value for name, value in options.items() if value is not None and (
      name not in defaults
      or any(_comparable(value) != _comparable(d) for d in defaults[name]))}


def check_options(options: Mapping[str, Any], variants: Sequence[str]) -> None:
  """Raises a ValueError naming the variants, their options and the closest
  one for the first key of `options` that none of `variants` declares."""
  if len(variants) == 1:
    registry.check_options(variants[0], options)
    return
  declared = {option.name for variant in variants for option in registry.variant_options(variant)}
  for key in options:
    if key not in declared:
      raise ValueError(f"no variant of layer_attention {tuple(variants)} has option {key!r}."
                       f"{registry.did_you_mean(key, declared)} Their options are: "
                       f"{', '.join(sorted(declared))}.")


def options_of(variant: str, options: Mapping[str, Any]) -> Dict[str, Any]:
  """The options among `options` that `variant` declares."""
  declared = {option.name for option in registry.variant_options(variant)}
  return {name: value for name, value in options.items() if name in declared}


def with_preset(variant: str, options: Mapping[str, Any], preset: str = "method",
                task: Optional[str] = None) -> Tuple[str, ml_collections.ConfigDict]:
  """The variant that preset `preset` of `variant` runs (`registry.preset_variant`)
  and its options: `options` completed with the preset's (for `task`, where
  the preset differs per task).

  The preset fills every option that `options` leaves unset or at its declared
  default; an option set to anything else is the user's and wins, so a preset
  can be run with one option changed. (An option explicitly set back to its
  default under a preset that changes it is indistinguishable from an unset one:
  the preset's value is used.) Where the preset runs another variant, the options
  the two share keep their values and the rest start at the new variant's defaults.

  Raises:
    ValueError: on an unknown preset, or one the variant does not have.
  """
  preset_options = registry.preset_options(variant, preset, task)
  preset_variant = registry.preset_variant(variant, preset)
  completed = options_config(preset_variant)
  for name, value in options.items():
    # An undeclared key stays while the variant does, for `check_options` to name.
    if value is not None and (name in completed or preset_variant == variant):
      completed[name] = value
  defaults = {option.name: option.default for option in registry.variant_options(preset_variant)}
  for name, value in preset_options.items():
    current = completed.get(name)
    if current is None or _comparable(current) == _comparable(defaults[name]):
      completed[name] = value
  return preset_variant, completed


def _comparable(value: Any) -> Any:
  return list(value) if isinstance(value, (tuple, list)) else value
