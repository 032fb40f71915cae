"""The layer stack: `num_layers` blocks, unrolled or scanned, with a carry.

Unrolled, block i is the submodule `block_{i}` (the first wave's parameter
tree). With `config.scan_layers` the schedule's period (one block, or e.g.
local, local, local, dot_product) is one `nn.scan` body over
`num_layers / period` steps, its parameters stacked along a leading "layers"
axis under `blocks`: one block is compiled instead of `num_layers`. With a
`config.remat_policy` each block is rematerialised in the backward pass,
keeping what the named `jax.checkpoint_policies` policy saves. Both modes give
the same outputs and gradients for the same weights (`tests/models`).
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from attention_jax import axes, registry
from attention_jax.models.blocks import Block
from attention_jax.models.config import REMAT_POLICIES, ModelConfig
from attention_jax.variants.common import RANDOM_COLLECTION

Array = jnp.ndarray
Carry = Dict[str, Any]
# The carry's entry of every layer's output (`run_layers(keep_layer_outputs=True)`).
LAYER_OUTPUTS = "layer_outputs"


def initial_carry(config: ModelConfig, batch: int, length: int) -> Carry:
  """The carry before the first block: the initial entries of every scheduled
  variant that carries something (RealFormer's zero scores), else empty.

  A scanned stack needs the carry's structure fixed from the first step, so
  both modes start from it.
  """
  carry = {}
  for variant in dict.fromkeys(config.schedule_period):
    spec = registry.get_variant(variant)
    if spec.initial_carry is not None:
      carry.update(spec.initial_carry(batch, length, config.num_heads))
  return carry


def _block_class(config: ModelConfig):
  policy = REMAT_POLICIES[config.remat_policy]
  if config.remat_policy == "none":
    return Block
  # mask (3) is an array; is_causal (4) and deterministic (5) are Python flags
  # (argument indices count the module as 0).
  return nn.remat(Block, policy=policy, static_argnums=(4, 5))


class _Period(nn.Module):
  """One period of the schedule as a scan body: `(x, carry) -> (x, carry)`."""

  config: ModelConfig
  is_causal: bool
  deterministic: bool
  keep_layer_outputs: bool = False

  @nn.compact
  def __call__(self, state: Tuple[Array, Carry], mask: Optional[Array]):
    x, carry = state
    block = _block_class(self.config)
    outputs = []
    for i, variant in enumerate(self.config.schedule_period):
      x, carry = block(self.config, variant, name=f"block_{i}")(
          x, carry, mask, self.is_causal, self.deterministic)
      outputs.append(x)
    # The scan stacks each step's [period, B, T, E] outputs when asked.
    return (x, carry), (jnp.stack(outputs) if self.keep_layer_outputs else None)


def run_layers(config: ModelConfig, x: Array, carry: Optional[Carry] = None, *,
               mask: Optional[Array] = None, is_causal: bool = False,
               deterministic: bool = True,
               keep_layer_outputs: bool = False) -> Tuple[Array, Carry]:
  """Runs `config.num_layers` blocks following `config.schedule`.

  Called inside a module's compact method; the blocks become that module's
  submodules (`block_{i}` unrolled, `blocks` scanned), so an encoder keeps
  the parameter tree `encoder/block_{i}/...` it always had.

  Args:
    config: the model config (`num_layers`, `layer_attention`, `scan_layers`,
      `remat_policy` and every block field).
    x: `[B, T, E]`.
    carry: the first block's carry; None for `initial_carry`.
    mask: the mixers' mask (key padding `[B, 1, 1, T]` from the encoder).
    is_causal, deterministic: as the blocks take them.
    keep_layer_outputs: hand every layer's output on in the returned carry, as
      `carry[LAYER_OUTPUTS]` `[B, num_layers + 1, T, E]` (the stack's input
      first): what transparent attention mixes.

  Returns:
    `(x [B, T, E], the last block's carry)`.
  """
  if carry is None:
    carry = initial_carry(config, x.shape[0], x.shape[1])
  inputs = x
  if not config.scan_layers:
    block = _block_class(config)
    outputs = []
    for i, variant in enumerate(config.schedule):
      x, carry = block(config, variant, name=f"block_{i}")(x, carry, mask, is_causal,
                                                            deterministic)
      outputs.append(x)
    if keep_layer_outputs:
      carry = {**carry, LAYER_OUTPUTS: jnp.stack([inputs] + outputs, axis=1)}
    return x, carry
  period = len(config.schedule_period)
  scanned = nn.scan(
      _Period, variable_axes={"params": 0, "intermediates": 0, "losses": 0, "cache": 0,
                              "memory": 0, "batch_stats": 0, RANDOM_COLLECTION: 0},
      split_rngs={"params": True, "dropout": True, "attention": True},
      in_axes=(nn.broadcast,), length=config.num_layers // period,
      metadata_params={nn.PARTITION_NAME: axes.LAYERS})
  (x, carry), stacked = scanned(config, is_causal, deterministic, keep_layer_outputs,
                                name="blocks")((x, carry), mask)
  if keep_layer_outputs:  # [steps, period, B, T, E] -> [B, num_layers, T, E]
    stacked = jnp.moveaxis(stacked.reshape((-1,) + stacked.shape[2:]), 0, 1)
    carry = {**carry, LAYER_OUTPUTS: jnp.concatenate([inputs[:, None], stacked], axis=1)}
  return x, carry


class LayerStack(nn.Module):
  """`run_layers` as a module of its own (its blocks under its scope).

  Attributes:
    config: the model config.
  """

  config: ModelConfig

  @nn.compact
  def __call__(self, x: Array, carry: Optional[Carry] = None, *, mask: Optional[Array] = None,
               is_causal: bool = False, deterministic: bool = True) -> Tuple[Array, Carry]:
    """As `run_layers`."""
    return run_layers(self.config, x, carry, mask=mask, is_causal=is_causal,
                      deterministic=deterministic)


def unstack_scanned(params: Dict[str, Any], config: ModelConfig) -> Dict[str, Any]:
  """A scanned stack's parameters `{"blocks": {"block_j": [N, ...]}}` as the
  unrolled stack's `{"block_{i}": ...}`: layer i = step i // period, block
  i % period. For comparing the two modes and loading one into the other."""
  period = len(config.schedule_period)
  unrolled = {}
  for i in range(config.num_layers):
    step, position = divmod(i, period)
    unrolled[f"block_{i}"] = jax.tree.map(lambda leaf, s=step: leaf[s],
                                          params["blocks"][f"block_{position}"])
  return unrolled
