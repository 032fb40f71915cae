"""Attention replaced (section G): fnet, mlp_mixer, gmlp, xca and lite, each
against its formula written out in numpy (float64), with padding, causality
(by the Jacobian) and bad arguments."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_jax import registry
from attention_jax.variants.mixing.cross_covariance import cross_covariance_attention
from attention_jax.variants.mixing.fourier import FourierMixing, fourier_mixing
from attention_jax.variants.mixing.long_short import LongShortRangeAttention
from attention_jax.variants.mixing.mlp import GatedMLP, TokenMixingMLP
from attention_testing import as_float64, assert_close, jit_apply, jit_init, np_softmax, perturbed

B, T, E = 2, 6, 8
LENGTHS = np.array([4, 6])  # the first sequence has two padded tokens


def random_tokens(seed=0, shape=(B, T, E)):
  return jnp.asarray(np.random.default_rng(seed).normal(size=shape), jnp.float32)


def padding_mask(lengths=LENGTHS, length=T):
  """The key-padding mask `[B, 1, 1, T]` the encoder passes."""
  return jnp.asarray(np.arange(length)[None, :] < np.asarray(lengths)[:, None])[:, None, None]


def with_padded_tokens_changed(x, lengths=LENGTHS):
  """x with every padded token replaced by other values."""
  padded = np.arange(x.shape[1])[None, :] >= np.asarray(lengths)[:, None]
  return jnp.where(jnp.asarray(padded)[..., None], 100.0 + x ** 2, x)


def np_zero_padding(x, lengths):
  return x * (np.arange(x.shape[1])[None, :] < np.asarray(lengths)[:, None])[..., None]


np_gelu = np.vectorize(lambda v: 0.5 * v * (1.0 + math.erf(v / math.sqrt(2.0))))


def np_layer_norm(x, scale, bias, eps=1e-6):
  mean = x.mean(-1, keepdims=True)
  return (x - mean) / np.sqrt(((x - mean) ** 2).mean(-1, keepdims=True) + eps) * scale + bias


def module_and_params(name, x, seed=1, **fields):
  """The registered module of `name` with random (perturbed) parameters."""
  module = registry.get_variant(name).module(num_heads=2, **fields)
  variables = jit_init(module, jax.random.PRNGKey(seed), x)
  return module, perturbed(variables.get("params", {}), seed)


def assert_padding_contributes_nothing(apply, x, lengths=LENGTHS):
  """Real tokens' outputs do not change with the padded tokens' values, and
  padded tokens output zeros."""
  out = np.asarray(apply(x))
  changed = np.asarray(apply(with_padded_tokens_changed(x, lengths)))
  real = np.arange(x.shape[1])[None, :] < np.asarray(lengths)[:, None]
  assert_close(out[real], changed[real], rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(out[~real], 0.0)


def assert_module_is_its_formula(module, params, x, formula, is_causal, padding):
  """`module` equals `formula(lengths)` (numpy) padded by `padding` (the
  module's keyword arguments for LENGTHS) and unpadded (`formula(None)`), and
  padded tokens contribute nothing."""
  apply = jax.jit(lambda x: module.apply({"params": params}, x, is_causal=is_causal, **padding))
  assert_close(apply(x), formula(LENGTHS), rtol=1e-4, atol=1e-5)
  assert_padding_contributes_nothing(apply, x)
  full = jax.jit(lambda x: module.apply({"params": params}, x, is_causal=is_causal))(x)
  assert_close(full, formula(None), rtol=1e-4, atol=1e-5)


def assert_no_output_reads_a_later_token(apply, x):
  """d out[t] / d x[s] = 0 for every s > t (the Jacobian's upper blocks), and
  not for every s < t (so the check can fail)."""
  jacobian = np.asarray(jax.jacfwd(apply)(x[:1]))[0, :, :, 0]  # [T, E, T, E]
  length = x.shape[1]
  later = np.triu(np.ones((length, length), bool), k=1)
  np.testing.assert_array_equal(jacobian.transpose(0, 2, 1, 3)[later], 0.0)
  assert np.abs(jacobian.transpose(0, 2, 1, 3)[later.T]).max() > 1e-4


# --------------------------------------------------------------------------------------
# fnet


@pytest.mark.property("fnet")
def test_fnet_is_the_real_part_of_numpys_2d_fft_over_tokens_and_channels():
  x = random_tokens()
  want = np.fft.fft2(as_float64(x), axes=(1, 2)).real
  assert_close(jax.jit(fourier_mixing)(x), want, rtol=1e-5, atol=1e-4)
  # The same as the DFT written as a sum of cosines: sum_{s,c} x[s,c] cos(2 pi (ts/T + ec/E)).
  t, e = np.arange(T), np.arange(E)
  angles = 2 * np.pi * (np.outer(t, t)[:, None, :, None] / T + np.outer(e, e)[None, :, None] / E)
  assert_close(want, np.einsum("tesc,bsc->bte", np.cos(angles), as_float64(x)), atol=1e-9)


@pytest.mark.property("fnet")
def test_fnet_module_zeroes_padding_before_the_transform():
  x = random_tokens(1)
  module, _ = module_and_params("fnet", x)
  assert not jit_init(module, jax.random.PRNGKey(0), x)  # no parameters
  apply = jax.jit(lambda x: module.apply({}, x, mask=padding_mask()))
  want = np.fft.fft2(np_zero_padding(as_float64(x), LENGTHS), axes=(1, 2)).real
  assert_close(apply(x)[0, :4], want[0, :4], atol=1e-4)
  assert_padding_contributes_nothing(apply, x)
  by_lengths = jit_apply(module, {}, x, key_value_seq_lengths=jnp.asarray(LENGTHS))
  assert_close(by_lengths, apply(x), atol=1e-5)


@pytest.mark.property("fnet")
@pytest.mark.parametrize("arguments, message", [
    (dict(is_causal=True), "'fnet' does not support is_causal"),
    (dict(context=jnp.zeros((B, T, E))), "'fnet' does not support context"),
    (dict(segment_ids=jnp.zeros((B, T), jnp.int32)), "'fnet' does not support segment_ids"),
    (dict(mask=jnp.ones((B, 1, T, T), bool)), "takes only a key-padding mask"),
])
def test_fnet_refuses_what_it_cannot_do(arguments, message):
  module = FourierMixing()
  with pytest.raises(ValueError, match=message):
    jit_apply(module, {}, random_tokens(), **arguments)


@pytest.mark.property("fnet")
def test_fnet_has_no_weights_to_drop():
  with pytest.raises(ValueError, match=r"fnet has no mixing weights to drop; got dropout_rate=0.1"):
    FourierMixing(dropout_rate=0.1).apply({}, random_tokens(), deterministic=False)


# --------------------------------------------------------------------------------------
# mlp_mixer


def np_token_mixing(x, p, lengths=None):
  x = as_float64(x) if lengths is None else np_zero_padding(as_float64(x), lengths)
  w1, b1, w2, b2 = (as_float64(p[n]) for n in ("token_in_kernel", "token_in_bias",
                                                "token_out_kernel", "token_out_bias"))
  out = np.zeros_like(x)
  for b in range(x.shape[0]):
    for c in range(x.shape[2]):  # every channel through the same MLP across the tokens
      out[b, :, c] = np_gelu(x[b, :, c] @ w1 + b1) @ w2 + b2
  return out if lengths is None else np_zero_padding(out, lengths)


@pytest.mark.property("mlp_mixer")
def test_mlp_mixer_is_an_mlp_across_the_tokens_of_every_channel():
  x = random_tokens(2)
  module, params = module_and_params("mlp_mixer", x, max_length=T)
  assert params["token_in_kernel"].shape == (T, E // 2)  # F = E / 2 by default
  assert_close(jax.jit(module.apply)({"params": params}, x), np_token_mixing(x, params),
               rtol=1e-5, atol=1e-5)
  module, params = module_and_params("mlp_mixer", x, max_length=T, hidden_dim=3)
  assert params["token_out_kernel"].shape == (3, T)
  apply = jax.jit(lambda x: module.apply({"params": params}, x, mask=padding_mask()))
  assert_close(apply(x), np_token_mixing(x, params, LENGTHS), rtol=1e-5, atol=1e-5)
  assert_padding_contributes_nothing(apply, x)


@pytest.mark.property("mlp_mixer")
def test_mlp_mixer_runs_at_its_length_only():
  module = TokenMixingMLP(max_length=T + 1)
  with pytest.raises(ValueError, match=r"mlp_mixer mixes exactly max_length=7 tokens .* got a "
                                       r"sequence of T=6; set the option max_length"):
    jit_init(module, jax.random.PRNGKey(0), random_tokens())
  with pytest.raises(ValueError, match="'mlp_mixer' does not support is_causal"):
    TokenMixingMLP(max_length=T).init(jax.random.PRNGKey(0), random_tokens(),
                                      is_causal=True)


# --------------------------------------------------------------------------------------
# gmlp


def np_gmlp(x, p, is_causal=False, lengths=None):
  """The gMLP block's body written out: GELU(x U), split, LayerNorm, W v + b, gate, V."""
  x, p = as_float64(x), {k: as_float64(v) for k, v in p.items()}
  z = np_gelu(x @ p["in_kernel"] + p["in_bias"])
  half = z.shape[-1] // 2
  u, v = z[..., :half], np_layer_norm(z[..., half:], p["norm_scale"], p["norm_bias"])
  weights = np.tril(p["spatial_kernel"]) if is_causal else p["spatial_kernel"]
  if lengths is not None:
    v = np_zero_padding(v, lengths)
  out = (u * (np.einsum("ts,bsg->btg", weights, v) + p["spatial_bias"][:, None])) \
      @ p["out_kernel"] + p["out_bias"]
  return out if lengths is None else np_zero_padding(out, lengths)


@pytest.mark.property("gmlp")
@pytest.mark.parametrize("is_causal", [False, True])
def test_gmlp_is_the_gmlp_block_without_norm_and_shortcut(is_causal):
  x = random_tokens(3)
  module, params = module_and_params("gmlp", x, max_length=T)
  assert params["in_kernel"].shape == (E, 2 * E) and params["spatial_kernel"].shape == (T, T)
  assert_module_is_its_formula(module, params, x,
                               lambda lengths: np_gmlp(x, params, is_causal, lengths), is_causal,
                               dict(key_value_seq_lengths=jnp.asarray(LENGTHS)))


@pytest.mark.property("gmlp")
def test_causal_gmlp_reads_no_later_token():
  x = random_tokens(4, (1, 5, 4))
  module, params = module_and_params("gmlp", x, max_length=5, hidden_dim=6)
  assert_no_output_reads_a_later_token(
      lambda x: jit_apply(module, {"params": params}, x, is_causal=True), x)


@pytest.mark.property("gmlp")
def test_gmlp_starts_as_an_ungated_mlp():
  """W near zero and b = 1 (the paper's initialisation): s(z) ~ u at the start."""
  x = random_tokens(5)
  module = GatedMLP(max_length=T)
  params = jit_init(module, jax.random.PRNGKey(0), x)["params"]
  assert np.abs(np.asarray(params["spatial_kernel"])).max() <= 1e-3 / T
  np.testing.assert_array_equal(params["spatial_bias"], 1.0)
  z = jax.nn.gelu(x @ params["in_kernel"] + params["in_bias"], approximate=False)
  ungated = z[..., :E] @ params["out_kernel"] + params["out_bias"]
  assert_close(jit_apply(module, {"params": params}, x), ungated, rtol=0, atol=1e-2)


@pytest.mark.property("gmlp")
@pytest.mark.parametrize("fields, message", [
    (dict(max_length=T, hidden_dim=7), r"hidden_dim must be even to be split in two halves, "
                                       r"got 7"),
    (dict(max_length=T - 1), r"gmlp mixes exactly max_length=5 tokens .* got a sequence of T=6"),
])
def test_gmlp_refuses_bad_sizes(fields, message):
  with pytest.raises(ValueError, match=message):
    GatedMLP(**fields).init(jax.random.PRNGKey(0), random_tokens())


# --------------------------------------------------------------------------------------
# xca


def np_xca(query, key, value, temperature, lengths=None):
  """Per batch and head: the [D, D] weights softmax_j(tau q^_i . k^_j) over the
  channels, q^ and k^ unit columns over the (real) tokens; out = v A^T."""
  q, k, v = (as_float64(a) for a in (query, key, value))
  if lengths is not None:
    q, k, v = (np_zero_padding(a.reshape(B, T, -1), lengths).reshape(a.shape)
               for a in (q, k, v))
  out = np.zeros_like(q)
  for b in range(q.shape[0]):
    for h in range(q.shape[2]):
      kv_head = h * k.shape[2] // q.shape[2]
      q_hat = q[b, :, h] / np.linalg.norm(q[b, :, h], axis=0)
      k_hat = k[b, :, kv_head] / np.linalg.norm(k[b, :, kv_head], axis=0)
      weights = np_softmax(temperature[h] * q_hat.T @ k_hat)  # [D, D], rows sum to 1
      out[b, :, h] = v[b, :, kv_head] @ weights.T
  return out


@pytest.mark.property("xca")
@pytest.mark.parametrize("num_kv_heads", [3, 1])
def test_xca_is_attention_over_channels_with_unit_token_columns(num_kv_heads):
  rng = np.random.default_rng(6)
  query = jnp.asarray(rng.normal(size=(B, T, 3, 4)), jnp.float32)
  key, value = (jnp.asarray(rng.normal(size=(B, T, num_kv_heads, 4)), jnp.float32)
                for _ in range(2))
  temperature = jnp.asarray([0.5, 1.0, 3.0])
  xca = jax.jit(cross_covariance_attention)
  assert_close(xca(query, key, value, temperature=temperature),
               np_xca(query, key, value, temperature), rtol=1e-5, atol=1e-5)
  padded = xca(query, key, value, temperature=temperature,
               key_value_seq_lengths=jnp.asarray(LENGTHS))
  assert_close(padded, np_xca(query, key, value, temperature, LENGTHS), rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(np.asarray(padded)[0, 4:], 0.0)


@pytest.mark.property("xca")
def test_xca_layer_learns_a_temperature_per_head_and_ignores_padding():
  x = random_tokens(7)
  module, params = module_and_params("xca", x)
  assert params["variant"]["temperature"].shape == (2,)
  apply = jax.jit(lambda x: module.apply({"params": params}, x, mask=padding_mask()))
  # The layer's output projection has a bias: padded rows output it, not zeros.
  out, changed = apply(x), apply(with_padded_tokens_changed(x))
  assert_close(out[0, :4], changed[0, :4], rtol=1e-5, atol=1e-5)
  assert_close(out[1], changed[1], rtol=1e-5, atol=1e-5)


@pytest.mark.property("xca")
@pytest.mark.parametrize("arguments, message", [
    (dict(is_causal=True), "'xca' does not support is_causal"),
    (dict(key=jnp.zeros((B, T + 1, 2, 4)), value=jnp.zeros((B, T + 1, 2, 4))),
     r"one length; got Tq=6 and Tk=7"),
    (dict(value=jnp.zeros((B, T, 2, 5))), r"value head size must be the key's D=4, got 5"),
    (dict(temperature=jnp.ones((3,))), r"temperature must have shape \[2\], got \[3\]"),
])
def test_xca_refuses_what_it_cannot_do(arguments, message):
  given = dict(query=jnp.zeros((B, T, 2, 4)), key=jnp.zeros((B, T, 2, 4)),
               value=jnp.zeros((B, T, 2, 4)), temperature=jnp.ones((2,)))
  with pytest.raises(ValueError, match=message):
    cross_covariance_attention(**{**given, **arguments})


# --------------------------------------------------------------------------------------
# lite


def np_lite(x, p, is_causal=False, lengths=None):
  """The two branches by hand on the split halves: attention on the first,
  GLU then a per-channel convolution on the second; one projection."""
  x, p = as_float64(x), {k: as_float64(v) for k, v in p.items()}
  half = x.shape[-1] // 2
  project = lambda name: np.einsum("bte,ehd->bthd", x[..., :half], p[f"{name}_kernel"]) + \
      p[f"{name}_bias"]
  q, k, v = project("query"), project("key"), project("value")
  logits = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
  allowed = np.ones((B, 1, T, T), bool)
  if is_causal:
    allowed &= np.tril(np.ones((T, T), bool))
  if lengths is not None:
    allowed &= (np.arange(T)[None, :] < lengths[:, None])[:, None, None, :]
  heads = np.einsum("bhqk,bkhd->bqhd", np_softmax(np.where(allowed, logits, -np.inf)), v)
  glu = x[..., half:] @ p["glu_kernel"] + p["glu_bias"]
  gated = glu[..., :half] / (1.0 + np.exp(-glu[..., half:]))
  if lengths is not None:
    gated = np_zero_padding(gated, lengths)
  size = p["conv_kernel"].shape[0]
  left = size - 1 if is_causal else (size - 1) // 2
  conv = np.tile(p["conv_bias"], (B, T, 1))
  for t in range(T):
    for j in range(size):
      if 0 <= t + j - left < T:
        conv[:, t] += p["conv_kernel"][j] * gated[:, t + j - left]
  out = np.concatenate([heads.reshape(B, T, -1), conv], -1) @ p["out_kernel"] + p["out_bias"]
  return out if lengths is None else np_zero_padding(out, lengths)


@pytest.mark.property("lite")
@pytest.mark.parametrize("is_causal", [False, True])
def test_lite_is_attention_on_one_half_and_convolution_on_the_other(is_causal):
  x = random_tokens(8)
  module, params = module_and_params("lite", x, kernel_size=3)
  assert params["query_kernel"].shape == (E // 2, 2, 2) and params["conv_kernel"].shape == (3, 4)
  assert_module_is_its_formula(module, params, x,
                               lambda lengths: np_lite(x, params, is_causal, lengths), is_causal,
                               dict(mask=padding_mask()))


@pytest.mark.property("lite")
@pytest.mark.parametrize("is_causal", [False, True])
def test_lite_masks_tokens_past_the_query_lengths_as_keys_too(is_causal):
  """With `query_seq_lengths` alone, the tokens past them are padding (the
  family's rule, `tokens.real_tokens`): the convolution already zeroed them,
  and the attention half must not read them as keys either."""
  x = random_tokens(10)
  module, params = module_and_params("lite", x, kernel_size=3)
  assert_module_is_its_formula(module, params, x,
                               lambda lengths: np_lite(x, params, is_causal, lengths), is_causal,
                               dict(query_seq_lengths=jnp.asarray(LENGTHS)))


@pytest.mark.property("lite")
def test_causal_lite_reads_no_later_token():
  x = random_tokens(9, (1, 5, 4))
  module, params = module_and_params("lite", x, kernel_size=3)
  assert_no_output_reads_a_later_token(
      lambda x: jit_apply(module, {"params": params}, x, is_causal=True), x)


@pytest.mark.property("lite")
@pytest.mark.parametrize("shape, fields, message", [
    ((B, T, 7), dict(num_heads=1), r"the model width E \(lite splits it between attention and "
                                   r"convolution\) must be even to be split in two halves, got 7"),
    ((B, T, 6), dict(num_heads=2), r"num_heads=2 must divide the attention half of the width, "
                                   r"E / 2 = 3"),
    ((B, T, 8), dict(num_heads=2, kernel_size=0), r"kernel_size must be an int >= 1, got 0"),
])
def test_lite_refuses_bad_sizes(shape, fields, message):
  with pytest.raises(ValueError, match=message):
    LongShortRangeAttention(**fields).init(jax.random.PRNGKey(0), random_tokens(0, shape))


@pytest.mark.property("lite")
def test_lite_refuses_segments_its_convolution_would_cross():
  with pytest.raises(ValueError, match="'lite' does not support segment_ids"):
    LongShortRangeAttention(num_heads=2).init(
        jax.random.PRNGKey(0), random_tokens(), segment_ids=jnp.zeros((B, T), jnp.int32))



# --------------------------------------------------------------------------------------
# every mixer of the family


@pytest.mark.parametrize("name, fields", [("fnet", {}), ("mlp_mixer", dict(max_length=T)),
                                          ("gmlp", dict(max_length=T)), ("lite", {})])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.int32])
def test_mixers_refuse_a_key_padding_mask_that_is_not_boolean(name, fields, dtype):
  """A mask is boolean, True for a real token (as `dot_product_attention`
  demands). An additive float mask (0 for real, -1e9 for padding) cast to
  bool would mark the real tokens as padding and the padded ones as real."""
  x = random_tokens(12)
  module, params = module_and_params(name, x, **fields)
  additive = jnp.where(padding_mask(), 0, -10 ** 9).astype(dtype)
  with pytest.raises(ValueError, match=rf"mask must be boolean \(True may attend\), got dtype "
                                       rf"{jnp.dtype(dtype).name}"):
    module.apply({"params": params}, x, mask=additive)
  with pytest.raises(ValueError, match=r"mask must be boolean"):
    cross_covariance_attention(x.reshape(B, T, 2, 4), x.reshape(B, T, 2, 4),
                               x.reshape(B, T, 2, 4), mask=additive, temperature=jnp.ones(2))
