"""A causal language model on a generated needle task (attention_jax.data.needle).

  python -m experiments.train --config=configs/needle/needle.py:dot_product,multi_key,T128 --workdir=...

The argument is `variant[,kind][,length]`: the kind one of "single" (the
default), "multi_key", "multi_value" or "variable_tracking" (RULER's
retrieval and multi-hop tracing tasks, Hsieh et al. 2024); the length one of
T64, T128 (default), T256, T512. The model and its training are the recall
table's (configs/recall/recall.py: 2 layers, width 64, 4 heads, learned
positions, 1,000 steps of batch 32), so the two tables compare the same
mixers on the same budget. Needles sit at depths 0, 0.25, 0.5, 0.75 and 1 of
the haystack, and evaluation reports test accuracy per depth
("depth<percent>_accuracy"): with one run per length, the needle table's
heatmap of length against depth.
"""

import pathlib

from attention_jax.data import needle
from attention_jax.train.config import load_config_helpers

recall = load_config_helpers(pathlib.Path(__file__).parents[1] / "recall" / "recall.py")

KINDS = needle.KINDS
LENGTHS = {"T64": 64, "T128": 128, "T256": 256, "T512": 512}
DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)


def get_config(arg: str = "dot_product"):
  variant, attention_preset, kind, seq_len = recall.task_and_length(
      arg, KINDS, LENGTHS, default_task="single", default_length=128, task_word="kind")
  config = recall.get_config(f"{variant},{attention_preset}")
  config.task = "needle"
  config.task_options = dict(train_size=20_000, validation_size=1_000, test_size=1_000,
                             kind=kind, seq_len=seq_len, depths=DEPTHS)
  return config
