r"""Reproduces a results table from its config: runs the grid's cells, then writes
the table, a CSV and plots.

  python -m experiments.reproduce --table=configs/tables/lra_smoke.py --results=results/lra_smoke/
  python -m experiments.reproduce --table=configs/tables/lra.py --results=results/lra/ \
      --only=task=listops --only=variant=performer,linear
  python -m experiments.reproduce --table=configs/tables/lra_speed.py \
      --results=results/lra_speed/ --batch_size=2 --dry_run

A table config (`configs/tables/*.py`, `get_config()`) names a grid and its
`kind` (`experiments.tables`):

* "accuracy": tasks x variants x seeds, each cell a `python -m
  experiments.train` run in `<results>/runs/<task>/<variant>/seed<k>/` (data
  in the shared `--data_dir`);
* "speed": variants x lengths of `experiments.benchmark_lra_speed`, in
  `<results>/runs/<variant>/len<T>/`;
* "kernels": lengths of `experiments.benchmark_attention`, in
  `<results>/runs/len<T>/`.

A cell is finished when its `results.json` exists; finished cells are not run
again, so an interrupted reproduction continues where it stopped (a training
cell also resumes from its own checkpoint). Each cell runs in its own process
(`run_cell`, the one cell runner, also used by `experiments.compare`). Then
`table.md` (device and git revision in its header, the LRA paper's number next
to each measured one, mean +- std over seeds with n), `table.csv` and PNG
plots are written from every finished cell of the grid; `--norun` writes only
these, from the cells already finished.
"""

from __future__ import annotations

import pathlib
import shlex
import sys
from typing import Any, Callable, Dict, Optional, Sequence

from absl import flags
from ml_collections import config_flags

from experiments import cli, tables
from experiments.tables import report
from experiments.tables.cells import parse_only, run_cell, run_grid, select

Runner = Callable[..., Optional[Dict[str, Any]]]


def define_flags(flag_values: flags.FlagValues, argv: Sequence[str]) -> None:
  """This script's flags (see `experiments.cli`)."""
  config_flags.DEFINE_config_file("table", None, "a configs/tables/*.py file",
                                  flag_values=flag_values, sys_argv=list(argv))
  flags.DEFINE_string("results", None, "the table's folder: runs/, table.md, table.csv, plots",
                      flag_values=flag_values)
  flags.DEFINE_multi_string("only", [], "FIELD=VALUE[,VALUE...]: run only the cells matching "
                            "(repeatable), e.g. --only=variant=linear", flag_values=flag_values)
  flags.DEFINE_bool("dry_run", False, "print what would run, run nothing",
                    flag_values=flag_values)
  flags.DEFINE_string("data_dir", "data", "prepared data, shared by all cells",
                      flag_values=flag_values)
  flags.DEFINE_integer("batch_size", None, "override a speed table's batch size", lower_bound=1,
                       flag_values=flag_values)
  flags.DEFINE_bool("run", True, "run the unfinished cells; --norun only (re)writes the table "
                    "and plots from the finished cells", flag_values=flag_values)
  flags.mark_flags_as_required(["table", "results"], flag_values=flag_values)

  def check_table(table: Any, argument: str) -> None:
    if not pathlib.Path(argument.split(":")[0]).is_file():
      raise ValueError("no such file; expected a configs/tables/*.py file.")
    tables.check_table(table)

  cli.check_config_file(flag_values, "table", check_table)


def reproduce(args: cli.Args, runner: Runner = run_cell) -> int:
  """Runs the table's unfinished cells and writes its outputs.

  Returns:
    0 when every selected cell has results, 1 when some failed, 2 on bad input.
  """
  table, results = args.table, pathlib.Path(args.results)
  try:
    cells = tables.expand(table, results, args.data_dir, args.batch_size)
    selected = select(cells, parse_only(args.only))
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  counts = dict(failed=0)
  if args.run:
    counts = run_grid(selected, dry_run=args.dry_run, runner=runner)
  if args.dry_run:
    return 0
  command = shlex.join(["python", "-m", "experiments.reproduce", *args.argv[1:]])
  written = report.write_outputs(table, tables.kind_of(table), cells, results, command,
                                 args.data_dir)
  print(f"wrote {', '.join(written)} to {results}")
  print((results / "table.md").read_text())
  return 1 if counts["failed"] else 0


def main(argv: Optional[Sequence[str]] = None, runner: Runner = run_cell) -> int:
  """This script from Python: `argv` and errors as in `cli.parse`."""
  return reproduce(cli.parse(define_flags, argv, __name__), runner)


if __name__ == "__main__":
  cli.run(define_flags, reproduce)
