"""Trains one task's config for several attention variants and prints a table.

  python -m experiments.compare --config=configs/lra/listops.py --preset=smoke \\
      --variants=dot_product,linear,performer,local --workdir=runs/listops-smoke \\
      --config.num_train_steps=300

Each variant runs as its own `python -m experiments.train` process in
`<workdir>/<variant>` (so peak memory is that variant's alone, and a crash
stops only its row); a variant whose workdir already holds results is not run
again, and an interrupted one resumes from its checkpoint. `--config.a.b=value`
overrides are checked against the task's config here, before any run, and
passed to every run as given. The runs go through `experiments.tables.cells`'
cell runner; for grids of tasks x variants x seeds with paper numbers and
plots, use `experiments.reproduce` with a `configs/tables/` file. The table
(test accuracy at the best validation checkpoint, steps/s, peak memory) is
printed and written to `<workdir>/table.md`.
"""

from __future__ import annotations

import pathlib
import re
from typing import Any, Dict, List, Optional, Sequence

from absl import flags
from ml_collections import config_flags

from attention_jax.train.provenance import describe_devices
from attention_jax.train.workdir import RESULTS_FILE
from experiments import cli
from experiments.tables.accuracy import training_command
from experiments.tables.cells import run_cell


def define_flags(flag_values: flags.FlagValues, argv: Sequence[str]) -> None:
  """This script's flags (see `experiments.cli`)."""
  config_flags.DEFINE_config_file(
      "config", None, "a configs/lra/<task>.py file, without an argument (the variants come "
      "from --variants, the presets from --preset); --config.a.b=value overrides go to every "
      "run", flag_values=flag_values, sys_argv=list(argv))
  flags.DEFINE_list("variants", ["dot_product", "linear", "performer", "local"],
                    "attention variant names, comma-separated", flag_values=flag_values)
  flags.DEFINE_multi_string("preset", [], "a preset of the config (repeatable), e.g. smoke",
                            flag_values=flag_values)
  flags.DEFINE_string("workdir", None, "one subfolder per variant goes here",
                      flag_values=flag_values)
  flags.mark_flags_as_required(["config", "workdir"], flag_values=flag_values)

  def no_argument(config: Any, argument: str) -> None:
    del config
    if ":" in argument:
      raise ValueError("expected the task's config file alone: the variant is each of "
                       "--variants, the presets are --preset.")

  def known_variants(names: Sequence[str]) -> bool:
    from attention_jax.registry import get_mixer  # pylint: disable=g-import-not-at-top
    for name in names:
      try:
        get_mixer(name)
      except ValueError as e:  # its message lists the valid names
        raise flags.ValidationError(str(e)) from e
    return True

  cli.check_config_file(flag_values, "config", no_argument)
  flags.register_validator("variants", known_variants, flag_values=flag_values)


def config_overrides(args: cli.Args) -> List[str]:
  """The command line's `--config.a.b=value` flags, for the runs' command lines.

  As given, but each as one argument: `--config.a.b value` (which absl reads
  too) becomes `--config.a.b=value`.
  """
  argv = args.flag_values.read_flags_from_files(args.argv[1:], force_gnu=False)
  overrides = []
  for i, arg in enumerate(argv):
    match = re.match(r"^--?(no)?config\.([^=]+)(=.*)?$", arg)
    if not match:
      continue
    if match.group(3) is not None or args.flag_values[f"config.{match.group(2)}"].boolean:
      overrides.append(arg)
    else:
      overrides.append(f"{arg}={argv[i + 1]}")
  return overrides


def run_variant(config: str, variant: str, presets: Sequence[str], workdir: pathlib.Path,
                overrides: Sequence[str] = ()) -> Optional[Dict]:
  """Trains `config:variant[,presets]` in `workdir` (unless finished there) and
  returns its results, or None when the run failed (its output is printed).

  The run goes through `experiments.tables.cells.run_cell`, the one cell runner."""
  # Absolute: orbax refuses relative checkpoint paths.
  workdir = pathlib.Path(workdir).resolve()
  command = training_command(config, variant, presets, workdir, overrides)
  return run_cell(command, workdir / RESULTS_FILE)


def table_rows(results: Dict[str, Optional[Dict]]) -> List[Dict[str, str]]:
  """One row of formatted cells per variant."""
  rows = []
  for variant, result in results.items():
    if result is None:
      rows.append(dict(variant=variant, test="failed", validation="", steps_per_s="",
                       peak_memory=""))
      continue
    m = result["metrics"]
    test = m.get("test", {}).get("accuracy")
    memory = m.get("peak_memory_bytes")
    rows.append(dict(
        variant=variant,
        test="" if test is None else f"{100 * test:.1f}",
        validation=f"{100 * m['best_validation']['accuracy']:.1f}"
        if "best_validation" in m else "",
        steps_per_s="" if not m.get("steps_per_s") else f"{m['steps_per_s']:.1f}",
        peak_memory="" if memory is None else f"{memory / 2**20:.0f} MiB"
        f"{' (host RSS)' if m.get('memory_source') == 'host_rss' else ''}"))
  return rows


def markdown_table(rows: List[Dict[str, str]]) -> str:
  header = ["variant", "test accuracy (%)", "best validation (%)", "steps/s", "peak memory"]
  keys = ["variant", "test", "validation", "steps_per_s", "peak_memory"]
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  lines += ["| " + " | ".join(row[key] for key in keys) + " |" for row in rows]
  return "\n".join(lines)


def compare(args: cli.Args) -> int:
  """Runs every variant, then prints and writes the table.

  Returns:
    0 when every variant has results, 1 otherwise.
  """
  config_file = config_flags.get_config_filename(args.flag_values["config"])
  overrides = config_overrides(args)
  variants = list(dict.fromkeys(args.variants))
  workdir = pathlib.Path(args.workdir)
  results = {name: run_variant(config_file, name, args.preset, workdir / name, overrides)
             for name in variants}
  first = next((r for r in results.values() if r), None)
  header = ""
  if first:
    devices = first["devices"]
    header = (f"{first['config']['task']} ({', '.join(args.preset) or 'full'}), "
              f"{describe_devices(devices)}, git {first['git_revision']}\n\n")
  table = header + markdown_table(table_rows(results)) + "\n"
  workdir.mkdir(parents=True, exist_ok=True)
  (workdir / "table.md").write_text(table)
  print(table)
  return 0 if all(results.values()) else 1


def main(argv: Optional[Sequence[str]] = None) -> int:
  """This script from Python: `argv` and errors as in `cli.parse`."""
  return compare(cli.parse(define_flags, argv, __name__))


if __name__ == "__main__":
  cli.run(define_flags, compare)
