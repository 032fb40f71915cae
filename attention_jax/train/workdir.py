"""A run's workdir: claimed for one config, and refused to another.

The workdir keeps `config.json`, what the run computes: a restart with a
config that differs in anything but `RESTARTABLE` keys is refused
(`WorkdirConflictError`), or with `overwrite` the old run is moved aside to
`<workdir>.replaced-<time>`. A finished run leaves `results.json` there.
"""

from __future__ import annotations

import datetime
import json
import pathlib
from typing import Any

import jax
import ml_collections

from attention_jax.train.config import config_differences

CONFIG_FILE = "config.json"
RESULTS_FILE = "results.json"


class WorkdirConflictError(ValueError):
  """The workdir holds a run of a different config."""


def check_workdir_path(workdir: pathlib.Path) -> None:
  """Raises ValueError when `workdir`, or a folder above it, is an existing file."""
  for path in (workdir, *workdir.parents):
    if path.exists():
      if not path.is_dir():
        where = "is" if path == workdir else f"is inside {path}, which is"
        raise ValueError(f"workdir {workdir} {where} an existing file, expected a directory (a "
                         f"new path, or the workdir of a run to resume).")
      return


def claim_workdir(workdir: pathlib.Path, config: ml_collections.ConfigDict,
                  overwrite: bool) -> None:
  """Writes the config into the workdir, or checks it against the run there."""
  saved_path = workdir / CONFIG_FILE
  current = json.loads(config.to_json())
  if saved_path.is_file():
    saved = json.loads(saved_path.read_text())
    differences = config_differences(saved, current)
    # A run that stopped before writing any metrics or checkpoint (e.g. a config
    # its variant refused at the first trace) leaves nothing to protect.
    holds_a_run = (workdir / "metrics.jsonl").exists() or any(
        path.name.isdigit() for path in (workdir / "checkpoints").glob("*"))
    if differences and not holds_a_run:
      differences = []
    if differences and not overwrite:
      listed = "; ".join(f"{key}: {old!r} there, {new!r} now" for key, old, new in
                         differences[:8])
      raise WorkdirConflictError(
          f"workdir {workdir} holds a run of a different config ({listed}"
          f"{'; ...' if len(differences) > 8 else ''}). Use another workdir, or overwrite=True "
          f"(--overwrite) to move that run aside to {workdir}.replaced-<time> and start afresh.")
    if differences and jax.process_index() == 0:
      stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
      workdir.rename(workdir.with_name(f"{workdir.name}.replaced-{stamp}"))
  if jax.process_index() == 0:
    workdir.mkdir(parents=True, exist_ok=True)
    write_json(saved_path, current)


def write_json(path: pathlib.Path, value: Any) -> None:
  """Writes `value` to `path` whole or not at all (through a .partial file)."""
  partial = path.with_name(path.name + ".partial")
  partial.write_text(json.dumps(value, indent=2, sort_keys=True, default=str) + "\n")
  partial.replace(path)
