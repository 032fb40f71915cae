"""Helpers shared by the tests: random inputs and an independent mask builder."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np


def random_qkv(seed=0, batch=2, q_len=7, kv_len=None, num_heads=4, num_kv_heads=None,
               head_dim=8, value_dim=None, dtype=jnp.float32):
  """query [B, Tq, H, D], key [B, Tk, Hkv, D], value [B, Tk, Hkv, Dv] ~ N(0, 1)."""
  kv_len = q_len if kv_len is None else kv_len
  num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
  value_dim = head_dim if value_dim is None else value_dim
  kq, kk, kv = jax.random.split(jax.random.PRNGKey(seed), 3)
  query = jax.random.normal(kq, (batch, q_len, num_heads, head_dim), dtype)
  key = jax.random.normal(kk, (batch, kv_len, num_kv_heads, head_dim), dtype)
  value = jax.random.normal(kv, (batch, kv_len, num_kv_heads, value_dim), dtype)
  return query, key, value


def loop_mask(batch, q_len, kv_len, *, is_causal=False, window=None, q_lengths=None,
              kv_lengths=None, q_segments=None, kv_segments=None):
  """The allowed (query, key) pairs written out one by one: [B, 1, Tq, Tk] bool.

  Deliberately a plain loop over the definitions, independent of attention_jax.core.
  """
  allowed = np.ones((batch, 1, q_len, kv_len), bool)
  for b, i, j in itertools.product(range(batch), range(q_len), range(kv_len)):
    ok = True
    if is_causal:
      ok &= j <= i
    if window is not None:
      left, right = (window, window) if isinstance(window, int) else window
      ok &= i - left <= j <= i + right
    if q_lengths is not None:
      ok &= i < q_lengths[b]
    if kv_lengths is not None:
      ok &= j < kv_lengths[b]
    if q_segments is not None:
      ok &= q_segments[b][i] == kv_segments[b][j]
    allowed[b, 0, i, j] = ok
  return allowed


def assert_close(actual, expected, rtol=1e-5, atol=1e-5, err_msg=""):
  np.testing.assert_allclose(np.asarray(actual, np.float32), np.asarray(expected, np.float32),
                             rtol=rtol, atol=atol, err_msg=err_msg)
