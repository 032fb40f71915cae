"""Every causal token mixer of the registry on synthetic recall: the recall table.

  python -m experiments.reproduce --table=configs/tables/recall.py --results=results/recall/

The variants are a registry query (`registry.list_variants("mixer")` with
`causal`), so a causal variant registered later joins the table by itself;
one that cannot train here goes into `NOT_RUN` with the reason. Each is the
attention of the small language model of `configs/recall/recall.py` (2
layers, width 64, 1,500 steps of batch 32), 2 seeds, on

* multi-query associative recall (Zoology, Arora et al. 2023) at T = 64 and
  128, trained on a mixture of 2 to T/8 key-value pairs, with test accuracy
  per pair count: the columns "pairs<n>" and the plot of accuracy against
  pairs per variant;
* induction heads and selective copying at T = 64, one column each.

Zoology's finding, the anchor: dense attention keeps recall as the pairs
grow, while gated convolutions and efficient attention with a fixed-size
state lose it. Here the fixed-state variants are the kernelised ones
(linear, performer, rfa) and the windowed ones (local, band, block_local,
...), whose state is the window. The notes say what this table shows.

Cell overrides, where a default does not fit T = 64 or 128 tokens: block
and window sizes of at most T / 4, an axial grid that divides the length, and
the length itself where a variant's weights are sized by it (the
Synthesizers, gmlp) (see `_overrides`).
"""

from __future__ import annotations

import ml_collections

from attention_jax import registry

LENGTHS = (64, 128)

# A causal mixer that cannot train on these tasks, with the reason; the table lists it.
NOT_RUN = {}


def causal_variants():
  return tuple(v for v in registry.list_variants("mixer")
               if registry.get_variant(v).causal and v not in NOT_RUN)


def _overrides(seq_len: int):
  """Per-variant options at length `seq_len`."""
  options = {
      "synthesizer_dense": {"max_length": seq_len},
      "synthesizer_random": {"max_length": seq_len},
      "synthesizer_factorized": {"max_length": seq_len},
      "gmlp": {"max_length": seq_len},
      "bigbird": {"block_size": 8},
      "axial": {"shape": [8, seq_len // 8]},
  }
  return {variant: {"model": {"attention_options": value}} for variant, value in options.items()}


def get_config():
  config = ml_collections.ConfigDict()
  config.name = "recall"
  config.kind = "grouped_accuracy"
  config.description = "Every causal token mixer on synthetic recall (CPU)"
  config.tasks = {
      "mqar_T64": "configs/recall/recall.py:mqar,T64",
      "mqar_T128": "configs/recall/recall.py:mqar,T128",
      "induction_T64": "configs/recall/recall.py:induction_heads,T64",
      "copying_T64": "configs/recall/recall.py:selective_copying,T64",
  }
  config.task_order = ("mqar_T64", "mqar_T128", "induction_T64", "copying_T64")
  config.variants = causal_variants()
  config.not_run = NOT_RUN
  config.seeds = (0, 1)
  config.presets = ()
  config.flags = ()
  config.paper = False
  config.sort_by_accuracy = True
  config.group_axis = "key-value pairs"
  config.notes = ()
  config.cell_overrides = {"mqar_T64": _overrides(64), "mqar_T128": _overrides(128),
                           "induction_T64": _overrides(64), "copying_T64": _overrides(64)}
  return config
