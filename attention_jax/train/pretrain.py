"""Self-pretraining (Amos et al. 2024, "Never Train from Scratch"): a language-
modelling phase on the task's own inputs before the classification phase,
both in one workdir.

  config.pretrain.objective = "causal"
  config.pretrain.num_train_steps = 2000
  config.pretrain.learning_rate = None   # None: the run's optimizer.learning_rate

The pretraining phase is a run of its own in `<workdir>/pretrain/`
(`pretrain_config`): the classifier's encoder as a language model
(`model.kind="language_model"`: the same token embedding and blocks, causal,
under a next-token head) trained on the task's inputs, the labels unused, no
outside data. The classification run in `<workdir>` starts from it: when it
initialises (it has no checkpoint of its own yet), the `encoder` parameters
of the pretrained model's last checkpoint replace its own (`hand_over`); its
head starts fresh. Each phase resumes like any run, from its own
checkpoints: a run killed in the first phase continues it, then hands over;
one killed in the second finds the first finished (its `results.json`) and
resumes its own checkpoint, the handover long done. Both phases are
functions of the config and seed alone, so an interrupted run ends with the
parameters of an uninterrupted one.

Decision: causal language modelling, not masked. The classifier's encoder
and the language model share their parameters' names and shapes
(`params/encoder/...`), so the handover is a copy of one subtree; the
pretraining runs the variant causally, which the causal variants can, and a
variant that cannot attend causally is refused by the language model's own
check. The paper pretrains bidirectional models with masked language
modelling; that objective is not here yet.
"""

from __future__ import annotations

import pathlib
from typing import Any

import jax
import ml_collections

from attention_jax.models import kinds
from attention_jax.train.checkpoints import Checkpointer

PRETRAIN_DIR = "pretrain"
OBJECTIVES = ("causal",)
# The model kind whose encoder the pretrained language model hands over to.
HANDS_OVER_TO = ("classifier",)


def enabled(config: ml_collections.ConfigDict) -> bool:
  return config.get("pretrain") is not None and config.pretrain.objective is not None


def check_pretrain(config: ml_collections.ConfigDict) -> None:
  """Refuses, naming the option, what the pretraining phase cannot run.

  Raises:
    ValueError: for an objective other than `OBJECTIVES`, a model kind whose
      encoder the language model cannot hand over to, or a step count that
      is not positive.
  """
  if not enabled(config):
    return
  options = config.pretrain
  if options.objective not in OBJECTIVES:
    raise ValueError(f"pretrain.objective must be None or one of {OBJECTIVES}, got "
                     f"{options.objective!r}.")
  if config.model.kind not in HANDS_OVER_TO:
    raise ValueError(
        f"pretrain.objective={options.objective!r} hands a language model's encoder to the "
        f"classifier's; model.kind={config.model.kind!r} has no such encoder (pretraining "
        f"runs for model.kind in {HANDS_OVER_TO}).")
  if (isinstance(options.num_train_steps, bool) or not isinstance(options.num_train_steps, int)
      or options.num_train_steps < 1):
    raise ValueError(f"pretrain.num_train_steps must be a positive int with "
                     f"pretrain.objective={options.objective!r}, got "
                     f"{options.num_train_steps!r}.")


def pretrain_config(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """The first phase's config: the task's inputs, next-token prediction by the
  classifier's encoder (its size, variant and options), for
  `pretrain.num_train_steps` at `pretrain.learning_rate` (else the run's),
  without the classification run's length evaluations or pretraining."""
  phase = ml_collections.ConfigDict(config.to_dict())
  options = config.pretrain
  phase.pretrain = ml_collections.ConfigDict(dict(
      objective=None, num_train_steps=0, learning_rate=None, warmup_steps=None))
  phase.model.kind = kinds.get_kind("language_model").name
  phase.model.num_classes = None  # the vocabulary: the language model's classes
  phase.num_train_steps = options.num_train_steps
  if options.learning_rate is not None:
    phase.optimizer.learning_rate = options.learning_rate
  if options.warmup_steps is not None:
    phase.optimizer.warmup_steps = options.warmup_steps
  phase.optimizer.warmup_steps = min(phase.optimizer.warmup_steps, options.num_train_steps - 1)
  phase.length_eval.lengths = ()
  phase.length_eval.rope_scaling = None
  phase.eval_every = min(phase.eval_every, options.num_train_steps)
  phase.checkpoint_every = min(phase.checkpoint_every, options.num_train_steps)
  return phase


def checked_phase(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """`pretrain_config(config)`, completed and its run built, so that what the
  first phase cannot run (a variant with no causal form) is refused before
  anything is written, naming the option.

  Raises:
    ValueError: naming `pretrain.objective` and the reason.
  """
  # pylint: disable=import-outside-toplevel
  from attention_jax.train.completion import complete_config
  from attention_jax.train.run import build_run
  # pylint: enable=import-outside-toplevel
  try:
    phase = complete_config(pretrain_config(config))
    build_run(phase)
  except ValueError as error:
    raise ValueError(f"pretrain.objective={config.pretrain.objective!r} trains model.attention="
                     f"{config.model.attention!r} as a language model first: {error}") from error
  return phase


def pretrained_encoder(workdir: pathlib.Path, abstract_state: Any, shardings: Any) -> Any:
  """The `encoder` parameters of the first phase's last checkpoint, restored
  into the language model's abstract state (`abstract_state`, `shardings`).

  Raises:
    FileNotFoundError: when the first phase left no checkpoint.
  """
  checkpoints = Checkpointer(workdir / PRETRAIN_DIR / "checkpoints", keep=1,
                             best_metric="accuracy", best_mode="max", async_save=False)
  try:
    restored = checkpoints.restore(abstract_state, shardings)
  finally:
    checkpoints.close()
  if restored is None:
    raise FileNotFoundError(f"the pretraining phase left no checkpoint in "
                            f"{workdir / PRETRAIN_DIR / 'checkpoints'}.")
  state, _ = restored
  return state.params["encoder"]


def hand_over(state: Any, encoder: Any) -> Any:
  """`state` with its `encoder` parameters replaced by `encoder` (same tree
  and shapes: checked), the rest (the head, the optimizer's moments of the
  fresh parameters) as initialised."""
  mine = jax.tree_util.tree_structure(state.params["encoder"])
  theirs = jax.tree_util.tree_structure(encoder)
  if mine != theirs:
    raise ValueError("the pretrained encoder's parameters do not match the classifier's: "
                     f"{theirs} against {mine}.")
  for a, b in zip(jax.tree_util.tree_leaves(state.params["encoder"]),
                  jax.tree_util.tree_leaves(encoder)):
    if a.shape != b.shape:
      raise ValueError(f"a pretrained encoder parameter has shape {b.shape}, the "
                       f"classifier's {a.shape}.")
  params = dict(state.params, encoder=encoder)
  return state.replace(params=type(state.params)(params) if not isinstance(state.params, dict)
                       else params)
