"""The generated reversal and sorting tasks."""

import json

import numpy as np
import pytest

from attention_jax import data
from attention_jax.data import seq2seq


def _symbols(row):
  """The symbols of one row before its EOS, as ints from 0."""
  end = int(np.flatnonzero(row == seq2seq.EOS_ID)[0])
  assert np.all(row[end + 1:] == seq2seq.PAD_ID)
  return row[:end] - seq2seq.FIRST_SYMBOL


@pytest.mark.parametrize("kind", seq2seq.KINDS)
def test_targets_are_the_reversed_or_sorted_sources(kind):
  arrays = seq2seq.generate(200, (3, 0), kind=kind, num_symbols=7, min_length=4, max_length=9)
  assert arrays["inputs"].shape == arrays["targets"].shape == (200, 10)
  lengths = []
  for source, target in zip(arrays["inputs"], arrays["targets"]):
    source, target = _symbols(source), _symbols(target)
    lengths.append(len(source))
    assert source.min() >= 0 and source.max() < 7
    expected = source[::-1] if kind == "reverse" else np.sort(source)
    np.testing.assert_array_equal(target, expected)
  assert min(lengths) == 4 and max(lengths) == 9  # the whole range is drawn


def test_generation_is_a_pure_function_of_the_seed():
  make = lambda seed: seq2seq.generate(50, seed, kind="reverse", num_symbols=5, min_length=3,
                                       max_length=6)
  np.testing.assert_array_equal(make((0, 1))["inputs"], make((0, 1))["inputs"])
  assert not np.array_equal(make((0, 1))["inputs"], make((0, 2))["inputs"])


def test_prepare_writes_the_splits_once_and_again_when_the_settings_change(tmp_path):
  task = data.get_task("sort", train_size=30, validation_size=10, test_size=10, max_length=8,
                       min_length=2)
  assert task.info.vocab_size == task.info.num_classes == 13
  assert task.info.seq_len == task.info.target_len == 9
  assert task.prepare(tmp_path, progress=False) == dict(train=30, validation=10, test=10)
  assert task.prepare(tmp_path, progress=False) == dict(train=0, validation=0, test=0)
  splits = task.splits(tmp_path)
  batch = splits["test"].gather(np.arange(10))
  assert set(batch) == {"inputs", "targets"} and batch["targets"].shape == (10, 9)
  # The validation split differs from the test split (its own seed).
  assert not np.array_equal(splits["validation"].gather(np.arange(10))["inputs"], batch["inputs"])
  bigger = data.get_task("sort", train_size=40, validation_size=10, test_size=10, max_length=8,
                         min_length=2)
  assert bigger.prepare(tmp_path, progress=False) == dict(train=40, validation=0, test=0)
  settings = json.loads((tmp_path / "sort" / "train" / "settings.json").read_text())
  assert settings["size"] == 40 and settings["kind"] == "sort"


def test_missing_data_names_the_folder_and_the_command(tmp_path):
  with pytest.raises(FileNotFoundError, match="make_data --task reverse"):
    data.get_task("reverse").splits(tmp_path)


@pytest.mark.parametrize("options, message", [
    (dict(kind="rotate"), "kind must be one of"),
    (dict(min_length=5, max_length=4), "min_length=5, max_length=4"),
    (dict(num_symbols=1), "num_symbols must be at least 2, got 1"),
    (dict(test_size=0), "test_size must be a positive integer, got 0"),
])
def test_bad_options_are_named(options, message):
  with pytest.raises(ValueError, match=message):
    seq2seq.make_task(**options)
