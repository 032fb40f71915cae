"""Position schemes and mixers tested past their training length: the length
table.

  python -m experiments.reproduce --table=configs/tables/length.py --results=results/length/

Small causal models (`configs/length/length.py`) trained at T (the character
LM at 64, MQAR at 32) and tested at T, 2T, 4T and 8T: dense attention with
each position scheme (sinusoidal; learned, tested at T only, since it has no
positions past its table; RoPE plain and with NTK-aware or YaRN scaling
applied at evaluation; ALiBi; T5 bias; xPos; NoPE), then a sliding window
(local, a quarter of T, with RoPE), FoX (forgetting attention, no positions)
and a recurrent mixer (GLA, no positions). One figure per task,
`length_<task>.png`: the metric against the evaluation length.

The anchor is ALiBi's (Press et al. 2022, figure 1): sinusoidal positions
fail just past the training length, RoPE and T5 degrade more slowly, and
ALiBi's perplexity stays flat to many times it; the notes say whether this
reproduces at these sizes. One seed per cell.
"""

from __future__ import annotations

import pathlib

import ml_collections

from attention_jax.train.config import load_config_helpers

length_config = load_config_helpers(pathlib.Path(__file__).parents[1] / "length" / "length.py")

# (variant, position scheme, attention options) per row.
ROWS = (*(("dot_product", position, {}) for position in length_config.POSITIONS),
        ("local", "rope", "window"), ("forgetting", "nope", {}), ("gla", "nope", {}))


def row_label(variant: str, position: str) -> str:
  return f"{variant}+{position}"


def _overrides(task: str, variant: str, position: str, options):
  train_length = length_config.TRAIN_LENGTHS[task]
  overrides = length_config.position_overrides(position, train_length)
  if options == "window":  # a quarter of the training length
    overrides["model"]["attention_options"] = {"window_size": train_length // 4}
  return overrides


def get_config():
  config = ml_collections.ConfigDict()
  config.name = "length"
  config.kind = "length"
  config.description = "Length generalisation: trained at T, tested to 8T (CPU)"
  config.tasks = {task: f"configs/length/length.py:{task}" for task in length_config.TASKS}
  config.task_order = length_config.TASKS
  config.variants = tuple(row_label(variant, position) for variant, position, _ in ROWS)
  config.baselines = {row_label(variant, position): {"variant": variant}
                      for variant, position, _ in ROWS}
  config.cell_overrides = {
      task: {row_label(variant, position): _overrides(task, variant, position, options)
             for variant, position, options in ROWS}
      for task in length_config.TASKS}
  config.metrics = {"chars": "bits_per_token", "mqar": "accuracy"}
  config.seeds = (0,)
  config.presets = ()
  config.flags = ()
  config.paper = False
  config.notes = ("Not yet run: the cells are made by the command above from a clean tree",)
  return config
