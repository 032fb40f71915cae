"""Lite Transformer's Long-Short Range Attention (Wu et al. 2020), `lite`:
dot-product attention on half the channels beside a GLU and depthwise
convolution on the other half, one output projection over both.
"""

from __future__ import annotations

from typing import Any, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from attention_jax import registry
from attention_jax.variants import common
from attention_jax.variants.dense import dot_product_attention
from attention_jax.variants.mixing import tokens

Array = jnp.ndarray
Dtype = Any


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
  tokens.check_tokens(x)
  half = tokens.split_in_half("the channels E of x (attention and convolution halves)", x.shape[-1])
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
  valid = tokens.real_tokens("lite", x, mask, query_seq_lengths, key_value_seq_lengths)
  attention_inputs, conv_inputs = x[..., :half], x[..., half:]
  project = lambda kernel, bias: jnp.einsum("bte,ehd->bthd", attention_inputs, kernel) + bias
  # The keys are masked by every padding argument, as the convolution's inputs
  # are: a token past `query_seq_lengths` alone is padding too (`real_tokens`),
  # which `dot_product_attention` would still read as a key.
  key_mask = None if valid is None else valid[:, None, None, :]
  heads = dot_product_attention(
      project(query_kernel, query_bias), project(key_kernel, key_bias),
      project(value_kernel, value_bias), mask=key_mask, is_causal=is_causal,
      query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
      dropout_rate=dropout_rate, dropout_rng=dropout_rng)
  values, gates = jnp.split(conv_inputs @ glu_kernel + glu_bias, 2, axis=-1)
  glu = tokens.zero_padding(values * jax.nn.sigmoid(gates), valid)
  conv = depthwise_convolution(glu, conv_kernel, conv_bias, is_causal=is_causal)
  both = jnp.concatenate([heads.reshape(x.shape[:2] + (-1,)).astype(conv.dtype), conv], axis=-1)
  return tokens.zero_padding(both @ out_kernel + out_bias, valid).astype(x.dtype)


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
    tokens.check_tokens(x)
    features = x.shape[-1]
    half = tokens.split_in_half("the model width E (lite splits it between attention and "
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
    dtype = tokens.computation_dtype(self, x)
    arrays = tokens.make_params(
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
        dropout_rng=tokens.module_dropout_rng(self, deterministic), **arrays)
    return common.mixer_output(out, carry)


registry.register(registry.VariantSpec(
    name="lite", fn=long_short_range_attention, complexity="O(T^2)", subquadratic=False,
    causal=True, paper="Wu et al. 2020", mixer=LongShortRangeAttention,
    options=dict(kernel_size="k, the convolution branch's width in tokens"),
    not_decodable="LongShortRangeAttention keeps neither a KV cache for its attention half nor "
                  "the last k - 1 tokens for its convolution half",
    **tokens.MIXING_SPEC))
