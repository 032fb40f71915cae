"""Stick-breaking attention against the product formula, written out in float64."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_jax.models import ModelConfig
from attention_jax.variants.modern.stick_breaking import stick_breaking_attention
from attention_testing import (as_float64, assert_close, assert_same_outputs_and_grads,
                               jit_call, largest_intermediate, random_qkv)

B, T, H, HKV, D = 2, 21, 4, 2, 8


def _numpy_stick_breaking(query, key, value, allowed, attend_current=False):
  """A_ij = beta_ij prod_{j < k < i} (1 - beta_ik) over the allowed keys, one
  query at a time: the stick breaks at the nearest allowed key first."""
  q, k, v = map(as_float64, (query, key, value))
  group = q.shape[2] // k.shape[2]
  out = np.zeros(q.shape[:3] + (v.shape[-1],))
  for b in range(q.shape[0]):
    for h in range(q.shape[2]):
      for i in range(q.shape[1]):
        left = 1.0  # what is left of the stick
        for j in range(i if attend_current else i - 1, -1, -1):
          if not allowed[b, i, j]:
            continue
          beta = 1.0 / (1.0 + np.exp(-(q[b, i, h] @ k[b, j, h // group]) / np.sqrt(D)))
          out[b, i, h] += left * beta * v[b, j, h // group]
          left *= 1.0 - beta
  return out


@pytest.mark.parametrize("implementation", ["blockwise", "xla"])
@pytest.mark.parametrize("attend_current", [False, True])
@pytest.mark.property("stick_breaking")
def test_equals_the_stick_written_out_with_padding_and_segments(implementation, attend_current):
  query, key, value = random_qkv(batch=B, q_len=T, num_heads=H, num_kv_heads=HKV, head_dim=D)
  lengths = np.array([T, 13])
  segments = np.array([[0] * 8 + [1] * 13, [0] * 21])
  allowed = ((np.arange(T)[None, None, :] < lengths[:, None, None])
             & (segments[:, :, None] == segments[:, None, :]))
  got = jax.jit(functools.partial(
      stick_breaking_attention, is_causal=True, key_value_seq_lengths=jnp.asarray(lengths),
      query_seq_lengths=jnp.asarray(lengths), segment_ids=jnp.asarray(segments),
      attend_current=attend_current, implementation=implementation, block_size=8))(
          query, key, value)
  want = _numpy_stick_breaking(query, key, value, allowed, attend_current)
  want[1, 13:] = 0.0  # padded queries attend to nothing
  assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.property("stick_breaking")
def test_blockwise_gradients_equal_autodiff_of_the_dense_form():
  arrays = random_qkv(seed=1, batch=B, q_len=T, num_heads=H, num_kv_heads=HKV, head_dim=D)
  assert_same_outputs_and_grads(
      jax.jit(functools.partial(stick_breaking_attention, is_causal=True, block_size=8)),
      jax.jit(functools.partial(stick_breaking_attention, is_causal=True, implementation="xla")),
      *arrays, rtol=1e-4, atol=1e-5)


@pytest.mark.property("stick_breaking")
def test_weights_sum_to_at_most_one_and_the_nearest_key_breaks_first():
  """With one-hot values the output rows are the weights: each row sums to at
  most 1, and a key with a huge logit takes the whole stick only if it is the
  nearest (a nearer key's break leaves less for it)."""
  query, key, _ = random_qkv(seed=2, batch=1, q_len=T, num_heads=1, head_dim=D)
  eye = jnp.eye(T)[None, :, None, :]
  weights = jit_call(stick_breaking_attention, query, key, eye, is_causal=True)[0, :, 0]
  assert float(weights.sum(-1).max()) <= 1.0 + 1e-6 and float(weights.min()) >= 0.0
  assert float(jnp.abs(jnp.triu(weights)).max()) == 0.0  # keys before the query only
  # A logit of +30 for every key: the nearest earlier key takes all of it.
  ones = jnp.ones((1, T, 1, 1))
  taken = jit_call(stick_breaking_attention, ones * 30.0, ones, eye, is_causal=True,
                   scale=1.0)[0, :, 0]
  assert_close(taken[1:], np.eye(T, k=-1)[1:], atol=1e-6)


def test_decoding_positions_equal_the_causal_pass():
  """What MultiHeadAttention does while decoding: one query at its position
  against every cached key, the later ones masked."""
  query, key, value = random_qkv(seed=3, batch=B, q_len=T, num_heads=H, num_kv_heads=HKV,
                                 head_dim=D)
  full = jit_call(stick_breaking_attention, query, key, value, is_causal=True)
  for i in (0, 5, T - 1):
    visible = (jnp.arange(T) <= i)[None, None, None, :]
    step = jit_call(stick_breaking_attention, query[:, i:i + 1], key, value, mask=visible,
                    query_positions=jnp.asarray([i]))
    assert_close(step[:, 0], full[:, i], rtol=1e-5, atol=1e-6)


def test_the_blockwise_form_holds_no_length_squared_array():
  length = 1024
  query, key, value = (jax.ShapeDtypeStruct((1, length, 1, 16), jnp.float32),) * 3
  loss = lambda q, k, v: jnp.sum(stick_breaking_attention(q, k, v, is_causal=True))
  assert largest_intermediate(jax.grad(loss, argnums=(0, 1, 2)), query, key, value) < \
      length * length // 4


def test_bad_input_is_named():
  query, key, value = random_qkv(batch=1, q_len=5, num_heads=2, head_dim=8)
  with pytest.raises(ValueError, match="stick_breaking attention is causal"):
    stick_breaking_attention(query, key, value)
  with pytest.raises(ValueError, match="does not support bias"):
    stick_breaking_attention(query, key, value, jnp.zeros((1, 2, 5, 5)), is_causal=True)
  with pytest.raises(ValueError, match="implementation must be one of"):
    stick_breaking_attention(query, key, value, is_causal=True, implementation="pallas")
  with pytest.raises(ValueError, match="is causal only, and its encoder"):
    ModelConfig(attention="stick_breaking", kind="classifier")
