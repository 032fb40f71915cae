"""Prior family, section E of issue #17: the Gaussian Transformer's distance prior,
hard-coded Gaussian attention and the Average Attention Network."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attention_jax
from attention_jax.layers.attention import MultiHeadAttention, attention_weights
from attention_jax.variants.prior.average import (AverageAttention, average_attention,
                                                  average_attention_step, initial_average_state)
from attention_jax.variants.prior.biases import gaussian_transformer_attention
from attention_jax.variants.prior.hard_coded import hard_coded_gaussian_attention
from attention_testing import (B, H, Q_LENGTHS, Q_SEGMENTS, TK, TQ, VARIANT_MASK_CASES, as_float64,
                               assert_close, assert_same_outputs_and_grads, jit_apply, jit_call,
                               jit_init, largest_intermediate, loop_mask, perturbed, random_qkv)

MASK_CASES = VARIANT_MASK_CASES


def np_masked_attention(logits, allowed, value, num_heads):
  """softmax over the allowed keys, rows with none give zeros: logits [B, H, Tq, Tk],
  allowed [B, 1, Tq, Tk], value [B, Tk, Hkv, Dv] -> [B, Tq, H, Dv] float64."""
  logits = np.where(allowed, as_float64(logits), -np.inf)
  row_max = np.max(logits, -1, keepdims=True)
  weights = np.exp(logits - np.where(np.isfinite(row_max), row_max, 0.0))
  total = weights.sum(-1, keepdims=True)
  weights = weights / np.where(total == 0, 1.0, total)
  value = np.repeat(as_float64(value), num_heads // value.shape[2], axis=2)
  return np.einsum("bhqk,bkhd->bqhd", weights, value)


# ----------------------------------------------------------------------------------
# gaussian_transformer


@pytest.mark.property("gaussian_transformer")
@pytest.mark.parametrize("case", ["plain", "everything"])
def test_gaussian_transformer_with_zero_prior_is_dot_product_attention(case):
  query, key, value = random_qkv(seed=1, batch=B, q_len=TQ, kv_len=TK, num_heads=H,
                                 num_kv_heads=2)
  kwargs = MASK_CASES[case][0]
  zeros = jnp.zeros((H,))
  ours = lambda q, k, v: gaussian_transformer_attention(
      q, k, v, distance_weight=zeros, distance_bias=zeros, **kwargs)
  theirs = lambda q, k, v: attention_jax.dot_product_attention(q, k, v, **kwargs)
  rows = None if "query_seq_lengths" not in kwargs else (
      np.arange(TQ)[None, :] < Q_LENGTHS[:, None])
  assert_same_outputs_and_grads(ours, theirs, query, key, value, rows=rows)


@pytest.mark.property("gaussian_transformer")
@pytest.mark.parametrize("case", sorted(MASK_CASES))
def test_gaussian_transformer_against_numpy(case):
  query, key, value = random_qkv(seed=2, batch=B, q_len=TQ, kv_len=TK, num_heads=H,
                                 num_kv_heads=2)
  rng = np.random.default_rng(0)
  weight = rng.normal(size=H).astype(np.float32)
  offset = rng.normal(size=H).astype(np.float32) * 3
  kwargs, mask_args = MASK_CASES[case]
  out = gaussian_transformer_attention(query, key, value, distance_weight=weight,
                                       distance_bias=offset, **kwargs)
  scores = np.einsum("bqhd,bkhd->bhqk", as_float64(query),
                     np.repeat(as_float64(key), 2, axis=2)) / np.sqrt(query.shape[-1])
  distance = np.arange(TQ)[:, None] - np.arange(TK)[None, :]
  prior_bias = -np.abs(weight[:, None, None] * distance[None] ** 2 + offset[:, None, None])
  allowed = loop_mask(B, TQ, TK, **mask_args)
  want = np_masked_attention(scores + prior_bias[None], allowed, value, H)
  assert_close(out, want, rtol=1e-4, atol=1e-5)


@pytest.mark.property("gaussian_transformer")
def test_gaussian_transformer_prior_follows_query_positions():
  """While decoding, query i sits at its absolute position: the prior is that of
  the full sequence's row."""
  query, key, value = random_qkv(seed=3, batch=1, q_len=TK, num_heads=H)
  weight, offset = jnp.full((H,), 0.3), jnp.full((H,), -1.0)
  full = jit_call(gaussian_transformer_attention, query, key, value, distance_weight=weight,
                  distance_bias=offset)
  last = jit_call(gaussian_transformer_attention, query[:, -1:], key, value,
                  distance_weight=weight, distance_bias=offset,
                  query_positions=jnp.array([TK - 1]))
  assert_close(last, full[:, -1:])


@pytest.mark.property("gaussian_transformer")
@pytest.mark.parametrize("name,shape", [("distance_weight", (H + 1,)),
                                        ("distance_bias", (1, H))])
def test_gaussian_transformer_rejects_bad_shapes(name, shape):
  query, key, value = random_qkv(num_heads=H)
  arrays = dict(distance_weight=jnp.zeros((H,)), distance_bias=jnp.zeros((H,)))
  arrays[name] = jnp.zeros(shape)
  with pytest.raises(ValueError, match=name):
    gaussian_transformer_attention(query, key, value, **arrays)
  with pytest.raises(ValueError, match="query_positions"):
    gaussian_transformer_attention(query, key, value, distance_weight=jnp.zeros((H,)),
                                   distance_bias=jnp.zeros((H,)),
                                   query_positions=jnp.arange(3))


# ----------------------------------------------------------------------------------
# hard_coded_gaussian


def np_hard_coded_gaussian(value, num_heads, allowed, *, offset, sigma, window):
  """numpy weights exp(-(j - i - offset)^2 / 2 sigma^2) over the allowed keys
  (within `window` of the centre unless None); returns (out, weights [B, H, Tq, Tk])."""
  q_len, kv_len = allowed.shape[2:]
  distance = np.arange(kv_len)[None, :] - np.arange(q_len)[:, None] - offset
  allowed = allowed if window is None else allowed & (np.abs(distance) <= window)
  logits = np.broadcast_to(-distance ** 2 / (2.0 * sigma ** 2),
                           (allowed.shape[0], num_heads, q_len, kv_len))
  weights = np.exp(logits) * allowed
  total = weights.sum(-1, keepdims=True)
  weights = weights / np.where(total == 0, 1.0, total)
  out = np.einsum("bhqk,bkhd->bqhd", weights,
                  np.repeat(as_float64(value), num_heads // value.shape[2], axis=2))
  return out, weights


@pytest.mark.property("hard_coded_gaussian")
@pytest.mark.parametrize("case", sorted(MASK_CASES))
@pytest.mark.parametrize("offset,sigma,window", [(0, 1.0, None), (-1, 1.5, None), (0, 1.0, 2),
                                                 (1, 2.0, 1), (-1, 1.0, 3), (2, 1.0, 0)])
def test_hard_coded_gaussian_against_numpy(case, offset, sigma, window):
  """Windowed or not, against the formula truncated to the window, under every
  mask; the weights over the allowed keys sum to one (zero where none is allowed)."""
  length = TQ  # self-attention: the windowed band needs Tq == Tk
  _, _, value = random_qkv(seed=4, batch=B, q_len=length, num_heads=H, num_kv_heads=2)
  shape_only = jax.ShapeDtypeStruct((B, length, H, 8), jnp.float32)
  kwargs, mask_args = MASK_CASES[case]
  kwargs = dict(kwargs)
  mask_args = dict(mask_args)
  if "key_value_seq_lengths" in kwargs:
    kwargs["key_value_seq_lengths"] = jnp.array([3, 7])
    mask_args["kv_lengths"] = np.array([3, 7])
  if "segment_ids" in kwargs:
    kwargs["segment_ids"] = jnp.array(Q_SEGMENTS)
    mask_args["kv_segments"] = Q_SEGMENTS
  attend = jax.jit(lambda v: hard_coded_gaussian_attention(
      shape_only, shape_only, v, offset=offset, sigma=sigma, window=window, **kwargs))
  out = attend(value)
  allowed = loop_mask(B, length, length, **mask_args)
  want, weights = np_hard_coded_gaussian(value, H, allowed, offset=offset, sigma=sigma,
                                         window=window)
  assert_close(out, want, rtol=1e-5, atol=1e-6)
  # The weights themselves, read off one-hot values: rows sum to 1 over the allowed keys.
  got_weights = attention_weights(attend, jnp.zeros((B, length, 2, 1)))
  assert_close(got_weights, weights, atol=1e-6)
  sums = np.asarray(got_weights).sum(-1)
  sees_something = (weights > 0).any(-1)
  assert_close(sums[sees_something], 1.0)
  assert_close(sums[~sees_something], 0.0)


@pytest.mark.property("hard_coded_gaussian")
def test_hard_coded_gaussian_window_covering_the_support_equals_the_untruncated():
  _, _, value = random_qkv(seed=5, batch=1, q_len=40, num_heads=2)
  shape_only = jax.ShapeDtypeStruct((1, 40, 2, 8), jnp.float32)
  full = jit_call(hard_coded_gaussian_attention, shape_only, shape_only, value, window=None)
  banded = jit_call(hard_coded_gaussian_attention, shape_only, shape_only, value, window=8)
  assert_close(banded, full, atol=1e-6)


@pytest.mark.property("hard_coded_gaussian")
def test_hard_coded_gaussian_makes_no_query_or_key_projection():
  layer = MultiHeadAttention(num_heads=2, attention="hard_coded_gaussian")
  x = jax.random.normal(jax.random.PRNGKey(0), (1, 16, 8))
  params = jit_init(layer, jax.random.PRNGKey(1), x)["params"]
  assert "query" not in params and "key" not in params and "value" in params


@pytest.mark.property("hard_coded_gaussian")
@pytest.mark.parametrize("options,match", [(dict(offset=0.5), "offset"),
                                           (dict(sigma=0.0), "sigma"),
                                           (dict(window=-1), "window")])
def test_hard_coded_gaussian_rejects_bad_options(options, match):
  _, _, value = random_qkv(batch=1, num_heads=2)
  shape_only = jax.ShapeDtypeStruct((1, value.shape[1], 2, 8), jnp.float32)
  with pytest.raises(ValueError, match=match):
    hard_coded_gaussian_attention(shape_only, shape_only, value, **options)
  with pytest.raises(ValueError, match="bias"):
    hard_coded_gaussian_attention(shape_only, shape_only, value,
                                  bias=jnp.zeros((1, 1, value.shape[1], value.shape[1])))


# ----------------------------------------------------------------------------------
# average


def _average_layer(features=8, mlp_dim=16, seed=0):
  """An AverageAttention layer and random (not default-initialised) parameters."""
  layer = AverageAttention(mlp_dim=mlp_dim)
  x = jnp.zeros((1, 3, features))
  params = perturbed(jit_init(layer, jax.random.PRNGKey(seed), x)["params"])
  return layer, params


def np_average_layer(x, params, valid=None, is_causal=True):
  """The AAN's equations written out in numpy, position by position."""
  p = {k: as_float64(v) for k, v in params.items()}
  x = as_float64(x)
  batch, length, features = x.shape
  valid = np.ones((batch, length), bool) if valid is None else np.asarray(valid)
  out = np.zeros_like(x)
  sigmoid = lambda z: 1.0 / (1.0 + np.exp(-z))
  for b in range(batch):
    for t in range(length):
      upto = range(t + 1) if is_causal else range(length)
      seen = [x[b, k] for k in upto if valid[b, k]]
      average = np.mean(seen, axis=0) if seen else np.zeros(features)
      g = np.maximum(average @ p["ffn_in_kernel"] + p["ffn_in_bias"], 0) @ p["ffn_out_kernel"]
      g = g + p["ffn_out_bias"]
      gates = sigmoid(np.concatenate([x[b, t], g]) @ p["gate_kernel"] + p["gate_bias"])
      out[b, t] = gates[:features] * x[b, t] + gates[features:] * g
  return out


@pytest.mark.property("average")
@pytest.mark.parametrize("is_causal", [True, False])
@pytest.mark.parametrize("padded", [False, True])
def test_average_layer_against_numpy(is_causal, padded):
  """Cumulative (or whole-sequence) average over the valid tokens, FFN and gates, by formula."""
  layer, params = _average_layer()
  x = jax.random.normal(jax.random.PRNGKey(1), (2, 7, 8))
  lengths = np.array([4, 7])
  kwargs = dict(key_value_seq_lengths=jnp.array(lengths)) if padded else {}
  out = jit_apply(layer, {"params": params}, x, is_causal=is_causal, **kwargs)
  valid = np.arange(7)[None, :] < lengths[:, None] if padded else None
  assert_close(out, np_average_layer(x, params, valid, is_causal), rtol=1e-4, atol=1e-5)


@pytest.mark.property("average")
def test_average_cumulative_average_and_gates_by_formula():
  """Parameters that expose one piece at a time: an FFN that passes its input
  through and gates (i, f) = (0, 1) leave the cumulative average a_t itself;
  gates of 1/2 give (x_t + a_t) / 2."""
  features, hidden = 4, 4
  x = jax.random.normal(jax.random.PRNGKey(2), (1, 6, features))
  # relu(a W_1 + b_1) W_2 + b_2 with W_1 = I, b_1 = 10 (relu passes), W_2 = I, b_2 = -10: a_t.
  # Gates: a huge negative input-gate bias and positive forget-gate bias: out = g = a_t.
  arrays = dict(ffn_in_kernel=jnp.eye(features), ffn_in_bias=jnp.full((hidden,), 10.0),
                ffn_out_kernel=jnp.eye(features), ffn_out_bias=jnp.full((features,), -10.0),
                gate_kernel=jnp.zeros((2 * features, 2 * features)),
                gate_bias=jnp.concatenate([jnp.full((features,), -50.0),
                                           jnp.full((features,), 50.0)]))
  out = jit_call(average_attention, x, **arrays)
  cumulative = np.cumsum(np.asarray(x), axis=1) / np.arange(1, 7)[None, :, None]
  assert_close(out, cumulative, atol=1e-4)
  # The gates alone: sigmoid(b_g) halves (b_g = 0) mix x and g equally.
  arrays["gate_bias"] = jnp.zeros((2 * features,))
  out = jit_call(average_attention, x, **arrays)
  assert_close(out, 0.5 * np.asarray(x) + 0.5 * cumulative, atol=1e-4)


@pytest.mark.property("average")
def test_average_incremental_decoding_equals_the_full_pass():
  layer, params = _average_layer(seed=3)
  x = jax.random.normal(jax.random.PRNGKey(4), (2, 9, 8))
  full = jit_apply(layer, {"params": params}, x, is_causal=True)
  state = initial_average_state(2, 8)
  outs = []

  @jax.jit
  def step(state, t):
    """One decoding step, on token t of x."""
    return average_attention_step(state, x[:, t], **params)

  for t in range(x.shape[1]):
    state, out_t = step(state, t)
    outs.append(out_t)
  assert_close(jnp.stack(outs, axis=1), full, rtol=1e-5, atol=1e-5)
  assert [a.shape for a in state] == [(2, 8), (2,)]  # O(1) in T
  # A prompt in one call, then one token at a time, continues the same state.
  state, prompt_out = jit_call(average_attention_step, initial_average_state(2, 8), x[:, :4],
                               **params)
  state, out_t = step(state, 4)
  assert_close(jnp.concatenate([prompt_out, out_t[:, None]], axis=1), full[:, :5], rtol=1e-5,
               atol=1e-5)


@pytest.mark.property("average")
def test_average_is_linear_in_length():
  """No T x T array at T = 4096, through the pure function and its gradient."""
  layer, params = _average_layer()
  length = 4096
  loss = lambda p, x: jnp.sum(jit_apply(layer, {"params": p}, x, is_causal=True) ** 2)
  largest = largest_intermediate(jax.grad(loss, argnums=(0, 1)), params,
                                 jnp.zeros((1, length, 8)))
  assert largest < 64 * length


@pytest.mark.property("average")
def test_average_rejects_bad_arguments():
  layer, params = _average_layer()
  x = jnp.zeros((1, 5, 8))
  bad = dict(params, gate_kernel=jnp.zeros((8, 16)))
  with pytest.raises(ValueError, match="gate_kernel"):
    average_attention(x, **bad)
  with pytest.raises(ValueError, match="valid"):
    average_attention(x, valid=jnp.ones((1, 4), bool), **params)
  with pytest.raises(ValueError, match="segment_ids"):
    jit_apply(layer, {"params": params}, x, segment_ids=jnp.zeros((1, 5), jnp.int32))
  with pytest.raises(ValueError, match="x_t"):
    average_attention_step(initial_average_state(1, 8), jnp.zeros((1, 4)), **params)
  # An additive mask (0 real, -1e9 padded) read as bool would average the padding only.
  additive = jnp.asarray([0.0, 0.0, 0.0, -1e9, -1e9])[None, None, None, :]
  with pytest.raises(ValueError, match=r"mask must be boolean \(True may attend\), got dtype "
                                       r"float32"):
    jit_apply(layer, {"params": params}, x, mask=additive)


# ----------------------------------------------------------------------------------
# The Gaussian priors on the flex engine: the prior as a score_mod, against the
# dense form (the reference), outputs and gradients of every array, the learned
# ones included (they reach the kernel as arrays its score_mod closes over).


@pytest.mark.property("gaussian_transformer")
@pytest.mark.property("gaussian_local")
@pytest.mark.parametrize("implementation", ["blockwise", "xla"])
def test_gaussian_priors_on_flex_equal_their_dense_form(implementation):
  from attention_jax.variants.prior.biases import gaussian_local_attention
  query, key, value = random_qkv(batch=2, q_len=21, num_heads=4, num_kv_heads=2, head_dim=8)
  masks = dict(is_causal=True, key_value_seq_lengths=jnp.asarray([21, 13]),
               segment_ids=jnp.asarray(np.arange(21)[None].repeat(2, 0) // 15))
  weight, offset = jnp.asarray([0.1, 0.2, 0.05, 0.3]), jnp.asarray([0.0, -1.0, 0.5, 0.0])
  transformer = lambda impl: lambda q, k, v, w, b: gaussian_transformer_attention(
      q, k, v, distance_weight=w, distance_bias=b, query_positions=jnp.arange(21) + 3,
      implementation=impl, **masks)
  assert_same_outputs_and_grads(transformer(implementation), transformer(None), query, key,
                                value, weight, offset, rtol=1e-4, atol=1e-5)
  keys = jax.random.split(jax.random.PRNGKey(5), 3)
  # Windows of a few positions: a window far below one position makes the
  # softmax one-hot and the gradients 1/sigma^2 times float32 rounding, in
  # either form (flash's delta = rowsum(dO * O) is not exactly the dense one).
  predictor = (0.3 * jax.random.normal(keys[0], (4, 8, 8)),
               0.3 * jax.random.normal(keys[1], (4, 8)), 0.3 * jax.random.normal(keys[2], (4, 8)))
  local = lambda impl: lambda q, k, v, p, c, w: gaussian_local_attention(
      q, k, v, position_kernel=p, center_vector=c, window_vector=w, implementation=impl,
      **masks)
  assert_same_outputs_and_grads(local(implementation), local(None), query, key, value,
                                *predictor, rtol=1e-4, atol=1e-4)


def test_gaussian_priors_on_flex_refuse_dropout_by_name():
  query, key, value = random_qkv(q_len=9)
  with pytest.raises(ValueError, match=r"gaussian_transformer: dropout on the attention weights "
                                       r"runs on implementation=None"):
    gaussian_transformer_attention(query, key, value, distance_weight=jnp.ones(4),
                                   distance_bias=jnp.zeros(4), implementation="blockwise",
                                   dropout_rate=0.1, dropout_rng=jax.random.PRNGKey(0))


@pytest.mark.property("hard_coded_gaussian")
@pytest.mark.parametrize("offset,sigma,window", [(0, 1.0, None), (-1, 1.5, 2), (2, 1.0, 0)])
def test_hard_coded_gaussian_on_flex_equals_its_reference_form(offset, sigma, window):
  length = 21
  _, _, value = random_qkv(seed=4, batch=2, q_len=length, num_heads=4, num_kv_heads=2)
  shape_only = jax.ShapeDtypeStruct((2, length, 4, 8), jnp.float32)
  masks = dict(is_causal=True, key_value_seq_lengths=jnp.asarray([21, 9]),
               segment_ids=jnp.asarray(np.arange(length)[None].repeat(2, 0) // 12))
  attend = lambda implementation: lambda v: hard_coded_gaussian_attention(
      shape_only, shape_only, v, offset=offset, sigma=sigma, window=window,
      implementation=implementation, **masks)
  assert_same_outputs_and_grads(attend("blockwise"), attend(None), value, rtol=1e-5, atol=1e-6)
