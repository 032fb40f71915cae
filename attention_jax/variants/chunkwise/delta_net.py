"""The delta rule: DeltaNet (Schlag et al. 2021; chunkwise training, Yang et al.
2024), `delta_net`, and Gated DeltaNet (Yang et al. 2025), `gated_delta_net`.

The state is a fast-weight memory that, given key k_t, first reads what it
holds there and moves it towards v_t at the rate beta_t (a step of gradient
descent on |S^T k - v|^2 / 2), instead of adding k_t v_t^T on top:

    S_t = S_{t-1} - beta_t k_t (k_t^T S_{t-1} - v_t^T)
        = (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,      o_t = S_t^T q_t,

and Gated DeltaNet decays the memory first, by alpha_t = exp(g_t) per head:
S_t = alpha_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T. In the
engine's terms the read key is k_t and the write key -alpha_t beta_t k_t; the
chunkwise form solves a chunk's reads with the UT transform.

The layers as their papers (and flash-linear-attention's released layers)
build them: q, k and v each through a short causal convolution (width 4) and
SiLU, q and k L2-normalised (so that I - beta k k^T stays a contraction),
beta = sigmoid(x W_beta) per head, each head's output RMS-normalised, then
projected out. Gated DeltaNet's gate is Mamba-2's, g = -exp(A_log) softplus(x
W_a + dt_bias), its values are twice the keys' width (`expand_v`), and its
normalised output is gated by SiLU(x W_g).
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from attention_jax import registry
from attention_jax.variants import common
from attention_jax.variants.chunkwise import engine, parts

Array = jax.Array


def delta_rule_recurrence(query: Array, key: Array, value: Array, beta: Array,
                          log_decay: Optional[Array] = None) -> parts.Recurrence:
  """The engine's inputs for S_t = alpha_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T:
  read key k_t, write key -alpha_t beta_t k_t, key beta_t k_t (shapes as
  `delta_rule_attention`'s)."""
  if tuple(jnp.shape(beta)) != key.shape[:3]:
    raise ValueError(f"beta must be [B, T, H] = {list(key.shape[:3])}, got shape "
                     f"{list(jnp.shape(beta))}.")
  if log_decay is None:
    log_decay = jnp.zeros(key.shape[:3], jnp.float32)
  beta = beta[..., None].astype(jnp.float32)
  return parts.Recurrence(query, beta * key, value, log_decay, read_key=key,
                          write_key=-(jnp.exp(log_decay)[..., None] * beta) * key)


def delta_rule_attention(query: Array, key: Array, value: Array, beta: Array,
                         log_decay: Optional[Array] = None, *, scale: Optional[float] = None,
                         form: str = "chunkwise", chunk_size: int = engine.DEFAULT_CHUNK_SIZE,
                         initial_state: Optional[Array] = None):
  """The (gated) delta rule, causal: `(out [B, T, H, Dv], state [B, H, Dk, Dv])`.

  Args:
    query, key: `[B, T, H, Dk]` (keys used as given: L2-normalise them for a
      contraction); value: `[B, T, H, Dv]`.
    beta: `[B, T, H]`, the writing rate (in (0, 1) from a sigmoid).
    log_decay: `[B, T, H]`, log alpha <= 0 (Gated DeltaNet); None: no decay
      (DeltaNet).
    scale: multiplies the queries; Dk^-1/2 when None.
    form, chunk_size: how the recurrence runs (`engine.run`).
    initial_state: the state before these tokens (zeros when None).
  """
  scale = query.shape[-1] ** -0.5 if scale is None else scale
  return engine.run(form, *delta_rule_recurrence(query * scale, key, value, beta, log_decay),
                    chunk_size=chunk_size, initial_state=initial_state)


class DeltaNet(parts.RecurrentMixer):
  """The DeltaNet layer (the mixer contract, `parts.RecurrentMixer`).

  Attributes:
    head_dim: Dk, each head's key width; width / H when None.
    conv_size: the short convolutions' width (4).
    beta: a fixed writing rate in (0, 2) for every token; None (the paper):
      learned, sigmoid(x W_beta).
    expand_v: each head's value width over its key width.
    gated: Gated DeltaNet's decay gate and output gate (`GatedDeltaNet`).
  """

  head_dim: Optional[int] = None
  conv_size: int = 4
  beta: Optional[float] = None
  expand_v: float = 1.0
  gated: bool = False

  def sizes(self, width: int):
    key_dim = (parts.check_divides("num_heads", self.num_heads, width, "the model width")
               if self.head_dim is None else self.head_dim)
    value_dim = int(common.check_size("head_dim", key_dim) * self.expand_v)
    if value_dim < 1:
      raise ValueError(f"expand_v={self.expand_v} leaves no value feature per head.")
    if self.beta is not None:
      parts.check_fraction("beta", self.beta, high=2.0)
    return key_dim, value_dim

  def recurrence(self, x, positions, history):
    del positions
    key_dim, value_dim = self.sizes(x.shape[-1])
    history = history or {}
    new_history = {}

    def convolved(features, name):
      projected = parts.dense(features, name, param_dtype=self.param_dtype)(x)
      out, new_history[name] = parts.ShortConvolution(
          self.conv_size, param_dtype=self.param_dtype, name=f"{name}_conv")(
              projected, history.get(name))
      return parts.heads(out, self.num_heads)

    heads = self.num_heads
    query = parts.l2_normalize(convolved(heads * key_dim, "query"))
    key = parts.l2_normalize(convolved(heads * key_dim, "key"))
    value = convolved(heads * value_dim, "value")
    if self.beta is None:
      beta = jax.nn.sigmoid(parts.dense(heads, "beta", param_dtype=self.param_dtype)(x)
                            .astype(jnp.float32))
    else:
      beta = jnp.full(x.shape[:2] + (heads,), self.beta, jnp.float32)
    log_decay = None
    if self.gated:
      rate_log, step_bias = parts.mamba_decay_parameters(self, heads)
      step = jax.nn.softplus(parts.dense(heads, "decay", param_dtype=self.param_dtype)(x)
                             .astype(jnp.float32) + step_bias)
      log_decay = -jnp.exp(rate_log) * step
    return (delta_rule_recurrence(query * key_dim ** -0.5, key, value, beta, log_decay), None,
            new_history)

  def output(self, out, extras, x):
    del extras
    normed = parts.HeadNorm(param_dtype=self.param_dtype, name="head_norm")(out)
    merged = parts.merge_heads(normed)
    if self.gated:
      merged = merged * jax.nn.silu(parts.dense(merged.shape[-1], "output_gate",
                                                param_dtype=self.param_dtype)(x))
    return parts.dense(x.shape[-1], "out", param_dtype=self.param_dtype)(merged)


class GatedDeltaNet(DeltaNet):
  """The Gated DeltaNet layer: `DeltaNet` with the decay and output gates and
  values twice the keys' width."""

  gated: bool = True
  expand_v: float = 2.0


_SHARED_OPTIONS = dict(
    head_dim="Dk, each head's key width; width / H when None",
    conv_size="the width of the short causal convolutions on q, k and v",
    beta="a fixed writing rate in (0, 2); None: learned per token, sigmoid(x W_beta)",
    **parts.FORM_OPTIONS)

registry.register(registry.VariantSpec(
    name="delta_net", fn=delta_rule_attention, family="chunkwise",
    complexity="O(T C Dk + T Dk Dv)", subquadratic=True, exact=False, causal=True, cross=False,
    paper="Schlag et al. 2021; Yang et al. 2024", qkv=False, mixer=DeltaNet,
    options=_SHARED_OPTIONS))

registry.register(registry.VariantSpec(
    name="gated_delta_net", fn=delta_rule_attention, family="chunkwise",
    complexity="O(T C Dk + T Dk Dv)", subquadratic=True, exact=False, causal=True, cross=False,
    paper="Yang et al. 2025", qkv=False, mixer=GatedDeltaNet,
    options=dict(_SHARED_OPTIONS, expand_v="each head's value width over its key width (2)")))
