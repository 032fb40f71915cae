"""MoBA against its gating and block attention written out query by query."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attention_jax as aj
from attention_jax.variants.modern.moba import moba_attention
from attention_testing import (as_float64, assert_close, assert_same_outputs_and_grads,
                               jit_apply, jit_call, jit_init, np_softmax, random_qkv)

B, T, H, HKV, D = 2, 29, 4, 2, 8
BLOCK, TOP_K = 4, 3


def _numpy_moba(query, key, value, lengths, causal=True):
  """Per query: pool each block's real keys, score them, keep the own block
  and the best others up to TOP_K (later blocks not eligible when causal), then
  softmax over the chosen blocks' keys (causal inside)."""
  q, k, v = map(as_float64, (query, key, value))
  group = q.shape[2] // k.shape[2]
  num_blocks = -(-T // BLOCK)
  out = np.zeros(q.shape[:3] + (v.shape[-1],))
  for b in range(B):
    for h in range(H):
      kh, vh = k[b, :lengths[b], h // group], v[b, :lengths[b], h // group]
      for i in range(T):
        own = i // BLOCK
        scores = {}
        for blk in range(num_blocks):
          keys = kh[blk * BLOCK:(blk + 1) * BLOCK]
          if len(keys) == 0 or (causal and blk > own) or blk == own:
            continue
          scores[blk] = q[b, i, h] @ keys.mean(0)
        chosen = [own] + sorted(scores, key=scores.get, reverse=True)[:TOP_K - 1]
        js = [j for j in range(len(kh)) if j // BLOCK in chosen and (not causal or j <= i)]
        if not js:
          continue
        weights = np_softmax(np.array([q[b, i, h] @ kh[j] for j in js]) / np.sqrt(D))
        out[b, i, h] = weights @ vh[js]
  return out


@pytest.mark.parametrize("implementation", ["blockwise", "xla"])
@pytest.mark.property("moba")
def test_equals_the_gated_blocks_written_out(implementation):
  query, key, value = random_qkv(batch=B, q_len=T, num_heads=H, num_kv_heads=HKV, head_dim=D)
  lengths = [T, 18]
  got = jax.jit(functools.partial(
      moba_attention, block_size=BLOCK, top_k=TOP_K, is_causal=True,
      key_value_seq_lengths=jnp.asarray(lengths), implementation=implementation))(
          query, key, value)
  assert_close(got, _numpy_moba(query, key, value, lengths), rtol=1e-4, atol=1e-5)


@pytest.mark.property("moba")
def test_bidirectional_choice_ranges_over_every_block():
  query, key, value = random_qkv(seed=1, batch=B, q_len=T, num_heads=H, head_dim=D)
  got = jit_call(moba_attention, query, key, value, block_size=BLOCK, top_k=TOP_K)
  assert_close(got, _numpy_moba(query, key, value, [T, T], causal=False), rtol=1e-4,
               atol=1e-5)


@pytest.mark.property("moba")
def test_choosing_every_block_is_causal_attention():
  arrays = random_qkv(seed=2, batch=B, q_len=T, num_heads=H, num_kv_heads=HKV, head_dim=D)
  every = -(-T // BLOCK)
  assert_close(jit_call(moba_attention, *arrays, block_size=BLOCK, top_k=every, is_causal=True),
               jit_call(aj.dot_product_attention, *arrays, is_causal=True, implementation="xla"),
               rtol=1e-5, atol=1e-5)


@pytest.mark.property("moba")
def test_blockwise_gradients_equal_the_dense_reference_for_the_same_choice():
  arrays = random_qkv(seed=3, batch=B, q_len=T, num_heads=H, num_kv_heads=HKV, head_dim=D)
  run = lambda implementation: jax.jit(functools.partial(
      moba_attention, block_size=BLOCK, top_k=2, is_causal=True, implementation=implementation))
  assert_same_outputs_and_grads(run("blockwise"), run("xla"), *arrays, rtol=1e-4, atol=1e-5)


def test_bad_sizes_are_named():
  arrays = random_qkv(batch=1, q_len=16, num_heads=2, head_dim=8)
  with pytest.raises(ValueError, match=r"top_k \(5\) must be at most the number of key blocks 4"):
    moba_attention(*arrays, block_size=4, top_k=5, is_causal=True)
  with pytest.raises(ValueError, match="block_size must be an int >= 1"):
    moba_attention(*arrays, block_size=0, is_causal=True)
  with pytest.raises(ValueError, match=r"segment_ids \(the keys'\) must have shape \[1, 16\]"):
    moba_attention(*arrays, block_size=4, segment_ids=(jnp.zeros((1, 16)), jnp.zeros((1, 8))))


# Packed segments: each of 12 tokens (three blocks of BLOCK), so that the
# blocks of a segment alone and packed are the same keys.
SEGMENT = 12


def _packed_and_alone(is_causal, positions):
  """The layer's output for two packed segments and for each segment alone."""
  x = jax.random.normal(jax.random.PRNGKey(4), (1, 2 * SEGMENT, 16))
  layer = aj.MultiHeadAttention(num_heads=2, attention="moba", position="rope",
                                attention_options=dict(block_size=BLOCK, top_k=2))
  params = jit_init(layer, jax.random.PRNGKey(0), x, is_causal=is_causal)
  segment_ids = jnp.repeat(jnp.arange(2), SEGMENT)[None]
  packed = jit_apply(layer, params, x, is_causal=is_causal, segment_ids=segment_ids,
                     positions=positions)
  alone = jnp.concatenate([jit_apply(layer, params, x[:, :SEGMENT], is_causal=is_causal),
                           jit_apply(layer, params, x[:, SEGMENT:], is_causal=is_causal)], 1)
  return packed, alone


@pytest.mark.parametrize("is_causal", [True, False])
@pytest.mark.property("moba")
def test_packed_segments_with_restarting_positions_equal_each_segment_alone(is_causal):
  # The layer offers positions restarting at each segment; MoBA's blocks are
  # over the keys' indices, and a query chooses among its own segment's blocks.
  packed, alone = _packed_and_alone(is_causal, jnp.tile(jnp.arange(SEGMENT), 2))
  assert_close(packed, alone, rtol=1e-5, atol=1e-5)


@pytest.mark.property("moba")
def test_positions_do_not_move_the_blocks():
  # MoBA has no position encoding of its own: without rotary positions the
  # layer's output is the same whatever positions it is given.
  x = jax.random.normal(jax.random.PRNGKey(5), (2, 20, 16))
  layer = aj.MultiHeadAttention(num_heads=2, attention="moba",
                                attention_options=dict(block_size=BLOCK, top_k=2))
  params = jit_init(layer, jax.random.PRNGKey(0), x, is_causal=True)
  default = jit_apply(layer, params, x, is_causal=True)
  for positions in (jnp.arange(20) + 7, jnp.arange(20)[::-1], jnp.arange(40).reshape(2, 20)):
    assert_close(jit_apply(layer, params, x, is_causal=True, positions=positions), default,
                 rtol=0, atol=0)


@pytest.mark.parametrize("implementation", ["blockwise", "xla"])
@pytest.mark.property("moba")
def test_fewer_queries_than_keys_are_the_last_rows_of_the_full_pass(implementation):
  # Queries sit at the last keys (arange(Tq) + Tk - Tq), for the block choice
  # and for causality alike.
  query, key, value = random_qkv(seed=6, batch=B, q_len=T, num_heads=H, num_kv_heads=HKV,
                                 head_dim=D)
  run = lambda q: jit_call(moba_attention, q, key, value, block_size=BLOCK, top_k=TOP_K,
                           is_causal=True, implementation=implementation)
  for q_len in (1, 5, 12):
    assert_close(run(query[:, -q_len:]), run(query)[:, -q_len:], rtol=1e-5, atol=1e-5)
