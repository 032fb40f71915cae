"""Results tables: a table config's grid of cells, run and written up.

A table config (`configs/tables/*.py`, `get_config()`) names its `kind`, and
the module of that kind says what its cells are and what its table shows:

* `accuracy`: tasks x variants x seeds of `experiments.train`;
* `grouped_accuracy`: the same cells, accuracy per evaluation group of each
  task (recall per number of key-value pairs);
* `speed`: variants x lengths of `experiments.benchmark_lra_speed`;
* `kernels`: lengths of `experiments.benchmark_attention`;
* `architectures`: one smoke config per architecture (its own task and
  metric) x seeds, against each task's chance level;
* `length`: the cells of `accuracy`, each tested at its training length and
  the longer lengths of its `length_eval` (length generalisation).

Each kind module has the same parts: `REQUIRED` (the config keys it needs),
`PAPER` (whether the LRA paper's numbers stand beside its cells), `expand`
(the grid's cells), `summarize` (their results as rows), `markdown` (the rows
as table lines) and `plot` (PNGs). `cells` runs and selects cells for every
kind, `report` writes what every kind writes alike, and
`experiments.reproduce` is the command line.
"""

from __future__ import annotations

import pathlib
from types import ModuleType
from typing import Any, List, Optional

from attention_jax.train.config import load_config_module
from experiments.tables import accuracy, architectures, grouped, kernels, lengths, speed
from experiments.tables.cells import Cell

KINDS = {"accuracy": accuracy, "grouped_accuracy": grouped, "speed": speed,
         "kernels": kernels, "architectures": architectures, "length": lengths}


def kind_of(table: Any) -> ModuleType:
  """The module of the table's kind (checked by `check_table`)."""
  return KINDS[table.kind]


def check_table(table: Any) -> None:
  """Checks that `table` has a known kind and the keys that kind needs.

  Raises:
    ValueError: on an unknown kind or a missing key.
  """
  kind = table.get("kind")
  if kind not in KINDS:
    raise ValueError(f"kind must be one of {tuple(KINDS)}, got {kind!r}.")
  missing = [key for key in KINDS[kind].REQUIRED if key not in table]
  if missing:
    raise ValueError(f"a table of kind {kind!r} needs {', '.join(KINDS[kind].REQUIRED)}; it "
                     f"lacks {', '.join(missing)}.")
  if table.get("learning_rates") and not getattr(KINDS[kind], "SWEEPS_LEARNING_RATE", False):
    raise ValueError(f"learning_rates: a table of kind {kind!r} has no learning-rate sweep; "
                     "the accuracy kinds do.")
  if getattr(KINDS[kind], "SWEEPS_LEARNING_RATE", False):
    accuracy.learning_rates(table)  # its own errors, before any cell runs


def load_table(path: str | pathlib.Path) -> Any:
  """`get_config()` of a table config file, checked.

  Raises:
    ValueError: when the file does not exist, has no `get_config`, or its
      config lacks a key its kind needs.
  """
  path = pathlib.Path(path)
  if not path.is_file():
    raise ValueError(f"no such file {str(path)!r}; expected a configs/tables/*.py file.")
  table = load_config_module(path).get_config()
  try:
    check_table(table)
  except ValueError as e:
    raise ValueError(f"table {str(path)!r}: {e}") from e
  return table


def expand(table: Any, results_dir: pathlib.Path, data_dir: str = "data",
           batch_size: Optional[int] = None) -> List[Cell]:
  """The cells of `table` in the order they run: its kind's
  `expand(table, runs, *, data_dir, batch_size)`, each kind using what it needs.

  Args:
    table: a checked table config.
    results_dir: the table's results folder; cells go under `runs/`.
    data_dir: the prepared-data folder all training cells share.
    batch_size: overrides the speed table's batch size.
  """
  # Absolute: orbax refuses relative checkpoint paths.
  runs = pathlib.Path(results_dir).resolve() / "runs"
  return kind_of(table).expand(table, runs, data_dir=data_dir, batch_size=batch_size)
