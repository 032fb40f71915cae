"""compressive (Rae et al. 2020): the compression functions, the two memories
segment by segment against a numpy simulation, the attention-reconstruction
loss against its formula and its gradients, the compressed slots as the keys
just before the memory, and a language model trained segment by segment."""

import flax.linen as nn
from flax import traverse_util
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_jax.models import ModelConfig, build_model
from attention_jax.variants.recurrence import (CompressiveAttention, TransformerXLAttention,
                                               attention_reconstruction_loss,
                                               compress_memory, compressive_attention,
                                               transformer_xl_attention)
from attention_testing import (as_float64, assert_close, jit_apply, jit_call, jit_init,
                               np_project_heads, np_softmax, perturbed, random_qkv,
                               segment_training_step)

B, E, H = 2, 16, 2


def np_compress(states, rate, kind, params=None):
  """f_c in numpy: the mean of each window of `rate` states, or the
  convolution of kernel size and stride `rate` with the layer's weights."""
  batch, length, features = states.shape
  windows = as_float64(states).reshape(batch, length // rate, rate, features)
  if kind == "pool":
    return windows.mean(axis=2)
  return (np.einsum("bnce,cef->bnf", windows, as_float64(params["compression_kernel"]))
          + as_float64(params["compression_bias"]))


def np_memories(segments, memory_length, compressed_length, rate, compress):
  """The memories after each segment, kept state by state with a flag saying
  whether each slot holds a real state: `[(memory [B, M, E], real [M],
  compressed [B, Mc, E], real [Mc])]`."""
  batch, _, features = segments[0].shape
  memory, memory_real = np.zeros((batch, memory_length, features)), np.zeros(memory_length, bool)
  compressed = np.zeros((batch, compressed_length, features))
  compressed_real = np.zeros(compressed_length, bool)
  after = []
  for segment in segments:
    length = segment.shape[1]
    states = np.concatenate([memory, as_float64(segment)], axis=1)
    real = np.concatenate([memory_real, np.ones(length, bool)])
    evicted, evicted_real = states[:, :length], real[:length]
    memory, memory_real = states[:, length:], real[length:]
    # A compressed slot is real when every state of its window was.
    window_real = evicted_real.reshape(length // rate, rate).all(axis=1)
    compressed = np.concatenate([compressed, compress(evicted)], axis=1)[:, -compressed_length:]
    compressed_real = np.concatenate([compressed_real, window_real])[-compressed_length:]
    after.append((memory, memory_real, compressed, compressed_real))
  return after


def _layer(seed=3, first_length=4, **fields):
  fields = dict(dict(memory_length=8, compressed_memory_length=4, compression_rate=2), **fields)
  layer = CompressiveAttention(num_heads=H, **fields)
  x = jax.random.normal(jax.random.PRNGKey(2), (B, first_length, E))
  variables = jit_init(layer, jax.random.PRNGKey(seed), x, is_causal=True)
  return layer, perturbed(nn.meta.unbox(variables["params"])), variables["memory"]


def _segments(lengths, seed=10):
  return [jax.random.normal(jax.random.PRNGKey(seed + i), (B, length, E))
          for i, length in enumerate(lengths)]


@pytest.mark.property("compressive")
def test_compression_functions_equal_their_formulas():
  states = jax.random.normal(jax.random.PRNGKey(0), (B, 6, E))
  params = {"compression_kernel": jax.random.normal(jax.random.PRNGKey(1), (3, E, E)),
            "compression_bias": jax.random.normal(jax.random.PRNGKey(2), (E,))}
  assert_close(compress_memory(states, 3, "pool"), np_compress(states, 3, "pool"),
               rtol=1e-6, atol=1e-6)
  assert_close(compress_memory(states, 3, "conv", params["compression_kernel"],
                               params["compression_bias"]),
               np_compress(states, 3, "conv", params), rtol=1e-5, atol=1e-5)
  # Rate 1 pools nothing.
  np.testing.assert_array_equal(compress_memory(states, 1, "pool"), states)


@pytest.mark.property("compressive")
@pytest.mark.parametrize("compression", ["pool", "conv"])
@pytest.mark.parametrize("lengths,memory_length,compressed_length,rate", [
    ((4, 4, 4, 4, 4), 8, 4, 2),
    # A window of which only one state is real (segment 2) gives no slot.
    ((3, 6, 3, 6, 6, 3), 8, 3, 3),
    # Segments longer than the memory: part of the segment is compressed at once.
    ((4, 4, 4), 2, 3, 2),
    ((2, 4, 2), 0, 3, 2),
])
def test_memories_evolve_as_the_numpy_simulation(compression, lengths, memory_length,
                                                 compressed_length, rate):
  layer, params, memory = _layer(memory_length=memory_length,
                                 compressed_memory_length=compressed_length,
                                 compression_rate=rate, compression=compression,
                                 first_length=lengths[0])
  assert memory["compressed"].shape == (B, compressed_length, E)
  assert int(memory["filled"]) == int(memory["compressed_filled"]) == 0  # init: empty
  segments = _segments(lengths)
  expected = np_memories(segments, memory_length, compressed_length, rate,
                         lambda states: np_compress(states, rate, compression, params))
  garbage = np.random.default_rng(0)
  for segment, (np_memory, memory_real, np_compressed, compressed_real) in zip(segments,
                                                                                expected):
    y, state = jit_apply(layer, {"params": params, "memory": memory}, segment, is_causal=True,
                           mutable=["memory"])
    # Slots that hold no real state are hidden from every query.
    scrambled = {**memory,
                 "hidden": np.where(np.asarray(_real(memory, "filled", memory_length))[:, None],
                                    memory["hidden"],
                                    garbage.normal(size=memory["hidden"].shape)),
                 "compressed": np.where(
                     np.asarray(_real(memory, "compressed_filled", compressed_length))[:, None],
                     memory["compressed"], garbage.normal(size=memory["compressed"].shape))}
    assert_close(jit_apply(layer, {"params": params, "memory": scrambled}, segment, is_causal=True),
                 y, rtol=1e-5, atol=1e-5)
    memory = state["memory"]
    # The real slots are the last ones, and the counts say how many.
    assert int(memory["filled"]) == memory_real.sum()
    assert int(memory["compressed_filled"]) == compressed_real.sum()
    np.testing.assert_array_equal(_real(memory, "filled", memory_length), memory_real)
    np.testing.assert_array_equal(_real(memory, "compressed_filled", compressed_length),
                                  compressed_real)
    np.testing.assert_array_equal(memory["hidden"][:, memory_real], np_memory[:, memory_real])
    assert_close(memory["compressed"][:, compressed_real], np_compressed[:, compressed_real],
                 rtol=1e-5, atol=1e-5)
  assert compressed_real.any()  # the cases reach a compressed memory


def _real(memory, count, size):
  return np.arange(size) >= size - int(memory[count])


def np_reconstruction_loss(hidden, old_states, compressed, real_slots, params):
  """mean (attn(h, old) - attn(h, compressed))^2 over the real states, by the
  formula: per head softmax(q k^T / sqrt(D)) v with the layer's projections."""
  rate = old_states.shape[1] // compressed.shape[1]
  query = np_project_heads(as_float64(hidden), params["query"])

  def attend(states, real):
    key = np_project_heads(as_float64(states), params["key"])
    value = np_project_heads(as_float64(states), params["value"])
    logits = np.einsum("bqhd,bkhd->bhqk", query, key) / np.sqrt(query.shape[-1])
    logits = np.where(real, logits, -np.inf)
    return np.einsum("bhqk,bkhd->bqhd", np_softmax(logits), value)

  if real_slots == 0:
    return 0.0
  old_real = np.arange(old_states.shape[1]) >= old_states.shape[1] - real_slots * rate
  compressed_real = np.arange(compressed.shape[1]) >= compressed.shape[1] - real_slots
  return np.mean((attend(old_states, old_real) - attend(compressed, compressed_real)) ** 2)


def _filled_memory(layer, params, memory, lengths=(4, 4, 4)):
  """The memory after `lengths` segments (both memories full for the default layer)."""
  for segment in _segments(lengths, seed=20):
    _, state = jit_apply(layer, {"params": params, "memory": memory}, segment, is_causal=True,
                           mutable=["memory"])
    memory = state["memory"]
  return memory


@pytest.mark.property("compressive")
def test_sown_reconstruction_loss_equals_its_formula():
  layer, params, memory = _layer(memory_length=4, compressed_memory_length=2,
                                 reconstruction_weight=0.5)
  x = jax.random.normal(jax.random.PRNGKey(5), (B, 4, E))
  sown = lambda memory: jit_apply(layer, {"params": params, "memory": memory}, x, is_causal=True,
                                    mutable=["memory", "losses"])[1]["losses"]
  # The first segment pushes out only empty slots: nothing to reconstruct.
  np.testing.assert_array_equal(sown(memory)["attention_reconstruction"], [0.0])
  memory = _filled_memory(layer, params, memory, lengths=(4,))
  old_states = memory["hidden"]  # M = T: the whole memory leaves it
  compressed = np_compress(old_states, 2, "conv", params)
  expected = 0.5 * np_reconstruction_loss(x, old_states, compressed, 2, params["attention"])
  (loss,) = sown(memory)["attention_reconstruction"]
  assert expected > 1e-3
  assert_close(loss, expected, rtol=1e-4, atol=1e-6)


@pytest.mark.property("compressive")
@pytest.mark.parametrize("real_slots", [0, 1, 3])
def test_reconstruction_loss_compares_only_real_states(real_slots):
  _, params, _ = _layer()
  projections = params["attention"]
  hidden, old_states = _segments((5, 6), seed=30)
  compressed = jax.random.normal(jax.random.PRNGKey(31), (B, 3, E))
  loss = jit_call(attention_reconstruction_loss, hidden, old_states, compressed,
                  jnp.asarray(real_slots), projections)
  assert_close(loss, np_reconstruction_loss(hidden, old_states, compressed, real_slots,
                                            projections), rtol=1e-4, atol=1e-6)
  if real_slots == 0:
    assert float(loss) == 0.0


def _full_layer_and_segment(seed):
  """The default layer with both memories full, and a new segment `[B, 4, E]`."""
  layer, params, memory = _layer()
  return (layer, params, _filled_memory(layer, params, memory),
          jax.random.normal(jax.random.PRNGKey(seed), (B, 4, E)))


@pytest.mark.property("compressive")
def test_reconstruction_loss_trains_only_the_compression():
  layer, params, memory, x = _full_layer_and_segment(seed=6)

  def sown_loss(params, x, hidden):
    _, state = jit_apply(layer, {"params": params, "memory": {**memory, "hidden": hidden}}, x,
                           is_causal=True, mutable=["memory", "losses"])
    return sum(jnp.sum(leaf) for leaf in jax.tree.leaves(state["losses"]))

  assert float(sown_loss(params, x, memory["hidden"])) > 1e-3
  grad_params, grad_x, grad_hidden = jax.grad(sown_loss, argnums=(0, 1, 2))(
      params, x, memory["hidden"])
  for path, grad in traverse_util.flatten_dict(grad_params["attention"]).items():
    np.testing.assert_array_equal(grad, np.zeros_like(grad), err_msg=str(path))
  np.testing.assert_array_equal(grad_x, np.zeros_like(grad_x))
  np.testing.assert_array_equal(grad_hidden, np.zeros_like(grad_hidden))
  assert float(jnp.abs(grad_params["compression_kernel"]).max()) > 1e-4
  assert float(jnp.abs(grad_params["compression_bias"]).max()) > 1e-4


@pytest.mark.property("compressive")
def test_no_gradient_reaches_either_memory_from_the_output():
  layer, params, memory, x = _full_layer_and_segment(seed=7)

  def output_loss(params, hidden, compressed):
    y, _ = jit_apply(layer, {"params": params, "memory": {**memory, "hidden": hidden,
                                                     "compressed": compressed}},
                       x, is_causal=True, mutable=["memory"])
    return jnp.sum(y ** 2)

  # The compressed memory changes the output, yet passes it no gradient.
  without = {**memory, "compressed_filled": jnp.zeros((), jnp.int32)}
  difference = (jit_apply(layer, {"params": params, "memory": memory}, x, is_causal=True)
                - jit_apply(layer, {"params": params, "memory": without}, x, is_causal=True))
  assert np.abs(np.asarray(difference)).max() > 1e-3
  grad_params, grad_hidden, grad_compressed = jax.grad(output_loss, argnums=(0, 1, 2))(
      params, memory["hidden"], memory["compressed"])
  np.testing.assert_array_equal(grad_hidden, np.zeros_like(grad_hidden))
  np.testing.assert_array_equal(grad_compressed, np.zeros_like(grad_compressed))
  # The task loss does not reach the convolution either (the memory is stored
  # without gradient): only the reconstruction loss trains it.
  np.testing.assert_array_equal(grad_params["compression_kernel"],
                                np.zeros_like(grad_params["compression_kernel"]))
  assert float(jnp.abs(grad_params["attention"]["query"]["kernel"]).max()) > 0


@pytest.mark.property("compressive")
def test_compressed_slots_are_the_keys_just_before_the_memory():
  """Segment by segment, the layer equals Transformer-XL's with a memory of
  Mc + M slots holding `[compressed; memory]`: the compressed slots are keys
  at the positions just before the memory's, masked while not real. Before
  any slot is real (the first segments) that is Transformer-XL with M slots."""
  layer, params, memory = _layer()
  xl = TransformerXLAttention(num_heads=H, memory_length=4 + 8)
  xl_params = {"attention": params["attention"]}
  for segment in _segments((4, 4, 4, 4), seed=40):
    y, state = jit_apply(layer, {"params": params, "memory": memory}, segment, is_causal=True,
                           mutable=["memory"])
    xl_memory = {"hidden": jnp.concatenate([memory["compressed"], memory["hidden"]], axis=1),
                 "filled": memory["compressed_filled"] + memory["filled"]}
    assert_close(y, jit_apply(xl, {"params": xl_params, "memory": xl_memory}, segment,
                             is_causal=True), rtol=1e-5, atol=1e-5)
    memory = state["memory"]
  assert int(memory["compressed_filled"]) == 4


@pytest.mark.property("compressive")
def test_without_a_compressed_memory_it_is_transformer_xl():
  compressive, params, memory = _layer(compressed_memory_length=0)
  xl = TransformerXLAttention(num_heads=H, memory_length=8)
  xl_variables = jit_init(xl, jax.random.PRNGKey(3), jnp.zeros((B, 4, E)), is_causal=True)
  assert set(params) == {"attention"} and set(memory) == {"hidden", "filled"}
  assert (jax.tree.map(jnp.shape, params)
          == jax.tree.map(jnp.shape, nn.meta.unbox(xl_variables["params"])))
  xl_memory = xl_variables["memory"]
  for segment in _segments((4, 4, 4), seed=50):
    y, state = jit_apply(compressive, {"params": params, "memory": memory}, segment, is_causal=True,
                                 mutable=["memory", "losses"])
    xl_y, xl_state = jit_apply(xl, {"params": params, "memory": xl_memory}, segment, is_causal=True,
                              mutable=["memory"])
    np.testing.assert_array_equal(y, xl_y)
    assert "losses" not in state
    memory, xl_memory = state["memory"], xl_state["memory"]


@pytest.mark.property("compressive")
def test_pure_function_is_transformer_xl_over_both_memories():
  compressed_length, memory_length, q_len, head_dim = 2, 3, 4, 8
  query, key, value = random_qkv(seed=8, batch=B, q_len=q_len,
                                 kv_len=compressed_length + memory_length + q_len, num_heads=H,
                                 num_kv_heads=1, head_dim=head_dim)
  rng = np.random.default_rng(9)
  arrays = dict(
      relative_key=jnp.asarray(rng.normal(size=(1, 2 * q_len + 4, H, head_dim)), jnp.float32),
      content_bias=jnp.asarray(rng.normal(size=(H, head_dim)), jnp.float32),
      position_bias=jnp.asarray(rng.normal(size=(H, head_dim)), jnp.float32))
  got = jit_call(compressive_attention, query, key, value,
                 compressed_memory_length=compressed_length, memory_length=memory_length,
                 is_causal=True, **arrays)
  expected = jit_call(transformer_xl_attention, query, key, value, memory_length=5,
                      is_causal=True, **arrays)
  np.testing.assert_array_equal(got, expected)
  with pytest.raises(ValueError, match="compressed_memory_length must be an int >= 0, got -1"):
    compressive_attention(query, key, value, compressed_memory_length=-1, memory_length=3,
                          **arrays)


@pytest.mark.property("compressive")
@pytest.mark.parametrize("scan_layers", [False, True])
def test_language_model_with_compressive_memory_trains_segment_by_segment_under_jit(scan_layers):
  config = ModelConfig.from_config(dict(
      kind="language_model", vocab_size=11, num_layers=2, embed_dim=E, num_heads=H, mlp_dim=32,
      max_length=8, attention="compressive", position="none", scan_layers=scan_layers,
      attention_options={"memory_length": 8, "compressed_memory_length": 4,
                         "compression_rate": 2}))
  model = build_model(config)
  tokens = jax.random.randint(jax.random.PRNGKey(0), (B, 32), 0, 11)
  variables = jit_init(model, jax.random.PRNGKey(1), tokens[:, :8])

  step = segment_training_step(model, vocab_size=11)
  memory, reconstructions = variables["memory"], []
  for start in range(0, 32, 8):
    value, reconstruction, grads, memory = step(variables["params"], memory,
                                                tokens[:, start:start + 8])
    reconstructions.append(float(reconstruction))
    assert np.isfinite(float(value))
    assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))
  # Nothing real leaves the memory before the first segment has filled it.
  assert reconstructions[0] == 0.0 and min(reconstructions[1:]) > 0
  flat_grads = traverse_util.flatten_dict(nn.meta.unbox(grads))
  kernels = [g for path, g in flat_grads.items() if path[-1] == "compression_kernel"]
  assert len(kernels) == (1 if scan_layers else 2)
  assert all(float(jnp.abs(g).max()) > 0 for g in kernels)
  # One count per layer (stacked in one array per name when scanned).
  counts = {name: sum((np.ravel(leaf).tolist() for path, leaf
                       in traverse_util.flatten_dict(memory).items() if path[-1] == name), [])
            for name in ("filled", "compressed_filled")}
  assert counts == {"filled": [8, 8], "compressed_filled": [4, 4]}


def test_bad_compression_options_are_refused():
  x = jnp.zeros((B, 4, E))
  init = lambda **fields: CompressiveAttention(num_heads=H, **fields).init(
      jax.random.PRNGKey(0), x)
  with pytest.raises(ValueError, match="compressed_memory_length must be an int >= 0, got -1"):
    init(compressed_memory_length=-1)
  with pytest.raises(ValueError, match="compression_rate must be an int >= 1, got 0"):
    init(compression_rate=0)
  with pytest.raises(ValueError, match=r"unknown compression 'max'\..*Valid names are: pool, "
                                       r"conv\."):
    init(compression="max")
  with pytest.raises(ValueError, match="position='rope'"):
    init(position="rope")
  # Checked where a segment is compressed: initialisation and calls that keep
  # the memory as it is (a trainer's, without the collection) take any length.
  layer, params, memory = _layer(compression_rate=4, first_length=6)
  jit_apply(layer, {"params": params, "memory": memory}, jnp.zeros((B, 6, E)))
  with pytest.raises(ValueError, match=r"compression_rate=4 must divide the sequence length 6"):
    jit_apply(layer, {"params": params, "memory": memory}, jnp.zeros((B, 6, E)), mutable=["memory"])
  with pytest.raises(ValueError, match=r"the memory 'compressed' holds \[B, "
                                       r"compressed_memory_length, E\] = \[2, 3, 16\].*"
                                       r"segments must keep"):
    jit_apply(layer, {"params": params, "memory": {**memory, "compressed": jnp.zeros((B, 3, E))}},
                jnp.zeros((B, 4, E)), mutable=["memory"])
  with pytest.raises(ValueError, match="unknown compression 'mean'"):
    compress_memory(x, 2, "mean")
  with pytest.raises(ValueError, match="compression 'conv' needs its kernel"):
    compress_memory(x, 2, "conv")
  model = build_model(ModelConfig.from_config(dict(
      kind="language_model", vocab_size=11, num_layers=1, embed_dim=E, num_heads=H, mlp_dim=32,
      max_length=8, attention="compressive", attention_options={"compression": "pooling"})))
  with pytest.raises(ValueError, match=r"unknown compression 'pooling'\. Did you mean "
                                       r"'pool'\?"):
    jit_init(model, jax.random.PRNGKey(0), jnp.zeros((B, 8), jnp.int32))
