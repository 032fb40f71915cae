"""dot_product_attention against the dense reference (with loop-built masks) and jax.nn."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attention_jax
from attention_jax.core import reference_attention
from attention_testing import (B, H, MASK_CASES, TK, TQ, assert_close, bias_and_mask,
                               check_against_reference, jit_call, loop_mask, random_qkv)


@pytest.mark.parity("dot_product")
@pytest.mark.parametrize("case", sorted(MASK_CASES))
@pytest.mark.parametrize("num_kv_heads", [4, 2, 1])
@pytest.mark.parametrize("with_bias_and_mask", [False, True])
def test_matches_reference_outputs_and_gradients(case, num_kv_heads, with_bias_and_mask):
  check_against_reference(attention_jax.dot_product_attention, case, num_kv_heads,
                          with_bias_and_mask)


@pytest.mark.parity("dot_product")
@pytest.mark.parametrize("case", sorted(c for c in MASK_CASES if MASK_CASES[c][2]))
def test_matches_jax_nn_on_attended_rows(case):
  kwargs, mask_args, _ = MASK_CASES[case]
  query, key, value = random_qkv(batch=B, q_len=TQ, kv_len=TK, num_heads=H, num_kv_heads=2)
  bias, mask = bias_and_mask(seed=2)
  ours = jit_call(attention_jax.dot_product_attention, query, key, value, bias, mask, **kwargs)
  theirs = jit_call(jax.nn.dot_product_attention, query, key, value, bias, mask, **kwargs)
  # jax.nn gives rows with nothing to attend an arbitrary (non-zero) value; compare the rest.
  attended = (loop_mask(B, TQ, TK, **mask_args) & np.asarray(mask)).any(-1)[:, 0]  # [B, Tq]
  assert attended.sum() > B * TQ // 2
  assert_close(np.asarray(ours)[attended], np.asarray(theirs)[attended])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_fully_masked_rows_are_zero_with_zero_gradients(dtype):
  query, key, value = random_qkv(batch=B, q_len=TQ, kv_len=TK, num_heads=H, dtype=dtype)
  mask = np.ones((B, 1, TQ, TK), bool)
  mask[0, :, 2] = False  # query 2 of sequence 0 sees nothing
  mask[1, :, :, :] = False  # sequence 1 sees nothing at all
  bias = jnp.zeros((1, H, TQ, TK), dtype)

  def loss(q, k, v, b):
    out = attention_jax.dot_product_attention(q, k, v, b, jnp.array(mask))
    return jnp.sum(out.astype(jnp.float32) ** 2), out

  (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(
      query, key, value, bias)
  assert out.dtype == dtype
  assert np.all(np.isfinite(np.asarray(out, np.float32)))
  assert np.all(np.asarray(out[0, 2], np.float32) == 0)
  assert np.all(np.asarray(out[1], np.float32) == 0)
  assert np.any(np.asarray(out[0, 3], np.float32) != 0)
  dq, dk, dv, db = (np.asarray(g, np.float32) for g in grads)
  for g in (dq, dk, dv, db):
    assert np.all(np.isfinite(g))
  assert np.all(dq[0, 2] == 0) and np.all(dq[1] == 0)
  assert np.all(dk[1] == 0) and np.all(dv[1] == 0)
  assert np.all(db[0, :, 2] == 0)


def test_bias_of_minus_infinity_on_a_whole_row_gives_zeros_not_nan():
  query, key, value = random_qkv(batch=1, q_len=4, num_heads=2)
  bias = np.zeros((1, 2, 4, 4), np.float32)
  bias[..., 1, :] = -np.inf
  out = jit_call(attention_jax.dot_product_attention, query, key, value, jnp.array(bias))
  assert np.all(np.asarray(out)[0, 1] == 0)
  assert np.all(np.isfinite(np.asarray(out)))


def test_bfloat16_close_to_float32_reference():
  query, key, value = random_qkv(batch=B, q_len=16, num_heads=H, num_kv_heads=2, head_dim=32)
  as_bf16 = [x.astype(jnp.bfloat16) for x in (query, key, value)]
  out = jit_call(attention_jax.dot_product_attention, *as_bf16, is_causal=True)
  assert out.dtype == jnp.bfloat16
  causal = jnp.tril(jnp.ones((16, 16), bool))[None, None]
  assert_close(out, jit_call(reference_attention, *as_bf16, mask=causal), rtol=2e-2, atol=2e-2)


def test_unbatched_rank3_inputs_match_batched():
  query, key, value = random_qkv(batch=1, q_len=5, num_heads=2)
  batched = jit_call(attention_jax.dot_product_attention, query, key, value, is_causal=True)
  unbatched = jit_call(attention_jax.dot_product_attention, query[0], key[0], value[0],
                       is_causal=True)
  assert unbatched.shape == batched.shape[1:]
  assert_close(unbatched, batched[0])


def test_self_attention_segment_ids_array_equals_separate_attention_per_segment():
  query, key, value = random_qkv(batch=1, q_len=6, num_heads=2)
  segment_ids = jnp.array([[0, 0, 0, 1, 1, 1]])
  packed = jit_call(attention_jax.dot_product_attention, query, key, value,
                    segment_ids=segment_ids, is_causal=True)
  first = jit_call(attention_jax.dot_product_attention, query[:, :3], key[:, :3], value[:, :3],
                   is_causal=True)
  assert_close(packed[:, :3], first)


def test_dropout_keeps_expectation_and_is_seeded():
  query, key, value = random_qkv(batch=1, q_len=4, num_heads=1, head_dim=4)
  clean = jit_call(attention_jax.dot_product_attention, query, key, value)
  run = jax.jit(lambda rng: attention_jax.dot_product_attention(query, key, value, dropout_rate=0.5,
                                                                dropout_rng=rng))
  rng = jax.random.PRNGKey(3)
  assert_close(run(rng), run(rng), rtol=0, atol=0)
  assert not np.allclose(run(rng), clean)
  mean = jnp.mean(jax.vmap(run)(jax.random.split(rng, 4000)), axis=0)
  assert_close(mean, clean, atol=0.1, rtol=0)


BAD_INPUTS = {
    "rank": (dict(query=(2, 7, 4, 8, 1)), "query must have rank 4"),
    "key_rank": (dict(key=(2, 7, 4, 8, 1)), "key must have the rank of query"),
    "heads_divide": (dict(key=(2, 7, 3, 8), value=(2, 7, 3, 8)), r"multiple of the number of key/value heads \(3\)"),
    "head_dim": (dict(key=(2, 7, 4, 6)), "key head dim must equal query head dim 8"),
    "kv_length": (dict(value=(2, 6, 4, 8)), "key and value must have the same length"),
    "value_heads": (dict(value=(2, 7, 2, 8)), "same number of heads"),
    "batch": (dict(key=(3, 7, 4, 8), value=(3, 7, 4, 8)), "batch size"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_shapes_raise_value_errors_naming_the_argument(case):
  shapes, message = BAD_INPUTS[case]
  full = dict(query=(2, 7, 4, 8), key=(2, 7, 4, 8), value=(2, 7, 4, 8))
  full.update(shapes)
  args = [jnp.zeros(full[name]) for name in ("query", "key", "value")]
  with pytest.raises(ValueError, match=message):
    attention_jax.dot_product_attention(*args)


@pytest.mark.parametrize("kwargs, message", [
    (dict(bias=jnp.zeros((2, 4, 7, 5))), r"bias must broadcast to \[B, H, Tq, Tk\] = \[2, 4, 7, 7\].*got shape \[2, 4, 7, 5\]"),
    (dict(bias=jnp.zeros((7, 5))), r"bias must broadcast to \[B, H, Tq, Tk\].*leading 1s.*got shape \[7, 5\]"),
    (dict(bias=jnp.zeros((1, 2, 4, 7, 7))), r"bias must have rank at most 4.*got shape \[1, 2, 4, 7, 7\]"),
    (dict(mask=jnp.ones((2, 3, 7, 7), bool)), r"mask must broadcast to \[B, H, Tq, Tk\].*got shape \[2, 3, 7, 7\]"),
    (dict(mask=jnp.ones((6,), bool)), r"mask must broadcast to \[B, H, Tq, Tk\] = \[2, 4, 7, 7\].*got shape \[6\]"),
    (dict(mask=jnp.ones((1, 1, 7, 7))), "mask must be boolean"),
    (dict(query_seq_lengths=jnp.array([3, 8])), r"query_seq_lengths must lie in \[0, 7\], got values in \[3, 8\]"),
    (dict(key_value_seq_lengths=jnp.array([-1, 2])), r"key_value_seq_lengths must lie in \[0, 7\]"),
    (dict(key_value_seq_lengths=jnp.array([2, 2, 2])), r"key_value_seq_lengths must be an integer array of shape \[B\]"),
    (dict(key_value_seq_lengths=jnp.array([2.0, 2.0])), "key_value_seq_lengths must be an integer"),
    (dict(segment_ids=jnp.zeros((2, 6), jnp.int32)), r"segment_ids \(query side\) must have shape \[B, T\] = \[2, 7\]"),
    (dict(segment_ids=(jnp.zeros((2, 7)), jnp.zeros((2, 6)))), r"segment_ids \(key/value side\)"),
    (dict(local_window_size=(1, 2, 3)), "local_window_size must be an int or a pair"),
    (dict(local_window_size=-1), "local_window_size must be non-negative"),
    (dict(implementation="magic"), r"implementation must be one of \[.*'xla'.*got 'magic'"),
])
def test_bad_arguments_raise_value_errors(kwargs, message):
  query, key, value = random_qkv(batch=2, q_len=7, num_heads=4)
  with pytest.raises(ValueError, match=message):
    attention_jax.dot_product_attention(query, key, value, **kwargs)


def test_cudnn_runs_on_gpu_and_is_refused_elsewhere():
  query, key, value = random_qkv(batch=1, q_len=16, num_heads=2, head_dim=64, dtype=jnp.bfloat16)
  if jax.default_backend() == "gpu":
    out = attention_jax.dot_product_attention(query, key, value, implementation="cudnn")
    assert_close(out, reference_attention(query, key, value), rtol=2e-2, atol=2e-2)
  else:
    with pytest.raises(ValueError, match="'cudnn' is not available on backend"):
      attention_jax.dot_product_attention(query, key, value, implementation="cudnn")
