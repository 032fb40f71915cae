r"""Compile time and memory of the layer stack: unrolled, scanned, scanned + remat.

  python -m experiments.benchmark_layers --variant=linear --lengths=4096,16384 \
      --num_layers=4,8 --out=benchmarks/layer_stack_cpu.json

Compiles (never runs) the train step of the LRA text classifier
(`configs/lra/text.py`: width 256, 4 heads, MLP 1024; AdamW, gradients and
all, the trainer's own step) for each number of layers, sequence length and
stack mode:

* "unrolled": `scan_layers=False`, one copy of the block per layer;
* "scanned": `scan_layers=True`, one block under `nn.scan`;
* "scanned+remat": scanned, each block rematerialised with `--remat_policy`
  (default "full": only the blocks' inputs are kept for the backward pass).

For each it records the compile time (lowering + XLA compilation, caches
cleared first) and XLA's memory analysis of the step: temporaries (the
activations kept for the backward pass live here), arguments, outputs; the
ratios against the unrolled stack are printed from the same run. The state is
abstract (`jax.ShapeDtypeStruct`s), so nothing of the model's size is
allocated and 16K tokens compile on a laptop.
"""

from __future__ import annotations

import json
import pathlib
import sys
import time
from typing import Any, Dict, Optional, Sequence

from absl import flags

from experiments import cli

MODES = {"unrolled": dict(scan_layers=False, remat=False),
         "scanned": dict(scan_layers=True, remat=False),
         "scanned+remat": dict(scan_layers=True, remat=True)}


def compile_step(variant: str, length: int, num_layers: int, mode: str, *, batch_size: int,
                 remat_policy: str) -> Dict[str, Any]:
  """Compiles the text model's train step once; its compile time and memory."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from attention_jax.train.run import build_run  # pylint: disable=g-import-not-at-top
  from experiments.benchmark_attention import compiled_memory  # pylint: disable=g-import-not-at-top
  from experiments.benchmark_lra_speed import text_model_config  # pylint: disable=g-import-not-at-top

  settings = MODES[mode]
  config = text_model_config(variant, length)
  config.model.update(num_layers=num_layers, scan_layers=settings["scan_layers"],
                      remat_policy=remat_policy if settings["remat"] else "none")
  run = build_run(config, devices=jax.devices()[:1])
  batch = dict(inputs=jax.ShapeDtypeStruct((batch_size, length), jnp.int32),
               label=jax.ShapeDtypeStruct((batch_size,), jnp.int32),
               weight=jax.ShapeDtypeStruct((batch_size,), jnp.float32))
  state, shardings = run.abstract_state(batch)
  train_step = run.train_step(shardings)
  jax.clear_caches()
  started = time.perf_counter()
  compiled = run.compile(train_step, state, batch)
  compile_s = time.perf_counter() - started
  memory = compiled_memory(compiled) or {}
  return dict(variant=variant, length=length, num_layers=num_layers, mode=mode,
              remat_policy=config.model.remat_policy, batch_size=batch_size,
              compile_s=compile_s, memory=memory,
              temp_bytes=memory.get("temp_size_in_bytes"),
              total_bytes=sum(memory.get(f, 0) for f in (
                  "argument_size_in_bytes", "temp_size_in_bytes", "output_size_in_bytes"))
              - memory.get("alias_size_in_bytes", 0))


def define_flags(flag_values: flags.FlagValues, argv: Sequence[str]) -> None:
  """This script's flags (see `experiments.cli`)."""
  del argv  # only config flags read it
  flags.DEFINE_string("variant", "linear", "the attention variant of every layer",
                      flag_values=flag_values)
  cli.DEFINE_list_of(flags.IntegerParser(lower_bound=1), "lengths", [4096, 16384],
                     "sequence lengths T", flag_values=flag_values)
  cli.DEFINE_list_of(flags.IntegerParser(lower_bound=1), "num_layers", [4, 8],
                     "layer counts", flag_values=flag_values)
  cli.DEFINE_list_of(flags.EnumParser(list(MODES)), "modes", list(MODES), "stack modes",
                     flag_values=flag_values)
  flags.DEFINE_string("remat_policy", "full", "the policy of the scanned+remat mode",
                      flag_values=flag_values)
  flags.DEFINE_integer("batch", 2, "examples per step", lower_bound=1, flag_values=flag_values)
  flags.DEFINE_string("out", None, "the JSON file to write", flag_values=flag_values)


def benchmark(args: cli.Args) -> int:
  """Compiles every cell, prints a table with ratios, writes the JSON."""
  from attention_jax.train.provenance import device_summary, git_revision  # pylint: disable=g-import-not-at-top
  records = []
  print(f"{'layers':>6} {'T':>6} {'mode':>14} {'compile s':>10} {'temp MiB':>9} "
        f"{'compile x':>9} {'temp x':>7}")
  for num_layers in args.num_layers:
    for length in args.lengths:
      baseline: Optional[Dict[str, Any]] = None
      for mode in args.modes:
        record = compile_step(args.variant, length, num_layers, mode, batch_size=args.batch,
                              remat_policy=args.remat_policy)
        if mode == "unrolled":
          baseline = record
        if baseline is not None:
          record["compile_ratio_to_unrolled"] = record["compile_s"] / baseline["compile_s"]
          record["temp_ratio_to_unrolled"] = record["temp_bytes"] / baseline["temp_bytes"]
        records.append(record)
        print(f"{num_layers:>6} {length:>6} {mode:>14} {record['compile_s']:>10.2f} "
              f"{record['temp_bytes'] / 2**20:>9.1f} "
              f"{record.get('compile_ratio_to_unrolled', float('nan')):>9.2f} "
              f"{record.get('temp_ratio_to_unrolled', float('nan')):>7.2f}", flush=True)
  if args.out:
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(git_revision=git_revision(), devices=device_summary(),
                                   command=" ".join(["python -m experiments.benchmark_layers"]
                                                    + sys.argv[1:]),
                                   records=records), indent=1, sort_keys=True) + "\n")
  return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
  """This script from Python: `argv` and errors as in `cli.parse`."""
  return benchmark(cli.parse(define_flags, argv, __name__))


if __name__ == "__main__":
  cli.run(define_flags, benchmark)
