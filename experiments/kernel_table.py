r"""The kernel table of committed `experiments.benchmark_attention` and
`experiments.benchmark_block_sparse` JSON files.

One table per head dim: each shape's implementations side by side (ms, peak
MiB), then the best peer's time over each of ours (above 1: ours is faster);
for a block-sparse file, each pattern's block density, kernel and pure-JAX
times, and the fit of time against density. For benchmarks run outside
`experiments.reproduce` (a lent GPU's stages in experiments/gpu_session.sh),
e.g. the README's GPU tables:

  python -m experiments.kernel_table benchmarks/attention_gpu.json \
      benchmarks/attention_gpu_d64.json benchmarks/block_sparse_gpu.json
"""

from __future__ import annotations

import json
import sys
from typing import Sequence

from experiments.tables import kernels


def markdown(paths: Sequence[str]) -> str:
  lines = []
  for path in paths:
    with open(path) as f:
      payload = json.load(f)
    if "settings" in payload:  # experiments.benchmark_block_sparse's layout
      lines += _block_sparse(path, payload)
      continue
    env = payload["environment"]
    rows = kernels.benchmark_rows(payload["records"])
    dtype = payload["arguments"].get("dtype")
    for head_dim in sorted({r["head_dim"] for r in rows}):
      lines += [f"From `{path}` (git {str(env.get('git_revision'))[:7]}, {env.get('device_kind')}, "
                f"jax {env.get('jax_version')}; {dtype}, batch {payload['arguments'].get('batch')}, "
                f"{payload['arguments'].get('heads')} heads of {head_dim}):", "",
                *kernels.by_shape([r for r in rows if r["head_dim"] == head_dim]), ""]
  return "\n".join(lines)


def _block_sparse(path: str, payload) -> list:
  settings = payload["settings"]
  return [f"From `{path}` (git {str(payload.get('git_revision'))[:7]}, "
          f"{payload['devices']['kind']}; kernel {settings.get('implementation', 'blockwise')} in "
          f"blocks of {settings['block_size']}, {settings['dtype']}, T = {settings['length']}, "
          f"{settings['heads']} heads of {settings['head_dim']}, non-causal forward+backward, "
          f"median of {settings['repeats']}):", "",
          *kernels.block_sparse_lines(kernels.block_sparse_rows(payload["records"])), ""]


if __name__ == "__main__":
  print(markdown(sys.argv[1:]))
