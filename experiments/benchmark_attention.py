r"""Benchmark `attention_jax.dot_product_attention` against the peers on this backend.

Every implementation that `attention_jax.available_implementations()` lists for
the current backend is measured next to every peer available there, in the same
run and on the same inputs, for each sequence length, head dim, causal setting
and mode. The peers:

* ``jax.nn:xla``: `jax.nn.dot_product_attention(implementation="xla")`, everywhere;
* ``jax.nn:cudnn``: its cuDNN fused kernel (GPU);
* ``jax.pallas:gpu``: JAX's own Pallas attention, `jax.experimental.pallas.ops.gpu.attention.mha` (GPU);
* ``jax.pallas:mgpu``: JAX's own Mosaic GPU attention, `...ops.gpu.attention_mgpu` (Hopper GPUs);
* ``jax.pallas:tpu``: JAX's own Pallas flash attention, `...ops.tpu.flash_attention` (TPU).

Each record carries its ratio to every peer of the same shape and to the best
(fastest) one, and the table prints the latter. The modes:

* ``fwd``: the attention output;
* ``fwd_bwd``: the gradient of ``sum(out)`` with respect to ``q``, ``k`` and ``v``.

Each cell is jit-compiled first (not timed), run once to warm up, then timed as
the median wall time of ``--repeats`` runs with `jax.block_until_ready`.

Peak memory. On CPU every cell runs in a fresh child process (the script calls
itself with an internal ``--cell`` flag), so the process high-water mark
belongs to that cell alone; the figure reported is the peak RSS minus the RSS
just before the computation (inputs and executable already resident). On
GPU/TPU cells run in-process and the device's ``peak_bytes_in_use`` is used; it
cannot be reset, so a cell that does not raise it gets an upper bound only
(marked '~' in the table, like any other inexact figure).
XLA's compiled memory analysis is recorded on every backend as well; on CPU a
cell whose compiled program needs more memory than the machine has is recorded
as failed with that figure instead of being run into swap or the OOM killer.

This is a benchmark, not a test: it asserts nothing about speed.

Usage::

  python -m experiments.benchmark_attention
  python -m experiments.benchmark_attention --lengths=1024,4096 --dtype=bfloat16 \
      --causal=true --modes=fwd_bwd --repeats=20
  # The blockwise implementation where dense attention cannot run at all:
  python -m experiments.benchmark_attention --lengths=65536 --modes=fwd_bwd \
      --causal=false --impls=attention_jax:blockwise,attention_jax:xla --repeats=1
"""

from __future__ import annotations

import datetime
import functools
import json
import math
import os
import pathlib
import resource
import statistics
import subprocess
import sys
import time
from typing import Any, Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
from absl import flags

import attention_jax
from experiments import cli

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
PEER = "jax.nn:xla"  # The peer present on every backend.
# label -> backends it runs on (None: every backend); the order is the table's.
PEERS = {
    PEER: None,
    "jax.nn:cudnn": ("gpu",),  # cuDNN's fused attention exists for NVIDIA GPUs only.
    "jax.pallas:gpu": ("gpu",),
    "jax.pallas:mgpu": ("gpu",),  # Hopper or newer only (see available_peers).
    "jax.pallas:tpu": ("tpu",),
}
MODES = ("fwd", "fwd_bwd")
MB = 1024 * 1024

# ---------------------------------------------------------------------------
# Command line.
# ---------------------------------------------------------------------------


def define_sweep_flags(flag_values: flags.FlagValues, cell_timeout: float) -> None:
  """The flags of a sweep of cells, this script's and `benchmark_scaling`'s."""
  flags.DEFINE_integer("batch", 1, "batch size", lower_bound=1, flag_values=flag_values)
  flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "inputs' dtype",
                    flag_values=flag_values)
  cli.DEFINE_list_of(flags.EnumParser(MODES), "modes", list(MODES), "modes to sweep",
                     flag_values)
  flags.DEFINE_integer("repeats", 3, "timed runs per cell", lower_bound=1,
                       flag_values=flag_values)
  flags.DEFINE_float("cell_timeout", cell_timeout, "seconds before a CPU child process is "
                     "abandoned", flag_values=flag_values)
  flags.DEFINE_string("cell", None, "internal: run the one cell this JSON describes and print "
                      "its record (the child process of a CPU sweep)", flag_values=flag_values)


def define_flags(flag_values: flags.FlagValues, argv: Sequence[str]) -> None:
  """This script's flags (see `experiments.cli`); the defaults finish in a few
  minutes on 2 CPU cores."""
  del argv  # only config flags read it
  define_sweep_flags(flag_values, cell_timeout=900.0)
  positive = flags.IntegerParser(lower_bound=1)
  cli.DEFINE_list_of(positive, "lengths", None, "sequence lengths T (queries and keys alike); "
                     "default 512..4096 on CPU, 1024..16384 on accelerators", flag_values)
  flags.DEFINE_integer("heads", 8, "attention heads", lower_bound=1, flag_values=flag_values)
  cli.DEFINE_list_of(positive, "head_dims", None, "head dims D; default 64 on CPU, 64 and 128 "
                     "on accelerators", flag_values)
  flags.DEFINE_enum("causal", "both", ["both", "true", "false"], "causal settings to sweep",
                    flag_values=flag_values)
  flags.DEFINE_list("impls", None, "labels to run, e.g. attention_jax:xla,jax.nn:cudnn "
                    "(default: all available; the available peers are always added)",
                    flag_values=flag_values)
  flags.DEFINE_string("out", None, "JSON output (default: benchmarks/attention_<backend>.json)",
                      flag_values=flag_values)


def fill_defaults(args: cli.Args) -> cli.Args:
  """Sets the lengths and head dims left out to this backend's defaults."""
  accelerator = jax.default_backend() != "cpu"
  if args.lengths is None:
    args.lengths = [1024, 2048, 4096, 8192, 16384] if accelerator else [512, 1024, 2048, 4096]
  if args.head_dims is None:
    args.head_dims = [64, 128] if accelerator else [64]
  return args


def causal_settings(choice: str) -> list[bool]:
  """Maps the --causal choice to the settings to sweep."""
  return {"both": [False, True], "true": [True], "false": [False]}[choice]


# ---------------------------------------------------------------------------
# Implementations.
# ---------------------------------------------------------------------------


# Implementations over a device mesh, which this one-device benchmark does not
# build: ring attention has its own (experiments.benchmark_ring).
MESH_IMPLEMENTATIONS = ("ring",)


def attention_jax_implementations() -> tuple[str, ...]:
  """Names `attention_jax.dot_product_attention` accepts on this backend (one device)."""
  if not hasattr(attention_jax, "dot_product_attention"):
    return ()
  names = getattr(attention_jax, "available_implementations", lambda: ("xla",))()
  return tuple(name for name in names if name not in MESH_IMPLEMENTATIONS)


def available_peers(backend: str | None = None) -> list[str]:
  """The peer labels that run on `backend`."""
  backend = backend or jax.default_backend()
  peers = [label for label, backends in PEERS.items() if backends is None or backend in backends]
  if "jax.pallas:mgpu" in peers and not _is_hopper_or_newer():
    peers.remove("jax.pallas:mgpu")
  return peers


def _is_hopper_or_newer() -> bool:
  from attention_jax.kernels.flash_attention import pallas_mgpu  # pylint: disable=import-outside-toplevel
  return pallas_mgpu.is_hopper_or_newer()


def available_labels(backend: str | None = None) -> list[str]:
  """All implementation labels that can be benchmarked on `backend`, peers last."""
  labels = [f"attention_jax:{name}" for name in attention_jax_implementations()]
  return labels + available_peers(backend)


def select_labels(requested: list[str] | None, backend: str) -> list[str]:
  """Validates --impls against what is available and makes sure the peers are in."""
  available = available_labels(backend)
  if requested is None:
    return available
  unknown = [label for label in requested if label not in available]
  if unknown:
    raise SystemExit(f"unavailable implementation(s) {unknown}; choose from {available}")
  # Ratios are defined against the peers, so they are always measured.
  return list(dict.fromkeys(requested + available_peers(backend)))


def _jax_pallas_gpu(q, k, v, is_causal):
  """JAX's Triton flash attention; same layout [B, T, H, D], scale passed explicitly."""
  from jax.experimental.pallas.ops.gpu import attention  # pylint: disable=import-outside-toplevel
  return attention.mha(q, k, v, None, sm_scale=q.shape[-1] ** -0.5, causal=is_causal)


def _jax_pallas_mgpu(q, k, v, is_causal):
  """JAX's Mosaic GPU (Hopper) flash attention: float16, D and T multiples of 64/128.

  jax 0.11's kernel takes float16 only; bfloat16 inputs are cast (the tensor
  cores run both at one rate; the casts are elementwise passes over q, k, v and
  the output, timed with the kernel).
  """
  from jax.experimental.pallas.ops.gpu import attention_mgpu  # pylint: disable=import-outside-toplevel
  # The backward blocks are required for its gradient (jax 0.11: "Need to specify
  # backward blocks"); 64 everywhere as in JAX's own tests. It has no causal backward.
  config = attention_mgpu.TuningConfig(block_q=64, block_kv=128 if q.shape[-1] <= 128 else 64,
                                       max_concurrent_steps=2, causal=is_causal,
                                       block_q_dkv=64, block_kv_dkv=64, block_q_dq=64,
                                       block_kv_dq=64)
  # The kernel's own scale is fixed at 1; pre-scaling q gives the usual 1/sqrt(D).
  q = q * jnp.asarray(q.shape[-1] ** -0.5, q.dtype)
  half = lambda x: x.astype(jnp.float16)
  return attention_mgpu.attention(half(q), half(k), half(v), config).astype(q.dtype)


def _jax_pallas_tpu(q, k, v, is_causal):
  """JAX's Mosaic TPU flash attention, which takes the layout [B, H, T, D]."""
  from jax.experimental.pallas.ops.tpu import flash_attention  # pylint: disable=import-outside-toplevel
  to_heads_first = lambda x: x.transpose(0, 2, 1, 3)
  out = flash_attention.flash_attention(*map(to_heads_first, (q, k, v)), causal=is_causal,
                                        sm_scale=q.shape[-1] ** -0.5)
  return to_heads_first(out)


def attention_function(label: str) -> Callable[..., jax.Array]:
  """Returns `f(q, k, v, is_causal)` for a label such as "attention_jax:xla"."""
  library, implementation = label.split(":", 1)
  if library == "jax.pallas":
    return {"gpu": _jax_pallas_gpu, "mgpu": _jax_pallas_mgpu,
            "tpu": _jax_pallas_tpu}[implementation]
  attend = {
      "attention_jax": lambda: attention_jax.dot_product_attention,
      "jax.nn": lambda: jax.nn.dot_product_attention,
  }[library]()
  return functools.partial(attend, implementation=implementation)


# ---------------------------------------------------------------------------
# One cell: inputs, the function to time, the measurements.
# ---------------------------------------------------------------------------


def make_inputs(cell: dict[str, Any]) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Random normal q, k, v of layout [B, T, H, D] from a fixed key.

  Every cell builds them from the same key, so all implementations see
  identical inputs even when they run in different processes. The key uses the
  "rbg" generator: it is deterministic on a given backend and compiles in about
  half the time of the default threefry, which each CPU child process pays.
  """
  shape = (cell["batch"], cell["seq_len"], cell["heads"], cell["head_dim"])
  keys = jax.random.split(jax.random.key(0, impl="rbg"), 3)
  return tuple(jax.random.normal(k, shape, dtype=cell["dtype"]) for k in keys)


def make_step(label: str, mode: str, causal: bool) -> Callable[..., Any]:
  """The jitted computation for one cell: the forward pass, or grads of sum(out)."""
  attend = attention_function(label)

  def forward(q, k, v):
    return attend(q, k, v, is_causal=causal)

  if mode == "fwd":
    return jax.jit(forward)

  def loss(q, k, v):
    # Sum in float32 so the bfloat16 runs do not lose the loss to rounding.
    return forward(q, k, v).astype(jnp.float32).sum()

  return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def attention_flops(cell: dict[str, Any]) -> float:
  """Matmul FLOPs: 4*B*H*T*T*D forward, 2.5x that for the backward, halved if causal."""
  b, t, h, d = cell["batch"], cell["seq_len"], cell["heads"], cell["head_dim"]
  flops = 4.0 * b * h * t * t * d
  if cell["mode"] == "fwd_bwd":
    flops *= 3.5
  if cell["causal"]:
    flops /= 2
  return flops


def compiled_memory(compiled: Any) -> dict[str, int] | None:
  """XLA's static memory analysis of an executable; None where unsupported."""
  try:
    stats = compiled.memory_analysis()
  except Exception:  # pylint: disable=broad-except
    return None
  if stats is None:
    return None
  fields = ("temp_size_in_bytes", "argument_size_in_bytes", "output_size_in_bytes",
            "alias_size_in_bytes", "generated_code_size_in_bytes")
  return {f: int(getattr(stats, f)) for f in fields if hasattr(stats, f)}


def time_runs(compiled: Any, inputs: tuple[jax.Array, ...], repeats: int) -> list[float]:
  """Milliseconds of `repeats` runs, after one untimed warm-up run."""
  jax.block_until_ready(compiled(*inputs))  # The first call pays one-off runtime setup.
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(compiled(*inputs))
    times.append((time.perf_counter() - start) * 1e3)
  return times


# ---------------------------------------------------------------------------
# Memory probes.
# ---------------------------------------------------------------------------


def _proc_status_bytes(field: str) -> int | None:
  """A `kB` field of /proc/self/status in bytes (Linux only), else None."""
  try:
    with open("/proc/self/status") as status:
      for line in status:
        if line.startswith(field + ":"):
          return int(line.split()[1]) * 1024
  except OSError:
    pass
  return None


def current_rss() -> int | None:
  """Resident set size of this process now."""
  return _proc_status_bytes("VmRSS")


def reset_peak_rss() -> bool:
  """Resets the RSS high-water mark to the current RSS (Linux >= 4.0).

  Without this the peak would include compilation, which can exceed the run.
  """
  try:
    with open("/proc/self/clear_refs", "w") as clear_refs:
      clear_refs.write("5")
    return True
  except OSError:
    return False


def peak_rss() -> int:
  """This process's RSS high-water mark.

  VmHWM is preferred over `ru_maxrss` because on Linux a child's `ru_maxrss`
  starts at its parent's high-water mark (it is carried across exec), which
  would charge the parent's memory to the cell.
  """
  hwm = _proc_status_bytes("VmHWM")
  if hwm is not None:
    return hwm
  maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
  return maxrss if sys.platform == "darwin" else maxrss * 1024  # bytes vs kB


def device_memory(device: jax.Device) -> dict[str, int]:
  """The allocator's statistics for `device`; empty where the backend has none."""
  try:
    return device.memory_stats() or {}
  except Exception:  # pylint: disable=broad-except
    return {}


class PeakMemory:
  """Context manager measuring the peak memory of the code inside it.

  `process` mode (CPU, one cell per process): peak RSS minus the RSS at entry.
  `device` mode (accelerators): the allocator's peak minus bytes in use at
  entry; exact only if the cell raised the process-wide peak, otherwise an
  upper bound. `exact` is False for those bounds, and in `process` mode where
  the high-water mark could not be reset (then compilation may dominate it).
  """

  def __init__(self, method: str):
    self.method = method
    self.result: dict[str, Any] = {"method": method}

  def __enter__(self) -> "PeakMemory":
    if self.method == "process":
      self.result["baseline_bytes"] = current_rss()
      self.result["peak_reset"] = reset_peak_rss()
      if self.result["baseline_bytes"] is None:  # No /proc: the mark is all we have.
        self.result["baseline_bytes"] = peak_rss()
    else:
      stats = device_memory(jax.devices()[0])
      self.result["baseline_bytes"] = stats.get("bytes_in_use")
      self._peak_before = stats.get("peak_bytes_in_use")
    return self

  def __exit__(self, *exc_info) -> None:
    if self.method == "process":
      peak, exact = peak_rss(), self.result["peak_reset"]
    else:
      peak = device_memory(jax.devices()[0]).get("peak_bytes_in_use")
      exact = peak is not None and self._peak_before is not None and peak > self._peak_before
    baseline = self.result["baseline_bytes"]
    self.result["peak_bytes"] = peak
    self.result["peak_delta_bytes"] = (
        max(peak - baseline, 0) if peak is not None and baseline is not None else None)
    self.result["exact"] = bool(exact)


# ---------------------------------------------------------------------------
# Running cells.
# ---------------------------------------------------------------------------


def make_cells(args: cli.Args, labels: list[str]) -> Iterator[dict[str, Any]]:
  """One JSON-serialisable description per (length, head dim, causal, mode, impl)."""
  for seq_len in args.lengths:
    for head_dim in args.head_dims:
      for causal in causal_settings(args.causal):
        for mode in args.modes:
          for label in labels:
            yield {
                "impl": label, "seq_len": seq_len, "causal": causal, "mode": mode,
                "batch": args.batch, "heads": args.heads, "head_dim": head_dim,
                "dtype": args.dtype, "repeats": args.repeats,
            }


def physical_memory_bytes() -> int | None:
  """Total RAM of this machine, where the OS tells."""
  try:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  except (ValueError, OSError, AttributeError):
    return None


def check_fits_in_memory(memory: dict[str, int] | None, memory_method: str) -> None:
  """On CPU, refuses to run a program that XLA says needs more than all the RAM.

  Such a run would only thrash or be killed; the figure itself is the result.
  """
  total = physical_memory_bytes()
  if memory_method != "process" or not memory or total is None:
    return
  needed = sum(memory.get(f, 0) for f in ("temp_size_in_bytes", "argument_size_in_bytes",
                                          "output_size_in_bytes"))
  if needed > total:
    raise MemoryError(f"XLA's memory analysis says the program needs {needed / 2**30:.1f} GiB, "
                      f"more than this machine's {total / 2**30:.1f} GiB")


def measure_cell(cell: dict[str, Any], memory_method: str) -> dict[str, Any]:
  """Compiles, times and measures one cell in this process; errors are recorded."""
  record = dict(cell, flops=attention_flops(cell), memory={"method": memory_method},
                error=None)
  try:
    inputs = jax.block_until_ready(make_inputs(cell))
    step = make_step(cell["impl"], cell["mode"], cell["causal"])
    start = time.perf_counter()
    compiled = step.lower(*inputs).compile()
    record["compile_s"] = time.perf_counter() - start
    record["memory"]["compiled"] = compiled_memory(compiled)
    check_fits_in_memory(record["memory"]["compiled"], memory_method)
    with PeakMemory(memory_method) as memory:
      times = time_runs(compiled, inputs, cell["repeats"])
    record["memory"] = dict(memory.result, compiled=record["memory"]["compiled"])
    record["times_ms"] = times
    record["ms"] = statistics.median(times)
    record["gflop_per_s"] = record["flops"] / (record["ms"] * 1e-3) / 1e9
  except Exception as e:  # pylint: disable=broad-except
    # OOMs and unsupported configurations (e.g. cuDNN rejecting float32) are
    # results too: note them and let the sweep go on.
    record["error"] = f"{type(e).__name__}: {e}"[:2000]
  return record


def measure_in_child(cell: dict[str, Any], timeout: float,
                     module: str = "experiments.benchmark_attention",
                     failed: dict[str, Any] | None = None) -> dict[str, Any]:
  """Runs one cell in a fresh Python process so that its peak RSS is its own.

  The child is `python -m <module> --cell=<json>`, which prints the record as
  its last JSON line; `failed` is the record to complete when the child dies.
  """
  command = [sys.executable, "-m", module, f"--cell={json.dumps(cell)}"]
  if failed is None:
    failed = dict(cell, flops=attention_flops(cell), memory={"method": "process"})
  try:
    child = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True,
                           timeout=timeout, check=False)
  except subprocess.TimeoutExpired:
    return dict(failed, error=f"timed out after {timeout:.0f} s")
  # The record is the last JSON line; anything else on stdout is library chatter.
  for line in reversed(child.stdout.splitlines()):
    if line.startswith("{"):
      return json.loads(line)
  if child.returncode < 0:
    reason = f"killed by signal {-child.returncode} (out of memory?)"
  else:
    reason = f"exit status {child.returncode}: {child.stderr.strip()[-1000:]}"
  return dict(failed, error=f"child process failed, {reason}")


def run_cells(cells: list[dict[str, Any]], args: cli.Args,
              backend: str) -> list[dict[str, Any]]:
  """Measures every cell, isolating each in its own process on CPU."""
  records = []
  for i, cell in enumerate(cells, 1):
    if backend == "cpu":
      record = measure_in_child(cell, args.cell_timeout)
    else:
      # Accelerators stay in-process: a TPU can be held by one process only,
      # and a child per cell would re-initialise the runtime every time.
      record = measure_cell(cell, "device")
      jax.clear_caches()  # Drop this cell's executables before the next one.
    records.append(record)
    outcome = f"{record['ms']:.2f} ms" if record.get("error") is None else "FAILED"
    print(f"[{i}/{len(cells)}] {cell['impl']} T={cell['seq_len']} D={cell['head_dim']} "
          f"causal={cell['causal']} {cell['mode']}: {outcome}", flush=True)
  return records


def add_speedups(records: list[dict[str, Any]]) -> None:
  """Adds each record's speed-up over every peer of the same shape, and the best peer.

  `speedup_vs[peer]` = peer_ms / impl_ms; `best_peer` is the fastest peer that
  ran on that shape and `speedup_vs_best_peer` the ratio to it (above 1: faster).
  """
  def shape_key(r):
    return (r["seq_len"], r["head_dim"], r["causal"], r["mode"])

  peer_ms: dict[tuple, dict[str, float]] = {}
  for r in records:
    if r["impl"] in PEERS and r.get("error") is None:
      peer_ms.setdefault(shape_key(r), {})[r["impl"]] = r["ms"]
  for record in records:
    peers = peer_ms.get(shape_key(record), {})
    ran = record.get("error") is None
    record["speedup_vs"] = {p: ms / record["ms"] for p, ms in peers.items()} if ran else {}
    record["best_peer"] = min(peers, key=peers.get) if peers else None
    record["speedup_vs_best_peer"] = (
        record["speedup_vs"][record["best_peer"]] if ran and peers else None)


# ---------------------------------------------------------------------------
# Reporting.
# ---------------------------------------------------------------------------


def peak_mb_text(memory: dict[str, Any]) -> str:
  """The measured peak in MB; '~' marks an inexact figure, '-' a missing one."""
  delta = memory.get("peak_delta_bytes")
  if delta is None:
    return "-"
  return ("" if memory.get("exact") else "~") + f"{delta / MB:.1f}"


def format_table(records: list[dict[str, Any]], backend: str) -> str:
  """A fixed-width table of all records, one line each."""
  # TFLOP/s reads better on accelerators, GFLOP/s on CPU.
  unit, scale = ("GFLOP/s", 1.0) if backend == "cpu" else ("TFLOP/s", 1e-3)
  header = (f"{'impl':<24} {'T':>6} {'D':>4} {'causal':>6} {'mode':>8} {'ms':>10} "
            f"{unit:>9} {'peak MB':>9} {'vs best peer':>13}  best peer")
  lines = [header, "-" * len(header)]
  for r in records:
    prefix = (f"{r['impl']:<24} {r['seq_len']:>6} {r['head_dim']:>4} {str(r['causal']):>6} "
              f"{r['mode']:>8} ")
    if r.get("error") is not None:
      lines.append(prefix + f"{'failed:':>10} {r['error'].splitlines()[0][:80]}")
      continue
    speedup = r["speedup_vs_best_peer"]
    lines.append(prefix + f"{r['ms']:>10.2f} {r['gflop_per_s'] * scale:>9.2f} "
                 f"{peak_mb_text(r['memory']):>9} "
                 f"{(f'{speedup:.2f}x' if speedup is not None else '-'):>13}  "
                 f"{r['best_peer'] or '-'}")
  return "\n".join(lines)


def environment() -> dict[str, Any]:
  """What the numbers were measured on, and with which commit."""
  from attention_jax.train.provenance import git_revision, host_cpu  # pylint: disable=import-outside-toplevel
  device = jax.devices()[0]
  cpu_model, cpu_isa = host_cpu()
  return {
      "git_revision": git_revision(),
      "backend": jax.default_backend(),
      "device_kind": device.device_kind,
      "device_count": jax.device_count(),
      "jax_version": jax.__version__,
      "attention_jax_version": getattr(attention_jax, "__version__", None),
      "python": sys.version.split()[0],
      "cpu_count": os.cpu_count(),
      "cpu_model": cpu_model,
      "cpu_isa": list(cpu_isa),
  }


def write_records(path: pathlib.Path, script: str, settings: dict[str, Any],
                  records: list[dict[str, Any]]) -> None:
  """A benchmark script's JSON: where it ran (git revision, devices), the command
  line that made it (`python -m <script> ...`), its settings and its records."""
  from attention_jax.train.provenance import device_summary, git_revision  # pylint: disable=import-outside-toplevel
  write_json(path, dict(git_revision=git_revision(), devices=device_summary(),
                        command=" ".join([f"python -m {script}"] + sys.argv[1:]),
                        settings=settings, records=records))


def write_json(path: pathlib.Path, payload: dict[str, Any]) -> None:
  """Writes `payload`, creating the folder; non-finite floats become null."""
  def finite(x):
    if isinstance(x, float) and not math.isfinite(x):
      return None
    if isinstance(x, dict):
      return {k: finite(v) for k, v in x.items()}
    if isinstance(x, list):
      return [finite(v) for v in x]
    return x

  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(finite(payload), indent=2) + "\n")


def benchmark(args: cli.Args) -> dict[str, Any]:
  """Runs the sweep, prints the table, writes the JSON and returns its payload."""
  if args.cell is not None:  # Child process: one cell, its record on stdout.
    print(json.dumps(measure_cell(json.loads(args.cell), "process")), flush=True)
    return {}

  fill_defaults(args)
  backend = jax.default_backend()
  labels = select_labels(args.impls, backend)
  cells = list(make_cells(args, labels))
  start = time.perf_counter()
  records = run_cells(cells, args, backend)
  add_speedups(records)
  print(format_table(records, backend))

  out = pathlib.Path(args.out or REPO_ROOT / "benchmarks" / f"attention_{backend}.json")
  arguments = {k: v for k, v in vars(args).items() if k != "cell"}
  arguments.update(impls=labels, out=str(out))
  payload = {
      "environment": environment(),
      "arguments": arguments,
      "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(),
      "wall_time_s": time.perf_counter() - start,
      "peers": available_peers(backend),
      "records": records,
  }
  write_json(out, payload)
  print(f"wrote {len(records)} records to {out} in {payload['wall_time_s']:.0f} s")
  return payload


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  """This script from Python: `argv` and errors as in `cli.parse`."""
  return benchmark(cli.parse(define_flags, argv, __name__))


if __name__ == "__main__":
  cli.run(define_flags, benchmark)
