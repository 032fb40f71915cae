"""CIFAR-10 grey pixels: the grey-scale formula on hand-worked pixels, and the real
tfds path over a tiny `cifar10` that the test writes with tfds's own builder class."""

import numpy as np
import PIL.Image
import pytest
import tensorflow_datasets as tfds

from attention_jax import data
from attention_jax.data import image


def write_tfds_dataset(name, data_dir, splits):
  """Writes `splits` ({split: [example dict]}) as the registered tfds data set `name`."""
  real = tfds.builder_cls(name)

  def split_generators(self, dl_manager):
    del self, dl_manager
    return {split: enumerate(examples) for split, examples in splits.items()}

  with tfds.core.registered.skip_registration():
    fake = type("OfflineBuilder", (real,), {
        "name": name, "_split_generators": split_generators,
        "get_metadata": classmethod(lambda cls: real.get_metadata())})
  fake(data_dir=str(data_dir), file_format="array_record").download_and_prepare()


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


def _picture(index):
  """A 32 x 32 RGB picture whose grey value is a known function of `index`."""
  rgb = np.zeros((32, 32, 3), np.uint8)
  rgb[..., 0] = index * 20        # red only: grey = int(0.2989 * r / 255 * 255.5)
  rgb[index, index] = 255         # one white pixel at (index, index): grey 255
  return rgb


@pytest.fixture(scope="module")
def cifar_dir(tmp_path_factory):
  folder = tmp_path_factory.mktemp("tfds")
  write_tfds_dataset("cifar10", folder, {
      "train": [{"id": f"train_{i}", "image": PIL.Image.fromarray(_picture(i)), "label": i}
                for i in range(10)],
      "test": [{"id": f"test_{i}", "image": PIL.Image.fromarray(_picture(i)),
                "label": (i + 3) % 10} for i in range(4)]})
  return folder


def test_prepare_reads_the_tfds_files(cifar_dir, tmp_path):
  task = image.make_task(data_dir_tfds=cifar_dir, download=False)
  # LRA's split: train[:90%] / train[90%:] / test.
  assert task.prepare(tmp_path, progress=False) == {"train": 9, "validation": 1, "test": 4}
  splits = task.splits(tmp_path)
  seen_train = set()
  for split, label_of in (("train", lambda i: i), ("validation", lambda i: i),
                          ("test", lambda i: (i + 3) % 10)):
    batch = splits[split].gather(np.arange(len(splits[split])))
    for tokens, label in zip(batch["inputs"], batch["label"]):
      # The white pixel names the picture; its flat position is index * 32 + index.
      index = int(np.flatnonzero(tokens == 256)[0]) // 33
      expected = np.full(1024, int(0.2989 * index * 20 / 255 * 255.5) + 1)
      expected[index * 33] = 256
      np.testing.assert_array_equal(tokens, expected)
      assert label == label_of(index)
      if split != "test":
        assert index not in seen_train  # train and validation do not overlap
        seen_train.add(index)
  assert seen_train == set(range(10))


def test_sizes_and_missing_data(cifar_dir, tmp_path):
  task = image.make_task(data_dir_tfds=cifar_dir, download=False, train_size=3, test_size=2)
  assert task.prepare(tmp_path, progress=False) == {"train": 3, "validation": 1, "test": 2}
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
