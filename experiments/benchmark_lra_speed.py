r"""The LRA paper's efficiency benchmark (Tay et al. 2020, Table 2) for one cell.

  python -m experiments.benchmark_lra_speed --variant=performer --length=4096 --batch=4 \
      --out=results/lra_speed/runs/performer/len4096/results.json

Times train steps of the byte-level text classifier (the model settings of
`configs/lra/text.py`: 4 layers of width 256, 4 heads, MLP 1024) at one
sequence length on random byte tokens, so no dataset is needed. The step is the
trainer's own (`attention_jax.train.run.build_run`): AdamW, gradient and all.
One variant and length per process, so that the peak memory is that cell's
alone; `experiments.reproduce` runs the grid of `configs/tables/lra_speed.py`
cell by cell.

What is recorded in the results file (JSON):

* `steps_per_s`: one over the median time of the `--steps` timed steps (each
  waited for), after compilation and `--warmup` untimed steps; every step's
  time is in `step_times_ms`;
* `memory`: the cell's peak memory. On GPU/TPU the allocator's
  `peak_bytes_in_use`; on CPU, whose backend keeps no statistics, XLA's
  compiled memory analysis of the train step (arguments + temporaries +
  outputs not aliased to the donated state), which is what a device would have
  to hold. The process's peak RSS during the timed steps is recorded beside it.
* `status`: "ok"; "oom" when the step ran out of memory; "refused" when XLA's
  analysis says the step needs more than this machine's RAM (it is then not
  run). Such cells still exit 0: their status is the result.

Several cells may compile side by side on one accelerator (compilation is CPU
work, a lent GPU's time is short) and still be timed one at a time: with
`ATTENTION_JAX_TIMING_LOCK=<file>` in the environment, a cell runs its warm-up
and timed steps holding an exclusive lock on that file, and records how long it
waited for it (`timing_lock`). Another cell's compilation may still launch
autotuning kernels on the device meanwhile, which is why the step is the
median of several.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import os
import pathlib
import sys
import time
from typing import Any, Dict, Optional, Sequence

from absl import flags

from experiments import cli

TEXT_CONFIG = "configs/lra/text.py"
REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]


def text_model_config(variant: str, length: int,
                      overrides: Optional[Dict[str, Any]] = None) -> Any:
  """The text task's config (`configs/lra/text.py`, no preset) for `variant` at
  sequence length `length`, with the nested `overrides` merged in (as
  `configs/tables/cell.py` does, e.g. `{"model": {"pooling": "mean"}}`).

  Raises:
    ValueError: on an unknown variant or a length below 1.
  """
  from attention_jax import data as lra_data  # pylint: disable=g-import-not-at-top
  from attention_jax.train.config import load_config_module  # pylint: disable=g-import-not-at-top
  if not isinstance(length, int) or length < 1:
    raise ValueError(f"length must be a positive integer, got {length!r}.")
  config = load_config_module(REPO_ROOT / TEXT_CONFIG).get_config(variant)
  if overrides:
    cell = load_config_module(REPO_ROOT / "configs" / "tables" / "cell.py")
    with config.unlocked():
      cell.merge(config, overrides)
  info = lra_data.get_task("text", seq_len=length).info
  model = config.model
  model.vocab_size, model.num_classes, model.max_length = info.vocab_size, info.num_classes, length
  return config


@contextlib.contextmanager
def timing_lock(record: Dict[str, Any]):
  """Holds the exclusive lock named by $ATTENTION_JAX_TIMING_LOCK, if set, and
  records its path and the seconds waited for it in `record["timing_lock"]`."""
  path = os.environ.get("ATTENTION_JAX_TIMING_LOCK")
  if not path:
    yield
    return
  started = time.perf_counter()
  with open(path, "a") as lock_file:
    fcntl.flock(lock_file, fcntl.LOCK_EX)
    record["timing_lock"] = dict(path=path, waited_s=time.perf_counter() - started)
    try:
      yield
    finally:
      fcntl.flock(lock_file, fcntl.LOCK_UN)


def measure(variant: str, length: int, batch_size: int, steps: int = 10, warmup: int = 2,
            seed: int = 0, overrides: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
  """Compiles and times the text model's train step for one (variant, length).

  Args:
    variant: a registry name.
    length: tokens per example, T.
    batch_size: examples per step, B (the batch is `[B, T]` random bytes).
    steps: timed steps (>= 1).
    warmup: untimed steps after compilation (>= 0).
    seed: of the parameters and the random tokens.
    overrides: nested config overrides (see `text_model_config`).

  Returns:
    The record written to the results file (see the module docstring); on
    running out of memory `status` is "oom" and `error` the message.

  Raises:
    ValueError: on an unknown variant or a non-positive size.
  """
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from attention_jax.train import partitioning  # pylint: disable=g-import-not-at-top
  from attention_jax.train.run import build_run  # pylint: disable=g-import-not-at-top
  # pylint: disable-next=g-import-not-at-top
  from attention_jax.train.provenance import device_summary, git_revision
  from experiments import benchmark_attention as bench  # pylint: disable=g-import-not-at-top

  for name, value, minimum in (("batch_size", batch_size, 1), ("steps", steps, 1),
                               ("warmup", warmup, 0)):
    if not isinstance(value, int) or value < minimum:
      raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}.")
  config = text_model_config(variant, length, overrides)
  config.seed = seed  # of the parameters and the train step's dropout
  record: Dict[str, Any] = dict(
      variant=variant, length=length, batch_size=batch_size, steps=steps, warmup=warmup,
      overrides=overrides or {},
      model={k: config.model[k] for k in ("num_layers", "embed_dim", "num_heads", "mlp_dim",
                                          "pooling")},
      devices=device_summary(), git_revision=git_revision(), status="ok", error=None)
  on_cpu = jax.default_backend() == "cpu"
  try:
    run = build_run(config, devices=jax.devices()[:1])
    rng = np.random.default_rng(seed)
    host_batch = dict(
        inputs=rng.integers(1, config.model.vocab_size, (batch_size, length), dtype=np.int32),
        label=rng.integers(0, config.model.num_classes, (batch_size,), dtype=np.int32),
        weight=np.ones((batch_size,), np.float32))
    batch = partitioning.shard_batch(host_batch, partitioning.batch_sharding(run.mesh))
    state, shardings = run.init_state(host_batch)
    train_step = run.train_step(shardings)
    started = time.perf_counter()
    compiled = run.compile(train_step, state, batch)  # for XLA's memory analysis
    record["compile_s"] = time.perf_counter() - started
    analysed = bench.compiled_memory(compiled)
    record["compiled_memory"] = analysed
    if analysed:
      needed = sum(analysed.get(f, 0) for f in ("argument_size_in_bytes", "temp_size_in_bytes",
                                                 "output_size_in_bytes"))
      record["compiled_memory_bytes"] = needed - analysed.get("alias_size_in_bytes", 0)
    if on_cpu:
      try:
        bench.check_fits_in_memory(analysed, "process")
      except MemoryError as e:
        record.update(status="refused", error=str(e))
        return record
    step_seconds = []
    with timing_lock(record):
      for _ in range(warmup):
        state, metrics = train_step(state, batch)
      jax.block_until_ready(state)
      with bench.PeakMemory("process" if on_cpu else "device") as peak:
        for _ in range(steps):
          started = time.perf_counter()
          state, metrics = train_step(state, batch)
          jax.block_until_ready((state, metrics))
          step_seconds.append(time.perf_counter() - started)
    # The median step, not the mean: one step slowed by another process on a
    # shared machine then moves nothing.
    median = float(np.median(step_seconds))
    record.update(steps_per_s=1.0 / median, step_ms=1e3 * median,
                  step_times_ms=[1e3 * s for s in step_seconds],
                  loss=float(metrics["loss"]), rss=peak.result if on_cpu else None)
    if on_cpu:
      record["memory"] = dict(bytes=record.get("compiled_memory_bytes"),
                              source="xla_memory_analysis")
    else:
      stats = bench.device_memory(jax.devices()[0])
      record["memory"] = dict(bytes=stats.get("peak_bytes_in_use"), source="device")
  except MemoryError as e:
    record.update(status="oom", error=str(e))
  except Exception as e:  # pylint: disable=broad-except
    if "RESOURCE_EXHAUSTED" not in str(e) and "out of memory" not in str(e).lower():
      raise
    record.update(status="oom", error=str(e).splitlines()[0][:500])
  return record


def define_flags(flag_values: flags.FlagValues, argv: Sequence[str]) -> None:
  """This script's flags (see `experiments.cli`)."""
  del argv  # only config flags read it
  flags.DEFINE_string("variant", None, "a registry name, e.g. performer", flag_values=flag_values)
  flags.DEFINE_integer("length", None, "sequence length T", flag_values=flag_values)
  flags.DEFINE_integer("batch", 32, "batch size (the paper's: 32)", flag_values=flag_values)
  flags.DEFINE_integer("steps", 10, "timed train steps", flag_values=flag_values)
  flags.DEFINE_integer("warmup", 2, "untimed steps after compiling", flag_values=flag_values)
  flags.DEFINE_integer("seed", 0, "of the parameters and the random tokens",
                       flag_values=flag_values)
  flags.DEFINE_string("overrides", "{}", 'nested config overrides as JSON, e.g. {"model": '
                      '{"pooling": "mean"}}', flag_values=flag_values)
  flags.DEFINE_string("out", None, "the results file to write (JSON)", flag_values=flag_values)
  flags.mark_flags_as_required(["variant", "length", "out"], flag_values=flag_values)


def benchmark(args: cli.Args) -> int:
  """Measures one cell and writes its results file; 2 on bad arguments."""
  try:
    overrides = json.loads(args.overrides)
    record = measure(args.variant, args.length, args.batch, args.steps, args.warmup, args.seed,
                     overrides)
  except ValueError as e:  # json.JSONDecodeError is a ValueError too.
    print(f"error: {e}", file=sys.stderr)
    return 2
  record["finished"] = datetime.datetime.now(datetime.timezone.utc).isoformat()
  out = pathlib.Path(args.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  partial = out.with_name(out.name + ".partial")
  partial.write_text(json.dumps(record, indent=2, sort_keys=True, default=str) + "\n")
  partial.replace(out)
  summary = {k: record.get(k) for k in ("variant", "length", "status", "steps_per_s")}
  summary["memory_mib"] = ((record.get("memory") or {}).get("bytes") or 0) / 2**20
  print(json.dumps(summary))
  return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
  """This script from Python: `argv` and errors as in `cli.parse`."""
  return benchmark(cli.parse(define_flags, argv, __name__))


if __name__ == "__main__":
  cli.run(define_flags, benchmark)
