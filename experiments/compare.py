"""Trains one task's config for several attention variants and prints a table.

  python -m experiments.compare --config=configs/lra/listops.py --preset=smoke \\
      --variants=dot_product,linear,performer,local --workdir=runs/listops-smoke

Each variant runs as its own `python -m experiments.train` process in
`<workdir>/<variant>` (so peak memory is that variant's alone, and a crash
stops only its row); a variant whose workdir already holds results is not run
again, and an interrupted one resumes from its checkpoint. The runs go through
`experiments.reproduce`'s cell runner; for grids of tasks x variants x seeds
with paper numbers and plots, use `experiments.reproduce` with a
`configs/tables/` file. The table (test
accuracy at the best validation checkpoint, steps/s, peak memory) is printed
and written to `<workdir>/table.md`.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
from typing import Dict, List, Optional, Sequence

from attention_jax.train.trainer import RESULTS_FILE
from experiments.reproduce import run_cell, training_command


def run_variant(config: str, variant: str, presets: Sequence[str], workdir: pathlib.Path,
                overrides: Sequence[str] = ()) -> Optional[Dict]:
  """Trains `config:variant[,presets]` in `workdir` (unless finished there) and
  returns its results, or None when the run failed (its output is printed).

  The run goes through `experiments.reproduce.run_cell`, the one cell runner."""
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


def main(argv: Optional[Sequence[str]] = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--config", required=True, help="a configs/lra/<task>.py file")
  parser.add_argument("--variants", default="dot_product,linear,performer,local",
                      help="comma-separated attention variant names")
  parser.add_argument("--preset", action="append", default=[],
                      help="a preset of the config (repeatable), e.g. smoke")
  parser.add_argument("--workdir", required=True, help="one subfolder per variant goes here")
  parser.add_argument("overrides", nargs="*",
                      help="--config.a.b=value overrides passed to every run (after --)")
  args = parser.parse_args(argv)
  from attention_jax.registry import get_variant  # pylint: disable=g-import-not-at-top
  variants = [name.strip() for name in args.variants.split(",") if name.strip()]
  for name in variants:
    get_variant(name)  # an unknown name fails here, listing the valid ones
  workdir = pathlib.Path(args.workdir)
  results = {name: run_variant(args.config, name, args.preset, workdir / name, args.overrides)
             for name in variants}
  first = next((r for r in results.values() if r), None)
  header = ""
  if first:
    devices = first["devices"]
    header = (f"{first['config']['task']} ({', '.join(args.preset) or 'full'}), "
              f"{devices['count']} x {devices['kind']}, git {first['git_revision']}\n\n")
  table = header + markdown_table(table_rows(results)) + "\n"
  workdir.mkdir(parents=True, exist_ok=True)
  (workdir / "table.md").write_text(table)
  print(table)
  return 0 if all(results.values()) else 1


if __name__ == "__main__":
  sys.exit(main())
