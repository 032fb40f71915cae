"""Scores carried from layer to layer: each layer's logits mixed with what the
layer before it computed, handed on in the layer stack's carry.

RealFormer (He et al. 2020), `realformer`: residual attention, each layer's
logits plus the previous layer's (`carries=("attention_scores",)` in the
registry).

Predictive attention (Wang et al. 2021), `predictive`: each layer's logits
mixed with a 2-D convolution of the previous layer's attention map, carried
likewise (`carries=("attention_maps",)`), O(T^2).
"""

from __future__ import annotations

from typing import Dict, Mapping, Optional, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from attention_jax import registry
from attention_jax.core.masks import length_predicate
from attention_jax.core.softmax import masked_softmax
from attention_jax.variants import common
from attention_jax.variants.dense import prepare_batched_inputs

Array = jnp.ndarray


# --------------------------------------------------------------------------------------
# RealFormer: residual attention scores.

SCORES = "attention_scores"  # the carry key RealFormer reads and writes


def realformer_attention(
    query: Array,
    key: Array,
    value: Array,
    bias: Optional[Array] = None,
    mask: Optional[Array] = None,
    *,
    is_causal: bool = False,
    query_seq_lengths: Optional[Array] = None,
    key_value_seq_lengths: Optional[Array] = None,
    segment_ids=None,
    carry: Optional[Mapping[str, Array]] = None,
    residual_weight: float = 1.0,
    scale: Optional[float] = None,
    dropout_rate: float = 0.0,
    dropout_rng: Optional[jax.Array] = None,
) -> Tuple[Array, Dict[str, Array]]:
  """RealFormer's residual attention (He et al. 2020): each layer adds the
  previous layer's pre-softmax scores to its own,

      S_l = Q K^T * scale + bias + w S_{l-1},   out = softmax(S_l, masked) V,

  and hands S_l to the next layer, so with w = 1 the scores are a running sum
  over the layers (w = 0 is vanilla attention). The carried scores are those
  before masking: each layer applies its own masks.

  Args:
    query, key, value, bias, mask, is_causal, query_seq_lengths,
      key_value_seq_lengths, segment_ids: as in `dot_product_attention`.
    carry: `{"attention_scores": [B, H, Tq, Tk]}`, the previous layer's S;
      absent (the first layer) counts as zeros.
    residual_weight: w.
    scale: logit scale, 1/sqrt(D) when None.
    dropout_rate, dropout_rng: dropout on the attention weights.

  Returns:
    `([B, Tq, H, Dv] in the query dtype, {"attention_scores": S_l float32})`.
  """
  inputs = prepare_batched_inputs(
      "realformer", query, key, value, bias, mask, scale=scale, is_causal=is_causal,
      query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
      segment_ids=segment_ids)
  scores = _scaled_scores(inputs)
  previous = _carried_map(carry, SCORES, scores.shape, "scores")
  if previous is not None:
    scores = scores + residual_weight * previous
  weights = common.dropout_weights(masked_softmax(scores, inputs.dense_mask()), dropout_rate,
                                   dropout_rng)
  out = common.weighted_values(weights, inputs.value).astype(inputs.query.dtype)
  return out, {SCORES: scores}


def _scaled_scores(inputs) -> Array:
  """q . k * scale + bias, float32 `[B, H, Tq, Tk]` (grouped K/V heads repeated)."""
  key_heads = common.repeat_kv_heads(inputs.key, inputs.query.shape[2])
  scores = jnp.einsum("bqhd,bkhd->bhqk", inputs.query, key_heads,
                      preferred_element_type=jnp.float32) * inputs.scale
  return scores if inputs.bias is None else scores + inputs.bias.astype(jnp.float32)


def _carried_map(carry: Optional[Mapping[str, Array]], name: str, shape: tuple,
                 what: str) -> Optional[Array]:
  """The previous layer's `[B, H, Tq, Tk]` map under `carry[name]`, None when
  absent (the first layer, or a direct call without a carry)."""
  previous = None if carry is None else carry.get(name)
  if previous is not None and tuple(previous.shape) != tuple(shape):
    raise ValueError(f"carry[{name!r}] must be the previous layer's {what} "
                     f"[B, H, Tq, Tk] = {list(shape)}, got shape {list(previous.shape)}.")
  return previous


def _realformer_initial_carry(batch: int, length: int, num_heads: int) -> Dict[str, Array]:
  return {SCORES: jnp.zeros((batch, num_heads, length, length), jnp.float32)}


registry.register(registry.VariantSpec(
    name="realformer", fn=realformer_attention, family="prior", complexity="O(T^2)",
    takes=("dropout",),
    subquadratic=False, exact=False, causal=True, cross=True, paper="He et al. 2020",
    options=dict(residual_weight="w: weight of the previous layer's scores (0: vanilla)",
                 scale="multiplies the logits; 1/sqrt(D) when None"),
    carries=(SCORES,), initial_carry=_realformer_initial_carry,
    not_decodable="its carry holds the previous layer's whole [T, T] scores"))


# --------------------------------------------------------------------------------------
# Predictive attention: the previous layer's maps through a 2-D convolution.

MAPS = "attention_maps"  # the carry key predictive attention reads and writes


def predict_maps(previous: Array, conv_kernel: Array, *, is_causal: bool = False,
                 q_segment_ids: Optional[Array] = None,
                 kv_segment_ids: Optional[Array] = None) -> Array:
  """g(A): a 2-D convolution over the `[Tq, Tk]` plane with the heads as channels.

  previous: `[B, H, Tq, Tk]`; conv_kernel: `[k, k, H, H]` (rows, columns, in,
  out heads), k odd. Zero padding keeps the size. Causal: the query axis is
  padded above only, so row i reads rows i - k + 1 .. i and never a later
  query's map (whose weights depend on later tokens); the key axis needs no
  such care, since a causal map is already zero right of its diagonal.

  Packed sequences (`q_segment_ids` `[B, Tq]` and `kv_segment_ids` `[B, Tk]`):
  entry (i, j) reads only rows of i's segment and columns of j's, as if each
  sequence's map were convolved alone (zero past its borders); otherwise the
  window would read the weights of the sequence packed beside it, made from
  that sequence's tokens.
  Returns float32 `[B, H, Tq, Tk]`.
  """
  size = conv_kernel.shape[0]
  half = size // 2
  rows = (size - 1, 0) if is_causal else (half, half)
  previous, conv_kernel = previous.astype(jnp.float32), conv_kernel.astype(jnp.float32)
  if q_segment_ids is None and kv_segment_ids is None:
    return jax.lax.conv_general_dilated(
        previous, conv_kernel, window_strides=(1, 1), padding=(rows, (half, half)),
        dimension_numbers=("NCHW", "HWIO", "NCHW"))
  # The convolution written as its k^2 shifted windows, each masked where the
  # entry read lies in another segment (the zero padding's entries are zero
  # anyway, whatever the padded ids compare to).
  _, _, q_len, kv_len = previous.shape
  padded = jnp.pad(previous, ((0, 0), (0, 0), rows, (half, half)))
  q_ids = jnp.pad(jnp.asarray(q_segment_ids), ((0, 0), rows))
  kv_ids = jnp.pad(jnp.asarray(kv_segment_ids), ((0, 0), (half, half)))
  out = jnp.zeros(previous.shape[:1] + (conv_kernel.shape[3], q_len, kv_len), jnp.float32)
  for r in range(size):
    same_rows = q_ids[:, r:r + q_len] == q_segment_ids  # [B, Tq]
    for c in range(size):
      same_columns = kv_ids[:, c:c + kv_len] == kv_segment_ids  # [B, Tk]
      window = padded[:, :, r:r + q_len, c:c + kv_len]
      window = jnp.where(same_rows[:, None, :, None] & same_columns[:, None, None, :], window,
                         0.0)
      out = out + jnp.einsum("bhqk,ho->boqk", window, conv_kernel[r, c])
  return out


def predictive_attention(
    query: Array,
    key: Array,
    value: Array,
    bias: Optional[Array] = None,
    mask: Optional[Array] = None,
    *,
    conv_kernel: Array,
    is_causal: bool = False,
    query_seq_lengths: Optional[Array] = None,
    key_value_seq_lengths: Optional[Array] = None,
    segment_ids=None,
    carry: Optional[Mapping[str, Array]] = None,
    previous_weight: float = 0.5,
    scale: Optional[float] = None,
    dropout_rate: float = 0.0,
    dropout_rng: Optional[jax.Array] = None,
) -> Tuple[Array, Dict[str, Array]]:
  """Predictive attention (Wang et al. 2021): each layer's logits mixed with a
  convolution of the previous layer's attention map,

      S_l = (1 - a) (Q K^T * scale + bias) + a g(A_{l-1}),
      A_l = softmax(S_l, masked),   out = A_l V,

  with g the 2-D convolution of `predict_maps` (heads as channels) and A_l
  handed to the next layer. The paper's convex mix w1 = 1 - a, w2 = a: a = 0
  is vanilla attention. The map carried is the softmax's output before
  dropout, zero at every masked entry, so padded or later tokens reach no
  allowed weight through the convolution; with `segment_ids` the convolution
  stays within each packed sequence's block of the map. g has no bias: a constant per head
  added to a whole row of logits would cancel in the softmax.

  The carried rows of padded queries are zero too. Under key-only padding
  (what `Encoder` passes) the softmax still gives a padded query a row over
  the valid keys, made from its own padded token, and the next layer's g
  reads rows i - k // 2 .. i + k // 2: that row would reach the valid queries
  beside it. A carried map links the layers of one self-attention stack (its
  shape is checked against the next layer's [Tq, Tk]), so with Tq == Tk the
  key padding (`key_value_seq_lengths`, or a mask with no query axis) marks
  the queries at the same positions as padded; query lengths, segments or a
  pairwise mask already leave such rows with no allowed key. The padded
  queries' own outputs are left as computed (meaningless, as in `Encoder`).

  Args:
    query, key, value, bias, mask, is_causal, query_seq_lengths,
      key_value_seq_lengths, segment_ids: as in `dot_product_attention`.
    conv_kernel: `[k, k, H, H]`, g's kernel (k odd).
    carry: `{"attention_maps": [B, H, Tq, Tk]}`, A_{l-1}; absent (the first
      layer) counts as zeros, so the first layer is vanilla attention with
      its logits scaled by 1 - a.
    previous_weight: a, in [0, 1].
    scale: logit scale, 1/sqrt(D) when None.
    dropout_rate, dropout_rng: dropout on the attention weights.

  Returns:
    `([B, Tq, H, Dv] in the query dtype, {"attention_maps": A_l float32})`,
    A_l's rows of padded queries zeroed.
  """
  if not 0.0 <= previous_weight <= 1.0:
    raise ValueError(f"previous_weight must be in [0, 1] (the weight a of the predicted "
                     f"map), got {previous_weight}.")
  inputs = prepare_batched_inputs(
      "predictive", query, key, value, bias, mask, scale=scale, is_causal=is_causal,
      query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
      segment_ids=segment_ids)
  num_heads = inputs.query.shape[2]
  size = jnp.shape(conv_kernel)[0]
  common.check_per_head("conv_kernel", conv_kernel, (size, size, num_heads, num_heads))
  if size % 2 == 0:
    raise ValueError(f"conv_kernel must be [k, k, H, H] with k odd (a centred window), got "
                     f"k = {size}.")
  scores = (1.0 - previous_weight) * _scaled_scores(inputs)
  previous = _carried_map(carry, MAPS, scores.shape, "attention map")
  if previous is not None:
    scores = scores + previous_weight * predict_maps(
        previous, conv_kernel, is_causal=is_causal, q_segment_ids=inputs.q_segment_ids,
        kv_segment_ids=inputs.kv_segment_ids)
  maps = masked_softmax(scores, inputs.dense_mask())
  weights = common.dropout_weights(maps, dropout_rate, dropout_rng)
  out = common.weighted_values(weights, inputs.value).astype(inputs.query.dtype)
  real_queries = _real_queries_by_key_padding(inputs)
  if real_queries is not None:
    maps = jnp.where(real_queries, maps, 0.0)
  return out, {MAPS: maps}


def _real_queries_by_key_padding(inputs) -> Optional[Array]:
  """The queries a self-attention call's key padding leaves real, as rows of
  the map: `[B|1, H|1, Tq, 1]` bool, or None when Tq != Tk or no key is
  padded (`key_value_seq_lengths`, or a mask `[B|1, H|1, 1, Tk]`)."""
  q_len, kv_len = inputs.query.shape[1], inputs.key.shape[1]
  if q_len != kv_len:
    return None
  real = None
  if inputs.key_value_seq_lengths is not None:
    lengths = jnp.asarray(inputs.key_value_seq_lengths)
    real = length_predicate(jnp.arange(kv_len)[None, :], lengths[:, None])[:, None, :]
  mask = inputs.mask
  if mask is not None and mask.shape[2] == 1 and mask.shape[3] == kv_len:
    real = mask[:, :, 0, :] if real is None else jnp.logical_and(real, mask[:, :, 0, :])
  return None if real is None else real[..., None]  # key position j is query row j


class PredictiveConvolution(nn.Module):
  """`predictive`'s convolution kernel `[k, k, H, H]`."""

  kernel_size: int = 3

  @nn.compact
  def __call__(self, query, key, value, deterministic: bool = True) -> dict:
    del key, value, deterministic
    if self.kernel_size < 1 or self.kernel_size % 2 == 0:
      raise ValueError(f"kernel_size must be an odd positive int (a centred window), got "
                       f"{self.kernel_size}.")
    num_heads = query.shape[2]
    shape = (self.kernel_size, self.kernel_size, num_heads, num_heads)
    return {"conv_kernel": self.param("conv_kernel", nn.initializers.lecun_normal(), shape)}


def _predictive_initial_carry(batch: int, length: int, num_heads: int) -> Dict[str, Array]:
  return {MAPS: jnp.zeros((batch, num_heads, length, length), jnp.float32)}


registry.register(registry.VariantSpec(
    name="predictive", fn=predictive_attention, family="prior", complexity="O(T^2)",
    takes=("dropout",),
    subquadratic=False, exact=False, causal=True, cross=True, paper="Wang et al. 2021",
    extras=PredictiveConvolution,
    options=dict(previous_weight="a: S = (1 - a) q . k + a conv(previous map); 0 is vanilla",
                 kernel_size="k, the convolution's odd window over (query, key) positions",
                 scale="multiplies the logits; 1/sqrt(D) when None"),
    carries=(MAPS,), initial_carry=_predictive_initial_carry,
    not_decodable="its carry holds the previous layer's whole [T, T] attention map"))
