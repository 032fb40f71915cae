"""routing_aggregation (Li et al. 2019): heads aggregated by routing-by-agreement."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attention_jax
from attention_jax.models import Block, ModelConfig
from attention_jax.variants import heads as heads_lib
from attention_testing import (as_float64, assert_close, jit_apply, jit_call, jit_init,
                               perturbed)

B, T, H, D, N, C = 2, 5, 4, 3, 3, 2


def random_heads(seed):
  rng = np.random.default_rng(seed)
  return (jnp.asarray(rng.normal(size=(B, T, H, D)), jnp.float32),
          jnp.asarray(rng.normal(size=(H, N, D, C)), jnp.float32))


def np_squash(s):
  norm = np.linalg.norm(s, axis=-1, keepdims=True)
  return s * norm / (1 + norm ** 2)


def np_route(head_outputs, vote_kernels, iterations):
  """Dynamic routing written out per position, head and capsule (float64)."""
  o, w = as_float64(head_outputs), as_float64(vote_kernels)
  out = np.zeros((B, T, N, C))
  for b in range(B):
    for t in range(T):
      votes = np.stack([[o[b, t, h] @ w[h, n] for n in range(N)] for h in range(H)])  # [H, N, C]
      logits = np.zeros((H, N))
      for _ in range(iterations):
        coupling = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
        capsules = np.stack([np_squash(sum(coupling[h, n] * votes[h, n] for h in range(H)))
                             for n in range(N)])
        logits = logits + np.einsum("nc,hnc->hn", capsules, votes)
      out[b, t] = capsules
  return out.reshape(B, T, N * C)


@pytest.mark.property("routing_aggregation")
def test_one_iteration_is_the_squashed_mean_of_the_projected_votes():
  """Uniform couplings 1/N: out_n = squash((1/N) sum_h O_h W_{h,n}); with N = H
  capsules that is the squashed mean over the heads."""
  rng = np.random.default_rng(0)
  head_outputs = jnp.asarray(rng.normal(size=(B, T, H, D)), jnp.float32)
  vote_kernels = jnp.asarray(rng.normal(size=(H, H, D, C)), jnp.float32)
  out = heads_lib.route_heads(head_outputs, vote_kernels, iterations=1)
  votes = np.einsum("bthd,hndc->bthnc", as_float64(head_outputs), as_float64(vote_kernels))
  want = np_squash(votes.mean(axis=2)).reshape(B, T, H * C)
  assert_close(out, want, rtol=1e-5, atol=1e-6)


@pytest.mark.property("routing_aggregation")
@pytest.mark.parametrize("iterations", [1, 3])
def test_route_heads_against_numpy(iterations):
  head_outputs, vote_kernels = random_heads(1)
  out = jax.jit(heads_lib.route_heads, static_argnums=2)(head_outputs, vote_kernels, iterations)
  assert_close(out, np_route(head_outputs, vote_kernels, iterations), rtol=1e-4, atol=1e-5)


@pytest.mark.property("routing_aggregation")
def test_routing_moves_the_couplings_towards_agreement():
  """Three iterations differ from one: the couplings have moved."""
  head_outputs, vote_kernels = random_heads(2)
  one = heads_lib.route_heads(head_outputs, vote_kernels, 1)
  three = heads_lib.route_heads(head_outputs, vote_kernels, 3)
  assert np.abs(np.asarray(one) - np.asarray(three)).max() > 1e-3


@pytest.mark.property("routing_aggregation")
@pytest.mark.parametrize("arguments, message", [
    (dict(iterations=0), "iterations"),
    (dict(vote_kernels=jnp.zeros((H + 1, N, D, C))), "vote_kernels"),
    (dict(vote_kernels=jnp.zeros((H, N, D + 1, C))), "vote_kernels"),
    (dict(head_outputs=jnp.zeros((T, H, D))), "head_outputs"),
])
def test_route_heads_rejects_bad_arguments(arguments, message):
  head_outputs, vote_kernels = random_heads(3)
  given = dict(head_outputs=head_outputs, vote_kernels=vote_kernels, iterations=3)
  given.update(arguments)
  with pytest.raises(ValueError, match=message):
    heads_lib.route_heads(**given)


@pytest.mark.property("routing_aggregation")
def test_module_is_dot_product_heads_then_routing():
  module = heads_lib.RoutingAggregation(num_heads=2, iterations=2)
  x = jax.random.normal(jax.random.PRNGKey(0), (2, 6, 8))
  params = perturbed(jit_init(module, jax.random.PRNGKey(1), x)["params"])
  lengths = jnp.array([4, 6])
  out = jit_apply(module, {"params": params}, x, is_causal=True, key_value_seq_lengths=lengths)
  project = lambda name: jnp.einsum("bte,ehd->bthd", x, params[name]["kernel"]) + \
      params[name]["bias"]
  heads = jit_call(attention_jax.dot_product_attention, project("query"), project("key"),
                   project("value"), is_causal=True, key_value_seq_lengths=lengths)
  assert_close(out, jit_call(heads_lib.route_heads, heads, params["vote_kernels"], 2), atol=1e-5)
  with pytest.raises(ValueError, match="num_capsules"):
    heads_lib.RoutingAggregation(num_heads=2, num_capsules=3).init(jax.random.PRNGKey(1), x)


@pytest.mark.property("routing_aggregation")
def test_runs_in_a_causal_block_under_jit():
  config = ModelConfig(attention="routing_aggregation",
                       attention_options={"num_capsules": 4, "iterations": 3}, num_layers=1,
                       embed_dim=16, num_heads=2, mlp_dim=32, max_length=8, dropout_rate=0.0)
  block = Block(config)
  x = jax.random.normal(jax.random.PRNGKey(2), (2, 8, 16))
  variables = jit_init(block, jax.random.PRNGKey(0), x, {})
  assert variables["params"]["attention"]["vote_kernels"].shape == (2, 4, 8, 4)
  run = jax.jit(lambda v, x: block.apply(v, x, {}, is_causal=True)[0])
  y = run(variables, x)
  # Causal: a change at the last position leaves the earlier outputs alone.
  z = run(variables, x.at[:, -1].add(1.0))
  assert_close(y[:, :-1], z[:, :-1], rtol=0, atol=1e-6)
  assert np.isfinite(np.asarray(y)).all()
