"""Training metrics: a JSON-lines file, TensorBoard events and a progress bar.

`MetricsLogger` writes every record twice under the work directory:

- `metrics.jsonl`: one JSON object a line, {"step", "split", "time", **metrics},
  appended and flushed after each record, so a killed run loses at most the
  line it was writing. `read_metrics` reads it back.
- `tensorboard/`: the numeric metrics as TensorBoard scalars "<split>/<name>"
  (tensorboardX).

A run resumed from the checkpoint of step S re-runs the steps after S, so the
records a killed run wrote after S are stale: the logger drops them from
`metrics.jsonl` and tells TensorBoard to purge them (`purge_step=S + 1`).

Only the first host (`jax.process_index() == 0`) writes and shows the bar; on
the others every method is a no-op, so trainers call them unconditionally.
"""

from __future__ import annotations

import json
import logging as pylogging
import operator
import os
import pathlib
import resource
import sys
import time
from typing import Any, Dict, List, Mapping, Optional, Union

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np
import tensorboardX
import tqdm

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
# The fields every record carries; metrics may not use these names.
RESERVED_KEYS = ("step", "split", "time")
# tensorboardX writes events from a background thread: an event queued just
# before our flush() may reach the file after it, and then waits for the
# thread's own periodic flush (120 s by default). A shorter period bounds how
# stale the event file can get; close() writes everything.
_TENSORBOARD_FLUSH_SECS = 10



class _WithoutNonFiniteNotice(pylogging.Filter):
  """Drops tensorboardX's warning for each NaN or infinite scalar: such a value
  is recorded as it is (TensorBoard plots it as NaN/Inf), and a diverged loss
  is the trainer's to report, in one message naming the step."""

  def filter(self, record: pylogging.LogRecord) -> bool:
    return "NaN or Inf found in input tensor" not in record.getMessage()


pylogging.getLogger("tensorboardX.x2num").addFilter(_WithoutNonFiniteNotice())

PathLike = Union[str, os.PathLike]
Scalar = Union[bool, int, float, str]


def _check_step(value: Any, name: str, minimum: int) -> int:
  """`value` (a Python, numpy or JAX integer) as an int >= `minimum`.

  Raises:
    ValueError: naming `name` on a non-integer (bools and floats included) or a
      value below `minimum`.
  """
  try:
    step = None if isinstance(value, (bool, np.bool_)) else operator.index(value)
  except TypeError:
    step = None
  if step is None or step < minimum:
    raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}.")
  return step


def _check_split(split: Any) -> str:
  if not isinstance(split, str) or not split:
    raise ValueError(f"split must be a non-empty str (e.g. 'train'), got {split!r}.")
  return split


def _plain(name: str, value: Any) -> Scalar:
  """`value` (a Python, numpy or JAX scalar, or a str) as a plain Python value.

  Raises:
    ValueError: on arrays with more than one element and on other types.
  """
  if isinstance(value, str):
    return value
  try:
    array = np.asarray(value)
  except (TypeError, ValueError):
    array = None
  if array is None or array.size != 1 or array.dtype == object:
    raise ValueError(f"metric {name!r} must be a scalar number or a str, got {value!r} "
                     f"({type(value).__name__}).")
  # jnp.issubdtype also knows bfloat16 and the other ml_dtypes floats.
  if array.dtype == bool:
    return bool(array.reshape(()))
  if jnp.issubdtype(array.dtype, jnp.integer):
    return int(array.reshape(()))
  if jnp.issubdtype(array.dtype, jnp.floating):
    return float(array.reshape(()))
  raise ValueError(f"metric {name!r} must be a real number or a str, got dtype {array.dtype}.")


def _parse_record(line: str, path: pathlib.Path, lineno: int) -> Dict[str, Any]:
  """One line of metrics.jsonl as a dict; ValueError naming the file and line if malformed."""
  try:
    record = json.loads(line)
  except json.JSONDecodeError as error:
    raise ValueError(f"{path}:{lineno}: malformed metrics record ({error.msg}): "
                     f"{line[:80]!r}.") from None
  if (not isinstance(record, dict) or not isinstance(record.get("step"), int)
      or not isinstance(record.get("split"), str)):
    raise ValueError(f"{path}:{lineno}: a metrics record must be a JSON object with an int "
                     f"'step' and a str 'split', got {line[:80]!r}.")
  return record


def read_metrics(workdir: PathLike, split: Optional[str] = None) -> List[Dict[str, Any]]:
  """The records of `workdir/metrics.jsonl`, in file order.

  Args:
    workdir: the directory a `MetricsLogger` wrote to.
    split: when given, only the records of this split ("train", "validation", ...).

  Returns:
    One dict per record: {"step": int, "split": str, "time": float, **metrics};
    [] when the file does not exist.

  Raises:
    ValueError: on a malformed line (naming the file and the line number), e.g.
      the partial last line of a run killed mid-write, which the next
      `MetricsLogger` on this directory removes; or on an empty/non-str `split`.
  """
  if split is not None:
    _check_split(split)
  path = pathlib.Path(workdir) / METRICS_FILE
  if not path.exists():
    return []
  records = []
  with open(path, encoding="utf-8") as f:
    for lineno, line in enumerate(f, start=1):
      if not line.strip():
        continue
      record = _parse_record(line, path, lineno)
      if split is None or record["split"] == split:
        records.append(record)
  return records


def _drop_stale_records(path: pathlib.Path, start_step: int) -> None:
  """Rewrites `path` without the records after `start_step` (all kept when it is 0) and
  without a partial last line, atomically; leaves it alone when there is nothing to drop.

  Raises:
    ValueError: on a malformed line other than the last one: that is not a
      killed write but a damaged file, which should not be silently pruned.
  """
  text = path.read_text(encoding="utf-8", errors="replace")
  lines = text.split("\n")
  # Every record ends with "\n", so the piece after the last one is "" unless the
  # previous run was killed in the middle of a line.
  complete, tail = lines[:-1], lines[-1]
  kept, dropped = [], 0
  for lineno, line in enumerate(complete, start=1):
    if not line.strip():
      continue
    if start_step == 0 or _parse_record(line, path, lineno)["step"] <= start_step:
      kept.append(line)
    else:
      dropped += 1
  partial = bool(tail.strip())
  if not dropped and not partial:
    return
  tmp = path.with_name(path.name + ".tmp")
  with open(tmp, "w", encoding="utf-8") as f:
    f.writelines(line + "\n" for line in kept)
    f.flush()
    os.fsync(f.fileno())
  # os.replace is atomic: a kill now leaves either the old file or the new one.
  os.replace(tmp, path)
  logging.info("%s: dropped %d record(s) after step %d%s.", path, dropped, start_step,
               " and a partial last line" if partial else "")


def _format_postfix(value: Any) -> str:
  """A compact progress-bar string: floats to 4 significant digits."""
  if isinstance(value, str):
    return value
  try:
    plain = _plain("postfix", value)
  except ValueError:
    return str(value)
  if isinstance(plain, float):
    return f"{plain:.4g}"
  return str(plain)


class MetricsLogger:
  """Writes training metrics to metrics.jsonl and TensorBoard and shows a progress bar.

  Usage:

    with MetricsLogger(workdir, total_steps=10_000, start_step=restored_step) as logger:
      for step in range(restored_step + 1, 10_001):
        ...
        logger.advance(step, loss=loss)
        if step % 100 == 0:
          logger.write(step, "train", {"loss": loss, "accuracy": accuracy})
        logger.message("saved checkpoint")

  Args:
    workdir: the run's directory (created if needed); the logger owns
      `workdir/metrics.jsonl` and `workdir/tensorboard/`.
    total_steps: the last training step, the progress bar's total.
    start_step: the step training resumes after (the restored checkpoint's),
      0 for a fresh run. When > 0, records after it are dropped from
      metrics.jsonl and purged from TensorBoard: the resumed run writes them
      again. A partial last line in metrics.jsonl is dropped in every case.
    enabled: whether this process writes anything; None means "only the first
      host" (`jax.process_index() == 0`). A disabled logger creates no file,
      shows no bar and prints nothing.
    progress: whether to show the tqdm bar (steps, loss, steps/s, ETA) on stderr.
    description: the bar's label, e.g. "listops/performer".

  Raises:
    ValueError: when total_steps < 1, start_step < 0 or either is not an integer.
  """

  def __init__(self, workdir: PathLike, *, total_steps: int, start_step: int = 0,
               enabled: Optional[bool] = None, progress: bool = True, description: str = ""):
    self.total_steps = _check_step(total_steps, "total_steps", 1)
    self.start_step = _check_step(start_step, "start_step", 0)
    self.workdir = pathlib.Path(workdir)
    self.enabled = jax.process_index() == 0 if enabled is None else bool(enabled)
    self._closed = False
    self._file = None
    self._writer = None
    self._bar = None
    if not self.enabled:
      return
    self.workdir.mkdir(parents=True, exist_ok=True)
    path = self.workdir / METRICS_FILE
    if path.exists():
      _drop_stale_records(path, self.start_step)
    self._file = open(path, "a", encoding="utf-8")
    # purge_step: TensorBoard hides the events of earlier runs at or after it.
    # The suffix: tensorboardX names event files by the second and opens them with
    # "wb", so a second writer within the same second would truncate the first's
    # file; nanoseconds keep the names distinct and in chronological order.
    self._writer = tensorboardX.SummaryWriter(
        str(self.workdir / TENSORBOARD_DIR),
        purge_step=self.start_step + 1 if self.start_step > 0 else None,
        flush_secs=_TENSORBOARD_FLUSH_SECS, filename_suffix=f".{time.time_ns()}")
    if progress:
      # tqdm's own rate (step/s) and ETA; they count from `initial`, so a resumed
      # run's rate is not inflated by the restored steps.
      self._bar = tqdm.tqdm(total=self.total_steps, initial=self.start_step, unit="step",
                            desc=description, dynamic_ncols=True, smoothing=0.1,
                            # A redirected log gets a line every 30 s, a terminal 10 a second.
                            mininterval=0.1 if sys.stderr.isatty() else 30.0)

  @property
  def path(self) -> pathlib.Path:
    """The JSON-lines file."""
    return self.workdir / METRICS_FILE

  def _check_open(self) -> None:
    if self._closed:
      raise RuntimeError(f"MetricsLogger({str(self.workdir)!r}) is closed.")

  def write(self, step: int, split: str, metrics: Mapping[str, Any]) -> None:
    """Records `metrics` of `split` at `step`: a line of metrics.jsonl and, for each
    numeric value, the TensorBoard scalar "<split>/<name>". The line is flushed
    at once; the events within `_TENSORBOARD_FLUSH_SECS` (see there).

    Args:
      step: the training step (an int >= 0).
      split: e.g. "train", "validation", "test".
      metrics: name -> Python/numpy/JAX scalar or str (strs go to the JSON line
        only). NaN and infinities are written as JSON's NaN/Infinity extensions,
        which Python's json module reads back.

    Raises:
      ValueError: on a bad step or split, a non-scalar value, or a metric named
        like a reserved field ("step", "split", "time").
      RuntimeError: after `close()`.
    """
    step = _check_step(step, "step", 0)
    _check_split(split)
    values = {}
    for name, value in metrics.items():
      if not isinstance(name, str) or not name:
        raise ValueError(f"metric names must be non-empty strs, got {name!r}.")
      if name in RESERVED_KEYS:
        raise ValueError(f"metric name {name!r} is reserved for the record's own fields "
                         f"{RESERVED_KEYS}.")
      values[name] = _plain(name, value)
    if not self.enabled:
      return
    self._check_open()
    now = time.time()
    record = {"step": step, "split": split, "time": now, **values}
    # One write call per line, then flush: a SIGKILL leaves at most this line partial.
    self._file.write(json.dumps(record) + "\n")
    self._file.flush()
    for name, value in values.items():
      if not isinstance(value, str):
        self._writer.add_scalar(f"{split}/{name}", float(value), global_step=step, walltime=now)
    self._writer.flush()

  def advance(self, step: int, **postfix: Any) -> None:
    """Moves the progress bar to `step` (absolute) and shows `postfix` (e.g. loss=0.693).

    Raises:
      ValueError: on a step that is not an integer >= 0.
    """
    step = _check_step(step, "step", 0)
    if self._bar is None or self._closed:
      return
    if postfix:
      self._bar.set_postfix({k: _format_postfix(v) for k, v in postfix.items()}, refresh=False)
    # update() rather than assigning n: tqdm refreshes and recomputes the rate on it.
    self._bar.update(step - self._bar.n)

  def message(self, text: str) -> None:
    """Prints `text` on its own line above the progress bar (stdout; no-op when disabled)."""
    if not self.enabled:
      return
    if self._bar is not None and not self._closed:
      tqdm.tqdm.write(str(text))
    else:
      print(text, flush=True)

  def flush(self) -> None:
    """Flushes metrics.jsonl and the TensorBoard events."""
    if self._file is not None and not self._closed:
      self._file.flush()
      self._writer.flush()

  def close(self) -> None:
    """Flushes and closes the file, the TensorBoard writer (which writes out its
    queued events) and the bar; a second call does nothing."""
    if self._closed:
      return
    self._closed = True
    if self._bar is not None:
      self._bar.close()
    if self._writer is not None:
      self._writer.close()
    if self._file is not None:
      self._file.close()

  def __enter__(self) -> MetricsLogger:
    return self

  def __exit__(self, *exc_info: Any) -> None:
    self.close()


def peak_memory() -> Dict[str, Any]:
  """The peak memory this process has used so far.

  On GPU and TPU: the maximum over the local devices of the backend's
  `peak_bytes_in_use` (device memory only). On CPU, whose backend reports no
  memory statistics: the peak resident set size of the whole process, which
  includes the host-side data (datasets, Python, the compiler), not only the
  arrays of the model.

  Returns:
    {"peak_memory_bytes": int, "memory_source": "device" | "host_rss"}.
  """
  peaks = []
  for device in jax.local_devices():
    stats = device.memory_stats()
    if stats and "peak_bytes_in_use" in stats:
      peaks.append(int(stats["peak_bytes_in_use"]))
  if peaks:
    return {"peak_memory_bytes": max(peaks), "memory_source": "device"}
  max_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
  # Linux reports ru_maxrss in KiB, macOS in bytes.
  scale = 1 if sys.platform == "darwin" else 1024
  return {"peak_memory_bytes": int(max_rss) * scale, "memory_source": "host_rss"}
