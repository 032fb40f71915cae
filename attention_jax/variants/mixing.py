"""Attention replaced or reorganised (section G of VARIANTS.md): token mixers
that are not softmax attention over tokens.

* `fnet` (Lee-Thorp et al. 2021): the real part of the 2-D discrete Fourier
  transform over the sequence and hidden axes, no parameters, O(T log T).
* `mlp_mixer` (Tolstikhin et al. 2021): the token-mixing MLP, a two-layer MLP
  across the sequence axis shared by every channel; its weights are sized by
  the sequence length (`max_length`), its cost O(T F) with F its hidden width.
* `gmlp` (Liu et al. 2021): the gMLP block's body, a channel projection with
  GELU, the spatial gating unit (half the channels gate the other half after
  a learned [T, T] projection along the sequence) and a channel projection
  back; causal with the projection masked to its lower triangle.
* `xca` (El-Nouby et al. 2021, XCiT): cross-covariance attention, a Q/K/V
  variant whose [D, D] weights mix the channels of each head, from queries and
  keys L2-normalised along the tokens; linear in T.
* `lite` (Wu et al. 2020): Long-Short Range Attention, dot-product attention
  on half the channels beside a GLU and depthwise convolution on the other
  half, one output projection over both.

Padding, the same in every mixer here: a token is padding when it is past
`key_value_seq_lengths` or `query_seq_lengths`, or masked by a key-padding
mask `[B|1, 1, 1, T]`. Padded tokens are zeroed before the mixing, so they
contribute nothing to a real token's output, and their own outputs are zero
(tested: a real token's output does not change with a padded token's value).
A padded sequence is not its unpadded self, though: the Fourier transform's
frequencies and a fixed-length mixer's weights follow the padded length T.
"""

from __future__ import annotations

from typing import Any, ClassVar, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from attention_jax import registry
from attention_jax.core import masks as mask_lib
from attention_jax.core.softmax import masked_softmax
from attention_jax.variants import common
from attention_jax.variants.dense import dot_product_attention

Array = jnp.ndarray
Dtype = Any

LAYER_NORM_EPSILON = 1e-6  # flax's LayerNorm default


def real_tokens(variant: str, x: Array, mask: Optional[Array] = None,
                query_seq_lengths: Optional[Array] = None,
                key_value_seq_lengths: Optional[Array] = None) -> Optional[Array]:
  """The real tokens of `x` `[B, T, ...]` as `[B, T]` bool, None when all are.

  A self-mixer's queries and keys are the same tokens, so a token is padding
  when any of the padding arguments says so: past either length, or masked by
  a key-padding mask `[B|1, 1, 1, T]` (a pairwise mask is refused by name).
  """
  batch, length = x.shape[:2]
  valid = common.key_padding(variant, mask, key_value_seq_lengths, batch, length)
  if query_seq_lengths is not None:
    valid = mask_lib.and_masks(valid, mask_lib.length_predicate(
        jnp.arange(length)[None, :], jnp.asarray(query_seq_lengths)[:, None]))
  return valid


def zero_padding(x: Array, valid: Optional[Array]) -> Array:
  """`x` `[B, T, ...]` with the tokens that `valid` `[B, T]` marks False set to 0."""
  if valid is None:
    return x
  if tuple(jnp.shape(valid)) != x.shape[:2]:
    raise ValueError(f"valid must be [B, T] = {list(x.shape[:2])}, got shape "
                     f"{list(jnp.shape(valid))}.")
  return jnp.where(valid.reshape(valid.shape + (1,) * (x.ndim - 2)), x, jnp.zeros((), x.dtype))


def _check_tokens(x: Array) -> None:
  if jnp.ndim(x) != 3:
    raise ValueError(f"x must be [B, T, E], got shape {list(jnp.shape(x))}.")


def _check_fixed_length(variant: str, length: int, max_length: int) -> None:
  """A mixer whose weights are sized by the sequence length runs at that length only."""
  common.check_size("max_length", max_length)
  if length != max_length:
    raise ValueError(f"{variant} mixes exactly max_length={max_length} tokens (its weights "
                     f"are sized by the sequence length), got a sequence of T={length}; set "
                     f"the option max_length to the length the model runs at ({length}).")


def _split_in_half(what: str, size: int) -> int:
  if size % 2:
    raise ValueError(f"{what} must be even to be split in two halves, got {size}.")
  return size // 2


def _layer_norm(x: Array, scale: Array, bias: Array) -> Array:
  """LayerNorm over the last axis: (x - mean) / sqrt(var + eps) * scale + bias."""
  mean = jnp.mean(x, axis=-1, keepdims=True)
  variance = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
  return (x - mean) * jax.lax.rsqrt(variance + LAYER_NORM_EPSILON) * scale + bias


def _dropout_rng(module: nn.Module, deterministic: bool) -> Optional[jax.Array]:
  return module.make_rng("dropout") if module.dropout_rate > 0.0 and not deterministic else None


def _params(module: nn.Module, dtype: Dtype, **shapes_and_inits) -> dict:
  """`{name: param}` from `name=(shape, initialiser)`, cast to the computation dtype."""
  return {name: module.param(name, init, shape, module.param_dtype).astype(dtype)
          for name, (shape, init) in shapes_and_inits.items()}


def _computation_dtype(module: nn.Module, x: Array) -> Dtype:
  return module.dtype or jnp.promote_types(x.dtype, module.param_dtype)


# --------------------------------------------------------------------------------------
# FNet: the Fourier transform as the token mixer.


def fourier_mixing(x: Array, *, valid: Optional[Array] = None) -> Array:
  """FNet's Fourier sublayer (Lee-Thorp et al. 2021):

      y = Re(FFT_seq(FFT_hidden(x))),

  the real part of the 2-D DFT over the sequence and hidden axes,
  y[t, e] = sum_{s, c} x[s, c] cos(2 pi (t s / T + e c / E)). Computed by FFT,
  O(T E log(T E)); no T x T array (the paper's DFT-matrix form is a faster
  TPU route for short sequences, the same numbers).

  Args:
    x: `[B, T, E]`.
    valid: `[B, T]` bool, the real tokens; padded ones are zeroed before the
      transform (they contribute nothing) and their outputs are zero.

  Returns:
    `[B, T, E]` in x's dtype (the transform runs in float32 or wider).
  """
  _check_tokens(x)
  inputs = zero_padding(x.astype(jnp.promote_types(x.dtype, jnp.float32)), valid)
  out = jnp.fft.fft2(inputs, axes=(1, 2)).real
  return zero_padding(out, valid).astype(x.dtype)


class FourierMixing(nn.Module):
  """`fnet` as a token mixer (the mixer contract): `fourier_mixing`, no parameters.

  Attributes:
    num_heads: not used (the transform has no heads); the model passes it to
      every mixer.
    dropout_rate: must be 0 in training: the transform has no weights to drop.
    dtype: the output dtype; x's when None.
  """

  num_heads: Optional[int] = None
  dropout_rate: float = 0.0
  dtype: Optional[Dtype] = None

  @nn.compact
  def __call__(self, x: Array, context: Optional[Array] = None, *, mask=None,
               is_causal: bool = False, query_seq_lengths=None, key_value_seq_lengths=None,
               segment_ids=None, positions=None, deterministic: bool = True, carry=None):
    """The mixer contract. x: `[B, T, E]`; mask: key padding `[B|1, 1, 1, T]`;
    query_seq_lengths / key_value_seq_lengths: `[B]`; positions: not needed
    (the transform is over the positions); carry: passed through. Returns
    `[B, T, E]` (with the carry when given one)."""
    del positions
    # Every output frequency sums every token: no causal or per-segment form.
    common.reject_unsupported("fnet", context=context, is_causal=is_causal,
                              segment_ids=segment_ids)
    if self.dropout_rate > 0.0 and not deterministic:
      raise ValueError(f"fnet has no mixing weights to drop; got dropout_rate="
                       f"{self.dropout_rate}: set it to 0 for this variant.")
    _check_tokens(x)
    valid = real_tokens("fnet", x, mask, query_seq_lengths, key_value_seq_lengths)
    out = fourier_mixing(x, valid=valid)
    return common.mixer_output(out.astype(self.dtype or x.dtype), carry)


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
  _check_tokens(x)
  length = x.shape[1]
  hidden = jnp.shape(token_in_kernel)[-1]
  for name, array, expected in (("token_in_kernel", token_in_kernel, (length, hidden)),
                                ("token_in_bias", token_in_bias, (hidden,)),
                                ("token_out_kernel", token_out_kernel, (hidden, length)),
                                ("token_out_bias", token_out_bias, (length,))):
    common.check_per_head(name, array, expected)
  inputs = zero_padding(x, valid)
  hidden_units = jax.nn.gelu(jnp.einsum("bse,sf->bfe", inputs, token_in_kernel)
                             + token_in_bias[:, None], approximate=False)
  hidden_units = common.dropout_weights(hidden_units, dropout_rate, dropout_rng)
  out = jnp.einsum("bfe,ft->bte", hidden_units, token_out_kernel) + token_out_bias[:, None]
  return zero_padding(out, valid).astype(x.dtype)


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
    _check_tokens(x)
    _check_fixed_length(self.variant, x.shape[1], self.max_length)
    valid = real_tokens(self.variant, x, mask, query_seq_lengths, key_value_seq_lengths)
    dtype = _computation_dtype(self, x)
    out = self.mix(x.astype(dtype), dtype=dtype, valid=valid, is_causal=is_causal,
                   dropout_rng=_dropout_rng(self, deterministic))
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
    arrays = _params(self, dtype, token_in_kernel=((self.max_length, hidden), dense_init),
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
  _check_tokens(z)
  length = z.shape[1]
  half = _split_in_half("the channels of z (u and v)", z.shape[-1])
  for name, array, expected in (("norm_scale", norm_scale, (half,)),
                                ("norm_bias", norm_bias, (half,)),
                                ("spatial_kernel", spatial_kernel, (length, length)),
                                ("spatial_bias", spatial_bias, (length,))):
    common.check_per_head(name, array, expected)
  gate, gated = z[..., :half], z[..., half:]
  normalised = _layer_norm(gated.astype(jnp.promote_types(z.dtype, jnp.float32)), norm_scale,
                           norm_bias)
  normalised = zero_padding(normalised, valid)
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
  _check_tokens(x)
  features, hidden = x.shape[-1], jnp.shape(in_kernel)[-1]
  _split_in_half("hidden_dim F (the spatial gating unit splits it)", hidden)
  for name, array, expected in (("in_kernel", in_kernel, (features, hidden)),
                                ("in_bias", in_bias, (hidden,)),
                                ("out_kernel", out_kernel, (hidden // 2, features)),
                                ("out_bias", out_bias, (features,))):
    common.check_per_head(name, array, expected)
  hidden_units = jax.nn.gelu(x @ in_kernel + in_bias, approximate=False)
  hidden_units = common.dropout_weights(hidden_units, dropout_rate, dropout_rng)
  gated = spatial_gating_unit(hidden_units, is_causal=is_causal, valid=valid, **gating_arrays)
  return zero_padding(gated @ out_kernel + out_bias, valid).astype(x.dtype)


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
    half = _split_in_half("hidden_dim", hidden)
    dense_init = nn.initializers.lecun_normal()
    zeros, ones = nn.initializers.zeros_init(), nn.initializers.ones_init()
    length = self.max_length
    arrays = _params(self, dtype, in_kernel=((features, hidden), dense_init),
                     in_bias=((hidden,), zeros), norm_scale=((half,), ones),
                     norm_bias=((half,), zeros),
                     spatial_kernel=((length, length), near_zero_spatial_init()),
                     spatial_bias=((length,), ones), out_kernel=((half, features), dense_init),
                     out_bias=((features,), zeros))
    return gated_mlp(x, is_causal=is_causal, valid=valid, dropout_rate=self.dropout_rate,
                     dropout_rng=dropout_rng, **arrays)


# --------------------------------------------------------------------------------------
# XCiT: cross-covariance attention over the channels.


def _token_l2_normalised(x: Array) -> Array:
  """x `[B, T, H, D]` / its L2 norm over the tokens (per batch, head and channel).
  The norm is floored at 1e-6, so an all-zero channel stays zero with finite
  gradients."""
  squared_norm = jnp.sum(jnp.square(x), axis=1, keepdims=True)
  return x * jax.lax.rsqrt(jnp.maximum(squared_norm, 1e-12))


def cross_covariance_attention(
    query: Array,
    key: Array,
    value: Array,
    bias: Optional[Array] = None,
    mask: Optional[Array] = None,
    *,
    temperature: Array,
    is_causal: bool = False,
    query_seq_lengths: Optional[Array] = None,
    key_value_seq_lengths: Optional[Array] = None,
    segment_ids: Optional[Array] = None,
    dropout_rate: float = 0.0,
    dropout_rng: Optional[jax.Array] = None,
) -> Array:
  """Cross-covariance attention (El-Nouby et al. 2021, XCiT), per head:

      q^, k^ = q, k divided by their L2 norms along the tokens (per channel),
      A[i, j] = softmax_j(tau * sum_t q^[t, i] k^[t, j])       ([D, D]),
      out[t, i] = sum_j A[i, j] v[t, j],

  the paper's V A_XC(K, Q) with A_XC = softmax(K^T Q^ / tau), its learned
  temperature written as the multiplier tau. The weights mix the channels
  of each token: O(T D^2) per head, linear in T, never a T x T array.

  Padding: tokens past either length or masked by the key-padding mask have
  their q, k and v zeroed before the norms and sums (they contribute nothing)
  and output zeros.

  Args:
    query: `[B, T, H, D]`; key: `[B, T, Hkv, D]`; value: `[B, T, Hkv, D]` (one
      length T: the sums pair token t of the queries with token t of the
      keys; the value's head size is the key's, since A mixes its channels).
    bias: not supported (there are no token-token logits).
    mask: a key-padding mask `[B|1, 1, 1, T]` only.
    temperature: tau `[H]`.
    is_causal, segment_ids: not supported (every weight sums every token).
    query_seq_lengths, key_value_seq_lengths: `[B]`, padding.
    dropout_rate, dropout_rng: dropout on A.

  Returns:
    `[B, T, H, D]` in the query dtype.
  """
  common.reject_unsupported("xca", bias=bias, is_causal=is_causal, segment_ids=segment_ids)
  if jnp.ndim(query) != 4 or jnp.ndim(key) != 4 or jnp.ndim(value) != 4:
    raise ValueError(f"query, key and value must be [B, T, H, D], got shapes "
                     f"{list(jnp.shape(query))}, {list(jnp.shape(key))}, "
                     f"{list(jnp.shape(value))}.")
  if key.shape[1] != query.shape[1]:
    raise ValueError(f"xca sums over the tokens of the queries and keys together, so they need "
                     f"one length; got Tq={query.shape[1]} and Tk={key.shape[1]} (xca has no "
                     f"cross-attention form).")
  common.check_query_key_sizes("xca", query, key)
  if value.shape[-1] != key.shape[-1]:
    raise ValueError(f"xca's [D, D] weights mix the value channels, so the value head size must "
                     f"be the key's D={key.shape[-1]}, got {value.shape[-1]}.")
  num_heads, out_dtype = query.shape[2], query.dtype
  common.check_per_head("temperature", temperature, (num_heads,))
  key = common.repeat_kv_heads(key, num_heads)
  value = common.repeat_kv_heads(value, num_heads)
  valid = real_tokens("xca", query, mask, query_seq_lengths, key_value_seq_lengths)
  wide = jnp.promote_types(query.dtype, jnp.float32)
  query, key = (_token_l2_normalised(zero_padding(a.astype(wide), valid)) for a in (query, key))
  logits = jnp.einsum("bthi,bthj->bhij", query, key) * temperature.astype(wide)[:, None, None]
  weights = common.dropout_weights(masked_softmax(logits, None), dropout_rate, dropout_rng)
  out = jnp.einsum("bhij,bthj->bthi", weights, zero_padding(value.astype(wide), valid))
  return out.astype(out_dtype)


class CrossCovarianceTemperature(nn.Module):
  """`xca`'s learned temperature tau `[H]`, initialised at 1 (XCiT's start)."""

  @nn.compact
  def __call__(self, query, key, value, deterministic: bool = True) -> dict:
    del key, value, deterministic
    return {"temperature": self.param("temperature", nn.initializers.ones_init(),
                                      (query.shape[2],))}


# --------------------------------------------------------------------------------------
# Lite Transformer: Long-Short Range Attention.


def depthwise_convolution(x: Array, kernel: Array, bias: Array, *,
                          is_causal: bool = False) -> Array:
  """A 1-D convolution along the tokens, each channel with its own filter:
  out[t, c] = sum_j kernel[j, c] x[t + j - left, c] + bias[c], zero-padded.

  Causal: left = k - 1, so position t reads tokens t - k + 1 .. t; otherwise
  the window is centred, left = (k - 1) // 2.

  Args:
    x: `[B, T, C]`; kernel: `[k, C]`; bias: `[C]`.

  Returns:
    `[B, T, C]`.
  """
  size, channels = jnp.shape(kernel)
  common.check_per_head("conv_bias", bias, (channels,))
  left = size - 1 if is_causal else (size - 1) // 2
  out = jax.lax.conv_general_dilated(
      x, kernel[:, None, :].astype(x.dtype), window_strides=(1,),
      padding=[(left, size - 1 - left)], dimension_numbers=("NWC", "WIO", "NWC"),
      feature_group_count=channels)
  return out + bias.astype(x.dtype)


def long_short_range_attention(
    x: Array,
    *,
    query_kernel: Array,
    query_bias: Array,
    key_kernel: Array,
    key_bias: Array,
    value_kernel: Array,
    value_bias: Array,
    glu_kernel: Array,
    glu_bias: Array,
    conv_kernel: Array,
    conv_bias: Array,
    out_kernel: Array,
    out_bias: Array,
    mask: Optional[Array] = None,
    is_causal: bool = False,
    query_seq_lengths: Optional[Array] = None,
    key_value_seq_lengths: Optional[Array] = None,
    dropout_rate: float = 0.0,
    dropout_rng: Optional[jax.Array] = None,
) -> Array:
  """Long-Short Range Attention (Wu et al. 2020, Lite Transformer): the
  channels split in two halves, each through its own branch,

      x_a, x_c = x[:, :E/2], x[:, E/2:]
      global: heads = dot_product_attention(x_a W_q + b_q, x_a W_k + b_k, x_a W_v + b_v)
      local:  conv = DepthwiseConv(GLU(x_c W_g + b_g))      (GLU(a; g) = a sigmoid(g))
      out = [heads; conv] W_o + b_o,

  the global branch the library's `dot_product_attention` with every mask it
  takes, the local branch a GLU and a depthwise convolution in place of the
  paper's lightweight/dynamic convolution (a depthwise convolution is a
  lightweight one without its softmax-normalised, head-shared filters). One
  output projection over the concatenation replaces the two branches' own.

  Args:
    x: `[B, T, E]`, E even.
    query_kernel, key_kernel, value_kernel: `[E/2, H, D]`; their biases `[H, D]`.
    glu_kernel: W_g `[E/2, E]` (the first E/2 outputs the values, the rest the
      gates); glu_bias: `[E]`.
    conv_kernel: `[k, E/2]`; conv_bias: `[E/2]`.
    out_kernel: W_o `[H D + E/2, O]`; out_bias: `[O]`.
    mask: a key-padding mask `[B|1, 1, 1, T]` (the convolution cannot apply
      a pairwise one).
    is_causal: causal attention and a causal (left-padded) convolution.
    query_seq_lengths, key_value_seq_lengths: `[B]`, padding: padded tokens
      are zeroed before the convolution, masked as keys, and output zeros.
    dropout_rate, dropout_rng: dropout on the attention weights.

  Returns:
    `[B, T, O]` in x's dtype.
  """
  _check_tokens(x)
  half = _split_in_half("the channels E of x (attention and convolution halves)", x.shape[-1])
  num_heads, head_dim = jnp.shape(query_kernel)[1:]
  for name, array, expected in (
      ("query_kernel", query_kernel, (half, num_heads, head_dim)),
      ("key_kernel", key_kernel, (half, num_heads, head_dim)),
      ("value_kernel", value_kernel, (half, num_heads, head_dim)),
      ("query_bias", query_bias, (num_heads, head_dim)),
      ("key_bias", key_bias, (num_heads, head_dim)),
      ("value_bias", value_bias, (num_heads, head_dim)),
      ("glu_kernel", glu_kernel, (half, 2 * half)), ("glu_bias", glu_bias, (2 * half,)),
      ("conv_kernel", conv_kernel, (None, half)),
      ("out_kernel", out_kernel, (num_heads * head_dim + half, None))):
    common.check_per_head(name, array, expected)
  valid = real_tokens("lite", x, mask, query_seq_lengths, key_value_seq_lengths)
  attention_inputs, conv_inputs = x[..., :half], x[..., half:]
  project = lambda kernel, bias: jnp.einsum("bte,ehd->bthd", attention_inputs, kernel) + bias
  heads = dot_product_attention(
      project(query_kernel, query_bias), project(key_kernel, key_bias),
      project(value_kernel, value_bias), mask=mask, is_causal=is_causal,
      query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
      dropout_rate=dropout_rate, dropout_rng=dropout_rng)
  values, gates = jnp.split(conv_inputs @ glu_kernel + glu_bias, 2, axis=-1)
  conv = depthwise_convolution(zero_padding(values * jax.nn.sigmoid(gates), valid), conv_kernel,
                               conv_bias, is_causal=is_causal)
  both = jnp.concatenate([heads.reshape(x.shape[:2] + (-1,)).astype(conv.dtype), conv], axis=-1)
  return zero_padding(both @ out_kernel + out_bias, valid).astype(x.dtype)


class LongShortRangeAttention(nn.Module):
  """`lite` as a token mixer (the mixer contract): `long_short_range_attention`
  with its parameters. Causal when called with `is_causal`.

  Attributes:
    num_heads: H, the attention branch's heads over E / 2 channels (H must
      divide E / 2).
    kernel_size: k, the convolution's width in tokens.
    dropout_rate: dropout on the attention weights.
    dtype, param_dtype: computation and parameter dtypes.
  """

  num_heads: int
  kernel_size: int = 7
  dropout_rate: float = 0.0
  dtype: Optional[Dtype] = None
  param_dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, x: Array, context: Optional[Array] = None, *, mask=None,
               is_causal: bool = False, query_seq_lengths=None, key_value_seq_lengths=None,
               segment_ids=None, positions=None, deterministic: bool = True, carry=None):
    """The mixer contract. x: `[B, T, E]`, E even; mask: key padding `[B|1, 1,
    1, T]`; query_seq_lengths / key_value_seq_lengths: `[B]`; positions: not
    used (no relative positions); carry: passed through. Returns `[B, T, E]`
    (with the carry when given one)."""
    del positions
    # The convolution would run across packed segments' borders.
    common.reject_unsupported("lite", context=context, segment_ids=segment_ids)
    _check_tokens(x)
    features = x.shape[-1]
    half = _split_in_half("the model width E (lite splits it between attention and "
                          "convolution)", features)
    num_heads = common.check_size("num_heads", self.num_heads)
    if half % num_heads:
      raise ValueError(f"num_heads={num_heads} must divide the attention half of the width, "
                       f"E / 2 = {half}.")
    head_dim = half // num_heads
    size = common.check_size("kernel_size", self.kernel_size)
    dense_init = nn.initializers.lecun_normal()
    heads_init = nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal",
                                                  in_axis=0, out_axis=(1, 2))
    zeros = nn.initializers.zeros_init()
    heads_shape, bias_shape = (half, num_heads, head_dim), (num_heads, head_dim)
    dtype = _computation_dtype(self, x)
    arrays = _params(
        self, dtype, query_kernel=(heads_shape, heads_init), query_bias=(bias_shape, zeros),
        key_kernel=(heads_shape, heads_init), key_bias=(bias_shape, zeros),
        value_kernel=(heads_shape, heads_init), value_bias=(bias_shape, zeros),
        glu_kernel=((half, features), dense_init), glu_bias=((features,), zeros),
        conv_kernel=((size, half), nn.initializers.lecun_normal(in_axis=0, out_axis=1)),
        conv_bias=((half,), zeros), out_kernel=((features, features), dense_init),
        out_bias=((features,), zeros))
    out = long_short_range_attention(
        x.astype(dtype), mask=mask, is_causal=is_causal, query_seq_lengths=query_seq_lengths,
        key_value_seq_lengths=key_value_seq_lengths, dropout_rate=self.dropout_rate,
        dropout_rng=_dropout_rng(self, deterministic), **arrays)
    return common.mixer_output(out, carry)


_MIXING = dict(family="mixing", exact=False, cross=False, qkv=False)
_FIXED_LENGTH = "T, the sequence length the weights are sized for (another length is refused)"
registry.register(registry.VariantSpec(
    name="fnet", fn=fourier_mixing, complexity="O(T log T)", subquadratic=True, causal=False,
    paper="Lee-Thorp et al. 2021", mixer=FourierMixing, **_MIXING))
registry.register(registry.VariantSpec(
    name="mlp_mixer", fn=token_mixing_mlp, complexity="O(T F)", subquadratic=True,
    causal=False, paper="Tolstikhin et al. 2021", mixer=TokenMixingMLP,
    options=dict(max_length=_FIXED_LENGTH,
                 hidden_dim="F, the token-mixing MLP's hidden width; E / 2 when None"),
    **_MIXING))
registry.register(registry.VariantSpec(
    name="gmlp", fn=gated_mlp, complexity="O(T^2)", subquadratic=False, causal=True,
    paper="Liu et al. 2021", mixer=GatedMLP,
    options=dict(max_length=_FIXED_LENGTH,
                 hidden_dim="F, the width of the gated activations (even, split into gate and "
                            "gated halves); 2 E when None"),
    not_decodable="its spatial projection W [T, T] mixes the whole sequence at once; a decoding "
                  "step would need every earlier token's normalised half, which GatedMLP does "
                  "not cache",
    **_MIXING))
registry.register(registry.VariantSpec(
    name="xca", fn=cross_covariance_attention, family="mixing", complexity="O(T D^2)",
    subquadratic=True, exact=False, causal=False, cross=False, paper="El-Nouby et al. 2021",
    extras=CrossCovarianceTemperature))
registry.register(registry.VariantSpec(
    name="lite", fn=long_short_range_attention, complexity="O(T^2)", subquadratic=False,
    causal=True, paper="Wu et al. 2020", mixer=LongShortRangeAttention,
    options=dict(kernel_size="k, the convolution branch's width in tokens"),
    not_decodable="LongShortRangeAttention keeps neither a KV cache for its attention half nor "
                  "the last k - 1 tokens for its convolution half",
    **_MIXING))
