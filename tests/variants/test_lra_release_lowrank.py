"""The `lra_release` presets of linformer, synthesizer_dense, performer and linear
against numpy re-creations written from the LRA release's code
(google-research/long-range-arena, lra_benchmarks/models/...), and their
options per task as the release's configs set them."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attention_jax
from attention_jax import registry
from attention_jax.variants import common, linear, low_rank
from attention_testing import (as_float64 as _np, np_project_heads as _np_project,
                               np_project_out as _np_out, np_softmax as _np_softmax)
from attention_testing import (assert_close, jit_apply, jit_call, jit_init, random_qkv)

TASKS = ("listops", "text", "retrieval", "image", "pathfinder32", "pathx")


def _release_layer(name, task, length, **extra):
  """MultiHeadAttention running preset lra_release of row `name` on `task`."""
  variant = registry.preset_variant(name, "lra_release")
  options = dict(registry.preset_options(name, "lra_release", task), **extra)
  return attention_jax.MultiHeadAttention(num_heads=2, attention=variant,
                                          attention_options=options)


# ---------------------------------------------------------------------------- linformer


def test_linformer_release_preset_is_the_same_on_every_task():
  # LinformerBlock never passes low_rank_features (default 16); Text's config
  # sets config.low_rank_features = 32 at its top level, which train.py never reads.
  for task in (None, *TASKS):
    assert registry.preset_options("linformer", "lra_release", task) == dict(
        projected_length=16, share_kv=True, projection_init="xavier_uniform",
        mask_padding=False)


@pytest.mark.property("linformer")
def test_linformer_release_is_one_shared_projection_and_ignores_padding():
  length, embed = 20, 16
  layer = _release_layer("linformer", "listops", length)
  x = np.asarray(jax.random.normal(jax.random.PRNGKey(0), (2, length, embed)))
  params = nn.meta.unbox(jit_init(layer, jax.random.PRNGKey(1), jnp.asarray(x))["params"])
  assert set(params["variant"]) == {"key_projection"}  # the release's one `lr_kernel`
  kernel = _np(params["variant"]["key_projection"])
  assert kernel.shape == (length, 16)
  # LinformerAttention.apply: key and value both projected along the length by
  # the same kernel, then dot_product_attention (queries scaled by 1/sqrt(D)),
  # with the padding mask never used.
  q, k, v = (_np_project(x, params[name]) for name in ("query", "key", "value"))
  k = np.einsum("bthd,tk->bkhd", k, kernel)
  v = np.einsum("bthd,tk->bkhd", v, kernel)
  weights = _np_softmax(np.einsum("bqhd,bkhd->bhqk", q / np.sqrt(q.shape[-1]), k))
  expected = _np_out(np.einsum("bhqk,bkhd->bqhd", weights, v), params["out"])
  padded = jit_apply(layer, {"params": params}, jnp.asarray(x),
                       key_value_seq_lengths=jnp.array([20, 9]),
                       query_seq_lengths=jnp.array([20, 9]))
  assert_close(padded, expected, rtol=1e-4, atol=1e-5)
  # A pairwise mask is still refused rather than ignored.
  with pytest.raises(ValueError, match="key-padding mask"):
    jit_apply(layer, {"params": params}, jnp.asarray(x), mask=jnp.ones((2, 1, length, length), bool))


def test_linformer_xavier_uniform_projection_has_the_glorot_bound_and_variance():
  key = jnp.zeros((1, 512, 1, 4))
  arrays = {}
  for init in ("normal", "xavier_uniform"):
    module = low_rank.LinformerProjections(projected_length=16, projection_init=init)
    arrays[init] = _np(module.init_with_output(jax.random.PRNGKey(0), key, key, key)[0]
                       ["key_projection"])
  bound = np.sqrt(6.0 / (512 + 16))  # Glorot: U(-a, a), a = sqrt(6 / (fan_in + fan_out))
  glorot = arrays["xavier_uniform"]
  assert np.abs(glorot).max() <= bound and np.abs(glorot).max() > 0.99 * bound
  assert abs(glorot.var() / (bound ** 2 / 3) - 1) < 0.05
  assert abs(arrays["normal"].var() * 512 - 1) < 0.05  # ours: N(0, 1/Tk)
  with pytest.raises(ValueError, match="projection_init must be one of .* got 'glorot'"):
    low_rank.LinformerProjections(projection_init="glorot").init(jax.random.PRNGKey(0), key,
                                                                  key, key)


# ---------------------------------------------------------------------------- synthesizer


def test_synthesizer_release_preset_runs_the_mixed_random_synthesizer_on_every_task():
  # SynthesizerEncoder defaults: synthesizer_mode='random', ignore_dot_product=False.
  # Image and Pathfinder set synthesizer_mode='random' (the same); Text's
  # factorized_random / ignore_dot_product / k sit at its config's top level,
  # which train.py never reads.
  assert registry.preset_variant("synthesizer_dense", "lra_release") == "synthesizer_random"
  for task in (None, *TASKS):
    assert registry.preset_options("synthesizer_dense", "lra_release", task) == dict(
        mix_dot_product=True, logits_init="xavier_uniform")


def _release_synthetic_attention(q, k, v, random, valid):
  """synthetic_attention (release): q . k / sqrt(D) plus the [H, Tmax, Tmax]
  random logits sliced to the lengths, the padding as a -1e10 bias on every
  pair with a padded query or key (SynthesizerAttention.apply, make_padding_mask),
  one softmax."""
  length = q.shape[1]
  logits = np.einsum("bqhd,bkhd->bhqk", q / np.sqrt(q.shape[-1]), k)
  logits = logits + random[None, :, :length, :length]
  pair = valid[:, None, :, None] & valid[:, None, None, :]
  weights = _np_softmax(logits + np.where(pair, 0.0, -1e10))
  return np.einsum("bhqk,bkhd->bqhd", weights, v)


@pytest.mark.property("synthesizer_random")
@pytest.mark.property("synthesizer_dense")
def test_synthesizer_release_is_random_logits_plus_dot_products_before_one_softmax():
  length, max_length, embed = 7, 9, 16
  layer = _release_layer("synthesizer_dense", "image", length, max_length=max_length)
  x = np.asarray(jax.random.normal(jax.random.PRNGKey(2), (2, length, embed)))
  params = nn.meta.unbox(jit_init(layer, jax.random.PRNGKey(3), jnp.asarray(x))["params"])
  assert set(params) == {"query", "key", "value", "variant", "out"}
  random = _np(params["variant"]["logits"])
  assert random.shape == (2, max_length, max_length)
  q, k, v = (_np_project(x, params[name]) for name in ("query", "key", "value"))
  lengths = np.array([7, 4])
  valid = np.arange(length)[None, :] < lengths[:, None]
  expected = _np_out(_release_synthetic_attention(q, k, v, random, valid), params["out"])
  out = np.asarray(jit_apply(layer, {"params": params}, jnp.asarray(x),
                               key_value_seq_lengths=jnp.asarray(lengths),
                               query_seq_lengths=jnp.asarray(lengths)))
  # Valid queries agree; a padded query's row is all -1e10 in the release
  # (uniform weights once float32 rounds logit - 1e10), zero output here.
  assert_close(out[0], expected[0], rtol=1e-4, atol=1e-5)
  assert_close(out[1, :4], expected[1, :4], rtol=1e-4, atol=1e-5)


def test_synthesizer_release_logits_start_glorot_uniform():
  heads, max_length = 2, 64
  query = jnp.zeros((1, 4, heads, 8))
  init = lambda logits_init: _np(attention_jax.get_variant("synthesizer_random").extras(
      max_length=max_length, logits_init=logits_init).init_with_output(
          jax.random.PRNGKey(0), query, query, query)[1]["params"]["logits"])
  # Glorot over [H, Tmax, Tmax]: fan_in = fan_out = H * Tmax, a = sqrt(3 / (H Tmax)).
  bound = np.sqrt(3.0 / (heads * max_length))
  glorot = init("xavier_uniform")
  assert np.abs(glorot).max() <= bound and np.abs(glorot).max() > 0.99 * bound
  assert abs(glorot.var() / (bound ** 2 / 3) - 1) < 0.05
  assert abs(init("normal").std() - 1) < 0.05


def test_synthesizer_scale_without_mixing_is_refused():
  query, key, value = random_qkv(batch=1, q_len=4, num_heads=2)
  from attention_jax.variants.prior import synthesizer  # pylint: disable=g-import-not-at-top
  with pytest.raises(ValueError, match="scale=0.5 with mix_dot_product=False"):
    synthesizer.synthesizer_attention(query, key, value,
                                      synthetic_logits=jnp.zeros((1, 2, 4, 4)), scale=0.5)


# ---------------------------------------------------------------------------- performer


def test_performer_release_preset_per_task():
  # PerformerEncoder's default attention_fn_cls='generalized' (ReLU kernel,
  # kernel_epsilon 1e-3, no features, data not normalised) on Text, Retrieval,
  # Image, Pathfinder (and Path-X, which has no release config); ListOps's
  # config: 'softmax' with nb_features=2, ortho_scaling=0.0 (chi-distributed
  # row norms, our orthogonal projection), numerical_stabilizer default 1e-6,
  # redraw_features=True.
  relu = dict(kernel="relu", kernel_epsilon=1e-3, scale=1.0, mask_padding=False)
  for task in (None, "text", "retrieval", "image", "pathfinder32", "pathx"):
    assert registry.preset_options("performer", "lra_release", task) == relu
  assert registry.preset_options("performer", "lra_release", "listops") == dict(
      kernel="softmax", kernel_epsilon=0.0, scale=None, mask_padding=False, num_features=2,
      numerical_stabilizer=1e-6, redraw_every=1)


def _np_normalised(q_prime, k_prime, v, stabilizer):
  """FastAttentionviaLowRankDecomposition, bidirectional and renormalised:
  W = Q' (K'^T V), R = Q' (K'^T 1), R + 2 eps [|R| <= eps], W / R."""
  kv = np.einsum("bkhm,bkhd->bhmd", k_prime, v)
  numerator = np.einsum("bqhm,bhmd->bqhd", q_prime, kv)
  r = np.einsum("bqhm,bhm->bqh", q_prime, k_prime.sum(1))
  stabilised = r + 2 * stabilizer * (np.abs(r) <= stabilizer)
  return numerator / stabilised[..., None], r


@pytest.mark.property("performer")
def test_performer_release_relu_kernel_is_generalized_attention_without_padding():
  query, key, value = random_qkv(seed=4, batch=2, q_len=9, num_heads=2, head_dim=8)
  options = registry.preset_options("performer", "lra_release", "text")
  out = jit_call(linear.performer_attention, query, key, value,
                 key_value_seq_lengths=jnp.array([9, 3]), query_seq_lengths=jnp.array([9, 3]),
                 **options)
  # generalized_kernel_feature_creator with projection None, normalize_data=False:
  # relu(x) + 1e-3; make_fast_generalized_attention's numerical_stabilizer is 0.
  features = lambda x: np.maximum(_np(x), 0.0) + 1e-3
  expected, _ = _np_normalised(features(query), features(key), _np(value), 0.0)
  assert_close(out, expected, rtol=1e-5, atol=1e-6)


def _release_softmax_features(x, projection, is_query, eps):
  """nonnegative_softmax_kernel_feature_creator (normalize_data=True)."""
  x, w = _np(x), _np(projection)
  normalizer = x.shape[-1] ** -0.25
  ratio = w.shape[0] ** -0.5
  dash = np.einsum("bthd,md->bthm", normalizer * x, w)
  diag = (np.sum(x ** 2, -1, keepdims=True) / 2.0) * normalizer ** 2
  if is_query:
    shift = dash.max(-1, keepdims=True)
  else:  # over the features and the attention (length) axis, per batch and head
    shift = dash.max(axis=(1, 3), keepdims=True)
  return ratio * (np.exp(dash - diag - shift) + eps)


@pytest.mark.property("performer")
def test_performer_release_listops_is_the_reference_codes_stabilised_favor():
  query, key, value = random_qkv(seed=5, batch=2, q_len=8, num_heads=2, head_dim=8)
  # Large queries in the second half: their features underflow to eps, their
  # normalisers fall below eps and take the reference code's 2 eps.
  query = query * jnp.array([1.0] * 4 + [6.0] * 4)[None, :, None, None]
  options = registry.preset_options("performer", "lra_release", "listops")
  projection = jit_call(linear.gaussian_projection, jax.random.PRNGKey(6),
                        options["num_features"], 8)
  fn_options = {k: v for k, v in options.items() if k not in ("num_features", "redraw_every")}
  out = jit_call(linear.performer_attention, query, key, value, projection=projection,
                 key_value_seq_lengths=jnp.array([8, 2]), **fn_options)
  eps = 1e-6
  expected, r = _np_normalised(_release_softmax_features(query, projection, True, eps),
                               _release_softmax_features(key, projection, False, eps),
                               _np(value), eps)
  tiny = np.abs(r) <= eps
  assert tiny.any() and not tiny.all() and np.abs(expected[tiny]).max() > 0.05
  assert_close(out, expected, rtol=2e-4, atol=1e-6)


def test_performer_release_layers_per_task():
  x = jnp.ones((1, 6, 16))
  relu = jit_init(_release_layer("performer", "image", 6), jax.random.PRNGKey(0), x)
  assert common.RANDOM_COLLECTION not in relu  # no random features at all
  favor = jit_init(_release_layer("performer", "listops", 6), jax.random.PRNGKey(0), x)
  assert favor[common.RANDOM_COLLECTION]["variant"]["projection"].shape == (2, 8)


def test_performer_kernel_options_are_checked():
  query, key, value = random_qkv(batch=1, q_len=4, num_heads=2)
  projection = jnp.ones((2, 8))
  fn = linear.performer_attention
  with pytest.raises(ValueError, match="kernel must be one of .* got 'gelu'"):
    fn(query, key, value, projection=projection, kernel="gelu")
  with pytest.raises(ValueError, match="kernel_epsilon is an option of the relu kernel"):
    fn(query, key, value, projection=projection, kernel_epsilon=1e-3)
  with pytest.raises(ValueError, match="numerical_stabilizer is an option of the softmax"):
    fn(query, key, value, kernel="relu", numerical_stabilizer=1e-6)
  with pytest.raises(ValueError, match="needs projection"):
    fn(query, key, value)
  with pytest.raises(ValueError, match="kernel_epsilon must be a float >= 0, got -1"):
    fn(query, key, value, kernel="relu", kernel_epsilon=-1)


# ---------------------------------------------------------------------------- linear


def test_linear_release_preset_is_the_same_on_every_task():
  for task in (None, *TASKS):
    assert registry.preset_options("linear", "lra_release", task) == dict(epsilon=1e-6,
                                                                          mask_padding=False)


@pytest.mark.property("linear")
@pytest.mark.parametrize("shift", [0.0, -6.0])
def test_linear_release_adds_epsilon_to_the_normaliser_and_ignores_padding(shift):
  # shift -6: elu(x) + 1 ~ 2.5e-3 for queries and keys, so the normaliser is
  # ~4e-4 and the release's + 1e-6 changes the output measurably.
  query, key, value = random_qkv(seed=7, batch=2, q_len=8, num_heads=2, head_dim=8)
  query, key = query + shift, key + shift
  options = registry.preset_options("linear", "lra_release", "retrieval")
  out = linear.linear_attention(query, key, value, key_value_seq_lengths=jnp.array([8, 3]),
                                query_seq_lengths=jnp.array([8, 3]), **options)
  # linear_attention (release): elu + 1 features, kv = K'^T V,
  # z = 1 / (Q' . sum_s K'_s + 1e-6), y = Q' kv z.
  elu1 = lambda x: np.where(x > 0, x + 1.0, np.exp(np.minimum(x, 0.0)))
  q, k, v = elu1(_np(query)), elu1(_np(key)), _np(value)
  kv = np.einsum("nshd,nshm->nhmd", k, v)
  z = 1.0 / (np.einsum("nlhd,nhd->nlh", q, k.sum(1)) + 1e-6)
  expected = np.einsum("nlhd,nhmd,nlh->nlhm", q, kv, z)
  assert_close(out, expected, rtol=2e-4, atol=1e-6)
  if shift:
    without = linear.linear_attention(query, key, value, mask_padding=False)
    assert np.abs(np.asarray(without) - expected).max() > 1e-3 * np.abs(expected).max()
