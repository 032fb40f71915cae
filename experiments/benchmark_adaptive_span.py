r"""Adaptive span's cost against its learned span, in one run.

  python -m experiments.benchmark_adaptive_span --out=benchmarks/adaptive_span_cpu.json

One causal `adaptive_span_attention` call (batch 1, `--heads` heads of
`--head_dim`, `--length` tokens) with the static band of `--max_span` S and
ramp R, timed forward and forward+backward (gradients of sum(out^2) in the
queries, keys, values and spans) for each largest span z in `--spans` (every
head at z). The arrays are the same in every cell (the band of S + R - 1
keys, one key block at a time); only the work changes, since the key blocks
past z + R are skipped by `lax.cond` (`sparse.windows.band_attention`'s `reach`).
Printed per z: the median milliseconds, the ratio to z = S (the whole band,
below 1: cheaper) and the share of the band's key blocks in reach, the
figure the time should follow.

This is a benchmark, not a test: it asserts nothing about speed.
"""

from __future__ import annotations

import pathlib
import statistics
from typing import Any, Dict, List, Optional, Sequence

import jax
import jax.numpy as jnp
from absl import flags

from experiments import benchmark_attention as common
from experiments import cli

MODES = common.MODES


def define_flags(flag_values: flags.FlagValues, argv: Sequence[str]) -> None:
  """This script's flags (see `experiments.cli`)."""
  del argv
  flags.DEFINE_integer("length", 4096, "sequence length T", lower_bound=1,
                       flag_values=flag_values)
  flags.DEFINE_integer("heads", 4, "heads H", lower_bound=1, flag_values=flag_values)
  flags.DEFINE_integer("head_dim", 32, "head dim D", lower_bound=1, flag_values=flag_values)
  flags.DEFINE_integer("max_span", 1024, "S, the static band's largest span", lower_bound=1,
                       flag_values=flag_values)
  flags.DEFINE_integer("ramp", 32, "R, the mask's ramp", lower_bound=1, flag_values=flag_values)
  flags.DEFINE_integer("block_size", 64, "b, the key blocks skipped past z + R", lower_bound=1,
                       flag_values=flag_values)
  cli.DEFINE_list_of(flags.FloatParser(lower_bound=0.0), "spans", [32.0, 128.0, 512.0, 1024.0],
                     "largest spans z to time (z = S is the reference)", flag_values)
  flags.DEFINE_integer("repeats", 5, "timed runs per cell (the median is reported)",
                       lower_bound=1, flag_values=flag_values)
  flags.DEFINE_string("out", None, "JSON output; none written when unset",
                      flag_values=flag_values)


def blocks_in_reach(span: float, args: cli.Args) -> float:
  """The share of the causal band's key block offsets within z + R: offset o
  (o = 0 the query's own block) is computed when (o - 1) b + 1 < z + R."""
  width = args.max_span + args.ramp - 1
  offsets = range(-(-width // args.block_size) + 1)
  computed = [o for o in offsets if o == 0 or (o - 1) * args.block_size + 1 < span + args.ramp]
  return len(computed) / len(offsets)


def make_step(args: cli.Args, mode: str):
  """The jitted call of one cell: forward, or the gradients of sum(out^2)."""
  from attention_jax.variants.heads import adaptive_span_attention  # pylint: disable=g-import-not-at-top

  def forward(query, key, value, spans):
    return adaptive_span_attention(query, key, value, is_causal=True, spans=spans,
                                   max_span=args.max_span, ramp=args.ramp,
                                   block_size=args.block_size)

  if mode == "fwd":
    return jax.jit(forward)
  return jax.jit(jax.grad(lambda *a: jnp.sum(forward(*a) ** 2), argnums=(0, 1, 2, 3)))


def benchmark(args: cli.Args) -> int:
  """Times every (mode, span) cell, prints the ratios, writes the JSON."""
  shape = (1, args.length, args.heads, args.head_dim)
  keys = jax.random.split(jax.random.PRNGKey(0), 3)
  query, key, value = (jax.random.normal(k, shape, jnp.float32) for k in keys)
  spans = sorted(set(args.spans) | {float(args.max_span)})
  records: List[Dict[str, Any]] = []
  print(f"T={args.length} H={args.heads} D={args.head_dim} S={args.max_span} R={args.ramp} "
        f"b={args.block_size}, causal, float32, {jax.devices()[0].device_kind}")
  print(f"{'mode':>8} {'span z':>7} {'ms':>9} {'x of z=S':>9} {'blocks in reach':>16}")
  for mode in MODES:
    step = make_step(args, mode)
    by_span = {}
    for span in spans:
      span_array = jnp.full((args.heads,), span, jnp.float32)
      inputs = (query, key, value, span_array)
      times = common.time_runs(step, inputs, args.repeats)
      by_span[span] = dict(mode=mode, span=span, ms=statistics.median(times), times_ms=times,
                           blocks_in_reach=blocks_in_reach(span, args))
    full = by_span[float(args.max_span)]["ms"]
    for span in spans:
      record = by_span[span]
      record["ratio_to_full_span"] = record["ms"] / full
      records.append(record)
      print(f"{mode:>8} {span:>7.0f} {record['ms']:>9.1f} {record['ratio_to_full_span']:>9.2f} "
            f"{record['blocks_in_reach']:>16.2f}", flush=True)
  if args.out:
    common.write_records(pathlib.Path(args.out), "experiments.benchmark_adaptive_span",
                         dict(length=args.length, heads=args.heads, head_dim=args.head_dim,
                              max_span=args.max_span, ramp=args.ramp,
                              block_size=args.block_size, repeats=args.repeats), records)
  return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
  """This script from Python: `argv` and errors as in `cli.parse`."""
  return benchmark(cli.parse(define_flags, argv, __name__))


if __name__ == "__main__":
  cli.run(define_flags, benchmark)
