"""Sigmoid attention against its formula, and ALiBi reaching it as a score_mod."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attention_jax as aj
from attention_jax import positional
from attention_jax.variants.modern.sigmoid import sigmoid_attention
from attention_testing import (as_float64, assert_close, assert_same_outputs_and_grads,
                               jit_apply, jit_init, loop_mask, random_qkv)

B, T, H, HKV, D = 2, 13, 4, 2, 8


@pytest.mark.parametrize("implementation", ["blockwise", "xla"])
@pytest.mark.property("sigmoid")
def test_equals_the_formula_with_the_default_bias_under_causal_and_padding(implementation):
  query, key, value = random_qkv(batch=B, q_len=T, num_heads=H, num_kv_heads=HKV, head_dim=D)
  lengths = jnp.asarray([T, 7])
  got = jax.jit(functools.partial(sigmoid_attention, is_causal=True,
                                  key_value_seq_lengths=lengths, query_seq_lengths=lengths,
                                  implementation=implementation))(query, key, value)
  q, k, v = map(as_float64, (query, key, value))
  k, v = (np.repeat(a, H // HKV, axis=2) for a in (k, v))
  logits = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(D) - np.log(T)
  allowed = loop_mask(B, T, T, is_causal=True, q_lengths=[T, 7], kv_lengths=[T, 7])
  weights = np.where(allowed, 1.0 / (1.0 + np.exp(-logits)), 0.0)
  assert_close(got, np.einsum("bhqk,bkhd->bqhd", weights, v), rtol=1e-4, atol=1e-5)


@pytest.mark.property("sigmoid")
def test_blockwise_gradients_equal_the_dense_reference():
  arrays = random_qkv(seed=1, batch=B, q_len=T, num_heads=H, num_kv_heads=HKV, head_dim=D)
  run = lambda implementation: jax.jit(functools.partial(
      sigmoid_attention, is_causal=True, sigmoid_bias=-1.5, local_window_size=(4, 0),
      implementation=implementation))
  assert_same_outputs_and_grads(run("blockwise"), run("xla"), *arrays, rtol=1e-4, atol=1e-5)


def test_alibi_positions_reach_it_as_a_score_mod_equal_to_a_materialised_bias():
  layer = lambda: aj.MultiHeadAttention(num_heads=H, attention="sigmoid", position="alibi")
  x = jax.random.normal(jax.random.PRNGKey(2), (B, T, 16))
  params = nn.meta.unbox(jit_init(layer(), jax.random.PRNGKey(3), x, is_causal=True)["params"])
  got = jit_apply(layer(), {"params": params}, x, is_causal=True)

  @jax.jit
  def written_out(params):
    """sigmoid_attention of the layer's projections under the materialised ALiBi bias."""
    project = lambda name: jnp.einsum("bte,ehd->bthd", x, params[name]["kernel"]) + params[name][
        "bias"]
    bias = positional.alibi_bias(H, jnp.arange(T)[None], jnp.arange(T)[None])
    out = sigmoid_attention(project("query"), project("key"), project("value"), bias,
                            is_causal=True, implementation="xla")
    return jnp.einsum("bthd,hde->bte", out, params["out"]["kernel"]) + params["out"]["bias"]

  want = written_out(params)
  assert_close(got, want, rtol=1e-5, atol=1e-5)
