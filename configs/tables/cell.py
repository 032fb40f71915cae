"""One cell of a table: a task config plus overrides that `--config.a.b=value`
flags cannot express, such as new keys of the free-form
`model.attention_options` (an LSH chunk size, a Synthesizer's length).

  python -m experiments.train --workdir=... \\
      '--config=configs/tables/cell.py:configs/lra/text.py|lsh|{"model":{"pooling":"mean"}}'

The argument is `<task config file>|<that file's argument>|<JSON overrides>`;
the overrides are nested dicts merged key by key into the task config (a key
the trainer does not know is still refused by its config check).
`experiments.reproduce` writes these arguments for the cells of a table that
carry `cell_overrides`; other cells use the task config file directly.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any, Mapping

import ml_collections

from attention_jax.train.config import load_config_module

SEPARATOR = "|"


def load_config_file(path: str | pathlib.Path, arg: str) -> ml_collections.ConfigDict:
  """`get_config(arg)` of the config file at `path` (ValueError if it is missing)."""
  return load_config_module(path).get_config(arg)


def merge(config: ml_collections.ConfigDict, overrides: Mapping[str, Any]) -> None:
  """Sets each leaf of the nested `overrides` in `config` (in place), adding
  keys under free-form dicts."""
  for key, value in overrides.items():
    if isinstance(value, Mapping) and key in config and isinstance(
        config[key], (ml_collections.ConfigDict, dict)):
      merge(config[key], value)
    else:
      config[key] = value


def get_config(arg: str) -> ml_collections.ConfigDict:
  parts = (arg or "").split(SEPARATOR, 2)
  if len(parts) != 3:
    raise ValueError(f"expected '<config file>{SEPARATOR}<its argument>{SEPARATOR}<JSON "
                     f"overrides>', got {arg!r}.")
  path, config_arg, overrides = parts
  config = load_config_file(path, config_arg)
  with config.unlocked():
    merge(config, json.loads(overrides) if overrides.strip() else {})
  return config
