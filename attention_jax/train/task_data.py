"""The task a config trains on: its options, where its prepared data lives, and
its splits, prepared once per filesystem.

  task, splits = prepare_splits(config)
"""

from __future__ import annotations

import hashlib
import json
import pathlib
from typing import Any, Dict, Tuple

import jax
from jax.experimental import multihost_utils
import ml_collections

from attention_jax import data as lra_data


def task_options(config: ml_collections.ConfigDict) -> Dict[str, Any]:
  """The task's make_task options: those the config sets (not None)."""
  return {key: value for key, value in dict(config.task_options).items() if value is not None}


def task_data_dir(config: ml_collections.ConfigDict) -> pathlib.Path:
  """Where the config's task data lives: `data_dir` itself for the task's
  default options (what `experiments.make_data --task <name>` writes), else a
  subfolder named by a hash of the options, so that a smoke-sized set and the
  full set never overwrite or stand in for each other."""
  # Where the data is read from, and how fast, do not change what it is.
  options = {key: value for key, value in task_options(config).items()
             if key not in ("release_dir", "data_dir_tfds", "download", "workers")}
  if not options:
    return pathlib.Path(config.data_dir)
  digest = hashlib.sha256(json.dumps(options, sort_keys=True, default=str).encode()).hexdigest()
  folder = pathlib.Path(config.data_dir) / f"{config.task}-{digest[:10]}"
  if jax.process_index() == 0:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "task_options.json").write_text(json.dumps(options, indent=1, sort_keys=True,
                                                         default=str) + "\n")
  return folder


def prepare_splits(config: ml_collections.ConfigDict
                   ) -> Tuple[lra_data.Task, Dict[str, lra_data.ExampleSource]]:
  """The config's task and its splits, prepared first when `config.prepare_data`."""
  task = lra_data.get_task(config.task, **task_options(config))
  data_dir = task_data_dir(config)
  if config.prepare_data:
    # The first process prepares alone: processes sharing a filesystem would
    # otherwise write the same files at once. The others then find the data
    # there, or prepare their own copy on a filesystem of their own.
    if jax.process_index() == 0:
      task.prepare(data_dir, progress=config.progress)
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices("attention_jax_prepare_data")
      if jax.process_index() > 0:
        task.prepare(data_dir, progress=False)
  return task, task.splits(data_dir)
