"""What every LRA task shares: its description, its examples, and batch iteration.

A task is prepared once into a data directory (generated, or converted from a
release or tensorflow-datasets) and then read as random-access example sources,
one per split. `batches` turns a source into the trainer's stream: a fixed
permutation per (seed, epoch), global batches cut from the concatenation of the
epochs, and this host's rows of each global batch. Batch `step` is a pure
function of (seed, step), so a run restarted at step s sees exactly the batches
an uninterrupted run saw from step s on.
"""

from __future__ import annotations

import abc
import dataclasses
import json
import pathlib
from typing import Any, Callable, Dict, Iterator, Mapping, Optional, Tuple

import numpy as np

SPLITS = ("train", "validation", "test")


class DataUnavailableError(FileNotFoundError):
  """A task's source data is not on this machine and could not be fetched (not
  prepared where it is read from, or its download failed); the message is one line
  naming the data set and how to place its files by hand."""


@dataclasses.dataclass(frozen=True)
class TaskInfo:
  """What a model needs to know about a task.

  Attributes:
    name: registry name, e.g. "listops", "pathfinder32".
    vocab_size: token ids are in [0, vocab_size).
    num_classes: labels are in [0, num_classes).
    seq_len: length of every `inputs` row (padded with `pad_id`).
    pad_id: the padding token; the model's padding mask is `inputs != pad_id`.
    dual: two sequences per example (`inputs` and `inputs2`), as in retrieval.
    target_len: for a sequence-to-sequence task, the length of every `targets`
      row (tokens over the same vocabulary); 0 for a classification task.
    split_sizes: the number of examples of each split at the release's size
      (a generated task's: the sizes it makes).
    stream: the examples of a split are consecutive segments of one corpus:
      the trainer reads them with `stream_batches` (each row continues its own
      stream) and carries a model's "memory" collection from step to step.
    eval_groups: names of the groups evaluation reports apart ("<name>_accuracy",
      e.g. recall per number of key-value pairs); an example's `group` array
      holds its index here. Empty: no groups.
  """

  name: str
  vocab_size: int
  num_classes: int
  seq_len: int
  pad_id: int = 0
  dual: bool = False
  target_len: int = 0
  split_sizes: Mapping[str, int] = dataclasses.field(default_factory=dict)
  stream: bool = False
  eval_groups: Tuple[str, ...] = ()


class ExampleSource(abc.ABC):
  """Random access to the examples of one split."""

  @abc.abstractmethod
  def __len__(self) -> int:
    ...

  @abc.abstractmethod
  def gather(self, indices: np.ndarray) -> Dict[str, np.ndarray]:
    """The examples at `indices` `[N]`, batched: `inputs [N, T]` int32, `label [N]`
    int32 (and `inputs2 [N, T]` for dual tasks; `targets [N, T']` instead of
    `label` for sequence-to-sequence tasks)."""


class ArraySource(ExampleSource):
  """Examples held as equal-length arrays (in memory or memory-mapped .npy)."""

  def __init__(self, arrays: Mapping[str, np.ndarray]):
    lengths = {name: len(array) for name, array in arrays.items()}
    if len(set(lengths.values())) != 1:
      raise ValueError(f"all arrays of a source need the same length, got {lengths}.")
    self.arrays = dict(arrays)

  def __len__(self) -> int:
    return len(next(iter(self.arrays.values())))

  def gather(self, indices: np.ndarray) -> Dict[str, np.ndarray]:
    # Sorted reads are much faster on memory-mapped files; undo the sort after.
    order = np.argsort(indices, kind="stable")
    inverse = np.empty_like(order)
    inverse[order] = np.arange(len(order))
    sorted_indices = np.asarray(indices)[order]
    return {name: np.asarray(array[sorted_indices])[inverse].astype(
        np.int32 if np.issubdtype(array.dtype, np.integer) else array.dtype)
            for name, array in self.arrays.items()}

  @classmethod
  def load(cls, folder: pathlib.Path, names: Tuple[str, ...] = ("inputs", "label"),
           mmap: bool = True) -> "ArraySource":
    """Reads `<folder>/<name>.npy` for each name; a clear error names a missing file."""
    folder = pathlib.Path(folder)
    arrays = {}
    for name in names:
      path = folder / f"{name}.npy"
      if not path.is_file():
        raise FileNotFoundError(f"expected the file {path} (array {name!r} of the split in "
                                f"{folder}); prepare the data with `python -m "
                                f"experiments.make_data`.")
      arrays[name] = np.load(path, mmap_mode="r" if mmap else None)
    return cls(arrays)

  def save(self, folder: pathlib.Path) -> None:
    """Writes each array as `<folder>/<name>.npy`, atomically per file."""
    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for name, array in self.arrays.items():
      partial = folder / f"{name}.npy.partial"
      with open(partial, "wb") as f:
        np.save(f, array)
      partial.replace(folder / f"{name}.npy")


class Task(abc.ABC):
  """One LRA task: how to prepare its data and how to read it back."""

  info: TaskInfo

  @abc.abstractmethod
  def prepare(self, data_dir: pathlib.Path, *, progress: bool = True) -> Dict[str, int]:
    """Generates or converts every split into `data_dir/<info.name>/<split>/`,
    skipping splits already there; returns the number of examples written per
    split (0 for skipped ones)."""

  @abc.abstractmethod
  def splits(self, data_dir: pathlib.Path) -> Dict[str, ExampleSource]:
    """The prepared splits; raises FileNotFoundError naming the missing path."""


def prepare_generated(name: str, data_dir: pathlib.Path,
                      settings_of: Callable[[str], Dict[str, Any]],
                      generate: Callable[[int, str], Dict[str, np.ndarray]], *,
                      progress: bool = True) -> Dict[str, int]:
  """`Task.prepare` of a generated task: each split of `data_dir/<name>/` made by
  `generate(split_index, split)` unless its `settings.json` already equals
  `settings_of(split)` (a split generated with other settings is stale and made
  again). Returns the examples written per split (0 for those kept)."""
  written = {}
  for index, split in enumerate(SPLITS):
    folder = pathlib.Path(data_dir) / name / split
    settings, wanted = folder / "settings.json", settings_of(split)
    if settings.is_file() and json.loads(settings.read_text()) == wanted:
      written[split] = 0
      continue
    source = ArraySource(generate(index, split))
    source.save(folder)
    settings.write_text(json.dumps(wanted, sort_keys=True) + "\n")
    written[split] = len(source)
    if progress:
      print(f"{name} {split}: {len(source)} examples -> {folder}")
  return written


class GeneratedTask(Task):
  """A task made in-process: split `i` (train, validation, test) of seed `s` is
  `generate(size, np.random.default_rng((s, i)), **generation)`, a pure function
  of (seed, split), stored under `data_dir/<info.name>/<split>/` with its
  settings (`generation`, `described`, the seed and the split's size) so that a
  split made with other settings is made again.

  Attributes:
    info: the task's description; `info.split_sizes` are the sizes made.
    generate: `(count, rng, **generation) -> {array name: [count, ...] array}`.
    generation: the generator's keyword arguments.
    arrays: the names of the arrays `splits` reads back.
    described: settings recorded beside `generation` that the generator is
      not passed (e.g. which of a module's generators it is).
  """

  def __init__(self, info: TaskInfo, generate: Callable[..., Dict[str, np.ndarray]], *,
               generation: Mapping[str, Any], seed: int, arrays: Tuple[str, ...],
               described: Mapping[str, Any] = None):
    self.info, self.generate, self.arrays = info, generate, tuple(arrays)
    self.generation, self.seed = dict(generation), int(seed)
    self.described = dict(described or {})

  def settings(self, split: str) -> Dict[str, Any]:
    return dict(self.generation, **self.described, seed=self.seed,
                size=self.info.split_sizes[split])

  def prepare(self, data_dir: pathlib.Path, *, progress: bool = True) -> Dict[str, int]:
    return prepare_generated(
        self.info.name, data_dir, self.settings,
        lambda index, split: self.generate(self.info.split_sizes[split],
                                           np.random.default_rng((self.seed, index)),
                                           **self.generation),
        progress=progress)

  def splits(self, data_dir: pathlib.Path) -> Dict[str, ExampleSource]:
    return load_splits(data_dir, self.info.name, self.arrays)


def check_split_sizes(sizes: Mapping[str, int]) -> Dict[str, int]:
  """`{split: size}` checked to be positive integers (`<split>_size` in the error)."""
  for split, size in sizes.items():
    if int(size) != size or size < 1:
      raise ValueError(f"{split}_size must be a positive integer, got {size!r}.")
  return {split: int(size) for split, size in sizes.items()}


def load_splits(data_dir: pathlib.Path, task: str,
                names: Tuple[str, ...] = ("inputs", "label")) -> Dict[str, ArraySource]:
  """Every split of `task` prepared under `data_dir/<task>/`, memory-mapped.

  Raises:
    FileNotFoundError: naming the missing folder, its files and the command
      that prepares them.
  """
  root = pathlib.Path(data_dir) / task
  if not root.is_dir():
    files = " and ".join(f"{name}.npy" for name in names)
    raise FileNotFoundError(f"expected the {task} data directory {root} (with "
                            f"{'/'.join(SPLITS)}/{files}); prepare it with "
                            f"`python -m experiments.make_data --task {task}`.")
  return {split: ArraySource.load(root / split, names=names) for split in SPLITS}


def batches(source: ExampleSource, *, batch_size: int, seed: int, start_step: int = 0,
            shuffle: bool = True, num_steps: Optional[int] = None,
            process_index: int = 0, process_count: int = 1) -> Iterator[Dict[str, np.ndarray]]:
  """This host's part of the global batches `start_step, start_step + 1, ...`.

  Args:
    source: the split's examples.
    batch_size: the global batch size; each host gets `batch_size // process_count`
      consecutive rows of every global batch.
    seed: fixes the order: epoch e is `permutation(seed, e)` of the source.
    start_step: the first global batch to yield (resuming a run).
    shuffle: False keeps the source order (evaluation).
    num_steps: stop after this many batches; None runs forever (training).
      Evaluation over a whole split uses `num_steps = ceil(len / batch_size)`
      with `shuffle=False`; its last batch wraps around to the first examples
      and carries a `weight` of 0 on those rows so that each example counts once.
    process_index, process_count: this host among all (jax.process_index()/count()).

  Yields:
    The source's arrays for this host's rows, plus `weight [rows]` float32
    (1 for real examples, 0 for the wrap-around rows of a final partial pass).
  """
  if batch_size % process_count:
    raise ValueError(f"batch_size={batch_size} must be a multiple of the number of hosts "
                     f"{process_count}.")
  size = len(source)
  if size == 0:
    raise ValueError("the split has no examples.")
  rows_per_host = batch_size // process_count
  permutations: Dict[int, np.ndarray] = {}

  def order(epoch: int) -> np.ndarray:
    if epoch not in permutations:
      permutations.clear()  # Keep at most the epochs a batch can straddle.
      permutations[epoch] = (np.random.default_rng([seed, epoch]).permutation(size)
                             if shuffle else np.arange(size))
    return permutations[epoch]

  step = start_step
  while num_steps is None or step < start_step + num_steps:
    first = step * batch_size + process_index * rows_per_host
    positions = np.arange(first, first + rows_per_host)  # in the endless epoch stream
    epochs, offsets = np.divmod(positions, size)
    indices = np.empty(rows_per_host, np.int64)
    for epoch in np.unique(epochs):
      rows = epochs == epoch
      indices[rows] = order(int(epoch))[offsets[rows]]
    batch = source.gather(indices)
    # Without shuffling the stream is one pass: rows past it repeat examples.
    batch["weight"] = (positions < size).astype(np.float32) if not shuffle else np.ones(
        rows_per_host, np.float32)
    yield batch
    step += 1


def stream_batches(source: ExampleSource, *, batch_size: int, start_step: int = 0,
                   num_steps: Optional[int] = None, process_index: int = 0,
                   process_count: int = 1) -> Iterator[Dict[str, np.ndarray]]:
  """This host's part of global batches in which each row continues a stream:
  the source's examples (consecutive segments of a corpus, in order) are dealt
  into `batch_size` lanes of `L = len(source) // batch_size` consecutive
  examples, and row b of batch s is example `b L + (s mod L)`, the segment
  after the one row b had at step s - 1 (what a recurrence memory carried
  from step to step needs). After L steps every lane starts again; the last
  `len(source) mod batch_size` examples are not used. Batch s is a pure
  function of s, so a restarted run continues its streams exactly.

  Args:
    source: the split's examples, in stream order.
    batch_size: the global batch size (lanes); each host gets its
      `batch_size // process_count` consecutive rows.
    start_step, num_steps: as `batches` (an evaluation pass over the split
      is `num_steps = len(source) // batch_size` from step 0).
    process_index, process_count: this host among all.

  Yields:
    The source's arrays for this host's rows, plus `weight [rows]` float32 (1).
  """
  if batch_size % process_count:
    raise ValueError(f"batch_size={batch_size} must be a multiple of the number of hosts "
                     f"{process_count}.")
  lane_length = len(source) // batch_size
  if lane_length == 0:
    raise ValueError(f"a stream of batch_size={batch_size} lanes needs at least {batch_size} "
                     f"examples, got {len(source)}.")
  rows_per_host = batch_size // process_count
  lanes = np.arange(process_index * rows_per_host, (process_index + 1) * rows_per_host)
  step = start_step
  while num_steps is None or step < start_step + num_steps:
    batch = source.gather(lanes * lane_length + step % lane_length)
    batch["weight"] = np.ones(rows_per_host, np.float32)
    yield batch
    step += 1
