"""The LRA accuracy table (Tay et al. 2020, Table 1) at the paper's settings.

  python -m experiments.reproduce --table=configs/tables/lra.py --results=results/lra/

Every task of `configs/lra/` (no preset: the LRA release's model, batch and
steps) x the paper's eleven models x three seeds. The paper's models map to
registry names as in `experiments/lra_paper.py` (Sparse Trans. = `fixed`, Child
et al.'s fixed pattern; Synthesizer = `synthesizer_dense`; Reformer = `lsh`).

Cell overrides. The [CLS] pooling of ListOps, Text, Retrieval and Image
prepends a token, so those sequences are T + 1 long (2001, 4001, 4001, 1025):
no block size divides them, which LSH (`chunk_size`) and Sinkhorn
(`block_size`) need. Those two variants therefore pool by the mean on those
tasks, with blocks of 50 (2000, 4000) or 64 (1024). `synthesizer_dense`
synthesises logits for `max_length` positions, set to the task's T + 1.
"""

from __future__ import annotations

import ml_collections

VARIANTS = ("dot_product", "local", "fixed", "longformer", "linformer", "lsh", "sinkhorn",
            "synthesizer_dense", "bigbird", "linear", "performer")
# task -> (config file, sequence length T, pooling of the task config)
TASKS = {
    "listops": ("configs/lra/listops.py", 2000, "cls"),
    "text": ("configs/lra/text.py", 4000, "cls"),
    "retrieval": ("configs/lra/retrieval.py", 4000, "cls"),
    "image": ("configs/lra/image.py", 1024, "cls"),
    "pathfinder32": ("configs/lra/pathfinder32.py", 1024, "mean"),
    "pathx": ("configs/lra/pathx.py", 16384, "mean"),
}


def variant_overrides(length: int, pooling: str) -> dict:
  """The per-variant config overrides a task of length T and pooling needs."""
  block = 64 if length % 64 == 0 else 50
  mean = {"pooling": "mean"} if pooling == "cls" else {}
  return {
      "lsh": {"model": dict(mean, attention_options={"chunk_size": block})},
      "sinkhorn": {"model": dict(mean, attention_options={"block_size": block})},
      "synthesizer_dense": {"model": {"attention_options": {"max_length": length + 1}}},
  }


def get_config():
  config = ml_collections.ConfigDict()
  config.name = "lra"
  config.kind = "accuracy"
  config.description = "LRA accuracy table at the paper's settings"
  config.tasks = {task: path for task, (path, _, _) in TASKS.items()}
  config.variants = VARIANTS
  config.seeds = (0, 1, 2)
  config.presets = ()
  config.flags = ()  # --config.a.b=value flags for every cell
  config.cell_overrides = {task: variant_overrides(length, pooling)
                           for task, (_, length, pooling) in TASKS.items()}
  return config
