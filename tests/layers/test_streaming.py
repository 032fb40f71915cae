"""StreamingLLM attention: sinks plus a window, as a mask in the full pass and as
a cache of fixed size in decoding."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attention_jax as aj
from attention_jax.models import ModelConfig, build_model
from attention_jax.models.generation import decoding_model, empty_cache
from attention_testing import assert_close, jit_apply, jit_init

B, T, E, H = 2, 15, 16, 2
SINKS, WINDOW = 2, 4


def _visible_by_loops(length):
  allowed = np.zeros((length, length), bool)
  for q in range(length):
    for k in range(q + 1):
      allowed[q, k] = k < SINKS or q - k < WINDOW
  return allowed


def test_the_full_pass_sees_the_sinks_and_the_window():
  layer = aj.MultiHeadAttention(num_heads=H, streaming=(SINKS, WINDOW), position="rope")
  x = jax.random.normal(jax.random.PRNGKey(0), (B, T, E))
  params = nn.meta.unbox(jit_init(layer, jax.random.PRNGKey(1), x, is_causal=True)["params"])
  plain = aj.MultiHeadAttention(num_heads=H, position="rope")
  want = jit_apply(plain, {"params": params}, x,
                   mask=jnp.asarray(_visible_by_loops(T))[None, None])
  assert_close(jit_apply(layer, {"params": params}, x, is_causal=True), want)


def test_decoding_past_the_cache_equals_the_full_pass_with_a_cache_of_fixed_size():
  """Three times the cache's length, one token at a time, with RoPE: each
  cached key is rotated at its position in the text."""
  config = ModelConfig.from_config(dict(
      kind="language_model", vocab_size=11, num_layers=2, embed_dim=E, num_heads=H, mlp_dim=32,
      max_length=T, dropout_rate=0.0, position="rope", streaming_attention=(SINKS, WINDOW)))
  model = build_model(config)
  tokens = jax.random.randint(jax.random.PRNGKey(2), (B, T), 1, 11)
  variables = jit_init(model, jax.random.PRNGKey(3), tokens)
  expected = jit_apply(model, variables, tokens)
  decoder = decoding_model(model)
  cache = empty_cache(decoder, B, T)
  sizes = {leaf.shape[1] for leaf in jax.tree.leaves(cache) if leaf.ndim == 4}
  assert sizes == {SINKS + WINDOW}  # not T: the cache does not grow with the text
  step = jax.jit(lambda cache, tokens: decoder.apply({**variables, "cache": cache}, tokens,
                                                     mutable=["cache"]))
  logits, state = step(cache, tokens[:, :3])  # a prompt, then one token at a time
  pieces = [logits]
  for t in range(3, T):
    logits, state = step(state["cache"], tokens[:, t:t + 1])
    pieces.append(logits)
  np.testing.assert_allclose(jnp.concatenate(pieces, axis=1), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("overrides, message", [
    (dict(streaming_attention=(2, 0)), r"model.streaming_attention must be \(sinks, window\)"),
    (dict(streaming_attention=(2, 4), kind="classifier"), "for a language model"),
])
def test_bad_settings_are_named(overrides, message):
  with pytest.raises(ValueError, match=message):
    ModelConfig.from_config(dict(dict(kind="language_model", embed_dim=E, num_heads=H),
                                 **overrides))


def test_the_default_config_takes_it_as_a_typed_placeholder():
  """`--config.model.streaming_attention=(2,8)` needs a placeholder of type tuple."""
  from attention_jax.models.config import default_model_config  # pylint: disable=import-outside-toplevel
  config = default_model_config()
  assert config.streaming_attention is None
  config.streaming_attention = (2, 8)
  config.kind = "language_model"
  assert ModelConfig.from_config(config).streaming_attention == (2, 8)
