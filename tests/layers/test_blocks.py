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
from attention_testing import assert_close, jit_apply, jit_init

B, T, E, F = 2, 8, 16, 32


def _inputs(seed=0, length=T, features=E):
  return jax.random.normal(jax.random.PRNGKey(seed), (B, length, features))


def _params(module, *args, **kwargs):
  return nn.meta.unbox(jit_init(module, jax.random.PRNGKey(1), *args, **kwargs))["params"]


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
  assert_close(jit_apply(module, {"params": params}, x), expected, atol=1e-5)


# The GLU family of Shazeer 2020, written out: gate(x W) * (x V).
_GATE_FUNCTIONS = {
    "glu": lambda h: 1.0 / (1.0 + jnp.exp(-h)),
    "bilinear": lambda h: h,
    "reglu": _PLAIN["relu"],
    "geglu": _PLAIN["gelu"],
    "swiglu": _PLAIN["swish"],
}


@pytest.mark.parametrize("activation", sorted(_GATE_FUNCTIONS))
def test_gated_feedforward_equals_gate_xw_times_xv_then_w_out(activation):
  x = _inputs()
  module = FeedForward(F, activation=activation)
  params = _perturbed(_params(module, x))
  assert set(params) == {"wi_0", "wi_1", "wo"}
  hidden = _GATE_FUNCTIONS[activation](_dense(x, params["wi_0"])) * _dense(x, params["wi_1"])
  assert_close(jit_apply(module, {"params": params}, x), _dense(hidden, params["wo"]), atol=1e-5)


@pytest.mark.parametrize("activation", ["relu", "swiglu"])
def test_chunked_feedforward_equals_the_whole_layer_in_value_and_gradient(activation):
  """Reformer's chunking: the same parameters, outputs and gradients, and the
  hidden activation is never whole (no [B, T, F] array in the computation)."""
  length = 12
  x = _inputs(length=length)
  whole = FeedForward(F, activation=activation)
  chunked = FeedForward(F, activation=activation, chunk_size=4)
  params = _perturbed(_params(whole, x))
  assert jax.tree.structure(_params(chunked, x)) == jax.tree.structure(params)

  def loss(module, params, x):
    return jnp.sum(jnp.sin(jit_apply(module, {"params": params}, x)))

  assert_close(jit_apply(chunked, {"params": params}, x), jit_apply(whole, {"params": params}, x),
               atol=1e-5)
  for expected, got in zip(jax.grad(loss, (1, 2))(whole, params, x),
                           jax.grad(loss, (1, 2))(chunked, params, x)):
    for a, b in zip(jax.tree.leaves(expected), jax.tree.leaves(got)):
      assert_close(b, a, atol=1e-5)
  shapes = attention_testing.intermediate_shapes(
      jax.grad(functools.partial(loss, chunked), argnums=1), params, x)
  assert (B, 4, F) in shapes and (B, length, F) not in shapes


def test_chunked_feedforward_rejects_a_chunk_that_does_not_divide_the_length():
  with pytest.raises(ValueError, match=r"chunk_size must be a positive divisor of the sequence "
                     r"length 8, got 3"):
    FeedForward(F, chunk_size=3).init(jax.random.PRNGKey(0), _inputs())


def test_feedforward_without_bias_has_no_bias_params():
  x = _inputs()
  module = FeedForward(F, activation="relu", use_bias=False)
  params = _params(module, x)
  assert "bias" not in params["wi"] and "bias" not in params["wo"]
  expected = jnp.maximum(x @ params["wi"]["kernel"], 0) @ params["wo"]["kernel"]
  assert_close(jit_apply(module, {"params": params}, x), expected)


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
  assert_close(jit_apply(module, {"params": params}, x, deterministic=True), reference)
  dropped = jit_apply(module, {"params": params}, x, deterministic=False,
                         rngs={"dropout": jax.random.PRNGKey(3)})
  assert not np.allclose(dropped, reference, atol=1e-3)


# ---------------------------------------------------------------------------
# Norms.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind,formula", [("layernorm", _layer_norm), ("rmsnorm", _rms_norm)])
def test_norm_equals_its_formula_and_names_its_scale_axis(kind, formula):
  x = 3.0 * _inputs() + 1.0
  module = make_norm(kind, jnp.float32)
  boxed = jit_init(module, jax.random.PRNGKey(0), x)["params"]
  assert all(leaf.names == ("embed",) for _, leaf in _boxes(boxed))
  params = _perturbed(nn.meta.unbox(boxed))
  assert_close(jit_apply(module, {"params": params}, x), formula(x, params), atol=1e-5)


def test_scalenorm_is_g_x_over_its_norm_with_g_starting_at_sqrt_e():
  x = 3.0 * _inputs() + 1.0
  module = make_norm("scalenorm")
  params = _params(module, x)
  np.testing.assert_allclose(params["scale"], np.sqrt(E), rtol=1e-6)
  params = {"scale": jnp.float32(1.7)}
  x64 = np.asarray(x, np.float64)
  expected = 1.7 * x64 / np.linalg.norm(x64, axis=-1, keepdims=True)
  assert_close(jit_apply(module, {"params": params}, x), expected, atol=1e-5)


def test_powernorm_divides_by_the_previous_running_quadratic_mean_and_updates_it():
  """Shen et al. 2020, Algorithm 1: training normalises by psi_{t-1} and sets
  psi_t^2 = a psi_{t-1}^2 + (1 - a) mean(x^2); evaluation reads psi and keeps it."""
  x = 2.0 * _inputs() + 0.5
  train, evaluate = make_norm("powernorm", deterministic=False), make_norm("powernorm")
  variables = nn.meta.unbox(jit_init(evaluate, jax.random.PRNGKey(0), x))
  np.testing.assert_array_equal(variables["batch_stats"]["quadratic_mean"], np.ones(E))
  rng = np.random.default_rng(0)
  previous = rng.uniform(0.5, 2.0, E)
  params = {"scale": jnp.asarray(rng.normal(size=E), jnp.float32),
            "bias": jnp.asarray(rng.normal(size=E), jnp.float32)}
  variables = {"params": params, "batch_stats": {"quadratic_mean": jnp.asarray(previous,
                                                                               jnp.float32)}}
  x64 = np.asarray(x, np.float64)
  expected = (np.asarray(params["scale"]) * x64 / np.sqrt(previous + 1e-5)
              + np.asarray(params["bias"]))
  y, updated = jit_apply(train, variables, x, mutable=["batch_stats"])
  assert_close(y, expected, atol=1e-5)
  np.testing.assert_allclose(updated["batch_stats"]["quadratic_mean"],
                             0.9 * previous + 0.1 * np.mean(x64 ** 2, axis=(0, 1)), rtol=1e-5)
  # Evaluation: the same output from the stored statistic, which stays.
  assert_close(jit_apply(evaluate, variables, x), expected, atol=1e-5)
  # The statistic is a constant of the step: the gradient is g / psi_{t-1}.
  grad = jax.grad(lambda x: jnp.sum(jit_apply(train, variables, x, mutable=["batch_stats"])[0]))(x)
  assert_close(grad, np.broadcast_to(np.asarray(params["scale"]) / np.sqrt(previous + 1e-5),
                                     x.shape), atol=1e-5)


def test_adanorm_is_c_one_minus_ky_times_y_with_the_factor_held_constant():
  """Xu et al. 2019: z = C (1 - k y) y, y the standardised input; the gradient
  treats (1 - k y) as a constant: compared with central differences of z with
  the factor frozen at the point."""
  x = 3.0 * _inputs(length=3) + 1.0
  module = make_norm("adanorm")
  assert not jax.tree.leaves(jit_init(module, jax.random.PRNGKey(1), x))  # nothing learned

  def standardised(x):
    centred = x - x.mean(-1, keepdims=True)
    return centred / np.sqrt((centred ** 2).mean(-1, keepdims=True) + 1e-6)

  x64 = np.asarray(x, np.float64)
  y = standardised(x64)
  assert_close(jit_apply(module, {}, x), (1.0 - 0.1 * y) * y, atol=1e-5)
  frozen = 1.0 - 0.1 * y
  weights = np.asarray(_inputs(seed=5, length=3), np.float64)
  grad = np.asarray(jax.grad(lambda x: jnp.sum(weights * jit_apply(module, {}, x)))(x))
  step, numeric = 1e-6, np.zeros_like(x64)
  for index in np.ndindex(x64.shape):
    shift = np.zeros_like(x64)
    shift[index] = step
    numeric[index] = np.sum(weights * frozen * (standardised(x64 + shift)
                                                - standardised(x64 - shift))) / (2 * step)
  np.testing.assert_allclose(grad, numeric, atol=1e-4)


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
