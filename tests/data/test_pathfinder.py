"""Pathfinder: labels checked on the pixels, determinism, caching, the release loader."""

import os

import numpy as np
import pytest
from PIL import Image
from scipy import ndimage

from attention_jax import data
from attention_jax.data import pathfinder

EIGHT_NEIGHBOURS = np.ones((3, 3), bool)


def _dots_connected(image: np.ndarray) -> bool:
  """Reads an image like a person would: finds the two dots (the only blobs
  that survive an erosion which removes thin lines) and asks whether one
  8-connected stroke of ink joins them."""
  ink = image >= 128  # at least half covered: the generator's "ink"
  blobs, count = ndimage.label(ndimage.binary_erosion(ink, EIGHT_NEIGHBOURS))
  assert count == 2, f"expected two dots, found {count} thick blobs"
  strokes, _ = ndimage.label(ink, EIGHT_NEIGHBOURS)
  first, second = (strokes[blobs == k][0] for k in (1, 2))
  return first == second


@pytest.mark.parametrize("resolution, count", [(32, 200), (64, 30), (128, 10)])
def test_labels_agree_with_the_connectivity_of_solid_paths(resolution, count):
  # With no gaps the paths are pixel-connected, so the label can be read off
  # the picture without any of the generator's bookkeeping. At 32 pixels the
  # dots are made bigger than the preset's, so that a 3x3 erosion finds them.
  overrides = {"dot_radius": 2.5} if resolution == 32 else {}
  config = pathfinder.preset(resolution, gap_length=0.0, **overrides)
  labels = np.arange(count) % 2
  images, _ = pathfinder.generate(config, labels, np.random.default_rng(7))
  seen = np.array([_dots_connected(image) for image in images])
  np.testing.assert_array_equal(seen, labels == 1)


def test_dashed_paths_have_gaps_and_the_preset_images_look_right():
  pixels, labels = pathfinder.generate_chunk(pathfinder.preset(32), seed=1, split_index=0,
                                             chunk_index=0, count=20)
  assert pixels.shape == (20, 1024) and pixels.dtype == np.uint8
  ink = pixels.reshape(20, 32, 32) >= 128
  # Dashes break the paths into many separate strokes; solid paths would give
  # at most 2 long paths + 5 distractors = 7 components per image.
  pieces = [ndimage.label(image, EIGHT_NEIGHBOURS)[1] for image in ink]
  assert min(pieces) > 7
  assert 0.03 < ink.mean() < 0.3  # neither empty nor flooded
  assert sorted(np.bincount(labels)) == [10, 10]


def test_rasteriser_draws_a_hand_worked_dash():
  config = pathfinder.PathfinderConfig(resolution=10, dash_length=4.0, thickness=1.0,
                                       antialias=False)
  # A horizontal dash along the middle of row 3, from x = 2.5 to 6.5: the
  # centres of pixels (3, 2) ... (3, 6) lie on it, every other one is >= 1 away.
  flat, coverage = pathfinder._rasterise_dashes(  # pylint: disable=protected-access
      np.array([[[3.5, 2.5]]]), np.array([[[3.5, 6.5]]]), config)
  image = np.zeros(100)
  image[flat[0][coverage[0] > 0]] = 1
  expected = np.zeros((10, 10))
  expected[3, 2:7] = 1
  np.testing.assert_array_equal(image.reshape(10, 10), expected)


def test_task_info_and_token_convention():
  for resolution in (32, 64, 128, 256):
    info = data.get_task(f"pathfinder{resolution}").info
    assert (info.name, info.vocab_size, info.num_classes, info.seq_len, info.pad_id) == (
        f"pathfinder{resolution}", 257, 2, resolution ** 2, 0)
    assert info.split_sizes == {"train": 159_840, "validation": 19_980, "test": 19_980}
  with pytest.raises(ValueError, match="resolution=48; valid resolutions are"):
    pathfinder.make_task(48)
  with pytest.raises(ValueError, match=r"unknown Pathfinder option\(s\) \['dash'\]"):
    pathfinder.make_task(32, dash=3)


@pytest.mark.parametrize("resolution, size", [(32, 12), (128, 4)])
def test_prepare_writes_pixels_and_splits_read_them_as_shifted_tokens(tmp_path, resolution,
                                                                      size):
  task = data.get_task(f"pathfinder{resolution}", train_size=size, validation_size=2,
                       test_size=2, workers=1)
  assert task.prepare(tmp_path, progress=False) == {"train": size, "validation": 2, "test": 2}
  folder = tmp_path / f"pathfinder{resolution}" / "train"
  pixels = np.load(folder / "inputs.npy")
  assert pixels.dtype == np.uint8 and pixels.shape == (size, resolution ** 2)
  batch = task.splits(tmp_path)["train"].gather(np.arange(size))
  assert batch["inputs"].dtype == np.int32 and batch["inputs"].shape == (size, resolution ** 2)
  np.testing.assert_array_equal(batch["inputs"], pixels.astype(np.int32) + 1)
  assert batch["inputs"].min() >= 1 and batch["inputs"].max() <= 256
  assert set(np.unique(batch["label"])) <= {0, 1}


def test_prepare_skips_what_is_there_and_refuses_other_settings(tmp_path):
  sizes = dict(train_size=8, validation_size=2, test_size=2)
  task = pathfinder.make_task(32, **sizes, workers=1)
  task.prepare(tmp_path, progress=False)
  inputs = tmp_path / "pathfinder32" / "train" / "inputs.npy"
  stamp = os.stat(inputs).st_mtime_ns
  assert task.prepare(tmp_path, progress=False) == {"train": 0, "validation": 0, "test": 0}
  assert os.stat(inputs).st_mtime_ns == stamp
  with pytest.raises(ValueError, match=r"pathfinder32[/\\]train holds Pathfinder data made "
                                       r"with other settings"):
    pathfinder.make_task(32, **sizes, seed=1, workers=1).prepare(tmp_path, progress=False)


def test_same_seed_same_bytes_whatever_the_number_of_workers(tmp_path):
  sizes = dict(train_size=24, validation_size=6, test_size=6)
  outputs = []
  for name, workers in (("one", 1), ("two", 2)):
    pathfinder.make_task(32, **sizes, seed=3, workers=workers, chunk_size=6).prepare(
        tmp_path / name, progress=False)
    outputs.append([(tmp_path / name / "pathfinder32" / split / f"{array}.npy").read_bytes()
                    for split in data.SPLITS for array in ("inputs", "label")])
  assert outputs[0] == outputs[1]
  other = pathfinder.make_task(32, **sizes, seed=4, workers=1, chunk_size=6)
  other.prepare(tmp_path / "other", progress=False)
  assert (tmp_path / "other" / "pathfinder32" / "train" / "inputs.npy").read_bytes() != outputs[0][0]
  labels = np.load(tmp_path / "one" / "pathfinder32" / "train" / "label.npy")
  assert labels.sum() == 12  # exactly half positive


def test_missing_data_directory_is_named(tmp_path):
  task = pathfinder.make_task(32)
  with pytest.raises(FileNotFoundError, match=r"nowhere[/\\]pathfinder32.*inputs.npy"):
    task.splits(tmp_path / "nowhere")
  (tmp_path / "pathfinder32" / "train").mkdir(parents=True)
  with pytest.raises(FileNotFoundError, match=r"expected the file .*train[/\\]inputs.npy"):
    task.splits(tmp_path)


def _write_release(root, labels_per_file, resolution=32):
  """A miniature LRA release: PNGs plus text metadata rows as the release has."""
  folder = root / f"pathfinder{resolution}" / "curv_contour_length_14"
  rng = np.random.default_rng(0)
  images = {}
  for file_number, labels in labels_per_file.items():
    (folder / "imgs" / str(file_number)).mkdir(parents=True, exist_ok=True)
    (folder / "metadata").mkdir(parents=True, exist_ok=True)
    rows = []
    for i, label in enumerate(labels):
      pixels = rng.integers(0, 256, (resolution, resolution), dtype=np.uint8)
      Image.fromarray(pixels, mode="L").save(folder / "imgs" / str(file_number) /
                                             f"sample_{i}.png")
      images[(file_number, i)] = pixels
      rows.append(f"imgs/{file_number} sample_{i}.png {i} {label} 1.0 14 2.0 5 1.5 2 1\n")
    (folder / "metadata" / f"{file_number}.npy").write_text("".join(rows))
  return folder, images


def test_release_loader_converts_pngs_in_metadata_order(tmp_path):
  # Files 2 and 10 check the numeric order (a text sort would put 10 first).
  labels = {10: [1, 0, 0, 1, 1], 2: [0, 1, 1, 0, 1]}
  _, images = _write_release(tmp_path / "release", labels)
  task = data.get_task("pathfinder32", release_dir=tmp_path / "release")
  assert task.prepare(tmp_path / "data", progress=False) == {"train": 8, "validation": 1,
                                                            "test": 1}
  order = [(2, i) for i in range(5)] + [(10, i) for i in range(5)]
  splits = task.splits(tmp_path / "data")
  got = np.concatenate([splits[s].gather(np.arange(len(splits[s])))["inputs"]
                        for s in data.SPLITS])
  expected = np.stack([images[key].reshape(-1) for key in order]).astype(np.int32) + 1
  np.testing.assert_array_equal(got, expected)
  got_labels = np.concatenate([splits[s].gather(np.arange(len(splits[s])))["label"]
                               for s in data.SPLITS])
  np.testing.assert_array_equal(got_labels, [0, 1, 1, 0, 1, 1, 0, 0, 1, 1])


def test_release_loader_names_what_is_missing_or_malformed(tmp_path):
  empty = tmp_path / "empty"
  empty.mkdir()
  with pytest.raises(FileNotFoundError, match=r"no LRA Pathfinder release under .*empty: "
                                              r"expected a folder with metadata/<k>.npy"):
    pathfinder.make_task(32, release_dir=empty).prepare(tmp_path / "d1", progress=False)

  folder, _ = _write_release(tmp_path / "no_rows", {0: [1]})
  (folder / "metadata" / "0.npy").unlink()
  with pytest.raises(FileNotFoundError, match=r"expected metadata files .*metadata/<k>.npy"):
    pathfinder.make_task(32, release_dir=tmp_path / "no_rows").prepare(tmp_path / "d2",
                                                                       progress=False)

  folder, _ = _write_release(tmp_path / "bad_row", {0: [1, 0]})
  with open(folder / "metadata" / "0.npy", "a") as f:
    f.write("imgs/0 sample_2.png\n")
  with pytest.raises(ValueError, match=r"0.npy line 3: expected 'imgs/<k> sample_<i>.png"):
    pathfinder.make_task(32, release_dir=tmp_path / "bad_row").prepare(tmp_path / "d3",
                                                                       progress=False)

  folder, _ = _write_release(tmp_path / "no_image", {0: [1, 0]})
  (folder / "imgs" / "0" / "sample_1.png").unlink()
  with pytest.raises(FileNotFoundError, match=r"expected the image .*sample_1.png"):
    pathfinder.make_task(32, release_dir=tmp_path / "no_image").prepare(tmp_path / "d4",
                                                                        progress=False)
