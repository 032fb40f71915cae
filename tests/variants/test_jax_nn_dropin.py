"""`dot_product_attention` as a drop-in for `jax.nn.dot_product_attention`, in every
implementation that runs on CPU (the Pallas kernels in their interpreters):

  * `return_residual=True` returns jax.nn's residual (the log-sum-exp, `[B, Tq, H]`,
    in the input dtype, jax.nn's fill on fully masked rows), with true gradients;
  * a bias or mask of rank below 4 gains leading 1s, as jax.nn's does;
  * everything stays finite: it runs under `jax.debug_infs(True)`, forward and
    backward, with fully masked rows (which output zeros, unlike jax.nn's).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attention_jax
from attention_jax.core import MASKED_LOGSUMEXP, reference_attention
from attention_jax.kernels.flash_attention import (BlockSizes, blockwise_dot_product_attention,
                                                   flash_dot_product_attention, pallas_mgpu,
                                                   pallas_tpu)
from attention_testing import (B, H, MASK_CASES, TK, TQ, assert_close, bias_and_mask,
                               jit_call, loop_mask, random_qkv)

KV_HEADS = 2
SCALE = 0.3

# Every implementation that runs on CPU, each with the signature of dot_product_attention.
IMPLEMENTATIONS = {
    "xla": functools.partial(attention_jax.dot_product_attention, implementation="xla"),
    "blockwise": functools.partial(attention_jax.dot_product_attention,
                                   implementation="blockwise"),
    # Blocks that do not divide Tq = 7 or Tk = 9 (several per sequence).
    "blockwise_small_blocks": functools.partial(
        blockwise_dot_product_attention,
        block_sizes=BlockSizes(block_q=4, block_k=4, block_q_dkv=2, block_k_dkv=8)),
    # implementation="pallas" off an accelerator: the Triton kernels, interpreted.
    "pallas": functools.partial(flash_dot_product_attention, block_sizes=BlockSizes(16, 16)),
    "pallas_tpu": pallas_tpu.tpu_dot_product_attention,
}
# The Pallas interpreters are slow: they run a few cases each; xla and blockwise run all.
SLOW = ("pallas", "pallas_tpu")


def _inputs(dtype=jnp.float32, seed=0):
  query, key, value = random_qkv(seed=seed, batch=B, q_len=TQ, kv_len=TK, num_heads=H,
                                 num_kv_heads=KV_HEADS, dtype=dtype)
  bias, mask = bias_and_mask(seed=2)
  return query, key, value, bias.astype(dtype), mask


# ---------------------------------------------------------------------------
# return_residual against jax.nn.
# ---------------------------------------------------------------------------

JAX_NN_CASES = sorted(case for case in MASK_CASES if MASK_CASES[case][2])
# jax.nn's masks all at once (segments are ours alone).
ALL_OF_JAX_NN = dict(is_causal=True, local_window_size=(4, 1),
                     query_seq_lengths=jnp.array([5, 7]), key_value_seq_lengths=jnp.array([3, 9]))
ALL_OF_JAX_NN_LOOP = dict(is_causal=True, window=(4, 1), q_lengths=np.array([5, 7]),
                          kv_lengths=np.array([3, 9]))


def _check_residual_against_jax_nn(fn, kwargs, loop_args, dtype=jnp.float32, rtol=1e-5,
                                   atol=1e-5):
  query, key, value, bias, mask = _inputs(dtype)
  out, residual = jax.jit(lambda *a: fn(*a, return_residual=True, scale=SCALE, **kwargs))(
      query, key, value, bias, mask)
  want_out, want_residual = jax.nn.dot_product_attention(
      query, key, value, bias, mask, scale=SCALE, return_residual=True, **kwargs)
  assert residual.shape == want_residual.shape == (B, TQ, H)
  assert residual.dtype == want_residual.dtype == dtype
  attended = (loop_mask(B, TQ, TK, **loop_args) & np.asarray(mask)).any(-1)[:, 0]  # [B, Tq]
  # Rows that attend something: jax.nn's values. The rest: jax.nn's fill, to the bit
  # (jax.nn's is the log-sum-exp of a row of fills, which rounds to the fill).
  assert_close(np.asarray(residual)[attended], np.asarray(want_residual)[attended], rtol=rtol,
               atol=atol)
  np.testing.assert_array_equal(np.asarray(residual)[~attended],
                                np.asarray(want_residual)[~attended])
  np.testing.assert_array_equal(np.asarray(residual, np.float32)[~attended],
                                np.float32(jnp.asarray(MASKED_LOGSUMEXP, dtype)))
  # Outputs: jax.nn's where something is attended, zeros elsewhere.
  assert_close(np.asarray(out)[attended], np.asarray(want_out)[attended], rtol=rtol, atol=atol)
  assert np.all(np.asarray(out, np.float32)[~attended] == 0)
  return attended


@pytest.mark.parametrize("name", ["xla", "blockwise", "blockwise_small_blocks"])
@pytest.mark.parametrize("case", JAX_NN_CASES)
def test_residual_equals_jax_nn(name, case):
  kwargs, loop_args, _ = MASK_CASES[case]
  _check_residual_against_jax_nn(IMPLEMENTATIONS[name], kwargs, loop_args)


@pytest.mark.parametrize("name", sorted(IMPLEMENTATIONS))
def test_residual_equals_jax_nn_under_all_its_masks(name):
  attended = _check_residual_against_jax_nn(IMPLEMENTATIONS[name], ALL_OF_JAX_NN,
                                            ALL_OF_JAX_NN_LOOP)
  assert 0 < attended.sum() < attended.size  # both kinds of rows are checked


@pytest.mark.parametrize("name", ["xla", "blockwise_small_blocks", "pallas_tpu"])
def test_bfloat16_residual_is_jax_nns_in_bfloat16(name):
  _check_residual_against_jax_nn(IMPLEMENTATIONS[name], ALL_OF_JAX_NN, ALL_OF_JAX_NN_LOOP,
                                 dtype=jnp.bfloat16, rtol=2e-2, atol=5e-2)


def test_float16_residual_of_a_fully_masked_row_is_finite():
  """jax.nn's fill overflows float16 (its residual is -inf there); ours is -65504."""
  query, key, value = (x.astype(jnp.float16) for x in random_qkv(batch=1, q_len=3))
  mask = jnp.array([True, True, False])[:, None] & jnp.ones((3,), bool)  # query 2: nothing
  out, residual = jit_call(attention_jax.dot_product_attention, query, key, value, mask=mask,
                           return_residual=True)
  # jax.nn eager: under jit on CPU its float16 einsum asks for a precision XLA refuses.
  _, theirs = jax.nn.dot_product_attention(query, key, value, mask=mask, return_residual=True)
  assert residual.dtype == jnp.float16
  assert np.all(np.isneginf(np.asarray(theirs[0, 2])))
  np.testing.assert_array_equal(np.asarray(residual[0, 2]), np.float16(-65504))
  assert_close(residual[0, :2], theirs[0, :2], rtol=1e-3, atol=1e-3)
  assert np.all(np.asarray(out[0, 2]) == 0)


def test_unbatched_residual_has_shape_tq_h():
  query, key, value = random_qkv(batch=1, q_len=5, num_heads=2)
  out, residual = jit_call(attention_jax.dot_product_attention, query[0], key[0], value[0],
                           is_causal=True, return_residual=True)
  _, theirs = jit_call(jax.nn.dot_product_attention, query[0], key[0], value[0], is_causal=True,
                       return_residual=True)
  assert out.shape == (5, 2, 8) and residual.shape == theirs.shape == (5, 2)
  assert_close(residual, theirs)


def test_residual_with_segment_ids_equals_the_reference():
  """(jax.nn takes no segment ids: the dense reference is the oracle here.)"""
  kwargs, loop_args, _ = MASK_CASES["everything"]
  query, key, value, bias, mask = _inputs()
  allowed = jnp.array(loop_mask(B, TQ, TK, **loop_args)) & mask
  _, want = jit_call(reference_attention, query, key, value, bias, allowed, scale=SCALE,
                     return_residual=True)
  for name in ("xla", "blockwise_small_blocks"):
    _, residual = jit_call(IMPLEMENTATIONS[name], query, key, value, bias, mask, scale=SCALE,
                           return_residual=True, **kwargs)
    assert_close(residual, want, err_msg=name)


# ---------------------------------------------------------------------------
# The residual's gradients.
# ---------------------------------------------------------------------------


def _lse_oracle(query, key, value, bias, allowed, scale):
  """jax.nn.logsumexp over the allowed logits, differentiated by autodiff.

  Fully masked rows take all their logits instead (their log-sum-exp of nothing
  has a NaN gradient): compare such rows' values elsewhere, and give them no
  cotangent.
  """
  del value
  allowed = allowed | ~allowed.any(-1, keepdims=True)
  key = jnp.repeat(key, query.shape[2] // key.shape[2], axis=2)
  logits = jnp.einsum("bqhd,bkhd->bhqk", query, key,
                      precision=jax.lax.Precision.HIGHEST) * scale + bias
  return jax.nn.logsumexp(jnp.where(allowed, logits, -jnp.inf), axis=-1).transpose(0, 2, 1)


def _output_residual_and_grads(fn, args, out_cotangent, lse_cotangent):
  """fn's outputs and the gradients of <out, out_ct> + <residual, lse_ct> w.r.t. args."""
  def loss(*a):
    out, residual = fn(*a)
    return (jnp.sum(out.astype(jnp.float32) * out_cotangent)
            + jnp.sum(residual.astype(jnp.float32) * lse_cotangent)), (out, residual)
  (_, outputs), grads = jax.value_and_grad(loss, argnums=tuple(range(len(args))),
                                           has_aux=True)(*args)
  return outputs, grads


@pytest.mark.parametrize("name", sorted(IMPLEMENTATIONS))
def test_residual_gradients_equal_autodiff_of_logsumexp(name):
  """Gradients of a loss on the output and the residual: q, k, v and the bias."""
  query, key, value, bias, _ = _inputs()
  # A causal window, and keys past a length: no row is fully masked here (see below).
  kwargs = dict(is_causal=True, local_window_size=(3, 0), key_value_seq_lengths=jnp.array([4, 9]))
  allowed = jnp.array(loop_mask(B, TQ, TK, is_causal=True, window=(3, 0),
                                kv_lengths=np.array([4, 9])))
  assert np.all(np.asarray(allowed).any(-1))
  out_ct = jax.random.normal(jax.random.PRNGKey(5), query.shape)
  lse_ct = jax.random.normal(jax.random.PRNGKey(6), query.shape[:3])
  ours = lambda *a: IMPLEMENTATIONS[name](*a, scale=SCALE, return_residual=True, **kwargs)
  oracle = lambda q, k, v, b: (reference_attention(q, k, v, b, allowed, scale=SCALE),
                               _lse_oracle(q, k, v, b, allowed, SCALE))
  args = (query, key, value, bias)
  (out, residual), grads = jax.jit(lambda *a: _output_residual_and_grads(
      ours, a, out_ct, lse_ct))(*args)
  (want_out, want_residual), want_grads = jax.jit(lambda *a: _output_residual_and_grads(
      oracle, a, out_ct, lse_ct))(*args)
  assert_close(out, want_out)
  assert_close(residual, want_residual)
  for arg, got, want in zip("qkvb", grads, want_grads):
    assert_close(got, want, err_msg=f"gradient of {arg}")
  # The residual's own share is not zero (jax.nn's residual would give none).
  _, lse_only = jax.jit(lambda *a: _output_residual_and_grads(
      ours, a, jnp.zeros_like(out_ct), lse_ct))(*args)
  assert np.abs(np.asarray(lse_only[0])).max() > 1e-2


@pytest.mark.parametrize("name", ["xla", "blockwise_small_blocks", "pallas"])
def test_fully_masked_rows_pass_no_gradient_through_the_residual(name):
  query, key, value, bias, _ = _inputs()
  mask = np.ones((B, 1, TQ, TK), bool)
  mask[0, :, 2] = False  # query 2 of sequence 0 sees nothing
  kwargs = dict(query_seq_lengths=jnp.array([5, 7]))  # queries 5, 6 of sequence 0 neither
  lse_ct = jnp.zeros(query.shape[:3]).at[0, 2].set(1.0).at[0, 5:].set(1.0)
  fn = lambda *a: IMPLEMENTATIONS[name](*a, jnp.array(mask), return_residual=True, **kwargs)
  (_, residual), grads = jax.jit(lambda *a: _output_residual_and_grads(
      fn, a, jnp.zeros(query.shape), lse_ct))(query, key, value, bias)
  np.testing.assert_array_equal(np.asarray(residual)[0, [2, 5, 6]], np.float32(MASKED_LOGSUMEXP))
  for got in grads:
    np.testing.assert_array_equal(np.asarray(got), 0.0)


def test_mosaic_gpu_residual_and_its_gradients_equal_the_reference():
  """The Mosaic GPU kernels (interpreted): 16-bit inputs, head dim 64, no bias or mask."""
  batch, q_len, kv_len = 2, 100, 150
  query, key, value = random_qkv(seed=4, batch=batch, q_len=q_len, kv_len=kv_len, num_heads=4,
                                 num_kv_heads=2, head_dim=64, dtype=jnp.bfloat16)
  kwargs = dict(is_causal=True, local_window_size=(80, 0),
                key_value_seq_lengths=jnp.array([140, 64]), query_seq_lengths=jnp.array([90, 33]))
  allowed = loop_mask(batch, q_len, kv_len, is_causal=True, window=(80, 0),
                      kv_lengths=np.array([140, 64]), q_lengths=np.array([90, 33]))
  attended = allowed.any(-1)[:, 0]
  blocks = BlockSizes(block_q=64, block_k=64, block_q_dkv=64, block_k_dkv=64)
  out_ct = jax.random.normal(jax.random.PRNGKey(5), query.shape)
  # The residual's cotangent on attended rows only (see _lse_oracle).
  lse_ct = jax.random.normal(jax.random.PRNGKey(6), query.shape[:3]) * attended[..., None]
  ours = lambda *a: pallas_mgpu.mgpu_dot_product_attention(
      *a, scale=SCALE, block_sizes=blocks, return_residual=True, **kwargs)
  f32 = lambda x: x.astype(jnp.float32)
  oracle = lambda q, k, v: (
      reference_attention(f32(q), f32(k), f32(v), None, jnp.array(allowed), scale=SCALE),
      _lse_oracle(f32(q), f32(k), None, 0.0, jnp.array(allowed), SCALE))
  args = (query, key, value)
  (out, residual), grads = jax.jit(lambda *a: _output_residual_and_grads(
      ours, a, out_ct, lse_ct))(*args)
  (want_out, want_residual), want_grads = jax.jit(lambda *a: _output_residual_and_grads(
      oracle, a, out_ct, lse_ct))(*args)
  assert residual.dtype == jnp.bfloat16 and residual.shape == (batch, q_len, 4)
  assert_close(out, want_out, rtol=2e-2, atol=2e-2)
  assert_close(np.asarray(residual)[attended], np.asarray(want_residual)[attended], rtol=2e-2,
               atol=5e-2)
  np.testing.assert_array_equal(np.asarray(residual, np.float32)[~attended],
                                np.float32(jnp.bfloat16(MASKED_LOGSUMEXP)))
  for arg, got, want in zip("qkv", grads, want_grads):
    assert_close(got, want, rtol=5e-2, atol=5e-2, err_msg=f"gradient of {arg}")


# ---------------------------------------------------------------------------
# Bias and mask of rank below 4.
# ---------------------------------------------------------------------------

# name -> (bias shape, mask shape); None: no bias or no mask.
LOW_RANK = {
    "mask_tk": (None, (TK,)),
    "mask_1_1_tk": (None, (1, 1, TK)),
    "mask_tq_tk": (None, (TQ, TK)),
    "mask_h_tq_tk": (None, (H, TQ, TK)),
    "bias_tk": ((TK,), None),
    "bias_tq_tk_and_mask_h_1_tk": ((TQ, TK), (H, 1, TK)),
    "bias_h_tq_1_and_mask_1_tq_1": ((H, TQ, 1), (1, TQ, 1)),
}
# The Pallas interpreters take the two that cover every padded axis.
PALLAS_LOW_RANK = ("bias_tq_tk_and_mask_h_1_tk", "mask_tk")
LOW_RANK_GRID = [
    (name, case) for name in sorted(IMPLEMENTATIONS) for case in sorted(LOW_RANK)
    if name not in SLOW or case in PALLAS_LOW_RANK]


def _low_rank_inputs(case):
  bias_shape, mask_shape = LOW_RANK[case]
  rng = np.random.default_rng(11)
  bias = None if bias_shape is None else jnp.array(rng.normal(size=bias_shape), jnp.float32)
  mask = None
  if mask_shape is not None:
    mask = rng.random(mask_shape) > 0.3
    mask.reshape(-1, mask_shape[-1])[:, 0] = True  # every row attends (jax.nn's output = ours)
    mask = jnp.array(mask)
  return bias, mask


@pytest.mark.parametrize("name, case", LOW_RANK_GRID)
def test_low_rank_bias_and_mask_are_padded_with_leading_ones_as_jax_nn(name, case):
  query, key, value, _, _ = _inputs()
  bias, mask = _low_rank_inputs(case)
  out, residual = jax.jit(lambda *a: IMPLEMENTATIONS[name](
      *a, scale=SCALE, return_residual=True))(query, key, value, bias, mask)
  want_out, want_residual = jax.nn.dot_product_attention(
      query, key, value, bias, mask, scale=SCALE, return_residual=True)
  assert_close(out, want_out)
  assert_close(residual, want_residual)


def test_unbatched_call_pads_bias_and_mask_to_rank_4_as_jax_nn():
  """A rank-3 call: a `[Tk]` mask, and a rank-4 bias with batch 1 (jax.nn takes both)."""
  query, key, value = (x[0] for x in random_qkv(batch=1, q_len=TQ, kv_len=TK))
  mask = jnp.arange(TK) % 3 != 1
  bias = jax.random.normal(jax.random.PRNGKey(1), (1, 4, TQ, TK))
  ours = jit_call(attention_jax.dot_product_attention, query, key, value, bias, mask)
  assert_close(ours, jit_call(jax.nn.dot_product_attention, query, key, value, bias, mask))
  with pytest.raises(ValueError, match=r"bias must broadcast to \[B, H, Tq, Tk\] = \[1, 4, 7, 9\]"):
    attention_jax.dot_product_attention(query, key, value, jnp.zeros((2, 4, TQ, TK)))


# ---------------------------------------------------------------------------
# Finite everywhere: jax.debug_infs.
# ---------------------------------------------------------------------------


def _fully_masked_inputs():
  query, key, value, bias, _ = _inputs()
  mask = np.ones((B, 1, TQ, TK), bool)
  mask[0, :, 2] = False  # query 2 of sequence 0 sees nothing
  mask[1, :, :, 4] = False
  return query, key, value, bias, jnp.array(mask)


@pytest.mark.parametrize("name", sorted(IMPLEMENTATIONS))
def test_runs_under_debug_infs_with_fully_masked_rows(name):
  """Eager, so that every operation is checked, not only a jitted function's outputs:
  jax.nn runs here, and so must every implementation (forward and backward)."""
  query, key, value, bias, mask = _fully_masked_inputs()
  fn = lambda q, k, v, b: IMPLEMENTATIONS[name](q, k, v, b, mask, is_causal=True)
  loss = lambda *a: jnp.sum(fn(*a) ** 2)
  with jax.debug_infs(True):
    jax.nn.dot_product_attention(query, key, value, bias, mask, is_causal=True)  # the bar
    out = fn(query, key, value, bias)
    grads = jax.grad(loss, argnums=(0, 1, 2, 3))(query, key, value, bias)
  assert np.all(np.asarray(out[0, 2]) == 0)
  for g in grads:
    assert np.all(np.isfinite(np.asarray(g)))


def _finite_loss(out, residual):
  return jnp.sum(out.astype(jnp.float32)) + jnp.sum(jnp.exp(residual.astype(jnp.float32)))


@pytest.mark.parametrize("name", sorted(IMPLEMENTATIONS))
def test_residual_runs_under_debug_infs_with_fully_masked_rows(name):
  query, key, value, bias, mask = _fully_masked_inputs()
  fn = lambda q, k, v, b: IMPLEMENTATIONS[name](q, k, v, b, mask, return_residual=True)
  # exp(residual), as when partial results are combined: a sum of the residuals
  # themselves would overflow on the fully masked rows' -2.4e38.
  loss = lambda *a: _finite_loss(*fn(*a))
  with jax.debug_infs(True):
    jax.nn.dot_product_attention(query, key, value, bias, mask, return_residual=True)
    _, residual = fn(query, key, value, bias)
    jax.grad(loss, argnums=(0, 1, 2, 3))(query, key, value, bias)
  np.testing.assert_array_equal(np.asarray(residual[0, 2]), np.float32(MASKED_LOGSUMEXP))


def test_mosaic_gpu_runs_under_debug_infs_with_fully_masked_rows():
  query, key, value = random_qkv(seed=4, batch=2, q_len=64, kv_len=64, num_heads=2,
                                 head_dim=64, dtype=jnp.bfloat16)
  blocks = BlockSizes(block_q=64, block_k=64, block_q_dkv=64, block_k_dkv=64)
  # Sequence 1 sees no key at all.
  fn = lambda q, k, v: pallas_mgpu.mgpu_dot_product_attention(
      q, k, v, block_sizes=blocks, key_value_seq_lengths=jnp.array([40, 0]), is_causal=True,
      return_residual=True)
  loss = lambda *a: _finite_loss(*fn(*a))
  with jax.debug_infs(True):
    out, residual = fn(query, key, value)
    jax.grad(loss, argnums=(0, 1, 2))(query, key, value)
  assert np.all(np.asarray(out[1], np.float32) == 0)
  assert np.all(np.isfinite(np.asarray(residual, np.float32)))


def test_bias_of_minus_infinity_still_gives_zero_rows_outside_debug_infs():
  """(A -inf bias is the caller's infinity: debug_infs rightly flags it, in jax.nn too.)"""
  query, key, value = random_qkv(batch=1, q_len=4, num_heads=2)
  bias = jnp.zeros((4, 4)).at[1].set(-jnp.inf)
  out, residual = attention_jax.dot_product_attention(query, key, value, bias,
                                                      return_residual=True)
  assert np.all(np.asarray(out[0, 1]) == 0)
  np.testing.assert_array_equal(np.asarray(residual[0, 1]), np.float32(MASKED_LOGSUMEXP))
