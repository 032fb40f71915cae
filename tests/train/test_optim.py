"""make_optimizer / make_schedule: schedule values, decay mask, clipping, accumulation."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from attention_jax.train import make_optimizer, make_schedule

PEAK, WARMUP, TOTAL, END = 2e-3, 10, 110, 1e-4


def _schedule(name, **overrides):
  config = dict(learning_rate=PEAK, warmup_steps=WARMUP, num_train_steps=TOTAL,
                end_learning_rate=END, schedule=name)
  config.update(overrides)
  return make_schedule(config)


@pytest.mark.parametrize("name", ["linear", "cosine", "rsqrt"])
def test_warmup_is_linear_from_zero_to_the_peak(name):
  schedule = _schedule(name)
  for step in (0, 3, 5, WARMUP):
    np.testing.assert_allclose(schedule(step), PEAK * step / WARMUP, rtol=1e-6, atol=1e-12)


def test_cosine_decays_by_half_a_cosine_to_the_end_value():
  schedule = _schedule("cosine")
  for step in (WARMUP + 25, WARMUP + 50, WARMUP + 75, TOTAL, TOTAL + 40):
    progress = min(step - WARMUP, TOTAL - WARMUP) / (TOTAL - WARMUP)
    expected = END + (PEAK - END) * 0.5 * (1 + math.cos(math.pi * progress))
    np.testing.assert_allclose(schedule(step), expected, rtol=1e-5)
  np.testing.assert_allclose(schedule(TOTAL), END, rtol=1e-5)


def test_linear_decays_in_a_straight_line_to_the_end_value():
  schedule = _schedule("linear")
  for step in (WARMUP + 20, WARMUP + 50, TOTAL, TOTAL + 7):
    progress = min(step - WARMUP, TOTAL - WARMUP) / (TOTAL - WARMUP)
    np.testing.assert_allclose(schedule(step), PEAK + (END - PEAK) * progress, rtol=1e-5)


def test_rsqrt_halves_when_the_step_quadruples():
  schedule = _schedule("rsqrt")
  np.testing.assert_allclose(schedule(4 * WARMUP), PEAK / 2, rtol=1e-6)
  np.testing.assert_allclose(schedule(100 * WARMUP), PEAK / 10, rtol=1e-6)


def test_no_warmup_starts_at_the_peak():
  np.testing.assert_allclose(_schedule("cosine", warmup_steps=0)(0), PEAK, rtol=1e-6)


def test_unknown_schedule_names_the_valid_ones():
  with pytest.raises(ValueError, match="linear.*cosine.*rsqrt.*'exponential'"):
    make_optimizer(dict(schedule="exponential"))


def test_unknown_key_is_rejected():
  with pytest.raises(ValueError, match="learnig_rate"):
    make_optimizer(dict(learnig_rate=1e-3))


def test_decay_steps_must_follow_the_warmup():
  with pytest.raises(ValueError, match="num_train_steps"):
    make_optimizer(dict(warmup_steps=100, num_train_steps=100))


def _params():
  return {"dense": {"kernel": jnp.ones((2, 3)), "bias": jnp.ones((3,))},
          "norm": {"scale": jnp.ones((3,))}}


def test_updates_follow_the_schedule():
  # A constant gradient makes Adam's normalised step exactly 1 per coordinate,
  # so each update is -learning_rate(t).
  config = dict(learning_rate=PEAK, warmup_steps=4, num_train_steps=20, schedule="linear",
                weight_decay=0.0, eps=0.0, grad_clip_norm=0.0)
  optimizer = make_optimizer(config)
  params = _params()
  grads = jax.tree.map(lambda p: 0.5 * jnp.ones_like(p), params)
  state = optimizer.init(params)
  for step in range(7):
    updates, state = optimizer.update(grads, state, params)
    expected = PEAK * step / 4 if step <= 4 else PEAK + (0.0 - PEAK) * (step - 4) / 16
    np.testing.assert_allclose(updates["dense"]["kernel"], -expected, rtol=1e-5, atol=1e-12)


def test_weight_decay_skips_biases_and_norm_scales():
  optimizer = make_optimizer(dict(learning_rate=0.1, warmup_steps=0, num_train_steps=10,
                                  schedule="linear", weight_decay=0.5))
  params = _params()
  zero_grads = jax.tree.map(jnp.zeros_like, params)
  updates, _ = optimizer.update(zero_grads, optimizer.init(params), params)
  np.testing.assert_allclose(updates["dense"]["kernel"], -0.1 * 0.5, rtol=1e-6)
  np.testing.assert_array_equal(updates["dense"]["bias"], 0.0)
  np.testing.assert_array_equal(updates["norm"]["scale"], 0.0)


def test_clipping_bounds_the_gradient_adam_sees():
  clip = 0.25
  optimizer = make_optimizer(dict(grad_clip_norm=clip, b1=0.9))
  params = _params()
  grads = jax.tree.map(lambda p: 100.0 * jnp.arange(p.size, dtype=p.dtype).reshape(p.shape) + 1,
                       params)
  assert optax.tree.norm(grads) > 100 * clip
  _, state = optimizer.update(grads, optimizer.init(params), params)
  mu = optax.tree_utils.tree_get(state, "mu")
  # After one step Adam's first moment is (1 - b1) * the gradient it received.
  np.testing.assert_allclose(optax.tree.norm(mu), (1 - 0.9) * clip, rtol=1e-5)


def test_gradient_accumulation_applies_the_mean_every_k_steps():
  k = 3
  config = dict(learning_rate=0.1, warmup_steps=0, num_train_steps=10, schedule="linear",
                weight_decay=0.0, grad_clip_norm=0.0)
  accumulating = make_optimizer(dict(config, grad_accum_steps=k))
  plain = make_optimizer(config)
  params = _params()
  micro = [jax.tree.map(lambda p, i=i: (i + 1.0) * jnp.ones_like(p), params) for i in range(k)]
  state = accumulating.init(params)
  for i, grads in enumerate(micro):
    updates, state = accumulating.update(grads, state, params)
    if i < k - 1:
      assert all(np.all(u == 0) for u in jax.tree.leaves(updates))
  mean = jax.tree.map(lambda *g: sum(g) / k, *micro)
  expected, _ = plain.update(mean, plain.init(params), params)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), updates, expected)
