"""Attention pooling (HAN's learned query, its hierarchical form, Lin et al.'s
several queries) and ESIM's cross alignment against their formulas in numpy;
padding; the classifier pooling by attention; and what is refused."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_jax import registry, train
from attention_jax.models import Block, Encoder, ModelConfig, SequenceClassifier, build_model
from attention_jax.models.blocks import make_mixer
from attention_jax.train.config import parse_config_arg
from attention_jax.variants import pooling
from attention_testing import (as_float64, assert_close, jit_apply, jit_call, jit_init, np_softmax,
                               perturbed)

B, T, E, A = 3, 7, 5, 4


def _normal(seed, shape, scale=1.0):
  return jax.random.normal(jax.random.PRNGKey(seed), shape) * scale


def _level(seed, features=E, width=A, queries=None):
  """One level's pooling arrays: kernel [E, A], bias [A], context vector [A] or [H, A]."""
  shape = (width,) if queries is None else (queries, width)
  return dict(kernel=_normal(seed, (features, width), 0.5), bias=_normal(seed + 1, (width,)),
              context_vector=_normal(seed + 2, shape))


def np_attention_pooling(x, kernel, bias, context_vector, allowed):
  """sum_t softmax_t(tanh(x_t W + b) . u) x_t over the allowed t, per query:
  x [N, T, E], context_vector [H, A], allowed [N, T] -> ([N, H, E], weights [N, H, T])."""
  x = as_float64(x)
  hidden = np.tanh(x @ as_float64(kernel) + as_float64(bias))
  logits = np.einsum("nta,ha->nht", hidden, as_float64(context_vector))
  weights = np.zeros_like(logits)
  for n in range(x.shape[0]):
    real = np.asarray(allowed[n], bool)
    if real.any():  # nothing to pool: weights 0
      weights[n][:, real] = np_softmax(logits[n][:, real])
  return np.einsum("nht,nte->nhe", weights, x), weights


def _mask(rows):
  return jnp.asarray(np.array(rows, bool))


# Padding anywhere in row 0, at the end of row 1, none in row 2.
MASK = _mask([[1, 0, 1, 1, 0, 1, 0], [1, 1, 1, 0, 0, 0, 0], [1] * T])


# --------------------------------------------------------------------------------------
# attention_pooling.


@pytest.mark.property("attention_pooling")
@pytest.mark.parametrize("queries", [None, 3])
def test_attention_pooling_is_the_formula_and_padded_tokens_get_weight_zero(queries):
  x = _normal(0, (B, T, E))
  level = _level(1, queries=queries)
  lengths = jnp.array([7, 7, 6])  # combined with the mask: row 2 loses its last token
  pooled, weights = jax.jit(lambda x: pooling.attention_pooling(
      x, mask=MASK, lengths=lengths, return_weights=True, **level))(x)
  allowed = np.asarray(MASK) & (np.arange(T)[None] < np.asarray(lengths)[:, None])
  expected, expected_weights = np_attention_pooling(
      x, level["kernel"], level["bias"], np.atleast_2d(level["context_vector"]), allowed)
  heads = 1 if queries is None else queries
  assert pooled.shape == ((B, E) if queries is None else (B, heads * E))
  assert weights.shape == ((B, T) if queries is None else (B, heads, T))
  assert_close(pooled, expected.reshape(B, -1), rtol=1e-5, atol=1e-5)
  assert_close(weights, expected_weights.reshape(weights.shape), rtol=1e-5, atol=1e-6)
  weights = np.asarray(weights).reshape(B, heads, T)
  assert_close(weights.sum(-1), np.ones((B, heads)))
  assert np.all(weights[~np.broadcast_to(allowed[:, None], weights.shape)] == 0)
  # Padding content does not reach the result.
  noise = jnp.where(jnp.asarray(allowed)[..., None], x, 1e3)
  assert_close(jit_call(pooling.attention_pooling, noise, mask=MASK, lengths=lengths, **level),
               pooled, rtol=1e-5, atol=1e-5)


@pytest.mark.property("attention_pooling")
def test_a_zero_context_vector_is_mean_pooling_and_an_empty_row_pools_to_zeros():
  x = _normal(2, (B, T, E))
  level = dict(_level(3), context_vector=jnp.zeros((A,)))
  mask = MASK.at[2].set(False)  # row 2: nothing to pool

  def loss(x, level):
    pooled = pooling.attention_pooling(x, mask=mask, **level)
    return jnp.sum(pooled ** 2), pooled

  (_, pooled), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(x, level)
  real = np.asarray(mask)[..., None]
  mean = (np.asarray(x) * real).sum(1) / np.maximum(real.sum(1), 1)
  assert_close(pooled, mean, rtol=1e-5, atol=1e-6)
  assert_close(pooled[2], np.zeros(E))
  assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))


@pytest.mark.property("attention_pooling")
def test_the_module_pools_with_its_parameters_several_queries_concatenated():
  x = _normal(4, (B, T, E))
  module = pooling.AttentionPooling(num_queries=2, attention_dim=3)
  params = perturbed(jit_init(module, jax.random.PRNGKey(0), x)["params"])
  assert {k: v.shape for k, v in params.items()} == {
      "kernel": (E, 3), "bias": (3,), "context_vector": (2, 3)}
  got = jit_apply(module, {"params": params}, x, mask=MASK)
  expected, _ = np_attention_pooling(x, params["kernel"], params["bias"],
                                     params["context_vector"], np.asarray(MASK))
  assert got.shape == (B, 2 * E)
  assert_close(got, expected.reshape(B, 2 * E), rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------------
# The hierarchical form (HAN).

S, W = 3, 4
# Document 0: its middle sentence is all padding; document 1: its last;
# document 2: no word at all.
WORD_MASK = _mask([[[1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 0]],
                   [[1, 1, 1, 1], [1, 0, 0, 0], [0, 0, 0, 0]],
                   [[0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]]])


def np_hierarchical(x, word, sentence, word_mask):
  """Word pooling per sentence, then sentence pooling, both by `np_attention_pooling`."""
  batch, sentences, words, features = x.shape
  flat_mask = np.asarray(word_mask).reshape(batch * sentences, words)
  vectors, _ = np_attention_pooling(np.asarray(x).reshape(-1, words, features), word["kernel"],
                                    word["bias"], np.atleast_2d(word["context_vector"]),
                                    flat_mask)
  vectors = vectors.reshape(batch, sentences, -1)
  document, weights = np_attention_pooling(vectors, sentence["kernel"], sentence["bias"],
                                           np.atleast_2d(sentence["context_vector"]),
                                           np.asarray(word_mask).any(-1))
  return document.reshape(batch, -1), weights


@pytest.mark.property("attention_pooling")
def test_hierarchical_pooling_is_word_pooling_then_sentence_pooling():
  x = _normal(5, (B, S, W, E))
  word, sentence = _level(6), _level(9, queries=2)
  got = jax.jit(lambda x: pooling.hierarchical_attention_pooling(x, word, sentence,
                                                                 WORD_MASK))(x)
  expected, weights = np_hierarchical(x, word, sentence, WORD_MASK)
  assert got.shape == (B, 2 * E)
  assert_close(got, expected, rtol=1e-5, atol=1e-5)
  assert np.all(weights[0, :, 1] == 0) and np.all(weights[1, :, 2] == 0)  # empty sentences
  assert_close(got[2], np.zeros(2 * E))  # an empty document pools to zeros, not NaN
  # Document 0 without its empty sentence pools to the same vector.
  kept = jnp.asarray(x)[0:1, jnp.array([0, 2])]
  alone = jit_call(pooling.hierarchical_attention_pooling, kept, word, sentence,
                   WORD_MASK[0:1, [0, 2]])
  assert_close(alone[0], got[0], rtol=1e-5, atol=1e-5)
  # Neither padded words nor empty sentences reach the result.
  noise = jnp.where(WORD_MASK[..., None], x, -50.0)
  assert_close(jit_call(pooling.hierarchical_attention_pooling, noise, word, sentence, WORD_MASK),
               got, rtol=1e-5, atol=1e-5)


@pytest.mark.property("attention_pooling")
def test_sentence_length_cuts_the_sequence_into_chunks_and_pools_twice():
  x = _normal(7, (B, T, E))
  module = pooling.AttentionPooling(sentence_length=3, num_queries=2)
  params = perturbed(jit_init(module, jax.random.PRNGKey(0), x)["params"])
  got = jit_apply(module, {"params": params}, x, mask=MASK)
  # T = 7 in chunks of 3: the third chunk holds one token and two of padding.
  chunks = np.zeros((B, 9, E), np.float32)
  chunks[:, :T] = x
  chunk_mask = np.zeros((B, 9), bool)
  chunk_mask[:, :T] = np.asarray(MASK)
  level = lambda prefix: {k: params[prefix + k] for k in ("kernel", "bias", "context_vector")}
  expected, _ = np_hierarchical(chunks.reshape(B, 3, 3, E), level("word_"), level("sentence_"),
                                chunk_mask.reshape(B, 3, 3))
  assert got.shape == (B, 2 * E)
  assert_close(got, expected, rtol=1e-5, atol=1e-5)


# Padding at the end only, as the GRUs require: document 0 has an empty last
# sentence, document 2 no word at all.
GRU_MASK = _mask([[[1, 1, 0, 0], [1, 1, 1, 0], [0, 0, 0, 0]],
                  [[1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 0, 0]],
                  [[0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]]])


def _han(x, word_mask, seed=0):
  module = pooling.HierarchicalAttentionPooling(hidden_dim=3, num_queries=2)
  params = perturbed(jit_init(module, jax.random.PRNGKey(seed), x, word_mask=word_mask)["params"])
  return module, params


@pytest.mark.property("attention_pooling")
def test_han_with_gru_encoders_is_the_encoders_then_the_two_poolings_by_hand():
  x = _normal(8, (B, S, W, E))
  module, params = _han(x, GRU_MASK)
  got = jax.jit(lambda p, x: module.apply({"params": p}, x, word_mask=GRU_MASK))(params, x)
  assert got.shape == (B, 2 * 6)
  # By hand: the word GRU over each sentence, word pooling, the sentence GRU
  # over the sentence vectors (empty sentences at the end), sentence pooling.
  gru = pooling.BidirectionalGRU(3)
  level = lambda prefix: {k: params[prefix + k] for k in ("kernel", "bias", "context_vector")}
  words = np.asarray(jit_apply(gru, {"params": params["word_encoder"]}, x.reshape(B * S, W, E),
                               GRU_MASK.reshape(B * S, W)))
  flat_mask = np.asarray(GRU_MASK).reshape(B * S, W)
  word = level("word_")
  vectors, _ = np_attention_pooling(words, word["kernel"], word["bias"], word["context_vector"],
                                    flat_mask)
  sentence_mask = np.asarray(GRU_MASK).any(-1)
  vectors = np.asarray(jit_apply(gru, {"params": params["sentence_encoder"]},
                                 jnp.asarray(vectors.reshape(B, S, 6), jnp.float32),
                                 jnp.asarray(sentence_mask)))
  sentence = level("sentence_")
  expected, weights = np_attention_pooling(vectors, sentence["kernel"], sentence["bias"],
                                           sentence["context_vector"], sentence_mask)
  assert_close(got, expected.reshape(B, -1), rtol=1e-5, atol=1e-5)
  assert np.all(weights[0, :, 2] == 0)
  assert_close(got[2], np.zeros(12))


@pytest.mark.property("attention_pooling")
def test_han_ignores_padded_words_and_trailing_empty_sentences_with_finite_gradients():
  word_mask = GRU_MASK
  x = _normal(9, (B, S, W, E))
  module, params = _han(x, word_mask)

  def loss(params, x):
    got = jit_apply(module, {"params": params}, x, word_mask=word_mask)
    return jnp.sum(got ** 2), got

  (_, got), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, x)
  assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))
  assert np.all(np.asarray(grads[1])[~np.asarray(word_mask)] == 0)  # padding gets no gradient
  noise = jnp.where(word_mask[..., None], x, 7.0)
  assert_close(jit_apply(module, {"params": params}, noise, word_mask=word_mask), got,
               rtol=1e-5, atol=1e-5)
  # Document 0 without its empty sentence and without the padded last word column.
  trimmed = jit_apply(module, {"params": params}, x[0:1, :2, :3], word_mask=word_mask[0:1, :2, :3])
  assert_close(trimmed[0], got[0], rtol=1e-5, atol=1e-5)


def test_han_with_gru_refuses_padding_before_a_real_word():
  x = _normal(10, (B, S, W, E))
  module, params = _han(x, GRU_MASK)
  with pytest.raises(ValueError, match=r"word_mask must pad at the end of each row when "
                                       r"encoder='gru'.*encoder='none'"):
    module.apply({"params": params}, x, word_mask=GRU_MASK.at[0, 0, 0].set(False))
  with pytest.raises(ValueError, match=r"any\(word_mask, -1\) must pad at the end"):
    module.apply({"params": params}, x, word_mask=WORD_MASK)  # document 0's empty middle
  with pytest.raises(ValueError, match=r"unknown encoder 'lstm'.*gru, none"):
    pooling.HierarchicalAttentionPooling(encoder="lstm").init(jax.random.PRNGKey(0), x)


def test_han_without_encoders_takes_padding_anywhere_and_is_the_pure_function():
  x = _normal(11, (B, S, W, E))
  module = pooling.HierarchicalAttentionPooling(encoder="none")
  params = perturbed(jit_init(module, jax.random.PRNGKey(0), x, word_mask=WORD_MASK)["params"])
  level = lambda prefix: {k: params[prefix + k] for k in ("kernel", "bias", "context_vector")}
  expected, _ = np_hierarchical(x, level("word_"), level("sentence_"), WORD_MASK)
  assert_close(jit_apply(module, {"params": params}, x, word_mask=WORD_MASK), expected,
               rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------------
# cross_alignment.


def np_cross_alignment(a, b, a_allowed, b_allowed):
  """ESIM's alignment written out pair by pair, then [x; x~; x - x~; x * x~]."""
  a, b = as_float64(a), as_float64(b)
  a_aligned, b_aligned = np.zeros_like(a), np.zeros_like(b)
  for n in range(a.shape[0]):
    scores = a[n] @ b[n].T  # [Ta, Tb]
    for i in np.flatnonzero(a_allowed[n]):
      js = np.flatnonzero(b_allowed[n])
      if js.size:
        a_aligned[n, i] = np_softmax(scores[i, js]) @ b[n, js]
    for j in np.flatnonzero(b_allowed[n]):
      is_ = np.flatnonzero(a_allowed[n])
      if is_.size:
        b_aligned[n, j] = np_softmax(scores[is_, j]) @ a[n, is_]
  enhance = lambda x, y: np.concatenate([x, y, x - y, x * y], -1)
  return (enhance(a, a_aligned), enhance(b, b_aligned)), (a_aligned, b_aligned)


@pytest.mark.property("cross_alignment")
def test_cross_alignment_is_esim_both_ways_with_the_enhancement_layout():
  a, b = _normal(12, (B, T, E)), _normal(13, (B, 5, E))
  b_lengths = jnp.array([5, 2, 0])  # document 2's b is empty
  got_a, got_b = jax.jit(lambda a, b: pooling.cross_alignment(a, b, a_mask=MASK,
                                                              b_lengths=b_lengths))(a, b)
  b_allowed = np.arange(5)[None] < np.asarray(b_lengths)[:, None]
  (m_a, m_b), (a_aligned, b_aligned) = np_cross_alignment(a, b, np.asarray(MASK), b_allowed)
  assert got_a.shape == (B, T, 4 * E) and got_b.shape == (B, 5, 4 * E)
  assert_close(got_a, m_a, rtol=1e-5, atol=1e-5)
  assert_close(got_b, m_b, rtol=1e-5, atol=1e-5)
  # The layout, block by block: [x; x~; x - x~; x * x~].
  assert_close(got_a[..., :E], a)
  assert_close(got_a[..., E:2 * E], a_aligned, rtol=1e-5, atol=1e-5)
  assert_close(got_b[..., 3 * E:], np.asarray(b) * b_aligned, rtol=1e-5, atol=1e-5)
  # Nothing to align with: zeros, not NaN.
  assert_close(got_a[2, :, E:2 * E], np.zeros((T, E)))
  aligned = jit_call(pooling.cross_alignment, a, b, MASK, None, b_lengths=b_lengths,
                     enhanced=False)
  assert_close(aligned[0], a_aligned, rtol=1e-5, atol=1e-5)
  assert_close(aligned[1], b_aligned, rtol=1e-5, atol=1e-5)


@pytest.mark.property("cross_alignment")
def test_cross_alignment_ignores_padding_and_passes_finite_gradients_when_fully_masked():
  a, b = _normal(14, (B, T, E)), _normal(15, (B, 5, E))
  b_mask = _mask([[1, 0, 1, 1, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0]])
  module = pooling.CrossAlignment()

  def loss(a, b):
    aligned = jit_apply(module, {}, a, b, a_mask=MASK, b_mask=b_mask)
    return sum(jnp.sum(m ** 2) for m in aligned), aligned

  (_, (m_a, m_b)), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(a, b)
  assert all(np.isfinite(np.asarray(g)).all() for g in grads)
  noisy_a = jnp.where(MASK[..., None], a, 30.0)
  noisy_b = jnp.where(b_mask[..., None], b, -30.0)
  n_a, n_b = jit_apply(module, {}, noisy_a, noisy_b, a_mask=MASK, b_mask=b_mask)
  # The real tokens' enhancements do not move; padded ones keep their own x.
  assert_close(np.asarray(n_a)[np.asarray(MASK)], np.asarray(m_a)[np.asarray(MASK)],
               rtol=1e-5, atol=1e-5)
  assert_close(np.asarray(n_b)[np.asarray(b_mask)], np.asarray(m_b)[np.asarray(b_mask)],
               rtol=1e-5, atol=1e-5)
  assert_close(m_a[2, :, E:2 * E], np.zeros((T, E)))  # b of document 2 is all padding
  assert_close(m_b[2], np.zeros((5, 4 * E)) + np.concatenate(
      [b[2], np.zeros((5, E)), b[2], np.zeros((5, E))], -1))


# --------------------------------------------------------------------------------------
# The classifier pooling by attention.

V = 20
SMALL = dict(vocab_size=V, num_layers=1, embed_dim=8, num_heads=2, mlp_dim=16, max_length=12,
             dropout_rate=0.0, num_classes=3)


def _tokens(seed=0, length=8):
  return jax.random.randint(jax.random.PRNGKey(seed), (2, length), 2, V)


@pytest.mark.property("attention_pooling")
def test_classifier_pooling_by_attention_is_the_module_on_the_encoder_outputs():
  config = ModelConfig(**SMALL, pooling="attention", pooling_options={"num_queries": 2})
  model = SequenceClassifier(config)
  tokens = _tokens()
  mask = jnp.arange(8)[None] < jnp.array([[8], [5]])
  variables = nn.meta.unbox(jit_init(model, jax.random.PRNGKey(0), tokens))
  params = perturbed(variables["params"])
  assert "cls" not in params and set(params["pooling"]) == {"kernel", "bias", "context_vector"}
  logits = jit_apply(model, {"params": params}, tokens, padding_mask=mask)
  encoded = jit_apply(Encoder(config), {"params": params["encoder"]}, tokens, padding_mask=mask)
  pooled, _ = np_attention_pooling(encoded, params["pooling"]["kernel"],
                                   params["pooling"]["bias"],
                                   params["pooling"]["context_vector"], np.asarray(mask))
  expected = pooled.reshape(2, -1) @ as_float64(params["head"]["kernel"]) + as_float64(
      params["head"]["bias"])
  assert_close(logits, expected, rtol=1e-4, atol=1e-5)
  # Padded tokens do not change the logits; unmasked, they do.
  other = jnp.where(mask, tokens, _tokens(seed=5))
  assert_close(jit_apply(model, {"params": params}, other, padding_mask=mask), logits,
               rtol=1e-5, atol=1e-5)
  assert not np.allclose(jit_apply(model, {"params": params}, other), logits, atol=1e-4)


@pytest.mark.property("attention_pooling")
@pytest.mark.parametrize("pooling_options", [{}, {"sentence_length": 3}])
def test_a_classifier_pooling_by_attention_trains_with_the_trainer(pooling_options):
  config = dict(SMALL, pooling="attention", pooling_options=pooling_options)
  model = build_model(config)
  rng = np.random.default_rng(0)
  inputs = rng.integers(1, V, (4, 10)).astype(np.int32)
  inputs[:, 7:] = 0  # padding is token 0
  batch = dict(inputs=inputs, label=rng.integers(0, 3, 4).astype(np.int32),
               weight=np.ones(4, np.float32))
  mesh = train.make_mesh((1, 1, 1), devices=jax.devices()[:1])
  optimizer = train.make_optimizer(dict(learning_rate=1e-2, warmup_steps=1, num_train_steps=4))
  state, shardings = train.create_sharded_state(model, optimizer, batch, mesh)
  before = jax.device_get(state.params["pooling"])
  step = train.make_train_step(model, optimizer, mesh, shardings)
  # The head starts at zero, so the pooling gets a gradient from the second step on.
  for _ in range(3):
    state, metrics = step(state, train.shard_batch(batch, train.batch_sharding(mesh)))
    metrics = jax.device_get(metrics)
    assert all(np.isfinite(np.asarray(v)).all() for v in jax.tree.leaves(metrics))
  after = jax.device_get(state.params["pooling"])
  moved = jax.tree.map(lambda x, y: float(np.abs(np.asarray(x) - np.asarray(y)).max()),
                       before, after)
  assert all(np.isfinite(m) for m in jax.tree.leaves(moved))
  assert min(jax.tree.leaves(moved)) > 0  # every parameter of the pooling learns


def test_pooling_options_are_checked_against_the_pooling():
  with pytest.raises(ValueError, match=r"'attention_pooling' has no option 'num_query'\. "
                                       r"Did you mean 'num_queries'"):
    ModelConfig(**SMALL, pooling="attention", pooling_options={"num_query": 2})
  with pytest.raises(ValueError, match=r"model.pooling_options \{'num_queries': 2\} are set, but "
                                       r"pooling 'mean' takes no options"):
    ModelConfig(**SMALL, pooling="mean", pooling_options={"num_queries": 2})
  # Unset and default options are dropped, whatever the pooling (the default
  # config lists them all).
  config = ModelConfig(**SMALL, pooling="cls",
                       pooling_options={"num_queries": 1, "sentence_length": None})
  assert dict(config.pooling_options) == {}


@pytest.mark.parametrize("name", ["attention_pooling", "cross_alignment"])
def test_a_pooling_or_alignment_module_is_refused_as_a_token_mixer(name):
  message = rf"'{name}' is an? {registry.get_variant(name).role} module, not a token mixer"
  with pytest.raises(ValueError, match=message):
    ModelConfig(**SMALL, attention=name)
  with pytest.raises(ValueError, match=message):
    ModelConfig(**SMALL, layer_attention=("dot_product", name))
  with pytest.raises(ValueError, match=message):
    make_mixer(ModelConfig(**SMALL), name)
  with pytest.raises(ValueError, match=message):
    parse_config_arg(name, ())
  x = jnp.ones((1, 4, 8))
  with pytest.raises(ValueError, match=message):
    Block(ModelConfig(**SMALL), attention=name).init(jax.random.PRNGKey(0), x, {})


# --------------------------------------------------------------------------------------
# Bad arguments.


@pytest.mark.parametrize("call, message", [
    (lambda: pooling.attention_pooling(jnp.ones((2, 3)), **_level(0)),
     r"x must have shape \[B, T, E\], got shape \[2, 3\]"),
    (lambda: pooling.attention_pooling(jnp.ones((2, 3, 6)), **_level(0)),
     r"kernel must have shape \[E, A\] with E = 6 \(x's last size\), got shape \[5, 4\]"),
    (lambda: pooling.attention_pooling(jnp.ones((2, 3, E)), **dict(_level(0), bias=jnp.ones(3))),
     r"bias must have shape \[A\] = \[4\], got shape \[3\]"),
    (lambda: pooling.attention_pooling(jnp.ones((2, 3, E)),
                                       **dict(_level(0), context_vector=jnp.ones((2, 3)))),
     r"context_vector must have shape \[A\] or \[H, A\] with A = 4 .*got shape \[2, 3\]"),
    (lambda: pooling.attention_pooling(jnp.ones((2, 3, E)), mask=jnp.ones((1, 3), bool),
                                       **_level(0)),
     r"mask must have shape \[B, T\] = \[2, 3\], got shape \[1, 3\]"),
    (lambda: pooling.attention_pooling(jnp.ones((2, 3, E)), mask=jnp.ones((2, 3)), **_level(0)),
     r"mask must be boolean \(True for real tokens\), got dtype float32"),
    (lambda: pooling.attention_pooling(jnp.ones((2, 3, E)), lengths=jnp.ones((2, 1)),
                                       **_level(0)),
     r"lengths must have shape \[B\] = \[2\], got shape \[2, 1\]"),
    # Lengths are counts of tokens: a float (2.5 would keep 3 tokens), a bool
    # or a count outside [0, T] (silently none or all) is refused, as
    # dot_product_attention refuses its key_value_seq_lengths.
    (lambda: pooling.attention_pooling(jnp.ones((2, 3, E)), lengths=jnp.array([2.5, 3.0]),
                                       **_level(0)),
     r"lengths must be an integer array of shape \[B\] = \[2\], got float32 \[2\]"),
    (lambda: pooling.attention_pooling(jnp.ones((2, 3, E)), lengths=jnp.array([True, False]),
                                       **_level(0)),
     r"lengths must be an integer array of shape \[B\] = \[2\], got bool \[2\]"),
    (lambda: pooling.attention_pooling(jnp.ones((2, 3, E)), lengths=jnp.array([1, 4]),
                                       **_level(0)),
     r"lengths must lie in \[0, 3\], got values in \[1, 4\]"),
    (lambda: pooling.cross_alignment(jnp.ones((2, 3, E)), jnp.ones((2, 4, E)),
                                     b_lengths=jnp.array([-1, 2])),
     r"b_lengths must lie in \[0, 4\], got values in \[-1, 2\]"),
    (lambda: pooling.hierarchical_attention_pooling(jnp.ones((2, 3, E)), _level(0), _level(0)),
     r"x must have shape \[B, S, W, E\] \(S sentences of W words\), got shape \[2, 3, 5\]"),
    (lambda: pooling.hierarchical_attention_pooling(jnp.ones((2, 3, 4, E)), _level(0), _level(0),
                                                    jnp.ones((2, 3, 5), bool)),
     r"word_mask must have shape \[B, S, W\] = \[2, 3, 4\], got shape \[2, 3, 5\]"),
    (lambda: pooling.hierarchical_attention_pooling(jnp.ones((2, 3, 4, E)), _level(0),
                                                    _level(0, features=3)),
     r"sentence level: kernel must have shape \[E, A\] with E = 5"),
    (lambda: pooling.hierarchical_attention_pooling(jnp.ones((2, 3, 4, E)), {"kernel": 1},
                                                    _level(0)),
     r"word_parameters must hold 'context_vector', 'kernel' and optionally 'bias', got keys "
     r"\['kernel'\]"),
    (lambda: pooling.cross_alignment(jnp.ones((2, 3, E)), jnp.ones((2, 4, E + 1))),
     r"b must have a's batch and feature sizes, \[B, Tb, E\] = \[2, \*, 5\], got shape "
     r"\[2, 4, 6\]"),
    (lambda: pooling.cross_alignment(jnp.ones((2, 3, E)), jnp.ones((4, E))),
     r"a and b must be \[B, T, E\], got shapes \[2, 3, 5\] and \[4, 5\]"),
    (lambda: pooling.cross_alignment(jnp.ones((2, 3, E)), jnp.ones((2, 4, E)),
                                     b_mask=jnp.ones((2, 3), bool)),
     r"b_mask must have shape \[B, T\] = \[2, 4\], got shape \[2, 3\]"),
    (lambda: pooling.cross_alignment(jnp.ones((2, 3, E)), jnp.ones((2, 4, E)),
                                     a_lengths=jnp.ones(3)),
     r"a_lengths must have shape \[B\] = \[2\], got shape \[3\]"),
    (lambda: pooling.AttentionPooling(num_queries=0).init(jax.random.PRNGKey(0),
                                                          jnp.ones((2, 3, E))),
     r"num_queries must be an int >= 1, got 0"),
    (lambda: pooling.AttentionPooling(sentence_length=0).init(jax.random.PRNGKey(0),
                                                              jnp.ones((2, 3, E))),
     r"sentence_length must be an int >= 1, got 0"),
])
def test_bad_arguments_are_named_with_what_was_received_and_expected(call, message):
  with pytest.raises(ValueError, match=message):
    call()
