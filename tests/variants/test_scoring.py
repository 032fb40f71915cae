"""The scoring functions (Bahdanau's additive score, Luong's dot, general and
concat scores) against scores written out in numpy, and their masks."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attention_jax
from attention_jax.variants import scoring
from attention_testing import (assert_close, assert_same_outputs_and_grads, jit_apply, jit_call,
                               jit_init, random_qkv)


def _np(x):
  return np.asarray(x, np.float64)


def _np_attention(scores, value, allowed):
  """softmax over the allowed keys of scores [B, H, Tq, Tk], applied to value [B, Tk, H, Dv]."""
  scores = np.where(allowed, scores, -np.inf)
  weights = np.exp(scores - scores.max(-1, keepdims=True))
  weights = weights / weights.sum(-1, keepdims=True)
  return np.einsum("bhqk,bkhv->bqhv", weights, _np(value)), weights


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4))
def _params(seed, heads, q_dim, k_dim, width):
  """Random query/key kernels, score vector and score kernel, drawn as one program."""
  keys = jax.random.split(jax.random.PRNGKey(seed), 4)
  return dict(query_kernel=jax.random.normal(keys[0], (heads, q_dim, width)) * 0.5,
              key_kernel=jax.random.normal(keys[1], (heads, k_dim, width)) * 0.5,
              score_vector=jax.random.normal(keys[2], (heads, width)),
              score_kernel=jax.random.normal(keys[3], (heads, q_dim, k_dim)) * 0.3)


@pytest.mark.property("additive")
def test_additive_is_bahdanau_with_queries_and_keys_of_different_sizes():
  batch, q_len, kv_len, heads, q_dim, k_dim, width = 2, 5, 6, 2, 3, 7, 4
  keys = jax.random.split(jax.random.PRNGKey(1), 3)
  query = jax.random.normal(keys[0], (batch, q_len, heads, q_dim))
  key = jax.random.normal(keys[1], (batch, kv_len, heads, k_dim))
  value = jax.random.normal(keys[2], (batch, kv_len, heads, 5))
  p = _params(0, heads, q_dim, k_dim, width)
  lengths = np.array([6, 2])
  got = jit_call(scoring.additive_attention, query, key, value, query_kernel=p["query_kernel"],
                 key_kernel=p["key_kernel"], score_vector=p["score_vector"],
                 key_value_seq_lengths=jnp.asarray(lengths))
  wq = np.einsum("bqhd,hda->bhqa", _np(query), _np(p["query_kernel"]))
  wk = np.einsum("bkhd,hda->bhka", _np(key), _np(p["key_kernel"]))
  scores = np.einsum("bhqka,ha->bhqk", np.tanh(wq[:, :, :, None] + wk[:, :, None]),
                     _np(p["score_vector"]))
  allowed = (np.arange(kv_len)[None, :] < lengths[:, None])[:, None, None, :]
  expected, weights = _np_attention(scores, value, allowed)
  assert_close(got, expected, rtol=1e-5, atol=1e-5)
  assert np.all(weights[1, ..., 2:] == 0)  # padded keys get weight 0
  assert_close(weights.sum(-1), np.ones(weights.shape[:-1]))


@pytest.mark.property("luong_concat")
def test_luong_concat_is_the_additive_score_of_the_concatenation():
  query, key, value = random_qkv(seed=2, num_heads=2, head_dim=4)
  p = _params(1, 2, 4, 4, 6)
  concat_kernel = jnp.concatenate([p["query_kernel"], p["key_kernel"]], axis=1)
  got = jit_call(scoring.luong_concat_attention, query, key, value, concat_kernel=concat_kernel,
                 score_vector=p["score_vector"], is_causal=True)
  hidden = np.tanh(np.einsum("bqhd,hda->bhqa", _np(query), _np(p["query_kernel"]))[:, :, :, None]
                   + np.einsum("bkhd,hda->bhka", _np(key), _np(p["key_kernel"]))[:, :, None])
  scores = np.einsum("bhqka,ha->bhqk", hidden, _np(p["score_vector"]))
  causal = np.tril(np.ones((query.shape[1], key.shape[1]), bool))[None, None]
  assert_close(got, _np_attention(scores, value, causal)[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parity("luong_dot")
@pytest.mark.parametrize("kwargs", [{}, dict(is_causal=True),
                                    dict(key_value_seq_lengths=jnp.array([3, 7]))])
def test_luong_dot_is_unscaled_dot_product_attention(kwargs):
  query, key, value = random_qkv(seed=3, num_heads=2, head_dim=8)
  ours = lambda q, k, v: scoring.luong_dot_attention(q, k, v, **kwargs)
  dense = lambda q, k, v: attention_jax.dot_product_attention(q, k, v, scale=1.0,
                                                              implementation="xla", **kwargs)
  assert_same_outputs_and_grads(ours, dense, query, key, value, rtol=1e-4, atol=1e-5)


@pytest.mark.property("luong_general")
def test_luong_general_is_q_w_k_and_with_the_identity_is_luong_dot():
  query, key, value = random_qkv(seed=4, num_heads=2, head_dim=5)
  p = _params(2, 2, 5, 5, 1)
  got = jit_call(scoring.luong_general_attention, query, key, value,
                 score_kernel=p["score_kernel"])
  scores = np.einsum("bqhd,hde,bkhe->bhqk", _np(query), _np(p["score_kernel"]), _np(key))
  assert_close(got, _np_attention(scores, value, True)[0], rtol=1e-5, atol=1e-5)
  identity = jnp.broadcast_to(jnp.eye(5), (2, 5, 5))
  assert_close(jit_call(scoring.luong_general_attention, query, key, value,
                        score_kernel=identity),
               jit_call(scoring.luong_dot_attention, query, key, value), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["additive", "luong_dot", "luong_general", "luong_concat",
                                  "luong_local", "nadaraya_watson", "structured_crf", "graph"])
def test_the_layer_honours_padding_and_runs_under_jit(name):
  layer = attention_jax.MultiHeadAttention(num_heads=2, attention=name)
  x = jax.random.normal(jax.random.PRNGKey(0), (2, 9, 16))
  variables = jit_init(layer, jax.random.PRNGKey(1), x)
  apply = jax.jit(lambda v, x: layer.apply(v, x, key_value_seq_lengths=jnp.array([9, 4])))
  out = apply(variables, x)
  # What the padded keys (4..8 of sequence 1) hold changes nothing.
  out_changed = apply(variables, x.at[1, 4:].set(7.0))
  assert_close(out[1, :4], out_changed[1, :4], rtol=1e-5, atol=1e-5)
  # A valid key does change the output (the test can fail).
  assert not np.allclose(out[1, :4], apply(variables, x.at[1, 2].set(7.0))[1, :4])


@pytest.mark.parametrize("fn, arguments, message", [
    (scoring.additive_attention, dict(query_kernel=jnp.zeros((2, 3, 4)),
                                      key_kernel=jnp.zeros((2, 8, 4)),
                                      score_vector=jnp.zeros((2, 4))),
     r"query_kernel must have shape \[2, 8, \*\], got \[2, 3, 4\]"),
    (scoring.additive_attention, dict(query_kernel=jnp.zeros((2, 8, 4)),
                                      key_kernel=jnp.zeros((2, 8, 5)),
                                      score_vector=jnp.zeros((2, 4))),
     r"key_kernel must have shape \[2, 8, 4\]"),
    (scoring.luong_general_attention, dict(score_kernel=jnp.zeros((2, 8, 7))),
     r"score_kernel must have shape \[2, 8, 8\]"),
    (scoring.luong_concat_attention, dict(concat_kernel=jnp.zeros((2, 8, 4)),
                                          score_vector=jnp.zeros((2, 4))),
     r"concat_kernel must have shape \[2, 16, \*\]"),
    (scoring.luong_dot_attention, dict(key_value_seq_lengths=jnp.array([1, 2, 3])),
     "key_value_seq_lengths"),
])
def test_bad_sizes_name_the_argument(fn, arguments, message):
  query, key, value = random_qkv(num_heads=2, head_dim=8)
  with pytest.raises(ValueError, match=message):
    fn(query, key, value, **arguments)


def test_luong_dot_refuses_keys_of_another_size():
  query, _, value = random_qkv(num_heads=2, head_dim=8)
  key = jnp.zeros(query.shape[:3] + (4,))
  with pytest.raises(ValueError, match="query dim 8 and key dim 4"):
    scoring.luong_dot_attention(query, key, value)


# ---------------------------------------------------------------------------- luong_local


def _np_local(scores, value, centre, window, allowed, sigma=None):
  """Luong's local weights in numpy: the softmax over the keys within `window`
  of `centre` [B, H, Tq]; with `sigma` (local-p, eq. 10) times the Gaussian
  there, not renormalised; without (local-m, eq. 7) the window softmax alone."""
  distance = np.arange(scores.shape[-1])[None, None, None, :] - centre[..., None]
  with np.errstate(invalid="ignore"):  # rows with no key in their window
    _, weights = _np_attention(scores, value, allowed & (np.abs(distance) <= window))
  weights = np.nan_to_num(weights)
  if sigma is not None:
    weights = weights * np.exp(-distance ** 2 / (2 * sigma ** 2))
  return np.einsum("bhqk,bkhv->bqhv", weights, _np(value)), weights


@pytest.mark.property("luong_local")
@pytest.mark.parametrize("mode", ["monotonic", "predictive"])
def test_luong_local_with_an_infinite_window_and_flat_gaussian_is_global_attention(mode):
  query, key, value = random_qkv(seed=8, num_heads=2, head_dim=4, kv_len=9)
  p = _params(3, 2, 4, 4, 3)
  kwargs = dict(key_value_seq_lengths=jnp.array([9, 5]))
  flat = dict(sigma=float("inf")) if mode == "predictive" else {}  # local-m has no Gaussian
  local = lambda q, k, v: scoring.luong_local_attention(
      q, k, v, mode=mode, window=10**6, score="dot", **flat,
      position_kernel=p["query_kernel"], position_vector=p["score_vector"], **kwargs)
  global_ = lambda q, k, v: scoring.luong_dot_attention(q, k, v, **kwargs)
  assert_same_outputs_and_grads(local, global_, query, key, value, rtol=1e-4, atol=1e-5)


@pytest.mark.property("luong_local")
def test_luong_local_monotonic_is_the_plain_softmax_over_the_window():
  """local-m (Luong et al. 2015, eq. 7): p_t = t and the weights are the
  softmax over the keys in [p_t - D, p_t + D]; the Gaussian of eq. 10 is
  local-p's alone, so each row with a key in its window sums to 1."""
  query, key, value = random_qkv(seed=9, num_heads=2, head_dim=4, q_len=6, kv_len=11)
  p = _params(4, 2, 4, 4, 1)
  positions = jnp.array([[0, 2, 4, 6, 8, 10], [1, 1, 3, 3, 9, 9]])
  lengths = np.array([11, 7])
  got = jit_call(scoring.luong_local_attention, query, key, value, mode="monotonic", window=2,
                 score_kernel=p["score_kernel"], query_positions=positions,
                 key_value_seq_lengths=jnp.asarray(lengths))
  scores = np.einsum("bqhd,hde,bkhe->bhqk", _np(query), _np(p["score_kernel"]), _np(key))
  allowed = (np.arange(11)[None, :] < lengths[:, None])[:, None, None, :]
  centre = np.broadcast_to(np.asarray(positions, np.float64)[:, None], (2, 2, 6))
  expected, weights = _np_local(scores, value, centre, window=2, allowed=allowed)
  assert_close(got, expected, rtol=1e-5, atol=1e-5)
  # The same as dense attention under the window mask: no other factor.
  window_mask = (np.abs(np.arange(11)[None, None, :] - np.asarray(positions)[:, :, None]) <= 2)
  dense = jit_call(
      attention_jax.dot_product_attention,
      jnp.einsum("bqhd,hde->bqhe", query, p["score_kernel"]), key, value, scale=1.0,
      mask=jnp.asarray(window_mask)[:, None], key_value_seq_lengths=jnp.asarray(lengths),
      implementation="xla")
  assert_close(got, dense, rtol=1e-5, atol=1e-5)
  # Row 1's queries at 9 see only keys 7..11, all padding: no weight, output 0.
  assert np.all(weights[1, :, 4:] == 0) and np.all(np.asarray(got)[1, 4:] == 0)
  # Every other row is a distribution over its window.
  assert_close(weights[0].sum(-1), np.ones((2, 6)))
  assert_close(weights[1, :, :4].sum(-1), np.ones((2, 4)))


@pytest.mark.property("luong_local")
def test_luong_local_predictive_centres_at_s_sigmoid_of_the_query():
  query, key, value = random_qkv(seed=10, num_heads=2, head_dim=4, q_len=5, kv_len=12)
  p = _params(5, 2, 4, 4, 3)
  lengths = np.array([12, 8])
  got = jit_call(
      scoring.luong_local_attention, query, key, value, window=3, sigma=1.5, score="dot",
      position_kernel=p["query_kernel"],
      position_vector=p["score_vector"], key_value_seq_lengths=jnp.asarray(lengths))
  hidden = np.tanh(np.einsum("bqhd,hda->bhqa", _np(query), _np(p["query_kernel"])))
  logits = np.einsum("bhqa,ha->bhq", hidden, _np(p["score_vector"]))
  centre = lengths[:, None, None] / (1 + np.exp(-logits))  # S sigmoid(v^T tanh(W_p h))
  scores = np.einsum("bqhd,bkhd->bhqk", _np(query), _np(key))
  allowed = (np.arange(12)[None, :] < lengths[:, None])[:, None, None, :]
  expected, weights = _np_local(scores, value, centre, window=3, allowed=allowed, sigma=1.5)
  assert_close(got, expected, rtol=1e-4, atol=1e-5)
  assert np.all(weights[1, ..., 8:] == 0)  # padded keys get weight 0
  # local-p keeps eq. 10's Gaussian (not renormalised): without it the
  # output would be the window softmax alone, which it is not.
  assert np.all(weights.sum(-1) < 1.0)
  assert not np.allclose(got, _np_local(scores, value, centre, window=3, allowed=allowed)[0],
                         atol=1e-3)


def test_luong_local_layer_places_decoded_queries_at_their_positions():
  """While decoding one token at a time, local-m's p_t is the token's position
  (the cache offset), so the last step equals the full pass's last row."""
  layer = attention_jax.MultiHeadAttention(
      num_heads=2, attention="luong_local", attention_options=dict(mode="monotonic", window=2))
  x = jax.random.normal(jax.random.PRNGKey(0), (1, 6, 8))
  variables = jit_init(layer, jax.random.PRNGKey(1), x)
  full = jit_apply(layer, variables, x, is_causal=True)
  decoder = attention_jax.MultiHeadAttention(
      num_heads=2, attention="luong_local", decode=True,
      attention_options=dict(mode="monotonic", window=2))
  cache = jit_init(decoder, jax.random.PRNGKey(1), x)["cache"]
  for t in range(6):
    out, updated = jit_apply(decoder, {"params": variables["params"], "cache": cache}, x[:, t:t + 1],
                                 mutable=["cache"])
    cache = updated["cache"]
    assert_close(out[:, 0], full[:, t], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("options, message", [
    (dict(mode="local-x"), "mode must be one of"),
    (dict(score="concat"), "score must be one of"),
    (dict(window=-1, mode="monotonic", score="dot"), "window"),
    (dict(sigma=0.0, score="dot"), "sigma must be > 0"),
    (dict(sigma=1.0, mode="monotonic", score="dot"),
     r"sigma is local-p's Gaussian width; mode='monotonic' .* got sigma=1.0"),
    (dict(score="dot"), "mode='predictive' needs position_kernel"),
    (dict(mode="monotonic"), "score='general' needs score_kernel"),
    (dict(mode="monotonic", score="dot", query_positions=jnp.zeros((3,))),
     r"query_positions must be \[Tq\] or \[B, Tq\] = \[7\] or \[2, 7\], got \[3\]"),
    (dict(score="dot", position_kernel=jnp.zeros((2, 8, 3)), position_vector=jnp.zeros((2, 4))),
     r"position_vector must have shape \[2, 3\], got \[2, 4\]"),
    # A non-boolean mask is refused as dot_product_attention refuses it, not
    # cast to bool by the window's logical_and (0.3 would let every key in).
    (dict(mode="monotonic", score="dot", mask=jnp.full((7,), 0.3)),
     r"mask must be boolean \(True may attend\), got dtype float32"),
    (dict(score="dot", position_kernel=jnp.zeros((2, 8, 3)), position_vector=jnp.zeros((2, 3)),
          mask=jnp.ones((2, 1, 1, 7), jnp.int32)),
     r"mask must be boolean \(True may attend\), got dtype int32"),
])
def test_luong_local_rejects_bad_arguments(options, message):
  query, key, value = random_qkv(num_heads=2, head_dim=8)
  with pytest.raises(ValueError, match=message):
    scoring.luong_local_attention(query, key, value, **options)


# ---------------------------------------------------------------------------- nadaraya_watson


@pytest.mark.property("nadaraya_watson")
@pytest.mark.parametrize("width", [0.5, 2.0])
def test_nadaraya_watson_gaussian_is_the_closed_form(width):
  query, key, value = random_qkv(seed=6, num_heads=2, head_dim=3, kv_len=9)
  lengths = np.array([9, 4])
  got = jit_call(scoring.nadaraya_watson_attention, query, key, value, width=width,
                 key_value_seq_lengths=jnp.asarray(lengths))
  q, k, v = _np(query), _np(key), _np(value)
  kernel = np.exp(-((q[:, :, None] - k[:, None]) ** 2).sum(-1) / (2 * width ** 2))  # [B,Tq,Tk,H]
  kernel = kernel * (np.arange(k.shape[1])[None, :] < lengths[:, None])[:, None, :, None]
  expected = np.einsum("bqkh,bkhv->bqhv", kernel, v) / kernel.sum(2)[..., None]
  assert_close(got, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.property("nadaraya_watson")
def test_nadaraya_watson_average_is_the_mean_of_the_allowed_values():
  query, key, value = random_qkv(seed=7, num_heads=2, head_dim=4)
  got = scoring.nadaraya_watson_attention(query, key, value, kernel="average", is_causal=True)
  v = _np(value)
  expected = np.cumsum(v, axis=1)[:, :query.shape[1]] / np.arange(1, query.shape[1] + 1)[
      None, :, None, None]
  assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.property("nadaraya_watson")
def test_nadaraya_watson_learned_width_starts_at_the_width_and_is_trained():
  layer = attention_jax.MultiHeadAttention(
      num_heads=2, attention="nadaraya_watson",
      attention_options=dict(learn_width=True, width=1.5))
  fixed = attention_jax.MultiHeadAttention(num_heads=2, attention="nadaraya_watson",
                                           attention_options=dict(width=1.5))
  x = jax.random.normal(jax.random.PRNGKey(0), (2, 6, 8))
  variables = jit_init(layer, jax.random.PRNGKey(1), x)
  params = variables["params"]
  without = {name: p for name, p in params.items() if name != "variant"}
  assert_close(jit_apply(layer, variables, x), jit_apply(fixed, {"params": without}, x))
  grads = jax.grad(lambda p: jnp.sum(jnp.sin(jit_apply(layer, {"params": p}, x))))(params)
  assert float(jnp.max(jnp.abs(grads["variant"]["log_width"]))) > 0.0
  wider = jax.tree.map(lambda p: p, params)
  wider["variant"]["log_width"] = jnp.log(jnp.array([1.0, 3.0]))  # head 1 three times wider
  out_wider = jit_apply(layer, {"params": wider}, x)
  assert not np.allclose(out_wider, jit_apply(layer, variables, x))


@pytest.mark.parametrize("options, message", [
    (dict(kernel="epanechnikov"), "kernel must be one of"),
    (dict(width=0.0), "width must be > 0, got 0.0"),
    (dict(log_width=jnp.zeros((3,))), r"log_width must have shape \[2\], got \[3\]"),
])
def test_nadaraya_watson_rejects_bad_arguments(options, message):
  query, key, value = random_qkv(num_heads=2, head_dim=4)
  with pytest.raises(ValueError, match=message):
    scoring.nadaraya_watson_attention(query, key, value, **options)
