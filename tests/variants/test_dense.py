"""dot_product_attention against the dense reference (with loop-built masks) and jax.nn."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attention_jax
from attention_jax.core import reference_attention
from attention_testing import assert_close, loop_mask, random_qkv

B, TQ, TK, H = 2, 7, 9, 4
Q_LENGTHS = np.array([5, 7])
KV_LENGTHS = np.array([3, 9])
Q_SEGMENTS = np.array([[1, 1, 1, 2, 2, 2, 2], [1, 1, 1, 1, 1, 1, 3]])
KV_SEGMENTS = np.array([[1, 1, 2, 2, 2, 2, 2, 0, 0], [1, 1, 1, 1, 2, 2, 2, 2, 2]])

# name -> (keyword arguments of dot_product_attention, arguments of loop_mask, supported by jax.nn)
CASES = {
    "plain": ({}, {}, True),
    "causal": (dict(is_causal=True), dict(is_causal=True), True),
    "window": (dict(local_window_size=2), dict(window=2), True),
    "window_pair": (dict(local_window_size=(3, 0)), dict(window=(3, 0)), True),
    "causal_window": (dict(is_causal=True, local_window_size=(2, 2)),
                      dict(is_causal=True, window=(2, 2)), True),
    "q_lengths": (dict(query_seq_lengths=jnp.array(Q_LENGTHS)), dict(q_lengths=Q_LENGTHS), True),
    "kv_lengths": (dict(key_value_seq_lengths=jnp.array(KV_LENGTHS)),
                   dict(kv_lengths=KV_LENGTHS), True),
    "segments": (dict(segment_ids=(jnp.array(Q_SEGMENTS), jnp.array(KV_SEGMENTS))),
                 dict(q_segments=Q_SEGMENTS, kv_segments=KV_SEGMENTS), False),
    "everything": (dict(is_causal=True, local_window_size=(4, 1),
                        key_value_seq_lengths=jnp.array(KV_LENGTHS),
                        segment_ids=(jnp.array(Q_SEGMENTS), jnp.array(KV_SEGMENTS))),
                   dict(is_causal=True, window=(4, 1), kv_lengths=KV_LENGTHS,
                        q_segments=Q_SEGMENTS, kv_segments=KV_SEGMENTS), False),
}
HEAD_LAYOUTS = {"mha": 4, "gqa": 2, "mqa": 1}


def _bias_and_mask(seed):
  rng = np.random.default_rng(seed)
  bias = jnp.array(rng.normal(size=(1, H, TQ, TK)), jnp.float32)
  mask = jnp.array(rng.random((B, 1, TQ, TK)) > 0.2)
  return bias, mask


def _grads(fn, query, key, value, bias):
  """Gradients of a fixed random projection of the output w.r.t. q, k, v and bias."""
  cotangent = jax.random.normal(jax.random.PRNGKey(42), fn(query, key, value, bias).shape)
  loss = lambda *args: jnp.sum(fn(*args).astype(jnp.float32) * cotangent)
  return jax.grad(loss, argnums=(0, 1, 2, 3))(query, key, value, bias)


@pytest.mark.parity("dot_product")
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("heads", sorted(HEAD_LAYOUTS))
@pytest.mark.parametrize("with_bias_and_mask", [False, True])
def test_matches_reference_outputs_and_gradients(case, heads, with_bias_and_mask):
  kwargs, mask_args, _ = CASES[case]
  query, key, value = random_qkv(batch=B, q_len=TQ, kv_len=TK, num_heads=H,
                                 num_kv_heads=HEAD_LAYOUTS[heads], value_dim=5)
  allowed = loop_mask(B, TQ, TK, **mask_args)
  bias, extra_mask = _bias_and_mask(seed=1)
  if with_bias_and_mask:
    allowed = allowed & np.asarray(extra_mask)
  else:
    bias, extra_mask = jnp.zeros_like(bias), None

  ours = lambda q, k, v, b: attention_jax.dot_product_attention(
      q, k, v, b, extra_mask, scale=0.3, **kwargs)
  oracle = lambda q, k, v, b: reference_attention(q, k, v, b, jnp.array(allowed), scale=0.3)

  assert_close(jax.jit(ours)(query, key, value, bias), oracle(query, key, value, bias))
  for name, got, want in zip("qkvb", _grads(ours, query, key, value, bias),
                             _grads(oracle, query, key, value, bias)):
    assert_close(got, want, err_msg=f"gradient of {name}")


@pytest.mark.parity("dot_product")
@pytest.mark.parametrize("case", sorted(c for c in CASES if CASES[c][2]))
def test_matches_jax_nn_on_attended_rows(case):
  kwargs, mask_args, _ = CASES[case]
  query, key, value = random_qkv(batch=B, q_len=TQ, kv_len=TK, num_heads=H, num_kv_heads=2)
  bias, mask = _bias_and_mask(seed=2)
  ours = attention_jax.dot_product_attention(query, key, value, bias, mask, **kwargs)
  theirs = jax.nn.dot_product_attention(query, key, value, bias, mask, **kwargs)
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

  (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(
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
  out = attention_jax.dot_product_attention(query, key, value, jnp.array(bias))
  assert np.all(np.asarray(out)[0, 1] == 0)
  assert np.all(np.isfinite(np.asarray(out)))


def test_bfloat16_close_to_float32_reference():
  query, key, value = random_qkv(batch=B, q_len=16, num_heads=H, num_kv_heads=2, head_dim=32)
  as_bf16 = [x.astype(jnp.bfloat16) for x in (query, key, value)]
  out = attention_jax.dot_product_attention(*as_bf16, is_causal=True)
  assert out.dtype == jnp.bfloat16
  causal = jnp.tril(jnp.ones((16, 16), bool))[None, None]
  assert_close(out, reference_attention(*as_bf16, mask=causal), rtol=2e-2, atol=2e-2)


def test_unbatched_rank3_inputs_match_batched():
  query, key, value = random_qkv(batch=1, q_len=5, num_heads=2)
  batched = attention_jax.dot_product_attention(query, key, value, is_causal=True)
  unbatched = attention_jax.dot_product_attention(query[0], key[0], value[0], is_causal=True)
  assert unbatched.shape == batched.shape[1:]
  assert_close(unbatched, batched[0])


def test_self_attention_segment_ids_array_equals_separate_attention_per_segment():
  query, key, value = random_qkv(batch=1, q_len=6, num_heads=2)
  segment_ids = jnp.array([[0, 0, 0, 1, 1, 1]])
  packed = attention_jax.dot_product_attention(query, key, value, segment_ids=segment_ids,
                                               is_causal=True)
  first = attention_jax.dot_product_attention(query[:, :3], key[:, :3], value[:, :3],
                                              is_causal=True)
  assert_close(packed[:, :3], first)


def test_dropout_keeps_expectation_and_is_seeded():
  query, key, value = random_qkv(batch=1, q_len=4, num_heads=1, head_dim=4)
  clean = attention_jax.dot_product_attention(query, key, value)
  run = lambda rng: attention_jax.dot_product_attention(query, key, value, dropout_rate=0.5,
                                                        dropout_rng=rng)
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
    (dict(bias=jnp.zeros((2, 4, 7, 5))), r"bias must have rank 4 and broadcast to \[B, H, Tq, Tk\] = \[2, 4, 7, 7\].*\[2, 4, 7, 5\]"),
    (dict(bias=jnp.zeros((7, 7))), r"bias must have rank 4.*got shape \[7, 7\]"),
    (dict(mask=jnp.ones((2, 3, 7, 7), bool)), r"mask must have rank 4.*\[2, 3, 7, 7\]"),
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
