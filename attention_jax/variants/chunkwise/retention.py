"""Retention (Sun et al. 2023, "Retentive Network"), `retention`.

Linear attention with a fixed decay gamma_h per head and rotated queries and
keys (section 2.1):

    S_t = gamma S_{t-1} + k_t v_t^T,   o_t = S_t^T q_t
    parallel: O = (Q K^T * D) V,  D_ts = gamma^(t - s) for s <= t, 0 after,

gamma_h = 1 - 2^(-5 - h) for head h (the paper's multi-scale decays), queries
and keys rotated by position (xPos's rotation, here RoPE), keys scaled by
Dk^-1/2. The multi-scale retention layer (section 2.2): values and gate twice
the model width (`value_factor` 2), each head normalised on its own
(GroupNorm), gated by swish(x W_G), projected out. The parallel form's
normalisation of D's rows is left out: the GroupNorm after it is invariant to
a per-head scale.
"""

from __future__ import annotations

from typing import Optional, Sequence

import jax
import jax.numpy as jnp

from attention_jax import positional, registry
from attention_jax.variants.chunkwise import engine, parts

Array = jax.Array


def multi_scale_decays(num_heads: int) -> Array:
  """The paper's gamma_h = 1 - 2^(-5 - h), h = 0 .. H - 1: `[H]`."""
  return 1.0 - 2.0 ** (-5.0 - jnp.arange(num_heads, dtype=jnp.float32))


def check_decays(decays: Sequence[float], num_heads: int) -> Array:
  """Fixed decays given as an option: one per head, each in (0, 1)."""
  decays = tuple(decays)
  if len(decays) != num_heads:
    raise ValueError(f"decays must give one decay per head ({num_heads}), got {len(decays)}: "
                     f"{decays!r}.")
  for decay in decays:
    parts.check_fraction("decays", decay)
  return jnp.asarray(decays, jnp.float32)


def multi_scale_retention(query: Array, key: Array, value: Array, decays: Array, *,
              scale: Optional[float] = None, form: str = "chunkwise",
              chunk_size: int = engine.DEFAULT_CHUNK_SIZE,
              initial_state: Optional[Array] = None):
  """Causal retention: `(out [B, T, H, Dv], state [B, H, Dk, Dv])`.

  Args:
    query, key: `[B, T, H, Dk]`, already rotated; value: `[B, T, H, Dv]`.
    decays: gamma `[H]`, each in (0, 1).
    scale: multiplies the keys; Dk^-1/2 when None.
    form, chunk_size: "parallel" is the paper's parallel form, "recurrent"
      its recurrent form, "chunkwise" its chunkwise form (`engine.run`).
    initial_state: the state before these tokens (zeros when None).
  """
  scale = key.shape[-1] ** -0.5 if scale is None else scale
  log_decay = jnp.broadcast_to(jnp.log(decays), key.shape[:3])
  return engine.run(form, query, key * scale, value, log_decay, chunk_size=chunk_size,
                    initial_state=initial_state)


class MultiScaleRetention(parts.RecurrentMixer):
  """The multi-scale retention layer (the mixer contract, `parts.RecurrentMixer`).

  Attributes:
    value_factor: the values' and gate's width over the model width (2).
    decays: gamma per head, each in (0, 1); None: 1 - 2^(-5 - h).
    max_wavelength: the rotation's base.
  """

  value_factor: float = 2.0
  decays: Optional[Sequence[float]] = None
  max_wavelength: float = 10_000.0

  def recurrence(self, x, positions, history):
    width = x.shape[-1]
    heads = self.num_heads
    key_dim = parts.check_divides("num_heads", heads, width, "the model width")
    if key_dim % 2:
      raise ValueError(f"retention rotates pairs of features: width / num_heads = {key_dim} "
                       f"must be even.")
    value_width = int(width * self.value_factor)
    parts.check_divides("num_heads", heads, max(value_width, 1),
                        "value_factor x the model width")
    decays = (multi_scale_decays(heads) if self.decays is None
              else check_decays(self.decays, heads))
    dense = lambda features, name: parts.dense(features, name, param_dtype=self.param_dtype)(x)
    rotate = lambda a: positional.apply_rope(a, positions, max_wavelength=self.max_wavelength)
    query = rotate(parts.heads(dense(width, "query"), heads))
    key = rotate(parts.heads(dense(width, "key"), heads)) * key_dim ** -0.5
    value = parts.heads(dense(value_width, "value"), heads)
    log_decay = jnp.broadcast_to(jnp.log(decays), key.shape[:3])
    return parts.Recurrence(query, key, value, log_decay), None, {}

  def output(self, out, extras, x):
    del extras
    normed = parts.HeadNorm(center=True, param_dtype=self.param_dtype, name="group_norm")(out)
    merged = parts.merge_heads(normed)
    gate = jax.nn.silu(parts.dense(merged.shape[-1], "gate", param_dtype=self.param_dtype)(x))
    return parts.dense(x.shape[-1], "out", param_dtype=self.param_dtype)(gate * merged)


registry.register(registry.VariantSpec(
    name="retention", fn=multi_scale_retention, family="chunkwise", complexity="O(T C D + T D Dv)",
    subquadratic=True, exact=False, causal=True, cross=False, paper="Sun et al. 2023",
    qkv=False, mixer=MultiScaleRetention,
    options=dict(
        value_factor="the values' and gate's width over the model width (the paper's 2)",
        decays=registry.VariantOption(
            "decays", tuple, None, "gamma per head, each in (0, 1); None: 1 - 2^(-5 - h)"),
        max_wavelength="the base of the query and key rotation",
        **parts.FORM_OPTIONS)))
