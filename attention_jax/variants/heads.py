"""Multi-head mechanisms: MHA, multi-query and grouped-query attention, and
what is done across heads (section B of VARIANTS.md).

The pure function takes the projection kernels as arrays; the Flax module is
`attention_jax.MultiHeadAttention`, which owns them (named in the registry by
its path, so this file imports no layer).

* `talking_heads` (Shazeer et al. 2020): learned mixing of the logits across
  heads before the softmax (P_l `[h, h_k]`) and of the weights after it
  (P_w `[h_v, h]`), square by default; its two matrices `TalkingHeadsMixing`
  makes.
* `fixed_head_size` (Bhojanapalli et al. 2020): multi-head attention whose
  head size D is an option, not width / H, so adding heads does not shrink
  them (the low-rank bottleneck of D < T). The module's `head_dim` field does
  it; the spec routes the option there (`module_options`).
* `multi_scale` (Guo et al. 2020): fixed windows of different sizes per head,
  each head `local` attention with its own window. It is registered here, in
  the heads family where VARIANTS.md lists it, because what it adds is the
  assignment of windows to heads; the computation is
  `sparse.windows.local_attention` (blockwise, O(T w)) called once per
  distinct window, so none of the sparse engine's internals are needed.
* `disagreement` (Li et al. 2018): multi-head dot-product attention whose
  function hands back three disagreement regularisers (subspace, position,
  output) as auxiliary losses, through the `sow_loss` callback that
  `MultiHeadAttention` passes to a function taking it.
* `adaptive_span` (Sukhbaatar et al. 2019): each head masks keys beyond its
  learned span z_h with a soft ramp; its arrays are the static band of the
  largest possible span S, its work skips the key blocks beyond the current
  largest span z (`sparse.windows.band_attention` with `reach`), O(T (z + R)).
* `routing_aggregation` (Li et al. 2019): the heads' outputs aggregated by
  routing-by-agreement (capsule dynamic routing) instead of Concat W^O; a
  token mixer (`RoutingAggregation`) running dot-product attention on its
  projected heads, then `route_heads`.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional, Sequence, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from attention_jax import registry
from attention_jax.core.softmax import masked_softmax
from attention_jax.variants import common, scoring
from attention_jax.variants.dense import dot_product_attention, prepare_inputs
from attention_jax.variants.sparse.windows import band_attention, local_attention

Array = jnp.ndarray


def multi_head_attention(
    inputs_q: Array,
    inputs_kv: Optional[Array],
    query_kernel: Array,
    key_kernel: Array,
    value_kernel: Array,
    out_kernel: Array,
    *,
    attention_fn: Callable[..., Array] = dot_product_attention,
    sum_of_heads: bool = False,
    **attention_kwargs,
) -> Array:
  """Concat(head_1, ..., head_H) W^O with head_i = attention(x W_i^Q, c W_i^K, c W_i^V).

  Args:
    inputs_q: `[B, Tq, E]`.
    inputs_kv: `[B, Tk, Ec]`, or None for self-attention.
    query_kernel: `[E, H, D]`.
    key_kernel, value_kernel: `[Ec, Hkv, D]`; Hkv = H (MHA), 1 (MQA) or a divisor (GQA).
    out_kernel: `[H, D, O]`.
    attention_fn: the pure attention function applied to the heads.
    sum_of_heads: compute sum_i head_i W_i^O instead of the concatenation; the
      two are the same linear map, written the way each paper writes it.
    **attention_kwargs: forwarded to `attention_fn` (mask, is_causal, ...).

  Returns:
    `[B, Tq, O]`.
  """
  inputs_kv = inputs_q if inputs_kv is None else inputs_kv
  query = jnp.einsum("bte,ehd->bthd", inputs_q, query_kernel)
  key = jnp.einsum("bte,ehd->bthd", inputs_kv, key_kernel)
  value = jnp.einsum("bte,ehd->bthd", inputs_kv, value_kernel)
  heads = attention_fn(query, key, value, **attention_kwargs)  # [B, Tq, H, D]
  if sum_of_heads:
    return jnp.einsum("bthd,hdo->bto", heads, out_kernel)
  batch, q_len, num_heads, head_dim = heads.shape
  concatenated = heads.reshape(batch, q_len, num_heads * head_dim)
  return concatenated @ out_kernel.reshape(num_heads * head_dim, -1)


def _mix_heads(mixing: Array, x: Array) -> Array:
  """`x'[h] = sum_g mixing[h, g] x[g]` over the head axis of `x` `[B, G, Tq, Tk]`;
  mixing `[H, G]` (out heads, in heads) -> `[B, H, Tq, Tk]`."""
  return jnp.einsum("hg,bgqk->bhqk", mixing.astype(jnp.float32), x)


def _talking_head_counts(logits_mixing: Array, weights_mixing: Array, key_heads: int,
                        value_heads: int) -> Tuple[int, int]:
  """(h, h_v) read from P_l `[h, h_k]` and P_w `[h_v, h]`, checked against the
  h_k = `key_heads` query heads and the `value_heads` heads of the values
  (repeated to h_v, so they must divide it)."""
  logits_shape, weights_shape = tuple(jnp.shape(logits_mixing)), tuple(jnp.shape(weights_mixing))
  if len(logits_shape) != 2 or logits_shape[1] != key_heads or logits_shape[0] < 1:
    raise ValueError(f"logits_mixing must be P_l [h, h_k] = [*, {key_heads}] (h >= 1 softmax "
                     f"heads, each a mix of the h_k = {key_heads} query heads' logits), got "
                     f"{list(logits_shape)}.")
  softmax_heads = logits_shape[0]
  if len(weights_shape) != 2 or weights_shape[1] != softmax_heads or weights_shape[0] < 1:
    raise ValueError(f"weights_mixing must be P_w [h_v, h] = [*, {softmax_heads}] (h = "
                     f"{softmax_heads}, logits_mixing's rows; h_v >= 1 output heads), got "
                     f"{list(weights_shape)}.")
  out_heads = weights_shape[0]
  if out_heads % value_heads:
    raise ValueError(f"value must have a number of heads dividing h_v = {out_heads} "
                     f"(weights_mixing's rows; each is repeated to h_v / Hv output heads), got "
                     f"{value_heads} heads.")
  return softmax_heads, out_heads


def talking_heads_attention(query: Array, key: Array, value: Array, bias: Optional[Array] = None,
                            mask: Optional[Array] = None, *, logits_mixing: Array,
                            weights_mixing: Array, scale: Optional[float] = None,
                            is_causal: bool = False, query_seq_lengths: Optional[Array] = None,
                            key_value_seq_lengths: Optional[Array] = None, segment_ids=None,
                            dropout_rate: float = 0.0,
                            dropout_rng: Optional[jax.Array] = None) -> Array:
  """Talking-heads attention: out = (P_w softmax(P_l (q . k * scale + bias))) v.

  Shazeer et al. 2020 let three head counts differ: h_k heads of queries and
  keys (their logits), h heads where the softmax is taken and h_v heads of
  weights, values and output. The products P x mix the head axis:

      logits'[i] = sum_k P_l[i, k] logits[k]    P_l `[h, h_k]`
      weights'[v] = sum_i P_w[v, i] weights[i]  P_w `[h_v, h]`

  (every softmax head's logits a learned combination of all key heads' logits,
  likewise the weights after the softmax). With h_k = h = h_v and
  P_l = P_w = I it is `dot_product_attention`.

  Orientation: our matrices are (out heads, in heads), `einsum("ik,bkqs->biqs",
  P_l, logits)`. The paper writes `einsum("BNMk,kh->BNMh", logits, P_l)` with
  P_l `[h_k, h]` and P_w `[h, h_v]` (in, out): ours are the transposes of
  the paper's, so port its (Mesh TensorFlow's) weights as P_l.T and P_w.T.

  Masks: the softmax sees the mixed logits under the mask, so no masked key
  gets weight there. After P_w a head's weights are a combination of every
  head's, so a key masked in this head but allowed in another would get
  weight; the mixed weights are therefore masked again. For the masks that are
  the same in every head (causal, padding, segments, a `[B, 1, Tq, Tk]` mask)
  that changes nothing: a key masked in every head has weight 0 in every
  head, and stays 0 after the mix. A mask per head needs h_k = h = h_v (its
  heads would not be the same heads on both sides of a mix). Mixed weights
  need not sum to 1 (P_w is any matrix), as in the paper.

  Args:
    query: `[B, Tq, h_k, D]`; key: `[B, Tk, Hkv, D]` (Hkv divides h_k; grouped
      heads are repeated); value: `[B, Tk, Hv, Dv]` (Hv divides h_v, output
      head j reading value head j // (h_v / Hv); `MultiHeadAttention`
      projects Hv = Hkv).
    bias: added to the logits before the mix, broadcastable to `[B, h_k, Tq, Tk]`.
    logits_mixing: P_l `[h, h_k]`, applied before the softmax.
    weights_mixing: P_w `[h_v, h]`, applied after it.
    scale: multiplies q . k; 1/sqrt(D) when None.
    is_causal, query_seq_lengths, key_value_seq_lengths, segment_ids: as in
      `dot_product_attention`.
    dropout_rate, dropout_rng: dropout on the mixed weights.

  Returns:
    `[B, Tq, h_v, Dv]` in the query dtype.
  """
  if jnp.ndim(query) != 4 or jnp.ndim(key) != 4 or jnp.ndim(value) != 4:
    raise ValueError(f"query, key and value must be [B, T, H, D], got shapes "
                     f"{list(jnp.shape(query))}, {list(jnp.shape(key))}, "
                     f"{list(jnp.shape(value))}.")
  common.check_query_key_sizes("talking_heads", query, key)
  key_heads = query.shape[2]
  softmax_heads, out_heads = _talking_head_counts(logits_mixing, weights_mixing, key_heads,
                                                  value.shape[2])
  scale = query.shape[-1] ** -0.5 if scale is None else scale
  # prepare_inputs checks the masks against the logits [B, h_k, Tq, Tk] and
  # wants values with the keys' heads: it sees a stand-in (the real values
  # are read below, with their own head count).
  stand_in_value = jnp.zeros(key.shape[:3] + (1,), query.dtype)
  inputs, _ = prepare_inputs(query, key, stand_in_value, bias, mask, is_causal=is_causal,
                             query_seq_lengths=query_seq_lengths,
                             key_value_seq_lengths=key_value_seq_lengths, segment_ids=segment_ids)
  allowed = inputs.dense_mask()
  square = key_heads == softmax_heads == out_heads
  if allowed is not None and allowed.shape[1] != 1 and not square:
    raise ValueError(f"mask has a head axis of {allowed.shape[1]}, and a mask per head needs "
                     f"h_k = h = h_v, got h_k = {key_heads}, h = {softmax_heads}, h_v = "
                     f"{out_heads}; mask every head alike ([B, 1, Tq, Tk]).")

  scores = scoring.dot_score(query, common.repeat_kv_heads(key, key_heads)) * jnp.float32(scale)
  if inputs.bias is not None:
    scores = scores + inputs.bias.astype(jnp.float32)
  weights = _mix_heads(weights_mixing, masked_softmax(_mix_heads(logits_mixing, scores),
                                                      allowed))
  if allowed is not None:
    weights = jnp.where(allowed, weights, 0.0)
  weights = common.dropout_weights(weights, dropout_rate, dropout_rng)
  return common.weighted_values(weights, jnp.asarray(value)).astype(query.dtype)


def _identity(rng, shape, dtype=jnp.float32):
  del rng
  return jnp.eye(shape[0], shape[1], dtype=dtype)


class TalkingHeadsMixing(nn.Module):
  """`talking_heads`' P_l `[h, h_k]` and P_w `[h_v, h]` (out heads, in heads:
  the paper's transposes), h_k the layer's query heads.

  Initialised to the identity, so a square layer (the defaults, h = h_v =
  h_k) starts as multi-head attention; a non-square one starts with head i
  of each side mixed into head i of the other, the surplus heads at 0.

  Attributes:
    softmax_heads: h, the heads the softmax is taken in; h_k when None.
    value_heads: h_v, the heads of the mixed weights and of the output; h_k
      when None. The layer's `num_kv_heads` value heads are repeated to h_v,
      so they must divide it.
  """

  softmax_heads: Optional[int] = None
  value_heads: Optional[int] = None

  @nn.compact
  def __call__(self, query, key, value, deterministic: bool = True) -> dict:
    del key, deterministic
    key_heads = query.shape[2]
    softmax_heads = common.check_size(
        "softmax_heads", key_heads if self.softmax_heads is None else self.softmax_heads)
    out_heads = common.check_size(
        "value_heads", key_heads if self.value_heads is None else self.value_heads)
    if out_heads % value.shape[2]:
      raise ValueError(f"value_heads must be a multiple of the layer's {value.shape[2]} value "
                       f"heads (num_kv_heads), which are repeated to it, got {out_heads}.")
    return {"logits_mixing": self.param("logits_mixing", _identity, (softmax_heads, key_heads)),
            "weights_mixing": self.param("weights_mixing", _identity,
                                         (out_heads, softmax_heads))}


def head_windows(windows: Sequence[int], num_heads: int, length: int) -> Tuple[int, ...]:
  """The window of each of `num_heads` heads: the heads split into
  len(`windows`) contiguous groups, as even as possible (head h takes
  windows[h * n // H]); one entry per head when n = H. Each window must fit
  the sequence `length`."""
  if not isinstance(windows, (tuple, list)) or not 1 <= len(windows) <= num_heads:
    raise ValueError(f"windows must be a tuple of 1 to num_heads ({num_heads}) window sizes, "
                     f"got {windows!r}.")
  for index, window in enumerate(windows):
    common.check_size(f"windows[{index}]", window, length=length)
  return tuple(windows[head * len(windows) // num_heads] for head in range(num_heads))


def multi_scale_attention(query: Array, key: Array, value: Array, bias: Optional[Array] = None,
                          mask: Optional[Array] = None, *, is_causal: bool = False,
                          query_seq_lengths: Optional[Array] = None,
                          key_value_seq_lengths: Optional[Array] = None, segment_ids=None,
                          windows: Tuple[int, ...] = (16, 64),
                          scale: Optional[float] = None) -> Array:
  """Multi-scale self-attention: head h is local attention with window w_h.

  Query i of head h sees keys [i - w_h, i + w_h] ([i - w_h, i] when causal);
  small windows capture local structure, large ones longer range, in the
  same layer. Heads that share a window are computed together by
  `sparse.windows.local_attention` (blockwise, never a T x T array), so the cost is
  O(T sum_h w_h). Masks, padding and segments as `local` takes them (self-
  attention only; a key-padding mask, no dense bias).

  Args:
    query: `[B, T, H, D]`; key: `[B, T, Hkv, D]`; value: `[B, T, Hkv, Dv]`.
    windows: the window sizes, one per head or one per contiguous group of
      heads (`head_windows`), each at most T.
    scale: multiplies the logits; 1/sqrt(D) when None.

  Returns:
    `[B, T, H, Dv]` in the query dtype.
  """
  common.reject_unsupported("multi_scale", bias=bias)
  num_heads = query.shape[2]
  per_head = head_windows(windows, num_heads, query.shape[1])
  # Each group of heads takes its own K/V heads: repeated to H first (O(T)).
  key = common.repeat_kv_heads(key, num_heads)
  value = common.repeat_kv_heads(value, num_heads)
  outputs, order = [], []
  for window in sorted(set(per_head)):
    heads = np.array([h for h, w in enumerate(per_head) if w == window])
    outputs.append(local_attention(
        query[:, :, heads], key[:, :, heads], value[:, :, heads], mask=mask,
        is_causal=is_causal, query_seq_lengths=query_seq_lengths,
        key_value_seq_lengths=key_value_seq_lengths, segment_ids=segment_ids,
        window_size=window, scale=scale))
    order.extend(heads)
  # The groups' outputs back in head order.
  return jnp.concatenate(outputs, axis=2)[:, :, np.argsort(order)]


DISAGREEMENT_REGULARIZERS = ("subspace", "position", "output")
# Below this squared norm a head's vector counts as zero (cosine 0, finite gradient).
_TINY_SQUARED_NORM = 1e-24


def _mean_pairwise_cosine(x: Array) -> Array:
  """(1/H^2) sum_{h,g} cos(x_h, x_g), x_h the whole `[N, F]` slice of head h
  flattened (the Frobenius inner product of the heads' matrices), averaged
  over the batch. x: `[B, N, H, F]`; returns a float32 scalar."""
  x = x.astype(jnp.float32)
  flat = jnp.swapaxes(x, 1, 2).reshape(x.shape[0], x.shape[2], -1)  # [B, H, N F]
  squared_norm = jnp.sum(jnp.square(flat), axis=-1, keepdims=True)
  unit = flat * jax.lax.rsqrt(jnp.maximum(squared_norm, _TINY_SQUARED_NORM))
  return jnp.mean(jnp.einsum("bhn,bgn->bhg", unit, unit))


def subspace_disagreement(value: Array, key_visible: Optional[Array] = None) -> Array:
  """D_sub = -(1/H^2) sum_{i,j} cos(V_i, V_j) over the heads' projected values.

  Args:
    value: `[B, Tk, H, Dv]`, one value head per query head (repeat grouped
      K/V heads first: heads sharing values then agree, cos = 1).
    key_visible: `[B|1, Tk]` bool, the keys of the sequence (those some query
      may attend); the values of the others (padding) are left out of V_i.
      None: every key.

  Returns:
    A float32 scalar in [-1, 1], averaged over the batch (higher = more diverse).
  """
  if key_visible is not None:
    value = jnp.where(key_visible[:, :, None, None], value.astype(jnp.float32), 0.0)
  return -_mean_pairwise_cosine(value)


def position_disagreement(weights: Array) -> Array:
  """D_pos = -(1/H^2) sum_{i,j} |A_i ⊙ A_j|, |.| the sum of the elements.

  sum_{i,j} sum_{q,k} A_i A_j = sum_{q,k} (sum_i A_i)^2, so it costs one
  `[Tq, Tk]` square per example, not H^2 products.

  Args:
    weights: the attention weights A `[B, H, Tq, Tk]` (>= 0).

  Returns:
    A float32 scalar <= 0, averaged over the batch.
  """
  num_heads = weights.shape[1]
  summed = jnp.sum(weights.astype(jnp.float32), axis=1)  # [B, Tq, Tk]
  return -jnp.mean(jnp.sum(jnp.square(summed), axis=(1, 2))) / num_heads ** 2


def output_disagreement(outputs: Array) -> Array:
  """D_out = -(1/H^2) sum_{i,j} cos(O_i, O_j) over the heads' outputs (before W^O).

  Args:
    outputs: `[B, Tq, H, Dv]`.

  Returns:
    A float32 scalar in [-1, 1], averaged over the batch.
  """
  return -_mean_pairwise_cosine(outputs)


def check_regularizers(regularizers: Tuple[str, ...]) -> Tuple[str, ...]:
  """`regularizers`, checked: a tuple of distinct names from DISAGREEMENT_REGULARIZERS."""
  if (not isinstance(regularizers, (tuple, list)) or len(set(regularizers)) != len(regularizers)
      or not set(regularizers) <= set(DISAGREEMENT_REGULARIZERS)):
    raise ValueError(f"regularizers must be a tuple of distinct names from "
                     f"{DISAGREEMENT_REGULARIZERS}, got {regularizers!r}.")
  return tuple(regularizers)


def disagreement_attention(query: Array, key: Array, value: Array, bias: Optional[Array] = None,
                           mask: Optional[Array] = None, *,
                           regularizers: Tuple[str, ...] = DISAGREEMENT_REGULARIZERS,
                           weight: float = 1.0, scale: Optional[float] = None,
                           sow_loss: Optional[Callable[[str, Array], None]] = None,
                           **kwargs) -> Array:
  """Dot-product attention with disagreement regularisation (Li et al. 2018).

  The output is `dot_product_attention`'s. The paper trains
  argmax_theta L(y | x) + lambda D, D the sum of the chosen disagreements
  (`subspace_disagreement`, `position_disagreement`, `output_disagreement`:
  each is minus a similarity, so more diverse heads give a larger D).
  Sign convention: the trainer minimises, so each chosen regulariser r is
  handed to `sow_loss` as the loss `weight * (-D_r)` (the weighted mean
  similarity) under the name "<r>_disagreement"; minimising it maximises the
  disagreement. A direct call (sow_loss None) computes no regulariser.
  Padding reaches no regulariser: the subspace one reads the values of the
  keys some query may attend, the others read the weights and outputs,
  which are 0 in a padded (fully masked) query's row.

  Args:
    query: `[B, Tq, H, D]`; key: `[B, Tk, Hkv, D]`; value: `[B, Tk, Hkv, Dv]`.
    bias: added to the logits, broadcastable to `[B, H, Tq, Tk]`.
    regularizers: which of "subspace", "position", "output" to apply.
    weight: lambda, the weight of each regulariser in the loss (1.0, the
      paper's weight); 0 turns them off.
    scale: multiplies q . k; 1/sqrt(D) when None.
    sow_loss: `sow_loss(name, loss)`, given by `MultiHeadAttention`, which
      sows the loss into the "losses" collection the trainer adds up.
    **kwargs: the masks of `dot_product_attention` and dropout (the
      position regulariser sees the weights before dropout).

  Returns:
    `[B, Tq, H, Dv]` in the query dtype.
  """
  regularizers = check_regularizers(regularizers)
  common.check_query_key_sizes("disagreement", query, key)
  scale = query.shape[-1] ** -0.5 if scale is None else scale
  # The weights are the dense softmax's; kept here for the position regulariser.
  kept = {}

  def keeping_softmax(scores, allowed):
    kept["weights"], kept["allowed"] = masked_softmax(scores, allowed), allowed
    return kept["weights"]

  out = scoring.scored_attention(
      query, key, value, lambda q, k: scoring.dot_score(q, k) * jnp.float32(scale), bias, mask,
      weighting=keeping_softmax, **kwargs)
  if sow_loss is None or weight == 0.0:
    return out
  # V_i holds the values of the sequence's keys only: a padded key (one no
  # query may attend, in any head) must not change the loss.
  allowed = kept["allowed"]
  key_visible = None if allowed is None else jnp.any(allowed, axis=(1, 2))  # [B|1, Tk]
  disagreements = dict(
      subspace=lambda: subspace_disagreement(common.repeat_kv_heads(value, query.shape[2]),
                                             key_visible),
      position=lambda: position_disagreement(kept["weights"]),
      output=lambda: output_disagreement(out))
  for name in regularizers:
    sow_loss(f"{name}_disagreement", -jnp.float32(weight) * disagreements[name]())
  return out


def span_mask(distance: Array, spans: Array, ramp: int) -> Array:
  """m_z(x) = clamp((R + z - x) / R, 0, 1): 1 up to the span z, then a linear
  ramp to 0 over R more positions. distance x and spans z broadcast together."""
  return jnp.clip((ramp + spans - distance) / ramp, 0.0, 1.0)


def span_penalty_loss(spans: Array, span_penalty: float) -> Array:
  """The paper's L1 term lambda / H sum_h z_h of one layer's spans `[H]`."""
  return jnp.float32(span_penalty) * jnp.mean(spans)


def adaptive_span_attention(query: Array, key: Array, value: Array, bias: Optional[Array] = None,
                            mask: Optional[Array] = None, *, is_causal: bool = False,
                            query_seq_lengths: Optional[Array] = None,
                            key_value_seq_lengths: Optional[Array] = None, segment_ids=None,
                            spans: Array, max_span: int = 128, ramp: int = 32,
                            block_size: int = 32, scale: Optional[float] = None) -> Array:
  """Adaptive attention span: a_ij = m_h(i - j) exp(s_ij) / sum_k m_h(i - k) exp(s_ik).

  m_h = `span_mask` with head h's span z_h in [0, S], S = `max_span`. The
  masked, renormalised softmax is the softmax of s_ij + log m_h(i - j)
  (log 0 = -inf removes the key), which is how it is computed. The distance
  is i - j with j <= i when causal, as in the paper (a language model);
  without causality it is |i - j| on both sides.

  Cost: a key at distance >= z + R has mask 0, and z <= S, so only the
  band of S + R - 1 keys each side can count: its shapes bound the memory,
  O(T (S + R)), no T x T array. The work follows the current largest span
  z* = max_h z_h: `sparse.windows.band_attention` computes the band one key block
  (of `block_size`) offset at a time and skips, under `lax.cond`, every
  offset whose nearest key is z* + R or more away, forward and backward:
  O(T (z* + R + b)). (The paper's code trims its keys to z* by slicing,
  which needs the span on the host; the cond keeps it traced under `jit`.)

  Args:
    query: `[B, T, H, D]`; key: `[B, T, Hkv, D]`; value: `[B, T, Hkv, Dv]`.
    spans: z `[H]` float, in [0, max_span] (`AdaptiveSpan` clamps them).
    max_span: S, the largest span, an int >= 1.
    ramp: R, the length of the ramp, an int >= 1.
    block_size: b, the key blocks skipped beyond the largest span, an int >= 1.
    scale: multiplies q . k; 1/sqrt(D) when None.
    is_causal, query_seq_lengths, key_value_seq_lengths, segment_ids, mask:
      as `local` takes them (self-attention, a key-padding mask only).

  Returns:
    `[B, T, H, Dv]` in the query dtype.
  """
  common.reject_unsupported("adaptive_span", bias=bias)
  common.check_size("max_span", max_span)
  common.check_size("ramp", ramp)
  common.check_per_head("spans", spans, (query.shape[2],))
  width = max_span + ramp - 1
  # [H] -> [H, 1, 1], against the band's `[G, 1, Q, K]` positions.
  head_spans = spans.astype(jnp.float32)[:, None, None]

  def log_span_mask(q_pos, k_pos):
    masked = span_mask(jnp.abs(q_pos - k_pos).astype(jnp.float32), head_spans, ramp)
    # log 0 -> -inf, with the log's gradient kept finite where the mask is 0.
    positive = masked > 0.0
    return jnp.where(positive, jnp.log(jnp.where(positive, masked, 1.0)), -jnp.inf)

  return band_attention("adaptive_span", query, key, value, width, width,
                        position_logits=log_span_mask, mask=mask, is_causal=is_causal,
                        query_seq_lengths=query_seq_lengths,
                        key_value_seq_lengths=key_value_seq_lengths, segment_ids=segment_ids,
                        scale=scale, block_size=min(common.check_size("block_size", block_size),
                                                    width),
                        reach=jnp.max(spans) + ramp)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def clamp_spans(spans: Array, max_span: float) -> Array:
  """clip(spans, 0, max_span), whose gradient reaches a span outside
  [0, max_span] when descending it moves the span back towards the range.

  The paper projects its span parameters into the range after each update,
  so a span at a bound still learns from the mask and the penalty. A plain
  clip read where the spans are used would give a span that an update pushed
  past a bound a gradient of 0 from both, for good (a head stuck at span 0
  or S). Here its gradient is kept when it points back inside (g < 0 below
  0, g > 0 above S) and dropped when it points further out, where the
  paper's projection would hold the span at the bound."""
  return jnp.clip(spans, 0.0, max_span)


def _clamp_spans_forward(spans, max_span):
  return clamp_spans(spans, max_span), spans


def _clamp_spans_backward(max_span, spans, grad):
  outward = ((spans < 0.0) & (grad > 0.0)) | ((spans > max_span) & (grad < 0.0))
  return (jnp.where(outward, 0.0, grad),)


clamp_spans.defvjp(_clamp_spans_forward, _clamp_spans_backward)


class AdaptiveSpan(nn.Module):
  """`adaptive_span`'s spans z `[H]`, a parameter "span" in tokens, clamped to
  [0, max_span] where it is read by `clamp_spans` (the paper clamps it after
  each update, which the trainer has no hook for; `clamp_spans` gives a span
  pushed past a bound the gradient that brings it back, as the projection
  would). It starts at S / 2. Sows the span penalty `span_penalty_loss` into
  "losses" (the trainer adds it to the loss).

  Scale: the parameter is the span in tokens, where the paper's is the
  fraction z / S (its span S p), so an optimiser whose steps are about the
  learning rate (Adam) moves these spans S times more slowly than the
  paper's: at S = 128 and lr 3e-3, about 3 tokens in 1000 steps."""

  max_span: int = 128
  ramp: int = 32
  span_penalty: float = 2e-6

  @nn.compact
  def __call__(self, query, key, value, deterministic: bool = True) -> dict:
    del key, value, deterministic
    common.check_size("max_span", self.max_span)
    half = lambda rng, shape: jnp.full(shape, self.max_span / 2, jnp.float32)
    spans = clamp_spans(self.param("span", half, (query.shape[2],)), float(self.max_span))
    if self.span_penalty:
      self.sow("losses", "span_penalty", span_penalty_loss(spans, self.span_penalty))
    return {"spans": spans}


# --------------------------------------------------------------------------------------
# Routing-by-agreement: the heads' outputs aggregated by dynamic routing.


def squash(s: Array, axis: int = -1) -> Array:
  """The capsule non-linearity (Sabour et al. 2017): s |s|^2 / ((1 + |s|^2) |s|),
  the direction of s with a length in [0, 1); 0 at s = 0 (finite gradient)."""
  norm2 = jnp.sum(jnp.square(s), axis=axis, keepdims=True)
  return s * (norm2 / (1.0 + norm2)) * jax.lax.rsqrt(norm2 + 1e-9)


def route_heads(head_outputs: Array, vote_kernels: Array, iterations: int = 3) -> Array:
  """Heads aggregated by routing-by-agreement (Li et al. 2019, sec. 3; Sabour et
  al. 2017's dynamic routing), at every position separately:

      V_{h->n} = W_{h,n} O_h                         (votes of head h for capsule n)
      B_{h,n} = 0; repeat `iterations` times:
        C_{h,n} = exp(B_{h,n}) / sum_n' exp(B_{h,n'})  (each head's couplings)
        S_n = sum_h C_{h,n} V_{h->n},   Out_n = squash(S_n)
        B_{h,n} += Out_n . V_{h->n}                  (agreement)
      out = [Out_1; ...; Out_N]

  The first iteration's couplings are uniform, 1/N, so with one iteration
  out_n = squash((1 / N) sum_h W_{h,n} O_h): with N = H capsules the squashed
  mean of the heads' projected votes (instead of Concat(O_h) W^O). Gradients
  flow through every iteration.

  Args:
    head_outputs: O `[B, T, H, D]`, the heads' attention outputs.
    vote_kernels: W `[H, N, D, C]`, N output capsules of size C.
    iterations: routing iterations, >= 1.

  Returns:
    `[B, T, N C]` float32.
  """
  common.check_size("iterations", iterations)
  if jnp.ndim(head_outputs) != 4:
    raise ValueError(f"head_outputs must be [B, T, H, D], got shape "
                     f"{list(jnp.shape(head_outputs))}.")
  batch, length, num_heads, head_dim = head_outputs.shape
  common.check_per_head("vote_kernels", vote_kernels, (num_heads, None, head_dim, None))
  num_capsules, capsule_dim = vote_kernels.shape[1], vote_kernels.shape[3]
  votes = jnp.einsum("bthd,hndc->bthnc", head_outputs.astype(jnp.float32),
                     jnp.asarray(vote_kernels, jnp.float32))
  agreement = jnp.zeros((batch, length, num_heads, num_capsules), jnp.float32)
  for iteration in range(iterations):
    coupling = jax.nn.softmax(agreement, axis=-1)  # over the output capsules
    capsules = squash(jnp.einsum("bthn,bthnc->btnc", coupling, votes))
    if iteration + 1 < iterations:
      agreement = agreement + jnp.einsum("btnc,bthnc->bthn", capsules, votes)
  return capsules.reshape(batch, length, num_capsules * capsule_dim)


class RoutingAggregation(nn.Module):
  """Multi-head attention whose heads are aggregated by `route_heads` instead
  of Concat(heads) W^O, as a token mixer (the mixer contract).

  Q, K, V are projected into H heads of size E / H, each head is
  `dot_product_attention` (every mask, padding and segment it takes), and the
  N output capsules of size E / N, concatenated, are the output `[B, T, E]`:
  the votes W `[H, N, E/H, E/N]` replace W^O (H E^2 / N weights, E^2 at N = H).

  Attributes:
    num_heads: H.
    num_capsules: N, the output capsules; H when None. Must divide E.
    iterations: routing iterations.
    dropout_rate: dropout on the attention weights.
    dtype, param_dtype: computation and parameter dtypes.
  """

  num_heads: int
  num_capsules: Optional[int] = None
  iterations: int = 3
  dropout_rate: float = 0.0
  dtype: Optional[Any] = None
  param_dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: Array, context: Optional[Array] = None, *, mask=None,
               is_causal: bool = False, query_seq_lengths=None, key_value_seq_lengths=None,
               segment_ids=None, positions=None, deterministic: bool = True, carry=None):
    """The mixer contract. x: `[B, Tq, E]`; context: `[B, Tk, E]` or None;
    mask: broadcastable to `[B, H, Tq, Tk]`; positions: not used (no relative
    positions); carry: passed through. Returns `[B, Tq, E]` (with the carry
    when given one)."""
    del positions
    features = x.shape[-1]
    num_heads = common.check_size("num_heads", self.num_heads)
    num_capsules = common.check_size("num_capsules", self.num_capsules or num_heads)
    for name, parts in (("num_heads", num_heads), ("num_capsules", num_capsules)):
      if features % parts:
        raise ValueError(f"{name}={parts} must divide the features E = {features}.")
    head_dim = features // num_heads
    dtype = self.dtype or jnp.promote_types(x.dtype, self.param_dtype)
    project = lambda name, inputs: nn.DenseGeneral(
        (num_heads, head_dim), dtype=dtype, param_dtype=self.param_dtype, name=name)(inputs)
    inputs = x if context is None else context
    dropout_rng = None
    if self.dropout_rate > 0.0 and not deterministic:
      dropout_rng = self.make_rng("dropout")
    heads = dot_product_attention(
        project("query", x), project("key", inputs), project("value", inputs), mask=mask,
        is_causal=is_causal, query_seq_lengths=query_seq_lengths,
        key_value_seq_lengths=key_value_seq_lengths, segment_ids=segment_ids,
        dropout_rate=self.dropout_rate, dropout_rng=dropout_rng)
    vote_kernels = self.param(
        "vote_kernels", nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal",
                                                         in_axis=-2, out_axis=-1,
                                                         batch_axis=(0, 1)),
        (num_heads, num_capsules, head_dim, features // num_capsules), self.param_dtype)
    out = route_heads(heads, vote_kernels, self.iterations)
    return common.mixer_output(out.astype(dtype), carry)


# The heads run dot-product attention, so they take its options.
_HEADS = dict(fn=multi_head_attention, family="heads", complexity="O(T^2)", subquadratic=False,
              exact=True, causal=True, cross=True, qkv=False, mixer=registry.ATTENTION_MIXER,
              options=dict(
                  implementation=registry.VariantOption(
                      "implementation", str, None,
                      "'xla', 'blockwise', 'pallas', 'cudnn', ...; None picks the best here"),
                  local_window_size=registry.VariantOption(
                      "local_window_size", tuple, None,
                      "(left, right): each query sees keys q - left .. q + right; None for all"),
                  scale=registry.VariantOption("scale", float, None,
                                               "multiplies the logits; 1/sqrt(D) when None")))
registry.register(registry.VariantSpec(name="multi_head", paper="Vaswani et al. 2017", **_HEADS))
registry.register(registry.VariantSpec(name="multi_query", paper="Shazeer 2019",
                                       module_defaults={"num_kv_heads": 1}, **_HEADS))
# The head size is MultiHeadAttention's field, so the option sets the layer
# (module_options), and its default is preset there (module_defaults): 64, the
# head size of BERT-base, which the paper fixes while varying the heads.
_FIXED_HEAD_DIM = 64
registry.register(registry.VariantSpec(
    name="fixed_head_size", paper="Bhojanapalli et al. 2020",
    module_defaults={"head_dim": _FIXED_HEAD_DIM}, module_options=("head_dim",),
    **{**_HEADS, "options": dict(
        _HEADS["options"],
        head_dim=registry.VariantOption(
            "head_dim", int, _FIXED_HEAD_DIM,
            "D, the size of every head, independent of the width and of num_heads"))}))
# Grouped-query attention: pass num_kv_heads (a divisor of num_heads) to the module.
registry.register(registry.VariantSpec(name="grouped_query", paper="Ainslie et al. 2023",
                                       **_HEADS))
registry.register(registry.VariantSpec(
    name="talking_heads", fn=talking_heads_attention, paper="Shazeer et al. 2020",
    takes=("dropout",),
    family="heads", complexity="O(T^2)", subquadratic=False, exact=False, causal=True,
    cross=True, extras=TalkingHeadsMixing,
    options=dict(scale="multiplies the logits q . k; 1/sqrt(D) when None",
                 softmax_heads="h, the heads the softmax is taken in: P_l [h, num_heads] mixes "
                               "the query/key heads' logits into them; num_heads when None",
                 value_heads="h_v, the output heads: P_w [h_v, h] mixes the weights into "
                             "them; output head j reads value head j // (h_v / num_kv_heads); "
                             "num_heads when None")))
registry.register(registry.VariantSpec(
    name="multi_scale", fn=multi_scale_attention, paper="Guo et al. 2020", family="heads",
    complexity="O(T w)", subquadratic=True, exact=True, causal=True, cross=False,
    options=dict(windows="window sizes w (keys each side of the query): one per head, or one "
                         "per contiguous group of heads",
                 scale="multiplies the logits; 1/sqrt(D) when None")))
registry.register(registry.VariantSpec(
    name="disagreement", fn=disagreement_attention, paper="Li et al. 2018", family="heads",
    takes=("dropout", "aux_losses"),
    complexity="O(T^2)", subquadratic=False, exact=True, causal=True, cross=True,
    options=dict(regularizers="which disagreements to maximise: 'subspace', 'position', "
                              "'output'",
                 weight="lambda: each regulariser's loss is weight * (-D); 0 turns them off",
                 scale="multiplies the logits q . k; 1/sqrt(D) when None")))
registry.register(registry.VariantSpec(
    name="adaptive_span", fn=adaptive_span_attention, paper="Sukhbaatar et al. 2019",
    family="heads", complexity="O(T (z + R))", subquadratic=True, exact=False, causal=True,
    cross=False, extras=AdaptiveSpan,
    options=dict(max_span="S, the largest span; the band of S + R - 1 keys bounds the cost",
                 ramp="R, the length of the mask's ramp from 1 to 0 after the span",
                 span_penalty="lambda of the L1 loss lambda / H sum_h z_h (0: none)",
                 block_size="b, key blocks past the largest span + R are skipped (lax.cond)",
                 scale="multiplies the logits q . k; 1/sqrt(D) when None")))
registry.register(registry.VariantSpec(
    name="routing_aggregation", fn=route_heads, paper="Li et al. 2019", family="heads",
    complexity="O(T^2)", subquadratic=False, exact=False, causal=True, cross=True, qkv=False,
    mixer=RoutingAggregation,
    options=dict(num_capsules="N, the output capsules (each E / N); num_heads when None",
                 iterations="routing-by-agreement iterations (1: uniform couplings)")))
