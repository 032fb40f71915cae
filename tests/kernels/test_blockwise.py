"""The pure-JAX blockwise implementation against the dense reference."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attention_jax
from attention_jax.core import reach_of
from attention_jax.kernels.flash_attention import (BlockSizes, blockwise_dot_product_attention,
                                                   common)
from attention_testing import (MASK_CASES, check_against_reference, jit_call,
                               largest_intermediate, loop_mask, random_qkv)

# Blocks that do not divide Tq = 7 or Tk = 9, and differ between the two backward sweeps.
SMALL_BLOCKS = BlockSizes(block_q=4, block_k=4, block_q_dkv=2, block_k_dkv=8)


def _blockwise(*args, **kwargs):
  return blockwise_dot_product_attention(*args, block_sizes=SMALL_BLOCKS, **kwargs)


@pytest.mark.parity("blockwise")
@pytest.mark.parametrize("case", sorted(MASK_CASES))
@pytest.mark.parametrize("num_kv_heads", [4, 1])
@pytest.mark.parametrize("with_bias_and_mask", [False, True])
def test_matches_reference_outputs_and_gradients(case, num_kv_heads, with_bias_and_mask):
  check_against_reference(_blockwise, case, num_kv_heads, with_bias_and_mask)


@pytest.mark.parity("blockwise")
@pytest.mark.parametrize("case", ["plain", "causal", "everything"])
def test_bfloat16_matches_reference(case):
  check_against_reference(_blockwise, case, 2, True, dtype=jnp.bfloat16, rtol=2e-2, atol=2e-2)


def test_selected_through_dot_product_attention():
  query, key, value = random_qkv(q_len=33, kv_len=40)
  expected = jit_call(attention_jax.dot_product_attention, query, key, value, is_causal=True)
  actual = jit_call(attention_jax.dot_product_attention, query, key, value, is_causal=True,
                    implementation="blockwise")
  np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("q_len, kv_len", [(1, 12), (12, 1), (1, 1)])
def test_a_sequence_of_one_token_is_padded_like_any_other(q_len, kv_len):
  """One query against a cache of keys (a decoding step), or one key: a
  length of 1 is a real sequence, not a broadcast axis."""
  query, key, value = random_qkv(seed=3, q_len=q_len, kv_len=kv_len)
  mask = jnp.asarray(np.random.default_rng(0).random((query.shape[0], 1, q_len, kv_len)) > 0.3)

  def outputs_and_grads(implementation):
    attend = lambda q, k, v: attention_jax.dot_product_attention(
        q, k, v, mask=mask, implementation=implementation)

    def loss(*arrays):
      out = attend(*arrays)
      return jnp.sum(out ** 2), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(
        query, key, value)
    return out, grads

  for ours, theirs in zip(jax.tree.leaves(outputs_and_grads("blockwise")),
                          jax.tree.leaves(outputs_and_grads("xla"))):
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("reach_args", [(False, None), (True, None), (False, (3, 1)),
                                        (True, (5, 2)), (False, (0, 6))])
@pytest.mark.parametrize("blocks", [(4, 4), (2, 8), (8, 2), (3, 5)])
def test_block_ranges_cover_exactly_the_blocks_with_allowed_pairs(reach_args, blocks):
  is_causal, window = reach_args
  bq, bk = blocks
  q_len, kv_len = 24, 40
  allowed = loop_mask(1, q_len, kv_len, is_causal=is_causal, window=window)[0, 0]
  reach = reach_of(is_causal, window)
  nq, nk = q_len // bq + (q_len % bq > 0), kv_len // bk + (kv_len % bk > 0)
  needed = {(i, j) for i, j in itertools.product(range(nq), range(nk))
            if allowed[i * bq:(i + 1) * bq, j * bk:(j + 1) * bk].any()}
  by_query = {(i, j) for i in range(nq)
              for j in range(*map(int, common.kv_block_range(i, bq, bk, nk, reach)))}
  by_key = {(i, j) for j in range(nk)
            for i in range(*map(int, common.q_block_range(j, bq, bk, nq, reach)))}
  assert by_query == needed
  assert by_key == needed


def test_forward_and_backward_never_build_a_length_squared_array():
  length, heads, dim = 2048, 2, 16
  query, key, value = random_qkv(batch=1, q_len=length, num_heads=heads, head_dim=dim)
  blocks = BlockSizes(block_q=128, block_k=128)

  def loss(q, k, v):
    out = blockwise_dot_product_attention(q, k, v, is_causal=True, block_sizes=blocks)
    return jnp.sum(out ** 2)

  largest = largest_intermediate(jax.grad(loss, argnums=(0, 1, 2)), query, key, value)
  # O(T) residuals (q, k, v, out: T * H * D) and one block of logits at a time.
  assert largest <= max(length * heads * dim, heads * 128 * 128)
  dense_loss = lambda q, k, v: jnp.sum(
      attention_jax.dot_product_attention(q, k, v, implementation="xla") ** 2)
  dense_largest = largest_intermediate(jax.grad(dense_loss, argnums=(0, 1, 2)),
                                        query, key, value)
  assert dense_largest >= length * length  # the check would catch a T x T array


def test_block_sizes_are_validated():
  with pytest.raises(ValueError, match="BlockSizes.block_q must be a positive int, got 0"):
    BlockSizes(block_q=0, block_k=4)
