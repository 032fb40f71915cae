"""MLPs across the tokens, their weights sized by the sequence length
(`max_length`; another length is refused):

* `mlp_mixer` (Tolstikhin et al. 2021): the token-mixing MLP, a two-layer MLP
  across the sequence axis shared by every channel, O(T F) with F its hidden
  width.
* `gmlp` (Liu et al. 2021): the gMLP block's body, a channel projection with
  GELU, the spatial gating unit (half the channels gate the other half after
  a learned [T, T] projection along the sequence) and a channel projection
  back; causal with the projection masked to its lower triangle.

Both are token mixers of their own, subclasses of `FixedLengthMixer`.
"""

from __future__ import annotations

from typing import Any, ClassVar, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from attention_jax import registry
from attention_jax.variants import common
from attention_jax.variants.mixing import tokens

Array = jnp.ndarray
Dtype = Any


LAYER_NORM_EPSILON = 1e-6  # flax's LayerNorm default


def _check_fixed_length(variant: str, length: int, max_length: int) -> None:
  """A mixer whose weights are sized by the sequence length runs at that length only."""
  common.check_size("max_length", max_length)
  if length != max_length:
    raise ValueError(f"{variant} mixes exactly max_length={max_length} tokens (its weights "
                     f"are sized by the sequence length), got a sequence of T={length}; set "
                     f"the option max_length to the length the model runs at ({length}).")


def _layer_norm(x: Array, scale: Array, bias: Array) -> Array:
  """LayerNorm over the last axis: (x - mean) / sqrt(var + eps) * scale + bias."""
  mean = jnp.mean(x, axis=-1, keepdims=True)
  variance = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
  return (x - mean) * jax.lax.rsqrt(variance + LAYER_NORM_EPSILON) * scale + bias


# --------------------------------------------------------------------------------------
# MLP-Mixer: an MLP across the tokens.


def token_mixing_mlp(x: Array, *, token_in_kernel: Array, token_in_bias: Array,
                     token_out_kernel: Array, token_out_bias: Array,
                     valid: Optional[Array] = None, dropout_rate: float = 0.0,
                     dropout_rng: Optional[jax.Array] = None) -> Array:
  """MLP-Mixer's token-mixing MLP (Tolstikhin et al. 2021, eq. 1, without the
  LayerNorm and the skip connection, which the model's block adds): for every
  channel c, the column x[:, c] through a two-layer MLP across the tokens,

      out[t, c] = sum_f W2[f, t] GELU(sum_s x[s, c] W1[s, f] + b1[f]) + b2[t],

  the same weights for every channel. GELU is the exact (erf) one. O(T F E)
  work for F hidden units: linear in T, with weights sized by T.

  Args:
    x: `[B, T, E]`.
    token_in_kernel: W1 `[T, F]`; token_in_bias: b1 `[F]`.
    token_out_kernel: W2 `[F, T]`; token_out_bias: b2 `[T]`.
    valid: `[B, T]` bool, the real tokens; padded ones are zeroed before the
      MLP (they contribute nothing) and their outputs are zero.
    dropout_rate, dropout_rng: dropout on the hidden activations.

  Returns:
    `[B, T, E]` in x's dtype.
  """
  tokens.check_tokens(x)
  length = x.shape[1]
  hidden = jnp.shape(token_in_kernel)[-1]
  for name, array, expected in (("token_in_kernel", token_in_kernel, (length, hidden)),
                                ("token_in_bias", token_in_bias, (hidden,)),
                                ("token_out_kernel", token_out_kernel, (hidden, length)),
                                ("token_out_bias", token_out_bias, (length,))):
    common.check_per_head(name, array, expected)
  inputs = tokens.zero_padding(x, valid)
  hidden_units = jax.nn.gelu(jnp.einsum("bse,sf->bfe", inputs, token_in_kernel)
                             + token_in_bias[:, None], approximate=False)
  hidden_units = common.dropout_weights(hidden_units, dropout_rate, dropout_rng)
  out = jnp.einsum("bfe,ft->bte", hidden_units, token_out_kernel) + token_out_bias[:, None]
  return tokens.zero_padding(out, valid).astype(x.dtype)


class FixedLengthMixer(nn.Module):
  """What the token mixers with weights sized by the sequence length share
  (`mlp_mixer`, `gmlp`): their fields and the mixer contract's checks; a
  subclass creates its parameters and mixes in `mix`.

  Attributes:
    num_heads: not used (these mixers have no heads); the model passes it to
      every mixer.
    max_length: T, the sequence length the weights are sized for; another
      length is refused.
    hidden_dim: F, the hidden width (the subclass says its default).
    dropout_rate: dropout on the hidden activations.
    dtype, param_dtype: computation and parameter dtypes.
  """

  num_heads: Optional[int] = None
  max_length: int = 512
  hidden_dim: Optional[int] = None
  dropout_rate: float = 0.0
  dtype: Optional[Dtype] = None
  param_dtype: Dtype = jnp.float32

  variant: ClassVar[str] = ""  # the registry name, for messages
  has_causal_form: ClassVar[bool] = False

  @nn.compact
  def __call__(self, x: Array, context: Optional[Array] = None, *, mask=None,
               is_causal: bool = False, query_seq_lengths=None, key_value_seq_lengths=None,
               segment_ids=None, positions=None, deterministic: bool = True, carry=None):
    """The mixer contract. x: `[B, T, E]` with T = max_length; mask: key
    padding `[B|1, 1, 1, T]`; query_seq_lengths / key_value_seq_lengths:
    `[B]`; positions: not needed (the weights are indexed by position);
    carry: passed through. Returns `[B, T, E]` (with the carry when given one)."""
    del positions
    common.reject_unsupported(self.variant, context=context, segment_ids=segment_ids,
                              is_causal=is_causal and not self.has_causal_form)
    tokens.check_tokens(x)
    _check_fixed_length(self.variant, x.shape[1], self.max_length)
    valid = tokens.real_tokens(self.variant, x, mask, query_seq_lengths, key_value_seq_lengths)
    dtype = tokens.computation_dtype(self, x)
    out = self.mix(x.astype(dtype), dtype=dtype, valid=valid, is_causal=is_causal,
                   dropout_rng=tokens.module_dropout_rng(self, deterministic))
    return common.mixer_output(out, carry)

  def mix(self, x: Array, *, dtype: Dtype, valid: Optional[Array], is_causal: bool,
          dropout_rng: Optional[jax.Array]) -> Array:
    """The subclass's parameters and mixing: x `[B, T, E]` -> `[B, T, E]`."""
    raise NotImplementedError


class TokenMixingMLP(FixedLengthMixer):
  """`mlp_mixer` as a token mixer (the mixer contract): `token_mixing_mlp`
  with its parameters, for sequences of exactly `max_length` tokens. Its
  fields are `FixedLengthMixer`'s; `hidden_dim` F is E / 2 when None, the
  ratio of every model in the paper's Table 1 (D_S = C / 2). Not causal:
  every output token reads every input token through W1."""

  variant: ClassVar[str] = "mlp_mixer"

  def mix(self, x: Array, *, dtype: Dtype, valid: Optional[Array], is_causal: bool,
          dropout_rng: Optional[jax.Array]) -> Array:
    del is_causal  # refused by the caller
    hidden = common.check_size("hidden_dim", self.hidden_dim or max(x.shape[-1] // 2, 1))
    dense_init = nn.initializers.lecun_normal()
    zeros = nn.initializers.zeros_init()
    arrays = tokens.make_params(self, dtype,
                                token_in_kernel=((self.max_length, hidden), dense_init),
                                token_in_bias=((hidden,), zeros),
                                token_out_kernel=((hidden, self.max_length), dense_init),
                                token_out_bias=((self.max_length,), zeros))
    return token_mixing_mlp(x, valid=valid, dropout_rate=self.dropout_rate,
                            dropout_rng=dropout_rng, **arrays)


# --------------------------------------------------------------------------------------
# gMLP: the spatial gating unit.


def spatial_gating_unit(z: Array, *, norm_scale: Array, norm_bias: Array, spatial_kernel: Array,
                        spatial_bias: Array, is_causal: bool = False,
                        valid: Optional[Array] = None) -> Array:
  """gMLP's spatial gating unit (Liu et al. 2021):

      (u, v) = split(z) along the channels (u the first half),
      v <- LayerNorm(v),
      v'[t] = sum_s W[t, s] v[s] + b[t]        (along the sequence),
      s(z) = u * v'.

  Causal: W is masked to its lower triangle (s <= t), so no output reads a
  later token (the LayerNorm is per token). O(T^2 G) work.

  Args:
    z: `[B, T, 2G]`.
    norm_scale, norm_bias: `[G]`, the LayerNorm's.
    spatial_kernel: W `[T, T]`, row t the weights of output position t.
    spatial_bias: b `[T]`.
    is_causal: mask W to s <= t.
    valid: `[B, T]` bool, the real tokens; padded ones' normalised v is
      zeroed before the projection, so they contribute nothing.

  Returns:
    `[B, T, G]` in z's dtype.
  """
  tokens.check_tokens(z)
  length = z.shape[1]
  half = tokens.split_in_half("the channels of z (u and v)", z.shape[-1])
  for name, array, expected in (("norm_scale", norm_scale, (half,)),
                                ("norm_bias", norm_bias, (half,)),
                                ("spatial_kernel", spatial_kernel, (length, length)),
                                ("spatial_bias", spatial_bias, (length,))):
    common.check_per_head(name, array, expected)
  gate, gated = z[..., :half], z[..., half:]
  normalised = _layer_norm(gated.astype(jnp.promote_types(z.dtype, jnp.float32)), norm_scale,
                           norm_bias)
  normalised = tokens.zero_padding(normalised, valid)
  if is_causal:
    spatial_kernel = jnp.where(jnp.tril(jnp.ones((length, length), bool)), spatial_kernel,
                               jnp.zeros((), spatial_kernel.dtype))
  projected = jnp.einsum("ts,bsg->btg", spatial_kernel, normalised) + spatial_bias[:, None]
  return (gate * projected).astype(z.dtype)


def gated_mlp(x: Array, *, in_kernel: Array, in_bias: Array, out_kernel: Array,
              out_bias: Array, is_causal: bool = False, valid: Optional[Array] = None,
              dropout_rate: float = 0.0, dropout_rng: Optional[jax.Array] = None,
              **gating_arrays: Array) -> Array:
  """The gMLP block (Liu et al. 2021) without its LayerNorm and
  shortcut, which the model's block adds:

      Z = GELU(x U + b_U),   Z~ = s(Z),   out = Z~ V + b_V,

  s the spatial gating unit (`spatial_gating_unit`). GELU is the exact (erf) one.

  Args:
    x: `[B, T, E]`.
    in_kernel: U `[E, F]`; in_bias: b_U `[F]` (F even).
    out_kernel: V `[F / 2, E]`; out_bias: b_V `[E]`.
    is_causal: the causal spatial projection (`spatial_gating_unit`).
    valid: `[B, T]` bool, the real tokens; padded ones contribute nothing and
      their outputs are zero.
    dropout_rate, dropout_rng: dropout on Z, the hidden activations.
    **gating_arrays: norm_scale, norm_bias, spatial_kernel, spatial_bias of
      `spatial_gating_unit`.

  Returns:
    `[B, T, E]` in x's dtype.
  """
  tokens.check_tokens(x)
  features, hidden = x.shape[-1], jnp.shape(in_kernel)[-1]
  tokens.split_in_half("hidden_dim F (the spatial gating unit splits it)", hidden)
  for name, array, expected in (("in_kernel", in_kernel, (features, hidden)),
                                ("in_bias", in_bias, (hidden,)),
                                ("out_kernel", out_kernel, (hidden // 2, features)),
                                ("out_bias", out_bias, (features,))):
    common.check_per_head(name, array, expected)
  hidden_units = jax.nn.gelu(x @ in_kernel + in_bias, approximate=False)
  hidden_units = common.dropout_weights(hidden_units, dropout_rate, dropout_rng)
  gated = spatial_gating_unit(hidden_units, is_causal=is_causal, valid=valid, **gating_arrays)
  return tokens.zero_padding(gated @ out_kernel + out_bias, valid).astype(x.dtype)


def near_zero_spatial_init(epsilon: float = 1e-3):
  """W `[T, T]` uniform in +-epsilon / T: |W v| <= epsilon max|v| at any length,
  so with b = 1 the gating unit starts as s(z) ~ u (the paper's near-zero W
  and unit b, which it needs for stable training)."""

  def init(key, shape, dtype=jnp.float32):
    bound = epsilon / shape[-1]
    return jax.random.uniform(key, shape, dtype, -bound, bound)

  return init


class GatedMLP(FixedLengthMixer):
  """`gmlp` as a token mixer (the mixer contract): `gated_mlp`, the gMLP
  block's channel projection in, spatial gating unit and channel projection
  out, for sequences of exactly `max_length` tokens (the spatial projection W
  is `[T, T]`). Its fields are `FixedLengthMixer`'s; `hidden_dim` F (even:
  the gating unit halves it) is 2 E when None, so the gate and the gated half
  are each as wide as the model; dropout is on Z, the hidden activations.
  Causal when called with `is_causal` (W's lower triangle)."""

  variant: ClassVar[str] = "gmlp"
  has_causal_form: ClassVar[bool] = True

  def mix(self, x: Array, *, dtype: Dtype, valid: Optional[Array], is_causal: bool,
          dropout_rng: Optional[jax.Array]) -> Array:
    features = x.shape[-1]
    hidden = common.check_size("hidden_dim", self.hidden_dim or 2 * features)
    half = tokens.split_in_half("hidden_dim", hidden)
    dense_init = nn.initializers.lecun_normal()
    zeros, ones = nn.initializers.zeros_init(), nn.initializers.ones_init()
    length = self.max_length
    arrays = tokens.make_params(self, dtype, in_kernel=((features, hidden), dense_init),
                                in_bias=((hidden,), zeros), norm_scale=((half,), ones),
                                norm_bias=((half,), zeros),
                                spatial_kernel=((length, length), near_zero_spatial_init()),
                                spatial_bias=((length,), ones),
                                out_kernel=((half, features), dense_init),
                                out_bias=((features,), zeros))
    return gated_mlp(x, is_causal=is_causal, valid=valid, dropout_rate=self.dropout_rate,
                     dropout_rng=dropout_rng, **arrays)


_FIXED_LENGTH = "T, the sequence length the weights are sized for (another length is refused)"


registry.register(registry.VariantSpec(
    name="mlp_mixer", fn=token_mixing_mlp, complexity="O(T F)", subquadratic=True,
    causal=False, paper="Tolstikhin et al. 2021", mixer=TokenMixingMLP,
    options=dict(max_length=_FIXED_LENGTH,
                 hidden_dim="F, the token-mixing MLP's hidden width; E / 2 when None"),
    **tokens.MIXING_SPEC))
registry.register(registry.VariantSpec(
    name="gmlp", fn=gated_mlp, complexity="O(T^2)", subquadratic=False, causal=True,
    paper="Liu et al. 2021", mixer=GatedMLP,
    options=dict(max_length=_FIXED_LENGTH,
                 hidden_dim="F, the width of the gated activations (even, split into gate and "
                            "gated halves); 2 E when None"),
    not_decodable="its spatial projection W [T, T] mixes the whole sequence at once; a decoding "
                  "step would need every earlier token's normalised half, which GatedMLP does "
                  "not cache",
    **tokens.MIXING_SPEC))
