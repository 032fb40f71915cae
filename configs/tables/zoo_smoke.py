"""Every token mixer of the registry trained on smoke ListOps: the zoo table.

  python -m experiments.reproduce --table=configs/tables/zoo_smoke.py --results=results/zoo_smoke/

The variants are a registry query, `registry.list_variants("mixer")`, so a
variant registered later joins the table by itself; a mixer that cannot train
here goes into `NOT_RUN` with the reason, and the table lists it. Each runs as
the encoder's attention of `configs/lra/listops.py` at its smoke preset
(depth <= 4, 100 tokens, a 2-layer width-64 model, 600 steps of batch 32) with
the variant's method options, 2 seeds: about a minute a cell on 2 CPU cores
(Pallas `flash` is interpreted on CPU: about five). The target is every
variant above the majority class; the table says which are.

Cell overrides, where a default does not fit 101 tokens ([CLS] + 100):
BigBird's blocks are 16 (as in lra_smoke.py: at 64 the sequence makes 2
blocks, fewer than its 3 random blocks). Three variants need the length to
divide their structure and 101 is prime, so they pool by the mean over the
100 tokens instead of a [CLS] token: `axial` (a 10 x 10 grid),
`memory_compressed` (stride 4) and `nystromformer` (with 20 landmarks, not
64, a divisor of 100). `disagreement` weighs its regularisers by 0.01, not the
paper's 1: the paper adds them to a sentence's summed log-likelihood, and the
position term is itself a sum over the queries (up to T = 101 here), so
against one label's cross-entropy a weight of 1 made the regulariser the whole
loss (seed 1 stayed at the majority class, its auxiliary loss 7.4 against a
cross-entropy of 2); 0.01 is about 1 / T, the weight per query. `mlp_mixer`
and `gmlp` have weights sized by the sequence length, so their `max_length`
is the 101 tokens. `moba` chooses among blocks of 16 keys (7 of them).
"""

from __future__ import annotations

import ml_collections

from attention_jax import registry

# A mixer that cannot train on this task, with the reason; the table lists it.
NOT_RUN = {name: "causal only (no form that attends to later tokens), and ListOps is read by "
                 "a bidirectional encoder: it is in the recall table"
           for name in registry.list_variants("mixer")
           if not registry.get_variant(name).bidirectional}


def get_config():
  config = ml_collections.ConfigDict()
  config.name = "zoo_smoke"
  config.kind = "accuracy"
  config.description = "Every registered token mixer on ListOps, smoke preset (CPU)"
  config.tasks = {"listops": "configs/lra/listops.py"}
  config.variants = tuple(v for v in registry.list_variants("mixer") if v not in NOT_RUN)
  config.not_run = NOT_RUN
  config.seeds = (0, 1)
  config.presets = ("smoke",)
  config.flags = ()
  config.paper = False
  config.sort_by_accuracy = True
  config.notes = (
      "dilated attends from position i to i + 2m only (dilation 2, no local heads): the "
      "two parity classes never exchange information in any layer, so the [CLS] token sees "
      "half the expression; Longformer uses dilation with undilated heads beside it, which "
      "`longformer`'s row is",
      "disagreement's regularisers are weighted 0.01 here, not 1 (docstring of "
      "configs/tables/zoo_smoke.py)",
      "transformer_xl and compressive train without a memory here (a classifier's batches are "
      "independent examples), so both are the same relative-attention layer and their rows "
      "are equal; their memories are measured by configs/tables/chars.py",
      "the chunkwise rows' cells shared the two cores: seed 0 of delta_net, gated_delta_net "
      "and gla with the test suite, seed 1 of delta_net and gated_delta_net with test runs, "
      "and the others with a training run at the lowest priority (nice 19): their steps/s "
      "and memory are lower bounds, not comparable with the other rows'",
      "mla's two cells were re-made at 2966b30 (stop 61: its head projections had started "
      "sqrt(H) too small), beside other training runs: its steps/s and memory are lower "
      "bounds too",
      "disagreement's two cells were re-made at a2ffb48 (stop 62: its subspace regulariser "
      "had read the values of padded keys), beside the test suite and training runs: its "
      "steps/s and memory are lower bounds too",
      "grouped_query shares 2 key/value heads among the 4 query heads; its cells were "
      "re-made with it at stop 62 (before, num_kv_heads was unset and the row was "
      "multi_head's), beside other training runs: its steps/s are lower bounds too",)
  mean_pooled = {"model": {"pooling": "mean"}}
  config.cell_overrides = {"listops": {
      "bigbird": {"model": {"attention_options": {"block_size": 16}}},
      "axial": mean_pooled,
      "memory_compressed": mean_pooled,
      "disagreement": {"model": {"attention_options": {"weight": 0.01}}},
      "nystromformer": {"model": {"pooling": "mean", "attention_options": {"num_landmarks": 20}}},
      "mlp_mixer": {"model": {"attention_options": {"max_length": 101}}},
      "gmlp": {"model": {"attention_options": {"max_length": 101}}},
      # 7 blocks of 16 (its default 64 would make 2, fewer than its top_k of 3).
      "moba": {"model": {"attention_options": {"block_size": 16}}},
      # The 4 query heads share 2 key/value heads (unset, it is multi_head).
      "grouped_query": {"model": {"num_kv_heads": 2}},
  }}
  return config
