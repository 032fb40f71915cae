"""The attention kernel table: `experiments.benchmark_attention` over a grid of
sequence lengths (each length one cell, one benchmark run).

  python -m experiments.reproduce --table=configs/tables/kernels.py --results=results/kernels/

Every implementation `attention_jax.available_implementations()` lists on the
backend, next to its peers (jax.nn xla / cuDNN, JAX's Pallas kernels), forward
and forward+backward, float32, batch 1, 8 heads of 64, non-causal and causal.
"""

from __future__ import annotations

import ml_collections


def get_config():
  config = ml_collections.ConfigDict()
  config.name = "kernels"
  config.kind = "kernels"
  config.description = "attention kernels against their peers"
  config.lengths = (1024, 2048, 4096, 8192)
  # The other flags of experiments.benchmark_attention, the same for every cell.
  config.args = ("--batch=1", "--heads=8", "--head_dims=64", "--dtype=float32", "--causal=both",
                 "--modes=fwd,fwd_bwd", "--repeats=3")
  # The flags of experiments.benchmark_block_sparse (its cell: runs/block_sparse).
  config.block_sparse_args = ("--length=8192", "--heads=4", "--head_dim=64", "--repeats=3")
  config.cell_timeout_s = 3600
  return config
