r"""How every registered variant scales with the sequence length.

For each variant and each length T, one attention layer (the variant's module:
`MultiHeadAttention(attention=name)` or its own mixer, `num_heads` heads of
`head_dim`, so the model width is their product) is timed in the forward pass
and in forward+backward (gradients of `sum(out^2)` w.r.t. the parameters and the
input), and its peak memory is measured. Every cell runs in its own process on
CPU (peak RSS is then its own; see `benchmark_attention`), and a cell whose
compiled program needs more memory than the machine has is recorded as failed
with that figure instead of being run.

Reported per variant: milliseconds and peak MB at each T, the ratio to dense
attention (`dot_product` computed by XLA with the T x T logits) at the same T and mode (above 1: faster / smaller),
and the least-squares slope of log(time) and log(memory) against log(T) — about
1 for linear cost, 2 for quadratic. The table is printed, the records written as
JSON, and the curves drawn on log-log axes.

This is a benchmark, not a test: it asserts nothing about speed.

Usage::

  python -m experiments.benchmark_scaling
  python -m experiments.benchmark_scaling --variants=dot_product,local,performer \
      --lengths=1024,4096,16384 --modes=fwd_bwd
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import pathlib
import statistics
import time
from typing import Any, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from attention_jax import registry
from experiments import benchmark_attention as common
from experiments import cli

REPO_ROOT = common.REPO_ROOT
DENSE = "dot_product"
MODES = common.MODES
MB = common.MB


def define_flags(flag_values: flags.FlagValues, argv: Sequence[str]) -> None:
  """This script's flags (see `experiments.cli`)."""
  del argv  # only config flags read it
  common.define_sweep_flags(flag_values, cell_timeout=1800.0)
  flags.DEFINE_list("variants", None, "registered token mixers, comma-separated (default: all; "
                    "dot_product is always added)", flag_values=flag_values)
  cli.DEFINE_list_of(flags.IntegerParser(lower_bound=1), "lengths",
                     [1024, 2048, 4096, 8192, 16384], "sequence lengths T", flag_values)
  flags.DEFINE_integer("heads", 4, "attention heads", lower_bound=1, flag_values=flag_values)
  flags.DEFINE_integer("head_dim", 64, "head dim D", lower_bound=1, flag_values=flag_values)
  flags.DEFINE_string("out", None, "JSON output (default: benchmarks/scaling_<backend>.json); the "
                      "plot is written next to it with the suffix .png", flag_values=flag_values)
  flags.DEFINE_integer("max_quadratic_length", None, "measure variants registered as quadratic "
                       "(other than the dense reference, which always runs) only up to this T",
                       flag_values=flag_values)

  def known_variants(names: Sequence[str] | None) -> bool:
    for name in names or ():
      try:
        registry.get_mixer(name)
      except ValueError as e:  # its message lists the valid names
        raise flags.ValidationError(str(e)) from e
    return True

  flags.register_validator("variants", known_variants, flag_values=flag_values)


def parse_args(argv: Sequence[str] | None = None) -> cli.Args:
  """This script's flags from `argv` (as on the command line; None: `sys.argv[1:]`).

  Raises:
    flags.Error: on a bad flag, naming it.
  """
  return cli.parse(define_flags, argv, __name__)


# Measured only where they compile natively: off an accelerator the Pallas
# kernel runs in its interpreter, which times the interpreter, not the kernel.
ACCELERATOR_ONLY = ("flash",)


def selected_variants(requested: list[str] | None, backend: str = "cpu") -> list[str]:
  """The variants to measure, dense first (every ratio is against it)."""
  if requested is None:
    names = [name for name in registry.list_variants("mixer")
             if backend != "cpu" or name not in ACCELERATOR_ONLY]
  else:
    names = list(requested)
  return [DENSE] + [name for name in dict.fromkeys(names) if name != DENSE]


# ---------------------------------------------------------------------------
# One cell.
# ---------------------------------------------------------------------------


def make_cells(args: cli.Args, variants: list[str]) -> Iterator[dict[str, Any]]:
  for name in variants:
    quadratic = name != DENSE and not registry.get_variant(name).subquadratic
    for seq_len in args.lengths:
      if quadratic and args.max_quadratic_length and seq_len > args.max_quadratic_length:
        continue
      for mode in args.modes:
        yield {"variant": name, "seq_len": seq_len, "mode": mode, "batch": args.batch,
               "heads": args.heads, "head_dim": args.head_dim, "dtype": args.dtype,
               "repeats": args.repeats}


def module_of(variant: str, num_heads: int, seq_len: int):
  """The variant's layer at length `seq_len`.

  Dense attention and its head layouts are pinned to the XLA implementation:
  `implementation=None` would pick blockwise on CPU for long sequences, and the
  reference must be the materialised T x T softmax. Variants whose parameters
  are sized by a `max_length` (the Synthesizers, mlp_mixer, gmlp) get
  `max_length = seq_len`.
  """
  spec = registry.get_mixer(variant)
  if variant == DENSE or spec.family == "heads":
    return spec.module(num_heads=num_heads, attention_options={"implementation": "xla"})
  fields = lambda cls: {f.name for f in dataclasses.fields(cls)} if cls is not None else set()
  if "max_length" in fields(spec.extras):
    return spec.module(num_heads=num_heads, attention_options={"max_length": seq_len})
  if spec.mixer is not None and "max_length" in fields(spec.mixer_class):
    return spec.module(num_heads=num_heads, max_length=seq_len)
  return spec.module(num_heads=num_heads)


def make_step(cell: dict[str, Any]):
  """The layer's jitted forward pass or gradient, its variables and its input."""
  width = cell["heads"] * cell["head_dim"]
  module = module_of(cell["variant"], cell["heads"], cell["seq_len"])
  x = jax.random.normal(jax.random.key(0, impl="rbg"),
                        (cell["batch"], cell["seq_len"], width), cell["dtype"])
  variables = jax.jit(module.init)(jax.random.PRNGKey(0), x)

  def forward(variables, x):
    return module.apply(variables, x)

  if cell["mode"] == "fwd":
    return jax.jit(forward), (variables, x)

  def loss(variables, x):
    return jnp.sum(jnp.square(forward(variables, x).astype(jnp.float32)))

  return jax.jit(jax.grad(loss, argnums=(0, 1))), (variables, x)


def measure_cell(cell: dict[str, Any], memory_method: str,
                 step_of_cell=None) -> dict[str, Any]:
  """Compiles, times and measures one cell in this process; errors are recorded.
  `step_of_cell(cell) -> (jitted step, inputs)`: this file's `make_step` when
  None (benchmark_chunkwise passes its own)."""
  record = dict(cell, memory={"method": memory_method}, error=None)
  try:
    step, inputs = (step_of_cell or make_step)(cell)
    inputs = jax.block_until_ready(inputs)
    start = time.perf_counter()
    compiled = step.lower(*inputs).compile()
    record["compile_s"] = time.perf_counter() - start
    record["memory"]["compiled"] = common.compiled_memory(compiled)
    common.check_fits_in_memory(record["memory"]["compiled"], memory_method)
    with common.PeakMemory(memory_method) as memory:
      times = common.time_runs(compiled, inputs, cell["repeats"])
    record["memory"] = dict(memory.result, compiled=record["memory"]["compiled"])
    record["times_ms"] = times
    record["ms"] = statistics.median(times)
  except Exception as e:  # pylint: disable=broad-except
    record["error"] = f"{type(e).__name__}: {e}"[:2000]
  return record


def run_cells(cells: list[dict[str, Any]], args: cli.Args,
              backend: str) -> list[dict[str, Any]]:
  records = []
  for i, cell in enumerate(cells, 1):
    if backend == "cpu":
      failed = dict(cell, memory={"method": "process"})
      record = common.measure_in_child(cell, args.cell_timeout, "experiments.benchmark_scaling",
                                       failed)
    else:
      record = measure_cell(cell, "device")
      jax.clear_caches()
    records.append(record)
    outcome = f"{record['ms']:.2f} ms" if record.get("error") is None else "FAILED"
    print(f"[{i}/{len(cells)}] {cell['variant']} T={cell['seq_len']} {cell['mode']}: {outcome}",
          flush=True)
  return records


# ---------------------------------------------------------------------------
# Analysis.
# ---------------------------------------------------------------------------


def peak_bytes(record: dict[str, Any]) -> float | None:
  return record.get("memory", {}).get("peak_delta_bytes")


def log_log_slope(lengths: list[int], values: list[float | None]) -> float | None:
  """Least-squares slope of log(value) against log(T) over the cells that ran."""
  points = [(math.log(t), math.log(v)) for t, v in zip(lengths, values) if v and v > 0]
  if len(points) < 2:
    return None
  xs, ys = zip(*points)
  return float(np.polyfit(xs, ys, 1)[0])


def summarize(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
  """One row per (variant, mode): the series, slopes and ratios to dense."""
  ok = [r for r in records if r.get("error") is None]
  dense = {(r["seq_len"], r["mode"]): r for r in ok if r["variant"] == DENSE}
  rows = []
  for variant in dict.fromkeys(r["variant"] for r in records):
    for mode in dict.fromkeys(r["mode"] for r in records):
      cells = sorted((r for r in records if r["variant"] == variant and r["mode"] == mode),
                     key=lambda r: r["seq_len"])
      if not cells:
        continue
      lengths = [r["seq_len"] for r in cells]
      ms = [r.get("ms") if r.get("error") is None else None for r in cells]
      mem = [peak_bytes(r) if r.get("error") is None else None for r in cells]

      def ratio(r, value, of):
        d = dense.get((r["seq_len"], mode))
        return of(d) / value if d is not None and value else None

      rows.append({
          "variant": variant, "mode": mode, "lengths": lengths, "ms": ms, "peak_bytes": mem,
          "speedup_vs_dense": [ratio(r, v, lambda d: d["ms"]) for r, v in zip(cells, ms)],
          "memory_ratio_vs_dense": [ratio(r, v, peak_bytes) for r, v in zip(cells, mem)],
          "time_slope": log_log_slope(lengths, ms),
          "memory_slope": log_log_slope(lengths, mem),
          "errors": {r["seq_len"]: r["error"] for r in cells if r.get("error")},
          "subquadratic": registry.get_variant(variant).subquadratic,
      })
  return rows


def format_table(rows: list[dict[str, Any]]) -> str:
  """Per (variant, mode): ms / MB at each T with the speed-up over dense, and the slopes."""
  lengths = sorted({t for row in rows for t in row["lengths"]})
  header = f"{'variant':<24} {'mode':>8} " + " ".join(f"{'T=' + str(t):>22}" for t in lengths)
  header += f" {'slope t':>8} {'slope mem':>9}"
  lines = [header, "-" * len(header)]
  fmt_slope = lambda s: f"{s:.2f}" if s is not None else "-"
  for row in rows:
    by_len = {t: i for i, t in enumerate(row["lengths"])}
    cells = []
    for t in lengths:
      i = by_len.get(t)
      if i is None or row["ms"][i] is None:
        cells.append(f"{'failed' if i is not None else '':>22}")
        continue
      mem = row["peak_bytes"][i]
      speedup = row["speedup_vs_dense"][i]
      text = (f"{row['ms'][i]:.0f}ms/{(mem or 0) / MB:.0f}MB"
              f"{f' {speedup:.1f}x' if speedup else ''}")
      cells.append(f"{text:>22}")
    lines.append(f"{row['variant']:<24} {row['mode']:>8} " + " ".join(cells) +
                 f" {fmt_slope(row['time_slope']):>8} {fmt_slope(row['memory_slope']):>9}")
  return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: pathlib.Path) -> None:
  """Time and peak memory against T on log-log axes, one line per variant, per mode."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

  modes = list(dict.fromkeys(row["mode"] for row in rows))
  fig, axes = plt.subplots(len(modes), 2, figsize=(13, 4.5 * len(modes)), squeeze=False)
  for mode_axes, mode in zip(axes, modes):
    for row in (r for r in rows if r["mode"] == mode):
      style = dict(marker="o", markersize=3, linewidth=2.5 if row["variant"] == DENSE else 1,
                   color="black" if row["variant"] == DENSE else None, label=row["variant"])
      for ax, values, scale in ((mode_axes[0], row["ms"], 1.0),
                                (mode_axes[1], row["peak_bytes"], 1 / MB)):
        points = [(t, v * scale) for t, v in zip(row["lengths"], values) if v]
        if points:
          ax.plot(*zip(*points), **style)
    for ax, what in zip(mode_axes, ("time (ms)", "peak memory (MB)")):
      ax.set(xscale="log", yscale="log", xlabel="sequence length T", ylabel=what,
             title=f"{what.split(' (')[0]}, {mode}")
      ax.grid(True, which="both", alpha=0.3)
  axes[0][1].legend(fontsize=7, ncol=2, loc="upper left")
  fig.tight_layout()
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=110)
  plt.close(fig)


def benchmark(args: cli.Args) -> dict[str, Any]:
  """Runs the sweep, prints the table, writes the JSON and the plot and returns the payload."""
  if args.cell is not None:  # Child process: one cell, its record on stdout.
    print(json.dumps(measure_cell(json.loads(args.cell), "process")), flush=True)
    return {}

  backend = jax.default_backend()
  variants = selected_variants(args.variants, backend)
  start = time.perf_counter()
  records = run_cells(list(make_cells(args, variants)), args, backend)
  rows = summarize(records)
  print(format_table(rows))

  out = pathlib.Path(args.out or REPO_ROOT / "benchmarks" / f"scaling_{backend}.json")
  arguments = {k: v for k, v in vars(args).items() if k != "cell"}
  arguments.update(variants=variants, out=str(out))
  payload = {
      "environment": common.environment(),
      "arguments": arguments,
      "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(),
      "wall_time_s": time.perf_counter() - start,
      "summary": rows,
      "records": records,
  }
  common.write_json(out, payload)
  plot(rows, out.with_suffix(".png"))
  print(f"wrote {len(records)} records to {out} and the plot to {out.with_suffix('.png')} in "
        f"{payload['wall_time_s']:.0f} s")
  return payload


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  """This script from Python: `argv` and errors as in `cli.parse`."""
  return benchmark(parse_args(argv))


if __name__ == "__main__":
  cli.run(define_flags, benchmark)
