"""Checkpoints of the train state: the latest K and the best by an eval metric.

A thin layer over `orbax.checkpoint.CheckpointManager` that adds what a
restartable trainer needs around it:

- restores go straight into the state's shardings (every process reads only
  its own shards);
- a checkpoint that cannot be restored (truncated, missing or garbage files, a
  structure that does not match) is moved aside to `<directory>/corrupt/` with
  a `CorruptCheckpointWarning`, and the next older one is tried; nothing in the
  directory is ever deleted except by the keep-K/best retention;
- a half-written checkpoint (orbax's `*.orbax-checkpoint-tmp*` directory, or a
  step directory without orbax's `commit_success.txt` marker, as a SIGKILL
  during a save leaves them) is never picked: such directories are moved aside
  when a `Checkpointer` opens the directory.

Layout: `<directory>/<step>/` as orbax writes it (`default/` holds the state,
`metrics/` the eval metrics of that step).
"""

from __future__ import annotations

import json
import logging
import math
import re
import warnings
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from jax.experimental import multihost_utils
from orbax.checkpoint import checkpoint_managers

BEST_MODES = ("max", "min")
# Where unusable checkpoints are moved, under the checkpoint directory.
CORRUPT_SUBDIR = "corrupt"
# The step directory names of orbax's standard name format with no prefix and
# no zero padding, the format used here.
_STEP_NAME = re.compile(r"0|[1-9]\d*")


class _WithoutMetricsNotice(logging.Filter):
  """Drops orbax's warning for each save without metrics while a best metric is
  tracked: periodic checkpoints between evaluations have none by design."""

  def filter(self, record: logging.LogRecord) -> bool:
    return "did not provide metrics" not in record.getMessage()


logging.getLogger("absl").addFilter(_WithoutMetricsNotice())


class CorruptCheckpointWarning(UserWarning):
  """A checkpoint could not be used and was moved aside (its path and the error
  are in the message)."""


def _any_process(flag: bool) -> bool:
  """True on every process when `flag` is True on any: all processes must agree
  on which checkpoint they restore, though each reads only its own shards."""
  if jax.process_count() == 1:
    return flag
  return bool(np.any(multihost_utils.process_allgather(np.asarray(flag))))


def _sync(name: str) -> None:
  if jax.process_count() > 1:
    ocp.multihost.sync_global_processes(f"attention_jax_checkpoints:{name}")


def _plain_metrics(metrics: Mapping[str, Any]) -> Dict[str, float]:
  """`metrics` as a JSON-ready {name: float}; ValueError naming a bad entry."""
  plain = {}
  for name, value in metrics.items():
    try:
      plain[str(name)] = float(value)
    except (TypeError, ValueError) as e:
      raise ValueError(f"metrics must map names to numbers, got {name!r}: {value!r}.") from e
  return plain


class Checkpointer:
  """Saves and restores `TrainState`s under one directory with orbax.

  Keeps the `keep` most recent checkpoints and, when `best_metric` is set, also
  the one with the best value of that metric among the checkpoints saved with
  metrics; every other checkpoint is deleted once a newer save is written.

  Use from all processes alike (saves and restores are collective); only
  process 0 moves directories.

  Attributes:
    directory: the checkpoint directory (an `epath.Path`).
  """

  def __init__(self, directory: epath.PathLike, *, keep: int = 3,
               best_metric: Optional[str] = None, best_mode: str = "max",
               async_save: bool = True):
    """Opens (and creates) the checkpoint directory.

    Args:
      directory: where the step directories live; created if missing.
      keep: how many of the most recent checkpoints to keep, >= 1.
      best_metric: the metric (a key of the `metrics` given to `save`) whose
        best checkpoint is kept besides the latest `keep`; None keeps only the
        latest.
      best_mode: "max" or "min": whether a larger or a smaller `best_metric`
        is better.
      async_save: write checkpoints in a background thread; `save` returns
        once the arrays are copied off the devices.

    Raises:
      ValueError: when `keep` is not an integer >= 1, `best_mode` is not one of
        `BEST_MODES`, or `best_metric` is not None nor a non-empty string.
    """
    if isinstance(keep, bool) or not isinstance(keep, (int, np.integer)) or keep < 1:
      raise ValueError(f"keep must be an integer >= 1 (the number of latest checkpoints to "
                       f"keep), got {keep!r}.")
    if best_mode not in BEST_MODES:
      raise ValueError(f"best_mode must be one of {BEST_MODES}, got {best_mode!r}.")
    if best_metric is not None and (not isinstance(best_metric, str) or not best_metric):
      raise ValueError(f"best_metric must be None or a metric name, got {best_metric!r}.")
    self.directory = epath.Path(directory)
    self.keep = int(keep)
    self.best_metric = best_metric
    self.best_mode = best_mode
    self.async_save = bool(async_save)
    # Only committed step directories (with orbax's commit marker) count as
    # checkpoints; the default format for local paths would also list a step
    # directory whose save never finished writing its marker.
    self._name_format = ocp.step.standard_name_format(
        temporary_path_cls=ocp.path.atomicity.CommitFileTemporaryPath)
    self.directory.mkdir(parents=True, exist_ok=True)
    self._set_aside_unfinished()
    self._manager = self._make_manager()

  # -- orbax -----------------------------------------------------------------

  def _best_fn(self) -> Optional[Callable[[Mapping[str, float]], float]]:
    if self.best_metric is None:
      return None
    name, worst = self.best_metric, -math.inf if self.best_mode == "max" else math.inf

    def value(metrics: Mapping[str, float]) -> float:
      # A NaN (a diverged evaluation) would compare arbitrarily: rank it last.
      result = float(metrics[name])
      return worst if math.isnan(result) else result
    return value

  def _make_manager(self) -> ocp.CheckpointManager:
    policies: List[checkpoint_managers.PreservationPolicy] = [
        checkpoint_managers.LatestN(n=self.keep)]
    if self.best_metric is not None:
      # BestN keeps the n checkpoints sorting last; `reverse` sorts descending,
      # so the smallest value comes last. Without
      # keep_checkpoints_without_metrics=False it would keep every periodic
      # (metric-less) checkpoint forever.
      policies.append(checkpoint_managers.BestN(
          get_metric_fn=self._best_fn(), reverse=self.best_mode == "min", n=1,
          keep_checkpoints_without_metrics=False))
    options = ocp.CheckpointManagerOptions(
        preservation_policy=checkpoint_managers.AnyPreservationPolicy(policies),
        # best_fn/best_mode make orbax store each save's metrics and rank them
        # in best_step(); the preservation policy alone decides what is kept.
        best_fn=self._best_fn(), best_mode=self.best_mode,
        enable_async_checkpointing=self.async_save,
        step_name_format=self._name_format,
        # Leftover temporary directories are moved aside, not deleted.
        cleanup_tmp_directories=False,
        create=True)
    return ocp.CheckpointManager(self.directory, options=options)

  # -- moving unusable checkpoints aside ---------------------------------------

  def _aside_destination(self, name: str) -> epath.Path:
    """`corrupt/<name>`, or `corrupt/<name>.<k>` when that is taken (the same
    step may go bad again after it was saved anew)."""
    root = self.directory / CORRUPT_SUBDIR
    destination, k = root / name, 1
    while destination.exists():
      destination, k = root / f"{name}.{k}", k + 1
    return destination

  def _set_aside(self, path: epath.Path, reason: str) -> None:
    """Moves `path` to `corrupt/` (process 0) and warns (every process)."""
    destination = self._aside_destination(path.name)
    if jax.process_index() == 0 and path.exists():
      destination.parent.mkdir(parents=True, exist_ok=True)
      path.rename(destination)
    # stacklevel: the caller of __init__, restore or restore_best.
    warnings.warn(f"checkpoint {path} {reason}; moved it to {destination}.",
                  CorruptCheckpointWarning, stacklevel=4)

  def _set_aside_unfinished(self) -> None:
    """Moves aside what an interrupted save leaves behind, so that it is never
    restored and the same step can be saved again: orbax's temporary
    directories, step directories without the commit marker, and step
    directories whose metrics file is unreadable (which would stop orbax from
    opening the directory at all)."""
    if jax.process_index() == 0:
      for path in sorted(self.directory.iterdir(), key=lambda p: p.name):
        name = path.name
        if not path.is_dir():
          continue
        if ocp.step.TMP_DIR_SUFFIX in name and _STEP_NAME.fullmatch(
            name.split(ocp.step.TMP_DIR_SUFFIX)[0]):
          self._set_aside(path, "is a partial save (an orbax temporary directory)")
        elif _STEP_NAME.fullmatch(name):
          if not ocp.step.is_path_finalized(
              path, temporary_path_cls=ocp.path.atomicity.CommitFileTemporaryPath):
            self._set_aside(path, "was never completed (it has no commit marker)")
          elif (error := self._metrics_error(path)) is not None:
            self._set_aside(path, f"has unreadable metrics ({error})")
    _sync("set_aside_unfinished")

  @staticmethod
  def _metrics_error(step_path: epath.Path) -> Optional[str]:
    # orbax stores them as <step>/metrics/metrics (a JSON object).
    metrics_file = (step_path / ocp.checkpoint_manager.METRIC_ITEM_NAME /
                    ocp.checkpoint_manager.METRIC_ITEM_NAME)
    if not metrics_file.exists():
      return None
    try:
      if not isinstance(json.loads(metrics_file.read_text()), dict):
        return f"{metrics_file} does not hold a JSON object"
    except (OSError, ValueError) as e:
      return f"{type(e).__name__}: {e}"
    return None

  # -- public API ------------------------------------------------------------

  def all_steps(self) -> List[int]:
    """The steps of the checkpoints on disk, ascending."""
    return sorted(int(step) for step in self._manager.all_steps())

  def latest_step(self) -> Optional[int]:
    """The newest checkpoint's step, or None when there is none."""
    steps = self.all_steps()
    return steps[-1] if steps else None

  def step_path(self, step: int) -> epath.Path:
    """The directory of the checkpoint of `step` (whether or not it exists)."""
    return ocp.step.build_step_path(self.directory, self._name_format, int(step))

  def best_step(self) -> Optional[int]:
    """The step of the checkpoint with the best `best_metric`, or None when no
    checkpoint has metrics or best tracking is off (`best_metric=None`)."""
    if self.best_metric is None:
      return None
    return self._manager.best_step()

  def save(self, step: int, state: Any, *,
           metrics: Optional[Mapping[str, Any]] = None) -> bool:
    """Saves `state` as the checkpoint of `step`, then applies the retention.

    Every call saves (the caller decides when); orbax's save-interval policy is
    not used. With `async_save` this returns once the arrays are copied off the
    devices, so `state` may be donated to the next step right away.

    Args:
      step: the train step the state is at, >= 0.
      state: the `TrainState` (or any pytree of arrays).
      metrics: {name: number} of an evaluation at `step`, e.g.
        {"accuracy": 0.41, "loss": 1.7}; must hold `best_metric` when that is
        set. Stored with the checkpoint only when best tracking is on.

    Returns:
      True when a checkpoint was written; False when `step` already has one (a
      final step that was also a periodic one).

    Raises:
      ValueError: on a negative step, a step older than the latest checkpoint,
        metrics that are not numbers or lack `best_metric`.
    """
    step = int(step)
    if step < 0:
      raise ValueError(f"step must be >= 0, got {step}.")
    if metrics is not None:
      metrics = _plain_metrics(metrics)
      if self.best_metric is not None and self.best_metric not in metrics:
        raise ValueError(f"metrics must include best_metric {self.best_metric!r}, got the keys "
                         f"{sorted(metrics)}.")
    steps = self.all_steps()
    if step in steps:
      return False
    if steps and step < steps[-1]:
      # The retention orders checkpoints by when they were saved; an older
      # step saved after a newer one would be taken for the latest.
      raise ValueError(f"step {step} is older than the latest checkpoint {steps[-1]} in "
                       f"{self.directory}; checkpoints are saved in increasing step order.")
    return bool(self._manager.save(step, args=ocp.args.StandardSave(state), metrics=metrics,
                                   force=True))

  def restore(self, abstract_state: Any, shardings: Any) -> Optional[Tuple[Any, int]]:
    """Restores the newest usable checkpoint into `shardings`.

    A checkpoint that fails to restore is moved aside with a
    `CorruptCheckpointWarning` and the next older one is tried.

    Args:
      abstract_state: the state's `jax.ShapeDtypeStruct`s (a `TrainState`).
      shardings: the same tree of `NamedSharding`s; each array is read straight
        onto its shards.

    Returns:
      `(state, step)`, or None when no checkpoint is usable.

    Raises:
      ValueError: when `abstract_state` and `shardings` differ in structure.
    """
    return self._restore_first(abstract_state, shardings, self.latest_step)

  def restore_best(self, abstract_state: Any, shardings: Any) -> Optional[Tuple[Any, int]]:
    """Like `restore`, for the checkpoint with the best `best_metric`.

    Returns:
      `(state, step)`, or None when no usable checkpoint has metrics (always
      None with `best_metric=None`).
    """
    return self._restore_first(abstract_state, shardings, self.best_step)

  def _restore_first(self, abstract_state: Any, shardings: Any,
                     pick: Callable[[], Optional[int]]) -> Optional[Tuple[Any, int]]:
    if jax.tree.structure(abstract_state) != jax.tree.structure(shardings):
      raise ValueError(f"abstract_state and shardings must have the same tree structure, got "
                       f"{jax.tree.structure(abstract_state)} and "
                       f"{jax.tree.structure(shardings)}.")
    target = jax.tree.map(
        lambda abstract, sharding: jax.ShapeDtypeStruct(abstract.shape, abstract.dtype,
                                                        sharding=sharding),
        abstract_state, shardings)
    # A save still being written must not be read (nor moved aside).
    self._manager.wait_until_finished()
    tried = set()
    while (step := pick()) is not None:
      if step in tried:
        # Moving it aside did not take it out of the listing: stop, rather
        # than retry the same checkpoint forever.
        raise RuntimeError(f"checkpoint {step} in {self.directory} failed to restore and is "
                           f"still listed after being moved aside.")
      tried.add(step)
      error: Optional[Exception] = None
      try:
        state = self._manager.restore(step, args=ocp.args.StandardRestore(target))
      except Exception as e:  # pylint: disable=broad-except
        # Anything: truncated or missing files, garbage metadata, a state
        # structure or shape that is not the checkpoint's.
        error = e
      if not _any_process(error is not None):
        return state, step
      path = self.step_path(step)
      if error is None:
        reason = "could not be restored on another process"
      else:
        # tensorstore errors carry whole specs; the head names the cause.
        message = str(error)
        message = message if len(message) <= 600 else message[:600] + " ..."
        reason = f"could not be restored ({type(error).__name__}: {message})"
      self._set_aside(path, reason)
      _sync(f"set_aside_{step}")
      # The manager caches the step list; re-read it without the moved step.
      self._manager.reload()
    return None

  def wait_until_finished(self) -> None:
    """Blocks until every started save is written (and old ones are deleted)."""
    self._manager.wait_until_finished()

  def close(self) -> None:
    """Waits for pending saves and releases orbax's resources."""
    self._manager.close()

  def __enter__(self) -> "Checkpointer":
    return self

  def __exit__(self, *exc_info) -> None:
    self.close()
