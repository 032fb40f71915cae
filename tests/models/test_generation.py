"""Generation from the language model: the decoding cache, sampling, and every
causal variant decoding one token at a time (or refusing to, with a reason)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from attention_jax import registry
from attention_jax.models import ModelConfig, build_model
from attention_jax.models.generation import (decoding_model, empty_cache, generate,
                                             sample_logits)
from attention_testing import jit_apply, jit_call, jit_init, perturbed

B, T, VOCAB = 2, 12, 11
CAUSAL_MIXERS = [n for n in registry.list_variants("mixer") if registry.get_variant(n).causal]


def _config(**overrides):
  fields = dict(vocab_size=VOCAB, num_layers=2, embed_dim=16, num_heads=2, mlp_dim=32,
                max_length=T, dropout_rate=0.0, kind="language_model")
  fields.update(overrides)
  return ModelConfig.from_config(fields)


def _model_and_variables(config, seed=0):
  model = build_model(config)
  tokens = jax.random.randint(jax.random.PRNGKey(seed + 1), (B, T), 1, VOCAB)
  variables = jit_init(model, jax.random.PRNGKey(seed), tokens)
  return model, {**variables, "params": perturbed(variables["params"])}, tokens


def _assert_decodes_as_its_full_pass(config, prompt_length=5):
  """A prompt of 5 tokens in one call, then one token at a time, gives the
  logits of one full causal pass (both in one compiled program)."""
  model, variables, tokens = _model_and_variables(config)
  decoder = decoding_model(model)

  def full_and_decoded(variables, tokens):
    def decode(cache, tokens):
      logits, state = decoder.apply({**variables, "cache": cache}, tokens, mutable=["cache"])
      return state["cache"], logits

    cache, prompt_logits = decode(empty_cache(decoder, B, T), tokens[:, :prompt_length])
    # One token per step: tokens [T - prompt, B, 1] -> logits [T - prompt, B, 1, V].
    _, step_logits = jax.lax.scan(decode, cache, tokens[:, prompt_length:, None].swapaxes(0, 1))
    decoded = jnp.concatenate([prompt_logits, step_logits[:, :, 0].swapaxes(0, 1)], axis=1)
    return model.apply(variables, tokens), decoded

  expected, decoded = jax.jit(full_and_decoded)(variables, tokens)
  np.testing.assert_allclose(decoded, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("overrides", [
    dict(position="sinusoidal"), dict(position="learned"), dict(position="complex"),
    dict(position="rope"), dict(position="alibi"), dict(position="t5"),
    dict(position="xl_relative"), dict(position="shaw"), dict(position="rope", scan_layers=True),
    dict(num_kv_heads=1), dict(stack="reversible")])
def test_greedy_generation_is_the_argmax_of_the_full_forward_pass(overrides):
  model, variables, tokens = _model_and_variables(_config(**overrides))
  prompt = tokens[:, :4]
  out = generate(model, variables["params"], prompt, max_new_tokens=T - 4)
  assert out.shape == (B, T) and (out[:, :4] == prompt).all()
  # One causal pass over the output scores every prefix: position t - 1 sees
  # tokens up to t - 1 only, as the pass over `out[:, :t]` would.
  logits = jit_apply(model, variables, out)
  np.testing.assert_array_equal(out[:, 4:], jnp.argmax(logits[:, 3:-1], axis=-1))


# Options that fit T = 12 tokens (weights sized by the length, blocks to choose
# from); chunks of 4 make the chunkwise mixers' 5-token prompt span two chunks.
SHORT_OPTIONS = {"moba": {"block_size": 4, "top_k": 2},
                 **{name: {"chunk_size": 4} for name in registry.list_variants()
                    if registry.get_variant(name).family == "chunkwise"},
                 "nsa": {"compress_block_size": 4, "compress_stride": 2, "select_block_size": 2,
                         "top_n": 4, "window": 4}}


@pytest.mark.parametrize("name", CAUSAL_MIXERS)
def test_every_causal_variant_decodes_as_its_full_pass_or_says_why_not(name):
  options = {"max_length": T} if name.startswith("synthesizer") else SHORT_OPTIONS.get(name, {})
  # One layer: each layer keeps its own cache by the same code, which the
  # two-layer models of the tests above and below decode through.
  config = _config(attention=name, attention_options=options, num_layers=1)
  refusal = registry.get_variant(name).decoding_refusal
  if refusal is not None:
    with pytest.raises(ValueError, match=f"attention variant '{name}' cannot decode one token "
                                         f"at a time: "):
      empty_cache(decoding_model(build_model(config)), B, T)
    return
  _assert_decodes_as_its_full_pass(config)


@pytest.mark.parametrize("overrides", [
    dict(output_gate="elementwise", value_residual=0.5),
    dict(output_gate="headwise", value_residual=0.25, scan_layers=True, num_layers=3),
    dict(position="rope", position_options={"scaling": "yarn", "scaling_factor": 4.0,
                                            "original_length": 4, "rotary_fraction": 0.5}),
    dict(position="xpos", position_options={"scale_base": 16.0}), dict(position="none"),
    # A sliding window over absolute positions, the new queries' and the cache's.
    dict(attention_options={"local_window_size": (3, 0)}),
    # Learned sinks of the flex engine, in a StreamingLLM cache of 5 slots.
    dict(attention="flex", attention_options={"sinks": True, "softcap": 5.0},
         streaming_attention=(1, 4)),
    # QK-norm before the rotation, of the cache's keys too.
    dict(attention="flex", attention_options={"qk_norm": "rms"}, position="rope"),
    # NSA's three key/value sets per group (one per branch), rotated, cached and
    # mixed with the first layer's values like one set.
    dict(attention="nsa", attention_options=SHORT_OPTIONS["nsa"], position="rope",
         value_residual=0.5, scan_layers=True)])
def test_layer_options_and_positions_decode_as_their_full_pass(overrides):
  _assert_decodes_as_its_full_pass(_config(**overrides))


def test_a_hybrid_of_gated_delta_net_and_sliding_window_attention_trains_and_decodes():
  """Gated DeltaNet's hybrid through `layer_attention`: three gated_delta_net
  layers, then one of attention over a sliding window of 3 past tokens. Each
  layer is the mixer its schedule names, a few Adam steps on a fixed batch
  lower the loss with a gradient in every layer, and decoding (the recurrent
  state in three layers, the key-value cache in the fourth) equals the full
  pass."""
  config = _config(num_layers=4, layer_attention=("gated_delta_net",) * 3 + ("dot_product",),
                   attention_options={"chunk_size": 4, "local_window_size": (3, 0)})
  model, variables, tokens = _model_and_variables(config)
  blocks = [variables["params"]["encoder"][f"block_{i}"]["attention"] for i in range(4)]
  assert ["beta" in block for block in blocks] == [True, True, True, False]
  assert set(blocks[3]) == {"query", "key", "value", "out"}

  def loss(params):
    logits = model.apply({"params": params}, tokens[:, :-1])
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], -1))

  optimizer = optax.adam(1e-2)

  @jax.jit
  def step(params, state):
    value, grads = jax.value_and_grad(loss)(params)
    updates, state = optimizer.update(grads, state)
    return optax.apply_updates(params, updates), state, value, grads

  params = variables["params"]
  state = optimizer.init(params)
  losses = []
  for _ in range(5):
    params, state, value, grads = step(params, state)
    losses.append(float(value))
  assert losses[-1] < losses[0], losses
  for i in range(4):
    block_grads = jax.tree.leaves(grads["encoder"][f"block_{i}"]["attention"])
    assert max(float(jnp.abs(g).max()) for g in block_grads) > 0, f"block {i}"
  _assert_decodes_as_its_full_pass(config)


def test_sampling_restricted_to_the_top_tokens():
  logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]] * 2))
  # Each setting one program, drawn with 200 keys (op by op: ~30 programs, 20 ops a draw).
  draws = lambda **kw: np.stack([jit_call(sample_logits, logits, jax.random.PRNGKey(i), **kw)
                                 for i in range(200)])
  greedy = np.asarray(jit_call(sample_logits, logits, None, temperature=0.0))
  np.testing.assert_array_equal(greedy, [0, 0])
  np.testing.assert_array_equal(draws(top_k=1), 0)
  np.testing.assert_array_equal(draws(top_p=0.4), 0)  # 0.5 alone reaches 0.4
  assert set(np.unique(draws(top_k=2))) == {0, 1}
  assert set(np.unique(draws(top_p=0.7))) == {0, 1}  # 0.5 < 0.7 <= 0.5 + 0.3
  assert set(np.unique(draws())) == {0, 1, 2, 3}
  # A draw is a function of the key.
  np.testing.assert_array_equal(jit_call(sample_logits, logits, jax.random.PRNGKey(3)),
                                jit_call(sample_logits, logits, jax.random.PRNGKey(3)))


def test_sampled_generation_follows_its_key_and_top_k_one_is_greedy():
  model, variables, tokens = _model_and_variables(_config())
  params, prompt = variables["params"], tokens[:, :3]
  greedy = generate(model, params, prompt, 6)
  np.testing.assert_array_equal(
      generate(model, params, prompt, 6, temperature=1.0, top_k=1, rng=jax.random.PRNGKey(5)),
      greedy)
  first = generate(model, params, prompt, 6, temperature=1.5, rng=jax.random.PRNGKey(1))
  np.testing.assert_array_equal(
      generate(model, params, prompt, 6, temperature=1.5, rng=jax.random.PRNGKey(1)), first)
  others = [generate(model, params, prompt, 6, temperature=1.5, rng=jax.random.PRNGKey(k))
            for k in range(2, 6)]
  assert any((other != first).any() for other in others)


def test_a_token_past_the_cache_is_an_error():
  model, variables, tokens = _model_and_variables(_config())
  decoder = decoding_model(model)
  _, state = jit_apply(decoder, {**variables, "cache": empty_cache(decoder, B, 4)},
                       tokens[:, :4], mutable=["cache"])
  with pytest.raises(ValueError, match="the KV cache holds 4 tokens and 4 are in it"):
    decoder.apply({**variables, **state}, tokens[:, 4:5], mutable=["cache"])
  # Under jit the index is traced: the check runs as a callback and aborts.
  step = jax.jit(lambda cache, tokens: decoder.apply({**variables, "cache": cache}, tokens,
                                                     mutable=["cache"]))
  with pytest.raises(Exception, match="the KV cache holds 4 tokens and 4 are in it"):
    jax.block_until_ready(step(state["cache"], tokens[:, 4:5]))


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_new_tokens=T - 3), "prompt length 4 \\+ max_new_tokens 9 = 13 tokens exceeds the "
                                 "model's max_length=12"),
    (dict(max_new_tokens=0), "max_new_tokens must be an int >= 1, got 0"),
    (dict(max_new_tokens=2, top_k=0), "top_k must be a positive int"),
    (dict(max_new_tokens=2, top_p=1.5), "top_p must be in \\(0, 1\\]"),
    (dict(max_new_tokens=2, top_p=0.0), "top_p must be in \\(0, 1\\]"),
    (dict(max_new_tokens=2, temperature=-0.5), "temperature must be >= 0"),
    (dict(max_new_tokens=2, temperature=1.0), "rng must be a PRNG key"),
])
def test_bad_generation_arguments_name_themselves(kwargs, message):
  model, variables, tokens = _model_and_variables(_config())
  with pytest.raises(ValueError, match=message):
    generate(model, variables["params"], tokens[:, :4], **kwargs)


def test_only_a_language_model_generates():
  classifier = build_model(_config(kind="classifier"))
  with pytest.raises(ValueError, match="model must be a causal language model"):
    generate(classifier, {}, jnp.ones((1, 2), jnp.int32), 2)
  with pytest.raises(ValueError, match="prompt must be \\[B, P\\] integer token ids"):
    generate(build_model(_config()), {}, jnp.ones((2,), jnp.int32), 2)
