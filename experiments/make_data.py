"""Prepares LRA tasks into a data directory: generates or converts each split once.

  python -m experiments.make_data --task listops --task pathfinder32 --data-dir DIR
  python -m experiments.make_data --task listops --data-dir DIR --size-scale 0.01
  python -m experiments.make_data --task retrieval --data-dir DIR --release-dir lra_release/tsv_data

Each task is `attention_jax.data.get_task(name, **options).prepare(DIR)`, which
shows the task's own progress bars and skips splits already in DIR. One line per
task tells what was written, how long it took and the examples per second.
Options go only to the tasks that take them: an option a task does not take is an
error that names the task and lists what it takes.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import pathlib
import sys
import time
from typing import Any, Dict, List, Optional, Sequence

from attention_jax import data
from attention_jax.data import SPLITS

_SIZE_OPTIONS = tuple(f"{split}_size" for split in SPLITS)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(prog="python -m experiments.make_data",
                                   description=__doc__.split("\n\n")[0])
  parser.add_argument("--task", action="append", required=True, choices=data.list_tasks(),
                      help="a task to prepare; repeat for several")
  parser.add_argument("--data-dir", required=True, type=pathlib.Path,
                      help="where the tasks' splits are written (DIR/<task>/<split>/)")
  parser.add_argument("--size-scale", type=float,
                      help="each split's size as this fraction of the LRA release's size")
  for split in SPLITS:
    parser.add_argument(f"--{split}-size", type=int, help=f"examples of the {split} split")
  parser.add_argument("--seed", type=int, help="generator seed (generated tasks)")
  parser.add_argument("--release-dir", type=pathlib.Path,
                      help="the LRA release's files for the task (retrieval; loaders)")
  parser.add_argument("--tfds-data-dir", dest="data_dir_tfds", type=pathlib.Path,
                      help="tensorflow-datasets' data_dir (text, image)")
  parser.add_argument("--no-download", dest="download", action="store_false", default=None,
                      help="fail rather than let tensorflow-datasets download (text, image)")
  parser.add_argument("--option", action="append", default=[], metavar="NAME=VALUE",
                      help="any other make_task option, e.g. --option max_length=1000")
  parser.add_argument("--quiet", action="store_true", help="no progress bars")
  args = parser.parse_args(argv)
  args.error = parser.error
  if args.size_scale is not None and args.size_scale <= 0:
    parser.error(f"--size-scale must be positive, got {args.size_scale}.")
  return args


def _parse_value(text: str) -> Any:
  try:
    return ast.literal_eval(text)
  except (ValueError, SyntaxError):
    return text  # a plain string, e.g. a path or a name


def common_options(args: argparse.Namespace) -> Dict[str, Any]:
  """The options given on the command line, sizes apart (they depend on the task)."""
  options = {name: getattr(args, name) for name in ("seed", "release_dir", "data_dir_tfds",
                                                    "download")
             if getattr(args, name) is not None}
  for item in args.option:
    name, equals, value = item.partition("=")
    if not equals or not name:
      args.error(f"--option expects NAME=VALUE, got {item!r}.")
    options[name] = _parse_value(value)
  return options


def check_options(name: str, options: Sequence[str], error) -> None:
  """Calls `error` when the task's make_task does not take one of `options`."""
  parameters = data.task_parameters(name)
  if any(p.kind == inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
    return  # takes anything; the task checks its own options
  unknown = [option for option in options if option not in parameters]
  if unknown:
    flags = ", ".join(f"--{o.replace('_', '-')} ({o})" for o in unknown)
    error(f"task {name!r} does not take {flags}; it takes: {', '.join(parameters)}.")


def task_sizes(name: str, args: argparse.Namespace, options: Dict[str, Any]) -> Dict[str, int]:
  """{split: size} from --<split>-size, else --size-scale times the release size."""
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


def main(argv: Optional[Sequence[str]] = None) -> List[str]:
  args = parse_args(argv)
  options = common_options(args)
  plans = []
  # Check every task's options before preparing any, so a typo fails at once.
  for name in dict.fromkeys(args.task):
    sizes_given = [o for o in _SIZE_OPTIONS if getattr(args, o) is not None]
    if args.size_scale is not None:
      sizes_given = list(_SIZE_OPTIONS)
    check_options(name, [*options, *sizes_given], args.error)
    plans.append((name, {**options, **size_options(task_sizes(name, args, options))}))
  lines = []
  for name, task_options in plans:
    line = prepare_task(name, task_options, args.data_dir, progress=not args.quiet)
    print(line, flush=True)
    lines.append(line)
  return lines


if __name__ == "__main__":
  main(sys.argv[1:])
