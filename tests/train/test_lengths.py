"""Evaluation past the training length (`config.length_eval`): the best
checkpoint tested at longer lengths, checked against an evaluation written
here; RoPE scaled at evaluation; lengths and position schemes that cannot be
evaluated refused before anything is trained."""

import json

import jax
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
import pytest

from attention_jax import data as lra_data
from attention_jax.models import build_model
from attention_jax.train.completion import complete_config
from attention_jax.train.config import config_differences, default_config
from attention_jax.train.trainer import train_and_evaluate
from attention_testing import jit_apply

TRAIN_LENGTH = 16


def _config(tmp_path, position="rope", variant="dot_product", **length_eval):
  config = default_config(variant)
  config.task = "mqar"
  config.task_options = dict(train_size=256, validation_size=32, test_size=32,
                             seq_len=TRAIN_LENGTH, pair_counts=(2,), num_keys=8, num_values=8)
  config.data_dir = str(tmp_path / "data")
  config.model.update(kind="language_model", num_layers=1, embed_dim=16, num_heads=2,
                      mlp_dim=32, position=position, dropout_rate=0.0,
                      attention_dropout_rate=0.0)
  config.num_train_steps = 8
  config.optimizer.update(learning_rate=1e-2, warmup_steps=2)
  config.batch_size = 16
  config.eval_every = config.checkpoint_every = 8
  config.log_every = 4
  config.progress = False
  config.length_eval.update(length_eval)
  return config


def _accuracy_and_loss(config_dict, params, length, tmp_path, position_options):
  """Test accuracy and mean cross-entropy of the scored tokens of MQAR made at
  `length`, scored here from the model's logits."""
  options = dict(config_dict["task_options"], seq_len=length)
  task = lra_data.get_task("mqar", **options)
  task.prepare(tmp_path / f"check{length}", progress=False)
  test = task.splits(tmp_path / f"check{length}")["test"]
  batch = test.gather(np.arange(len(test)))
  model_config = dict(config_dict["model"], max_length=length,
                      position_options=position_options)
  model = build_model(ml_collections.ConfigDict(model_config))
  inputs = batch["inputs"]
  logits = jit_apply(model, {"params": params}, inputs, padding_mask=inputs != 0,
                     deterministic=True)[:, :-1]
  labels, scored = inputs[:, 1:], batch["target_mask"][:, 1:] > 0
  log_probs = jax.nn.log_softmax(np.asarray(logits, np.float64), axis=-1)
  nll = -np.take_along_axis(np.asarray(log_probs), labels[..., None], axis=-1)[..., 0]
  right = np.argmax(logits, axis=-1) == labels
  return float(right[scored].mean()), float(nll[scored].mean())


@pytest.fixture(scope="module")
def yarn_run(tmp_path_factory):
  tmp_path = tmp_path_factory.mktemp("lengths")
  workdir = tmp_path / "workdir"
  results = train_and_evaluate(_config(tmp_path, lengths=(32, 64), rope_scaling="yarn"), workdir)
  return tmp_path, workdir, results


def test_the_best_checkpoint_is_tested_at_each_length_with_rope_stretched_to_it(yarn_run):
  tmp_path, workdir, results = yarn_run
  metrics = results["metrics"]
  by_length = metrics["test_by_length"]
  assert list(by_length) == ["16", "32", "64"]
  assert by_length["16"] == metrics["test"]  # the training length is the ordinary test
  assert all(entry["step"] == metrics["test"]["step"] for entry in by_length.values())
  assert json.loads((workdir / "results.json").read_text())["metrics"]["test_by_length"] == \
      by_length
  with ocp.CheckpointManager(workdir / "checkpoints") as manager:
    restored = manager.restore(metrics["test"]["step"])
  state = restored["default"] if "default" in restored else restored
  params = jax.tree.map(np.asarray, state["params"] if isinstance(state, dict) else state.params)
  config = results["config"]
  for length in (32, 64):
    factor = length / TRAIN_LENGTH
    yarn = dict(scaling="yarn", scaling_factor=factor, original_length=TRAIN_LENGTH)
    accuracy, loss = _accuracy_and_loss(config, params, length, tmp_path, yarn)
    assert by_length[str(length)]["accuracy"] == pytest.approx(accuracy, abs=1e-6)
    assert by_length[str(length)]["loss"] == pytest.approx(loss, rel=1e-4)
    assert by_length[str(length)]["count"] == 32 * 2  # 32 examples of 2 answers each
    # Without the scaling the same parameters score differently: it was applied.
    _, unscaled_loss = _accuracy_and_loss(config, params, length, tmp_path, {})
    assert abs(unscaled_loss - loss) > 1e-3 * loss


def test_each_length_is_logged_as_its_own_test_split(yarn_run):
  _, workdir, _ = yarn_run
  records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  assert {r["split"] for r in records} >= {"test", "test_length32", "test_length64"}


def test_a_run_from_before_length_eval_existed_still_resumes(tmp_path):
  saved = default_config().to_dict()
  del saved["length_eval"]
  assert config_differences(saved, default_config().to_dict()) == []
  changed = default_config()
  changed.length_eval.lengths = (128,)
  assert [key for key, _, _ in config_differences(saved, changed.to_dict())] == \
      ["length_eval.lengths"]


@pytest.mark.parametrize("position, length_eval, message", [
    ("learned", dict(lengths=(32,)), "model.position='learned' has a table of 16 trained "
                                     "positions and none past it"),
    ("rope", dict(lengths=(16, 32)), r"longer than the training length 16 .*got \(16, 32\)"),
    ("rope", dict(lengths=(8,)), "longer than the training length 16"),
    ("rope", dict(lengths=(32, 32)), "lists a length twice"),
    ("sinusoidal", dict(lengths=(32,), rope_scaling="yarn"),
     "stretches rotary positions, but model.position is 'sinusoidal'"),
    ("rope", dict(rope_scaling="ntk"), "length_eval.lengths is empty"),
    ("rope", dict(lengths=(32,), rope_scaling="log"), "rope_scaling must be None or one of"),
])
def test_lengths_the_model_cannot_be_evaluated_at_are_refused_naming_the_option(
    tmp_path, position, length_eval, message):
  config = _config(tmp_path, position=position, **length_eval)
  with pytest.raises(ValueError, match=message):
    complete_config(config)
  with pytest.raises(ValueError, match=message):
    train_and_evaluate(config, tmp_path / "workdir")
  assert not (tmp_path / "workdir").exists()


def test_a_task_without_a_length_option_is_refused(tmp_path):
  config = _config(tmp_path, lengths=(32,))
  config.task, config.task_options = "listops", dict(train_size=64)
  config.model.kind = "classifier"
  with pytest.raises(ValueError, match="task 'listops' at other lengths through its seq_len"):
    complete_config(config)


def test_parameters_sized_by_the_length_are_refused_before_training(tmp_path):
  # Linformer's projection of the keys is sized by the length it is built at.
  config = _config(tmp_path, position="sinusoidal", variant="linformer", lengths=(64,))
  config.task = "matching"
  config.task_options = dict(train_size=64, validation_size=16, test_size=16, seq_len=32)
  config.model.kind = "dual_classifier"
  config.model.attention_options.projected_length = 8
  with pytest.raises(ValueError, match=r"attention='linformer' with model.position='sinusoidal' "
                                       r"has parameters whose shapes depend on the sequence "
                                       r"length \(.*key_projection"):
    train_and_evaluate(config, tmp_path / "workdir")
  assert not (tmp_path / "workdir" / "checkpoints").exists()


def test_a_stream_too_short_for_its_lanes_at_a_length_is_refused_before_training(tmp_path):
  """The character corpus read at 8x the segment: its test split has fewer
  segments than the batch has streams, which evaluation could not read."""
  config = _config(tmp_path, lengths=(512,))
  config.task = "chars"
  config.task_options = dict(train_size=20_000, validation_size=4_096, test_size=4_096,
                             seq_len=64)
  with pytest.raises(ValueError, match="a stream of batch_size=16 lanes needs at least 16 "
                                       "examples, got 8"):
    train_and_evaluate(config, tmp_path / "workdir")
  assert not (tmp_path / "workdir" / "checkpoints").exists()
