"""The table of model kinds: every row is complete and consistent with what
reads it (the model config, the objectives, the trainer's task check)."""

import dataclasses
import types

import pytest

from attention_jax.models import KINDS, MODEL_KINDS, ModelConfig, build_model, kinds
from attention_jax.train.objectives import OBJECTIVES, get_objective

CONFIG_FIELDS = {field.name for field in dataclasses.fields(ModelConfig)}


@pytest.mark.parametrize("name", MODEL_KINDS)
def test_every_kind_names_its_objective_task_shapes_and_config_fields(name):
  kind = KINDS[name]
  assert kind.name == name
  assert kind.objective in OBJECTIVES and get_objective(name).name == kind.objective
  assert kind.tasks and set(kind.tasks) <= set(kinds.TASK_SHAPES)
  assert set(kind.fields) <= CONFIG_FIELDS, set(kind.fields) - CONFIG_FIELDS
  assert callable(kind.builder)


def test_build_model_builds_the_kinds_builder():
  common = dict(vocab_size=16, num_classes=3, num_layers=1, embed_dim=8, num_heads=2,
                mlp_dim=16, max_length=16, patch_size=4, chunk_length=4,
                funnel_blocks=(1, 1), funnel_decoder_blocks=0, attention="dot_product")
  for name, kind in KINDS.items():
    assert type(build_model(dict(common, kind=name))) is kind.builder, name


@pytest.mark.parametrize("info, expected", [
    (dict(), ("classifier", "vit", "funnel", "hierarchical", "masked_language_model",
              "language_model")),
    (dict(dual=True), ("dual_classifier",)),
    (dict(target_len=8), ("rnn_seq2seq", "transformer_seq2seq")),
    (dict(stream=True), ("language_model",)),
])
def test_the_kinds_made_for_a_task_come_first(info, expected):
  task_info = types.SimpleNamespace(**{"dual": False, "target_len": 0, "stream": False, **info})
  assert kinds.kinds_for_task(task_info) == expected


def test_an_unknown_kind_lists_the_table():
  with pytest.raises(ValueError, match=r"unknown model kind 'vitt'\. Did you mean 'vit'\? "
                                       r"Valid names are: classifier, dual_classifier"):
    kinds.get_kind("vitt")
  with pytest.raises(ValueError, match="unknown model kind 'vitt'"):
    get_objective("vitt")
