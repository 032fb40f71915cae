"""CIFAR-10 grey pixels: the grey-scale formula on hand-worked pixels, and the real tfds
path end to end: the test writes `cifar-10-binary.tar.gz` with the real download's
layout, the real `cifar10` builder prepares it offline (`tfds_offline`), and
`prepare` converts the array_record files it wrote."""

import numpy as np
import pytest
import tensorflow_datasets as tfds

import tfds_offline
from attention_jax import data
from attention_jax.data import image

# Colours whose grey value is worked out by hand in test_grayscale_hand_worked.
COLOURS = np.array([[0, 0, 0], [255, 255, 255], [255, 0, 0], [0, 255, 0], [0, 0, 255],
                    [100, 150, 200]], np.uint8)
HAND_GREY = np.array([0, 255, 76, 149, 29, 141])
TRAIN_FILES = [f"data_batch_{i}.bin" for i in range(1, 6)]


def archive_images(seed=0):
  """{file: [(label, rgb, expected tokens)]}: 2 images per training batch, 3 test images,
  each pixel one of COLOURS at random, so its token is HAND_GREY + 1."""
  rng = np.random.default_rng(seed)
  files = {}
  for name in [*TRAIN_FILES, "test_batch.bin"]:
    records = []
    for _ in range(3 if name == "test_batch.bin" else 2):
      colour = rng.integers(0, len(COLOURS), size=(32, 32))
      label = int(rng.integers(0, 10))
      records.append((label, COLOURS[colour], HAND_GREY[colour].reshape(-1) + 1))
    files[name] = records
  return files


def _rows(records):
  return sorted((tuple(int(t) for t in tokens), label) for label, _, tokens in records)


def test_grayscale_hand_worked():
  # int((0.2989 r + 0.5870 g + 0.1140 b) / 255 * 255.5), worked out by hand:
  pixels = np.array([[0, 0, 0],         # 0
                     [255, 255, 255],   # 0.9999 * 255.5 = 255.47 -> 255
                     [255, 0, 0],       # 0.2989 * 255.5 = 76.37 -> 76
                     [0, 255, 0],       # 0.5870 * 255.5 = 149.98 -> 149 (truncated)
                     [0, 0, 255],       # 0.1140 * 255.5 = 29.13 -> 29
                     [100, 150, 200]],  # 140.74 / 255 * 255.5 = 141.02 -> 141
                    np.uint8)
  np.testing.assert_array_equal(image.to_grayscale(pixels), [0, 255, 76, 149, 29, 141])


def test_tokens_are_row_major_pixels_plus_one():
  rgb = np.zeros((1, 2, 3, 3), np.uint8)
  rgb[0, 0, 2] = 255   # row 0, column 2 -> position 2
  rgb[0, 1, 0] = [255, 0, 0]  # row 1, column 0 -> position 3
  np.testing.assert_array_equal(image.pixel_tokens(rgb), [[1, 1, 256, 77, 1, 1]])


def test_info_is_the_lra_setting():
  info = data.get_task("image").info
  assert (info.name, info.vocab_size, info.num_classes, info.seq_len, info.dual) == (
      "image", 257, 10, 1024, False)
  assert dict(info.split_sizes) == {"train": 45000, "validation": 5000, "test": 10000}


@pytest.fixture(scope="module")
def cifar_dir(tmp_path_factory):
  folder = tmp_path_factory.mktemp("tfds")
  files = archive_images()
  archive = tfds_offline.write_cifar10_archive(
      folder / "downloads", {name: [(label, rgb) for label, rgb, _ in records]
                             for name, records in files.items()})
  builder = tfds_offline.prepare("cifar10", folder, {tfds_offline.CIFAR10_URL: archive})
  assert builder.info.features["label"].names == list(tfds_offline.CIFAR10_NAMES)
  return folder


def _examples(source):
  batch = source.gather(np.arange(len(source)))
  return sorted((tuple(int(t) for t in row), int(label))
                for row, label in zip(batch["inputs"], batch["label"]))


def test_prepare_converts_what_the_real_builder_prepared(cifar_dir, tmp_path):
  task = image.make_task(data_dir_tfds=cifar_dir, download=False)
  # LRA's split: train[:90%] / train[90%:] / test.
  assert task.prepare(tmp_path, progress=False) == {"train": 9, "validation": 1, "test": 3}
  splits = task.splits(tmp_path)
  files = archive_images()
  train_images = [record for name in TRAIN_FILES for record in files[name]]
  # Train and validation share out the 10 training images, each once.
  assert sorted(_examples(splits["train"]) + _examples(splits["validation"])) == _rows(
      train_images)
  assert _examples(splits["test"]) == _rows(files["test_batch.bin"])
  assert np.load(tmp_path / "image" / "train" / "inputs.npy").dtype == np.int16


def test_sizes_and_missing_data(cifar_dir, tmp_path):
  task = image.make_task(data_dir_tfds=cifar_dir, download=False, train_size=3, test_size=2)
  assert task.prepare(tmp_path, progress=False) == {"train": 3, "validation": 1, "test": 2}
  assert set(_examples(task.splits(tmp_path)["test"])) <= set(
      _rows(archive_images()["test_batch.bin"]))
  with pytest.raises(FileNotFoundError, match=r"'cifar10' is not prepared in .*nothing"):
    image.make_task(data_dir_tfds=tmp_path / "nothing", download=False).prepare(
        tmp_path / "out", progress=False)
  with pytest.raises(FileNotFoundError, match=r"image/validation/label\.npy"):
    (tmp_path / "image" / "validation" / "label.npy").unlink()
    task.splits(tmp_path)


def test_mock_data_path_of_tfds(tmp_path):
  # tfds.testing.mock_data stands in for tfds.data_source without any files.
  with tfds.testing.mock_data(num_examples=3):
    written = image.make_task().prepare(tmp_path, progress=False)
  assert written == {"train": 3, "validation": 3, "test": 3}
  batch = image.make_task().splits(tmp_path)["train"].gather(np.arange(3))
  assert batch["inputs"].shape == (3, 1024)
  assert batch["inputs"].min() >= 1 and batch["inputs"].max() <= 256
