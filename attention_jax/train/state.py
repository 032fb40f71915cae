"""The train state and its creation directly into its shardings."""

from __future__ import annotations

import functools
from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import struct
from jax.sharding import Mesh

from attention_jax.train import partitioning
from attention_jax.train.objectives import CLASSIFY, Objective

# Variable collections that are not carried from step to step: the parameters
# have their own field, sown losses and intermediates are recomputed each call.
# Transformer-XL's "memory" is a stream's state between consecutive segments:
# carried only when the batches are streams (`memory_rows`); batches of
# independent examples train without one.
NOT_CARRIED = ("params", "losses", "intermediates", "memory")
MEMORY_COLLECTION = "memory"


@struct.dataclass
class TrainState:
  """Everything a training step reads and writes.

  Attributes:
    step: int32 scalar, the number of train steps (micro-batches) taken.
    params: the "params" collection.
    opt_state: the optimiser's state.
    collections: the other variable collections the model updates as it trains,
      e.g. {"kmeans": ...} of routing attention; {} for most models.
  """

  step: jax.Array
  params: Any
  opt_state: Any
  collections: Dict[str, Any]


def init_batch(example_batch: Mapping[str, Any], rows: int = 1) -> Dict[str, jax.Array]:
  """A batch of `rows` rows of the example's shapes and dtypes to initialise from.

  Token id 1 (not padding) everywhere: initialisation depends only on shapes.
  """
  return {name: jnp.ones((rows,) + tuple(value.shape[1:]), value.dtype)
          for name, value in example_batch.items()}


def _init_state(rng: jax.Array, *, model: nn.Module, optimizer: optax.GradientTransformation,
                batch: Dict[str, jax.Array], objective: Objective, boxed: bool,
                carry_memory: bool = False) -> TrainState:
  variables = model.init({"params": rng}, objective.prepared(batch, None, model), True,
                         method=objective.model_call)
  if not boxed:
    variables = nn.meta.unbox(variables)
  params = variables["params"]
  carried = lambda name: name not in NOT_CARRIED or (carry_memory and name == MEMORY_COLLECTION)
  # With `boxed`, the optimiser's parameter-shaped state (Adam's moments)
  # inherits the boxes and so the parameters' logical axes.
  return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                    opt_state=optimizer.init(params),
                    collections={name: value for name, value in variables.items()
                                 if carried(name)})


def _state_initializer(model: nn.Module, optimizer: optax.GradientTransformation,
                       example_batch: Mapping[str, Any], objective: Objective,
                       memory_rows: Optional[int]) -> Callable[..., TrainState]:
  """`_init_state` for a batch like `example_batch`: one row, or `memory_rows`
  rows when the state carries a "memory" collection (its arrays have a row
  per stream of the global batch)."""
  return functools.partial(_init_state, model=model, optimizer=optimizer,
                           batch=init_batch(example_batch, memory_rows or 1),
                           objective=objective, carry_memory=memory_rows is not None)


def abstract_state_and_shardings(
    model: nn.Module, optimizer: optax.GradientTransformation, example_batch: Mapping[str, Any],
    mesh: Mesh, rules: Sequence[Tuple[str, Any]] = partitioning.LOGICAL_AXIS_RULES, *,
    objective: Objective = CLASSIFY,
    memory_rows: Optional[int] = None) -> Tuple[TrainState, TrainState]:
  """The state's shapes and its shardings, computed without allocating it.

  `memory_rows`: as `create_sharded_state`'s.

  Returns:
    `(abstract_state, shardings)`: a `TrainState` of `jax.ShapeDtypeStruct`s and
    one of `NamedSharding`s (what a checkpoint restore needs as targets).
  """
  init = _state_initializer(model, optimizer, example_batch, objective, memory_rows)
  rng = jax.random.key(0)
  # Traced under the mesh as the steps are: ring attention needs its axis.
  eval_shape = partitioning.under_mesh(jax.eval_shape, mesh, rules)
  boxed = eval_shape(functools.partial(init, boxed=True), rng)
  abstract = eval_shape(functools.partial(init, boxed=False), rng)
  shardings = partitioning.logical_to_mesh_shardings(boxed, mesh, rules)
  if jax.tree.structure(shardings) != jax.tree.structure(abstract):
    raise ValueError("the optimizer's state does not follow the parameters' structure when "
                     "they carry partitioning boxes; its shardings cannot be derived.")
  return abstract, shardings


def create_sharded_state(
    model: nn.Module, optimizer: optax.GradientTransformation, example_batch: Mapping[str, Any],
    mesh: Mesh, rules: Sequence[Tuple[str, Any]] = partitioning.LOGICAL_AXIS_RULES,
    rng: jax.Array | None = None, *,
    objective: Objective = CLASSIFY,
    memory_rows: Optional[int] = None) -> Tuple[TrainState, TrainState]:
  """A freshly initialised train state, each array created on its own shards.

  Args:
    model: the flax module.
    optimizer: the optax transformation.
    example_batch: a batch of the data the model will see (arrays or
      `jax.ShapeDtypeStruct`s); only shapes and dtypes are used.
    mesh, rules: the device mesh and the logical-axis rules.
    rng: the parameter initialisation key; `jax.random.key(0)` by default.
    objective: how the model is called on a batch (its `model_call`).
    memory_rows: None, or the global batch size of a stream of consecutive
      segments: the state then carries the model's "memory" collection
      (Transformer-XL's), `memory_rows` rows of it, empty, and the train step
      updates it. Its arrays are replicated (small: M states per layer and row).

  Returns:
    `(state, shardings)`; `shardings` is the `TrainState` of `NamedSharding`s the
    steps are compiled with.
  """
  _, shardings = abstract_state_and_shardings(model, optimizer, example_batch, mesh, rules,
                                              objective=objective, memory_rows=memory_rows)
  init = functools.partial(_state_initializer(model, optimizer, example_batch, objective,
                                              memory_rows), boxed=False)
  rng = jax.random.key(0) if rng is None else rng
  # out_shardings makes every device compute only its own shards: the full
  # parameters never exist on one device.
  state = partitioning.under_mesh(jax.jit(init, out_shardings=shardings), mesh, rules)(rng)
  return state, shardings
