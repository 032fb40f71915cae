"""Two CPU processes without a cluster manager: `experiments.train` with
--coordinator_address/--num_processes/--process_id (process 0) and the
JAX_COORDINATOR_ADDRESS/JAX_NUM_PROCESSES/JAX_PROCESS_ID variables (process 1),
one simulated device each, exchanging data through gloo on a free localhost
port. Their losses must be those of one process with the same two devices.

Every run is its own `python -m experiments.train` process: the device count
and `jax.distributed` must be set up before jax initialises.
"""

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from attention_jax.train import metrics

ROOT = pathlib.Path(__file__).parents[2]
TINY = ROOT / "tests" / "train" / "tiny_config.py"
TIMEOUT_S = 240
# Long enough for the loss to move and for a signal to land mid-run; short
# enough for 2 shared cores (one validation batch, no test pass).
STEPS = 8
OVERRIDES = (f"--config.num_train_steps={STEPS}", "--config.log_every=1",
             f"--config.eval_every={STEPS}", "--config.checkpoint_every=4",
             "--config.eval_steps=1", "--config.test_at_end=false")


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def _env(device_count: int, **extra) -> dict:
  env = dict(os.environ, PYTHONUNBUFFERED="1", **extra)
  # conftest's XLA_FLAGS (the optimisation level) are kept.
  env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                      f" --xla_force_host_platform_device_count={device_count}").strip()
  # gloo is jax's default for CPU collectives; named so that the test says what it uses.
  env["JAX_CPU_COLLECTIVES_IMPLEMENTATION"] = "gloo"
  for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
    if name not in extra:
      env.pop(name, None)
  return env


def _command(workdir, data_dir):
  return [sys.executable, "-m", "experiments.train", f"--config={TINY}", f"--workdir={workdir}",
          f"--config.data_dir={data_dir}", *OVERRIDES]


def _start_pair(workdir, data_dir):
  """Starts process 0 (by flags) and process 1 (by environment variables)."""
  address = f"localhost:{_free_port()}"
  command = _command(workdir, data_dir)
  first = subprocess.Popen(
      command + [f"--coordinator_address={address}", "--num_processes=2", "--process_id=0"],
      cwd=ROOT, env=_env(1), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  second = subprocess.Popen(
      command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
      env=_env(1, JAX_COORDINATOR_ADDRESS=address, JAX_NUM_PROCESSES="2", JAX_PROCESS_ID="1"))
  return [first, second]


def _finish(processes):
  """(returncode, stderr) of each process; kills all if one hangs."""
  results = []
  try:
    for process in processes:
      _, stderr = process.communicate(timeout=TIMEOUT_S)
      results.append((process.returncode, stderr))
  finally:
    for process in processes:
      if process.poll() is None:
        process.kill()
        process.wait()
  return results


def _train_losses(workdir):
  return [r["loss"] for r in metrics.read_metrics(workdir, "train")]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
  """One process with two devices; it also prepares the data the pairs read."""
  tmp = tmp_path_factory.mktemp("multiprocess")
  workdir = tmp / "one-process"
  result = subprocess.run(_command(workdir, tmp / "data"), cwd=ROOT, env=_env(2),
                          capture_output=True, text=True, timeout=TIMEOUT_S)
  assert result.returncode == 0, result.stderr[-3000:]
  return tmp, workdir


def test_two_processes_train_like_one_process_with_as_many_devices(one_process):
  tmp, reference = one_process
  workdir = tmp / "two-processes"
  for rank, (returncode, stderr) in enumerate(_finish(_start_pair(workdir, tmp / "data"))):
    assert returncode == 0, f"process {rank}: {stderr[-3000:]}"

  results = json.loads((workdir / "results.json").read_text())
  assert results["devices"]["process_count"] == 2 and results["devices"]["count"] == 2
  assert results["devices"]["local_count"] == 1
  expected = _train_losses(reference)
  assert len(expected) == STEPS and np.ptp(expected) > 1e-3  # the run moves
  np.testing.assert_allclose(_train_losses(workdir), expected, rtol=2e-5, atol=2e-6)
  reference_results = json.loads((reference / "results.json").read_text())
  np.testing.assert_allclose(results["metrics"]["validation"]["loss"],
                             reference_results["metrics"]["validation"]["loss"], rtol=2e-5)


@pytest.mark.slow
def test_a_signal_to_one_process_stops_both_after_the_same_step_and_resumes_exactly(
    one_process):
  tmp, reference = one_process
  workdir = tmp / "interrupted-pair"
  processes = _start_pair(workdir, tmp / "data")
  deadline = time.time() + TIMEOUT_S
  while time.time() < deadline and processes[1].poll() is None:
    records = metrics.read_metrics(workdir, "train") if (workdir / "metrics.jsonl").exists() \
        else []
    if records and records[-1]["step"] >= 2:
      processes[1].send_signal(signal.SIGINT)
      break
    time.sleep(0.005)
  (code_0, stderr_0), (code_1, stderr_1) = _finish(processes)
  # Process 1 got SIGINT; process 0 stops for it and reports the same signal.
  assert (code_0, code_1) == (130, 130), (stderr_0[-2000:], stderr_1[-2000:])
  stopped = [int(line.split("after step ")[1].split(";")[0]) for line in
             (stderr_0 + stderr_1).splitlines() if "interrupted by SIGINT" in line]
  assert len(stopped) == 2 and stopped[0] == stopped[1] < STEPS
  assert (workdir / "checkpoints" / str(stopped[0])).is_dir()

  for rank, (returncode, stderr) in enumerate(_finish(_start_pair(workdir, tmp / "data"))):
    assert returncode == 0, f"process {rank}: {stderr[-3000:]}"
  results = json.loads((workdir / "results.json").read_text())
  assert results["resumed_from"] == stopped[0]
  np.testing.assert_allclose(_train_losses(workdir), _train_losses(reference), rtol=2e-5,
                             atol=2e-6)
