"""The Funnel Transformer: pooling of values and masks against the written-out mean,
the stage lengths, pooled queries over unpooled keys, padding, the upsampling
decoder against the paper's formula, its config checks, and training."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_jax.models import FunnelTransformer, LayerStack, build_model
from attention_jax.models.funnel import pool_pairs, upsample
from attention_jax.models.stack import unstack_scanned
from attention_testing import assert_close, jit_apply, jit_init, train_briefly

V, E = 11, 16



def _init(model, *args, **kwargs):
  return nn.meta.unbox(jit_init(model, *args, **kwargs))

def _funnel(**overrides):
  config = dict(kind="funnel", vocab_size=V, num_classes=3, embed_dim=E, num_heads=2, mlp_dim=32,
                max_length=32, funnel_blocks=(2, 1, 2), funnel_decoder_blocks=2,
                dropout_rate=0.0)
  return build_model({**config, **overrides})


def _tokens(batch, length, seed=0):
  return jax.random.randint(jax.random.PRNGKey(seed), (batch, length), 1, V)


def _captured(model, variables, tokens, names, method=None, **kwargs):
  """{name: output} of the submodules `names` in one forward pass."""
  _, state = jit_apply(model, variables, tokens, capture_intermediates=lambda m, _: m.name in names,
                       mutable=["intermediates"], method=method, **kwargs)
  return {name: state["intermediates"][name]["__call__"][0] for name in names}


def test_pooling_is_the_mean_of_the_real_positions_of_each_pair():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(2, 8, 3)).astype(np.float32)  # one prefix position, 7 to pool
  mask = np.array([[1, 1, 1, 1, 0, 0, 0, 1],
                   [1, 0, 1, 1, 1, 0, 1, 1]], bool)
  pooled, pooled_mask = pool_pairs(jnp.asarray(x), jnp.asarray(mask), prefix_length=1)
  expected = np.zeros((2, 5, 3), np.float32)
  expected_mask = np.zeros((2, 5), bool)
  for b in range(2):
    expected[b, 0], expected_mask[b, 0] = x[b, 0], True  # the prefix is kept apart
    for i in range(4):
      members = [1 + 2 * i + k for k in range(2) if 1 + 2 * i + k < 8 and mask[b, 1 + 2 * i + k]]
      expected_mask[b, 1 + i] = bool(members)
      if members:
        expected[b, 1 + i] = np.mean([x[b, t] for t in members], axis=0)
  # Row 0: pairs (real, real), (real, pad), (pad, pad), (real, the odd end's filler).
  np.testing.assert_array_equal(pooled_mask, expected_mask)
  np.testing.assert_array_equal(expected_mask[0], [True, True, True, False, True])
  assert_close(pooled, expected, rtol=1e-6, atol=1e-6)
  assert np.all(np.asarray(pooled)[0, 3] == 0)


def test_upsampling_repeats_each_position_back_to_where_pooling_took_it():
  x = np.arange(2 * 4 * 2, dtype=np.float32).reshape(2, 4, 2)  # prefix + 3 pooled positions
  up = np.asarray(upsample(jnp.asarray(x), length=10, factor=4, prefix_length=1))
  assert up.shape == (2, 11, 2)
  np.testing.assert_array_equal(up[:, 0], x[:, 0])
  for t in range(10):
    np.testing.assert_array_equal(up[:, 1 + t], x[:, 1 + t // 4])


@pytest.mark.parametrize("pooling,length,lengths", [
    ("cls", 13, (14, 8, 5)), ("cls", 16, (17, 9, 5)), ("mean", 13, (13, 7, 4)),
    ("max", 5, (5, 3, 2))])
def test_each_stage_halves_the_sequence_the_cls_kept_apart(pooling, length, lengths):
  model = _funnel(pooling=pooling)
  tokens = _tokens(2, length)
  variables = _init(model, jax.random.PRNGKey(0), tokens)
  outputs = _captured(model, variables, tokens, ("stage_0", "stage_1_pooling", "stage_2"))
  assert outputs["stage_0"][0].shape == (2, lengths[0], E)
  assert outputs["stage_1_pooling"][0].shape == (2, lengths[1], E)  # stage 1: the pooling block
  assert outputs["stage_2"][0].shape == (2, lengths[2], E)
  assert jit_apply(model, variables, tokens).shape == (2, 3)


def test_the_pooling_block_attends_from_pooled_queries_to_unpooled_keys():
  model = _funnel(pooling="mean")
  tokens = _tokens(2, 12)
  variables = _init(model, jax.random.PRNGKey(0), tokens)
  names = ("query", "key", "value")
  _, state = jit_apply(model, variables, tokens, mutable=["intermediates"],
                       capture_intermediates=lambda m, _: m.name in names)
  projections = state["intermediates"]["stage_1_pooling"]["attention"]
  assert projections["query"]["__call__"][0].shape[:2] == (2, 6)
  assert projections["key"]["__call__"][0].shape[:2] == (2, 12)
  assert projections["value"]["__call__"][0].shape[:2] == (2, 12)
  # Pooling the whole sequence instead: no pooling block, keys pooled too.
  model = _funnel(pooling="mean", funnel_pool_queries_only=False)
  variables = _init(model, jax.random.PRNGKey(0), tokens)
  assert "stage_1_pooling" not in variables["params"]
  _, state = jit_apply(model, variables, tokens, mutable=["intermediates"],
                       capture_intermediates=lambda m, _: m.name == "key")
  keys = state["intermediates"]["stage_1"]["block_0"]["attention"]["key"]["__call__"][0]
  assert keys.shape[:2] == (2, 6)


@pytest.mark.parametrize("overrides", [dict(pooling="mean"), dict(pooling="cls"),
                                       dict(pooling="max", funnel_pool_queries_only=False)])
def test_padding_changes_nothing_through_the_stages(overrides):
  model = _funnel(**overrides)
  tokens = _tokens(3, 15)
  mask = jnp.arange(15)[None] < jnp.array([[15], [9], [4]])
  variables = _init(model, jax.random.PRNGKey(0), tokens, padding_mask=mask)
  variables = {"params": {**variables["params"], "head": jax.tree.map(
      lambda a: jax.random.normal(jax.random.PRNGKey(1), a.shape), variables["params"]["head"])}}
  logits = jit_apply(model, variables, tokens, padding_mask=mask)
  changed = jnp.where(mask, tokens, (tokens + 3) % (V - 1) + 1)
  assert_close(jit_apply(model, variables, changed, padding_mask=mask), logits,
               rtol=1e-5, atol=1e-5)
  # ...while a change to a real token does move them (the test can fail).
  moved = jit_apply(model, variables, tokens.at[:, 0].set(tokens[:, 0] % (V - 1) + 1),
                    padding_mask=mask)
  assert not np.allclose(moved, logits, atol=1e-4)


@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_decoder_is_blocks_over_the_repeated_last_stage_plus_the_first(pooling):
  model = _funnel(pooling=pooling)
  config = model.config
  tokens = _tokens(2, 11)
  variables = _init(model, jax.random.PRNGKey(0), tokens, method=model.token_outputs)
  params = variables["params"]
  assert "head" not in params and "decoder" in params
  outputs = _captured(model, variables, tokens, ("stage_0", "stage_2"),
                      method=model.token_outputs)
  first, last = np.asarray(outputs["stage_0"][0]), np.asarray(outputs["stage_2"][0])
  prefix = 1 if pooling == "cls" else 0
  # The paper's decoder input: h_up[t] = h_last[t // 2^(S-1)], plus h_1.
  up = np.concatenate([last[:, :prefix]] + [last[:, prefix + t // 4][:, None]
                                            for t in range(11)], axis=1) + first
  decoder = LayerStack(dataclasses.replace(config, num_layers=config.funnel_decoder_blocks))
  x, _ = jit_apply(decoder, {"params": params["decoder"]}, jnp.asarray(up),
                   mask=jnp.ones((2, 1, 1, 11 + prefix), bool))
  x = nn.LayerNorm(epsilon=1e-6).apply({"params": params["decoder_norm"]}, x)
  token_outputs = jit_apply(model, variables, tokens, method=model.token_outputs)
  assert token_outputs.shape == (2, 11, E)
  assert_close(token_outputs, x[:, prefix:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("overrides,message", [
    (dict(funnel_blocks=()), r"model.funnel_blocks must be a non-empty tuple of positive block "
                             r"counts, one per stage \(e.g. \(2, 2, 2\)\), got \(\)"),
    (dict(funnel_blocks=(2, 0)), r"model.funnel_blocks .* got \(2, 0\)"),
    (dict(funnel_decoder_blocks=-1), r"model.funnel_decoder_blocks must be an integer >= 0, "
                                     r"got -1"),
    (dict(attention="local"), r"model.funnel_pool_queries_only=True attends from the pooled "
                              r"queries to the unpooled keys \(cross-attention\), and attention "
                              r"'local' has no cross-attention form; set it False"),
    (dict(layer_attention=("dot_product", "linear"), scan_layers=True, num_layers=2,
          funnel_blocks=(2, 2)), r"the Funnel's stacks of funnel_blocks=\(2, 2\) and "
                                 r"funnel_decoder_blocks=2 have \(2, 1, 2\) blocks \(a pooling "
                                 r"block not counted\), not multiples of 2"),
])
def test_bad_config_is_named(overrides, message):
  with pytest.raises(ValueError, match=message):
    _funnel(**overrides)


def test_scanned_stages_equal_unrolled_ones():
  # A stage of 3 blocks after pooling is a pooling block and a stack of 2:
  # whole periods of the two-variant schedule, as stage 0 and the decoder are.
  common = dict(layer_attention=("dot_product", "linear"), num_layers=2, funnel_blocks=(2, 3))
  unrolled, scanned = _funnel(**common), _funnel(**common, scan_layers=True)
  tokens = _tokens(2, 12)
  stacked = _init(scanned, jax.random.PRNGKey(0), tokens, method=scanned.token_outputs)
  stack_config = dataclasses.replace(scanned.config, num_layers=2)
  params = {name: unstack_scanned(tree, stack_config)
            if name in ("stage_0", "stage_1", "decoder") else tree
            for name, tree in stacked["params"].items()}
  reference = _init(unrolled, jax.random.PRNGKey(0), tokens, method=unrolled.token_outputs)
  assert jax.tree.map(jnp.shape, params) == jax.tree.map(jnp.shape, reference["params"])
  assert_close(jit_apply(unrolled, {"params": params}, tokens, method=unrolled.token_outputs),
               jit_apply(scanned, stacked, tokens, method=scanned.token_outputs),
               rtol=1e-5, atol=1e-5)


def test_one_stage_with_pooling_off_takes_any_mixer():
  model = _funnel(attention="local", attention_options=dict(window_size=4),
                  funnel_pool_queries_only=False)
  tokens = _tokens(2, 12)
  assert jit_apply(model, _init(model, jax.random.PRNGKey(0), tokens), tokens).shape == (2, 3)
  assert isinstance(_funnel(attention="local", funnel_blocks=(3,)), FunnelTransformer)


def test_the_listops_config_builds_it_and_the_trainer_trains_it(tmp_path):
  from attention_jax.train.config import load_config_module
  config = load_config_module("configs/lra/listops.py").get_config("dot_product,funnel,smoke")
  assert config.model.kind == "funnel"
  config.task_options.update(train_size=64, validation_size=32, test_size=32, max_length=40)
  config.model.update(embed_dim=16, num_heads=2, mlp_dim=16, head_mlp_dim=16,
                      funnel_blocks=(1, 1))
  train_briefly(config, tmp_path)
