r"""Training memory against depth: the reversible stack against the standard one.

  python -m experiments.benchmark_reversible --variant=dot_product --length=1024 \
      --num_layers=2,4,8,16 --out=benchmarks/reversible_cpu.json

Compiles (never runs) the train step of the LRA text classifier
(`configs/lra/text.py`: width 256, 4 heads, MLP 1024, dropout 0.1; AdamW,
gradients and all, the trainer's own step) for each depth and stack:

* "standard": the pre-norm blocks in sequence, every activation the backward
  pass needs kept;
* "standard+remat": the same, each block rematerialised (`remat_policy`
  "full": only each block's input is kept), for reference;
* "reversible": `model.stack="reversible"`, every layer's inputs recomputed
  from its outputs in the backward pass.

For each it records XLA's memory analysis of the compiled step: temporaries
(where the activations kept for the backward pass live), arguments (the
state: parameters and optimiser moments, which grow with depth in every
stack), outputs. Printed from the same run: temporaries per stack, each
stack's ratio to the standard stack at that depth, and each stack's growth
per added layer (least squares over the depths). The state is abstract
(`jax.ShapeDtypeStruct`s): nothing of the model's size is allocated. The
table is printed and written next to the JSON with the suffix .txt.
"""

from __future__ import annotations

import json
import pathlib
import sys
from typing import Any, Dict, List, Optional, Sequence

import numpy as np
from absl import flags

from experiments import cli

STACKS = {"standard": dict(stack="standard", remat_policy="none"),
          "standard+remat": dict(stack="standard", remat_policy="full"),
          "reversible": dict(stack="reversible", remat_policy="none")}
MIB = 2**20


def compile_step(variant: str, length: int, num_layers: int, stack: str, *,
                 batch_size: int) -> Dict[str, Any]:
  """Compiles the text model's train step once; XLA's memory analysis of it."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from attention_jax.train.run import build_run  # pylint: disable=g-import-not-at-top
  from experiments.benchmark_attention import compiled_memory  # pylint: disable=g-import-not-at-top
  from experiments.benchmark_lra_speed import text_model_config  # pylint: disable=g-import-not-at-top

  config = text_model_config(variant, length)
  config.model.update(num_layers=num_layers, **STACKS[stack])
  run = build_run(config, devices=jax.devices()[:1])
  batch = dict(inputs=jax.ShapeDtypeStruct((batch_size, length), jnp.int32),
               label=jax.ShapeDtypeStruct((batch_size,), jnp.int32),
               weight=jax.ShapeDtypeStruct((batch_size,), jnp.float32))
  state, shardings = run.abstract_state(batch)
  compiled = run.compile(run.train_step(shardings), state, batch)
  memory = compiled_memory(compiled) or {}
  return dict(variant=variant, length=length, num_layers=num_layers, stack=stack,
              remat_policy=STACKS[stack]["remat_policy"], batch_size=batch_size, memory=memory,
              temp_bytes=memory.get("temp_size_in_bytes"),
              argument_bytes=memory.get("argument_size_in_bytes"))


def growth_per_layer(records: List[Dict[str, Any]], stack: str) -> float:
  """The least-squares slope of temporaries (bytes) against depth for `stack`."""
  rows = [(r["num_layers"], r["temp_bytes"]) for r in records if r["stack"] == stack]
  if len(rows) < 2:
    return float("nan")
  depths, temps = np.array(rows, dtype=np.float64).T
  return float(np.polyfit(depths, temps, 1)[0])


def define_flags(flag_values: flags.FlagValues, argv: Sequence[str]) -> None:
  """This script's flags (see `experiments.cli`)."""
  del argv  # only config flags read it
  flags.DEFINE_string("variant", "dot_product", "the attention variant of every layer",
                      flag_values=flag_values)
  flags.DEFINE_integer("length", 1024, "sequence length T", lower_bound=1,
                       flag_values=flag_values)
  cli.DEFINE_list_of(flags.IntegerParser(lower_bound=1), "num_layers", [2, 4, 8, 16],
                     "depths", flag_values=flag_values)
  cli.DEFINE_list_of(flags.EnumParser(list(STACKS)), "stacks", list(STACKS), "stacks",
                     flag_values=flag_values)
  flags.DEFINE_integer("batch", 2, "examples per step", lower_bound=1, flag_values=flag_values)
  flags.DEFINE_string("out", None, "the JSON file to write (the table goes next to it, .txt)",
                      flag_values=flag_values)


def benchmark(args: cli.Args) -> int:
  """Compiles every cell, prints a table with ratios, writes the JSON and the table."""
  from attention_jax.train.provenance import device_summary, git_revision  # pylint: disable=g-import-not-at-top
  lines: List[str] = []

  def emit(line: str) -> None:
    print(line, flush=True)
    lines.append(line)

  emit(f"train step of the text model, {args.variant}, T={args.length}, batch {args.batch}: "
       f"XLA temporaries (MiB) and the ratio to the standard stack")
  emit(f"{'layers':>6} " + " ".join(f"{stack:>22}" for stack in args.stacks))
  records = []
  for num_layers in args.num_layers:
    row = {stack: compile_step(args.variant, args.length, num_layers, stack,
                               batch_size=args.batch) for stack in args.stacks}
    baseline = row.get("standard")
    cells = []
    for stack, record in row.items():
      if baseline is not None:
        record["temp_ratio_to_standard"] = record["temp_bytes"] / baseline["temp_bytes"]
      records.append(record)
      cells.append(f"{record['temp_bytes'] / MIB:>12.1f} "
                   f"({record.get('temp_ratio_to_standard', float('nan')):>5.2f}x)")
    emit(f"{num_layers:>6} " + " ".join(f"{cell:>22}" for cell in cells))
  growth = {stack: growth_per_layer(records, stack) for stack in args.stacks}
  emit(f"{'MiB/layer':>6} " + " ".join(f"{growth[stack] / MIB:>22.2f}" for stack in args.stacks))
  if args.out:
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(git_revision=git_revision(), devices=device_summary(),
                                   command=" ".join(["python -m experiments.benchmark_reversible"]
                                                    + sys.argv[1:]),
                                   temp_growth_bytes_per_layer=growth, records=records),
                              indent=1, sort_keys=True) + "\n")
    out.with_suffix(".txt").write_text("\n".join(lines) + "\n")
  return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
  """This script from Python: `argv` and errors as in `cli.parse`."""
  return benchmark(cli.parse(define_flags, argv, __name__))


if __name__ == "__main__":
  cli.run(define_flags, benchmark)
