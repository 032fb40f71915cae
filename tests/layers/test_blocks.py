"""FeedForward and norms against their written-out formulas (the Block built from
them: tests/models/test_block.py)."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.scipy.special import erf

import attention_testing

from attention_jax.layers import FeedForward, make_norm
from attention_testing import assert_close

B, T, E, F = 2, 8, 16, 32


def _inputs(seed=0, length=T, features=E):
  return jax.random.normal(jax.random.PRNGKey(seed), (B, length, features))


def _params(module, *args, **kwargs):
  return nn.meta.unbox(module.init(jax.random.PRNGKey(1), *args, **kwargs))["params"]


def _dense(x, p):
  return x @ p["kernel"] + p["bias"]


_layer_norm = attention_testing.layer_norm_by_formula
_rms_norm = attention_testing.rms_norm_by_formula
_perturbed = attention_testing.perturbed


# ---------------------------------------------------------------------------
# FeedForward.
# ---------------------------------------------------------------------------

_PLAIN = {
    "relu": lambda h: jnp.maximum(h, 0),
    "gelu": lambda h: 0.5 * h * (1 + erf(h / np.sqrt(2))),
    "swish": lambda h: h / (1 + jnp.exp(-h)),
}


@pytest.mark.parametrize("activation", sorted(_PLAIN))
def test_feedforward_equals_act_x_w_then_w_out(activation):
  x = _inputs()
  module = FeedForward(F, activation=activation)
  params = _perturbed(_params(module, x))
  expected = _dense(_PLAIN[activation](_dense(x, params["wi"])), params["wo"])
  assert_close(module.apply({"params": params}, x), expected, atol=1e-5)


@pytest.mark.parametrize("activation,gate", [("swiglu", "swish"), ("geglu", "gelu")])
def test_gated_feedforward_equals_act_xw_times_xv_then_w_out(activation, gate):
  x = _inputs()
  module = FeedForward(F, activation=activation)
  params = _perturbed(_params(module, x))
  assert set(params) == {"wi_0", "wi_1", "wo"}
  hidden = _PLAIN[gate](_dense(x, params["wi_0"])) * _dense(x, params["wi_1"])
  assert_close(module.apply({"params": params}, x), _dense(hidden, params["wo"]), atol=1e-5)


def test_feedforward_without_bias_has_no_bias_params():
  x = _inputs()
  module = FeedForward(F, activation="relu", use_bias=False)
  params = _params(module, x)
  assert "bias" not in params["wi"] and "bias" not in params["wo"]
  expected = jnp.maximum(x @ params["wi"]["kernel"], 0) @ params["wo"]["kernel"]
  assert_close(module.apply({"params": params}, x), expected)


def test_feedforward_unknown_activation_lists_the_valid_ones():
  with pytest.raises(ValueError, match="activation.*swiglu.*'tanh'"):
    FeedForward(F, activation="tanh").init(jax.random.PRNGKey(0), _inputs())


def test_feedforward_params_carry_logical_axes():
  boxed = FeedForward(F, activation="geglu").init(jax.random.PRNGKey(0), _inputs())["params"]
  names = {path: leaf.names for path, leaf in _boxes(boxed)}
  assert names == {
      ("wi_0", "kernel"): ("embed", "mlp"), ("wi_0", "bias"): ("mlp",),
      ("wi_1", "kernel"): ("embed", "mlp"), ("wi_1", "bias"): ("mlp",),
      ("wo", "kernel"): ("mlp", "embed"), ("wo", "bias"): ("embed",),
  }


def _boxes(tree):
  flat = jax.tree_util.tree_flatten_with_path(
      tree, is_leaf=lambda x: isinstance(x, nn.Partitioned))[0]
  return [(tuple(k.key for k in path), leaf) for path, leaf in flat]


def test_feedforward_dropout_acts_only_when_not_deterministic():
  x = _inputs()
  module = FeedForward(F, dropout_rate=0.5)
  params = _params(module, x)
  reference = FeedForward(F, dropout_rate=0.0).apply({"params": params}, x)
  assert_close(module.apply({"params": params}, x, deterministic=True), reference)
  dropped = module.apply({"params": params}, x, deterministic=False,
                         rngs={"dropout": jax.random.PRNGKey(3)})
  assert not np.allclose(dropped, reference, atol=1e-3)


# ---------------------------------------------------------------------------
# Norms.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind,formula", [("layernorm", _layer_norm), ("rmsnorm", _rms_norm)])
def test_norm_equals_its_formula_and_names_its_scale_axis(kind, formula):
  x = 3.0 * _inputs() + 1.0
  module = make_norm(kind, jnp.float32)
  boxed = module.init(jax.random.PRNGKey(0), x)["params"]
  assert all(leaf.names == ("embed",) for _, leaf in _boxes(boxed))
  params = _perturbed(nn.meta.unbox(boxed))
  assert_close(module.apply({"params": params}, x), formula(x, params), atol=1e-5)


def test_make_norm_unknown_name_lists_the_valid_ones():
  with pytest.raises(ValueError, match="layernorm.*rmsnorm.*'batchnorm'"):
    make_norm("batchnorm")


def test_gelu_matches_jax_exact_gelu_with_one_saved_array(capsys):
  """The custom-JVP GELU is jax.nn.gelu(approximate=False) in value, first and
  second derivative (to float32 rounding), and reverse mode keeps one array of its input's size (the
  erf form keeps three)."""
  from jax.ad_checkpoint import print_saved_residuals  # pylint: disable=g-import-not-at-top
  from attention_jax.layers.feedforward import gelu  # pylint: disable=g-import-not-at-top
  x = jnp.linspace(-12.0, 12.0, 4001)
  exact = functools.partial(jax.nn.gelu, approximate=False)
  np.testing.assert_allclose(gelu(x), exact(x), rtol=0, atol=1e-6)
  for order in (1, 2):
    ours, theirs = gelu, exact
    for _ in range(order):
      ours, theirs = jax.grad(ours), jax.grad(theirs)
    np.testing.assert_allclose(jax.vmap(ours)(x), jax.vmap(theirs)(x), rtol=0, atol=1e-6)
  x = jnp.ones((3, 7, 97))
  for fn, expected in ((gelu, 1), (exact, 3)):
    print_saved_residuals(lambda v, fn=fn: fn(v).sum(), x)
    saved = [line for line in capsys.readouterr().out.splitlines()
             if line.startswith("f32[3,7,97]") and "from the argument" not in line]
    assert len(saved) == expected, saved
