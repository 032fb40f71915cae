"""The layer stack: `num_layers` blocks, unrolled or scanned, with a carry.

`config.stack` picks the arrangement: "standard" (this module: the blocks in
sequence, optionally skipped by LayerDrop, `layer_drop.py`), "reversible"
(`reversible.py`) or "universal" (`universal.py`).

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
from attention_jax.layers.attention import initial_value_residual_carry, key_value_sets
from attention_jax.models.blocks import block_class
from attention_jax.models.config import ModelConfig
from attention_jax.models.layer_drop import run_or_skip
from attention_jax.models.reversible import ReversibleStack
from attention_jax.models.universal import UniversalStack
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
  if config.value_residual is not None:
    num_kv_heads, value_dim = value_layout(config, config.schedule_period[0])
    carry.update(initial_value_residual_carry(batch, length, num_kv_heads, value_dim,
                                              config.jnp_dtype))
  return carry


def value_layout(config: ModelConfig, variant: str) -> Tuple[int, int]:
  """`(value heads, Dv)` of the values `variant`'s attention layer projects
  under `config`: the config's K/V heads or the variant's preset
  (multi_query's one), times the variant's key/value sets (NSA's one per
  branch), and its head size (fixed_head_size's `head_dim`) or the width
  over the heads."""
  spec = registry.get_variant(variant)
  options = config.options_for(variant)
  layer = {**spec.module_defaults, **spec.route_options(options)["layer"]}
  num_kv_heads = config.num_kv_heads or layer.get("num_kv_heads") or config.num_heads
  head_dim = layer.get("head_dim") or (config.qkv_dim or config.embed_dim) // config.num_heads
  return num_kv_heads * key_value_sets(spec, options), head_dim


def _skipped_carry(variant: str):
  """The carry past a block of `variant` that LayerDrop skips (None: unchanged)."""
  return registry.get_variant(variant).skipped_carry


class _Period(nn.Module):
  """One period of the schedule as a scan body: `(x, carry) -> (x, carry)`."""

  config: ModelConfig
  is_causal: bool
  deterministic: bool
  keep_layer_outputs: bool = False

  @nn.compact
  def __call__(self, state: Tuple[Array, Carry], mask: Optional[Array]):
    x, carry = state
    block = block_class(self.config)
    outputs = []
    for i, variant in enumerate(self.config.schedule_period):
      x, carry = run_or_skip(block(self.config, variant, name=f"block_{i}"),
                             self.config.layer_drop_rate, x, carry, mask, self.is_causal,
                             self.deterministic, _skipped_carry(variant))
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
  the parameter tree `encoder/block_{i}/...` it always had. The reversible
  and universal stacks are one submodule, `reversible` or `universal`.

  Args:
    config: the model config (`stack`, `num_layers`, `layer_attention`,
      `scan_layers`, `remat_policy`, `layer_drop_rate` and every block field).
    x: `[B, T, E]`.
    carry: the first block's carry; None for `initial_carry`.
    mask: the mixers' mask (key padding `[B, 1, 1, T]` from the encoder).
    is_causal, deterministic: as the blocks take them; with `layer_drop_rate`
      and `deterministic=False` the blocks draw from the "dropout" stream.
    keep_layer_outputs: hand every layer's output on in the returned carry, as
      `carry[LAYER_OUTPUTS]` `[B, num_layers + 1, T, E]` (the stack's input
      first): what transparent attention mixes (the standard stack only).

  Returns:
    `(x [B, T, E], the last block's carry)`.
  """
  if carry is None:
    carry = initial_carry(config, x.shape[0], x.shape[1])
  if keep_layer_outputs and config.stack != "standard":
    raise ValueError(f"every layer's output is kept by the standard stack only; model.stack is "
                     f"{config.stack!r}.")
  if config.stack == "reversible":
    x = ReversibleStack(config, name="reversible")(x, mask=mask, is_causal=is_causal,
                                                   deterministic=deterministic)
    return x, carry
  if config.stack == "universal":
    return UniversalStack(config, name="universal")(x, carry, mask=mask, is_causal=is_causal,
                                                    deterministic=deterministic)
  inputs = x
  if not config.scan_layers:
    block = block_class(config)
    outputs = []
    for i, variant in enumerate(config.schedule):
      x, carry = run_or_skip(block(config, variant, name=f"block_{i}"), config.layer_drop_rate,
                             x, carry, mask, is_causal, deterministic, _skipped_carry(variant))
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
