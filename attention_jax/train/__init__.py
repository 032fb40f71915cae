"""Sharded training: the mesh and partitioning rules, the optimiser, the state,
the compiled train/eval steps, a config's run built from them (`build_run`),
checkpoints, metrics and the training loop
(`attention_jax.train.trainer.train_and_evaluate`)."""

from attention_jax.train.objectives import OBJECTIVES, Objective, get_objective
from attention_jax.train.optim import (SCHEDULES, default_optimizer_config, make_optimizer,
                                       make_schedule)
from attention_jax.train.partitioning import (DATA_AXES, LOGICAL_AXIS_RULES, MESH_AXES,
                                              batch_sharding, check_batch_size,
                                              logical_to_mesh_shardings, make_mesh,
                                              shard_batch)
from attention_jax.train.run import Run, build_run
from attention_jax.train.state import TrainState, create_sharded_state
from attention_jax.train.steps import make_eval_step, make_train_step, summarize_eval

__all__ = [
    "DATA_AXES", "LOGICAL_AXIS_RULES", "MESH_AXES", "OBJECTIVES", "Objective", "Run", "SCHEDULES",
    "TrainState", "batch_sharding", "build_run", "check_batch_size", "create_sharded_state",
    "default_optimizer_config", "get_objective", "logical_to_mesh_shardings", "make_eval_step",
    "make_mesh", "make_optimizer", "make_schedule", "make_train_step", "shard_batch",
    "summarize_eval",
]
