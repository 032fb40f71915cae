"""Attention with a prior: scores that do not come from query-key dot products.

Synthesizer (Tay et al. 2021): the attention logits are synthesised without
token-token interactions, then softmax-normalised and applied to the values.

* `synthesizer_dense`: each query position's logits over key positions come
  from an MLP of that token alone, B_i = W2 relu(W1 x_i + b1) + b2 in R^Tmax,
  truncated to the Tk keys. x_i is the per-head query projection, so each head
  has its own MLP and the layer is still `MultiHeadAttention`.
* `synthesizer_random`: a matrix R [H, Tmax, Tmax] of logits, learned or fixed.
* `synthesizer_factorized`: R = R1 R2^T with R1, R2 [H, Tmax, k].

All three are `synthesizer_attention` with the logits made by their `extras`
module. The logits are [B|1, H, Tq, Tk], so the cost is O(T^2) like dense
attention; the saving of the paper is in not computing q k^T.

RealFormer (He et al. 2020), `realformer`: residual attention, each layer's
logits plus the previous layer's. The scores flow from block to block in the
layer stack's carry (`carries=("attention_scores",)` in the registry).
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Optional, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from attention_jax import registry
from attention_jax.core.masks import make_attention_mask, split_segment_ids
from attention_jax.core.softmax import masked_softmax
from attention_jax.variants import common
from attention_jax.variants.dense import prepare_inputs

Array = jnp.ndarray
Dtype = Any


def synthesizer_attention(
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
    synthetic_logits: Array,
    dropout_rate: float = 0.0,
    dropout_rng: Optional[jax.Array] = None,
) -> Array:
  """softmax(synthetic_logits + bias, masked) v.

  The query and key contents are not used (the extras module has already made
  the logits from what it needs); they give Tq and Tk. Padding, causal,
  segment masks and `mask` are applied to the logits by the masked softmax, so
  masked keys get exactly zero weight and queries that see nothing output zeros.

  Args:
    query: `[B, Tq, H, D]`.
    key: `[B, Tk, Hkv, D]`.
    value: `[B, Tk, Hkv, Dv]`; query head h uses value head h // (H // Hkv).
    bias: additive, broadcastable to `[B, H, Tq, Tk]`.
    mask: boolean, broadcastable to `[B, H, Tq, Tk]`; True may attend.
    is_causal: query i sees keys j <= i.
    query_seq_lengths, key_value_seq_lengths: `[B]` valid lengths.
    segment_ids: `[B, T]` or `(q_segment_ids, kv_segment_ids)`.
    synthetic_logits: `[B|1, H, Tq, Tk]` the synthesised scores.
    dropout_rate, dropout_rng: dropout on the attention weights.

  Returns:
    `[B, Tq, H, Dv]` in the value dtype.
  """
  batch, q_len, num_heads, _ = query.shape
  kv_len, num_kv_heads = key.shape[1], value.shape[2]
  expected = (batch, num_heads, q_len, kv_len)
  shape = tuple(synthetic_logits.shape)
  if len(shape) != 4 or shape[0] not in (1, batch) or shape[1:] != expected[1:]:
    raise ValueError(f"synthetic_logits must be [B|1, H, Tq, Tk] = [{batch}|1, {num_heads}, "
                     f"{q_len}, {kv_len}], got shape {list(shape)}.")
  if value.shape[1] != kv_len or num_heads % num_kv_heads:
    raise ValueError(f"value must be [B, Tk, Hkv, Dv] with Tk = {kv_len} and Hkv dividing "
                     f"H = {num_heads}, got shape {list(value.shape)}.")
  logits = synthetic_logits.astype(jnp.float32)
  if bias is not None:
    logits = logits + jnp.asarray(bias, jnp.float32)
  q_segments, kv_segments = split_segment_ids(segment_ids)
  allowed = make_attention_mask(
      q_len, kv_len, is_causal=is_causal, query_seq_lengths=query_seq_lengths,
      key_value_seq_lengths=key_value_seq_lengths, q_segment_ids=q_segments,
      kv_segment_ids=kv_segments, mask=mask)
  weights = masked_softmax(logits, allowed)
  weights = jnp.broadcast_to(weights, (batch,) + weights.shape[1:])
  weights = common.dropout_weights(weights, dropout_rate, dropout_rng)
  return common.weighted_values(weights, value.astype(jnp.float32)).astype(value.dtype)


def _check_length(variant: str, what: str, length: int, max_length: int) -> None:
  common.check_size("max_length", max_length)
  if length > max_length:
    raise ValueError(f"{variant} synthesises logits for at most max_length={max_length} "
                     f"positions, got {what}={length}; raise max_length.")


_PER_HEAD_KERNEL = nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal",
                                                    in_axis=-2, out_axis=-1, batch_axis=(0,))


class DenseSyntheticLogits(nn.Module):
  """Dense Synthesizer logits B_i = W2 relu(W1 x_i + b1) + b2, per head.

  x_i is the per-head query projection `[D]` of token i, so each head has its
  own two-layer MLP; only the first Tk of the max_length outputs are used.

  Attributes:
    max_length: Tmax, the longest key sequence the MLP can score.
    hidden_dim: width of the MLP; the head dim D when None.
    param_dtype: dtype of the MLP's parameters.
  """

  max_length: int = 512
  hidden_dim: Optional[int] = None
  param_dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, query: Array, key: Array, value: Array, *, deterministic: bool = True):
    """query `[B, Tq, H, D]` -> `{"synthetic_logits": [B, H, Tq, Tk]}`."""
    del value, deterministic
    kv_len = key.shape[1]
    _check_length("synthesizer_dense", "key length Tk", kv_len, self.max_length)
    _, _, num_heads, head_dim = query.shape
    hidden_dim = common.check_size("hidden_dim", self.hidden_dim or head_dim)
    w1 = self.param("hidden_kernel", _PER_HEAD_KERNEL, (num_heads, head_dim, hidden_dim),
                    self.param_dtype)
    b1 = self.param("hidden_bias", nn.initializers.zeros_init(), (num_heads, hidden_dim),
                    self.param_dtype)
    w2 = self.param("logits_kernel", _PER_HEAD_KERNEL, (num_heads, hidden_dim, self.max_length),
                    self.param_dtype)
    b2 = self.param("logits_bias", nn.initializers.zeros_init(), (num_heads, self.max_length),
                    self.param_dtype)
    batch = query.shape[0]
    hidden = jax.nn.relu(jnp.einsum("bqhd,hdf->bhqf", query, w1) + b1[None, :, None, :])
    # Truncating the weights, not the logits, keeps the work at Tk columns.
    # The kernel is broadcast over the batch so that (B, H) are the product's
    # batch dimensions: XLA then writes the [B, H, Tq, Tk] logits (and their
    # gradient) in place instead of transposing a [H, B, Tq, Tk] product, which
    # made this layer 2x slower on CPU at 4K tokens.
    per_example_kernel = jnp.broadcast_to(w2[None, :, :, :kv_len],
                                          (batch, num_heads, hidden_dim, kv_len))
    logits = jnp.einsum("bhqf,bhfk->bhqk", hidden, per_example_kernel)
    return dict(synthetic_logits=logits + b2[None, :, None, :kv_len])


class _RandomLogits(nn.Module):
  """A (learned or fixed) random array of logits, sliced to the sequence lengths."""

  max_length: int = 512
  trainable: bool = True
  seed: int = 0
  param_dtype: Dtype = jnp.float32

  variant = ""

  def _check_lengths(self, query: Array, key: Array) -> None:
    _check_length(self.variant, "query length Tq", query.shape[1], self.max_length)
    _check_length(self.variant, "key length Tk", key.shape[1], self.max_length)

  def _random(self, name: str, index: int, shape, stddev: float) -> Array:
    """A trainable parameter, or (trainable=False) a constant drawn from `seed`.

    The fixed matrix is deliberately not drawn from the "attention" RNG stream:
    the fixed Random Synthesizer keeps one matrix for the whole training run.
    """
    init = nn.initializers.normal(stddev)
    if self.trainable:
      return self.param(name, init, shape, self.param_dtype)
    key = jax.random.fold_in(jax.random.PRNGKey(self.seed), index)
    return jax.lax.stop_gradient(init(key, shape, self.param_dtype))


class RandomSyntheticLogits(_RandomLogits):
  """Random Synthesizer logits R[h, i, j] for query position i and key position j.

  Attributes:
    max_length: Tmax; R is `[H, Tmax, Tmax]` and both Tq and Tk must fit.
    trainable: learn R (as a parameter), or keep a fixed one drawn from `seed`.
    seed: PRNG seed of the fixed matrix.
  """

  variant = "synthesizer_random"

  @nn.compact
  def __call__(self, query: Array, key: Array, value: Array, *, deterministic: bool = True):
    """-> `{"synthetic_logits": [1, H, Tq, Tk]}`."""
    del value, deterministic
    self._check_lengths(query, key)
    logits = self._random("logits", 0, (query.shape[2], self.max_length, self.max_length), 1.0)
    return dict(synthetic_logits=logits[None, :, :query.shape[1], :key.shape[1]])


class FactorizedSyntheticLogits(_RandomLogits):
  """Factorised Random Synthesizer logits R = R1 R2^T, R1, R2 `[H, Tmax, k]`.

  Attributes:
    max_length: Tmax; both Tq and Tk must fit.
    rank: k, the inner size of the factorisation.
    trainable: learn R1, R2, or keep fixed ones drawn from `seed`.
    seed: PRNG seed of the fixed factors.
  """

  rank: int = 8

  variant = "synthesizer_factorized"

  @nn.compact
  def __call__(self, query: Array, key: Array, value: Array, *, deterministic: bool = True):
    """-> `{"synthetic_logits": [1, H, Tq, Tk]}`."""
    del value, deterministic
    self._check_lengths(query, key)
    rank = common.check_size("rank", self.rank)
    shape = (query.shape[2], self.max_length, rank)
    # Entries of R1 R2^T then have unit variance, like the unfactorised R.
    stddev = rank ** -0.25
    left = self._random("query_factor", 0, shape, stddev)[:, :query.shape[1]]
    right = self._random("key_factor", 1, shape, stddev)[:, :key.shape[1]]
    return dict(synthetic_logits=jnp.einsum("hqr,hkr->hqk", left, right)[None])


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
  inputs, unbatched = prepare_inputs(
      query, key, value, bias, mask, scale=scale, is_causal=is_causal,
      query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
      segment_ids=segment_ids)
  if unbatched:
    raise ValueError(f"realformer takes batched query [B, Tq, H, D], got shape "
                     f"{list(jnp.shape(query))}.")
  batch, q_len, num_heads, _ = inputs.query.shape
  kv_len = inputs.key.shape[1]
  key_heads = common.repeat_kv_heads(inputs.key, num_heads)
  scores = jnp.einsum("bqhd,bkhd->bhqk", inputs.query, key_heads,
                      preferred_element_type=jnp.float32) * inputs.scale
  if inputs.bias is not None:
    scores = scores + inputs.bias.astype(jnp.float32)
  previous = None if carry is None else carry.get(SCORES)
  if previous is not None:
    expected = (batch, num_heads, q_len, kv_len)
    if tuple(previous.shape) != expected:
      raise ValueError(f"carry[{SCORES!r}] must be the previous layer's scores "
                       f"[B, H, Tq, Tk] = {list(expected)}, got shape {list(previous.shape)}.")
    scores = scores + residual_weight * previous
  weights = common.dropout_weights(masked_softmax(scores, inputs.dense_mask()), dropout_rate,
                                   dropout_rng)
  out = common.weighted_values(weights, inputs.value).astype(inputs.query.dtype)
  return out, {SCORES: scores}


def _realformer_initial_carry(batch: int, length: int, num_heads: int) -> Dict[str, Array]:
  return {SCORES: jnp.zeros((batch, num_heads, length, length), jnp.float32)}


registry.register(registry.VariantSpec(
    name="realformer", fn=realformer_attention, family="prior", complexity="O(T^2)",
    subquadratic=False, exact=False, causal=True, cross=True, paper="He et al. 2020",
    options=dict(residual_weight="w: weight of the previous layer's scores (0: vanilla)",
                 scale="multiplies the logits; 1/sqrt(D) when None"),
    carries=(SCORES,), initial_carry=_realformer_initial_carry))


_SYNTHESIZER = dict(fn=synthesizer_attention, family="prior", complexity="O(T^2)",
                    subquadratic=False, exact=False, causal=True, cross=True,
                    paper="Tay et al. 2021")
_MAX_LENGTH = dict(max_length="longest key sequence the synthetic logits cover")
_RANDOM = dict(_MAX_LENGTH, trainable="learn the random logits (else fixed)",
               seed="initial logits' seed")
registry.register(registry.VariantSpec(
    name="synthesizer_dense", extras=DenseSyntheticLogits,
    options=dict(_MAX_LENGTH, hidden_dim="width of the logit MLP; the head dim when None"),
    **_SYNTHESIZER))
registry.register(registry.VariantSpec(name="synthesizer_random", extras=RandomSyntheticLogits,
                                       options=_RANDOM, **_SYNTHESIZER))
registry.register(registry.VariantSpec(
    name="synthesizer_factorized", extras=FactorizedSyntheticLogits,
    options=dict(_RANDOM, rank="rank of the factorised logits"), **_SYNTHESIZER))
