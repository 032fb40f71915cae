"""Writes the README's results tables from the committed results (or checks them).

  python -m experiments.readme_tables          # rewrite every results block of README.md
  python -m experiments.readme_tables --check  # exit 1 if one differs from its results

Each block sits between `<!-- results: <table.md path> [sections=N] -->` and
`<!-- results:end -->` and is that committed `table.md`'s tables (from its
first `##` heading on, or its first N sections; headings two levels down)
under a line naming the file, its git revision and device. The `table.md` files are themselves made from the
cells' `results.json` by `experiments.reproduce` (or, for the quick start,
`experiments.compare`); `tests/test_readme_tables.py` re-renders each one
from its `results.json` files, so a README figure that differs from what its
results say fails the suite.
"""

from __future__ import annotations

import pathlib
import re
from typing import Dict, List, Optional, Sequence

from absl import flags

from experiments import cli

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
END = "<!-- results:end -->"
_START = re.compile(r"<!-- results: (\S+)(?: sections=(\d+))? -->\n")

# The committed tables and the table configs that made them (None: made by
# experiments.compare, the quick start).
SOURCES: Dict[str, Optional[str]] = {
    "results/quickstart/table.md": None,
    "results/lra_smoke/table.md": "configs/tables/lra_smoke.py",
    "results/lra_speed/table.md": "configs/tables/lra_speed.py",
    "benchmarks/lra_speed_h200/table.md": "configs/tables/lra_speed.py",
    "results/kernels/table.md": "configs/tables/kernels.py",
    "results/seq2seq_smoke/table.md": "configs/tables/seq2seq_smoke.py",
    "results/zoo_smoke/table.md": "configs/tables/zoo_smoke.py",
    "results/chars/table.md": "configs/tables/chars.py",
    "results/recall_sweep/table.md": "configs/tables/recall_sweep.py",
    "results/length/table.md": "configs/tables/length.py",
    "results/needle/table.md": "configs/tables/needle.py",
    "results/pretrain_smoke/table.md": "configs/tables/pretrain_smoke.py",
}


def define_flags(flag_values: flags.FlagValues, argv: Sequence[str]) -> None:
  """This script's flags (see `experiments.cli`)."""
  del argv
  flags.DEFINE_bool("check", False, "only check that README.md's results blocks are current",
                    flag_values=flag_values)


def tables_of(text: str, sections: Optional[int] = None) -> List[str]:
  """The lines of a `table.md` from its first `##` heading on (what does not
  depend on the machine that wrote it: the header and the data-dependent
  majority-class line come before), its first `sections` sections when given."""
  lines = text.rstrip("\n").splitlines()
  headings = [i for i, line in enumerate(lines) if line.startswith("## ")]
  if not headings:  # experiments.compare's table: one title line, then the table
    return lines[next(i for i, line in enumerate(lines) if line.startswith("|")):]
  end = headings[sections] if sections is not None and sections < len(headings) else len(lines)
  while end > headings[0] and not lines[end - 1].strip():
    end -= 1
  return lines[headings[0]:end]


def provenance(text: str) -> str:
  """"git <rev>, <device>" from a table.md's header (either format)."""
  # Every revision of "- git revision: a, b" (cells made at different commits), or the one.
  listed = re.search(r"- git revision: (.+)", text)
  revisions = (re.findall(r"[0-9a-f]{7,40}\S*", listed.group(1)) if listed else
               re.findall(r"git ([0-9a-f]{7,40}\S*)", text)[:1])
  device = re.search(r"- device: (.+)|, (\d+ x \w+(?: \([^)]*\))?), git", text)
  where = device.group(1) or device.group(2) if device else "unknown device"
  return f"git {', '.join(r[:7] for r in revisions) or 'unknown'}, {where}"


def block(source: str, sections: Optional[int] = None) -> str:
  """The README block of committed table `source` (a path relative to the
  repository): its first `sections` sections, or all."""
  text = (ROOT / source).read_text()
  body = [("##" + line) if line.startswith("#") else line for line in tables_of(text, sections)]
  return "\n".join([f"From `{source}` ({provenance(text)}):", "", *body]) + "\n"


def render(readme_text: str) -> str:
  """`readme_text` with every results block rewritten from its source.

  Raises:
    ValueError: on a block without its end marker or naming an unknown source.
  """
  out, position = [], 0
  for match in _START.finditer(readme_text):
    source = match.group(1)
    if source not in SOURCES:
      raise ValueError(f"README.md names results {source!r}; known results are: "
                       f"{', '.join(SOURCES)}.")
    end = readme_text.find(END, match.end())
    if end < 0:
      raise ValueError(f"README.md's block of {source!r} has no {END!r} marker.")
    sections = int(match.group(2)) if match.group(2) else None
    out += [readme_text[position:match.end()], block(source, sections)]
    position = end
  return "".join(out) + readme_text[position:]


def write_or_check(args: cli.Args) -> int:
  """Rewrites the blocks, or with --check says whether one is stale (1)."""
  current = README.read_text()
  updated = render(current)
  if updated == current:
    return 0
  if args.check:
    print("README.md's results tables are stale: run python -m experiments.readme_tables")
    return 1
  README.write_text(updated)
  return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
  """This script from Python: `argv` and errors as in `cli.parse`."""
  return write_or_check(cli.parse(define_flags, argv, __name__))


if __name__ == "__main__":
  cli.run(define_flags, write_or_check)
