"""The "speed" table: variants x lengths of `experiments.benchmark_lra_speed`.

Each cell times the LRA text model's train step for one `(variant, length)` in
`<results>/runs/<variant>/len<T>/`; the table gives steps/s and peak memory
with their ratios to `dot_product` at the same length beside the paper's
ratios, and which variants meet the paper's at the longest length measured.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any, Dict, List, Mapping, Optional, Sequence

from experiments import lra_paper
from experiments.tables import report
from experiments.tables.accuracy import plain
from experiments.tables.cells import Cell, benchmark_cell, read_results

REQUIRED = ("name", "variants", "lengths", "batch_size")
PAPER = True  # the LRA paper's ratios stand beside the measured ones


def _merge(into: Dict[str, Any], more: Mapping[str, Any]) -> None:
  for key, value in more.items():
    if isinstance(value, Mapping) and isinstance(into.get(key), dict):
      _merge(into[key], value)
    else:
      into[key] = json.loads(json.dumps(value))


def expand(table: Any, runs: pathlib.Path, *, data_dir: str = "data",
           batch_size: Optional[int] = None) -> List[Cell]:
  """The cells, length-major; `cell_overrides` are keyed by variant, or by
  `<variant>@<length>` for one length (merged over the variant's); `data_dir`
  is unused (the benchmark makes random tokens). See `experiments.tables.expand`."""
  del data_dir
  overrides = plain(table.get("cell_overrides", {})) or {}
  batch = batch_size or table.batch_size
  cells = []
  for length in table.lengths:
    for variant in table.variants:
      cell_overrides: Dict[str, Any] = {}
      for name in (variant, f"{variant}@{length}"):
        _merge(cell_overrides, overrides.get(name, {}))
      flags = (f"--variant={variant}", f"--length={length}", f"--batch={batch}",
               f"--steps={table.get('steps', 5)}", f"--warmup={table.get('warmup', 1)}",
               f"--overrides={json.dumps(cell_overrides, sort_keys=True)}")
      cells.append(benchmark_cell(table, dict(variant=variant, length=length),
                                  runs / variant / f"len{length}",
                                  "experiments.benchmark_lra_speed", flags))
  return cells


def summarize(table: Any, cells: Sequence[Cell]) -> List[Dict[str, Any]]:
  """One row per (variant, length): status, steps/s, memory (MiB) and their
  ratios to dot_product at that length, and the paper's ratios."""
  del table
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


def markdown(table: Any, rows: Sequence[Dict[str, Any]], data_dir: str = "") -> List[str]:
  """Steps/s and memory (variants x lengths), each with its ratio to
  dot_product and the paper's, then the comparison with the paper."""
  del data_dir
  by = {(r["variant"], r["length"]): r for r in rows}
  lengths = list(table.lengths)
  batches = sorted({r["batch_size"] for r in rows if r.get("batch_size")})
  lines = [f"Batch size {', '.join(map(str, batches)) or '-'} (the paper: 32). Ratios are to "
           "dot_product at the same length; the paper's ratio follows the slash.", ""]
  for title, *keys in (
      ("Train steps per second (ratio to dot_product / paper)", "steps_per_s", "speed_ratio",
       "paper_speed_ratio", "{:.3g}"),
      ("Peak memory, MiB (ratio to dot_product / paper)", "memory_mib", "memory_ratio",
       "paper_memory_ratio", "{:.0f}")):
    lines += [f"## {title}", "",
              *report.markdown_head(["variant", *map(report.length_label, lengths)]),
              *report.variant_rows(table.variants, lengths, lambda variant, length, keys=keys:
                                   _cell_text(by.get((variant, length), {}), *keys)), ""]
  measured = [r["length"] for r in rows if r.get("status") == "ok"]
  if measured:
    lines += paper_comparison(table, by, max(measured))
  memory_sources = sorted({r.get("memory_source") for r in rows if r.get("memory_source")})
  if memory_sources:
    lines.append(f"Memory source: {', '.join(memory_sources)} (see "
                 "experiments/benchmark_lra_speed.py).")
  return lines


def _cell_text(row: Mapping[str, Any], value_key: str, ratio_key: str, paper_key: str,
               fmt: str) -> str:
  """`value (ratio to dot_product) / the paper's ratio`; a failed cell's status
  in place of its value, "-" for a cell not run."""
  if not row.get("status"):
    return "-"
  paper = report.ratio_text(row.get(paper_key))
  if row["status"] != "ok":
    return f"{row['status']} / {paper}"
  value = row.get(value_key)
  return (f"{'-' if value is None else fmt.format(value)} "
          f"({report.ratio_text(row.get(ratio_key))}) / {paper}")


def paper_comparison(table: Any, by: Dict[Any, Dict[str, Any]], length: int) -> List[str]:
  """Which variants, at `length`, are at least the paper's speed-up over the
  Transformer and at most its memory ratio (the issue's targets for the table)."""
  lines = [f"## Against the paper at {length} tokens", "",
           *report.markdown_head(["variant", "speed-up / paper", "at least the paper's",
                                  "memory ratio / paper", "at most the paper's"])]
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
      verdicts += [f"{report.ratio_text(value)} / {report.ratio_text(paper)}",
                   "-" if value is None or paper is None else
                   ("yes" if better(round(value, 2), round(paper, 2)) else "no")]
    lines.append(report.markdown_row([variant, *verdicts]))
  return lines + [""] if compared else []


def plot(table: Any, rows: Sequence[Dict[str, Any]], out: pathlib.Path) -> List[str]:
  """`speed.png` and `memory.png`: steps/s and peak memory against length,
  log-log, one line per variant."""
  plt = report.pyplot()
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
    report.length_axes(ax, label, f"{table.get('description', table.name)}")
    ax.legend(fontsize=7, ncol=2)
    written.append(report.save_figure(fig, out, name))
  return written
