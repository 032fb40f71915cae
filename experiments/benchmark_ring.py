r"""Ring attention over 8 simulated devices against blockwise attention on one, in one run.

  python -m experiments.benchmark_ring --out=benchmarks/ring_cpu.json

For each length T in `--lengths`: one causal attention call (batch 1, `--heads`
heads of `--head_dim`, float32), forward and forward+backward (gradients of
sum(out^2) in q, k and v), computed

- by `blockwise` attention on one device, and
- by `ring_attention` with the sequence split over `--devices` simulated CPU
  devices (`--xla_force_host_platform_device_count`), zig-zag layout.

Reported per cell: the peak memory of one device from XLA's memory analysis
of the compiled program (arguments + outputs + temporaries, the partitioned
per-device program for the ring), and the median wall time of `--repeats`
runs for lengths up to `--time_max_length` (longer ones are compiled and
measured for memory only: their time on this machine is minutes a run).
The simulated devices share this machine's cores, so the ring's wall time is
the whole ring's work on those cores plus its exchanges, not the time one of
n real devices would take (about 1/n of the work each).

This is a benchmark, not a test: it asserts nothing.
"""

from __future__ import annotations

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  # Before jax initialises: the ring's devices.
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_force_host_platform_device_count=8").strip()

import pathlib  # pylint: disable=g-import-not-at-top,wrong-import-position
import statistics
from typing import Any, Dict, List, Optional, Sequence

import jax
import jax.numpy as jnp
from absl import flags
from jax.sharding import NamedSharding, PartitionSpec as P

from experiments import benchmark_attention as common
from experiments import cli

MODES = common.MODES


def define_flags(flag_values: flags.FlagValues, argv: Sequence[str]) -> None:
  """This script's flags (see `experiments.cli`)."""
  del argv
  cli.DEFINE_list_of(flags.IntegerParser(lower_bound=1), "lengths", [16384, 65536, 262144],
                     "sequence lengths T", flag_values)
  flags.DEFINE_integer("devices", 8, "devices of the ring", lower_bound=1,
                       flag_values=flag_values)
  flags.DEFINE_integer("heads", 1, "heads H", lower_bound=1, flag_values=flag_values)
  flags.DEFINE_integer("head_dim", 64, "head dim D", lower_bound=1, flag_values=flag_values)
  flags.DEFINE_integer("block_size", 512, "the blockwise loops' query and key blocks",
                       lower_bound=1, flag_values=flag_values)
  flags.DEFINE_integer("time_max_length", 65536, "time lengths up to this; memory only above",
                       lower_bound=0, flag_values=flag_values)
  flags.DEFINE_integer("repeats", 3, "timed runs per cell (the median is reported)",
                       lower_bound=1, flag_values=flag_values)
  flags.DEFINE_string("out", None, "JSON output; none written when unset",
                      flag_values=flag_values)


def peak_bytes(compiled) -> int:
  """One device's peak memory: arguments, outputs and temporaries (less aliasing)."""
  stats = compiled.memory_analysis()
  return int(stats.argument_size_in_bytes + stats.output_size_in_bytes
             + stats.temp_size_in_bytes - stats.alias_size_in_bytes)


def make_call(args: cli.Args, implementation: str, mode: str):
  """The jitted call of one cell and where its inputs go."""
  from attention_jax.kernels.flash_attention import BlockSizes, blockwise_dot_product_attention, ring  # pylint: disable=g-import-not-at-top
  blocks = BlockSizes(args.block_size, args.block_size)
  if implementation == "ring":
    if args.devices > jax.device_count():
      raise ValueError(f"--devices={args.devices} but jax sees {jax.device_count()} devices; "
                       f"set XLA_FLAGS=--xla_force_host_platform_device_count before running.")
    mesh = jax.make_mesh((args.devices,), ("sequence",), devices=jax.devices()[:args.devices],
                         axis_types=(jax.sharding.AxisType.Auto,))
    placement = NamedSharding(mesh, P(None, "sequence"))
    forward = lambda q, k, v: ring.ring_attention(q, k, v, mesh=mesh, is_causal=True,
                                                  block_sizes=blocks)
  else:
    placement = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    forward = lambda q, k, v: blockwise_dot_product_attention(q, k, v, is_causal=True,
                                                              block_sizes=blocks)
  if mode == "fwd":
    fn = forward
  else:
    fn = jax.grad(lambda *a: jnp.sum(forward(*a) ** 2), argnums=(0, 1, 2))
  return jax.jit(fn, in_shardings=(placement,) * 3), placement


def benchmark(args: cli.Args) -> int:
  """Measures every (length, mode, implementation) cell, prints ratios, writes the JSON."""
  records: List[Dict[str, Any]] = []
  print(f"causal, B=1 H={args.heads} D={args.head_dim} float32, blocks {args.block_size}; "
        f"ring over {args.devices} simulated devices of {jax.devices()[0].device_kind}")
  print(f"{'T':>7} {'mode':>8} {'blockwise MiB':>14} {'ring MiB/dev':>13} {'ratio':>6} "
        f"{'blockwise ms':>13} {'ring ms':>9}")
  for length in args.lengths:
    shape = (1, length, args.heads, args.head_dim)
    keys = jax.random.split(jax.random.key(0), 3)
    for mode in MODES:
      cell: Dict[str, Any] = dict(length=length, mode=mode)
      for implementation in ("blockwise", "ring"):
        call, placement = make_call(args, implementation, mode)
        inputs = [jax.device_put(jax.random.normal(k, shape, jnp.float32), placement)
                  for k in keys]
        cell[f"{implementation}_peak_mib"] = peak_bytes(call.lower(*inputs).compile()) / 2**20
        if length <= args.time_max_length:
          times = common.time_runs(call, inputs, args.repeats)
          cell[f"{implementation}_ms"] = statistics.median(times)
          cell[f"{implementation}_times_ms"] = times
      cell["memory_ratio"] = cell["ring_peak_mib"] / cell["blockwise_peak_mib"]
      records.append(cell)
      time_of = lambda name: f"{cell[name]:.0f}" if name in cell else "-"
      print(f"{length:>7} {mode:>8} {cell['blockwise_peak_mib']:>14.1f} "
            f"{cell['ring_peak_mib']:>13.1f} {cell['memory_ratio']:>6.3f} "
            f"{time_of('blockwise_ms'):>13} {time_of('ring_ms'):>9}", flush=True)
  if args.out:
    common.write_records(pathlib.Path(args.out), "experiments.benchmark_ring",
                         dict(devices=args.devices, heads=args.heads, head_dim=args.head_dim,
                              block_size=args.block_size, repeats=args.repeats, causal=True,
                              layout="zigzag", dtype="float32"), records)
  return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
  """This script from Python: `argv` and errors as in `cli.parse`."""
  return benchmark(cli.parse(define_flags, argv, __name__))


if __name__ == "__main__":
  cli.run(define_flags, benchmark)
