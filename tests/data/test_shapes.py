"""The generated shapes task: the image task's format, each class's shape by
its geometry, shapes inside the canvas, balanced labels, the splits'
determinism, and its errors."""

import numpy as np
import pytest

from attention_jax import data
from attention_jax.data import shapes

SIDE = 32


def _offsets(centre_y, centre_x):
  pixel = np.arange(SIDE) + 0.5
  dy, dx = np.meshgrid(pixel - centre_y, pixel - centre_x, indexing="ij")
  return dy[None], dx[None]


def _mask(name, size=8.0, centre=(16.0, 16.0)):
  dy, dx = _offsets(*centre)
  label = np.array([shapes.CLASSES.index(name)])
  return shapes.shape_masks(label, dy, dx, np.full((1, 1, 1), size))[0]


def test_each_class_is_its_shape():
  size = 8.0
  dy, dx = (a[0] for a in _offsets(16.0, 16.0))
  radius = np.hypot(dy, dx)
  disk, ring = _mask("disk"), _mask("ring")
  assert disk.sum() == pytest.approx(np.pi * size ** 2, rel=0.08)
  assert np.array_equal(disk, radius <= size)
  assert ring[radius < size - 3].sum() == 0 and ring.sum() > 0 and np.all(disk[ring])
  square, outline = _mask("square"), _mask("square_outline")
  assert np.array_equal(square, np.maximum(np.abs(dy), np.abs(dx)) <= 0.8 * size)
  assert np.all(square[outline]) and not outline[16, 16] and square[16, 16]
  triangle = _mask("triangle")
  widths = triangle.sum(axis=1)
  rows = np.flatnonzero(widths)
  assert widths[rows[0]] < widths[rows[-1]]  # apex at the top, base at the bottom
  assert np.all(np.diff(widths[rows]) >= 0)
  horizontal, vertical, plus = _mask("horizontal_bar"), _mask("vertical_bar"), _mask("plus")
  assert np.array_equal(plus, horizontal | vertical)
  assert np.array_equal(horizontal, vertical.T)  # the centre is on the diagonal
  assert np.all(np.abs(dy[horizontal]) <= 1.5) and np.ptp(dx[horizontal]) >= 2 * size - 1
  cross = _mask("cross")
  assert np.array_equal(cross, cross.T) and np.array_equal(cross, cross[:, ::-1])
  assert np.array_equal(_mask("diamond"), np.abs(dy) + np.abs(dx) <= size)


def test_no_two_classes_draw_the_same_pixels():
  for size in (5.0, 10.0):
    masks = [_mask(name, size) for name in shapes.CLASSES]
    for i in range(len(masks)):
      for j in range(i + 1, len(masks)):
        assert not np.array_equal(masks[i], masks[j]), (shapes.CLASSES[i], shapes.CLASSES[j])


def test_images_are_the_image_tasks_format_with_balanced_labels():
  arrays = shapes.images(500, np.random.default_rng(0), image_size=SIDE)
  assert arrays["inputs"].shape == (500, SIDE * SIDE) and arrays["inputs"].dtype == np.int16
  assert arrays["inputs"].min() >= 1 and arrays["inputs"].max() <= 256  # pixel + 1
  assert np.array_equal(np.bincount(arrays["label"]), np.full(10, 50))
  assert data.get_task("shapes").info.vocab_size == data.get_task(
      "image").info.vocab_size == 257


def test_the_shape_is_brighter_than_its_background_and_inside_the_canvas():
  rng = np.random.default_rng(1)
  arrays = shapes.images(300, rng, image_size=SIDE)
  images = arrays["inputs"].reshape(-1, SIDE, SIDE).astype(float) - 1
  # Regenerate the draws that placed each shape: same generator order as `images`.
  rng = np.random.default_rng(1)
  label = rng.permutation(np.arange(300) % 10)
  size = rng.uniform(shapes.MIN_SIZE, shapes.MAX_SIZE, 300)
  centre_y = rng.uniform(size + 1, SIDE - size - 1)
  centre_x = rng.uniform(size + 1, SIDE - size - 1)
  assert np.array_equal(label, arrays["label"])
  for index in range(300):
    mask = _mask(shapes.CLASSES[label[index]], size[index], (centre_y[index], centre_x[index]))
    # Nothing of the shape on the outermost pixels; the shape is brighter on average.
    assert not (mask[0].any() or mask[-1].any() or mask[:, 0].any() or mask[:, -1].any())
    assert images[index][mask].mean() > images[index][~mask].mean() + 40


def test_splits_are_a_function_of_the_seed(tmp_path):
  sizes = dict(train_size=40, validation_size=10, test_size=10)
  task = data.get_task("shapes", seed=3, **sizes)
  assert task.info.num_classes == 10 and task.info.seq_len == SIDE * SIDE
  assert task.prepare(tmp_path / "a", progress=False) == dict(train=40, validation=10, test=10)
  assert task.prepare(tmp_path / "a", progress=False) == dict(train=0, validation=0, test=0)
  data.get_task("shapes", seed=3, **sizes).prepare(tmp_path / "b", progress=False)
  data.get_task("shapes", seed=4, **sizes).prepare(tmp_path / "c", progress=False)
  a, b, c = (data.get_task("shapes", seed=3, **sizes).splits(tmp_path / n) for n in "abc")
  indices = np.arange(10)
  for split in ("train", "test"):
    assert np.array_equal(a[split].gather(indices)["inputs"], b[split].gather(indices)["inputs"])
    assert not np.array_equal(a[split].gather(indices)["inputs"],
                              c[split].gather(indices)["inputs"])
  assert not np.array_equal(a["train"].gather(indices)["inputs"],
                            a["test"].gather(indices)["inputs"])


@pytest.mark.parametrize("options, message", [
    (dict(train_size=0), "train_size must be a positive integer, got 0"),
    (dict(test_size=2.5), "test_size must be a positive integer, got 2.5"),
])
def test_bad_sizes_are_named(options, message):
  with pytest.raises(ValueError, match=message):
    data.get_task("shapes", **options)
