"""The "grouped_accuracy" table: the cells of an accuracy table (tasks x
variants x seeds of `experiments.train`), each task's test accuracy broken
down by the task's evaluation groups (`TaskInfo.eval_groups`, e.g. recall per
number of key-value pairs), with a plot of accuracy against the group per
variant.

A group is read from the results' test metrics, "<group>_accuracy" (ordered
by a trailing number, else by name); a task without groups shows its accuracy in one
column. Rows follow `accuracy.ordered_variants` (by mean test accuracy of the
first task with `sort_by_accuracy`). `group_axis`, optional, labels the
plots' x axis (default "group"); a group name ending in a number ("pairs8")
is plotted at that number. `heatmaps`, optional, `{name: (task, ...)}`,
draws instead one figure per name, `heatmap_<name>.png`: a panel per variant
with its tasks as rows and the groups as columns, coloured by mean accuracy
(the needle table: lengths by needle depth), and the markdown the same
tables: a section per name, a row per variant and task.
"""

from __future__ import annotations

import math
import re
from typing import Any, Dict, List, Optional, Sequence, Tuple

from experiments.tables import accuracy, report
from experiments.tables.cells import Cell

REQUIRED = accuracy.REQUIRED
PAPER = False
SWEEPS_LEARNING_RATE = True  # as the accuracy kind: `accuracy.selected_runs`
expand = accuracy.expand
OVERALL = "all"  # the column of a task's accuracy over every group


def _groups(test_metrics: Dict[str, float], metric: str) -> List[str]:
  """The group names of one run's test metrics: by their trailing numbers when
  all have one ("pairs2" before "pairs16"), else by name."""
  suffix = f"_{metric}"
  groups = sorted(name[:-len(suffix)] for name in test_metrics
                  if name.endswith(suffix) and name != metric)
  if all(re.search(r"\d+$", group) for group in groups):
    groups.sort(key=lambda group: _position(group, 0))
  return groups


def summarize(table: Any, cells: Sequence[Cell]) -> List[Dict[str, Any]]:
  """One row per (task, variant, preset, group), the group "all" included:
  the spread of test accuracy (%) over seeds."""
  metric = table.get("metric", "accuracy")
  rows = []
  for (task, variant, preset), selected in accuracy.selected_runs(table, cells).items():
    tests = [r["metrics"]["test"] for r in selected["runs"] if "test" in r["metrics"]]
    groups = _groups(tests[0], metric) if tests else []
    for group in (*groups, OVERALL):
      name = metric if group == OVERALL else f"{group}_{metric}"
      rows.append(dict(task=task, variant=variant, preset=preset, group=group,
                       test=report.spread([100 * t[name] for t in tests if name in t]),
                       learning_rate=selected["learning_rate"],
                       rates_finished=selected["rates_finished"]))
  return rows


def _columns(table: Any, rows: Sequence[Dict[str, Any]]) -> List[Tuple[str, str, str]]:
  """(task, preset, group) columns: per task and preset its groups (if any),
  then "all"."""
  columns = []
  for task in accuracy.task_names(table):
    for preset in accuracy.attention_presets(table):
      groups = [g for g in dict.fromkeys(r["group"] for r in rows
                                          if (r["task"], r["preset"]) == (task, preset))
                if g != OVERALL]
      columns += [(task, preset, group) for group in (*groups, OVERALL)]
  return columns


def _overall_rows(rows: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
  """The rows of the whole task (what `accuracy.ordered_variants` sorts by)."""
  return [r for r in rows if r["group"] == OVERALL]


def markdown(table: Any, rows: Sequence[Dict[str, Any]], data_dir: str = "data") -> List[str]:
  """Test accuracy per variant (rows) and task x group (columns)."""
  del data_dir
  by = {(r["task"], r["variant"], r["preset"], r["group"]): r for r in rows}
  columns = _columns(table, rows)
  several_presets = len(accuracy.attention_presets(table)) > 1
  names = [" ".join([task, *([preset] if several_presets else []), group])
           for task, preset, group in columns]
  metric = table.get("metric", "accuracy").replace("_", " ")
  if table.get("heatmaps"):
    lines = _heatmap_sections(table, rows, by, metric)
  else:
    lines = [f"## Test {metric} (%) per group: mean ± std (n seeds)", "",
             *report.markdown_head(["variant", *names]),
             *report.variant_rows(
                 accuracy.ordered_variants(table, _overall_rows(rows)), columns,
                 lambda variant, column: report.spread_text(
                     by.get((column[0], variant, column[1], column[2]), {}).get("test")))]
  if accuracy.sweeps_learning_rate(table):
    # One column per task and preset: the rate its row reports.
    rate_columns = [(task, preset) for task in accuracy.task_names(table)
                    for preset in accuracy.attention_presets(table)]
    lines += ["", "## Learning rate of each row", "", accuracy.learning_rate_note(table), "",
              *report.markdown_head(["variant", *(" ".join([task, *([preset] if several_presets
                                                                      else [])])
                                                  for task, preset in rate_columns)]),
              *report.variant_rows(
                  accuracy.ordered_variants(table, _overall_rows(rows)), rate_columns,
                  lambda variant, column: accuracy.rate_text(
                      by.get((column[0], variant, column[1], OVERALL), {})))]
  not_run = accuracy.plain(table.get("not_run", {})) or {}
  if not_run:
    lines += ["", "## Not run here", "", *report.markdown_head(["variant", "reason"]),
              *(report.markdown_row([variant, reason]) for variant, reason in not_run.items())]
  return lines


def _heatmap_sections(table: Any, rows: Sequence[Dict[str, Any]], by: Dict[tuple, Any],
                      metric: str) -> List[str]:
  """A section per heatmap, its figure as a table: a row per variant and task
  (the needle table: per length), the groups and "all" as columns. One table
  of every task by every group would be some thirty columns wide."""
  preset = accuracy.attention_presets(table)[0]
  variants = accuracy.ordered_variants(table, _overall_rows(rows))
  lines: List[str] = []
  order = accuracy.task_names(table)
  # In the order of the tasks (a ConfigDict sorts its keys by name).
  for name, tasks in sorted(accuracy.plain(table.heatmaps).items(),
                            key=lambda item: min(map(order.index, item[1]))):
    groups = list(dict.fromkeys(g for t, p, g in _columns(table, rows)
                                if t in tasks and p == preset and g != OVERALL))
    lines += [f"## {name}: test {metric} (%) per {table.get('group_axis', 'group')}: "
              "mean ± std (n seeds)", "",
              *report.markdown_head(["variant", "task", *groups, OVERALL])]
    lines += [report.markdown_row([variant, task, *(
        report.spread_text(by.get((task, variant, preset, group), {}).get("test"))
        for group in (*groups, OVERALL))]) for variant in variants for task in tasks]
    lines.append("")
  return lines[:-1]


def _position(group: str, index: int) -> float:
  """Where a group sits on the x axis: its trailing number, else its index."""
  match = re.search(r"(\d+)$", group)
  return float(match.group(1)) if match else float(index)


def plot(table: Any, rows: Sequence[Dict[str, Any]], out) -> List[str]:
  """`accuracy_by_group.png`: one panel per variant, test accuracy against the
  group (log2 axis when the groups are numbers), a line per task with more
  than one group, error bars of one std over seeds."""
  grouped = [(task, preset) for task in accuracy.task_names(table)
             for preset in accuracy.attention_presets(table)
             if len({r["group"] for r in rows if (r["task"], r["preset"]) == (task, preset)}) > 2]
  if table.get("heatmaps"):
    drawn = [_heatmap(table, rows, out, name, tasks)
             for name, tasks in accuracy.plain(table.heatmaps).items()]
    return [name for name in drawn if name]
  if not grouped:
    return []
  plt = report.pyplot()
  variants = accuracy.ordered_variants(table, _overall_rows(rows))
  per_row = min(8, len(variants))
  num_rows = math.ceil(len(variants) / per_row)
  fig, axes = plt.subplots(num_rows, per_row, figsize=(2.2 * per_row, 2.0 * num_rows),
                           sharex=True, sharey=True, squeeze=False)
  by = {(r["task"], r["variant"], r["preset"], r["group"]): r for r in rows}
  # One colour per task in every panel, and one legend for the figure: a panel
  # holding only its second task's line must not draw it in the first's colour.
  several_presets = len({preset for _, preset in grouped}) > 1
  labels = {key: f"{key[0]} {key[1]}" if several_presets else key[0] for key in grouped}
  colors = {key: f"C{index}" for index, key in enumerate(grouped)}
  for ax, variant in zip(axes.flat, variants):
    for task, preset in grouped:
      groups = [g for t, p, g in _columns(table, rows) if (t, p) == (task, preset)
                and g != OVERALL]
      stats = [by.get((task, variant, preset, g), {}).get("test") or {} for g in groups]
      points = [(_position(g, i), s["mean"], s["std"]) for i, (g, s) in enumerate(zip(groups, stats))
                if s.get("n")]
      if points:
        xs, means, stds = zip(*points)
        ax.errorbar(xs, means, yerr=stds, marker="o", markersize=3, capsize=2,
                    color=colors[(task, preset)], label=labels[(task, preset)])
    ax.set_title(variant, fontsize=8)
    ax.set_ylim(0, 105)
    if all(re.search(r"\d+$", g) for _, _, g in _columns(table, rows) if g != OVERALL):
      ax.set_xscale("log", base=2)
    ax.tick_params(labelsize=7)
  for ax in list(axes.flat)[len(variants):]:
    ax.axis("off")
  fig.legend(handles=[plt.Line2D([], [], color=colors[key], marker="o", markersize=3,
                                  label=labels[key]) for key in grouped],
             loc="upper right", fontsize=7)
  fig.supxlabel(table.get("group_axis", "group"))
  fig.supylabel(f"test {table.get('metric', 'accuracy').replace('_', ' ')} (%)")
  fig.suptitle(table.get("description", table.name), fontsize=10)
  return [report.save_figure(fig, out, "accuracy_by_group.png")]


def _heatmap(table: Any, rows: Sequence[Dict[str, Any]], out, name: str,
             tasks: Sequence[str]) -> Optional[str]:
  """`heatmap_<name>.png`: per variant, mean test accuracy of `tasks` (rows)
  at each group (columns), its value written in the cell (blank: not run);
  None, drawing nothing, before any of the tasks has a finished run."""
  preset = accuracy.attention_presets(table)[0]
  groups = list(dict.fromkeys(g for t, p, g in _columns(table, rows)
                              if t in tasks and p == preset and g != OVERALL))
  if not groups:
    return None
  plt = report.pyplot()
  variants = accuracy.ordered_variants(table, _overall_rows(rows))
  per_row = min(4, len(variants))
  num_rows = math.ceil(len(variants) / per_row)
  fig, axes = plt.subplots(num_rows, per_row, figsize=(0.5 * len(groups) * per_row + 1.5,
                                                       0.4 * len(tasks) * num_rows + 1.2),
                           squeeze=False)
  by = {(r["task"], r["variant"], r["group"]): r for r in rows if r["preset"] == preset}
  for ax, variant in zip(axes.flat, variants):
    means = [[(by.get((task, variant, group), {}).get("test") or {}).get("mean", math.nan)
              for group in groups] for task in tasks]
    ax.imshow(means, vmin=0, vmax=100, cmap="viridis", aspect="auto")
    for i, line in enumerate(means):
      for j, mean in enumerate(line):
        if not math.isnan(mean):
          ax.text(j, i, f"{mean:.0f}", ha="center", va="center", fontsize=6,
                  color="white" if mean < 60 else "black")
    ax.set_xticks(range(len(groups)), groups, fontsize=6, rotation=45)
    ax.set_yticks(range(len(tasks)), tasks, fontsize=6)
    ax.set_title(variant, fontsize=8)
  for ax in list(axes.flat)[len(variants):]:
    ax.axis("off")
  fig.suptitle(f"{table.get('description', table.name)}: {name}, test "
               f"{table.get('metric', 'accuracy').replace('_', ' ')} (%)", fontsize=9)
  return report.save_figure(fig, out, f"heatmap_{name}.png")
