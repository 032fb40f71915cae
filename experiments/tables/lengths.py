"""The "length" table: the cells of an accuracy table (tasks x variants x
seeds of `experiments.train`), each run's best checkpoint tested at its
training length and at the longer lengths of its `length_eval`
(`attention_jax.train.lengths`), with one plot per task of the metric against
the evaluation length.

A row is usually a mixer with a position scheme (the `baselines` of an
accuracy table: a label, its variant and the overrides that set the
position). `metrics`, `{task: metric}` (default "accuracy" for every task),
names each task's column metric, read from the results' `test_by_length`
(the training length alone, from `test`, for a run evaluated only there, such
as learned positions): an accuracy is shown in percent, another metric (bits
per character) as it is, lower being better.
"""

from __future__ import annotations

from typing import Any, Dict, List, Sequence, Tuple

from experiments.tables import accuracy, report
from experiments.tables.cells import Cell, read_results

REQUIRED = accuracy.REQUIRED
PAPER = False
expand = accuracy.expand


def task_metric(table: Any, task: str) -> str:
  return dict(accuracy.plain(table.get("metrics", {})) or {}).get(task, "accuracy")


def _is_percent(metric: str) -> bool:
  return metric.endswith("accuracy")


def _by_length(results: Dict[str, Any]) -> Dict[int, Dict[str, float]]:
  """`{length: test metrics}` of one run: its `test_by_length`, else its
  training length's test."""
  metrics = results.get("metrics", {})
  if "test_by_length" in metrics:
    return {int(length): m for length, m in metrics["test_by_length"].items()}
  if "test" in metrics:
    return {int(results["config"]["task_options"]["seq_len"]): metrics["test"]}
  return {}


def summarize(table: Any, cells: Sequence[Cell]) -> List[Dict[str, Any]]:
  """One row per (task, variant, preset, evaluation length): the spread of
  the task's metric over seeds (in % for an accuracy), and the training
  length."""
  runs: Dict[Tuple[str, str, str], List[Dict[str, Any]]] = {}
  for cell in cells:
    key = (cell.key["task"], cell.key["variant"], cell.key["preset"])
    runs.setdefault(key, [])
    results = read_results(cell.results_path)
    if results is not None:
      runs[key].append(results)
  rows = []
  for (task, variant, preset), finished in runs.items():
    metric = task_metric(table, task)
    scale = 100.0 if _is_percent(metric) else 1.0
    per_run = [_by_length(results) for results in finished]
    for length in sorted({length for lengths in per_run for length in lengths}):
      values = [lengths[length].get(metric) for lengths in per_run if length in lengths]
      rows.append(dict(
          task=task, variant=variant, preset=preset, length=length,
          train_length=int(finished[0]["config"]["task_options"]["seq_len"]),
          test=report.spread([None if v is None else scale * v for v in values])))
  return rows


def _lengths(rows: Sequence[Dict[str, Any]], task: str) -> List[int]:
  return sorted({r["length"] for r in rows if r["task"] == task})


def markdown(table: Any, rows: Sequence[Dict[str, Any]], data_dir: str = "data") -> List[str]:
  """Per task: the metric per variant (rows) at each evaluation length
  (columns, "T=<length> (<k>x)")."""
  del data_dir
  preset = accuracy.attention_presets(table)[0]
  by = {(r["task"], r["variant"], r["length"]): r for r in rows if r["preset"] == preset}
  lines: List[str] = []
  for task in accuracy.task_names(table):
    metric = task_metric(table, task)
    lengths = _lengths(rows, task)
    train = next((r["train_length"] for r in rows if r["task"] == task), None)
    names = [f"T={length}" + (f" ({length / train:g}x)" if train else "") for length in lengths]
    unit = " (%)" if _is_percent(metric) else ""
    if lines:
      lines.append("")
    lines += [f"## {task}: test {metric.replace('_', ' ')}{unit} by evaluation length, "
              f"trained at T={train}: mean ± std (n seeds)", "",
              *report.markdown_head(["variant", *names]),
              *report.variant_rows(
                  list(table.variants), lengths,
                  lambda variant, length, task=task, metric=metric: report.spread_text(
                      by.get((task, variant, length), {}).get("test"),
                      digits=1 if _is_percent(metric) else 3))]
  return lines


def plot(table: Any, rows: Sequence[Dict[str, Any]], out) -> List[str]:
  """`length_<task>.png` per task with a finished run: the metric against the
  evaluation length (log2 axis), a line per variant, the training length
  marked."""
  plt = report.pyplot()
  written = []
  preset = accuracy.attention_presets(table)[0]
  for task in accuracy.task_names(table):
    task_rows = [r for r in rows if r["task"] == task and r["preset"] == preset
                 and r["test"]["n"]]
    if not task_rows:
      continue
    metric = task_metric(table, task)
    fig, ax = plt.subplots(figsize=(6.0, 4.0))
    for index, variant in enumerate(table.variants):
      points = sorted((r["length"], r["test"]["mean"]) for r in task_rows
                      if r["variant"] == variant)
      if points:
        lengths, means = zip(*points)
        ax.plot(lengths, means, marker="o", markersize=3, label=variant,
                color=f"C{index % 10}", linestyle="-" if index < 10 else "--")
    ax.axvline(task_rows[0]["train_length"], color="grey", linestyle=":", linewidth=1)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("evaluation length (dotted: training length)")
    ax.set_ylabel(f"test {metric.replace('_', ' ')}" + (" (%)" if _is_percent(metric) else ""))
    ax.set_title(f"{table.get('description', table.name)}: {task}", fontsize=9)
    ax.legend(fontsize=6, ncol=2)
    written.append(report.save_figure(fig, out, f"length_{task}.png"))
  return written
