r"""Sweep the GPU kernels' block sizes and launch settings; the defaults come from this.

For each head dim and causal setting, times forward+backward of
`pallas_gpu.flash_attention_gpu` (Triton) and `pallas_mgpu.flash_attention_mgpu`
(Mosaic GPU) at one sequence length over a grid of tilings, in one process and
on the same inputs, and prints the fastest of each. Two stages keep the grid
small: the forward/dq tile with its warps and pipeline depth first (under the
default dk/dv tile), then the dk/dv tile under the best of those.

Every configuration's forward output is also compared with the XLA reference in
float32 (‖out - ref‖ / ‖ref‖), so a fast tiling that computes the wrong thing
cannot win.

  python -m experiments.tune_block_sizes --seq_len=8192 --head_dims=64,128 \
      --out=benchmarks/block_sizes_gpu.json

A benchmark, not a test: it needs a GPU and asserts nothing.
"""

from __future__ import annotations

import datetime
import itertools
import statistics
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from absl import flags

from attention_jax.kernels.flash_attention import BlockSizes, pallas_gpu, pallas_mgpu
from attention_jax.variants.dense import prepare_inputs
from experiments import benchmark_attention as bench
from experiments import cli

# Triton: forward/dq tiles x warps x stages, then dk/dv tiles.
TRITON_TILES = ((64, 64), (64, 128), (128, 64), (128, 128))
TRITON_WARPS = (4, 8)
TRITON_STAGES = (2, 3)
TRITON_DKV_TILES = ((32, 64), (64, 64), (64, 128), (128, 64), (128, 128))
# Mosaic GPU: block_q and block_k_dkv are one warpgroup's 64 rows; the key step of
# the forward/dq pass and the query step of the dk/dv pass are free, with the
# pipeline depth.
MGPU_BLOCK_K = (64, 128, 256)
MGPU_STEPS = (2, 3)
MGPU_BLOCK_Q_DKV = (64, 128, 256)


def define_flags(flag_values: flags.FlagValues, argv: Sequence[str]) -> None:
  del argv
  positive = flags.IntegerParser(lower_bound=1)
  flags.DEFINE_integer("seq_len", 8192, "sequence length T", lower_bound=1,
                       flag_values=flag_values)
  cli.DEFINE_list_of(positive, "head_dims", [64, 128], "head dims D", flag_values)
  flags.DEFINE_integer("batch", 1, "batch size", lower_bound=1, flag_values=flag_values)
  flags.DEFINE_integer("heads", 8, "attention heads", lower_bound=1, flag_values=flag_values)
  flags.DEFINE_enum("causal", "false", ["both", "true", "false"], "causal settings",
                    flag_values=flag_values)
  flags.DEFINE_list("kernels", ["pallas", "pallas_mgpu"], "kernels to tune",
                    flag_values=flag_values)
  flags.DEFINE_integer("repeats", 10, "timed runs per configuration", lower_bound=1,
                       flag_values=flag_values)
  flags.DEFINE_string("out", "benchmarks/block_sizes_gpu.json", "JSON output",
                      flag_values=flag_values)


def triton_kernel(setting: dict[str, int]) -> Callable[..., jax.Array]:
  blocks = BlockSizes(setting["block_q"], setting["block_k"], setting["block_q_dkv"],
                      setting["block_k_dkv"])
  return lambda inputs: pallas_gpu.flash_attention_gpu(
      inputs, blocks, num_warps=setting["num_warps"], num_stages=setting["num_stages"])


def mgpu_kernel(setting: dict[str, int]) -> Callable[..., jax.Array]:
  blocks = BlockSizes(pallas_mgpu.BLOCK_Q, setting["block_k"], setting["block_q_dkv"],
                      pallas_mgpu.BLOCK_Q)
  return lambda inputs: pallas_mgpu.flash_attention_mgpu(
      inputs, blocks, max_concurrent_steps=setting["max_concurrent_steps"])


def measure(kernel: Callable[..., jax.Array], qkv, causal: bool, reference: jax.Array,
            repeats: int) -> dict[str, Any]:
  """Forward error against the reference and the median forward+backward time."""
  def forward(q, k, v):
    inputs, _ = prepare_inputs(q, k, v, None, None, is_causal=causal)
    return kernel(inputs)

  def loss(q, k, v):
    return forward(q, k, v).astype(jnp.float32).sum()

  record: dict[str, Any] = {"error": None}
  try:
    out = jax.jit(forward)(*qkv).astype(jnp.float32)
    record["relative_error"] = float(jnp.linalg.norm(out - reference) /
                                     jnp.linalg.norm(reference))
    start = time.perf_counter()
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*qkv).compile()
    record["compile_s"] = time.perf_counter() - start
    record["times_ms"] = bench.time_runs(compiled, qkv, repeats)
    record["ms"] = statistics.median(record["times_ms"])
  except Exception as e:  # pylint: disable=broad-except
    # Tilings that do not fit (shared memory, registers) are results too.
    record["error"] = f"{type(e).__name__}: {e}"[:1000]
  jax.clear_caches()
  return record


def best(records: list[dict[str, Any]]) -> dict[str, Any] | None:
  ran = [r for r in records if r["error"] is None and r["relative_error"] < 1e-2]
  return min(ran, key=lambda r: r["ms"]) if ran else None


def sweep(stage_settings, make_kernel, qkv, causal, reference, repeats, label):
  records = []
  for setting in stage_settings:
    record = dict(setting, **measure(make_kernel(setting), qkv, causal, reference, repeats))
    outcome = (f"{record['ms']:.3f} ms, error {record['relative_error']:.1e}"
               if record["error"] is None else f"FAILED {record['error'].splitlines()[0][:100]}")
    print(f"  {label} {setting}: {outcome}", flush=True)
    records.append(record)
  return records


def tune_triton(qkv, causal, reference, repeats):
  base = dict(pallas_gpu.default_block_sizes_gpu(qkv[0].shape[-1], qkv[0].dtype).__dict__)
  dkv = dict(block_q_dkv=base["block_q_dkv"], block_k_dkv=base["block_k_dkv"])
  first = [dict(block_q=bq, block_k=bk, num_warps=w, num_stages=s, **dkv)
           for (bq, bk), w, s in itertools.product(TRITON_TILES, TRITON_WARPS, TRITON_STAGES)]
  records = sweep(first, triton_kernel, qkv, causal, reference, repeats, "pallas fwd/dq")
  winner = best(records)
  if winner is None:
    return records
  keep = {k: winner[k] for k in ("block_q", "block_k", "num_warps", "num_stages")}
  second = [dict(keep, block_q_dkv=bq, block_k_dkv=bk) for bq, bk in TRITON_DKV_TILES
            if (bq, bk) != (dkv["block_q_dkv"], dkv["block_k_dkv"])]
  return records + sweep(second, triton_kernel, qkv, causal, reference, repeats, "pallas dk/dv")


def tune_mgpu(qkv, causal, reference, repeats):
  settings = [dict(block_k=bk, block_q_dkv=bq, max_concurrent_steps=s)
              for bk, bq, s in itertools.product(MGPU_BLOCK_K, MGPU_BLOCK_Q_DKV, MGPU_STEPS)]
  return sweep(settings, mgpu_kernel, qkv, causal, reference, repeats, "pallas_mgpu")


def tune(args: cli.Args) -> dict[str, Any]:
  tuners = {"pallas": tune_triton, "pallas_mgpu": tune_mgpu}
  results = []
  for head_dim in args.head_dims:
    cell = dict(batch=args.batch, seq_len=args.seq_len, heads=args.heads, head_dim=head_dim,
                dtype="bfloat16")
    qkv = jax.block_until_ready(bench.make_inputs(cell))
    for causal in bench.causal_settings(args.causal):
      upcast = [x.astype(jnp.float32) for x in qkv]
      with jax.default_matmul_precision("highest"):
        reference = jax.jit(lambda q, k, v, c=causal: jax.nn.dot_product_attention(
            q, k, v, is_causal=c, implementation="xla"))(*upcast)
      for kernel in args.kernels:
        print(f"{kernel} D={head_dim} causal={causal} T={args.seq_len}", flush=True)
        records = tuners[kernel](qkv, causal, reference, args.repeats)
        winner = best(records)
        results.append(dict(kernel=kernel, head_dim=head_dim, causal=causal,
                            seq_len=args.seq_len, best=winner, records=records))
  lines = [f"{'kernel':<12} {'D':>4} {'causal':>6} {'ms':>9}  best setting"]
  for r in results:
    winner = r["best"]
    setting = ({k: v for k, v in winner.items()
                if k not in ("error", "relative_error", "compile_s", "times_ms", "ms")}
               if winner else "none ran")
    ms = f"{winner['ms']:.3f}" if winner else "-"
    lines.append(f"{r['kernel']:<12} {r['head_dim']:>4} {str(r['causal']):>6} {ms:>9}  {setting}")
  print("\n".join(lines))
  payload = dict(environment=bench.environment(), arguments=vars(args),
                 timestamp=datetime.datetime.now(datetime.timezone.utc).isoformat(),
                 results=results)
  bench.write_json(bench.pathlib.Path(args.out), payload)
  return payload


if __name__ == "__main__":
  cli.run(define_flags, tune)
