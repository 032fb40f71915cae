"""The "kernels" table: lengths of `experiments.benchmark_attention`.

Each cell runs the benchmark at one sequence length in
`<results>/runs/len<T>/` (the table config's `args` are its other flags); the
table puts each shape's implementations side by side, then lists every
benchmark record: implementation, length, mode, causal, milliseconds, peak
memory and the ratio to the fastest peer. With `block_sparse_args`, one more
cell (`<results>/runs/block_sparse/`) runs `experiments.benchmark_block_sparse`
and the table adds its rows: each sparse pattern's block density and its
time through the block-sparse kernel and through the variant's pure-JAX form.
"""

from __future__ import annotations

import pathlib
from typing import Any, Dict, List, Optional, Sequence, Tuple

from experiments.benchmark_block_sparse import fit_line
from experiments.tables import report
from experiments.tables.cells import Cell, benchmark_cell, read_results

REQUIRED = ("name", "lengths")
PAPER = False  # the LRA paper has no kernel table


def expand(table: Any, runs: pathlib.Path, *, data_dir: str = "data",
           batch_size: Optional[int] = None) -> List[Cell]:
  """One cell per length; `data_dir` and `batch_size` are unused (the inputs
  are random, the batch is in the table's `args`). See `experiments.tables.expand`."""
  del data_dir, batch_size
  cells = [benchmark_cell(table, dict(length=length), runs / f"len{length}",
                          "experiments.benchmark_attention",
                          (f"--lengths={length}", *table.get("args", ())))
           for length in table.lengths]
  if table.get("block_sparse_args") is not None:
    cells.append(benchmark_cell(table, dict(block_sparse=True), runs / "block_sparse",
                                "experiments.benchmark_block_sparse", table.block_sparse_args))
  return cells


def summarize(table: Any, cells: Sequence[Cell]) -> List[Dict[str, Any]]:
  """One row per benchmark record (implementation, length, mode, causal), and
  one per block-sparse record (variant, options)."""
  del table
  rows = []
  for cell in cells:
    records = (read_results(cell.results_path) or {}).get("records", [])
    rows += block_sparse_rows(records) if cell.key.get("block_sparse") else benchmark_rows(
        records)
  return rows


def block_sparse_rows(records: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
  """The table's rows of `experiments.benchmark_block_sparse` records."""
  return [dict(variant=r["variant"], options=", ".join(f"{k}={v}" for k, v in
                                                       r["options"].items()),
               block_density=r["block_density"], kernel_ms=r["kernel_ms"],
               pure_ms=r.get("pure_ms"), pure_over_kernel=r.get("pure_over_kernel"))
          for r in records]


def _is_block_sparse(row: Dict[str, Any]) -> bool:
  return "variant" in row


def benchmark_rows(records: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
  """The table's rows of `experiments.benchmark_attention` records.

  A peak that is only an upper bound (an accelerator's allocator peak that the
  cell did not raise) is left out.
  """
  def peak_mib(memory):
    exact = memory.get("exact", True)
    return ((memory.get("peak_delta_bytes") or 0) / 2**20 or None) if exact else None

  return [dict(impl=r.get("impl"), length=r.get("seq_len"), mode=r.get("mode"),
               causal=r.get("causal"), head_dim=r.get("head_dim"), ms=r.get("ms"),
               peak_mib=peak_mib(r.get("memory") or {}),
               speedup_vs_best_peer=r.get("speedup_vs_best_peer"), best_peer=r.get("best_peer"),
               error=r.get("error"))
          for r in records]


def by_shape(rows: Sequence[Dict[str, Any]]) -> List[str]:
  """One line per (T, mode, causal): each implementation's "ms (peak MiB)"
  side by side, then the best peer's time over each of ours (above 1: ours is
  faster)."""
  impls = list(dict.fromkeys(r["impl"] for r in rows))
  ours = [impl for impl in impls if impl.startswith("attention_jax:")]
  shapes = list(dict.fromkeys((r["length"], r["mode"], r["causal"]) for r in rows))
  cells = {(r["length"], r["mode"], r["causal"], r["impl"]): r for r in rows}

  def timing(r: Optional[Dict[str, Any]]) -> str:
    if r is None or r.get("error") or r.get("ms") is None:
      return "-" if r is None else "failed"
    peak = "-" if r["peak_mib"] is None else f"{r['peak_mib']:.0f}"
    # Below 10 ms three significant figures: GPU cells take fractions of a millisecond.
    ms = f"{r['ms']:.0f}" if r["ms"] >= 10 else f"{r['ms']:.3g}"
    return f"{ms} ({peak})"

  lines = report.markdown_head(["T", "mode", "causal", *[f"{i} ms (MiB)" for i in impls],
                                " / ".join(ours) + " vs best peer"])
  for length, mode, causal in shapes:
    here = [cells.get((length, mode, causal, impl)) for impl in impls]
    ratios = [report.ratio_text((cells.get((length, mode, causal, impl)) or {}).get(
        "speedup_vs_best_peer")) for impl in ours]
    lines.append(report.markdown_row([length, mode, causal, *map(timing, here),
                                      " / ".join(ratios)]))
  return lines


def markdown(table: Any, rows: Sequence[Dict[str, Any]], data_dir: str = "") -> List[str]:
  """The timings side by side per shape (`by_shape`), then one line per record;
  a failed one says why in place of its numbers."""
  del table, data_dir
  sparse_rows = [r for r in rows if _is_block_sparse(r)]
  rows = [r for r in rows if not _is_block_sparse(r)]
  lines = ["## ms (peak MiB) by shape, and the best peer's time over ours", "",
           *by_shape(rows), ""]
  if sparse_rows:
    lines += ["## Block-sparse kernel: forward+backward ms against the pure-JAX forms", "",
              *block_sparse_lines(sparse_rows), ""]
  lines += ["## Every record", ""]
  lines += report.markdown_head(["impl", "T", "mode", "causal", "ms", "peak MiB",
                                 "vs best peer", "best peer"])
  for r in rows:
    shape = [r["impl"], r["length"], r["mode"], r["causal"]]
    if r.get("error"):
      failed = f"failed: {str(r['error']).splitlines()[0][:60]}"
      lines.append(report.markdown_row([*shape, failed]) + " | | |")
      continue
    peak = "-" if r["peak_mib"] is None else f"{r['peak_mib']:.1f}"
    lines.append(report.markdown_row([*shape, f"{r['ms']:.2f}", peak,
                                      report.ratio_text(r.get("speedup_vs_best_peer")),
                                      r.get("best_peer") or "-"]))
  return lines


def block_sparse_lines(rows: Sequence[Dict[str, Any]]) -> List[str]:
  """One line per pattern (dense blockwise first, density 1), then the least-
  squares line of the kernel's time against block density."""
  lines = report.markdown_head(["variant", "options", "block density", "kernel ms", "pure ms",
                                "pure / kernel"])
  for r in rows:
    pure = "-" if r["pure_ms"] is None else _ms(r["pure_ms"])
    lines.append(report.markdown_row([
        r["variant"], r["options"] or "-", f"{r['block_density']:.3f}", _ms(r["kernel_ms"]),
        pure, report.ratio_text(r["pure_over_kernel"])]))
  fit = fit_line([r["block_density"] for r in rows], [r["kernel_ms"] for r in rows])
  return lines + ["", f"Kernel ms = {_ms(fit['intercept_ms'])} + {_ms(fit['slope_ms'])} x block "
                      f"density (least squares over the {len(rows)} rows, R^2 "
                      f"{fit['r_squared']:.3f})."]


def _ms(milliseconds: float) -> str:
  """Whole milliseconds from 10 on (CPU cells), two decimals under (GPU cells)."""
  return f"{milliseconds:.0f}" if abs(milliseconds) >= 10 else f"{milliseconds:.2f}"


def plot(table: Any, rows: Sequence[Dict[str, Any]], out: pathlib.Path) -> List[str]:
  """`kernels.png`: milliseconds against length, log-log; one panel per mode,
  one colour per implementation, dashed when causal."""
  del table
  plt = report.pyplot()
  series: Dict[Tuple[str, str, bool], List[Tuple[int, float]]] = {}
  for r in (r for r in rows if not _is_block_sparse(r)):
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
    report.length_axes(ax, "ms", mode)
    ax.legend(fontsize=7)
  return [report.save_figure(fig, out, "kernels.png")]
