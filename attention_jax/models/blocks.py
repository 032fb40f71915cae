"""A Transformer block from parts named in the model config: a token mixer (any
registered variant), a feed-forward layer, a norm, and a residual arrangement.

The mixer contract (docs/ARCHITECTURE.md) is the one call every registered
variant's module answers:

    mixer(x [B, Tq, E], context=None, *, mask=None, is_causal=False,
          deterministic=True, carry=None, **sequence_arguments)
      -> y [B, Tq, E]            when carry is None
      -> (y, carry)              when called with a carry

where `sequence_arguments` are the padding/segment/position arguments the
block was given (only those that are set), and `carry` is the pytree the layer
stack hands from block to block.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, Optional

import flax.linen as nn
import jax.numpy as jnp
from flax.core import FrozenDict

from attention_jax import axes, positional, registry
from attention_jax import layers
from attention_jax.layers import make_norm
from attention_jax.models.config import REMAT_POLICIES, ModelConfig

Array = jnp.ndarray
Carry = Dict[str, Any]
# The residual stream's logical axes.
EMBEDDED = (axes.ACTIVATION_BATCH, axes.ACTIVATION_LENGTH, axes.ACTIVATION_EMBED)


def make_mixer(config: ModelConfig, variant: str, **module_kwargs) -> nn.Module:
  """The token mixer of `variant`, configured from `config`.

  A Q/K/V variant is `MultiHeadAttention` running it, with its options in
  `attention_options` (those in the spec's `module_options` set the layer's
  field of that name instead); a mixer that is not Q/K/V attention (Perceiver,
  inducing points, ...) gets its declared options as module fields. A
  registered module that is not a token mixer (a pooling or alignment
  module, `registry.ROLES`) is refused with a ValueError saying what it is.
  """
  spec = registry.get_mixer(variant)
  kwargs = dict(num_heads=config.num_heads, dropout_rate=config.attention_dropout_rate,
                dtype=config.jnp_dtype)
  # Only what is set: a None must not override a variant's preset (multi_query
  # presets num_kv_heads=1).
  if config.num_kv_heads is not None:
    kwargs["num_kv_heads"] = config.num_kv_heads
  if config.qkv_dim is not None:
    if "qkv_features" not in {f.name for f in dataclasses.fields(spec.mixer_class)}:
      raise ValueError(f"model.qkv_dim={config.qkv_dim} is set but the mixer of {variant!r} "
                       f"({spec.mixer_class.__name__}) has no qkv width to set; leave it None.")
    kwargs["qkv_features"] = config.qkv_dim
  if config.position in positional.RELATIVE_POSITIONS:
    if "position" not in {f.name for f in dataclasses.fields(spec.mixer_class)}:
      raise ValueError(
          f"model.position={config.position!r} is a relative position applied inside the "
          f"attention layer, and the mixer of {variant!r} ({spec.mixer_class.__name__}) takes "
          "none; use an absolute one ('learned', 'sinusoidal') or 'none'.")
    kwargs.update(position=config.position, position_options=config.position_options)
  if spec.in_attention_layer:  # the config refuses these for a mixer of its own
    for name, field in (("output_gate", "output_gate"), ("value_residual", "value_residual"),
                        ("streaming_attention", "streaming")):
      if getattr(config, name) is not None:
        kwargs[field] = getattr(config, name)
  if config.decode:
    if spec.decoding_refusal is not None:
      raise ValueError(f"attention variant {variant!r} cannot decode one token at a time: "
                       f"{spec.decoding_refusal}.")
    kwargs["decode"] = True
  # Each option where its registration routes it: a layer field (fixed_head_size's
  # head_dim, or every option of a mixer of its own), else the attention
  # layer's options, which it splits between its extras module and the function.
  routed = spec.route_options(config.options_for(variant))
  kwargs.update(routed["layer"])
  if spec.in_attention_layer:
    kwargs["attention_options"] = FrozenDict({**routed["extras"], **routed["fn"]})
  return spec.module(**kwargs, **module_kwargs)


def _pre_norm(x: Array, branch: Callable[[Array], Array], norm: nn.Module) -> Array:
  return x + branch(norm(x))


def _post_norm(x: Array, branch: Callable[[Array], Array], norm: nn.Module) -> Array:
  return norm(x + branch(x))


# residual name -> (x, branch, norm) -> new x; `branch` includes its dropout.
RESIDUAL_ARRANGEMENTS = {"pre_norm": _pre_norm, "post_norm": _post_norm}


def make_feed_forward(config: ModelConfig, **module_kwargs) -> nn.Module:
  """The block's feed-forward layer (`config.feed_forward` with its
  `feed_forward_options`), configured from `config`."""
  return layers.make_feed_forward(
      config.feed_forward, mlp_dim=config.mlp_dim, activation=config.activation,
      dropout_rate=config.dropout_rate, dtype=config.jnp_dtype,
      options=config.feed_forward_options, **module_kwargs)


def feed_forward_arguments(config: ModelConfig, is_causal: bool) -> Dict[str, Any]:
  """The keyword arguments of the feed-forward layer's call: a causal block
  tells the mixture of experts (whose capacity routing would otherwise let a
  later token change an earlier token's output) to route without capacity."""
  return {"is_causal": True} if is_causal and config.feed_forward == "moe" else {}


def block_class(config: ModelConfig):
  """`Block`, or `nn.remat(Block)` keeping what `config.remat_policy` names."""
  if config.remat_policy == "none":
    return Block
  # mask (3) is an array; is_causal (4) and deterministic (5) are Python flags
  # (argument indices count the module as 0).
  return nn.remat(Block, policy=REMAT_POLICIES[config.remat_policy], static_argnums=(4, 5))


class Block(nn.Module):
  """Mixer and feed-forward sub-layers, each in a residual branch.

  Sub-modules are named `attention_norm`, `attention`, `mlp_norm` and `mlp`
  (the parameter tree of the first wave's `EncoderBlock`).

  Attributes:
    config: the model config.
    attention: this layer's variant (an entry of `config.schedule`);
      `config.attention` when None.
  """

  config: ModelConfig
  attention: Optional[str] = None

  @nn.compact
  def __call__(self, x: Array, carry: Optional[Carry] = None, mask: Optional[Array] = None,
               is_causal: bool = False, deterministic: bool = True, *,
               context: Optional[Array] = None, **sequence_arguments) -> tuple:
    """x: `[B, T, E]`; carry: the stack's carry ({} for none).

    `mask`, `is_causal` and `sequence_arguments` (segment_ids,
    query_seq_lengths, key_value_seq_lengths, positions) go to the mixer.
    With `context` `[B, Tk, E]` the mixer attends from x's positions to the
    context's (its cross-attention form; `mask` then covers the context's
    keys), as the Funnel's pooling block does: queries pooled, keys not.

    Returns:
      `(x [B, T, E], carry)`.
    """
    if x.ndim != 3:
      raise ValueError(f"x must be [B, T, E], got shape {x.shape}.")
    config, dtype = self.config, self.config.jnp_dtype
    mixer = make_mixer(config, self.attention or config.attention, name="attention")
    mlp = make_feed_forward(config, name="mlp")
    attention_norm = make_norm(config.norm, dtype, deterministic=deterministic,
                               name="attention_norm")
    mlp_norm = make_norm(config.norm, dtype, deterministic=deterministic, name="mlp_norm")
    dropout = nn.Dropout(config.dropout_rate)
    residual = RESIDUAL_ARRANGEMENTS[config.residual]
    mixer_arguments = {k: v for k, v in sequence_arguments.items() if v is not None}
    if mask is not None:
      mixer_arguments["mask"] = mask
    if is_causal:
      mixer_arguments["is_causal"] = True
    if context is not None:
      # The context is the stream x came from, so it gets the same treatment
      # as x on the way into the mixer: pre-LN normalises both.
      mixer_arguments["context"] = (attention_norm(context) if config.residual == "pre_norm"
                                    else context)
    carry = {} if carry is None else carry

    def attend(y):
      nonlocal carry
      y, carry = mixer(y, deterministic=deterministic, carry=carry, **mixer_arguments)
      return dropout(y, deterministic=deterministic)

    mlp_arguments = feed_forward_arguments(config, is_causal)

    def feed_forward(y):
      return dropout(mlp(y, deterministic=deterministic, **mlp_arguments),
                     deterministic=deterministic)

    for branch, norm in ((attend, attention_norm), (feed_forward, mlp_norm)):
      x = residual(x, branch, norm)
      x = nn.with_logical_constraint(x, EMBEDDED)
    return x, carry
