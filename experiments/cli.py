"""The experiment scripts' command lines: absl flags, started by `absl.app.run`.

Every `python -m experiments.<script>` takes absl flags, as `experiments.train`
does: `--name=value` (or `--name value`), `--flag` / `--noflag` for a boolean,
`--name=a,b` for a list, a repeated `--name=...` for a repeatable flag, and a
config file as `--config=FILE[:ARG]` with `--config.a.b=value` overrides
(ml_collections' config flag). A bad flag is one line naming it.

A script declares its flags in `define_flags(flag_values, argv)` instead of at
import, for two reasons:

* the scripts share flag names with other meanings and defaults (`--batch`,
  `--lengths`, `--out`; `--config` in `experiments.compare` and
  `experiments.train`), and one process (a test session, a script importing
  another) imports several of them, which absl's one global FLAGS refuses;
* Python callers (tests, other scripts) parse argvs of their own, as many as
  they like: ml_collections adds a config's `--config.a.b` flags while it
  parses, so the same FlagValues cannot be parsed twice.

So `parse` (from Python) defines the flags on a fresh FlagValues for each call,
and `run` (the command line) defines them on absl's global FLAGS next to absl's
own (`--help`, `--helpfull`, `--flagfile`, `--verbosity`), so that `--help`
lists them and absl reports a bad one.

A script that starts several processes' work (`experiments.train`) takes
`--coordinator_address`, `--num_processes` and `--process_id` from
`define_distributed_flags`, and `distributed_arguments_of` turns them, their
JAX_* variables and a cluster manager's environment into the arguments of
`jax.distributed.initialize`, checked before jax starts.
"""

from __future__ import annotations

import difflib
import os
import re
import sys
import types
from typing import Any, Callable, Dict, Mapping, Optional, Sequence

from absl import app, flags, logging
import ml_collections
from ml_collections import config_flags

# `define_flags(flag_values, argv)`: defines a script's flags on `flag_values`;
# `argv` is the whole command line, which ml_collections' config flags search
# for their `--config.a.b` overrides.
DefineFlags = Callable[[flags.FlagValues, Sequence[str]], None]


class Args(types.SimpleNamespace):
  """A script's parsed flags: `args.name` is the value of `--name`.

  `vars(args)` holds the script's flags only (absl's own are left out);
  `argv` and `flag_values` are kept outside it.

  Attributes:
    argv: the command line as given, program name first.
    flag_values: the absl FlagValues the flags were parsed into, for what only
      absl knows (a config flag's file name and overrides).
  """

  __slots__ = ("argv", "flag_values")


class _ListParser(flags.ListParser):
  """A comma-separated list whose items `item` parses (absl's own list flag
  keeps them strings)."""

  def __init__(self, item: flags.ArgumentParser):
    super().__init__()
    self._item = item

  def parse(self, argument: Any) -> list:
    items = []
    for text in super().parse(argument):
      try:
        items.append(self._item.parse(text))
      except ValueError as e:
        raise ValueError(f"{text!r}: {e}") from e
    return items

  def flag_type(self) -> str:
    return f"list of {self._item.flag_type()}"


def DEFINE_list_of(item: flags.ArgumentParser, name: str, default: Optional[Sequence[Any]],
                   help_string: str, flag_values: flags.FlagValues) -> flags.FlagHolder:
  """A comma-separated list flag (`--lengths=1024,4096`) of items that `item`
  parses, e.g. `flags.IntegerParser(lower_bound=1)` or `flags.EnumParser(choices)`;
  a bad item is an error naming the flag and the item."""
  return flags.DEFINE(_ListParser(item), name, default, help_string, flag_values,
                      serializer=flags.CsvListSerializer(","))


def check_config_file(flag_values: flags.FlagValues, name: str,
                      check: Callable[[Any, str], None]) -> None:
  """Registers `check(config, argument)` as a validator of the config flag `--name`.

  `argument` is the flag's value as given (`FILE[:ARG]`); a ValueError or
  OSError (ml_collections could not load the file) that `check` raises is a
  bad `--name`, reported as absl reports one, but with the argument where
  absl would print the whole config.
  """

  def checker(config: Any) -> bool:
    if config is None:
      return True  # Not given: absl reports a missing required flag itself.
    argument = config_flags.get_config_filename(flag_values[name])
    try:
      check(config, argument)
    except (OSError, ValueError) as e:
      raise flags.IllegalFlagValueError(f"flag --{name}={argument}: {e}") from e
    return True

  flags.register_validator(name, checker, flag_values=flag_values)


def config_keys(config: Any, prefix: str = "") -> list:
  """Every key of a ConfigDict (or dict), dotted: "model", "model.embed_dim", ..."""
  keys = []
  for key, value in config.items():
    keys.append(f"{prefix}{key}")
    if isinstance(value, (ml_collections.ConfigDict, dict)):
      keys.extend(config_keys(value, f"{prefix}{key}."))
  return keys


def unknown_override_message(flag_name: str, key: str, config: Any) -> str:
  """The one line for `--<flag_name>.<key>=...` when `config` has no `key`:
  the flag, and the closest keys as the fix."""
  close = difflib.get_close_matches(key, config_keys(config), n=3, cutoff=0.6)
  if close:
    fix = "did you mean " + " or ".join(f"--{flag_name}.{match}" for match in close) + "?"
  else:
    fix = f"the valid keys are those the config file's get_config() returns."
  return f"--{flag_name}.{key}: the config of --{flag_name} has no key {key!r}; {fix}"


def _args(flag_values: flags.FlagValues, names: Sequence[str], argv: Sequence[str]) -> Args:
  args = Args(**{name: flag_values[name].value for name in names})
  args.argv = list(argv)
  args.flag_values = flag_values
  return args


def _parse(flag_values: flags.FlagValues, argv: Sequence[str]) -> None:
  """`flag_values(argv)`, refusing arguments that are not flags.

  Raises:
    flags.Error: on a bad flag or an argument that is not one; also for an
      override of a key its config lacks, which ml_collections reports as an
      AttributeError or KeyError from inside absl's parsing.
  """
  try:
    rest = flag_values(list(argv))
  except (AttributeError, KeyError) as e:
    key = str(e).strip("\"'")
    for arg in argv[1:]:
      match = re.match(r"--?(?:no)?(\w+)\.([^=]+)", arg)
      # Only a config flag takes `--<name>.<path>` overrides.
      if match and match.group(1) in flag_values and key in match.group(2).split("."):
        name, path = match.groups()
        raise flags.Error(unknown_override_message(name, path, flag_values[name].value)) from e
    raise
  if len(rest) > 1:
    raise flags.Error(f"unexpected argument(s) {' '.join(rest[1:])!r}: every option is a flag, "
                      f"and a flag takes one value (a list is --name=a,b).")


def parse(define_flags: DefineFlags, argv: Optional[Sequence[str]] = None,
          program: str = "experiments") -> Args:
  """Parses a script's command line from Python, into a fresh FlagValues.

  Args:
    define_flags: the script's `define_flags`.
    argv: the command line after the program name (None: `sys.argv[1:]`).
    program: the program name, for absl.

  Returns:
    The flags' values.

  Raises:
    flags.Error: on an unknown flag, a bad value or a missing required flag
      (the message names the flag), or an argument that is not a flag.
  """
  argv = [program, *(sys.argv[1:] if argv is None else argv)]
  flag_values = flags.FlagValues()
  define_flags(flag_values, argv)
  # Before parsing: a config flag adds its `--config.a.b` flags while parsing.
  names = list(flag_values)
  _parse(flag_values, argv)
  return _args(flag_values, names, argv)


def run(define_flags: DefineFlags, main: Callable[[Args], Any]) -> None:
  """Runs a script from the command line: `absl.app.run` with its flags.

  The flags go on absl's global FLAGS (in this process only this script
  defines any), and `main(args)` runs with their values. An int result is the
  exit status; any other (a payload for Python callers) exits with 0. A bad
  flag, or an argument that is not one, is one line on stderr and exit status
  1, as absl reports it.
  """
  before = set(flags.FLAGS)
  define_flags(flags.FLAGS, sys.argv)
  names = [name for name in flags.FLAGS if name not in before]

  def parse_command_line(argv: Sequence[str]) -> Sequence[str]:
    try:
      _parse(flags.FLAGS, argv)
    except flags.Error as e:  # As absl's app.parse_flags_with_usage reports it.
      sys.stderr.write(f"FATAL Flags parsing error: {e}\n"
                       "Pass --helpshort or --helpfull to see help on flags.\n")
      sys.exit(1)
    return argv[:1]

  def run_main(argv: Sequence[str]) -> Any:
    del argv  # the program name alone: parse_command_line refuses other arguments
    if not flags.FLAGS["verbosity"].present:
      # As in experiments.train: jax and orbax log much at INFO, which absl's
      # default would print; --verbosity=0 brings it back.
      logging.set_verbosity(logging.WARNING)
    result = main(_args(flags.FLAGS, names, sys.argv))
    return result if isinstance(result, int) else 0

  app.run(run_main, flags_parser=parse_command_line)


# -- multi-process runs: the flags and variables of jax.distributed ------------

# The variables behind --coordinator_address, --num_processes and --process_id.
# jax 0.10 reads only the first itself (and auto-detects the rest only under a
# cluster manager); the other two are read here.
DISTRIBUTED_ENV = dict(coordinator_address="JAX_COORDINATOR_ADDRESS",
                       num_processes="JAX_NUM_PROCESSES", process_id="JAX_PROCESS_ID")


def define_distributed_flags(flag_values: flags.FlagValues) -> None:
  """Defines --coordinator_address, --num_processes and --process_id, which
  `distributed_arguments_of` reads."""
  flags.DEFINE_string(
      "coordinator_address", None,
      "multi-process runs without a cluster manager: host:port of process 0, the same on "
      "every process (default: $JAX_COORDINATOR_ADDRESS)", flag_values=flag_values)
  flags.DEFINE_integer(
      "num_processes", None,
      "multi-process runs: how many processes (default: $JAX_NUM_PROCESSES)",
      flag_values=flag_values)
  flags.DEFINE_integer(
      "process_id", None,
      "multi-process runs: this process's index, 0 to num_processes - 1 (default: "
      "$JAX_PROCESS_ID)", flag_values=flag_values)


def distributed_arguments_of(flag_values: flags.FlagValues,
                             environ: Mapping[str, str] = os.environ
                             ) -> Optional[Dict[str, Any]]:
  """`distributed_arguments` of the flags `define_distributed_flags` defined."""
  return distributed_arguments(*(flag_values[name].value for name in DISTRIBUTED_ENV),
                               environ=environ)


def distributed_requested(environ: Mapping[str, str] = os.environ) -> bool:
  """True when a launcher's environment asks for more than one process."""
  if environ.get("JAX_COORDINATOR_ADDRESS"):
    return True
  for name in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"):
    if environ.get(name, "1").isdigit() and int(environ.get(name, "1")) > 1:
      return True
  return "," in environ.get("TPU_WORKER_HOSTNAMES", "")


def _cluster_manager(environ: Mapping[str, str]) -> Optional[str]:
  """The cluster manager whose environment describes this job, if any (one jax
  can read the process count and index from)."""
  for name in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"):
    if environ.get(name, "1").isdigit() and int(environ.get(name, "1")) > 1:
      return "SLURM" if name.startswith("SLURM") else "Open MPI"
  if "," in environ.get("TPU_WORKER_HOSTNAMES", ""):
    return "a TPU pod"
  return None


def distributed_arguments(coordinator_address: Optional[str] = None,
                          num_processes: Optional[int] = None,
                          process_id: Optional[int] = None,
                          environ: Mapping[str, str] = os.environ) -> Optional[Dict[str, Any]]:
  """The keyword arguments of `jax.distributed.initialize` for this process, or
  None for a single-process run.

  Each argument falls back on its environment variable (`DISTRIBUTED_ENV`);
  what is still unset is left to jax's cluster detection when a cluster
  manager describes the job, and is an error otherwise.

  Args:
    coordinator_address, num_processes, process_id: the flags' values (None
      when not given).
    environ: the environment.

  Returns:
    {} to let jax detect everything, the settings given otherwise; None when
    no setting and no launcher asks for several processes.

  Raises:
    ValueError: naming the flag and its variable, on a value that is not
      valid, or on a multi-process run that a cluster manager does not describe
      and that lacks one of the three settings.
  """
  given: Dict[str, Any] = {}
  for name, value in (("coordinator_address", coordinator_address),
                      ("num_processes", num_processes), ("process_id", process_id)):
    variable = DISTRIBUTED_ENV[name]
    source = f"--{name}"
    if value is None and environ.get(variable, "").strip():
      value, source = environ[variable].strip(), f"${variable}"
    if value is None:
      continue
    if name == "coordinator_address":
      host, _, port = str(value).rpartition(":")
      if not host or not port.isdigit():
        raise ValueError(f"{source}={value!r} must be host:port (the address process 0 listens "
                         f"on, the same for every process), e.g. 10.0.0.1:8476.")
    else:
      try:
        value = int(value)
      except ValueError:
        raise ValueError(f"{source}={value!r} must be an integer.") from None
      if value < (1 if name == "num_processes" else 0):
        expected = "at least 1" if name == "num_processes" else "at least 0"
        raise ValueError(f"{source}={value} must be {expected}.")
    given[name] = (value, source)

  if "num_processes" in given and "process_id" in given:
    (count, count_source), (index, index_source) = given["num_processes"], given["process_id"]
    if index >= count:
      raise ValueError(f"{index_source}={index} must be below {count_source}={count} "
                       f"(processes are numbered 0 to {count - 1}).")
  if not given:
    return {} if distributed_requested(environ) else None
  if _cluster_manager(environ) is None:
    missing = [name for name in DISTRIBUTED_ENV if name not in given]
    if missing:
      if set(missing) == {"coordinator_address", "process_id"} and given[
          "num_processes"][0] == 1:
        return None  # One process asked for explicitly.
      listed = ", ".join(f"--{name} (or ${DISTRIBUTED_ENV[name]})" for name in missing)
      have = ", ".join(f"{source}={value}" for value, source in given.values())
      raise ValueError(f"{have} asks for a multi-process run, which without a cluster manager "
                       f"(SLURM, Open MPI, a TPU pod) also needs {listed}: give every process "
                       f"the same --coordinator_address and --num_processes and its own "
                       f"--process_id.")
  return {name: value for name, (value, _) in given.items()}
