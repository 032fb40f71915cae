"""LayerDrop: the standard stack skipping blocks in training, and only there."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_jax.models import Block, LayerStack, ModelConfig
from attention_jax.models.stack import unstack_scanned
from attention_jax.train.steps import sown_losses
from attention_testing import jit_apply, jit_init, perturbed, small_stack_config

B, T, E = 2, 8, 16


def _config(**overrides) -> ModelConfig:
  return small_stack_config(T, **overrides)


def _x(seed=0):
  return jax.random.normal(jax.random.PRNGKey(seed), (B, T, E))


def _params(config):
  variables = jit_init(LayerStack(config), jax.random.PRNGKey(1), _x())
  return perturbed(nn.meta.unbox(variables["params"]))


def _apply(config, params, x, *, deterministic, seed=0):
  return jit_apply(LayerStack(config), {"params": params}, x, deterministic=deterministic,
                   rngs={"dropout": jax.random.PRNGKey(seed)})[0]


@pytest.mark.parametrize("scan_layers", [False, True])
def test_rate_zero_in_training_and_any_rate_in_evaluation_equal_the_plain_stack(scan_layers):
  plain = _config(dropout_rate=0.1, scan_layers=scan_layers)
  params, x = _params(plain), _x()
  for seed in (0, 1):
    np.testing.assert_array_equal(
        _apply(_config(dropout_rate=0.1, scan_layers=scan_layers, layer_drop_rate=0.0), params,
               x, deterministic=False, seed=seed),
        _apply(plain, params, x, deterministic=False, seed=seed))
  for rate in (0.5, 1.0):
    np.testing.assert_array_equal(
        _apply(_config(dropout_rate=0.1, scan_layers=scan_layers, layer_drop_rate=rate), params,
               x, deterministic=True),
        _apply(plain, params, x, deterministic=True))


@pytest.mark.parametrize("overrides", [dict(), dict(scan_layers=True, remat_policy="full"),
                                       dict(attention="realformer")])
def test_rate_one_in_training_is_the_identity_with_zero_gradients(overrides):
  config = _config(layer_drop_rate=1.0, dropout_rate=0.1, **overrides)
  params, x = _params(config), _x()
  stack = LayerStack(config)

  def loss(params, x):
    y, carry = jit_apply(stack, {"params": params}, x, deterministic=False,
                           rngs={"dropout": jax.random.PRNGKey(3)})
    return jnp.sum(jnp.sin(y)), (y, carry)

  (_, (y, carry)), (param_grads, x_grads) = jax.jit(
      jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, x)
  np.testing.assert_array_equal(y, x)
  np.testing.assert_allclose(x_grads, jnp.cos(x), rtol=1e-6)
  assert all(not leaf.any() for leaf in jax.tree.leaves(param_grads))
  # RealFormer's scores pass through a skipped layer unchanged (zeros).
  assert all(not leaf.any() for leaf in jax.tree.leaves(carry))


def test_a_skipped_block_is_not_computed():
  # The block sits in a branch of a conditional that XLA runs only when taken.
  config = _config(layer_drop_rate=0.5)
  jaxpr = jax.make_jaxpr(lambda p, x: LayerStack(config).apply(
      {"params": p}, x, deterministic=False, rngs={"dropout": jax.random.PRNGKey(0)}))(
          _params(config), _x())
  conditionals = [eqn for eqn in jaxpr.jaxpr.eqns if eqn.primitive.name == "cond"]
  assert len(conditionals) == config.num_layers
  assert all("dot_general" in str(eqn.params["branches"][1]) for eqn in conditionals)
  assert all("dot_general" not in str(eqn.params["branches"][0]) for eqn in conditionals)


@pytest.mark.parametrize("scan_layers", [False, True])
def test_each_layer_is_skipped_with_the_rate_independently(scan_layers):
  # Two layers, 400 fixed dropout keys (deterministic: the test cannot flake).
  # Each output must be one of the four compositions of the blocks it could
  # run, each layer skipped with probability 0.3, both with 0.09: each
  # frequency within 4 binomial standard deviations (at most 0.092 for a
  # single layer's, 0.057 for both).
  rate, draws = 0.3, 400
  config = _config(num_layers=2, layer_drop_rate=rate, scan_layers=scan_layers)
  params, x = _params(config), _x()
  blocks = unstack_scanned(params, config) if scan_layers else params
  block = Block(_config(num_layers=2))
  run = [lambda y, i=i: jit_apply(block, {"params": blocks[f"block_{i}"]}, y)[0] for i in (0, 1)]
  outcomes = {(False, False): run[1](run[0](x)), (True, False): run[1](x),
              (False, True): run[0](x), (True, True): x}
  apply = jax.jit(lambda seed: LayerStack(config).apply(
      {"params": params}, x, deterministic=False, rngs={"dropout": jax.random.PRNGKey(seed)})[0])
  skipped = []
  for seed in range(draws):
    y = apply(seed)
    matches = [key for key, expected in outcomes.items() if np.allclose(y, expected, atol=1e-5)]
    assert len(matches) == 1, (seed, matches)
    skipped.append(matches[0])
  skipped = np.array(skipped)

  def within(frequency, p):
    return abs(frequency - p) <= 4 * np.sqrt(p * (1 - p) / draws)

  assert within(skipped[:, 0].mean(), rate), skipped[:, 0].mean()
  assert within(skipped[:, 1].mean(), rate), skipped[:, 1].mean()
  assert within((skipped[:, 0] & skipped[:, 1]).mean(), rate ** 2)


def test_a_skipped_block_sows_a_zero_auxiliary_loss():
  # adaptive_span sows its span penalty into "losses"; a skipped layer's
  # entry is 0 and the collection keeps its structure.
  options = {"max_span": 4, "ramp": 2, "span_penalty": 0.5}
  config = _config(attention="adaptive_span", attention_options=options, num_layers=2)
  params, x = _params(config), _x()

  def losses(rate):
    stack = LayerStack(_config(attention="adaptive_span", attention_options=options,
                               num_layers=2, layer_drop_rate=rate))
    return jax.jit(lambda seed: stack.apply(
        {"params": params}, x, deterministic=False, rngs={"dropout": jax.random.PRNGKey(seed)},
        mutable=["losses"])[1])

  kept = losses(0.0)(0)
  assert float(sown_losses(kept)) > 0
  dropped = losses(1.0)(0)
  assert jax.tree.structure(dropped) == jax.tree.structure(kept)
  assert float(sown_losses(dropped)) == 0.0
  # At rate 0.5 the total is one of: no layer's penalty, either layer's
  # alone, both; 40 fixed keys see all four.
  per_layer = [float(sown_losses({"losses": kept["losses"][f"block_{i}"]})) for i in (0, 1)]
  half = losses(0.5)
  totals = {round(float(sown_losses(half(seed))), 5) for seed in range(40)}
  assert totals == {0.0, round(per_layer[0], 5), round(per_layer[1], 5),
                    round(sum(per_layer), 5)}


def test_layer_drop_needs_a_dropout_key_in_training_only():
  config = _config(layer_drop_rate=0.5)
  params, x = _params(config), _x()
  LayerStack(config).apply({"params": params}, x, deterministic=True)
  with pytest.raises(Exception, match="dropout"):
    LayerStack(config).apply({"params": params}, x, deterministic=False)


@pytest.mark.parametrize("overrides, message", [
    (dict(layer_drop_rate=1.5), r"model.layer_drop_rate must be in \[0, 1\], got 1.5"),
    (dict(layer_drop_rate=-0.1), r"model.layer_drop_rate must be in \[0, 1\], got -0.1"),
    (dict(layer_drop_rate=0.2, stack="universal"),
     r"model.layer_drop_rate=0.2 skips blocks of the standard stack; "
     r"model.stack='universal' takes 0"),
    (dict(stack="recurrent"), r"unknown stack 'recurrent'. Valid names are: standard, reversible, universal"),
])
def test_bad_values_are_named(overrides, message):
  with pytest.raises(ValueError, match=message):
    _config(**overrides)
