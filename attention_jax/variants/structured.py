"""Structured attention (section A of VARIANTS.md): weights that come from a
structure over the keys rather than from one softmax over all of them.

* `structured_crf` (Kim, Denton, Hoang and Rush 2017, "Structured Attention
  Networks", segmentation attention): for each query a linear-chain CRF over
  its keys with binary labels z_j; the unary log-potential of z_j = 1 is the
  score q . k_j / sqrt(D) (z_j = 0 has 0) and a learned per-head `[2, 2]`
  matrix scores consecutive labels. The weights are the marginals
  p(z_j = 1 | q), computed by forward-backward in log space (a `lax.scan`
  over the keys each way) and differentiated by autodiff. They need not sum
  to 1 (the paper); `normalize=True` divides them by their sum.
* `graph` (the Transformer as a graph neural network; Velickovic et al. 2018,
  with the scaled dot-product score of the Transformer rather than GAT's
  additive one): each node (query) attends only to its neighbours (keys),
  given as a dense boolean adjacency or as edge lists, which are computed per
  edge with segment sums and never build a T x T array.

Both are registered in the scoring family and run inside `MultiHeadAttention`
(`attention="structured_crf"` or `"graph"`); how a model hands a graph to the
layer is described at `graph_attention`.
"""

from __future__ import annotations

from typing import Optional, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from attention_jax import registry
from attention_jax.core import masks as mask_lib
from attention_jax.core.block_mask import create_block_mask
from attention_jax.core.softmax import MASKED_LOGSUMEXP, masked_softmax
from attention_jax.variants import common, scoring
from attention_jax.flex import flex_attention
from attention_jax.variants.dense import prepare_inputs

Array = jnp.ndarray


# ---------------------------------------------------------------------------- structured_crf


def _log_normalized(log_potentials: Array) -> Array:
  """`[..., 2]` shifted so that its two entries' log-sum-exp is 0: the messages
  stay of the size of one step's potentials however long the chain, and the
  marginals (differences at one position) do not change."""
  return log_potentials - jnp.logaddexp(log_potentials[..., :1], log_potentials[..., 1:])


def linear_chain_marginals(unary: Array, transition: Array,
                           allowed: Optional[Array] = None) -> Array:
  """p(z_j = 1) in a binary linear-chain CRF, by forward-backward in log space.

  The chain over positions j (the last axis) has log-potential

      sum_j z_j * unary_j + sum_{j, j' consecutive} transition[z_j, z_j'],

  over the allowed positions only: a position that is not allowed is left
  out of the chain (its label is not a variable, and the transition links the
  allowed positions on either side of it), so appending or inserting masked
  positions never changes the marginals of the others, and a padded sequence
  gives the marginals of the unpadded one. Its weight is 0.

  Args:
    unary: `[..., T]`, the log-potential of z_j = 1 (z_j = 0 has 0).
    transition: `[..., 2, 2]` broadcastable against `unary`'s leading axes:
      transition[a, b] scores z_j = a followed by z_j' = b.
    allowed: boolean, broadcastable to `unary`; None: every position.

  Returns:
    `[..., T]` marginals in `unary`'s dtype promoted to float32 at least; 0
    where not allowed (and everywhere on a chain with nothing allowed).
  """
  dtype = jnp.promote_types(unary.dtype, jnp.float32)
  unary = unary.astype(dtype)
  chains = unary.shape[:-1]
  transition = jnp.broadcast_to(jnp.asarray(transition, dtype), chains + (2, 2))
  allowed = (jnp.ones(unary.shape, bool) if allowed is None
             else jnp.broadcast_to(jnp.asarray(allowed, bool), unary.shape))
  # Labels last: theta [..., T, 2] = (0, unary); then positions first for the scans.
  theta = jnp.stack([jnp.zeros_like(unary), unary], axis=-1)
  steps = (jnp.moveaxis(theta, -2, 0), jnp.moveaxis(allowed, -1, 0))

  def forward(carry, step):
    # alpha [..., 2]: log of the summed potentials of the labels up to the last
    # allowed position, by that position's label (normalised per step).
    alpha, started = carry
    theta_j, ok = step
    # moved[b] = logsumexp_a alpha[a] + transition[a, b]
    moved = jnp.logaddexp(alpha[..., :1] + transition[..., 0, :],
                          alpha[..., 1:] + transition[..., 1, :])
    # The first allowed position has no predecessor: no transition into it.
    alpha_j = _log_normalized(jnp.where(started[..., None], moved, 0.0) + theta_j)
    alpha = jnp.where(ok[..., None], alpha_j, alpha)
    return (alpha, started | ok), alpha

  def backward(carry, step):
    # following [..., 2]: theta + beta of the next allowed position, by its label.
    following, has_next = carry
    theta_j, ok = step
    # beta[a] = logsumexp_b transition[a, b] + following[b]; 0 at the last one.
    beta = jnp.logaddexp(transition[..., :, 0] + following[..., :1],
                         transition[..., :, 1] + following[..., 1:])
    beta = jnp.where(has_next[..., None], beta, 0.0)
    following = jnp.where(ok[..., None], _log_normalized(theta_j + beta), following)
    return (following, has_next | ok), beta

  start = (jnp.zeros(chains + (2,), dtype), jnp.zeros(chains, bool))
  _, alphas = jax.lax.scan(forward, start, steps)
  _, betas = jax.lax.scan(backward, start, steps, reverse=True)
  # p(z_j = 1) / p(z_j = 0) = exp((alpha + beta)[1] - (alpha + beta)[0]); the
  # per-step normalisations shift both labels alike.
  both = alphas + betas  # [T, ..., 2]
  log_odds = jnp.moveaxis(both[..., 1] - both[..., 0], 0, -1)
  return jnp.where(allowed, jax.nn.sigmoid(log_odds), 0.0)


def structured_crf_attention(query: Array, key: Array, value: Array,
                             bias: Optional[Array] = None, mask: Optional[Array] = None, *,
                             transition: Optional[Array] = None, normalize: bool = False,
                             **kwargs) -> Array:
  """Segmentation attention: out_i = sum_j p(z_j = 1 | q_i) v_j.

  Per query and head, a binary linear-chain CRF over the keys (in key order)
  with unary log-potential q_i . k_j / sqrt(D) (+ bias) for z_j = 1 and the
  pairwise log-potentials `transition`; the weights are its marginals
  (`linear_chain_marginals`). With a zero transition the labels are
  independent and the weights are sigmoid(q_i . k_j / sqrt(D)).

  Masked keys (padding, causal, segments, `mask`) are left out of the chain:
  weight exactly 0, and the transition links the allowed keys on either side,
  so padding never changes the weights of the real keys (forcing z_j = 0
  there instead would let trailing padding pull the last real key towards 0).
  Cost: O(Tq Tk) memory and work, a scan of Tk steps each way.

  Args:
    query: `[B, Tq, H, D]`; key: `[B, Tk, Hkv, D]`; value: `[B, Tk, Hkv, Dv]`.
    transition: `[H, 2, 2]`, transition[h, a, b] scores label a followed by
      label b in head h (`CRFTransition` makes it; zeros when None).
    normalize: divide the marginals by their sum (False: the paper's weights).
    **kwargs: the masks of `dot_product_attention` and dropout.

  Returns:
    `[B, Tq, H, Dv]` in the query dtype.
  """
  common.check_query_key_sizes("structured_crf", query, key)
  num_heads = query.shape[2]
  if transition is None:
    transition = jnp.zeros((num_heads, 2, 2), jnp.float32)
  common.check_per_head("transition", transition, (num_heads, 2, 2))
  scale = query.shape[-1] ** -0.5

  def weighting(scores, allowed):  # scores [B, H, Tq, Tk]; one chain per (b, h, i)
    marginals = linear_chain_marginals(scores, transition[None, :, None], allowed)
    if normalize:
      total = jnp.sum(marginals, axis=-1, keepdims=True)
      marginals = marginals / jnp.where(total > 0, total, 1.0)
    return marginals

  return scoring.scored_attention(query, key, value, lambda q, k: scoring.dot_score(q, k) * scale,
                                  bias, mask, weighting=weighting, **kwargs)


class CRFTransition(nn.Module):
  """`structured_crf`'s per-head transition log-potentials `[H, 2, 2]`, zero at
  init (independent labels: sigmoid weights)."""

  @nn.compact
  def __call__(self, query, key, value, deterministic: bool = True) -> dict:
    del key, value, deterministic
    return {"transition": self.param("transition", nn.initializers.zeros_init(),
                                     (query.shape[2], 2, 2))}


# ---------------------------------------------------------------------------- graph


def _check_adjacency(adjacency, batch: int, q_len: int, kv_len: int) -> Array:
  """The adjacency as a mask `[B|1, 1, Tq, Tk]`."""
  adjacency = jnp.asarray(adjacency)
  if adjacency.dtype != jnp.bool_:
    raise ValueError(f"adjacency must be boolean (True: query i attends to key j), got dtype "
                     f"{adjacency.dtype}.")
  if adjacency.shape not in ((q_len, kv_len), (batch, q_len, kv_len)):
    raise ValueError(f"adjacency must have shape [B, Tq, Tk] = [{batch}, {q_len}, {kv_len}] or "
                     f"[Tq, Tk] = [{q_len}, {kv_len}], got {list(adjacency.shape)}.")
  return adjacency.reshape((-1, 1, q_len, kv_len))


def _check_edges(senders, receivers, batch: int, q_len: int,
                 kv_len: int) -> Tuple[Array, Array]:
  """The edge lists as `[B, E]` int arrays; indices are checked where concrete."""
  for name, edges in (("senders", senders), ("receivers", receivers)):
    if edges is None:
      raise ValueError(f"edge lists need both senders and receivers, got {name}=None.")
  senders, receivers = jnp.asarray(senders), jnp.asarray(receivers)
  if senders.shape != receivers.shape:
    raise ValueError(f"senders and receivers must have the same shape ([B, E] or [E]), got "
                     f"senders {list(senders.shape)} and receivers {list(receivers.shape)}.")
  for name, edges, length, nodes in (("senders", senders, kv_len, "keys"),
                                     ("receivers", receivers, q_len, "queries")):
    if not jnp.issubdtype(edges.dtype, jnp.integer):
      raise ValueError(f"{name} must be an integer array of node indices, got dtype "
                       f"{edges.dtype}.")
    if edges.ndim not in (1, 2) or (edges.ndim == 2 and edges.shape[0] != batch):
      raise ValueError(f"{name} must have shape [B, E] = [{batch}, E] or [E], got "
                       f"{list(edges.shape)}.")
    # Values are only checkable outside jit; under jit an index past the end is
    # a padding edge like a negative one.
    if not isinstance(edges, jax.core.Tracer) and edges.size:
      high = int(np.max(np.asarray(edges)))
      if high >= length:
        raise ValueError(f"{name} must index the {length} {nodes} (0 to {length - 1}; a "
                         f"negative index marks a padding edge), got index {high}.")
  shape = (batch, senders.shape[-1])
  return jnp.broadcast_to(senders, shape), jnp.broadcast_to(receivers, shape)


def _at_pairs(pairwise: Array, receivers: Array, senders: Array) -> Array:
  """pairwise[b, h, r, s] of every edge: `[B|1, H|1, Tq|1, Tk|1]` -> `[B, E, H|1]`
  (a broadcast axis is read at 0)."""
  batch = pairwise.shape[0]
  b = jnp.arange(batch)[:, None] if batch > 1 else 0
  r = receivers if pairwise.shape[2] > 1 else 0
  s = senders if pairwise.shape[3] > 1 else 0
  # The advanced indices are split by the head slice, so their axes come first.
  out = pairwise[b, :, r, s]
  return jnp.broadcast_to(out, receivers.shape + out.shape[-1:])


def _edge_attention(inputs, senders: Array, receivers: Array, dropout_rate: float,
                    dropout_rng: Optional[jax.Array]) -> Array:
  """Attention along the edges `senders -> receivers` (`[B, E]`), O(E) memory:
  `[B, Tq, H, Dv]` float32."""
  query, key, value = inputs.query, inputs.key, inputs.value
  batch, q_len, num_heads, _ = query.shape
  kv_len = key.shape[1]
  # Negative (and, under jit, too large) indices are padding edges; they are
  # read at 0 and weigh nothing.
  valid = (receivers >= 0) & (receivers < q_len) & (senders >= 0) & (senders < kv_len)
  receivers, senders = jnp.clip(receivers, 0, q_len - 1), jnp.clip(senders, 0, kv_len - 1)
  # The masks of dot_product_attention are predicates of positions, evaluated
  # at each edge's (receiver, sender) pair.
  valid = mask_lib.and_masks(valid, mask_lib.reach_predicate(
      receivers, senders, mask_lib.reach_of(inputs.is_causal, None)))
  if inputs.query_seq_lengths is not None:
    valid = valid & mask_lib.length_predicate(
        receivers, jnp.asarray(inputs.query_seq_lengths)[:, None])
  if inputs.key_value_seq_lengths is not None:
    valid = valid & mask_lib.length_predicate(
        senders, jnp.asarray(inputs.key_value_seq_lengths)[:, None])
  if inputs.q_segment_ids is not None:
    valid = valid & mask_lib.segment_predicate(
        jnp.take_along_axis(inputs.q_segment_ids, receivers, axis=1),
        jnp.take_along_axis(inputs.kv_segment_ids, senders, axis=1))
  valid = valid[:, :, None]  # [B, E, 1]
  if inputs.mask is not None:
    valid = valid & _at_pairs(inputs.mask, receivers, senders)

  at_nodes = lambda x, index: jnp.take_along_axis(x, index[:, :, None, None], axis=1)
  edge_query = at_nodes(query, receivers)  # [B, E, H, D]
  edge_key = common.repeat_kv_heads(at_nodes(key, senders), num_heads)
  edge_value = common.repeat_kv_heads(at_nodes(value, senders), num_heads)  # [B, E, H, Dv]
  logits = jnp.einsum("behd,behd->beh", edge_query, edge_key,
                      preferred_element_type=jnp.float32) * inputs.scale
  if inputs.bias is not None:
    logits = logits + _at_pairs(inputs.bias, receivers, senders).astype(jnp.float32)
  valid = jnp.broadcast_to(valid, logits.shape)

  def per_receiver(segment_op, edge_values):  # [B, E, ...] -> [B, Tq, ...]
    return jax.vmap(lambda x, ids: segment_op(x, ids, num_segments=q_len))(edge_values,
                                                                           receivers)

  at_receivers = lambda node_values: jnp.take_along_axis(node_values, receivers[:, :, None],
                                                         axis=1)
  # The softmax over each receiver's edges, as core.softmax does it over a row:
  # the maximum only stabilises (so it passes no gradient), and a receiver
  # with no valid edge exponentiates nothing and divides by 1: zero weights.
  row_max = per_receiver(jax.ops.segment_max, jnp.where(valid, logits, MASKED_LOGSUMEXP))
  row_max = jax.lax.stop_gradient(
      jnp.where(jnp.isfinite(row_max) & (row_max > MASKED_LOGSUMEXP), row_max, 0.0))
  # Both `where`s: an invalid edge's exponent is never evaluated away from 0,
  # so neither its value nor its gradient can be inf or NaN.
  unnormalized = jnp.where(valid, jnp.exp(jnp.where(valid, logits - at_receivers(row_max),
                                                    0.0)), 0.0)
  normalizer = per_receiver(jax.ops.segment_sum, unnormalized)
  weights = unnormalized / at_receivers(jnp.where(normalizer > 0, normalizer, 1.0))
  weights = common.dropout_weights(weights, dropout_rate, dropout_rng)
  return per_receiver(jax.ops.segment_sum,
                      weights[..., None] * edge_value.astype(jnp.float32))  # [B, Tq, H, Dv]


def graph_attention(query: Array, key: Array, value: Array, bias: Optional[Array] = None,
                    mask: Optional[Array] = None, *, adjacency: Optional[Array] = None,
                    senders: Optional[Array] = None, receivers: Optional[Array] = None,
                    scale: Optional[float] = None, is_causal: bool = False,
                    query_seq_lengths: Optional[Array] = None,
                    key_value_seq_lengths: Optional[Array] = None, segment_ids=None,
                    dropout_rate: float = 0.0,
                    dropout_rng: Optional[jax.Array] = None,
                    implementation: Optional[str] = None) -> Array:
  """Attention along the edges of a graph: node i attends to its neighbours j,
  out_i = sum_{j in N(i)} softmax_j(q_i . k_j * scale + bias) v_j.

  The graph is one of
  * nothing: the complete graph, which is dense attention (O(Tq Tk));
  * `adjacency`: boolean `[B, Tq, Tk]` or `[Tq, Tk]`, adjacency[b, i, j] True
    when node i attends to node j; a masked dense softmax (O(Tq Tk));
  * edge lists `senders`, `receivers`: int `[B, E]` or `[E]` (the same graph
    for every sequence), edge e going from key `senders[e]` to query
    `receivers[e]`; a negative index in either marks a padding edge (so
    graphs of different sizes batch together). Computed per edge: scores of
    gathered (q, k) pairs, a softmax per receiver by `jax.ops.segment_max`
    and `segment_sum`, outputs by `segment_sum` of weight * v: O(E + T)
    memory, no T x T array. Indices past the end are refused where they are
    concrete; under jit they are padding edges too. A repeated edge counts
    as often as it is listed.

  Every other mask (causal, lengths, segments, `mask`, `bias`) applies on top,
  evaluated at each edge's (receiver, sender) pair on the edge path. A node
  with no (unmasked) incoming edge outputs zeros.

  How a model gives the graph to `MultiHeadAttention(attention="graph")`: a
  dense adjacency rides on the layer's `mask` argument (`mask=adjacency[:,
  None]`, `[B, 1, Tq, Tk]`), which every mixer already takes; edge lists are
  per-call arrays, passed as `attention_arguments={"senders": s, "receivers":
  r}`, which the layer forwards to the variant's function (a `Block` passes
  it on with its other sequence arguments).

  Args:
    query: `[B, Tq, H, D]`; key: `[B, Tk, Hkv, D]`; value: `[B, Tk, Hkv, Dv]`.
    adjacency, senders, receivers: the graph, as above (not both forms).
    scale: logit scale; 1/sqrt(D) when None.
    implementation: None, the forms above (the reference); or a kernel of
      `flex_attention` ("blockwise", ...), with the adjacency closed over by
      its mask_mod; "blockwise" also skips the tiles with no edge (a block
      mask made from the adjacency), and neither builds the logits. Takes an
      adjacency (or none), not edge lists (already O(E)).
    The rest: as `dot_product_attention`.

  Returns:
    `[B, Tq, H, Dv]` in the query dtype.
  """
  if jnp.ndim(query) != 4 or jnp.ndim(key) != 4 or jnp.ndim(value) != 4:
    raise ValueError(f"query, key and value must be [B, T, H, D], got shapes "
                     f"{list(jnp.shape(query))}, {list(jnp.shape(key))}, "
                     f"{list(jnp.shape(value))}.")
  batch, q_len = query.shape[:2]
  kv_len = key.shape[1]
  passed_on = dict(is_causal=is_causal, query_seq_lengths=query_seq_lengths,
                   key_value_seq_lengths=key_value_seq_lengths, segment_ids=segment_ids)
  if implementation is not None:
    if senders is not None or receivers is not None:
      raise ValueError(f"graph with implementation={implementation!r} takes an adjacency; edge "
                       "lists run on implementation=None (O(E) already).")
    edges = None if adjacency is None else jnp.broadcast_to(
        _check_adjacency(adjacency, batch, q_len, kv_len)[:, 0], (batch, q_len, kv_len))
    mask_mod = None if edges is None else (lambda b, h, q_idx, kv_idx: edges[b, q_idx, kv_idx])
    graph = dict(mask_mod=mask_mod)
    if mask_mod is not None and implementation == "blockwise":
      graph = dict(block_mask=create_block_mask(mask_mod, batch, None, q_len, kv_len))
    return flex_attention(query, key, value, bias=bias, mask=mask, scale=scale,
                          implementation=implementation, dropout_rate=dropout_rate,
                          dropout_rng=dropout_rng, **graph, **passed_on)
  if senders is None and receivers is None:
    common.check_query_key_sizes("graph", query, key)
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    edges = None if adjacency is None else _check_adjacency(adjacency, batch, q_len, kv_len)
    return scoring.scored_attention(
        query, key, value, lambda q, k: scoring.dot_score(q, k) * scale, bias, mask,
        weighting=lambda scores, allowed: masked_softmax(scores,
                                                         mask_lib.and_masks(allowed, edges)),
        dropout_rate=dropout_rate, dropout_rng=dropout_rng, **passed_on)
  if adjacency is not None:
    raise ValueError("give the graph as adjacency or as senders and receivers, not both.")
  senders, receivers = _check_edges(senders, receivers, batch, q_len, kv_len)
  inputs, _ = prepare_inputs(query, key, value, bias, mask, scale=scale, **passed_on)
  out = _edge_attention(inputs, senders, receivers, dropout_rate, dropout_rng)
  return out.astype(query.dtype)


_STRUCTURED = dict(family="scoring", causal=True, cross=True)
registry.register(registry.VariantSpec(
    name="structured_crf", takes=("dropout",), fn=structured_crf_attention, paper="Kim et al. 2017",
    complexity="O(T^2)", subquadratic=False, exact=False, extras=CRFTransition,
    options=dict(normalize="divide the CRF marginals by their sum (False: the paper's "
                           "weights, which need not sum to 1)"),
    **_STRUCTURED))
# Exact: softmax attention under the graph's mask. Quadratic as a layer (with
# no graph or a dense adjacency); edge lists cost O(E).
registry.register(registry.VariantSpec(
    name="graph", takes=("dropout",), fn=graph_attention, paper="Velickovic et al. 2018",
    complexity="O(T^2); O(E) with edge lists", subquadratic=False, exact=True,
    options=dict(scale="logit scale; 1/sqrt(D) when None",
                 implementation="None: the masked softmax or the edge lists (the reference); "
                                "'blockwise', 'xla', ...: flex_attention with the adjacency as "
                                "its mask_mod ('blockwise' skips tiles with no edge)"),
    **_STRUCTURED))
