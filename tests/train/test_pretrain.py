"""Self-pretraining (`attention_jax.train.pretrain`): a causal or masked
language-modelling phase on the task's inputs in <workdir>/pretrain/, its
encoder handed to the classifier; either phase resumes to the parameters of an
uninterrupted run."""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_jax.models import ModelConfig
from attention_jax.train import pretrain
from attention_jax.train.objectives import PAD_ID, OBJECTIVES
from attention_jax.train.trainer import train_and_evaluate
from tests.train import tiny_config
from tests.train.saved_params import checkpoint_params

PRETRAIN_STEPS = 8
STEPS = 12


def _config(tmp_path, **pretrain_options):
  config = tiny_config.get_config()
  config.data_dir = str(tmp_path / "data")
  config.num_train_steps = STEPS
  config.pretrain.update(dict(objective="causal", num_train_steps=PRETRAIN_STEPS,
                              learning_rate=1e-2), **pretrain_options)
  return config


def _assert_equal_trees(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(x, y)


@pytest.fixture(scope="module")
def pretrained_run(tmp_path_factory):
  tmp_path = tmp_path_factory.mktemp("pretrained")
  workdir = tmp_path / "workdir"
  return tmp_path, workdir, train_and_evaluate(_config(tmp_path), workdir)


def test_the_first_phase_is_a_language_model_of_the_task_s_inputs(pretrained_run):
  _, workdir, results = pretrained_run
  phase = json.loads((workdir / "pretrain" / "results.json").read_text())
  assert phase["config"]["model"]["kind"] == "language_model"
  assert phase["config"]["task"] == "listops" and phase["num_train_steps"] == PRETRAIN_STEPS
  assert phase["config"]["optimizer"]["learning_rate"] == 1e-2
  assert results["config"]["model"]["kind"] == "classifier"
  assert results["pretrain"]["num_train_steps"] == PRETRAIN_STEPS
  assert results["pretrain"]["validation"] == phase["metrics"]["validation"]
  # The classifier's encoder and the language model's share names and shapes.
  lm = checkpoint_params(workdir / "pretrain", PRETRAIN_STEPS)
  classifier = checkpoint_params(workdir, STEPS)
  assert jax.tree.structure(lm["encoder"]) == jax.tree.structure(classifier["encoder"])
  assert "lm_head" in lm and "head" in classifier


def test_the_classifier_starts_from_the_pretrained_encoder(tmp_path, pretrained_run):
  # With a learning rate of ~0 the classifier's encoder stays what it was handed.
  source, workdir, _ = pretrained_run
  config = _config(source)
  config.optimizer.learning_rate = 1e-12  # (weight decay is scaled by it too)
  still = tmp_path / "still"
  shutil.copytree(workdir / "pretrain", still / "pretrain")
  # (The first phase's config is unchanged by the classifier's optimizer: it
  # has its own learning rate, so its finished run is reused.)
  train_and_evaluate(config, still)
  handed = checkpoint_params(still / "pretrain", PRETRAIN_STEPS)["encoder"]
  kept = checkpoint_params(still, STEPS)["encoder"]
  for a, b in zip(jax.tree.leaves(handed), jax.tree.leaves(kept)):
    np.testing.assert_allclose(a, b, atol=1e-6)


@pytest.mark.parametrize("phase", ["pretrain", "classify"])
def test_a_run_stopped_in_either_phase_resumes_to_the_same_parameters(tmp_path, pretrained_run,
                                                                      phase):
  source, workdir, results = pretrained_run
  copy = tmp_path / "workdir"
  shutil.copytree(workdir, copy)
  # What a run killed after the phase's first kept checkpoint leaves: that
  # phase's later checkpoints and results gone (and, stopped in the first
  # phase, none of the second's files but its claim).
  stopped = copy / "pretrain" if phase == "pretrain" else copy
  (stopped / "results.json").unlink()
  kept = sorted(int(p.name) for p in (stopped / "checkpoints").iterdir() if p.name.isdigit())
  cut = kept[0]
  assert cut < (PRETRAIN_STEPS if phase == "pretrain" else STEPS)
  for step in kept[1:]:
    shutil.rmtree(stopped / "checkpoints" / str(step))
  if phase == "pretrain":
    for path in copy.iterdir():
      if path.name not in ("pretrain", "config.json"):
        shutil.rmtree(path) if path.is_dir() else path.unlink()
  resumed = train_and_evaluate(_config(source), copy)
  phase_results = json.loads((copy / "pretrain" / "results.json").read_text())
  if phase == "pretrain":
    assert phase_results["resumed_from"] == cut and resumed["resumed_from"] is None
  else:
    assert resumed["resumed_from"] == cut
  _assert_equal_trees(checkpoint_params(workdir, STEPS), checkpoint_params(copy, STEPS))
  _assert_equal_trees(checkpoint_params(workdir / "pretrain", PRETRAIN_STEPS),
                      checkpoint_params(copy / "pretrain", PRETRAIN_STEPS))
  assert resumed["metrics"]["test"] == results["metrics"]["test"]


@pytest.mark.parametrize("change, message", [
    (dict(objective="denoising"), r"pretrain.objective must be None or one of \('causal', "
                                  r"'masked'\), got 'denoising'"),
    (dict(num_train_steps=0), r"pretrain.num_train_steps must be a positive int"),
    (dict(objective="masked", mask_rate=1.0), r"pretrain.mask_rate must be in \(0, 1\) with "
                                              r"pretrain.objective='masked', got 1.0"),
])
def test_bad_pretraining_options_are_refused_by_name(tmp_path, change, message):
  with pytest.raises(ValueError, match=message):
    train_and_evaluate(_config(tmp_path, **change), tmp_path / "run")
  assert not (tmp_path / "run").exists()


def test_a_model_kind_without_the_classifier_s_encoder_is_refused(tmp_path):
  config = _config(tmp_path)
  config.model.kind = "funnel"
  with pytest.raises(ValueError, match=r"model.kind='funnel' has no such encoder"):
    pretrain.check_pretrain(config)


def test_a_variant_without_a_causal_form_is_refused_before_anything_is_written(tmp_path):
  config = tiny_config.get_config("linformer")
  config.data_dir = str(tmp_path / "data")
  config.pretrain.update(objective="causal", num_train_steps=4)
  with pytest.raises(ValueError, match=r"pretrain.objective='causal' trains "
                                       r"model.attention='linformer' as a language model first: "
                                       r".*'linformer' has no causal form"):
    train_and_evaluate(config, tmp_path / "run")
  assert not (tmp_path / "run").exists()


def test_masked_pretraining_hands_over_the_encoder_without_the_mask_row(tmp_path):
  # A classifier whose learning rate is ~0 keeps what it was handed: the
  # masked language model's encoder, its token embedding cut to the task's ids.
  config = _config(tmp_path, objective="masked", mask_rate=0.3)
  config.optimizer.learning_rate = 1e-12
  workdir = tmp_path / "workdir"
  train_and_evaluate(config, workdir)
  phase = json.loads((workdir / "pretrain" / "results.json").read_text())["config"]["model"]
  classifier = json.loads((workdir / "results.json").read_text())["config"]["model"]
  assert phase["kind"] == "masked_language_model" and phase["mask_rate"] == 0.3
  assert phase["vocab_size"] == classifier["vocab_size"] + 1  # [MASK]
  handed = checkpoint_params(workdir / "pretrain", PRETRAIN_STEPS)["encoder"]
  kept = checkpoint_params(workdir, STEPS)["encoder"]
  embedding = handed["token_embedding"]["embedding"]
  handed["token_embedding"]["embedding"] = embedding[:classifier["vocab_size"]]
  for a, b in zip(jax.tree.leaves(handed), jax.tree.leaves(kept)):
    np.testing.assert_allclose(a, b, atol=1e-6)


def test_an_encoder_the_classifier_cannot_take_is_refused_before_the_phase_trains(tmp_path):
  # Linformer's projections are sized by the length, which the classifier's
  # [CLS] makes one longer: the masked phase (which runs it both ways, as the
  # causal one cannot) would train an encoder that cannot be handed over.
  config = tiny_config.get_config("linformer")
  config.data_dir = str(tmp_path / "data")
  config.model.attention_options.projected_length = 8
  config.pretrain.update(objective="masked", num_train_steps=4)
  with pytest.raises(ValueError, match=r"encoder parameter \['block_0'\]\['attention'\]"
                                       r".*has shape \(40, 8\), the classifier's \(41, 8\)"):
    train_and_evaluate(config, tmp_path / "run")
  assert not (tmp_path / "run" / "pretrain").exists()


def _masking(batch, key=None, mask_rate=0.25, vocab_size=11):
  model = type("Model", (), {"config": ModelConfig(vocab_size=vocab_size, mask_rate=mask_rate)})
  return OBJECTIVES["masked_token"].prepared(batch, key, model)


def test_the_masked_objective_masks_real_tokens_at_its_rate_and_scores_only_them():
  rng = np.random.default_rng(0)
  lengths = rng.integers(1, 64, size=256)
  tokens = np.where(np.arange(64) < lengths[:, None], rng.integers(1, 10, size=(256, 64)), PAD_ID)
  batch = dict(inputs=jnp.asarray(tokens, jnp.int32), weight=jnp.ones(256).at[-1].set(0.0))
  out = _masking(batch, jax.random.key(3))
  masked, corrupted = np.asarray(out["masked"]), np.asarray(out["masked_inputs"])
  assert not masked[tokens == PAD_ID].any()
  np.testing.assert_array_equal(corrupted[masked], 10)  # [MASK]: the last id
  np.testing.assert_array_equal(corrupted[~masked], tokens[~masked])
  rate = masked.sum() / (tokens != PAD_ID).sum()
  assert abs(rate - 0.25) < 0.02, rate  # ~8,000 real tokens: 5 standard errors
  labels, weights = OBJECTIVES["masked_token"].targets(out)
  np.testing.assert_array_equal(labels, tokens)
  np.testing.assert_array_equal(weights, masked * np.asarray(batch["weight"])[:, None])
  # Training draws new positions with each step's key; evaluation's follow
  # from each example alone, whatever its batch.
  assert (np.asarray(_masking(batch, jax.random.key(4))["masked"]) != masked).any()
  evaluated = np.asarray(_masking(batch)["masked"])
  alone = np.asarray(_masking(dict(inputs=batch["inputs"][5:6], weight=batch["weight"][5:6]))[
      "masked"])
  np.testing.assert_array_equal(alone[0], evaluated[5])
  assert (evaluated[0] != evaluated[1]).any()
  with pytest.raises(ValueError, match=r"model.mask_rate must be in \(0, 1\), got 0.0"):
    ModelConfig(vocab_size=11, mask_rate=0.0)
