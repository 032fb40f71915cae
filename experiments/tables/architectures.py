"""The "architectures" table: one row per architecture, each its own smoke
config (its task, its metric), against that task's chance level.

The table config lists `rows`, `{label: {...}}` with

* `config`: the experiment config file and its argument,
  `"configs/lra/listops.py:dot_product,smoke"`;
* `overrides` (optional): nested config values set on top (through
  `configs/tables/cell.py`), e.g. `{"model": {"feed_forward": "moe"}}`;
* `metric` (optional, default "accuracy"): the evaluation metric shown;
* `chance`: the level to beat, "majority" (the test split's most common
  label, computed from the prepared data) or a number in percent with
  `chance_reason` saying where it comes from.

and `seeds`; `row_order` gives the display and run order (a ConfigDict
sorts its keys). Each cell is `(row, seed)` in `<results>/runs/<row>/seed<k>/`.
The table gives mean ± std over seeds, the chance level and whether every
seed beat it.
"""

from __future__ import annotations

import pathlib
from typing import Any, Dict, List, Optional, Sequence

from experiments.tables import accuracy, report
from experiments.tables.cells import Cell, read_results

REQUIRED = ("name", "rows", "seeds")
PAPER = False


def row_names(table: Any) -> List[str]:
  """The rows in display order: `row_order` when given, else as `rows` lists them."""
  order = list(table.get("row_order", ()))
  if order and sorted(order) != sorted(table.rows):
    raise ValueError(f"row_order {tuple(order)} must list the rows {tuple(table.rows)} once each.")
  return order or list(table.rows)


def _row(table: Any, label: str) -> Dict[str, Any]:
  row = accuracy.plain(table.rows[label])
  if "config" not in row or "chance" not in row:
    raise ValueError(f"row {label!r} needs 'config' and 'chance', got keys {sorted(row)}.")
  if row["chance"] != "majority" and not isinstance(row["chance"], (int, float)):
    raise ValueError(f"row {label!r}: chance must be 'majority' or a number (%), got "
                     f"{row['chance']!r}.")
  return row


def expand(table: Any, runs: pathlib.Path, *, data_dir: str = "data",
           batch_size: Optional[int] = None) -> List[Cell]:
  """The cells, seed-major."""
  del batch_size
  cells = []
  for seed in table.seeds:
    for label in row_names(table):
      row = _row(table, label)
      config_file, argument = accuracy.task_config(row["config"])
      variant, presets = argument[0], argument[1:]
      workdir = runs / label / f"seed{seed}"
      flags = (f"--config.seed={seed}", f"--config.data_dir={data_dir}",
               "--config.progress=False", *table.get("flags", ()))
      cells.append(Cell(key=dict(row=label, seed=seed), workdir=workdir,
                        command=accuracy.training_command(config_file, variant, presets,
                                                          workdir, flags,
                                                          row.get("overrides"))))
  return cells


def summarize(table: Any, cells: Sequence[Cell]) -> List[Dict[str, Any]]:
  """One row per architecture: the spread of its test metric (%) and of steps/s."""
  runs: Dict[str, List[Dict[str, Any]]] = {label: [] for label in row_names(table)}
  for cell in cells:
    results = read_results(cell.results_path)
    if results is not None and "test" in results.get("metrics", {}):
      runs[cell.key["row"]].append(results["metrics"])
  rows = []
  for label, metrics in runs.items():
    row = _row(table, label)
    name = row.get("metric", "accuracy")
    tests = [100 * m["test"][name] for m in metrics]
    rows.append(dict(row=label, config=row["config"], metric=name,
                     test=report.spread(tests), worst_test=min(tests) if tests else None,
                     steps_per_s=report.spread([m.get("steps_per_s") for m in metrics])))
  return rows


def _chance(table: Any, label: str, data_dir: str) -> Optional[float]:
  row = _row(table, label)
  if row["chance"] != "majority":
    return float(row["chance"])
  config_file, argument = accuracy.task_config(row["config"])
  return accuracy.majority_class(config_file, argument[1:], data_dir)


def markdown(table: Any, rows: Sequence[Dict[str, Any]], data_dir: str = "data") -> List[str]:
  """Per architecture: its config, metric, test mean ± std, chance and the
  verdict. Each row gets its "chance" here (the majority class needs the
  prepared data, which only this step is given), for the CSV and the plot."""
  lines = ["## Test metric against chance, per architecture", "",
           *report.markdown_head(["architecture", "config", "test metric (%)",
                                  "mean ± std (n seeds)", "chance (%)",
                                  "every seed above chance", "steps/s"])]
  reasons = []
  for row in rows:
    chance = row["chance"] = _chance(table, row["row"], data_dir)
    worst = row["worst_test"]
    verdict = "-" if worst is None or chance is None else ("yes" if worst > chance else "no")
    spec = _row(table, row["row"])
    if "chance_reason" in spec:
      reasons.append(f"{row['row']}: chance {spec['chance']}% is {spec['chance_reason']}.")
    lines.append(report.markdown_row([
        row["row"], f"`{row['config']}`", row["metric"].replace("_", " "),
        report.spread_text(row["test"]), "-" if chance is None else f"{chance:.1f}", verdict,
        report.spread_text(row["steps_per_s"])]))
  overrides = {label: accuracy.plain(table.rows[label]).get("overrides")
               for label in row_names(table)}
  lines += ["", "Chance is the majority class of the test split unless said here: "
            + (" ".join(reasons) if reasons else "(no other).")]
  lines += ["", "## Overrides on top of each config", "",
            *report.markdown_head(["architecture", "overrides"]),
            *(report.markdown_row([label, f"`{value}`" if value else "-"])
              for label, value in overrides.items())]
  return lines


def plot(table: Any, rows: Sequence[Dict[str, Any]], out: pathlib.Path) -> List[str]:
  """`architectures.png`: each architecture's test metric (error bar: one std
  over seeds), its chance level as a black tick."""
  done = [r for r in rows if r["test"]["n"]]
  if not done:
    return []
  plt = report.pyplot()
  fig, ax = plt.subplots(figsize=(max(6, 0.6 * len(done)), 4))
  xs = range(len(done))
  ax.bar(xs, [r["test"]["mean"] for r in done], yerr=[r["test"]["std"] or 0 for r in done],
         capsize=2)
  chances = [(x, r["chance"]) for x, r in zip(xs, done) if r.get("chance") is not None]
  if chances:
    ax.scatter([x for x, _ in chances], [c for _, c in chances], marker="_", s=300,
               color="black", zorder=3, label="chance")
    ax.legend(fontsize=8)
  ax.set_xticks(list(xs))
  ax.set_xticklabels([r["row"] for r in done], rotation=45, ha="right")
  ax.set_ylabel("test metric (%)")
  ax.set_title(table.get("description", table.name))
  return [report.save_figure(fig, out, "architectures.png")]
