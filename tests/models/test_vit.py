"""The Vision Transformer: patch extraction and embedding against their written-out
formulas, the sequence it encodes, the [CLS] read by the head, its config checks,
and training (on a task it can learn, and through the trainer on Pathfinder)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from attention_jax.models import VisionTransformer, build_model
from attention_jax.models.vit import extract_patches
from attention_testing import assert_close, jit_apply, jit_init, train_briefly

VOCAB = 257  # 8-bit pixels + 1, as the image tasks give them



def _init(model, *args, **kwargs):
  return nn.meta.unbox(jit_init(model, *args, **kwargs))

def _vit(side=8, **overrides):
  config = dict(kind="vit", vocab_size=VOCAB, num_classes=3, num_layers=1, embed_dim=16,
                num_heads=2, mlp_dim=32, max_length=side * side, patch_size=4,
                position="learned", dropout_rate=0.0)
  return build_model({**config, **overrides})


def _pixels(batch, side, seed=0):
  return jax.random.randint(jax.random.PRNGKey(seed), (batch, side * side), 1, VOCAB)


def _captured(model, variables, tokens, name):
  """The output of submodule `name` in a forward pass."""
  _, state = jit_apply(model, variables, tokens, capture_intermediates=lambda m, _: m.name == name,
                         mutable=["intermediates"])
  (out,) = state["intermediates"][name]["__call__"]
  return out


def test_patches_are_the_grid_in_row_major_order_each_flattened_row_by_row():
  height, width, channels, p = 6, 4, 2, 2
  images = np.arange(2 * height * width * channels, dtype=np.float32).reshape(
      2, height, width, channels)
  expected = np.zeros((2, (height // p) * (width // p), p * p * channels), np.float32)
  for b in range(2):
    for i in range(height // p):
      for j in range(width // p):
        values = [images[b, i * p + r, j * p + c, k]
                  for r in range(p) for c in range(p) for k in range(channels)]
        expected[b, i * (width // p) + j] = values
  np.testing.assert_array_equal(extract_patches(jnp.asarray(images), p), expected)


def test_patch_embedding_is_a_linear_map_of_each_patchs_pixels_in_minus_one_one():
  side, p = 8, 4
  model = _vit(side=side, patch_size=p)
  tokens = _pixels(2, side)
  variables = _init(model, jax.random.PRNGKey(1), tokens)
  embedded = _captured(model, variables, tokens, "patch_embedding")
  kernel = np.asarray(variables["params"]["patch_embedding"]["kernel"])
  bias = np.asarray(variables["params"]["patch_embedding"]["bias"])
  pixels = (np.asarray(tokens, np.float64) - 1) / 255 * 2 - 1  # token 1 -> -1, 256 -> 1
  grid = side // p
  for b in range(2):
    for i in range(grid):
      for j in range(grid):
        patch = [pixels[b, (i * p + r) * side + j * p + c] for r in range(p) for c in range(p)]
        assert_close(embedded[b, i * grid + j], np.asarray(patch) @ kernel + bias,
                     rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("side,patch_size,pooling,length", [
    (8, 4, "cls", 2 * 2 + 1), (8, 2, "cls", 4 * 4 + 1), (12, 3, "cls", 4 * 4 + 1),
    (8, 1, "cls", 64 + 1), (8, 4, "mean", 2 * 2)])
def test_the_encoder_sees_the_patches_and_a_cls(side, patch_size, pooling, length):
  model = _vit(side=side, patch_size=patch_size, pooling=pooling)
  tokens = _pixels(2, side)
  variables = _init(model, jax.random.PRNGKey(0), tokens)
  assert _captured(model, variables, tokens, "encoder").shape == (2, length, 16)
  # Learned positions for the patches alone: the [CLS] is a learned vector already.
  table = variables["params"]["encoder"]["position_embedding"]["embedding"]
  assert table.shape == ((side // patch_size) ** 2, 16)


def test_the_head_reads_the_cls_output():
  model = _vit()
  tokens = _pixels(3, 8)
  variables = _init(model, jax.random.PRNGKey(2), tokens)
  # A non-zero head (it starts at zero), so that the logits say what it reads.
  head = dict(variables["params"]["head"])
  head["kernel"] = jax.random.normal(jax.random.PRNGKey(3), head["kernel"].shape)
  variables = {"params": {**variables["params"], "head": head}}
  encoded = _captured(model, variables, tokens, "encoder")
  logits = jit_apply(model, variables, tokens)
  assert_close(logits, np.asarray(encoded[:, 0]) @ np.asarray(head["kernel"]) + head["bias"],
               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("attention", ["linear", "local", "fnet"])
def test_any_non_causal_mixer_is_its_attention(attention):
  options = dict(window_size=4) if attention == "local" else {}
  model = _vit(attention=attention, attention_options=options)
  tokens = _pixels(2, 8)
  variables = _init(model, jax.random.PRNGKey(0), tokens)
  assert jit_apply(model, variables, tokens).shape == (2, 3)


@pytest.mark.parametrize("overrides,message", [
    (dict(patch_size=5), r"model.patch_size=5 must divide the image side 8 "
                         r"\(max_length=64 pixels\)"),
    (dict(patch_size=3, max_length=1024), r"model.patch_size=3 must divide the image side 32"),
    (dict(patch_size=0), r"model.patch_size must be an integer >= 1, got 0"),
    (dict(max_length=60), r"model.max_length=60 is not a square"),
    (dict(position="complex"), r"model.position 'complex' is a word embedding; kind 'vit'"),
])
def test_bad_config_is_named(overrides, message):
  with pytest.raises(ValueError, match=message):
    _vit(**overrides)


def test_an_image_of_another_size_is_refused():
  model = _vit()
  with pytest.raises(ValueError, match=r"tokens must be \[B, max_length=64\] pixels, got "
                                       r"shape \(2, 49\)"):
    _init(model, jax.random.PRNGKey(0), _pixels(2, 7))


def test_it_learns_where_the_bright_patch_is():
  """Three classes: a bright 4 x 4 square in the top-left, top-right or bottom
  half of a noisy image. Adam on the cross-entropy separates them."""
  rng = np.random.default_rng(0)
  labels = rng.integers(0, 3, 96)
  images = rng.integers(0, 100, (96, 8, 8))
  for n, label in enumerate(labels):
    row, column = [(0, 0), (0, 4), (4, rng.integers(0, 5))][label]
    images[n, row:row + 4, column:column + 4] = 255
  tokens = jnp.asarray(images.reshape(96, 64) + 1)
  model = _vit(embed_dim=16, num_layers=1)
  params = _init(model, jax.random.PRNGKey(0), tokens)["params"]
  optimizer = optax.adam(3e-3)

  def loss(params):
    logits = jit_apply(model, {"params": params}, tokens)
    return optax.softmax_cross_entropy_with_integer_labels(logits, jnp.asarray(labels)).mean()

  @jax.jit
  def step(params, state):
    value, grads = jax.value_and_grad(loss)(params)
    updates, state = optimizer.update(grads, state)
    return optax.apply_updates(params, updates), state, value

  state = optimizer.init(params)
  first = float(loss(params))
  for _ in range(60):
    params, state, _ = step(params, state)
  accuracy = float((jit_apply(model, {"params": params}, tokens).argmax(-1) == labels).mean())
  assert first == pytest.approx(np.log(3), abs=1e-3)  # the zero head starts uniform
  assert accuracy > 0.9, accuracy


def test_the_pathfinder_and_image_configs_build_it_and_the_trainer_trains_it(tmp_path):
  from attention_jax.train.config import load_config_module
  image = load_config_module("configs/lra/image.py").get_config("dot_product,vit,smoke")
  model = build_model(dict(image.model.to_dict(), vocab_size=VOCAB, num_classes=10,
                           max_length=1024))
  assert isinstance(model, VisionTransformer) and model.config.patch_size == 4
  config = load_config_module("configs/lra/pathfinder32.py").get_config("dot_product,vit,smoke")
  assert config.model.kind == "vit"
  config.task_options.update(train_size=64, validation_size=32, test_size=32)
  config.model.update(num_layers=1, embed_dim=16, num_heads=2, mlp_dim=16, head_mlp_dim=16)
  train_briefly(config, tmp_path)
