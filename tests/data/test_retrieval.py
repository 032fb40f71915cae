"""AAN retrieval: conversion of a tiny release-format TSV that the test writes."""

import numpy as np
import pytest

from attention_jax import data
from attention_jax.data import retrieval

# (label, id1, id2, text1, text2), as in the release: tab separated, no header.
TRAIN = [("1", "P01", "P02", "cites", "cited"),
         ("0.0", "P03", "P04", "naïve \"quotes\"", ""),
         ("1.0", "P05", "P06", "a much longer first document", "x")]
EVAL = [("0", "P07", "P08", "e1", "e2")]
TEST = [("1", "P09", "P10", "t1", "文書")]


def write_release(folder, rows_by_file=None, line_end="\n"):
  rows_by_file = rows_by_file or {"train": TRAIN, "eval": EVAL, "test": TEST}
  folder.mkdir(parents=True, exist_ok=True)
  for name, rows in rows_by_file.items():
    lines = ["\t".join(row) + line_end for row in rows]
    (folder / f"new_aan_pairs.{name}.tsv").write_bytes("".join(lines).encode("utf-8"))
  return folder


def byte_row(string, seq_len):
  row = [b + 1 for b in string.encode("utf-8")[:seq_len]]
  return row + [0] * (seq_len - len(row))


def test_info_is_the_lra_setting():
  info = data.get_task("retrieval").info
  assert (info.name, info.vocab_size, info.num_classes, info.seq_len, info.dual) == (
      "retrieval", 257, 2, 4000, True)


@pytest.mark.parametrize("line_end", ["\n", "\r\n"])
def test_pairs_are_converted_in_file_order(tmp_path, line_end):
  release = write_release(tmp_path / "release", line_end=line_end)
  task = retrieval.make_task(release_dir=release, seq_len=10)
  assert task.prepare(tmp_path / "out", progress=False) == {"train": 3, "validation": 1,
                                                            "test": 1}
  splits = task.splits(tmp_path / "out")
  for split, rows in (("train", TRAIN), ("validation", EVAL), ("test", TEST)):
    batch = splits[split].gather(np.arange(len(rows)))
    np.testing.assert_array_equal(batch["label"], [int(float(r[0])) for r in rows])
    np.testing.assert_array_equal(batch["inputs"], [byte_row(r[3], 10) for r in rows])
    np.testing.assert_array_equal(batch["inputs2"], [byte_row(r[4], 10) for r in rows])
  # 'a much longer first document' is cut to its first 10 bytes.
  assert bytes(b - 1 for b in splits["train"].gather(np.array([2]))["inputs"][0]) == (
      b"a much lon")


def test_the_unpacked_release_is_read_from_its_tsv_data_folder(tmp_path):
  # lra_release.gz unpacks to lra_release/ with the AAN files in tsv_data/, beside the
  # other tasks' folders.
  release = tmp_path / "lra_release"
  write_release(release / "tsv_data")
  (release / "listops-1000").mkdir()
  task = retrieval.make_task(release_dir=release, seq_len=4)
  assert task.prepare(tmp_path / "out", progress=False) == {"train": 3, "validation": 1,
                                                            "test": 1}
  batch = task.splits(tmp_path / "out")["test"].gather(np.array([0]))
  # ("1", "P09", "P10", "t1", "文書"): 文 = e6 96 87, 書 = e6 9b b8, cut to 4 bytes.
  np.testing.assert_array_equal(batch["inputs"], [[ord("t") + 1, ord("1") + 1, 0, 0]])
  np.testing.assert_array_equal(batch["inputs2"], [[0xe7, 0x97, 0x88, 0xe7]])
  np.testing.assert_array_equal(batch["label"], [1])


def test_same_data_same_bytes_sizes_and_skipping(tmp_path):
  release = write_release(tmp_path / "release")
  task = retrieval.make_task(release_dir=release, seq_len=5, train_size=2)
  for out in ("a", "b"):
    task.prepare(tmp_path / out, progress=False)
  for split in data.SPLITS:
    for name in ("inputs", "inputs2", "label"):
      a, b = (tmp_path / d / "retrieval" / split / f"{name}.npy" for d in "ab")
      assert a.read_bytes() == b.read_bytes()
  assert len(task.splits(tmp_path / "a")["train"]) == 2
  # Prepared splits are skipped, even without the release files.
  assert retrieval.make_task(seq_len=5, train_size=2).prepare(tmp_path / "a") == {
      "train": 0, "validation": 0, "test": 0}


def test_malformed_rows_name_the_file_and_line(tmp_path):
  rows = {"train": TRAIN, "eval": [EVAL[0], ("1", "P1", "only four columns")], "test": TEST}
  release = write_release(tmp_path / "bad_columns", rows)
  with pytest.raises(ValueError, match=r"new_aan_pairs\.eval\.tsv, line 2: expected 5 "
                                       r"tab-separated columns .*got 3"):
    retrieval.make_task(release_dir=release).prepare(tmp_path / "out", progress=False)
  rows = {"train": [TRAIN[0], ("yes", "P1", "P2", "a", "b")], "eval": EVAL, "test": TEST}
  release = write_release(tmp_path / "bad_label", rows)
  with pytest.raises(ValueError, match=r"new_aan_pairs\.train\.tsv, line 2: expected a label "
                                       r"0 or 1 .*got b'yes'"):
    retrieval.make_task(release_dir=release).prepare(tmp_path / "out2", progress=False)


def test_missing_release_and_data_dir(tmp_path):
  with pytest.raises(ValueError, match="pass release_dir="):
    retrieval.make_task().prepare(tmp_path / "out", progress=False)
  release = write_release(tmp_path / "partial", {"train": TRAIN})
  with pytest.raises(FileNotFoundError, match=r"new_aan_pairs\.eval\.tsv \(the validation "
                                              r"pairs .* in .*partial or in .*partial/tsv_data"):
    retrieval.make_task(release_dir=release).prepare(tmp_path / "out", progress=False)
  with pytest.raises(FileNotFoundError, match=r"retrieval/train/inputs2\.npy"):
    (tmp_path / "out" / "retrieval" / "train" / "inputs2.npy").unlink()
    retrieval.make_task().splits(tmp_path / "out")
