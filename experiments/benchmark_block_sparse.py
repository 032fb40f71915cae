r"""The block-sparse flash kernel against the sparse variants' pure-JAX forms, in one run.

  python -m experiments.benchmark_block_sparse --out=benchmarks/block_sparse_cpu.json
  python -m experiments.benchmark_block_sparse --implementation=pallas_gpu \
      --dtype=bfloat16 --length=16384 --heads=8 --repeats=10   # on a GPU

For each sparse variant at a few settings of its pattern (`CASES`), one
non-causal self-attention call (batch 1, `--heads` heads of `--head_dim`,
`--dtype`, T = `--length`), forward+backward (gradients of sum(out^2) in q, k
and v), timed twice: through the block-sparse kernel (`--implementation`:
"blockwise", the lax loops, or an accelerator's Pallas kernel, in the default
blocks) and through the variant's pure-JAX form (`implementation=None`).
Dense attention through the same kernel family (blockwise, or the dense Pallas
kernel at the same blocks) is the density-1 cell.

Reported per cell: the pattern's block density (the fraction of (query block,
key block) pairs the kernel visits, from the layout it computes), the median
time of `--repeats` runs of each form, and their ratio. Then the least-squares
line of the kernel's time against block density over every cell: if the
kernel's cost is its visited blocks, the line goes through about the origin
and dense attention, and its R^2 is near 1.

This is a benchmark, not a test: it asserts nothing.
"""

from __future__ import annotations

import functools
import pathlib
import statistics
from typing import Any, Dict, List, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from experiments import benchmark_attention as common
from experiments import cli

# (variant, options): each pattern at two or three densities.
CASES = (
    ("local", dict(window_size=128)), ("local", dict(window_size=512)),
    ("local", dict(window_size=1024)),
    ("block_local", dict(block_size=256)), ("block_local", dict(block_size=1024)),
    ("dilated", dict(window_size=128, dilation=2)), ("dilated", dict(window_size=256, dilation=4)),
    ("strided", dict(stride=64)), ("strided", dict(stride=128)),
    ("fixed", dict(stride=128, num_summary=8)), ("fixed", dict(stride=256, num_summary=32)),
    ("longformer", dict(window_size=256, num_global=1)),
    ("longformer", dict(window_size=512, num_global=16)),
    ("bigbird", dict(block_size=128, num_random_blocks=3)),
    ("bigbird", dict(block_size=128, num_random_blocks=8)),
)


# --implementation -> the dense kernel of its family (the density-1 cell).
KERNELS = {"blockwise": "blockwise", "pallas_gpu": "flash", "pallas_tpu": "flash"}


def define_flags(flag_values: flags.FlagValues, argv: Sequence[str]) -> None:
  """This script's flags (see `experiments.cli`)."""
  del argv
  flags.DEFINE_integer("length", 8192, "sequence length T", lower_bound=1,
                       flag_values=flag_values)
  flags.DEFINE_integer("heads", 4, "heads H", lower_bound=1, flag_values=flag_values)
  flags.DEFINE_integer("head_dim", 64, "head dim D", lower_bound=1, flag_values=flag_values)
  flags.DEFINE_enum("implementation", "blockwise", list(KERNELS),
                    "the block-sparse kernel timed against the pure-JAX forms",
                    flag_values=flag_values)
  flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "q, k, v dtype",
                    flag_values=flag_values)
  flags.DEFINE_integer("repeats", 3, "timed runs per cell (the median is reported)",
                       lower_bound=1, flag_values=flag_values)
  cli.DEFINE_list_of(flags.ArgumentParser(), "variants", None,
                     "only these variants (default: every one in CASES)", flag_values)
  flags.DEFINE_string("out", None, "JSON output; none written when unset",
                      flag_values=flag_values)


def _variant_call(variant: str, options: Dict[str, Any], implementation: Optional[str]):
  from attention_jax import registry  # pylint: disable=import-outside-toplevel
  fn = functools.partial(registry.get_variant(variant).fn, **options,
                         implementation=implementation)
  if variant == "bigbird":
    fn = functools.partial(fn, rng=jax.random.PRNGKey(0))
  return fn


def _training_step(forward):
  return jax.jit(jax.grad(lambda *a: jnp.sum(forward(*a) ** 2), argnums=(0, 1, 2)))


class _Recorded(Exception):
  """Raised once the layout is recorded: nothing after it needs to run."""


def block_density(variant: str, options: Dict[str, Any], inputs) -> float:
  """The fraction of (query block, key block) pairs the kernel visits, from the
  layout the variant hands to the kernel's loops (recorded from an eager call,
  stopped there)."""
  # pylint: disable-next=import-outside-toplevel
  from attention_jax.kernels.flash_attention import blockwise
  layouts = []
  attend = blockwise.flex_attend  # the loops of the flex engine run every pattern

  def recording(cfg, operands, masks):
    del cfg, operands
    layouts.append(np.asarray(masks.block_layout))  # [B|1, H|1, nq, nk]
    raise _Recorded

  blockwise.flex_attend = recording
  try:
    _variant_call(variant, options, "blockwise")(*inputs)
  except _Recorded:
    pass
  finally:
    blockwise.flex_attend = attend
  return float(np.any(layouts[0] != 0, axis=(0, 1)).mean())


def benchmark(args: cli.Args) -> int:
  """Times every case both ways, prints ratios and the fit, writes the JSON."""
  # pylint: disable=import-outside-toplevel
  from attention_jax import registry
  from attention_jax.kernels.flash_attention import block_sparse
  # pylint: enable=import-outside-toplevel
  blocks = block_sparse.default_block_sizes()
  shape = (1, args.length, args.heads, args.head_dim)
  inputs = tuple(jax.random.normal(k, shape, jnp.dtype(args.dtype))
                 for k in jax.random.split(jax.random.key(0), 3))
  records: List[Dict[str, Any]] = []
  print(f"non-causal forward+backward, B=1 T={args.length} H={args.heads} D={args.head_dim} "
        f"{args.dtype}, kernel {args.implementation} in blocks {blocks.block_q} (BigBird: its "
        f"own), {jax.devices()[0].device_kind}")
  print(f"{'variant':>12} {'options':<40} {'density':>8} {'kernel ms':>10} {'pure ms':>9} "
        f"{'pure/kernel':>12}")
  dense = functools.partial(registry.get_variant(KERNELS[args.implementation]).fn,
                            block_sizes=blocks)
  dense_times = common.time_runs(_training_step(dense), inputs, args.repeats)
  dense_ms = statistics.median(dense_times)
  records.append(dict(variant="dense", options={}, block_density=1.0, kernel_ms=dense_ms,
                      kernel_times_ms=dense_times))
  print(f"{'dense':>12} {'(' + KERNELS[args.implementation] + ', every block)':<40} {1.0:>8.3f} {dense_ms:>10.0f}", flush=True)
  selected = [c for c in CASES if not args.variants or c[0] in args.variants]
  for variant, options in selected:
    cell: Dict[str, Any] = dict(variant=variant, options=options,
                                block_density=block_density(variant, options, inputs))
    for name, implementation in (("kernel", args.implementation), ("pure", None)):
      step = _training_step(_variant_call(variant, options, implementation))
      times = common.time_runs(step, inputs, args.repeats)
      cell[f"{name}_ms"], cell[f"{name}_times_ms"] = statistics.median(times), times
    cell["pure_over_kernel"] = cell["pure_ms"] / cell["kernel_ms"]
    records.append(cell)
    print(f"{variant:>12} {str(options):<40} {cell['block_density']:>8.3f} "
          f"{cell['kernel_ms']:>10.0f} {cell['pure_ms']:>9.0f} {cell['pure_over_kernel']:>12.2f}",
          flush=True)
  fit = fit_line([r["block_density"] for r in records], [r["kernel_ms"] for r in records])
  print(f"kernel ms = {fit['intercept_ms']:.0f} + {fit['slope_ms']:.0f} x block density "
        f"(R^2 {fit['r_squared']:.3f}, {len(records)} cells)")
  if args.out:
    common.write_records(pathlib.Path(args.out), "experiments.benchmark_block_sparse",
                         dict(length=args.length, heads=args.heads, head_dim=args.head_dim,
                              block_size=blocks.block_q, repeats=args.repeats, causal=False,
                              dtype=args.dtype, implementation=args.implementation,
                              mode="fwd+bwd", fit=fit), records)
  return 0


def fit_line(densities: Sequence[float], times_ms: Sequence[float]) -> Dict[str, float]:
  """Least squares `time = intercept + slope * density`, with R^2."""
  x, y = np.asarray(densities, float), np.asarray(times_ms, float)
  slope, intercept = np.polyfit(x, y, 1)
  residual = y - (intercept + slope * x)
  total = np.sum((y - y.mean()) ** 2)
  r_squared = 1.0 - float(np.sum(residual ** 2) / total) if total > 0 else float("nan")
  return dict(slope_ms=float(slope), intercept_ms=float(intercept), r_squared=r_squared)


def main(argv: Optional[Sequence[str]] = None) -> int:
  """This script from Python: `argv` and errors as in `cli.parse`."""
  return benchmark(cli.parse(define_flags, argv, __name__))


if __name__ == "__main__":
  cli.run(define_flags, benchmark)
