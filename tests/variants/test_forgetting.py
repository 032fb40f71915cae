"""Forgetting attention (FoX) against its formula; the gates' gradient through the kernels."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attention_jax as aj
from attention_jax.variants.modern.forgetting import forgetting_attention
from attention_testing import (as_float64, assert_close, assert_same_outputs_and_grads,
                               jit_apply, jit_call, jit_init, loop_mask, np_softmax,
                               random_qkv)

B, T, H, HKV, D = 2, 13, 4, 2, 8


def _log_forget(seed=5):
  return jax.nn.log_sigmoid(jax.random.normal(jax.random.PRNGKey(seed), (B, T, H)) + 1.0)


@pytest.mark.parametrize("implementation", ["blockwise", "xla"])
@pytest.mark.property("forgetting")
def test_equals_the_formula_with_the_products_of_the_gates(implementation):
  query, key, value = random_qkv(batch=B, q_len=T, num_heads=H, num_kv_heads=HKV, head_dim=D)
  log_forget = _log_forget()
  cumulative = jnp.cumsum(log_forget, axis=1)
  lengths = jnp.asarray([T, 9])
  got = jax.jit(functools.partial(
      forgetting_attention, is_causal=True, key_value_seq_lengths=lengths,
      implementation=implementation))(query, key, value, query_log_decay=cumulative,
                                       key_log_decay=cumulative)
  q, k, v, f = map(as_float64, (query, key, value, log_forget))
  k, v = (np.repeat(a, H // HKV, axis=2) for a in (k, v))
  # D_ij = sum_{l = j + 1}^{i} log f_l, written as a loop over l.
  decay = np.zeros((B, H, T, T))
  for i in range(T):
    for j in range(i):
      decay[:, :, i, j] = f[:, j + 1:i + 1].sum(axis=1)
  logits = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(D) + decay
  allowed = loop_mask(B, T, T, is_causal=True, kv_lengths=[T, 9])
  weights = np_softmax(np.where(allowed, logits, -np.inf))
  assert_close(got, np.einsum("bhqk,bkhd->bqhd", weights, v), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("implementation", ["blockwise", "pallas_tpu"])
@pytest.mark.property("forgetting")
def test_the_gates_gradient_comes_back_through_the_kernel(implementation):
  arrays = random_qkv(seed=1, batch=1, q_len=T, num_heads=H, num_kv_heads=HKV, head_dim=D)

  def run(implementation, q, k, v, log_forget):
    cumulative = jnp.cumsum(log_forget, axis=1)
    return forgetting_attention(q, k, v, query_log_decay=cumulative, key_log_decay=cumulative,
                                is_causal=True, implementation=implementation)

  assert_same_outputs_and_grads(jax.jit(functools.partial(run, implementation)),
                                jax.jit(functools.partial(run, "xla")), *arrays,
                                _log_forget()[:1], rtol=1e-4, atol=1e-5)


@pytest.mark.property("forgetting")
def test_gates_at_one_are_causal_softmax_attention():
  arrays = random_qkv(seed=2, batch=B, q_len=T, num_heads=H, head_dim=D)
  zeros = jnp.zeros((B, T, H))  # log 1
  assert_close(jit_call(forgetting_attention, *arrays, query_log_decay=zeros,
                        key_log_decay=zeros, is_causal=True),
               jit_call(aj.dot_product_attention, *arrays, is_causal=True, implementation="xla"))


def test_the_layer_learns_its_gates_from_its_input():
  layer = aj.MultiHeadAttention(num_heads=H, attention="forgetting",
                                attention_options={"forget_bias_init": 2.0})
  x = jax.random.normal(jax.random.PRNGKey(3), (B, T, 16))
  params = nn.meta.unbox(jit_init(layer, jax.random.PRNGKey(4), x, is_causal=True)["params"])
  gate = params["variant"]["forget_gate"]
  assert gate["kernel"].shape == (16, H) and float(gate["bias"].min()) == 2.0
  grads = jax.jit(jax.grad(lambda p: jnp.sum(jnp.sin(
      layer.apply({"params": p}, x, is_causal=True)))))(params)
  assert float(jnp.abs(grads["variant"]["forget_gate"]["kernel"]).max()) > 0.0
  # The layer's output is the function's with the gates computed from x.

  @jax.jit
  def written_out(params):
    """forgetting_attention of the layer's projections, its gates from x."""
    gate = params["variant"]["forget_gate"]
    project = lambda name: jnp.einsum("bte,ehd->bthd", x, params[name]["kernel"]) + params[name][
        "bias"]
    cumulative = jnp.cumsum(jax.nn.log_sigmoid(x @ gate["kernel"] + gate["bias"]), axis=1)
    out = forgetting_attention(project("query"), project("key"), project("value"),
                               is_causal=True, query_log_decay=cumulative,
                               key_log_decay=cumulative, implementation="xla")
    return jnp.einsum("bthd,hde->bte", out, params["out"]["kernel"]) + params["out"]["bias"]

  want = written_out(params)
  assert_close(jit_apply(layer, {"params": params}, x, is_causal=True), want, rtol=1e-5,
               atol=1e-5)


def test_bad_decay_shapes_are_named():
  arrays = random_qkv(batch=B, q_len=T, num_heads=H, head_dim=D)
  with pytest.raises(ValueError, match=r"key_log_decay must be \[B, T, H\] = \[2, 13, 4\]"):
    forgetting_attention(*arrays, query_log_decay=jnp.zeros((B, T, H)),
                         key_log_decay=jnp.zeros((B, T, 1)), is_causal=True)


def test_a_call_that_would_let_queries_see_later_keys_is_refused():
  """c_i - c_j grows for a later key j, so without causality or a mask that
  hides later keys (a decoding step's) the bias favours the future."""
  arrays = random_qkv(batch=B, q_len=T, num_heads=H, head_dim=D)
  cumulative = jnp.cumsum(_log_forget(), axis=1)
  with pytest.raises(ValueError, match=r"forgetting attention is causal: pass is_causal=True"):
    forgetting_attention(*arrays, query_log_decay=cumulative, key_log_decay=cumulative)
  # A mask that hides the later keys is what a decoding step passes: accepted.
  causal = jnp.tril(jnp.ones((T, T), bool))[None, None]
  assert_close(
      jit_call(forgetting_attention, *arrays, mask=causal, query_log_decay=cumulative,
               key_log_decay=cumulative),
      jit_call(forgetting_attention, *arrays, is_causal=True, query_log_decay=cumulative,
               key_log_decay=cumulative))
