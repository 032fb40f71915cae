"""RWKV-7 "Goose" (Peng et al. 2025), `rwkv7`: the generalised delta rule with
a decay per key dimension and an in-context learning rate.

The state reads along a normalised key kappa_t and writes back a fraction
a_t (per dimension) of what it read, after decaying by w_t (section 4):

    S_t = (diag(w_t) - (a_t * kappa_t) kappa_t^T) S_{t-1} + k~_t v_t^T,
    o_t = S_t^T r_t + (r_t . (rho * k~_t)) v_t,

with w_t = exp(-e^(-1/2) sigmoid(d_t)) in (exp(-e^(-1/2)), 1) = (0.545, 1),
kappa_t = normalise(k_t * xi) (xi learned), the replacement key
k~_t = k_t * (1 + (a_t - 1) * alpha) (alpha learned) and a bonus for the current token (rho learned, per head).
In the engine's terms the read key is kappa, the write key -a * kappa, the
log-decay log w (per dimension), the query r.

The time-mixing layer: token shift (each branch reads a learned mix of x_t
and x_{t-1}), receptance, key and value projections, low-rank (LoRA) maps for
the decay, the learning rate and the output gate, GroupNorm per head, the
bonus, the gate, the output projection. RWKV-7's value residual across layers
(each layer's values mixed with the first layer's) is not part of this layer.
"""

from __future__ import annotations

import math
from typing import Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from attention_jax import registry
from attention_jax.variants import common
from attention_jax.variants.chunkwise import engine, parts

Array = jax.Array
GROUP_NORM_EPSILON = 64e-5  # RWKV-7's, for heads of 64
BRANCHES = ("receptance", "decay", "key", "value", "learning_rate", "gate")


def rwkv7_attention(receptance: Array, key: Array, value: Array, log_decay: Array,
                    learning_rate: Array, removal_key: Array, bonus: Array, *,
                    form: str = "chunkwise", chunk_size: int = engine.DEFAULT_CHUNK_SIZE,
                    initial_state: Optional[Array] = None):
  """RWKV-7's state update and read-out, causal: `(out [B, T, H, D], state [B, H, D, D])`.

  Args:
    receptance: r `[B, T, H, D]`, the query.
    key: k~ `[B, T, H, D]`, the key written (the replacement key).
    value: v `[B, T, H, D]`.
    log_decay: log w `[B, T, H, D]`, < 0.
    learning_rate: a `[B, T, H, D]`, in (0, 1).
    removal_key: kappa `[B, T, H, D]`, L2-normalised per head.
    bonus: rho `[H, D]`, the current token's extra weight.
    form, chunk_size, initial_state: as `engine.run`.
  """
  out, state = engine.run(form, *_recurrence(receptance, key, value, log_decay, learning_rate,
                                             removal_key),
                          chunk_size=chunk_size, initial_state=initial_state)
  return out + _bonus(receptance, key, value, bonus), state


def _recurrence(receptance, key, value, log_decay, learning_rate, removal_key):
  return parts.Recurrence(receptance, key, value, log_decay, read_key=removal_key,
                          write_key=-learning_rate * removal_key)


def _bonus(receptance, key, value, bonus):
  return jnp.sum(receptance * bonus * key, axis=-1, keepdims=True) * value


class RWKV7TimeMix(parts.RecurrentMixer):
  """RWKV-7's time mixing (the mixer contract, `parts.RecurrentMixer`).

  Attributes:
    low_rank_dim: the rank of the LoRA maps of the decay, the learning rate
      and the gate; min(64, width) when None.
  """

  low_rank_dim: Optional[int] = None

  def recurrence(self, x, positions, history):
    del positions
    width = x.shape[-1]
    heads = self.num_heads
    head_dim = parts.check_divides("num_heads", heads, width, "the model width")
    rank = common.check_size("low_rank_dim", min(64, width) if self.low_rank_dim is None
                             else self.low_rank_dim)
    shifted, last = parts.token_shift(x, None if history is None else history["shift"])
    ramp = lambda rng, shape, dtype: jnp.broadcast_to(
        jnp.linspace(0.0, 1.0, shape[-1], dtype=dtype), shape)
    mix = self.param("token_mix", ramp, (len(BRANCHES), width), self.param_dtype)
    branch = {name: x + (shifted - x) * mix[i].astype(x.dtype) for i, name in enumerate(BRANCHES)}
    dense = lambda features, name, **kw: parts.dense(features, name,
                                                     param_dtype=self.param_dtype, **kw)
    zeros = nn.initializers.zeros

    def low_rank(name, inputs, activation, bias_init=zeros):
      hidden = activation(dense(rank, f"{name}_down")(inputs))
      return dense(width, f"{name}_up", use_bias=True, kernel_init=zeros,
                   bias_init=bias_init)(hidden).astype(jnp.float32)

    as_heads = lambda a: parts.heads(a, heads)
    receptance = as_heads(dense(width, "receptance")(branch["receptance"]))
    key = as_heads(dense(width, "key")(branch["key"]))
    value = as_heads(dense(width, "value")(branch["value"]))
    # Decays from slow (sigmoid(-6): w ~ 0.998) to fast (sigmoid(1): w ~ 0.64) across
    # dimensions; RWKV-LM's own start spans d in [-6.5, -1.5] (w ~ 0.999 to 0.895).
    decay_init = lambda rng, shape, dtype: jnp.linspace(-6.0, 1.0, shape[0], dtype=dtype)
    log_decay = -math.exp(-0.5) * jax.nn.sigmoid(
        low_rank("decay", branch["decay"], jnp.tanh, decay_init))
    learning_rate = jax.nn.sigmoid(low_rank("learning_rate", branch["learning_rate"],
                                            lambda h: h))
    gate = dense(width, "gate_up")(jax.nn.sigmoid(dense(rank, "gate_down")(branch["gate"])))
    per_head = lambda name, value: self.param(name, nn.initializers.constant(value),
                                              (heads, head_dim), self.param_dtype)
    removal_key = parts.l2_normalize(key * per_head("removal_scale", 0.85))
    learning_rate = as_heads(learning_rate)
    key = key * (1.0 + (learning_rate - 1.0) * per_head("replacement_scale", 1.0))
    recurrence = _recurrence(receptance, key, value, as_heads(log_decay), learning_rate,
                             removal_key)
    return recurrence, (receptance, key, value, gate), {"shift": last}

  def output(self, out, extras, x):
    receptance, key, value, gate = extras
    heads, head_dim = out.shape[2:]
    normed = parts.HeadNorm(center=True, epsilon=GROUP_NORM_EPSILON,
                            param_dtype=self.param_dtype, name="group_norm")(out)
    bonus = self.param("bonus", nn.initializers.zeros, (heads, head_dim), self.param_dtype)
    y = parts.merge_heads(normed + _bonus(receptance, key, value, bonus)) * gate
    return parts.dense(x.shape[-1], "out", param_dtype=self.param_dtype)(y)


registry.register(registry.VariantSpec(
    name="rwkv7", fn=rwkv7_attention, family="chunkwise", complexity="O(T C D + T D^2)",
    subquadratic=True, exact=False, causal=True, cross=False, paper="Peng et al. 2025",
    qkv=False, mixer=RWKV7TimeMix,
    options=dict(
        low_rank_dim="the rank of the decay's, learning rate's and gate's LoRA maps; "
                     "min(64, width) when None",
        **parts.FORM_OPTIONS)))
