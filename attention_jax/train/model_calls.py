"""How a model is called on a batch: one function per kind of task.

A model call is `call(module, batch, deterministic) -> logits`. It is passed to
flax as `method=`, so the same function initialises the model
(`model.init(rngs, batch, True, method=call)`) and applies it in the train and
eval steps.
"""

from __future__ import annotations

from typing import Callable, Dict

import flax.linen as nn
import jax

# Token id 0 is padding in every task (see attention_jax.data).
PAD_ID = 0

ModelCall = Callable[[nn.Module, Dict[str, jax.Array], bool], jax.Array]


def classify(module: nn.Module, batch: Dict[str, jax.Array], deterministic: bool) -> jax.Array:
  """A single-tower classifier on `batch["inputs"]` `[B, T]` -> logits `[B, C]`."""
  inputs = batch["inputs"]
  return module(inputs, padding_mask=inputs != PAD_ID, deterministic=deterministic)
