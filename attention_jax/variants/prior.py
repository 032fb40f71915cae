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
attention; the saving of the paper is in not computing q k^T. They read no
key projection (and the random ones no query projection either), so
`MultiHeadAttention` makes none (`unused_projections` of their modules).

`mix_dot_product=True` adds the scaled q . k logits to the synthetic ones
before the one softmax: the LRA release's "Synthesizer" (models/synthesizer/
synthesizer_attention.py, `synthetic_attention` with its default
`ignore_dot_product=False`), the paper's Random + Vanilla mixture without the
paper's learned mixing weights (the release adds the logits as they are).

Gaussian Transformer (Guo et al. 2019), `gaussian_transformer`: dot-product
attention with the learned distance prior -|w (i - j)^2 + b| (w, b per head)
added to the logits, O(T^2).

Localness modelling (Yang et al. 2018), `gaussian_local`: dot-product
attention with the Gaussian bias -(j - P_i)^2 / (2 sigma_i^2) whose centre P_i
and width sigma_i each query predicts from its own projection, O(T^2).

Conditionally adaptive attention (Pilault et al. 2021), `conditional_adapter`:
dot-product attention plus a learned block-diagonal bias whose blocks a FiLM
of each example's task embedding modulates; the task ids come per call
(`attention_arguments={"task_ids": ids}`), O(T^2).

Hard-coded Gaussian attention (You et al. 2020), `hard_coded_gaussian`: fixed
weights exp(-(j - (i + offset))^2 / (2 sigma^2)) normalised over the allowed
keys, no queries or keys; within `window` keys of the centre it is `sparse`'s
band with logits from the positions, O(T w).

Average Attention Network (Zhang et al. 2018), `average`: not Q/K/V attention
but a token mixer (`AverageAttention`): each position's cumulative average of
the inputs, a feed-forward layer and input/forget gates, O(T), decodable one
token at a time with O(1) state (`average_attention_step`, or the module's
`decode`).

RealFormer (He et al. 2020), `realformer`: residual attention, each layer's
logits plus the previous layer's. The scores flow from block to block in the
layer stack's carry (`carries=("attention_scores",)` in the registry).

Predictive attention (Wang et al. 2021), `predictive`: each layer's logits
mixed with a 2-D convolution of the previous layer's attention map, carried
likewise (`carries=("attention_maps",)`), O(T^2).
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Optional, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from attention_jax import registry
from attention_jax.core.masks import length_predicate, make_attention_mask, split_segment_ids
from attention_jax.core.softmax import masked_softmax
from attention_jax.variants import common
from attention_jax.variants.dense import dot_product_attention, prepare_batched_inputs
from attention_jax.variants.sparse.windows import positional_band_attention

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


# --------------------------------------------------------------------------------------
# Priors added to the dot-product logits.


def _prior_attention(query: Array, key: Array, value: Array, prior: Array,
                     bias: Optional[Array], mask: Optional[Array], *, scale: Optional[float],
                     **kwargs) -> Array:
  """`dot_product_attention` with `prior` `[B|1, H, Tq, Tk]` added to its logits
  (and to `bias`): the masks, padding and dropout in `kwargs` are its."""
  if bias is not None:
    prior = prior + jnp.asarray(bias, jnp.float32)
  return dot_product_attention(query, key, value, prior, mask, scale=scale, **kwargs)


# --------------------------------------------------------------------------------------
# Gaussian Transformer: a learned prior on the distance i - j.


@common.passes_on_masks
def gaussian_transformer_attention(query: Array, key: Array, value: Array,
                                   bias: Optional[Array] = None, mask: Optional[Array] = None, *,
                                   distance_weight: Array, distance_bias: Array,
                                   query_positions: Optional[Array] = None,
                                   scale: Optional[float] = None, **kwargs) -> Array:
  """The Gaussian Transformer's attention (Guo et al. 2019):

      out = softmax(q k^T * scale - |w_h (i - j)^2 + b_h| + bias, masked) v,

  a Gaussian-shaped prior on the distance between query position i and key
  position j (w > 0, b = 0: exp(-w (i - j)^2) times the dot-product weights;
  b < 0 moves the peak to |i - j| = sqrt(-b / w)). w = b = 0 is dot-product
  attention. The prior is a bias for `dot_product_attention`, so masks,
  padding and dropout are its.

  Args:
    query, key, value, bias, mask: as in `dot_product_attention`.
    distance_weight: w `[H]`, one per query head.
    distance_bias: b `[H]`.
    query_positions: `[Tq]` or `[B, Tq]`, the positions i of the queries
      (`arange(Tq)` when None; `MultiHeadAttention` passes its positions,
      offset while decoding); key j is at position j.
    scale: logit scale, 1/sqrt(D) when None.
    **kwargs: the masks of `dot_product_attention` (is_causal,
      query_seq_lengths, key_value_seq_lengths, segment_ids) and dropout.

  Returns:
    `[B, Tq, H, Dv]`.
  """
  batch, q_len, num_heads = query.shape[:3]
  common.check_per_head("distance_weight", distance_weight, (num_heads,))
  common.check_per_head("distance_bias", distance_bias, (num_heads,))
  positions = common.query_positions(query_positions, batch, q_len)
  squared = jnp.square(positions[:, :, None] - jnp.arange(key.shape[1], dtype=jnp.float32))
  weight = jnp.asarray(distance_weight, jnp.float32)[None, :, None, None]
  offset = jnp.asarray(distance_bias, jnp.float32)[None, :, None, None]
  prior = -jnp.abs(weight * squared[:, None] + offset)  # [B, H, Tq, Tk]
  return _prior_attention(query, key, value, prior, bias, mask, scale=scale, **kwargs)


class GaussianDistancePrior(nn.Module):
  """`gaussian_transformer`'s w and b, `[H]` each, learned.

  They start at `initial_weight` and `initial_bias` rather than zero: the
  gradient of |w d^2 + b| vanishes at w = b = 0 (d|x|/dx is taken as 0 there),
  so a prior started at zero would never move.

  Attributes:
    initial_weight: w at initialisation (0.1: the weight of a key 3 positions
      away is multiplied by exp(-0.9)).
    initial_bias: b at initialisation.
  """

  initial_weight: float = 0.1
  initial_bias: float = 0.0

  @nn.compact
  def __call__(self, query, key, value, deterministic: bool = True) -> dict:
    del key, value, deterministic
    heads = query.shape[2]
    constant = lambda v: (lambda rng, shape: jnp.full(shape, v, jnp.float32))
    return dict(distance_weight=self.param("distance_weight", constant(self.initial_weight),
                                           (heads,)),
                distance_bias=self.param("distance_bias", constant(self.initial_bias), (heads,)))


registry.register(registry.VariantSpec(
    name="gaussian_transformer", fn=gaussian_transformer_attention, family="prior",
    complexity="O(T^2)", subquadratic=False, exact=False, causal=True, cross=True,
    paper="Guo et al. 2019", extras=GaussianDistancePrior,
    options=dict(initial_weight="w at initialisation, per head (the prior -|w (i-j)^2 + b|)",
                 initial_bias="b at initialisation, per head",
                 scale="multiplies the q . k logits; 1/sqrt(D) when None")))


# --------------------------------------------------------------------------------------
# Localness modelling: a Gaussian bias with a predicted centre and window.


@common.passes_on_masks
def gaussian_local_attention(query: Array, key: Array, value: Array,
                             bias: Optional[Array] = None, mask: Optional[Array] = None, *,
                             position_kernel: Array, center_vector: Array, window_vector: Array,
                             key_value_seq_lengths: Optional[Array] = None,
                             scale: Optional[float] = None, **kwargs) -> Array:
  """Localness modelling (Yang et al. 2018, eqs. 5-9), per head h and query i:

      P_i = T sigmoid(U_p^T tanh(W_p q_i)),   D_i = T sigmoid(U_d^T tanh(W_p q_i)),
      sigma_i = D_i / 2,   G_ij = -(j - P_i)^2 / (2 sigma_i^2),
      out = softmax(q k^T * scale + G + bias, masked) v.

  P_i is the predicted centre and D_i the predicted window of query i's local
  region, both in (0, T); the one W_p is shared by the two predictions, as in
  the paper. T is the paper's I, the input length: here the row's valid key
  count `key_value_seq_lengths[b]`, or Tk without it, so a padded row's centres
  are those of the unpadded sequence (a key-padding `mask` masks keys but does
  not change T: pass lengths for that). Causal or not, T is the key count:
  the bias then depends on the length, never on a later token's content.
  The bias is an additive `bias` for `dot_product_attention`, so masks,
  padding (weight 0) and dropout are its. O(T^2).

  Args:
    query, key, value, bias, mask: as in `dot_product_attention`.
    position_kernel: W_p `[H, D, D]`, `[h, d_in, d_out]`.
    center_vector: U_p `[H, D]`.
    window_vector: U_d `[H, D]`.
    key_value_seq_lengths: `[B]` valid keys, T of each row (Tk when None).
    scale: the q . k logits' scale, 1/sqrt(D) when None.
    **kwargs: the other masks of `dot_product_attention` (is_causal,
      query_seq_lengths, segment_ids) and dropout.

  Returns:
    `[B, Tq, H, Dv]`.
  """
  batch, _, num_heads, head_dim = query.shape
  kv_len = key.shape[1]
  common.check_per_head("position_kernel", position_kernel, (num_heads, head_dim, head_dim))
  common.check_per_head("center_vector", center_vector, (num_heads, head_dim))
  common.check_per_head("window_vector", window_vector, (num_heads, head_dim))
  length = jnp.full((batch,), kv_len, jnp.float32) if key_value_seq_lengths is None else \
      jnp.asarray(key_value_seq_lengths, jnp.float32)
  if length.shape != (batch,):
    raise ValueError(f"key_value_seq_lengths must be [B] = [{batch}], got shape "
                     f"{list(length.shape)}.")
  hidden = jnp.tanh(jnp.einsum("bqhd,hde->bhqe", query.astype(jnp.float32),
                               jnp.asarray(position_kernel, jnp.float32)))
  length = length[:, None, None]
  center = length * jax.nn.sigmoid(jnp.einsum("bhqe,he->bhq", hidden, center_vector))
  window = length * jax.nn.sigmoid(jnp.einsum("bhqe,he->bhq", hidden, window_vector))
  # sigmoid underflows to 0 below about -88 in float32; a floor keeps 1 / sigma^2
  # finite there (such a window is far narrower than one position anyway).
  variance = 2.0 * jnp.square(jnp.maximum(window, 1e-3) / 2.0)
  distance = jnp.arange(kv_len, dtype=jnp.float32) - center[..., None]
  local_bias = -jnp.square(distance) / variance[..., None]  # [B, H, Tq, Tk]
  return _prior_attention(query, key, value, local_bias, bias, mask, scale=scale,
                          key_value_seq_lengths=key_value_seq_lengths, **kwargs)


class LocalnessPredictor(nn.Module):
  """`gaussian_local`'s W_p `[H, D, D]`, U_p and U_d `[H, D]`, learned per head.

  Attributes:
    param_dtype: dtype of the parameters.
  """

  param_dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, query, key, value, deterministic: bool = True) -> dict:
    del key, value, deterministic
    _, _, num_heads, head_dim = query.shape
    vector_init = nn.initializers.normal(head_dim ** -0.5)
    return dict(
        position_kernel=self.param("position_kernel", _PER_HEAD_KERNEL,
                                   (num_heads, head_dim, head_dim), self.param_dtype),
        center_vector=self.param("center_vector", vector_init, (num_heads, head_dim),
                                 self.param_dtype),
        window_vector=self.param("window_vector", vector_init, (num_heads, head_dim),
                                 self.param_dtype))


registry.register(registry.VariantSpec(
    name="gaussian_local", fn=gaussian_local_attention, family="prior", complexity="O(T^2)",
    subquadratic=False, exact=False, causal=True, cross=True, paper="Yang et al. 2018",
    extras=LocalnessPredictor,
    options=dict(scale="multiplies the q . k logits; 1/sqrt(D) when None")))


# --------------------------------------------------------------------------------------
# Conditionally adaptive attention: a task-conditioned block-diagonal bias.


def task_film(task_ids: Optional[Array], task_embeddings: Array, film_kernel: Array,
              film_bias: Array, batch: int) -> Tuple[Array, Array]:
  """FiLM parameters of each example's task: (gamma, beta) = split(z W + b).

  Args:
    task_ids: `[B]` ints in [0, K), or None: every example is task 0 (a model
      that names no task runs as a single-task one).
    task_embeddings: z, `[K, Z]`, one row per task.
    film_kernel: W `[Z, 2 b]`; film_bias: b `[2 b]`. The first b outputs are
      gamma, the last b beta.
    batch: B.

  Returns:
    (gamma `[B, b]`, beta `[B, b]`) float32.
  """
  num_tasks, task_dim = jnp.shape(task_embeddings)
  common.check_per_head("film_kernel", film_kernel, (task_dim, None))
  common.check_per_head("film_bias", film_bias, (jnp.shape(film_kernel)[1],))
  if jnp.shape(film_kernel)[1] % 2:
    raise ValueError(f"film_kernel must be [Z, 2 b] (gamma's b outputs, then beta's), got "
                     f"{list(jnp.shape(film_kernel))}.")
  if task_ids is None:
    task_ids = jnp.zeros((batch,), jnp.int32)
  task_ids = jnp.asarray(task_ids)
  if task_ids.shape != (batch,) or not jnp.issubdtype(task_ids.dtype, jnp.integer):
    raise ValueError(f"task_ids must be ints of shape [B] = [{batch}], got {task_ids.dtype} "
                     f"of shape {list(task_ids.shape)}.")
  if not isinstance(task_ids, jax.core.Tracer):
    ids = np.asarray(task_ids)
    if ids.min() < 0 or ids.max() >= num_tasks:
      raise ValueError(f"task_ids must be in [0, num_tasks) = [0, {num_tasks}), got "
                       f"{ids.tolist()}.")
  # Under jit the ids cannot be checked; an unknown task gets NaN, never another
  # task's embedding.
  embedding = jnp.take(jnp.asarray(task_embeddings, jnp.float32), task_ids, axis=0,
                       mode="fill", fill_value=jnp.nan)
  film = embedding @ jnp.asarray(film_kernel, jnp.float32) + jnp.asarray(film_bias, jnp.float32)
  gamma, beta = jnp.split(film, 2, axis=-1)
  return gamma, beta


def conditional_block_bias(block_logits: Array, gamma: Array, beta: Array,
                           length: int) -> Array:
  """M(z) = diag(A'_1, ..., A'_N), A'_n = A_n gamma(z) + beta(z), cut to T x T.

  Block n covers positions [n b, (n + 1) b); entries outside the diagonal
  blocks are 0. gamma and beta scale and shift each column of a block (the
  FiLM of a block row's b features): A'_n[r, c] = A_n[r, c] gamma[c] + beta[c].

  Args:
    block_logits: A `[H, N, b, b]`, N b >= `length`.
    gamma, beta: `[B, b]`, each example's task's.
    length: T.

  Returns:
    `[B, H, T, T]` float32.
  """
  num_heads, num_blocks, block, _ = jnp.shape(block_logits)
  positions = jnp.arange(length)
  block_of, within = positions // block, positions % block
  same_block = block_of[:, None] == block_of[None, :]
  # A[h, n(i), i mod b, j mod b], one gather; entries off the diagonal blocks unused.
  logits = jnp.asarray(block_logits, jnp.float32)[:, block_of[:, None], within[:, None],
                                                  within[None, :]]  # [H, T, T]
  gamma_columns = jnp.asarray(gamma, jnp.float32)[:, None, None, within]  # [B, 1, 1, T]
  beta_columns = jnp.asarray(beta, jnp.float32)[:, None, None, within]
  return jnp.where(same_block, logits[None] * gamma_columns + beta_columns, 0.0)


@common.passes_on_masks
def conditional_adapter_attention(query: Array, key: Array, value: Array,
                                  bias: Optional[Array] = None, mask: Optional[Array] = None, *,
                                  block_logits: Array, task_embeddings: Array, film_kernel: Array,
                                  film_bias: Array, task_ids: Optional[Array] = None,
                                  scale: Optional[float] = None, **kwargs) -> Array:
  """Conditional attention of CA-MTL (Pilault et al. 2021, sec. 2.1):

      out = softmax(q k^T * scale + M(z) + bias, masked) v,
      M(z) = diag(A'_1, ..., A'_N),   A'_n = A_n gamma(z) + beta(z),

  a learned block-diagonal bias on the logits (blocks of b positions, one
  matrix A_n per block and head), modulated by a FiLM of the task embedding
  z of each example (`task_film`, `conditional_block_bias`). With A = 0, or
  gamma = beta = 0, it is dot-product attention; gamma = 1, beta = 0 leaves
  the bias A unmodulated. Masks, padding and dropout are
  `dot_product_attention`'s. Self-attention (the blocks are on the diagonal
  of a square matrix), O(T^2).

  Args:
    query, key, value, bias, mask: as in `dot_product_attention`.
    block_logits: A `[H, N, b, b]`; N b must cover the sequence.
    task_embeddings: z `[K, Z]` for K tasks.
    film_kernel, film_bias: `[Z, 2 b]`, `[2 b]`, (gamma, beta) = split(z W + b).
    task_ids: `[B]` ints, each example's task (per batch, so passed per call:
      `MultiHeadAttention(...)(x, attention_arguments={"task_ids": ids})`);
      None: task 0 for every example.
    scale: the q . k logits' scale, 1/sqrt(D) when None.
    **kwargs: the masks of `dot_product_attention` (is_causal,
      query_seq_lengths, key_value_seq_lengths, segment_ids) and dropout.

  Returns:
    `[B, T, H, Dv]`.
  """
  batch, length, num_heads = query.shape[:3]
  if key.shape[1] != length:
    raise ValueError(f"conditional_adapter is self-attention: the key length ({key.shape[1]}) "
                     f"must equal the query length ({length}).")
  shape = tuple(jnp.shape(block_logits))
  common.check_per_head("block_logits", block_logits, (num_heads, None, None, None))
  if shape[2] != shape[3] or shape[1] * shape[2] < length:
    raise ValueError(f"block_logits must be [H, N, b, b] with N b >= T = {length}, got "
                     f"{list(shape)}; raise max_length.")
  gamma, beta = task_film(task_ids, task_embeddings, film_kernel, film_bias, batch)
  if gamma.shape[-1] != shape[2]:
    raise ValueError(f"film_kernel must be [Z, 2 b] with b = {shape[2]} (block_logits' block "
                     f"size), got {list(jnp.shape(film_kernel))}.")
  task_bias = conditional_block_bias(block_logits, gamma, beta, length)
  return _prior_attention(query, key, value, task_bias, bias, mask, scale=scale, **kwargs)


class TaskConditioning(nn.Module):
  """`conditional_adapter`'s arrays: A `[H, N, b, b]` (N = ceil(max_length / b)),
  the task embeddings `[K, Z]` and the FiLM layer `[Z, 2 b]`, `[2 b]`.

  A starts at zero and the FiLM at gamma = 1, beta = 0 (zero kernel), so a new
  layer is dot-product attention for every task; the task embeddings start
  random so that the tasks' FiLMs part as soon as the kernel learns.

  Attributes:
    num_tasks: K.
    task_dim: Z.
    block_size: b, the positions per diagonal block.
    max_length: the longest sequence the blocks cover.
    param_dtype: dtype of the parameters.
  """

  num_tasks: int = 8
  task_dim: int = 32
  block_size: int = 16
  max_length: int = 512
  param_dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, query, key, value, deterministic: bool = True) -> dict:
    del key, value, deterministic
    num_heads = query.shape[2]
    block = common.check_size("block_size", self.block_size)
    num_blocks = -(-common.check_size("max_length", self.max_length) // block)
    task_dim = common.check_size("task_dim", self.task_dim)
    film_bias = lambda rng, shape, dtype: jnp.concatenate(
        [jnp.ones(shape[0] // 2, dtype), jnp.zeros(shape[0] // 2, dtype)])
    return dict(
        block_logits=self.param("block_logits", nn.initializers.zeros_init(),
                                (num_heads, num_blocks, block, block), self.param_dtype),
        task_embeddings=self.param("task_embeddings", nn.initializers.normal(1.0),
                                   (common.check_size("num_tasks", self.num_tasks), task_dim),
                                   self.param_dtype),
        film_kernel=self.param("film_kernel", nn.initializers.zeros_init(),
                               (task_dim, 2 * block), self.param_dtype),
        film_bias=self.param("film_bias", film_bias, (2 * block,), self.param_dtype))


registry.register(registry.VariantSpec(
    name="conditional_adapter", fn=conditional_adapter_attention, family="prior",
    complexity="O(T^2)", subquadratic=False, exact=False, causal=True, cross=False,
    paper="Pilault et al. 2021", extras=TaskConditioning,
    options=dict(num_tasks="K, the number of tasks (task_ids in [0, K))",
                 task_dim="Z, the size of a task embedding",
                 block_size="b, positions per block of the block-diagonal bias",
                 max_length="longest sequence the blocks cover",
                 scale="multiplies the q . k logits; 1/sqrt(D) when None")))


# --------------------------------------------------------------------------------------
# Hard-coded Gaussian attention: weights from the positions alone.


def hard_coded_gaussian_attention(
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
    offset: int = 0,
    sigma: float = 1.0,
    window: Optional[int] = 8,
) -> Array:
  """Hard-coded Gaussian attention (You et al. 2020):

      weights_ij = exp(-(j - c_i)^2 / (2 sigma^2)) / sum_{j' allowed} (same),
      c_i = i + offset,   out_i = sum_j weights_ij v_j,

  over the keys that the masks allow (and, with `window`, |j - c_i| <= w);
  queries that see no key output zeros. The paper centres heads on the token
  (offset 0) or its neighbours (-1, +1). Query and key contents are not read
  (`MultiHeadAttention` makes neither projection): they only give the shapes.

  Args:
    query: `[B, T, H, D]` (shape only; a `jax.ShapeDtypeStruct` will do).
    key: `[B, T, Hkv, D]` (shape only).
    value: `[B, T, Hkv, Dv]`; query head h uses value head h // (H // Hkv).
    bias: additive logits `[B|1, H|1, Tq, Tk]`; only with `window=None`.
    mask: boolean, broadcastable to `[B, H, Tq, Tk]`; with a window only a key
      padding mask `[B|1, 1, 1, Tk]`.
    is_causal, query_seq_lengths, key_value_seq_lengths, segment_ids: as in
      `dot_product_attention`.
    offset: the centre's offset from the query position, an int.
    sigma: the Gaussian's standard deviation, in positions, > 0.
    window: w, keys farther than w from the centre get weight 0, computed as a
      band, O(T w), self-attention only (Tq == Tk); the weights are those of
      the untruncated Gaussian renormalised over the band (w = 8, sigma = 1:
      the mass left out is below 1e-14). None: every key, O(T^2), a
      `[Tq, Tk]` array of logits; Tq may differ from Tk.

  Returns:
    `[B, Tq, H, Dv]` in the value dtype.
  """
  if not isinstance(offset, int) or isinstance(offset, bool):
    raise ValueError(f"offset must be an int (0: on the token, -1/+1: previous/next), got "
                     f"{offset!r}.")
  if not sigma > 0:
    raise ValueError(f"sigma must be > 0, got {sigma!r}.")
  num_heads = query.shape[2]
  inverse_variance = 1.0 / (2.0 * float(sigma) ** 2)

  def position_logits(q_pos, k_pos):
    distance = (k_pos - (q_pos + offset)).astype(jnp.float32)
    return -jnp.square(distance) * inverse_variance

  if window is None:
    q_len, kv_len = query.shape[1], value.shape[1]
    logits = position_logits(jnp.arange(q_len)[:, None], jnp.arange(kv_len)[None, :])
    return synthesizer_attention(
        query, key, value, bias, mask, is_causal=is_causal, query_seq_lengths=query_seq_lengths,
        key_value_seq_lengths=key_value_seq_lengths, segment_ids=segment_ids,
        synthetic_logits=jnp.broadcast_to(logits, (1, num_heads, q_len, kv_len)))
  common.check_size("window", window, minimum=0)
  if key.shape[1] != query.shape[1]:
    raise ValueError(f"hard_coded_gaussian with a window is self-attention only: the query "
                     f"length ({query.shape[1]}) must equal the key length ({key.shape[1]}); "
                     f"use window=None for cross-attention.")
  # A dense bias is T x T, which the band exists to avoid.
  common.reject_unsupported("hard_coded_gaussian (with a window)", bias=bias)
  in_window = lambda q_pos, k_pos: jnp.abs(k_pos - (q_pos + offset)) <= window
  # The band [i - left, i + right] holds [c_i - w, c_i + w]; `in_window` trims it.
  return positional_band_attention(
      "hard_coded_gaussian", value, num_heads, position_logits, left=max(window - offset, 0),
      right=max(window + offset, 0), allowed=in_window, mask=mask, is_causal=is_causal,
      query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
      segment_ids=segment_ids)


class NoQueryKey(nn.Module):
  """The extras of a variant that reads neither queries nor keys
  (`hard_coded_gaussian`): no arrays, only the projections to leave out."""

  @staticmethod
  def unused_projections(options: Mapping[str, Any]) -> frozenset:
    del options
    return frozenset({"query", "key"})

  @nn.compact
  def __call__(self, query, key, value, deterministic: bool = True) -> dict:
    del query, key, value, deterministic
    return {}


registry.register(registry.VariantSpec(
    name="hard_coded_gaussian", fn=hard_coded_gaussian_attention, family="prior",
    complexity="O(T w)", subquadratic=True, exact=False, causal=True, cross=False,
    paper="You et al. 2020", extras=NoQueryKey,
    options=dict(offset="the Gaussian's centre relative to the query (0: the token, -1/+1: "
                        "the previous/next one)",
                 sigma="the Gaussian's standard deviation, in positions",
                 window="w: only keys within w of the centre, O(T w); None: every key, "
                        "O(T^2) (and cross-attention)")))


# --------------------------------------------------------------------------------------
# Average Attention Network: a cumulative average, a feed-forward layer and gates.

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
    subquadratic=False, exact=False, causal=True, cross=True, paper="He et al. 2020",
    options=dict(residual_weight="w: weight of the previous layer's scores (0: vanilla)",
                 scale="multiplies the logits; 1/sqrt(D) when None"),
    carries=(SCORES,), initial_carry=_realformer_initial_carry,
    not_decodable="its carry holds the previous layer's whole [T, T] scores"))



# --------------------------------------------------------------------------------------
# Predictive attention: the previous layer's maps through a 2-D convolution.

MAPS = "attention_maps"  # the carry key predictive attention reads and writes


def predict_maps(previous: Array, conv_kernel: Array, *, is_causal: bool = False) -> Array:
  """g(A): a 2-D convolution over the `[Tq, Tk]` plane with the heads as channels.

  previous: `[B, H, Tq, Tk]`; conv_kernel: `[k, k, H, H]` (rows, columns, in,
  out heads), k odd. Zero padding keeps the size. Causal: the query axis is
  padded above only, so row i reads rows i - k + 1 .. i and never a later
  query's map (whose weights depend on later tokens); the key axis needs no
  such care, since a causal map is already zero right of its diagonal.
  Returns float32 `[B, H, Tq, Tk]`.
  """
  size = conv_kernel.shape[0]
  half = size // 2
  rows = (size - 1, 0) if is_causal else (half, half)
  return jax.lax.conv_general_dilated(
      previous.astype(jnp.float32), conv_kernel.astype(jnp.float32), window_strides=(1, 1),
      padding=(rows, (half, half)), dimension_numbers=("NCHW", "HWIO", "NCHW"))


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
  allowed weight through the convolution. g has no bias: a constant per head
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
    scores = scores + previous_weight * predict_maps(previous, conv_kernel,
                                                     is_causal=is_causal)
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
    subquadratic=False, exact=False, causal=True, cross=True, paper="Wang et al. 2021",
    extras=PredictiveConvolution,
    options=dict(previous_weight="a: S = (1 - a) q . k + a conv(previous map); 0 is vanilla",
                 kernel_size="k, the convolution's odd window over (query, key) positions",
                 scale="multiplies the logits; 1/sqrt(D) when None"),
    carries=(MAPS,), initial_carry=_predictive_initial_carry,
    not_decodable="its carry holds the previous layer's whole [T, T] attention map"))

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
    name="synthesizer_dense", extras=DenseSyntheticLogits,
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
                                       options=_RANDOM, not_decodable=_TABLE_NOT_DECODABLE,
                                       **_SYNTHESIZER))
registry.register(registry.VariantSpec(
    name="synthesizer_factorized", extras=FactorizedSyntheticLogits,
    not_decodable=_TABLE_NOT_DECODABLE,
    options=dict(_RANDOM, rank="rank of the factorised logits"), **_SYNTHESIZER))
