"""Differential attention against the paper's formulas written out in numpy and jnp."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attention_jax as aj
from attention_jax.models import stack
from attention_jax.variants.modern.differential import (DEPTH, differential_attention,
                                                        lambda_init_at)
from attention_testing import (as_float64, assert_close, assert_same_outputs_and_grads,
                               jit_apply, jit_call, jit_init, loop_mask, np_softmax, random_qkv,
                               small_stack_config)

B, T, H, HKV, D = 2, 11, 4, 2, 8


def _lambda_arrays(seed=1):
  keys = jax.random.split(jax.random.PRNGKey(seed), 5)
  vectors = tuple(0.3 * jax.random.normal(k, (D // 2,)) for k in keys[:4])
  return vectors, 1.0 + 0.1 * jax.random.normal(keys[4], (D,))


def _numpy_differential(query, key, value, vectors, norm_scale, allowed, lambda_init):
  """Eqs. 1-3 of Ye et al. 2024 in float64, one head at a time, halves taken as
  the even and odd features; `allowed` `[B, 1, Tq, Tk]`."""
  q, k, v = map(as_float64, (query, key, value))
  lq1, lk1, lq2, lk2 = map(as_float64, vectors)
  lam = np.exp(lq1 @ lk1) - np.exp(lq2 @ lk2) + lambda_init
  group = q.shape[2] // k.shape[2]
  out = np.zeros(q.shape[:3] + (v.shape[-1],))
  for b in range(q.shape[0]):
    for h in range(q.shape[2]):
      maps = []
      for half in (0, 1):
        logits = q[b, :, h, half::2] @ k[b, :, h // group, half::2].T / np.sqrt(D // 2)
        logits = np.where(allowed[b, 0], logits, -np.inf)
        rows = allowed[b, 0].any(-1)
        weights = np_softmax(np.where(rows[:, None], logits, 0.0)) * rows[:, None]
        maps.append(weights)
      attended = (maps[0] - lam * maps[1]) @ v[b, :, h // group]
      rms = np.sqrt(np.mean(attended ** 2, axis=-1, keepdims=True) + 1e-5)
      out[b, :, h] = attended / rms * as_float64(norm_scale) * (1.0 - lambda_init)
  return out


@pytest.mark.property("differential")
def test_equals_the_papers_formulas_under_causal_and_padding_masks():
  query, key, value = random_qkv(batch=B, q_len=T, num_heads=H, num_kv_heads=HKV, head_dim=D)
  vectors, norm_scale = _lambda_arrays()
  lengths = jnp.asarray([T, 6])
  got, update = jax.jit(functools.partial(
      differential_attention, is_causal=True, key_value_seq_lengths=lengths,
      query_seq_lengths=lengths))(query, key, value, lambda_vectors=vectors,
                                  norm_scale=norm_scale)
  allowed = loop_mask(B, T, T, is_causal=True, q_lengths=[T, 6], kv_lengths=[T, 6])
  want = _numpy_differential(query, key, value, vectors, norm_scale, allowed, 0.2)
  assert_close(got, want, rtol=1e-4, atol=1e-5)
  assert int(update[DEPTH]) == 1  # the first layer: lambda_init = 0.8 - 0.6 = 0.2
  assert float(jnp.abs(got[1, 6:]).max()) == 0.0  # padded queries attend to nothing


@pytest.mark.property("differential")
def test_gradients_of_every_array_equal_autodiff_of_the_formula():
  query, key, value = random_qkv(seed=2, batch=B, q_len=T, num_heads=H, num_kv_heads=HKV,
                                 head_dim=D)
  vectors, norm_scale = _lambda_arrays(3)

  def ours(q, k, v, lq1, lk1, lq2, lk2, g):
    return differential_attention(q, k, v, is_causal=True, lambda_vectors=(lq1, lk1, lq2, lk2),
                                  norm_scale=g, lambda_init=0.5, implementation="blockwise")[0]

  def formula(q, k, v, lq1, lk1, lq2, lk2, g):
    k, v = (jnp.repeat(a, H // HKV, axis=2) for a in (k, v))
    causal = jnp.tril(jnp.ones((T, T), bool))
    softmax = lambda q, k: jax.nn.softmax(jnp.where(
        causal, jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(D // 2), -jnp.inf), axis=-1)
    lam = jnp.exp(lq1 @ lk1) - jnp.exp(lq2 @ lk2) + 0.5
    weights = softmax(q[..., 0::2], k[..., 0::2]) - lam * softmax(q[..., 1::2], k[..., 1::2])
    out = jnp.einsum("bhqk,bkhd->bqhd", weights, v)
    return out * jax.lax.rsqrt(jnp.mean(out ** 2, -1, keepdims=True) + 1e-5) * g * 0.5

  assert_same_outputs_and_grads(jax.jit(ours), jax.jit(formula), query, key, value, *vectors,
                                norm_scale, rtol=1e-4, atol=1e-5)


@pytest.mark.property("differential")
def test_lambda_zero_is_normalised_softmax_attention_of_the_first_half():
  """With lambda = 0 the second map drops out: RMSNorm(softmax(Q1 K1^T) V)."""
  query, key, value = random_qkv(seed=4, batch=B, q_len=T, num_heads=H, head_dim=D)
  zero = jnp.zeros((D // 2,))
  # exp(0) - exp(0) + lambda_init = lambda_init; lambda_init = 0 makes lambda 0.
  got, _ = jit_call(differential_attention, query, key, value, lambda_vectors=(zero,) * 4,
                    norm_scale=jnp.ones((D,)), lambda_init=0.0)

  @jax.jit
  def written_out(query, key, value):
    """RMSNorm of softmax attention over the first half of the head dims."""
    first = aj.dot_product_attention(query[..., 0::2], key[..., 0::2], value,
                                     implementation="xla")
    return first * jax.lax.rsqrt(jnp.mean(first ** 2, -1, keepdims=True) + 1e-5)

  want = written_out(query, key, value)
  assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_the_stack_counts_the_depth_and_each_layer_takes_the_papers_lambda_init():
  query, key, value = random_qkv(seed=5, batch=B, q_len=T, num_heads=H, head_dim=D)
  vectors, norm_scale = _lambda_arrays()
  third, update = jit_call(differential_attention, query, key, value, lambda_vectors=vectors,
                           norm_scale=norm_scale, carry={DEPTH: jnp.int32(2)})
  fixed, _ = jit_call(differential_attention, query, key, value, lambda_vectors=vectors,
                      norm_scale=norm_scale, lambda_init=float(0.8 - 0.6 * np.exp(-0.6)))
  assert int(update[DEPTH]) == 3
  assert_close(lambda_init_at(3), 0.8 - 0.6 * np.exp(-0.6))
  assert_close(third, fixed)
  # Three differential layers of a model stack hand the count on: 3 at the end.
  config = small_stack_config(T, attention="differential", num_layers=3, num_heads=H)
  x = jax.random.normal(jax.random.PRNGKey(6), (B, T, config.embed_dim))
  module = stack.LayerStack(config)
  variables = jit_init(module, jax.random.PRNGKey(7), x, is_causal=True)
  _, carry = jax.jit(lambda v, x: module.apply(v, x, is_causal=True))(variables, x)
  assert int(carry[DEPTH]) == 3
  params = nn.meta.unbox(variables["params"])
  assert set(params["block_0"]["attention"]["variant"]) == {
      "lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2", "norm_scale"}


@pytest.mark.parametrize("scan_layers", [False, True])
def test_a_layer_that_layer_drop_skips_still_counts_in_the_depth(scan_layers):
  """lambda_init belongs to the layer's index: a block LayerDrop skips in
  training still advances the count, so the layers after it keep their own
  lambda_init (evaluation runs every block)."""
  config = small_stack_config(T, attention="differential", num_layers=4, num_heads=H,
                              layer_drop_rate=0.5, scan_layers=scan_layers)
  x = jax.random.normal(jax.random.PRNGKey(6), (B, T, config.embed_dim))
  module = stack.LayerStack(config)
  variables = jit_init(module, jax.random.PRNGKey(7), x, is_causal=True)
  train = jax.jit(lambda v, x, rng: module.apply(v, x, is_causal=True, deterministic=False,
                                                 rngs={"dropout": rng})[1][DEPTH])
  depths = [int(train(variables, x, jax.random.PRNGKey(seed))) for seed in range(6)]
  assert depths == [4] * 6


@pytest.mark.property("differential")
def test_both_maps_run_through_the_flash_loops():
  query, key, value = random_qkv(seed=8, batch=1, q_len=T, num_heads=2, head_dim=D)
  vectors, norm_scale = _lambda_arrays()
  run = lambda implementation: differential_attention(
      query, key, value, is_causal=True, lambda_vectors=vectors, norm_scale=norm_scale,
      implementation=implementation)[0]
  assert_close(jax.jit(lambda: run("blockwise"))(), jax.jit(lambda: run("xla"))(), rtol=1e-4,
               atol=1e-5)


def test_bad_options_are_named():
  query, key, value = random_qkv(batch=1, q_len=5, num_heads=2, head_dim=7)
  vectors = (jnp.zeros((3,)),) * 4
  with pytest.raises(ValueError, match="head dim must be even"):
    differential_attention(query, key, value, lambda_vectors=vectors, norm_scale=jnp.ones((7,)))
  query, key, value = random_qkv(batch=1, q_len=5, num_heads=2, head_dim=8)
  with pytest.raises(ValueError, match="lambda_init must be in"):
    differential_attention(query, key, value, lambda_vectors=(jnp.zeros((4,)),) * 4,
                           norm_scale=jnp.ones((8,)), lambda_init=1.5)
  with pytest.raises(ValueError, match=r"lambda_q1 must have shape \[4\]"):
    differential_attention(query, key, value, lambda_vectors=(jnp.zeros((3,)),) * 4,
                           norm_scale=jnp.ones((8,)))


@pytest.mark.parametrize("head_dim, position_options, relative", [
    (8, {}, True), (12, {"rotary_fraction": 2 / 3}, True),
    (6, {}, False), (8, {"rotary_fraction": 0.75}, False)])
def test_under_rope_each_half_keeps_whole_rotated_pairs_or_the_layer_refuses(
    head_dim, position_options, relative):
  """RoPE pairs feature i with i + R/2 (R the rotated width); the even and odd
  halves keep whole pairs only when R is a multiple of 4, and only then does
  each map depend on the distance alone."""
  layer = aj.MultiHeadAttention(num_heads=2, qkv_features=2 * head_dim,
                                attention="differential", position="rope",
                                position_options=position_options)
  x = jax.random.normal(jax.random.PRNGKey(10), (1, T, 16))
  if not relative:
    with pytest.raises(ValueError, match=r"rotary_width must be a multiple of 4"):
      jit_init(layer, jax.random.PRNGKey(11), x, is_causal=True)
    return
  variables = jit_init(layer, jax.random.PRNGKey(11), x, is_causal=True)
  out = jit_apply(layer, variables, x, is_causal=True, positions=jnp.arange(T))
  shifted = jit_apply(layer, variables, x, is_causal=True, positions=jnp.arange(T) + 37)
  assert_close(shifted, out, rtol=1e-4, atol=1e-5)
