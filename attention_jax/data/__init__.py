"""The Long-Range-Arena tasks and the generated sequence-to-sequence and recall ones, by name.

  task = attention_jax.data.get_task("listops")
  task.prepare(data_dir)                 # generate / convert, once
  splits = task.splits(data_dir)         # {"train": ExampleSource, ...}
  for batch in batches(splits["train"], batch_size=32, seed=0, start_step=step): ...

Each task lives in its own module; it is imported only when asked for, so a task
that needs an optional dependency costs nothing to the others.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any, Dict, Tuple

from attention_jax.data.base import (SPLITS, ArraySource, DataUnavailableError, ExampleSource,
                                     Task, TaskInfo, batches, stream_batches)

# name -> (module, keyword arguments of its `make_task`).
_TASKS: Dict[str, Tuple[str, Dict[str, Any]]] = {
    "listops": ("attention_jax.data.listops", {}),
    "pathfinder32": ("attention_jax.data.pathfinder", {"resolution": 32}),
    "pathfinder64": ("attention_jax.data.pathfinder", {"resolution": 64}),
    "pathfinder128": ("attention_jax.data.pathfinder", {"resolution": 128}),  # Path-X
    "pathfinder256": ("attention_jax.data.pathfinder", {"resolution": 256}),
    "text": ("attention_jax.data.text", {}),
    "image": ("attention_jax.data.image", {}),
    "retrieval": ("attention_jax.data.retrieval", {}),
    # Generated sequence-to-sequence tasks (not LRA): for the RNN encoder-decoder.
    "reverse": ("attention_jax.data.seq2seq", {"kind": "reverse"}),
    "sort": ("attention_jax.data.seq2seq", {"kind": "sort"}),
    # Generated recall tasks (not LRA): for causal language models.
    "mqar": ("attention_jax.data.recall", {"kind": "mqar"}),
    "induction_heads": ("attention_jax.data.recall", {"kind": "induction_heads"}),
    "selective_copying": ("attention_jax.data.recall", {"kind": "selective_copying"}),
    # Generated needle-in-a-haystack tasks in the manner of RULER (not LRA): a
    # needle's depth in a haystack of filler; `kind` chooses single, multi_key,
    # multi_value or variable_tracking.
    "needle": ("attention_jax.data.needle", {}),
    # Generated related / unrelated document pairs (not LRA): retrieval's shape
    # for dual encoders where the AAN release files are absent.
    "matching": ("attention_jax.data.matching", {}),
    # Generated 32 x 32 grey images of 10 shapes (not LRA): the image task's format
    # for image models where CIFAR-10 cannot be downloaded.
    "shapes": ("attention_jax.data.shapes", {}),
    # A character corpus in consecutive segments (not LRA): language modelling.
    "chars": ("attention_jax.data.chars", {}),
}


def list_tasks() -> Tuple[str, ...]:
  return tuple(_TASKS)


def task_parameters(name: str) -> Dict[str, inspect.Parameter]:
  """The options `get_task(name, **options)` takes (its module's `make_task`)."""
  return dict(inspect.signature(_task_module(name).make_task).parameters)


def _task_module(name: str):
  if name not in _TASKS:
    raise ValueError(f"unknown task {name!r}; valid tasks are: {', '.join(_TASKS)}.")
  return importlib.import_module(_TASKS[name][0])


def get_task(name: str, **options) -> Task:
  """The task registered as `name`, built with `options` (e.g. sizes, seed)."""
  module = _task_module(name)
  return module.make_task(**{**_TASKS[name][1], **options})


__all__ = ["SPLITS", "ArraySource", "DataUnavailableError", "ExampleSource", "Task", "TaskInfo",
           "batches", "get_task", "list_tasks", "stream_batches", "task_parameters"]
