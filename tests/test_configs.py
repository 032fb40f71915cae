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
  assert model.encoder.attention == variant
  tokens = jax.numpy.zeros((2, 16), jax.numpy.int32)
  variables = jax.eval_shape(model.init, jax.random.PRNGKey(0), tokens)
  logits = jax.eval_shape(model.apply, variables, tokens)
  assert logits.shape == (2, config.model.num_classes)


def test_classifier_config_rejects_an_unknown_variant():
  with pytest.raises(ValueError, match="unknown attention variant 'nope'; valid names are"):
    _load("models/classifier.py").get_config("nope")
