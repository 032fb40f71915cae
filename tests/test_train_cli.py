"""experiments/train.py: when it asks jax for a multi-process setup, and the
one-line errors it gives instead of tracebacks."""

import math
import os
import pathlib
import subprocess
import sys

import pytest

from attention_jax.train import metrics
from experiments.cli import distributed_arguments, distributed_requested

ROOT = pathlib.Path(__file__).parents[1]
TINY = ROOT / "tests" / "train" / "tiny_config.py"


@pytest.mark.parametrize("environ, expected", [
    ({}, False),
    ({"SLURM_NTASKS": "1"}, False),
    ({"SLURM_NTASKS": "4"}, True),
    ({"OMPI_COMM_WORLD_SIZE": "2"}, True),
    ({"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234"}, True),
    ({"TPU_WORKER_HOSTNAMES": "localhost"}, False),
    ({"TPU_WORKER_HOSTNAMES": "host-0,host-1"}, True),
])
def test_distributed_is_initialised_only_for_multi_process_jobs(environ, expected):
  assert distributed_requested(environ) is expected


# ---------------------------------------------------------------------------
# The arguments of jax.distributed.initialize: flags, then JAX_* variables,
# then a cluster manager's detection.
# ---------------------------------------------------------------------------

FULL_ENV = {"JAX_COORDINATOR_ADDRESS": "10.0.0.1:8476", "JAX_NUM_PROCESSES": "4",
            "JAX_PROCESS_ID": "3"}


@pytest.mark.parametrize("flags, environ, expected", [
    ({}, {}, None),
    ({}, {"SLURM_NTASKS": "1"}, None),
    # A cluster manager alone: jax detects everything itself.
    ({}, {"SLURM_NTASKS": "4"}, {}),
    ({}, {"OMPI_COMM_WORLD_SIZE": "2"}, {}),
    # No cluster manager: all three, by flags, variables or both.
    (dict(coordinator_address="localhost:1234", num_processes=2, process_id=0), {},
     dict(coordinator_address="localhost:1234", num_processes=2, process_id=0)),
    ({}, FULL_ENV, dict(coordinator_address="10.0.0.1:8476", num_processes=4, process_id=3)),
    (dict(process_id=1), FULL_ENV,
     dict(coordinator_address="10.0.0.1:8476", num_processes=4, process_id=1)),
    # A cluster manager fills in what is not given.
    (dict(coordinator_address="host:99"), {"SLURM_NTASKS": "4"},
     dict(coordinator_address="host:99")),
    ({}, {"JAX_COORDINATOR_ADDRESS": "host:99", "SLURM_NTASKS": "4"},
     dict(coordinator_address="host:99")),
    # One process asked for.
    (dict(num_processes=1), {}, None),
])
def test_distributed_arguments_from_flags_environment_and_cluster(flags, environ, expected):
  assert distributed_arguments(**flags, environ=environ) == expected


@pytest.mark.parametrize("flags, environ, words", [
    # What the CLI's help used to suggest: an address alone.
    ({}, {"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234"},
     ["$JAX_COORDINATOR_ADDRESS=10.0.0.1:1234", "--num_processes (or $JAX_NUM_PROCESSES)",
      "--process_id (or $JAX_PROCESS_ID)", "cluster manager"]),
    (dict(num_processes=2, process_id=0), {}, ["--coordinator_address (or "]),
    (dict(coordinator_address="localhost"), {}, ["--coordinator_address='localhost'",
                                                 "host:port"]),
    (dict(coordinator_address="a:1", num_processes=2, process_id=2), {},
     ["--process_id=2", "below --num_processes=2"]),
    (dict(num_processes=0), {}, ["--num_processes=0", "at least 1"]),
    ({}, {"JAX_COORDINATOR_ADDRESS": "a:1", "JAX_NUM_PROCESSES": "two", "JAX_PROCESS_ID": "0"},
     ["$JAX_NUM_PROCESSES='two'", "integer"]),
])
def test_distributed_arguments_name_what_is_wrong(flags, environ, words):
  with pytest.raises(ValueError) as error:
    distributed_arguments(**flags, environ=environ)
  for word in words:
    assert word in str(error.value)


# ---------------------------------------------------------------------------
# Bad command lines: one line on stderr naming the flag and the fix, exit
# status 2, no traceback, nothing written.
# ---------------------------------------------------------------------------


def _run(tmp_path, *args, **env):
  environ = {key: value for key, value in os.environ.items()
             if not key.startswith(("JAX_COORDINATOR", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"))}
  environ.update(env)
  return subprocess.run([sys.executable, "-m", "experiments.train", *args], cwd=ROOT,
                        env=environ, capture_output=True, text=True, timeout=300)


def _assert_one_line_error(result, words):
  assert result.returncode == 2, result.stderr[-3000:]
  assert "Traceback" not in result.stderr, result.stderr[-3000:]
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1, result.stderr[-3000:]
  assert lines[0].startswith("error: ")
  for word in words:
    assert word in lines[0]


def test_a_workdir_that_is_a_file_is_refused(tmp_path):
  path = tmp_path / "a-file"
  path.write_text("not a workdir")
  result = _run(tmp_path, f"--config={TINY}", f"--workdir={path}")
  _assert_one_line_error(result, [f"--workdir={path}", "existing file", "give a directory"])
  result = _run(tmp_path, f"--config={TINY}", f"--workdir={path}/run")
  _assert_one_line_error(result, [f"--workdir={path}/run", f"inside {path}"])
  assert path.read_text() == "not a workdir"


def test_a_config_file_that_does_not_exist_is_refused(tmp_path):
  missing = tmp_path / "no_such_config.py"
  for extra in ([], ["--config.num_train_steps=3"]):  # overrides fail differently inside
    result = _run(tmp_path, f"--config={missing}:arg", f"--workdir={tmp_path / 'w'}", *extra)
    _assert_one_line_error(result, [f"--config={missing}:arg", "does not exist",
                                    "give a config file's path"])
  assert not (tmp_path / "w").exists()


@pytest.mark.parametrize("override, words", [
    ("--config.model.embed_dims=8", ["--config.model.embed_dims", "no key 'model.embed_dims'",
                                     "did you mean --config.model.embed_dim"]),
    ("--config.optimiser.learning_rate=1", ["--config.optimiser.learning_rate",
                                            "did you mean --config.optimizer.learning_rate"]),
    ("--config.zzz=1", ["--config.zzz", "no key 'zzz'", "get_config() returns"]),
    ("--config.model.attention_options.window=3", [
        "no key 'model.attention_options.window'", "variant_options"]),
    ("--config.model.pooling_options.queries=3", [
        "no key 'model.pooling_options.queries'", "variant_options('attention_pooling')"]),
])
def test_an_override_of_a_key_that_does_not_exist_is_refused(tmp_path, override, words):
  result = _run(tmp_path, f"--config={TINY}", f"--workdir={tmp_path / 'w'}", override)
  _assert_one_line_error(result, words)
  assert not (tmp_path / "w").exists()


def test_a_coordinator_address_alone_is_refused_before_jax_starts(tmp_path):
  result = _run(tmp_path, f"--config={TINY}", f"--workdir={tmp_path / 'w'}",
                JAX_COORDINATOR_ADDRESS="localhost:1")
  _assert_one_line_error(result, ["$JAX_COORDINATOR_ADDRESS=localhost:1", "--num_processes",
                                  "--process_id"])
  assert not (tmp_path / "w").exists()


def test_a_diverging_run_stops_with_one_line_naming_the_step_and_last_good_checkpoint(
    tmp_path):
  workdir = tmp_path / "w"
  # An absurd learning rate: the warm-up's first update (step 2) blows the
  # parameters up, so step 3's loss is not finite.
  result = _run(tmp_path, f"--config={TINY}", f"--workdir={workdir}",
                f"--config.data_dir={tmp_path / 'data'}", "--config.optimizer.learning_rate=1e30",
                "--config.optimizer.grad_clip_norm=0", "--config.checkpoint_every=2",
                "--config.log_every=4")
  assert result.returncode == 1, result.stderr[-3000:]
  assert "Traceback" not in result.stderr
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1, result.stderr[-3000:]
  assert lines[0].startswith("error: training diverged: ")
  assert "at step 3;" in lines[0]
  good = workdir / "checkpoints" / "2"
  assert f"the last good checkpoint is step 2 at {good}" in lines[0]
  assert good.is_dir()
  # Nothing of the diverged state is saved; its record says what happened.
  steps = {p.name for p in (workdir / "checkpoints").iterdir() if p.name.isdigit()}
  assert steps == {"2"}
  assert math.isnan(metrics.read_metrics(workdir, "train")[-1]["loss"])
  assert not (workdir / "results.json").exists()
