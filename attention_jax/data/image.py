"""LRA image classification: CIFAR-10 as sequences of 1024 grey pixels.

As in the LRA release (lra_benchmarks/image/input_pipeline.py):
- splits: tensorflow-datasets' `cifar10` `train[:90%]` for training (45,000
  images), `train[90%:]` for validation (5,000) and `test` for testing (10,000);
- grey scale: `tf.image.rgb_to_grayscale` on the uint8 image, which converts to
  float32 in [0, 1] (x / 255), takes 0.2989 R + 0.5870 G + 0.1140 B, and
  converts back to uint8 by `int(gray * 255.5)` (truncation, not rounding).
  `to_grayscale` does the same in float32 numpy, so pure green (0, 255, 0) is
  149, not the 150 that rounding 0.587 * 255 would give;
- the 32 x 32 image is flattened row by row into 1024 pixels.
LRA fed the pixel values 0..255 to the model directly; here token = pixel + 1
(vocabulary 257) so that id 0 stays the padding id of every task, and since
no image is padded the padding mask is all ones.

Preparing reads through `tfds.data_source`, which needs no TensorFlow (images are
decoded with PIL). Building `cifar10` the first time does: tensorflow-datasets
reads the downloaded batches with `tf.io.gfile` and encodes the images to PNG
with TensorFlow, so `pip install -e ".[data]"` on the machine that downloads; a
machine without TensorFlow can read a prepared `cifar10` (array_record) but not
build one.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from attention_jax.data.base import TaskInfo
from attention_jax.data.text import BYTE_VOCAB_SIZE, TfdsTask

IMAGE_SIZE = 32
_TFDS_SPLITS = {"train": "train[:90%]", "validation": "train[90%:]", "test": "test"}
_RELEASE_SIZES = {"train": 45_000, "validation": 5_000, "test": 10_000}
_GRAY_WEIGHTS = np.array([0.2989, 0.5870, 0.1140], np.float32)  # tf.image.rgb_to_grayscale


def to_grayscale(rgb: np.ndarray) -> np.ndarray:
  """`tf.image.rgb_to_grayscale` of uint8 images: `[..., 3]` uint8 -> `[...]` uint8."""
  if rgb.dtype != np.uint8 or rgb.shape[-1] != 3:
    raise ValueError(f"expected uint8 RGB images [..., 3], got {rgb.dtype} {rgb.shape}.")
  unit = rgb.astype(np.float32) * np.float32(1 / 255)
  gray = unit @ _GRAY_WEIGHTS
  return (gray * np.float32(255.5)).astype(np.uint8)


def pixel_tokens(rgb: np.ndarray) -> np.ndarray:
  """Tokens of images: `[N, H, W, 3]` uint8 -> `[N, H * W]` int16, grey pixel + 1."""
  gray = to_grayscale(rgb)
  return gray.reshape(len(gray), -1).astype(np.int16) + 1


class ImageTask(TfdsTask):
  """CIFAR-10: `inputs [1024]` int16 tokens (grey pixel + 1), `label` 0..9."""

  tfds_name = "cifar10"
  tfds_splits = _TFDS_SPLITS

  def convert(self, examples):
    images = np.stack([np.asarray(example["image"]) for example in examples])
    return {"inputs": pixel_tokens(images),
            "label": np.array([example["label"] for example in examples], np.uint8)}


def make_task(*, train_size: Optional[int] = None, validation_size: Optional[int] = None,
              test_size: Optional[int] = None, data_dir_tfds: Optional[str] = None,
              download: bool = True) -> ImageTask:
  """The LRA image task.

  Args:
    train_size, validation_size, test_size: the first that many examples of each
      split; None takes all (45,000 / 5,000 / 10,000).
    data_dir_tfds: where tensorflow-datasets keeps `cifar10` (None: its default).
    download: let tensorflow-datasets download and prepare the data set when it
      is not in `data_dir_tfds`; False raises FileNotFoundError instead.
  """
  info = TaskInfo(name="image", vocab_size=BYTE_VOCAB_SIZE, num_classes=10,
                  seq_len=IMAGE_SIZE * IMAGE_SIZE, split_sizes=dict(_RELEASE_SIZES))
  sizes = {"train": train_size, "validation": validation_size, "test": test_size}
  return ImageTask(info, sizes, data_dir_tfds, download)
