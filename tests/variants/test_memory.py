"""Memory family: persistent memory (exact), inducing points and Perceiver (properties)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attention_jax
from attention_jax.core import reference_attention
from attention_jax.models import Block, ModelConfig
from attention_jax.variants import memory
from attention_testing import (B, H, KV_LENGTHS, KV_SEGMENTS, Q_LENGTHS, Q_SEGMENTS, TK, TQ,
                               assert_close, bias_and_mask, jit_apply, jit_call, jit_init,
                               loop_mask, random_qkv)

NUM_MEMORY = 3

# name -> (keyword arguments of the variant, arguments of loop_mask)
PERSISTENT_CASES = {
    "plain": ({}, {}),
    "causal": (dict(is_causal=True), dict(is_causal=True)),
    "q_lengths": (dict(query_seq_lengths=jnp.array(Q_LENGTHS)), dict(q_lengths=Q_LENGTHS)),
    "kv_lengths": (dict(key_value_seq_lengths=jnp.array(KV_LENGTHS)),
                   dict(kv_lengths=KV_LENGTHS)),
    "segments": (dict(segment_ids=(jnp.array(Q_SEGMENTS), jnp.array(KV_SEGMENTS))),
                 dict(q_segments=Q_SEGMENTS, kv_segments=KV_SEGMENTS)),
    "everything": (dict(is_causal=True, query_seq_lengths=jnp.array(Q_LENGTHS),
                        key_value_seq_lengths=jnp.array(KV_LENGTHS),
                        segment_ids=(jnp.array(Q_SEGMENTS), jnp.array(KV_SEGMENTS))),
                   dict(is_causal=True, q_lengths=Q_LENGTHS, kv_lengths=KV_LENGTHS,
                        q_segments=Q_SEGMENTS, kv_segments=KV_SEGMENTS)),
}


def _memories(num_kv_heads, head_dim=8, value_dim=5, seed=3):
  k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
  return (jax.random.normal(k1, (NUM_MEMORY, num_kv_heads, head_dim)),
          jax.random.normal(k2, (NUM_MEMORY, num_kv_heads, value_dim)))


def _memory_columns(q_lengths=None, **_):
  """[B, 1, Tq, N]: every query sees every memory slot, except padded queries (zero output)."""
  visible = np.ones((B, 1, TQ, NUM_MEMORY), bool)
  if q_lengths is not None:
    for b in range(B):
      visible[b, 0, q_lengths[b]:] = False
  return visible


@pytest.mark.parity("persistent_memory")
@pytest.mark.parametrize("case", sorted(PERSISTENT_CASES))
@pytest.mark.parametrize("num_kv_heads, with_bias_and_mask", [(2, False), (4, True)])
def test_persistent_memory_equals_dense_attention_over_the_extended_keys(
    case, num_kv_heads, with_bias_and_mask):
  kwargs, mask_args = PERSISTENT_CASES[case]
  query, key, value = random_qkv(batch=B, q_len=TQ, kv_len=TK, num_heads=H,
                                 num_kv_heads=num_kv_heads, value_dim=5)
  memory_key, memory_value = _memories(num_kv_heads)
  allowed = loop_mask(B, TQ, TK, **mask_args)
  bias, extra_mask = bias_and_mask(seed=1)
  if with_bias_and_mask:
    allowed = allowed & np.asarray(extra_mask)
  else:
    bias, extra_mask = None, None
  # The oracle's key axis is [memory slots, keys]; memory columns are always visible.
  extended_allowed = jnp.array(np.concatenate([_memory_columns(**mask_args), allowed], -1))
  extended_bias = None if bias is None else jnp.pad(bias, ((0, 0),) * 3 + ((NUM_MEMORY, 0),))
  cotangent = jax.random.normal(jax.random.PRNGKey(42), (B, TQ, H, 5))

  def ours(q, k, v, mk, mv):
    out = memory.persistent_memory_attention(q, k, v, bias, extra_mask, memory_key=mk,
                                             memory_value=mv, scale=0.3, **kwargs)
    return jnp.sum(out * cotangent), out

  def oracle(q, k, v, mk, mv):
    k = jnp.concatenate([jnp.broadcast_to(mk, (B,) + mk.shape), k], axis=1)
    v = jnp.concatenate([jnp.broadcast_to(mv, (B,) + mv.shape), v], axis=1)
    out = reference_attention(q, k, v, extended_bias, extended_allowed, scale=0.3)
    return jnp.sum(out * cotangent), out

  args = (query, key, value, memory_key, memory_value)
  (_, out), grads = jax.jit(jax.value_and_grad(ours, argnums=range(5), has_aux=True))(*args)
  (_, want), want_grads = jax.value_and_grad(oracle, argnums=range(5), has_aux=True)(*args)
  assert_close(out, want)
  for name, got, expected in zip(["q", "k", "v", "memory_key", "memory_value"], grads,
                                 want_grads):
    assert_close(got, expected, err_msg=f"gradient of {name}")


@pytest.mark.parity("persistent_memory")
def test_persistent_memory_causal_sees_memory_but_not_the_future():
  query, key, value = random_qkv(batch=1, q_len=6, num_heads=2, head_dim=4)
  memory_key, memory_value = (jax.random.normal(jax.random.PRNGKey(s), (2, 2, 4)) for s in (5, 6))
  attend = jax.jit(lambda k, v, mk, mv: memory.persistent_memory_attention(
      query, k, v, is_causal=True, memory_key=mk, memory_value=mv))
  out = attend(key, value, memory_key, memory_value)
  # Changing the last token's key and value leaves every earlier query unchanged...
  changed = attend(key.at[:, -1].add(3.0), value.at[:, -1].add(3.0), memory_key, memory_value)
  assert_close(changed[:, :-1], out[:, :-1])
  assert np.abs(np.asarray(changed[:, -1] - out[:, -1])).max() > 1e-3
  # ... while the memory reaches even the first query, which sees one token only.
  changed = attend(key, value, memory_key, memory_value + 1.0)
  assert np.abs(np.asarray(changed[:, 0] - out[:, 0])).min() > 1e-3
  # Its output is the softmax mix of its own token and the memory, written out.
  logits = np.concatenate([np.einsum("hd,nhd->hn", query[0, 0], memory_key),
                           np.einsum("hd,hd->h", query[0, 0], key[0, 0])[:, None]], -1) / 2.0
  weights = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
  values = np.concatenate([np.transpose(memory_value, (1, 0, 2)), value[0, :1].transpose(1, 0, 2)],
                          1)
  assert_close(out[0, 0], np.einsum("hn,hnd->hd", weights, values))


@pytest.mark.parity("persistent_memory")
def test_persistent_memory_trains_through_multi_head_attention_under_jit():
  x = jax.random.normal(jax.random.PRNGKey(0), (2, 10, 16))
  module = attention_jax.MultiHeadAttention(
      num_heads=4, num_kv_heads=2, attention="persistent_memory",
      attention_options={"num_memory_slots": 5})
  params = jit_init(module, jax.random.PRNGKey(1), x)
  memories = params["params"]["variant"]
  assert memories["memory_key"].shape == (5, 2, 4)
  assert memories["memory_value"].shape == (5, 2, 4)
  lengths = jnp.array([10, 6])
  loss = lambda p: jnp.sum(module.apply(p, x, is_causal=True, key_value_seq_lengths=lengths) ** 2)
  grads = jax.jit(jax.grad(loss))(params)["params"]["variant"]
  assert np.abs(np.asarray(grads["memory_key"])).min() > 0
  assert np.abs(np.asarray(grads["memory_value"])).min() > 0


def test_persistent_memory_rejects_bad_sizes():
  x = jnp.ones((1, 4, 8))
  module = attention_jax.MultiHeadAttention(num_heads=2, attention="persistent_memory",
                                            attention_options={"num_memory_slots": 0})
  with pytest.raises(ValueError, match="num_memory_slots must be an int >= 1"):
    jit_init(module, jax.random.PRNGKey(0), x)
  query, key, value = random_qkv(batch=1, q_len=4, num_heads=2, head_dim=4)
  with pytest.raises(ValueError, match=r"memory_key must be \[N, Hkv, D\]"):
    memory.persistent_memory_attention(query, key, value, memory_key=jnp.ones((3, 2, 5)),
                                       memory_value=jnp.ones((3, 2, 4)))
  with pytest.raises(ValueError, match=r"memory_value must be \[N, Hkv, Dv\]"):
    memory.persistent_memory_attention(query, key, value, memory_key=jnp.ones((3, 2, 4)),
                                       memory_value=jnp.ones((2, 2, 4)))
  with pytest.raises(ValueError, match="mask and bias must have rank 4"):
    memory.persistent_memory_attention(query, key, value, mask=jnp.ones((1, 1, 4, 3), bool),
                                       memory_key=jnp.ones((3, 2, 4)),
                                       memory_value=jnp.ones((3, 2, 4)))


# --------------------------------------------------------------------------------------
# inducing_points and perceiver.

LATENT_VARIANTS = [pytest.param("inducing_points", marks=pytest.mark.property("inducing_points")),
                   pytest.param("perceiver", marks=pytest.mark.property("perceiver"))]
SIZES = {"inducing_points": dict(num_inducing_points=4), "perceiver": dict(num_latents=4)}
LEARNED = {"inducing_points": "inducing_points", "perceiver": "latents"}  # Parameter names.


def _plain_block(queries, inputs, valid):
  """Parameter-free attention softmax(q c^T) c, so the composition can be written out."""
  inputs = queries if inputs is None else inputs
  logits = jnp.einsum("bme,bte->bmt", queries, inputs)
  weights = attention_jax.masked_softmax(logits, None if valid is None else valid[:, None, :])
  return jnp.einsum("bmt,bte->bme", weights, inputs)


def _np_attend(queries, inputs, valid):
  logits = queries @ inputs.T
  weights = np.where(valid[None, :], np.exp(logits - logits.max()), 0.0)
  return (weights / weights.sum(-1, keepdims=True)) @ inputs


@pytest.mark.property("inducing_points")
@pytest.mark.property("perceiver")
@pytest.mark.parametrize("num_process", [0, 2])
def test_latent_bottleneck_composes_its_blocks(num_process):
  x = np.asarray(jax.random.normal(jax.random.PRNGKey(0), (2, 6, 3)), np.float64)
  latents = np.asarray(jax.random.normal(jax.random.PRNGKey(1), (4, 3)), np.float64)
  lengths = [6, 4]
  inputs_valid = np.arange(6)[None, :] < np.array(lengths)[:, None]
  query_valid = np.arange(6)[None, :] < np.array([5, 6])[:, None]
  out = jit_call(
      memory.latent_bottleneck_attention,
      jnp.asarray(x, jnp.float32), jnp.asarray(latents, jnp.float32), _plain_block, _plain_block,
      process=[_plain_block] * num_process, inputs_valid=jnp.array(inputs_valid),
      query_valid=jnp.array(query_valid))
  for b in range(2):
    z = _np_attend(latents, x[b], inputs_valid[b])  # The latents read the valid inputs only.
    for _ in range(num_process):
      z = _np_attend(z, z, np.ones(4, bool))
    want = _np_attend(x[b], z, np.ones(4, bool)) * query_valid[b][:, None]
    assert_close(out[b], want, rtol=1e-4, atol=1e-5)


def _latent_module(name, **options):
  return attention_jax.get_variant(name).module(num_heads=2, **{**SIZES[name], **options})


def _init_apply(module, x, **kwargs):
  variables = jit_init(module, jax.random.PRNGKey(0), x, **kwargs)
  return variables, jax.jit(lambda v, x: module.apply(v, x, **kwargs))


@pytest.mark.parametrize("name", LATENT_VARIANTS)
def test_latent_mixer_is_permutation_equivariant(name):
  x = jax.random.normal(jax.random.PRNGKey(2), (2, 12, 16))
  variables, apply = _init_apply(_latent_module(name), x)
  perm = np.random.default_rng(0).permutation(12)
  assert_close(apply(variables, x[:, perm]), apply(variables, x)[:, perm], atol=2e-5)


@pytest.mark.parametrize("name", LATENT_VARIANTS)
def test_latent_mixer_ignores_padded_tokens(name):
  x = jax.random.normal(jax.random.PRNGKey(3), (2, 12, 16))
  lengths = jnp.array([12, 7])
  module = _latent_module(name)
  variables, apply = _init_apply(module, x, key_value_seq_lengths=lengths)
  out = apply(variables, x)
  garbage = x.at[1, 7:].set(100.0 * jax.random.normal(jax.random.PRNGKey(4), (5, 16)))
  assert_close(apply(variables, garbage)[1, :7], out[1, :7], atol=2e-5)
  # The same padding as a key-padding mask, as the encoder passes it.
  mask = (jnp.arange(12)[None, :] < lengths[:, None])[:, None, None, :]
  assert_close(jit_apply(module, variables, x, mask=mask), out, atol=2e-5)
  # Padded queries output zeros.
  q_padded = jit_apply(module, variables, x, query_seq_lengths=lengths, key_value_seq_lengths=lengths)
  assert np.all(np.asarray(q_padded[1, 7:]) == 0)
  assert_close(q_padded[:, :7], out[:, :7], atol=2e-5)


@pytest.mark.parametrize("name", LATENT_VARIANTS)
def test_latent_mixer_carries_information_from_far_tokens(name):
  x = jax.random.normal(jax.random.PRNGKey(5), (1, 40, 16))
  module = _latent_module(name)
  variables = jit_init(module, jax.random.PRNGKey(0), x)

  def first_output(last_token, lengths):
    return jit_apply(module, variables, x.at[0, -1].set(last_token),
                        key_value_seq_lengths=lengths)[0, 0]

  jacobian = jax.jit(jax.jacobian(first_output))
  assert np.abs(np.asarray(jacobian(x[0, -1], jnp.array([40])))).max() > 1e-4  # [E, E]
  # ... and nothing from a padded one.
  assert np.abs(np.asarray(jacobian(x[0, -1], jnp.array([39])))).max() == 0


@pytest.mark.parametrize("name", LATENT_VARIANTS)
def test_latent_mixer_cross_attends_and_trains(name):
  x = jax.random.normal(jax.random.PRNGKey(6), (2, 5, 16))
  context = jax.random.normal(jax.random.PRNGKey(7), (2, 11, 16))
  module = _latent_module(name, dropout_rate=0.1)
  variables = jit_init(module, jax.random.PRNGKey(0), x, context)
  assert variables["params"][LEARNED[name]].shape == (4, 16)

  def loss(variables, rng):
    out = jit_apply(module, variables, x, context, deterministic=False, rngs={"dropout": rng})
    return jnp.sum(out ** 2)

  grads = jax.jit(jax.grad(loss))(variables, jax.random.PRNGKey(8))["params"]
  assert np.abs(np.asarray(grads[LEARNED[name]])).max() > 0
  # The module also runs as an encoder block's mixer, by name.
  config = ModelConfig.from_config(dict(embed_dim=16, num_heads=2, mlp_dim=32, attention=name,
                                        attention_dropout_rate=0.1))
  block = Block(config)
  shapes = jax.eval_shape(block.init, jax.random.PRNGKey(0), context)
  assert LEARNED[name] in shapes["params"]["attention"]


@pytest.mark.parametrize("name", LATENT_VARIANTS)
def test_latent_mixer_rejects_what_it_cannot_do(name):
  x = jnp.ones((1, 6, 8))
  module = _latent_module(name)
  for kwargs, argument in [(dict(is_causal=True), "is_causal"),
                           (dict(segment_ids=jnp.ones((1, 6), int)), "segment_ids"),
                           (dict(mask=jnp.ones((1, 1, 6, 6), bool)), "key-padding mask")]:
    with pytest.raises(ValueError, match=argument):
      jit_init(module, jax.random.PRNGKey(0), x, **kwargs)
  with pytest.raises(ValueError, match="does not support position"):
    jax.eval_shape(_latent_module(name, position="rope").init, jax.random.PRNGKey(0), x)
  size_name = "num_inducing_points" if name == "inducing_points" else "num_latents"
  with pytest.raises(ValueError, match=f"{size_name} must be an int >= 1, got 0"):
    jax.eval_shape(_latent_module(name, **{size_name: 0}).init, jax.random.PRNGKey(0), x)


@pytest.mark.property("perceiver")
def test_perceiver_latent_layers():
  x = jax.random.normal(jax.random.PRNGKey(9), (1, 6, 8))
  # The parameters' names and the refusal need only tracing, not a compiled init.
  variables = jax.eval_shape(_latent_module("perceiver", num_latent_layers=3).init,
                             jax.random.PRNGKey(0), x)
  assert {"latent_0", "latent_1", "latent_2", "encode", "decode"} <= set(variables["params"])
  with pytest.raises(ValueError, match="num_latent_layers must be an int >= 0, got -1"):
    jax.eval_shape(_latent_module("perceiver", num_latent_layers=-1).init,
                   jax.random.PRNGKey(0), x)
