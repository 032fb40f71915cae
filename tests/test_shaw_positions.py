"""Shaw et al. 2018's relative position representations: the clipped index,
the attention against its explicit `[T, T, D]` formulation, its cost, and the
scheme by name in a layer."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attention_jax
from attention_jax import positional
from attention_jax.variants.dense import shaw_relative_attention
from attention_testing import (as_float64, assert_close, jit_apply, jit_call, jit_init,
                               largest_intermediate, random_qkv)

B, H = 2, 4


def test_index_is_the_clipped_distance_by_hand():
  index = positional.shaw_relative_index(jnp.arange(4), jnp.arange(5), max_distance=2)
  # k - q clipped to [-2, 2], plus 2.
  expected = [[2, 3, 4, 4, 4], [1, 2, 3, 4, 4], [0, 1, 2, 3, 4], [0, 0, 1, 2, 3]]
  np.testing.assert_array_equal(index[0], expected)
  with pytest.raises(ValueError, match="max_distance must be a positive int"):
    positional.shaw_relative_index(jnp.arange(4), jnp.arange(4), max_distance=0)


def np_shaw(query, key, value, key_embeddings, value_embeddings, index, allowed):
  """Eqs. 3-5 with the [Tq, Tk, D] arrays a^K_ij and a^V_ij built explicitly."""
  q, k, v = (as_float64(a) for a in (query, key, value))
  group = q.shape[2] // k.shape[2]
  k, v = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
  a_key = as_float64(key_embeddings)[index]  # [B, Tq, Tk, D]
  a_value = as_float64(value_embeddings)[index]
  logits = (np.einsum("bqhd,bkhd->bhqk", q, k)
            + np.einsum("bqhd,bqkd->bhqk", q, a_key)) / np.sqrt(q.shape[-1])
  logits = np.where(allowed, logits, -np.inf)
  weights = np.exp(logits - logits.max(-1, keepdims=True))
  weights = np.nan_to_num(weights / weights.sum(-1, keepdims=True))
  return (np.einsum("bhqk,bkhd->bqhd", weights, v)
          + np.einsum("bhqk,bqkd->bqhd", weights, a_value))


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("num_kv_heads", [H, 2])
def test_attention_equals_the_explicit_formulation(is_causal, num_kv_heads):
  length, max_distance = 9, 3
  query, key, value = random_qkv(seed=0, batch=B, q_len=length, kv_len=length, num_heads=H,
                                 num_kv_heads=num_kv_heads, head_dim=8)
  rng = np.random.default_rng(1)
  key_embeddings = jnp.asarray(rng.normal(size=(2 * max_distance + 1, 8)), jnp.float32)
  value_embeddings = jnp.asarray(rng.normal(size=(2 * max_distance + 1, 8)), jnp.float32)
  lengths = jnp.array([9, 6])
  index = positional.shaw_relative_index(jnp.arange(length), jnp.arange(length), max_distance)
  got = jit_call(shaw_relative_attention, query, key, value, key_embeddings=key_embeddings,
                 value_embeddings=value_embeddings, relative_index=index, is_causal=is_causal,
                 key_value_seq_lengths=lengths)
  q_pos, k_pos = np.arange(length)[:, None], np.arange(length)[None, :]
  allowed = (k_pos < np.asarray(lengths)[:, None, None, None]) & (
      (k_pos <= q_pos) if is_causal else True)
  expected = np_shaw(query, key, value, key_embeddings, value_embeddings,
                     np.broadcast_to(np.asarray(index), (B, length, length)), allowed)
  assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_no_length_by_length_by_dim_array_at_large_length():
  length, head_dim, max_distance = 1024, 32, 16
  query = jnp.zeros((1, length, 1, head_dim))
  rows = 2 * max_distance + 1
  index = positional.shaw_relative_index(jnp.arange(length), jnp.arange(length), max_distance)

  def loss(query, key_embeddings, value_embeddings):
    return jnp.sum(shaw_relative_attention(
        query, query, query, key_embeddings=key_embeddings, value_embeddings=value_embeddings,
        relative_index=index, is_causal=True))

  largest = largest_intermediate(jax.grad(loss, argnums=(0, 1, 2)), query,
                                 jnp.zeros((rows, head_dim)), jnp.zeros((rows, head_dim)))
  assert largest < length * length * head_dim / 4, largest


def _layer(**fields):
  return attention_jax.MultiHeadAttention(num_heads=H, position="shaw",
                                          position_options={"max_distance": 3}, **fields)


def test_layer_outputs_depend_on_distances_only_and_decode_as_the_causal_pass():
  x = jax.random.normal(jax.random.PRNGKey(0), (B, 10, 16))
  layer = _layer()
  variables = jit_init(layer, jax.random.PRNGKey(1), x)
  params = jax.tree.map(lambda p: p + 0.2, nn.meta.unbox(variables["params"]))
  shifted = jit_apply(layer, {"params": params}, x, positions=jnp.arange(10) + 17)
  plain = jit_apply(layer, {"params": params}, x)
  assert_close(shifted, plain, rtol=1e-5, atol=1e-5)
  expected = jit_apply(layer, {"params": params}, x, is_causal=True)
  decoder = layer.clone(decode=True)
  cache = jit_init(decoder, jax.random.PRNGKey(0), x)["cache"]
  # One program for the ten steps: the layer (a dict among its fields) has no hash, so
  # jit_apply would compile each step anew.
  step = jax.jit(lambda cache, token: decoder.apply({"params": params, "cache": cache}, token,
                                                    mutable=["cache"]))
  outputs = []
  for t in range(10):
    out, state = step(cache, x[:, t:t + 1])
    cache = state["cache"]
    outputs.append(out)
  assert_close(jnp.concatenate(outputs, axis=1), expected, rtol=1e-5, atol=1e-5)


def test_shaw_is_refused_for_a_variant_without_attention_weights():
  with pytest.raises(ValueError, match="position='shaw' .* got attention='linear'"):
    _layer(attention="linear").init(jax.random.PRNGKey(0), jnp.zeros((1, 4, 16)))
