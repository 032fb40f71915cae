"""Attention in an RNN encoder-decoder: reversing strings of 20 to 30 symbols.

  python -m experiments.reproduce --table=configs/tables/seq2seq_smoke.py \
      --results=results/seq2seq_smoke/
  python -m experiments.attention_heatmap --workdir=results/seq2seq_smoke/runs/reverse/additive/method/seed0 \
      --out=results/seq2seq_smoke/heatmap.png

The scoring functions of section A (and scaled dot-product attention) as the
decoder's attention of `configs/seq2seq/reverse.py` at its smoke preset, and
the same encoder-decoder without attention ("no_attention": its 64-wide final
state is the only context), 2 seeds each. The measure is the share of test
strings decoded greedily right to the last symbol and EOS. About a minute a
cell on 2 CPU cores.
"""

from __future__ import annotations

import ml_collections

VARIANTS = ("no_attention", "additive", "luong_dot", "luong_general", "luong_concat",
            "luong_local", "nadaraya_watson", "dot_product")


def get_config():
  config = ml_collections.ConfigDict()
  config.name = "seq2seq_smoke"
  config.kind = "accuracy"
  config.description = "RNN encoder-decoder on string reversal (20-30 symbols), smoke preset (CPU)"
  config.tasks = {"reverse": "configs/seq2seq/reverse.py"}
  config.variants = VARIANTS
  config.seeds = (0, 1)
  config.presets = ("smoke",)
  config.flags = ()
  config.metric = "sequence_accuracy"
  config.paper = False
  config.baselines = {"no_attention": {
      "variant": "additive", "overrides": {"model": {"decoder_attention": False}}}}
  config.notes = (
      "sequence accuracy: greedy decoding, every symbol and the EOS right; validation and test "
      "splits of 500 strings each",)
  return config
