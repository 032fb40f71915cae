"""LRA document retrieval: AAN citation pairs, two byte-level documents each.

The LRA release ships `new_aan_pairs.train.tsv`, `new_aan_pairs.eval.tsv` and
`new_aan_pairs.test.tsv` (147,086 / 18,090 / 17,437 pairs). Each line has five
tab-separated columns and the files have no header (LRA reads them with
`make_csv_dataset(column_names=['label', 'id1', 'id2', 'text1', 'text2'],
header=False, use_quote_delim=False, field_delim='\\t')`):

  label <TAB> id1 <TAB> id2 <TAB> text1 <TAB> text2

`label` is 1 when the papers are linked by a citation, else 0 (LRA parses it as
a float and casts it to int, so "1.0" is read as 1). Quotes are ordinary
characters; a line ending "\\r\\n" loses its "\\r". Each text is encoded as in
the text task (`ByteTextEncoder`: byte + 1, 0 for padding) into `seq_len`
tokens (LRA: 4000), giving `inputs` (text1) and `inputs2` (text2).

The files are looked for in `release_dir`, then in `release_dir/tsv_data/`,
where the unpacked LRA release (lra_release.gz) keeps them.
"""

from __future__ import annotations

import pathlib
from typing import Dict, Iterator, List, Optional, Tuple

import numpy as np

from attention_jax.data.base import SPLITS, ArraySource, ExampleSource, Task, TaskInfo
from attention_jax.data.text import (BYTE_VOCAB_SIZE, LRA_TEXT_LENGTH, array_names,
                                     encode_bytes, progress_bar, requested_size,
                                     split_is_prepared)

RELEASE_FILES = {"train": "new_aan_pairs.train.tsv", "validation": "new_aan_pairs.eval.tsv",
                 "test": "new_aan_pairs.test.tsv"}
RELEASE_SUBDIR = "tsv_data"  # of the unpacked LRA release
COLUMNS = ("label", "id1", "id2", "text1", "text2")
_RELEASE_SIZES = {"train": 147_086, "validation": 18_090, "test": 17_437}
_CHUNK = 1024  # rows encoded at a time


def read_pairs(path: pathlib.Path, limit: Optional[int] = None
               ) -> Iterator[Tuple[int, bytes, bytes]]:
  """(label, text1, text2) of each line of a release TSV, at most `limit` of them.

  Blank lines are skipped. A line without exactly five columns, or whose label
  is not 0 or 1, raises ValueError naming the file and the line number.
  """
  count = 0
  with open(path, "rb") as f:
    for line_number, line in enumerate(f, start=1):
      if limit is not None and count >= limit:
        return
      line = line.rstrip(b"\n").rstrip(b"\r")
      if not line.strip():
        continue
      fields = line.split(b"\t")
      if len(fields) != len(COLUMNS):
        raise ValueError(f"{path}, line {line_number}: expected {len(COLUMNS)} tab-separated "
                         f"columns ({', '.join(COLUMNS)}), got {len(fields)}.")
      yield _parse_label(fields[0], path, line_number), fields[3], fields[4]
      count += 1


def _parse_label(field: bytes, path: pathlib.Path, line_number: int) -> int:
  try:
    value = float(field)
  except ValueError:
    value = None
  if value not in (0.0, 1.0):
    raise ValueError(f"{path}, line {line_number}: expected a label 0 or 1 in the first "
                     f"column, got {field[:40]!r}.")
  return int(value)


def count_pairs(path: pathlib.Path) -> int:
  """The number of non-blank lines of a TSV (read once more to allocate arrays)."""
  with open(path, "rb") as f:
    return sum(1 for line in f if line.strip())


class RetrievalTask(Task):
  """AAN pairs: `inputs`, `inputs2` `[seq_len]` int16 byte tokens, `label` 0/1."""

  def __init__(self, info: TaskInfo, release_dir: Optional[pathlib.Path],
               sizes: Dict[str, Optional[int]]):
    self.info = info
    self.release_dir = None if release_dir is None else pathlib.Path(release_dir)
    self.sizes = sizes

  def release_file(self, split: str) -> pathlib.Path:
    """The release TSV of `split`; a clear error if it is not there."""
    if self.release_dir is None:
      raise ValueError("the retrieval task converts the LRA release files: pass "
                       "release_dir=<folder with new_aan_pairs.{train,eval,test}.tsv> "
                       "(make_data: --release-dir).")
    for folder in (self.release_dir, self.release_dir / RELEASE_SUBDIR):
      path = folder / RELEASE_FILES[split]
      if path.is_file():
        return path
    raise FileNotFoundError(f"expected the LRA release file {RELEASE_FILES[split]} (the "
                            f"{split} pairs of the AAN retrieval task) in {self.release_dir} "
                            f"or in {self.release_dir / RELEASE_SUBDIR}.")

  def prepare(self, data_dir: pathlib.Path, *, progress: bool = True) -> Dict[str, int]:
    root = pathlib.Path(data_dir) / self.info.name
    names = array_names(self.info)
    written = {}
    for split in SPLITS:
      folder = root / split
      if split_is_prepared(folder, names, self.sizes[split]):
        written[split] = 0
        continue
      path = self.release_file(split)
      count = requested_size(count_pairs(path), self.sizes[split], split)
      arrays = self._convert(path, count, f"{self.info.name}/{split}", progress)
      ArraySource(arrays).save(folder)
      written[split] = count
    return written

  def _convert(self, path: pathlib.Path, count: int, description: str,
               progress: bool) -> Dict[str, np.ndarray]:
    seq_len = self.info.seq_len
    arrays = {"inputs": np.zeros((count, seq_len), np.int16),
              "inputs2": np.zeros((count, seq_len), np.int16),
              "label": np.zeros(count, np.uint8)}
    rows: List[Tuple[int, bytes, bytes]] = []
    start = 0
    with progress_bar(count, description, progress) as bar:
      for row in read_pairs(path, limit=count):
        rows.append(row)
        if len(rows) == _CHUNK:
          self._fill(arrays, start, rows)
          start += len(rows)
          bar.update(len(rows))
          rows = []
      self._fill(arrays, start, rows)
      bar.update(len(rows))
    return arrays

  def _fill(self, arrays: Dict[str, np.ndarray], start: int,
            rows: List[Tuple[int, bytes, bytes]]) -> None:
    if not rows:
      return
    labels, texts1, texts2 = zip(*rows)
    stop = start + len(rows)
    arrays["label"][start:stop] = labels
    arrays["inputs"][start:stop] = encode_bytes(texts1, self.info.seq_len)
    arrays["inputs2"][start:stop] = encode_bytes(texts2, self.info.seq_len)

  def splits(self, data_dir: pathlib.Path) -> Dict[str, ExampleSource]:
    root = pathlib.Path(data_dir) / self.info.name
    return {split: ArraySource.load(root / split, array_names(self.info)) for split in SPLITS}


def make_task(*, release_dir: Optional[str] = None, seq_len: int = LRA_TEXT_LENGTH,
              train_size: Optional[int] = None, validation_size: Optional[int] = None,
              test_size: Optional[int] = None) -> RetrievalTask:
  """The LRA retrieval task.

  Args:
    release_dir: the folder holding the LRA release's `new_aan_pairs.*.tsv`, or
      the unpacked release whose `tsv_data/` holds them (needed by `prepare` only).
    seq_len: bytes kept per document (LRA: 4000).
    train_size, validation_size, test_size: the first that many pairs of each
      file; None takes all.
  """
  if seq_len < 1:
    raise ValueError(f"seq_len must be positive, got {seq_len}.")
  info = TaskInfo(name="retrieval", vocab_size=BYTE_VOCAB_SIZE, num_classes=2,
                  seq_len=seq_len, dual=True, split_sizes=dict(_RELEASE_SIZES))
  sizes = {"train": train_size, "validation": validation_size, "test": test_size}
  return RetrievalTask(info, release_dir, sizes)
