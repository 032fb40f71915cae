"""Every causal token mixer of the registry on synthetic recall: the recall table.

  python -m experiments.reproduce --table=configs/tables/recall.py --results=results/recall/

The variants are a registry query (`registry.list_variants("mixer")` with
`causal`), so a causal variant registered later joins the table by itself;
one that cannot train here goes into `NOT_RUN` with the reason. Each is the
attention of the small language model of `configs/recall/recall.py` (2
layers, width 64, 1,000 steps of batch 32), 2 seeds, on

* multi-query associative recall (Zoology, Arora et al. 2023) at T = 32 and
  64, trained on a mixture of 2 to T/8 key-value pairs, with test accuracy
  per pair count: the columns "pairs<n>" and the plot of accuracy against
  pairs per variant;
* induction heads and selective copying at T = 32, one column each.

The lengths are what a 2-core CPU affords for every causal variant: the
section-A scoring functions and structured attention run at 1 to 6 steps a
second at T = 64, and at T = 128 dense attention itself does not learn MQAR
in this budget (19% after 1,500 steps, where it reaches 100% at T = 64).

Zoology's finding, the anchor: dense attention keeps recall as the pairs
grow, while gated convolutions and efficient attention with a fixed-size
state lose it. Here the fixed-state variants are the kernelised ones
(linear, performer, rfa) and the windowed ones (local, band, block_local,
...), whose state is the window. The notes say what this table shows: the
anchor holds in the best seed, and dense attention's recall at this budget
depends on the seed.

Cell overrides, where a default does not fit T = 32 or 64 tokens: block
and window sizes of at most T / 4, an axial grid that divides the length, and
the length itself where a variant's weights are sized by it (the
Synthesizers, gmlp) (see `_overrides`).
"""

from __future__ import annotations

import ml_collections

from attention_jax import registry

LENGTHS = (32, 64)

# A causal mixer that cannot train on these tasks, with the reason; the table lists it.
NOT_RUN = {}


def causal_variants():
  return tuple(v for v in registry.list_variants("mixer")
               if registry.get_variant(v).causal and v not in NOT_RUN)


def _overrides(seq_len: int):
  """Per-variant options at length `seq_len`: a local variant sees at most a
  quarter of the sequence (its defaults, windows and blocks of 64, would be
  the whole of it: dense attention under another name), an axial grid divides
  the length, and weights sized by the length (the Synthesizers, gmlp) are
  sized to it."""
  quarter = seq_len // 4
  options = {
      "synthesizer_dense": {"max_length": seq_len},
      "synthesizer_random": {"max_length": seq_len},
      "synthesizer_factorized": {"max_length": seq_len},
      "gmlp": {"max_length": seq_len},
      "axial": {"shape": [8, seq_len // 8]},
      "local": {"window_size": quarter},
      "band": {"window_size": quarter},
      "block_local": {"block_size": quarter},
      "global_tokens": {"window_size": quarter},
      "low_rank_locality": {"window_size": quarter},
      "multi_scale": {"windows": [seq_len // 8, quarter]},
      # Dilation 2: the window of T/8 positions reaches back T/4.
      "dilated": {"window_size": seq_len // 8},
      "longformer": {"window_size": seq_len // 8},
      "lsh": {"chunk_size": quarter},
      "sinkhorn": {"block_size": quarter},
      # 8 blocks: a window of 3, a global and 3 random ones still leave some out.
      "bigbird": {"block_size": seq_len // 8},
      # 8 blocks, each query choosing 3 (its own and two by gating).
      "moba": {"block_size": seq_len // 8},
      # Blocks of T/8 compressed every T/16 tokens, 8 selection blocks of
      # which 4 are chosen (the first, the query's own and the one before it
      # always, one by importance), and a window of T/4.
      "nsa": {"compress_block_size": seq_len // 8, "compress_stride": seq_len // 16,
              "select_block_size": seq_len // 8, "top_n": 4, "window": quarter},
  }
  overrides = {variant: {"model": {"attention_options": value}}
               for variant, value in options.items()}
  # Grouped-query attention: the 4 query heads share 2 key/value heads (its
  # layer's num_kv_heads, which unset makes it multi_head under another name).
  overrides["grouped_query"] = {"model": {"num_kv_heads": 2}}
  return overrides


def get_config():
  config = ml_collections.ConfigDict()
  config.name = "recall"
  config.kind = "grouped_accuracy"
  config.description = "Every causal token mixer on synthetic recall (CPU)"
  config.tasks = {
      "mqar_T32": "configs/recall/recall.py:mqar,T32",
      "mqar_T64": "configs/recall/recall.py:mqar,T64",
      "induction_T32": "configs/recall/recall.py:induction_heads,T32",
      "copying_T32": "configs/recall/recall.py:selective_copying,T32",
  }
  config.task_order = ("mqar_T32", "mqar_T64", "induction_T32", "copying_T32")
  config.variants = causal_variants()
  config.not_run = NOT_RUN
  config.seeds = (0, 1)
  config.presets = ()
  config.flags = ()
  config.paper = False
  config.sort_by_accuracy = True
  config.group_axis = "key-value pairs"
  config.notes = (
      "Zoology's anchor holds in the best seed: dense attention (dot_product and every "
      "variant computing the same attention: multi_head, flash, blockwise, "
      "graph, adaptive_span, bigbird and sinkhorn at these sizes) reaches 99.8-100% at every "
      "pair count and both lengths in seed 0 (sinkhorn 96.3% at 8 pairs), while no variant with a fixed-size state or "
      "window (linear, rfa, performer, local, band, block_local, multi_scale, longformer, "
      "dilated, strided, fixed, axial, lsh, routing, average, the Synthesizers) exceeds 56% "
      "at 2 pairs or 15% at 8 pairs (T=64) in any seed, and each falls as the pairs grow "
      "(about halving per doubling, with seed spreads of a few points)",
      "Dense attention is bimodal over seeds at this budget (one learning rate, 1,000 steps): "
      "in seed 1 it stays at 39% (T=32) and 20% (T=64) overall, and so does every variant "
      "above that finished (37-40%, 20-21%: the same function from the same initialisation); "
      "the mean +- std columns mix the two. Zoology reports the best of a learning-rate sweep",
      "Relative positions form the recall circuit in both seeds: transformer_xl and "
      "compressive (here without memory: one segment) and fixed_head_size reach 99.9-100% "
      "at every pair count in both seeds",
      "The section-A scoring functions (additive, luong_*, nadaraya_watson, structured_crf) "
      "attend over every position yet fall with the pairs like the fixed-state variants; on "
      "induction heads additive, luong_concat and structured_crf reach 100% while luong_dot, "
      "luong_general, luong_local and nadaraya_watson stay at 15-45%",
      "Induction heads (one key to recall) separate reach, not state: linear and performer "
      "reach 99-100% in both seeds, the windowed variants stay near chance (5-6%, 16 symbols: the trigger "
      "lies beyond the window)",
      "The attention of 2023-2026 (test accuracy at 2 / 4 / 8 pairs, T=64, seeds 0 and 1): "
      "stick_breaking keeps recall in both seeds (100/100/100 and 99/98/97; 100% at T=32) with "
      "no position encoding, where dense attention is bimodal (100/100/100 and 47/24/12); "
      "differential (100/100/100, 89/65/39) and forgetting (100/100/100, 92/80/59) reach "
      "100% in seed 0 and hold more than dense attention in seed 1. nsa falls slowly with the "
      "pairs (77/68/59, 52/50/48; 99% at T=32 in both seeds), between the kernelised rows "
      "(linear 56/26/13 and 49/25/12, performer 54/27/15 and 45/21/14, rfa 41/18/10 and "
      "43/20/10) and dense attention; moba reaches 89/70/65 in seed 0 and the kernelised "
      "level in seed 1 (49/23/12), and at T=32 (blocks of 4, 3 chosen: 12 of 32 keys) stays "
      "at 44-47% at 2 pairs. mla (54/28/14, 53/28/14) and sigmoid (56/26/15, 46/21/12) "
      "sit at the kernelised level here: at this budget neither formed the recall circuit "
      "in either seed",
      "Every cell finished. 6 had diverged (NaN gradient norm under a finite loss: performer "
      "in 4, bigbird and global_tokens in seed 1 of MQAR at T=64) from two numerical defects "
      "found by replaying their steps: feature attention kept one key constant over the "
      "sequence, so a performer key of large norm underflowed the early queries' normaliser, "
      "and sparse part merging took an empty part's maximum as 0, so with every logit far "
      "below 0 its normaliser underflowed; the quotient rule's 1/normaliser^2 then overflowed. "
      "Both are fixed (ddb97aa, 63aef54), and the rows of every variant whose computation "
      "they touch (performer, rfa, bigbird, global_tokens, longformer, adaptive_span, "
      "strided, fixed, random) were re-made after them",
      "nsa and mla were re-made at 2966b30 (stop 61, from a clean clone): NSA now always "
      "selects the first block and the two nearest (the paper's section 4.1; it had forced "
      "one), its three branches have their own keys and values (section 3.3.3), and top_n is "
      "4 here so that one block is still chosen by importance; MLA's head projections start "
      "at their fan-in's scale (they had started sqrt(H) too small). Their cells shared the "
      "two cores with two other training runs",
      "The chunkwise recurrent mixers (MQAR at T=64, 2/4/8 pairs, seeds 0 and 1): the delta "
      "rule closes most of the recall gap that Zoology finds for fixed-size states. rwkv7 "
      "holds recall in both seeds (100/100/99.9, 100/99.9/99.6) and delta_net nearly "
      "(100/99.8/97.9, 99.6/97.7/88.6); gated_delta_net reaches 100/99.8/97.7 in seed 0 and "
      "74/49/31 in seed 1, the bimodality dense attention shows at this budget. The "
      "recurrences that only decay their state fall with the pairs as the kernelised rows "
      "do, in both seeds: gla 71/45/22 and 71/47/28, retention 72/48/24 and 73/45/23, mamba2 "
      "60/55/45 and 56/30/15. Each keeps a matrix-valued state per head of the same size; "
      "what differs is the update: the delta rule overwrites the value stored under a key, "
      "where an additive update sums every value written under similar keys. All six reach "
      "100% on induction heads and 95-100% on selective copying in both seeds",
      "grouped_query (2 key/value heads for the 4 query heads; before stop 62 its "
      "num_kv_heads was unset and its row was multi_head's) forms the recall circuit in "
      "neither seed at this budget: 56/30/15 and 84/49/27 at 2/4/8 pairs (T=64), 62/32 "
      "and 56/29 (T=32); 100% on induction heads and 97-99% on selective copying. Its "
      "cells shared the two cores with other training runs",
      "lsh and routing are causal inside their groups only: the groups (LSH's sorted "
      "chunks, routing's top-k cluster members) are chosen over the whole sequence, as in "
      "their papers, so a later token can change which earlier keys a query sees (their "
      "docstrings; stop 62). Their rows sit with the fixed-state variants all the same",
  )
  config.cell_overrides = {"mqar_T32": _overrides(32), "mqar_T64": _overrides(64),
                           "induction_T32": _overrides(32), "copying_T32": _overrides(32)}
  return config
