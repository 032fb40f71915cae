"""The LRA accuracy table at the `smoke` preset, runnable on a 2-core CPU.

  python -m experiments.reproduce --table=configs/tables/lra_smoke.py --results=results/lra_smoke/

The paper's eleven models (as in `configs/tables/lra.py`) x both attention
presets (`method`: the paper's method; `lra_release`: what the LRA release's
code ran, docs/lra_release.md) x two seeds on smoke ListOps (depth <= 4, 100
tokens, a 2-layer width-64 model, 600 steps): about a minute a cell on 2 CPU
cores, so the 44 cells take about 45 minutes.

Only ListOps: it is the one task whose smoke data this machine can make. Text,
Retrieval and Image need downloads (IMDB through tensorflow-datasets, the LRA
release's AAN files, CIFAR-10) that are impossible here. Pathfinder32 is
generated locally, but its smoke preset (1,024 tokens, 400 steps of batch 32)
ran at 0.22 steps/s on this shared machine and was still at chance (loss
0.693, train accuracy 52%) after 100 steps: about half an hour per cell, so
eleven variants cannot fit. Run it with `--only` on a faster machine, e.g.
`--table=configs/tables/lra.py` filtered, or add it to `TASKS` below.

Every row pools by [CLS] (the task's pooling): LSH and Sinkhorn pad the 101
tokens to their block multiple themselves. One cell override: BigBird's blocks
are 16 tokens in both presets (at 64, the default and the release's, the 101
tokens make 2 blocks, fewer than its 3 random blocks: the run is refused).
"""

from __future__ import annotations

import ml_collections

VARIANTS = ("dot_product", "local", "fixed", "longformer", "linformer", "lsh", "sinkhorn",
            "synthesizer_dense", "bigbird", "linear", "performer")
TASKS = {"listops": "configs/lra/listops.py"}


def get_config():
  config = ml_collections.ConfigDict()
  config.name = "lra_smoke"
  config.kind = "accuracy"
  config.description = "LRA accuracy table, smoke preset (CPU)"
  config.tasks = TASKS
  config.variants = VARIANTS
  config.seeds = (0, 1)
  config.presets = ("smoke",)
  config.attention_presets = ("method", "lra_release")
  config.flags = ()
  config.cell_overrides = {"listops": {
      "bigbird": {"model": {"attention_options": {"block_size": 16}}},
  }}
  return config
