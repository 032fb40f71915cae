"""Sparse attention patterns against the dense reference under the same pattern.

Each pattern is written here a second time, pair by pair from its definition
(`_pattern_mask`), and the dense `reference_attention` under that boolean mask
is the oracle for outputs and q/k/v gradients.
"""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_jax import registry
from attention_jax.core import reference_attention
from attention_jax.layers.attention import MultiHeadAttention
from attention_jax.variants import sparse
from attention_testing import assert_close, random_qkv

B, H = 2, 4
Q_LENGTHS = np.array([13, 19])
KV_LENGTHS = np.array([11, 19])


def _pattern_mask(length, allowed, *, q_lengths=None, kv_lengths=None, segments=None):
  """`[B, 1, T, T]` bool: `allowed(b, i, j)` and padding and segments, pair by pair."""
  mask = np.zeros((B, 1, length, length), bool)
  for b, i, j in itertools.product(range(B), range(length), range(length)):
    ok = allowed(b, i, j)
    if q_lengths is not None:
      ok = ok and i < q_lengths[b] and j < kv_lengths[b]
    if segments is not None:
      ok = ok and segments[b][i] == segments[b][j]
    mask[b, 0, i, j] = ok
  return mask


def _outputs_and_grads(fn, query, key, value):
  cotangent = jax.random.normal(jax.random.PRNGKey(7), query.shape[:3] + value.shape[-1:])

  def loss(q, k, v):
    out = fn(q, k, v)
    return jnp.sum(out * cotangent), out

  (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(query, key, value)
  return out, grads


def _assert_parity(attention_fn, allowed, *, length, num_kv_heads=H, **kwargs):
  """attention_fn(q, k, v, **kwargs) equals the reference under `allowed`, with gradients."""
  query, key, value = random_qkv(seed=3, batch=B, q_len=length, num_heads=H,
                                 num_kv_heads=num_kv_heads, head_dim=8, value_dim=6)
  ours = jax.jit(lambda q, k, v: _outputs_and_grads(
      lambda *a: attention_fn(*a, **kwargs), q, k, v))(query, key, value)
  theirs = _outputs_and_grads(
      lambda *a: reference_attention(*a, None, jnp.asarray(allowed)), query, key, value)
  # Every query must see something for the comparison to say anything.
  assert allowed.any(-1).sum() > 0
  for name, got, want in zip(("out", "dq", "dk", "dv"), (ours[0], *ours[1]),
                             (theirs[0], *theirs[1])):
    assert_close(got, want, err_msg=name)


def _padding_args(length):
  """Keyword arguments for queries/keys padding and packed segments, and the same for the mask."""
  segments = np.array([[0] * 9 + [1] * (length - 9), [0] * 4 + [1] * (length - 4)])
  call = dict(query_seq_lengths=jnp.array(Q_LENGTHS), key_value_seq_lengths=jnp.array(KV_LENGTHS),
              segment_ids=jnp.array(segments))
  masks = dict(q_lengths=Q_LENGTHS, kv_lengths=KV_LENGTHS, segments=segments)
  return call, masks


# The patterns, written from their definitions: (b, i, j) -> may query i see key j.
def _local(w, causal):
  return lambda b, i, j: (i - w <= j <= i) if causal else abs(i - j) <= w


def _block(size, causal):
  return lambda b, i, j: i // size == j // size and (j <= i or not causal)


def _dilated(w, d, causal):
  return lambda b, i, j: (i - j) % d == 0 and abs(i - j) <= d * w and (j <= i or not causal)


T = 19  # not a multiple of any block size below: internal padding is exercised


@pytest.mark.parity("local")
@pytest.mark.parity("band")
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [1, 4, 19])
def test_local_matches_dense_window(causal, window):
  _assert_parity(sparse.local_attention, _pattern_mask(T, _local(window, causal)), length=T,
                 is_causal=causal, window_size=window)


@pytest.mark.parity("local")
def test_local_matches_dense_attention_with_local_window_size():
  """The same band, as dot_product_attention's own window, with grouped K/V heads."""
  import attention_jax  # pylint: disable=import-outside-toplevel
  query, key, value = random_qkv(seed=5, batch=B, q_len=T, num_heads=H, num_kv_heads=2)
  ours = jax.jit(functools.partial(sparse.local_attention, window_size=3))(query, key, value)
  theirs = attention_jax.dot_product_attention(query, key, value, local_window_size=(3, 3),
                                               implementation="xla")
  assert_close(ours, theirs)
  assert registry.get_variant("band").fn is registry.get_variant("local").fn


@pytest.mark.parity("block_local")
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("size", [1, 5, 19])
def test_block_local_matches_dense_block_diagonal(causal, size):
  _assert_parity(sparse.block_local_attention, _pattern_mask(T, _block(size, causal)), length=T,
                 is_causal=causal, block_size=size)


@pytest.mark.parity("dilated")
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window,dilation", [(2, 3), (3, 2), (5, 1)])
def test_dilated_matches_dense_dilated_band(causal, window, dilation):
  _assert_parity(sparse.dilated_attention, _pattern_mask(T, _dilated(window, dilation, causal)),
                 length=T, is_causal=causal, window_size=window, dilation=dilation)


# name -> (function, options, pattern) for the padding, segments and GQA checks.
PADDED_CASES = {
    "local": (sparse.local_attention, dict(window_size=3), _local(3, False)),
    "block_local": (sparse.block_local_attention, dict(block_size=4), _block(4, False)),
    "dilated": (sparse.dilated_attention, dict(window_size=2, dilation=2),
                _dilated(2, 2, False)),
}


@pytest.mark.parametrize("name", sorted(PADDED_CASES))
def test_padding_segments_and_grouped_heads_match_dense(name):
  fn, options, pattern = PADDED_CASES[name]
  call, masks = _padding_args(T)
  _assert_parity(fn, _pattern_mask(T, pattern, **masks), length=T, num_kv_heads=2,
                 **call, **options)


@pytest.mark.parametrize("name", sorted(PADDED_CASES))
def test_padded_keys_do_not_change_valid_queries_and_padded_queries_are_zero(name):
  fn, options, _ = PADDED_CASES[name]
  fn = jax.jit(functools.partial(fn, **options))
  query, key, value = random_qkv(seed=1, batch=B, q_len=T, num_heads=2)
  lengths = jnp.array([12, T])
  out = fn(query, key, value, key_value_seq_lengths=lengths, query_seq_lengths=lengths)
  garbage = jnp.where(jnp.arange(T)[None, :, None, None] >= 12, 1e3, 0.0)
  again = fn(query, key + garbage, value - garbage, key_value_seq_lengths=lengths,
             query_seq_lengths=lengths)
  assert_close(out[0, :12], again[0, :12])
  assert np.all(np.asarray(out[0, 12:]) == 0.0)
  # A key-padding mask is the same as the lengths.
  key_mask = (jnp.arange(T)[None, :] < lengths[:, None])[:, None, None, :]
  with_mask = fn(query, key, value, mask=key_mask, query_seq_lengths=lengths)
  assert_close(with_mask, out)


BAD_SIZES = [
    ("local", dict(window_size=0), "window_size must be an int >= 1"),
    ("local", dict(window_size=20), "window_size=20 must be at most the sequence length 19"),
    ("block_local", dict(block_size=2.5), "block_size must be an int"),
    ("block_local", dict(block_size=40), "block_size=40 must be at most"),
    ("dilated", dict(window_size=2, dilation=0), "dilation must be an int >= 1"),
    ("dilated", dict(window_size=30), "window_size=30 must be at most"),
]


@pytest.mark.parametrize("name,options,message", BAD_SIZES)
def test_bad_sizes_name_the_argument_and_the_constraint(name, options, message):
  query, key, value = random_qkv(q_len=T, num_heads=2)
  with pytest.raises(ValueError, match=message):
    registry.get_variant(name).fn(query, key, value, **options)


MODULE_OPTIONS = {
    "local": dict(window_size=8),
    "band": dict(window_size=8),
    "block_local": dict(block_size=8),
    "dilated": dict(window_size=4, dilation=3),
}


@pytest.mark.parametrize("name", sorted(MODULE_OPTIONS))
def test_refuses_cross_attention_bias_and_pairwise_masks(name):
  fn = functools.partial(registry.get_variant(name).fn, **MODULE_OPTIONS[name])
  query, key, value = random_qkv(q_len=8, kv_len=12, num_heads=2)
  with pytest.raises(ValueError, match=r"query length \(8\).*key/value length \(12\)"):
    fn(query, key, value)
  query, key, value = random_qkv(q_len=8, num_heads=2)
  with pytest.raises(ValueError, match="bias"):
    fn(query, key, value, jnp.zeros((1, 2, 8, 8)))
  with pytest.raises(ValueError, match="key-padding mask"):
    fn(query, key, value, None, jnp.ones((1, 1, 8, 8), bool))


@pytest.mark.parametrize("name", sorted(MODULE_OPTIONS))
def test_runs_in_multi_head_attention_under_jit(name):
  x = jax.random.normal(jax.random.PRNGKey(0), (2, 40, 16))
  layer = MultiHeadAttention(num_heads=4, num_kv_heads=2, attention=name,
                             attention_options=MODULE_OPTIONS[name])
  variables = layer.init(jax.random.PRNGKey(1), x)
  key_mask = (jnp.arange(40)[None, :] < jnp.array([30, 40])[:, None])[:, None, None, :]
  apply = jax.jit(lambda v, x, m: layer.apply(v, x, mask=m, is_causal=True))
  out = apply(variables, x, key_mask)
  assert out.shape == x.shape and np.isfinite(np.asarray(out)).all()
  # Causal: a change at the end does not reach the start.
  changed = apply(variables, x.at[:, 30:].add(1.0), key_mask)
  assert_close(out[:, :30], changed[:, :30])
