"""Cells: the runs a table's grid is made of, and the one runner for them.

A cell is one process (`python -m experiments.train`, `...benchmark_lra_speed`
or `...benchmark_attention`) that writes its `results.json` into its own
folder. A cell is finished when that file exists: finished cells are not run
again, so an interrupted grid continues where it stopped. `run_cell` is the one
cell runner of the project (`experiments.reproduce` and `experiments.compare`).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import pathlib
import shlex
import subprocess
import sys
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

RESULTS_FILE = "results.json"  # the same name the trainer writes (train.workdir.RESULTS_FILE)


@dataclasses.dataclass(frozen=True)
class Cell:
  """One run of a grid.

  Attributes:
    key: what identifies the cell, e.g. {"task": "listops", "variant": "linear",
      "seed": 0}; `--only` filters on these fields.
    workdir: where the run writes, its `results.json` included.
    command: the argv of the process that runs it.
    record_failure: write a results file when the process is killed (SIGKILL,
      e.g. by the OOM killer) or times out, so the cell counts as measured.
    timeout_s: the process's time limit, None for none.
  """

  key: Dict[str, Any]
  workdir: pathlib.Path
  command: Tuple[str, ...]
  record_failure: bool = False
  timeout_s: Optional[float] = None

  @property
  def results_path(self) -> pathlib.Path:
    return self.workdir / RESULTS_FILE

  @property
  def name(self) -> str:
    return " ".join(f"{k}={v}" for k, v in self.key.items())


def benchmark_cell(table: Any, key: Dict[str, Any], workdir: pathlib.Path, module: str,
                   flags: Sequence[str]) -> Cell:
  """A cell of `python -m <module> <flags> --out=<its results file>`.

  A benchmark's failure is its result: a cell killed (out of memory) or past
  the table's `cell_timeout_s` is recorded as such and not run again.
  """
  command = (sys.executable, "-m", module, *flags, f"--out={workdir / RESULTS_FILE}")
  return Cell(key=key, workdir=workdir, command=command, record_failure=True,
              timeout_s=table.get("cell_timeout_s"))


def read_results(path: pathlib.Path) -> Optional[Dict[str, Any]]:
  """The results file at `path`, or None when it is missing or unreadable."""
  try:
    return json.loads(path.read_text())
  except (OSError, ValueError):
    return None


def run_cell(command: Sequence[str], results_path: pathlib.Path, *,
             timeout_s: Optional[float] = None, record_failure: bool = False,
             cwd: Optional[pathlib.Path] = None) -> Optional[Dict[str, Any]]:
  """Runs `command` unless `results_path` exists, and returns the results.

  The one cell runner of the project (reproduce and compare). The process's
  output goes to this process's stdout/stderr.

  Args:
    command: the argv; it must write `results_path` when it succeeds.
    results_path: the cell's results file; its existence means finished.
    timeout_s: kill the process after this long.
    record_failure: when the process is killed by SIGKILL (the OOM killer) or
      times out, write `{"status": "killed"|"timeout", ...}` to `results_path`
      so the cell is reported as such and not run again.
    cwd: where to run it (this process's working directory by default).

  Returns:
    The results, or None when the process failed without writing them.
  """
  results = read_results(results_path)
  if results is not None:
    return results
  print(f"== {shlex.join(command[1:])}", flush=True)
  failure = None
  try:
    returncode = subprocess.run(list(command), cwd=cwd, timeout=timeout_s,
                                check=False).returncode
    if returncode == -9:
      failure = dict(status="killed", error="killed by SIGKILL (out of memory?)")
  except subprocess.TimeoutExpired:
    returncode = None
    failure = dict(status="timeout", error=f"timed out after {timeout_s:.0f} s")
  results = read_results(results_path)
  if results is None and failure is not None and record_failure:
    results = dict(failure, command=list(command), returncode=returncode,
                   finished=datetime.datetime.now(datetime.timezone.utc).isoformat())
    results_path.parent.mkdir(parents=True, exist_ok=True)
    results_path.write_text(json.dumps(results, indent=2) + "\n")
  if results is None:
    print(f"== failed (exit status {returncode}): {shlex.join(command[1:])}", flush=True)
  return results


def run_grid(cells: Sequence[Cell], *, dry_run: bool = False,
             runner: Callable[..., Optional[Dict[str, Any]]] = run_cell) -> Dict[str, int]:
  """Runs the unfinished cells in order.

  Returns:
    Counts: {"finished": already done, "ran": run now and succeeded,
    "failed": run now without results, "pending": not run (dry run)}.
  """
  counts = dict(finished=0, ran=0, failed=0, pending=0)
  todo = [cell for cell in cells if not cell.results_path.is_file()]
  counts["finished"] = len(cells) - len(todo)
  print(f"{len(cells)} cells: {counts['finished']} finished, {len(todo)} to run", flush=True)
  for i, cell in enumerate(todo, 1):
    if dry_run:
      print(f"would run [{i}/{len(todo)}] {cell.name}: {shlex.join(cell.command[1:])}")
      counts["pending"] += 1
      continue
    print(f"[{i}/{len(todo)}] {cell.name}", flush=True)
    result = runner(cell.command, cell.results_path, timeout_s=cell.timeout_s,
                    record_failure=cell.record_failure)
    counts["ran" if result is not None else "failed"] += 1
  return counts


def parse_only(filters: Sequence[str]) -> Dict[str, List[str]]:
  """`["task=listops", "variant=a,b"]` -> `{"task": ["listops"], "variant": ["a", "b"]}`.

  Raises:
    ValueError: on a filter that is not `field=value[,value...]`.
  """
  parsed: Dict[str, List[str]] = {}
  for text in filters:
    field, sep, values = text.partition("=")
    names = [v.strip() for v in values.split(",") if v.strip()]
    if not sep or not field.strip() or not names:
      raise ValueError(f"--only {text!r}: expected FIELD=VALUE[,VALUE...], e.g. "
                       f"'variant=performer,linear'.")
    parsed.setdefault(field.strip(), []).extend(names)
  return parsed


def select(cells: Sequence[Cell], only: Mapping[str, Sequence[str]]) -> List[Cell]:
  """The cells whose key matches every `--only` filter.

  Raises:
    ValueError: on a field the cells do not have, or a value no cell has.
  """
  fields = list(cells[0].key) if cells else []
  for field, values in only.items():
    if field not in fields:
      raise ValueError(f"--only {field}=...: this table's cells have no field {field!r}; "
                       f"fields are: {', '.join(fields)}.")
    present = {str(cell.key[field]) for cell in cells}
    unknown = [v for v in values if v not in present]
    if unknown:
      raise ValueError(f"--only {field}={','.join(values)}: no cell has {field} "
                       f"{', '.join(map(repr, unknown))}; values are: "
                       f"{', '.join(sorted(present))}.")
  return [cell for cell in cells
          if all(str(cell.key[field]) in values for field, values in only.items())]
