"""Linearised attention: linear (exact w.r.t. its quadratic form), performer and rfa
(random-feature estimates of softmax attention)."""

import functools
import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attention_jax
from attention_jax.core import reference_attention
from attention_jax.models import build_model, default_model_config
from attention_jax.variants import common, linear
from attention_testing import (as_float64, assert_close, assert_same_outputs_and_grads, jit_apply,
                               jit_call, jit_init, loop_mask, outputs_and_grads, random_qkv)

# This file's tolerance: float32 sums over whole sequences in a different order.
_assert_same = functools.partial(assert_same_outputs_and_grads, rtol=2e-5, atol=2e-5)

B, T, H = 2, 13, 4


def _phi(x):
  x = np.asarray(x, np.float64)
  return np.where(x > 0, x + 1.0, np.exp(x))  # elu(x) + 1, written out


def quadratic_linear_attention(query, key, value, allowed):
  """phi(Q) phi(K)^T, masked by `allowed` [B, 1, Tq, Tk], row-normalised, times V;
  built densely, with grouped K/V heads repeated."""
  group = query.shape[2] // key.shape[2]
  key = jnp.repeat(key, group, axis=2)
  value = jnp.repeat(value, group, axis=2)
  phi = lambda x: jnp.where(x > 0, x + 1.0, jnp.exp(jnp.minimum(x, 0.0)))
  kernel = jnp.einsum("bqhd,bkhd->bhqk", phi(query), phi(key),
                      precision=jax.lax.Precision.HIGHEST)
  kernel = jnp.where(jnp.asarray(allowed), kernel, 0.0)
  normaliser = kernel.sum(-1, keepdims=True)
  weights = kernel / jnp.where(normaliser == 0, 1.0, normaliser)
  return jnp.einsum("bhqk,bkhd->bqhd", weights, value, precision=jax.lax.Precision.HIGHEST)


def test_elu_feature_map_is_elu_plus_one():
  x = np.linspace(-3, 3, 13, dtype=np.float32)
  assert_close(linear.elu_feature_map(jnp.array(x)), _phi(x))


@pytest.mark.property("linear")
@pytest.mark.parametrize("num_kv_heads", [4, 2])
@pytest.mark.parametrize("kv_len", [13, 6])
def test_linear_non_causal_equals_its_quadratic_form(num_kv_heads, kv_len):
  query, key, value = random_qkv(batch=B, q_len=T, kv_len=kv_len, num_heads=H,
                                 num_kv_heads=num_kv_heads, value_dim=5)
  allowed = loop_mask(B, T, kv_len)
  _assert_same(lambda q, k, v: linear.linear_attention(q, k, v),
                 lambda q, k, v: quadratic_linear_attention(q, k, v, allowed),
                 query, key, value)


@pytest.mark.property("linear")
@pytest.mark.parametrize("chunk_size", [4, 13, 64])
def test_linear_causal_equals_the_masked_quadratic_form(chunk_size):
  # Chunks of 4 over 13 tokens: several chunks and a padded last one.
  query, key, value = random_qkv(seed=1, batch=B, q_len=T, num_heads=H, num_kv_heads=2,
                                 value_dim=5)
  allowed = loop_mask(B, T, T, is_causal=True)
  _assert_same(
      lambda q, k, v: jax.jit(lambda *a: linear.linear_attention(
          *a, is_causal=True, chunk_size=chunk_size))(q, k, v),
      lambda q, k, v: quadratic_linear_attention(q, k, v, allowed), query, key, value)


@pytest.mark.property("linear")
@pytest.mark.parametrize("is_causal", [False, True])
def test_linear_padding(is_causal):
  q_lengths, kv_lengths = np.array([9, 13]), np.array([9, 5])
  query, key, value = random_qkv(seed=2, batch=B, q_len=T, num_heads=H)
  fn = jax.jit(lambda k, v: linear.linear_attention(
      query, k, v, is_causal=is_causal, chunk_size=4, query_seq_lengths=jnp.array(q_lengths),
      key_value_seq_lengths=jnp.array(kv_lengths)))
  out = fn(key, value)
  # Padded keys' content does not matter.
  noise = jax.random.normal(jax.random.PRNGKey(3), key.shape) * 10
  padded = ~loop_mask(B, T, T, kv_lengths=kv_lengths)[:, 0, 0, :, None, None]
  assert_close(fn(jnp.where(padded, noise, key), jnp.where(padded, noise, value)), out)
  # Equal to the quadratic form under the padding mask; padded queries are zero.
  allowed = loop_mask(B, T, T, is_causal=is_causal, q_lengths=q_lengths, kv_lengths=kv_lengths)
  assert_close(out, jit_call(quadratic_linear_attention, query, key, value, allowed))
  assert np.all(np.asarray(out[0, 9:]) == 0)
  # A key-padding mask [B, 1, 1, Tk] is the same padding.
  key_mask = jnp.array(loop_mask(B, 1, T, kv_lengths=kv_lengths))
  by_mask = jit_call(linear.linear_attention, query, key, value, None, key_mask,
                     is_causal=is_causal, query_seq_lengths=jnp.array(q_lengths))
  assert_close(by_mask, out)


@pytest.mark.property("linear")
def test_linear_bfloat16_sums_over_a_long_sequence_in_float32():
  # The prefix sums over 8192 tokens ran in bfloat16 (its state carried in
  # bfloat16 from chunk to chunk): errors of ~0.08 on outputs near 1, twenty
  # times bfloat16's rounding of the output itself. Performer and rfa sum in float32.
  length = 8192
  query, key, value = (x.astype(jnp.bfloat16) for x in random_qkv(
      seed=21, batch=1, q_len=length, num_heads=1, head_dim=8))
  value = value + 1.0
  out = jit_call(linear.linear_attention, query, key, value, is_causal=True)
  assert out.dtype == jnp.bfloat16
  # The causal recurrence written out in float64: S_t = sum_{s <= t} phi(k_s) v_s^T.
  phi_q, phi_k = _phi(query[0, :, 0]), _phi(key[0, :, 0])
  v = as_float64(value[0, :, 0])
  numerator = np.einsum("tf,tfd->td", phi_q, np.cumsum(phi_k[:, :, None] * v[:, None, :], 0))
  expected = numerator / np.einsum("tf,tf->t", phi_q, np.cumsum(phi_k, 0))[:, None]
  # bfloat16's own rounding of outputs below 4 is at most 2^-7.
  assert np.abs(expected).max() < 4
  assert np.abs(as_float64(out[0, :, 0]) - expected).max() <= 2 ** -7 + 1e-4


@pytest.mark.parametrize("name", ["linear", "performer", "rfa"])
def test_refuses_what_it_cannot_do(name):
  query, key, value = random_qkv(batch=B, q_len=8, kv_len=6, num_heads=H)
  fn = attention_jax.get_variant(name).fn
  extra = {} if name == "linear" else {"projection": jnp.ones((4, 8))}
  with pytest.raises(ValueError, match="bias"):
    fn(query, key, value, jnp.zeros((1, H, 8, 6)), **extra)
  with pytest.raises(ValueError, match="segment_ids"):
    fn(query, key, value, segment_ids=jnp.zeros((B, 8), int), **extra)
  with pytest.raises(ValueError, match=r"key-padding mask of shape \[B\|1, 1, 1, Tk\]"):
    fn(query, key, value, None, jnp.ones((B, 1, 8, 6), bool), **extra)
  with pytest.raises(ValueError, match="is_causal needs Tq == Tk"):
    fn(query, key, value, is_causal=True, **extra)
  with pytest.raises(ValueError, match="chunk_size must be an int >= 1"):
    fn(query, query, query, is_causal=True, chunk_size=0, **extra)


def test_gaussian_projection_sizes_and_orthogonality():
  rng = jax.random.PRNGKey(0)
  w = np.asarray(linear.gaussian_projection(rng, 20, 8, orthogonal=True))
  assert w.shape == (20, 8)
  unit = w / np.linalg.norm(w, axis=1, keepdims=True)
  gram = unit[:8] @ unit[:8].T  # one block of D rows is orthogonal
  assert_close(gram, np.eye(8), atol=1e-5)
  with pytest.raises(ValueError, match="num_features must be an int >= 1"):
    linear.gaussian_projection(rng, 0, 8)


def test_orthogonal_blocks_are_factored_one_matrix_per_qr_call():
  """A batched QR on CPU blocks a thread of XLA's pool until its matrices are
  done; two in one program (two layers' redraws) hung a 2-core machine in 3 of
  3 runs of 200 steps. Every QR of the projection factors one [D, D] block,
  and the rows are those of the batched call's Q (Haar: R's diagonal > 0)."""
  import jax.extend  # pylint: disable=import-outside-toplevel
  qr_operands = []

  def visit(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == "qr":
        qr_operands.append(eqn.invars[0].aval.shape)
      for sub in jax.extend.core.jaxprs_in_params(eqn.params):
        visit(sub)

  rng = jax.random.PRNGKey(3)
  visit(jax.make_jaxpr(lambda r: linear.gaussian_projection(r, 40, 8))(rng).jaxpr)
  assert qr_operands == [(8, 8)]
  blocks = np.asarray(jax.random.normal(jax.random.split(rng)[0], (5, 8, 8)), np.float64)
  rows = np.asarray(linear.gaussian_projection(rng, 40, 8), np.float64)
  for i, block in enumerate(blocks):
    q, r = np.linalg.qr(block)
    q = q * np.sign(np.diag(r))
    unit = rows[8 * i:8 * (i + 1)] / np.linalg.norm(rows[8 * i:8 * (i + 1)], axis=1,
                                                      keepdims=True)
    assert_close(unit, q.T, atol=1e-5)


def _softmax_error(name, num_features, seed, is_causal, **options):
  query, key, value = random_qkv(seed=seed, batch=1, q_len=32, num_heads=2, head_dim=8)
  if name == "rfa":
    # The paper's setting: unit-norm q and k; here softmax(q^ . k^ * 2).
    unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)
    query, key, options = unit(query), unit(key), dict(options, scale=2.0)
    scale = 2.0
  else:
    # Positive features' variance grows like exp(|q + k|^2): moderate logits.
    query, key, scale = query * 0.5, key * 0.5, 8 ** -0.5
  projection = jit_call(linear.gaussian_projection, jax.random.PRNGKey(100 + seed), num_features,
                        8, orthogonal=options.pop("orthogonal", True))
  fn = attention_jax.get_variant(name).fn
  out = jit_call(fn, query, key, value, is_causal=is_causal, projection=projection, chunk_size=8,
                 **options)
  exact = jit_call(reference_attention, query, key, value, None,
                   jnp.array(loop_mask(1, 32, 32, is_causal=is_causal)), scale=scale)
  return float(jnp.sqrt(jnp.mean((out - exact) ** 2)))


@pytest.mark.property("performer")
@pytest.mark.property("rfa")
@pytest.mark.parametrize("name", ["performer", "rfa"])
@pytest.mark.parametrize("is_causal", [False, True])
def test_error_against_softmax_falls_as_features_grow(name, is_causal):
  errors = [np.mean([_softmax_error(name, m, seed, is_causal) for seed in range(6)])
            for m in (16, 64, 256)]
  assert errors[0] > errors[1] > errors[2], errors
  assert errors[2] < 0.5 * errors[0], errors


@pytest.mark.property("performer")
def test_orthogonal_features_beat_iid_on_average():
  errors = {orthogonal: np.mean([_softmax_error("performer", 16, seed, False,
                                                orthogonal=orthogonal) for seed in range(12)])
            for orthogonal in (True, False)}
  assert errors[True] < errors[False], errors


@pytest.mark.property("performer")
def test_positive_features_estimate_the_exponential_kernel_without_bias():
  rng = np.random.default_rng(0)
  q, k = (jnp.array(rng.normal(size=(8,)) * 0.4, jnp.float32) for _ in range(2))
  draws = 2000
  projections = jax.random.normal(jax.random.PRNGKey(1), (draws, 16, 8))
  estimate = jax.vmap(lambda w: jnp.sum(
      jnp.exp(linear.positive_feature_logits(q, w) + linear.positive_feature_logits(k, w))))(
          projections)
  assert np.all(np.asarray(estimate) > 0)  # positive features: positive estimates
  exact = float(jnp.exp(q @ k))
  assert abs(float(estimate.mean()) - exact) < 0.02 * exact


@pytest.mark.property("rfa")
def test_fourier_features_estimate_the_gaussian_kernel_without_bias():
  rng = np.random.default_rng(1)
  x, y = (jnp.array(rng.normal(size=(8,)) * 0.3, jnp.float32) for _ in range(2))
  projections = jax.random.normal(jax.random.PRNGKey(2), (2000, 16, 8))
  estimate = jax.vmap(lambda w: linear.random_fourier_features(x, w)
                      @ linear.random_fourier_features(y, w))(projections)
  exact = float(jnp.exp(-jnp.sum((x - y) ** 2) / 2))
  assert abs(float(estimate.mean()) - exact) < 0.02 * exact


def _performer_in_log_space(projection, is_causal):
  """Performer's attention from its kernel's logarithm: log sum_m phi_m(q) phi_m(k)
  as a logsumexp of feature logits, then a softmax over the keys; the same
  function as phi(Q) (phi(K)^T V) / normaliser, computed without exponentials
  that can underflow."""
  def attend(query, key, value):
    scaled_q, scaled_k = linear._scaled(query, key, None)
    q_logits = linear.positive_feature_logits(scaled_q, projection)  # [B, T, H, m]
    k_logits = linear.positive_feature_logits(scaled_k, projection)
    log_kernel = jax.nn.logsumexp(q_logits[:, :, None] + k_logits[:, None], axis=-1)
    if is_causal:
      length = query.shape[1]
      causal = jnp.tril(jnp.ones((length, length), bool))[None, :, :, None]
      log_kernel = jnp.where(causal, log_kernel, -jnp.inf)
    weights = jax.nn.softmax(log_kernel, axis=2)  # [B, t, s, H]
    return jnp.einsum("btsh,bshd->bthd", weights, value, precision=jax.lax.Precision.HIGHEST)
  return attend


@pytest.mark.property("performer")
@pytest.mark.parametrize("is_causal,chunk_size", [(True, 4), (True, 64), (False, 64)])
def test_performer_keys_far_apart_in_scale_keep_exact_outputs_and_finite_gradients(
    is_causal, chunk_size):
  # exp(w . k - |k|^2 / 2) falls with a key's norm: a key 8 times the others'
  # sits ~exp(-100) below them. Against one constant over the sequence, the
  # first query (which sees only that key) had a normaliser of ~1e-40: its
  # output came out 0 instead of v_0 and its gradient NaN (the recall table's
  # diverged performer runs).
  query, key, value = random_qkv(seed=3, batch=1, q_len=T, num_heads=2, head_dim=8)
  key = key.at[:, 0].multiply(8.0).at[:, 6].multiply(6.0)
  projection = jit_call(linear.gaussian_projection, jax.random.PRNGKey(4), 16, 8)
  ours = lambda q, k, v: linear.performer_attention(q, k, v, is_causal=is_causal,
                                                    projection=projection,
                                                    chunk_size=chunk_size)
  _, grads = outputs_and_grads(ours, query, key, value)
  assert all(np.isfinite(np.asarray(g)).all() for g in grads)
  if is_causal:
    assert_close(jax.jit(ours)(query, key, value)[:, 0], value[:, 0], rtol=1e-5, atol=1e-5)
  assert_same_outputs_and_grads(ours, _performer_in_log_space(projection, is_causal),
                                query, key, value, rtol=1e-4, atol=1e-4)


@pytest.mark.property("rfa")
@pytest.mark.parametrize("chunk_size", [4, 64])
def test_rfa_keys_far_apart_in_norm_keep_exact_outputs(chunk_size):
  # Unnormalised rfa weighs key s by exp(|k_s|^2 / 2): the same spread of scales.
  query, key, value = random_qkv(seed=5, batch=1, q_len=T, num_heads=2, head_dim=8)
  key = key.at[:, 0].multiply(0.2).at[:, 6].multiply(8.0)
  projection = linear.gaussian_projection(jax.random.PRNGKey(6), 64, 8)
  out = jit_call(linear.rfa_attention, query, key, value, is_causal=True,
                 projection=projection, normalize=False, chunk_size=chunk_size)
  scaled_q, scaled_k = (as_float64(x) * 8 ** -0.25 for x in (query, key))
  features = jax.jit(linear.random_fourier_features)
  phi = lambda x: as_float64(features(jnp.asarray(x, jnp.float32), projection))
  kernel = (np.einsum("bthf,bshf->bhts", phi(scaled_q), phi(scaled_k))
            * np.exp(0.5 * np.sum(scaled_k ** 2, -1)).transpose(0, 2, 1)[:, :, None, :])
  kernel = np.where(np.tril(np.ones((T, T), bool)), kernel, 0.0)
  expected = np.einsum("bhts,bshd->bthd", kernel / kernel.sum(-1, keepdims=True),
                       as_float64(value))
  assert np.isfinite(np.asarray(out)).all()
  assert_close(out, expected, rtol=1e-3, atol=1e-3)


def _unnormalised_rfa_by_formula(projection, is_causal):
  """phi(q) . phi(k) exp(|k|^2 / 2), masked, row-normalised, times V: the kernel
  exp(q . k) estimated by unnormalised rfa, written densely (q, k scaled by D^-1/4)."""
  def attend(query, key, value):
    scaled_q, scaled_k = (x * query.shape[-1] ** -0.25 for x in (query, key))
    phi = lambda x: linear.random_fourier_features(x, projection)
    kernel = (jnp.einsum("bthf,bshf->bhts", phi(scaled_q), phi(scaled_k),
                         precision=jax.lax.Precision.HIGHEST)
              * jnp.exp(0.5 * jnp.sum(scaled_k ** 2, -1)).transpose(0, 2, 1)[:, :, None, :])
    if is_causal:
      length = query.shape[1]
      kernel = jnp.where(jnp.tril(jnp.ones((length, length), bool)), kernel, 0.0)
    weights = kernel / kernel.sum(-1, keepdims=True)
    return jnp.einsum("bhts,bshd->bthd", weights, value, precision=jax.lax.Precision.HIGHEST)
  return attend


@pytest.mark.property("rfa")
@pytest.mark.parametrize("is_causal", [False, True])
def test_unnormalised_rfa_gradients_include_the_key_norm_factor(is_causal):
  # exp(|k|^2 / 2) is part of each key's kernel, not a constant that cancels:
  # passed only as a stop-gradient log-scale, the keys' gradients missed its
  # derivative (off by more than their own size).
  query, key, value = random_qkv(seed=11, batch=1, q_len=7, num_heads=2, head_dim=8)
  key = key * 0.5
  projection = linear.gaussian_projection(jax.random.PRNGKey(12), 64, 8, orthogonal=False)
  ours = lambda q, k, v: linear.rfa_attention(q, k, v, is_causal=is_causal,
                                              projection=projection, normalize=False)
  assert_same_outputs_and_grads(ours, _unnormalised_rfa_by_formula(projection, is_causal),
                                query, key, value, rtol=1e-4, atol=1e-4)


@pytest.mark.property("rfa")
def test_rfa_default_scale_is_the_one_its_option_documents():
  # The option's doc said "1/sqrt(D) when None"; with normalize (the default)
  # None is 1 (the paper's 1 / sigma^2 for unit vectors), 1/sqrt(D) only without.
  query, key, value = random_qkv(seed=15, batch=1, q_len=6, num_heads=2, head_dim=8)
  projection = linear.gaussian_projection(jax.random.PRNGKey(16), 16, 8)
  out = lambda **options: jit_call(linear.rfa_attention, query, key, value,
                                   projection=projection, **options)
  assert_close(out(), out(scale=1.0), rtol=1e-6, atol=1e-6)
  assert np.abs(np.asarray(out() - out(scale=8 ** -0.5))).max() > 1e-3
  assert_close(out(normalize=False), out(normalize=False, scale=8 ** -0.5), rtol=1e-6, atol=1e-6)
  doc = attention_jax.get_variant("rfa").options["scale"]
  assert "1 with normalize" in doc and "1/sqrt(D) without" in doc, doc


@pytest.mark.property("rfa")
@pytest.mark.parametrize("normalize", [True, False])
def test_rfa_gated_recurrence_equals_a_python_loop(normalize):
  query, key, value = random_qkv(seed=4, batch=B, q_len=11, num_heads=H, num_kv_heads=2,
                                 head_dim=8, value_dim=3)
  key_lengths = np.array([11, 7])
  projection = linear.gaussian_projection(jax.random.PRNGKey(5), 32, 8, orthogonal=False)
  gate_kernel = jax.random.normal(jax.random.PRNGKey(6), (2, 8))
  gate_bias = jnp.array([0.5, -0.5])
  out = jit_call(linear.rfa_attention, query, key, value, is_causal=True, projection=projection,
                 gate_kernel=gate_kernel, gate_bias=gate_bias, chunk_size=4,
                 normalize=normalize, scale=0.5 if normalize else 0.1,
                 key_value_seq_lengths=jnp.array(key_lengths))

  # The recurrence of the paper, token by token, in float64 numpy.
  q, k, v = (np.asarray(x, np.float64) for x in (query, key, value))
  w = np.asarray(projection, np.float64)
  s = 0.5 if normalize else 0.1
  expected = np.zeros(out.shape)
  for b in range(B):
    for h in range(H):
      kv_head = h // 2
      state, normaliser = np.zeros((64, 3)), np.zeros(64)
      for t in range(11):
        if t < key_lengths[b]:
          kt = k[b, t, kv_head]
          gate = 1 / (1 + np.exp(-(kt @ np.asarray(gate_kernel[kv_head]) + gate_bias[kv_head])))
          if normalize:
            kt = kt / np.linalg.norm(kt)
          kt = kt * np.sqrt(s)
          phi_k = np.concatenate([np.sin(w @ kt), np.cos(w @ kt)]) / np.sqrt(32)
          phi_k = phi_k * np.exp(kt @ kt / 2)  # exp(|k|^2/2): constant when normalised
          state = gate * state + (1 - gate) * np.outer(phi_k, v[b, t, kv_head])
          normaliser = gate * normaliser + (1 - gate) * phi_k
        qt = q[b, t, h] / (np.linalg.norm(q[b, t, h]) if normalize else 1.0) * np.sqrt(s)
        phi_q = np.concatenate([np.sin(w @ qt), np.cos(w @ qt)]) / np.sqrt(32)
        expected[b, t, h] = phi_q @ state / (phi_q @ normaliser)
  assert_close(out, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.property("performer")
@pytest.mark.property("rfa")
@pytest.mark.parametrize("name", ["performer", "rfa"])
@pytest.mark.parametrize("is_causal", [False, True])
def test_random_feature_padding(name, is_causal):
  kv_lengths, q_lengths = np.array([13, 6]), np.array([13, 10])
  query, key, value = random_qkv(seed=8, batch=B, q_len=T, num_heads=H, num_kv_heads=1)
  projection = linear.gaussian_projection(jax.random.PRNGKey(9), 16, 8)
  fn = jax.jit(lambda k, v: attention_jax.get_variant(name).fn(
      query, k, v, is_causal=is_causal, projection=projection, chunk_size=4,
      query_seq_lengths=jnp.array(q_lengths), key_value_seq_lengths=jnp.array(kv_lengths)))
  out = fn(key, value)
  noise = jax.random.normal(jax.random.PRNGKey(3), key.shape) * 3
  padded = ~loop_mask(B, 1, T, kv_lengths=kv_lengths)[:, 0, 0, :, None, None]
  assert_close(fn(jnp.where(padded, noise, key), jnp.where(padded, noise, value)), out,
               rtol=1e-4, atol=1e-5)
  assert np.all(np.asarray(out[1, 10:]) == 0) and np.any(np.asarray(out[1, :10]) != 0)


def _run_module(name, options, is_causal, rngs=None):
  x = jax.random.normal(jax.random.PRNGKey(1), (2, 24, 16))
  module = attention_jax.MultiHeadAttention(num_heads=2, num_kv_heads=1, attention=name,
                                            attention_options=options)
  variables = jit_init(module, jax.random.PRNGKey(0), x, is_causal=is_causal)
  apply = jax.jit(lambda variables, x, rngs: module.apply(variables, x, is_causal=is_causal,
                                                          rngs=rngs))
  return variables, apply(variables, x, rngs or {})


@pytest.mark.parametrize("name,options,is_causal", [
    ("linear", {"chunk_size": 8}, True),
    ("linear", {}, False),
    ("performer", {"num_features": 32}, True),
    ("rfa", {"num_features": 16, "orthogonal": True}, False),
    ("rfa", {"num_features": 16, "gated": True}, True),
])
def test_runs_through_multi_head_attention_under_jit(name, options, is_causal):
  variables, out = _run_module(name, options, is_causal)
  assert out.shape == (2, 24, 16) and np.isfinite(np.asarray(out)).all()
  has_gate = "gate_kernel" in variables["params"].get("variant", {})
  assert has_gate == bool(options.get("gated"))


def _layer_projections(random_collection):
  """{path: projection} of every layer's features in a "random" collection."""
  flat = flax.traverse_util.flatten_dict(flax.core.unfreeze(random_collection))
  return {path: np.asarray(value) for path, value in flat.items() if path[-1] == "projection"}


@pytest.mark.property("performer")
@pytest.mark.property("rfa")
@pytest.mark.parametrize("name", ["performer", "rfa"])
def test_each_layer_of_a_model_draws_its_own_features(name):
  config = default_model_config()
  config.update(dict(attention=name, attention_options={"num_features": 4}, vocab_size=11,
                     num_classes=2, num_layers=2, embed_dim=16, num_heads=2, mlp_dim=16,
                     max_length=8, dropout_rate=0.0))
  model = build_model(config)
  tokens = jnp.arange(16).reshape(2, 8) % 11
  variables = jit_init(model, jax.random.PRNGKey(0), tokens)
  projections = _layer_projections(variables[common.RANDOM_COLLECTION])
  assert len(projections) == 2, sorted(projections)
  first, second = projections.values()
  assert first.shape == second.shape == (4, 8)
  assert np.abs(first - second).max() > 0.1


def _attention_module(name, redraw_every):
  return attention_jax.MultiHeadAttention(
      num_heads=2, num_kv_heads=1, attention=name,
      attention_options={"num_features": 4, "redraw_every": redraw_every})


@pytest.mark.property("performer")
@pytest.mark.property("rfa")
@pytest.mark.parametrize("name", ["performer", "rfa"])
def test_features_are_redrawn_at_training_calls_0_n_2n_and_fixed_in_evaluation(name):
  module = _attention_module(name, redraw_every=2)
  x = jax.random.normal(jax.random.PRNGKey(1), (2, 6, 16))
  variables = jit_init(module, jax.random.PRNGKey(0), x)
  drawn = [_layer_projections(variables[common.RANDOM_COLLECTION])]
  outputs = []
  for step in range(5):  # as the trainer: the attention key is a function of the step
    out, updates = jit_apply(module, variables, x, deterministic=False,
                                rngs={"attention": jax.random.fold_in(jax.random.key(0), step)},
                                mutable=[common.RANDOM_COLLECTION])
    variables = {**variables, **updates}
    drawn.append(_layer_projections(variables[common.RANDOM_COLLECTION]))
    outputs.append(np.asarray(out))
  (path,) = drawn[0]
  changed = [not np.array_equal(drawn[i + 1][path], drawn[i][path]) for i in range(5)]
  assert changed == [True, False, True, False, True]
  # The output of a call used that call's draw: it changed exactly when the features did.
  assert [not np.array_equal(outputs[i], outputs[i - 1]) for i in range(1, 5)] == changed[1:]
  # Evaluation: the kept draw, the same in two calls, and the collection is left alone.
  evaluate = lambda: jit_apply(module, variables, x, deterministic=True,
                                  rngs={"attention": jax.random.key(9)},
                                  mutable=[common.RANDOM_COLLECTION])
  (first, kept), (second, _) = evaluate(), evaluate()
  np.testing.assert_array_equal(np.asarray(first), np.asarray(second))
  np.testing.assert_array_equal(_layer_projections(kept[common.RANDOM_COLLECTION])[path],
                                drawn[-1][path])
  # redraw_every=0: training never redraws.
  never = _attention_module(name, redraw_every=0)
  variables = jit_init(never, jax.random.PRNGKey(0), x)
  _, updates = jit_apply(never, variables, x, deterministic=False,
                           rngs={"attention": jax.random.key(3)}, mutable=[common.RANDOM_COLLECTION])
  np.testing.assert_array_equal(_layer_projections(updates[common.RANDOM_COLLECTION])[path],
                                _layer_projections(variables[common.RANDOM_COLLECTION])[path])


def test_performer_relu_kernel_draws_no_features():
  module = attention_jax.MultiHeadAttention(num_heads=2, attention="performer",
                                            attention_options={"kernel": "relu"})
  variables = jit_init(module, jax.random.PRNGKey(0), jnp.ones((1, 6, 16)))
  assert common.RANDOM_COLLECTION not in variables
  assert "variant" not in variables["params"]


def test_gates_need_causal():
  query, key, value = random_qkv(batch=1, q_len=4, num_heads=2)
  with pytest.raises(ValueError, match="is_causal=True"):
    linear.rfa_attention(query, key, value, projection=jnp.ones((4, 8)),
                         gate_kernel=jnp.ones((2, 8)), gate_bias=jnp.ones((2,)))


def _decode_in_pieces(layer, params, random, x, pieces):
  """The decoding layer fed `x` in consecutive pieces of the given lengths."""
  variables = {"params": params, **random}
  cache = jit_init(layer, jax.random.PRNGKey(0), x)["cache"]
  outputs = []
  start = 0
  for length in pieces:
    out, mutated = jit_apply(layer, {**variables, "cache": cache}, x[:, start:start + length],
                               mutable=["cache"])
    cache, start = mutated["cache"], start + length
    outputs.append(out)
  return jnp.concatenate(outputs, axis=1), cache


@pytest.mark.property("linear")
@pytest.mark.property("performer")
@pytest.mark.property("rfa")
@pytest.mark.parametrize("name,options", [
    ("linear", {}), ("linear", {"epsilon": 1e-6}), ("performer", {}),
    ("performer", {"kernel": "relu", "kernel_epsilon": 1e-3, "scale": 1.0}),
    ("rfa", {}), ("rfa", {"gated": True, "normalize": False})])
@pytest.mark.parametrize("num_kv_heads", [H, 2])
def test_decoding_from_the_recurrent_state_equals_the_causal_pass(name, options, num_kv_heads):
  x = jax.random.normal(jax.random.PRNGKey(1), (B, T, 16))
  full = attention_jax.MultiHeadAttention(num_heads=H, num_kv_heads=num_kv_heads,
                                          attention=name, attention_options=options,
                                          position="rope")
  variables = jit_init(full, jax.random.PRNGKey(2), x, is_causal=True)
  params = jax.tree.map(lambda p: p + 0.1, nn.meta.unbox(variables["params"]))
  random = {k: v for k, v in variables.items() if k not in ("params", "cache")}
  expected = jit_apply(full, {"params": params, **random}, x, is_causal=True)
  # A prompt of 5 in one call, then one token at a time, then 3 at once.
  pieces = [5] + [1] * (T - 8) + [3]
  decoded, cache = _decode_in_pieces(full.clone(decode=True), params, random, x, pieces)
  assert_close(decoded, expected, rtol=1e-4, atol=1e-4)
  # The state is the same size whatever the length: no keys or values kept.
  assert "cached_key" not in cache and int(cache["cache_index"]) == T
  assert all(T not in leaf.shape[1:] for leaf in jax.tree.leaves(cache["recurrent_state"]))


def test_performer_with_the_reference_stabiliser_refuses_to_decode():
  x = jnp.ones((1, 4, 16))
  layer = attention_jax.MultiHeadAttention(num_heads=H, attention="performer", decode=True,
                                           attention_options={"numerical_stabilizer": 1e-6})
  with pytest.raises(ValueError, match="numerical_stabilizer=1e-06 cannot decode"):
    jit_init(layer, jax.random.PRNGKey(0), x)


@pytest.mark.parametrize("is_causal", [False, True])
def test_performer_reference_stabiliser_is_refused_in_causal_attention(is_causal):
  # Its key constant is the largest projection over every key: with it, a later
  # key changed earlier queries' outputs (by ~0.9 for a key of norm 10).
  query, key, value = random_qkv(seed=13, batch=1, q_len=8, num_heads=1, head_dim=4)
  projection = linear.gaussian_projection(jax.random.PRNGKey(14), 2, 4)
  attend = jax.jit(lambda k: linear.performer_attention(query, k, value, is_causal=is_causal,
                                                        projection=projection,
                                                        numerical_stabilizer=1e-6))
  if is_causal:
    with pytest.raises(ValueError, match="numerical_stabilizer=1e-06 with is_causal"):
      attend(key)
  else:  # all keys are every query's: nothing to leak
    assert np.isfinite(np.asarray(attend(key))).all()


@pytest.mark.parametrize("name", ["performer", "rfa"])
@pytest.mark.parametrize("scale", [0.0, -0.5])
def test_random_features_refuse_a_scale_that_is_not_positive(name, scale):
  # q and k are multiplied by sqrt(scale): 0 gave uniform weights without a word,
  # a negative scale a bare "math domain error".
  query, key, value = random_qkv(seed=17, batch=1, q_len=4, num_heads=1, head_dim=8)
  projection = linear.gaussian_projection(jax.random.PRNGKey(18), 8, 8)
  fn = attention_jax.get_variant(name).fn
  with pytest.raises(ValueError, match=f"scale must be a float > 0 .*got {scale}"):
    fn(query, key, value, projection=projection, scale=scale)
