"""Trains one config: `python -m experiments.train --config=FILE[:ARG] --workdir=DIR`.

  python -m experiments.train --config=configs/lra/listops.py:performer,smoke \\
      --workdir=runs/listops-performer --config.num_train_steps=300

`--config.a.b=value` overrides any config key. Running the same command again
resumes the run in the workdir (or does nothing more if it finished); a workdir
holding a run of a different config is refused unless `--overwrite` is given,
which moves that run aside.

Stopping: Ctrl-C (SIGINT) or SIGTERM while training checkpoints the current
step, waits for the save and prints how to resume (the same command, which
continues exactly from that step); a second signal stops at once. With several
processes, a signal to any one stops all after the next step at which they
record train metrics or checkpoint (within `log_every` steps).

Several processes (hosts, or processes on one host) run the same command each,
sharing the workdir's filesystem; `jax.distributed.initialize` is called when
more than one process is asked for:

- without a cluster manager, give every process the coordinator's address (a
  `host:port` that process 0 listens on), the number of processes and its own
  index, by flags or by environment variables:

    python -m experiments.train ... --coordinator_address=host0:8476 \\
        --num_processes=2 --process_id=0     # on host0
    JAX_COORDINATOR_ADDRESS=host0:8476 JAX_NUM_PROCESSES=2 JAX_PROCESS_ID=1 \\
        python -m experiments.train ...      # on host1

  (jax reads JAX_COORDINATOR_ADDRESS itself; JAX_NUM_PROCESSES and
  JAX_PROCESS_ID are read by `experiments.cli`. A flag wins over its
  variable.) On CPU the processes exchange data with gloo, jax's default CPU
  collectives (`JAX_CPU_COLLECTIVES_IMPLEMENTATION`);
- under SLURM (several tasks), Open MPI (mpirun) or on a TPU pod nothing is
  needed: jax reads the job's coordinates from the launcher's environment; any
  of the three settings above overrides what it would detect.

Exit status: 0 finished; 1 training diverged (a NaN or infinite loss: the line
names the step and the last good checkpoint); 2 a bad flag, config or workdir
(one line saying which and what to do); 128 + the signal's number when
interrupted (130 for SIGINT, 143 for SIGTERM, as a shell reports a process
the signal killed), after the checkpoint is written.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import signal
import sys
from typing import List, NoReturn, Optional, Sequence

from absl import app, flags, logging
import ml_collections
from ml_collections import config_flags
from ml_collections.config_flags import config_path

from experiments import cli

_CONFIG = config_flags.DEFINE_config_file("config", None, "the experiment config file[:arg]",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "where checkpoints, metrics and results go")
_OVERWRITE = flags.DEFINE_bool("overwrite", False,
                               "move aside a run of a different config in --workdir")
cli.define_distributed_flags(flags.FLAGS)
flags.mark_flags_as_required(["config", "workdir"])

EXIT_DIVERGED = 1
EXIT_USAGE = 2


def _fail(message: str, status: int = EXIT_USAGE) -> NoReturn:
  """Prints `message` as one line on stderr and exits with `status`."""
  print(f"error: {message}", file=sys.stderr, flush=True)
  sys.exit(status)


# -- flag parsing with one-line errors -----------------------------------------


def _config_argument(argv: Sequence[str]) -> Optional[str]:
  """The value of the last --config flag in `argv` (absl syntax), or None."""
  value = None
  args = list(argv[1:])
  for i, arg in enumerate(args):
    if arg == "--":  # absl stops reading flags here.
      break
    match = re.fullmatch(r"--?config(=(.*))?", arg, flags=re.DOTALL)
    if match:
      value = match.group(2) if match.group(1) else (args[i + 1] if i + 1 < len(args) else None)
  return value


def _override_flags(argv: Sequence[str]) -> List[str]:
  """The `--config.a.b` flags in `argv`, as written up to any "=", in order."""
  overrides = []
  for arg in argv[1:]:
    if arg == "--":
      break
    if re.match(r"-{1,2}(no)?config\.", arg):
      overrides.append(arg.split("=", 1)[0])
  return overrides


def _unknown_override_message(argv: Sequence[str], config_argument: str) -> Optional[str]:
  """The one-line error for the first --config.<key> override whose key the
  config lacks, or None when every override names a key (so the failure was
  something else)."""
  path, *arguments = config_argument.split(":", 1)
  try:
    # Loaded again as ml_collections does (get_config of the file, with the
    # text after the first ":"), to list its keys.
    spec = importlib.util.spec_from_file_location("_config_for_keys", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config(*arguments)
  except Exception:  # pylint: disable=broad-except
    return None  # Not an override's fault: let the original error show.
  for flag in _override_flags(argv):
    key = flag.split(".", 1)[1]
    try:
      config_path.get_value(key, config)
      continue
    except (AttributeError, KeyError, IndexError, ValueError):
      pass
    message = cli.unknown_override_message("config", key, config)
    if key.startswith(("model.attention_options.", "model.pooling_options.")):
      message += (" A variant's options are those it declares: "
                  "attention_jax.variant_options(name) and docs/variants.md list them "
                  "(the pooling's: variant_options('attention_pooling')).")
    elif key.startswith(("task_options.", "model.position_options.")):
      message += (" New keys of a free-form option dict cannot be added by a flag: set them in "
                  "a config file (see configs/tables/cell.py).")
    return message
  return None


def parse_flags(argv: List[str]) -> List[str]:
  """absl's flag parsing, with one-line errors (exit status 2) for a --config
  file that does not exist and for overrides of keys the config lacks, which
  ml_collections reports with a traceback."""
  expanded = flags.FLAGS.read_flags_from_files(argv, force_gnu=False)
  config_argument = _config_argument(expanded)
  if config_argument is not None:
    path = config_argument.split(":", 1)[0]
    if not os.path.isfile(path):
      what = "is a directory" if os.path.isdir(path) else "does not exist"
      _fail(f"--config={config_argument}: the config file {path} {what} (relative to "
            f"{os.getcwd()}); give a config file's path, e.g. "
            f"--config=configs/lra/listops.py:performer,smoke.")
  try:
    return app.parse_flags_with_usage(argv)
  except (AttributeError, KeyError):
    message = (_unknown_override_message(expanded, config_argument)
               if config_argument is not None else None)
    if message is None:
      raise
    _fail(message)


def _check_workdir_flag(workdir: str) -> None:
  path = os.path.abspath(workdir)
  while not os.path.exists(path) and os.path.dirname(path) != path:
    path = os.path.dirname(path)
  if os.path.exists(path) and not os.path.isdir(path):
    where = "is" if path == os.path.abspath(workdir) else f"is inside {path}, which is"
    _fail(f"--workdir={workdir} {where} an existing file; give a directory: a new path, or the "
          f"workdir of a run to resume.")


def _resume_command() -> str:
  """The command line this process was started with, to run again."""
  return shlex.join(getattr(sys, "orig_argv", None) or [sys.executable, *sys.argv])


def main(argv):
  del argv
  if not flags.FLAGS["verbosity"].present:
    # Orbax and jax log every checkpoint step at INFO; the progress bar and the
    # trainer's messages say what matters. --verbosity=0 brings them back.
    logging.set_verbosity(logging.WARNING)
  _check_workdir_flag(_WORKDIR.value)
  try:
    distributed = cli.distributed_arguments_of(flags.FLAGS)
  except ValueError as e:
    _fail(str(e))
  import jax  # pylint: disable=g-import-not-at-top
  if distributed is not None:
    jax.distributed.initialize(**distributed)
  from attention_jax.train import trainer  # pylint: disable=g-import-not-at-top
  try:
    results = trainer.train_and_evaluate(_CONFIG.value, _WORKDIR.value,
                                         overwrite=_OVERWRITE.value)
  except ValueError as e:  # Bad input: say what and stop, without a traceback.
    _fail(str(e))
  except trainer.TrainingDivergedError as e:
    _fail(str(e), EXIT_DIVERGED)
  except trainer.TrainingInterrupted as e:
    # Every process: each names its own command.
    print(f"{e} To resume, run the same command: {_resume_command()}", file=sys.stderr,
          flush=True)
    sys.exit(128 + e.signal_number)
  except KeyboardInterrupt:
    # A Ctrl-C outside the training loop (preparing data, compiling the
    # first step, the final evaluation): nothing of the run is lost.
    print(f"interrupted outside the training loop; to continue, run the same command: "
          f"{_resume_command()}", file=sys.stderr, flush=True)
    sys.exit(128 + signal.SIGINT)
  if jax.process_index() == 0:
    metrics = results["metrics"]
    summary = dict(validation=metrics["validation"], test=metrics.get("test"),
                   steps_per_s=metrics["steps_per_s"],
                   peak_memory_bytes=metrics["peak_memory_bytes"])
    print(json.dumps(summary, default=str))


if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags)
