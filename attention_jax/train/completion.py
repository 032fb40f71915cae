"""A config completed for its task, before anything is built from it.

  config = complete_config(config)

Checked (`check_config`), its attention preset applied, ring attention chosen
when the sequence is split, the task's vocabulary, classes and length filled
into the model where the config leaves them unset, and checked against the
task: the model kind fits the task's shape (`models.kinds.kinds_for_task`),
the sizes cover the task's.
"""

from __future__ import annotations

import ml_collections

from attention_jax import data as lra_data
from attention_jax import registry
from attention_jax.models import kinds
from attention_jax.train.config import apply_attention_preset, check_config
from attention_jax.train.lengths import check_length_eval
from attention_jax.train.pretrain import check_pretrain
from attention_jax.train.task_data import task_options


def complete_config(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """A checked copy of `config` with the task's sizes filled into the model.

  Raises:
    ValueError: on an unknown key, preset or name, a model kind the task
      cannot train, sizes smaller than the task's, or batch and step counts
      that do not fit together.
  """
  check_config(config)
  config = ml_collections.ConfigDict(config.to_dict())  # unlocked copy, references resolved
  apply_attention_preset(config)
  if config.sequence_shards > 1:
    _attend_over_the_ring(config)
  info = lra_data.get_task(config.task, **task_options(config)).info
  fitting = kinds.kinds_for_task(info)
  if config.model.kind not in fitting:
    raise ValueError(f"task {config.task!r} needs model.kind {' or '.join(map(repr, fitting))}, "
                     f"got {config.model.kind!r}.")
  kind = kinds.get_kind(config.model.kind)
  # The ids a kind adds (the masked language model's [MASK]) come after the task's.
  vocab_size = info.vocab_size + kind.added_tokens
  filled = dict(vocab_size=vocab_size, num_classes=info.num_classes, max_length=info.seq_len)
  for key, value in filled.items():
    if config.model[key] is None:
      config.model[key] = value
  if config.model.vocab_size < vocab_size:
    added = f" and the {kind.added_tokens} id(s) model.kind={kind.name!r} adds" * bool(
        kind.added_tokens)
    raise ValueError(f"model.vocab_size={config.model.vocab_size} is smaller than task "
                     f"{config.task!r}'s vocabulary of {info.vocab_size} tokens{added}.")
  # A model predicting the tokens of its input has the vocabulary for
  # classes, whatever labels the task has.
  if (kind.objective not in ("next_token", "masked_token")
      and config.model.num_classes != info.num_classes):
    raise ValueError(f"model.num_classes={config.model.num_classes} but task {config.task!r} "
                     f"has {info.num_classes} classes.")
  if config.model.max_length < info.seq_len:
    raise ValueError(f"model.max_length={config.model.max_length} is shorter than task "
                     f"{config.task!r}'s sequences of {info.seq_len} tokens.")
  check_length_eval(config, info.seq_len)
  check_pretrain(config)
  if config.eval_batch_size is None:
    config.eval_batch_size = config.batch_size
  if info.stream and config.eval_batch_size != config.batch_size:
    raise ValueError(f"task {config.task!r} is a stream of consecutive segments, evaluated in "
                     f"the training batch's {config.batch_size} streams (a model's memory has "
                     f"a row per stream); eval_batch_size must be {config.batch_size} or None, "
                     f"got {config.eval_batch_size}.")
  # num_train_steps counts batches; the optimiser's schedule counts updates,
  # one per `grad_accum_steps` batches.
  accum = int(config.optimizer.grad_accum_steps)
  if config.num_train_steps % accum:
    raise ValueError(f"num_train_steps={config.num_train_steps} must be a multiple of "
                     f"optimizer.grad_accum_steps={accum}.")
  config.optimizer.num_train_steps = config.num_train_steps // accum
  return config


def _attend_over_the_ring(config: ml_collections.ConfigDict) -> None:
  """Sets the attention of a sequence-split run to ring attention."""
  options = config.model.attention_options
  # The sparse variants' `implementation` picks the kernel of their pattern, not a ring.
  if "implementation" not in options or registry.get_variant(config.model.attention).family \
      == "sparse":
    raise ValueError(
        f"sequence_shards={config.sequence_shards} splits the sequence over devices, which "
        f"only exact attention with an `implementation` option (ring attention) takes here; "
        f"model.attention={config.model.attention!r} has none (e.g. dot_product has).")
  if options.implementation not in (None, "ring"):
    raise ValueError(
        f"sequence_shards={config.sequence_shards} runs the attention as implementation='ring', "
        f"but model.attention_options.implementation={options.implementation!r}.")
  options.implementation = "ring"
