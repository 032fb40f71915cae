"""The "accuracy" table: tasks x variants x attention presets x seeds of
`experiments.train`.

Each cell trains one `(task, variant, preset, seed)` in
`<results>/runs/<task>/<variant>/<preset>/seed<k>/` (data in the shared
`--data_dir`); the preset is the variant's named option set (`method`, the
paper's method; `lra_release`, what the LRA release ran: see
`attention_jax.registry.PRESETS`), from the table's `attention_presets`
(default: method only). The table gives test accuracy as mean ± std over seeds,
one column per preset, beside the LRA paper's number, then best validation
accuracy, steps/s and peak memory.

Optional keys: `metric`, the evaluation metric shown (default "accuracy";
e.g. "sequence_accuracy" of a sequence-to-sequence task); `paper=False`
for a table with no LRA paper numbers; `baselines`, rows that are not a
registered variant, `{label: {"variant": name, "overrides": {...}}}` (the
variant's config with the overrides, e.g. the encoder-decoder without
attention), listed in `variants` by their label; `sort_by_accuracy=True`
to order the rows and the plot by mean test accuracy (best first), for a
table of many variants; a `tasks` value may name presets of its config file
after a colon (`"configs/recall/recall.py:mqar,T128"`), so one file serves
several columns; `percent=False` for a metric shown as it is (bits per
character) rather than as a percentage; `task_order`, the tasks in the order the table shows and
runs them (a ConfigDict sorts the keys of `tasks`); `not_run`, `{variant: reason}` for variants the
table leaves out, listed under it with the reason (never dropped silently).
With the majority class known, the table says which variants beat it in
every seed.

`learning_rates`, optional, sweeps the optimiser's rate as Zoology does: a
cell per rate (`--config.optimizer.learning_rate`, in `.../lr<rate>/seed<k>`;
a rate of None is the task config's own, in the `.../seed<k>` a table without
a sweep uses, so its finished cells count), and each row reports the rate
whose finished seeds have the best mean best-validation metric (ties: the
rate listed first; `lower_is_better=True` for a loss such as bits per
character), with the rate it chose (`selected_runs`).
"""

from __future__ import annotations

import json
import math
import pathlib
import sys
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from attention_jax.train.config import load_config_module
from experiments import lra_paper
from experiments.tables import report
from experiments.tables.cells import Cell, read_results

REQUIRED = ("name", "tasks", "variants", "seeds")
PAPER = True  # the LRA paper's number stands beside each measured one
SWEEPS_LEARNING_RATE = True  # `learning_rates` (see the module docstring)
CELL_CONFIG = "configs/tables/cell.py"


def plain(value: Any) -> Any:
  """ConfigDicts and tuples as plain dicts and lists (for JSON)."""
  if hasattr(value, "to_dict"):
    value = value.to_dict()
  if isinstance(value, Mapping):
    return {k: plain(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [plain(v) for v in value]
  return value


def training_command(config_file: str, variant: str, presets: Sequence[str],
                     workdir: pathlib.Path, flags: Sequence[str] = (),
                     overrides: Optional[Mapping[str, Any]] = None) -> Tuple[str, ...]:
  """The `experiments.train` argv of one run; `overrides` (nested dicts) go
  through `configs/tables/cell.py` when given."""
  arg = ",".join([variant, *presets])
  if overrides:
    config = f"{CELL_CONFIG}:{config_file}|{arg}|{json.dumps(plain(overrides), sort_keys=True)}"
  else:
    config = f"{config_file}:{arg}"
  return (sys.executable, "-m", "experiments.train", f"--config={config}",
          f"--workdir={workdir}", *flags)


def task_names(table: Any) -> Tuple[str, ...]:
  """The table's tasks in display order: `task_order` when given (a ConfigDict
  keeps its keys sorted), else as `tasks` lists them."""
  order = tuple(table.get("task_order", ()))
  if order and sorted(order) != sorted(table.tasks):
    raise ValueError(f"task_order {order} must list the tasks {tuple(table.tasks)} once each.")
  return order or tuple(table.tasks)


def task_config(value: str) -> Tuple[str, Tuple[str, ...]]:
  """A `tasks` entry, `"<config file>[:preset,...]"`, as (file, the task's own
  presets): one config file serves several columns (e.g. recall at two lengths)."""
  path, _, presets = value.partition(":")
  return path, tuple(p for p in presets.split(",") if p)


def attention_presets(table: Any) -> Tuple[str, ...]:
  """The table's attention presets, checked against the registry."""
  from attention_jax.registry import PRESETS, unknown_name_error  # pylint: disable=g-import-not-at-top
  presets = tuple(table.get("attention_presets", ("method",)))
  for preset in presets:
    if preset not in PRESETS:
      raise unknown_name_error("attention preset", preset, PRESETS)
  return presets


def learning_rates(table: Any) -> Tuple[Optional[float], ...]:
  """The table's learning-rate sweep (None: the task config's own rate); `(None,)`
  without one.

  Raises:
    ValueError: naming `learning_rates`, for a rate that is not a positive
      number or None, or a rate listed twice.
  """
  rates = tuple(table.get("learning_rates", ()) or (None,))
  for rate in rates:
    if rate is not None and (isinstance(rate, bool) or not isinstance(rate, (int, float))
                             or not rate > 0):
      raise ValueError(f"learning_rates must hold positive numbers or None (the config's own "
                       f"rate), got {rate!r} in {rates}.")
  if len(set(rates)) != len(rates):
    raise ValueError(f"learning_rates lists a rate twice: {rates}.")
  return rates


def sweeps_learning_rate(table: Any) -> bool:
  return learning_rates(table) != (None,)


def expand(table: Any, runs: pathlib.Path, *, data_dir: str = "data",
           batch_size: Optional[int] = None) -> List[Cell]:
  """The cells, seed-major (a stopped run has whole seeds first), one per
  preset the variant has; `batch_size` is unused (a training cell's batch is
  its config's). See `experiments.tables.expand`."""
  from attention_jax.registry import variant_presets  # pylint: disable=g-import-not-at-top
  del batch_size
  overrides = plain(table.get("cell_overrides", {})) or {}
  baselines = plain(table.get("baselines", {})) or {}
  presets = tuple(table.get("presets", ()))
  cells = []
  for seed in table.seeds:
    for task in task_names(table):
      config_file, task_presets = task_config(table.tasks[task])
      for label in table.variants:
        baseline = baselines.get(label, {})
        variant = baseline.get("variant", label)
        cell_overrides = _merged(baseline.get("overrides", {}),
                                 overrides.get(task, {}).get(label, {}))
        for preset in attention_presets(table):
          if preset not in variant_presets(variant):
            continue  # the table shows "-" for a preset the variant does not have
          for rate in learning_rates(table):
            key = dict(task=task, variant=label, preset=preset, seed=seed)
            workdir = runs / task / label / preset
            flags = (f"--config.seed={seed}", f"--config.data_dir={data_dir}",
                     "--config.progress=False", *table.get("flags", ()))
            if sweeps_learning_rate(table):
              key["learning_rate"] = rate
            if rate is not None:
              workdir = workdir / f"lr{rate:g}"
              flags += (f"--config.optimizer.learning_rate={rate!r}",)
            workdir = workdir / f"seed{seed}"
            cells.append(Cell(
                key=key, workdir=workdir,
                command=training_command(config_file, variant,
                                         (*presets, *task_presets, preset), workdir, flags,
                                         cell_overrides)))
  return cells


def selected_runs(table: Any, cells: Sequence[Cell]
                  ) -> Dict[Tuple[str, str, str], Dict[str, Any]]:
  """Per (task, variant, preset), the finished runs the row reports: every run
  without a sweep; with one, those of the rate whose runs have the best mean
  best-validation metric (Zoology's protocol: each model at its best rate).

  Returns:
    `{(task, variant, preset): {"runs": [results], "learning_rate": the
    chosen rate as the runs' config has it (None without a sweep or a
    finished run), "rates_finished": how many rates have a finished run}}`,
    every row present, with no runs before any finished.
  """
  metric = table.get("metric", "accuracy")
  sign = -1.0 if table.get("lower_is_better", False) else 1.0
  by_rate: Dict[Tuple[str, str, str], Dict[Any, List[Dict[str, Any]]]] = {}
  for cell in cells:
    row = (cell.key["task"], cell.key["variant"], cell.key["preset"])
    runs = by_rate.setdefault(row, {}).setdefault(cell.key.get("learning_rate"), [])
    results = read_results(cell.results_path)
    if results is not None and "metrics" in results:
      runs.append(results)
  selected = {}
  for row, rates in by_rate.items():
    finished = {rate: runs for rate, runs in rates.items() if runs}
    chosen: List[Dict[str, Any]] = []
    if finished:
      def score(runs):
        values = [r["metrics"].get("best_validation", {}).get(metric) for r in runs]
        values = [v for v in values if v is not None]
        return sign * sum(values) / len(values) if values else -math.inf
      # max keeps the first of equal scores: the rate listed first.
      chosen = max(finished.values(), key=score)
    rate = None
    if chosen and sweeps_learning_rate(table):
      rate = chosen[0].get("config", {}).get("optimizer", {}).get("learning_rate")
    selected[row] = dict(runs=chosen, learning_rate=rate, rates_finished=len(finished))
  return selected


def _merged(base: Mapping[str, Any], update: Mapping[str, Any]) -> Dict[str, Any]:
  """Nested dicts `base` updated by `update`, key by key."""
  merged = dict(base)
  for key, value in update.items():
    merged[key] = (_merged(merged[key], value) if isinstance(value, Mapping)
                   and isinstance(merged.get(key), Mapping) else value)
  return merged


def summarize(table: Any, cells: Sequence[Cell]) -> List[Dict[str, Any]]:
  """One row per (task, variant, preset): spreads of test accuracy (%), best
  validation accuracy (%) (the table's `metric`), steps/s and peak memory
  (MiB), and the paper's number."""
  metric = table.get("metric", "accuracy")
  scale = 100 if table.get("percent", True) else 1
  rows = []
  for (task, variant, preset), selected in selected_runs(table, cells).items():
    runs = selected["runs"]
    metrics = [r["metrics"] for r in runs]
    tests = [scale * m["test"][metric] for m in metrics if "test" in m]
    rows.append(dict(
        task=task, variant=variant, preset=preset,
        test=report.spread(tests), worst_test=min(tests) if tests else None,
        validation=report.spread([scale * m["best_validation"][metric] for m in metrics
                                  if "best_validation" in m]),
        steps_per_s=report.spread([m.get("steps_per_s") for m in metrics]),
        memory_mib=report.spread([m["peak_memory_bytes"] / 2**20 for m in metrics
                                  if m.get("peak_memory_bytes")]),
        memory_source=next((m.get("memory_source") for m in metrics), None),
        seeds=[r["config"]["seed"] for r in runs],
        learning_rate=selected["learning_rate"], rates_finished=selected["rates_finished"],
        paper=lra_paper.accuracy(variant, task) if table.get("paper", True) else None))
  return rows


def ordered_variants(table: Any, rows: Sequence[Dict[str, Any]]) -> List[str]:
  """The table's variants, by mean test accuracy of its first task and preset
  (best first, unfinished last) when it asks `sort_by_accuracy`, else as listed."""
  variants = list(table.variants)
  if not table.get("sort_by_accuracy", False):
    return variants
  first = (task_names(table)[0], attention_presets(table)[0])
  by = {r["variant"]: (r.get("test") or {}).get("mean")
        for r in rows if (r["task"], r["preset"]) == first}
  return sorted(variants, key=lambda v: (by.get(v) is None, -(by.get(v) or 0.0)))


def majority_verdict(table: Any, rows: Sequence[Dict[str, Any]],
                     majority: Mapping[str, Optional[float]]) -> List[str]:
  """Per task and preset: how many variants beat the majority class in every
  finished seed, and which did not (or have no finished seed)."""
  lines = []
  by = {(r["task"], r["variant"], r["preset"]): r for r in rows}
  for task, level in majority.items():
    if level is None:
      continue
    for preset in attention_presets(table):
      done = {v: by[(task, v, preset)]["worst_test"] for v in table.variants
              if by.get((task, v, preset), {}).get("worst_test") is not None}
      below = [f"{v} ({worst:.1f})" for v, worst in done.items() if worst <= level]
      missing = [v for v in table.variants if v not in done]
      line = (f"{task} {preset}: {len(done) - len(below)} of {len(done)} finished variants "
              f"beat the majority class ({level:.1f}%) in every seed")
      line += f"; not: {', '.join(below)} (worst seed)." if below else "."
      if missing:
        line += f" No finished run: {', '.join(missing)}."
      lines.append(line)
  return lines


def majority_class(config_file: str, presets: Sequence[str], data_dir: str,
                   split: str = "test") -> Optional[float]:
  """The share (%) of the most common label in a task's prepared `split`, the
  accuracy of always guessing it; None when the data is not there (or the task
  is not a classification of single labels)."""
  try:
    from attention_jax import data as lra_data  # pylint: disable=g-import-not-at-top
    # pylint: disable-next=g-import-not-at-top
    from attention_jax.train.task_data import task_data_dir, task_options
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


def markdown(table: Any, rows: Sequence[Dict[str, Any]], data_dir: str = "data") -> List[str]:
  """The majority class of each task and who beats it, test accuracy (variants x tasks) beside
  the paper's, then validation accuracy, steps/s and memory per cell."""
  tasks = list(task_names(table))
  presets = attention_presets(table)
  by = {(r["task"], r["variant"], r["preset"]): r for r in rows}
  majority = {}
  for task in tasks:
    config_file, task_presets = task_config(table.tasks[task])
    majority[task] = majority_class(config_file, (*table.get("presets", ()), *task_presets),
                                    data_dir)
  lines = []
  known = [f"{task} {value:.1f}%" for task, value in majority.items() if value is not None]
  if known:
    # Above the first heading: like the majority class, it needs the prepared data.
    lines += [f"Majority class of the test split (always guessing it): {', '.join(known)}.", "",
              *majority_verdict(table, rows, majority), ""]

  # A percentage to 0.1; a plain metric (bits per character) to 0.001.
  digits = 1 if table.get("percent", True) else 3

  def test_cell(variant: str, column: Tuple[str, Optional[str]]) -> str:
    task, preset = column
    if preset is not None:
      return report.spread_text(by.get((task, variant, preset), {}).get("test"), digits=digits)
    paper = lra_paper.accuracy(variant, task)
    return "-" if paper is None else f"{paper:.2f}"

  # Per task: one column per preset, then the paper's number.
  paper = table.get("paper", True)
  columns = [(task, preset) for task in tasks
             for preset in ((*presets, None) if paper else presets)]
  names = [f"{task} {preset or 'paper'}" for task, preset in columns]
  metric = table.get("metric", "accuracy").replace("_", " ")
  unit = " (%)" if table.get("percent", True) else ""
  lines += [f"## Test {metric}{unit}: measured mean ± std (n seeds) per preset"
            + (", and the LRA paper" if paper else ""),
            "", *report.markdown_head(["variant", *names]),
            *report.variant_rows(ordered_variants(table, rows), columns, test_cell)]
  not_run = plain(table.get("not_run", {})) or {}
  if not_run:
    lines += ["", "## Not run here", "", *report.markdown_head(["variant", "reason"]),
              *(report.markdown_row([variant, reason]) for variant, reason in not_run.items())]
  sweep = sweeps_learning_rate(table)
  lines += ["", f"## Best validation {metric}{unit}, train steps/s and peak memory (MiB)", ""]
  if sweep:
    lines += [learning_rate_note(table), ""]
  lines += report.markdown_head(["task", "variant", "preset", f"best validation{unit}",
                                 *(["learning rate"] if sweep else []),
                                 "steps/s", "peak memory (MiB)"])
  for task in tasks:
    for variant in ordered_variants(table, rows):
      for preset in presets:
        row = by.get((task, variant, preset), {})
        source = " host RSS" if row.get("memory_source") == "host_rss" else ""
        lines.append(report.markdown_row([
            task, variant, preset, report.spread_text(row.get("validation"), digits=digits),
            *([rate_text(row)] if sweep else []),
            report.spread_text(row.get("steps_per_s")),
            report.spread_text(row.get("memory_mib"), digits=0) + source]))
  return lines


def learning_rate_note(table: Any) -> str:
  """What a swept table's rows report, in one line."""
  rates = ", ".join("the config's own" if r is None else f"{r:g}" for r in learning_rates(table))
  direction = "lowest" if table.get("lower_is_better", False) else "best"
  return (f"Each row reports the learning rate, of {rates}, whose finished seeds have the "
          f"{direction} mean best-validation {table.get('metric', 'accuracy').replace('_', ' ')} "
          "(Zoology's protocol); its rate and how many rates had finished runs:")


def rate_text(row: Mapping[str, Any]) -> str:
  """A row's chosen rate, "0.003 (best of 2 rates run)" or "0.003 (the only rate
  run)"; "-" before any run."""
  if row.get("learning_rate") is None:
    return "-"
  if row["rates_finished"] == 1:
    return f"{row['learning_rate']:g} (the only rate run)"
  return f"{row['learning_rate']:g} (best of {row['rates_finished']} rates run)"


def plot(table: Any, rows: Sequence[Dict[str, Any]], out: pathlib.Path) -> List[str]:
  """`<metric>.png` (`accuracy.png` unless the table names another metric): the
  test metric by variant (ordered as the table's rows), one bar group per task,
  error bars of one std over seeds, the paper's number as a black tick."""
  plt = report.pyplot()
  groups = [(t, p) for t in task_names(table) for p in attention_presets(table)
            if any(r["task"] == t and r["preset"] == p and r["test"]["n"] for r in rows)]
  if not groups:
    return []
  by = {(r["task"], r["variant"], r["preset"]): r for r in rows}
  variants = ordered_variants(table, rows)
  width = 0.8 / len(groups)
  per_variant = 0.7 if len(variants) <= 20 else 0.3  # a zoo of 50 still fits a page
  fig, ax = plt.subplots(figsize=(max(6, per_variant * len(variants) * max(1, len(groups) / 2)),
                                  4))
  for i, (task, preset) in enumerate(groups):
    xs = [j + (i - (len(groups) - 1) / 2) * width for j in range(len(variants))]
    cells = [by.get((task, v, preset), {}) for v in variants]
    means = [(cell.get("test") or {}).get("mean") or 0 for cell in cells]
    stds = [(cell.get("test") or {}).get("std") or 0 for cell in cells]
    ax.bar(xs, means, width, yerr=stds, capsize=2,
           label=f"{task} ({preset})" if len(attention_presets(table)) > 1 else task)
    papers = [(x, cell.get("paper")) for x, cell in zip(xs, cells)]
    papers = [(x, p) for x, p in papers if p is not None]
    if papers:
      ax.scatter([x for x, _ in papers], [p for _, p in papers], marker="_", s=200,
                 color="black", zorder=3,
                 label=("LRA paper" + (" (full settings)" if table.get("presets") else ""))
                 if i == 0 else None)
  ax.set_xticks(range(len(variants)))
  ax.set_xticklabels(variants, rotation=45, ha="right")
  ax.set_ylabel(f"test {table.get('metric', 'accuracy').replace('_', ' ')}"
                + (" (%)" if table.get("percent", True) else ""))
  ax.set_title(table.get("description", table.name))
  ax.legend(fontsize=8)
  return [report.save_figure(fig, out, f"{table.get('metric', 'accuracy')}.png")]
