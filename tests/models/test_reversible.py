"""The reversible stack (Reformer): its layers' formula, its custom VJP against
ordinary autodiff of the same computation, its memory, and what it refuses."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_jax.models import Block, LayerStack, ModelConfig, build_model
from attention_jax.models.reversible import ReversibleBlock, reversible_layers
from attention_testing import (assert_causal_language_model, jit_apply, jit_init, perturbed,
                               small_stack_config)

B, T, E = 2, 12, 16


def _config(**overrides) -> ModelConfig:
  return small_stack_config(T, **{"stack": "reversible", **overrides})


def _x(seed=0, length=T):
  return jax.random.normal(jax.random.PRNGKey(seed), (B, length, E))


def _params(config, x):
  params = nn.meta.unbox(jit_init(LayerStack(config), jax.random.PRNGKey(1), x)["params"])
  return perturbed(params)


def _padding_mask(lengths=(T, 7)):
  return (jnp.arange(T)[None] < jnp.array(lengths)[:, None])[:, None, None, :]


def _plain_reversible(config, params, x, mask=None, is_causal=False):
  """The same layers with ordinary autodiff: y1 = x1 + F(x2), y2 = x2 + G(y1)."""
  x1 = x2 = x
  for i, variant in enumerate(config.schedule):
    layer = ReversibleBlock(config, variant)
    layer_params = {"params": params["reversible"][f"block_{i}"]}
    x1 = x1 + jit_apply(layer, layer_params, x2, mask, is_causal, True,
                        method=ReversibleBlock.attend)
    x2 = x2 + jit_apply(layer, layer_params, x1, True, method=ReversibleBlock.feed_forward)
  return (x1 + x2) / 2


def _assert_grads_close(grads, expected):
  """Equal within float32 rounding of the largest gradient: inputs recomputed
  from outputs differ from the saved ones by rounding, which the backward
  pass carries into every entry (one whose exact gradient is 0, a key
  bias's, comes out near 1e-7 of the largest)."""
  # The largest magnitude of each leaf in one program (op by op: two per leaf shape).
  maxima = jax.jit(lambda tree: jax.tree.map(lambda leaf: jnp.abs(leaf).max(), tree))(expected)
  scale = max(float(leaf_max) for leaf_max in jax.tree.leaves(maxima))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * scale),
               grads, expected)


def test_one_layer_is_half_the_input_plus_the_pre_norm_block_with_its_parameters():
  # With x1 = x2 = x: y1 = x + F(x) and y2 = x + G(y1), while the pre-norm
  # block gives x + F(x) + G(x + F(x)) = y1 + G(y1); so (y1 + y2) / 2 =
  # (x + block(x)) / 2 with the same parameters (a reversible layer's are a
  # Block's, by name).
  config = _config(num_layers=1)
  x = _x()
  params = _params(config, x)
  out, _ = jit_apply(LayerStack(config), {"params": params}, x)
  block_out, _ = jit_apply(Block(_config(num_layers=1, stack="standard")),
                           {"params": params["reversible"]["block_0"]}, x)
  np.testing.assert_allclose(out, (x + block_out) / 2, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("overrides, masked, is_causal", [
    (dict(), False, False),
    (dict(layer_attention=("local", "dot_product"), attention_options={"window_size": 3},
          num_layers=4, norm="rmsnorm"), True, False),
    (dict(position="rope"), True, True),
])
def test_custom_vjp_equals_autodiff_of_the_same_layers(overrides, masked, is_causal):
  config = _config(**overrides)
  x = _x(3)
  mask = _padding_mask() if masked else None
  params = _params(config, x)
  stack = LayerStack(config)

  def loss(params, x):
    y, _ = jit_apply(stack, {"params": params}, x, mask=mask, is_causal=is_causal)
    return jnp.sum(jnp.sin(y) * jnp.arange(E))

  def plain_loss(params, x):
    return jnp.sum(jnp.sin(_plain_reversible(config, params, x, mask, is_causal)) * jnp.arange(E))

  (value, grads), (expected, expected_grads) = [
      jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(params, x) for f in (loss, plain_loss)]
  np.testing.assert_allclose(value, expected, rtol=1e-5)
  _assert_grads_close(grads, expected_grads)
  # Every layer's parameters get a gradient (the test could fail by zeros).
  for i in range(config.num_layers):
    block_grads = grads[0]["reversible"][f"block_{i}"]
    assert float(jnp.abs(block_grads["attention_norm"]["scale"]).sum()) > 0
    assert float(jnp.abs(block_grads["mlp"]["wo"]["kernel"]).sum()) > 0


def test_custom_vjp_with_dropout_keys_equals_autodiff_with_the_same_keys():
  # In training F and G drop units; the backward recomputes them with the
  # same key, so the gradients are those of the stochastic forward pass.
  # Two periods of (dot_product, multi_query): the parameters of period
  # position j stacked over the periods, one key per layer.
  config = _config(dropout_rate=0.3, attention_dropout_rate=0.2, num_layers=4,
                   layer_attention=("dot_product", "multi_query"))
  x = _x(4)
  params = _params(config, x)["reversible"]
  layers = [ReversibleBlock(config, v) for v in config.schedule_period]

  def attend(layer):
    return lambda p, y, context, key: jit_apply(layer, 
        {"params": p}, y, context["mask"], False, False, method=ReversibleBlock.attend,
        rngs={"dropout": key})

  def feed_forward(layer):
    return lambda p, y, context, key: jit_apply(layer, 
        {"params": p}, y, False, method=ReversibleBlock.feed_forward, rngs={"dropout": key})

  fs, gs = tuple(map(attend, layers)), tuple(map(feed_forward, layers))
  # The two periods' parameters stacked, in one program (op by op: one per leaf shape).
  stacked = jax.jit(lambda params: [
      jax.tree.map(lambda *leaves: jnp.stack(leaves), params[f"block_{j}"],
                   params[f"block_{j + 2}"]) for j in (0, 1)])(params)
  context = {"mask": _padding_mask()}

  def loss(stacked, x1, x2, keys):
    y1, y2 = reversible_layers(fs, gs, stacked, x1, x2, context, keys)
    return jnp.sum(jnp.cos(y1) + y2 ** 2)

  def plain_loss(stacked, x1, x2, keys):
    for step in range(2):
      for j in range(2):
        p = jax.tree.map(lambda leaf, s=step: leaf[s], stacked[j])
        f_key, g_key = jax.random.split(keys[step, j])
        x1 = x1 + fs[j](p, x2, context, f_key)
        x2 = x2 + gs[j](p, x1, context, g_key)
    return jnp.sum(jnp.cos(x1) + x2 ** 2)

  x2, keys = _x(5), jax.random.split(jax.random.PRNGKey(10), (2, 2))
  (value, grads), (expected, expected_grads) = [
      jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))(stacked, x, x2, keys)
      for f in (loss, plain_loss)]
  np.testing.assert_allclose(value, expected, rtol=1e-5)
  _assert_grads_close(grads, expected_grads)
  # The keys matter: others give another loss.
  other = jax.jit(loss)(stacked, x, x2, jax.random.split(jax.random.PRNGKey(11), (2, 2)))
  assert not np.isclose(float(other), float(expected), rtol=1e-3)


def test_stack_in_training_draws_dropout_and_is_deterministic_in_evaluation():
  config = _config(dropout_rate=0.2)
  x = _x()
  params = _params(config, x)
  stack = LayerStack(config)
  evaluated, _ = jit_apply(stack, {"params": params}, x)
  np.testing.assert_allclose(evaluated, _plain_reversible(config, params, x), rtol=1e-5,
                             atol=1e-5)
  trained = [jit_apply(stack, {"params": params}, x, deterministic=False,
                         rngs={"dropout": jax.random.PRNGKey(seed)})[0] for seed in (0, 0, 1)]
  np.testing.assert_array_equal(trained[0], trained[1])
  assert not np.allclose(trained[0], trained[2], atol=1e-3)
  assert not np.allclose(trained[0], evaluated, atol=1e-3)


def _train_grad_temp_bytes(stack, num_layers, length=256):
  """XLA's temporaries of the compiled gradient of a training pass (dropout
  on: its bits are per layer, and were once hoisted out of the layers)."""
  config = ModelConfig(vocab_size=11, num_layers=num_layers, embed_dim=32, num_heads=2,
                       mlp_dim=64, max_length=length, dropout_rate=0.1, stack=stack)
  layers = LayerStack(config)
  x = jax.ShapeDtypeStruct((2, length, 32), jnp.float32)
  params = jax.eval_shape(lambda: nn.meta.unbox(
      jit_init(layers, jax.random.PRNGKey(0), jnp.zeros(x.shape))["params"]))

  def loss(params, x):
    y, _ = jit_apply(layers, {"params": params}, x, deterministic=False,
                        rngs={"dropout": jax.random.PRNGKey(1)})
    return jnp.sum(jnp.sin(y))

  compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(params, x).compile()
  return compiled.memory_analysis().temp_size_in_bytes


def test_reversible_backward_memory_does_not_grow_with_depth_like_the_standard_stack():
  # XLA's memory analysis of the compiled gradient (no timing): the standard
  # stack keeps each layer's activations (its [B, H, T, T] attention weights
  # among them), so its temporaries grow by about one layer's activations
  # per layer; the reversible stack keeps the outputs, and grows only by the
  # layers' parameter gradients (32-wide layers: under 1/10 of the growth
  # here).
  standard = [_train_grad_temp_bytes("standard", n) for n in (2, 8)]
  reversible = [_train_grad_temp_bytes("reversible", n) for n in (2, 8)]
  standard_growth, reversible_growth = standard[1] - standard[0], reversible[1] - reversible[0]
  assert standard_growth > 2 * standard[0]  # about linear in depth
  assert reversible_growth < 0.1 * standard_growth, (standard, reversible)
  assert reversible[1] < 0.5 * standard[1], (standard, reversible)


@pytest.mark.parametrize("kind", ["classifier", "dual_classifier", "language_model"])
def test_every_stacked_model_kind_trains_under_jit(kind):
  config = _config(kind=kind, num_classes=3, dropout_rate=0.1)
  model = build_model(config)
  tokens = jax.random.randint(jax.random.PRNGKey(0), (B, T), 1, 11)
  inputs = (tokens, tokens[::-1]) if kind == "dual_classifier" else (tokens,)
  params = perturbed(nn.meta.unbox(jit_init(model, jax.random.PRNGKey(1), *inputs)["params"]))
  assert set(params["encoder"]["reversible"]) == {f"block_{i}" for i in range(3)}

  def loss(params):
    out = jit_apply(model, {"params": params}, *inputs, deterministic=False,
                      rngs={"dropout": jax.random.PRNGKey(2)})
    return jnp.sum(out ** 2)

  value, grads = jax.jit(jax.value_and_grad(loss))(params)
  assert np.isfinite(value)
  assert all(np.isfinite(leaf).all() for leaf in jax.tree.leaves(grads))
  assert float(jnp.abs(grads["encoder"]["reversible"]["block_0"]["attention"]["query"]
                       ["kernel"]).sum()) > 0


def test_reversible_language_model_is_causal():
  config = _config(kind="language_model")
  assert_causal_language_model(build_model(config), B, T, cut=6, vocab_size=11)


@pytest.mark.parametrize("overrides, message", [
    (dict(residual="post_norm"), r"model.residual='post_norm' must be 'pre_norm'"),
    (dict(scan_layers=True), r"model.scan_layers scans the standard stack's blocks; "
                             r"model.stack='reversible'"),
    (dict(remat_policy="full"), r"model.remat_policy='full' must be 'none'"),
    (dict(attention="realformer"), r"attention 'realformer' carries \('attention_scores',\)"),
    (dict(layer_drop_rate=0.1), r"model.layer_drop_rate=0.1 skips blocks of the standard stack"),
    (dict(kind="rnn_seq2seq"), r"model.kind='rnn_seq2seq' has none"),
    # Was refused only at init, blaming the attention for PowerNorm's batch_stats.
    (dict(norm="powernorm"), r"model.norm='powernorm' keeps a running statistic"),
])
def test_what_the_config_refuses_is_named(overrides, message):
  with pytest.raises(ValueError, match=message):
    _config(**overrides)


@pytest.mark.parametrize("attention, collection", [("performer", "'random'"),
                                                   ("adaptive_span", "'losses'")])
def test_a_layer_with_variables_besides_parameters_is_refused_at_init(attention, collection):
  config = _config(attention=attention)
  with pytest.raises(ValueError, match=rf"attention '{attention}' keeps variables in "
                                       rf"{collection}"):
    # Raised while tracing: abstract evaluation finds it without compiling the init.
    jax.eval_shape(LayerStack(config).init, jax.random.PRNGKey(0), _x())
