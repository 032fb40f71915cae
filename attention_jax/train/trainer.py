"""The training loop: from a config and a workdir to checkpoints, metrics and a
results file.

  results = train_and_evaluate(config, workdir)

Everything a run needs to continue lives in the workdir: `config.json` (what
the run computes; a restart with a different config is refused), orbax
checkpoints under `checkpoints/`, `metrics.jsonl` and TensorBoard events, and
at the end `results.json`. A run killed at any moment and started again with
the same command restores its latest checkpoint and continues to the same
parameters and metrics as a run that was never stopped: batch `s` and the
dropout keys of step `s` are functions of (seed, s) alone.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import math
import pathlib
import subprocess
import time
from typing import Any, Dict, Iterator, Optional

import jax
import ml_collections
import numpy as np

from attention_jax import data as lra_data
from attention_jax.models import build_model
from attention_jax.train import partitioning
from attention_jax.train.checkpoints import Checkpointer
from attention_jax.train.config import check_config, config_differences
from attention_jax.train.metrics import MetricsLogger, peak_memory
from attention_jax.train.objectives import get_objective
from attention_jax.train.optim import make_optimizer
from attention_jax.train.state import abstract_state_and_shardings, create_sharded_state
from attention_jax.train.steps import make_eval_step, make_train_step, summarize_eval

CONFIG_FILE = "config.json"
RESULTS_FILE = "results.json"


class WorkdirConflictError(ValueError):
  """The workdir holds a run of a different config."""


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str | pathlib.Path, *,
                       overwrite: bool = False) -> Dict[str, Any]:
  """Trains `config` in `workdir` (resuming what is there) and returns the results.

  Args:
    config: a config built on `attention_jax.train.config.default_config()`.
    workdir: where the run keeps its config, checkpoints, metrics and results.
    overwrite: when the workdir holds a run of a different config, move it aside
      to `<workdir>.replaced-<time>` and start afresh (otherwise an error).

  Returns:
    The contents of `results.json` (read back, without training, when the
    workdir holds a finished run of this config).

  Raises:
    ValueError: on an unknown config key or name, a mesh shape that does not fit
      the devices, a batch size that does not split over the data axes, or
      (`WorkdirConflictError`) a workdir holding a different run. All of these
      are raised before anything is compiled or written.
  """
  # orbax needs absolute checkpoint paths.
  workdir = pathlib.Path(workdir).absolute()
  config = _completed(config)
  mesh = partitioning.make_mesh(config.mesh_shape)
  partitioning.check_batch_size(config.batch_size, mesh)
  partitioning.check_batch_size(config.eval_batch_size, mesh)
  model = build_model(config.model)
  objective = get_objective(config.model.kind)
  optimizer = make_optimizer(config.optimizer)
  _claim_workdir(workdir, config, overwrite)
  if (workdir / RESULTS_FILE).is_file():  # This run finished before.
    return json.loads((workdir / RESULTS_FILE).read_text())

  task = lra_data.get_task(config.task, **task_options(config))
  data_dir = task_data_dir(config)
  if config.prepare_data:
    task.prepare(data_dir, progress=config.progress and jax.process_index() == 0)
  splits = task.splits(data_dir)
  host = dict(process_index=jax.process_index(), process_count=jax.process_count())
  batch_sharding = partitioning.batch_sharding(mesh)
  example_batch = next(lra_data.batches(splits["train"], batch_size=config.batch_size,
                                        seed=config.seed, **host))

  abstract_state, shardings = abstract_state_and_shardings(model, optimizer, example_batch, mesh,
                                                           objective=objective)
  checkpointer = Checkpointer(workdir / "checkpoints", keep=config.keep_checkpoints,
                              best_metric="accuracy", best_mode="max",
                              async_save=config.async_checkpoints)
  restored = checkpointer.restore(abstract_state, shardings)
  if restored is None:
    state, _ = create_sharded_state(model, optimizer, example_batch, mesh,
                                    rng=jax.random.key(config.seed), objective=objective)
    start_step = 0
  else:
    state, start_step = restored
  train_step = make_train_step(model, optimizer, mesh, shardings, seed=config.seed,
                               rng_streams=tuple(config.rng_streams), objective=objective)
  eval_step = make_eval_step(model, mesh, shardings, objective=objective)

  def evaluate(state, split: str) -> Dict[str, float]:
    source = splits[split]
    num_steps = config.eval_steps or math.ceil(len(source) / config.eval_batch_size)
    sums = None
    for batch in lra_data.batches(source, batch_size=config.eval_batch_size, seed=0,
                                  shuffle=False, num_steps=num_steps, **host):
      out = eval_step(state, partitioning.shard_batch(batch, batch_sharding))
      sums = out if sums is None else jax.tree.map(lambda a, b: a + b, sums, out)
    return summarize_eval(sums)

  total = config.num_train_steps
  tokens_per_example = sum(example_batch[key].shape[1] for key in objective.sequence_keys)
  logger = MetricsLogger(workdir, total_steps=total, start_step=start_step,
                         progress=config.progress,
                         description=f"{config.task}/{config.model.attention}")
  if start_step:
    logger.message(f"resumed from the checkpoint of step {start_step} in {workdir}")
  train_batches: Iterator[Dict[str, np.ndarray]] = lra_data.batches(
      splits["train"], batch_size=config.batch_size, seed=config.seed, start_step=start_step,
      **host)

  # Throughput counts the time in train steps only, without the first step of
  # this process (compilation), evaluation and checkpointing.
  timer = _StepTimer()
  compile_s = None
  train_sums: Dict[str, Any] = {}
  last_train: Dict[str, float] = {}
  validation: Dict[str, float] = {}
  for step in range(start_step + 1, total + 1):
    batch = partitioning.shard_batch(next(train_batches), batch_sharding)
    if compile_s is None:
      started = time.perf_counter()
      state, metrics = train_step(state, batch)
      jax.block_until_ready(metrics)
      compile_s = time.perf_counter() - started
      timer.restart()
    else:
      state, metrics = train_step(state, batch)
      timer.count()
    # Device-side running sums: no host sync until a record is written.
    weighted = dict(loss=metrics["loss"] * metrics["count"],
                    accuracy=metrics["accuracy"] * metrics["count"], count=metrics["count"])
    train_sums = weighted if not train_sums else jax.tree.map(lambda a, b: a + b, train_sums,
                                                              weighted)

    if step % config.log_every == 0 or step == total:
      count = max(float(train_sums["count"]), 1e-8)
      steps_per_s = timer.rate()
      last_train = dict(loss=float(train_sums["loss"]) / count,
                        accuracy=float(train_sums["accuracy"]) / count,
                        grad_norm=float(metrics["grad_norm"]),
                        learning_rate=float(_learning_rate(config, step)))
      if steps_per_s:
        last_train.update(steps_per_s=steps_per_s,
                          examples_per_s=steps_per_s * config.batch_size,
                          tokens_per_s=steps_per_s * config.batch_size * tokens_per_example)
      last_train.update(peak_memory())
      logger.write(step, "train", last_train)
      train_sums = {}
    logger.advance(step, **({"loss": last_train["loss"]} if last_train else {}))

    evaluated = step % config.eval_every == 0 or step == total
    if evaluated or step % config.checkpoint_every == 0:
      # Dispatch is asynchronous: wait for the train steps to finish before
      # stopping their clock.
      jax.block_until_ready(state)
    if evaluated:
      timer.pause()
      validation = evaluate(state, "validation")
      logger.write(step, "validation", validation)
      timer.resume()
    if evaluated or step % config.checkpoint_every == 0:
      timer.pause()
      # Every eval step is checkpointed with its metrics, so the best
      # checkpoint is the best evaluated state.
      checkpointer.save(step, state, metrics=validation if evaluated else None)
      timer.resume()
  checkpointer.wait_until_finished()

  if not validation:  # Restarted after the final step: nothing left to train.
    validation = evaluate(state, "validation")
  steps_per_s = timer.rate()
  results_metrics: Dict[str, Any] = dict(
      train=last_train, validation=validation, num_params=_num_params(state.params),
      compile_s=compile_s, steps_per_s=steps_per_s, steps_timed=timer.steps, **peak_memory())
  if steps_per_s:
    results_metrics.update(examples_per_s=steps_per_s * config.batch_size,
                           tokens_per_s=steps_per_s * config.batch_size * tokens_per_example)
  best = checkpointer.restore_best(abstract_state, shardings)
  if best is not None:
    best_state, best_step = best
    results_metrics["best_validation"] = dict(step=best_step, **evaluate(best_state,
                                                                        "validation"))
    if config.test_at_end and "test" in splits:
      test = evaluate(best_state, "test")
      logger.write(best_step, "test", test)
      results_metrics["test"] = dict(step=best_step, **test)
  checkpointer.close()
  logger.close()

  results = dict(config=config.to_dict(), git_revision=git_revision(),
                 devices=device_summary(), mesh=dict(mesh.shape), num_train_steps=total,
                 resumed_from=start_step or None,
                 finished=datetime.datetime.now(datetime.timezone.utc).isoformat(),
                 metrics=results_metrics)
  if jax.process_index() == 0:
    _write_json(workdir / RESULTS_FILE, results)
  return results


def task_options(config: ml_collections.ConfigDict) -> Dict[str, Any]:
  """The task's make_task options: those the config sets (not None)."""
  return {key: value for key, value in dict(config.task_options).items() if value is not None}


def task_data_dir(config: ml_collections.ConfigDict) -> pathlib.Path:
  """Where the config's task data lives: `data_dir` itself for the task's
  default options (what `experiments.make_data --task <name>` writes), else a
  subfolder named by a hash of the options, so that a smoke-sized set and the
  full set never overwrite or stand in for each other."""
  # Where the data is read from, and how fast, do not change what it is.
  options = {key: value for key, value in task_options(config).items()
             if key not in ("release_dir", "data_dir_tfds", "download", "workers")}
  if not options:
    return pathlib.Path(config.data_dir)
  digest = hashlib.sha256(json.dumps(options, sort_keys=True, default=str).encode()).hexdigest()
  folder = pathlib.Path(config.data_dir) / f"{config.task}-{digest[:10]}"
  if jax.process_index() == 0:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "task_options.json").write_text(json.dumps(options, indent=1, sort_keys=True,
                                                         default=str) + "\n")
  return folder


def _completed(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """A checked copy of `config` with the task's sizes filled into the model."""
  check_config(config)
  config = ml_collections.ConfigDict(config.to_dict())  # unlocked copy, references resolved
  info = lra_data.get_task(config.task, **task_options(config)).info
  if info.dual != (config.model.kind == "dual_classifier"):
    expected = "dual_classifier" if info.dual else "classifier' or 'language_model"
    raise ValueError(f"task {config.task!r} needs model.kind '{expected}', got "
                     f"{config.model.kind!r}.")
  filled = dict(vocab_size=info.vocab_size, num_classes=info.num_classes,
                max_length=info.seq_len)
  for key, value in filled.items():
    if config.model[key] is None:
      config.model[key] = value
  if config.model.vocab_size < info.vocab_size:
    raise ValueError(f"model.vocab_size={config.model.vocab_size} is smaller than task "
                     f"{config.task!r}'s vocabulary of {info.vocab_size} tokens.")
  if config.model.kind != "language_model" and config.model.num_classes != info.num_classes:
    raise ValueError(f"model.num_classes={config.model.num_classes} but task {config.task!r} "
                     f"has {info.num_classes} classes.")
  if config.model.max_length < info.seq_len:
    raise ValueError(f"model.max_length={config.model.max_length} is shorter than task "
                     f"{config.task!r}'s sequences of {info.seq_len} tokens.")
  if config.eval_batch_size is None:
    config.eval_batch_size = config.batch_size
  # num_train_steps counts batches; the optimiser's schedule counts updates,
  # one per `grad_accum_steps` batches.
  accum = int(config.optimizer.grad_accum_steps)
  if config.num_train_steps % accum:
    raise ValueError(f"num_train_steps={config.num_train_steps} must be a multiple of "
                     f"optimizer.grad_accum_steps={accum}.")
  config.optimizer.num_train_steps = config.num_train_steps // accum
  return config


def _claim_workdir(workdir: pathlib.Path, config: ml_collections.ConfigDict,
                   overwrite: bool) -> None:
  """Writes the config into the workdir, or checks it against the run there."""
  saved_path = workdir / CONFIG_FILE
  current = json.loads(config.to_json())
  if saved_path.is_file():
    saved = json.loads(saved_path.read_text())
    differences = config_differences(saved, current)
    # A run that stopped before writing any metrics or checkpoint (e.g. a config
    # its variant refused at the first trace) leaves nothing to protect.
    holds_a_run = (workdir / "metrics.jsonl").exists() or any(
        path.name.isdigit() for path in (workdir / "checkpoints").glob("*"))
    if differences and not holds_a_run:
      differences = []
    if differences and not overwrite:
      listed = "; ".join(f"{key}: {old!r} there, {new!r} now" for key, old, new in
                         differences[:8])
      raise WorkdirConflictError(
          f"workdir {workdir} holds a run of a different config ({listed}"
          f"{'; ...' if len(differences) > 8 else ''}). Use another workdir, or overwrite=True "
          f"(--overwrite) to move that run aside to {workdir}.replaced-<time> and start afresh.")
    if differences and jax.process_index() == 0:
      stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
      workdir.rename(workdir.with_name(f"{workdir.name}.replaced-{stamp}"))
  if jax.process_index() == 0:
    workdir.mkdir(parents=True, exist_ok=True)
    _write_json(saved_path, current)


def _write_json(path: pathlib.Path, value: Any) -> None:
  partial = path.with_name(path.name + ".partial")
  partial.write_text(json.dumps(value, indent=2, sort_keys=True, default=str) + "\n")
  partial.replace(path)


def _learning_rate(config: ml_collections.ConfigDict, step: int) -> float:
  from attention_jax.train.optim import make_schedule  # pylint: disable=g-import-not-at-top
  updates = step // max(int(config.optimizer.grad_accum_steps), 1)
  return float(make_schedule(config.optimizer)(updates))


def _num_params(params: Any) -> int:
  return int(sum(np.prod(leaf.shape) for leaf in jax.tree.leaves(params)))


class _StepTimer:
  """Wall time spent in train steps, excluding paused stretches."""

  def __init__(self):
    self.steps, self.seconds = 0, 0.0
    self._since: Optional[float] = None

  def restart(self):
    self._since = time.perf_counter()

  def count(self):
    self.steps += 1

  def pause(self):
    if self._since is not None:
      self.seconds += time.perf_counter() - self._since
      self._since = None

  def resume(self):
    self._since = time.perf_counter()

  def rate(self) -> Optional[float]:
    """Steps per second so far (None before any timed step)."""
    seconds = self.seconds + (time.perf_counter() - self._since if self._since else 0.0)
    return self.steps / seconds if self.steps and seconds > 0 else None


def git_revision() -> Optional[str]:
  """The commit of the checkout this package runs from ("+dirty" with local
  changes), or None outside a git checkout."""
  root = pathlib.Path(__file__).resolve().parents[2]
  try:
    revision = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                           capture_output=True, text=True, timeout=10).stdout.strip()
  except (OSError, subprocess.SubprocessError):
    return None
  return revision + ("+dirty" if dirty else "")


def device_summary() -> Dict[str, Any]:
  """The devices a run used: kind, platform, counts."""
  device = jax.devices()[0]
  return dict(kind=device.device_kind, platform=device.platform, count=jax.device_count(),
              local_count=jax.local_device_count(), process_count=jax.process_count())
