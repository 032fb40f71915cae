r"""Reproduces a results table from its config: runs the grid's cells, then writes
the table, a CSV and plots.

  python -m experiments.reproduce --table=configs/tables/lra_smoke.py --results=results/lra_smoke/
  python -m experiments.reproduce --table=configs/tables/lra.py --results=results/lra/ \
      --only task=listops --only variant=performer,linear
  python -m experiments.reproduce --table=configs/tables/lra_speed.py \
      --results=results/lra_speed/ --batch-size=2 --dry-run

A table config (`configs/tables/*.py`, `get_config()`) names a grid and its
`kind`:

* "accuracy": tasks x variants x seeds, each cell a `python -m
  experiments.train` run in `<results>/runs/<task>/<variant>/seed<k>/` (data
  in the shared `--data-dir`);
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
plots are written from every finished cell of the grid.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime
import json
import math
import pathlib
import shlex
import statistics
import subprocess
import sys
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from attention_jax.train.config import load_config_module
from experiments import lra_paper

RESULTS_FILE = "results.json"  # the same name the trainer writes (trainer.RESULTS_FILE)
KINDS = ("accuracy", "speed", "kernels")
CELL_CONFIG = "configs/tables/cell.py"
REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]


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


# ---------------------------------------------------------------------------
# Tables and their grids.
# ---------------------------------------------------------------------------


def load_table(path: str | pathlib.Path) -> Any:
  """`get_config()` of a table config file, checked.

  Raises:
    ValueError: when the file does not exist, has no `get_config`, or its
      config lacks a key its kind needs.
  """
  path = pathlib.Path(path)
  if not path.is_file():
    raise ValueError(f"--table: no such file {str(path)!r}; expected a configs/tables/*.py file.")
  try:
    module = load_config_module(path)
  except ValueError as e:
    raise ValueError(f"--table: {e}") from e
  table = module.get_config()
  kind = table.get("kind")
  if kind not in KINDS:
    raise ValueError(f"table {str(path)!r}: kind must be one of {KINDS}, got {kind!r}.")
  needed = dict(accuracy=("name", "tasks", "variants", "seeds"),
                speed=("name", "variants", "lengths", "batch_size"),
                kernels=("name", "lengths"))[kind]
  missing = [key for key in needed if key not in table]
  if missing:
    raise ValueError(f"table {str(path)!r} of kind {kind!r} lacks {', '.join(missing)}.")
  return table


def _plain(value: Any) -> Any:
  """ConfigDicts and tuples as plain dicts and lists (for JSON)."""
  if hasattr(value, "to_dict"):
    value = value.to_dict()
  if isinstance(value, Mapping):
    return {k: _plain(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [_plain(v) for v in value]
  return value


def training_command(config_file: str, variant: str, presets: Sequence[str],
                     workdir: pathlib.Path, flags: Sequence[str] = (),
                     overrides: Optional[Mapping[str, Any]] = None) -> Tuple[str, ...]:
  """The `experiments.train` argv of one run; `overrides` (nested dicts) go
  through `configs/tables/cell.py` when given."""
  arg = ",".join([variant, *presets])
  if overrides:
    config = f"{CELL_CONFIG}:{config_file}|{arg}|{json.dumps(_plain(overrides), sort_keys=True)}"
  else:
    config = f"{config_file}:{arg}"
  return (sys.executable, "-m", "experiments.train", f"--config={config}",
          f"--workdir={workdir}", *flags)


def expand(table: Any, results_dir: pathlib.Path, data_dir: str = "data",
           batch_size: Optional[int] = None) -> List[Cell]:
  """The cells of `table` in the order they run (seed-major for accuracy
  tables, so a stopped run has whole seeds first).

  Args:
    table: a loaded table config.
    results_dir: the table's results folder; cells go under `runs/`.
    data_dir: the prepared-data folder all training cells share.
    batch_size: overrides the speed table's batch size.
  """
  # Absolute: orbax refuses relative checkpoint paths.
  runs = pathlib.Path(results_dir).resolve() / "runs"
  overrides = _plain(table.get("cell_overrides", {})) or {}
  cells = []
  if table.kind == "accuracy":
    presets = tuple(table.get("presets", ()))
    for seed in table.seeds:
      for task, config_file in table.tasks.items():
        for variant in table.variants:
          workdir = runs / task / variant / f"seed{seed}"
          flags = (f"--config.seed={seed}", f"--config.data_dir={data_dir}",
                   "--config.progress=False", *table.get("flags", ()))
          cells.append(Cell(
              key=dict(task=task, variant=variant, seed=seed), workdir=workdir,
              command=training_command(config_file, variant, presets, workdir, flags,
                                       overrides.get(task, {}).get(variant))))
  elif table.kind == "speed":
    batch = batch_size or table.batch_size
    for length in table.lengths:
      for variant in table.variants:
        workdir = runs / variant / f"len{length}"
        cell_overrides: Dict[str, Any] = {}
        for name in (variant, f"{variant}@{length}"):
          _merge(cell_overrides, overrides.get(name, {}))
        command = (sys.executable, "-m", "experiments.benchmark_lra_speed",
                   f"--variant={variant}", f"--length={length}", f"--batch={batch}",
                   f"--steps={table.get('steps', 5)}", f"--warmup={table.get('warmup', 1)}",
                   f"--overrides={json.dumps(cell_overrides, sort_keys=True)}",
                   f"--out={workdir / RESULTS_FILE}")
        cells.append(Cell(key=dict(variant=variant, length=length), workdir=workdir,
                          command=command, record_failure=True,
                          timeout_s=table.get("cell_timeout_s")))
  else:
    for length in table.lengths:
      workdir = runs / f"len{length}"
      command = (sys.executable, "-m", "experiments.benchmark_attention", "--lengths",
                 str(length), *table.get("args", ()), "--out", str(workdir / RESULTS_FILE))
      cells.append(Cell(key=dict(length=length), workdir=workdir, command=command,
                        record_failure=True, timeout_s=table.get("cell_timeout_s")))
  return cells


def _merge(into: Dict[str, Any], more: Mapping[str, Any]) -> None:
  for key, value in more.items():
    if isinstance(value, Mapping) and isinstance(into.get(key), dict):
      _merge(into[key], value)
    else:
      into[key] = json.loads(json.dumps(value))


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


# ---------------------------------------------------------------------------
# Running cells.
# ---------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------
# Tables.
# ---------------------------------------------------------------------------


def spread(values: Sequence[float]) -> Dict[str, Any]:
  """Mean, sample standard deviation (0 for one value) and count."""
  values = [v for v in values if v is not None and math.isfinite(v)]
  if not values:
    return dict(mean=None, std=None, n=0)
  return dict(mean=statistics.fmean(values),
              std=statistics.stdev(values) if len(values) > 1 else 0.0, n=len(values))


def _fmt(stats: Mapping[str, Any], scale: float = 1.0, digits: int = 1) -> str:
  if not stats or not stats.get("n"):
    return "-"
  text = f"{stats['mean'] * scale:.{digits}f}"
  if stats["n"] > 1:
    text += f" ± {stats['std'] * scale:.{digits}f}"
  return text + f" (n={stats['n']})"


def summarize_accuracy(table: Any, cells: Sequence[Cell]) -> List[Dict[str, Any]]:
  """One row per (task, variant): spreads of test accuracy (%), best
  validation accuracy (%), steps/s and peak memory (MiB), and the paper's number."""
  groups: Dict[Tuple[str, str], List[Dict[str, Any]]] = {}
  for cell in cells:
    groups.setdefault((cell.key["task"], cell.key["variant"]), [])
    results = read_results(cell.results_path)
    if results is not None and "metrics" in results:
      groups[(cell.key["task"], cell.key["variant"])].append(results)
  rows = []
  for (task, variant), runs in groups.items():
    metrics = [r["metrics"] for r in runs]
    rows.append(dict(
        task=task, variant=variant,
        test=spread([100 * m["test"]["accuracy"] for m in metrics if "test" in m]),
        validation=spread([100 * m["best_validation"]["accuracy"] for m in metrics
                           if "best_validation" in m]),
        steps_per_s=spread([m.get("steps_per_s") for m in metrics]),
        memory_mib=spread([m["peak_memory_bytes"] / 2**20 for m in metrics
                           if m.get("peak_memory_bytes")]),
        memory_source=next((m.get("memory_source") for m in metrics), None),
        seeds=[r["config"]["seed"] for r in runs],
        paper=lra_paper.accuracy(variant, task)))
  return rows


def summarize_speed(table: Any, cells: Sequence[Cell]) -> List[Dict[str, Any]]:
  """One row per (variant, length): status, steps/s, memory (MiB) and their
  ratios to dot_product at that length, and the paper's ratios."""
  records = {(c.key["variant"], c.key["length"]): read_results(c.results_path) for c in cells}
  rows = []
  for (variant, length), record in records.items():
    base = records.get(("dot_product", length)) or {}
    row = dict(variant=variant, length=length, status=None, steps_per_s=None,
               memory_mib=None, speed_ratio=None, memory_ratio=None, batch_size=None,
               paper_speed_ratio=lra_paper.speed_ratio(variant, length),
               paper_memory_ratio=lra_paper.memory_ratio(variant, length))
    if record is not None:
      memory = (record.get("memory") or {}).get("bytes")
      base_memory = (base.get("memory") or {}).get("bytes")
      row.update(status=record.get("status"), steps_per_s=record.get("steps_per_s"),
                 batch_size=record.get("batch_size"),
                 memory_mib=memory / 2**20 if memory else None,
                 memory_source=(record.get("memory") or {}).get("source"))
      if row["steps_per_s"] and base.get("steps_per_s"):
        row["speed_ratio"] = row["steps_per_s"] / base["steps_per_s"]
      if memory and base_memory:
        row["memory_ratio"] = memory / base_memory
    rows.append(row)
  return rows


def summarize_kernels(table: Any, cells: Sequence[Cell]) -> List[Dict[str, Any]]:
  """One row per benchmark record (implementation, length, mode, causal)."""
  rows = []
  for cell in cells:
    payload = read_results(cell.results_path) or {}
    for r in payload.get("records", []):
      rows.append(dict(impl=r.get("impl"), length=r.get("seq_len"), mode=r.get("mode"),
                       causal=r.get("causal"), head_dim=r.get("head_dim"), ms=r.get("ms"),
                       peak_mib=((r.get("memory") or {}).get("peak_delta_bytes") or 0) / 2**20
                       or None, speedup_vs_best_peer=r.get("speedup_vs_best_peer"),
                       best_peer=r.get("best_peer"), error=r.get("error")))
  return rows


def provenance(cells: Sequence[Cell]) -> Dict[str, Any]:
  """The devices and git revisions the finished cells ran on."""
  devices, revisions = set(), set()
  for cell in cells:
    results = read_results(cell.results_path) or {}
    d = results.get("devices")
    if d:
      devices.add(f"{d.get('count')} x {d.get('kind')} ({d.get('platform')})")
    env = results.get("environment")
    if env:
      devices.add(f"{env.get('device_count')} x {env.get('device_kind')} ({env.get('backend')})")
    revision = results.get("git_revision") or (env or {}).get("git_revision")
    if revision:
      revisions.add(revision)
  return dict(devices=sorted(devices), git_revisions=sorted(revisions))


def _header(table: Any, cells: Sequence[Cell], command: str) -> List[str]:
  info = provenance(cells)
  finished = sum(cell.results_path.is_file() for cell in cells)
  lines = [f"# {table.get('description', table.name)}", "",
           f"- device: {', '.join(info['devices']) or 'unknown (no finished cell)'}",
           f"- git revision: {', '.join(info['git_revisions']) or 'unknown'}",
           f"- cells finished: {finished} of {len(cells)}",
           f"- command: `{command}`",
           f"- generated: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}"]
  lines += [f"- note: {note}" for note in table.get("notes", ())]
  if table.kind != "kernels":  # the LRA tables print the paper's number beside each cell
    lines.append(f"- paper numbers: {lra_paper.PAPER}, see experiments/lra_paper.py"
                 + (f"; the paper's are at its full settings, these cells at the preset "
                    f"{', '.join(table.presets)}" if table.get("presets") else ""))
  return lines + [""]


def majority_class(config_file: str, presets: Sequence[str], data_dir: str,
                   split: str = "test") -> Optional[float]:
  """The share (%) of the most common label in a task's prepared `split`, the
  accuracy of always guessing it; None when the data is not there (or the task
  is not a classification of single labels)."""
  try:
    from attention_jax import data as lra_data  # pylint: disable=g-import-not-at-top
    # pylint: disable-next=g-import-not-at-top
    from attention_jax.train.trainer import task_data_dir, task_options
    config = load_config_module(config_file).get_config(",".join(["dot_product", *presets]))
    config.data_dir = data_dir
    folder = task_data_dir(config)
    if not folder.is_dir():
      return None
    source = lra_data.get_task(config.task, **task_options(config)).splits(folder)[split]
    counts: Dict[int, int] = {}
    for batch in lra_data.batches(source, batch_size=256, seed=0, shuffle=False,
                                  num_steps=math.ceil(len(source) / 256)):
      for label, weight in zip(batch["label"].tolist(), batch["weight"].tolist()):
        if weight > 0:
          counts[label] = counts.get(label, 0) + 1
    return 100 * max(counts.values()) / sum(counts.values()) if counts else None
  except Exception:  # pylint: disable=broad-except
    return None  # A missing or unreadable dataset: the table just goes without it.


def accuracy_markdown(table: Any, rows: Sequence[Dict[str, Any]],
                      data_dir: str = "data") -> List[str]:
  tasks = list(table.tasks)
  by = {(r["task"], r["variant"]): r for r in rows}
  majority = {task: majority_class(table.tasks[task], tuple(table.get("presets", ())), data_dir)
              for task in tasks}
  lines = []
  known = [f"{task} {value:.1f}%" for task, value in majority.items() if value is not None]
  if known:
    lines += [f"Majority class of the test split (always guessing it): {', '.join(known)}.", ""]
  lines += ["## Test accuracy (%): measured mean ± std (n seeds) / LRA paper", "",
           "| variant | " + " | ".join(tasks) + " |", "|---|" + "---|" * len(tasks)]
  for variant in table.variants:
    cells = []
    for task in tasks:
      row = by.get((task, variant), {})
      paper = row.get("paper")
      cells.append(f"{_fmt(row.get('test'))} / {'-' if paper is None else f'{paper:.2f}'}")
    lines.append(f"| {variant} | " + " | ".join(cells) + " |")
  lines += ["", "## Best validation accuracy (%), train steps/s and peak memory (MiB)", "",
            "| task | variant | best validation (%) | steps/s | peak memory (MiB) |",
            "|---|---|---|---|---|"]
  for task in tasks:
    for variant in table.variants:
      row = by.get((task, variant), {})
      source = " host RSS" if row.get("memory_source") == "host_rss" else ""
      lines.append(f"| {task} | {variant} | {_fmt(row.get('validation'))} | "
                   f"{_fmt(row.get('steps_per_s'))} | {_fmt(row.get('memory_mib'), digits=0)}"
                   f"{source} |")
  return lines


def _ratio(value: Optional[float]) -> str:
  return "-" if value is None else f"{value:.2f}x"


def speed_markdown(table: Any, rows: Sequence[Dict[str, Any]], data_dir: str = "") -> List[str]:
  by = {(r["variant"], r["length"]): r for r in rows}
  lengths = list(table.lengths)
  batches = sorted({r["batch_size"] for r in rows if r.get("batch_size")})
  lines = [f"Batch size {', '.join(map(str, batches)) or '-'} (the paper: 32). Ratios are to "
           "dot_product at the same length; the paper's ratio follows the slash.", ""]
  for title, value_key, ratio_key, paper_key, fmt in (
      ("Train steps per second (ratio to dot_product / paper)", "steps_per_s", "speed_ratio",
       "paper_speed_ratio", "{:.3g}"),
      ("Peak memory, MiB (ratio to dot_product / paper)", "memory_mib", "memory_ratio",
       "paper_memory_ratio", "{:.0f}")):
    lines += [f"## {title}", "", "| variant | " + " | ".join(f"{n // 1024}K" if n % 1024 == 0
                                                             else str(n) for n in lengths)
              + " |", "|---|" + "---|" * len(lengths)]
    for variant in table.variants:
      cells = []
      for length in lengths:
        row = by.get((variant, length), {})
        if not row.get("status"):
          cells.append("-")
        elif row["status"] != "ok":
          cells.append(f"{row['status']} / {_ratio(row.get(paper_key))}")
        else:
          value = row.get(value_key)
          cells.append(f"{'-' if value is None else fmt.format(value)} "
                       f"({_ratio(row.get(ratio_key))}) / {_ratio(row.get(paper_key))}")
      lines.append(f"| {variant} | " + " | ".join(cells) + " |")
    lines.append("")
  measured = [r["length"] for r in rows if r.get("status") == "ok"]
  if measured:
    lines += _paper_comparison(table, by, max(measured))
  memory_sources = sorted({r.get("memory_source") for r in rows if r.get("memory_source")})
  if memory_sources:
    lines.append(f"Memory source: {', '.join(memory_sources)} (see "
                 "experiments/benchmark_lra_speed.py).")
  return lines


def _paper_comparison(table: Any, by: Dict[Any, Dict[str, Any]], length: int) -> List[str]:
  """Which variants, at `length`, are at least the paper's speed-up over the
  Transformer and at most its memory ratio (the issue's targets for the table)."""
  lines = [f"## Against the paper at {length} tokens", "",
           "| variant | speed-up / paper | at least the paper's | memory ratio / paper | "
           "at most the paper's |", "|---|---|---|---|---|"]
  compared = 0
  for variant in table.variants:
    row = by.get((variant, length), {})
    if variant == "dot_product" or row.get("paper_speed_ratio") is None:
      continue
    compared += 1
    verdicts = []
    for key, paper_key, better in (("speed_ratio", "paper_speed_ratio", lambda a, b: a >= b),
                                   ("memory_ratio", "paper_memory_ratio", lambda a, b: a <= b)):
      value, paper = row.get(key), row.get(paper_key)
      verdicts += [f"{_ratio(value)} / {_ratio(paper)}",
                   "-" if value is None or paper is None else
                   ("yes" if better(round(value, 2), round(paper, 2)) else "no")]
    lines.append(f"| {variant} | " + " | ".join(verdicts) + " |")
  return lines + [""] if compared else []


def _mib(value: Optional[float]) -> str:
  return "-" if value is None else f"{value:.1f}"


def kernels_markdown(table: Any, rows: Sequence[Dict[str, Any]], data_dir: str = "") -> List[str]:
  lines = ["| impl | T | mode | causal | ms | peak MiB | vs best peer | best peer |",
           "|---|---|---|---|---|---|---|---|"]
  for r in rows:
    if r.get("error"):
      lines.append(f"| {r['impl']} | {r['length']} | {r['mode']} | {r['causal']} | failed: "
                   f"{str(r['error']).splitlines()[0][:60]} | | | |")
      continue
    lines.append(f"| {r['impl']} | {r['length']} | {r['mode']} | {r['causal']} | "
                 f"{r['ms']:.2f} | {_mib(r['peak_mib'])} | "
                 f"{_ratio(r.get('speedup_vs_best_peer'))} | {r.get('best_peer') or '-'} |")
  return lines


def _csv_value(value: Any) -> Any:
  if isinstance(value, float):
    return f"{value:.6g}"
  if isinstance(value, (list, tuple)):
    return " ".join(map(str, value))
  return "" if value is None else value


def write_csv(path: pathlib.Path, rows: Sequence[Dict[str, Any]]) -> None:
  """Rows as CSV; spreads become `<name>_mean`, `<name>_std`, `<name>_n` columns."""
  flat_rows = []
  for row in rows:
    flat = {}
    for key, value in row.items():
      if isinstance(value, dict) and set(value) == {"mean", "std", "n"}:
        flat.update({f"{key}_{k}": value[k] for k in ("mean", "std", "n")})
      else:
        flat[key] = value
    flat_rows.append(flat)
  fields = list(dict.fromkeys(k for row in flat_rows for k in row))
  with path.open("w", newline="") as f:
    writer = csv.DictWriter(f, fieldnames=fields)
    writer.writeheader()
    for row in flat_rows:
      writer.writerow({k: _csv_value(row.get(k)) for k in fields})


# ---------------------------------------------------------------------------
# Plots.
# ---------------------------------------------------------------------------


def _pyplot():
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  return plt


def plot_accuracy(table: Any, rows: Sequence[Dict[str, Any]], out: pathlib.Path) -> List[str]:
  """`accuracy.png`: test accuracy by variant, one bar group per task, error bars
  of one std over seeds, the paper's number as a black tick."""
  plt = _pyplot()
  tasks = [t for t in table.tasks if any(r["task"] == t and r["test"]["n"] for r in rows)]
  if not tasks:
    return []
  by = {(r["task"], r["variant"]): r for r in rows}
  variants = list(table.variants)
  width = 0.8 / len(tasks)
  fig, ax = plt.subplots(figsize=(max(6, 0.7 * len(variants) * max(1, len(tasks) / 2)), 4))
  for i, task in enumerate(tasks):
    xs = [j + (i - (len(tasks) - 1) / 2) * width for j in range(len(variants))]
    means = [(by.get((task, v), {}).get("test") or {}).get("mean") or 0 for v in variants]
    stds = [(by.get((task, v), {}).get("test") or {}).get("std") or 0 for v in variants]
    ax.bar(xs, means, width, yerr=stds, capsize=2, label=task)
    papers = [(x, by.get((task, v), {}).get("paper")) for x, v in zip(xs, variants)]
    papers = [(x, p) for x, p in papers if p is not None]
    if papers:
      ax.scatter([x for x, _ in papers], [p for _, p in papers], marker="_", s=200,
                 color="black", zorder=3,
                 label=("LRA paper" + (" (full settings)" if table.get("presets") else ""))
                 if i == 0 else None)
  ax.set_xticks(range(len(variants)))
  ax.set_xticklabels(variants, rotation=45, ha="right")
  ax.set_ylabel("test accuracy (%)")
  ax.set_title(table.get("description", table.name))
  ax.legend(fontsize=8)
  fig.tight_layout()
  path = out / "accuracy.png"
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return [path.name]


def plot_speed(table: Any, rows: Sequence[Dict[str, Any]], out: pathlib.Path) -> List[str]:
  """`speed.png` and `memory.png`: steps/s and peak memory against length,
  log-log, one line per variant."""
  plt = _pyplot()
  written = []
  for name, key, label in (("speed.png", "steps_per_s", "train steps / s"),
                           ("memory.png", "memory_mib", "peak memory (MiB)")):
    fig, ax = plt.subplots(figsize=(6, 4.5))
    drawn = False
    for i, variant in enumerate(table.variants):
      points = sorted((r["length"], r[key]) for r in rows
                      if r["variant"] == variant and r.get("status") == "ok" and r.get(key))
      if points:  # Eleven lines: tab20 colours and alternating markers keep them apart.
        ax.plot(*zip(*points), marker="os^vD"[i % 5], color=plt.cm.tab20(i % 20),
                label=variant)
        drawn = True
    if not drawn:
      plt.close(fig)
      continue
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length")
    ax.set_ylabel(label)
    ax.set_title(f"{table.get('description', table.name)}")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(out / name, dpi=120)
    plt.close(fig)
    written.append(name)
  return written


def plot_kernels(table: Any, rows: Sequence[Dict[str, Any]], out: pathlib.Path) -> List[str]:
  """`kernels.png`: milliseconds against length, log-log; one panel per mode,
  one colour per implementation, dashed when causal."""
  plt = _pyplot()
  series: Dict[Tuple[str, str, bool], List[Tuple[int, float]]] = {}
  for r in rows:
    if r.get("ms"):
      series.setdefault((r["mode"], r["impl"], bool(r["causal"])), []).append(
          (r["length"], r["ms"]))
  if not series:
    return []
  modes = sorted({mode for mode, _, _ in series})
  impls = sorted({impl for _, impl, _ in series})
  colours = {impl: f"C{i}" for i, impl in enumerate(impls)}
  fig, axes = plt.subplots(1, len(modes), figsize=(6 * len(modes), 4.5), squeeze=False)
  for ax, mode in zip(axes[0], modes):
    for (m, impl, causal), points in sorted(series.items()):
      if m == mode:
        ax.plot(*zip(*sorted(points)), marker="o", color=colours[impl],
                linestyle="--" if causal else "-", label=f"{impl}{' causal' if causal else ''}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_title(mode)
    ax.set_xlabel("sequence length")
    ax.set_ylabel("ms")
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(out / "kernels.png", dpi=120)
  plt.close(fig)
  return ["kernels.png"]


def write_outputs(table: Any, cells: Sequence[Cell], results_dir: pathlib.Path,
                  command: str, data_dir: str = "data") -> List[str]:
  """Writes table.md, table.csv and the plots from the finished cells.

  Returns:
    The names of the files written.
  """
  summarize, markdown, plot = dict(
      accuracy=(summarize_accuracy, accuracy_markdown, plot_accuracy),
      speed=(summarize_speed, speed_markdown, plot_speed),
      kernels=(summarize_kernels, kernels_markdown, plot_kernels))[table.kind]
  rows = summarize(table, cells)
  results_dir.mkdir(parents=True, exist_ok=True)
  text = "\n".join(_header(table, cells, command) + markdown(table, rows, data_dir)) + "\n"
  (results_dir / "table.md").write_text(text)
  write_csv(results_dir / "table.csv", rows)
  return ["table.md", "table.csv", *plot(table, rows, results_dir)]


# ---------------------------------------------------------------------------
# Command line.
# ---------------------------------------------------------------------------


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--table", required=True, help="a configs/tables/*.py file")
  parser.add_argument("--results", required=True, type=pathlib.Path,
                      help="the table's folder: runs/, table.md, table.csv, plots")
  parser.add_argument("--only", action="append", default=[], metavar="FIELD=VALUE[,VALUE]",
                      help="run only the cells matching (repeatable), e.g. variant=linear")
  parser.add_argument("--dry-run", action="store_true", help="print what would run, run nothing")
  parser.add_argument("--data-dir", default="data", help="prepared data, shared by all cells")
  parser.add_argument("--batch-size", type=int, default=None,
                      help="override a speed table's batch size")
  parser.add_argument("--no-run", action="store_true",
                      help="only (re)write the table and plots from finished cells")
  return parser.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None,
         runner: Callable[..., Optional[Dict[str, Any]]] = run_cell) -> int:
  """Runs the table's unfinished cells and writes its outputs.

  Returns:
    0 when every selected cell has results, 1 when some failed, 2 on bad input.
  """
  args = parse_args(argv)
  try:
    table = load_table(args.table)
    if args.batch_size is not None and args.batch_size < 1:
      raise ValueError(f"--batch-size must be a positive integer, got {args.batch_size}.")
    cells = expand(table, args.results, args.data_dir, args.batch_size)
    selected = select(cells, parse_only(args.only))
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  counts = dict(failed=0)
  if not args.no_run:
    counts = run_grid(selected, dry_run=args.dry_run, runner=runner)
  if args.dry_run:
    return 0
  command = shlex.join(["python", "-m", "experiments.reproduce", *(
      argv if argv is not None else sys.argv[1:])])
  written = write_outputs(table, cells, args.results, command, args.data_dir)
  print(f"wrote {', '.join(written)} to {args.results}")
  print((args.results / "table.md").read_text())
  return 1 if counts["failed"] else 0


if __name__ == "__main__":
  sys.exit(main())
