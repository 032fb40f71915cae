"""Smoke test of experiments/benchmark_reversible.py on tiny shapes: bookkeeping, not speed."""

import json
import pathlib
import sys

import pytest

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # experiments/ is a script folder, not installed.
  sys.path.insert(0, str(REPO_ROOT))

from experiments import benchmark_reversible  # pylint: disable=g-import-not-at-top


def test_every_cell_is_compiled_with_ratios_growth_and_the_table_written(tmp_path):
  out = tmp_path / "reversible.json"
  assert benchmark_reversible.main([
      "--length=64", "--num_layers=1,3", "--stacks=standard,reversible", f"--out={out}"]) == 0
  data = json.loads(out.read_text())
  cells = {(r["num_layers"], r["stack"]) for r in data["records"]}
  assert cells == {(n, s) for n in (1, 3) for s in ("standard", "reversible")}
  for record in data["records"]:
    assert record["temp_bytes"] > 0 and record["length"] == 64
    standard = next(r for r in data["records"] if r["stack"] == "standard"
                    and r["num_layers"] == record["num_layers"])
    assert record["temp_ratio_to_standard"] == pytest.approx(
        record["temp_bytes"] / standard["temp_bytes"])
  growth = data["temp_growth_bytes_per_layer"]
  by = {(r["num_layers"], r["stack"]): r["temp_bytes"] for r in data["records"]}
  assert growth["standard"] == pytest.approx((by[3, "standard"] - by[1, "standard"]) / 2)
  table = out.with_suffix(".txt").read_text()
  assert "reversible" in table and "MiB/layer" in table
  assert data["command"].startswith("python -m experiments.benchmark_reversible")


def test_growth_per_layer_is_the_least_squares_slope():
  records = [dict(stack="s", num_layers=n, temp_bytes=5 + 3 * n) for n in (2, 4, 8)]
  assert benchmark_reversible.growth_per_layer(records, "s") == pytest.approx(3.0)
