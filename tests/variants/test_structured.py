"""Structured attention: the CRF marginals against brute-force enumeration of
every label sequence (numpy, float64) and their gradients against finite
differences; graph attention on a complete graph against dense attention, and
as edge lists against the dense adjacency and a numpy masked softmax."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attention_jax
from attention_jax.core import reference_attention
from attention_jax.models import Block, ModelConfig
from attention_jax.variants import structured
from attention_testing import (as_float64, assert_close, assert_same_outputs_and_grads, jit_apply,
                               jit_call, jit_init, largest_intermediate, random_qkv)

# ---------------------------------------------------------------------------- structured_crf


def _np_chain_marginals(unary, transition, allowed):
  """p(z_j = 1) of one chain by enumerating every labelling of its allowed
  positions (the masked ones are not in the chain): unary [T], transition
  [2, 2], allowed [T] bool."""
  positions = np.flatnonzero(allowed)
  marginals = np.zeros(len(unary))
  if not len(positions):
    return marginals
  labels = np.array(list(itertools.product([0, 1], repeat=len(positions))))  # [2^n, n]
  log_potential = labels @ unary[positions] + transition[labels[:, :-1], labels[:, 1:]].sum(1)
  probability = np.exp(log_potential - log_potential.max())
  probability /= probability.sum()
  marginals[positions] = probability @ labels
  return marginals


def _np_marginals(unary, transition, allowed):
  """`_np_chain_marginals` over leading axes: unary, allowed [..., T]; transition [..., 2, 2]."""
  unary = as_float64(unary)
  allowed = np.broadcast_to(allowed, unary.shape)
  transition = np.broadcast_to(as_float64(transition), unary.shape[:-1] + (2, 2))
  out = np.zeros_like(unary)
  for index in np.ndindex(unary.shape[:-1]):
    out[index] = _np_chain_marginals(unary[index], transition[index], allowed[index])
  return out


def _np_crf_attention(query, key, value, transition, allowed):
  """The structured_crf output and weights: query [B, Tq, H, D], key/value
  [B, Tk, H, *], transition [H, 2, 2], allowed [B|1, 1, Tq, Tk]."""
  query, key, value = as_float64(query), as_float64(key), as_float64(value)
  scores = np.einsum("bqhd,bkhd->bhqk", query, key) / np.sqrt(query.shape[-1])
  weights = _np_marginals(scores, as_float64(transition)[None, :, None], allowed)
  return np.einsum("bhqk,bkhv->bqhv", weights, value), weights


@pytest.mark.property("structured_crf")
@pytest.mark.parametrize("length", [1, 2, 3, 4, 5, 6])
def test_crf_marginals_equal_brute_force_enumeration(length):
  rng = np.random.default_rng(length)
  unary = rng.normal(size=(4, length)) * 2.0
  transition = rng.normal(size=(4, 2, 2)) * 1.5
  allowed = rng.random((4, length)) > 0.3
  allowed[0] = True  # one full chain
  allowed[1] = False  # one with nothing to attend: weights 0
  with jax.enable_x64(True):
    got = jax.jit(structured.linear_chain_marginals)(jnp.asarray(unary), jnp.asarray(transition),
                                                     jnp.asarray(allowed))
    assert got.dtype == jnp.float64
    np.testing.assert_allclose(np.asarray(got), _np_marginals(unary, transition, allowed),
                               rtol=1e-12, atol=1e-12)


@pytest.mark.property("structured_crf")
def test_crf_marginal_gradients_equal_finite_differences_in_float64():
  rng = np.random.default_rng(0)
  unary = rng.normal(size=(2, 6))
  transition = rng.normal(size=(2, 2, 2))
  allowed = np.array([[True] * 6, [True, False, True, True, False, True]])
  weights = rng.normal(size=(2, 6))
  with jax.enable_x64(True):
    loss = jax.jit(lambda u, t: jnp.sum(jnp.sin(structured.linear_chain_marginals(
        u, t, jnp.asarray(allowed)) * weights)))
    grads = jax.grad(loss, argnums=(0, 1))(jnp.asarray(unary), jnp.asarray(transition))
    arguments = [unary, transition]
    for argument, grad in enumerate(grads):
      numeric = np.zeros_like(arguments[argument])
      for index in np.ndindex(numeric.shape):
        shifted = [a.copy() for a in arguments], [a.copy() for a in arguments]
        shifted[0][argument][index] += 1e-6
        shifted[1][argument][index] -= 1e-6
        numeric[index] = (float(loss(*shifted[0])) - float(loss(*shifted[1]))) / 2e-6
      np.testing.assert_allclose(np.asarray(grad), numeric, rtol=1e-6, atol=1e-8)
    assert np.abs(np.asarray(grads[1])).max() > 1e-3  # the transition matters


@pytest.mark.property("structured_crf")
@pytest.mark.parametrize("kwargs, allowed", [
    ({}, np.ones((1, 1, 5, 5), bool)),
    (dict(is_causal=True), np.tril(np.ones((5, 5), bool))[None, None]),
    (dict(key_value_seq_lengths=jnp.array([3])), (np.arange(5) < 3)[None, None, None, :]),
])
def test_crf_attention_is_the_marginals_of_its_scores_and_its_gradients_are_right(kwargs,
                                                                                   allowed):
  """Against numpy enumeration: the output, and the gradients in query, key and
  transition against central differences of that float64 enumeration."""
  query, key, value = random_qkv(seed=1, batch=1, q_len=5, num_heads=2, head_dim=3)
  transition = jax.random.normal(jax.random.PRNGKey(5), (2, 2, 2))
  cotangent = np.random.default_rng(1).normal(size=(1, 5, 2, 3))

  def ours(q, k, t):
    return structured.structured_crf_attention(q, k, value, transition=t, **kwargs)

  out = jax.jit(ours)(query, key, transition)
  expected, weights = _np_crf_attention(query, key, value, transition, allowed)
  assert_close(out, expected, rtol=1e-5, atol=1e-5)
  assert np.all(weights[..., ~np.broadcast_to(allowed, weights.shape)] == 0)

  grads = jax.jit(jax.grad(lambda *a: jnp.sum(ours(*a) * cotangent), argnums=(0, 1, 2)))(
      query, key, transition)
  arguments = [as_float64(query), as_float64(key), as_float64(transition)]
  loss = lambda q, k, t: np.sum(_np_crf_attention(q, k, value, t, allowed)[0] * cotangent)
  for argument, grad in enumerate(grads):
    numeric = np.zeros_like(arguments[argument])
    for index in np.ndindex(numeric.shape):
      plus, minus = [a.copy() for a in arguments], [a.copy() for a in arguments]
      plus[argument][index] += 1e-6
      minus[argument][index] -= 1e-6
      numeric[index] = (loss(*plus) - loss(*minus)) / 2e-6
    assert_close(grad, numeric, rtol=1e-4, atol=1e-5, err_msg=f"gradient of argument {argument}")


@pytest.mark.property("structured_crf")
def test_crf_with_zero_transitions_is_independent_sigmoids():
  query, key, value = random_qkv(seed=2, num_heads=2, head_dim=4, kv_len=6)
  scores = np.einsum("bqhd,bkhd->bhqk", as_float64(query), as_float64(key)) / 2.0
  sigmoid = 1.0 / (1.0 + np.exp(-scores))
  got = jit_call(structured.structured_crf_attention, query, key, value)
  assert_close(got, np.einsum("bhqk,bkhv->bqhv", sigmoid, as_float64(value)), atol=1e-5)
  normalized = sigmoid / sigmoid.sum(-1, keepdims=True)
  got = jit_call(structured.structured_crf_attention, query, key, value, normalize=True,
                 transition=jnp.zeros((2, 2, 2)))
  assert_close(got, np.einsum("bhqk,bkhv->bqhv", normalized, as_float64(value)), atol=1e-5)


@pytest.mark.property("structured_crf")
@pytest.mark.parametrize("padding", ["lengths", "mask"])
@pytest.mark.parametrize("normalize", [False, True])
def test_crf_padded_keys_weigh_nothing_and_change_nothing(padding, normalize):
  """Keys 5..8 padded: weight 0, and the outputs are those of the 5 real keys alone."""
  query, key, _ = random_qkv(seed=3, batch=2, q_len=4, kv_len=8, num_heads=2, head_dim=4)
  value = jnp.broadcast_to(jnp.eye(8)[None, :, None, :], (2, 8, 2, 8))  # out = the weights
  transition = jax.random.normal(jax.random.PRNGKey(6), (2, 2, 2))
  lengths = jnp.array([5, 5])
  padded = (dict(key_value_seq_lengths=lengths) if padding == "lengths" else
            dict(mask=(jnp.arange(8) < 5)[None, None, None, :]))
  crf = jax.jit(lambda k, v, **kw: structured.structured_crf_attention(
      query, k, v, transition=transition, normalize=normalize, **kw))
  weights = crf(key, value, **padded)
  assert np.all(np.asarray(weights)[..., 5:] == 0)
  assert_close(weights[..., :5], crf(key[:, :5], value[:, :5, :, :5]), rtol=1e-5, atol=1e-6)
  if normalize:
    assert_close(np.asarray(weights).sum(-1), np.ones((2, 4, 2)), atol=1e-5)
  # What the padded keys hold changes nothing.
  assert_close(crf(key.at[:, 5:].set(9.0), value, **padded), weights, rtol=1e-6, atol=1e-7)


@pytest.mark.property("structured_crf")
def test_crf_layer_learns_its_transition():
  layer = attention_jax.MultiHeadAttention(num_heads=2, attention="structured_crf")
  x = jax.random.normal(jax.random.PRNGKey(0), (2, 6, 8))
  variables = jit_init(layer, jax.random.PRNGKey(1), x)
  transition = variables["params"]["variant"]["transition"]
  assert transition.shape == (2, 2, 2) and not np.any(transition)
  grads = jax.grad(lambda p: jnp.sum(jnp.sin(jit_apply(layer, {"params": p}, x))))(variables["params"])
  assert float(jnp.max(jnp.abs(grads["variant"]["transition"]))) > 0.0


@pytest.mark.parametrize("transition, message", [
    (jnp.zeros((2, 2)), r"transition must have shape \[2, 2, 2\], got \[2, 2\]"),
    (jnp.zeros((3, 2, 2)), r"transition must have shape \[2, 2, 2\], got \[3, 2, 2\]"),
    (jnp.zeros((2, 3, 3)), r"transition must have shape \[2, 2, 2\], got \[2, 3, 3\]"),
])
def test_crf_refuses_a_bad_transition(transition, message):
  query, key, value = random_qkv(num_heads=2, head_dim=4)
  with pytest.raises(ValueError, match=message):
    structured.structured_crf_attention(query, key, value, transition=transition)


# ---------------------------------------------------------------------------- graph


def _complete_edges(q_len, kv_len):
  receivers, senders = np.meshgrid(np.arange(q_len), np.arange(kv_len), indexing="ij")
  return jnp.asarray(senders.reshape(-1)), jnp.asarray(receivers.reshape(-1))


@pytest.mark.parity("graph")
@pytest.mark.parametrize("form", ["none", "adjacency", "edges"])
def test_graph_on_the_complete_graph_is_dense_attention(form):
  query, key, value = random_qkv(seed=4, q_len=5, kv_len=7, num_heads=4, num_kv_heads=2)
  graph = {"none": {}, "adjacency": dict(adjacency=jnp.ones((5, 7), bool)),
           "edges": dict(zip(("senders", "receivers"), _complete_edges(5, 7)))}[form]
  assert_same_outputs_and_grads(
      lambda q, k, v: structured.graph_attention(q, k, v, **graph), reference_attention,
      query, key, value, rtol=1e-5, atol=1e-5)


def _random_graph(seed, batch, q_len, kv_len, num_edges):
  """Edge lists [B, E] with some padding edges (-1), no repeated edge, and
  node 0 of every sequence isolated; and the adjacency [B, Tq, Tk] they give."""
  rng = np.random.default_rng(seed)
  senders = np.full((batch, num_edges), -1)
  receivers = np.full((batch, num_edges), -1)
  adjacency = np.zeros((batch, q_len, kv_len), bool)
  for b in range(batch):
    pairs = [(r, s) for r in range(1, q_len) for s in range(kv_len)]
    chosen = rng.choice(len(pairs), size=num_edges - 3, replace=False)
    for e, index in enumerate(chosen):
      receivers[b, e], senders[b, e] = pairs[index]
      adjacency[b, pairs[index][0], pairs[index][1]] = True
    order = rng.permutation(num_edges)  # padding edges anywhere
    senders[b], receivers[b] = senders[b, order], receivers[b, order]
  return jnp.asarray(senders), jnp.asarray(receivers), adjacency


@pytest.mark.parity("graph")
@pytest.mark.parametrize("kwargs", [{}, dict(is_causal=True),
                                    dict(key_value_seq_lengths=jnp.array([9, 4]))])
def test_graph_as_edges_equals_the_adjacency_and_a_numpy_masked_softmax(kwargs):
  query, key, value = random_qkv(seed=5, q_len=9, num_heads=2, head_dim=4)
  senders, receivers, adjacency = _random_graph(0, 2, 9, 9, num_edges=30)
  bias = jax.random.normal(jax.random.PRNGKey(3), (1, 2, 9, 9))
  edges = lambda q, k, v, b: structured.graph_attention(q, k, v, b, senders=senders,
                                                         receivers=receivers, **kwargs)
  dense = lambda q, k, v, b: structured.graph_attention(q, k, v, b, adjacency=adjacency,
                                                         **kwargs)
  assert_same_outputs_and_grads(edges, dense, query, key, value, bias, rtol=1e-5, atol=1e-5)

  allowed = adjacency[:, None]
  if kwargs.get("is_causal"):
    allowed = allowed & np.tril(np.ones((9, 9), bool))
  if "key_value_seq_lengths" in kwargs:
    allowed = allowed & (np.arange(9)[None, :] < np.array([9, 4])[:, None])[:, None, None]
  logits = (np.einsum("bqhd,bkhd->bhqk", as_float64(query), as_float64(key)) / 2.0
            + as_float64(bias))
  logits = np.where(allowed, logits, -np.inf)
  row_max = np.where(allowed.any(-1, keepdims=True), logits.max(-1, keepdims=True), 0.0)
  weights = np.exp(logits - row_max)
  weights /= np.maximum(weights.sum(-1, keepdims=True), 1e-300)
  expected = np.einsum("bhqk,bkhv->bqhv", weights, as_float64(value))
  out = jax.jit(edges)(query, key, value, bias)
  assert_close(out, expected, rtol=1e-5, atol=1e-5)
  assert np.all(np.asarray(out)[:, 0] == 0)  # node 0 has no incoming edge


@pytest.mark.parity("graph")
@pytest.mark.parametrize("implementation", ["blockwise", "xla"])
def test_graph_on_flex_equals_the_masked_softmax(implementation):
  # The adjacency as flex's mask_mod (on blockwise also a block mask; block
  # masks are checked against brute force in tests/kernels/test_flex.py).
  query, key, value = random_qkv(seed=5, q_len=19, num_heads=2, head_dim=4)
  _, _, adjacency = _random_graph(0, 2, 19, 19, num_edges=60)
  bias = jax.random.normal(jax.random.PRNGKey(3), (1, 2, 19, 19))
  options = dict(adjacency=adjacency, is_causal=True, key_value_seq_lengths=jnp.array([19, 7]))
  assert_same_outputs_and_grads(
      lambda q, k, v, b: structured.graph_attention(q, k, v, b, implementation=implementation,
                                                    **options),
      lambda q, k, v, b: structured.graph_attention(q, k, v, b, **options),
      query, key, value, bias, rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError, match=r"graph with implementation='blockwise' takes an "
                                       r"adjacency; edge lists run on implementation=None"):
    structured.graph_attention(query, key, value, senders=jnp.zeros(3, jnp.int32),
                               receivers=jnp.zeros(3, jnp.int32), implementation="blockwise")


@pytest.mark.parity("graph")
@pytest.mark.parametrize("form", ["adjacency", "edges"])
def test_graph_isolated_nodes_give_zeros_and_finite_gradients(form):
  query, key, value = random_qkv(seed=6, q_len=4, num_heads=2, head_dim=4)
  # Only node 2 receives (from 0 and 3); the others are isolated.
  graph = (dict(adjacency=jnp.array([[False] * 4] * 2 + [[True, False, False, True]]
                                    + [[False] * 4])) if form == "adjacency" else
           dict(senders=jnp.array([0, 3, -1]), receivers=jnp.array([2, 2, -1])))
  fn = jax.jit(lambda q, k, v: structured.graph_attention(q, k, v, **graph))
  out = fn(query, key, value)
  assert np.all(np.asarray(out)[:, [0, 1, 3]] == 0)
  assert np.abs(np.asarray(out)[:, 2]).max() > 0
  grads = jax.grad(lambda *a: jnp.sum(fn(*a) ** 2), argnums=(0, 1, 2))(query, key, value)
  assert all(np.isfinite(np.asarray(g)).all() for g in grads)
  assert np.all(np.asarray(grads[0])[:, [0, 1, 3]] == 0)


@pytest.mark.parity("graph")
def test_graph_edge_lists_build_no_length_squared_array():
  length, heads, dim = 4096, 2, 8
  rng = np.random.default_rng(0)
  senders = jnp.asarray(rng.integers(0, length, size=(1, 8 * length)))
  receivers = jnp.asarray(rng.integers(0, length, size=(1, 8 * length)))
  x = jnp.zeros((1, length, heads, dim))

  def grads(graph):
    loss = lambda q, k, v: jnp.sum(structured.graph_attention(q, k, v, **graph) ** 2)
    return lambda *a: jax.grad(loss, argnums=(0, 1, 2))(*a)

  largest = largest_intermediate(grads(dict(senders=senders, receivers=receivers)), x, x, x)
  assert largest < length * length // 4, largest
  # The same check sees the dense form's T x T scores.
  dense = largest_intermediate(grads({}), x, x, x)
  assert dense >= length * length


@pytest.mark.parity("graph")
def test_graph_layer_takes_edges_as_attention_arguments_or_an_adjacency_as_mask():
  layer = attention_jax.MultiHeadAttention(num_heads=2, attention="graph")
  x = jax.random.normal(jax.random.PRNGKey(0), (2, 9, 16))
  variables = jit_init(layer, jax.random.PRNGKey(1), x)
  senders, receivers, adjacency = _random_graph(1, 2, 9, 9, num_edges=25)
  by_edges = jax.jit(lambda v, x, s, r: layer.apply(
      v, x, attention_arguments=dict(senders=s, receivers=r)))(variables, x, senders, receivers)
  by_mask = jit_apply(layer, variables, x, mask=jnp.asarray(adjacency)[:, None])
  assert_close(by_edges, by_mask, rtol=1e-5, atol=1e-5)
  assert not np.allclose(by_mask, jit_apply(layer, variables, x))  # the graph matters
  with pytest.raises(ValueError, match="takes no attention argument 'edges'; its function "
                                       "takes: adjacency, senders, receivers, scale"):
    jit_apply(layer, variables, x, attention_arguments=dict(edges=senders))
  with pytest.raises(ValueError, match="takes no attention argument 'is_causal'"):
    jit_apply(layer, variables, x, attention_arguments=dict(is_causal=True))


@pytest.mark.parity("graph")
def test_a_block_passes_the_edges_on_to_its_mixer():
  config = ModelConfig(attention="graph", num_layers=1, embed_dim=16, num_heads=2, mlp_dim=32,
                       max_length=9, dropout_rate=0.0)
  block = Block(config)
  x = jax.random.normal(jax.random.PRNGKey(0), (2, 9, 16))
  variables = jit_init(block, jax.random.PRNGKey(1), x, {})
  senders, receivers, adjacency = _random_graph(2, 2, 9, 9, num_edges=20)
  by_edges, _ = jit_apply(block, variables, x, {},
                            attention_arguments=dict(senders=senders, receivers=receivers))
  by_mask, _ = jit_apply(block, variables, x, {}, mask=jnp.asarray(adjacency)[:, None])
  assert_close(by_edges, by_mask, rtol=1e-5, atol=1e-5)


_EDGES = jnp.array([[0, 1], [2, 3]])


@pytest.mark.parametrize("graph, message", [
    (dict(adjacency=jnp.ones((7, 6), bool)),
     r"adjacency must have shape \[B, Tq, Tk\] = \[2, 7, 7\] or \[Tq, Tk\] = \[7, 7\], "
     r"got \[7, 6\]"),
    (dict(adjacency=jnp.ones((7, 7))), "adjacency must be boolean .* got dtype float32"),
    (dict(senders=_EDGES, receivers=jnp.array([0, 1])),
     r"senders and receivers must have the same shape .* got senders \[2, 2\] and "
     r"receivers \[2\]"),
    (dict(senders=_EDGES, receivers=_EDGES.astype(jnp.float32)),
     "receivers must be an integer array of node indices, got dtype float32"),
    (dict(senders=_EDGES.at[1, 1].set(7), receivers=_EDGES),
     r"senders must index the 7 keys \(0 to 6; .*\), got index 7"),
    (dict(senders=_EDGES, receivers=_EDGES.at[0, 0].set(9)),
     r"receivers must index the 7 queries \(0 to 6; .*\), got index 9"),
    (dict(senders=jnp.zeros((3, 2), int), receivers=jnp.zeros((3, 2), int)),
     r"senders must have shape \[B, E\] = \[2, E\] or \[E\], got \[3, 2\]"),
    (dict(senders=_EDGES), "need both senders and receivers, got receivers=None"),
    (dict(senders=_EDGES, receivers=_EDGES, adjacency=jnp.ones((7, 7), bool)),
     "not both"),
])
def test_graph_refuses_bad_graphs_naming_the_argument(graph, message):
  query, key, value = random_qkv(num_heads=2, head_dim=4)
  with pytest.raises(ValueError, match=message):
    structured.graph_attention(query, key, value, **graph)
