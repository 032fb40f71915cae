"""Self-pretraining on ListOps (Amos et al. 2024, "Never Train from Scratch"),
smoke size: each model trained from scratch and after a causal language-
modelling phase on the task's own inputs.

  python -m experiments.reproduce --table=configs/tables/pretrain_smoke.py \
      --results=results/pretrain_smoke/

The model and budget are the LRA smoke table's (`configs/lra/listops.py`,
preset `smoke`: 600 steps of batch 32); a row "<variant>+spt" first trains
the same encoder as a language model over the task's inputs for 600 steps
(`config.pretrain`, `attention_jax/train/pretrain.py`; labels unused, no
outside data), then the classifier from its encoder for the same 600 steps.
The rows without pretraining run the LRA smoke table's commands, so its
finished cells can be copied in. dot_product and three efficient variants
with a causal form (the pretraining runs the variant causally): linear,
performer and local. The text task (IMDB through tensorflow-datasets) needs
a download this machine cannot make; its column is for a machine that can.
"""

import ml_collections

VARIANTS = ("dot_product", "linear", "performer", "local")
SPT = {"pretrain": {"objective": "causal", "num_train_steps": 600}}


def get_config():
  config = ml_collections.ConfigDict()
  config.name = "pretrain_smoke"
  config.kind = "accuracy"
  config.description = "ListOps from scratch and self-pretrained, smoke size (CPU)"
  config.tasks = {"listops": "configs/lra/listops.py"}
  config.variants = tuple(label for variant in VARIANTS for label in (variant, f"{variant}+spt"))
  config.baselines = {f"{variant}+spt": {"variant": variant, "overrides": SPT}
                      for variant in VARIANTS}
  config.seeds = (0, 1)
  config.presets = ("smoke",)
  config.flags = ()
  config.paper = False
  config.notes = ("The rows without pretraining are the LRA smoke table's runs, copied (the same "
                  "commands); the +spt rows are not yet run",)
  return config
