"""DualEncoderClassifier (retrieval's two towers) and LanguageModel (causal LM):
what they compute, checked against the parts they are built from."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_jax.models import (DualEncoderClassifier, Encoder, LanguageModel, ModelConfig,
                                  SequenceClassifier, build_model)
from attention_jax.models.classifier import masked_mean
from attention_testing import assert_close, jit_apply, jit_init

B, T, V, E = 3, 10, 24, 16
# dropout_rate=0.0: the old Encoder's and classifiers' default (ModelConfig's is 0.1).
SMALL = dict(vocab_size=V, num_layers=2, embed_dim=E, num_heads=4, mlp_dim=32, max_length=16,
             dropout_rate=0.0)


def _small(**overrides):
  """The checked ModelConfig of SMALL with `overrides`."""
  return ModelConfig.from_config({**SMALL, **overrides})


def _tokens(seed, length=T):
  return jax.random.randint(jax.random.PRNGKey(seed), (B, length), 1, V)


def _perturbed(variables, seed=3):
  """Random parameters everywhere: the zero-initialised head would make every logit 0."""
  leaves, tree = jax.tree.flatten(nn.meta.unbox(variables))
  rng = np.random.default_rng(seed)
  return jax.tree.unflatten(
      tree, [leaf + 0.3 * rng.standard_normal(leaf.shape, np.float32) for leaf in leaves])


@pytest.mark.parametrize("pooling,pair_features", [("cls", "lra"), ("mean", "lra"),
                                                   ("max", "sentence_bert")])
def test_dual_classifier_is_the_head_on_its_pair_features(pooling, pair_features):
  """LRA: [u, v, u * v, u - v]; Sentence-BERT: [u, v, |u - v|]."""
  config = _small(num_classes=3, pooling=pooling, head_mlp_dim=8, pair_features=pair_features)
  model = DualEncoderClassifier(config)
  tokens, tokens2 = _tokens(0), _tokens(1, length=T - 2)
  mask = jnp.arange(T)[None] < jnp.array([[T], [6], [3]])
  mask2 = jnp.ones((B, T - 2), bool)
  variables = _perturbed(jit_init(model, jax.random.PRNGKey(0), tokens, tokens2))
  params = variables["params"]
  # One encoder shared by both towers.
  assert sorted(params) == sorted(["encoder", "head_hidden", "head"] +
                                  (["cls"] if pooling == "cls" else []))
  logits = jit_apply(model, variables, tokens, tokens2, padding_mask=mask, padding_mask2=mask2)

  encoder = Encoder(config)

  @jax.jit
  def written_out(params):
    def tower(x, m):
      prefix = params["cls"] if pooling == "cls" else None
      out = encoder.apply({"params": params["encoder"]}, x, padding_mask=m, prefix=prefix)
      if pooling == "cls":
        return out[:, 0]
      if pooling == "mean":
        return masked_mean(out, m)
      return jnp.max(jnp.where(m[..., None], out, -jnp.inf), axis=1)

    u, v = tower(tokens, mask), tower(tokens2, mask2)
    if pair_features == "lra":
      features = jnp.concatenate([u, v, u * v, u - v], axis=-1)
    else:
      features = jnp.concatenate([u, v, jnp.abs(u - v)], axis=-1)
    hidden = jax.nn.relu(features @ params["head_hidden"]["kernel"]
                         + params["head_hidden"]["bias"])
    return hidden @ params["head"]["kernel"] + params["head"]["bias"]

  assert logits.shape == (B, 3)
  assert_close(logits, written_out(params), rtol=1e-5, atol=1e-5)
  # The order of the pair matters (u - v), so the towers are not mixed up.
  swapped = jit_apply(model, variables, tokens2, tokens, padding_mask=mask2, padding_mask2=mask)
  assert not np.allclose(swapped, logits, atol=1e-4)


def test_dual_classifier_ignores_padded_tokens_of_either_document():
  model = DualEncoderClassifier(_small(num_classes=2, pooling="mean"))
  tokens, tokens2 = _tokens(0), _tokens(1)
  mask = jnp.broadcast_to(jnp.arange(T)[None] < 6, (B, T))
  variables = _perturbed(jit_init(model, jax.random.PRNGKey(0), tokens, tokens2))
  logits = jit_apply(model, variables, tokens, tokens2, padding_mask=mask, padding_mask2=mask)
  changed = jit_apply(model, variables, tokens.at[:, 6:].set(5), tokens2.at[:, 7:].set(9),
                      padding_mask=mask, padding_mask2=mask)
  assert_close(changed, logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("attention", ["dot_product", "linear", "local"])
def test_language_model_logits_never_depend_on_later_tokens(attention):
  options = {"window_size": 3} if attention == "local" else {}
  model = LanguageModel(_small(kind="language_model", attention=attention,
                               attention_options=options))
  tokens = _tokens(0)
  variables = _perturbed(jit_init(model, jax.random.PRNGKey(0), tokens))
  logits = jit_apply(model, variables, tokens)
  assert logits.shape == (B, T, V) and logits.dtype == jnp.float32
  for t in (0, 4, T - 2):
    changed = jit_apply(model, variables, tokens.at[:, t + 1:].set((tokens[:, t + 1:] + 5) % V))
    assert_close(changed[:, :t + 1], logits[:, :t + 1], rtol=1e-5, atol=1e-5)
    # ...while the changed positions do move (the test can fail).
    assert not np.allclose(changed[:, t + 1:], logits[:, t + 1:], atol=1e-3)


def test_build_model_makes_each_kind_and_refuses_a_non_causal_language_model():
  common = dict(vocab_size=V, num_classes=4, num_layers=1, embed_dim=E, num_heads=2, mlp_dim=8,
                max_length=T)
  assert isinstance(build_model({**common, "kind": "dual_classifier"}), DualEncoderClassifier)
  assert isinstance(build_model({**common, "kind": "language_model"}), LanguageModel)
  with pytest.raises(ValueError, match=r"unknown model kind 'seq2seq'\. Did you mean "
                     r"'rnn_seq2seq'\? Valid names are: classifier, dual_classifier, "
                     r"language_model, rnn_seq2seq, transformer_seq2seq, vit, funnel, "
                     r"hierarchical, masked_language_model\."):
    build_model({**common, "kind": "seq2seq"})
  with pytest.raises(ValueError, match="'linformer' has no causal form"):
    build_model({**common, "kind": "language_model", "attention": "linformer"})


@pytest.mark.parametrize("attention,options", [("dot_product", {}), ("gmlp", {"max_length": T + 1}),
                                               ("xca", {})])
def test_cls_pooling_starts_with_gradients_of_the_size_of_mean_pooling(attention, options):
  """A [CLS] initialised at zero reaches the first pre-norm LayerNorm as a zero
  vector (it has no position embedding), whose derivative there is
  1/sqrt(epsilon): the gradient norm at initialisation was ~70x mean
  pooling's (dot_product) and ~10^12 (gmlp, xca), and global-norm clipping
  then left the other gradients at nothing."""
  import optax  # pylint: disable=import-outside-toplevel
  tokens = _tokens(0)
  norms = {}
  for pooling in ("cls", "mean"):
    # gmlp's weights are sized by the length: T tokens, one more with [CLS].
    sized = {"max_length": T + (pooling == "cls")} if "max_length" in options else {}
    config = _small(num_classes=4, pooling=pooling, attention=attention,
                    attention_options=sized, dropout_rate=0.0)
    model = SequenceClassifier(config)
    params = nn.meta.unbox(jit_init(model, jax.random.PRNGKey(0), tokens))["params"]
    # The zero-initialised head passes no gradient down; a random one does.
    params["head"]["kernel"] = jax.random.normal(jax.random.PRNGKey(1),
                                                 params["head"]["kernel"].shape)
    # One program for the gradient and its norm (op by op it was ~50 compiles).
    grad_norm = jax.jit(lambda p: optax.tree.norm(jax.grad(lambda p: jnp.mean(
        jax.nn.log_softmax(model.apply({"params": p}, tokens))[:, 0]))(p)))
    norms[pooling] = float(grad_norm(params))
  assert norms["cls"] < 5 * norms["mean"], norms
