"""The numbers the Long Range Arena paper reports, keyed by our registry names.

Tay et al. 2020, "Long Range Arena: A Benchmark for Efficient Transformers",
arXiv 2011.04006 (ICLR 2021). Sources, as looked up for this module:

* Table 1 (test accuracy, %): the paper's Table 1, identical to the leaderboard
  in the README of github.com/google-research/long-range-arena ("Current
  leaderboard results ... as of 8th November 2020"). Path-X is "FAIL" for every
  model (at best chance); it has no number here.
* Table 2 (train steps per second and peak memory per TPU v3 device, GB, of
  the byte-level text model at batch 32 on 4x4 TPU v3 chips): the paper's
  Table 2, read from a transcription of the ICLR version (repository
  viktor-shcherb/msc_thesis, references/2021-05-long-range-arena/). Sparse
  Transformer and Longformer are not in it (the paper excludes them from the
  efficiency benchmark). The paper prints Synthesizer's 3K cell as
  "6.6 (2.9x)", the same as Sinkhorn's and out of line with its 2K (5.7) and 4K
  (1.9) cells; it is kept as printed.

The paper's models map to our variants as follows: Transformer = dot_product,
Local Attention = local, Sparse Trans. = fixed (Child et al.'s "fixed"
pattern), Longformer = longformer, Linformer = linformer, Reformer = lsh,
Sinkhorn Trans. = sinkhorn, Synthesizer = synthesizer_dense, BigBird = bigbird,
Linear Trans. = linear, Performer = performer.
"""

from __future__ import annotations

from typing import Dict, Optional

PAPER = "Tay et al. 2020, Long Range Arena (arXiv 2011.04006)"

# Our variant name -> the paper's row label.
PAPER_NAMES: Dict[str, str] = {
    "dot_product": "Transformer", "local": "Local Attention", "fixed": "Sparse Trans.",
    "longformer": "Longformer", "linformer": "Linformer", "lsh": "Reformer",
    "sinkhorn": "Sinkhorn Trans.", "synthesizer_dense": "Synthesizer", "bigbird": "BigBird",
    "linear": "Linear Trans.", "performer": "Performer",
}

TASKS = ("listops", "text", "retrieval", "image", "pathfinder32")

# Table 1: test accuracy (%), columns in the order of TASKS.
_TABLE1 = {
    "dot_product": (36.37, 64.27, 57.46, 42.44, 71.40),
    "local": (15.82, 52.98, 53.39, 41.46, 66.63),
    "fixed": (17.07, 63.58, 59.59, 44.24, 71.71),
    "longformer": (35.63, 62.85, 56.89, 42.22, 69.71),
    "linformer": (35.70, 53.94, 52.27, 38.56, 76.34),
    "lsh": (37.27, 56.10, 53.40, 38.07, 68.50),
    "sinkhorn": (33.67, 61.20, 53.83, 41.23, 67.45),
    "synthesizer_dense": (36.99, 61.68, 54.67, 41.61, 69.45),
    "bigbird": (36.05, 64.02, 59.29, 40.83, 74.87),
    "linear": (16.13, 65.90, 53.09, 42.34, 75.30),
    "performer": (18.01, 65.40, 53.82, 42.77, 77.05),
}
ACCURACY: Dict[str, Dict[str, float]] = {
    variant: dict(zip(TASKS, row)) for variant, row in _TABLE1.items()}

LENGTHS = (1024, 2048, 3072, 4096)
# Table 2: steps per second and peak memory (GB per device) at 1K, 2K, 3K, 4K.
_STEPS = {
    "dot_product": (8.1, 4.9, 2.3, 1.4),
    "local": (9.2, 8.4, 7.4, 7.4),
    "linformer": (9.3, 9.1, 8.5, 7.7),
    "lsh": (4.4, 2.2, 1.5, 1.1),
    "sinkhorn": (9.1, 7.9, 6.6, 5.3),
    "synthesizer_dense": (8.7, 5.7, 6.6, 1.9),
    "bigbird": (7.4, 3.9, 2.7, 1.5),
    "linear": (9.1, 9.3, 8.6, 7.8),
    "performer": (9.5, 9.4, 8.7, 8.0),
}
_MEMORY_GB = {
    "dot_product": (0.85, 2.65, 5.51, 9.48),
    "local": (0.42, 0.76, 1.06, 1.37),
    "linformer": (0.37, 0.55, 0.99, 0.99),
    "lsh": (0.48, 0.99, 1.53, 2.28),
    "sinkhorn": (0.47, 0.83, 1.13, 1.48),
    "synthesizer_dense": (0.65, 1.98, 4.09, 6.99),
    "bigbird": (0.77, 1.49, 2.18, 2.88),
    "linear": (0.37, 0.57, 0.80, 1.03),
    "performer": (0.37, 0.59, 0.82, 1.06),
}
STEPS_PER_S: Dict[str, Dict[int, float]] = {
    variant: dict(zip(LENGTHS, row)) for variant, row in _STEPS.items()}
MEMORY_GB: Dict[str, Dict[int, float]] = {
    variant: dict(zip(LENGTHS, row)) for variant, row in _MEMORY_GB.items()}


def accuracy(variant: str, task: str) -> Optional[float]:
  """Table 1's test accuracy (%) of `variant` on `task`, or None where the paper
  has no number (Path-X, a variant it did not run, a task it does not have)."""
  return ACCURACY.get(variant, {}).get(task)


def speed_ratio(variant: str, length: int) -> Optional[float]:
  """Table 2: `variant`'s steps/s over the Transformer's at `length`, or None."""
  steps, base = STEPS_PER_S.get(variant, {}).get(length), STEPS_PER_S["dot_product"].get(length)
  return None if steps is None or base is None else steps / base


def memory_ratio(variant: str, length: int) -> Optional[float]:
  """Table 2: `variant`'s peak memory over the Transformer's at `length`, or None."""
  memory, base = MEMORY_GB.get(variant, {}).get(length), MEMORY_GB["dot_product"].get(length)
  return None if memory is None or base is None else memory / base
