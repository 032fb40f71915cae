"""Reversible residual layers (Reformer, Kitaev et al. 2020; RevNet, Gomez et
al. 2017): the backward pass recomputes each layer's inputs from its outputs
instead of keeping activations, so training memory does not grow with depth.

The stream is two copies of the embeddings, x1 = x2 = x `[B, T, E]`. Layer i
computes

    y1 = x1 + F_i(x2),   F_i = dropout(mixer(norm(x2)))
    y2 = x2 + G_i(y1),   G_i = dropout(feed_forward(norm(y1)))

which is inverted by x2 = y2 - G_i(y1), x1 = y1 - F_i(x2). The stack returns
the mean (y1 + y2) / 2: width E and no parameters of its own, so the encoder's
final norm and every head work unchanged (Reformer concatenates to 2E instead,
which would change the head's width). Each layer's parameters are a `Block`'s
(`attention_norm`, `attention`, `mlp_norm`, `mlp`), under
`reversible/block_{i}`.

Decision: a functional `jax.custom_vjp` over explicit parameters, not
`nn.custom_vjp`. The backward must re-run each layer's F and G from
recomputed inputs; `nn.custom_vjp`'s backward receives only residuals, not
the module, so it would have to apply the layers as pure functions anyway
(or save `nn.vjp` closures, which keep exactly the activations this avoids).
Here the whole stack is one custom VJP whose residuals are the outputs
(y1, y2), the parameters, the mask and the dropout keys; the backward walks
the layers in reverse (a `lax.scan` over the schedule's periods), each
layer a `jax.vjp` of G then F at the recomputed inputs. Dropout in training
draws one key per layer, an input of the VJP, so the recomputation drops
the same units as the forward pass.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional, Sequence, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from attention_jax.layers.norms import make_norm
from attention_jax.models.blocks import (EMBEDDED, feed_forward_arguments, make_feed_forward,
                                         make_mixer)
from attention_jax.models.config import ModelConfig

Array = jnp.ndarray
# residual(params, x [B, T, E], context, key) -> [B, T, E]: F_i or G_i.
Residual = Callable[[Any, Array, Any, Optional[Array]], Array]
# Variable collections a reversible layer may hold: its parameters, attention
# weights sown for inspection, and a decoding cache.
_ALLOWED_COLLECTIONS = ("params", "intermediates", "cache")


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def reversible_layers(attend: Sequence[Residual], feed_forward: Sequence[Residual],
                      params: Sequence[Any], x1: Array, x2: Array, context: Any,
                      keys: Optional[Array]) -> Tuple[Array, Array]:
  """Runs S periods of P reversible layers, saving no activation for the
  backward pass.

  Args:
    attend: F_j of each of the P layers of a period,
      `attend[j](params[j] at one step, x, context, key)`.
    feed_forward: G_j likewise.
    params: per period position j, that layer's parameters stacked over the
      S steps (leading axis S; differentiated).
    x1, x2: the two streams, `[B, T, E]` each (differentiated).
    context: arrays every layer reads and nothing differentiates (the mask).
    keys: `[S, P]` PRNG keys (each split into F's and G's), or None without
      dropout.

  Returns:
    `(y1, y2)`, `[B, T, E]` each.
  """

  def period(stream, step_inputs):
    x1, x2 = stream
    for j, (layer_params, f_key, g_key) in enumerate(_layers_of(step_inputs)):
      x1 = x1 + attend[j](layer_params, x2, context, f_key)
      x2 = x2 + feed_forward[j](layer_params, x1, context, g_key)
    return (x1, x2), None

  (y1, y2), _ = jax.lax.scan(period, (x1, x2), (tuple(params), keys))
  return y1, y2


def _layers_of(step_inputs):
  """`(params, F's key, G's key)` of each layer of one period."""
  params, keys = step_inputs
  for j, layer_params in enumerate(params):
    f_key, g_key = (None, None) if keys is None else jax.random.split(keys[j])
    yield layer_params, f_key, g_key


def _forward(attend, feed_forward, params, x1, x2, context, keys):
  # The residuals are the outputs, not the activations of any layer.
  y1, y2 = reversible_layers(attend, feed_forward, params, x1, x2, context, keys)
  return (y1, y2), (params, y1, y2, context, keys)


def _backward(attend, feed_forward, residuals, cotangents):
  params, y1, y2, context, keys = residuals

  def period(state, step_inputs):
    y1, y2, dy1, dy2 = state
    layers = list(_layers_of(step_inputs))
    grads = [None] * len(layers)
    for j in reversed(range(len(layers))):
      layer_params, f_key, g_key = layers[j]
      # y2 = x2 + G(y1): G's vjp at y1 gives x2 back and adds G's path to dy1.
      g_out, g_vjp = jax.vjp(
          lambda p, y, g=feed_forward[j], k=g_key: g(p, y, context, k), layer_params, y1)
      x2 = y2 - g_out
      g_grads, dy1_through_g = g_vjp(dy2)
      dy1 = dy1 + dy1_through_g
      # y1 = x1 + F(x2): F's vjp at the recomputed x2 gives x1 back.
      f_out, f_vjp = jax.vjp(
          lambda p, x, f=attend[j], k=f_key: f(p, x, context, k), layer_params, x2)
      x1 = y1 - f_out
      f_grads, dx2_through_f = f_vjp(dy1)
      grads[j] = jax.tree.map(jnp.add, f_grads, g_grads)
      y1, y2, dy2 = x1, x2, dy2 + dx2_through_f
    return (y1, y2, dy1, dy2), tuple(grads)

  # A loop, not unrolled layers: XLA then runs the periods one after the
  # other, reusing one period's buffers. Unrolled, its scheduler was free to
  # hoist what depends on no layer's output (the counters of every layer's
  # dropout bits, blockwise attention's block masks) to the start, and the
  # temporaries grew with depth again (measured: 6 MiB a layer at T=1024,
  # E=128; 18 with dropout).
  (_, _, dx1, dx2), grads = jax.lax.scan(period, (y1, y2) + tuple(cotangents),
                                         (tuple(params), keys), reverse=True)
  # The mask and the keys are not differentiated: None is their zero cotangent.
  return list(grads) if isinstance(params, list) else grads, dx1, dx2, None, None


reversible_layers.defvjp(_forward, _backward)


class ReversibleBlock(nn.Module):
  """One reversible layer: its residual functions F (`attend`) and G
  (`feed_forward`), with a `Block`'s parameter names.

  Attributes:
    config: the model config.
    variant: this layer's mixer (an entry of `config.schedule`).
  """

  config: ModelConfig
  variant: str

  def setup(self):
    config = self.config
    self.attention_norm = make_norm(config.norm, config.jnp_dtype)
    self.attention = make_mixer(config, self.variant)
    self.mlp_norm = make_norm(config.norm, config.jnp_dtype)
    self.mlp = make_feed_forward(config)
    self.dropout = nn.Dropout(config.dropout_rate)

  def attend(self, x: Array, mask: Optional[Array], is_causal: bool,
             deterministic: bool) -> Array:
    """F(x) = dropout(mixer(norm(x))); x: `[B, T, E]`."""
    arguments = {}
    if mask is not None:
      arguments["mask"] = mask
    if is_causal:
      arguments["is_causal"] = True
    y = self.attention(self.attention_norm(x), deterministic=deterministic, **arguments)
    return nn.with_logical_constraint(self.dropout(y, deterministic=deterministic), EMBEDDED)

  def feed_forward(self, x: Array, deterministic: bool, is_causal: bool = False) -> Array:
    """G(x) = dropout(feed_forward(norm(x))); x: `[B, T, E]`."""
    y = self.mlp(self.mlp_norm(x), deterministic=deterministic,
                 **feed_forward_arguments(self.config, is_causal))
    return nn.with_logical_constraint(self.dropout(y, deterministic=deterministic), EMBEDDED)

  def __call__(self, x1: Array, x2: Array, mask: Optional[Array], is_causal: bool,
               deterministic: bool) -> Tuple[Array, Array]:
    """The layer run directly (initialisation, decoding): `(y1, y2)`."""
    y1 = x1 + self.attend(x2, mask, is_causal, deterministic)
    return y1, x2 + self.feed_forward(y1, deterministic, is_causal)


class ReversibleStack(nn.Module):
  """`num_layers` reversible layers following `config.schedule`, from the two
  copies of `x` to the mean of the two streams.

  Attributes:
    config: the model config (`residual` "pre_norm", no carry, no scan or
      remat: `ModelConfig` checks these).
  """

  config: ModelConfig

  @nn.compact
  def __call__(self, x: Array, *, mask: Optional[Array] = None, is_causal: bool = False,
               deterministic: bool = True) -> Array:
    """x: `[B, T, E]`; mask: the mixers' mask. Returns `[B, T, E]`.

    Raises:
      ValueError: when a layer keeps variables other than parameters (a
        "random" draw, a "memory", sown "losses"): the backward pass re-runs
        each layer as a pure function of its parameters.
    """
    config = self.config
    layers = [ReversibleBlock(config, variant, name=f"block_{i}")
              for i, variant in enumerate(config.schedule)]
    if self.is_initializing() or config.decode:
      # No gradient here: the layers run as modules, creating their
      # parameters (and, decoding, their caches).
      x1 = x2 = x
      for layer in layers:
        x1, x2 = layer(x1, x2, mask, is_causal, deterministic)
      self._check_variables(layers)
      return (x1 + x2) / 2
    self._check_variables(layers)
    # The loop runs over whole periods of the schedule (P layers, their
    # parameters stacked over the S periods); a schedule that does not
    # divide num_layers is one period of every layer.
    size = len(config.schedule_period)
    size = size if config.num_layers % size == 0 else config.num_layers
    steps = config.num_layers // size
    per_layer = [nn.meta.unbox(layer.variables["params"]) for layer in layers]
    params = [jax.tree.map(lambda *leaves: jnp.stack(leaves), *per_layer[j::size])
              for j in range(size)]
    attend = tuple(self._residual(variant, "attend", is_causal, deterministic)
                   for variant in config.schedule[:size])
    feed_forward = tuple(self._residual(variant, "feed_forward", is_causal, deterministic)
                         for variant in config.schedule[:size])
    keys = None
    if not deterministic and (config.dropout_rate or config.attention_dropout_rate):
      keys = jax.random.split(self.make_rng("dropout"), (steps, size))
    y1, y2 = reversible_layers(attend, feed_forward, params, x, x, {"mask": mask}, keys)
    return (y1 + y2) / 2

  def _residual(self, variant: str, method: str, is_causal: bool,
                deterministic: bool) -> Residual:
    """F or G of a `variant` layer as a pure function of its parameters."""
    layer = ReversibleBlock(self.config, variant)

    def residual(params, x, context, key):
      rngs = {} if key is None else {"dropout": key}
      if method == "attend":
        return layer.apply({"params": params}, x, context["mask"], is_causal, deterministic,
                           method=ReversibleBlock.attend, rngs=rngs)
      return layer.apply({"params": params}, x, deterministic, is_causal,
                         method=ReversibleBlock.feed_forward, rngs=rngs)

    return residual

  def _check_variables(self, layers: Sequence[ReversibleBlock]) -> None:
    for layer in layers:
      kept = sorted(set(layer.variables) - set(_ALLOWED_COLLECTIONS))
      if kept:
        raise ValueError(
            f"model.stack='reversible' re-runs each layer from its parameters alone in the "
            f"backward pass, but attention {layer.variant!r} keeps variables in "
            f"{', '.join(map(repr, kept))} (random draws, a memory or sown losses): use "
            f"stack='standard' for it, or a variant whose only variables are parameters.")
