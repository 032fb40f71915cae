"""Scoring functions (section A of VARIANTS.md): attention whose logits come
from a learned or plain score of each query-key pair, as in the RNN
translation models.

* `additive` (Bahdanau et al. 2015): score(q, k) = w^T tanh(W_q q + W_k k),
  queries and keys of different sizes allowed (each has its own projection).
* `luong_dot` (Luong et al. 2015): score(q, k) = q . k, unscaled.
* `luong_general`: score(q, k) = q^T W k.
* `luong_concat`: score(q, k) = w^T tanh(W [q; k]): the additive score with
  W = [W_q W_k], so it is computed by the same function.
* `nadaraya_watson` (Nadaraya 1964, Watson 1964; the D2L chapter's attention
  pooling): score(q, k) = -|q - k|^2 / (2 w^2), the Gaussian kernel, with a
  fixed width or one learned per head; or average pooling (every key alike).

Each is `scored_attention` with its score function; the masks, padding,
causal and segment arguments are those of `dot_product_attention`. The scores
are `[B, H, Tq, Tk]` (the additive ones pass through a `[B, H, Tq, Tk, A]`
tanh), so every one costs O(T^2) like dense attention. Their parameters are
per head and made by the variant's extras module inside `MultiHeadAttention`.
"""

from __future__ import annotations

from typing import Callable, ClassVar, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from attention_jax import registry
from attention_jax.core.masks import check_boolean_mask
from attention_jax.core.softmax import masked_softmax
from attention_jax.variants import common
from attention_jax.variants.dense import prepare_inputs

Array = jnp.ndarray
# score(query [B, Tq, H, Dq], key [B, Tk, H, Dk]) -> [B, H, Tq, Tk] float32
ScoreFn = Callable[[Array, Array], Array]


def _general_score(query: Array, key: Array, score_kernel: Array) -> Array:
  """q^T W k per head: `[B, H, Tq, Tk]`; W `[H, Dq, Dk]`."""
  common.check_per_head("score_kernel", score_kernel,
                        (query.shape[2], query.shape[3], key.shape[3]))
  return jnp.einsum("bqhd,hde,bkhe->bhqk", query, score_kernel, key)


def dot_score(query: Array, key: Array) -> Array:
  """q . k per head, unscaled: `[B, H, Tq, Tk]` float32."""
  return jnp.einsum("bqhd,bkhd->bhqk", query, key, preferred_element_type=jnp.float32)


def scored_attention(query: Array, key: Array, value: Array, score: ScoreFn,
                     bias: Optional[Array] = None, mask: Optional[Array] = None, *,
                     is_causal: bool = False, query_seq_lengths: Optional[Array] = None,
                     key_value_seq_lengths: Optional[Array] = None, segment_ids=None,
                     dropout_rate: float = 0.0, dropout_rng: Optional[jax.Array] = None,
                     weighting: Callable[[Array, Optional[Array]], Array] = masked_softmax
                     ) -> Array:
  """softmax(score(q, k) + bias, masked) v: `[B, Tq, H, Dv]` in the query dtype.

  Queries and keys may differ in their last size (the score decides what it
  accepts); grouped K/V heads are repeated to the query heads.
  `weighting(scores [B, H, Tq, Tk] float32, mask [B|1, H|1, Tq, Tk] bool or
  None)` replaces the softmax (structured attention's CRF marginals, a graph's
  adjacency, Luong's local-p softmax times a Gaussian); masked entries must get
  weight 0.
  """
  if jnp.ndim(query) != 4 or jnp.ndim(key) != 4 or jnp.ndim(value) != 4:
    raise ValueError(f"query, key and value must be [B, T, H, D], got shapes "
                     f"{list(jnp.shape(query))}, {list(jnp.shape(key))}, "
                     f"{list(jnp.shape(value))}.")
  num_heads = query.shape[2]
  # prepare_inputs checks the masks against the shapes; it needs equal q/k sizes,
  # so it sees a key with the query's last size (the score reads the real key).
  stand_in_key = jnp.zeros(key.shape[:3] + query.shape[3:], query.dtype)
  inputs, _ = prepare_inputs(query, stand_in_key, value, bias, mask, is_causal=is_causal,
                             query_seq_lengths=query_seq_lengths,
                             key_value_seq_lengths=key_value_seq_lengths,
                             segment_ids=segment_ids)
  scores = score(query, common.repeat_kv_heads(key, num_heads)).astype(jnp.float32)
  if inputs.bias is not None:
    scores = scores + inputs.bias.astype(jnp.float32)
  weights = weighting(scores, inputs.dense_mask())
  weights = common.dropout_weights(weights, dropout_rate, dropout_rng)
  return common.weighted_values(weights, inputs.value).astype(query.dtype)


def additive_attention(query: Array, key: Array, value: Array, bias: Optional[Array] = None,
                       mask: Optional[Array] = None, *, query_kernel: Array, key_kernel: Array,
                       score_vector: Array, **kwargs) -> Array:
  """Bahdanau attention: score(q, k) = w^T tanh(W_q q + W_k k), per head.

  Args:
    query: `[B, Tq, H, Dq]`; key: `[B, Tk, Hkv, Dk]`; value: `[B, Tk, Hkv, Dv]`.
    query_kernel: W_q `[H, Dq, A]`; key_kernel: W_k `[H, Dk, A]`;
    score_vector: w `[H, A]`.
    **kwargs: the masks of `dot_product_attention` (is_causal,
      query_seq_lengths, key_value_seq_lengths, segment_ids) and dropout.
  """
  num_heads, q_dim, k_dim = query.shape[2], query.shape[3], key.shape[3]
  common.check_per_head("query_kernel", query_kernel, (num_heads, q_dim, None))
  attention_dim = query_kernel.shape[-1]
  common.check_per_head("key_kernel", key_kernel, (num_heads, k_dim, attention_dim))
  common.check_per_head("score_vector", score_vector, (num_heads, attention_dim))

  def score(q, k):
    projected_q = jnp.einsum("bqhd,hda->bhqa", q, query_kernel)
    projected_k = jnp.einsum("bkhd,hda->bhka", k, key_kernel)
    hidden = jnp.tanh(projected_q[:, :, :, None, :] + projected_k[:, :, None, :, :])
    return jnp.einsum("bhqka,ha->bhqk", hidden, score_vector)

  return scored_attention(query, key, value, score, bias, mask, **kwargs)


def luong_dot_attention(query: Array, key: Array, value: Array, bias: Optional[Array] = None,
                        mask: Optional[Array] = None, **kwargs) -> Array:
  """Luong's dot score: score(q, k) = q . k (no 1/sqrt(D) scale)."""
  common.check_query_key_sizes("luong_dot", query, key)
  return scored_attention(query, key, value, dot_score, bias, mask, **kwargs)


def luong_general_attention(query: Array, key: Array, value: Array,
                            bias: Optional[Array] = None, mask: Optional[Array] = None, *,
                            score_kernel: Array, **kwargs) -> Array:
  """Luong's general score: score(q, k) = q^T W k, W `[H, Dq, Dk]` per head."""
  score = lambda q, k: _general_score(q, k, score_kernel)
  return scored_attention(query, key, value, score, bias, mask, **kwargs)


def luong_concat_attention(query: Array, key: Array, value: Array,
                           bias: Optional[Array] = None, mask: Optional[Array] = None, *,
                           concat_kernel: Array, score_vector: Array, **kwargs) -> Array:
  """Luong's concat score: score(q, k) = w^T tanh(W [q; k]), W `[H, Dq + Dk, A]`.

  W [q; k] = W[:Dq] q + W[Dq:] k, so this is `additive_attention` with the
  kernel split in two.
  """
  q_dim = query.shape[3]
  common.check_per_head("concat_kernel", concat_kernel,
                  (query.shape[2], q_dim + key.shape[3], None))
  return additive_attention(query, key, value, bias, mask,
                            query_kernel=concat_kernel[:, :q_dim],
                            key_kernel=concat_kernel[:, q_dim:], score_vector=score_vector,
                            **kwargs)


LUONG_LOCAL_MODES = ("predictive", "monotonic")
LUONG_LOCAL_SCORES = ("general", "dot")


def luong_local_attention(query: Array, key: Array, value: Array, bias: Optional[Array] = None,
                          mask: Optional[Array] = None, *, mode: str = "predictive",
                          window: int = 10, sigma: Optional[float] = None,
                          score: str = "general", score_kernel: Optional[Array] = None,
                          position_kernel: Optional[Array] = None,
                          position_vector: Optional[Array] = None,
                          query_positions: Optional[Array] = None, **kwargs) -> Array:
  """Luong's local attention: each query attends to the keys within `window`
  of an aligned position p_t (Luong et al. 2015, section 3.2):

  * "monotonic" (local-m, eq. 7): p_t = t, the query's own position, and
    a_t(s) = softmax_{|s' - p_t| <= D}(score(h_t, k_s')), the plain softmax
    over the window [p_t - D, p_t + D];
  * "predictive" (local-p): p_t = S * sigmoid(v_p^T tanh(W_p h_t)) (eq. 9),
    S the number of keys (each row's `key_value_seq_lengths` where given),
    and the window's softmax scaled by a Gaussian centred there (eq. 10),
    a_t(s) = softmax_{|s' - p_t| <= D}(score(h_t, k_s')) * exp(-(s - p_t)^2 / (2 sigma^2)),
    not renormalised after the Gaussian, as in the paper. p_t is real, so
    the Gaussian favours the keys nearest the predicted point.
    Without `key_value_seq_lengths`, S is Tk, padding included: padding
    given only through `mask` (as the encoder passes it) moves p_t, so the
    padded length changes the real tokens' outputs; and under `is_causal`
    (or while decoding, where Tk is the cache's size) query t's p_t depends
    on how many keys there are after it. The paper's S is the source length
    (cross-attention): pass `key_value_seq_lengths` (the RNN and Transformer
    seq2seq models do).

  Args:
    query: `[B, Tq, H, D]`; key: `[B, Tk, Hkv, D]`; value: `[B, Tk, Hkv, Dv]`.
    mode: "predictive" or "monotonic".
    window: D, the half-width of the window, in keys.
    sigma: local-p's Gaussian standard deviation; D / 2 when None (the
      paper). local-m has no Gaussian and refuses a sigma.
    score: "general" (q^T W k, with `score_kernel` `[H, D, D]`) or "dot".
    position_kernel: W_p `[H, D, A]`; position_vector: v_p `[H, A]` (local-p).
    query_positions: `[Tq]` or `[B, Tq]` positions t of the queries (local-m),
      `arange(Tq)` when None; `MultiHeadAttention` passes its positions,
      offset while decoding.
    **kwargs: the masks of `dot_product_attention` and dropout.
  """
  if mode not in LUONG_LOCAL_MODES:
    raise ValueError(f"mode must be one of {LUONG_LOCAL_MODES}, got {mode!r}.")
  if score not in LUONG_LOCAL_SCORES:
    raise ValueError(f"score must be one of {LUONG_LOCAL_SCORES}, got {score!r}.")
  common.check_size("window", window, minimum=0)
  if mode == "monotonic" and sigma is not None:
    # Setting it would have no effect: refuse rather than ignore it.
    raise ValueError(f"sigma is local-p's Gaussian width; mode='monotonic' (local-m) weights "
                     f"its window by the softmax alone, got sigma={sigma!r}.")
  sigma = window / 2 if sigma is None else sigma
  if mode == "predictive" and not sigma > 0:
    raise ValueError(f"sigma must be > 0 (or None for window / 2), got {sigma!r}.")
  common.check_query_key_sizes("luong_local", query, key)
  batch, q_len, num_heads, head_dim = query.shape
  kv_len = key.shape[1]
  if mode == "predictive":
    for name, array in (("position_kernel", position_kernel),
                        ("position_vector", position_vector)):
      if array is None:
        raise ValueError(f"mode='predictive' needs {name} (W_p and v_p); got None.")
    common.check_per_head("position_kernel", position_kernel, (num_heads, head_dim, None))
    common.check_per_head("position_vector", position_vector,
                          (num_heads, position_kernel.shape[-1]))
    lengths = kwargs.get("key_value_seq_lengths")
    num_keys = (jnp.full((batch,), kv_len, jnp.float32) if lengths is None
                else jnp.asarray(lengths, jnp.float32))
    hidden = jnp.tanh(jnp.einsum("bqhd,hda->bhqa", query, position_kernel))
    centre = num_keys[:, None, None] * jax.nn.sigmoid(
        jnp.einsum("bhqa,ha->bhq", hidden, position_vector).astype(jnp.float32))
  else:
    centre = common.query_positions(query_positions, batch, q_len)[:, None, :]
  distance = jnp.arange(kv_len, dtype=jnp.float32) - centre[..., None]  # [B, H|1, Tq, Tk]
  in_window = jnp.abs(distance) <= window
  # Checked here, not only by prepare_inputs: logical_and would cast a float
  # or int mask to bool first (0.3 -> True), and the check would never see it.
  check_boolean_mask(mask)
  mask = in_window if mask is None else jnp.logical_and(mask, in_window)

  score_fn = dot_score
  if score == "general":
    if score_kernel is None:
      raise ValueError("score='general' needs score_kernel (W); got None.")
    score_fn = lambda q, k: _general_score(q, k, score_kernel)
  if mode == "monotonic":  # eq. 7: the window's softmax is the weighting
    return scored_attention(query, key, value, score_fn, bias, mask, **kwargs)
  gaussian = jnp.exp(-jnp.square(distance) / (2.0 * jnp.square(jnp.float32(sigma))))
  local_weights = lambda scores, allowed: masked_softmax(scores, allowed) * gaussian
  return scored_attention(query, key, value, score_fn, bias, mask, weighting=local_weights,
                          **kwargs)


_KERNEL_INIT = nn.initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=(0,))
_VECTOR_INIT = nn.initializers.lecun_normal(in_axis=-1, out_axis=-1, batch_axis=(0,))


NADARAYA_WATSON_KERNELS = ("gaussian", "average")


def nadaraya_watson_attention(query: Array, key: Array, value: Array,
                              bias: Optional[Array] = None, mask: Optional[Array] = None, *,
                              kernel: str = "gaussian", width: float = 1.0,
                              log_width: Optional[Array] = None, **kwargs) -> Array:
  """Nadaraya-Watson kernel regression as attention: out_i = sum_j K(q_i, k_j) v_j / sum_j K.

  Args:
    kernel: "gaussian", K = exp(-|q - k|^2 / (2 w^2)), or "average", K = 1
      (the mean of the allowed values).
    width: w > 0.
    log_width: `[H]`, per-head learned log-widths added to log w (the
      parametric kernel; `NadarayaWatsonWidth` makes it), or None.
  """
  if kernel not in NADARAYA_WATSON_KERNELS:
    raise ValueError(f"kernel must be one of {NADARAYA_WATSON_KERNELS}, got {kernel!r}.")
  if not width > 0:
    raise ValueError(f"width must be > 0, got {width!r}.")
  common.check_query_key_sizes("nadaraya_watson", query, key)
  if log_width is not None:
    common.check_per_head("log_width", log_width, (query.shape[2],))

  def score(q, k):
    if kernel == "average":
      return jnp.zeros((q.shape[0], q.shape[2], q.shape[1], k.shape[1]), jnp.float32)
    # |q - k|^2 = |q|^2 - 2 q.k + |k|^2, without a [B, H, Tq, Tk, D] difference.
    squared = (jnp.sum(jnp.square(q), -1).transpose(0, 2, 1)[..., None]
               - 2.0 * jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32)
               + jnp.sum(jnp.square(k), -1).transpose(0, 2, 1)[:, :, None, :])
    widths = jnp.full((q.shape[2],), width, jnp.float32)
    if log_width is not None:
      widths = widths * jnp.exp(log_width.astype(jnp.float32))
    return -squared / (2.0 * jnp.square(widths))[None, :, None, None]

  return scored_attention(query, key, value, score, bias, mask, **kwargs)


class NadarayaWatsonWidth(nn.Module):
  """The parametric kernel's per-head log-width `[H]` (zero at init: the width
  starts at `width`), when `learn_width`; nothing otherwise."""

  learn_width: bool = False

  @nn.compact
  def __call__(self, query, key, value, deterministic: bool = True) -> dict:
    del key, value, deterministic
    if not self.learn_width:
      return {}
    return {"log_width": self.param("log_width", nn.initializers.zeros_init(),
                                    (query.shape[2],))}


class AdditiveScore(nn.Module):
  """`additive`'s parameters per head: W_q `[H, Dq, A]`, W_k `[H, Dk, A]` and
  w `[H, A]` (A = `attention_dim`, the head dim when None)."""

  attention_dim: Optional[int] = None
  concatenated: ClassVar[bool] = False  # one kernel W [H, Dq + Dk, A] instead (concat)

  @nn.compact
  def __call__(self, query, key, value, deterministic: bool = True) -> dict:
    del value, deterministic
    heads, q_dim, k_dim = query.shape[2], query.shape[3], key.shape[3]
    width = common.check_size("attention_dim", self.attention_dim or q_dim)
    arrays = {"score_vector": self.param("score_vector", _VECTOR_INIT, (heads, width))}
    if self.concatenated:
      arrays["concat_kernel"] = self.param("concat_kernel", _KERNEL_INIT,
                                           (heads, q_dim + k_dim, width))
    else:
      arrays["query_kernel"] = self.param("query_kernel", _KERNEL_INIT, (heads, q_dim, width))
      arrays["key_kernel"] = self.param("key_kernel", _KERNEL_INIT, (heads, k_dim, width))
    return arrays


class ConcatScore(AdditiveScore):
  """`luong_concat`'s W `[H, Dq + Dk, A]` and w `[H, A]`."""

  concatenated: ClassVar[bool] = True


class LocalScore(nn.Module):
  """`luong_local`'s parameters per head: W `[H, D, D]` for the general score,
  and W_p `[H, D, A]`, v_p `[H, A]` predicting the aligned position (local-p;
  A = `position_dim`, the head dim when None)."""

  mode: str = "predictive"
  score: str = "general"
  position_dim: Optional[int] = None

  @nn.compact
  def __call__(self, query, key, value, deterministic: bool = True) -> dict:
    del value, deterministic
    heads, head_dim = query.shape[2], query.shape[3]
    arrays = {}
    if self.score == "general":
      arrays["score_kernel"] = self.param("score_kernel", _KERNEL_INIT,
                                          (heads, head_dim, key.shape[3]))
    if self.mode == "predictive":
      width = common.check_size("position_dim", self.position_dim or head_dim)
      arrays["position_kernel"] = self.param("position_kernel", _KERNEL_INIT,
                                             (heads, head_dim, width))
      arrays["position_vector"] = self.param("position_vector", _VECTOR_INIT, (heads, width))
    return arrays


class GeneralScore(nn.Module):
  """`luong_general`'s W `[H, Dq, Dk]`."""

  @nn.compact
  def __call__(self, query, key, value, deterministic: bool = True) -> dict:
    del value, deterministic
    shape = (query.shape[2], query.shape[3], key.shape[3])
    return {"score_kernel": self.param("score_kernel", _KERNEL_INIT, shape)}


_SCORING = dict(family="scoring", complexity="O(T^2)", subquadratic=False, exact=False,
                causal=True, cross=True)
_WIDTH = dict(attention_dim="A, the width of the tanh layer; the head dim when None")
registry.register(registry.VariantSpec(
    name="additive", takes=("dropout",), fn=additive_attention, paper="Bahdanau et al. 2015",
    extras=AdditiveScore, options=_WIDTH, **_SCORING))
registry.register(registry.VariantSpec(
    name="luong_dot", fn=luong_dot_attention, paper="Luong et al. 2015", options={},
    takes=("dropout",),
    **_SCORING))
registry.register(registry.VariantSpec(
    name="luong_general", takes=("dropout",), fn=luong_general_attention, paper="Luong et al. 2015",
    extras=GeneralScore, options={}, **_SCORING))
registry.register(registry.VariantSpec(
    name="luong_concat", takes=("dropout",), fn=luong_concat_attention, paper="Luong et al. 2015",
    extras=ConcatScore, options=_WIDTH, **_SCORING))
registry.register(registry.VariantSpec(
    name="luong_local", fn=luong_local_attention, paper="Luong et al. 2015", extras=LocalScore,
    takes=("dropout", "query_positions"),
    options=dict(mode="'predictive' (local-p: p_t = S sigmoid(v^T tanh(W_p h_t)), S the "
                      "key_value_seq_lengths or else Tk with any padding; the window's "
                      "softmax times a Gaussian at p_t) or 'monotonic' (local-m: p_t = t, the "
                      "window's softmax alone)",
                 window="D, the window's half-width in keys",
                 sigma="local-p's Gaussian standard deviation at p_t; D / 2 when None "
                       "(local-m has no Gaussian)",
                 score="'general' (q^T W k) or 'dot'",
                 position_dim="A, the width of local-p's position predictor; the head dim "
                              "when None"),
    **_SCORING))
registry.register(registry.VariantSpec(
    name="nadaraya_watson", fn=nadaraya_watson_attention, paper="Nadaraya 1964; Watson 1964",
    takes=("dropout",),
    extras=NadarayaWatsonWidth,
    options=dict(kernel="'gaussian' (exp(-|q - k|^2 / 2 w^2)) or 'average' (mean pooling)",
                 width="w, the Gaussian kernel's width",
                 learn_width="learn a per-head log-width added to log w (the parametric "
                             "kernel)"),
    **_SCORING))
