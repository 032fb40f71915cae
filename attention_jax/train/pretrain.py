"""Self-pretraining (Amos et al. 2024, "Never Train from Scratch"): a language-
modelling phase on the task's own inputs before the classification phase,
both in one workdir.

  config.pretrain.objective = "masked"   # or "causal"
  config.pretrain.num_train_steps = 2000
  config.pretrain.learning_rate = None   # None: the run's optimizer.learning_rate
  config.pretrain.mask_rate = 0.15       # "masked": the share of tokens masked

The pretraining phase is a run of its own in `<workdir>/pretrain/`
(`pretrain_config`): the classifier's encoder (the same token embedding and
blocks, its size, variant and options) under a token head, trained on the
task's inputs, the labels unused, no outside data. Objective "causal" runs it
as a language model (`model.kind="language_model"`: causal, each position
predicts the next token); "masked" as a masked language model
(`"masked_language_model"`: both ways, as the classifier runs it, each
masked position predicts its own token; the paper's objective for
bidirectional models), whose vocabulary has one id more, [MASK].

The classification run in `<workdir>` starts from it: when it initialises
(it has no checkpoint of its own yet), the `encoder` parameters of the
pretrained model's last checkpoint replace its own (`hand_over`; the token
embedding without the [MASK] row); its head starts fresh. Each phase resumes
like any run, from its own checkpoints: a run killed in the first phase
continues it, then hands over; one killed in the second finds the first
finished (its `results.json`) and resumes its own checkpoint, the handover
long done. Both phases are functions of the config and seed alone, so an
interrupted run ends with the parameters of an uninterrupted one.

The classifier's encoder and the language models share their parameters'
names and shapes (`params/encoder/...`), so the handover is a copy of one
subtree. The causal objective needs a variant with a causal form (refused
by the language model's own check otherwise); the masked one runs any
variant the classifier can.
"""

from __future__ import annotations

import pathlib
from typing import Any

import jax
import ml_collections

from attention_jax.models import kinds
from attention_jax.train.checkpoints import Checkpointer

PRETRAIN_DIR = "pretrain"
# pretrain.objective -> the model kind that the first phase trains.
PHASE_KINDS = {"causal": "language_model", "masked": "masked_language_model"}
OBJECTIVES = tuple(PHASE_KINDS)
# The model kind whose encoder the pretrained language model hands over to.
HANDS_OVER_TO = ("classifier",)


def enabled(config: ml_collections.ConfigDict) -> bool:
  return config.get("pretrain") is not None and config.pretrain.objective is not None


def check_pretrain(config: ml_collections.ConfigDict) -> None:
  """Refuses, naming the option, what the pretraining phase cannot run.

  Raises:
    ValueError: for an objective other than `OBJECTIVES`, a model kind whose
      encoder the language model cannot hand over to, a step count that
      is not positive, or a mask rate outside (0, 1).
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
  rate = options.mask_rate
  if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 < rate < 1:
    raise ValueError(f"pretrain.mask_rate must be in (0, 1) with pretrain.objective="
                     f"{options.objective!r}, got {rate!r}.")


def pretrain_config(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """The first phase's config: the task's inputs, the tokens predicted by the
  classifier's encoder (its size, variant and options; the next token, or the
  masked ones), for `pretrain.num_train_steps` at `pretrain.learning_rate`
  (else the run's), without the classification run's length evaluations or
  pretraining."""
  phase = ml_collections.ConfigDict(config.to_dict())
  options = config.pretrain
  phase.pretrain = ml_collections.ConfigDict(dict(
      objective=None, num_train_steps=0, learning_rate=None, warmup_steps=None,
      mask_rate=0.15))
  kind = kinds.get_kind(PHASE_KINDS[options.objective])
  phase.model.kind = kind.name
  phase.model.num_classes = None  # the vocabulary: the language model's classes
  if phase.model.vocab_size is not None:  # None: the task's, and the kind's ids
    phase.model.vocab_size += kind.added_tokens
  if kind.added_tokens:
    phase.model.mask_rate = options.mask_rate
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
    what = {"causal": "a language model", "masked": "a masked language model"}[
        config.pretrain.objective]
    raise ValueError(f"pretrain.objective={config.pretrain.objective!r} trains model.attention="
                     f"{config.model.attention!r} as {what} first: {error}") from error
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


def check_handover(encoder: Any, pretrained: Any) -> None:
  """Refuses a pretrained encoder whose parameters (`pretrained`: arrays or
  their abstract shapes) the classifier's `encoder` cannot take: another tree,
  or a parameter of another shape, except the token embedding's extra [MASK]
  row. Run on the abstract states before the first phase trains.

  Raises:
    ValueError: naming the parameter and both shapes.
  """
  mine = jax.tree_util.tree_structure(encoder)
  theirs = jax.tree_util.tree_structure(pretrained)
  if mine != theirs:
    raise ValueError("the pretrained encoder's parameters do not match the classifier's: "
                     f"{theirs} against {mine}.")
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(encoder),
                          jax.tree_util.tree_leaves(pretrained)):
    if a.shape != b.shape and not _mask_row_added(path, a, b):
      raise ValueError(f"the pretraining phase's encoder parameter "
                       f"{jax.tree_util.keystr(path)} has shape {b.shape}, the classifier's "
                       f"{a.shape}: a parameter sized by the sequence length differs where "
                       f"the classifier prepends a [CLS] token (model.pooling='cls').")


def _mask_row_added(path: Any, a: Any, b: Any) -> bool:
  """Whether `b` is the token embedding `a` with the [MASK] row (or rows) after it."""
  names = [getattr(key, "key", getattr(key, "name", None)) for key in path]
  return ("token_embedding" in names and b.shape[1:] == a.shape[1:]
          and b.shape[0] > a.shape[0])


def hand_over(state: Any, encoder: Any) -> Any:
  """`state` with its `encoder` parameters replaced by `encoder` (checked by
  `check_handover`), the rest (the head, the optimizer's moments of the fresh
  parameters) as initialised. A masked language model's token embedding has
  a row more than the classifier's, [MASK] (the last id), left behind."""
  check_handover(state.params["encoder"], encoder)
  encoder = jax.tree_util.tree_map_with_path(
      lambda path, a, b: b[:a.shape[0]] if _mask_row_added(path, a, b) else b,
      state.params["encoder"], encoder)
  params = dict(state.params, encoder=encoder)
  return state.replace(params=type(state.params)(params) if not isinstance(state.params, dict)
                       else params)
