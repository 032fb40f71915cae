"""The model layer: one config, blocks from parts, the carry, scan/remat, declared options."""

import json
import os
import pathlib
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attention_jax as aj
from attention_jax import registry
from attention_jax.models import (Block, LayerStack, ModelConfig, build_model,
                                  default_model_config)
from attention_jax.models.config import POOLING_VARIANTS
from attention_jax.models.stack import unstack_scanned
from attention_jax.variants.prior.carried import SCORES
from attention_testing import jit_apply, jit_init, small_stack_config

REPO = pathlib.Path(__file__).resolve().parents[2]

B, T, E = 2, 16, 16


def _config(**overrides) -> ModelConfig:
  return small_stack_config(T, **{"num_layers": 4, **overrides})


def _x(seed=0):
  return jax.random.normal(jax.random.PRNGKey(seed), (B, T, E))


def _stack_loss(config):
  stack = LayerStack(config)

  def loss(params, x):
    y, _ = jit_apply(stack, {"params": params}, x)
    return jnp.sum(jnp.sin(y))

  return stack, loss


# ---------------------------------------------------------------------------
# One layer stack: unrolled, scanned, rematerialised.


@pytest.mark.parametrize("layer_attention", [(), ("local", "dot_product")])
@pytest.mark.parametrize("remat_policy", ["none", "full", "dots"])
def test_scanned_stack_equals_unrolled(layer_attention, remat_policy):
  options = {"window_size": 3} if layer_attention else {}
  unrolled = _config(layer_attention=layer_attention, attention_options=options)
  scanned = _config(layer_attention=layer_attention, attention_options=options,
                    scan_layers=True, remat_policy=remat_policy)
  x = _x()
  stack, loss = _stack_loss(scanned)
  scanned_params = nn.meta.unbox(jit_init(stack, jax.random.PRNGKey(1), x)["params"])
  params = unstack_scanned(scanned_params, scanned)
  _, unrolled_loss = _stack_loss(unrolled)

  value, grads = jax.jit(jax.value_and_grad(loss))(scanned_params, x)
  expected, expected_grads = jax.jit(jax.value_and_grad(unrolled_loss))(params, x)
  np.testing.assert_allclose(value, expected, rtol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-5),
               unstack_scanned(grads, scanned), expected_grads)


def test_qkv_dim_sets_the_attention_width_apart_from_the_model_width():
  config = _config(num_layers=1, qkv_dim=8)
  stack = LayerStack(config)
  params = nn.meta.unbox(jit_init(stack, jax.random.PRNGKey(0), _x())["params"])
  attention = params["block_0"]["attention"]
  shapes = {name: leaf["kernel"].shape for name, leaf in attention.items() if "kernel" in leaf}
  # H = 2 heads of D = qkv_dim / H = 4, projected from and back to E = 16.
  assert shapes["query"] == (E, 2, 4) and shapes["out"] == (2, 4, E)
  y, _ = jit_apply(stack, {"params": params}, _x())
  assert y.shape == (B, T, E)
  with pytest.raises(ValueError, match="model.qkv_dim must be a positive multiple of num_heads"):
    _config(qkv_dim=7)
  with pytest.raises(ValueError, match="model.qkv_dim=8 is set but the mixer of 'perceiver'"):
    LayerStack(_config(num_layers=1, qkv_dim=8, attention="perceiver")).init(
        jax.random.PRNGKey(0), _x())


def test_scan_needs_whole_periods():
  with pytest.raises(ValueError, match="num_layers=3 is not a multiple of its 2 entries"):
    _config(num_layers=3, layer_attention=("local", "dot_product"), scan_layers=True)


def test_scanned_parameters_carry_a_layers_axis():
  config = _config(scan_layers=True)
  boxed = jax.eval_shape(LayerStack(config).init, jax.random.PRNGKey(0), _x())["params"]
  kernel = boxed["blocks"]["block_0"]["attention"]["query"]["kernel"]
  assert kernel.names == ("layers", "embed", "heads", "kv")
  assert kernel.value.shape == (4, E, 2, E // 2)


# ---------------------------------------------------------------------------
# A per-layer schedule equals building the layers by hand.


def test_layer_schedule_equals_blocks_built_by_hand():
  config = _config(layer_attention=("local", "local", "dot_product"), num_layers=6,
                   attention_options={"window_size": 2})
  assert config.schedule == ("local", "local", "dot_product") * 2
  x = _x(3)
  stack = LayerStack(config)
  params = jit_init(stack, jax.random.PRNGKey(0), x)["params"]
  y, _ = jit_apply(stack, {"params": params}, x)

  expected = x
  for i, variant in enumerate(config.schedule):
    block = Block(config, variant)
    expected, _ = jit_apply(block, {"params": params[f"block_{i}"]}, expected, {})
  np.testing.assert_allclose(y, expected, rtol=1e-6, atol=1e-6)
  # The local layers really are local: one with the full window differs.
  wide = _config(layer_attention=("local", "local", "dot_product"), num_layers=6,
                 attention_options={"window_size": T})
  y_wide, _ = jit_apply(LayerStack(wide), {"params": params}, x)
  assert np.abs(np.asarray(y_wide - y)).max() > 1e-3


def test_schedule_options_must_belong_to_a_scheduled_variant():
  with pytest.raises(ValueError, match=r"no variant of layer_attention .* has option "
                                       r"'window_sise'. Did you mean 'window_size'"):
    _config(layer_attention=("local", "dot_product"), attention_options={"window_sise": 2})


# ---------------------------------------------------------------------------
# The carry: RealFormer.


def _encoder_params(config, tokens):
  return jit_init(build_model(config), jax.random.PRNGKey(0), tokens)["params"]


def test_realformer_with_zero_residual_weight_is_the_vanilla_encoder():
  tokens = jax.random.randint(jax.random.PRNGKey(4), (B, T), 1, 11)
  # A language model: the classifier's zero-initialised head would hide any difference.
  vanilla = _config(attention="dot_product", kind="language_model")
  real = _config(attention="realformer", attention_options={"residual_weight": 0.0},
                 kind="language_model")
  params = _encoder_params(vanilla, tokens)
  expected = jit_apply(build_model(vanilla), {"params": params}, tokens)
  out = jit_apply(build_model(real), {"params": params}, tokens)
  np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)
  # ... and with the default weight 1 it is a different model.
  residual = jit_apply(build_model(_config(attention="realformer", kind="language_model")),
                       {"params": params}, tokens)
  assert np.abs(np.asarray(residual - expected)).max() > 1e-4


@pytest.mark.property("realformer")
@pytest.mark.parametrize("scan_layers", [False, True])
def test_realformer_scores_are_the_running_sum_over_layers(scan_layers):
  """S_l = sum over layers j <= l of q_j k_j^T / sqrt(D), from each layer's own
  queries and keys, computed here from the parameters and the residual stream."""
  config = _config(attention="realformer", num_layers=3, scan_layers=scan_layers)
  x = _x(5)
  stack = LayerStack(config)
  params = nn.meta.unbox(jit_init(stack, jax.random.PRNGKey(0), x)["params"])
  _, carry = jit_apply(stack, {"params": params}, x)
  layers = unstack_scanned(params, config) if scan_layers else params

  one_layer = _config(attention="realformer", num_layers=1)

  @jax.jit  # one program for the three layers, whose shapes are the same
  def layer_by_hand(p, stream, previous):
    normed = nn.LayerNorm(epsilon=1e-6).apply({"params": p["attention_norm"]}, stream)
    project = lambda name: (jnp.einsum("bte,ehd->bthd", normed, p["attention"][name]["kernel"])
                            + p["attention"][name]["bias"])
    q, k = project("query"), project("key")
    running = previous + jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    stream, layer_carry = Block(one_layer).apply({"params": p}, stream, {SCORES: previous})
    return stream, running, layer_carry[SCORES]

  stream, running = x, jnp.zeros((B, 2, T, T))
  for i in range(config.num_layers):
    stream, running, layer_scores = layer_by_hand(layers[f"block_{i}"], stream, running)
    np.testing.assert_allclose(layer_scores, running, rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(carry[SCORES], running, rtol=1e-4, atol=1e-4)


def test_realformer_refuses_scores_of_the_wrong_shape():
  q = jnp.ones((1, 4, 2, 8))
  with pytest.raises(ValueError, match=r"carry\['attention_scores'\] must be"):
    aj.get_variant("realformer").fn(q, q, q, carry={SCORES: jnp.zeros((1, 2, 4, 5))})


# ---------------------------------------------------------------------------
# Declared options.


def test_variant_options_are_declared_with_type_default_and_doc():
  options = {o.name: o for o in aj.variant_options("local")}
  assert options["window_size"].type is int and options["window_size"].default == 64
  assert options["window_size"].doc
  for name in registry.list_variants():
    for option in aj.variant_options(name):
      assert option.doc and option.type in (int, float, bool, str, tuple), (name, option)


def test_undeclared_option_fails_when_the_model_is_built():
  with pytest.raises(ValueError, match=r"attention variant 'local' has no option 'window'. "
                                       r"Did you mean 'window_size'\? Its options are: "
                                       r"window_size, pattern, block_size, scale"):
    build_model(dict(attention="local", attention_options={"window": 3}))


def test_unknown_names_suggest_the_closest():
  with pytest.raises(ValueError, match=r"unknown attention variant 'perfomer'. "
                                       r"Did you mean 'performer'"):
    build_model(dict(attention="perfomer"))
  with pytest.raises(ValueError, match=r"unknown model config key 'num_layer'. "
                                       r"Did you mean 'num_layers'"):
    build_model(dict(num_layer=3))


def test_default_model_config_is_generated_from_the_dataclass():
  config = default_model_config()
  assert set(config.keys()) == {f for f in ModelConfig.__dataclass_fields__}
  assert config.num_kv_heads is None and config.scan_layers is False
  assert set(config.attention_options.keys()) == {"implementation", "local_window_size",
                                                  "scale"}


def test_options_table_in_docs_is_current():
  from experiments import variant_table  # pylint: disable=import-outside-toplevel
  text = variant_table.OPTIONS_DOC.read_text()
  assert variant_table.render_options(text) == text, (
      "docs/variants.md is stale: run python -m experiments.variant_table")
  for name in registry.list_variants():
    assert f"| `{name}` |" in text


def _train(tmp_path, config, *flags):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  return subprocess.run(
      [sys.executable, "-m", "experiments.train", f"--config={config}",
       f"--workdir={tmp_path / 'run'}", f"--config.data_dir={tmp_path / 'data'}", *flags],
      cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def test_toy_mixer_from_a_test_module_trains_with_a_cli_option(tmp_path):
  """A mixer registered outside attention_jax, its option set on the command line."""
  result = _train(tmp_path, "tests/models/toy_mixer_config.py",
                  "--config.model.attention_options.gain=0.5")
  assert result.returncode == 0, result.stderr[-3000:]
  saved = json.loads((tmp_path / "run" / "config.json").read_text())
  assert saved["model"]["attention"] == "toy_gated_mean"
  assert saved["model"]["attention_options"] == {"gain": 0.5}
  records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
  assert [r["step"] for r in records if r.get("split") == "train"] == [1, 2, 3, 4, 5]
  assert all(np.isfinite(r["loss"]) for r in records if r.get("split") == "train")


def test_cli_sets_a_declared_option_of_a_library_variant(tmp_path):
  result = _train(tmp_path, "tests/train/tiny_config.py:local",
                  "--config.model.attention_options.window_size=3",
                  "--config.num_train_steps=2", "--config.optimizer.warmup_steps=1",
                  "--config.eval_every=2",
                  "--config.checkpoint_every=2")
  assert result.returncode == 0, result.stderr[-3000:]
  saved = json.loads((tmp_path / "run" / "config.json").read_text())
  assert saved["model"]["attention_options"]["window_size"] == 3


# ---------------------------------------------------------------------------
# Layering: the pure level without layers/ and models/.


def test_pure_level_imports_and_runs_without_layers_or_models():
  program = """
import sys
sys.modules['attention_jax.layers'] = None   # makes `import attention_jax.layers...` fail
sys.modules['attention_jax.models'] = None
import jax, jax.numpy as jnp
import attention_jax as aj
from attention_jax import positional, registry
from attention_jax.kernels.flash_attention import blockwise_dot_product_attention
q = jax.random.normal(jax.random.PRNGKey(0), (1, 64, 2, 8))
for name in registry.list_variants():
  spec = registry.get_variant(name)
  aj.variant_options(name)
  assert spec.fn is not None
out = aj.dot_product_attention(q, q, q, is_causal=True)
ref = aj.reference_attention(q, q, q, mask=aj.make_attention_mask(64, 64, is_causal=True))
assert jnp.allclose(out, ref, atol=1e-5)
assert blockwise_dot_product_attention(q, q, q).shape == q.shape
assert registry.get_variant("local").fn(q, q, q, window_size=4).shape == q.shape
assert positional.apply_rope(q, jnp.arange(64)).shape == q.shape
try:
  aj.MultiHeadAttention
except ImportError:
  print("layers unimportable, as arranged")
print("ok")
"""
  result = subprocess.run([sys.executable, "-c", program], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  assert "ok" in result.stdout and "layers unimportable" in result.stdout


def _override_text(option):
  """A value for `--config.model.attention_options.<name>=` of the option's type."""
  if option.type is bool:
    return str(not option.default)
  if option.type is int:
    return str((option.default or 2) + 1)
  if option.type is float:
    return "0.25" if option.default == 0.5 else "0.5"
  if option.type is tuple:
    return "(2, 2)"
  return "xla"


def _parse_override(variant, key, option):
  """The tiny config of `variant` with `--config.model.<key>.<option>=` set to a
  value of the option's type: `(value, its model config as a dict)`."""
  from ml_collections import config_flags  # pylint: disable=import-outside-toplevel
  from experiments import cli  # pylint: disable=import-outside-toplevel

  def define(flag_values, argv):
    config_flags.DEFINE_config_file("config", None, "", flag_values=flag_values,
                                    sys_argv=list(argv))

  text = _override_text(option)
  args = cli.parse(define, [f"--config={REPO / 'tests/train/tiny_config.py'}:{variant}",
                            f"--config.model.{key}.{option.name}={text}"])
  value = args.config.model[key][option.name]
  assert isinstance(value, option.type) and value != option.default, (option, value)
  return value, dict(args.config.model, vocab_size=11, num_classes=10, max_length=40)


@pytest.mark.parametrize("variant", registry.list_variants("mixer"))
def test_every_declared_option_is_a_command_line_override(variant):
  """`--config.model.attention_options.<name>=<value>` parses for every declared
  option (ml_collections can only override keys the config has, typed), and the
  model config accepts the result."""
  # A causal-only mechanism is built in a language model.
  kind = {} if registry.get_variant(variant).bidirectional else {"kind": "language_model"}
  for option in aj.variant_options(variant):
    value, model = _parse_override(variant, "attention_options", option)
    assert ModelConfig.from_config({**model, **kind}).attention_options[option.name] == value


@pytest.mark.parametrize("pooling", sorted(POOLING_VARIANTS))
def test_every_pooling_option_is_a_command_line_override(pooling):
  """The same for `--config.model.pooling_options.<name>=`, with the pooling set."""
  for option in aj.variant_options(POOLING_VARIANTS[pooling]):
    value, model = _parse_override("dot_product", "pooling_options", option)
    with pytest.raises(ValueError, match=f"pooling {model['pooling']!r} takes no options"):
      ModelConfig.from_config(model)
    config = ModelConfig.from_config(dict(model, pooling=pooling))
    assert config.pooling_options[option.name] == value
