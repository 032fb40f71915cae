"""Block (attention_jax.models.blocks) against its written-out formula: the
residual arrangements, causality, dropout, the mixer it builds, and the carry.

(Named test_block.py, not test_blocks.py: without __init__.py files pytest
cannot collect two test modules of one basename, and tests/layers/test_blocks.py
keeps the FeedForward and norm tests.)
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attention_testing
from attention_jax.layers import FeedForward, MultiHeadAttention
from attention_jax.models import Block, ModelConfig, build_model
from attention_testing import assert_close, jit_apply, jit_init

B, T, E, H, F = 2, 8, 16, 4, 32


def _config(**overrides):
  """The checked config of a block of width E, H heads, F hidden units.

  dropout_rate=0.0: the old EncoderBlock's default (ModelConfig's is 0.1; a
  block ignores absolute positions, which the model's input layer adds).
  """
  fields = dict(embed_dim=E, num_heads=H, mlp_dim=F, dropout_rate=0.0)
  return ModelConfig.from_config({**fields, **overrides})


def _block(**overrides):
  return Block(_config(**overrides))


def _inputs(seed=0, length=T, features=E):
  return jax.random.normal(jax.random.PRNGKey(seed), (B, length, features))


def _params(module, *args, **kwargs):
  return nn.meta.unbox(jit_init(module, jax.random.PRNGKey(1), *args, **kwargs))["params"]


def _apply(block, params, x, **kwargs):
  """The block's output; its carry must come back as given (empty here)."""
  out, carry = jit_apply(block, {"params": params}, x, **kwargs)
  assert carry == {}
  return out


_layer_norm = attention_testing.layer_norm_by_formula
_rms_norm = attention_testing.rms_norm_by_formula
_perturbed = attention_testing.perturbed


def _block_by_formula(params, x, *, residual, norm, mask=None, is_causal=False):
  """The residual structure written out, the sub-layers applied on their own."""
  attention = MultiHeadAttention(num_heads=H)
  mlp = FeedForward(F, activation="gelu")
  normalize = _layer_norm if norm == "layernorm" else _rms_norm

  def attend(y):
    return jit_apply(attention, {"params": params["attention"]}, y, mask=mask, is_causal=is_causal)

  def feed_forward(y):
    return jit_apply(mlp, {"params": params["mlp"]}, y)

  if residual == "pre_norm":
    y = x + attend(normalize(x, params["attention_norm"]))
    return y + feed_forward(normalize(y, params["mlp_norm"]))
  y = normalize(x + attend(x), params["attention_norm"])
  return normalize(y + feed_forward(y), params["mlp_norm"])


@pytest.mark.parametrize("residual", ["pre_norm", "post_norm"])
@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
def test_block_equals_pre_or_post_norm_formula(residual, norm):
  x = _inputs()
  mask = jax.random.bernoulli(jax.random.PRNGKey(4), 0.7, (B, 1, T, T)).at[..., 0].set(True)
  block = _block(norm=norm, residual=residual)
  params = _perturbed(_params(block, x))
  assert set(params) == {"attention", "attention_norm", "mlp", "mlp_norm"}
  expected = _block_by_formula(params, x, residual=residual, norm=norm, mask=mask)
  assert_close(_apply(block, params, x, mask=mask), expected, atol=1e-4)


def test_causal_block_output_at_t_ignores_later_inputs():
  x = _inputs()
  block = _block()
  params = _params(block, x)
  changed = x.at[:, 3:].set(_inputs(seed=9)[:, 3:])
  out = _apply(block, params, x, is_causal=True)
  out_changed = _apply(block, params, changed, is_causal=True)
  assert_close(out[:, :3], out_changed[:, :3])
  assert not np.allclose(out[:, 3:], out_changed[:, 3:], atol=1e-3)


def test_block_dropout_is_off_when_deterministic_and_on_otherwise():
  x = _inputs()
  block = _block(dropout_rate=0.3, attention_dropout_rate=0.3)
  params = _params(block, x)
  reference = _apply(_block(), params, x)
  assert_close(_apply(block, params, x, deterministic=True), reference)
  run = lambda seed: _apply(block, params, x, deterministic=False,
                            rngs={"dropout": jax.random.PRNGKey(seed)})
  assert not np.allclose(run(0), reference, atol=1e-3)
  assert not np.allclose(run(0), run(1), atol=1e-3)
  assert_close(run(2), run(2))


@pytest.mark.parametrize("attention,num_kv_heads,expected_kv_heads",
                         [("dot_product", None, H), ("multi_query", None, 1),
                          ("grouped_query", 2, 2)])
def test_block_builds_the_named_mixer(attention, num_kv_heads, expected_kv_heads):
  x = _inputs()
  block = _block(attention=attention, num_kv_heads=num_kv_heads)
  params = _params(block, x)
  assert params["attention"]["query"]["kernel"].shape == (E, H, E // H)
  assert params["attention"]["key"]["kernel"].shape == (E, expected_kv_heads, E // H)
  assert _apply(block, params, x).shape == x.shape


def test_block_attention_argument_overrides_the_config_variant():
  """The layer stack builds each layer's Block with its entry of the schedule."""
  x = _inputs()
  config = _config(layer_attention=("multi_query", "dot_product"))
  params = _params(Block(config, attention="multi_query"), x)
  assert params["attention"]["key"]["kernel"].shape == (E, 1, E // H)
  params = _params(Block(config), x)  # None: config.attention.
  assert params["attention"]["key"]["kernel"].shape == (E, H, E // H)


def test_block_passes_relative_position_to_the_mixer():
  x = _inputs()
  params = _params(_block(position="t5"), x)
  assert "relative_position_bias" in params["attention"]
  # RoPE has no parameters, but it makes the output depend on positions.
  rope = _block(position="rope")
  params = _params(rope, x)
  no_position = _apply(_block(), params, x)
  assert not np.allclose(_apply(rope, params, x), no_position, atol=1e-4)
  # An absolute scheme is the encoder's business: the block's mixer ignores it.
  assert_close(_apply(_block(position="sinusoidal"), params, x), no_position)


def test_a_relative_position_for_a_mixer_without_one_is_refused_by_name():
  with pytest.raises(ValueError, match=r"model.position='xl_relative' is a relative position "
                                       r"applied inside the attention layer, and the mixer of "
                                       r"'gla' \(GatedLinearAttention\) takes none"):
    _params(_block(attention="gla", position="xl_relative"), _inputs())


def test_block_hands_the_carry_on():
  x = _inputs()
  other = {"not_mine": jnp.arange(3.0)}
  # A mixer that carries nothing returns the carry it was given, untouched.
  block = _block()
  params = _params(block, x)
  out, carry = block.apply({"params": params}, x, carry=other)
  assert set(carry) == {"not_mine"} and carry["not_mine"] is other["not_mine"]
  assert_close(out, _apply(block, params, x))
  # RealFormer adds its scores [B, H, T, T] and keeps what it does not own.
  realformer = _block(attention="realformer")
  params = _params(realformer, x, carry={})
  out, carry = jit_apply(realformer, {"params": params}, x, carry=other)
  assert set(carry) == {"not_mine", "attention_scores"}
  assert carry["attention_scores"].shape == (B, H, T, T)
  # The next block reads them: its output differs from a first block's.
  second, _ = jit_apply(realformer, {"params": params}, x, carry=carry)
  assert not np.allclose(second, out, atol=1e-4)


def test_block_unknown_names_raise():
  # Names are checked with the config, before any block is built or traced.
  with pytest.raises(ValueError, match=r"unknown attention variant 'nope'\. .*Valid names are: "
                     r".*dot_product"):
    _config(attention="nope")
  with pytest.raises(ValueError, match=r"unknown norm 'nope'\. Valid names are: layernorm, "
                     r"rmsnorm, scalenorm, powernorm, adanorm\.$"):
    _config(norm="nope")
  with pytest.raises(ValueError, match=r"unknown residual 'pre'\..*Valid names are: pre_norm, "
                     r"post_norm\.$"):
    _config(residual="pre")
  # An unchecked ModelConfig is checked by build_model.
  with pytest.raises(ValueError, match=r"unknown norm 'nope'"):
    build_model(ModelConfig(norm="nope"))
  with pytest.raises(ValueError, match=r"x must be \[B, T, E\]"):
    _block().init(jax.random.PRNGKey(0), _inputs()[0])


@pytest.mark.parametrize("norm", ["scalenorm", "powernorm", "adanorm"])
def test_block_takes_every_norm_by_name_and_only_powernorm_keeps_statistics(norm):
  """Norm layers are named attention_norm and mlp_norm; PowerNorm's running
  statistic changes in training (deterministic=False) and not in evaluation."""
  block, x = _block(norm=norm), _inputs()
  variables = nn.meta.unbox(jit_init(block, jax.random.PRNGKey(1), x))
  if norm != "powernorm":
    assert set(variables) == {"params"}
    return
  stats = variables["batch_stats"]
  assert set(stats) == {"attention_norm", "mlp_norm"}
  _, evaluated = jit_apply(block, variables, x, mutable=["batch_stats"])
  assert jax.tree.all(jax.tree.map(np.array_equal, evaluated["batch_stats"], stats))
  _, trained = jit_apply(block, variables, x, deterministic=False, mutable=["batch_stats"])
  assert not np.allclose(trained["batch_stats"]["attention_norm"]["quadratic_mean"],
                         stats["attention_norm"]["quadratic_mean"])


@pytest.mark.parametrize("feed_forward,options", [
    ("mlp", dict(chunk_size=4)), ("moe", dict(num_experts=2, top_k=1)),
    ("product_key", dict(num_keys=8, top_k=2))])
def test_block_takes_every_feed_forward_by_name_with_its_options(feed_forward, options):
  block, x = _block(feed_forward=feed_forward, feed_forward_options=options), _inputs()
  params = _params(block, x)
  out = _apply(block, params, x)
  assert out.shape == x.shape and np.all(np.isfinite(out))
  # The block's mlp is the layer the options describe: rebuilt alone, it gives
  # the block's feed-forward branch (pre-norm: x + mlp(mlp_norm(h))).
  from attention_jax.layers import make_feed_forward  # pylint: disable=import-outside-toplevel
  layer = make_feed_forward(feed_forward, mlp_dim=F, activation="gelu", dropout_rate=0.0,
                            dtype=jnp.float32, options=options)
  assert jax.tree.structure(_params(layer, x)) == jax.tree.structure(params["mlp"])


def test_feed_forward_options_are_checked_against_the_layer():
  with pytest.raises(ValueError, match=r"feed_forward_options has 'num_experts', which "
                     r"feed_forward 'product_key' does not take\..*Its options are: .*num_keys"):
    _config(feed_forward="product_key", feed_forward_options=dict(num_experts=4))
  with pytest.raises(ValueError, match=r"unknown feed_forward 'moe2'.*Did you mean 'moe'"):
    _config(feed_forward="moe2")
