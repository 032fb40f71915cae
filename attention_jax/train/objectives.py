"""What a model is trained to do: how it is called on a batch and what its
logits are scored against. Each model kind names its objective in the table
of kinds (`attention_jax.models.kinds`); kinds that share one (the
classifiers of one sequence, the two encoder-decoders) share it here too.

An objective's `model_call(module, batch, deterministic) -> logits` is passed to
flax as `method=`, so the same function initialises the model
(`model.init(rngs, batch, True, method=call)`) and applies it in the train and
eval steps. `targets(batch) -> (labels, weights)` gives integer labels of the
logits' leading shape and a float weight per label (0 for padding), so one
weighted cross-entropy scores a label per sequence and a label per token alike.

An objective may `prepare` the batch first, making what the model reads and
what it is scored on from the batch (the masked language model's corrupted
inputs); the train step, the eval step and initialisation call it before the
model and the targets see the batch.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, Optional, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from attention_jax.models.kinds import get_kind

# Token id 0 is padding in every task (see attention_jax.data).
PAD_ID = 0

Batch = Dict[str, jax.Array]
ModelCall = Callable[[nn.Module, Batch, bool], jax.Array]
Targets = Callable[[Batch], Tuple[jax.Array, jax.Array]]
# (model, variables, batch) -> {name: sum over the batch}, computed in evaluation.
EvalSums = Callable[[nn.Module, Any, Batch], Dict[str, jax.Array]]
# (batch, key or None, the model) -> the batch with what the model reads added.
Prepare = Callable[[Batch, Optional[jax.Array], nn.Module], Batch]


@dataclasses.dataclass(frozen=True)
class Objective:
  """How a model kind is called and scored.

  Attributes:
    name: its name, the `objective` of the model kinds it trains.
    model_call: `(module, batch, deterministic) -> logits [B, ..., C]`.
    targets: `batch -> (labels [B, ...] int, weights [B, ...] float)`.
    sequence_keys: the batch arrays that are token sequences (the model reads
      all of their tokens; the trainer counts them for tokens/s).
    eval_sums: what evaluation adds up besides the teacher-forced loss and
      accuracy: `{"<metric>_correct": ..., "<metric>_count": ...}` pairs,
      which `summarize_eval` reports as "<metric>_accuracy" (e.g. decoding).
    prepare: `(batch, key, model) -> batch`, what `model_call` and `targets`
      read made from the batch; `key` is the train step's
      "masking" key, None in evaluation and initialisation. None: the batch
      as it is.
  """

  name: str
  model_call: ModelCall
  targets: Targets
  sequence_keys: Tuple[str, ...] = ("inputs",)
  eval_sums: Optional[EvalSums] = None
  prepare: Optional[Prepare] = None

  def prepared(self, batch: Batch, key: Optional[jax.Array], model: nn.Module) -> Batch:
    """`prepare(batch, key, model)`, or the batch when there is none."""
    return batch if self.prepare is None else self.prepare(batch, key, model)


def _classify(module: nn.Module, batch: Batch, deterministic: bool) -> jax.Array:
  """`[B, T]` inputs -> `[B, C]` logits."""
  inputs = batch["inputs"]
  return module(inputs, padding_mask=inputs != PAD_ID, deterministic=deterministic)


def _classify_pair(module: nn.Module, batch: Batch, deterministic: bool) -> jax.Array:
  """`[B, T1]` inputs and `[B, T2]` inputs2 -> `[B, C]` logits."""
  inputs, inputs2 = batch["inputs"], batch["inputs2"]
  return module(inputs, inputs2, padding_mask=inputs != PAD_ID, padding_mask2=inputs2 != PAD_ID,
                deterministic=deterministic)


def _example_labels(batch: Batch) -> Tuple[jax.Array, jax.Array]:
  return batch["label"], batch["weight"]


def _next_token_logits(module: nn.Module, batch: Batch, deterministic: bool) -> jax.Array:
  """`[B, T]` inputs -> `[B, T - 1, V]` logits of tokens 1..T-1.

  The model sees all T tokens (a length the variants' block sizes divide) and
  the last position, which has nothing to predict, is dropped.
  """
  inputs = batch["inputs"]
  return module(inputs, padding_mask=inputs != PAD_ID, deterministic=deterministic)[:, :-1]


def _next_tokens(batch: Batch) -> Tuple[jax.Array, jax.Array]:
  """Labels: tokens 1..T-1; weighted by the example weight, 0 where the target is
  padding, and, when the task marks the tokens it scores (`target_mask [B, T]`,
  e.g. the answers of a recall task), 0 on the others."""
  labels = batch["inputs"][:, 1:]
  weights = (labels != PAD_ID).astype(jnp.float32) * batch["weight"][:, None]
  if "target_mask" in batch:
    weights = weights * batch["target_mask"][:, 1:].astype(jnp.float32)
  return labels, weights


def _masked_inputs(batch: Batch, key: Optional[jax.Array], model: nn.Module) -> Batch:
  """Adds "masked_inputs" `[B, T]`: each real token of `inputs` replaced with
  probability `model.config.mask_rate` by the [MASK] id (the vocabulary's
  last, `vocab_size - 1`), and "masked" `[B, T]` bool: the replaced positions.

  BERT's corruption without its 10% random and 10% kept tokens: those keep a
  model that is fine-tuned on unmasked text from trusting [MASK]; here the
  classifier only inherits the encoder. With `key` (training) the positions
  are drawn afresh each step; without (evaluation), each example's follow
  from its own tokens, so a split scores the same in any batching.
  """
  tokens = batch["inputs"]
  if key is None:
    weights = jnp.arange(1, tokens.shape[1] + 1, dtype=jnp.uint32) * jnp.uint32(2654435761)
    digests = jnp.sum(tokens.astype(jnp.uint32) * weights, axis=1)  # [B], wrapping
    uniform = jax.vmap(lambda digest: jax.random.uniform(
        jax.random.fold_in(jax.random.key(0), digest), tokens.shape[1:]))(digests)
  else:
    uniform = jax.random.uniform(key, tokens.shape)
  masked = (uniform < model.config.mask_rate) & (tokens != PAD_ID)
  return dict(batch, masked_inputs=jnp.where(masked, model.config.vocab_size - 1, tokens),
              masked=masked)


def _masked_token_logits(module: nn.Module, batch: Batch, deterministic: bool) -> jax.Array:
  """`[B, T]` masked inputs -> `[B, T, V]` logits of each position's token."""
  return module(batch["masked_inputs"], padding_mask=batch["inputs"] != PAD_ID,
                deterministic=deterministic)


def _masked_tokens(batch: Batch) -> Tuple[jax.Array, jax.Array]:
  """Labels: the original tokens; weighted by the example weight at the masked
  positions, 0 elsewhere."""
  return batch["inputs"], batch["masked"].astype(jnp.float32) * batch["weight"][:, None]


def _teacher_forced(module: nn.Module, batch: Batch, deterministic: bool) -> jax.Array:
  """`[B, Ts]` inputs and `[B, Tt]` targets -> `[B, Tt, V]` logits of each
  target token given the ones before it."""
  return module(batch["inputs"], batch["targets"], deterministic=deterministic)


def _target_tokens(batch: Batch) -> Tuple[jax.Array, jax.Array]:
  """Labels: the target tokens (EOS included); weight 0 on padding."""
  labels = batch["targets"]
  return labels, (labels != PAD_ID).astype(jnp.float32) * batch["weight"][:, None]


def _decoded(model: nn.Module, variables: Any, batch: Batch) -> Dict[str, jax.Array]:
  """Sums of decoding (greedy or beam search, `model.config.beam_size`) without
  the targets: "sequence" (every target token and EOS right) and "decoded_token"."""
  from attention_jax.models import decoding  # pylint: disable=import-outside-toplevel
  targets = batch["targets"]
  tokens = decoding.decode(model, variables, batch["inputs"], max_length=targets.shape[1],
                           beam_size=model.config.beam_size)
  scored = targets != PAD_ID  # what follows EOS is not scored
  right = (tokens == targets) | ~scored
  weight = batch["weight"]
  return dict(sequence_correct=jnp.sum(jnp.all(right, axis=1) * weight),
              sequence_count=jnp.sum(weight),
              decoded_token_correct=jnp.sum((right & scored) * weight[:, None]),
              decoded_token_count=jnp.sum(scored * weight[:, None]))


OBJECTIVES: Dict[str, Objective] = {objective.name: objective for objective in (
    Objective("classify", _classify, _example_labels),
    Objective("classify_pair", _classify_pair, _example_labels,
              sequence_keys=("inputs", "inputs2")),
    Objective("next_token", _next_token_logits, _next_tokens),
    Objective("masked_token", _masked_token_logits, _masked_tokens, prepare=_masked_inputs),
    Objective("teacher_forced", _teacher_forced, _target_tokens,
              sequence_keys=("inputs", "targets"), eval_sums=_decoded),
)}
CLASSIFY = OBJECTIVES["classify"]


def get_objective(kind: str) -> Objective:
  """The objective of model kind `kind`; an unknown kind raises ValueError."""
  return OBJECTIVES[get_kind(kind).objective]
