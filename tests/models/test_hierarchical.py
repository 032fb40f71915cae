"""The hierarchical Transformer: equal to encoding each chunk on its own and then the
chunk vectors, padding chunks ignored, its config checks, and training."""

import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_jax.models import Encoder, HierarchicalTransformer, VectorEncoder, build_model
from attention_jax.models.classifier import masked_max, masked_mean
from attention_testing import assert_close, jit_apply, jit_call, jit_init, train_briefly

V, E, L = 11, 16, 4


def _model(**overrides):
  config = dict(kind="hierarchical", vocab_size=V, num_classes=3, num_layers=1, embed_dim=E,
                num_heads=2, mlp_dim=32, max_length=24, chunk_length=L, sentence_layers=1,
                dropout_rate=0.0)
  return build_model({**config, **overrides})


def _init(model, tokens, mask=None):
  """Variables with a non-zero head (it starts at zero), so logits show what it reads."""
  variables = nn.meta.unbox(jit_init(model, jax.random.PRNGKey(0), tokens, padding_mask=mask))
  params = dict(variables["params"])
  params["head"] = jax.tree.map(lambda a: jax.random.normal(jax.random.PRNGKey(1), a.shape),
                                params["head"])
  return {"params": params}


def _pool(x, mask, pooling):
  if pooling == "cls":
    return x[:, 0]
  return (masked_mean if pooling == "mean" else masked_max)(x, mask)


@pytest.mark.parametrize("pooling,position", [("cls", "learned"), ("mean", "sinusoidal"),
                                              ("max", "learned")])
def test_equals_each_chunk_encoded_alone_then_the_chunk_vectors(pooling, position):
  model = _model(pooling=pooling, position=position)
  config = model.config
  length = 14  # 4 chunks of 4, the last one half filled up with padding
  tokens = jax.random.randint(jax.random.PRNGKey(2), (2, length), 1, V)
  mask = jnp.arange(length)[None] < jnp.array([[14], [6]])  # document 1: chunks 2, 3 padding
  variables = _init(model, tokens, mask)
  params = variables["params"]
  token_encoder = Encoder(dataclasses.replace(config, max_length=L))
  sentence_encoder = VectorEncoder(dataclasses.replace(config, num_layers=1),
                                   num_positions=math.ceil(24 / L))
  chunk_prefix = params["chunk_cls"] if pooling == "cls" else None
  document_prefix = params["document_cls"] if pooling == "cls" else None
  expected = []
  for b in range(2):
    vectors, real = [], []
    for c in range(4):
      chunk = np.zeros((1, L), np.int32)
      chunk_mask = np.zeros((1, L), bool)
      # Sliced on the host: device slices are a program per index.
      part = np.asarray(tokens)[b, c * L:(c + 1) * L]
      chunk[0, :len(part)] = part
      chunk_mask[0, :len(part)] = np.asarray(mask)[b, c * L:(c + 1) * L]
      out = jit_apply(token_encoder, {"params": params["token_encoder"]}, jnp.asarray(chunk),
                      padding_mask=jnp.asarray(chunk_mask), prefix=chunk_prefix)
      vectors.append(jit_call(_pool, out, jnp.asarray(chunk_mask), pooling)[0])
      real.append(chunk_mask.any())
    real = jnp.asarray([real])
    out = jit_apply(sentence_encoder, {"params": params["sentence_encoder"]},
                    jnp.stack(vectors)[None], padding_mask=real,
                    prefix=document_prefix)
    document = jit_call(_pool, out, real, pooling)[0]
    expected.append(document @ params["head"]["kernel"] + params["head"]["bias"])
  assert_close(jit_apply(model, variables, tokens, padding_mask=mask), jnp.stack(expected),
               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("pooling", ["cls", "mean", "max"])
def test_padding_chunks_and_padded_tokens_change_nothing(pooling):
  model = _model(pooling=pooling)
  tokens = jax.random.randint(jax.random.PRNGKey(3), (2, 10), 1, V)
  mask = jnp.arange(10)[None] < jnp.array([[10], [7]])
  variables = _init(model, tokens, mask)
  logits = jit_apply(model, variables, tokens, padding_mask=mask)
  # Two more chunks of padding at the end of every document.
  longer = jnp.pad(tokens, ((0, 0), (0, 2 * L)))
  longer_mask = jnp.pad(mask, ((0, 0), (0, 2 * L)))
  assert_close(jit_apply(model, variables, longer, padding_mask=longer_mask), logits,
               rtol=1e-5, atol=1e-5)
  # Whatever sits at padded positions.
  changed = jnp.where(longer_mask, longer, (longer + 4) % (V - 1) + 1)
  assert_close(jit_apply(model, variables, changed, padding_mask=longer_mask), logits,
               rtol=1e-5, atol=1e-5)
  # ...while a real token of the second chunk does move them (the test can fail).
  moved = jit_apply(model, variables, tokens.at[:, 5].set(tokens[:, 5] % (V - 1) + 1),
                    padding_mask=mask)
  assert not np.allclose(moved, logits, atol=1e-4)


def test_without_a_mask_only_the_filled_up_tail_is_padding():
  model = _model()
  tokens = jax.random.randint(jax.random.PRNGKey(4), (2, 10), 1, V)
  variables = _init(model, tokens)
  assert_close(jit_apply(model, variables, tokens),
               jit_apply(model, variables, tokens, padding_mask=jnp.ones((2, 10), bool)),
               rtol=1e-6, atol=1e-6)


def test_chunks_are_one_batch_through_the_shared_encoder():
  model = _model()
  tokens = jax.random.randint(jax.random.PRNGKey(5), (3, 22), 1, V)
  variables = _init(model, tokens)
  _, state = jit_apply(model, variables, tokens, mutable=["intermediates"],
                       capture_intermediates=lambda m, _: isinstance(
                             m, (Encoder, VectorEncoder)))
  # 3 documents of ceil(22 / 4) = 6 chunks: 18 rows of [CLS] + 4 tokens.
  assert state["intermediates"]["token_encoder"]["__call__"][0].shape == (18, 1 + L, E)
  assert state["intermediates"]["sentence_encoder"]["__call__"][0].shape == (3, 1 + 6, E)
  assert set(variables["params"]) == {"chunk_cls", "token_encoder", "document_cls",
                                      "sentence_encoder", "head"}


@pytest.mark.parametrize("overrides,message", [
    (dict(chunk_length=32), r"model.chunk_length=32 must be at most max_length=24"),
    (dict(chunk_length=0), r"model.chunk_length must be an integer >= 1, got 0"),
    (dict(sentence_layers=0), r"model.sentence_layers must be an integer >= 1, got 0"),
    (dict(pooling="attention"), r"model.pooling of a hierarchical Transformer must be 'cls', "
                                r"'mean' or 'max' .*got 'attention'"),
    (dict(position="complex"), r"model.position 'complex' is a word embedding; kind "
                               r"'hierarchical'"),
    (dict(layer_attention=("dot_product", "linear"), num_layers=2, scan_layers=True,
          sentence_layers=3), r"model.sentence_layers=3 is not a multiple of 2"),
])
def test_bad_config_is_named(overrides, message):
  with pytest.raises(ValueError, match=message):
    _model(**overrides)


def test_the_listops_and_text_configs_build_it_and_the_trainer_trains_it(tmp_path):
  from attention_jax.train.config import load_config_module
  text = load_config_module("configs/lra/text.py").get_config("dot_product,hierarchical,smoke")
  model = build_model(dict(text.model.to_dict(), vocab_size=257, num_classes=2,
                           max_length=text.task_options.seq_len))
  assert isinstance(model, HierarchicalTransformer)
  config = load_config_module("configs/lra/listops.py").get_config(
      "dot_product,hierarchical,smoke")
  assert config.model.kind == "hierarchical"
  config.task_options.update(train_size=64, validation_size=32, test_size=32, max_length=40)
  config.model.update(embed_dim=16, num_heads=2, mlp_dim=16, head_mlp_dim=16, chunk_length=8)
  train_briefly(config, tmp_path)
