"""The Transformer encoder-decoder: decoding against the teacher-forced pass,
causality and source padding, transparent attention against its definition,
and the config's checks."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_jax.models import ModelConfig, build_model, decoding
from attention_jax.models.stack import LAYER_OUTPUTS, run_layers
from attention_testing import assert_close, jit_apply, jit_call, jit_init, perturbed

V, L = 13, 12
MODEL = dict(kind="transformer_seq2seq", attention="dot_product", cross_attention="additive",
             vocab_size=V, num_classes=V, num_layers=2, embed_dim=16, num_heads=2, mlp_dim=32,
             max_length=L, dropout_rate=0.0, position="learned")
# Sources left-aligned (symbols 3.., EOS 2, padding 0); targets likewise.
SOURCE = jnp.array([[3, 4, 5, 6, 7, 2, 0, 0, 0, 0, 0, 0],
                    [7, 8, 9, 2, 0, 0, 0, 0, 0, 0, 0, 0]], jnp.int32)
TARGET = jnp.array([[7, 6, 5, 4, 3, 2, 0, 0, 0, 0, 0, 0],
                    [9, 8, 7, 2, 0, 0, 0, 0, 0, 0, 0, 0]], jnp.int32)


def _model_and_variables(**overrides):
  model = build_model({**MODEL, **overrides})
  variables = nn.meta.unbox(jit_init(model, jax.random.PRNGKey(0), SOURCE, TARGET))
  # Random parameters everywhere: default biases and scales would hide a
  # branch that is not wired in.
  return model, {"params": perturbed(variables["params"])}


@pytest.mark.parametrize("cross_attention", ["dot_product", "additive", "luong_general"])
@pytest.mark.parametrize("transparent", [False, True])
def test_greedy_decoding_is_the_argmax_of_the_teacher_forced_pass_on_its_own_output(
    cross_attention, transparent):
  model, variables = _model_and_variables(cross_attention=cross_attention,
                                          transparent_attention=transparent)
  tokens = np.asarray(decoding.decode(model, variables, SOURCE, max_length=8))
  forced = np.asarray(jnp.argmax(jit_apply(model, variables, SOURCE, jnp.asarray(tokens)), -1))
  for row in range(tokens.shape[0]):
    # Up to the first EOS or padding, after which decoding emits padding.
    stop = next((t for t, token in enumerate(tokens[row]) if token in (0, 2)), 7)
    np.testing.assert_array_equal(tokens[row, :stop + 1], forced[row, :stop + 1])


def test_beam_search_of_one_beam_decodes_as_greedy():
  model, variables = _model_and_variables()
  np.testing.assert_array_equal(
      jit_call(decoding.beam_search, model, variables, SOURCE, max_length=8, beam_size=1),
      decoding.decode(model, variables, SOURCE, max_length=8))


def test_decoder_is_causal_and_ignores_padded_source_tokens():
  model, variables = _model_and_variables()
  logits = jit_apply(model, variables, SOURCE, TARGET)
  later = TARGET.at[:, 3:].set(5)
  assert_close(jit_apply(model, variables, SOURCE, later)[:, :4], logits[:, :4], atol=1e-5)
  assert not np.allclose(jit_apply(model, variables, SOURCE, later)[:, 4:], logits[:, 4:],
                         atol=1e-3)
  # The padding's token ids are hidden from the encoder and the cross-attention.
  repadded = jnp.where(SOURCE == 0, 11, SOURCE)
  padding = SOURCE == 0
  source_lengths = jnp.sum(~padding, axis=1)
  assert_close(_with_lengths(model, variables, repadded, source_lengths), logits, atol=1e-5)


def test_decoder_with_a_mixture_of_experts_is_causal():
  """Capacity-limited routing let later targets take the expert slots of
  earlier ones (logits at positions 0..3 moved by changing targets 3..); the
  decoder's feed-forward routes causally."""
  model, variables = _model_and_variables(
      feed_forward="moe", feed_forward_options=dict(num_experts=4, top_k=2, capacity_factor=0.5))
  logits = jit_apply(model, variables, SOURCE, TARGET)
  later = TARGET.at[:, 3:].set(5)
  assert_close(jit_apply(model, variables, SOURCE, later)[:, :4], logits[:, :4], atol=1e-6)


def _with_lengths(model, variables, source, source_lengths):
  """The teacher-forced logits with the source's padding given by lengths, not
  by token 0 (the model reads padding from the ids; here they are nonzero)."""
  from attention_jax.models.seq2seq import shift_right  # pylint: disable=import-outside-toplevel

  def forward(module):
    mask = jnp.arange(source.shape[1])[None] < source_lengths[:, None]
    encoded = module.encoder(source, padding_mask=mask)
    return module.decoder(shift_right(TARGET), encoded, source_lengths)

  return jax.jit(nn.apply(forward, model))(variables)  # one program, not op by op


@pytest.mark.parametrize("scan_layers", [False, True])
def test_the_stack_hands_on_every_layer_output_in_its_carry(scan_layers):
  config = ModelConfig.from_config(dict(embed_dim=16, num_heads=2, mlp_dim=32, num_layers=4,
                                        dropout_rate=0.0, scan_layers=scan_layers,
                                        layer_attention=("local", "dot_product"),
                                        attention_options=dict(window_size=2)))
  x = jax.random.normal(jax.random.PRNGKey(0), (2, 8, 16))
  module = _Stack(config)
  variables = jit_init(module, jax.random.PRNGKey(1), x)
  out, carry = jit_apply(module, variables, x)
  layers = carry[LAYER_OUTPUTS]
  assert layers.shape == (2, 5, 8, 16)
  assert_close(layers[:, 0], x)
  assert_close(layers[:, -1], out)
  # Layer i's output is what the stack cut to i layers returns.
  for i in range(1, 4):
    if scan_layers and i % 2:
      continue  # a scanned stack is cut at whole periods only
    cut = _Stack(dataclasses.replace(config, num_layers=i))
    if scan_layers:
      params = {"params": {"blocks": jax.tree.map(lambda a, i=i: a[:i // 2],
                                                  variables["params"]["blocks"])}}
    else:
      params = {"params": {k: v for k, v in variables["params"].items()
                           if int(k.split("_")[1]) < i}}
    assert_close(layers[:, i], jit_apply(cut, params, x)[0], atol=1e-5)


class _Stack(nn.Module):
  config: ModelConfig

  @nn.compact
  def __call__(self, x):
    return run_layers(self.config, x, keep_layer_outputs=True)


def test_transparent_attention_with_all_weight_on_the_last_layer_is_the_plain_model():
  """softmax(w_j) one-hot on h_L: every decoder layer reads the last encoder
  layer, normalised (the context norms and the encoder's final norm at the
  same parameters), as the plain encoder-decoder does."""
  model, variables = _model_and_variables(transparent_attention=True)
  plain = build_model(MODEL)
  params = dict(variables["params"])
  params["decoder"] = dict(params["decoder"])
  weights = np.full((2, 3), -1e4, np.float32)
  weights[:, -1] = 0.0
  params["decoder"]["transparent_weights"] = jnp.asarray(weights)
  final_norm = params["encoder"]["final_norm"]
  for j in range(2):
    params["decoder"][f"context_norm_{j}"] = final_norm
  plain_params = {"encoder": params["encoder"], "decoder": {
      k: v for k, v in params["decoder"].items()
      if k != "transparent_weights" and not k.startswith("context_norm")}}
  assert_close(jit_apply(model, {"params": params}, SOURCE, TARGET),
               jit_apply(plain, {"params": plain_params}, SOURCE, TARGET), atol=1e-5)
  # Uniform weights read a different (mean) source.
  params["decoder"]["transparent_weights"] = jnp.zeros((2, 3))
  assert not np.allclose(jit_apply(model, {"params": params}, SOURCE, TARGET),
                         jit_apply(plain, {"params": plain_params}, SOURCE, TARGET), atol=1e-3)


def test_bad_configs_raise_naming_the_field():
  with pytest.raises(ValueError, match=r"model.cross_attention 'bigbird' has no "
                     r"cross-attention form; variants with one: .*additive"):
    build_model({**MODEL, "cross_attention": "bigbird"})
  with pytest.raises(ValueError, match=r"the Transformer decoder's self-attention needs causal "
                     r"attention; attention 'linformer'"):
    build_model({**MODEL, "attention": "linformer"})
  with pytest.raises(ValueError, match=r"model.transparent_attention is set, but only kind "
                     r"'transformer_seq2seq'.*got kind 'classifier'"):
    build_model(dict(kind="classifier", transparent_attention=True))
  with pytest.raises(ValueError, match=r"model.cross_attention='additive' is set, but only"):
    build_model(dict(kind="classifier", cross_attention="additive"))
  model, variables = _model_and_variables()
  with pytest.raises(ValueError, match=r"max_length=13 decoding steps do not fit the model's "
                     r"buffer of 12 tokens"):
    decoding.decode(model, variables, SOURCE, max_length=13)
