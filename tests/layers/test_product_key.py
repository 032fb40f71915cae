"""ProductKeyMemory against scoring every one of its num_keys^2 slots (which the
layer itself never does)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_jax.layers import ProductKeyMemory
from attention_jax.layers.product_key import product_key_lookup
from attention_testing import (assert_close, intermediate_shapes, jit_apply, jit_call, jit_init,
                               perturbed)

B, T, E = 2, 5, 12


def _all_slot_scores(queries, sub_keys):
  """Every slot's score: the key of slot (i, j) is [c_i, c'_j]. [..., H, n^2]."""
  half = queries.shape[-1] // 2
  n = sub_keys.shape[2]
  keys = np.concatenate([np.repeat(sub_keys[0], n, axis=1),   # c_i for slot i * n + j
                         np.tile(sub_keys[1], (1, n, 1))], axis=-1)  # c'_j
  assert keys.shape[1] == n * n and half * 2 == keys.shape[-1]
  return np.einsum("...hd,hsd->...hs", queries, keys)


@pytest.mark.parametrize("num_keys,top_k", [(6, 1), (6, 4), (5, 5)])
def test_lookup_finds_the_best_slots_of_all_num_keys_squared(num_keys, top_k):
  rng = np.random.default_rng(num_keys + top_k)
  queries = rng.normal(size=(B, T, 3, 8)).astype(np.float32)
  sub_keys = rng.normal(size=(2, 3, num_keys, 4)).astype(np.float32)
  scores, slots = jit_call(product_key_lookup, jnp.asarray(queries), jnp.asarray(sub_keys), top_k)
  full = _all_slot_scores(queries.astype(np.float64), sub_keys.astype(np.float64))
  expected_slots = np.argsort(-full, axis=-1, kind="stable")[..., :top_k]
  np.testing.assert_array_equal(slots, expected_slots)
  assert_close(scores, np.take_along_axis(full, expected_slots, axis=-1), atol=1e-5)


def test_memory_output_equals_the_softmax_over_the_best_slots_of_all_slots():
  module = ProductKeyMemory(num_keys=8, top_k=3, num_heads=2, key_dim=6)
  x = jax.random.normal(jax.random.PRNGKey(0), (B, T, E))
  params = perturbed(nn.meta.unbox(jit_init(module, jax.random.PRNGKey(1), x))["params"])
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
  queries = np.asarray(x, np.float64) @ p["query"]["kernel"].reshape(E, -1)
  queries = (queries + p["query"]["bias"].reshape(-1)).reshape(B, T, 2, 2, 3)
  centred = queries - queries.mean(-1, keepdims=True)
  queries = centred / np.sqrt((centred ** 2).mean(-1, keepdims=True) + 1e-6)  # per half
  full = _all_slot_scores(queries.reshape(B, T, 2, 6), p["sub_keys"])
  best = np.argsort(-full, axis=-1)[..., :3]
  weights = np.exp(np.take_along_axis(full, best, -1))
  weights /= weights.sum(-1, keepdims=True)
  expected = np.einsum("bthk,bthke->bte", weights, p["values"][best])
  assert_close(jit_apply(module, {"params": params}, x), expected, atol=1e-5)


def test_no_array_the_size_of_the_memory_is_built_but_its_values():
  """n = 256: 65,536 slots. Forward and backward, no intermediate has a
  65,536-long axis except the values' gradient (a scatter into the table)."""
  module = ProductKeyMemory(num_keys=256, top_k=4, num_heads=2, key_dim=8)
  x = jax.random.normal(jax.random.PRNGKey(0), (B, T, E))
  params = nn.meta.unbox(jit_init(module, jax.random.PRNGKey(1), x))["params"]
  assert params["values"].shape == (256 * 256, E)
  forward = intermediate_shapes(lambda p: jit_apply(module, {"params": p}, x), params)
  assert not [s for s in forward if 256 * 256 in s]
  backward = intermediate_shapes(
      jax.grad(lambda p: jnp.sum(jit_apply(module, {"params": p}, x))), params)
  assert [s for s in backward if 256 * 256 in s] == [(256 * 256, E)]


@pytest.mark.parametrize("options,message", [
    (dict(key_dim=7), r"key_dim must be even \(two halves\), got 7"),
    (dict(num_keys=4, top_k=5), r"top_k must be at most num_keys=4, got 5"),
    (dict(num_heads=0), r"num_heads must be a positive integer, got 0"),
])
def test_bad_options_raise_naming_the_option(options, message):
  with pytest.raises(ValueError, match=message):
    ProductKeyMemory(**options).init(jax.random.PRNGKey(0), jnp.ones((B, T, E)))


def test_initialises_and_runs_under_a_mesh_with_logical_rules():
  """As the trainer builds it (the architectures table's row failed here while
  the query projection was nn.DenseGeneral, flax issue #3676)."""
  from attention_jax import axes  # pylint: disable=g-import-not-at-top
  mesh = jax.make_mesh((1, 1, 1), ("data", "fsdp", "tensor"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 3)
  memory = ProductKeyMemory(num_keys=8, top_k=2, num_heads=2, key_dim=8)
  x = jax.random.normal(jax.random.PRNGKey(0), (2, 5, 16))
  with jax.set_mesh(mesh), nn.logical_axis_rules(axes.DEFAULT_RULES):
    variables = jit_init(memory, jax.random.PRNGKey(1), x)
    out = jax.jit(memory.apply)(variables, x)
  specs = nn.get_partition_spec(variables)["params"]
  assert specs["query"]["kernel"] == jax.sharding.PartitionSpec("embed", "heads", "kv")
  assert_close(out, jit_apply(memory, nn.meta.unbox(variables), x), atol=1e-6)
