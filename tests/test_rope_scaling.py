"""RoPE's extensions against numpy formulas: position interpolation, NTK-aware
and YaRN scaling, partial RoPE and xPos; NoPE's constraint."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attention_jax as aj
from attention_jax import positional
from attention_jax.models import ModelConfig
from attention_testing import assert_close, jit_apply, jit_init

B, T, H, D = 2, 9, 3, 8
BASE = 10_000.0


def _np_rotate(x, positions, inv_freq, rotary_dim):
  """Pair i with i + rotary_dim / 2 and turn it by positions * inv_freq[i],
  one 2x2 rotation at a time; features past rotary_dim unchanged."""
  half = rotary_dim // 2
  out = np.array(x, np.float64)
  for t in range(x.shape[1]):
    for i in range(half):
      angle = positions[t] * inv_freq[i]
      a, b = x[:, t, :, i].astype(np.float64), x[:, t, :, i + half].astype(np.float64)
      out[:, t, :, i] = a * np.cos(angle) - b * np.sin(angle)
      out[:, t, :, i + half] = b * np.cos(angle) + a * np.sin(angle)
  return out


def _x(seed=0):
  return jax.random.normal(jax.random.PRNGKey(seed), (B, T, H, D))


POSITIONS = np.arange(T) * 3.0  # long enough strides for the scalings to matter
THETA = BASE ** (-np.arange(D // 2) * 2 / D)


@pytest.mark.parametrize("options, inv_freq, factor", [
    ({}, THETA, 1.0),
    # Position interpolation (Chen et al. 2023): positions / s.
    ({"scaling": "linear", "scaling_factor": 4.0}, THETA / 4.0, 1.0),
    # NTK-aware: the base grown to b s^(d / (d - 2)).
    ({"scaling": "ntk", "scaling_factor": 4.0},
     (BASE * 4.0 ** (D / (D - 2))) ** (-np.arange(D // 2) * 2 / D), 1.0),
])
def test_rope_and_its_scalings_rotate_by_the_formula(options, inv_freq, factor):
  x = _x()
  got = positional.Rotary.from_options(options)(x, jnp.asarray(POSITIONS))
  assert_close(got, factor * _np_rotate(np.asarray(x), POSITIONS, inv_freq, D), rtol=1e-5,
               atol=1e-5)


def test_yarn_interpolates_by_parts_and_scales_by_its_temperature():
  s, length = 8.0, 1024
  x = _x(1)
  got = positional.Rotary.from_options({"scaling": "yarn", "scaling_factor": s,
                                        "original_length": length})(x, jnp.asarray(POSITIONS))
  # Peng et al. 2023 (eqs. 17-22), with alpha = 1, beta = 32 turns in L = 1024.
  wavelengths = 2 * np.pi / THETA
  turns = length / wavelengths
  ramp = np.clip((turns - 1.0) / (32.0 - 1.0), 0.0, 1.0)
  inv_freq = (1 - ramp) * THETA / s + ramp * THETA
  temperature = 0.1 * np.log(s) + 1.0
  assert ramp[0] == 1.0 and ramp[-1] == 0.0  # the fastest kept, the slowest interpolated
  assert_close(got, temperature * _np_rotate(np.asarray(x), POSITIONS, inv_freq, D), rtol=1e-5,
               atol=1e-5)


def test_partial_rope_rotates_the_first_fraction_of_the_features_only():
  x = jax.random.normal(jax.random.PRNGKey(2), (B, T, H, 16))
  got = positional.Rotary.from_options({"rotary_fraction": 0.25})(x, jnp.asarray(POSITIONS))
  inv_freq = BASE ** (-np.arange(2) * 2 / 4)  # 4 rotated features: 2 pairs
  want = _np_rotate(np.asarray(x), POSITIONS, inv_freq, 4)
  assert_close(got, want, rtol=1e-5, atol=1e-5)
  assert_close(got[..., 4:], x[..., 4:])


def test_xpos_scales_queries_up_and_keys_down_by_zeta_to_the_position():
  x = _x(3)
  rotary = positional.Rotary.from_options({"scale_base": 16.0}, xpos=True)
  rotated = _np_rotate(np.asarray(x), POSITIONS, THETA, D)
  zeta = (np.arange(D // 2) * 2 / D + 0.4) / 1.4
  power = POSITIONS[None, :, None, None] / 16.0
  scale = np.concatenate([zeta, zeta]) ** power
  assert_close(rotary(x, jnp.asarray(POSITIONS)), rotated * scale, rtol=1e-5, atol=1e-5)
  assert_close(rotary(x, jnp.asarray(POSITIONS), is_key=True), rotated / scale, rtol=1e-5,
               atol=1e-5)


@pytest.mark.parametrize("options, xpos", [
    ({"scaling": "yarn", "scaling_factor": 4.0, "original_length": 16, "rotary_fraction": 0.5},
     False),
    ({"scale_base": 32.0}, True)])
def test_scores_depend_on_the_distance_only(options, xpos):
  rotary = positional.Rotary.from_options(options, xpos=xpos)
  q, k = _x(4)[:, :1], _x(5)[:, :1]
  score = lambda n, m: jnp.sum(rotary(q, jnp.asarray([n])) * rotary(k, jnp.asarray([m]),
                                                                     is_key=True))
  assert_close(score(7.0, 2.0), score(12.0, 7.0), rtol=1e-4, atol=1e-5)
  assert abs(float(score(7.0, 2.0)) - float(score(9.0, 2.0))) > 1e-4


def test_xpos_scores_stay_finite_far_from_position_zero():
  """zeta^(n / B) leaves float32 past n ~ 36K at B = 512 (zeta_0 = 0.29); the
  layer centres the exponent between a call's queries and keys, which changes
  no score (they depend on n - m), so a window far into a sequence scores as
  the same window at its start."""
  layer = aj.MultiHeadAttention(num_heads=2, qkv_features=16, position="xpos")
  x = jax.random.normal(jax.random.PRNGKey(6), (1, 12, 16))
  variables = jit_init(layer, jax.random.PRNGKey(7), x, is_causal=True)
  near = jit_apply(layer, variables, x, is_causal=True, positions=jnp.arange(12))
  far = jit_apply(layer, variables, x, is_causal=True, positions=jnp.arange(12) + 60_000)
  assert np.isfinite(np.asarray(far)).all()
  # float32 angles near 60,000 rad are a few 1e-3 off, as in plain RoPE there.
  assert_close(far, near, rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize("overrides, message", [
    (dict(position="rope", position_options={"scaling": "linear", "scaling_factor": 0.5}),
     r"scaling_factor must be >= 1"),
    (dict(position="rope", position_options={"scaling": "yarn", "scaling_factor": 2.0}),
     "needs original_length"),
    (dict(position="rope", position_options={"scaling": "dynamic"}), "scaling must be one of"),
    # A factor without a scaling would be ignored: plain RoPE, not the
    # stretch asked for.
    (dict(position="rope", position_options={"scaling_factor": 4.0}),
     r"scaling_factor=4.0 needs a scaling"),
    # YaRN's ramp divides by beta_fast - beta_slow.
    (dict(position="rope", position_options={"scaling": "yarn", "scaling_factor": 2.0,
                                             "original_length": 64, "beta_fast": 1.0}),
     r"beta_fast must exceed beta_slow"),
    (dict(position="rope", position_options={"wavelength": 500.0}),
     r"\['wavelength'\] are not options of rope"),
    (dict(position="xpos", position_options={"rotary_fraction": 1.5}),
     r"rotary_fraction must be in \(0, 1\]"),
    (dict(position="none"), r"model.position='none' \(NoPE\) .* its encoder"),
])
def test_bad_position_settings_are_named_at_build(overrides, message):
  with pytest.raises(ValueError, match=message):
    ModelConfig.from_config(dict(embed_dim=16, num_heads=2, mlp_dim=32, **overrides))
