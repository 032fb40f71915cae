"""The universal stack: one shared block over the steps, ACT halting against a
per-position NumPy reading of Graves (2016), the ponder cost, the errors."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_jax import positional
from attention_jax.models import Block, LayerStack, ModelConfig, build_model
from attention_jax.models.universal import adaptive_computation
from attention_jax.train.steps import sown_losses
from attention_testing import (assert_causal_language_model, jit_apply, jit_call, jit_init,
                               perturbed, small_stack_config)

B, T, E = 2, 8, 16


def _config(**overrides) -> ModelConfig:
  return small_stack_config(T, **{"num_layers": 4, "stack": "universal", **overrides})


def _x(seed=0):
  return jax.random.normal(jax.random.PRNGKey(seed), (B, T, E))


def _params(config, halting_bias=None):
  params = perturbed(nn.meta.unbox(jit_init(LayerStack(config), jax.random.PRNGKey(1),
                                             _x())["params"]))
  if halting_bias is not None:
    params["universal"]["halting"]["bias"] = jnp.full((1,), halting_bias)
  return params


def _padding_mask(lengths=(T, 5)):
  return (jnp.arange(T)[None] < jnp.array(lengths)[:, None])[:, None, None, :]


def np_act(states, halting, threshold):
  """Graves (2016) per position, from its definitions.

  states: [N, E], s_1..s_N; halting: [N], h_1..h_N. N' = min{n : h_1 + ... +
  h_n >= threshold}, at most N; R = 1 - (h_1 + ... + h_{N'-1}); the output is
  h_1 s_1 + ... + h_{N'-1} s_{N'-1} + R s_N'. Returns (output, N', R, p).
  """
  num_steps = len(halting)
  halt_at = num_steps
  for n in range(1, num_steps + 1):
    if sum(halting[:n]) >= threshold:
      halt_at = n
      break
  remainder = 1.0 - sum(halting[:halt_at - 1])
  weights = np.zeros(num_steps)
  weights[:halt_at - 1] = halting[:halt_at - 1]
  weights[halt_at - 1] = remainder
  return (weights[:, None] * states).sum(0), halt_at, remainder, weights


def test_act_arithmetic_equals_the_definitions_position_by_position():
  # A toy step that acts on each position alone, so every position's states
  # s_1..s_N can be computed without halting (a halted position's later
  # states are unused). The last channel is a marker the step keeps: where
  # it is 10 (position [1, 0]) the halting probability is 1 at step 1.
  rng = np.random.default_rng(0)
  num_steps, threshold = 5, 0.9
  w_step = rng.standard_normal((E - 1, E - 1)).astype(np.float32) / 4
  w_halt = rng.standard_normal(E).astype(np.float32)
  x = rng.standard_normal((B, T, E)).astype(np.float32)
  x[..., -1] = np.clip(x[..., -1], -1, 1)
  x[1, 0, -1] = 10.0

  def step(state, n):
    return jnp.concatenate([jnp.tanh(state[..., :-1] @ w_step + 0.1 * (n + 1)),
                            state[..., -1:]], axis=-1)

  def halt(state):
    logits = state @ w_halt - 1.0
    return jax.nn.sigmoid(jnp.where(state[..., -1] > 5, 100.0, logits))

  halted = jax.jit(lambda x: adaptive_computation(step, halt, x, num_steps, threshold))(x)
  # Read on the host: indexing the device arrays per position is a program per index shape.
  halted = jax.tree.map(np.asarray, halted)

  @jax.jit
  def unhalted(x):
    """Every step's state s_1..s_N [N, B, T, E] and halting probability [N, B, T]."""
    states = [x]
    for n in range(num_steps):
      states.append(step(states[-1], n))
    states = jnp.stack(states[1:])
    return states, jax.vmap(halt)(states)

  states, probabilities = map(np.asarray, unhalted(x))
  seen = set()
  for b in range(B):
    for t in range(T):
      output, halt_at, remainder, weights = np_act(states[:, b, t], probabilities[:, b, t],
                                                   threshold)
      seen.add(halt_at)
      assert int(halted.steps[b, t]) == halt_at
      np.testing.assert_allclose(halted.remainders[b, t], remainder, rtol=1e-5, atol=1e-6)
      np.testing.assert_allclose(halted.weights[:, b, t], weights, rtol=1e-5, atol=1e-6)
      np.testing.assert_allclose(halted.halting_probabilities[:halt_at, b, t],
                                 probabilities[:halt_at, b, t], rtol=1e-5)
      np.testing.assert_allclose(halted.output[b, t], output, rtol=1e-5, atol=1e-6)
      np.testing.assert_allclose(halted.ponder_cost[b, t], halt_at + remainder, rtol=1e-5)
  # The example reaches every kind of halt: at step 1, in between, forced at N.
  assert {1, 2, num_steps} <= seen, seen
  assert int(halted.steps[1, 0]) == 1
  np.testing.assert_allclose(halted.output[1, 0], states[0, 1, 0], rtol=1e-6, atol=1e-6)


def _step_signal(step):
  """What step `step` [1] adds: its timestep's sinusoids and the positions'."""
  return (positional.sinusoidal_embedding(step, E)
          + positional.sinusoidal_embedding(jnp.arange(T), E))


def _run_universal_by_hand(config, params, x, mask):
  """The universal stack written out: step n adds the timestep's (and the
  positions') sinusoids and applies the one block to the whole sequence; the
  halting unit reads the new state; a halted position's state is copied
  on. Returns (output [B, T, E], N' [B, T], R [B, T])."""
  block = Block(_config(stack="standard"))
  block_params = {"params": params["universal"]["block"]}
  w = np.asarray(params["universal"]["halting"]["kernel"])[:, 0]
  bias = float(params["universal"]["halting"]["bias"][0])
  state = np.asarray(x)
  trajectory, probabilities, running = [], [], np.ones((B, T), bool)
  cumulative = np.zeros((B, T))
  for n in range(config.num_layers):
    signal = jit_call(_step_signal, jnp.array([n + 1]))
    new, _ = jit_apply(block, block_params, state + signal, {}, mask)
    state = np.where(running[..., None], np.asarray(new), state)
    h = 1 / (1 + np.exp(-(state @ w + bias)))
    trajectory.append(state)
    probabilities.append(h)
    cumulative = cumulative + np.where(running, h, 0.0)
    running = running & (cumulative < config.act_threshold)
  output = np.zeros((B, T, E))
  steps, remainders = np.zeros((B, T), int), np.zeros((B, T))
  for b in range(B):
    for t in range(T):
      output[b, t], steps[b, t], remainders[b, t], _ = np_act(
          np.stack(trajectory)[:, b, t], np.stack(probabilities)[:, b, t], config.act_threshold)
  return output, steps, remainders


@pytest.mark.parametrize("halting_bias", [-1.0, 0.0])
def test_stack_equals_the_block_and_act_written_out(halting_bias):
  config = _config(ponder_cost_weight=0.5, act_threshold=0.9)
  params, x, mask = _params(config, halting_bias), _x(2), _padding_mask()
  (out, _), sown = jax.jit(lambda p, x: LayerStack(config).apply(
      {"params": p}, x, mask=mask, mutable=["losses"]))(params, x)
  expected, steps, remainders = _run_universal_by_hand(config, params, x, mask)
  np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-5)
  assert len(set(steps.ravel())) > 1  # positions halt at different steps
  # The ponder cost: mean of N' + R over the real positions, times the weight.
  real = np.asarray(mask[:, 0, 0, :])
  ponder = 0.5 * (steps + remainders)[real].mean()
  (sown_ponder,) = sown["losses"]["universal"]["ponder_cost"]
  np.testing.assert_allclose(sown_ponder, ponder, rtol=1e-5)
  np.testing.assert_allclose(sown_losses(sown), ponder, rtol=1e-5)
  assert not np.isclose(ponder, 0.5 * (steps + remainders).mean())  # padding excluded


def test_without_act_it_is_the_same_block_applied_num_layers_times():
  config = _config(act_halting=False, position="learned")
  params, x = _params(config), _x(3)
  assert set(params["universal"]) == {"block"}
  out, _ = jit_apply(LayerStack(config), {"params": params}, x)
  block = Block(_config(stack="standard"))
  expected = x
  for n in range(config.num_layers):
    # Learned positions act at the embedding: each step adds the timestep only.
    signal = jit_call(positional.sinusoidal_embedding, jnp.array([n + 1]), E)
    expected, _ = jit_apply(block, {"params": params["universal"]["block"]}, expected + signal)
  np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)


def test_a_position_halting_with_probability_one_at_step_one_gets_that_state():
  config = _config()
  params, x = _params(config, halting_bias=100.0), _x(4)  # sigmoid(100) = 1 in float32
  (out, _), sown = jit_apply(LayerStack(config), {"params": params}, x, mutable=["losses"])
  signal = jit_call(_step_signal, jnp.array([1]))
  first, _ = jit_apply(Block(_config(stack="standard")),
                       {"params": params["universal"]["block"]}, x + signal)
  np.testing.assert_allclose(out, first, rtol=1e-6, atol=1e-6)
  # N' = 1 and R = 1 - 0 = 1 everywhere.
  np.testing.assert_allclose(sown_losses(sown), config.ponder_cost_weight * 2.0, rtol=1e-6)


def test_one_block_whatever_the_number_of_steps():
  shapes = [jax.tree.map(jnp.shape, _params(_config(num_layers=n))) for n in (1, 2, 6)]
  assert set(shapes[0]) == {"universal"}
  assert set(shapes[0]["universal"]) == {"block", "halting"}
  assert shapes[0] == shapes[1] == shapes[2]


@pytest.mark.parametrize("kind", ["classifier", "dual_classifier", "language_model",
                                  "masked_language_model"])
def test_every_stacked_model_kind_trains_with_the_ponder_cost(kind):
  config = _config(kind=kind, num_classes=3, dropout_rate=0.1, remat_policy="full")
  model = build_model(config)
  tokens = jax.random.randint(jax.random.PRNGKey(0), (B, T), 1, 11)
  inputs = (tokens, tokens[::-1]) if kind == "dual_classifier" else (tokens,)
  params = perturbed(nn.meta.unbox(jit_init(model, jax.random.PRNGKey(1), *inputs)["params"]))

  def loss(params):
    out, sown = jit_apply(model, {"params": params}, *inputs, deterministic=False,
                          rngs={"dropout": jax.random.PRNGKey(2)}, mutable=["losses"])
    return jnp.mean(out ** 2) + sown_losses(sown), sown

  (value, sown), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
  assert np.isfinite(value) and float(sown_losses(sown)) > 0
  assert all(np.isfinite(leaf).all() for leaf in jax.tree.leaves(grads))
  # The ponder cost reaches the halting unit (through R).
  assert float(jnp.abs(grads["encoder"]["universal"]["halting"]["bias"]).sum()) > 0


def test_universal_language_model_is_causal():
  config = _config(kind="language_model", act_threshold=0.7)
  assert_causal_language_model(build_model(config), B, T, cut=5, vocab_size=11)


@pytest.mark.parametrize("overrides, message", [
    (dict(act_threshold=0.0), r"model.act_threshold must be in \(0, 1\] .*got 0.0"),
    (dict(act_threshold=1.5), r"model.act_threshold must be in \(0, 1\] .*got 1.5"),
    (dict(ponder_cost_weight=-1.0), r"model.ponder_cost_weight must be >= 0, got -1.0"),
    (dict(layer_attention=("local", "dot_product")),
     r"model.layer_attention=\('local', 'dot_product'\) schedules several"),
    (dict(decode=True, kind="language_model"), r"model.stack='universal' cannot decode"),
    (dict(scan_layers=True), r"model.scan_layers scans the standard stack's blocks"),
])
def test_bad_values_are_named(overrides, message):
  with pytest.raises(ValueError, match=message):
    _config(**overrides)
