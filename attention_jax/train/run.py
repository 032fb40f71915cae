"""What a config trains, built in one place: `build_run(config)`.

  run = build_run(config)                          # mesh, rules, model, objective, optimiser
  state, shardings = run.init_state(example_batch)
  train_step = run.train_step(shardings)

The trainer builds its run here, and so do the scripts that compile or time
its train step without its loop (`experiments.benchmark_layers`,
`benchmark_reversible`, `benchmark_lra_speed`) and the sharded test runner
(`tests/train/sharded_run.py`): a benchmark then measures the step a training
run takes, with the same rules, RNG streams and objective, and a change to how
a run is built reaches all of them.

`build_run` reads a config whose model sizes are set (the trainer's is
completed first, `completion.complete_config`) and raises every error of the
mesh, the rules, the batch split, the model and the optimiser before anything
is traced. The state and the steps need a batch's shapes, so they are built
from the run once there is one (the trainer claims its workdir and prepares its
data in between).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Optional, Sequence, Tuple

import flax.linen as nn
import jax
from jax.sharding import Mesh
import ml_collections
import optax

from attention_jax.models import build_model
from attention_jax.train import partitioning
from attention_jax.train.objectives import Objective, get_objective
from attention_jax.train.optim import make_optimizer
from attention_jax.train.state import (TrainState, abstract_state_and_shardings,
                                       create_sharded_state)
from attention_jax.train.steps import make_eval_step, make_train_step

Batch = Mapping[str, Any]


@dataclasses.dataclass(frozen=True)
class Run:
  """A config's mesh, sharding rules, model, objective and optimiser, and
  the state and steps built from them.

  Attributes:
    config: the config it was built from (`seed` and `rng_streams` are read
      by the steps).
    mesh: the device mesh of `config.mesh_shape` (and `sequence_shards`).
    rules: the checked logical-axis rules, the sequence on its own axis when it
      is split.
    model: `build_model(config.model)`.
    objective: the objective of the model's kind.
    optimizer: `make_optimizer(config.optimizer)`.
  """

  config: ml_collections.ConfigDict
  mesh: Mesh
  rules: Tuple[Tuple[str, Any], ...]
  model: nn.Module
  objective: Objective
  optimizer: optax.GradientTransformation

  def abstract_state(self, example_batch: Batch, *, memory_rows: Optional[int] = None
                     ) -> Tuple[TrainState, TrainState]:
    """`(abstract_state, shardings)` for batches like `example_batch`, nothing
    allocated (see `state.abstract_state_and_shardings`)."""
    return abstract_state_and_shardings(self.model, self.optimizer, example_batch, self.mesh,
                                        self.rules, objective=self.objective,
                                        memory_rows=memory_rows)

  def init_state(self, example_batch: Batch, *, rng: Optional[jax.Array] = None,
                 memory_rows: Optional[int] = None) -> Tuple[TrainState, TrainState]:
    """`(state, shardings)`: the state initialised on its shards from `rng`
    (`jax.random.key(config.seed)` by default; see `state.create_sharded_state`)."""
    rng = jax.random.key(self.config.seed) if rng is None else rng
    return create_sharded_state(self.model, self.optimizer, example_batch, self.mesh,
                                self.rules, rng=rng, objective=self.objective,
                                memory_rows=memory_rows)

  def train_step(self, shardings: TrainState) -> Callable[..., Any]:
    """The jitted train step for a state of `shardings` (`steps.make_train_step`)."""
    return make_train_step(self.model, self.optimizer, self.mesh, shardings,
                           seed=self.config.seed, rules=self.rules,
                           rng_streams=tuple(self.config.rng_streams), objective=self.objective)

  def eval_step(self, shardings: TrainState, *, eval_groups: Sequence[str] = ()
                ) -> Callable[..., Any]:
    """The jitted eval step for a state of `shardings` (`steps.make_eval_step`)."""
    return make_eval_step(self.model, self.mesh, shardings, rules=self.rules,
                          objective=self.objective, eval_groups=eval_groups)

  def compile(self, step: Callable[..., Any], *args: Any) -> Any:
    """`step` (one of this run's) compiled for `args` (arrays or
    `jax.ShapeDtypeStruct`s) without running it, for XLA's memory analysis."""
    # The steps wrap their jitted function in the mesh context (functools.wraps
    # keeps it as __wrapped__): lower it there.
    return partitioning.under_mesh(lambda *a: step.__wrapped__.lower(*a).compile(), self.mesh,
                                   self.rules)(*args)


def build_run(config: ml_collections.ConfigDict, *,
              devices: Optional[Sequence[jax.Device]] = None) -> Run:
  """The run of `config` over all devices (or `devices`).

  Raises:
    ValueError: on a mesh shape that does not fit the devices, bad axis rules,
      a batch size that does not split over the data axes, or a bad model or
      optimiser config: before anything is traced.
  """
  mesh = partitioning.make_mesh(config.mesh_shape, devices=devices,
                                sequence_shards=config.sequence_shards)
  rules = partitioning.axis_rules(partitioning.sequence_parallel_rules(
      config.logical_axis_rules, config.sequence_shards))
  for batch_size in (config.batch_size, config.eval_batch_size):
    if batch_size is not None:  # eval_batch_size None: batch_size
      partitioning.check_batch_size(batch_size, mesh)
  return Run(config=config, mesh=mesh, rules=rules, model=build_model(config.model),
             objective=get_objective(config.model.kind),
             optimizer=make_optimizer(config.optimizer))
