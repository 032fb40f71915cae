"""Byte-level IMDB: hand-worked byte tokens, and the real tfds path over files the test writes.

The test builds a tiny `imdb_reviews` with tensorflow-datasets' own builder class
(only its split generators replaced, so no download) into a temporary data_dir
as array_record files; `prepare` then reads it with the same
`tfds.data_source` call it makes in production, offline and without TensorFlow.
"""

import numpy as np
import pytest
import tensorflow_datasets as tfds

from attention_jax import data
from attention_jax.data import text


def write_tfds_dataset(name, data_dir, splits, **builder_kwargs):
  """Writes `splits` ({split: [example dict]}) as the registered tfds data set `name`."""
  real = tfds.builder_cls(name)

  def split_generators(self, dl_manager):
    del self, dl_manager
    return {split: enumerate(examples) for split, examples in splits.items()}

  with tfds.core.registered.skip_registration():
    fake = type("OfflineBuilder", (real,), {
        "name": name, "_split_generators": split_generators,
        # The metadata files sit beside the real class's module, not this one.
        "get_metadata": classmethod(lambda cls: real.get_metadata())})
  fake(data_dir=str(data_dir), file_format="array_record", **builder_kwargs).download_and_prepare()


def byte_row(raw, seq_len):
  """The expected tokens, worked out one byte at a time."""
  row = [b + 1 for b in raw[:seq_len]]
  return row + [0] * (seq_len - len(row))


TRAIN = [("good film", 1), ("héllo wörld", 1), ("bad", 0), ("日本", 0), ("", 1)]
TEST = [("meh", 0), ("a great, great film", 1), ("Ω", 1)]


@pytest.fixture(scope="module")
def imdb_dir(tmp_path_factory):
  folder = tmp_path_factory.mktemp("tfds")
  write_tfds_dataset("imdb_reviews", folder, {
      "train": [{"text": t, "label": l} for t, l in TRAIN],
      "test": [{"text": t, "label": l} for t, l in TEST]}, config="plain_text")
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


def test_prepare_reads_the_tfds_files_and_passes_labels_through(imdb_dir, tmp_path):
  task = text.make_task(seq_len=8, data_dir_tfds=imdb_dir, download=False)
  assert task.prepare(tmp_path, progress=False) == {"train": 5, "validation": 3, "test": 3}
  splits = task.splits(tmp_path)
  expected = {name: sorted((tuple(byte_row(t.encode("utf-8"), 8)), l) for t, l in rows)
              for name, rows in (("train", TRAIN), ("test", TEST))}
  assert _examples(splits["train"]) == expected["train"]
  # LRA validates on IMDB's test split.
  assert _examples(splits["validation"]) == _examples(splits["test"]) == expected["test"]
  assert np.load(tmp_path / "text" / "train" / "inputs.npy").dtype == np.int16


def test_same_data_same_bytes_and_prepared_splits_are_skipped(imdb_dir, tmp_path):
  task = text.make_task(seq_len=6, data_dir_tfds=imdb_dir, download=False, train_size=2)
  task.prepare(tmp_path / "a", progress=False)
  task.prepare(tmp_path / "b", progress=False)
  for split in data.SPLITS:
    for name in ("inputs", "label"):
      a, b = (tmp_path / d / "text" / split / f"{name}.npy" for d in "ab")
      assert a.read_bytes() == b.read_bytes()
  assert len(task.splits(tmp_path / "a")["train"]) == 2
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
