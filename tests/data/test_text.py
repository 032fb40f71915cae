"""Byte-level IMDB: hand-worked byte tokens, and the real tfds path end to end.

The test writes `aclImdb_v1.tar.gz` with the real download's layout; the real
`imdb_reviews` builder prepares it offline (`tfds_offline`: the download
manager serves the file instead of the URL) into array_record files, and
`prepare` reads them with the same `tfds.data_source` call it makes in
production. Expected tokens come from the archive's bytes, one byte at a time.
"""

import re
from unittest import mock

import numpy as np
import pytest
import tensorflow_datasets as tfds

import tfds_offline
from attention_jax import data
from attention_jax.data import text

# The archive's files: reviews under aclImdb/<split>/<pos|neg>/<id>_<rating>.txt,
# the unlabelled ones under train/unsup, and other files the builder skips.
ARCHIVE = {
    "aclImdb/README": b"Large Movie Review Dataset v1.0\n",
    "aclImdb/imdb.vocab": b"the\nand\n",
    "aclImdb/train/urls_pos.txt": b"http://www.imdb.com/title/tt0453418/usercomments\n",
    "aclImdb/train/pos/0_9.txt": b"good film",
    "aclImdb/train/pos/1_8.txt": "h\u00e9llo w\u00f6rld".encode("utf-8"),
    "aclImdb/train/neg/0_1.txt": b"  bad, really bad.<br /><br />It drags.\n",
    "aclImdb/train/neg/1_2.txt": "\u65e5\u672c".encode("utf-8"),
    "aclImdb/train/pos/2_10.txt": b"A \"classic\"\tof\tits kind",
    "aclImdb/train/unsup/0_0.txt": b"unlabelled, not in any labelled split",
    "aclImdb/test/neg/0_2.txt": b"meh",
    "aclImdb/test/pos/0_10.txt": b"a great, great film",
    "aclImdb/test/pos/1_7.txt": "\u03a9".encode("utf-8"),
}
_REVIEW = re.compile(r"aclImdb/(train|test)/(pos|neg)/\d+_\d+\.txt")


def expected_examples(split, seq_len):
  """Sorted (tokens, label) of the archive's `split` reviews: the builder strips the
  whitespace around a review, the label is 1 for pos/, the token of byte b is b + 1."""
  rows = []
  for name, content in ARCHIVE.items():
    match = _REVIEW.fullmatch(name)
    if match and match.group(1) == split:
      row = [b + 1 for b in content.strip()[:seq_len]]
      rows.append((tuple(row + [0] * (seq_len - len(row))), int(match.group(2) == "pos")))
  return sorted(rows)


@pytest.fixture(scope="module")
def imdb_dir(tmp_path_factory):
  folder = tmp_path_factory.mktemp("tfds")
  archive = tfds_offline.write_imdb_archive(folder / "downloads", ARCHIVE)
  builder = tfds_offline.prepare("imdb_reviews", folder, {tfds_offline.IMDB_URL: archive})
  assert {name: split.num_examples for name, split in builder.info.splits.items()} == {
      "train": 5, "test": 3, "unsupervised": 1}
  return folder


def test_encode_bytes_hand_worked():
  got = text.encode_bytes(["abc", "é", b"\x00\xff", ""], seq_len=4)
  np.testing.assert_array_equal(got, [[98, 99, 100, 0],      # 'a' = 97
                                      [196, 170, 0, 0],      # é = c3 a9
                                      [1, 256, 0, 0],        # extreme bytes, never 0
                                      [0, 0, 0, 0]])
  assert got.dtype == np.int16


def test_truncation_is_at_byte_level_and_may_split_a_character():
  # 'h' then the first byte of 'é' (0xc3): LRA cuts bytes, not characters.
  np.testing.assert_array_equal(text.encode_bytes(["héllo"], seq_len=2), [[105, 196]])
  np.testing.assert_array_equal(text.encode_bytes(["日"], seq_len=3), [[0xe6 + 1, 0x97 + 1,
                                                                       0xa5 + 1]])


def test_info_is_the_lra_setting():
  info = data.get_task("text").info
  assert (info.name, info.vocab_size, info.num_classes, info.seq_len, info.pad_id,
          info.dual) == ("text", 257, 2, 4000, 0, False)
  assert dict(info.split_sizes) == {"train": 25000, "validation": 25000, "test": 25000}


def _examples(source):
  batch = source.gather(np.arange(len(source)))
  return sorted((tuple(row), int(label)) for row, label in zip(batch["inputs"], batch["label"]))


def test_prepare_converts_what_the_real_builder_prepared(imdb_dir, tmp_path):
  task = text.make_task(seq_len=24, data_dir_tfds=imdb_dir, download=False)
  assert task.prepare(tmp_path, progress=False) == {"train": 5, "validation": 3, "test": 3}
  splits = task.splits(tmp_path)
  assert _examples(splits["train"]) == expected_examples("train", 24)
  # LRA validates on IMDB's test split.
  assert _examples(splits["validation"]) == _examples(splits["test"]) == expected_examples(
      "test", 24)
  assert np.load(tmp_path / "text" / "train" / "inputs.npy").dtype == np.int16
  # The longest review is cut at 24 bytes, after the builder's strip.
  assert (tuple(t + 1 for t in b"bad, really bad.<br /><b"), 0) in _examples(splits["train"])


def test_same_data_same_bytes_and_prepared_splits_are_skipped(imdb_dir, tmp_path):
  task = text.make_task(seq_len=6, data_dir_tfds=imdb_dir, download=False, train_size=2)
  task.prepare(tmp_path / "a", progress=False)
  task.prepare(tmp_path / "b", progress=False)
  for split in data.SPLITS:
    for name in ("inputs", "label"):
      a, b = (tmp_path / d / "text" / split / f"{name}.npy" for d in "ab")
      assert a.read_bytes() == b.read_bytes()
  assert len(task.splits(tmp_path / "a")["train"]) == 2
  assert set(_examples(task.splits(tmp_path / "a")["train"])) <= set(
      expected_examples("train", 6))
  assert task.prepare(tmp_path / "a", progress=False) == {"train": 0, "validation": 0,
                                                          "test": 0}
  other = text.make_task(seq_len=6, data_dir_tfds=imdb_dir, download=False, train_size=3)
  with pytest.raises(ValueError, match="holds 2 examples but 3 were asked for"):
    other.prepare(tmp_path / "a", progress=False)


def test_clear_errors(imdb_dir, tmp_path):
  empty = tmp_path / "no_tfds"
  with pytest.raises(FileNotFoundError, match=r"'imdb_reviews' is not prepared in .*no_tfds"):
    text.make_task(data_dir_tfds=empty, download=False).prepare(tmp_path, progress=False)
  with pytest.raises(FileNotFoundError, match=r"text/train/inputs\.npy"):
    text.make_task().splits(tmp_path / "missing")
  with pytest.raises(ValueError, match=r"train_size=9 must be in \[1, 5\]"):
    text.make_task(data_dir_tfds=imdb_dir, download=False, train_size=9).prepare(
        tmp_path, progress=False)
  with pytest.raises(ValueError, match="seq_len must be positive, got 0"):
    text.make_task(seq_len=0)


def test_missing_tensorflow_names_the_extra(tmp_path):
  # What tensorflow-datasets raises when it builds a data set without TensorFlow.
  def data_source(*args, **kwargs):
    try:
      raise ModuleNotFoundError("No module named 'tensorflow'", name="tensorflow")
    except ModuleNotFoundError as error:
      raise AttributeError("lazy module failed") from error

  with mock.patch.object(tfds, "data_source", data_source):
    with pytest.raises(RuntimeError, match=r"could not open 'imdb_reviews' split 'train'.*"
                                           r"needs TensorFlow: pip install -e \"\.\[data\]\""):
      text.make_task(data_dir_tfds=tmp_path, download=True).prepare(tmp_path / "out",
                                                                     progress=False)
