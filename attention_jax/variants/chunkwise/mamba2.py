"""Mamba-2 (Dao and Gu 2024, "Transformers are SSMs"), `mamba2`.

A selective state space model whose transition is a scalar per head, so that
it is linear attention with a decay (state space duality, section 3):

    h_t = exp(dt_t A) h_{t-1} + B_t (dt_t x_t)^T,    y_t = h_t^T C_t + D x_t,

h `[N, P]` per head, A = -exp(A_log) < 0 a learned rate per head, dt_t =
softplus(x W_dt + dt_bias) the token's step, B_t and C_t `[N]` shared by the
heads (one group). In the engine's terms the query is C, the key B, the value
dt x, the log-decay dt A. The block (section 7): one input projection to
(z, x, B, C, dt), a short causal convolution (width 4) and SiLU over (x, B, C),
the SSM, the skip D x, y * SiLU(z) RMS-normalised (the gated norm), and the
output projection. The inner width is `expand` (2) times the model width.
"""

from __future__ import annotations

from typing import Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from attention_jax import registry
from attention_jax.variants import common
from attention_jax.variants.chunkwise import engine, parts

Array = jax.Array
GATED_NORM_EPSILON = 1e-5


def ssd(x: Array, step: Array, rate_log: Array, state_in: Array, state_out: Array,
        skip: Optional[Array] = None, *, form: str = "chunkwise",
        chunk_size: int = engine.DEFAULT_CHUNK_SIZE, initial_state: Optional[Array] = None):
  """The selective SSM of Mamba-2 (its SSD layer), causal: `(y [B, T, H, P], h [B, H, N, P])`.

  Args:
    x: `[B, T, H, P]` the inputs per head.
    step: dt `[B, T, H]`, > 0 (after the softplus).
    rate_log: A_log `[H]`: A = -exp(A_log).
    state_in: B `[B, T, G, N]`, G groups dividing H (1 in the paper's block).
    state_out: C `[B, T, G, N]`.
    skip: D `[H]` (y += D x), or None.
    form, chunk_size, initial_state: as `engine.run`.
  """
  y, state = engine.run(form, *_ssd_recurrence(x, step, rate_log, state_in, state_out),
                        chunk_size=chunk_size, initial_state=initial_state)
  return (y if skip is None else y + skip[:, None] * x), state


def _ssd_recurrence(x, step, rate_log, state_in, state_out) -> parts.Recurrence:
  heads, groups = x.shape[2], state_in.shape[2]
  if heads % groups:
    raise ValueError(f"the groups of B and C ({groups}) must divide the heads ({heads}).")
  to_heads = lambda a: jnp.repeat(a, heads // groups, axis=2)
  step = step.astype(jnp.float32)
  return parts.Recurrence(to_heads(state_out), to_heads(state_in), x * step[..., None],
                          -jnp.exp(rate_log) * step)


class Mamba2(parts.RecurrentMixer):
  """The Mamba-2 block's mixer (the mixer contract, `parts.RecurrentMixer`).

  Attributes:
    state_size: N, the state's size per head (64; the paper's large models 128).
    expand: the inner width over the model width (2).
    head_dim: P, each head's width; None: the inner width / num_heads (the
      model's heads). Given, the heads are the inner width / P.
    conv_size: the short convolution's width (4).
  """

  state_size: int = 64
  expand: int = 2
  head_dim: Optional[int] = None
  conv_size: int = 4

  def sizes(self, width: int):
    inner = common.check_size("expand", self.expand) * width
    if self.head_dim is None:
      heads = self.num_heads
      head_dim = parts.check_divides("num_heads", heads, inner, "mamba2's inner width")
    else:
      head_dim = self.head_dim
      heads = parts.check_divides("head_dim", head_dim, inner, "mamba2's inner width")
    return inner, heads, head_dim, common.check_size("state_size", self.state_size)

  def recurrence(self, x, positions, history):
    del positions
    inner, heads, head_dim, state_size = self.sizes(x.shape[-1])
    gate, inputs, step = jnp.split(
        parts.dense(2 * inner + 2 * state_size + heads, "in_proj",
                    param_dtype=self.param_dtype)(x),
        [inner, 2 * inner + 2 * state_size], axis=-1)
    inputs, conv_history = parts.ShortConvolution(
        self.conv_size, use_bias=True, param_dtype=self.param_dtype, name="conv")(
            inputs, None if history is None else history["conv"])
    inputs, state_in, state_out = jnp.split(inputs, [inner, inner + state_size], axis=-1)
    rate_log, step_bias = parts.mamba_decay_parameters(self, heads)
    step = jax.nn.softplus(step.astype(jnp.float32) + step_bias)
    inputs = inputs.reshape(x.shape[:2] + (heads, head_dim))
    recurrence = _ssd_recurrence(inputs, step, rate_log, state_in[:, :, None],
                                 state_out[:, :, None])
    return recurrence, (inputs, gate), {"conv": conv_history}

  def output(self, out, extras, x):
    inputs, gate = extras
    skip = self.param("D", nn.initializers.ones, (out.shape[2],), jnp.float32)
    y = parts.merge_heads(out + skip[:, None] * inputs) * jax.nn.silu(gate)
    y32 = y.astype(jnp.float32)
    y32 = y32 * jax.lax.rsqrt(jnp.mean(y32 * y32, axis=-1, keepdims=True) + GATED_NORM_EPSILON)
    y = (y32 * self.param("norm", nn.initializers.ones, (y.shape[-1],), self.param_dtype)
         ).astype(x.dtype)
    return parts.dense(x.shape[-1], "out_proj", param_dtype=self.param_dtype)(y)


registry.register(registry.VariantSpec(
    name="mamba2", fn=ssd, family="chunkwise", complexity="O(T C N + T N P)",
    subquadratic=True, exact=False, causal=True, cross=False, paper="Dao and Gu 2024",
    qkv=False, mixer=Mamba2,
    options=dict(
        state_size="N, the state's size per head",
        expand="the inner width over the model width",
        head_dim="P, each head's width; None: inner width / num_heads",
        conv_size="the width of the short causal convolution over (x, B, C)",
        **parts.FORM_OPTIONS)))
