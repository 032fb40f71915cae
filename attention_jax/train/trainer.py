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

Two ways a run stops early on purpose, both leaving it ready to resume:

- SIGINT or SIGTERM: the current step finishes, is checkpointed (the save is
  waited for) and `TrainingInterrupted` is raised; the same command resumes
  from exactly that step. A second signal stops at once, as it would have.
  With several processes, all stop after the next step at which they already
  wait for the device (a train record, evaluation or checkpoint).
- a NaN or infinite training loss (or gradient norm): `TrainingDivergedError`,
  naming the step and the last checkpoint written before it.
"""

from __future__ import annotations

import datetime
import json
import math
import pathlib
import time
from typing import Any, Dict, Iterator, Optional

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from attention_jax import data as lra_data
from attention_jax.train import partitioning, pretrain
from attention_jax.train.checkpoints import Checkpointer
from attention_jax.train.completion import complete_config
from attention_jax.train.lengths import prepare_length_evals
from attention_jax.train.metrics import MetricsLogger, peak_memory
from attention_jax.train.provenance import device_summary, git_revision
from attention_jax.train.run import build_run
from attention_jax.train.signals import StopRequests, TrainingInterrupted
from attention_jax.train.state import MEMORY_COLLECTION
from attention_jax.train.steps import summarize_eval
from attention_jax.train.task_data import prepare_splits
from attention_jax.train.workdir import (RESULTS_FILE, check_workdir_path, claim_workdir,
                                         write_json)


class TrainingDivergedError(RuntimeError):
  """A train step's loss or gradient norm was NaN or infinite.

  Attributes:
    step: the first such step.
    loss, grad_norm: that step's values.
    checkpoint_step, checkpoint_path: the newest checkpoint, written before
      `step` (None when there is none).
  """

  def __init__(self, *, step: int, loss: float, grad_norm: float,
               checkpoint_step: Optional[int], checkpoint_path: Optional[str]):
    self.step, self.loss, self.grad_norm = step, loss, grad_norm
    self.checkpoint_step, self.checkpoint_path = checkpoint_step, checkpoint_path
    if checkpoint_step is None:
      last_good = "no checkpoint was written before it"
    else:
      last_good = f"the last good checkpoint is step {checkpoint_step} at {checkpoint_path}"
    super().__init__(
        f"training diverged: the loss was {loss} (gradient norm {grad_norm}) at step {step}; "
        f"{last_good}. The same config resumed from it repeats the same steps: change it "
        f"(e.g. a lower optimizer.learning_rate) in a new workdir.")


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str | pathlib.Path, *,
                       overwrite: bool = False, handle_signals: bool = True) -> Dict[str, Any]:
  """Trains `config` in `workdir` (resuming what is there) and returns the results.

  Args:
    config: a config built on `attention_jax.train.config.default_config()`.
    workdir: where the run keeps its config, checkpoints, metrics and results.
    overwrite: when the workdir holds a run of a different config, move it aside
      to `<workdir>.replaced-<time>` and start afresh (otherwise an error).
    handle_signals: while training, take SIGINT and SIGTERM as a request to
      checkpoint the current step and stop (`TrainingInterrupted`). Only
      possible in the main thread; elsewhere the signals act as before. With
      several processes, a signal to any of them stops all after the same
      step: the next train record, evaluation or checkpoint step.

  Returns:
    The contents of `results.json` (read back, without training, when the
    workdir holds a finished run of this config).

  Raises:
    ValueError: on an unknown config key or name, a mesh shape that does not fit
      the devices, a batch size that does not split over the data axes, or
      (`WorkdirConflictError`) a workdir holding a different run. All of these
      are raised before anything is compiled or written; likewise a workdir
      that is an existing file.
    TrainingDivergedError: a train loss or gradient norm was NaN or infinite.
    TrainingInterrupted: SIGINT or SIGTERM (with `handle_signals`).
  """
  # -- The run: every check before anything is compiled or written. --
  # orbax needs absolute checkpoint paths.
  workdir = pathlib.Path(workdir).absolute()
  check_workdir_path(workdir)
  config = complete_config(config)
  run = build_run(config)
  # Self-pretraining's first phase, checked now like the run itself.
  phase = pretrain.checked_phase(config) if pretrain.enabled(config) else None
  claim_workdir(workdir, config, overwrite)
  if (workdir / RESULTS_FILE).is_file():  # This run finished before.
    return json.loads((workdir / RESULTS_FILE).read_text())

  # -- Data and state: restored from the latest checkpoint, or initialised. --
  task, splits = prepare_splits(config)
  host = dict(process_index=jax.process_index(), process_count=jax.process_count())
  batch_sharding = partitioning.batch_sharding(run.mesh)
  # A stream task's rows continue from step to step, and a model's memory with them.
  stream = task.info.stream
  memory_rows = config.batch_size if stream else None
  example_batch = next(lra_data.stream_batches(splits["train"], batch_size=config.batch_size,
                                               **host) if stream else
                       lra_data.batches(splits["train"], batch_size=config.batch_size,
                                        seed=config.seed, **host))

  abstract_state, shardings = run.abstract_state(example_batch, memory_rows=memory_rows)
  # The task at the longer lengths of `length_eval` (none by default), its
  # data made and the model checked now, so that a bad length costs no training.
  length_evals = prepare_length_evals(config, run, task.info.seq_len, abstract_state,
                                      shardings, memory_rows)
  # Self-pretraining: the first phase is a run of its own in <workdir>/pretrain/
  # (resumed, or read back when finished); its encoder starts this one, which
  # checks now that it can take it.
  pretrained = None
  if phase is not None:
    phase_state, phase_shardings = build_run(phase).abstract_state(example_batch,
                                                                   memory_rows=memory_rows)
    pretrain.check_handover(abstract_state.params["encoder"], phase_state.params["encoder"])
    pretrained = train_and_evaluate(phase, workdir / pretrain.PRETRAIN_DIR, overwrite=overwrite,
                                    handle_signals=handle_signals)
  checkpointer = Checkpointer(workdir / "checkpoints", keep=config.keep_checkpoints,
                              best_metric="accuracy", best_mode="max",
                              async_save=config.async_checkpoints)
  restored = checkpointer.restore(abstract_state, shardings)
  if restored is None:
    state, _ = run.init_state(example_batch, memory_rows=memory_rows)
    start_step = 0
    if pretrained is not None:  # the handover, once: a resumed run has its own checkpoint
      state = pretrain.hand_over(state, pretrain.pretrained_encoder(
          workdir, phase_state, phase_shardings))
  else:
    state, start_step = restored
  train_step = run.train_step(shardings)
  eval_step = run.eval_step(shardings, eval_groups=task.info.eval_groups)

  # -- Evaluation: a split's batches through the eval step, summed on the device. --
  def evaluate(state, split: str, splits=splits, eval_step=eval_step) -> Dict[str, float]:
    source = splits[split]
    if stream:
      # The split's own streams, from an empty memory (its "filled" counts 0).
      num_steps = config.eval_steps or len(source) // config.batch_size
      batches = lra_data.stream_batches(source, batch_size=config.batch_size,
                                        num_steps=num_steps, **host)
      if MEMORY_COLLECTION in state.collections:
        empty = jax.tree.map(jnp.zeros_like, state.collections[MEMORY_COLLECTION])
        state = state.replace(collections={**state.collections, MEMORY_COLLECTION: empty})
    else:
      num_steps = config.eval_steps or math.ceil(len(source) / config.eval_batch_size)
      batches = lra_data.batches(source, batch_size=config.eval_batch_size, seed=0,
                                 shuffle=False, num_steps=num_steps, **host)
    sums = None
    for batch in batches:
      out = eval_step(state, partitioning.shard_batch(batch, batch_sharding))
      if isinstance(out, tuple):  # (sums, the memory after this batch)
        out, memory = out
        state = state.replace(collections={**state.collections, MEMORY_COLLECTION: memory})
      sums = out if sums is None else jax.tree.map(lambda a, b: a + b, sums, out)
    summary = summarize_eval(sums)
    if run.objective.name == "next_token":
      summary["bits_per_token"] = summary["loss"] / math.log(2)
    return summary

  # -- Logging, and the train batches from the step after the restored one. --
  total = config.num_train_steps
  tokens_per_example = sum(example_batch[key].shape[1] for key in run.objective.sequence_keys)
  logger = MetricsLogger(workdir, total_steps=total, start_step=start_step,
                         progress=config.progress,
                         description=f"{config.task}/{config.model.attention}")
  if start_step:
    logger.message(f"resumed from the checkpoint of step {start_step} in {workdir}")
  train_batches: Iterator[Dict[str, np.ndarray]] = (
      lra_data.stream_batches(splits["train"], batch_size=config.batch_size,
                              start_step=start_step, **host) if stream else
      lra_data.batches(splits["train"], batch_size=config.batch_size, seed=config.seed,
                       start_step=start_step, **host))

  # Throughput counts the time in train steps only, without the first step of
  # this process (compilation), evaluation and checkpointing.
  timer = _StepTimer()
  compile_s = None
  # Device-side running sums of the train metrics since the last record (None
  # right after one); see `_accumulate`.
  train_sums: Optional[Dict[str, jax.Array]] = None
  last_train: Dict[str, float] = {}
  validation: Dict[str, float] = {}

  def write_train_record(step: int, sums: Dict[str, jax.Array], metrics: Dict[str, jax.Array]):
    nonlocal last_train
    # One transfer for the record's device values.
    host_sums, grad_norm = jax.device_get((sums, metrics["grad_norm"]))
    count = max(float(host_sums["count"]), 1e-8)
    steps_per_s = timer.rate()
    # The loss is the cross-entropy plus the losses modules sow (aux_loss:
    # e.g. disagreement regularisers, span penalties), logged apart.
    last_train = dict(loss=float(host_sums["loss"]) / count,
                      cross_entropy=float(host_sums["cross_entropy"]) / count,
                      aux_loss=float(host_sums["aux_loss"]) / count,
                      accuracy=float(host_sums["accuracy"]) / count,
                      grad_norm=float(grad_norm),
                      learning_rate=float(_learning_rate(config, step)))
    if steps_per_s:
      last_train.update(steps_per_s=steps_per_s,
                        examples_per_s=steps_per_s * config.batch_size,
                        tokens_per_s=steps_per_s * config.batch_size * tokens_per_example)
    last_train.update(peak_memory())
    logger.write(step, "train", last_train)
    return host_sums

  def stop_if_diverged(host_sums: Dict[str, np.ndarray]) -> None:
    """Raises TrainingDivergedError when a step since the last record had a
    non-finite loss or gradient norm, once the last good checkpoint is on disk."""
    bad_step = int(host_sums["bad_step"])
    if not bad_step:
      return
    checkpointer.wait_until_finished()
    good_step = checkpointer.latest_step()
    good_path = None if good_step is None else checkpointer.step_path(good_step)
    raise TrainingDivergedError(
        step=bad_step, loss=float(host_sums["bad_loss"]),
        grad_norm=float(host_sums["bad_grad_norm"]), checkpoint_step=good_step,
        checkpoint_path=None if good_path is None else str(good_path))

  # -- The loop: step, record, evaluate, checkpoint; stop on a signal or divergence. --
  stop_requests = StopRequests(enabled=handle_signals)
  try:
    with stop_requests:
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
        # Decision: a NaN or Inf loss is caught without a host sync per step.
        # `_accumulate` runs on the device with the running sums and keeps the
        # first step whose loss or gradient norm is not finite; that value is
        # read only where the loop waits for the device anyway (a train record,
        # and before every evaluation and checkpoint, which wait for the state).
        # So a divergence is reported up to `log_every - 1` steps late, but
        # naming its own step, and no checkpoint of a diverged state is written.
        train_sums = _accumulate(train_sums, metrics, state.step)

        recorded = step % config.log_every == 0 or step == total
        if recorded:
          host_sums = write_train_record(step, train_sums, metrics)
          train_sums = None
          stop_if_diverged(host_sums)
        logger.advance(step, **({"loss": last_train["loss"]} if last_train else {}))

        evaluated = step % config.eval_every == 0 or step == total
        checkpointed = evaluated or step % config.checkpoint_every == 0
        if checkpointed:
          # Dispatch is asynchronous: wait for the train steps to finish before
          # stopping their clock, and check them before their state is saved.
          jax.block_until_ready(state)
          if train_sums is not None and int(train_sums["bad_step"]):
            stop_if_diverged(write_train_record(step, train_sums, metrics))
        if evaluated:
          timer.pause()
          validation = evaluate(state, "validation")
          logger.write(step, "validation", validation)
          timer.resume()
        if checkpointed:
          timer.pause()
          # Every eval step is checkpointed with its metrics, so the best
          # checkpoint is the best evaluated state.
          checkpointer.save(step, state, metrics=validation if evaluated else None)
          timer.resume()

        if stop_requests.requested(synced=recorded or checkpointed):
          if train_sums is not None:
            # The steps since the last record get one of their own, so that the
            # log has every step's loss; the resumed run starts a new interval.
            host_sums = write_train_record(step, train_sums, metrics)
            train_sums = None
            stop_if_diverged(host_sums)
          checkpointer.save(step, state)  # False when this step already has one.
          checkpointer.wait_until_finished()
          raise TrainingInterrupted(signal_number=stop_requests.signal_number, step=step,
                                    checkpoint_path=str(checkpointer.step_path(step)))
    checkpointer.wait_until_finished()
  except BaseException:
    # Stopped (diverged, interrupted or failed): pending saves are finished
    # and the metrics file closed, so the workdir is ready for a restart.
    checkpointer.close()
    logger.close()
    raise

  # -- Results: the best checkpoint on validation (and test), then results.json. --
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
    if length_evals:
      by_length = {str(task.info.seq_len): results_metrics.get("test") or dict(
          step=best_step, **evaluate(best_state, "test"))}
      for length_eval in length_evals:
        test = evaluate(best_state, "test", length_eval.splits, length_eval.eval_step)
        logger.write(best_step, f"test_length{length_eval.length}", test)
        by_length[str(length_eval.length)] = dict(step=best_step, **test)
      results_metrics["test_by_length"] = by_length
  checkpointer.close()
  logger.close()

  results = dict(config=config.to_dict(), git_revision=git_revision(),
                 devices=device_summary(), mesh=dict(run.mesh.shape), num_train_steps=total,
                 resumed_from=start_step or None,
                 **({} if pretrained is None else dict(pretrain=dict(
                     workdir=str(workdir / pretrain.PRETRAIN_DIR),
                     num_train_steps=pretrained["num_train_steps"],
                     validation=pretrained["metrics"]["validation"]))),
                 finished=datetime.datetime.now(datetime.timezone.utc).isoformat(),
                 metrics=results_metrics)
  if jax.process_index() == 0:
    write_json(workdir / RESULTS_FILE, results)
  return results


def _learning_rate(config: ml_collections.ConfigDict, step: int) -> float:
  from attention_jax.train.optim import make_schedule  # pylint: disable=g-import-not-at-top
  updates = step // max(int(config.optimizer.grad_accum_steps), 1)
  return float(make_schedule(config.optimizer)(updates))


def _num_params(params: Any) -> int:
  return int(sum(np.prod(leaf.shape) for leaf in jax.tree.leaves(params)))


@jax.jit
def _accumulate(sums: Optional[Dict[str, jax.Array]], metrics: Dict[str, jax.Array],
                step: jax.Array) -> Dict[str, jax.Array]:
  """The train metrics' running sums (loss, its two terms and accuracy weighted by the count)
  with one more step's `metrics` added; `sums` None starts them.

  Also keeps the first `step` whose loss or gradient norm is not finite
  ("bad_step", 0 while there is none) and those two values, so that a
  divergence is noticed without reading every step's loss on the host.
  """
  if sums is None:
    zero = jnp.zeros((), jnp.float32)
    sums = dict(loss=zero, cross_entropy=zero, aux_loss=zero, accuracy=zero, count=zero,
                bad_step=jnp.zeros((), jnp.int32), bad_loss=zero, bad_grad_norm=zero)
  count = metrics["count"]
  first_bad = (sums["bad_step"] == 0) & ~(jnp.isfinite(metrics["loss"]) &
                                          jnp.isfinite(metrics["grad_norm"]))
  weighted = {name: sums[name] + metrics[name] * count
              for name in ("loss", "cross_entropy", "aux_loss", "accuracy")}
  return dict(**weighted,
              count=sums["count"] + count,
              bad_step=jnp.where(first_bad, step.astype(jnp.int32), sums["bad_step"]),
              bad_loss=jnp.where(first_bad, metrics["loss"], sums["bad_loss"]),
              bad_grad_norm=jnp.where(first_bad, metrics["grad_norm"], sums["bad_grad_norm"]))


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
