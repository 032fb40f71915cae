"""LRA byte-level text classification: IMDB reviews as UTF-8 bytes.

The LRA release (lra_benchmarks/text_classification) reads tensorflow-datasets'
`imdb_reviews` (25,000 train and 25,000 test reviews, binary sentiment), uses
the test split for validation as well as for testing (IMDB has no validation
split), and encodes each review with `tfds.deprecated.text.ByteTextEncoder()`:
token = byte + 1, so that id 0 is left for padding and the vocabulary has
257 ids. Every review is truncated to its first `seq_len` bytes and padded
with 0 up to `seq_len`. The LRA paper gives the text task a length of 4K;
the release's base config says `max_length = 1000`, and published LRA
numbers use 4000, which is the default here (`seq_len=` changes it).
Truncation is at byte level, as in LRA, so it may cut a multi-byte UTF-8
character in two.

Reading goes through `tfds.data_source` (random access over array_record
files), which needs no TensorFlow. Building the data set the first time does:
tensorflow-datasets' builders open their downloads with `tf.io.gfile`, so
`pip install -e ".[data]"` (TensorFlow, CPU build) on the machine that downloads;
`experiments.make_data --task=text --data_dir=DIR` then downloads, builds and
converts. This module also holds the pieces that the other converted tasks
(image, retrieval) share: byte encoding, the check that a split folder is
already prepared, and opening a tensorflow-datasets split.
"""

from __future__ import annotations

import pathlib
from typing import Any, Dict, Iterable, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from attention_jax.data.base import (SPLITS, ArraySource, DataUnavailableError, ExampleSource, Task,
                                     TaskInfo)

LRA_TEXT_LENGTH = 4000
BYTE_VOCAB_SIZE = 257  # 256 byte values shifted by one, plus padding id 0.
TOKEN_DTYPE = np.int16  # Holds ids 0..256; gathered as int32.

_TFDS_NAME = "imdb_reviews"
# Our split -> the tfds split it is read from (LRA validates on the test set).
_TFDS_SPLITS = {"train": "train", "validation": "test", "test": "test"}
_RELEASE_SIZES = {"train": 25_000, "validation": 25_000, "test": 25_000}
_CHUNK = 512  # examples read from tfds per call


def encode_bytes(texts: Sequence[Union[bytes, str]], seq_len: int) -> np.ndarray:
  """Byte-level tokens of `texts`, LRA's ByteTextEncoder convention.

  Args:
    texts: N documents, as bytes or str (str is encoded as UTF-8).
    seq_len: the length of every row.

  Returns:
    `[N, seq_len]` int16: byte b of a document becomes token b + 1; documents
    longer than `seq_len` bytes are cut to their first `seq_len` bytes, shorter
    ones are padded with 0.
  """
  tokens = np.zeros((len(texts), seq_len), TOKEN_DTYPE)
  for row, text in enumerate(texts):
    data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
    codes = np.frombuffer(data[:seq_len], np.uint8)
    tokens[row, :len(codes)] = codes.astype(TOKEN_DTYPE) + 1
  return tokens


def array_names(info: TaskInfo) -> Tuple[str, ...]:
  """The arrays of one split of a task: `inputs` (+ `inputs2` if dual), `label`."""
  return ("inputs", "inputs2", "label") if info.dual else ("inputs", "label")


def split_is_prepared(folder: pathlib.Path, names: Iterable[str],
                      expected_size: Optional[int] = None) -> bool:
  """Whether `folder` already holds every `<name>.npy` of a split.

  A complete folder whose example count differs from `expected_size` (another
  `*_size` option than the one it was prepared with) raises ValueError rather
  than being silently reused.
  """
  paths = [pathlib.Path(folder) / f"{name}.npy" for name in names]
  if not all(path.is_file() for path in paths):
    return False
  if expected_size is not None:
    found = len(np.load(paths[-1], mmap_mode="r"))
    if found != expected_size:
      raise ValueError(f"{folder} holds {found} examples but {expected_size} were asked for; "
                       f"delete the folder (or use another data directory) to prepare it again.")
  return True


def requested_size(available: int, size: Optional[int], split: str) -> int:
  """The number of examples to take from a split of `available` (all if `size` is None)."""
  if size is None:
    return available
  if not 0 < size <= available:
    raise ValueError(f"{split}_size={size} must be in [1, {available}] (the examples this "
                     f"split has).")
  return size


def open_tfds_split(name: str, split: str, data_dir_tfds: Optional[str],
                    download: bool) -> Sequence[Mapping[str, Any]]:
  """`tfds.data_source(name, split=split)`: random access without TensorFlow.

  Raises:
    DataUnavailableError: with `download=False`, when the data set is not prepared
      in `data_dir_tfds`; with `download=True`, when its download fails (no
      network), saying where to place the downloaded file by hand.
    RuntimeError: any other failure of tensorflow-datasets (e.g. TensorFlow
      missing to build it).
  """
  import tensorflow_datasets as tfds  # Imported only by the tasks that read tfds.

  if not download:
    builder = tfds.builder(name, data_dir=data_dir_tfds, file_format="array_record")
    if not builder.is_prepared():
      raise DataUnavailableError(
          f"tensorflow-datasets {name!r} is not prepared in {builder.data_dir} (expected its "
          f"dataset_info.json and array_record files there); prepare it with "
          f"tfds.data_source({name!r}, data_dir=...) where the download works, or pass "
          f"download=True.")
  try:
    # array_record explicitly: given a data_dir, tfds.data_source would otherwise build
    # TFRecord files, which it cannot then read by index.
    return tfds.data_source(name, split=split, data_dir=data_dir_tfds, download=download,
                            builder_kwargs={"file_format": "array_record"})
  except Exception as error:  # Network, missing TensorFlow for building, wrong file format.
    url = _failed_download_url(error)
    if url is not None:
      raise DataUnavailableError(_offline_instructions(name, url, data_dir_tfds, error)) from error
    hint = ""
    if _missing_module(error) == "tensorflow":
      hint = (" Building a tensorflow-datasets data set needs TensorFlow: "
              "pip install -e \".[data]\" (or pip install tensorflow-cpu).")
    raise RuntimeError(f"tensorflow-datasets could not open {name!r} split {split!r} "
                       f"(data_dir={data_dir_tfds!r}, download={download}): {error}"
                       f"{hint}") from error


def _offline_instructions(name: str, url: str, data_dir_tfds: Optional[str],
                          error: BaseException) -> str:
  """One line: which download of `name` failed, and where to put the file by hand.

  tensorflow-datasets takes a download from `<data_dir>/downloads/manual/<file
  name>` when that file exists (and checks it against the registered checksum),
  so a file fetched on another machine can be placed there.
  """
  import tensorflow_datasets as tfds

  root = pathlib.Path(data_dir_tfds or tfds.core.constants.DATA_DIR).expanduser()
  manual_dir = root / "downloads" / "manual"
  if url:
    failed, file_name = url, url.rstrip("/").rsplit("/", 1)[-1]
  else:  # requests did not say which: the builder's URLs are in its checksums.tsv.
    failed, file_name = "a download", "each file of its checksums.tsv"
  return (f"tensorflow-datasets could not download {name!r}: {failed} failed "
          f"({type(_root_cause(error)).__name__}; no network?). Download {file_name} where the "
          f"network works and place it in {manual_dir}/ (tensorflow-datasets reads it from "
          f"there), or copy a prepared {root / name}/ from such a machine and pass --nodownload.")


def _causes(error: Optional[BaseException]) -> Iterable[BaseException]:
  """`error` and every exception it was raised from or during, outermost first."""
  seen = set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    yield error
    error = error.__cause__ or error.__context__


def _root_cause(error: BaseException) -> BaseException:
  *_, root = _causes(error)
  return root


def _failed_download_url(error: BaseException) -> Optional[str]:
  """The URL whose download failed for want of a connection somewhere in `error`'s
  chain ("" when the request is unknown), or None when no download failed."""
  import requests  # tensorflow-datasets downloads with it.

  for link in _causes(error):
    if isinstance(link, (requests.exceptions.ConnectionError, requests.exceptions.Timeout)):
      request = getattr(link, "request", None)
      return getattr(request, "url", None) or ""
  return None


def _missing_module(error: BaseException) -> Optional[str]:
  """The top-level module whose import failed somewhere in `error`'s chain, if any."""
  for link in _causes(error):
    if isinstance(link, ModuleNotFoundError) and link.name:
      return link.name.split(".")[0]
  return None


def read_examples(source: Sequence[Mapping[str, Any]], count: int,
                  progress_bar) -> Iterable[list]:
  """The first `count` examples of a tfds data source, in chunks of dicts."""
  for start in range(0, count, _CHUNK):
    # One record at a time: `__getitems__` would batch the reads, but
    # tfds.testing.mock_data's stand-in for it is broken in tfds 4.9.10.
    chunk = [source[i] for i in range(start, min(start + _CHUNK, count))]
    yield chunk
    progress_bar.update(len(chunk))


def progress_bar(total: int, description: str, enabled: bool):
  from tqdm.auto import tqdm  # tqdm shows examples/s with unit="ex".
  return tqdm(total=total, desc=description, unit="ex", disable=not enabled)


def prepare_tfds_task(task: "TfdsTask", data_dir: pathlib.Path, progress: bool) -> Dict[str, int]:
  """Converts every split of a tfds-backed task; splits read from the same tfds
  split with the same size are converted once and saved under each name."""
  root = pathlib.Path(data_dir) / task.info.name
  names = array_names(task.info)
  written: Dict[str, int] = {}
  converted: Dict[Tuple[str, int], Dict[str, np.ndarray]] = {}
  for split in SPLITS:
    folder = root / split
    size = task.sizes.get(split)
    if split_is_prepared(folder, names, size):
      written[split] = 0
      continue
    tfds_split = task.tfds_splits[split]
    source = open_tfds_split(task.tfds_name, tfds_split, task.data_dir_tfds, task.download)
    count = requested_size(len(source), size, split)
    if (tfds_split, count) not in converted:
      with progress_bar(count, f"{task.info.name}/{split}", progress) as bar:
        chunks = [task.convert(chunk) for chunk in read_examples(source, count, bar)]
      converted[(tfds_split, count)] = {name: np.concatenate([c[name] for c in chunks])
                                        for name in names}
    ArraySource(converted[(tfds_split, count)]).save(folder)
    written[split] = count
  return written


class TfdsTask(Task):
  """A task converted from a tensorflow-datasets data set, split by split.

  Subclasses set `tfds_name`, `tfds_splits` ({our split: tfds split string})
  and `convert(examples) -> {array name: [n, ...] array}`.
  """

  tfds_name: str
  tfds_splits: Mapping[str, str]

  def __init__(self, info: TaskInfo, sizes: Mapping[str, Optional[int]],
               data_dir_tfds: Optional[str], download: bool):
    self.info = info
    self.sizes = dict(sizes)
    self.data_dir_tfds = None if data_dir_tfds is None else str(data_dir_tfds)
    self.download = download

  def convert(self, examples: Sequence[Mapping[str, Any]]) -> Dict[str, np.ndarray]:
    raise NotImplementedError

  def prepare(self, data_dir: pathlib.Path, *, progress: bool = True) -> Dict[str, int]:
    return prepare_tfds_task(self, data_dir, progress)

  def splits(self, data_dir: pathlib.Path) -> Dict[str, ExampleSource]:
    root = pathlib.Path(data_dir) / self.info.name
    return {split: ArraySource.load(root / split, array_names(self.info)) for split in SPLITS}


class TextTask(TfdsTask):
  """IMDB reviews, byte level: `inputs [seq_len]` int16 tokens, `label` 0/1."""

  tfds_name = _TFDS_NAME
  tfds_splits = _TFDS_SPLITS

  def convert(self, examples):
    return {"inputs": encode_bytes([example["text"] for example in examples], self.info.seq_len),
            "label": np.array([example["label"] for example in examples], np.uint8)}


def make_task(*, seq_len: int = LRA_TEXT_LENGTH, train_size: Optional[int] = None,
              validation_size: Optional[int] = None, test_size: Optional[int] = None,
              data_dir_tfds: Optional[str] = None, download: bool = True) -> TextTask:
  """The LRA text task.

  Args:
    seq_len: bytes kept per review (LRA: 4000).
    train_size, validation_size, test_size: the first that many examples of each
      split; None takes all (25,000 each).
    data_dir_tfds: where tensorflow-datasets keeps `imdb_reviews` (None: its
      default, ~/tensorflow_datasets or $TFDS_DATA_DIR).
    download: let tensorflow-datasets download and prepare the data set when it
      is not in `data_dir_tfds`; False raises FileNotFoundError instead.
  """
  if seq_len < 1:
    raise ValueError(f"seq_len must be positive, got {seq_len}.")
  info = TaskInfo(name="text", vocab_size=BYTE_VOCAB_SIZE, num_classes=2, seq_len=seq_len,
                  split_sizes=dict(_RELEASE_SIZES))
  sizes = {"train": train_size, "validation": validation_size, "test": test_size}
  return TextTask(info, sizes, data_dir_tfds, download)
