"""The "flex" variant: composed options from a config, against flex_attention and dot_product."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attention_jax as aj
from attention_jax import positional
from attention_jax.core import mods
from attention_jax.variants.composed import composed_attention
from attention_testing import (assert_close, assert_same_outputs_and_grads, jit_apply,
                               jit_call, jit_init, random_qkv)

B, T, H, D = 2, 19, 4, 8


@pytest.mark.parity("flex")
def test_flex_without_options_is_dot_product_attention():
  arrays = random_qkv(batch=B, q_len=T, num_heads=H, num_kv_heads=2, head_dim=D)
  lengths = jnp.asarray([19, 11])
  assert_same_outputs_and_grads(
      functools.partial(composed_attention, is_causal=True, key_value_seq_lengths=lengths),
      functools.partial(aj.dot_product_attention, is_causal=True,
                        key_value_seq_lengths=lengths, implementation="xla"), *arrays)


@pytest.mark.parity("flex")
def test_named_mods_are_the_flex_mods_they_name():
  arrays = random_qkv(seed=1, batch=B, q_len=T, num_heads=H, head_dim=D)
  slopes, table = jnp.linspace(0.1, 0.4, H), jax.random.normal(jax.random.PRNGKey(2), (H, 8))
  prefix = jnp.asarray([3, 12])
  got = jit_call(composed_attention, *arrays,
                 mods=("alibi", "learned_alibi", "relative_bias", "prefix_lm"),
                 alibi_slopes=slopes, relative_bias_table=table, relative_bias_max_distance=16,
                 prefix_lengths=prefix, softcap=4.0)
  bucket = lambda distance: positional.t5_relative_position_bucket(
      distance, bidirectional=True, num_buckets=8, max_distance=16)
  chain = [mods.alibi(positional.alibi_slopes(H)), mods.alibi(slopes),
           mods.relative_bias(table, bucket)]

  def score_mod(score, b, h, q, k):
    for mod in chain:
      score = mod(score, b, h, q, k)
    return score

  want = jit_call(aj.flex_attention, *arrays, score_mod=score_mod,
                  mask_mod=mods.prefix_lm_mask(prefix), softcap=4.0, implementation="xla")
  assert_close(got, want)


def _layer(**options):
  return aj.MultiHeadAttention(num_heads=H, qkv_features=H * D, attention="flex",
                               attention_options=options)


def test_one_config_line_composes_cosine_scores_a_window_and_sinks_with_learned_arrays():
  options = dict(qk_norm="l2", scale=1.0, local_window_size=(5, 0), sinks=True,
                 mods=("learned_alibi", "relative_bias"), softcap=8.0)
  layer = _layer(**options)
  x = jax.random.normal(jax.random.PRNGKey(3), (B, T, 16))
  params = nn.meta.unbox(jit_init(layer, jax.random.PRNGKey(4), x, is_causal=True)["params"])
  variant = params["variant"]
  assert set(variant) == {"sink_logits", "query_norm_scale", "key_norm_scale", "alibi_slopes",
                          "relative_bias_table"}

  def loss(params):
    return jnp.sum(jnp.sin(layer.apply({"params": params}, x, is_causal=True)))

  grads = jax.jit(jax.grad(loss))(params)["variant"]
  for name, grad in grads.items():  # the kernel's backward reaches every learned array
    assert float(jnp.abs(grad).max()) > 0.0, name
  @jax.jit
  def written_out(params):
    """The same attention from flex_attention, written out with those arrays."""
    variant = params["variant"]
    project = lambda name: jnp.einsum("bte,ehd->bthd", x, params[name]["kernel"]) + params[name][
        "bias"]
    query, key, value = project("query"), project("key"), project("value")
    bucket = lambda distance: positional.t5_relative_position_bucket(
        distance, bidirectional=False, num_buckets=32, max_distance=128)
    chain = [mods.alibi(variant["alibi_slopes"]),
             mods.relative_bias(variant["relative_bias_table"], bucket)]

    def score_mod(score, b, h, q, k):
      for mod in chain:
        score = mod(score, b, h, q, k)
      return score

    attended = aj.flex_attention(
        query, key, value, score_mod=score_mod, qk_norm="l2", scale=1.0,
        qk_norm_scales=(variant["query_norm_scale"], variant["key_norm_scale"]),
        local_window_size=(5, 0), sinks=variant["sink_logits"], softcap=8.0, is_causal=True,
        implementation="xla")
    return jnp.einsum("bthd,hde->bte", attended, params["out"]["kernel"]) + params["out"]["bias"]

  assert_close(jit_apply(layer, {"params": params}, x, is_causal=True), written_out(params),
               rtol=1e-4, atol=1e-5)


def test_prefix_lengths_come_with_each_batch():
  layer = _layer(mods=("prefix_lm",))
  x = jax.random.normal(jax.random.PRNGKey(5), (B, T, 16))
  prefix = jnp.asarray([4, 9])
  variables = jit_init(layer, jax.random.PRNGKey(6), x,
                       attention_arguments={"prefix_lengths": prefix})
  out = jit_apply(layer, variables, x, attention_arguments={"prefix_lengths": prefix})
  # A token after the prefix sees no later token: changing the last token
  # leaves every earlier output past the prefix as it was.
  changed = x.at[:, -1].add(1.0)
  out_changed = jit_apply(layer, variables, changed,
                          attention_arguments={"prefix_lengths": prefix})
  np.testing.assert_allclose(out[:, 9:-1], out_changed[:, 9:-1], rtol=1e-5, atol=1e-6)
  # Inside the prefix every token sees the whole prefix: changing token 3 moves token 0.
  changed = x.at[:, 3].add(1.0)
  out_changed = jit_apply(layer, variables, changed,
                          attention_arguments={"prefix_lengths": prefix})
  assert float(jnp.abs(out[:, 0] - out_changed[:, 0]).min()) > 1e-4
  with pytest.raises(ValueError, match=r"mod 'prefix_lm' needs prefix_lengths, got None"):
    jit_apply(layer, variables, x)


def test_unknown_mods_and_qk_norms_are_refused_by_name():
  arrays = random_qkv(batch=B, q_len=T, num_heads=H, head_dim=D)
  with pytest.raises(ValueError, match=r"mods must be names from \('alibi', 'learned_alibi', "
                                       r"'relative_bias', 'prefix_lm'\), got \['rope'\]"):
    composed_attention(*arrays, mods=("rope",))
  with pytest.raises(ValueError, match=r"qk_norm must be one of \('rms', 'l2'\) or None, got "
                                       r"'layer'"):
    jit_init(_layer(qk_norm="layer"), jax.random.PRNGKey(0), jnp.zeros((1, 4, 16)))


@pytest.mark.parity("flex")
@pytest.mark.parametrize("position", ["alibi", "t5"])
def test_alibi_and_t5_positions_reach_flex_as_score_mods_and_equal_the_materialised_bias(
    position):
  # The same parameters through dot_product (the bias materialised, the
  # reference) and through flex (the bias a score_mod per tile): the same
  # outputs and gradients, the T5 table's included.
  x = jax.random.normal(jax.random.PRNGKey(7), (B, T, 16))
  positions = jnp.asarray([[3] * 4 + list(range(T - 4)), list(range(T))])  # [B, T]
  layers = {name: aj.MultiHeadAttention(num_heads=H, qkv_features=H * D, attention=name,
                                        position=position)
            for name in ("dot_product", "flex")}
  params = nn.meta.unbox(jit_init(layers["dot_product"], jax.random.PRNGKey(8), x,
                                  positions=positions)["params"])

  def outputs_and_grads(name):
    apply = lambda params: layers[name].apply({"params": params}, x, is_causal=True,
                                              positions=positions)
    def loss(params):
      out = apply(params)
      return jnp.sum(jnp.sin(out)), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    return out, grads

  (out, grads), (want, want_grads) = outputs_and_grads("flex"), outputs_and_grads("dot_product")
  assert_close(out, want, rtol=1e-5, atol=1e-5)
  for path, got in jax.tree_util.tree_leaves_with_path(grads):
    expected = functools.reduce(lambda tree, key: tree[key.key], path, want_grads)
    assert_close(got, expected, rtol=1e-4, atol=1e-5, err_msg=jax.tree_util.keystr(path))
  if position == "t5":
    assert float(jnp.abs(grads["relative_position_bias"]["rel_embedding"]).max()) > 0


@pytest.mark.parametrize("position, qk_norm", [("rope", "rms"), ("xpos", "rms"), ("xpos", "l2")])
def test_qk_norm_comes_before_the_rotation_so_scores_stay_relative(position, qk_norm):
  """Queries and keys are normalised, then rotated (as Qwen3 and OLMo 2 do):
  rotated first, RMS's learned per-feature scales mix the rotated pairs, and
  xPos's length scale is divided out, so the scores would depend on where the
  sequence starts rather than on the distance alone."""
  layer = aj.MultiHeadAttention(num_heads=H, qkv_features=H * D, attention="flex",
                                attention_options={"qk_norm": qk_norm}, position=position)
  x = jax.random.normal(jax.random.PRNGKey(7), (B, T, 16))
  variables = jit_init(layer, jax.random.PRNGKey(8), x, is_causal=True)
  # Learned scales, not their initial ones (all equal), which commute with a rotation.
  variant = variables["params"]["variant"]
  variant = {name: scale * jnp.exp(jax.random.normal(jax.random.PRNGKey(9), scale.shape))
             for name, scale in variant.items()}
  variables = {"params": {**variables["params"], "variant": variant}}
  positions = jnp.arange(T)
  out = jit_apply(layer, variables, x, is_causal=True, positions=positions)
  shifted = jit_apply(layer, variables, x, is_causal=True, positions=positions + 37)
  assert_close(shifted, out, rtol=1e-4, atol=1e-5)
