"""Synthesizer (Tay et al. 2021): the attention logits are synthesised without
token-token interactions, then softmax-normalised and applied to the values.

* `synthesizer_dense`: each query position's logits over key positions come
  from an MLP of that token alone, B_i = W2 relu(W1 x_i + b1) + b2 in R^Tmax,
  truncated to the Tk keys. x_i is the per-head query projection, so each head
  has its own MLP and the layer is still `MultiHeadAttention`.
* `synthesizer_random`: a matrix R [H, Tmax, Tmax] of logits, learned or fixed.
* `synthesizer_factorized`: R = R1 R2^T with R1, R2 [H, Tmax, k].

All three are `synthesizer_attention` with the logits made by their `extras`
module. The logits are [B|1, H, Tq, Tk], so the cost is O(T^2) like dense
attention; the saving of the paper is in not computing q k^T. They read no
key projection (and the random ones no query projection either), so
`MultiHeadAttention` makes none (`unused_projections` of their modules).

`mix_dot_product=True` adds the scaled q . k logits to the synthetic ones
before the one softmax: the LRA release's "Synthesizer" (models/synthesizer/
synthesizer_attention.py, `synthetic_attention` with its default
`ignore_dot_product=False`), the paper's Random + Vanilla mixture without the
paper's learned mixing weights (the release adds the logits as they are).
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from attention_jax import registry
from attention_jax.core.masks import make_attention_mask, split_segment_ids
from attention_jax.core.softmax import masked_softmax
from attention_jax.variants import common

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
    mix_dot_product: bool = False,
    scale: Optional[float] = None,
    dropout_rate: float = 0.0,
    dropout_rng: Optional[jax.Array] = None,
) -> Array:
  """softmax(synthetic_logits [+ q . k * scale] + bias, masked) v.

  Without `mix_dot_product` the query and key contents are not used (the
  extras module has already made the logits from what it needs; the layer
  passes shape-only stand-ins for projections it does not make); they give Tq
  and Tk. Padding, causal, segment masks and `mask` are applied to the logits
  by the masked softmax, so masked keys get exactly zero weight and queries
  that see nothing output zeros.

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
    mix_dot_product: add the dot-product logits q . k * scale to them before
      the softmax (the LRA release's Random Synthesizer, R + V).
    scale: the dot-product logits' scale, 1/sqrt(D) when None; only with
      `mix_dot_product`.
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
  if mix_dot_product:
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    keys = common.repeat_kv_heads(key, num_heads)
    logits = logits + jnp.einsum("bqhd,bkhd->bhqk", query, keys,
                                 preferred_element_type=jnp.float32) * scale
  elif scale is not None:
    raise ValueError(f"scale multiplies the dot-product logits, which only mix_dot_product=True "
                     f"adds; got scale={scale!r} with mix_dot_product=False.")
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


# A kernel per head, `[H, in, out]`: LeCun-style fan-in over `in` only (biases.py's
# LocalnessPredictor makes its W_p with it too).
PER_HEAD_KERNEL = nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal",
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

  @staticmethod
  def unused_projections(options: Mapping[str, Any]) -> frozenset:
    """The projections `MultiHeadAttention` need not make: the key's, unless
    the dot-product logits are mixed in (`options["mix_dot_product"]`)."""
    return frozenset() if options.get("mix_dot_product") else frozenset({"key"})

  @nn.compact
  def __call__(self, query: Array, key: Array, value: Array, *, deterministic: bool = True):
    """query `[B, Tq, H, D]` -> `{"synthetic_logits": [B, H, Tq, Tk]}`."""
    del value, deterministic
    kv_len = key.shape[1]
    _check_length("synthesizer_dense", "key length Tk", kv_len, self.max_length)
    _, _, num_heads, head_dim = query.shape
    hidden_dim = common.check_size("hidden_dim", self.hidden_dim or head_dim)
    w1 = self.param("hidden_kernel", PER_HEAD_KERNEL, (num_heads, head_dim, hidden_dim),
                    self.param_dtype)
    b1 = self.param("hidden_bias", nn.initializers.zeros_init(), (num_heads, hidden_dim),
                    self.param_dtype)
    w2 = self.param("logits_kernel", PER_HEAD_KERNEL, (num_heads, hidden_dim, self.max_length),
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


RANDOM_LOGITS_INITS = ("normal", "xavier_uniform")


class _RandomLogits(nn.Module):
  """A (learned or fixed) random array of logits, sliced to the sequence lengths."""

  max_length: int = 512
  trainable: bool = True
  logits_init: str = "normal"
  param_dtype: Dtype = jnp.float32

  variant = ""

  @staticmethod
  def unused_projections(options: Mapping[str, Any]) -> frozenset:
    """The projections `MultiHeadAttention` need not make: query's and key's
    (the logits depend on positions only), unless the dot-product logits are
    mixed in (`options["mix_dot_product"]`)."""
    return frozenset() if options.get("mix_dot_product") else frozenset({"query", "key"})

  def _check_lengths(self, query: Array, key: Array) -> None:
    _check_length(self.variant, "query length Tq", query.shape[1], self.max_length)
    _check_length(self.variant, "key length Tk", key.shape[1], self.max_length)

  def _random(self, name: str, shape, stddev: float) -> Array:
    """A trainable parameter, or (trainable=False) a fixed array of this layer.

    "normal": N(0, stddev^2) entries; "xavier_uniform": the LRA release's
    Glorot-uniform initialisation of the array (fans over its last two axes
    times the heads). The fixed array is drawn once per layer when the model is
    initialised and kept in the "random" collection (`common.layer_random`,
    never redrawn): the fixed Random Synthesizer keeps one matrix per layer for
    the whole run.
    """
    if self.logits_init not in RANDOM_LOGITS_INITS:
      raise ValueError(f"logits_init must be one of {RANDOM_LOGITS_INITS}, got "
                       f"{self.logits_init!r}.")
    if self.logits_init == "xavier_uniform":
      init = nn.initializers.xavier_uniform()
    else:
      init = nn.initializers.normal(stddev)
    if self.trainable:
      return self.param(name, init, shape, self.param_dtype)
    fixed = common.layer_random(self, name, lambda key: init(key, shape, self.param_dtype),
                                deterministic=True, redraw_every=0)
    return jax.lax.stop_gradient(fixed)


class RandomSyntheticLogits(_RandomLogits):
  """Random Synthesizer logits R[h, i, j] for query position i and key position j.

  Attributes:
    max_length: Tmax; R is `[H, Tmax, Tmax]` and both Tq and Tk must fit.
    trainable: learn R (as a parameter), or keep the layer's initial draw fixed.
    logits_init: "normal" (N(0, 1) entries) or "xavier_uniform" (the LRA
      release's: U(-a, a) with a = sqrt(3 / (H Tmax)), so nearly zero logits).
  """

  variant = "synthesizer_random"

  @nn.compact
  def __call__(self, query: Array, key: Array, value: Array, *, deterministic: bool = True):
    """-> `{"synthetic_logits": [1, H, Tq, Tk]}`."""
    del value, deterministic
    self._check_lengths(query, key)
    logits = self._random("logits", (query.shape[2], self.max_length, self.max_length), 1.0)
    return dict(synthetic_logits=logits[None, :, :query.shape[1], :key.shape[1]])


class FactorizedSyntheticLogits(_RandomLogits):
  """Factorised Random Synthesizer logits R = R1 R2^T, R1, R2 `[H, Tmax, k]`.

  Attributes:
    max_length: Tmax; both Tq and Tk must fit.
    rank: k, the inner size of the factorisation.
    trainable: learn R1, R2, or keep the layer's initial draws fixed.
    logits_init: "normal" (entries of R1 R2^T of unit variance) or
      "xavier_uniform" (the LRA release's initialisation of R1 and R2).
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
    left = self._random("query_factor", shape, stddev)[:, :query.shape[1]]
    right = self._random("key_factor", shape, stddev)[:, :key.shape[1]]
    return dict(synthetic_logits=jnp.einsum("hqr,hkr->hqk", left, right)[None])


_SYNTHESIZER = dict(fn=synthesizer_attention, family="prior", complexity="O(T^2)",
                    subquadratic=False, exact=False, causal=True, cross=True,
                    paper="Tay et al. 2021")
_COMMON = dict(max_length="longest key sequence the synthetic logits cover",
               mix_dot_product="add the scaled q . k logits before the softmax (the LRA "
                               "release's default, R + V)",
               scale="multiplies the mixed-in q . k logits; 1/sqrt(D) when None")
_RANDOM = dict(_COMMON, trainable="learn the random logits (else fixed per layer)",
               logits_init="'normal' or 'xavier_uniform' (the LRA release) initial logits")
registry.register(registry.VariantSpec(
    name="synthesizer_dense", takes=("dropout",), extras=DenseSyntheticLogits,
    options=dict(_COMMON, hidden_dim="width of the logit MLP; the head dim when None"),
    presets={"lra_release": registry.Preset(
        options=dict(mix_dot_product=True, logits_init="xavier_uniform"),
        variant="synthesizer_random",
        doc="The release's Synthesizer (models/synthesizer/) defaults to "
            "synthesizer_mode='random' with ignore_dot_product=False: a learned "
            "[H, max_len, max_len] Glorot-uniform logit matrix added to q . k / sqrt(D) "
            "before one softmax (R + V), on every task (Text's config sets another mode at "
            "the top level, where train.py does not read it).")},
    **_SYNTHESIZER))
# The learned [Tmax, Tmax] logits are indexed by the query's row in the call
# (synthesizer_dense's come from the query token itself and decode).
_TABLE_NOT_DECODABLE = ("its learned [T, T] logits are indexed by each query's row in the call, "
                        "not by its position in the sequence")
registry.register(registry.VariantSpec(name="synthesizer_random", extras=RandomSyntheticLogits,
                                       takes=("dropout",),
                                       options=_RANDOM, not_decodable=_TABLE_NOT_DECODABLE,
                                       **_SYNTHESIZER))
registry.register(registry.VariantSpec(
    name="synthesizer_factorized", takes=("dropout",), extras=FactorizedSyntheticLogits,
    not_decodable=_TABLE_NOT_DECODABLE,
    options=dict(_RANDOM, rank="rank of the factorised logits"), **_SYNTHESIZER))
