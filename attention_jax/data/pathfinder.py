"""Pathfinder (Linsley et al. 2018) and Path-X, as used by Long Range Arena.

Each image is black with white dashed curves ("paths") and two filled dots.
The label is 1 when the two dots sit at the two ends of one path, 0 when they
sit at one end each of two different paths. Every image has two long paths of
`contour_length` dashes (the candidates for the dots) and shorter distractor
paths; paths never touch: at least `clearance` pixels less than half covered
separate the "ink" (pixels at least half covered) of different paths, so
"connected" has a single meaning (the tests read the labels off the pixels).

Tokens. Images are stored as raw pixels, `inputs.npy` `[N, R * R]` uint8
(row-major), which keeps Path-X at one byte per pixel. The sources returned by
`splits` read them as tokens `pixel + 1` in [1, 256], so that id 0 stays the
padding id and a black pixel is a real token; `vocab_size = 257`. (LRA's own
pipeline fed raw pixels and masked black ones as padding; we do not.)

Generation. A path is a random walk of dashes: each dash turns from the
previous one by a uniform angle in [-max_turn, max_turn]; dash and gap lengths
are fixed. Paths are grown dash by dash for many images at once (numpy arrays
over images x attempts x candidate headings): a heading is kept when its dash
stays inside the canvas, does not come back near the path's earlier joints,
and its ink misses the occupancy map of what is already drawn (dilated by
`clearance`). Failed paths are regrown, several attempts side by side. Dashes
are rasterised exactly: pixel coverage from the distance of each pixel centre
to the dash segment (anti-aliased, or binary). Work is cut into chunks of
images with seeds `(seed, split, chunk)`, so the bytes depend only on the
seed and the chunk size, never on the number of worker processes (spawned,
so scripts that call `prepare` need the usual `if __name__ == "__main__":`).

Defaults follow the settings of the LRA release (the docstrings of LRA's tfds
builders): contour length 14 (the "hard" set, curv_contour_length_14, which
LRA trained on), distractors of `contour_length // 3` dashes, a resolution
dependent number of distractors, marker radius and line thickness; dash length
at 64-256 pixels and the turn angle are our choices (see `preset`). The
release has 199,800 images per difficulty, split 80/10/10 by LRA's input
pipeline: 159,840 / 19,980 / 19,980, the default sizes here.

Release loader. With `release_dir`, `prepare` converts LRA's PNGs instead of
generating: `<release_dir>/pathfinder<R>/<difficulty dir>/` (or the difficulty
folder itself) holds `imgs/<k>/sample_<i>.png` and `metadata/<k>.npy`; despite
the suffix each metadata file is text, one image per line, space separated:
`imgs/<k> sample_<i>.png <index> <label> ...` (field 0 the image folder
relative to the difficulty folder, field 1 the file name, field 3 the label).
Files are read in numeric order of `k`, rows in file order, and cut 80/10/10
into train/validation/test (LRA cut tfds's hash-ordered examples the same way,
so the membership of each split differs from LRA's, the proportions do not).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import math
import multiprocessing
import os
import pathlib
from typing import Dict, Mapping, Optional, Tuple

import numpy as np

from attention_jax.data.base import (SPLITS, ArraySource, ExampleSource, Task, TaskInfo,
                                     load_splits)

RESOLUTIONS = (32, 64, 128, 256)
VOCAB_SIZE = 257  # pixel values 0..255 shifted by one; 0 is padding.
# Pixels at least half covered are "ink"; the clearance between paths is
# counted in ink, so fainter anti-aliased fringes of two paths may meet.
INK = 0.5
RELEASE_SIZE = 199_800  # images per difficulty in the LRA release.
SPLIT_SIZES = {"train": 159_840, "validation": 19_980, "test": 19_980}

# Difficulty -> (contour length, folder name in the LRA release).
DIFFICULTIES = {
    "easy": (6, "curv_baseline"),
    "intermediate": (9, "curv_contour_length_9"),
    "hard": (14, "curv_contour_length_14"),
}


@dataclasses.dataclass(frozen=True)
class PathfinderConfig:
  """The difficulty knobs. Lengths are in pixels of the final image.

  Attributes:
    resolution: the images are `resolution x resolution`.
    contour_length: dashes per long path (the two paths that can carry dots).
    num_distractors: distractor paths per image (fewer when one cannot be
      placed without touching what is drawn).
    distractor_length: dashes per distractor path.
    dash_length: length of each dash.
    gap_length: empty length between consecutive dashes; 0 gives solid paths.
    max_turn_degrees: the largest turn between consecutive dashes.
    dot_radius: radius of the two dots.
    thickness: line width of the dashes.
    clearance: empty pixels kept between different paths (and around the dots
      of the long paths), so that paths never touch or cross.
    antialias: grey edges from exact pixel coverage; False draws binary images.
    intensity: the value of a fully covered pixel.
  """

  resolution: int = 32
  contour_length: int = 14
  num_distractors: int = 5
  distractor_length: int = 4
  dash_length: float = 2.0
  gap_length: float = 1.0
  max_turn_degrees: float = 30.0
  dot_radius: float = 1.5
  thickness: float = 1.0
  clearance: int = 1
  antialias: bool = True
  intensity: int = 255

  def __post_init__(self):
    checks = {
        "resolution": self.resolution >= 8,
        "contour_length": self.contour_length >= 1,
        "distractor_length": self.distractor_length >= 1,
        "num_distractors": self.num_distractors >= 0,
        "dash_length": self.dash_length > 0,
        "gap_length": self.gap_length >= 0,
        "max_turn_degrees": 0 <= self.max_turn_degrees <= 90,
        "dot_radius": self.dot_radius > 0,
        "thickness": self.thickness > 0,
        "clearance": self.clearance >= 0,
        "intensity": 1 <= self.intensity <= 255,
    }
    for name, ok in checks.items():
      if not ok:
        raise ValueError(f"PathfinderConfig.{name}={getattr(self, name)!r} is out of range.")

  @property
  def segment_length(self) -> float:
    return self.dash_length + self.gap_length


# Per resolution: (dash, gap, max turn, thickness, dot radius, clearance,
# distractor budget). Thickness, dot radius, gap (LRA's paddle margin) and the
# distractor budget (LRA's `num_distractor_snakes * distractor_length`; we draw
# `budget // distractor_length` distractors) are the LRA release's. Dash
# lengths and turn angles are ours: 14 dashes must fit twice into the image
# with room for distractors, which at 32 pixels needs short dashes and sharp
# turns (LRA's 32-pixel set is also its curviest, continuity 1.0 against 1.8).
_PRESETS = {
    32: (1.5, 1.0, 60.0, 1.0, 1.5, 1, 20),
    64: (3.0, 1.0, 45.0, 1.0, 2.5, 1, 22),
    128: (5.0, 2.5, 45.0, 1.5, 3.0, 2, 35),
    256: (10.0, 3.0, 45.0, 2.0, 5.0, 3, 30),
}


def preset(resolution: int = 32, difficulty: str = "hard", **overrides) -> PathfinderConfig:
  """The generator settings of the LRA release at `resolution` and `difficulty`."""
  if resolution not in _PRESETS:
    raise ValueError(f"resolution={resolution!r}; valid resolutions are {RESOLUTIONS}.")
  if difficulty not in DIFFICULTIES:
    raise ValueError(f"difficulty={difficulty!r}; valid ones are {tuple(DIFFICULTIES)}.")
  dash, gap, max_turn, thickness, dot_radius, clearance, budget = _PRESETS[resolution]
  contour_length = DIFFICULTIES[difficulty][0]
  distractor_length = max(1, contour_length // 3)
  settings = dict(resolution=resolution, contour_length=contour_length,
                  distractor_length=distractor_length,
                  num_distractors=max(1, budget // distractor_length),
                  dash_length=dash, gap_length=gap, max_turn_degrees=max_turn,
                  thickness=thickness,
                  dot_radius=dot_radius, clearance=clearance)
  unknown = set(overrides) - {f.name for f in dataclasses.fields(PathfinderConfig)}
  if unknown:
    raise ValueError(f"unknown Pathfinder option(s) {sorted(unknown)}; valid ones are "
                     f"{[f.name for f in dataclasses.fields(PathfinderConfig)]}.")
  return PathfinderConfig(**{**settings, **overrides})


# ----------------------------------------------------------------------------
# Geometry and rasterisation, vectorised over candidate paths.
# Points are (row, column) in pixel units; pixel (i, j) covers [i, i+1) x [j, j+1).


def _coverage(distance: np.ndarray, radius: float, antialias: bool) -> np.ndarray:
  """Pixel coverage of a shape of `radius` around a point/segment at `distance`."""
  if antialias:
    return np.clip(np.float32(radius + 0.5) - distance, 0.0, 1.0)
  # At least half a pixel, so that thin lines stay 8-connected.
  return (distance <= max(radius, 0.5)).astype(np.float32)


def _box(origin: np.ndarray, size: int,
         resolution: int) -> Tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
  """The pixels of `size x size` boxes at integer corners `origin [..., 2]`.

  Returns:
    the rows and columns of the pixel centres `[..., size * size]` (float32),
    their flat indices (int32; 0 outside the canvas) and an `inside` mask.
  """
  offset_rows, offset_columns = np.divmod(np.arange(size * size, dtype=np.int32), size)
  rows = origin[..., 0, None].astype(np.int32) + offset_rows
  columns = origin[..., 1, None].astype(np.int32) + offset_columns
  inside = (rows >= 0) & (rows < resolution) & (columns >= 0) & (columns < resolution)
  flat = np.where(inside, rows * resolution + columns, 0)
  return (rows.astype(np.float32) + 0.5, columns.astype(np.float32) + 0.5, flat, inside)


def _flatten_items(count: int, *arrays: np.ndarray) -> Tuple[np.ndarray, ...]:
  return tuple(array.reshape(count, math.prod(array.shape[1:])) for array in arrays)


def _rasterise_dashes(starts: np.ndarray, ends: np.ndarray,
                      config: PathfinderConfig) -> Tuple[np.ndarray, np.ndarray]:
  """Flat pixel indices `[C, M]` and their coverage `[C, M]` of the dashes
  `starts, ends [C, K, 2]` (exact distance from each pixel centre to the dash)."""
  reach = config.thickness / 2 + 0.5
  size = int(math.ceil(config.dash_length + 2 * reach)) + 1
  origin = np.floor(np.minimum(starts, ends) - reach)
  rows, columns, flat, inside = _box(origin, size, config.resolution)  # [C, K, S*S]
  start = starts.astype(np.float32)[..., None, :]
  along = (ends - starts).astype(np.float32)[..., None, :]  # [C, K, 1, 2]
  to_row, to_column = rows - start[..., 0], columns - start[..., 1]
  # Dashes all have length dash_length, so the projection needs no division per dash.
  t = (to_row * along[..., 0] + to_column * along[..., 1]) / np.float32(config.dash_length ** 2)
  np.clip(t, 0.0, 1.0, out=t)
  distance = np.sqrt((to_row - t * along[..., 0]) ** 2 + (to_column - t * along[..., 1]) ** 2)
  coverage = _coverage(distance, config.thickness / 2, config.antialias) * inside
  return _flatten_items(len(starts), flat, coverage)


def _rasterise_dots(centres: np.ndarray, config: PathfinderConfig) -> Tuple[np.ndarray, np.ndarray]:
  """Flat pixel indices and coverage `[C, M]` of filled dots at `centres [C, D, 2]`."""
  radius = config.dot_radius
  size = int(math.ceil(2 * radius + 1)) + 1
  rows, columns, flat, inside = _box(np.floor(centres - radius - 0.5), size, config.resolution)
  centre = centres.astype(np.float32)[..., None, :]
  distance = np.sqrt((rows - centre[..., 0]) ** 2 + (columns - centre[..., 1]) ** 2)
  coverage = _coverage(distance, radius, config.antialias) * inside
  return _flatten_items(len(centres), flat, coverage)


def _dilate(mask: np.ndarray, radius: int) -> np.ndarray:
  """Square dilation of boolean images `[N, R, R]` by `radius` pixels (separable)."""
  for axis in (1, 2):
    grown = mask.copy()
    for step in range(1, radius + 1):
      ahead = [slice(None)] * 3
      behind = [slice(None)] * 3
      ahead[axis], behind[axis] = slice(step, None), slice(None, -step)
      grown[tuple(ahead)] |= mask[tuple(behind)]
      grown[tuple(behind)] |= mask[tuple(ahead)]
    mask = grown
  return mask


class _Canvas:
  """A batch of images being drawn, and where nothing more may be drawn."""

  def __init__(self, config: PathfinderConfig, count: int):
    self.config = config
    pixels = config.resolution ** 2
    self.value = np.zeros((count, pixels), np.float32)
    self.blocked = np.zeros((count, pixels), bool)

  def draw(self, images: np.ndarray, flat: np.ndarray, coverage: np.ndarray) -> None:
    rows = np.broadcast_to(images[:, None], flat.shape)
    np.maximum.at(self.value, (rows, flat), coverage)

  def block(self, images: np.ndarray, flat: np.ndarray, coverage: np.ndarray) -> None:
    resolution = self.config.resolution
    footprint = np.zeros((len(images), resolution ** 2), bool)
    rows = np.broadcast_to(np.arange(len(images))[:, None], flat.shape)
    ink = coverage >= INK
    footprint[rows[ink], flat[ink]] = True
    grown = _dilate(footprint.reshape(-1, resolution, resolution), self.config.clearance)
    self.blocked[images] |= grown.reshape(len(images), resolution ** 2)

  def collides(self, images: np.ndarray, flat: np.ndarray, coverage: np.ndarray) -> np.ndarray:
    return np.any(self.blocked[images[:, None], flat] & (coverage >= INK), axis=1)


def _grow_paths(rng: np.random.Generator, canvas: _Canvas, images: np.ndarray, num_dashes: int,
                with_dots: bool, tries: int) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
  """One attempt at a path of `num_dashes` in each of `images`, grown dash by dash.

  Each step draws `tries` headings per image (the first dash also a start
  point), each a uniform turn from the previous heading, and keeps the first
  whose dash stays inside the canvas, touches nothing already drawn (the
  canvas's dilated occupancy) and keeps its far end at least a segment away
  from the path's earlier joints (no loops). A path with no valid heading at
  some step has failed. With `with_dots`, the dots at both ends must fit too.

  Returns:
    ok `[P]`, and dash starts and ends `[P, num_dashes, 2]`.
  """
  config = canvas.config
  count = len(images)
  margin = max(config.dot_radius, config.thickness / 2) + 0.5
  low, high = margin, config.resolution - margin
  max_turn = math.radians(config.max_turn_degrees)
  owners = np.repeat(images, tries)
  ok = np.ones(count, bool)
  starts = np.zeros((count, num_dashes, 2))
  ends = np.zeros((count, num_dashes, 2))
  joints = np.zeros((count, num_dashes + 1, 2))  # dash starts, then the last end
  heading = np.zeros(count)
  rows = np.arange(count)
  for k in range(num_dashes):
    if k == 0:
      start = rng.uniform(low, high, (count, tries, 2))
      angle = rng.uniform(0, 2 * math.pi, (count, tries))
    else:
      direction = np.stack([np.sin(heading), np.cos(heading)], axis=-1)
      start = np.repeat((starts[:, k - 1] + config.segment_length * direction)[:, None],
                        tries, axis=1)
      angle = heading[:, None] + rng.uniform(-max_turn, max_turn, (count, tries))
    direction = np.stack([np.sin(angle), np.cos(angle)], axis=-1)  # [P, T, 2]
    end = start + config.dash_length * direction
    valid = np.all((end >= low) & (end <= high) & (start >= low) & (start <= high), axis=-1)
    # The next joint (the next dash's start, or this end if last) must not
    # come back near the joints before the previous one.
    joint = end if k == num_dashes - 1 else start + config.segment_length * direction
    if k >= 1:
      distance = np.linalg.norm(joint[:, :, None] - joints[:, None, :k], axis=-1)  # [P, T, k]
      valid &= np.all(distance >= 0.999 * config.segment_length, axis=-1)
    flat, coverage = _rasterise_dashes(start.reshape(-1, 1, 2), end.reshape(-1, 1, 2), config)
    dot_centres = [c for c, needed in ((start, k == 0), (end, k == num_dashes - 1)) if needed]
    if with_dots and dot_centres:
      dots = _rasterise_dots(np.stack(dot_centres, axis=2).reshape(-1, len(dot_centres), 2),
                             config)
      flat, coverage = (np.concatenate(pair, axis=1) for pair in zip((flat, coverage), dots))
    valid &= ~canvas.collides(owners, flat, coverage).reshape(count, tries)
    ok &= valid.any(axis=1)
    pick = valid.argmax(axis=1)
    starts[:, k], ends[:, k] = start[rows, pick], end[rows, pick]
    heading = angle[rows, pick]
    joints[:, k] = starts[:, k]
  if with_dots:
    ok &= _dots_stand_clear(starts, ends, config)
  return ok, starts, ends


def _dots_stand_clear(starts: np.ndarray, ends: np.ndarray, config: PathfinderConfig) -> np.ndarray:
  """`[P]`: the dots at the two ends of each path (`starts, ends [P, K, 2]`) keep
  clear of each other and of the path except where it leaves them, so that a
  dot never sits on its own path's body (the path curling back to its end)."""
  keep_away = config.dot_radius + config.thickness / 2 + config.clearance + 1.5
  along = ends - starts  # [P, K, 2]
  arc_start = np.arange(starts.shape[1]) * config.segment_length  # of each dash, from the start
  arc_end = arc_start[::-1]  # from the far end of the path to the end of each dash
  clear = np.ones(len(starts), bool)
  for tip, arc in ((starts[:, 0], arc_start), (ends[:, -1], arc_end)):
    offset = tip[:, None] - starts  # [P, K, 2]
    t = np.clip(np.sum(offset * along, -1) / config.dash_length ** 2, 0.0, 1.0)
    distance = np.linalg.norm(offset - t[..., None] * along, axis=-1)  # [P, K]
    # Dashes within `keep_away` of the tip along the path leave from its dot.
    far_along = arc >= 2 * keep_away
    clear &= np.all((distance >= keep_away) | ~far_along, axis=1)
  dots_apart = np.linalg.norm(ends[:, -1] - starts[:, 0], axis=-1)
  return clear & (dots_apart >= 2 * config.dot_radius + config.clearance + 2)


def _place_paths(rng: np.random.Generator, canvas: _Canvas, images: np.ndarray,
                 num_dashes: int, with_dots: bool, rounds: int,
                 tries: int = 8, max_attempts: int = 16) -> Tuple[np.ndarray, np.ndarray]:
  """Draws one path of `num_dashes` into each of `images` where one fits.

  Each round grows paths for the images still waiting, several attempts per
  image side by side when few are waiting (so that the vectorised work stays
  about `len(images)` paths), and keeps each image's first success; at most
  `rounds` rounds. With `with_dots`, the dots at both ends of the path count as
  part of it for the clearance (they are drawn later, if chosen).

  Returns:
    placed `[len(images)]` bool and the path end points `[len(images), 2, 2]`.
  """
  config = canvas.config
  placed = np.zeros(len(images), bool)
  path_ends = np.zeros((len(images), 2, 2))
  waiting = np.arange(len(images))
  for _ in range(rounds):
    if not len(waiting):
      break
    attempts = int(np.clip(len(images) // len(waiting), 1, max_attempts))
    grown, starts, ends = _grow_paths(rng, canvas, np.repeat(images[waiting], attempts),
                                      num_dashes, with_dots, tries)
    grown = grown.reshape(len(waiting), attempts)
    found = grown.any(axis=1)
    chosen = np.flatnonzero(found) * attempts + grown.argmax(axis=1)[found]
    winners = images[waiting[found]]
    starts, ends = starts[chosen], ends[chosen]
    tips = np.stack([starts[:, 0], ends[:, -1]], axis=1)  # [W, 2, 2]
    stroke = _rasterise_dashes(starts, ends, config)
    footprint = stroke
    if with_dots:
      dots = _rasterise_dots(tips, config)
      footprint = tuple(np.concatenate(pair, axis=1) for pair in zip(stroke, dots))
    canvas.draw(winners, *stroke)
    canvas.block(winners, *footprint)
    placed[waiting[found]] = True
    path_ends[waiting[found]] = tips
    waiting = waiting[~found]
  return placed, path_ends


def render(config: PathfinderConfig, labels: np.ndarray,
           rng: np.random.Generator) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
  """One attempt at an image per label.

  Args:
    config: the generator settings.
    labels: `[N]` 1 for connected dots, 0 for dots on two different paths.
    rng: the source of randomness.

  Returns:
    images `[N, R, R]` uint8, dot centres `[N, 2, 2]` float (row, column), and
    `ok [N]`: False where the two long paths could not both be placed (the
    caller draws those again).
  """
  count = len(labels)
  canvas = _Canvas(config, count)
  everyone = np.arange(count)
  rounds = 64  # a long path fails to fit only in a very crowded setting.
  first_ok, first_ends = _place_paths(rng, canvas, everyone, config.contour_length, True, rounds)
  second_ok = np.zeros(count, bool)
  second_ends = np.zeros((count, 2, 2))
  second_ok[first_ok], second_ends[first_ok] = _place_paths(
      rng, canvas, everyone[first_ok], config.contour_length, True, rounds)
  ok = first_ok & second_ok

  # Positive: both ends of the first path. Negative: one end of each path.
  end_a, end_b = rng.integers(0, 2, (2, count))
  positive = np.asarray(labels) == 1
  dots = np.stack([first_ends[everyone, end_a],
                   np.where(positive[:, None], first_ends[everyone, 1 - end_a],
                            second_ends[everyone, end_b])], axis=1)
  canvas.draw(everyone[ok], *_rasterise_dots(dots[ok], config))

  for _ in range(config.num_distractors):
    _place_paths(rng, canvas, everyone[ok], config.distractor_length, False, rounds=8)
  images = np.rint(canvas.value * config.intensity).astype(np.uint8)
  return images.reshape(count, config.resolution, config.resolution), dots.astype(np.float32), ok


def generate(config: PathfinderConfig, labels: np.ndarray,
             rng: np.random.Generator) -> Tuple[np.ndarray, np.ndarray]:
  """Images `[N, R, R]` uint8 and dot centres `[N, 2, 2]` for `labels [N]`."""
  labels = np.asarray(labels)
  images = np.zeros((len(labels), config.resolution, config.resolution), np.uint8)
  dots = np.zeros((len(labels), 2, 2), np.float32)
  todo = np.arange(len(labels))
  for _ in range(100):
    if not len(todo):
      return images, dots
    drawn, centres, ok = render(config, labels[todo], rng)
    images[todo[ok]], dots[todo[ok]] = drawn[ok], centres[ok]
    todo = todo[~ok]
  raise RuntimeError(f"could not place the two long paths in {len(todo)} images with {config}; "
                     f"use shorter paths (contour_length, dash_length, gap_length) or a "
                     f"smaller clearance.")


def generate_chunk(config: PathfinderConfig, seed: int, split_index: int, chunk_index: int,
                   count: int) -> Tuple[np.ndarray, np.ndarray]:
  """Chunk `chunk_index` of a split: pixels `[count, R * R]` uint8 and labels
  `[count]` uint8, exactly half of each label (the odd one out at random)."""
  rng = np.random.default_rng([seed, split_index, chunk_index])
  labels = rng.permutation(np.arange(count) % 2 if count % 2 == 0 else
                           np.append(np.arange(count - 1) % 2, rng.integers(2)))
  images, _ = generate(config, labels, rng)
  return images.reshape(count, -1), labels.astype(np.uint8)


def _generate_chunk_job(job) -> Tuple[np.ndarray, np.ndarray]:
  return generate_chunk(*job)


# ----------------------------------------------------------------------------
# The task.


class PixelTokens(ExampleSource):
  """A split stored as uint8 pixels, read as tokens `pixel + 1` (0 is padding)."""

  def __init__(self, pixels: ArraySource):
    self.pixels = pixels

  def __len__(self) -> int:
    return len(self.pixels)

  def gather(self, indices: np.ndarray) -> Dict[str, np.ndarray]:
    batch = self.pixels.gather(indices)
    batch["inputs"] = batch["inputs"] + 1
    return batch


def _default_chunk_size(resolution: int) -> int:
  return int(np.clip(2 ** 20 // resolution ** 2, 64, 1000))


class PathfinderTask(Task):
  """Pathfinder at one resolution: generated, or converted from the LRA release."""

  def __init__(self, config: PathfinderConfig, *, sizes: Mapping[str, int], seed: int,
               difficulty: str, release_dir: Optional[pathlib.Path], workers: Optional[int],
               chunk_size: int):
    self.config = config
    self.sizes = dict(sizes)
    self.seed = seed
    self.difficulty = difficulty
    self.release_dir = None if release_dir is None else pathlib.Path(release_dir)
    self.workers = workers
    self.chunk_size = chunk_size
    resolution = config.resolution
    self.info = TaskInfo(name=f"pathfinder{resolution}", vocab_size=VOCAB_SIZE, num_classes=2,
                         seq_len=resolution ** 2, pad_id=0, dual=False,
                         split_sizes=dict(SPLIT_SIZES))

  # Where the data comes from, recorded next to each split so that a folder
  # made with other settings is not silently reused.
  def _provenance(self, split: str) -> dict:
    if self.release_dir is not None:
      return {"source": "lra_release", "release_dir": str(self.release_dir.resolve()),
              "difficulty": self.difficulty}
    return {"source": "generated", "seed": self.seed, "size": self.sizes[split],
            "chunk_size": self.chunk_size, "config": dataclasses.asdict(self.config)}

  def prepare(self, data_dir: pathlib.Path, *, progress: bool = True) -> Dict[str, int]:
    root = pathlib.Path(data_dir) / self.info.name
    todo = []
    written = {}
    for split in SPLITS:
      folder = root / split
      written[split] = 0
      if (folder / "inputs.npy").is_file() and (folder / "label.npy").is_file():
        self._check_provenance(folder, split)
      else:
        todo.append(split)
    if not todo:
      return written
    if self.release_dir is not None:
      pixels, labels = read_release(self.release_dir, self.config.resolution, self.difficulty,
                                    progress=progress)
      for split, rows in _release_split_rows(len(labels)).items():
        if split in todo:
          written[split] = self._write(root / split, split, pixels[rows], labels[rows])
      return written
    for split in todo:
      written[split] = self._generate_split(root / split, split, progress)
    return written

  def _check_provenance(self, folder: pathlib.Path, split: str) -> None:
    record = folder / "source.json"
    if record.is_file():
      found = json.loads(record.read_text())
      if found != json.loads(json.dumps(self._provenance(split))):
        raise ValueError(f"{folder} holds Pathfinder data made with other settings ({record}: "
                         f"{found}); delete the folder or use another data_dir.")

  def _write(self, folder: pathlib.Path, split: str, pixels: np.ndarray,
             labels: np.ndarray) -> int:
    ArraySource({"inputs": pixels, "label": labels}).save(folder)
    (folder / "source.json").write_text(json.dumps(self._provenance(split), indent=1))
    return len(labels)

  def _generate_split(self, folder: pathlib.Path, split: str, progress: bool) -> int:
    size = self.sizes[split]
    folder.mkdir(parents=True, exist_ok=True)
    counts = [min(self.chunk_size, size - start) for start in range(0, size, self.chunk_size)]
    jobs = [(self.config, self.seed, SPLITS.index(split), index, count)
            for index, count in enumerate(counts)]
    # Generated straight into a memory-mapped file, so that Path-X (2.6 GB of
    # training pixels) never needs to fit in memory; renamed when complete, as
    # ArraySource.save does.
    partial = folder / "inputs.npy.partial"
    pixels = np.lib.format.open_memmap(partial, mode="w+", dtype=np.uint8,
                                       shape=(size, self.config.resolution ** 2))
    labels = np.zeros(size, np.uint8)
    workers = min(self.workers or os.cpu_count() or 1, len(jobs))
    bar = _progress_bar(size, f"{self.info.name} {split}", progress)
    if workers <= 1:
      self._collect(map(_generate_chunk_job, jobs), pixels, labels, bar)
    else:
      # "spawn": the parent may run JAX threads, which a fork would copy mid-flight.
      context = multiprocessing.get_context("spawn")
      with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context) as pool:
        self._collect(pool.map(_generate_chunk_job, jobs), pixels, labels, bar)
    bar.close()
    pixels.flush()
    del pixels
    partial.replace(folder / "inputs.npy")
    ArraySource({"label": labels}).save(folder)
    (folder / "source.json").write_text(json.dumps(self._provenance(split), indent=1))
    return size

  @staticmethod
  def _collect(results, pixels: np.ndarray, labels: np.ndarray, bar) -> None:
    start = 0
    for chunk_pixels, chunk_labels in results:
      pixels[start:start + len(chunk_labels)] = chunk_pixels
      labels[start:start + len(chunk_labels)] = chunk_labels
      start += len(chunk_labels)
      bar.update(len(chunk_labels))

  def splits(self, data_dir: pathlib.Path) -> Dict[str, ExampleSource]:
    return {split: PixelTokens(source)
            for split, source in load_splits(data_dir, self.info.name).items()}


def _progress_bar(total: int, description: str, enabled: bool):
  import tqdm  # pylint: disable=import-outside-toplevel
  return tqdm.tqdm(total=total, desc=description, unit="img", disable=not enabled,
                   smoothing=0.1)


# ----------------------------------------------------------------------------
# The LRA release.


def _release_split_rows(count: int) -> Dict[str, slice]:
  """LRA's cut of one difficulty: the first 80% train, then 10% and 10%."""
  train_end, validation_end = count * 8 // 10, count * 9 // 10
  return {"train": slice(0, train_end), "validation": slice(train_end, validation_end),
          "test": slice(validation_end, count)}


def find_release_folder(release_dir: pathlib.Path, resolution: int,
                        difficulty: str) -> pathlib.Path:
  """The folder of one difficulty (the one holding `metadata/`) under `release_dir`."""
  release_dir = pathlib.Path(release_dir)
  folder_name = DIFFICULTIES[difficulty][1]
  candidates = [release_dir / f"pathfinder{resolution}" / folder_name,
                release_dir / "lra_release" / f"pathfinder{resolution}" / folder_name,
                release_dir / folder_name, release_dir]
  for candidate in candidates:
    if (candidate / "metadata").is_dir():
      return candidate
  raise FileNotFoundError(
      f"no LRA Pathfinder release under {release_dir}: expected a folder with metadata/<k>.npy "
      f"and imgs/<k>/sample_<i>.png at one of " + ", ".join(str(c) for c in candidates) + ".")


def read_release_metadata(folder: pathlib.Path) -> Tuple[list, np.ndarray]:
  """Image paths and labels listed by `folder/metadata/<k>.npy` (text, see module doc)."""
  metadata = folder / "metadata"
  files = sorted((p for p in metadata.glob("*.npy")),
                 key=lambda p: (0, int(p.stem), "") if p.stem.isdigit() else (1, 0, p.stem))
  if not files:
    raise FileNotFoundError(f"expected metadata files {metadata}/<k>.npy (text rows "
                            f"'imgs/<k> sample_<i>.png <index> <label> ...'), found none.")
  paths, labels = [], []
  for file in files:
    for number, line in enumerate(file.read_text().splitlines(), start=1):
      fields = line.split()
      if not fields:
        continue
      if len(fields) < 4 or fields[3] not in ("0", "1"):
        raise ValueError(f"{file} line {number}: expected 'imgs/<k> sample_<i>.png <index> "
                         f"<label 0 or 1> ...', got {line!r}.")
      paths.append(folder / fields[0] / fields[1])
      labels.append(int(fields[3]))
  return paths, np.asarray(labels, np.uint8)


def read_release(release_dir: pathlib.Path, resolution: int, difficulty: str = "hard", *,
                 progress: bool = False) -> Tuple[np.ndarray, np.ndarray]:
  """All images of one difficulty of the release: pixels `[N, R * R]` uint8 and
  labels `[N]` uint8, in metadata order."""
  from PIL import Image  # pylint: disable=import-outside-toplevel
  folder = find_release_folder(release_dir, resolution, difficulty)
  paths, labels = read_release_metadata(folder)
  pixels = np.zeros((len(paths), resolution ** 2), np.uint8)
  bar = _progress_bar(len(paths), f"pathfinder{resolution} release", progress)
  for row, path in enumerate(paths):
    if not path.is_file():
      raise FileNotFoundError(f"expected the image {path}, listed in {folder / 'metadata'}.")
    with Image.open(path) as image:
      grey = np.asarray(image.convert("L"))
    if grey.shape != (resolution, resolution):
      raise ValueError(f"{path} is {grey.shape[1]}x{grey.shape[0]} pixels; expected "
                       f"{resolution}x{resolution} for pathfinder{resolution}.")
    pixels[row] = grey.reshape(-1)
    bar.update(1)
  bar.close()
  return pixels, labels


def make_task(resolution: int = 32, *, train_size: Optional[int] = None,
              validation_size: Optional[int] = None, test_size: Optional[int] = None,
              seed: int = 0, difficulty: str = "hard", release_dir=None,
              workers: Optional[int] = None, chunk_size: Optional[int] = None,
              **knobs) -> PathfinderTask:
  """Pathfinder at `resolution` (32, 64, 128 = Path-X, 256).

  Args:
    resolution: image side in pixels; sequences have `resolution ** 2` tokens.
    train_size, validation_size, test_size: examples per split to generate
      (default: the release's 159,840 / 19,980 / 19,980); ignored with `release_dir`.
    seed: fixes every generated byte (given the chunk size).
    difficulty: "easy", "intermediate" or "hard" (contour length 6, 9, 14; LRA
      used "hard"); also picks the release folder.
    release_dir: convert the LRA release found there instead of generating.
    workers: generator processes (default: all cores; 1 runs in-process).
    chunk_size: images per seeded chunk (default: about 1 MB of pixels).
    **knobs: `PathfinderConfig` fields overriding the preset (e.g. gap_length=0).
  """
  config = preset(resolution, difficulty, **knobs)
  given = {"train": train_size, "validation": validation_size, "test": test_size}
  sizes = {**SPLIT_SIZES, **{split: n for split, n in given.items() if n is not None}}
  return PathfinderTask(config, sizes=sizes, seed=seed, difficulty=difficulty,
                        release_dir=release_dir, workers=workers,
                        chunk_size=chunk_size or _default_chunk_size(resolution))
