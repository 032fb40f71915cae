"""Real tensorflow-datasets builders, prepared offline from archives a test writes.

`tfds.testing.DatasetBuilderTestCase` patches the DownloadManager so that a
download returns the builder's `dummy_data/`; the pip package ships no
dummy_data for imdb_reviews or cifar10, so here the tests write archives with
the real downloads' layout, and `downloads_from` serves them in place of the
URLs (extraction, parsing, encoding and the array_record files are tfds's own).
"""

import contextlib
import io
import pathlib
import tarfile
from typing import Dict, Iterator, Mapping
from unittest import mock

import tensorflow_datasets as tfds

IMDB_URL = "http://ai.stanford.edu/~amaas/data/sentiment/aclImdb_v1.tar.gz"
CIFAR10_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-binary.tar.gz"


def write_tar_gz(path: pathlib.Path, members: Mapping[str, bytes]) -> pathlib.Path:
  """A .tar.gz at `path` holding `members` ({name in the archive: content})."""
  path.parent.mkdir(parents=True, exist_ok=True)
  with tarfile.open(path, "w:gz") as tar:
    for name, content in members.items():
      info = tarfile.TarInfo(name)
      info.size = len(content)
      tar.addfile(info, io.BytesIO(content))
  return path


@contextlib.contextmanager
def downloads_from(archives: Dict[str, pathlib.Path]) -> Iterator[None]:
  """Within it, tfds fetches `archives[url]` instead of `url`; any other URL fails."""

  def local(url):
    if url not in archives:
      raise AssertionError(f"unexpected download of {url}; the test serves {list(archives)}")
    return pathlib.Path(archives[url])

  with mock.patch.multiple(tfds.download.DownloadManager,
                           download=lambda self, url: local(url),
                           download_and_extract=lambda self, url: self.extract(local(url))):
    yield


def prepare(name: str, data_dir: pathlib.Path, archives: Dict[str, pathlib.Path]):
  """`tfds.builder(name).download_and_prepare()` as array_record, from `archives`."""
  builder = tfds.builder(name, data_dir=str(data_dir), file_format="array_record")
  config = tfds.download.DownloadConfig(compute_stats=tfds.download.ComputeStatsMode.SKIP)
  with downloads_from(archives):
    builder.download_and_prepare(download_config=config)
  return builder


def write_imdb_archive(folder: pathlib.Path, members: Mapping[str, bytes]) -> pathlib.Path:
  """`aclImdb_v1.tar.gz` in `folder`; `members` as in the real archive, e.g.
  `aclImdb/train/pos/0_9.txt` (reviews), `aclImdb/train/unsup/...`, `aclImdb/imdb.vocab`."""
  return write_tar_gz(pathlib.Path(folder) / "aclImdb_v1.tar.gz", members)


CIFAR10_NAMES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse",
                 "ship", "truck")


def write_cifar10_archive(folder: pathlib.Path, files: Mapping[str, list]) -> pathlib.Path:
  """`cifar-10-binary.tar.gz` in `folder`, the binary version's layout.

  `files` maps `data_batch_1.bin` ... `data_batch_5.bin` and `test_batch.bin` to
  `[(label, rgb [32, 32, 3] uint8), ...]`; each record is one label byte, then
  the red, green and blue planes of 1024 bytes, each row by row.
  """
  members = {}
  for name, records in files.items():
    members[f"cifar-10-batches-bin/{name}"] = b"".join(
        bytes([label]) + rgb.transpose(2, 0, 1).tobytes() for label, rgb in records)
  members["cifar-10-batches-bin/batches.meta.txt"] = "\n".join(CIFAR10_NAMES).encode() + b"\n\n"
  members["cifar-10-batches-bin/readme.html"] = b"<meta HTTP-EQUIV=\"REFRESH\">\n"
  return write_tar_gz(pathlib.Path(folder) / "cifar-10-binary.tar.gz", members)
