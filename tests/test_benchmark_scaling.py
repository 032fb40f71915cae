"""Smoke test of experiments/benchmark_scaling.py on tiny shapes: bookkeeping, not speed."""

import json
import math
import pathlib
import sys

import pytest
from absl import flags

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # experiments/ is a script folder, not installed.
  sys.path.insert(0, str(REPO_ROOT))

from experiments import benchmark_scaling  # pylint: disable=g-import-not-at-top

LENGTHS = (64, 128)


@pytest.fixture(scope="module")
def payload(tmp_path_factory):
  out = tmp_path_factory.mktemp("scaling") / "scaling.json"
  benchmark_scaling.main([
      "--variants=multi_query", f"--lengths={','.join(map(str, LENGTHS))}", "--heads=2",
      "--head_dim=8", "--modes=fwd,fwd_bwd", "--repeats=1", f"--out={out}"])
  return json.loads(out.read_text()), out


def test_dense_is_always_measured_and_every_cell_ran(payload):
  data, _ = payload
  assert data["arguments"]["variants"] == ["dot_product", "multi_query"]
  cells = {(r["variant"], r["seq_len"], r["mode"]) for r in data["records"]}
  assert cells == {(v, t, m) for v in ("dot_product", "multi_query") for t in LENGTHS
                   for m in ("fwd", "fwd_bwd")}
  for record in data["records"]:
    assert record["error"] is None, record["error"]
    assert record["ms"] > 0 and record["memory"]["peak_delta_bytes"] >= 0


def test_summary_has_slopes_and_ratios_to_dense(payload):
  data, _ = payload
  rows = {(row["variant"], row["mode"]): row for row in data["summary"]}
  assert set(rows) == {(v, m) for v in ("dot_product", "multi_query") for m in ("fwd", "fwd_bwd")}
  for (variant, mode), row in rows.items():
    assert row["lengths"] == list(LENGTHS)
    assert math.isfinite(row["time_slope"])
    ms = {r["seq_len"]: r["ms"] for r in data["records"]
          if r["variant"] == variant and r["mode"] == mode}
    dense = {r["seq_len"]: r["ms"] for r in data["records"]
             if r["variant"] == "dot_product" and r["mode"] == mode}
    assert row["speedup_vs_dense"] == pytest.approx([dense[t] / ms[t] for t in LENGTHS])
  assert rows["dot_product", "fwd"]["speedup_vs_dense"] == [1.0, 1.0]


def test_plot_is_written_next_to_the_json(payload):
  _, out = payload
  png = out.with_suffix(".png")
  assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_log_log_slope():
  lengths = [1000, 2000, 4000, 8000]
  assert benchmark_scaling.log_log_slope(lengths, [3 * t ** 2 for t in lengths]) == (
      pytest.approx(2.0))
  assert benchmark_scaling.log_log_slope(lengths, [5 * t for t in lengths]) == pytest.approx(1.0)
  # Failed cells (None) are left out; fewer than two points give no slope.
  assert benchmark_scaling.log_log_slope(lengths, [None, 4.0, None, 16.0]) == pytest.approx(1.0)
  assert benchmark_scaling.log_log_slope(lengths, [None, None, None, 1.0]) is None


def test_unknown_variant_is_a_bad_flag_listing_the_valid_names():
  with pytest.raises(flags.IllegalFlagValueError,
                     match=r"flag --variants=\['nope'\]: unknown attention variant 'nope'"):
    benchmark_scaling.main(["--variants=nope"])


def test_default_selection_is_every_mixer_but_the_interpreted_kernel_on_cpu():
  from attention_jax import registry  # pylint: disable=import-outside-toplevel
  on_cpu = benchmark_scaling.selected_variants(None, "cpu")
  assert on_cpu[0] == "dot_product"
  assert set(on_cpu) == set(registry.list_variants("mixer")) - {"flash"}
  assert "flash" in benchmark_scaling.selected_variants(None, "gpu")


def test_quadratic_variants_can_be_capped_in_length_but_dense_is_not():
  args = benchmark_scaling.parse_args(["--lengths=64,128", "--modes=fwd",
                                       "--max_quadratic_length=64"])
  cells = list(benchmark_scaling.make_cells(args, ["dot_product", "multi_query", "local"]))
  assert {(c["variant"], c["seq_len"]) for c in cells} == {
      ("dot_product", 64), ("dot_product", 128), ("multi_query", 64), ("local", 64),
      ("local", 128)}


def test_dense_reference_is_the_materialised_softmax():
  dense = benchmark_scaling.module_of("dot_product", 2, 64)
  assert dict(dense.attention_options) == {"implementation": "xla"}
  assert dict(benchmark_scaling.module_of("multi_query", 2, 64).attention_options) == {
      "implementation": "xla"}
  assert dict(benchmark_scaling.module_of("local", 2, 64).attention_options) == {}
  # Parameters sized by a maximum length are sized for the measured length.
  synthesizer = benchmark_scaling.module_of("synthesizer_random", 2, 2048)
  assert dict(synthesizer.attention_options) == {"max_length": 2048}
  assert benchmark_scaling.module_of("gmlp", 2, 2048).max_length == 2048
