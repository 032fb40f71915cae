"""Output gates (Qiu et al. 2025) and value residuals (Zhou et al. 2024) of the
attention layer, against their formulas written out with the layer's weights."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

import attention_jax as aj
from attention_jax.layers.attention import FIRST_VALUES, HAS_FIRST_VALUES
from attention_jax.models import ModelConfig, stack
from attention_testing import assert_close, jit_apply, jit_init, small_stack_config

B, T, E, H = 2, 9, 16, 2


def _project(x, p):
  return jnp.einsum("bte,ehd->bthd", x, p["kernel"]) + p["bias"]


def _output(out, p):
  return jnp.einsum("bthd,hde->bte", out, p["kernel"]) + p["bias"]


@pytest.mark.parametrize("gate", ["elementwise", "headwise"])
def test_the_output_gate_is_a_sigmoid_of_the_layer_input_on_each_head_output(gate):
  layer = aj.MultiHeadAttention(num_heads=H, output_gate=gate)
  x = jax.random.normal(jax.random.PRNGKey(0), (B, T, E))
  variables = jit_init(layer, jax.random.PRNGKey(1), x, is_causal=True)
  p = nn.meta.unbox(variables["params"])
  assert p["output_gate"]["kernel"].shape == (E, H, E // H if gate == "elementwise" else 1)
  p["output_gate"]["bias"] = 0.3 + p["output_gate"]["bias"]  # a bias that matters

  @jax.jit
  def written_out(p):
    attended = aj.dot_product_attention(_project(x, p["query"]), _project(x, p["key"]),
                                        _project(x, p["value"]), is_causal=True,
                                        implementation="xla")
    return _output(attended * jax.nn.sigmoid(_project(x, p["output_gate"])), p["out"])

  assert_close(jit_apply(layer, {"params": p}, x, is_causal=True), written_out(p), rtol=1e-5,
               atol=1e-5)


def test_a_later_layer_mixes_the_first_layers_values_into_its_own():
  layer = aj.MultiHeadAttention(num_heads=H, value_residual=0.25)
  x = jax.random.normal(jax.random.PRNGKey(2), (B, T, E))
  first = jax.random.normal(jax.random.PRNGKey(3), (B, T, H, E // H))
  p = nn.meta.unbox(jit_init(layer, jax.random.PRNGKey(4), x)["params"])
  carry = {FIRST_VALUES: first, HAS_FIRST_VALUES: jnp.ones((), bool)}
  got, handed_on = jit_apply(layer, {"params": p}, x, carry=carry)
  values = 0.75 * _project(x, p["value"]) + 0.25 * first
  want = _output(aj.dot_product_attention(_project(x, p["query"]), _project(x, p["key"]),
                                          values, implementation="xla"), p["out"])
  assert_close(got, want, rtol=1e-5, atol=1e-5)
  assert_close(handed_on[FIRST_VALUES], first)  # V_1 is handed on unchanged
  # The first layer (no V_1 yet) attends to its own values and hands them on.
  got, handed_on = jit_apply(layer, {"params": p}, x,
                             carry={**carry, HAS_FIRST_VALUES: jnp.zeros((), bool)})
  assert_close(handed_on[FIRST_VALUES], _project(x, p["value"]))
  assert_close(got, jit_apply(aj.MultiHeadAttention(num_heads=H), {"params": p}, x))
  assert bool(handed_on[HAS_FIRST_VALUES])


def _stack_outputs(config, variables, x):
  module = stack.LayerStack(config)
  return jit_apply(module, variables, x, is_causal=True)[0]


def test_in_a_stack_weight_zero_changes_nothing_and_scanned_equals_unrolled():
  config = small_stack_config(T, value_residual=0.5, output_gate="elementwise")
  x = jax.random.normal(jax.random.PRNGKey(5), (B, T, E))
  variables = nn.meta.unbox(jit_init(stack.LayerStack(config), jax.random.PRNGKey(6), x,
                                     is_causal=True))
  out = _stack_outputs(config, variables, x)
  fields = {f: getattr(config, f) for f in ("vocab_size", "num_layers", "embed_dim", "num_heads",
                                            "mlp_dim", "max_length", "dropout_rate")}
  off = ModelConfig.from_config(dict(fields, value_residual=0.0, output_gate="elementwise"))
  without = ModelConfig.from_config(dict(fields, output_gate="elementwise"))
  assert_close(_stack_outputs(off, variables, x), _stack_outputs(without, variables, x))
  assert float(jnp.abs(out - _stack_outputs(without, variables, x)).max()) > 1e-3
  scanned = ModelConfig.from_config(dict(fields, value_residual=0.5, output_gate="elementwise",
                                         scan_layers=True))
  stacked = jax.tree.map(lambda *leaves: jnp.stack(leaves),
                         *[variables["params"][f"block_{i}"] for i in range(3)])
  assert_close(_stack_outputs(scanned, {"params": {"blocks": {"block_0": stacked}}}, x), out,
               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("overrides, message", [
    (dict(output_gate="per_token"), "model.output_gate must be one of"),
    (dict(value_residual=1.5), r"model.value_residual is w .* in \[0, 1\]"),
    (dict(value_residual=0.5, attention="fnet"), "model.value_residual is an option of the Q/K/V"),
    (dict(value_residual=0.5, stack="reversible"), "reversible stack has not"),
])
def test_bad_settings_are_named(overrides, message):
  with pytest.raises(ValueError, match=message):
    small_stack_config(T, **overrides)
