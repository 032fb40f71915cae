"""Variants with random draws train per layer and resume bit-identically: the
"random" collection is checkpointed with the parameters and every draw is a
function of (seed, layer, step)."""

import json
import pathlib
import shutil
import sys

import jax
import numpy as np
import pytest

from attention_jax.train.trainer import train_and_evaluate

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import tiny_config  # pylint: disable=g-import-not-at-top,wrong-import-position

# variant -> options: Performer's features redrawn every 2 steps; BigBird's
# pattern drawn once per layer (the tiny ListOps task: at most 41 tokens).
RANDOM_VARIANTS = {
    "performer": {"redraw_every": 2, "num_features": 8},
    "bigbird": {"block_size": 8, "num_random_blocks": 1, "block_padding": "lra_release"},
}


def _config(tmp_path, variant):
  config = tiny_config.get_config(variant)
  config.data_dir = str(tmp_path / "data")
  config.model.num_layers = 2
  config.model.attention_options.update(RANDOM_VARIANTS[variant])
  config.num_train_steps = 8
  config.checkpoint_every = 4
  config.eval_every = 8
  config.keep_checkpoints = 3
  return config


def _state(workdir, step):
  """The parameters and the "random" collection of checkpoint `step`."""
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  with ocp.CheckpointManager(pathlib.Path(workdir) / "checkpoints") as manager:
    restored = manager.restore(step)
  state = restored["default"] if "default" in restored else restored
  return jax.tree.map(np.asarray, (state["params"], state["collections"]["random"]))


@pytest.mark.parametrize("variant", sorted(RANDOM_VARIANTS))
def test_a_resumed_run_draws_what_an_uninterrupted_one_drew(tmp_path, variant):
  workdir = tmp_path / "full"
  full = train_and_evaluate(_config(tmp_path, variant), workdir)
  params, random = _state(workdir, 8)
  _, random_at_4 = _state(workdir, 4)
  layers = sorted(k for k in random["encoder"] if k.startswith("block_"))
  assert len(layers) == 2
  first, second = (jax.tree.leaves(random["encoder"][name]) for name in layers)
  # One draw per layer.
  assert not all(np.array_equal(a, b) for a, b in zip(first, second))
  changed = not all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(random),
                                                          jax.tree.leaves(random_at_4)))
  # Performer redraws every 2 steps; BigBird's pattern is fixed for the run.
  assert changed == (variant == "performer")

  # Kill after step 4: drop the later checkpoint and the results, then resume.
  resumed_dir = tmp_path / "resumed"
  shutil.copytree(workdir, resumed_dir)
  (resumed_dir / "results.json").unlink()
  shutil.rmtree(resumed_dir / "checkpoints" / "8")
  resumed = train_and_evaluate(_config(tmp_path, variant), resumed_dir)
  assert resumed["resumed_from"] == 4
  resumed_params, resumed_random = _state(resumed_dir, 8)
  for a, b in zip(jax.tree.leaves((params, random)),
                  jax.tree.leaves((resumed_params, resumed_random))):
    np.testing.assert_array_equal(a, b)
  assert json.loads(json.dumps(full["metrics"]["test"])) == resumed["metrics"]["test"]
