"""transformer_xl (Dai et al. 2019): the relative shift, the relative scores,
and segment recurrence, which must equal one pass over the whole sequence
under the mask the memory implies."""

import flax.linen as nn
from flax import traverse_util
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_jax import positional
from attention_jax.models import LayerStack, ModelConfig, build_model
from attention_jax.variants.recurrence import TransformerXLAttention, transformer_xl_attention
from attention_testing import (as_float64, assert_close, jit_apply, jit_call, jit_init, perturbed,
                               random_qkv, segment_training_step)

B, E, H = 2, 16, 2


def explicit_shift(logits, kv_len):
  """`relative_shift` by indexing: out[i, j] = logits[i, j + Tq - 1 - i]."""
  q_len = logits.shape[-2]
  out = np.zeros(logits.shape[:-1] + (kv_len,), logits.dtype)
  for i in range(q_len):
    for j in range(kv_len):
      out[..., i, j] = logits[..., i, j + q_len - 1 - i]
  return out


@pytest.mark.property("transformer_xl")
@pytest.mark.parametrize("q_len,kv_len", [(5, 5), (4, 9), (1, 6), (6, 6 + 3)])
def test_relative_shift_equals_the_explicitly_indexed_form(q_len, kv_len):
  logits = np.random.default_rng(0).normal(size=(B, H, q_len, q_len + kv_len - 1)).astype(
      np.float32)
  np.testing.assert_array_equal(positional.relative_shift(jnp.asarray(logits), kv_len),
                                explicit_shift(logits, kv_len))


def test_relative_shift_refuses_the_wrong_number_of_distances():
  with pytest.raises(ValueError, match=r"logits must have Tq \+ Tk - 1 = 8"):
    positional.relative_shift(jnp.zeros((3, 7)), kv_len=6)


def _relative_module_params(features=E, head_dim=8, seed=0):
  module = positional.XLRelativePosition(num_heads=H, head_dim=head_dim)
  query = jnp.zeros((B, 3, H, head_dim))
  params = jit_init(module, jax.random.PRNGKey(seed), query, query, jnp.arange(3), jnp.arange(3),
                       features)["params"]
  return module, perturbed(nn.meta.unbox(params), seed=seed + 1)


def np_xl_terms(query, key, q_positions, k_positions, params, features):
  """u . k_j + (q_i + v) . W_R R(q_pos_i - k_pos_j), pair by pair."""
  query, key = as_float64(query), as_float64(key)
  kernel = as_float64(params["relative_kernel"])
  u, v = as_float64(params["content_bias"]), as_float64(params["position_bias"])
  distances = np.asarray(q_positions)[:, None] - np.asarray(k_positions)[None, :]
  sinusoids = as_float64(jit_call(positional.sinusoidal_embedding, jnp.asarray(distances),
                                  features))
  relative_key = np.einsum("qke,ehd->qkhd", sinusoids, kernel)  # [Tq, Tk, H, D]
  return (np.einsum("hd,bkhd->bhk", u, key)[:, :, None, :]
          + np.einsum("bqhd,qkhd->bhqk", query + v, relative_key))


@pytest.mark.property("transformer_xl")
@pytest.mark.parametrize("q_start,k_start,q_len,kv_len", [(0, 0, 5, 5), (4, 0, 3, 7),
                                                          (9, 9, 1, 1), (7, 0, 1, 10)])
def test_relative_scores_equal_the_pairwise_formula(q_start, k_start, q_len, kv_len):
  module, params = _relative_module_params()
  query, key, _ = random_qkv(seed=2, batch=B, q_len=q_len, kv_len=kv_len, num_heads=H,
                             num_kv_heads=H, head_dim=8)
  q_positions, k_positions = q_start + np.arange(q_len), k_start + np.arange(kv_len)
  got = jit_apply(module, {"params": params}, query, key, jnp.asarray(q_positions),
                     jnp.asarray(k_positions), E)
  assert_close(got, np_xl_terms(query, key, q_positions, k_positions, params, E),
               rtol=1e-4, atol=1e-4)


@pytest.mark.property("transformer_xl")
def test_relative_scores_depend_only_on_the_distance():
  module, params = _relative_module_params()
  query, key, _ = random_qkv(seed=3, batch=B, q_len=4, kv_len=6, num_heads=H, num_kv_heads=H,
                             head_dim=8)
  scores = lambda shift: jit_apply(module, {"params": params}, query, key, shift + jnp.arange(2, 6),
                                      shift + jnp.arange(6), E)
  assert_close(scores(0), scores(37), rtol=1e-4, atol=1e-4)
  with pytest.raises(AssertionError):  # and they do depend on it
    assert_close(scores(0), jit_apply(module, {"params": params}, query, key, jnp.arange(4),
                                         jnp.arange(6), E), rtol=1e-4, atol=1e-4)


@pytest.mark.property("transformer_xl")
@pytest.mark.parametrize("is_causal", [True, False])
def test_pure_function_equals_the_numpy_formula(is_causal):
  memory_length, q_len, head_dim = 3, 4, 8
  query, key, value = random_qkv(seed=4, batch=B, q_len=q_len, kv_len=memory_length + q_len,
                                 num_heads=H, num_kv_heads=1, head_dim=head_dim)
  rng = np.random.default_rng(5)
  relative_key = rng.normal(size=(1, 2 * q_len + memory_length - 1, H, head_dim))
  u, v = rng.normal(size=(H, head_dim)), rng.normal(size=(H, head_dim))
  got = jit_call(
      transformer_xl_attention, query, key, value,
      relative_key=jnp.asarray(relative_key, jnp.float32),
      content_bias=jnp.asarray(u, jnp.float32), position_bias=jnp.asarray(v, jnp.float32),
      memory_length=memory_length, is_causal=is_causal)

  q, k, val = (as_float64(a) for a in (query, key, value))
  k, val = np.repeat(k, H, axis=2), np.repeat(val, H, axis=2)
  logits = np.zeros((B, H, q_len, memory_length + q_len))
  for i in range(q_len):
    for j in range(memory_length + q_len):
      distance = memory_length + i - j
      r = relative_key[0, memory_length + q_len - 1 - distance]  # row of that distance
      logits[:, :, i, j] = (np.einsum("bhd,bhd->bh", q[:, i] + u, k[:, j])
                            + np.einsum("bhd,hd->bh", q[:, i] + v, r)) / np.sqrt(head_dim)
      if is_causal and j > memory_length + i:
        logits[:, :, i, j] = -np.inf
  weights = np.exp(logits - logits.max(-1, keepdims=True))
  weights /= weights.sum(-1, keepdims=True)
  expected = np.einsum("bhqk,bkhd->bqhd", weights, val)
  assert_close(got, expected, rtol=1e-4, atol=1e-4)


def _segments_mask(length, segment, memory_length, is_causal=True):
  """What segment recurrence lets query t see in one pass: the keys from
  `memory_length` before its segment's start up to itself (causal)."""
  q = np.arange(length)[:, None]
  k = np.arange(length)[None, :]
  start = (q // segment) * segment
  visible = (k >= start - memory_length) & (k < start + segment)
  return jnp.asarray(visible & (k <= q) if is_causal else visible)[None, None]


@pytest.mark.property("transformer_xl")
@pytest.mark.parametrize("memory_length", [4, 8])
@pytest.mark.parametrize("scan_layers", [False, True])
def test_segments_with_memory_equal_one_pass_under_the_memory_mask(memory_length, scan_layers):
  segment, length = 4, 16
  config = ModelConfig(attention="transformer_xl", num_layers=2, embed_dim=E, num_heads=H,
                       mlp_dim=32, attention_options={"memory_length": memory_length},
                       scan_layers=scan_layers)
  stack = LayerStack(config)
  x = jax.random.normal(jax.random.PRNGKey(0), (B, length, E))
  variables = jit_init(stack, jax.random.PRNGKey(1), x[:, :segment], is_causal=True)
  variables = {"params": perturbed(variables["params"]), "memory": variables["memory"]}
  memory, outputs = variables["memory"], []
  for start in range(0, length, segment):
    (y, _), state = jit_apply(stack, {"params": variables["params"], "memory": memory},
                                x[:, start:start + segment], is_causal=True, mutable=["memory"])
    memory = state["memory"]
    outputs.append(y)
  by_segment = jnp.concatenate(outputs, axis=1)
  whole, _ = jit_apply(stack, {"params": variables["params"]}, x,
                         mask=_segments_mask(length, segment, memory_length), is_causal=True)
  assert_close(by_segment, whole, rtol=2e-4, atol=2e-4)
  # Without the memory the segments differ: the memory is what carries across.
  alone = jnp.concatenate([jit_apply(stack, {"params": variables["params"]}, x[:, s:s + segment],
                                       is_causal=True)[0] for s in range(0, length, segment)], 1)
  assert np.abs(np.asarray(alone[:, segment:] - whole[:, segment:])).max() > 1e-2


def _layer(memory_length=3):
  layer = TransformerXLAttention(num_heads=H, memory_length=memory_length)
  x = jax.random.normal(jax.random.PRNGKey(2), (B, 5, E))
  variables = jit_init(layer, jax.random.PRNGKey(3), x, is_causal=True)
  return layer, {"params": perturbed(variables["params"]), "memory": variables["memory"]}, x


@pytest.mark.property("transformer_xl")
def test_memory_keeps_the_last_inputs_and_counts_what_it_holds():
  layer, variables, _ = _layer(memory_length=6)
  assert variables["memory"]["hidden"].shape == (B, 6, E)
  assert int(variables["memory"]["filled"]) == 0  # init leaves it empty
  memory, seen = variables["memory"], []
  for step, length in enumerate([4, 1, 3, 7]):
    x = jax.random.normal(jax.random.PRNGKey(10 + step), (B, length, E))
    seen.append(x)
    _, state = jit_apply(layer, {"params": variables["params"], "memory": memory}, x,
                           is_causal=True, mutable=["memory"])
    memory = state["memory"]
    so_far = jnp.concatenate(seen, axis=1)
    filled = min(so_far.shape[1], 6)
    assert int(memory["filled"]) == filled
    np.testing.assert_array_equal(memory["hidden"][:, 6 - filled:], so_far[:, -filled:])


@pytest.mark.property("transformer_xl")
def test_no_gradient_reaches_the_memory():
  layer, variables, x = _layer()
  _, state = jit_apply(layer, variables, x, is_causal=True, mutable=["memory"])
  memory = state["memory"]

  def loss(params, hidden):
    y, _ = jit_apply(layer, {"params": params, "memory": {**memory, "hidden": hidden}}, x,
                       is_causal=True, mutable=["memory"])
    return jnp.sum(y ** 2)

  # The memory changes the output, yet passes it no gradient.
  with_memory = jit_apply(layer, {"params": variables["params"], "memory": memory}, x,
                            is_causal=True)
  without = jit_apply(layer, {"params": variables["params"]}, x, is_causal=True)
  assert np.abs(np.asarray(with_memory - without)).max() > 1e-3
  grad_params, grad_memory = jax.grad(loss, argnums=(0, 1))(variables["params"],
                                                            memory["hidden"])
  np.testing.assert_array_equal(grad_memory, np.zeros_like(grad_memory))
  assert max(float(jnp.abs(g).max()) for g in jax.tree.leaves(grad_params)) > 0


@pytest.mark.property("transformer_xl")
def test_language_model_with_memory_trains_segment_by_segment_under_jit():
  config = ModelConfig.from_config(dict(
      kind="language_model", vocab_size=11, num_layers=2, embed_dim=E, num_heads=H, mlp_dim=32,
      max_length=8, attention="transformer_xl", attention_options={"memory_length": 8},
      position="none", scan_layers=True))
  model = build_model(config)
  tokens = jax.random.randint(jax.random.PRNGKey(0), (B, 24), 0, 11)
  variables = jit_init(model, jax.random.PRNGKey(1), tokens[:, :8])

  step = segment_training_step(model, vocab_size=11)
  memory = variables["memory"]
  for start in (0, 8, 16):
    value, sown, grads, memory = step(variables["params"], memory, tokens[:, start:start + 8])
    assert np.isfinite(float(value)) and float(sown) == 0.0  # transformer_xl sows no loss
    assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))
  filled = [leaf for path, leaf in traverse_util.flatten_dict(memory).items()
            if path[-1] == "filled"]
  assert [np.asarray(f).tolist() for f in filled] == [[8, 8]]  # one per scanned layer


def test_bad_memory_length_and_position_are_refused():
  x = jnp.zeros((B, 4, E))
  with pytest.raises(ValueError, match="memory_length"):
    TransformerXLAttention(num_heads=H, memory_length=-1).init(jax.random.PRNGKey(0), x)
  with pytest.raises(ValueError, match="position='rope'"):
    TransformerXLAttention(num_heads=H, position="rope").init(jax.random.PRNGKey(0), x)
  layer, variables, _ = _layer()
  with pytest.raises(ValueError, match="segments must keep the batch size"):
    jit_apply(layer, variables, jnp.zeros((B + 1, 4, E)), mutable=["memory"])
  model = build_model(ModelConfig.from_config(dict(
      kind="language_model", vocab_size=11, num_layers=1, embed_dim=E, num_heads=H, mlp_dim=32,
      max_length=8, attention="transformer_xl", attention_options={"memory_length": -2})))
  with pytest.raises(ValueError, match="memory_length must be .*, got -2"):
    jit_init(model, jax.random.PRNGKey(0), jnp.zeros((B, 8), jnp.int32))
