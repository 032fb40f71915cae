r"""The chunkwise recurrent mixers against exact attention and their own scan, by length.

At each sequence length T (default 1K..64K) and for each chunkwise mixer
(`attention_jax.variants.chunkwise`, family "chunkwise" in the registry), the
pure recurrence of `engine`

    S_t = (diag(exp(g_t)) + w_t r_t^T) S_{t-1} + k_t v_t^T,      o_t = S_t^T q_t,

is timed and its peak memory measured, forward (``fwd``: the outputs) and
forward+backward (``fwd_bwd``: the gradients of sum(outputs) in q, k and v),
in three forms on the same q, k, v (B = `--batch`, `--heads` heads, Dk =
`--key_dim`, Dv = `--value_dim`):

* ``chunkwise``: `engine.chunkwise_form` in chunks of `--chunk_size`, or with
  `--chunkwise_implementation=pallas_gpu` (``pallas_tpu``) the Pallas chunk
  kernels (`attention_jax.kernels.chunkwise.chunkwise_kernel`), in chunks of
  `--chunk_size` or, without it, the kernel's default (64 tokens with a decay
  per head, 16 with one per key dimension);
* ``recurrent``: `engine.recurrent_form`, one `lax.scan` step per token
  (skipped above `--max_recurrent_length`: it is slow);
* ``exact_attention``: causal softmax attention,
  `attention_jax.dot_product_attention(implementation="blockwise",
  is_causal=True)`: the portable flash attention, which never builds the
  T x T logits in either pass (skipped above `--max_exact_length` if given);
  `--exact_implementation=pallas` times our Triton kernel instead (on a GPU).
  Its cell does not depend on the mixer and is measured once per T and mode.

Each mixer gets the engine inputs of its kind (`MIXERS`, `engine_arguments`:
per-dimension or per-head decay, the delta rule's or RWKV-7's rank-one
transition), not its layer: the projections around the recurrence are the
same dense matmuls whatever the mixer. A skipped cell is recorded with its
reason, a failed one with its error.

Each cell is jit-compiled (not timed), run once to warm up, then timed as the
median of `--repeats` runs (`benchmark_attention.time_runs`). On CPU each cell
runs in its own process (`--isolate`, the default), so that its peak RSS is
its own (`benchmark_attention.PeakMemory`); on an accelerator the device's
peak bytes are used.

The summary has, per mixer and mode: the milliseconds and peak bytes of each
form at each T, the speed-ups of the chunkwise form over exact attention and
over the scan (ratios measured in this run), the crossover length (the first
T from which the chunkwise form is faster than exact attention at every
longer T where both ran; null if it is not faster at the last one), and the
slopes of log(time) and log(peak memory) against log(T): the chunkwise
form's memory slope should be about 1 (linear), exact attention's time slope
about 2. This is a benchmark, not a test: it asserts nothing.

Usage::

  python -m experiments.benchmark_chunkwise
  python -m experiments.benchmark_chunkwise --mixers=gla,delta_net --lengths=1024,4096 \
      --modes=fwd_bwd --repeats=1
"""

from __future__ import annotations

import datetime
import functools
import json
import pathlib
import sys
import time
from typing import Any, Callable, Dict, Iterator, List, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
from absl import flags

import attention_jax
from attention_jax import registry
from attention_jax.kernels.chunkwise import chunkwise_kernel
from attention_jax.variants.chunkwise import delta_net, engine, parts
from experiments import benchmark_attention as common
from experiments import cli
from experiments import benchmark_scaling
from experiments.benchmark_scaling import log_log_slope

REPO_ROOT = common.REPO_ROOT
MB = common.MB
EXACT = "exact_attention"  # the `mixer` of the exact attention cells
FORMS = ("chunkwise", "recurrent", EXACT)
# The chunkwise form's implementations: the engine, or the kernels' backend.
CHUNKWISE_IMPLEMENTATIONS = {"engine": None, "pallas_gpu": "gpu", "pallas_tpu": "tpu"}
EXACT_ATTENTION = dict(function="attention_jax.dot_product_attention", implementation="blockwise",
                       is_causal=True, note="the pure-JAX flash attention: online softmax over "
                       "key blocks, O(T) memory in both passes, never a T x T array")


class Kind(NamedTuple):
  """What a mixer's recurrence is made of.

  decay: "dimension" (log decay `[B, T, H, Dk]`), "head" (`[B, T, H]`, data
    dependent), "fixed" (`[B, T, H]`, one constant per head) or None (no decay).
  rule: None (gated linear attention), "delta" (r = k, w = -alpha beta k, key
    beta k, k normalised) or "rwkv7" (r = kappa, w = -a kappa, kappa = k normalised).
  """

  decay: Optional[str]
  rule: Optional[str]


MIXERS = {
    "gla": Kind("dimension", None),
    "retention": Kind("fixed", None),
    "mamba2": Kind("head", None),
    "delta_net": Kind(None, "delta"),
    "gated_delta_net": Kind("head", "delta"),
    "rwkv7": Kind("dimension", "rwkv7"),
}


def registered_mixers() -> List[str]:
  """The registered chunkwise mixers that `MIXERS` describes, in its order."""
  chunkwise = {name for name in registry.list_variants("mixer")
               if registry.get_variant(name).family == "chunkwise"}
  missing = sorted(chunkwise - set(MIXERS))
  if missing:  # a new mixer needs a row in MIXERS before it can be measured
    print(f"warning: chunkwise mixers without a row in MIXERS, not measured: {missing}",
          file=sys.stderr)
  return [name for name in MIXERS if name in chunkwise]


def define_flags(flag_values: flags.FlagValues, argv: Sequence[str]) -> None:
  """This script's flags (see `experiments.cli`)."""
  del argv
  common.define_sweep_flags(flag_values, cell_timeout=3600.0)
  positive = flags.IntegerParser(lower_bound=1)
  cli.DEFINE_list_of(positive, "lengths", [1024, 2048, 4096, 8192, 16384, 32768, 65536],
                     "sequence lengths T", flag_values)
  cli.DEFINE_list_of(flags.EnumParser(list(MIXERS)), "mixers", None,
                     "chunkwise mixers (default: those of MIXERS that are registered)",
                     flag_values)
  flags.DEFINE_integer("heads", 4, "heads H", lower_bound=1, flag_values=flag_values)
  flags.DEFINE_integer("key_dim", 64, "key (and query) dim Dk", lower_bound=1,
                       flag_values=flag_values)
  flags.DEFINE_integer("value_dim", 64, "value dim Dv", lower_bound=1, flag_values=flag_values)
  flags.DEFINE_integer("chunk_size", None, "C, tokens per chunk of the chunkwise form "
                       f"(default: {engine.DEFAULT_CHUNK_SIZE} for the engine, the kernel's own "
                       "for a kernel)", lower_bound=1, flag_values=flag_values)
  flags.DEFINE_enum("chunkwise_implementation", "engine", list(CHUNKWISE_IMPLEMENTATIONS),
                    "the chunkwise form: the pure-JAX engine or the Pallas chunk kernels",
                    flag_values=flag_values)
  flags.DEFINE_enum("exact_implementation", EXACT_ATTENTION["implementation"],
                    ["blockwise", "pallas", "pallas_mgpu", "cudnn", "xla"],
                    "dot_product_attention's implementation for the exact cells",
                    flag_values=flag_values)
  flags.DEFINE_integer("max_recurrent_length", 16384, "skip the recurrent scan above this T",
                       lower_bound=1, flag_values=flag_values)
  flags.DEFINE_integer("max_exact_length", None, "skip exact attention above this T (default: "
                       "never)", lower_bound=1, flag_values=flag_values)
  flags.DEFINE_boolean("isolate", True, "on CPU, run each cell in its own process so that its "
                       "peak RSS is its own (--noisolate: in this process, faster but the "
                       "memory figures are only indicative)", flag_values=flag_values)
  flags.DEFINE_string("out", None, "JSON output (default: benchmarks/chunkwise_<backend>.json)",
                      flag_values=flag_values)
  flags.DEFINE_string("from_json", None, "print the table of this saved run and stop (how "
                      "the README's tables are made)", flag_values=flag_values)


# ---------------------------------------------------------------------------
# The inputs of each kind, and one cell.
# ---------------------------------------------------------------------------


def make_inputs(cell: Dict[str, Any]):
  """`(q [B, T, H, Dk], k [B, T, H, Dk], v [B, T, H, Dv], gates)`: q, k, v
  standard normal in the cell's dtype (the differentiated inputs), and the
  mixer's gates in float32, as its layer would make them from random logits
  (`gates` is {} for exact attention):

    log_decay `[B, T, H, Dk]` ("dimension": GLA's log_sigmoid(x) / 16, RWKV-7's
      -exp(-softplus(-x) - 0.5)) or `[B, T, H]` ("head": Mamba-2's
      -A softplus(x - 4), A from 1 to 16 over the heads; "fixed": RetNet's
      log(1 - 2^(-5 - h)));
    beta `[B, T, H]` = sigmoid(x) (delta rule); a `[B, T, H, Dk]` = sigmoid(x) (RWKV-7).
  """
  b, t, h, dk, dv = (cell[n] for n in ("batch", "seq_len", "heads", "key_dim", "value_dim"))
  # The "rbg" generator compiles faster than threefry, which each child process pays.
  keys = iter(jax.random.split(jax.random.key(0, impl="rbg"), 5))
  normal = lambda shape, dtype=jnp.float32: jax.random.normal(next(keys), shape, dtype)
  q, k = normal((b, t, h, dk), cell["dtype"]), normal((b, t, h, dk), cell["dtype"])
  v = normal((b, t, h, dv), cell["dtype"])
  if cell["mixer"] == EXACT:
    return q, k, v, {}
  kind, gates = MIXERS[cell["mixer"]], {}
  if kind.decay == "dimension":
    x = normal((b, t, h, dk))
    gates["log_decay"] = (-jnp.exp(-jax.nn.softplus(-x) - 0.5) if kind.rule == "rwkv7"
                          else jax.nn.log_sigmoid(x) / 16)
  elif kind.decay == "head":
    gates["log_decay"] = -jnp.linspace(1.0, 16.0, h) * jax.nn.softplus(normal((b, t, h)) - 4)
  elif kind.decay == "fixed":
    gamma = 1 - 2.0 ** (-5.0 - jnp.arange(h))
    gates["log_decay"] = jnp.broadcast_to(jnp.log(gamma), (b, t, h))
  if kind.rule == "delta":
    gates["beta"] = jax.nn.sigmoid(normal((b, t, h)))
  elif kind.rule == "rwkv7":
    gates["a"] = jax.nn.sigmoid(normal((b, t, h, dk)))
  return q, k, v, gates


def engine_arguments(mixer: str, q, k, v, gates) -> parts.Recurrence:
  """The engine's inputs for `mixer` from `make_inputs`'s arrays. Inside the
  differentiated function: the keys' normalisation and the rank-one terms
  are part of what the backward pass goes through."""
  kind = MIXERS[mixer]
  q = q * q.shape[-1] ** -0.5  # as the layers scale their queries
  log_decay = gates.get("log_decay")
  if kind.rule is None:
    return parts.Recurrence(q, k, v, log_decay)
  kappa = parts.l2_normalize(k)
  if kind.rule == "delta":  # the library's own mapping: r = k, w = -alpha beta k, key beta k
    return delta_net.delta_rule_recurrence(q, kappa, v, gates["beta"], log_decay)
  return parts.Recurrence(q, k, v, log_decay, read_key=kappa, write_key=-gates["a"] * kappa)


def make_step(cell: Dict[str, Any]):
  """The cell's jitted forward pass (outputs) or gradients of sum(outputs) in
  q, k and v, and its inputs."""
  if cell["mixer"] == EXACT:
    forward = lambda q, k, v, gates: attention_jax.dot_product_attention(
        q, k, v, is_causal=True, implementation=cell["exact_implementation"])
  else:
    form = engine.recurrent_form
    if cell["form"] == "chunkwise":
      backend = CHUNKWISE_IMPLEMENTATIONS[cell["chunkwise_implementation"]]
      form = (functools.partial(engine.chunkwise_form,
                                chunk_size=cell["chunk_size"] or engine.DEFAULT_CHUNK_SIZE)
              if backend is None else
              functools.partial(chunkwise_kernel, backend=backend, chunk_size=cell["chunk_size"]))
    forward = lambda q, k, v, gates: form(*engine_arguments(cell["mixer"], q, k, v, gates))[0]
  inputs = make_inputs(cell)
  if cell["mode"] == "fwd":
    return jax.jit(forward), inputs
  loss = lambda *args: forward(*args).astype(jnp.float32).sum()
  return jax.jit(jax.grad(loss, argnums=(0, 1, 2))), inputs


def measure_cell(cell: Dict[str, Any], memory_method: str) -> Dict[str, Any]:
  """Compiles, times and measures one cell in this process
  (`benchmark_scaling.measure_cell` with this file's steps); an error is
  recorded, not raised."""
  return benchmark_scaling.measure_cell(cell, memory_method, make_step)


def make_cells(args: cli.Args, mixers: List[str]) -> Iterator[Dict[str, Any]]:
  """Per T and mode: exact attention once, then each mixer's two forms."""
  shape = dict(batch=args.batch, heads=args.heads, key_dim=args.key_dim,
               value_dim=args.value_dim, dtype=args.dtype, repeats=args.repeats,
               chunk_size=args.chunk_size,
               chunkwise_implementation=args.chunkwise_implementation,
               exact_implementation=args.exact_implementation)
  for seq_len in args.lengths:
    for mode in args.modes:
      yield dict(shape, mixer=EXACT, form=EXACT, seq_len=seq_len, mode=mode)
      for mixer in mixers:
        for form in ("chunkwise", "recurrent"):
          yield dict(shape, mixer=mixer, form=form, seq_len=seq_len, mode=mode)


def skip_reason(cell: Dict[str, Any], args: cli.Args) -> Optional[str]:
  """Why a cell is not run (a length cap), or None."""
  for form, cap, flag in (("recurrent", args.max_recurrent_length, "max_recurrent_length"),
                          (EXACT, args.max_exact_length, "max_exact_length")):
    if cell["form"] == form and cap is not None and cell["seq_len"] > cap:
      return f"T={cell['seq_len']} > --{flag}={cap}"
  return None


def run_cells(cells: List[Dict[str, Any]], args: cli.Args, backend: str,
              after_each: Callable[[List[Dict[str, Any]]], None] = lambda records: None
              ) -> List[Dict[str, Any]]:
  """Every cell's record, with `status` "ok", "skipped" or "failed" and, unless
  ok, the `reason` (the cap, or the error); `after_each(records so far)` is
  called after every cell."""
  records = []
  for i, cell in enumerate(cells, 1):
    reason = skip_reason(cell, args)
    if reason is not None:
      record = dict(cell, status="skipped", reason=reason)
    else:
      if backend == "cpu" and args.isolate:
        record = common.measure_in_child(cell, args.cell_timeout,
                                         "experiments.benchmark_chunkwise",
                                         dict(cell, memory={"method": "process"}))
      else:
        record = measure_cell(cell, "process" if backend == "cpu" else "device")
        jax.clear_caches()  # this cell's executables go before the next one
      error = record.pop("error", None)
      record.update(status="failed" if error else "ok", reason=error)
    records.append(record)
    outcome = (f"{record['ms']:.2f} ms" if record["status"] == "ok"
               else f"{record['status']}: {record['reason'].splitlines()[0][:100]}")
    print(f"[{i}/{len(cells)}] {cell['mixer']}:{cell['form']} T={cell['seq_len']} "
          f"{cell['mode']}: {outcome}", flush=True)
    after_each(records)
  return records


# ---------------------------------------------------------------------------
# Analysis.
# ---------------------------------------------------------------------------


def crossover_length(lengths: Sequence[int], ms: Sequence[Optional[float]],
                     exact_ms: Sequence[Optional[float]]) -> Optional[int]:
  """The first T from which `ms` stays below `exact_ms` at every longer T
  where both were measured; None if it is not below at the last such T."""
  crossover = None
  for t, mine, exact in zip(lengths, ms, exact_ms):
    if mine is None or exact is None:
      continue
    if mine >= exact:
      crossover = None
    elif crossover is None:
      crossover = t
  return crossover


def summarize(records: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
  """One row per (mixer, mode): each form's series, the chunkwise form's
  speed-ups, crossover length and slopes."""
  ok = {(r["mixer"], r["form"], r["seq_len"], r["mode"]): r
        for r in records if r["status"] == "ok"}
  lengths = sorted({r["seq_len"] for r in records})
  rows = []
  for mixer in dict.fromkeys(r["mixer"] for r in records if r["mixer"] != EXACT):
    for mode in dict.fromkeys(r["mode"] for r in records):
      # None where the cell was skipped or failed.
      cells = {form: [ok.get((EXACT if form == EXACT else mixer, form, t, mode)) for t in lengths]
               for form in FORMS}
      ms = {form: [r and r["ms"] for r in cells[form]] for form in FORMS}
      peak = {form: [r and r["memory"].get("peak_delta_bytes") for r in cells[form]]
              for form in FORMS}
      speedup = lambda other: [o / m if o and m else None
                               for o, m in zip(ms[other], ms["chunkwise"])]
      rows.append({
          "mixer": mixer, "mode": mode, "lengths": lengths, "ms": ms, "peak_bytes": peak,
          "speedup_vs_exact": speedup(EXACT),
          "speedup_vs_recurrent": speedup("recurrent"),
          "crossover_length": crossover_length(lengths, ms["chunkwise"], ms[EXACT]),
          "memory_slope": log_log_slope(lengths, peak["chunkwise"]),
          "time_slope": log_log_slope(lengths, ms["chunkwise"]),
          "slopes": {form: {"time": log_log_slope(lengths, ms[form]),
                            "memory": log_log_slope(lengths, peak[form])} for form in FORMS},
      })
  return rows


def format_table(rows: List[Dict[str, Any]]) -> str:
  """Per (mixer, mode) and T: the chunkwise form's ms, and how many times
  faster it is than exact attention and than the scan; then the crossover
  length and the memory slope."""
  if not rows:
    return "(no mixer measured)"
  lengths = rows[0]["lengths"]
  ratio = lambda x: "-" if x is None else f"{x:.1f}x"
  header = (f"{'mixer':<16} {'mode':>8} " + " ".join(f"{'T=' + str(t):>20}" for t in lengths)
            + f" {'crossover':>9} {'mem slope':>9}")
  lines = ["chunkwise ms, then speed-ups over exact attention / over the recurrent scan "
           "(above 1: chunkwise faster)", header, "-" * len(header)]
  for row in rows:
    cells = []
    for i, _ in enumerate(lengths):
      ms = row["ms"]["chunkwise"][i]
      text = "-" if ms is None else (f"{ms:.1f} {ratio(row['speedup_vs_exact'][i])}/"
                                     f"{ratio(row['speedup_vs_recurrent'][i])}")
      cells.append(f"{text:>20}")
    slope = row["memory_slope"]
    lines.append(f"{row['mixer']:<16} {row['mode']:>8} " + " ".join(cells) +
                 f" {str(row['crossover_length'] or '-'):>9} "
                 f"{'-' if slope is None else f'{slope:.2f}':>9}")
  return "\n".join(lines)


def benchmark(args: cli.Args) -> Dict[str, Any]:
  """Runs the sweep, prints the table, writes the JSON and returns its payload."""
  if args.cell is not None:  # Child process: one cell, its record on stdout.
    print(json.dumps(measure_cell(json.loads(args.cell), "process")), flush=True)
    return {}
  if args.from_json:
    payload = json.loads(pathlib.Path(args.from_json).read_text())
    environment = payload["environment"]
    print(f"{args.from_json}: {environment['device_kind']}, git {environment['git_revision']}, "
          f"exact attention: {payload['exact_attention']['implementation']}")
    print(format_table(payload["summary"]))
    return payload

  environment = common.environment()
  if (environment["git_revision"] or "").endswith("+dirty"):
    print(f"warning: uncommitted changes ({environment['git_revision']}), recorded in the JSON",
          file=sys.stderr)
  backend = jax.default_backend()
  mixers = args.mixers or registered_mixers()
  start = time.perf_counter()
  out = pathlib.Path(args.out or REPO_ROOT / "benchmarks" / f"chunkwise_{backend}.json")
  arguments = {k: v for k, v in vars(args).items() if k != "cell"}
  arguments.update(mixers=mixers, out=str(out))
  payload = {
      "environment": environment,
      "command": " ".join(["python -m experiments.benchmark_chunkwise"] + args.argv[1:]),
      "arguments": arguments,
      "exact_attention": dict(EXACT_ATTENTION, implementation=args.exact_implementation),
  }

  def write(records: List[Dict[str, Any]], complete: bool = False) -> None:
    # After every cell: a run stopped early (a lent machine's time running
    # out) keeps what it measured; `complete` says whether it ended.
    payload.update(timestamp=datetime.datetime.now(datetime.timezone.utc).isoformat(),
                   wall_time_s=time.perf_counter() - start, complete=complete,
                   summary=summarize(records), records=records)
    common.write_json(out, payload)

  records = run_cells(list(make_cells(args, mixers)), args, backend, after_each=write)
  write(records, complete=True)
  print(format_table(payload["summary"]))
  print(f"wrote {len(records)} records to {out} in {payload['wall_time_s']:.0f} s")
  return payload


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
  """This script from Python: `argv` and errors as in `cli.parse`."""
  return benchmark(cli.parse(define_flags, argv, __name__))


if __name__ == "__main__":
  cli.run(define_flags, benchmark)
