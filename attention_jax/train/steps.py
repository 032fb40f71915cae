"""The train and eval steps, compiled for a mesh with explicit shardings.

Losses and metrics are over the global batch: every row counts with its
`weight` (0 for the padding rows of a final evaluation batch), whatever the
mesh, so a sharded run computes what a one-device run computes.

The steps are traced with the mesh current and the logical-axis rules set
(`partitioning.under_mesh`), so the models' `nn.with_logical_constraint` hints
place the activations; the parameters and the batch carry explicit shardings.
"""

from __future__ import annotations

import zlib
from typing import Any, Callable, Dict, Sequence, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from attention_jax.train import partitioning
from attention_jax.train.objectives import CLASSIFY, Objective
from attention_jax.train.state import MEMORY_COLLECTION, TrainState

Batch = Dict[str, jax.Array]
Metrics = Dict[str, jax.Array]


def step_rngs(seed: int, step: jax.Array, streams: Sequence[str]) -> Dict[str, jax.Array]:
  """One key per RNG stream for train step `step`: a pure function of
  (seed, step, stream name), so a restarted run draws the same dropout masks."""
  step_key = jax.random.fold_in(jax.random.key(seed), step)
  # crc32, unlike hash(), is the same in every process.
  return {name: jax.random.fold_in(step_key, zlib.crc32(name.encode()) & 0x7FFFFFFF)
          for name in streams}


def weighted_cross_entropy(logits: jax.Array, labels: jax.Array,
                           weights: jax.Array) -> Tuple[jax.Array, jax.Array, jax.Array]:
  """Sums of `weight * cross-entropy` and `weight * correct`, and the sum of the
  weights. logits: `[..., C]`; labels: `[...]` int; weights: `[...]`."""
  weights = weights.astype(jnp.float32)
  cross_entropy = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
  correct = (jnp.argmax(logits, axis=-1) == labels).astype(jnp.float32)
  return (weights * cross_entropy).sum(), (weights * correct).sum(), weights.sum()


def sown_losses(collections: Dict[str, Any]) -> jax.Array:
  """The sum of every value modules `sow`ed into the "losses" collection (0 if none)."""
  return sum((jnp.sum(value) for value in jax.tree.leaves(collections.get("losses", {}))),
             jnp.zeros((), jnp.float32))


def make_train_step(model: nn.Module, optimizer: optax.GradientTransformation, mesh: Mesh,
                    state_shardings: TrainState, *, seed: int = 0,
                    rules: Sequence[Tuple[str, Any]] = partitioning.LOGICAL_AXIS_RULES,
                    rng_streams: Sequence[str] = ("dropout",),
                    objective: Objective = CLASSIFY) -> Callable[[TrainState, Batch],
                                                                   Tuple[TrainState, Metrics]]:
  """`step(state, batch) -> (state, metrics)`, one optimiser update (or micro-step
  of an accumulating optimiser).

  The loss is the weighted mean cross-entropy of the global batch (over its
  examples, or its tokens for a language model) plus the sum of the losses
  modules sow into "losses". The input state is donated: do not
  use it after the call.

  Args:
    model, optimizer: as given to `create_sharded_state`.
    mesh: the device mesh.
    state_shardings: the shardings `create_sharded_state` returned.
    rules: the logical-axis rules of the models' activation constraints.
    seed: the RNG seed; each step's keys are `step_rngs(seed, state.step, ...)`.
    rng_streams: the RNG streams the model draws from while training: "dropout",
      and "attention" for variants that redraw random features.
    objective: how the model is called on a batch and scored.

  Returns:
    The step. `metrics` holds scalars: "loss" (the optimised objective),
    "cross_entropy", "aux_loss", "accuracy", "count" (sum of the weights) and
    "grad_norm" (global norm before clipping).
  """

  def train_step(state: TrainState, batch: Batch) -> Tuple[TrainState, Metrics]:
    rngs = step_rngs(seed, state.step, rng_streams)
    if objective.prepare is not None:
      batch = objective.prepare(batch, step_rngs(seed, state.step, ("masking",))["masking"],
                                model)

    def loss_fn(params):
      logits, updates = model.apply(
          {"params": params, **state.collections}, batch, False,
          method=objective.model_call, rngs=rngs, mutable=[*state.collections, "losses"])
      cross_entropy_sum, correct, count = weighted_cross_entropy(logits,
                                                                 *objective.targets(batch))
      cross_entropy = cross_entropy_sum / jnp.maximum(count, 1e-8)
      aux_loss = sown_losses(updates)
      return cross_entropy + aux_loss, (updates, cross_entropy, aux_loss, correct, count)

    grads, (updates, cross_entropy, aux_loss, correct, count) = jax.grad(
        loss_fn, has_aux=True)(state.params)
    param_updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    new_state = state.replace(
        step=state.step + 1, params=optax.apply_updates(state.params, param_updates),
        opt_state=opt_state, collections={name: updates[name] for name in state.collections})
    metrics = dict(loss=cross_entropy + aux_loss, cross_entropy=cross_entropy,
                   aux_loss=aux_loss, accuracy=correct / jnp.maximum(count, 1e-8),
                   count=count, grad_norm=optax.tree.norm(grads))
    return new_state, metrics

  replicated = NamedSharding(mesh, P())
  jitted = jax.jit(train_step,
                   in_shardings=(state_shardings, partitioning.batch_sharding(mesh)),
                   out_shardings=(state_shardings, replicated), donate_argnums=0)
  return partitioning.under_mesh(jitted, mesh, rules)


def make_eval_step(model: nn.Module, mesh: Mesh, state_shardings: TrainState, *,
                   rules: Sequence[Tuple[str, Any]] = partitioning.LOGICAL_AXIS_RULES,
                   objective: Objective = CLASSIFY,
                   eval_groups: Sequence[str] = ()) -> Callable[[TrainState, Batch], Metrics]:
  """`step(state, batch) -> sums` without dropout, for adding up over a split.

  The sums are "loss_sum" (weighted cross-entropy), "correct" and "count" (sum of
  the weights), the objective's `eval_sums`, and for each name of the task's
  `eval_groups` "<name>_correct" and "<name>_count" over the examples whose
  `group` is its index; `summarize_eval` turns their totals into means.

  When the state carries a "memory" collection (a stream, see
  `create_sharded_state`), the step returns `(sums, memory)`: the memory after
  this batch, for the next batch of the same streams.
  """
  carries_memory = MEMORY_COLLECTION in state_shardings.collections

  def eval_step(state: TrainState, batch: Batch) -> Metrics:
    variables = {"params": state.params, **state.collections}
    batch = objective.prepared(batch, None, model)
    if carries_memory:
      logits, updates = model.apply(variables, batch, True, method=objective.model_call,
                                    mutable=[MEMORY_COLLECTION])
    else:
      logits = model.apply(variables, batch, True, method=objective.model_call)
    labels, weights = objective.targets(batch)
    loss_sum, correct, count = weighted_cross_entropy(logits, labels, weights)
    sums = dict(loss_sum=loss_sum, correct=correct, count=count)
    for index, name in enumerate(eval_groups):
      in_group = (batch["group"] == index).reshape((-1,) + (1,) * (weights.ndim - 1))
      _, sums[f"{name}_correct"], sums[f"{name}_count"] = weighted_cross_entropy(
          logits, labels, weights * in_group)
    if objective.eval_sums is not None:
      sums.update(objective.eval_sums(model, variables, batch))
    return (sums, updates[MEMORY_COLLECTION]) if carries_memory else sums

  replicated = NamedSharding(mesh, P())
  jitted = jax.jit(eval_step,
                   in_shardings=(state_shardings, partitioning.batch_sharding(mesh)),
                   out_shardings=((replicated, state_shardings.collections[MEMORY_COLLECTION])
                                  if carries_memory else replicated))
  return partitioning.under_mesh(jitted, mesh, rules)


def summarize_eval(sums: Metrics) -> Dict[str, float]:
  """{"loss", "accuracy", "count"} from eval-step sums added over batches, and
  "<metric>_accuracy" for each "<metric>_correct" / "<metric>_count" pair."""
  count = float(sums["count"])
  summary = dict(loss=float(sums["loss_sum"]) / max(count, 1e-8),
                 accuracy=float(sums["correct"]) / max(count, 1e-8), count=count)
  for name in sums:
    if name.endswith("_correct") and name[:-len("correct")] + "count" in sums:
      metric = name[:-len("_correct")]
      summary[f"{metric}_accuracy"] = float(sums[name]) / max(
          float(sums[f"{metric}_count"]), 1e-8)
  return summary
