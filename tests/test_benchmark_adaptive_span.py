"""experiments.benchmark_adaptive_span on a tiny band: its records and ratios."""

import json

import pytest
from absl import flags

from experiments import benchmark_adaptive_span


def test_one_tiny_run_records_every_span_and_mode(tmp_path):
  out = tmp_path / "span.json"
  assert benchmark_adaptive_span.main([
      "--length=64", "--heads=2", "--head_dim=4", "--max_span=24", "--ramp=4",
      "--block_size=8", "--spans=2,12", "--repeats=1", f"--out={out}"]) == 0
  payload = json.loads(out.read_text())
  records = {(r["mode"], r["span"]): r for r in payload["records"]}
  assert set(records) == {(m, z) for m in ("fwd", "fwd_bwd") for z in (2.0, 12.0, 24.0)}
  for mode in ("fwd", "fwd_bwd"):
    assert records[(mode, 24.0)]["ratio_to_full_span"] == 1.0
    assert all(records[(mode, z)]["ms"] > 0 for z in (2.0, 12.0))
  # Band of 24 + 4 - 1 = 27 keys in blocks of 8: offsets 0..4 back. z + R = 6
  # reaches offsets 0 and 1; z + R = 16 also 2 ((2 - 1) 8 + 1 = 9 < 16).
  assert [records[("fwd", z)]["blocks_in_reach"] for z in (2.0, 12.0, 24.0)] == pytest.approx(
      [2 / 5, 3 / 5, 1.0])
  assert payload["settings"]["max_span"] == 24


def test_bad_flags_are_refused():
  with pytest.raises(flags.Error, match="--spans=-1: '-1': -1.0 is not a non-negative"):
    benchmark_adaptive_span.main(["--spans=-1"])
