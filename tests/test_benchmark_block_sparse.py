"""experiments.benchmark_block_sparse on a short sequence: the records, the
block densities against the counts from each pattern's definition, the fit,
and the kernel table's block-sparse rows (no timing is asserted)."""

import json

import numpy as np
import pytest

from experiments import benchmark_block_sparse, kernel_table
from experiments.tables import kernels


def test_one_short_run_records_densities_times_and_the_fit(tmp_path):
  out = tmp_path / "block_sparse.json"
  assert benchmark_block_sparse.main(["--length=1024", "--heads=2", "--head_dim=16",
                                      "--repeats=1", "--variants=block_local",
                                      f"--out={out}"]) == 0
  payload = json.loads(out.read_text())
  records = {r["variant"] + str(r["options"].get("block_size", "")): r
             for r in payload["records"]}
  assert set(records) == {"dense", "block_local256", "block_local1024"}
  # Kernel blocks of 128 over T = 1024: 8 x 8. A 256-token block is 2 of them,
  # so each query block visits 2 key blocks; a 1024-token block is all of T.
  assert records["dense"]["block_density"] == 1.0
  assert records["block_local256"]["block_density"] == pytest.approx(16 / 64)
  assert records["block_local1024"]["block_density"] == 1.0
  for record in payload["records"]:
    assert record["kernel_ms"] > 0 and len(record["kernel_times_ms"]) == 1
  assert all(r["pure_ms"] > 0 for name, r in records.items() if name != "dense")
  assert set(payload["settings"]["fit"]) == {"slope_ms", "intercept_ms", "r_squared"}
  assert payload["settings"]["implementation"] == "blockwise"
  # experiments.kernel_table renders the file (as the README's GPU rows are).
  text = kernel_table.markdown([str(out)])
  assert "kernel blockwise in blocks of 128, float32, T = 1024, 2 heads of 16" in text
  assert "| block_local | block_size=256 | 0.250 |" in text
  assert "least squares over the 3 rows" in text


def test_the_fit_is_least_squares():
  fit = benchmark_block_sparse.fit_line([0.0, 0.5, 1.0], [10.0, 60.0, 110.0])
  assert fit["slope_ms"] == pytest.approx(100.0) and fit["intercept_ms"] == pytest.approx(10.0)
  assert fit["r_squared"] == pytest.approx(1.0)
  noisy = benchmark_block_sparse.fit_line([0.0, 0.5, 1.0], [10.0, 80.0, 110.0])
  assert noisy["r_squared"] < 1.0
  np.testing.assert_allclose(noisy["slope_ms"], 100.0)


def test_the_kernel_table_lists_the_block_sparse_rows_after_the_shapes():
  dense = dict(impl="attention_jax:blockwise", seq_len=1024, mode="fwd", causal=False,
               head_dim=64, ms=20.0, memory={}, speedup_vs_best_peer=2.0, best_peer="jax.nn")
  sparse = [dict(variant="dense", options={}, block_density=1.0, kernel_ms=100.0),
            dict(variant="local", options=dict(window_size=128), block_density=0.25,
                 kernel_ms=30.0, pure_ms=60.0, pure_over_kernel=2.0)]
  rows = kernels.benchmark_rows([dense]) + kernels.block_sparse_rows(sparse)
  text = "\n".join(kernels.markdown(None, rows))
  assert text.index("## ms (peak MiB) by shape") < text.index("## Block-sparse kernel")
  assert "| local | window_size=128 | 0.250 | 30 | 60 | 2.00x |" in text
  assert "| dense | - | 1.000 | 100 | - | - |" in text
  assert "Kernel ms = 6.67 + 93 x block density" in text  # 100 - 93.3 (under 10: 2 decimals)
  # The block-sparse rows are not records of the shape table.
  every_record = text[text.index("## Every record"):]
  assert "local" not in every_record and "attention_jax:blockwise" in every_record
