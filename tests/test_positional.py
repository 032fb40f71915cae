"""Tests of attention_jax.positional against the papers' definitions.

Expected values come from independent numpy / complex-number computations or
are worked out by hand from the definitions, never from the code under test.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_jax import positional
from attention_testing import jit_apply, jit_init

# Jitted once per shape: eager dispatch compiles every primitive separately, which
# dominates the runtime of tests this small.
rope = jax.jit(positional.apply_rope, static_argnames="max_wavelength")
buckets = jax.jit(positional.t5_relative_position_bucket,
                  static_argnames=("bidirectional", "num_buckets", "max_distance"))
sinusoids = jax.jit(positional.sinusoidal_embedding, static_argnums=(1, 2))

def _normal(shape, seed=0, dtype=jnp.float32):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


# --------------------------------------------------------------------------- sinusoidal


def _paper_sinusoids(positions, features, max_timescale=10_000.0):
  """PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(...), one entry at a time."""
  out = np.zeros((len(positions), features))
  for t, pos in enumerate(positions):
    for i in range(features // 2):
      angle = pos / max_timescale ** (2 * i / features)
      out[t, 2 * i], out[t, 2 * i + 1] = np.sin(angle), np.cos(angle)
  return out


def test_sinusoidal_matches_paper_formula():
  positions = [0, 1, 2, 7, 50, 333]
  got = sinusoids(jnp.array(positions), 16)
  assert got.shape == (6, 16)
  np.testing.assert_allclose(got, _paper_sinusoids(positions, 16), atol=2e-5)
  got = sinusoids(jnp.array(positions, jnp.float32), 6, 50.0)
  np.testing.assert_allclose(got, _paper_sinusoids(positions, 6, 50.0), atol=2e-5)


def test_sinusoidal_batched_positions():
  positions = jnp.array([[0, 1, 2], [5, 6, 9]])
  got = sinusoids(positions, 8)
  assert got.shape == (2, 3, 8)
  np.testing.assert_allclose(got[1], _paper_sinusoids([5, 6, 9], 8), atol=2e-5)


def test_sinusoidal_shift_is_a_fixed_linear_map():
  # The paper's motivation: PE(pos + k) = M_k PE(pos) for a matrix M_k independent
  # of pos. Fit M_k on some positions and check it on others.
  features, shift = 8, 5
  table = np.asarray(sinusoids(jnp.arange(200), features), np.float64)
  fit, held_out = np.arange(0, 100), np.arange(100, 195)
  m, *_ = np.linalg.lstsq(table[fit], table[fit + shift], rcond=None)
  np.testing.assert_allclose(table[held_out] @ m, table[held_out + shift], atol=1e-3)


def test_sinusoidal_odd_features_raises():
  with pytest.raises(ValueError, match=r"features must be a positive even int, got 7"):
    positional.sinusoidal_embedding(jnp.arange(4), 7)


def test_sinusoidal_module_adds_embedding_and_has_no_params():
  x = _normal((2, 5, 8))
  module = positional.SinusoidalPositionEmbedding()
  variables = jax.jit(module.init)(jax.random.PRNGKey(0), x)
  assert not jax.tree_util.tree_leaves(variables)
  apply = jax.jit(module.apply)
  np.testing.assert_allclose(apply(variables, x), x + _paper_sinusoids(range(5), 8), atol=2e-5)
  positions = jnp.array([[0, 1, 2, 0, 1], [3, 4, 5, 6, 7]])
  got = apply(variables, x, positions)
  np.testing.assert_allclose(got[0], x[0] + _paper_sinusoids([0, 1, 2, 0, 1], 8), atol=2e-5)
  np.testing.assert_allclose(got[1], x[1] + _paper_sinusoids([3, 4, 5, 6, 7], 8), atol=2e-5)
  assert apply(variables, x.astype(jnp.bfloat16)).dtype == jnp.bfloat16


def test_sinusoidal_module_bad_inputs():
  module = positional.SinusoidalPositionEmbedding()
  with pytest.raises(ValueError, match=r"x must be \[B, T, E\], got shape \(5, 8\)"):
    jit_init(module, jax.random.PRNGKey(0), jnp.zeros((5, 8)))
  with pytest.raises(ValueError, match=r"positions must be \[T\] or \[B, T\].*\(4,\)"):
    jit_init(module, jax.random.PRNGKey(0), jnp.zeros((2, 5, 8)), jnp.arange(4))


# --------------------------------------------------------------------------- learned


def test_learned_param_shape_axes_and_output():
  x = _normal((2, 3, 4))
  module = positional.LearnedPositionEmbedding(max_length=6)
  variables = jax.jit(module.init)(jax.random.PRNGKey(1), x)
  boxed = variables["params"]["embedding"]
  assert isinstance(boxed, nn.LogicallyPartitioned)
  assert boxed.names == ("length", "embed")
  table = np.asarray(nn.unbox(variables)["params"]["embedding"])
  assert table.shape == (6, 4)
  assert 0.005 < table.std() < 0.05  # normal(stddev=0.02)
  apply = jax.jit(module.apply)
  np.testing.assert_allclose(apply(variables, x), x + table[:3], atol=1e-6)
  positions = jnp.array([[5, 0, 2], [1, 1, 4]])
  got = apply(variables, x, positions)
  np.testing.assert_allclose(got, x + table[np.asarray(positions)], atol=1e-6)


def test_learned_too_long_raises():
  module = positional.LearnedPositionEmbedding(max_length=4)
  with pytest.raises(ValueError, match=r"sequence length 5 exceeds max_length 4"):
    jit_init(module, jax.random.PRNGKey(0), jnp.zeros((1, 5, 8)))
  x = jnp.zeros((1, 3, 8))
  variables = jit_init(module, jax.random.PRNGKey(0), x)
  with pytest.raises(ValueError, match=r"max_length=4.*\[0, 4\]"):  # eager: a value check
    module.apply(variables, x, jnp.array([0, 2, 4]))
  with pytest.raises(ValueError, match=r"positions must be integers"):
    jit_apply(module, variables, x, jnp.array([0.0, 1.0, 2.0]))


# --------------------------------------------------------------------------- RoPE


def _complex_rope(x, positions, max_wavelength=10_000.0):
  """Rotate-half RoPE as complex multiplication: z_i = x_i + 1j x_{i+D/2}, z_i *= e^{j pos theta_i}."""
  x = np.asarray(x, np.float64)
  positions = np.broadcast_to(np.asarray(positions, np.float64), x.shape[:2])
  half = x.shape[-1] // 2
  theta = max_wavelength ** (-2.0 * np.arange(half) / x.shape[-1])
  z = (x[..., :half] + 1j * x[..., half:]) * np.exp(1j * positions[:, :, None, None] * theta)
  return np.concatenate([z.real, z.imag], axis=-1)


def test_rope_matches_complex_rotation():
  x = _normal((2, 5, 3, 8))
  positions = jnp.array([[0, 1, 2, 3, 4], [7, 3, 100, 0, 12]])
  np.testing.assert_allclose(rope(x, positions), _complex_rope(x, positions),
                             atol=1e-4)
  np.testing.assert_allclose(rope(x, jnp.arange(5), max_wavelength=100.0),
                             _complex_rope(x, np.arange(5), 100.0), atol=1e-4)


def test_rope_preserves_norms():
  x = _normal((2, 6, 2, 16), seed=3)
  out = rope(x, jnp.arange(6) * 37)
  np.testing.assert_allclose(jnp.linalg.norm(out, axis=-1), jnp.linalg.norm(x, axis=-1),
                             rtol=1e-5)


def test_rope_dot_products_depend_on_relative_position_only():
  q, k = _normal((1, 6, 2, 8), seed=1), _normal((1, 6, 2, 8), seed=2)
  positions = jnp.arange(6)

  def logits(offset):
    rq = rope(q, positions + offset)
    rk = rope(k, positions + offset)
    return jnp.einsum("bqhd,bkhd->bhqk", rq, rk)

  np.testing.assert_allclose(logits(0), logits(11), atol=1e-4)
  # Guard: the rotation must actually change the logits.
  plain = jnp.einsum("bqhd,bkhd->bhqk", q, k)
  assert np.abs(np.asarray(logits(0)) - np.asarray(plain)).max() > 1e-2


def test_rope_jit_batched_positions_and_dtype():
  x = _normal((2, 4, 2, 8)).astype(jnp.bfloat16)
  positions = jnp.array([[0, 1, 2, 3], [5, 6, 7, 8]])
  out = rope(x, positions)
  assert out.dtype == jnp.bfloat16 and out.shape == x.shape
  np.testing.assert_allclose(np.asarray(out, np.float32), _complex_rope(x.astype(jnp.float32),
                                                                        positions), atol=5e-2)


def test_rope_bad_inputs():
  with pytest.raises(ValueError, match=r"even head dim D.*\(1, 4, 2, 7\)"):
    positional.apply_rope(jnp.zeros((1, 4, 2, 7)), jnp.arange(4))
  with pytest.raises(ValueError, match=r"x must be \[B, T, H, D\], got shape \(4, 2, 8\)"):
    positional.apply_rope(jnp.zeros((4, 2, 8)), jnp.arange(4))
  with pytest.raises(ValueError, match=r"positions must be \[T\] or \[B, T\].*\(3, 4\)"):
    positional.apply_rope(jnp.zeros((2, 4, 2, 8)), jnp.zeros((3, 4), jnp.int32))


# --------------------------------------------------------------------------- ALiBi


def test_alibi_slopes_powers_of_two():
  # Press et al. 2022, section 3: 8 heads use 1/2, 1/4, ..., 1/256; 16 heads 1/2^0.5, ..., 1/2^8.
  np.testing.assert_allclose(positional.alibi_slopes(8), [1 / 2 ** h for h in range(1, 9)],
                             rtol=1e-6)
  np.testing.assert_allclose(positional.alibi_slopes(16),
                             [2.0 ** (-h / 2) for h in range(1, 17)], rtol=1e-6)


def test_alibi_slopes_other_head_counts():
  # 12 heads: the 8-head slopes, then every other 16-head slope: 2^-0.5, 2^-1.5, 2^-2.5, 2^-3.5.
  expected = [2.0 ** -h for h in range(1, 9)] + [2.0 ** -0.5, 2.0 ** -1.5, 2.0 ** -2.5,
                                                  2.0 ** -3.5]
  np.testing.assert_allclose(positional.alibi_slopes(12), expected, rtol=1e-6)
  # 3 heads: the 2-head slopes 2^-4, 2^-8, then the first 4-head slope 2^-2.
  np.testing.assert_allclose(positional.alibi_slopes(3), [2.0 ** -4, 2.0 ** -8, 2.0 ** -2],
                             rtol=1e-6)


def test_alibi_bias_values():
  bias = positional.alibi_bias(2, jnp.arange(3), jnp.arange(4))
  assert bias.shape == (1, 2, 3, 4) and bias.dtype == jnp.float32
  distance = np.array([[0, 1, 2, 3], [1, 0, 1, 2], [2, 1, 0, 1]])
  np.testing.assert_allclose(bias[0, 0], -distance / 16, rtol=1e-6)
  np.testing.assert_allclose(bias[0, 1], -distance / 256, rtol=1e-6)


def test_alibi_bias_batched_positions_under_jit():
  q_positions = jnp.array([[0, 1], [10, 11]])
  bias = jax.jit(positional.alibi_bias, static_argnums=0)(1, q_positions, jnp.arange(3))
  assert bias.shape == (2, 1, 2, 3)
  np.testing.assert_allclose(bias[1, 0], -np.array([[10, 9, 8], [11, 10, 9]]) / 256, rtol=1e-6)


def test_alibi_bad_inputs():
  with pytest.raises(ValueError, match=r"num_heads must be a positive int, got 0"):
    positional.alibi_slopes(0)
  with pytest.raises(ValueError, match=r"q_positions must be \[T\] or \[B, T\].*\(1, 2, 3\)"):
    positional.alibi_bias(2, jnp.zeros((1, 2, 3), jnp.int32), jnp.arange(3))
  with pytest.raises(ValueError, match=r"incompatible batch sizes.*\(2, 3\).*\(3, 3\)"):
    positional.alibi_bias(2, jnp.zeros((2, 3), jnp.int32), jnp.zeros((3, 3), jnp.int32))


# --------------------------------------------------------------------------- T5


# (k_pos - q_pos, bucket) worked out by hand for num_buckets=32, max_distance=128.
# Bidirectional: 16 buckets per direction, the first 8 exact; keys before the query
# use 0..15, keys after it 16..31; larger distances get 8 + floor(8 log(d/8) / log 16).
BIDIRECTIONAL = [(0, 0), (-1, 1), (-3, 3), (-7, 7), (-8, 8), (-20, 10), (-127, 15), (-128, 15),
                 (-10_000, 15), (1, 17), (3, 19), (7, 23), (20, 26), (10_000, 31)]
# Unidirectional: 32 buckets, the first 16 exact, keys after the query in bucket 0;
# larger distances get 16 + floor(16 log(d/16) / log 8).
UNIDIRECTIONAL = [(0, 0), (5, 0), (1000, 0), (-5, 5), (-15, 15), (-16, 16), (-40, 23),
                  (-128, 31), (-10_000, 31)]


@pytest.mark.parametrize("bidirectional,cases", [(True, BIDIRECTIONAL), (False, UNIDIRECTIONAL)])
def test_t5_buckets_hand_worked(bidirectional, cases):
  relative, expected = map(np.array, zip(*cases))
  got = buckets(jnp.array(relative), bidirectional=bidirectional)
  assert got.dtype == jnp.int32
  np.testing.assert_array_equal(got, expected)


def test_t5_buckets_monotone_and_in_range():
  distance = jnp.arange(0, 400)
  before = np.asarray(buckets(-distance, num_buckets=16,
                                                             max_distance=64))
  after = np.asarray(buckets(distance[1:], num_buckets=16,
                                                            max_distance=64))
  assert np.all(np.diff(before) >= 0) and np.all(np.diff(after) >= 0)
  assert set(before) == set(range(8)) and set(after) == set(range(9, 16))


def test_t5_bucket_bad_inputs():
  with pytest.raises(ValueError, match=r"num_buckets must be .*got 7 with bidirectional=True"):
    positional.t5_relative_position_bucket(jnp.arange(3), num_buckets=7)
  with pytest.raises(ValueError, match=r"max_distance must exceed .* got 8"):
    positional.t5_relative_position_bucket(jnp.arange(3), max_distance=8)
  with pytest.raises(ValueError, match=r"relative_position must be an integer array.*float32"):
    positional.t5_relative_position_bucket(jnp.arange(3.0))


def test_t5_module_params_and_bias():
  module = positional.T5RelativePositionBias(num_heads=3)
  q_positions, k_positions = jnp.array([[0, 1, 2, 3], [4, 5, 6, 7]]), jnp.arange(5)
  variables = jax.jit(module.init)(jax.random.PRNGKey(0), q_positions, k_positions)
  boxed = variables["params"]["rel_embedding"]
  assert boxed.names == ("relpos_buckets", "heads")
  assert boxed.value.shape == (32, 3)

  # A table whose entries name their (bucket, head) makes the lookup checkable.
  table = jnp.arange(32)[:, None] * 10.0 + jnp.arange(3)[None, :]
  bias = jax.jit(module.apply)({"params": {"rel_embedding": table}}, q_positions, k_positions)
  assert bias.shape == (2, 3, 4, 5) and bias.dtype == jnp.float32
  for b, i, j, h in [(0, 0, 0, 0), (0, 2, 4, 1), (0, 3, 0, 2), (1, 0, 0, 2), (1, 3, 4, 0)]:
    rel = j - (4 * b + i)
    bucket = -rel if rel <= 0 else 16 + rel  # all offsets here are exact buckets
    assert bias[b, h, i, j] == bucket * 10 + h


def test_t5_module_equal_offsets_equal_bias():
  module = positional.T5RelativePositionBias(num_heads=2, num_buckets=8, max_distance=16)
  positions = jnp.arange(20)
  variables = jax.jit(module.init)(jax.random.PRNGKey(0), positions, positions)
  bias = np.asarray(jax.jit(module.apply)(variables, positions, positions))
  # Toeplitz: bias[i, j] depends only on j - i.
  np.testing.assert_array_equal(bias[:, :, 1:, 1:], bias[:, :, :-1, :-1])
  # Every bucket is used except num_buckets / 2: offset 0 counts as "before".
  assert len(np.unique(bias[0, 0])) == 7


# --------------------------------------------------------------------------- dispatcher


def test_check_position_encoding():
  for name in ("none", "sinusoidal", "learned", "complex", "rope", "xpos", "alibi", "t5",
               "xl_relative", "shaw"):
    assert positional.check_position_encoding(name) == name
  with pytest.raises(ValueError, match=r"unknown position encoding 'yarn'. Valid names are: "
                                       r"none, sinusoidal, learned, complex, rope, xpos, alibi, "
                                       r"t5, xl_relative, shaw"):
    positional.check_position_encoding("yarn")


# --------------------------------------------------------------------------- complex


def _complex_params(vocab=7, features=8, seed=3):
  module = positional.ComplexWordEmbedding(vocab, features)
  tokens = jnp.zeros((1, 3), jnp.int32)
  return module, nn.meta.unbox(jit_init(module, jax.random.PRNGKey(seed), tokens)["params"])


def test_complex_embedding_matches_the_complex_formula():
  module, params = _complex_params()
  tokens = jnp.array([[3, 1, 3, 6]])
  positions = jnp.array([0, 5, 9, 2])
  got = jit_apply(module, {"params": params}, tokens, positions)
  r, w, theta = (np.asarray(params[name], np.float64) for name in ("amplitude", "frequency",
                                                                    "phase"))
  for t, (token, pos) in enumerate(zip(np.asarray(tokens[0]), np.asarray(positions))):
    wave = r[token] * np.exp(1j * (w[token] * pos + theta[token]))
    np.testing.assert_allclose(got[0, t], np.concatenate([wave.real, wave.imag]), rtol=1e-5,
                               atol=1e-5)


def test_complex_embedding_shift_is_a_fixed_rotation_of_each_dimension():
  """f(j, pos + k) = f(j, pos) * exp(i w_j k), the same map for every pos."""
  module, params = _complex_params()
  tokens = jnp.array([[2, 5, 2]])
  shift = 4
  at = lambda pos: np.asarray(jit_apply(module, {"params": params}, tokens, pos), np.float64)
  as_complex = lambda x: x[..., :4] + 1j * x[..., 4:]
  rotation = np.exp(1j * np.asarray(params["frequency"], np.float64)[np.asarray(tokens)] * shift)
  for start in (0, 11):
    positions = jnp.arange(3) + start
    np.testing.assert_allclose(as_complex(at(positions + shift)),
                               as_complex(at(positions)) * rotation, rtol=1e-4, atol=1e-4)


def test_complex_embedding_in_a_model_and_bad_features():
  from attention_jax.models import ModelConfig, build_model  # pylint: disable=import-outside-toplevel
  config = ModelConfig.from_config(dict(kind="language_model", vocab_size=11, num_layers=1,
                                        embed_dim=16, num_heads=2, mlp_dim=32, max_length=8,
                                        position="complex"))
  model = build_model(config)
  tokens = jnp.ones((2, 8), jnp.int32)
  variables = jit_init(model, jax.random.PRNGKey(0), tokens)
  assert set(variables["params"]["encoder"]["token_embedding"]) == {"amplitude", "frequency",
                                                                    "phase"}
  # The same token at two positions embeds differently: the order is in the embedding.
  logits = jit_apply(model, variables, tokens)
  assert np.abs(np.asarray(logits[:, 0] - logits[:, 5])).max() > 1e-4
  with pytest.raises(ValueError, match="features must be a positive even int"):
    positional.ComplexWordEmbedding(5, 7).init(jax.random.PRNGKey(0), jnp.zeros((1, 2),
                                                                                 jnp.int32))
