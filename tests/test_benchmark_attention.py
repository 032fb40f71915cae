"""Smoke test of experiments/benchmark_attention.py on tiny shapes.

It checks the bookkeeping (one record per requested cell, finite numbers, a
memory figure, ratios to the best peer), never the speed itself.
"""

import json
import math
import pathlib
import sys

import pytest
from absl import flags

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # experiments/ is a script folder, not installed.
  sys.path.insert(0, str(REPO_ROOT))

# pylint: disable-next=g-import-not-at-top
from experiments import benchmark_attention, cli

LENGTHS = (64, 128)
MODES = ("fwd", "fwd_bwd")
# One attention_jax implementation; the peers must be added by the script itself.
# Each CPU cell costs a child process (~4 s), so the impl list is pinned rather
# than growing with available_implementations().
REQUESTED = ["attention_jax:xla"]


@pytest.fixture(scope="module")
def payload(tmp_path_factory):
  """Runs the benchmark once on tiny shapes and loads the JSON it wrote."""
  out = tmp_path_factory.mktemp("bench") / "attention.json"
  # Causal only, for the same reason: the sweep stays well under a minute.
  benchmark_attention.main([
      f"--lengths={','.join(map(str, LENGTHS))}", "--batch=1", "--heads=2", "--head_dims=16",
      "--causal=true", f"--modes={','.join(MODES)}", f"--impls={','.join(REQUESTED)}",
      "--repeats=1", f"--out={out}",
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


def test_ratios_are_against_the_best_peer_of_the_same_shape(payload):
  peer_ms = {(r["seq_len"], r["causal"], r["mode"]): r["ms"]
             for r in payload["records"] if r["impl"] == benchmark_attention.PEER}
  for record in payload["records"]:
    assert record["best_peer"] == benchmark_attention.PEER  # The only peer on CPU.
    expected = peer_ms[record["seq_len"], record["causal"], record["mode"]] / record["ms"]
    assert record["speedup_vs_best_peer"] == pytest.approx(expected)
    assert record["speedup_vs"] == {benchmark_attention.PEER: pytest.approx(expected)}


def test_list_flags_are_comma_separated_and_checked():
  args = cli.parse(benchmark_attention.define_flags, ["--lengths=64,128", "--modes=fwd"])
  assert (args.lengths, args.modes, args.head_dims) == ([64, 128], ["fwd"], None)
  with pytest.raises(flags.IllegalFlagValueError, match="flag --lengths=64,x: 'x'"):
    cli.parse(benchmark_attention.define_flags, ["--lengths=64,x"])
  with pytest.raises(flags.IllegalFlagValueError, match="flag --modes=fwd,back: 'back'"):
    cli.parse(benchmark_attention.define_flags, ["--modes=fwd,back"])
  # The old space-separated lists end the flags: the rest is refused, not ignored.
  with pytest.raises(flags.Error, match="unexpected argument"):
    cli.parse(benchmark_attention.define_flags, ["--lengths", "64", "128"])


def test_best_peer_is_the_fastest_peer_that_ran():
  shape = dict(seq_len=8, head_dim=4, causal=False, mode="fwd")
  records = [dict(shape, impl="attention_jax:pallas", ms=2.0, error=None),
             dict(shape, impl="jax.nn:xla", ms=8.0, error=None),
             dict(shape, impl="jax.nn:cudnn", ms=4.0, error=None),
             dict(shape, impl="jax.pallas:gpu", ms=None, error="failed"),
             dict(shape, head_dim=8, impl="jax.nn:xla", ms=1.0, error=None)]
  benchmark_attention.add_speedups(records)
  ours = records[0]
  assert ours["best_peer"] == "jax.nn:cudnn"
  assert ours["speedup_vs_best_peer"] == pytest.approx(2.0)
  assert ours["speedup_vs"] == {"jax.nn:xla": pytest.approx(4.0),
                                "jax.nn:cudnn": pytest.approx(2.0)}
  assert records[3]["speedup_vs_best_peer"] is None


def test_peers_per_backend(monkeypatch):
  assert benchmark_attention.available_peers("cpu") == ["jax.nn:xla"]
  assert benchmark_attention.available_peers("gpu") == ["jax.nn:xla", "jax.nn:cudnn",
                                                        "jax.pallas:gpu"]
  assert benchmark_attention.available_peers("tpu") == ["jax.nn:xla", "jax.pallas:tpu"]
  # JAX's Mosaic GPU kernel joins on Hopper and newer only.
  monkeypatch.setattr(benchmark_attention, "_is_hopper_or_newer", lambda: True)
  assert benchmark_attention.available_peers("gpu") == ["jax.nn:xla", "jax.nn:cudnn",
                                                        "jax.pallas:gpu", "jax.pallas:mgpu"]


def test_a_program_larger_than_the_machine_is_refused_with_its_size():
  total = benchmark_attention.physical_memory_bytes()
  assert total is not None and total > 0
  with pytest.raises(MemoryError, match="needs .* GiB, more than this machine"):
    benchmark_attention.check_fits_in_memory({"temp_size_in_bytes": 2 * total}, "process")
  benchmark_attention.check_fits_in_memory({"temp_size_in_bytes": total // 100}, "process")


def test_environment_and_arguments_recorded(payload):
  assert payload["environment"]["jax_version"]
  assert payload["environment"]["backend"]
  assert payload["arguments"]["lengths"] == list(LENGTHS)
  assert payload["timestamp"]


def test_default_impls_include_attention_jax_and_the_peers():
  labels = benchmark_attention.available_labels()
  assert {"attention_jax:xla", "attention_jax:blockwise"} <= set(labels)
  assert labels[-1] == benchmark_attention.PEER


def test_mesh_implementations_are_left_to_their_own_benchmark():
  import attention_jax  # pylint: disable=g-import-not-at-top
  assert "ring" in attention_jax.available_implementations()
  assert "attention_jax:ring" not in benchmark_attention.available_labels()


def test_flop_count():
  cell = {"batch": 2, "seq_len": 8, "heads": 3, "head_dim": 4, "mode": "fwd", "causal": False}
  forward = 4 * 2 * 3 * 8 * 8 * 4
  assert benchmark_attention.attention_flops(cell) == forward
  assert benchmark_attention.attention_flops(dict(cell, mode="fwd_bwd")) == 3.5 * forward
  assert benchmark_attention.attention_flops(
      dict(cell, mode="fwd_bwd", causal=True)) == 3.5 * forward / 2
