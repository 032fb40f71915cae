"""Multi-head latent attention: the DeepSeek-V2 equations in numpy, the
absorbed path against the plain one, and the latent cache's size."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_jax import registry
from attention_jax.models import ModelConfig
from attention_jax.models.blocks import make_mixer
from attention_jax.models.generation import decoding_model, empty_cache
from attention_jax.models import build_model
from attention_jax.variants.modern.mla import MultiHeadLatentAttention, latent_attention
from attention_testing import (as_float64, assert_close, jit_apply, jit_init, loop_mask,
                               np_softmax)

B, T, E, H = 2, 11, 32, 4


def _np_rope(x, positions):
  """Rotate-half RoPE in float64: feature i paired with i + D/2."""
  half = x.shape[-1] // 2
  inv_freq = 10_000.0 ** (-np.arange(half) * 2 / x.shape[-1])
  angles = positions[:, None, None] * inv_freq  # [T, 1, half]
  x1, x2 = x[..., :half], x[..., half:]
  return np.concatenate([x1 * np.cos(angles) - x2 * np.sin(angles),
                         x2 * np.cos(angles) + x1 * np.sin(angles)], axis=-1)


def _np_rms(x, scale):
  return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + 1e-6) * scale


@pytest.mark.property("mla")
def test_the_layer_computes_the_deepseek_v2_equations():
  layer = MultiHeadLatentAttention(num_heads=H, latent_dim=16, query_latent_dim=24, rope_dim=4)
  x = jax.random.normal(jax.random.PRNGKey(0), (B, T, E))
  lengths = jnp.asarray([T, 7])
  params = nn.meta.unbox(jit_init(layer, jax.random.PRNGKey(1), x, is_causal=True)["params"])
  got = jit_apply(layer, {"params": params}, x, is_causal=True, key_value_seq_lengths=lengths)
  p = {name: as_float64(value) for name, value in params.items()}
  h, positions = as_float64(x), np.arange(T, dtype=np.float64)
  c_kv = _np_rms(h @ p["kv_down"], p["kv_norm"])  # eq. 9
  k_c = np.einsum("btc,chd->bthd", c_kv, p["key_up"])  # eq. 10
  v = np.einsum("btc,chd->bthd", c_kv, p["value_up"])  # eq. 11
  c_q = _np_rms(h @ p["query_down"], p["query_norm"])  # eq. 12
  q_c = np.einsum("btc,chd->bthd", c_q, p["query_up"])  # eq. 13
  q_r = _np_rope(np.einsum("btc,chd->bthd", c_q, p["query_rope"]), positions)  # eq. 14
  k_r = _np_rope((h @ p["key_rope"])[:, :, None], positions)  # eq. 15, one for all heads
  logits = (np.einsum("bqhd,bkhd->bhqk", q_c, k_c) + np.einsum("bqhd,bkxd->bhqk", q_r, k_r))
  logits /= np.sqrt(k_c.shape[-1] + k_r.shape[-1])
  allowed = loop_mask(B, T, T, is_causal=True, kv_lengths=[T, 7])
  o = np.einsum("bhqk,bkhd->bqhd", np_softmax(np.where(allowed, logits, -np.inf)), v)
  want = np.einsum("bthd,hde->bte", o, p["out"])
  assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.property("mla")
def test_the_absorbed_path_equals_rebuilding_keys_and_values():
  keys = jax.random.split(jax.random.PRNGKey(2), 6)
  q_c = jax.random.normal(keys[0], (B, 5, H, 8))
  q_r = jax.random.normal(keys[1], (B, 5, H, 4))
  latent = jax.random.normal(keys[2], (B, T, 16))
  k_r = jax.random.normal(keys[3], (B, T, 4))
  key_up, value_up = (jax.random.normal(k, (16, H, 8)) / 4 for k in keys[4:])
  visible = jnp.arange(T)[None, None, None, :] <= jnp.arange(5)[None, None, :, None] + 6
  run = lambda absorb: jax.jit(functools.partial(
      latent_attention, absorb=absorb, mask=visible,
      key_value_seq_lengths=jnp.asarray([T, 9])))(q_c, q_r, latent, k_r, key_up, value_up)
  assert_close(run(True), run(False), rtol=1e-4, atol=1e-5)


def test_decoding_caches_the_latent_and_the_rope_key_only():
  config = ModelConfig.from_config(dict(
      kind="language_model", vocab_size=11, num_layers=1, embed_dim=E, num_heads=H, mlp_dim=32,
      max_length=T, dropout_rate=0.0, attention="mla",
      attention_options={"latent_dim": 16, "rope_dim": 4}))
  cache = empty_cache(decoding_model(build_model(config)), B, T)
  entries = {"/".join(str(getattr(k, "key", k)) for k in path): leaf.shape
             for path, leaf in jax.tree_util.tree_leaves_with_path(cache)}
  per_token = {name: shape[-1] for name, shape in entries.items() if len(shape) == 3}
  assert sorted(per_token.values()) == [4, 16]  # d_R and d_c: 20 numbers per token and layer
  assert all(shape[:2] == (B, T) for shape in entries.values() if len(shape) == 3)
  assert all(len(shape) in (0, 3) for shape in entries.values())  # and the index
  # Multi-head attention of the same width caches keys and values: 2 H d_h = 64.
  mha = ModelConfig.from_config(dict(config.__dict__, attention="dot_product",
                                     attention_options={}))
  mha_cache = empty_cache(decoding_model(build_model(mha)), B, T)
  mha_per_token = sum(int(np.prod(leaf.shape[2:])) for leaf in jax.tree.leaves(mha_cache)
                      if leaf.ndim == 4)
  assert mha_per_token == 2 * E


def test_decoding_with_and_without_absorbing_gives_the_same_tokens_logits():
  x = jax.random.normal(jax.random.PRNGKey(3), (B, T, E))
  outputs = []
  for absorb in (True, False):
    layer = MultiHeadLatentAttention(num_heads=H, absorb=absorb, decode=True)
    variables = jit_init(layer, jax.random.PRNGKey(4), x)
    cache = jax.tree.map(jnp.zeros_like, variables["cache"])
    pieces = []
    step = jax.jit(lambda v, c, x: layer.apply({**v, "cache": c}, x, mutable=["cache"]))
    for t in range(T):
      y, state = step({"params": variables["params"]}, cache, x[:, t:t + 1])
      cache = state["cache"]
      pieces.append(y)
    outputs.append(jnp.concatenate(pieces, axis=1))
  full = jit_apply(MultiHeadLatentAttention(num_heads=H), {"params": variables["params"]}, x,
                   is_causal=True)
  assert_close(outputs[0], outputs[1], rtol=1e-4, atol=1e-5)
  assert_close(outputs[0], full, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("options, message", [
    (dict(latent_dim=64), r"latent_dim \(64\) must be at most the model width 32"),
    (dict(query_latent_dim=40), r"query_latent_dim \(40\) must be at most the model width"),
    (dict(rope_dim=3), "rope_dim must be even"),
])
def test_bad_sizes_are_named(options, message):
  layer = MultiHeadLatentAttention(num_heads=H, **options)
  with pytest.raises(ValueError, match=message):
    layer.init(jax.random.PRNGKey(0), jnp.ones((1, 4, E)))


def test_head_kernels_start_at_the_scale_of_their_inputs():
  """lecun_normal on `[d_in, H, d]` read fan_in as H d_in (its default axes):
  q, k and v started sqrt(H) too small. Every kernel into the heads has std
  1/sqrt(d_in); the output kernel `[H, d_h, E]` sums over H d_h inputs."""
  width, heads = 64, 8  # d_h = 8, d_c = 32, d_c' = 64, d_R = 4: 1,024 to 4,096 draws each
  layer = MultiHeadLatentAttention(num_heads=heads)
  params = nn.meta.unbox(jit_init(layer, jax.random.PRNGKey(0), jnp.ones((1, 4, width)),
                                  is_causal=True)["params"])
  fan_in = dict(kv_down=width, query_down=width, query_up=64, query_rope=64, key_rope=width,
                key_up=32, value_up=32, out=heads * 8)
  for name, inputs in fan_in.items():
    std = float(np.std(np.asarray(params[name])))
    assert abs(std * np.sqrt(inputs) - 1.0) < 0.1, (name, std, inputs ** -0.5)


@pytest.mark.parametrize("absorb", [False, True])
def test_the_configs_absorb_reaches_the_layer(absorb):
  """The registry reports the layer's default, so a config's absorb=False is
  not dropped as the default and decoding takes the path it names."""
  default = {o.name: o.default for o in registry.variant_options("mla")}["absorb"]
  assert default == MultiHeadLatentAttention.absorb
  config = ModelConfig(attention="mla", kind="language_model", embed_dim=E, num_heads=H,
                       attention_options={"absorb": absorb})
  assert make_mixer(config, "mla").absorb is absorb
