"""Prepares LRA tasks into a data directory: generates or converts each split once.

  python -m experiments.make_data --task=listops --task=pathfinder32 --data_dir=DIR
  python -m experiments.make_data --task=listops --data_dir=DIR --size_scale=0.01
  python -m experiments.make_data --task=retrieval --data_dir=DIR --release_dir=lra_release/tsv_data
  python -m experiments.make_data --task=text --task=image --data_dir=DIR [--tfds_data_dir=TFDS]

text and image are downloaded and built by tensorflow-datasets the first time
(network, and TensorFlow: pip install -e ".[data]"), into TFDS (default
~/tensorflow_datasets); --nodownload then converts a TFDS copied from elsewhere.
Offline, tensorflow-datasets retries the download for about 3.5 minutes, then
the command ends with one line naming the file to place in TFDS/downloads/manual/.

Each task is `attention_jax.data.get_task(name, **options).prepare(DIR)`, which
shows the task's own progress bars and skips splits already in DIR. One line per
task tells what was written, how long it took and the examples per second.
Options go only to the tasks that take them: an option a task does not take is an
error that names the task and lists what it takes.
"""

from __future__ import annotations

import ast
import inspect
import pathlib
import sys
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

from absl import flags

from attention_jax import data
from attention_jax.data import SPLITS
from experiments import cli

_SIZE_OPTIONS = tuple(f"{split}_size" for split in SPLITS)
# make_task options that are paths -> the flag that gives each.
_PATH_OPTIONS = {"release_dir": "release_dir", "data_dir_tfds": "tfds_data_dir"}


def define_flags(flag_values: flags.FlagValues, argv: Sequence[str]) -> None:
  """This script's flags (see `experiments.cli`)."""
  del argv  # only config flags read it
  flags.DEFINE_multi_enum("task", None, data.list_tasks(), "a task to prepare; repeat for "
                          "several", flag_values=flag_values)
  flags.DEFINE_string("data_dir", None, "where the tasks' splits are written "
                      "(DIR/<task>/<split>/)", flag_values=flag_values)
  flags.DEFINE_float("size_scale", None, "each split's size as this fraction of the LRA "
                     "release's size", flag_values=flag_values)
  for split in SPLITS:
    flags.DEFINE_integer(f"{split}_size", None, f"examples of the {split} split",
                         flag_values=flag_values)
  flags.DEFINE_integer("seed", None, "generator seed (generated tasks)", flag_values=flag_values)
  flags.DEFINE_string("release_dir", None, "the LRA release's files for the task (retrieval; "
                      "loaders)", flag_values=flag_values)
  flags.DEFINE_string("tfds_data_dir", None, "tensorflow-datasets' data_dir (text, image)",
                      flag_values=flag_values)
  flags.DEFINE_bool("download", None, "--nodownload: fail rather than let tensorflow-datasets "
                    "download (text, image)", flag_values=flag_values)
  flags.DEFINE_multi_string("option", [], "NAME=VALUE: any other make_task option, e.g. "
                            "--option=max_length=1000", flag_values=flag_values)
  flags.DEFINE_bool("quiet", False, "no progress bars", flag_values=flag_values)
  flags.mark_flags_as_required(["task", "data_dir"], flag_values=flag_values)
  flags.register_validator("size_scale", lambda scale: scale is None or scale > 0,
                           "must be positive", flag_values=flag_values)

  def name_equals_value(items: Sequence[str]) -> bool:
    for item in items:
      name, equals, _ = item.partition("=")
      if not equals or not name:
        raise flags.ValidationError(f"expected NAME=VALUE, got {item!r}.")
    return True

  flags.register_validator("option", name_equals_value, flag_values=flag_values)


def _parse_value(text: str) -> Any:
  try:
    return ast.literal_eval(text)
  except (ValueError, SyntaxError):
    return text  # a plain string, e.g. a path or a name


def common_options(args: cli.Args) -> Dict[str, Any]:
  """The options given on the command line, sizes apart (they depend on the task)."""
  options: Dict[str, Any] = {option: pathlib.Path(getattr(args, flag))
                             for option, flag in _PATH_OPTIONS.items()
                             if getattr(args, flag) is not None}
  if args.seed is not None:
    options["seed"] = args.seed
  if args.download is not None:
    options["download"] = args.download
  for item in args.option:
    name, _, value = item.partition("=")
    options[name] = _parse_value(value)
  return options


def _flag_text(option: str) -> str:
  """How an option is given on the command line: `--release_dir`,
  `--tfds_data_dir (data_dir_tfds)`, `--option=max_length=...`."""
  flag = _PATH_OPTIONS.get(option, option)
  if flag not in ("seed", "download", *_PATH_OPTIONS.values(), *_SIZE_OPTIONS):
    return f"--option={option}=..."
  return f"--{flag}" + (f" ({option})" if flag != option else "")


def check_options(name: str, options: Sequence[str]) -> None:
  """Checks that the task's make_task takes every one of `options`.

  Raises:
    ValueError: naming the task, the flags of the options it does not take and
      the options it takes.
  """
  parameters = data.task_parameters(name)
  if any(p.kind == inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
    return  # takes anything; the task checks its own options
  unknown = [option for option in options if option not in parameters]
  if unknown:
    raise ValueError(f"task {name!r} does not take {', '.join(map(_flag_text, unknown))}; it "
                     f"takes: {', '.join(parameters)}.")


def task_sizes(name: str, args: cli.Args, options: Dict[str, Any]) -> Dict[str, int]:
  """{split: size} from --<split>_size, else --size_scale times the release size."""
  sizes = {split: getattr(args, f"{split}_size") for split in SPLITS
           if getattr(args, f"{split}_size") is not None}
  if args.size_scale is not None:
    release = data.get_task(name, **options).info.split_sizes
    for split in SPLITS:
      if split not in sizes and split in release:
        sizes[split] = max(1, round(release[split] * args.size_scale))
  return sizes


def size_options(sizes: Dict[str, int]) -> Dict[str, Any]:
  """Sizes as every task's `make_task` takes them: `<split>_size=`."""
  return {f"{split}_size": size for split, size in sizes.items()}


def prepare_task(name: str, options: Dict[str, Any], data_dir: pathlib.Path,
                 progress: bool) -> str:
  """Prepares one task; returns its summary line."""
  task = data.get_task(name, **options)
  start = time.perf_counter()
  written = task.prepare(data_dir, progress=progress)
  seconds = time.perf_counter() - start
  total = sum(written.values())
  where = pathlib.Path(data_dir) / task.info.name
  if total == 0:
    return f"{name}: already prepared in {where}, nothing to do."
  counts = ", ".join(f"{split} {count}" for split, count in written.items())
  return (f"{name}: wrote {total} examples ({counts}) in {seconds:.1f} s, "
          f"{total / max(seconds, 1e-9):.0f} examples/s -> {where}")


def plan(args: cli.Args) -> List[Tuple[str, Dict[str, Any]]]:
  """`(task, its options)` for every task given, all checked before any task
  is prepared, so that a typo fails at once.

  Raises:
    ValueError: when a task does not take an option given (see `check_options`).
  """
  options = common_options(args)
  sizes_given = [o for o in _SIZE_OPTIONS if getattr(args, o) is not None]
  if args.size_scale is not None:
    sizes_given = list(_SIZE_OPTIONS)
  plans = []
  for name in dict.fromkeys(args.task):
    check_options(name, [*options, *sizes_given])
    plans.append((name, {**options, **size_options(task_sizes(name, args, options))}))
  return plans


def prepare(plans: Sequence[Tuple[str, Dict[str, Any]]], args: cli.Args) -> List[str]:
  """Prepares every planned task; returns (and prints) their summary lines."""
  lines = []
  for name, task_options in plans:
    line = prepare_task(name, task_options, pathlib.Path(args.data_dir),
                        progress=not args.quiet)
    print(line, flush=True)
    lines.append(line)
  return lines


def command_line(args: cli.Args) -> int:
  """The command line's run: a task not taking an option given is one line
  and exit status 2, before any task is prepared; data that is not here and
  cannot be downloaded (offline) is one line saying where to place its files,
  and exit status 1."""
  try:
    plans = plan(args)
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  try:
    prepare(plans, args)
  except data.DataUnavailableError as e:
    print(f"error: {e}", file=sys.stderr)
    return 1
  return 0


def main(argv: Optional[Sequence[str]] = None) -> List[str]:
  """This script from Python: `argv` and errors as in `cli.parse`, and `plan`'s."""
  args = cli.parse(define_flags, argv, __name__)
  return prepare(plan(args), args)


if __name__ == "__main__":
  cli.run(define_flags, command_line)
