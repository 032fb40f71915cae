"""Low-rank and compressed attention: linformer, nystromformer, low_rank_locality,
memory_compressed."""

import functools
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attention_jax
from attention_jax.core import reference_attention
from attention_jax.variants import low_rank
from attention_testing import (assert_close, assert_same_outputs_and_grads, jit_apply, jit_call,
                               jit_init, loop_mask, random_qkv)

# This file's tolerance: float32 sums over whole sequences in a different order.
_assert_same = functools.partial(assert_same_outputs_and_grads, rtol=2e-5, atol=2e-5)

B, T, H = 2, 12, 4


def _padded_key_content_is_ignored(fn, key, value, kv_lengths, tol=1e-5):
  """fn(key, value) is unchanged when the keys/values past `kv_lengths` change."""
  batch, kv_len = key.shape[:2]
  padded = ~loop_mask(batch, 1, kv_len, kv_lengths=kv_lengths)[:, 0, 0, :, None, None]
  noise = jax.random.normal(jax.random.PRNGKey(11), key.shape) * 5
  out = fn(key, value)
  assert_close(fn(jnp.where(padded, noise, key), jnp.where(padded, noise, value)), out,
               rtol=tol, atol=tol)
  return out


def _run_module(name, options, is_causal=False, length=24):
  x = jax.random.normal(jax.random.PRNGKey(1), (2, length, 16))
  module = attention_jax.MultiHeadAttention(num_heads=2, num_kv_heads=1, attention=name,
                                            attention_options=options)
  variables = jit_init(module, jax.random.PRNGKey(0), x, is_causal=is_causal)
  out = jax.jit(lambda v, x: module.apply(v, x, is_causal=is_causal))(variables, x)
  assert out.shape == x.shape and np.isfinite(np.asarray(out)).all()
  return variables, module


def _refusals(fn, query, key, value, **arrays):
  with pytest.raises(ValueError, match="bias"):
    fn(query, key, value, jnp.zeros((1, H, query.shape[1], key.shape[1])), **arrays)
  with pytest.raises(ValueError, match="segment_ids"):
    fn(query, key, value, segment_ids=jnp.zeros((B, query.shape[1]), int), **arrays)
  with pytest.raises(ValueError, match="key-padding mask"):
    fn(query, key, value, None, jnp.ones((B, 1, query.shape[1], key.shape[1]), bool), **arrays)


# ---------------------------------------------------------------------------- linformer


@pytest.mark.property("linformer")
@pytest.mark.parametrize("kv_len,num_kv_heads", [(12, 4), (9, 2)])
def test_linformer_with_identity_projections_is_full_attention(kv_len, num_kv_heads):
  query, key, value = random_qkv(batch=B, q_len=T, kv_len=kv_len, num_heads=H,
                                 num_kv_heads=num_kv_heads, value_dim=5)
  identity = jnp.eye(kv_len)
  _assert_same(
      lambda q, k, v: low_rank.linformer_attention(q, k, v, key_projection=identity,
                                                   value_projection=identity, scale=0.3),
      lambda q, k, v: reference_attention(q, k, v, scale=0.3), query, key, value)


@pytest.mark.property("linformer")
def test_linformer_padding_zeroes_padded_keys_before_projecting():
  query, key, value = random_qkv(seed=1, batch=B, q_len=T, num_heads=H)
  projections = jax.random.normal(jax.random.PRNGKey(2), (2, 16, 5))  # sized for Tk <= 16
  kv_lengths, q_lengths = np.array([12, 7]), np.array([12, 8])
  fn = jax.jit(lambda k, v: low_rank.linformer_attention(
      query, k, v, key_projection=projections[0], value_projection=projections[1],
      key_value_seq_lengths=jnp.array(kv_lengths), query_seq_lengths=jnp.array(q_lengths)))
  out = _padded_key_content_is_ignored(fn, key, value, kv_lengths)
  assert np.all(np.asarray(out[1, 8:]) == 0) and np.any(np.asarray(out[1, :8]) != 0)
  # The approximation, stated: zeroed rows still enter the projection (as zeros).
  padded = ~loop_mask(B, 1, T, kv_lengths=kv_lengths)[:, 0, 0, :, None, None]
  unpadded = jit_call(
      low_rank.linformer_attention, query, jnp.where(padded, 0.0, key),
      jnp.where(padded, 0.0, value),
      key_projection=projections[0],
      value_projection=projections[1], query_seq_lengths=jnp.array(q_lengths))
  assert_close(unpadded, out)


def test_linformer_sizes_are_checked():
  query, key, value = random_qkv(batch=B, q_len=T, num_heads=H)
  with pytest.raises(ValueError, match="projected_length=13 must be at most the sequence length"):
    low_rank.linformer_attention(query, key, value, key_projection=jnp.ones((12, 13)))
  with pytest.raises(ValueError, match="sized for key length 8, got Tk=12"):
    low_rank.linformer_attention(query, key, value, key_projection=jnp.ones((8, 4)))
  with pytest.raises(ValueError, match="projected_length=32 must be at most"):
    _run_module("linformer", {"projected_length": 32})
  with pytest.raises(ValueError, match="is_causal"):
    low_rank.linformer_attention(query, key, value, is_causal=True,
                                 key_projection=jnp.ones((12, 4)))
  _refusals(low_rank.linformer_attention, query, key, value, key_projection=jnp.ones((12, 4)))


def test_linformer_module_sizes_from_the_key_length_and_rejects_longer_inputs():
  variables, module = _run_module("linformer", {"projected_length": 8})
  assert variables["params"]["variant"]["key_projection"].shape == (24, 8)
  assert variables["params"]["variant"]["value_projection"].shape == (24, 8)
  shorter = jit_apply(module, variables, jnp.ones((1, 16, 16)))
  assert shorter.shape == (1, 16, 16)
  with pytest.raises(ValueError, match="sized for key length 24, got Tk=32"):
    jit_apply(module, variables, jnp.ones((1, 32, 16)))
  shared, _ = _run_module("linformer", {"projected_length": 8, "share_kv": True})
  assert "value_projection" not in shared["params"]["variant"]


# ---------------------------------------------------------------------------- nystromformer


@pytest.mark.property("nystromformer")
def test_nystromformer_with_every_token_a_landmark_is_full_attention():
  # Landmarks = tokens: softmax(QK^T) pinv(softmax(QK^T)) softmax(QK^T) V = softmax(QK^T) V
  # once the iterative pseudo-inverse has converged (stated tolerance 1e-3).
  query, key, value = random_qkv(seed=2, batch=B, q_len=8, num_heads=H, num_kv_heads=2)
  _assert_same(
      lambda q, k, v: low_rank.nystromformer_attention(q, k, v, num_landmarks=8,
                                                       pinv_iterations=30, scale=0.2),
      lambda q, k, v: reference_attention(q, k, v, scale=0.2), query, key, value, rtol=1e-3,
      atol=1e-3)


def test_iterative_pinv_converges_to_the_pseudo_inverse():
  a = jax.nn.softmax(jax.random.normal(jax.random.PRNGKey(3), (2, 6, 6)), axis=-1)
  assert_close(jit_call(low_rank.iterative_pinv, a, 40), np.linalg.pinv(np.asarray(a)),
               atol=1e-3, rtol=1e-3)
  rough = np.abs(jit_call(low_rank.iterative_pinv, a, 2) - np.linalg.pinv(np.asarray(a))).max()
  assert rough > 1e-3  # the iteration count matters


@pytest.mark.property("nystromformer")
def test_nystromformer_error_falls_as_landmarks_grow():
  query, key, value = random_qkv(seed=3, batch=2, q_len=64, num_heads=2, head_dim=8)
  # Smooth sequences (neighbours alike), where segment means are good landmarks.
  smooth = lambda x: jnp.cumsum(x, axis=1) / 8
  query, key = smooth(query), smooth(key)
  exact = jit_call(reference_attention, query, key, value)
  errors = [float(jnp.sqrt(jnp.mean((jit_call(low_rank.nystromformer_attention,
      query, key, value, num_landmarks=m, pinv_iterations=20) - exact) ** 2)))
            for m in (4, 16, 64)]
  assert errors[0] > errors[1] > errors[2], errors
  assert errors[2] < 1e-2, errors


@pytest.mark.property("nystromformer")
def test_nystromformer_padding():
  query, key, value = random_qkv(seed=4, batch=B, q_len=T, kv_len=8, num_heads=H)
  kv_lengths, q_lengths = np.array([8, 5]), np.array([12, 6])
  fn = jax.jit(lambda k, v: low_rank.nystromformer_attention(
      query, k, v, num_landmarks=4, key_value_seq_lengths=jnp.array(kv_lengths),
      query_seq_lengths=jnp.array(q_lengths)))
  out = _padded_key_content_is_ignored(fn, key, value, kv_lengths, tol=1e-4)
  # Padded queries neither output anything nor shape the query landmarks.
  assert np.all(np.asarray(out[1, 6:]) == 0)
  noisy_query = query.at[1, 6:].set(9.0)
  again = jit_call(
      low_rank.nystromformer_attention, noisy_query, key, value, num_landmarks=4,
      key_value_seq_lengths=jnp.array(kv_lengths), query_seq_lengths=jnp.array(q_lengths))
  assert_close(again, out, rtol=1e-4, atol=1e-5)


def test_nystromformer_sizes_are_checked():
  query, key, value = random_qkv(batch=B, q_len=T, kv_len=8, num_heads=H)
  with pytest.raises(ValueError, match="num_landmarks=8 must divide the sequence length 12"):
    low_rank.nystromformer_attention(query, key, value, num_landmarks=8)
  with pytest.raises(ValueError, match="num_landmarks=3 must divide the sequence length 8"):
    low_rank.nystromformer_attention(query, key, value, num_landmarks=3)
  with pytest.raises(ValueError, match="pinv_iterations must be an int >= 0"):
    low_rank.nystromformer_attention(query, key, value, num_landmarks=4, pinv_iterations=-1)
  with pytest.raises(ValueError, match="is_causal"):
    low_rank.nystromformer_attention(query, query, query, num_landmarks=4, is_causal=True)
  _refusals(low_rank.nystromformer_attention, query, key, value, num_landmarks=4)


# ---------------------------------------------------------------------------- low_rank_locality


@pytest.mark.property("low_rank_locality")
@pytest.mark.parametrize("window,is_causal", [(1, False), (3, False), (3, True), (5, True),
                                              (20, False)])
def test_band_part_is_dense_attention_under_the_window_mask(window, is_causal):
  query, key, value = random_qkv(seed=5, batch=B, q_len=13, num_heads=H, num_kv_heads=2,
                                 value_dim=5)
  kv_lengths = np.array([13, 9])
  allowed = loop_mask(B, 13, 13, window=window, is_causal=is_causal, kv_lengths=kv_lengths)
  _assert_same(
      lambda q, k, v: jax.jit(lambda *a: low_rank.low_rank_locality_attention(
          *a, window_size=window, is_causal=is_causal,
          key_value_seq_lengths=jnp.array(kv_lengths)))(q, k, v),
      lambda q, k, v: reference_attention(q, k, v, None, jnp.array(allowed)),
      query, key, value)


@pytest.mark.property("low_rank_locality")
@pytest.mark.parametrize("is_causal", [False, True])
def test_low_rank_locality_is_band_plus_low_rank_attention(is_causal):
  query, key, value = random_qkv(seed=6, batch=B, q_len=10, num_heads=H, num_kv_heads=2)
  w_q = jax.random.normal(jax.random.PRNGKey(1), (H, 8, 3)) * 0.5
  w_k = jax.random.normal(jax.random.PRNGKey(2), (2, 8, 3)) * 0.5
  q_lengths = np.array([10, 6])
  out = jit_call(low_rank.low_rank_locality_attention,
                 query, key, value, window_size=2, is_causal=is_causal, query_low_rank=w_q,
                 key_low_rank=w_k, query_seq_lengths=jnp.array(q_lengths))

  @jax.jit
  def written_out(query, key, value, w_q, w_k):
    """Densely: the band softmax and the rank-3 softmax."""
    band = reference_attention(query, key, value, None,
                               jnp.array(loop_mask(B, 10, 10, window=2, is_causal=is_causal)))
    low_q = jnp.einsum("bthd,hdr->bthr", query, w_q)
    low_k = jnp.einsum("bthd,hdr->bthr", key, w_k)
    low = reference_attention(low_q, low_k, value, None,
                              jnp.array(loop_mask(B, 10, 10, is_causal=is_causal)))
    return band, low

  # Their sum, padded queries zero.
  band, low = written_out(query, key, value, w_q, w_k)
  expected = np.where(loop_mask(B, 10, 1, q_lengths=q_lengths)[:, 0, :, :, None],
                      band + low, 0.0)
  assert_close(out, expected)
  # The low-rank scores have rank <= r: their attention differs from the band's.
  assert np.abs(np.asarray(low - band)).max() > 1e-2


@pytest.mark.property("low_rank_locality")
def test_low_rank_locality_scale_is_the_band_s_only():
  # `scale` scales the band's logits; the low-rank term keeps 1/sqrt(r). The
  # option's doc said it "multiplies the logits", all of them.
  query, key, value = random_qkv(seed=7, batch=1, q_len=8, num_heads=2)
  w_q = jax.random.normal(jax.random.PRNGKey(3), (2, 8, 2))
  w_k = jax.random.normal(jax.random.PRNGKey(4), (2, 8, 2))
  out = lambda **options: jit_call(low_rank.low_rank_locality_attention, query, key, value,
                                   window_size=2, **options)
  band = out(scale=0.3)
  low = (out(query_low_rank=w_q, key_low_rank=w_k, scale=0.3) - band)
  expected_low = reference_attention(jnp.einsum("bthd,hdr->bthr", query, w_q),
                                     jnp.einsum("bthd,hdr->bthr", key, w_k), value)
  assert_close(low, expected_low, rtol=1e-5, atol=1e-5)
  doc = attention_jax.get_variant("low_rank_locality").options["scale"]
  assert "band" in doc and "1/sqrt(r)" in doc, doc


def test_low_rank_locality_arguments_are_checked():
  query, key, value = random_qkv(batch=B, q_len=T, num_heads=H)
  with pytest.raises(ValueError, match="window_size must be an int >= 1"):
    low_rank.low_rank_locality_attention(query, key, value, window_size=0)
  with pytest.raises(ValueError, match="Tq=12 must equal Tk=8"):
    low_rank.low_rank_locality_attention(query, key[:, :8], value[:, :8])
  with pytest.raises(ValueError, match="rank=9 must be at most"):
    _run_module("low_rank_locality", {"rank": 9})
  _refusals(low_rank.low_rank_locality_attention, query, key, value)


# ---------------------------------------------------------------------------- memory_compressed


def _identity_kernels(stride, heads, dim):
  kernel = jnp.zeros((stride, heads, dim, dim)).at[0].set(jnp.eye(dim))
  return kernel


@pytest.mark.property("memory_compressed")
@pytest.mark.parametrize("is_causal,kv_len", [(False, 12), (True, 12), (False, 9)])
def test_memory_compressed_with_stride_one_identity_is_full_attention(is_causal, kv_len):
  query, key, value = random_qkv(seed=7, batch=B, q_len=T, kv_len=kv_len, num_heads=H,
                                 num_kv_heads=2)
  kernel = _identity_kernels(1, 2, 8)
  allowed = jnp.array(loop_mask(B, T, kv_len, is_causal=is_causal))
  _assert_same(
      lambda q, k, v: low_rank.memory_compressed_attention(
          q, k, v, is_causal=is_causal, key_kernel=kernel, value_kernel=kernel),
      lambda q, k, v: reference_attention(q, k, v, None, allowed), query, key, value)


@pytest.mark.property("memory_compressed")
def test_memory_compressed_attends_to_the_convolved_memory():
  query, key, value = random_qkv(seed=8, batch=B, q_len=T, num_heads=H, num_kv_heads=2)
  kernels = jax.random.normal(jax.random.PRNGKey(3), (2, 3, 2, 8, 8)) * 0.3
  bias = jax.random.normal(jax.random.PRNGKey(4), (2, 2, 8))
  out = jit_call(low_rank.memory_compressed_attention, query, key, value,
                 key_kernel=kernels[0], value_kernel=kernels[1], key_bias=bias[0],
                 value_bias=bias[1])
  # The convolution written as a loop over windows: compressed length T / s = 4.
  k, v = np.asarray(key), np.asarray(value)
  memory = np.zeros((2, B, 4, 2, 8))
  for n in range(4):
    for j in range(3):
      memory[0, :, n] += np.einsum("bhd,hde->bhe", k[:, 3 * n + j], np.asarray(kernels[0, j]))
      memory[1, :, n] += np.einsum("bhd,hde->bhe", v[:, 3 * n + j], np.asarray(kernels[1, j]))
  memory += np.asarray(bias)[:, None, None]
  assert jit_call(low_rank.strided_convolution, key, kernels[0]).shape == (B, 4, 2, 8)
  expected = jit_call(reference_attention, query, jnp.array(memory[0], jnp.float32),
                      jnp.array(memory[1], jnp.float32))
  assert_close(out, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.property("memory_compressed")
def test_memory_compressed_causal_and_padding():
  query, key, value = random_qkv(seed=9, batch=B, q_len=T, num_heads=H)
  kernels = jax.random.normal(jax.random.PRNGKey(5), (2, 3, H, 8, 8)) * 0.3
  kv_lengths = np.array([12, 7])
  fn = jax.jit(lambda k, v: low_rank.memory_compressed_attention(
      query, k, v, is_causal=True, key_kernel=kernels[0], value_kernel=kernels[1],
      key_value_seq_lengths=jnp.array(kv_lengths)))
  out = _padded_key_content_is_ignored(fn, key, value, kv_lengths)
  # Causal: query i only sees windows that end at or before i; changing key 5
  # (window 1, keys 3..5) leaves queries 0..4 unchanged and changes query 5.
  changed = fn(key.at[:, 5].add(1.0), value.at[:, 5].add(1.0))
  assert_close(changed[:, :5], out[:, :5])
  assert np.abs(np.asarray(changed[:, 5] - out[:, 5])).max() > 1e-3
  assert np.all(np.asarray(out[:, :2]) == 0)  # no complete window yet


def test_memory_compressed_bad_stride_raises():
  query, key, value = random_qkv(batch=B, q_len=T, num_heads=H)
  with pytest.raises(ValueError, match="stride=5 must divide the sequence length 12"):
    low_rank.memory_compressed_attention(query, key, value, key_kernel=jnp.ones((5, H, 8, 8)),
                                         value_kernel=jnp.ones((5, H, 8, 8)))
  with pytest.raises(ValueError, match="stride=5 must divide the sequence length 24"):
    _run_module("memory_compressed", {"stride": 5})
  with pytest.raises(ValueError, match="stride must be an int >= 1"):
    _run_module("memory_compressed", {"stride": 0})
  kernel = jnp.ones((3, H, 8, 8))
  _refusals(low_rank.memory_compressed_attention, query, key, value, key_kernel=kernel,
            value_kernel=kernel)


@pytest.mark.parametrize("name,options,is_causal", [
    ("linformer", {"projected_length": 8}, False),
    ("nystromformer", {"num_landmarks": 6}, False),
    ("low_rank_locality", {"window_size": 4, "rank": 2}, True),
    ("memory_compressed", {"stride": 3}, True),
])
def test_runs_through_multi_head_attention_under_jit(name, options, is_causal):
  _run_module(name, options, is_causal)
