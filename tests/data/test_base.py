"""The shared data machinery: array sources and the resumable, sharded batch stream."""

import numpy as np
import pytest

from attention_jax import data
from attention_jax.data import ArraySource, batches


def _source(n=10, length=3):
  inputs = np.arange(n * length, dtype=np.int32).reshape(n, length)
  return ArraySource({"inputs": inputs, "label": np.arange(n, dtype=np.int32) % 2})


def _take(iterator, count):
  return [next(iterator) for _ in range(count)]


def test_gather_returns_rows_in_the_requested_order():
  source = _source()
  got = source.gather(np.array([7, 2, 7, 0]))
  np.testing.assert_array_equal(got["inputs"][:, 0], [21, 6, 21, 0])
  np.testing.assert_array_equal(got["label"], [1, 0, 1, 0])


def test_every_epoch_is_a_permutation_and_epochs_differ():
  stream = batches(_source(), batch_size=5, seed=3)
  first_rows = [b["inputs"][:, 0] // 3 for b in _take(stream, 4)]  # 2 epochs of 2 batches
  epoch0, epoch1 = np.concatenate(first_rows[:2]), np.concatenate(first_rows[2:])
  assert sorted(epoch0) == list(range(10)) and sorted(epoch1) == list(range(10))
  assert not np.array_equal(epoch0, epoch1)


def test_resuming_at_a_step_gives_the_batches_of_the_uninterrupted_stream():
  full = _take(batches(_source(n=7), batch_size=3, seed=11), 9)  # batches straddle epochs
  resumed = _take(batches(_source(n=7), batch_size=3, seed=11, start_step=5), 4)
  for a, b in zip(full[5:], resumed):
    np.testing.assert_array_equal(a["inputs"], b["inputs"])


def test_hosts_split_each_global_batch_without_overlap():
  whole = _take(batches(_source(), batch_size=4, seed=0), 3)
  parts = [_take(batches(_source(), batch_size=4, seed=0, process_index=i, process_count=2), 3)
           for i in range(2)]
  for step in range(3):
    joined = np.concatenate([parts[0][step]["inputs"], parts[1][step]["inputs"]])
    np.testing.assert_array_equal(joined, whole[step]["inputs"])


def test_evaluation_pass_weights_each_example_once():
  stream = batches(_source(n=10), batch_size=4, seed=0, shuffle=False, num_steps=3)
  seen = {}
  for batch in stream:
    for row, weight in zip(batch["inputs"][:, 0] // 3, batch["weight"]):
      seen[int(row)] = seen.get(int(row), 0) + weight
  assert seen == {i: 1.0 for i in range(10)}


def test_bad_arguments_are_named():
  with pytest.raises(ValueError, match="batch_size=5 must be a multiple of the number of hosts 2"):
    next(batches(_source(), batch_size=5, seed=0, process_count=2))
  with pytest.raises(ValueError, match="same length"):
    ArraySource({"inputs": np.zeros((3, 2)), "label": np.zeros(4)})
  with pytest.raises(ValueError, match="unknown task 'lisops'; valid tasks are: listops"):
    data.get_task("lisops")


def test_save_and_load_round_trip_and_missing_files_are_named(tmp_path):
  _source().save(tmp_path / "train")
  loaded = ArraySource.load(tmp_path / "train")
  np.testing.assert_array_equal(loaded.gather(np.arange(10))["inputs"], _source().arrays["inputs"])
  with pytest.raises(FileNotFoundError, match=r"expected the file .*missing[/\\]inputs.npy"):
    ArraySource.load(tmp_path / "missing")
