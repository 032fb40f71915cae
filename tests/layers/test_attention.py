"""MultiHeadAttention against Flax's MultiHeadDotProductAttention, KV-cache decoding, head layouts."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_jax import MultiHeadAttention, registry
from attention_jax.variants.heads import multi_head_attention
from attention_testing import assert_close, jit_apply, jit_call, jit_init

B, T, E, H = 2, 6, 16, 4


def _inputs(seed=0, length=T, features=E):
  return jax.random.normal(jax.random.PRNGKey(seed), (B, length, features))


def _init(module, *args, **kwargs):
  return nn.meta.unbox(jit_init(module, jax.random.PRNGKey(1), *args, **kwargs))


@pytest.mark.parity("multi_head")
@pytest.mark.parametrize("cross", [False, True])
@pytest.mark.parametrize("with_mask", [False, True])
def test_equals_flax_multi_head_dot_product_attention_with_the_same_weights(cross, with_mask):
  x = _inputs(0)
  context = _inputs(1, length=9, features=12) if cross else None
  kv_len = 9 if cross else T
  mask = None
  if with_mask:
    mask = jax.random.bernoulli(jax.random.PRNGKey(5), 0.7, (B, 1, T, kv_len))
  ours = MultiHeadAttention(num_heads=H, qkv_features=24, out_features=10)
  params = _init(ours, x, context)
  theirs = nn.MultiHeadDotProductAttention(num_heads=H, qkv_features=24, out_features=10)
  theirs_params = jit_init(theirs, jax.random.PRNGKey(2), x, context)
  assert jax.tree.structure(theirs_params) == jax.tree.structure(params)
  expected = jit_apply(theirs, params, x, context, mask=mask)
  actual = jit_apply(ours, params, x, context, mask=mask)
  if with_mask:  # Flax gives fully masked rows uniform weights; ours gives zeros.
    attended = np.asarray(mask).any(-1)[:, 0]
    actual, expected = np.asarray(actual)[attended], np.asarray(expected)[attended]
  assert_close(actual, expected)


def test_initial_parameters_equal_flax_dense_general_initialisation():
  x, context = _inputs(0), _inputs(1, length=9, features=12)
  ours = MultiHeadAttention(num_heads=H, qkv_features=24, out_features=10)
  theirs = nn.MultiHeadDotProductAttention(num_heads=H, qkv_features=24, out_features=10)
  key = jax.random.PRNGKey(3)
  expected = jit_init(theirs, key, x, context)
  actual = nn.meta.unbox(jit_init(ours, key, x, context))
  for (path, want), got in zip(jax.tree_util.tree_leaves_with_path(expected),
                               jax.tree.leaves(actual)):
    np.testing.assert_array_equal(got, want, err_msg=jax.tree_util.keystr(path))


def test_initialises_and_runs_under_an_active_mesh_with_logical_rules():
  # Flax's DenseGeneral attaches 3 logical names to its flat 2-D kernel, which
  # fails here (flax issue #3676); the activation constraints must apply too.
  mesh = jax.make_mesh((1, 1, 1), ("data", "fsdp", "tensor"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 3)
  rules = (("batch", "data"), ("embed", "fsdp"), ("heads", "tensor"), ("kv", None),
           ("length", None))
  module = MultiHeadAttention(num_heads=H)
  x = _inputs(0)
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    variables = jit_init(module, jax.random.PRNGKey(1), x)
    out = jax.jit(module.apply)(variables, x)
  specs = nn.get_partition_spec(variables)["params"]
  assert specs["query"]["kernel"] == jax.sharding.PartitionSpec("embed", "heads", "kv")
  assert specs["out"]["kernel"] == jax.sharding.PartitionSpec("heads", "kv", "embed")
  assert_close(out, jit_apply(module, variables, x), atol=1e-6)


@pytest.mark.parity("multi_head")
def test_pure_multi_head_function_and_sum_of_heads_form_equal_the_module():
  x, context = _inputs(0), _inputs(1, length=9)
  module = MultiHeadAttention(num_heads=H, use_bias=False)
  params = _init(module, x, context)["params"]
  expected = jit_apply(module, {"params": params}, x, context, is_causal=False)
  kernels = [params[name]["kernel"] for name in ("query", "key", "value", "out")]
  concat = jit_call(multi_head_attention, x, context, *kernels)
  summed = jit_call(multi_head_attention, x, context, *kernels, sum_of_heads=True)
  assert_close(concat, expected)
  assert_close(summed, expected)


@pytest.mark.parity("grouped_query")
@pytest.mark.parity("multi_query")
@pytest.mark.parametrize("variant, num_kv_heads", [("multi_query", None), ("grouped_query", 2)])
def test_shared_kv_heads_equal_mha_with_repeated_kv_weights(variant, num_kv_heads):
  x = _inputs(0)
  options = {} if num_kv_heads is None else {"num_kv_heads": num_kv_heads}
  grouped = registry.get_variant(variant).module(num_heads=H, **options)
  params = _init(grouped, x)["params"]
  kv_heads = params["key"]["kernel"].shape[1]
  assert kv_heads == (num_kv_heads or 1)
  # The same layer written as MHA: every query head h gets K/V head h // (H // Hkv).
  repeated = jax.tree.map(lambda p: p, params)
  for name in ("key", "value"):
    repeated[name] = {"kernel": jnp.repeat(params[name]["kernel"], H // kv_heads, axis=1),
                      "bias": jnp.repeat(params[name]["bias"], H // kv_heads, axis=0)}
  mha = MultiHeadAttention(num_heads=H)
  assert_close(jit_apply(grouped, {"params": params}, x, is_causal=True),
               jit_apply(mha, {"params": repeated}, x, is_causal=True))


def _decode_step_by_step(module, params, x, cache):
  outputs = []
  for t in range(x.shape[1]):
    out, mutated = jit_apply(module, {"params": params, "cache": cache}, x[:, t:t + 1],
                                mutable=["cache"])
    cache = mutated["cache"]
    outputs.append(out)
  return jnp.concatenate(outputs, axis=1)


@pytest.mark.parity("dot_product")
@pytest.mark.parametrize("position", [None, "rope", "alibi", "t5", "xl_relative"])
@pytest.mark.parametrize("num_kv_heads", [H, 2, 1])
def test_kv_cache_decoding_equals_the_causal_forward_pass(position, num_kv_heads):
  x = _inputs(3)
  full = MultiHeadAttention(num_heads=H, num_kv_heads=num_kv_heads, position=position)
  params = _init(full, x)["params"]
  expected = jit_apply(full, {"params": params}, x, is_causal=True)

  decoder = full.clone(decode=True)
  cache = jit_init(decoder, jax.random.PRNGKey(0), x)["cache"]
  assert cache["cached_key"].shape == (B, T, num_kv_heads, E // H)
  actual = jax.jit(_decode_step_by_step, static_argnums=0)(decoder, params, x, cache)
  assert_close(actual, expected, rtol=1e-5, atol=2e-5)


def test_kv_cache_prefill_then_decode_equals_the_causal_forward_pass():
  x = _inputs(4)
  full = MultiHeadAttention(num_heads=H, position="rope")
  params = _init(full, x)["params"]
  expected = jit_apply(full, {"params": params}, x, is_causal=True)
  decoder = full.clone(decode=True)
  cache = jit_init(decoder, jax.random.PRNGKey(0), x)["cache"]
  prefix, mutated = jit_apply(decoder, {"params": params, "cache": cache}, x[:, :4], mutable=["cache"])
  rest = _decode_step_by_step(decoder, params, x[:, 4:], mutated["cache"])
  assert_close(jnp.concatenate([prefix, rest], axis=1), expected, atol=2e-5)


def test_parameters_carry_logical_axis_names():
  module = MultiHeadAttention(num_heads=H, position="t5")
  boxed = jit_init(module, jax.random.PRNGKey(0), _inputs())["params"]
  names = {path: leaf.names for path, leaf in jax.tree_util.tree_flatten_with_path(
      boxed, is_leaf=lambda l: isinstance(l, nn.Partitioned))[0]}
  by_param = {"/".join(k.key for k in path): value for path, value in names.items()}
  assert by_param["query/kernel"] == ("embed", "heads", "kv")
  assert by_param["key/bias"] == ("heads", "kv")
  assert by_param["out/kernel"] == ("heads", "kv", "embed")
  assert by_param["out/bias"] == ("embed",)
  assert by_param["relative_position_bias/rel_embedding"] == ("relpos_buckets", "heads")


def test_fixed_head_size_is_independent_of_the_number_of_heads():
  module = MultiHeadAttention(num_heads=8, head_dim=32)
  params = _init(module, _inputs())["params"]
  assert params["query"]["kernel"].shape == (E, 8, 32)
  assert jit_apply(module, {"params": params}, _inputs()).shape == (B, T, E)


def test_attention_options_reach_the_pure_function():
  x = _inputs()
  windowed = MultiHeadAttention(num_heads=H, attention_options={"local_window_size": 0})
  params = _init(windowed, x)["params"]
  # With a window of 0 every token attends only to itself: output = out(value(x)).
  value = jnp.einsum("bte,ehd->bthd", x, params["value"]["kernel"]) + params["value"]["bias"]
  expected = jnp.einsum("bthd,hde->bte", value, params["out"]["kernel"]) + params["out"]["bias"]
  assert_close(jit_apply(windowed, {"params": params}, x), expected)


def test_dropout_is_active_only_when_not_deterministic():
  x = _inputs()
  module = MultiHeadAttention(num_heads=H, dropout_rate=0.5)
  params = _init(module, x)
  clean = jit_apply(module, params, x)
  assert_close(jit_apply(module, params, x, deterministic=True), clean)
  noisy = jit_apply(module, params, x, deterministic=False, rngs={"dropout": jax.random.PRNGKey(3)})
  assert not np.allclose(noisy, clean)


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_heads=4, num_kv_heads=3), r"num_heads \(4\) must be a multiple of num_kv_heads \(3\)"),
    (dict(num_heads=5), r"qkv_features \(16\) must be divisible by num_heads \(5\)"),
    (dict(num_heads=4, attention="nope"), "unknown attention variant 'nope'"),
    (dict(num_heads=4, attention="multi_head"), "is not Q/K/V attention"),
    (dict(num_heads=4, position="sinusoidal"), "position must be None or one of"),
])
def test_bad_configuration_raises_value_errors(kwargs, message):
  with pytest.raises(ValueError, match=message):
    MultiHeadAttention(**kwargs).init(jax.random.PRNGKey(0), _inputs())


def test_decode_refuses_cross_attention():
  with pytest.raises(ValueError, match="decode=True caches self-attention"):
    MultiHeadAttention(num_heads=H, decode=True).init(jax.random.PRNGKey(0), _inputs(),
                                                      _inputs(1))


@pytest.mark.parametrize("attention, options", [
    ("dot_product", {}), ("moba", {"block_size": 2, "top_k": 1})])
def test_decode_refuses_positions(attention, options):
  # A cached key sits at its slot, so a new token's only consistent position is
  # its slot. Given other positions the layer used to go on: RoPE's distances
  # to the cached keys shifted, and MoBA chose its blocks at the positions
  # instead of the cache indices, silently.
  decoder = MultiHeadAttention(num_heads=H, position="rope", decode=True, attention=attention,
                               attention_options=options)
  x = _inputs()
  variables = jax.eval_shape(decoder.init, jax.random.PRNGKey(0), x)
  for step in (x, x[:, :1]):  # the prompt's call and a step's
    with pytest.raises(ValueError, match=r"decode=True places the new tokens after those "
                                         r"already cached .* got positions of shape \(1, 1\)"):
      jax.eval_shape(lambda v, s: decoder.apply(v, s, positions=jnp.full((1, 1), 7),
                                                mutable=["cache"]), variables, step)


# ---------------------------------------------------------------------------
# Projections a variant does not read are neither created nor computed.


def _np_softmax(logits):
  logits = logits - logits.max(-1, keepdims=True)
  weights = np.exp(logits)
  return weights / weights.sum(-1, keepdims=True)


def _np_project(x, p):
  """x [B, T, E] through a HeadProjection's kernel [E, H, D] and bias [H, D]."""
  return np.einsum("bte,ehd->bthd", x, np.asarray(p["kernel"])) + np.asarray(p["bias"])


def _np_out(out, p):
  """[B, T, H, D] through the output projection ([H, D, E] kernel, [E] bias)."""
  return np.einsum("bthd,hde->bte", out, np.asarray(p["kernel"])) + np.asarray(p["bias"])


def _np_attend(weights, value):
  """weights [B|1, H, Tq, Tk], value [B, Tk, H, D] -> [B, Tq, H, D]."""
  return np.einsum("bhqk,bkhd->bqhd", weights, value)


def _keyless_layer(attention, **options):
  module = MultiHeadAttention(num_heads=2, attention=attention, attention_options=options)
  x = np.asarray(_inputs(5))
  params = _init(module, jnp.asarray(x))["params"]
  return module, x, params, np.asarray(jit_apply(module, {"params": params}, jnp.asarray(x)))


@pytest.mark.property("lsh")
def test_lsh_makes_no_key_projection_and_is_shared_qk_attention():
  # One bucket and one chunk: LSH is exactly dense attention over the shared
  # keys k_j = q_j / |q_j| with a token's own key penalised (Kitaev et al.).
  from attention_jax.variants import hashing  # pylint: disable=g-import-not-at-top
  module, x, params, out = _keyless_layer("lsh", n_buckets=1, chunk_size=T, n_hashes=1)
  assert set(params) == {"query", "value", "out"}
  q, v = _np_project(x, params["query"]), _np_project(x, params["value"])
  k = q / np.linalg.norm(q, axis=-1, keepdims=True)
  logits = np.einsum("bqhd,bkhd->bhqk", q, k) * q.shape[-1] ** -0.5
  logits = logits - hashing.SELF_ATTENTION_PENALTY * np.eye(T)
  expected = _np_out(_np_attend(_np_softmax(logits), v), params["out"])
  assert_close(out, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.property("synthesizer_dense")
def test_dense_synthesizer_makes_no_key_projection():
  module, x, params, out = _keyless_layer("synthesizer_dense", max_length=8)
  assert set(params) == {"query", "value", "variant", "out"}
  p = {k: np.asarray(w) for k, w in params["variant"].items()}
  q, v = _np_project(x, params["query"]), _np_project(x, params["value"])
  hidden = np.maximum(np.einsum("bqhd,hdf->bhqf", q, p["hidden_kernel"])
                      + p["hidden_bias"][None, :, None], 0.0)
  logits = (np.einsum("bhqf,hfk->bhqk", hidden, p["logits_kernel"])
            + p["logits_bias"][None, :, None])[..., :T]
  expected = _np_out(_np_attend(_np_softmax(logits), v), params["out"])
  assert_close(out, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.property("synthesizer_random")
@pytest.mark.property("synthesizer_factorized")
@pytest.mark.parametrize("attention", ["synthesizer_random", "synthesizer_factorized"])
def test_random_synthesizers_make_neither_query_nor_key_projection(attention):
  module, x, params, out = _keyless_layer(attention, max_length=8)
  assert set(params) == {"value", "variant", "out"}
  p = {k: np.asarray(w) for k, w in params["variant"].items()}
  if attention == "synthesizer_random":
    logits = p["logits"][:, :T, :T]
  else:
    logits = np.einsum("hqr,hkr->hqk", p["query_factor"][:, :T], p["key_factor"][:, :T])
  v = _np_project(x, params["value"])
  expected = _np_out(_np_attend(_np_softmax(logits[None]), v), params["out"])
  assert_close(out, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.property("synthesizer_random")
def test_random_synthesizer_mixed_with_dot_products_projects_queries_and_keys():
  module, x, params, out = _keyless_layer("synthesizer_random", max_length=8,
                                          mix_dot_product=True)
  assert set(params) == {"query", "key", "value", "variant", "out"}
  q, k, v = (_np_project(x, params[name]) for name in ("query", "key", "value"))
  logits = (np.einsum("bqhd,bkhd->bhqk", q, k) * q.shape[-1] ** -0.5
            + np.asarray(params["variant"]["logits"])[None, :, :T, :T])
  expected = _np_out(_np_attend(_np_softmax(logits), v), params["out"])
  assert_close(out, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.property("synthesizer_dense")
def test_decoding_a_keyless_variant_caches_values_only():
  x = _inputs(3)
  full = MultiHeadAttention(num_heads=H, attention="synthesizer_dense",
                            attention_options={"max_length": T})
  params = _init(full, x)["params"]
  expected = jit_apply(full, {"params": params}, x, is_causal=True)
  decoder = full.clone(decode=True)
  cache = jit_init(decoder, jax.random.PRNGKey(0), x)["cache"]
  assert set(cache) == {"cached_value", "cache_index"}
  actual = _decode_step_by_step(decoder, params, x, cache)
  assert_close(actual, expected, rtol=1e-5, atol=2e-5)


def test_attention_dropout_on_a_variant_without_weights_is_refused():
  module = MultiHeadAttention(num_heads=H, attention="linear", dropout_rate=0.1)
  x = _inputs()
  params = _init(module, x)["params"]
  with pytest.raises(ValueError, match=r"'linear' has no attention weights to drop; got "
                                       r"dropout_rate=0.1"):
    jit_apply(module, {"params": params}, x, deterministic=False,
                 rngs={"dropout": jax.random.PRNGKey(0)})
