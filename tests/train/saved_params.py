"""A checkpoint's parameters read back for comparison in the trainer's tests."""

import pathlib

import jax
import numpy as np


def checkpoint_params(workdir, step):
  """The parameters of checkpoint `step` in `workdir`, as NumPy arrays, read
  without a template."""
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  with ocp.CheckpointManager(pathlib.Path(workdir) / "checkpoints") as manager:
    restored = manager.restore(step)
  state = restored["default"] if "default" in restored else restored
  params = state["params"] if isinstance(state, dict) else state.params
  return jax.tree.map(np.asarray, params)
