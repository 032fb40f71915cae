"""Generated shapes: LRA's image task's format with images made here.

  task = attention_jax.data.get_task("shapes")

LRA's image task (`image.py`) is CIFAR-10, which tensorflow-datasets must
download. This task keeps its format (32 x 32 grey 8-bit images as 1,024
tokens `pixel + 1`, vocabulary 257, 10 classes, `inputs` and `label`) with
images the project generates, so that an image model (ViT) trains on
something learnable where CIFAR-10 cannot be fetched. It is not an LRA task,
and far easier than CIFAR-10.

Each image is one shape of its class on a uniform background with Gaussian
noise: a bright shape (intensity 150 to 255) on a dark background (0 to 90),
its size s (half its extent) uniform in [5, 10] pixels, its centre uniform
where the whole shape fits, noise of standard deviation 20 grey levels, then
rounded and clipped to 0..255. The classes (`CLASSES`): disk, ring, square,
square outline, triangle, plus, diagonal cross, horizontal bar, vertical bar,
diamond. Thin strokes are 3 pixels wide. No single pixel or patch decides
the class: size and place vary, so a model must combine the patches the
shape covers. Labels are balanced (each class a tenth, in random order).

Splits are a pure function of (seed, split), as the other generated tasks.
"""

from __future__ import annotations

from typing import Dict

import numpy as np

from attention_jax.data.base import GeneratedTask, TaskInfo, check_split_sizes

IMAGE_SIZE = 32
VOCAB_SIZE = 257  # pixel values 0..255 shifted by one; 0 is padding (as image.py).
CLASSES = ("disk", "ring", "square", "square_outline", "triangle", "plus", "cross",
           "horizontal_bar", "vertical_bar", "diamond")
MIN_SIZE, MAX_SIZE = 5, 10
HALF_STROKE = 1.5  # strokes 3 pixels wide
NOISE_STD = 20.0


def shape_masks(label: np.ndarray, dy: np.ndarray, dx: np.ndarray,
                size: np.ndarray) -> np.ndarray:
  """Which pixels each image's shape covers.

  label: `[N]` class indices into `CLASSES`; dy, dx: `[N, H, W]` offsets of each
  pixel centre from the shape's centre; size: `[N, 1, 1]` half extents.
  Returns `[N, H, W]` bool.
  """
  ady, adx = np.abs(dy), np.abs(dx)
  radius2 = dy ** 2 + dx ** 2
  box = np.maximum(ady, adx)
  side = 0.8 * size  # a square's half side (so that its area is close to the disk's)
  masks = {
      "disk": radius2 <= size ** 2,
      "ring": (radius2 <= size ** 2) & (radius2 > (size - 2 * HALF_STROKE) ** 2),
      "square": box <= side,
      "square_outline": (box <= side) & (box > side - 2 * HALF_STROKE),
      # Apex at the top (dy = -size), base at the bottom (dy = size).
      "triangle": (ady <= size) & (adx <= (dy + size) / 2),
      "plus": ((ady <= HALF_STROKE) & (adx <= size)) | ((adx <= HALF_STROKE) & (ady <= size)),
      "cross": ((np.abs(dy - dx) <= HALF_STROKE) | (np.abs(dy + dx) <= HALF_STROKE))
               & (box <= side),
      "horizontal_bar": (ady <= HALF_STROKE) & (adx <= size),
      "vertical_bar": (adx <= HALF_STROKE) & (ady <= size),
      "diamond": ady + adx <= size,
  }
  stacked = np.stack([masks[name] for name in CLASSES])  # [classes, N, H, W]
  return np.take_along_axis(stacked, label[None, :, None, None], axis=0)[0]


def images(count: int, rng: np.random.Generator, *, image_size: int) -> Dict[str, np.ndarray]:
  """`count` images: `inputs [count, image_size^2]` int16 tokens (pixel + 1,
  row by row) and `label [count]` uint8, balanced over `CLASSES`."""
  label = rng.permutation(np.arange(count) % len(CLASSES)).astype(np.uint8)
  size = rng.uniform(MIN_SIZE, MAX_SIZE, count)
  # Every shape reaches at most `size` from its centre along each axis.
  margin = size + 1
  centre_y = rng.uniform(margin, image_size - margin)
  centre_x = rng.uniform(margin, image_size - margin)
  background = rng.uniform(0, 90, count)
  foreground = rng.uniform(150, 255, count)
  pixel = np.arange(image_size) + 0.5  # pixel centres
  dy = pixel[None, :, None] - centre_y[:, None, None]
  dx = pixel[None, None, :] - centre_x[:, None, None]
  dy, dx = np.broadcast_arrays(dy, dx)
  covered = shape_masks(label, dy, dx, size[:, None, None])
  grey = np.where(covered, foreground[:, None, None], background[:, None, None])
  grey = grey + rng.normal(0, NOISE_STD, grey.shape)
  pixels = np.clip(np.rint(grey), 0, 255).astype(np.int16)
  return dict(inputs=pixels.reshape(count, -1) + 1, label=label)


def make_task(train_size: int = 45_000, validation_size: int = 5_000, test_size: int = 10_000,
              seed: int = 0) -> GeneratedTask:
  """The shapes task; the default sizes are LRA image's (CIFAR-10's train[:90%],
  train[90%:] and test)."""
  sizes = check_split_sizes({"train": train_size, "validation": validation_size,
                             "test": test_size})
  info = TaskInfo(name="shapes", vocab_size=VOCAB_SIZE, num_classes=len(CLASSES),
                  seq_len=IMAGE_SIZE * IMAGE_SIZE, split_sizes=sizes)
  return GeneratedTask(info, images, generation=dict(image_size=IMAGE_SIZE), seed=seed,
                       arrays=("inputs", "label"))
