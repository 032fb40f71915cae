"""Evaluation past the training length: the best checkpoint tested on longer
sequences of the same task (length generalisation).

  config.length_eval.lengths = (128, 256, 512)  # a model trained at T = 64
  config.length_eval.rope_scaling = "yarn"      # optional: RoPE stretched to each length

At the end of training the trainer evaluates the best checkpoint on the test
split of the task made at each length (`task_options.seq_len` set to it, the
other options unchanged: MQAR keeps its pair counts, so the keys and their
queries lie farther apart) and writes `test_by_length` to the results:
`{"<length>": metrics}`, the training length included (the ordinary test).

A model is evaluated at a longer length with the parameters it trained, so the
parameters must not depend on the length: learned positions (a table of
`max_length` rows) are refused, and so is any variant whose parameter shapes
change with `max_length` (found by comparing the two states' shapes). With
`rope_scaling` ("linear", "ntk" or "yarn", see `positional.Rotary`) a RoPE or
xPos model is evaluated at length L with the scaling factor L / T and the
training length T as its original length: the extension methods applied
without fine-tuning, as Peng et al. (2023) report them at s > 1.

Everything is checked and each length's data prepared before training starts,
so a bad length costs no training run.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, List, Optional

import jax
import ml_collections

from attention_jax import data as lra_data
from attention_jax import positional
from attention_jax.models import build_model
from attention_jax.train.task_data import prepare_splits


@dataclasses.dataclass(frozen=True)
class LengthEval:
  """What evaluating at one longer length needs.

  Attributes:
    length: the sequence length.
    splits: the task's splits made at that length.
    eval_step: the eval step of the model at that length (its RoPE scaled when
      asked), for the trained state's shardings.
  """

  length: int
  splits: Dict[str, lra_data.ExampleSource]
  eval_step: Callable[..., Any]


def check_length_eval(config: ml_collections.ConfigDict, train_length: int) -> None:
  """Raises ValueError on lengths or a scaling the trained model cannot be
  evaluated with (`config` completed; `train_length` the task's `seq_len`)."""
  options = config.length_eval
  lengths = tuple(options.lengths)
  if not options.lengths and options.rope_scaling is None:
    return
  if not lengths:
    raise ValueError(f"length_eval.rope_scaling={options.rope_scaling!r} scales RoPE to the "
                     f"evaluation lengths, but length_eval.lengths is empty; expected longer "
                     f"lengths than the training length {train_length}.")
  if "seq_len" not in lra_data.task_parameters(config.task):
    raise ValueError(f"length_eval.lengths makes task {config.task!r} at other lengths through "
                     f"its seq_len option, which it does not take.")
  bad = [length for length in lengths if not isinstance(length, int) or length <= train_length]
  if bad:
    raise ValueError(f"length_eval.lengths must be integers longer than the training length "
                     f"{train_length} (task_options.seq_len), got {lengths}.")
  if len(set(lengths)) != len(lengths):
    raise ValueError(f"length_eval.lengths lists a length twice: {lengths}.")
  position = config.model.position
  if position == "learned":
    raise ValueError(f"length_eval.lengths={lengths}: model.position='learned' has a table of "
                     f"{config.model.max_length} trained positions and none past it, so it "
                     f"cannot be evaluated at longer lengths; choose another model.position "
                     f"(sinusoidal, rope, alibi, t5, xpos, none) or no length_eval.lengths.")
  scaling = options.rope_scaling
  if scaling is not None:
    if scaling not in positional.ROPE_SCALINGS[1:]:
      raise ValueError(f"length_eval.rope_scaling must be None or one of "
                       f"{positional.ROPE_SCALINGS[1:]}, got {scaling!r}.")
    if position not in positional.ROTARY_POSITIONS:
      raise ValueError(f"length_eval.rope_scaling={scaling!r} stretches rotary positions, but "
                       f"model.position is {position!r}; expected one of "
                       f"{positional.ROTARY_POSITIONS}.")
    if dict(config.model.position_options).get("scaling") is not None:
      raise ValueError(f"length_eval.rope_scaling={scaling!r} sets the scaling at evaluation, "
                       f"but model.position_options.scaling is already "
                       f"{config.model.position_options.scaling!r} in training.")


def config_at_length(config: ml_collections.ConfigDict, length: int,
                     train_length: int) -> ml_collections.ConfigDict:
  """`config` with its task made at `length` and its model reading that length
  (RoPE scaled by length / train_length when `length_eval.rope_scaling`)."""
  config = ml_collections.ConfigDict(config.to_dict())
  config.task_options.seq_len = length
  config.model.max_length = length
  scaling = config.length_eval.rope_scaling
  if scaling is not None:
    config.model.position_options = dict(config.model.position_options, scaling=scaling,
                                         scaling_factor=length / train_length,
                                         original_length=train_length)
  return config


def prepare_length_evals(config: ml_collections.ConfigDict, run: Any, train_length: int,
                         abstract_state: Any, shardings: Any,
                         memory_rows: Optional[int]) -> List[LengthEval]:
  """One `LengthEval` per `config.length_eval.lengths`: its data prepared and
  its model's state checked to have the trained state's shapes.

  Raises:
    ValueError: when the model's parameters change shape with the length.
  """
  evals = []
  for length in config.length_eval.lengths:
    long_config = config_at_length(config, length, train_length)
    task, splits = prepare_splits(long_config)
    long_run = dataclasses.replace(run, config=long_config, model=build_model(long_config.model))
    # The first test batch as evaluation will read it (a stream too short for
    # its lanes at this length is an error now, not after training).
    host = dict(process_index=jax.process_index(), process_count=jax.process_count())
    example = next(lra_data.stream_batches(splits["test"], batch_size=config.batch_size, **host)
                   if task.info.stream else
                   lra_data.batches(splits["test"], batch_size=config.eval_batch_size, seed=0,
                                    shuffle=False, **host))
    long_state, _ = long_run.abstract_state(example, memory_rows=memory_rows)
    trained, longer = _param_shapes(abstract_state), _param_shapes(long_state)
    changed = sorted(name for name in trained.keys() | longer.keys()
                     if trained.get(name) != longer.get(name))
    if changed:
      raise ValueError(f"length_eval.lengths: model.attention={config.model.attention!r} with "
                       f"model.position={config.model.position!r} has parameters whose shapes "
                       f"depend on the sequence length ({', '.join(changed[:3])}), so the model "
                       f"trained at {train_length} cannot be evaluated at {length}.")
    evals.append(LengthEval(length=length, splits=splits,
                            eval_step=long_run.eval_step(shardings,
                                                         eval_groups=task.info.eval_groups)))
  return evals


def _param_shapes(state: Any) -> Dict[str, tuple]:
  """`{parameter path: shape}` of a (abstract) state's parameters."""
  return {jax.tree_util.keystr(path): leaf.shape
          for path, leaf in jax.tree_util.tree_leaves_with_path(state.params)}
