"""Smoke test of experiments/benchmark_attention.py on tiny shapes.

It checks the bookkeeping (one record per requested cell, finite numbers, a
memory figure, speedups against the peer), never the speed itself.
"""

import json
import math
import pathlib
import sys

import pytest

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # experiments/ is a script folder, not installed.
  sys.path.insert(0, str(REPO_ROOT))

from experiments import benchmark_attention  # pylint: disable=g-import-not-at-top

LENGTHS = (64, 128)
MODES = ("fwd", "fwd_bwd")
# One attention_jax implementation; the peer must be added by the script itself.
# Each CPU cell costs a child process (~4 s), so the impl list is pinned rather
# than growing with available_implementations().
REQUESTED = ["attention_jax:xla"]


@pytest.fixture(scope="module")
def payload(tmp_path_factory):
  """Runs the benchmark once on tiny shapes and loads the JSON it wrote."""
  out = tmp_path_factory.mktemp("bench") / "attention.json"
  # Causal only, for the same reason: the sweep stays well under a minute.
  benchmark_attention.main([
      "--lengths", *map(str, LENGTHS), "--batch", "1", "--heads", "2", "--head-dim", "16",
      "--causal", "true", "--modes", *MODES, "--impls", *REQUESTED, "--repeats", "1",
      "--out", str(out),
  ])
  return json.loads(out.read_text())


def test_one_record_per_requested_cell(payload):
  labels = REQUESTED + [benchmark_attention.PEER]
  assert payload["arguments"]["impls"] == labels
  cells = {(r["impl"], r["seq_len"], r["causal"], r["mode"]) for r in payload["records"]}
  expected = {(l, t, True, m) for l in labels for t in LENGTHS for m in MODES}
  assert cells == expected
  assert len(payload["records"]) == len(expected)


def test_records_hold_time_rate_and_memory(payload):
  for record in payload["records"]:
    assert record["error"] is None, record["error"]
    assert record["ms"] > 0
    assert math.isfinite(record["gflop_per_s"]) and record["gflop_per_s"] > 0
    assert record["memory"]["peak_delta_bytes"] is not None
    assert record["memory"]["peak_delta_bytes"] >= 0


def test_speedups_are_against_the_peer(payload):
  peer_ms = {(r["seq_len"], r["causal"], r["mode"]): r["ms"]
             for r in payload["records"] if r["impl"] == benchmark_attention.PEER}
  for record in payload["records"]:
    assert record["peer"] == benchmark_attention.PEER
    expected = peer_ms[record["seq_len"], record["causal"], record["mode"]] / record["ms"]
    assert record["speedup_vs_peer"] == pytest.approx(expected)


def test_environment_and_arguments_recorded(payload):
  assert payload["environment"]["jax_version"]
  assert payload["environment"]["backend"]
  assert payload["arguments"]["lengths"] == list(LENGTHS)
  assert payload["timestamp"]


def test_default_impls_include_attention_jax_and_peer():
  labels = benchmark_attention.available_labels()
  assert "attention_jax:xla" in labels
  assert labels[-1] == benchmark_attention.PEER


def test_flop_count():
  cell = {"batch": 2, "seq_len": 8, "heads": 3, "head_dim": 4, "mode": "fwd", "causal": False}
  forward = 4 * 2 * 3 * 8 * 8 * 4
  assert benchmark_attention.attention_flops(cell) == forward
  assert benchmark_attention.attention_flops(dict(cell, mode="fwd_bwd")) == 3.5 * forward
  assert benchmark_attention.attention_flops(
      dict(cell, mode="fwd_bwd", causal=True)) == 3.5 * forward / 2
