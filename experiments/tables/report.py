"""What every kind of table writes alike: numbers as text, markdown rows, the
header of `table.md`, `table.csv`, the plots' axes and files, and
`write_outputs`, which puts a kind's summary, markdown and plots together."""

from __future__ import annotations

import csv
import datetime
import math
import pathlib
import statistics
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence

from attention_jax.train.provenance import describe_devices
from experiments import lra_paper
from experiments.tables.cells import Cell, read_results

# ---------------------------------------------------------------------------
# Numbers and markdown.
# ---------------------------------------------------------------------------


def spread(values: Sequence[Optional[float]]) -> Dict[str, Any]:
  """Mean, sample standard deviation (0 for one value) and count."""
  values = [v for v in values if v is not None and math.isfinite(v)]
  if not values:
    return dict(mean=None, std=None, n=0)
  return dict(mean=statistics.fmean(values),
              std=statistics.stdev(values) if len(values) > 1 else 0.0, n=len(values))


def spread_text(stats: Optional[Mapping[str, Any]], scale: float = 1.0, digits: int = 1) -> str:
  """`mean ± std (n=k)`; no std for one value, "-" for none."""
  if not stats or not stats.get("n"):
    return "-"
  text = f"{stats['mean'] * scale:.{digits}f}"
  if stats["n"] > 1:
    text += f" ± {stats['std'] * scale:.{digits}f}"
  return text + f" (n={stats['n']})"


def ratio_text(value: Optional[float]) -> str:
  return "-" if value is None else f"{value:.2f}x"


def markdown_row(cells: Iterable[Any]) -> str:
  return "| " + " | ".join(map(str, cells)) + " |"


def markdown_head(columns: Sequence[str]) -> List[str]:
  """A markdown table's header row and its rule."""
  return [markdown_row(columns), "|" + "---|" * len(columns)]


def variant_rows(variants: Sequence[str], columns: Sequence[Any],
                 text: Callable[[str, Any], str]) -> List[str]:
  """One markdown row per variant: its name, then `text(variant, column)` for
  each column (a task, a length)."""
  return [markdown_row([variant, *(text(variant, column) for column in columns)])
          for variant in variants]


def length_label(length: int) -> str:
  """1024 -> "1K"; a length that is not whole kilotokens as it is."""
  return f"{length // 1024}K" if length % 1024 == 0 else str(length)


# ---------------------------------------------------------------------------
# table.md's header, table.csv.
# ---------------------------------------------------------------------------


def provenance(cells: Sequence[Cell]) -> Dict[str, Any]:
  """The devices and git revisions the finished cells ran on."""
  devices, revisions = set(), set()
  for cell in cells:
    results = read_results(cell.results_path) or {}
    d = results.get("devices")
    if d:
      devices.add(describe_devices(d) + ("" if d.get("cpu_model") else f" ({d.get('platform')})"))
    env = results.get("environment")
    if env:
      devices.add(f"{env.get('device_count')} x {env.get('device_kind')} ({env.get('backend')})")
    revision = results.get("git_revision") or (env or {}).get("git_revision")
    if revision:
      revisions.add(revision)
  return dict(devices=sorted(devices), git_revisions=sorted(revisions))


def header(table: Any, cells: Sequence[Cell], command: str, paper: bool) -> List[str]:
  """The lines above a table: its title, devices, git revisions, how many
  cells are finished, the command, the time, the table's notes and, where
  `paper`, where the LRA paper's numbers beside the cells come from."""
  info = provenance(cells)
  finished = sum(cell.results_path.is_file() for cell in cells)
  lines = [f"# {table.get('description', table.name)}", "",
           f"- device: {', '.join(info['devices']) or 'unknown (no finished cell)'}",
           f"- git revision: {', '.join(info['git_revisions']) or 'unknown'}",
           f"- cells finished: {finished} of {len(cells)}",
           f"- command: `{command}`",
           f"- generated: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}"]
  lines += [f"- note: {note}" for note in table.get("notes", ())]
  if paper:
    lines.append(f"- paper numbers: {lra_paper.PAPER}, see experiments/lra_paper.py"
                 + (f"; the paper's are at its full settings, these cells at the preset "
                    f"{', '.join(table.presets)}" if table.get("presets") else ""))
  return lines + [""]


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


def pyplot():
  """matplotlib's pyplot on the Agg backend (files only, no display)."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  return plt


def length_axes(ax: Any, ylabel: str, title: str) -> None:
  """Log-log axes of a quantity against the sequence length (powers of 2)."""
  ax.set_xscale("log", base=2)
  ax.set_yscale("log")
  ax.set_xlabel("sequence length")
  ax.set_ylabel(ylabel)
  ax.set_title(title)


def save_figure(fig: Any, out: pathlib.Path, name: str) -> str:
  """Writes `fig` to `out/name` and closes it; returns `name`."""
  fig.tight_layout()
  fig.savefig(out / name, dpi=120)
  pyplot().close(fig)
  return name


# ---------------------------------------------------------------------------
# All outputs of a table.
# ---------------------------------------------------------------------------


def write_outputs(table: Any, kind: Any, cells: Sequence[Cell], results_dir: pathlib.Path,
                  command: str, data_dir: str = "data") -> List[str]:
  """Writes table.md, table.csv and the plots from the finished cells.

  Args:
    table: the table config.
    kind: its kind's module (`experiments.tables.accuracy`, ...).
    cells: the whole grid (unfinished cells count in the header).
    results_dir: where the files go.
    command: the command line, for the header.
    data_dir: the prepared data (the accuracy table reads the majority class).

  Returns:
    The names of the files written.
  """
  rows = kind.summarize(table, cells)
  results_dir.mkdir(parents=True, exist_ok=True)
  paper = kind.PAPER and table.get("paper", True)  # a table off LRA says paper=False
  text = "\n".join(header(table, cells, command, paper)
                   + kind.markdown(table, rows, data_dir)) + "\n"
  (results_dir / "table.md").write_text(text)
  write_csv(results_dir / "table.csv", rows)
  return ["table.md", "table.csv", *kind.plot(table, rows, results_dir)]
