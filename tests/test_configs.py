"""Config files under configs/ load, validate their argument and build models."""

import importlib.util
import pathlib

import jax
import pytest

from attention_jax.models import SequenceClassifier, build_model

CONFIGS = pathlib.Path(__file__).resolve().parents[1] / "configs"


def _load(relative_path):
  spec = importlib.util.spec_from_file_location("config_under_test", CONFIGS / relative_path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@pytest.mark.parametrize("variant", ["dot_product", "multi_query"])
def test_classifier_config_builds_the_named_variant(variant):
  config = _load("models/classifier.py").get_config(variant)
  assert config.model.attention == variant
  model = build_model(config.model)
  assert isinstance(model, SequenceClassifier)
  assert model.config.attention == variant
  tokens = jax.numpy.zeros((2, 16), jax.numpy.int32)
  variables = jax.eval_shape(model.init, jax.random.PRNGKey(0), tokens)
  logits = jax.eval_shape(model.apply, variables, tokens)
  assert logits.shape == (2, config.model.num_classes)


def test_classifier_config_rejects_an_unknown_variant():
  with pytest.raises(ValueError, match="unknown attention variant 'nope'.*Valid names are"):
    _load("models/classifier.py").get_config("nope")


# ---------------------------------------------------------------------------
# configs/lra/<task>.py
# ---------------------------------------------------------------------------

LRA_CONFIGS = sorted(p.name for p in (CONFIGS / "lra").glob("*.py"))


def test_every_lra_task_has_a_config():
  assert LRA_CONFIGS == ["image.py", "listops.py", "pathfinder32.py", "pathx.py",
                         "retrieval.py", "text.py"]


@pytest.mark.parametrize("name", LRA_CONFIGS)
@pytest.mark.parametrize("arg", ["dot_product", "performer,smoke"])
def test_lra_config_validates_and_builds_a_model_for_its_task(name, arg):
  from attention_jax import data  # pylint: disable=g-import-not-at-top
  from attention_jax.train.config import check_config  # pylint: disable=g-import-not-at-top
  from attention_jax.train.trainer import task_options  # pylint: disable=g-import-not-at-top
  config = _load(f"lra/{name}").get_config(arg)
  check_config(config)
  assert config.model.attention == arg.split(",")[0]
  info = data.get_task(config.task, **task_options(config)).info
  model_config = dict(config.model.to_dict(), vocab_size=info.vocab_size,
                      num_classes=info.num_classes, max_length=info.seq_len)
  model = build_model(model_config)
  batch = {"inputs": jax.ShapeDtypeStruct((2, info.seq_len), jax.numpy.int32)}
  if info.dual:
    batch["inputs2"] = batch["inputs"]
  from attention_jax.train import get_objective  # pylint: disable=g-import-not-at-top
  call = get_objective(config.model.kind).model_call
  variables = jax.eval_shape(lambda b: model.init(jax.random.PRNGKey(0), b, True, method=call),
                             batch)
  logits = jax.eval_shape(lambda v, b: model.apply(v, b, True, method=call), variables, batch)
  assert logits.shape == (2, info.num_classes)
  # The optimiser's schedule is as long as the run.
  assert config.optimizer.num_train_steps == config.num_train_steps


def test_lra_listops_default_is_the_lra_release_setting():
  # lra_benchmarks/listops/configs/base_listops_config.py of the LRA release.
  config = _load("lra/listops.py").get_config("dot_product")
  assert (config.model.num_layers, config.model.embed_dim, config.model.num_heads,
          config.model.mlp_dim) == (6, 512, 8, 2048)
  assert (config.batch_size, config.num_train_steps) == (32, 5000)
  from attention_jax.train.optim import make_schedule  # pylint: disable=g-import-not-at-top
  schedule = make_schedule(config.optimizer)
  # "constant * linear_warmup * rsqrt_decay" with constant 0.05 and 1000 warm-up steps.
  for step in (500, 1000, 4000):
    expected = 0.05 * min(1.0, step / 1000) / max(step, 1000) ** 0.5
    assert float(schedule(step)) == pytest.approx(expected, rel=1e-5)


def test_lra_config_rejects_unknown_presets_and_variants():
  with pytest.raises(ValueError, match="unknown preset 'smok'.*valid presets are: smoke"):
    _load("lra/listops.py").get_config("performer,smok")
  with pytest.raises(ValueError, match="unknown attention variant 'performr'"):
    _load("lra/listops.py").get_config("performr,smoke")


def test_listops_smoke_config_learns_above_the_majority_class(tmp_path):
  import numpy as np  # pylint: disable=g-import-not-at-top
  from attention_jax.train.trainer import train_and_evaluate  # pylint: disable=g-import-not-at-top
  config = _load("lra/listops.py").get_config("dot_product,smoke")
  config.data_dir = str(tmp_path / "data")
  config.progress = False
  results = train_and_evaluate(config, tmp_path / "workdir")
  labels = np.concatenate([np.load(p) for p in (tmp_path / "data").rglob("test/label.npy")])
  majority = np.bincount(labels).max() / len(labels)
  test = results["metrics"]["test"]
  assert test["count"] == len(labels) == 500
  assert test["accuracy"] > majority + 0.08, (test, majority)
