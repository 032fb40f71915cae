"""Average Attention Network (Zhang et al. 2018), `average`: not Q/K/V
attention but a token mixer (`AverageAttention`): each position's cumulative
average of the inputs, a feed-forward layer and input/forget gates, O(T),
decodable one token at a time with O(1) state (`average_attention_step`, or
the module's `decode`).
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from attention_jax import registry
from attention_jax.variants import common

Array = jnp.ndarray
Dtype = Any


AVERAGE_ARRAYS = ("ffn_in_kernel", "ffn_in_bias", "ffn_out_kernel", "ffn_out_bias",
                  "gate_kernel", "gate_bias")


def _check_average_arrays(features: int, arrays: Mapping[str, Array]) -> None:
  missing = [name for name in AVERAGE_ARRAYS if name not in arrays]
  unknown = sorted(set(arrays) - set(AVERAGE_ARRAYS))
  if missing or unknown:
    raise ValueError(f"average takes the arrays {AVERAGE_ARRAYS}; missing {missing}, "
                     f"unknown {unknown}.")
  hidden = arrays["ffn_in_kernel"].shape[-1]
  for name, expected in (("ffn_in_kernel", (features, None)), ("ffn_in_bias", (hidden,)),
                         ("ffn_out_kernel", (hidden, features)), ("ffn_out_bias", (features,)),
                         ("gate_kernel", (2 * features, 2 * features)),
                         ("gate_bias", (2 * features,))):
    common.check_per_head(name, arrays[name], expected)


def _average_gating(x: Array, average: Array, *, ffn_in_kernel: Array, ffn_in_bias: Array,
                    ffn_out_kernel: Array, ffn_out_bias: Array, gate_kernel: Array,
                    gate_bias: Array, dropout_rate: float = 0.0,
                    dropout_rng: Optional[jax.Array] = None) -> Array:
  """The AAN's layers after the average, position by position (eqs. 1, 3, 4):
  g = FFN(average), (i, f) = sigmoid(W [x; g] + b), i * x + f * g. `[..., E]`."""
  hidden = jax.nn.relu(average @ ffn_in_kernel + ffn_in_bias)
  hidden = common.dropout_weights(hidden, dropout_rate, dropout_rng)
  ffn = hidden @ ffn_out_kernel + ffn_out_bias
  gates = jax.nn.sigmoid(jnp.concatenate([x, ffn], axis=-1) @ gate_kernel + gate_bias)
  input_gate, forget_gate = jnp.split(gates, 2, axis=-1)
  return input_gate * x + forget_gate * ffn


def average_attention(x: Array, *, is_causal: bool = True, valid: Optional[Array] = None,
                      dropout_rate: float = 0.0, dropout_rng: Optional[jax.Array] = None,
                      **arrays: Array) -> Array:
  """The Average Attention Network's layer (Zhang et al. 2018), without the
  residual and norm that the model's block adds (eq. 5, h = LN(x + out)):

      a_t = (1 / t) sum_{k <= t} x_k                       (eq. 1, the average)
      g_t = FFN(a_t) = relu(a_t W_1 + b_1) W_2 + b_2        (eq. 1)
      i_t, f_t = sigmoid([x_t; g_t] W_g + b_g)              (eq. 3, split in two)
      out_t = i_t * x_t + f_t * g_t                         (eq. 4)

  The average is a cumulative sum over the count: O(T), never T x T.
  With `valid` it runs over the valid tokens only, a_t = sum_{k <= t, valid}
  x_k / #{k <= t valid} (zero before the first valid one); without
  `is_causal` every position gets the average of all the valid tokens (an
  encoder's form, which the paper does not have: its AAN is the decoder's).

  Args:
    x: `[B, T, E]` the inputs y of the paper.
    is_causal: the cumulative average (the paper's); False: the whole sequence's.
    valid: `[B, T]` bool, the tokens to average (padding False); all when None.
    dropout_rate, dropout_rng: dropout on the FFN's hidden activations.
    **arrays: ffn_in_kernel W_1 `[E, F]`, ffn_in_bias b_1 `[F]`, ffn_out_kernel
      W_2 `[F, E]`, ffn_out_bias b_2 `[E]`, gate_kernel W_g `[2E, 2E]` (the
      first E outputs the input gate's), gate_bias b_g `[2E]`.

  Returns:
    `[B, T, E]` in x's dtype.
  """
  if jnp.ndim(x) != 3:
    raise ValueError(f"x must be [B, T, E], got shape {list(jnp.shape(x))}.")
  batch, length, features = x.shape
  _check_average_arrays(features, arrays)
  if valid is None:
    weight = jnp.ones((batch, length), jnp.float32)
  elif tuple(jnp.shape(valid)) != (batch, length):
    raise ValueError(f"valid must be [B, T] = [{batch}, {length}], got shape "
                     f"{list(jnp.shape(valid))}.")
  else:
    weight = jnp.asarray(valid, jnp.float32)
  inputs = x.astype(jnp.float32)
  weighted = inputs * weight[..., None]
  if is_causal:
    total, count = jnp.cumsum(weighted, axis=1), jnp.cumsum(weight, axis=1)
  else:
    total = jnp.sum(weighted, axis=1, keepdims=True)
    count = jnp.sum(weight, axis=1, keepdims=True)
  # A position with no valid token so far averages nothing: zero, not 0 / 0.
  average = jnp.broadcast_to(total / jnp.maximum(count, 1.0)[..., None], inputs.shape)
  out = _average_gating(inputs, average, dropout_rate=dropout_rate, dropout_rng=dropout_rng,
                        **arrays)
  return out.astype(x.dtype)


def initial_average_state(batch: int, features: int) -> Tuple[Array, Array]:
  """The incremental AAN's state before the first token: (sum `[B, E]`, count `[B]`)."""
  return jnp.zeros((batch, features), jnp.float32), jnp.zeros((batch,), jnp.float32)


def average_attention_step(state: Tuple[Array, Array], x_t: Array,
                           **arrays: Array) -> Tuple[Tuple[Array, Array], Array]:
  """Decoding with `average_attention` (causal): O(1) state, O(1) work per token.

  Args:
    state: (running sum `[B, E]`, count `[B]`) of the tokens so far
      (`initial_average_state`).
    x_t: `[B, E]`, the new token, or `[B, T, E]`, T new tokens in order (a
      prompt in one call).
    **arrays: as in `average_attention`.

  Returns:
    (the new state, out_t shaped like x_t in its dtype), out_t equal to
    `average_attention` of every token so far at the new positions.
  """
  total, count = state
  tokens = x_t[:, None] if jnp.ndim(x_t) == 2 else x_t
  if jnp.ndim(tokens) != 3 or (tokens.shape[0], tokens.shape[2]) != tuple(total.shape):
    raise ValueError(f"x_t must be [B, E] or [B, T, E] with [B, E] = {list(total.shape)} as "
                     f"the state's sum, got shape {list(jnp.shape(x_t))}.")
  _check_average_arrays(tokens.shape[-1], arrays)
  inputs = tokens.astype(jnp.float32)
  totals = total[:, None] + jnp.cumsum(inputs, axis=1)
  counts = count[:, None] + jnp.arange(1, tokens.shape[1] + 1, dtype=jnp.float32)
  out = _average_gating(inputs, totals / counts[..., None], **arrays)
  out = out[:, 0] if jnp.ndim(x_t) == 2 else out
  return (totals[:, -1], counts[:, -1]), out.astype(x_t.dtype)


class AverageAttention(nn.Module):
  """The Average Attention Network as a token mixer (the mixer contract):
  `average_attention` with its parameters. With `decode`, the running sum
  and count live in the "cache" collection and each call continues them
  (`average_attention_step`): O(1) state per sequence, whatever its length.

  Padding (`key_value_seq_lengths` or a key-padding mask) is left out of the
  averages; queries past `query_seq_lengths` output zeros. Causal or not, the
  layer is O(T); it takes no context, segments or relative positions.

  Attributes:
    num_heads: not used (an average has no heads); the model passes it to
      every mixer.
    mlp_dim: F, the hidden size of the FFN after the average; 4 E when None.
    dropout_rate: dropout on the FFN's hidden activations.
    dtype, param_dtype: computation and parameter dtypes.
    decode: incremental decoding: initialise with any input (the state's
      size does not depend on its length), then call with the new tokens.
  """

  num_heads: Optional[int] = None
  mlp_dim: Optional[int] = None
  dropout_rate: float = 0.0
  dtype: Optional[Dtype] = None
  param_dtype: Dtype = jnp.float32
  decode: bool = False

  @nn.compact
  def __call__(self, x: Array, context: Optional[Array] = None, *, mask=None,
               is_causal: bool = False, query_seq_lengths=None, key_value_seq_lengths=None,
               segment_ids=None, positions=None, deterministic: bool = True, carry=None):
    """The mixer contract. x: `[B, T, E]`; mask: key padding `[B|1, 1, 1, T]`;
    query_seq_lengths / key_value_seq_lengths: `[B]`; positions: not needed
    (an average is order-free up to t); carry: passed through. Returns
    `[B, T, E]` (with the carry when given one)."""
    del positions
    # Averages within segments would need a segmented cumulative sum; refused.
    common.reject_unsupported("average", context=context, segment_ids=segment_ids)
    batch, length, features = x.shape
    hidden = common.check_size("mlp_dim", self.mlp_dim or 4 * features)
    dense_init = nn.initializers.xavier_uniform()
    zeros = nn.initializers.zeros_init()
    arrays = dict(
        ffn_in_kernel=self.param("ffn_in_kernel", dense_init, (features, hidden),
                                 self.param_dtype),
        ffn_in_bias=self.param("ffn_in_bias", zeros, (hidden,), self.param_dtype),
        ffn_out_kernel=self.param("ffn_out_kernel", dense_init, (hidden, features),
                                  self.param_dtype),
        ffn_out_bias=self.param("ffn_out_bias", zeros, (features,), self.param_dtype),
        gate_kernel=self.param("gate_kernel", dense_init, (2 * features, 2 * features),
                               self.param_dtype),
        gate_bias=self.param("gate_bias", zeros, (2 * features,), self.param_dtype))
    dtype = self.dtype or jnp.promote_types(x.dtype, self.param_dtype)
    arrays = {name: array.astype(dtype) for name, array in arrays.items()}
    if self.decode and self.has_variable("cache", "running_sum"):
      common.reject_unsupported("average while decoding", mask=mask,
                                key_value_seq_lengths=key_value_seq_lengths)
      running_sum, count = self.variable("cache", "running_sum"), self.variable("cache", "count")
      (running_sum.value, count.value), out = average_attention_step(
          (running_sum.value, count.value), x.astype(dtype), **arrays)
      return common.mixer_output(out, carry)
    if self.decode:  # initialisation: the state starts empty
      self.variable("cache", "running_sum", jnp.zeros, (batch, features), jnp.float32)
      self.variable("cache", "count", jnp.zeros, (batch,), jnp.float32)
      is_causal = True
    valid = common.key_padding("average", mask, key_value_seq_lengths, batch, length)
    dropout_rng = None
    if self.dropout_rate > 0.0 and not deterministic:
      dropout_rng = self.make_rng("dropout")
    out = average_attention(x.astype(dtype), is_causal=is_causal, valid=valid,
                            dropout_rate=self.dropout_rate, dropout_rng=dropout_rng, **arrays)
    if query_seq_lengths is not None:
      out = common.zero_padded_queries(out[:, :, None], query_seq_lengths)[:, :, 0]
    return common.mixer_output(out, carry)


registry.register(registry.VariantSpec(
    name="average", fn=average_attention, family="prior", complexity="O(T)", subquadratic=True,
    exact=False, causal=True, cross=False, paper="Zhang et al. 2018", qkv=False,
    mixer=AverageAttention,
    options=dict(mlp_dim="F, the hidden size of the FFN after the average; 4 E when None")))
