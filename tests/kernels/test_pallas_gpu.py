"""The Pallas GPU (Triton) flash-attention kernels against the dense reference.

There is no GPU in CI: the kernels run in the Pallas interpreter on CPU, and
`test_kernels_lower_to_triton_ir` checks that the very same kernels lower with
the Triton backend (exported for CUDA, which needs no device).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

import attention_jax
from attention_jax.core import reference_attention
from attention_jax.kernels.flash_attention import BlockSizes, pallas_gpu
from attention_testing import (MASK_CASES, assert_close, check_against_reference, loop_mask,
                               random_qkv)

# The smallest Triton tiles: TQ = 7 and TK = 9 of the shared grid pad to one block.
SMALL_BLOCKS = BlockSizes(block_q=16, block_k=16)
# Differing forward and dk/dv tiles, so that padding follows the larger of each.
MIXED_BLOCKS = BlockSizes(block_q=16, block_k=32, block_q_dkv=32, block_k_dkv=16)
SCALE = 0.3


def _pallas(*args, block_sizes=SMALL_BLOCKS, **kwargs):
  return pallas_gpu.gpu_dot_product_attention(*args, block_sizes=block_sizes, **kwargs)


def _output_and_grads(fn, args, cotangent):
  """fn(*args) and the gradients of <fn(*args), cotangent> with respect to every arg."""
  out, vjp = jax.vjp(fn, *args)
  return out, vjp(cotangent.astype(out.dtype))


def _compare_with_reference(query, key, value, bias, extra_mask, kwargs, mask_args, *,
                            block_sizes, scale=SCALE, rtol=1e-5, atol=1e-5):
  """Output and gradients (q, k, v and bias when given) equal the loop-masked reference."""
  batch, q_len = query.shape[:2]
  allowed = loop_mask(batch, q_len, key.shape[1], **mask_args)
  if extra_mask is not None:
    allowed = allowed & np.asarray(extra_mask)
  args = (query, key, value) + (() if bias is None else (bias,))

  def ours(q, k, v, b=None):
    return _pallas(q, k, v, b, extra_mask, scale=scale, block_sizes=block_sizes, **kwargs)

  def oracle(q, k, v, b=None):
    return reference_attention(q, k, v, b, jnp.array(allowed), scale=scale)

  cotangent = jax.random.normal(jax.random.PRNGKey(7), query.shape[:3] + value.shape[-1:])
  # Both jitted: each test has its own shapes, and eager autodiff of the oracle
  # would compile every op anew.
  out, grads = jax.jit(lambda *a: _output_and_grads(ours, a, cotangent))(*args)
  expected_out, expected_grads = jax.jit(lambda *a: _output_and_grads(oracle, a, cotangent))(
      *args)
  assert out.dtype == query.dtype
  assert_close(out, expected_out, rtol=rtol, atol=atol)
  for name, got, want in zip("qkvb", grads, expected_grads):
    assert got.dtype == want.dtype
    assert_close(got, want, rtol=rtol, atol=atol, err_msg=f"gradient of {name}")


# ---------------------------------------------------------------------------
# Parity on the shared grid (every mask kind, grouped heads, bias and mask).
# ---------------------------------------------------------------------------


# Every case once with full heads and once with a single K/V head; the other
# pairings run in the slow sweep. (A zero bias is passed even without one, so
# the bias gradient is always checked; the long tests below pass no bias.)
@pytest.mark.parity("flash")
@pytest.mark.parametrize("case", sorted(MASK_CASES))
@pytest.mark.parametrize("num_kv_heads, with_bias_and_mask", [(4, False), (1, True)])
def test_matches_reference_outputs_and_gradients(case, num_kv_heads, with_bias_and_mask):
  check_against_reference(_pallas, case, num_kv_heads, with_bias_and_mask)


@pytest.mark.parity("flash")
@pytest.mark.parametrize("case", ["causal", "everything"])
def test_bfloat16_matches_reference(case):
  check_against_reference(_pallas, case, 2, True, dtype=jnp.bfloat16, rtol=2e-2, atol=2e-2)


# ---------------------------------------------------------------------------
# Several blocks per sequence: block skipping and padding for real.
# ---------------------------------------------------------------------------

LONG_B, LONG_TQ, LONG_TK = 2, 40, 72
# Runs of segments long enough that some (query block, key block) pairs share none.
LONG_Q_SEGMENTS = np.array([[0] * 10 + [1] * 20 + [2] * 10, [0] * 35 + [3] * 5])
LONG_KV_SEGMENTS = np.array([[0] * 30 + [1] * 20 + [2] * 22, [0] * 40 + [1] * 32])
LONG_KV_LENGTHS = np.array([20, 72])
LONG_Q_LENGTHS = np.array([33, 40])

# name -> (keyword arguments of dot_product_attention, arguments of loop_mask)
LONG_CASES = {
    "causal": (dict(is_causal=True), dict(is_causal=True)),
    "window": (dict(local_window_size=(5, 3)), dict(window=(5, 3))),
    "causal_window": (dict(is_causal=True, local_window_size=(20, 4)),
                      dict(is_causal=True, window=(20, 4))),
    "segments": (dict(segment_ids=(jnp.array(LONG_Q_SEGMENTS), jnp.array(LONG_KV_SEGMENTS))),
                 dict(q_segments=LONG_Q_SEGMENTS, kv_segments=LONG_KV_SEGMENTS)),
    "kv_lengths": (dict(key_value_seq_lengths=jnp.array(LONG_KV_LENGTHS)),
                   dict(kv_lengths=LONG_KV_LENGTHS)),
    "q_lengths": (dict(query_seq_lengths=jnp.array(LONG_Q_LENGTHS)),
                  dict(q_lengths=LONG_Q_LENGTHS)),
    "everything": (dict(is_causal=True, local_window_size=(30, 2),
                        key_value_seq_lengths=jnp.array(LONG_KV_LENGTHS),
                        query_seq_lengths=jnp.array(LONG_Q_LENGTHS),
                        segment_ids=(jnp.array(LONG_Q_SEGMENTS), jnp.array(LONG_KV_SEGMENTS))),
                   dict(is_causal=True, window=(30, 2), kv_lengths=LONG_KV_LENGTHS,
                        q_lengths=LONG_Q_LENGTHS, q_segments=LONG_Q_SEGMENTS,
                        kv_segments=LONG_KV_SEGMENTS)),
}


def _long_bias_and_mask(heads):
  rng = np.random.default_rng(3)
  bias = jnp.array(rng.normal(size=(LONG_B, 1, LONG_TQ, LONG_TK)), jnp.float32)
  mask = jnp.array(rng.random((1, heads, LONG_TQ, LONG_TK)) > 0.1)
  return bias, mask


def _check_long_case(case, block_sizes):
  """A long case without bias or mask (the kernels' no-bias path), grouped heads."""
  kwargs, mask_args = LONG_CASES[case]
  query, key, value = random_qkv(seed=1, batch=LONG_B, q_len=LONG_TQ, kv_len=LONG_TK,
                                 num_heads=4, num_kv_heads=2, head_dim=16, value_dim=24)
  _compare_with_reference(query, key, value, None, None, kwargs, mask_args,
                          block_sizes=block_sizes)


@pytest.mark.parity("flash")
@pytest.mark.parametrize("case", sorted(LONG_CASES))
def test_long_sequences_match_reference(case):
  _check_long_case(case, MIXED_BLOCKS)


@pytest.mark.parity("flash")
def test_long_sequences_with_bias_and_mask_match_reference():
  kwargs, mask_args = LONG_CASES["everything"]
  query, key, value = random_qkv(seed=2, batch=LONG_B, q_len=LONG_TQ, kv_len=LONG_TK,
                                 num_heads=2, head_dim=16)
  bias, mask = _long_bias_and_mask(heads=2)
  _compare_with_reference(query, key, value, bias, mask, kwargs, mask_args,
                          block_sizes=MIXED_BLOCKS)


@pytest.mark.parity("flash")
def test_broadcast_bias_and_mask_shapes():
  """A per-key bias `[B, 1, 1, Tk]` and a per-(head, query) mask `[1, H, Tq, 1]`."""
  batch, q_len, kv_len, heads = 2, 20, 40, 2
  query, key, value = random_qkv(seed=13, batch=batch, q_len=q_len, kv_len=kv_len,
                                 num_heads=heads, head_dim=16)
  rng = np.random.default_rng(14)
  bias = jnp.array(rng.normal(size=(batch, 1, 1, kv_len)), jnp.float32)
  mask = jnp.array(rng.random((1, heads, q_len, 1)) > 0.2)
  _compare_with_reference(query, key, value, bias, mask, dict(is_causal=True),
                          dict(is_causal=True), block_sizes=SMALL_BLOCKS)


# Each case leaves query block 0 (queries 0-15 of 64, blocks of 16) unable to see
# some key blocks: (keyword arguments, the key blocks query block 0 can see).
_SEGMENT_IDS = jnp.array([[0] * 16 + [1] * 48])
SKIP_CASES = {
    "causal": (dict(is_causal=True), 1),
    "window": (dict(local_window_size=(8, 8)), 2),
    "segments": (dict(segment_ids=_SEGMENT_IDS), 1),
    "kv_lengths": (dict(key_value_seq_lengths=jnp.array([16])), 1),
}


@pytest.mark.parametrize("case", sorted(SKIP_CASES))
def test_blocks_nobody_can_see_are_never_read(case):
  """NaN in blocks outside the mask stays out of results that do not depend on them.

  Masking alone would not do: a visited block multiplies its NaN values by
  zero probabilities and gets NaN. So finite results prove the skipping.
  """
  kwargs, visible_blocks = SKIP_CASES[case]
  length, block = 64, 16
  hidden = visible_blocks * block  # keys from here on are invisible to queries 0-15
  query, key, value = random_qkv(seed=3, batch=1, q_len=length, num_heads=2, head_dim=16)
  cotangent = jax.random.normal(jax.random.PRNGKey(0), query.shape)
  fn = jax.jit(lambda q, k, v, ct: _output_and_grads(
      lambda *a: _pallas(*a, block_sizes=SMALL_BLOCKS, **kwargs), (q, k, v), ct))
  clean_out, (clean_dq, clean_dk, clean_dv) = fn(query, key, value, cotangent)

  # Forward and dq: query block 0 must not visit key blocks holding NaN values.
  nan_values = value.at[:, hidden:].set(jnp.nan)
  out, (dq, _, _) = fn(query, key, nan_values, cotangent)
  np.testing.assert_array_equal(out[:, :block], clean_out[:, :block])
  np.testing.assert_array_equal(dq[:, :block], clean_dq[:, :block])

  # dk/dv: key blocks invisible to query block 0 must not visit it (NaN cotangent).
  nan_cotangent = cotangent.at[:, :block].set(jnp.nan)
  _, (_, dk, dv) = fn(query, key, value, nan_cotangent)
  np.testing.assert_array_equal(dk[:, hidden:], clean_dk[:, hidden:])
  np.testing.assert_array_equal(dv[:, hidden:], clean_dv[:, hidden:])


def test_fully_masked_rows_give_zeros_and_zero_gradients():
  batch, q_len, kv_len, heads = 2, 20, 24, 2
  query, key, value = random_qkv(seed=4, batch=batch, q_len=q_len, kv_len=kv_len,
                                 num_heads=heads, head_dim=16)
  bias = jax.random.normal(jax.random.PRNGKey(5), (batch, heads, q_len, kv_len))
  mask = np.ones((batch, 1, q_len, kv_len), bool)
  mask[0, :, 3:8] = False  # rows 3-7 of batch 0 see nothing
  lengths = jnp.array([kv_len, 0])  # batch 1 sees nothing at all

  def loss(q, k, v, b):
    out = _pallas(q, k, v, b, jnp.array(mask), key_value_seq_lengths=lengths)
    return jnp.sum(out * jnp.arange(out.size).reshape(out.shape) / out.size), out

  (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(
      query, key, value, bias)
  for x in (out,) + grads:
    assert np.isfinite(np.asarray(x)).all()
  dq, dk, dv, d_bias = grads
  np.testing.assert_array_equal(out[0, 3:8], 0.0)
  np.testing.assert_array_equal(out[1], 0.0)
  np.testing.assert_array_equal(dq[0, 3:8], 0.0)
  np.testing.assert_array_equal(d_bias[0, :, 3:8], 0.0)
  for grad in (dq, dk, dv):
    np.testing.assert_array_equal(grad[1], 0.0)
  np.testing.assert_array_equal(d_bias[1], 0.0)
  assert np.abs(np.asarray(out[0, :3])).sum() > 0  # the other rows are not zeroed too


# ---------------------------------------------------------------------------
# Head dims, dtypes, defaults, the unbatched form.
# ---------------------------------------------------------------------------

HEAD_DIMS = [32, 64, 80, 96, 128, 256]


def _head_dim_inputs(head_dim, dtype=jnp.float32):
  return random_qkv(seed=head_dim, batch=1, q_len=20, kv_len=24, num_heads=2,
                    head_dim=head_dim, dtype=dtype)


@pytest.mark.parity("flash")
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_head_dims_forward_matches_reference(head_dim):
  query, key, value = _head_dim_inputs(head_dim)
  expected = reference_attention(query, key, value, None,
                                 jnp.array(loop_mask(1, 20, 24, is_causal=True)))
  actual = jax.jit(functools.partial(_pallas, is_causal=True))(query, key, value)
  assert_close(actual, expected)


@pytest.mark.parity("flash")
@pytest.mark.parametrize("head_dim", [80, 256])
def test_head_dims_gradients_match_reference(head_dim):
  query, key, value = _head_dim_inputs(head_dim)
  # The default 1/sqrt(D) scale: at 0.3 a head dim of 256 gives logits of ~5
  # standard deviations, and float32 rounding of exp() alone exceeds 1e-5.
  _compare_with_reference(query, key, value, None, None, dict(is_causal=True),
                          dict(is_causal=True), block_sizes=SMALL_BLOCKS, scale=head_dim ** -0.5)


@pytest.mark.parity("flash")
def test_different_query_and_value_head_dims_and_float16():
  query, key, _ = random_qkv(seed=6, q_len=20, kv_len=30, num_heads=4, num_kv_heads=2,
                             head_dim=96, dtype=jnp.float16)
  value = jax.random.normal(jax.random.PRNGKey(8), (2, 30, 2, 40), jnp.float16)
  _compare_with_reference(query, key, value, None, None, dict(local_window_size=(6, 6)),
                          dict(window=(6, 6)), block_sizes=MIXED_BLOCKS, rtol=2e-2, atol=2e-2)


def test_default_block_sizes_are_triton_tiles_and_shrink_for_large_heads():
  for head_dim in HEAD_DIMS:
    for dtype in (jnp.float32, jnp.bfloat16):
      blocks = pallas_gpu.default_block_sizes_gpu(head_dim, dtype)
      for size in (blocks.block_q, blocks.block_k) + blocks.dkv:
        assert size >= 16 and size & (size - 1) == 0
  small = pallas_gpu.default_block_sizes_gpu(64, jnp.bfloat16)
  large = pallas_gpu.default_block_sizes_gpu(256, jnp.bfloat16)
  assert (small.block_q, small.block_k) == (128, 64)
  assert large.block_q * large.block_k < small.block_q * small.block_k


@pytest.mark.parity("flash")
def test_default_block_sizes_through_dot_product_attention_signature():
  query, key, value = random_qkv(seed=9, batch=1, q_len=130, kv_len=150, num_heads=2,
                                 head_dim=64)
  _compare_with_reference(query, key, value, None, None, dict(is_causal=True),
                          dict(is_causal=True), block_sizes=None)


def test_unbatched_inputs():
  query, key, value = random_qkv(seed=10, q_len=18, kv_len=21)
  expected = attention_jax.dot_product_attention(query[0], key[0], value[0], is_causal=True)
  actual = _pallas(query[0], key[0], value[0], is_causal=True)
  assert actual.shape == expected.shape
  assert_close(actual, expected)


# ---------------------------------------------------------------------------
# Validation, and lowering with the Triton backend.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("head_dim, value_dim, match", [
    (300, 8, "head dim of 1 to 256"), (8, 512, "value head dim of 1 to 256")])
def test_rejects_head_dims_over_256(head_dim, value_dim, match):
  query, key, value = random_qkv(head_dim=head_dim, value_dim=value_dim)
  with pytest.raises(ValueError, match=match):
    _pallas(query, key, value)


def test_rejects_unsupported_dtypes():
  query, key, value = (x.astype(jnp.int32) for x in random_qkv())
  with pytest.raises(ValueError, match="float32, bfloat16 or float16 inputs, got int32"):
    _pallas(query, key, value)


@pytest.mark.parametrize("blocks, field", [
    (BlockSizes(24, 16), "block_q=24"), (BlockSizes(16, 8), "block_k=8"),
    (BlockSizes(16, 16, block_k_dkv=48), "block_k_dkv=48")])
def test_rejects_block_sizes_that_are_not_triton_tiles(blocks, field):
  query, key, value = random_qkv()
  with pytest.raises(ValueError, match=f"powers of two and at least 16.*{field}"):
    _pallas(query, key, value, block_sizes=blocks)


@pytest.mark.parametrize("dtype, head_dim", [(jnp.bfloat16, 80), (jnp.float32, 256)])
def test_kernels_lower_to_triton_ir(dtype, head_dim):
  """The forward, dq and dk/dv kernels lower with the Triton backend (no GPU needed).

  Lowering checks what Triton demands of a kernel (power-of-two tiles, supported
  primitives); it does not compile the result to PTX.
  """
  q_len, kv_len = 300, 520
  query, key, value = random_qkv(batch=2, q_len=q_len, kv_len=kv_len, num_heads=4,
                                 num_kv_heads=2, head_dim=head_dim, dtype=dtype)
  bias = jnp.zeros((2, 1, 1, kv_len), dtype)
  mask = jnp.ones((1, 4, q_len, 1), bool)
  kwargs = dict(is_causal=True, local_window_size=(100, 0),
                key_value_seq_lengths=jnp.array([500, 3]),
                segment_ids=(jnp.zeros((2, q_len), jnp.int32), jnp.zeros((2, kv_len), jnp.int32)))

  def loss(q, k, v, b):
    out = pallas_gpu.gpu_dot_product_attention(q, k, v, b, mask, interpret=False, **kwargs)
    return jnp.sum(out.astype(jnp.float32))

  exported = export.export(
      jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))), platforms=["cuda"],
      disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
  )(query, key, value, bias)
  module = exported.mlir_module()
  for kernel in ("flash_attention_forward", "flash_attention_dq", "flash_attention_dkv"):
    assert f'name = "{kernel}"' in module


# ---------------------------------------------------------------------------
# The wide sweep (not in the default run: -m slow).
# ---------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parity("flash")
@pytest.mark.parametrize("case", sorted(MASK_CASES))
@pytest.mark.parametrize("num_kv_heads, with_bias_and_mask", [(4, True), (2, True), (1, False)])
def test_slow_other_head_and_bias_pairings(case, num_kv_heads, with_bias_and_mask):
  check_against_reference(_pallas, case, num_kv_heads, with_bias_and_mask)


@pytest.mark.slow
@pytest.mark.parity("flash")
@pytest.mark.parametrize("case", sorted(MASK_CASES))
def test_slow_bfloat16_every_case(case):
  check_against_reference(_pallas, case, 2, True, dtype=jnp.bfloat16, rtol=2e-2, atol=2e-2)


@pytest.mark.slow
@pytest.mark.parity("flash")
@pytest.mark.parametrize("case", sorted(LONG_CASES))
def test_slow_long_sequences_with_16x16_blocks(case):
  _check_long_case(case, SMALL_BLOCKS)


@pytest.mark.slow
@pytest.mark.parity("flash")
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_slow_every_head_dim_with_gradients(head_dim, dtype):
  query, key, value = _head_dim_inputs(head_dim, dtype)
  tolerance = 1e-5 if dtype == jnp.float32 else 2e-2
  _compare_with_reference(query, key, value, None, None, dict(local_window_size=(9, 2)),
                          dict(window=(9, 2)), block_sizes=MIXED_BLOCKS, scale=head_dim ** -0.5,
                          rtol=tolerance, atol=tolerance)


def _swap_sides(kwargs, mask_args):
  """The query-side masks of a case become key-side masks and vice versa."""
  kwarg_pairs = {"query_seq_lengths": "key_value_seq_lengths",
                 "key_value_seq_lengths": "query_seq_lengths"}
  kwargs = {kwarg_pairs.get(name, name): value for name, value in kwargs.items()}
  if "segment_ids" in kwargs:
    kwargs["segment_ids"] = tuple(reversed(kwargs["segment_ids"]))
  arg_pairs = {"q_lengths": "kv_lengths", "kv_lengths": "q_lengths",
               "q_segments": "kv_segments", "kv_segments": "q_segments"}
  mask_args = {arg_pairs.get(name, name): value for name, value in mask_args.items()}
  return kwargs, mask_args


@pytest.mark.slow
@pytest.mark.parity("flash")
@pytest.mark.parametrize("case", sorted(LONG_CASES))
def test_slow_long_sequences_longer_queries_with_bias(case, block_sizes=BlockSizes(32, 16, 16, 64)):
  """Tq > Tk (the long cases with queries and keys swapped), with a bias and a mask."""
  kwargs, mask_args = _swap_sides(*LONG_CASES[case])
  query, key, value = random_qkv(seed=11, batch=LONG_B, q_len=LONG_TK, kv_len=LONG_TQ,
                                 num_heads=2, head_dim=32)
  rng = np.random.default_rng(12)
  bias = jnp.array(rng.normal(size=(1, 2, LONG_TK, LONG_TQ)), jnp.float32)
  mask = jnp.array(rng.random((LONG_B, 1, LONG_TK, LONG_TQ)) > 0.1)
  _compare_with_reference(query, key, value, bias, mask, kwargs, mask_args,
                          block_sizes=block_sizes)
