"""The LRA accuracy table (Tay et al. 2020, Table 1) at the paper's settings.

  python -m experiments.reproduce --table=configs/tables/lra.py --results=results/lra/

Every task of `configs/lra/` (no preset: the LRA release's model, batch and
steps) x the paper's eleven models x three seeds. The paper's models map to
registry names as in `experiments/lra_paper.py` (Sparse Trans. = `fixed`, Child
et al.'s fixed pattern; Synthesizer = `synthesizer_dense`; Reformer = `lsh`).

Both attention presets: `method` (the paper's method) and `lra_release` (what
the LRA release's code ran; docs/lra_release.md). Every row pools as its task
does ([CLS] on ListOps, Text, Retrieval and Image: sequences of T + 1 =
2001, 4001, 4001, 1025 tokens, which LSH and Sinkhorn pad to their block
multiple themselves). Cell override: `synthesizer_dense` (and the release's
Random Synthesizer) synthesises logits for `max_length` positions, set to the
task's T + 1.
"""

from __future__ import annotations

import ml_collections

VARIANTS = ("dot_product", "local", "fixed", "longformer", "linformer", "lsh", "sinkhorn",
            "synthesizer_dense", "bigbird", "linear", "performer")
# task -> (config file, sequence length T)
TASKS = {
    "listops": ("configs/lra/listops.py", 2000),
    "text": ("configs/lra/text.py", 4000),
    "retrieval": ("configs/lra/retrieval.py", 4000),
    "image": ("configs/lra/image.py", 1024),
    "pathfinder32": ("configs/lra/pathfinder32.py", 1024),
    "pathx": ("configs/lra/pathx.py", 16384),
}


def variant_overrides(length: int) -> dict:
  """The per-variant config overrides a task of length T needs."""
  return {"synthesizer_dense": {"model": {"attention_options": {"max_length": length + 1}}}}


def get_config():
  config = ml_collections.ConfigDict()
  config.name = "lra"
  config.kind = "accuracy"
  config.description = "LRA accuracy table at the paper's settings"
  config.tasks = {task: path for task, (path, _) in TASKS.items()}
  config.variants = VARIANTS
  config.seeds = (0, 1, 2)
  config.presets = ()
  config.attention_presets = ("method", "lra_release")
  config.flags = ()  # --config.a.b=value flags for every cell
  config.cell_overrides = {task: variant_overrides(length)
                           for task, (_, length) in TASKS.items()}
  return config
