"""The trainer on 8 simulated devices: meshes, parameter shardings, and the same
losses on every mesh as on one device (tests/train/sharded_run.py, in a
subprocess so that the device count is set before jax initialises)."""

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

SCRIPT = pathlib.Path(__file__).with_name("sharded_run.py")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("sharded")
  result = subprocess.run([sys.executable, str(SCRIPT), str(tmp)], capture_output=True,
                          text=True, env=dict(os.environ), cwd=SCRIPT.parents[2], timeout=600)
  assert result.returncode == 0, result.stderr[-4000:]
  return json.loads(result.stdout.strip().splitlines()[-1])


def test_eight_devices_simulated(run):
  assert run["device_count"] == 8


def test_make_mesh_fills_in_the_rest(run):
  assert run["mesh_shapes"] == {
      "(-1, 2, 2)": {"data": 2, "fsdp": 2, "tensor": 2},
      "(-1, 1, 1)": {"data": 8, "fsdp": 1, "tensor": 1},
      "(2, -1, 1)": {"data": 2, "fsdp": 4, "tensor": 1},
      "(8, 1, 1)": {"data": 8, "fsdp": 1, "tensor": 1},
  }


@pytest.mark.parametrize("shape, words", [
    ("(3, -1, 1)", ["(3, -1, 1)", "8 devices"]),
    ("(2, 2, 1)", ["(2, 2, 1)", "4 devices", "there are 8"]),
    ("(-1, -1, 1)", ["(-1, -1, 1)", "at most one -1"]),
    ("(2, 2)", ["(2, 2)", "3 axes"]),
    ("(0, 8, 1)", ["(0, 8, 1)", "positive"]),
])
def test_make_mesh_rejects_shapes_that_do_not_fit(run, shape, words):
  message = run["mesh_errors"][shape]
  assert message is not None, f"mesh shape {shape} was accepted"
  for word in words:
    assert word in message


def test_same_losses_on_every_mesh_as_on_one_device(run):
  losses = run["losses"]
  reference = np.array(losses["one device"])
  assert len(reference) == 4
  # The run must move, or equal losses would prove nothing about the updates.
  assert np.ptp(reference) > 0.05
  for mesh in ("8,1,1", "2,4,1", "2,2,2"):
    np.testing.assert_allclose(losses[mesh], reference, rtol=2e-5, atol=2e-6, err_msg=mesh)


def test_parameters_and_optimizer_state_are_sharded_by_the_rules(run):
  # Mesh (2, 2, 2): "embed" -> fsdp, "heads"/"mlp"/"vocab" -> tensor, "kv"/"classes" whole.
  specs = run["specs"]
  assert specs["token_embedding"] == ["tensor", "fsdp"]  # (vocab, embed)
  assert specs["query_kernel"] == ["fsdp", "tensor", None]  # (embed, heads, kv)
  assert specs["query_kernel_shard_shape"] == [16 // 2, 2 // 2, 8]
  assert specs["out_kernel"] == ["tensor", None, "fsdp"]  # (heads, kv, embed)
  assert specs["mlp_wi_kernel"] == ["fsdp", "tensor"]  # (embed, mlp)
  assert specs["head_kernel"] == ["fsdp", None]  # (embed, classes)
  assert specs["query_kernel_adam_mu"] == ["fsdp", "tensor", None]
  assert specs["batch_inputs"] == [["data", "fsdp"]]


def test_eval_step_counts_every_example(run):
  assert run["eval"]["count"] == 16.0
  assert 0.0 <= run["eval"]["accuracy"] <= 1.0
  assert run["eval"]["loss"] > 0.0


def test_batch_that_does_not_divide_over_the_data_axes_raises(run):
  message = run["batch_error"]
  assert message is not None and "12" in message and "8" in message


def test_the_training_loop_gives_the_same_losses_on_every_mesh_as_on_one_device(run,
                                                                                tmp_path):
  sys.path.insert(0, str(SCRIPT.parent))
  import tiny_config  # pylint: disable=g-import-not-at-top
  from attention_jax.train import metrics  # pylint: disable=g-import-not-at-top
  from attention_jax.train.trainer import train_and_evaluate  # pylint: disable=g-import-not-at-top
  config = tiny_config.get_config()
  config.update(data_dir=str(tmp_path / "data"), mesh_shape=(1, 1, 1), num_train_steps=6,
                log_every=1, eval_every=6, checkpoint_every=6)
  results = train_and_evaluate(config, tmp_path / "one-device")
  reference = [r["loss"] for r in metrics.read_metrics(tmp_path / "one-device", "train")]
  assert len(reference) == 6 and np.ptp(reference) > 1e-3
  for mesh, losses in run["trainer"]["losses"].items():
    np.testing.assert_allclose(losses, reference, rtol=2e-5, atol=2e-6, err_msg=mesh)
    np.testing.assert_allclose(run["trainer"]["validation"][mesh]["loss"],
                               results["metrics"]["validation"]["loss"], rtol=2e-5)


def test_the_sequence_split_over_a_mesh_axis_gives_the_data_parallel_losses(run):
  """`config.sequence_shards=4`: a "sequence" mesh axis, ring attention."""
  meshes, losses = run["trainer"]["sequence_meshes"], run["trainer"]["sequence_losses"]
  assert meshes["2x1x1-sequence4-mean"] == {"data": 2, "fsdp": 1, "tensor": 1, "sequence": 4}
  reference = losses["8x1x1-mean"]
  assert len(reference) == 6 and np.ptp(reference) > 1e-3
  np.testing.assert_allclose(losses["2x1x1-sequence4-mean"], reference, rtol=2e-5, atol=2e-6)


def test_the_training_loop_refuses_a_batch_that_does_not_split_before_writing(run):
  message = run["trainer"]["batch_error"]
  assert message is not None and "12" in message and "8" in message
  assert not run["trainer"]["bad_batch_workdir_exists"]


def test_axis_rules_are_checked():
  from attention_jax.train import partitioning  # pylint: disable=g-import-not-at-top
  assert partitioning.axis_rules([["activation_batch", ["data", "fsdp"]], ["kv", None]]) == (
      ("activation_batch", ("data", "fsdp")), ("kv", None))
  with pytest.raises(ValueError, match="maps 'embed' to 'model', which is not a mesh axis"):
    partitioning.axis_rules([("embed", "model")])
  with pytest.raises(ValueError, match="must be \\(logical axis, mesh axes\\) pairs"):
    partitioning.axis_rules([("embed",)])
