"""SIGINT and SIGTERM as requests to stop training after a checkpointed step.

  with StopRequests() as stop_requests:
    for step in ...:
      ...
      if stop_requests.requested(synced=...):
        <checkpoint this step>; raise TrainingInterrupted(...)
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any, Dict, Optional

import jax
from jax.experimental import multihost_utils
import numpy as np


class TrainingInterrupted(KeyboardInterrupt):
  """SIGINT or SIGTERM stopped training after a checkpoint of the current step.

  A KeyboardInterrupt, so that `except Exception` does not swallow it.

  Attributes:
    signal_number: the signal this process received (`signal.SIGINT` or
      `signal.SIGTERM`), or on a process of a multi-process run that stopped
      because another process received one, that process's signal.
    step: the step training stopped after, which is checkpointed.
    checkpoint_path: that checkpoint's directory.
  """

  def __init__(self, *, signal_number: int, step: int, checkpoint_path: str):
    self.signal_number, self.step, self.checkpoint_path = signal_number, step, checkpoint_path
    super().__init__(f"interrupted by {signal.Signals(signal_number).name} after step {step}; "
                     f"saved its checkpoint {checkpoint_path}.")


class StopRequests:
  """SIGINT and SIGTERM as requests to stop after a train step.

  A context manager: entering installs the handlers, leaving restores the
  previous ones. `requested(synced)`, called after every train step,
  says whether to checkpoint that step and stop. The first signal only sets a
  flag; a second one is handled as it would have been without this
  (KeyboardInterrupt, or termination), for a step that never finishes.

  Decision: with several processes, all must stop after the same step, since
  saving is collective, so they agree at steps where the loop already waits
  for the device on every process (`synced`: a train record, an evaluation or
  a checkpoint): an all-gather of the signals received. That costs nothing on
  the other steps, and a stop waits for the next such step (at most
  `log_every` steps). jax's preemption service (`reached_preemption_sync_point`)
  would agree sooner, but it takes the last step any thread reported, and
  orbax reports older, finished saves from its background thread: a process
  could then be past the agreed step and never stop while the others save.
  Its SIGTERM handler is replaced here; so is Python's for SIGINT.
  """

  def __init__(self, enabled: bool = True):
    self.enabled = enabled
    self.signal_number: Optional[int] = None
    self._previous: Dict[int, Any] = {}

  def __enter__(self) -> "StopRequests":
    if self.enabled and threading.current_thread() is threading.main_thread():
      for number in (signal.SIGINT, signal.SIGTERM):
        self._previous[number] = signal.signal(number, self._handle)
    return self

  def __exit__(self, *exc_info) -> None:
    for number, handler in self._previous.items():
      signal.signal(number, handler)
    self._previous = {}

  def _handle(self, number: int, frame) -> None:
    if self.signal_number is None:
      self.signal_number = number
      return
    # A second signal: as if this handler had never been installed.
    previous = self._previous.get(number, signal.SIG_DFL)
    signal.signal(number, previous)
    if callable(previous):
      previous(number, frame)
    elif previous == signal.SIG_DFL:
      os.kill(os.getpid(), number)

  def requested(self, synced: bool) -> bool:
    """Whether to checkpoint the step just dispatched and stop.

    Args:
      synced: whether every process waits for the device at this step (the
        same on all processes); other processes' signals are heard only then.
    """
    if jax.process_count() == 1:
      return self.signal_number is not None
    if not synced:
      return False
    received = multihost_utils.process_allgather(np.int32(self.signal_number or 0))
    if not np.any(received):
      return False
    if self.signal_number is None:  # Stopped for another process's signal.
      self.signal_number = int(received[np.flatnonzero(received)[0]])
    return True
