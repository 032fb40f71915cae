"""experiments.benchmark_flex at tiny sizes: every case x length x pass is
recorded with finite positive times, the forms that cannot express a case say
so, and flex computes the same function as the plain kernel and jax.nn (no
timing or ratio is asserted)."""

import json
import math

import jax.numpy as jnp
import numpy as np
import pytest

from attention_jax.kernels.flash_attention import blockwise, pallas_gpu

from experiments import benchmark_flex


def test_a_tiny_run_records_every_case_length_and_pass(tmp_path):
  out = tmp_path / "flex.json"
  # Blocks of 16 over T = 32, 48: 2 x 2 and 3 x 3 tiles, so that the masks skip
  # some. The cap passes T = 32 (float32 logits of 4 KiB, their gradient 4 more,
  # ALiBi's bias 4 more) and stops jax.nn's fwd_bwd at T = 48.
  cap = 13000
  benchmark_flex.main(["--lengths=32,48", "--heads=1", "--head_dim=16", "--repeats=1",
                       "--block_size=16", "--window=8", f"--max_dense_bytes={cap}",
                       f"--out={out}"])
  payload = json.loads(out.read_text())
  assert payload["environment"]["git_revision"] is not None
  assert payload["environment"]["cpu_model"] is not None
  assert payload["command"].startswith("python -m experiments.benchmark_flex ")
  records = {(r["case"], r["length"], r["mode"]): r for r in payload["records"]}
  assert set(records) == {(case, length, mode) for case in benchmark_flex.CASES
                          for length in (32, 48) for mode in benchmark_flex.PASSES}
  for (case, length, mode), record in records.items():
    assert 0 < record["density"] <= 1
    for form in benchmark_flex.FORMS:
      result = record[form]
      if case == "softcap" and form != "flex":
        assert result["status"].startswith("n/a"), (case, form)
        continue
      if result["materialised_bytes"] > cap:
        assert result["status"].startswith("skipped: would materialise"), (case, form)
        continue
      assert result["status"] == "ok", (case, length, mode, form, result)
      assert math.isfinite(result["ms"]) and result["ms"] > 0
      if form != "flex":
        # The same function on both sides (outputs, or gradients in fwd_bwd).
        assert result["max_abs_diff_from_flex"] < 1e-4, (case, length, mode, form)
    ratio = record["flex_over_blockwise"]
    assert (ratio is None) == (record["blockwise"]["status"] != "ok")
    assert ratio is None or (math.isfinite(ratio) and ratio > 0)
  assert records[("causal", 32, "fwd_bwd")]["jax_nn"]["status"] == "ok"
  assert records[("causal", 48, "fwd_bwd")]["jax_nn"]["status"].startswith("skipped")
  assert records[("causal", 48, "fwd_bwd")]["blockwise"]["status"] == "ok"
  # The masks skip tiles where they should: the causal mask over 3 x 3 tiles
  # visits 6, the sliding window of 8 (keys i - 7 .. i) in tiles of 16 visits 5.
  np.testing.assert_allclose(records[("causal", 48, "fwd")]["density"], 6 / 9)
  np.testing.assert_allclose(records[("sliding_window", 48, "fwd")]["density"], 5 / 9)


@pytest.mark.parametrize("length", [1000, 4096])
def test_document_ids_cut_each_row_into_documents(length):
  ids = benchmark_flex.document_ids(2, length)
  assert ids.shape == (2, length) and ids[:, 0].tolist() == [0, 0]
  assert np.all(np.diff(ids, axis=1) >= 0)
  assert ids[:, -1].tolist() == [max(2, length // 1024) - 1] * 2


def test_the_triton_kernels_on_both_sides(tmp_path):
  # --implementation=pallas_gpu: flex on the Triton kernels against our plain
  # Triton kernel in the same blocks (interpreted off a GPU), in bfloat16.
  out = tmp_path / "flex_gpu.json"
  benchmark_flex.main(["--implementation=pallas_gpu", "--dtype=bfloat16", "--lengths=32",
                       "--heads=1", "--head_dim=16", "--repeats=1", "--block_size=16",
                       "--window=8", "--cases=causal,alibi,softcap", f"--out={out}"])
  records = json.loads(out.read_text())["records"]
  assert {(r["case"], r["mode"]) for r in records} == {
      (case, mode) for case in ("causal", "alibi", "softcap") for mode in benchmark_flex.PASSES}
  for record in records:
    assert (record["implementation"], record["plain_kernel"], record["dtype"]) == (
        "pallas_gpu", "pallas", "bfloat16")
    assert record["flex"]["status"] == "ok"
    if record["case"] != "softcap":
      # bfloat16 inputs: the two kernels agree to bfloat16's rounding.
      assert record["blockwise"]["max_abs_diff_from_flex"] < 0.1, record
      assert record["jax_nn"]["max_abs_diff_from_flex"] < 0.1, record


@pytest.mark.parametrize("head_dim", [64, 128])
def test_the_default_blocks_follow_the_implementation(head_dim):
  # Triton on both sides: the plain Triton kernel's forward blocks for this
  # head dim and dtype (not the blockwise kernel's), unless --block_size.
  gpu = pallas_gpu.default_block_sizes_gpu(head_dim, jnp.bfloat16)
  assert benchmark_flex.kernel_blocks(8192, None, "pallas_gpu", head_dim, "bfloat16") == (
      gpu.block_q, gpu.block_k)
  cpu = blockwise.default_block_sizes(8192, 8192)
  assert benchmark_flex.kernel_blocks(8192, None, "blockwise", head_dim, "bfloat16") == (
      cpu.block_q, cpu.block_k)
  assert benchmark_flex.kernel_blocks(8192, 32, "pallas_gpu", head_dim, "bfloat16") == (32, 32)


def test_a_saved_run_prints_its_tables(tmp_path, capsys):
  out = tmp_path / "flex.json"
  benchmark_flex.main(["--lengths=32", "--heads=1", "--head_dim=16", "--repeats=1",
                       "--block_size=16", "--cases=causal", f"--out={out}"])
  capsys.readouterr()
  payload = benchmark_flex.main([f"--from_json={out}"])
  printed = capsys.readouterr().out
  assert payload["records"] == json.loads(out.read_text())["records"]
  assert printed.count("causal              32") == 2  # one row per pass
  assert "flex/plain" in printed


def test_the_forms_are_timed_in_rounds_each_running_every_form_once_in_alternating_order():
  calls = []
  runs = {form: (lambda form=form: calls.append(form)) for form in ("flex", "blockwise")}
  times = benchmark_flex.time_in_rounds(runs, repeats=3)
  untimed = ["blockwise", "flex"]
  assert calls == untimed + ["flex", "blockwise", "blockwise", "flex", "flex", "blockwise"]
  assert {form: len(t) for form, t in times.items()} == {"flex": 3, "blockwise": 3}
