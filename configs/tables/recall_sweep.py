"""Multi-query associative recall as Zoology reports it: each model at its best
learning rate.

  python -m experiments.reproduce --table=configs/tables/recall_sweep.py \
      --results=results/recall_sweep/

The recall table (`configs/tables/recall.py`) trains every causal mixer at one
rate, 3e-3, and dense attention comes out bimodal over seeds there (99.9% and
20.5% at T = 64); Zoology (Arora et al. 2023) sweeps the rate per model and
reports the best. This table runs MQAR at T = 32 and 64 with the recall
table's model, budget and per-variant options at 1e-3, 3e-3 (the config's
own: the same runs as the recall table's, whose finished cells can be copied
in) and 1e-2, 2 seeds, and reports each row at the rate whose seeds have the
best mean best-validation accuracy (`learning_rates`,
`experiments/tables/accuracy.py`). The rows are one or two mixers per family,
not the whole zoo: the sweep triples a grid whose recurrent rows run at 4
steps a second here, and these rows carry the table's comparison (dense
attention, relative positions, the attention of 2023-2026, kernelised and
windowed attention with a fixed-size state, and the delta rule).
"""

from __future__ import annotations

import pathlib

from attention_jax.train.config import load_config_helpers

recall = load_config_helpers(pathlib.Path(__file__).with_name("recall.py"))

VARIANTS = ("dot_product", "transformer_xl", "stick_breaking", "differential", "forgetting",
            "sigmoid", "mla", "nsa", "moba", "linear", "performer", "local", "delta_net",
            "gated_delta_net")


def get_config():
  config = recall.get_config()
  config.name = "recall_sweep"
  config.description = "MQAR at each mixer's best learning rate (CPU)"
  config.tasks = {name: path for name, path in config.tasks.items() if name.startswith("mqar")}
  config.task_order = ("mqar_T32", "mqar_T64")
  config.cell_overrides = {task: config.cell_overrides[task] for task in config.task_order}
  config.variants = VARIANTS
  config.not_run = {}
  config.learning_rates = (1e-3, None, 1e-2)
  config.notes = ("The cells at the config's own rate (3e-3) are the recall table's runs, copied "
                  "(the same commands); the other rates' 112 cells ran from clean clones at "
                  "362262b, 46545c0, 13880b5 and 4916fc1; mla's and nsa's 24 cells were re-made "
                  "at 2966b30 (stop 61: NSA's forced blocks and per-branch keys and values, "
                  "MLA's initialisation), sharing the two cores with two other training runs",)
  return config
