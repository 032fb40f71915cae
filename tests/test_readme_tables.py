"""README figures are their results files': every results block of README.md
equals its committed table.md, and every table.md equals what its cells'
committed results.json files give when rendered again."""

import json
import pathlib
import re

import pytest

from experiments import compare, readme_tables, tables

ROOT = pathlib.Path(__file__).resolve().parents[1]
README_TEXT = (ROOT / "README.md").read_text()
IN_README = [source for source in readme_tables.SOURCES
             if f"<!-- results: {source}" in README_TEXT]


def test_the_readme_shows_the_committed_tables():
  assert IN_README, "README.md has no results blocks"
  assert readme_tables.render(README_TEXT) == README_TEXT, (
      "README.md's results tables differ from results/*/table.md: run "
      "python -m experiments.readme_tables")


def test_a_changed_readme_figure_is_caught():
  source = IN_README[0]
  rows = [line for line in readme_tables.block(source).splitlines() if line.startswith("| ")]
  figure_row = rows[-1]
  changed = README_TEXT.replace(figure_row, figure_row.replace("|", "| 9", 2)[:-1] + "|", 1)
  assert changed != README_TEXT
  assert readme_tables.render(changed) != changed


def _rendered_from_results(source: str, tmp_path: pathlib.Path):
  """The tables of committed `source` made again from its cells' results.json."""
  results_dir = (ROOT / source).parent
  config = readme_tables.SOURCES[source]
  if config is None:  # experiments.compare's table: one row per variant folder
    committed = readme_tables.tables_of((ROOT / source).read_text())
    variants = [line.split("|")[1].strip() for line in committed[2:]]
    results = {v: json.loads((results_dir / v / "results.json").read_text()) for v in variants}
    return compare.markdown_table(compare.table_rows(results)).splitlines()
  table = tables.load_table(ROOT / config)
  kind = tables.kind_of(table)
  cells = tables.expand(table, results_dir)
  # A table may be partial (a GPU table whose last cells the call's limit cut
  # off) only where its header says so.
  finished = sum(cell.results_path.is_file() for cell in cells)
  stated = re.search(r"^- cells finished: (\d+) of (\d+)$", (ROOT / source).read_text(), re.M)
  assert stated and (int(stated[1]), int(stated[2])) == (finished, len(cells)), (
      f"{source}: {finished} of {len(cells)} cells finished, the header says {stated}")
  lines = kind.markdown(table, kind.summarize(table, cells), data_dir=str(tmp_path / "none"))
  return readme_tables.tables_of("\n".join(lines) + "\n")


@pytest.mark.parametrize("source", IN_README)
def test_each_committed_table_is_what_its_results_give(source, tmp_path):
  committed = (ROOT / source).read_text()
  assert "+dirty" not in committed, f"{source} was made from a dirty tree"
  assert readme_tables.tables_of(committed) == _rendered_from_results(source, tmp_path)


def test_a_block_naming_unknown_results_is_refused():
  with pytest.raises(ValueError, match="known results are"):
    readme_tables.render("<!-- results: results/nope/table.md -->\n<!-- results:end -->\n")
