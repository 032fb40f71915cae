"""Gated linear attention (Yang et al. 2024, "Gated Linear Attention Transformers
with Hardware-Efficient Training"), `gla`.

Linear attention whose state forgets along each key dimension at a rate the
token chooses (section 4.1):

    S_t = diag(alpha_t) S_{t-1} + k_t v_t^T,     o_t = S_t^T q_t,
    alpha_t = sigmoid(x_t W_a1 W_a2 + b_a)^(1 / tau),  tau = 16   (low-rank W_a: rank 16)

and the layer of the paper's GLA Transformer (eq. 5 onwards): keys of half the
model width (`expand_k` 0.5), values of the full width, 4 heads, each head's
output normalised on its own (LayerNorm in the paper; RMSNorm here, as its
released code), gated by swish(x W_r + b_r), projected out.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from attention_jax import registry
from attention_jax.variants.chunkwise import engine, parts

Array = jax.Array


def gated_linear_attention(query: Array, key: Array, value: Array, log_decay: Array, *,
                           scale: Optional[float] = None, form: str = "chunkwise",
                           chunk_size: int = engine.DEFAULT_CHUNK_SIZE,
                           initial_state: Optional[Array] = None):
  """Causal gated linear attention: `(out [B, T, H, Dv], state [B, H, Dk, Dv])`.

  Args:
    query, key: `[B, T, H, Dk]`; value: `[B, T, H, Dv]`.
    log_decay: log alpha <= 0, `[B, T, H, Dk]` (per key dimension) or
      `[B, T, H]` (per head).
    scale: multiplies the queries; Dk^-1/2 when None.
    form, chunk_size: how the recurrence runs (`engine.run`).
    initial_state: the state before these tokens (zeros when None).
  """
  scale = query.shape[-1] ** -0.5 if scale is None else scale
  return engine.run(form, query * scale, key, value, log_decay, chunk_size=chunk_size,
                    initial_state=initial_state)


class GatedLinearAttention(parts.RecurrentMixer):
  """The GLA layer (the mixer contract, `parts.RecurrentMixer`).

  Attributes:
    expand_k: key width over model width (0.5 in the paper).
    expand_v: value width over model width (1).
    gate_low_rank_dim: the rank of W_a (16).
    gate_logit_normalizer: tau, the gate's temperature (16).
  """

  expand_k: float = 0.5
  expand_v: float = 1.0
  gate_low_rank_dim: int = 16
  gate_logit_normalizer: float = 16.0

  def sizes(self, width: int):
    key_width, value_width = int(width * self.expand_k), int(width * self.expand_v)
    for name, size in (("expand_k", key_width), ("expand_v", value_width)):
      if size < 1:
        raise ValueError(f"gla's {name} gives a width of {size} for a model of width {width}; "
                         f"it must give at least one feature per head.")
      parts.check_divides("num_heads", self.num_heads, size,
                          f"gla's {name} x the model width")
    parts.check_fraction("gate_logit_normalizer", self.gate_logit_normalizer, high=float("inf"))
    return key_width, value_width

  def recurrence(self, x, positions, history):
    del positions  # the decay orders the tokens
    key_width, value_width = self.sizes(x.shape[-1])
    dense = lambda features, name, **kw: parts.dense(features, name,
                                                     param_dtype=self.param_dtype, **kw)(x)
    query = parts.heads(dense(key_width, "query"), self.num_heads)
    key = parts.heads(dense(key_width, "key"), self.num_heads)
    value = parts.heads(dense(value_width, "value"), self.num_heads)
    gate_logits = parts.dense(key_width, "gate_up", use_bias=True, param_dtype=self.param_dtype)(
        dense(self.gate_low_rank_dim, "gate_down"))
    log_decay = (jax.nn.log_sigmoid(gate_logits.astype(jnp.float32))
                 / self.gate_logit_normalizer)
    return (parts.Recurrence(query * query.shape[-1] ** -0.5, key, value,
                             parts.heads(log_decay, self.num_heads)),
            None, {})

  def output(self, out, extras, x):
    del extras
    normed = parts.HeadNorm(param_dtype=self.param_dtype, name="head_norm")(out)
    gate = jax.nn.silu(parts.dense(normed.shape[2] * normed.shape[3], "output_gate",
                                   use_bias=True, param_dtype=self.param_dtype)(x))
    return parts.dense(x.shape[-1], "out", param_dtype=self.param_dtype)(
        gate * parts.merge_heads(normed))


registry.register(registry.VariantSpec(
    name="gla", fn=gated_linear_attention, family="chunkwise",
    complexity="O(T C Dk + T Dk Dv)", subquadratic=True, exact=False, causal=True, cross=False,
    paper="Yang et al. 2024", qkv=False, mixer=GatedLinearAttention,
    options=dict(
        expand_k="key width over model width (the paper's 0.5)",
        expand_v="value width over model width",
        gate_low_rank_dim="the rank of the decay gate's projection",
        gate_logit_normalizer="tau: alpha = sigmoid(logits)^(1/tau)",
        **parts.FORM_OPTIONS)))
