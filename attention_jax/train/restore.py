"""A finished (or stopped) run's model back from its workdir, for analysis.

  run = restore_run("results/seq2seq_smoke/runs/reverse/additive/method/seed0")
  logits = run.model.apply(run.variables, inputs, targets)

The config is the one the run saved (`config.json`), the parameters those of
its best checkpoint by validation accuracy (or the latest), restored on this
machine's devices whatever mesh the run trained on.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any, Dict

import flax.linen as nn
import jax
import ml_collections
import numpy as np

from attention_jax import data as lra_data
from attention_jax.models import build_model
from attention_jax.train import partitioning
from attention_jax.train.checkpoints import Checkpointer
from attention_jax.train.objectives import get_objective
from attention_jax.train.optim import make_optimizer
from attention_jax.train.state import abstract_state_and_shardings
from attention_jax.train.task_data import task_data_dir, task_options
from attention_jax.train.workdir import CONFIG_FILE


@dataclasses.dataclass(frozen=True)
class RestoredRun:
  """A run's config, model, variables (`{"params": ..., **collections}`), the
  step they are from, and its prepared data splits."""

  config: ml_collections.ConfigDict
  model: nn.Module
  variables: Dict[str, Any]
  step: int
  splits: Dict[str, lra_data.ExampleSource]


def restore_run(workdir: str | pathlib.Path, *, best: bool = True) -> RestoredRun:
  """The run in `workdir` at its best checkpoint (`best`) or its latest.

  Raises:
    FileNotFoundError: when `workdir` holds no config or no checkpoint (named).
  """
  workdir = pathlib.Path(workdir).absolute()
  config_path = workdir / CONFIG_FILE
  if not config_path.is_file():
    raise FileNotFoundError(f"expected a run's {CONFIG_FILE} in workdir {workdir}.")
  config = ml_collections.ConfigDict(json.loads(config_path.read_text()))
  model = build_model(config.model)
  objective = get_objective(config.model.kind)
  task = lra_data.get_task(config.task, **task_options(config))
  splits = task.splits(task_data_dir(config))
  example = splits["test"].gather(np.arange(1))
  example["weight"] = np.ones(1, np.float32)
  mesh = partitioning.make_mesh((len(jax.devices()), 1, 1))
  abstract, shardings = abstract_state_and_shardings(
      model, make_optimizer(config.optimizer), example, mesh,
      partitioning.axis_rules(config.logical_axis_rules), objective=objective)
  if not (workdir / "checkpoints").is_dir():
    raise FileNotFoundError(f"workdir {workdir} has no checkpoints/ folder to restore from.")
  # The trainer keeps its best checkpoint by validation accuracy.
  with Checkpointer(workdir / "checkpoints", best_metric="accuracy",
                    best_mode="max") as checkpointer:
    restored = (checkpointer.restore_best if best else checkpointer.restore)(abstract, shardings)
  if restored is None:
    raise FileNotFoundError(f"workdir {workdir} has no checkpoint to restore.")
  state, step = restored
  return RestoredRun(config=config, model=model,
                     variables={"params": state.params, **state.collections}, step=step,
                     splits=splits)
