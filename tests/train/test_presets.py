"""Attention presets in configs: chosen in the config argument or by key,
applied by the trainer to the options a config leaves at their defaults."""

import dataclasses
import pathlib

import pytest

from attention_jax import registry
from attention_jax.train.config import (apply_attention_preset, attention_preset_of,
                                        default_config, load_config_module)

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture
def toy_preset(monkeypatch):
  """`local` with a release preset of window 7, and window 5 on listops."""
  spec = registry.get_variant("local")
  preset = registry.Preset({"window_size": 7}, "toy", tasks={"listops": {"window_size": 5}})
  monkeypatch.setitem(registry._REGISTRY, "local",  # pylint: disable=protected-access
                      dataclasses.replace(spec, presets={"lra_release": preset}))


def test_the_config_argument_names_the_preset_and_the_trainer_applies_it(toy_preset):
  del toy_preset
  listops = load_config_module(ROOT / "configs/lra/listops.py")
  config = listops.get_config("local,smoke,lra_release")
  assert config.attention_preset == "lra_release"
  assert config.model.attention_options.window_size == 64  # the default, until applied
  apply_attention_preset(config)
  assert config.model.attention_options.window_size == 5  # listops's
  config = listops.get_config("local,lra_release")
  config.task = "text"
  assert apply_attention_preset(config).model.attention_options.window_size == 7
  # The method preset leaves the defaults.
  config = listops.get_config("local,smoke")
  assert config.attention_preset == "method"
  assert apply_attention_preset(config).model.attention_options.window_size == 64


def test_an_option_the_config_sets_wins_over_the_preset(toy_preset):
  del toy_preset
  config = default_config("local", "lra_release")
  config.model.attention_options.window_size = 9
  assert apply_attention_preset(config).model.attention_options.window_size == 9


def test_a_preset_running_another_variant_keeps_the_options_they_share(monkeypatch):
  spec = registry.get_variant("synthesizer_dense")
  preset = registry.Preset({"trainable": False}, "toy", variant="synthesizer_random")
  monkeypatch.setitem(registry._REGISTRY, "synthesizer_dense",  # pylint: disable=protected-access
                      dataclasses.replace(spec, presets={"lra_release": preset}))
  config = default_config("synthesizer_dense", "lra_release")
  config.model.attention_options.max_length = 101
  apply_attention_preset(config)
  assert config.model.attention == "synthesizer_random"
  assert config.model.attention_options.max_length == 101
  assert config.model.attention_options.trainable is False
  assert "hidden_dim" not in config.model.attention_options


def test_bad_presets_are_refused_by_name():
  listops = load_config_module(ROOT / "configs/lra/listops.py")
  with pytest.raises(ValueError, match="unknown preset 'lra' in config argument"):
    listops.get_config("local,lra")
  with pytest.raises(ValueError, match="'multi_query' has no preset 'lra_release'"):
    listops.get_config("multi_query,lra_release")
  with pytest.raises(ValueError, match="choose one of method, lra_release"):
    attention_preset_of(["method", "lra_release"])
  config = default_config("local")
  config.attention_preset = "release"
  with pytest.raises(ValueError, match="unknown preset 'release'"):
    apply_attention_preset(config)


def test_an_undeclared_option_survives_the_preset_to_be_refused_by_name():
  config = default_config("local")
  config.model.attention_options.windw_size = 9
  apply_attention_preset(config)
  assert config.model.attention_options.windw_size == 9
  from attention_jax.models import ModelConfig  # pylint: disable=g-import-not-at-top
  with pytest.raises(ValueError, match="has no option 'windw_size'. Did you mean 'window_size'"):
    ModelConfig.from_config(config.model)
