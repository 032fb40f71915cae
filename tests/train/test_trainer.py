"""The training loop end to end on one CPU device: what a run leaves in its
workdir, exact resumption (after SIGKILL, SIGINT or SIGTERM, after a corrupted
checkpoint), a diverging run stopped, and bad input refused before anything is
compiled or written."""

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from attention_jax.train import checkpoints, metrics
from attention_jax.train import trainer as train_trainer
from attention_jax.train.config import config_differences, default_config
from attention_jax.train.trainer import train_and_evaluate
from attention_jax.train.workdir import WorkdirConflictError

ROOT = pathlib.Path(__file__).parents[2]
TINY = ROOT / "tests" / "train" / "tiny_config.py"

sys.path.insert(0, str(TINY.parent))
import tiny_config  # pylint: disable=g-import-not-at-top,wrong-import-position
from saved_params import checkpoint_params  # pylint: disable=g-import-not-at-top,wrong-import-position


def _config(tmp_path, **overrides):
  config = tiny_config.get_config()
  config.data_dir = str(tmp_path / "data")
  for key, value in overrides.items():
    config[key] = value
  return config


def _assert_same_run(results_a, results_b):
  for split in ("validation", "test"):
    a, b = results_a["metrics"][split], results_b["metrics"][split]
    assert a["step"] == b["step"] if "step" in a else True
    np.testing.assert_allclose(a["loss"], b["loss"], rtol=1e-6, err_msg=split)
    assert a["accuracy"] == b["accuracy"], split


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
  tmp_path = tmp_path_factory.mktemp("run")
  workdir = tmp_path / "workdir"
  results = train_and_evaluate(_config(tmp_path), workdir)
  return tmp_path, workdir, results


def test_run_leaves_config_checkpoints_metrics_events_and_results(finished_run):
  tmp_path, workdir, results = finished_run
  on_disk = json.loads((workdir / "results.json").read_text())
  assert on_disk["metrics"]["validation"] == results["metrics"]["validation"]
  assert on_disk["config"]["model"]["attention"] == "dot_product"
  assert on_disk["config"]["model"]["vocab_size"] == 18  # filled in from the task
  assert on_disk["devices"]["count"] == 1 and on_disk["devices"]["platform"] == "cpu"
  assert on_disk["git_revision"] is None or len(on_disk["git_revision"]) >= 40
  m = on_disk["metrics"]
  assert m["steps_per_s"] > 0 and m["examples_per_s"] == pytest.approx(16 * m["steps_per_s"])
  assert m["tokens_per_s"] == pytest.approx(m["examples_per_s"] * 40)
  assert m["peak_memory_bytes"] > 0 and m["memory_source"] == "host_rss"
  assert m["num_params"] > 1000
  assert 0.0 <= m["test"]["accuracy"] <= 1.0 and m["test"]["count"] == 48
  assert m["validation"]["count"] == 64  # every example once, none twice

  records = metrics.read_metrics(workdir)
  train_steps = [r["step"] for r in records if r["split"] == "train"]
  assert train_steps == list(range(2, 25, 2))
  assert [r["step"] for r in records if r["split"] == "validation"] == [8, 16, 24]
  assert all(np.isfinite(r["loss"]) for r in records)
  assert list((workdir / "tensorboard").glob("events.out.tfevents.*"))

  # The latest two checkpoints and the best by validation accuracy.
  validation = {r["step"]: r["accuracy"] for r in records if r["split"] == "validation"}
  kept = {int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit()}
  assert {20, 24} <= kept and len(kept) <= 3
  best_kept = max(validation.get(step, -1.0) for step in kept)
  assert best_kept == max(validation.values())  # ties between steps may keep either
  assert m["best_validation"]["accuracy"] == pytest.approx(max(validation.values()))


def test_restarting_a_finished_run_trains_nothing_and_reports_the_same(finished_run):
  tmp_path, workdir, results = finished_run
  before = _snapshot(workdir)
  again = train_and_evaluate(_config(tmp_path), workdir)
  assert again == json.loads(json.dumps(results, default=str))
  assert _snapshot(workdir) == before


def test_a_run_killed_after_its_last_checkpoint_finishes_without_training(finished_run,
                                                                          tmp_path):
  source_tmp, workdir, results = finished_run
  copy = tmp_path / "workdir"
  subprocess.run(["cp", "-r", str(workdir), str(copy)], check=True)
  (copy / "results.json").unlink()
  again = train_and_evaluate(_config(source_tmp), copy)
  assert again["resumed_from"] == 24 and again["metrics"]["compile_s"] is None
  _assert_same_run(results, again)


def test_a_corrupted_latest_checkpoint_is_skipped_and_training_redone_exactly(finished_run,
                                                                              tmp_path):
  source_tmp, workdir, results = finished_run
  copy = tmp_path / "workdir"
  subprocess.run(["cp", "-r", str(workdir), str(copy)], check=True)
  (copy / "results.json").unlink()
  latest = copy / "checkpoints" / "24"
  data_files = [p for p in latest.rglob("*") if p.is_file() and p.stat().st_size > 0]
  for path in data_files:
    path.write_bytes(b"\0garbage" * 4)
  with pytest.warns(checkpoints.CorruptCheckpointWarning, match=str(latest)):
    redone = train_and_evaluate(_config(source_tmp), copy)
  assert redone["resumed_from"] == 20
  _assert_same_run(results, redone)
  # The bad checkpoint is kept aside, not deleted.
  assert list((copy / "checkpoints").rglob("corrupt*"))


def test_sigkill_at_any_moment_then_restart_reaches_the_uninterrupted_result(finished_run,
                                                                            tmp_path):
  source_tmp, reference_workdir, reference = finished_run
  workdir = tmp_path / "killed"
  command = [sys.executable, "-m", "experiments.train", f"--config={TINY}",
             f"--workdir={workdir}", f"--config.data_dir={source_tmp / 'data'}",
             # Slow steps (a longer run of the same kind would do the same) give the
             # kill a window between checkpoints.
             "--config.log_every=1"]
  env = dict(os.environ, PYTHONUNBUFFERED="1")
  process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE)
  deadline = time.time() + 300
  killed_after = None
  while time.time() < deadline and process.poll() is None:
    steps = [r["step"] for r in _safe_read(workdir) if r["split"] == "train"]
    if steps and steps[-1] >= 10:  # after checkpoint 8, before checkpoint 12
      process.send_signal(signal.SIGKILL)
      killed_after = steps[-1]
      break
    time.sleep(0.005)
  process.wait()
  assert killed_after is not None, "the run finished before it could be killed"
  assert not (workdir / "results.json").exists()

  # The restart uses the same command; log_every differs from the reference run
  # only in how often it writes train records.
  finished = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=600)
  assert finished.returncode == 0, finished.stderr[-3000:]
  resumed = json.loads((workdir / "results.json").read_text())
  # The newest checkpoint that was complete when killed (an async save may
  # still have been writing the one before the kill).
  assert resumed["resumed_from"] in (4, 8, 12) and resumed["resumed_from"] <= killed_after
  _assert_same_run(reference, resumed)
  for a, b in zip(jax.tree.leaves(checkpoint_params(reference_workdir, 24)),
                  jax.tree.leaves(checkpoint_params(workdir, 24))):
    np.testing.assert_array_equal(a, b)
  # The train records of the steps redone after the restart are not duplicated.
  steps = [r["step"] for r in metrics.read_metrics(workdir) if r["split"] == "train"]
  assert steps == list(range(1, 25))


@pytest.mark.parametrize("signal_number", [signal.SIGINT, signal.SIGTERM],
                         ids=["SIGINT", "SIGTERM"])
def test_a_signal_checkpoints_the_current_step_and_the_same_command_resumes_exactly(
    finished_run, tmp_path, signal_number):
  source_tmp, reference_workdir, reference = finished_run
  workdir = tmp_path / "interrupted"
  command = [sys.executable, "-m", "experiments.train", f"--config={TINY}",
             f"--workdir={workdir}", f"--config.data_dir={source_tmp / 'data'}",
             "--config.log_every=1"]
  env = dict(os.environ, PYTHONUNBUFFERED="1")
  process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
  deadline = time.time() + 300
  signalled_after = None
  while time.time() < deadline and process.poll() is None:
    steps = [r["step"] for r in _safe_read(workdir) if r["split"] == "train"]
    if steps and steps[-1] >= 10:  # between checkpoints 8 and 12
      process.send_signal(signal_number)
      signalled_after = steps[-1]
      break
    time.sleep(0.005)
  _, stderr = process.communicate(timeout=300)
  assert signalled_after is not None, "the run finished before it could be signalled"
  # 128 + the signal's number, as a shell reports a process the signal killed.
  assert process.returncode == 128 + signal_number, stderr[-3000:]
  assert "Traceback" not in stderr
  lines = stderr.strip().splitlines()
  assert len(lines) == 1, stderr[-3000:]
  stopped = int(lines[0].split("after step ")[1].split(";")[0])
  name = signal.Signals(signal_number).name
  assert lines[0].startswith(f"interrupted by {name} after step {stopped}; saved its "
                             f"checkpoint {workdir / 'checkpoints' / str(stopped)}.")
  assert lines[0].endswith("To resume, run the same command: " + " ".join(command))
  # The step it stopped after is checkpointed, whether or not a multiple of
  # checkpoint_every, and the log has a record of each step up to it.
  assert signalled_after <= stopped < 24
  assert (workdir / "checkpoints" / str(stopped)).is_dir()
  assert [r["step"] for r in metrics.read_metrics(workdir, "train")] == list(
      range(1, stopped + 1))
  assert not (workdir / "results.json").exists()
  if signal_number == signal.SIGTERM:
    return  # The same checkpoint as SIGINT's; resuming it once is enough.

  finished = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=600)
  assert finished.returncode == 0, finished.stderr[-3000:]
  resumed = json.loads((workdir / "results.json").read_text())
  assert resumed["resumed_from"] == stopped
  _assert_same_run(reference, resumed)
  for a, b in zip(jax.tree.leaves(checkpoint_params(reference_workdir, 24)),
                  jax.tree.leaves(checkpoint_params(workdir, 24))):
    np.testing.assert_array_equal(a, b)
  reference_losses = {r["step"]: r["loss"] for r in metrics.read_metrics(reference_workdir,
                                                                         "train")}
  losses = {r["step"]: r["loss"] for r in metrics.read_metrics(workdir, "train")}
  assert sorted(losses) == list(range(1, 25))
  for step in range(2, 25, 2):  # the reference records every other step
    if step - 1 > stopped or step <= stopped:  # records of the same two steps
      np.testing.assert_allclose((losses[step - 1] + losses[step]) / 2,
                                 reference_losses[step], rtol=1e-5)


def test_a_nan_loss_stops_the_run_naming_its_step_and_the_last_good_checkpoint(tmp_path):
  # An absurd learning rate: the warm-up's first update (step 2) blows the
  # parameters up, so step 3's loss is not finite. Records every 4 steps: the
  # divergence is noticed at step 4 but reported as step 3's.
  config = _config(tmp_path, log_every=4, checkpoint_every=2)
  config.optimizer.update(learning_rate=1e30, grad_clip_norm=0.0)
  workdir = tmp_path / "workdir"
  with pytest.raises(train_trainer.TrainingDivergedError) as error:
    train_and_evaluate(config, workdir)
  assert error.value.step == 3 and not np.isfinite(error.value.loss)
  assert error.value.checkpoint_step == 2
  assert error.value.checkpoint_path == str(workdir / "checkpoints" / "2")
  assert f"step 2 at {workdir / 'checkpoints' / '2'}" in str(error.value)
  assert {p.name for p in (workdir / "checkpoints").iterdir() if p.name.isdigit()} == {"2"}


def test_a_nan_before_a_checkpoint_between_records_is_caught_before_saving(tmp_path):
  # Records every 8 steps, checkpoints every 2: the check before each save
  # stops the run at step 4's checkpoint, not at step 8's record.
  config = _config(tmp_path, log_every=8, checkpoint_every=2)
  config.optimizer.update(learning_rate=1e30, grad_clip_norm=0.0)
  workdir = tmp_path / "workdir"
  with pytest.raises(train_trainer.TrainingDivergedError) as error:
    train_and_evaluate(config, workdir)
  assert error.value.step == 3 and error.value.checkpoint_step == 2
  records = metrics.read_metrics(workdir, "train")
  assert [r["step"] for r in records] == [4] and np.isnan(records[0]["loss"])


def _safe_read(workdir):
  try:
    return metrics.read_metrics(workdir)
  except ValueError:  # a line being written
    return []


# ---------------------------------------------------------------------------
# Bad input: refused before compiling, nothing in the workdir touched.
# ---------------------------------------------------------------------------


def _snapshot(folder):
  return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
          if p.is_file()}


def test_a_model_field_added_after_a_run_started_at_its_default_is_no_difference():
  """A run killed before a new ModelConfig field existed resumes: its saved
  config lacks the field, and the default is what the model did then."""
  current = json.loads(default_config_dict_with(decode=False))
  saved = json.loads(default_config_dict_with(decode=False))
  del saved["model"]["decode"]
  assert config_differences(saved, current) == []
  current["model"]["decode"] = True  # set to something else, it is one
  assert config_differences(saved, current) == [("model.decode", None, True)]
  current["model"]["decode"] = False
  current["model"]["embed_dim"] = 999  # and fields both have still compare
  assert [key for key, *_ in config_differences(saved, current)] == ["model.embed_dim"]


def default_config_dict_with(**model_fields):
  config = default_config()
  config.model.update(model_fields)
  return config.to_json()


def test_a_workdir_of_another_config_is_refused_untouched_unless_overwritten(finished_run,
                                                                             tmp_path):
  source_tmp, workdir, _ = finished_run
  copy = tmp_path / "workdir"
  subprocess.run(["cp", "-r", str(workdir), str(copy)], check=True)
  before = _snapshot(copy)
  other = _config(source_tmp)
  other.model.embed_dim = 32
  with pytest.raises(WorkdirConflictError, match=r"model\.embed_dim: 16 there, 32 now"):
    train_and_evaluate(other, copy)
  assert _snapshot(copy) == before

  other.num_train_steps = 2
  other.optimizer.warmup_steps = 1
  other.eval_every = other.checkpoint_every = other.log_every = 2
  train_and_evaluate(other, copy, overwrite=True)
  moved = [p for p in tmp_path.iterdir() if p.name.startswith("workdir.replaced-")]
  assert len(moved) == 1 and _snapshot(moved[0]) == before
  assert json.loads((copy / "config.json").read_text())["model"]["embed_dim"] == 32


@pytest.mark.parametrize("key, value, words", [
    ("mesh_shape", (3, 1, 1), ["(3, 1, 1)", "3 devices", "there are 1"]),
    ("task", "listopz", ["unknown task 'listopz'", "listops"]),
    ("num_train_steps", 0, ["num_train_steps", "positive", "0"]),
    ("sequence_shards", 0, ["sequence_shards", "positive", "0"]),
    ("sequence_shards", 2, ["(-1, 1, 1) with sequence_shards=2", "1 devices",
                            "groups of 2"]),
    ("model.attention", "linformer", ["sequence_shards=2", "ring attention",
                                      "model.attention='linformer'"]),
    ("model.attention", "local", ["sequence_shards=2", "ring attention",
                                  "model.attention='local'"]),
    ("model.attention_options.implementation", "xla",
     ["sequence_shards=2", "implementation='ring'", "implementation='xla'"]),
])
def test_bad_values_are_refused_before_anything_is_written(tmp_path, key, value, words):
  config = _config(tmp_path)
  if key.startswith("model."):  # what sequence_shards=2 cannot run
    config.sequence_shards = 2
    if key == "model.attention":
      config.model.attention = value
      config.model.attention_options = {}
    else:
      config.model.attention_options.implementation = value
  else:
    config[key] = value
  with pytest.raises(ValueError) as error:
    train_and_evaluate(config, tmp_path / "workdir")
  for word in words:
    assert word in str(error.value)
  assert not (tmp_path / "workdir").exists()


def test_a_workdir_that_is_a_file_is_refused_before_anything_is_written(tmp_path):
  path = tmp_path / "a-file"
  path.write_text("x")
  for workdir in (path, path / "run"):
    with pytest.raises(ValueError, match=f"workdir {workdir} .*existing file"):
      train_and_evaluate(_config(tmp_path), workdir)
  assert path.read_text() == "x" and not (tmp_path / "data").exists()


def test_unknown_config_keys_and_variants_are_refused(tmp_path):
  config = _config(tmp_path)
  config.unlock()
  config.optimiser = {"learning_rate": 1.0}
  with pytest.raises(ValueError, match="unknown config key.*'optimiser'"):
    train_and_evaluate(config, tmp_path / "workdir")
  config = _config(tmp_path)
  config.model.attention = "performr"
  with pytest.raises(ValueError, match="performr"):
    train_and_evaluate(config, tmp_path / "workdir")
  assert not (tmp_path / "workdir").exists()


def test_command_line_reports_bad_overrides_without_a_traceback(tmp_path):
  command = [sys.executable, "-m", "experiments.train", f"--config={TINY}",
             f"--workdir={tmp_path / 'w'}", "--config.model.embed_dims=8"]
  result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert result.returncode != 0
  assert "embed_dims" in result.stderr
  assert not (tmp_path / "w").exists()


def test_a_language_model_and_gradient_accumulation_train_through_the_same_loop(tmp_path,
                                                                               monkeypatch):
  config = _config(tmp_path, num_train_steps=8, eval_every=8, checkpoint_every=8)
  monkeypatch.chdir(tmp_path)  # a relative workdir (orbax itself wants absolute paths)
  config.model.kind = "language_model"
  config.optimizer.grad_accum_steps = 2
  config.optimizer.update(warmup_steps=1, learning_rate=1e-2)
  results = train_and_evaluate(config, "lm")
  validation = results["metrics"]["validation"]
  # Token-level: the count is the number of real next tokens, not of examples.
  assert validation["count"] > 64 * 5
  assert np.isfinite(validation["loss"])
  losses = [r["loss"] for r in metrics.read_metrics(tmp_path / "lm", "train")]
  assert losses[-1] < losses[0] - 0.1  # it learns
  # 8 batches are 4 optimiser updates: the schedule ends at update 4.
  assert results["config"]["optimizer"]["num_train_steps"] == 4


# ---------------------------------------------------------------------------
# Every task plugs into the trainer by its config file (data this machine
# cannot download: tfds's mock data, a release-format TSV written here).
# ---------------------------------------------------------------------------


def _lra_config(name, tmp_path, **task_options):
  import importlib.util  # pylint: disable=g-import-not-at-top
  spec = importlib.util.spec_from_file_location("lra_config", ROOT / "configs" / "lra" / name)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config("linear,smoke")
  config.task_options.update(task_options)
  config.update(data_dir=str(tmp_path / "data"), num_train_steps=2, eval_every=2,
                checkpoint_every=2, log_every=1, progress=False, batch_size=4,
                eval_batch_size=4)
  config.optimizer.warmup_steps = 1
  return config


@pytest.mark.parametrize("name", ["text.py", "image.py"])
def test_tfds_tasks_train_by_config_name(tmp_path, name):
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  config = _lra_config(name, tmp_path, train_size=8, validation_size=4, test_size=4)
  with tfds.testing.mock_data(num_examples=8):
    results = train_and_evaluate(config, tmp_path / "workdir")
  assert results["metrics"]["validation"]["count"] == 4
  assert results["metrics"]["test"]["count"] == 4


def test_retrieval_trains_the_dual_tower_by_config_name(tmp_path):
  release = tmp_path / "release"
  release.mkdir()
  rng = np.random.default_rng(0)
  for name in ("train", "eval", "test"):
    lines = [f"{i % 2}\tid{i}\tid{i + 1}\tpaper {rng.integers(1000)} cites\tother {i}\n"
             for i in range(8)]
    (release / f"new_aan_pairs.{name}.tsv").write_text("".join(lines))
  config = _lra_config("retrieval.py", tmp_path, release_dir=str(release), seq_len=32,
                       train_size=8, validation_size=4, test_size=4)
  results = train_and_evaluate(config, tmp_path / "workdir")
  assert results["config"]["model"]["kind"] == "dual_classifier"
  assert results["metrics"]["validation"]["count"] == 4


def test_a_workdir_holding_only_the_config_of_a_run_that_never_started_is_reused(tmp_path):
  workdir = tmp_path / "workdir"
  workdir.mkdir()
  stale = _config(tmp_path)
  stale.model.embed_dim = 32
  (workdir / "config.json").write_text(stale.to_json())
  config = _config(tmp_path, num_train_steps=2, eval_every=2, checkpoint_every=2, log_every=2)
  config.optimizer.warmup_steps = 1
  results = train_and_evaluate(config, workdir)
  assert results["config"]["model"]["embed_dim"] == 16
  assert json.loads((workdir / "config.json").read_text())["model"]["embed_dim"] == 16
