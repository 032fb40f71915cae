"""predictive (Wang et al. 2021): the previous layer's attention map through a
2-D convolution, mixed into the logits, handed on by the layer stack's carry."""

import flax.linen as nn
from flax import traverse_util
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attention_jax
from attention_jax.models import Block, Encoder, LayerStack, ModelConfig, build_model
from attention_jax.models.stack import unstack_scanned
from attention_jax.variants.prior.carried import MAPS, predictive_attention
from attention_testing import (B, H, Q_LENGTHS, TK, TQ, VARIANT_MASK_CASES, as_float64,
                               assert_same_outputs_and_grads, jit_apply, jit_init, loop_mask,
                               perturbed, random_qkv)


def _kernel(size=3, seed=3):
  return jnp.array(np.random.default_rng(seed).normal(size=(size, size, H, H)), jnp.float32)


def _previous_map(seed=4, q_len=TQ, kv_len=TK):
  """A stand-in A_{l-1}: rows of softmax weights (any array serves the formula)."""
  logits = np.random.default_rng(seed).normal(size=(B, H, q_len, kv_len))
  return jnp.array(np.exp(logits) / np.exp(logits).sum(-1, keepdims=True), jnp.float32)


def np_convolve(previous, kernel, is_causal, q_segments=None, kv_segments=None):
  """g(A)[b, o, i, j] = sum over (r, c, h) of kernel[r, c, h, o] A[b, h, i + dr, j + dc],
  written out offset by offset: dr = r - (k - 1) when causal (rows above only),
  else r - k // 2; dc = c - k // 2; entries outside the map count as zero, and
  so do, with segments `[B, Tq]` and `[B, Tk]`, those whose row is in another
  segment than i or whose column is in another segment than j."""
  previous, kernel = as_float64(previous), as_float64(kernel)
  if q_segments is not None:
    q_seg, kv_seg = np.asarray(q_segments), np.asarray(kv_segments)
    q_len, kv_len = previous.shape[2:]
    out = np.zeros(previous.shape[:1] + (kernel.shape[3], q_len, kv_len))
    for b in range(previous.shape[0]):
      for i in range(q_len):
        for j in range(kv_len):
          for r in range(kernel.shape[0]):
            for c in range(kernel.shape[1]):
              row = i + (r - (kernel.shape[0] - 1) if is_causal else r - kernel.shape[0] // 2)
              col = j + c - kernel.shape[1] // 2
              if (0 <= row < q_len and 0 <= col < kv_len and q_seg[b, row] == q_seg[b, i]
                  and kv_seg[b, col] == kv_seg[b, j]):
                out[b, :, i, j] += previous[b, :, row, col] @ kernel[r, c]
    return out
  size = kernel.shape[0]
  _, _, q_len, kv_len = previous.shape
  out = np.zeros(previous.shape[:1] + (kernel.shape[3], q_len, kv_len))
  for r in range(size):
    for c in range(size):
      dr = r - (size - 1) if is_causal else r - size // 2
      dc = c - size // 2
      shifted = np.zeros_like(previous)
      rows = slice(max(0, -dr), min(q_len, q_len - dr))
      cols = slice(max(0, -dc), min(kv_len, kv_len - dc))
      shifted[:, :, rows, cols] = previous[:, :, rows.start + dr:rows.stop + dr,
                                           cols.start + dc:cols.stop + dc]
      out += np.einsum("ho,bhqk->boqk", kernel[r, c], shifted)
  return out


@pytest.mark.property("predictive")
@pytest.mark.parametrize("case", sorted(VARIANT_MASK_CASES))
def test_with_zero_previous_weight_it_is_dot_product_attention(case):
  query, key, value = random_qkv(seed=1, batch=B, q_len=TQ, kv_len=TK, num_heads=H,
                                 num_kv_heads=2)
  kwargs = VARIANT_MASK_CASES[case][0]
  carry = {MAPS: _previous_map()}
  ours = lambda q, k, v: predictive_attention(
      q, k, v, conv_kernel=_kernel(), carry=carry, previous_weight=0.0, **kwargs)[0]
  theirs = lambda q, k, v: attention_jax.dot_product_attention(q, k, v, **kwargs)
  rows = None if "query_seq_lengths" not in kwargs else (
      np.arange(TQ)[None, :] < Q_LENGTHS[:, None])
  assert_same_outputs_and_grads(ours, theirs, query, key, value, rows=rows)


@pytest.mark.property("predictive")
@pytest.mark.parametrize("case", ["plain", "causal", "everything"])
def test_logits_mix_the_scores_with_the_convolved_previous_map(case):
  """S = (1 - a) q . k / sqrt(D) + a g(A_prev); A = softmax(S) over the allowed
  keys; out = A v; and A is what the layer hands on."""
  kwargs, mask_kwargs = VARIANT_MASK_CASES[case]
  query, key, value = random_qkv(seed=2, batch=B, q_len=TQ, kv_len=TK, num_heads=H)
  previous, kernel, weight = _previous_map(), _kernel(), 0.7
  out, carry = predictive_attention(query, key, value, conv_kernel=kernel,
                                    carry={MAPS: previous}, previous_weight=weight,
                                    **kwargs)
  is_causal = kwargs.get("is_causal", False)
  scores = np.einsum("bqhd,bkhd->bhqk", as_float64(query), as_float64(key)) / np.sqrt(
      query.shape[-1])
  segments = kwargs.get("segment_ids", (None, None))
  logits = (1 - weight) * scores + weight * np_convolve(previous, kernel, is_causal, *segments)
  allowed = loop_mask(B, TQ, TK, **mask_kwargs)
  logits = np.where(allowed, logits, -np.inf)
  row_max = np.max(logits, -1, keepdims=True)
  maps = np.exp(logits - np.where(np.isfinite(row_max), row_max, 0.0))
  total = maps.sum(-1, keepdims=True)
  maps = maps / np.where(total == 0, 1.0, total)
  np.testing.assert_allclose(carry[MAPS], maps, rtol=1e-4, atol=1e-5)
  expected = np.einsum("bhqk,bkhd->bqhd", maps, as_float64(value))
  np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-5)


# Padding anywhere, as Encoder passes it: a key mask [B, 1, 1, T], no query mask.
PADDED = np.array([[False] * 6 + [True] * 2, [False, False, True] + [False] * 3 + [True] * 2])
# Suffix padding, as key_value_seq_lengths give it.
LENGTHS = np.array([6, 5])


def _changed_at(padded, array, seed):
  """`array` [B, T, ...] with its `padded` [B, T] positions redrawn, far from the rest."""
  noise = 5.0 * jax.random.normal(jax.random.PRNGKey(seed), array.shape, array.dtype)
  return jnp.where(padded.reshape(padded.shape + (1,) * (array.ndim - 2)), noise, array)


@pytest.mark.property("predictive")
@pytest.mark.parametrize("padding", ["key_mask", "key_value_seq_lengths"])
def test_padded_tokens_reach_neither_the_valid_rows_nor_the_carried_map(padding):
  """With key-only padding the softmax still gives every padded query a row
  over the valid keys, made from the padded query; the next layer's
  convolution reads rows i - 1 .. i + 1, so that row would reach the valid
  query beside it. The carried rows of padded queries are zero instead."""
  length = PADDED.shape[1]
  if padding == "key_mask":
    padded, masks = PADDED, dict(mask=jnp.asarray(~PADDED)[:, None, None, :])
  else:
    padded = np.arange(length)[None, :] >= LENGTHS[:, None]
    masks = dict(key_value_seq_lengths=jnp.asarray(LENGTHS))
  first = random_qkv(seed=11, batch=B, q_len=length, num_heads=H)
  second = random_qkv(seed=12, batch=B, q_len=length, num_heads=H)

  @jax.jit
  def two_layers(first, second):
    """Two layers, the second carrying the first's maps, as one program."""
    _, carry = predictive_attention(*first, **masks, conv_kernel=_kernel(seed=5))
    out, last = predictive_attention(*second, **masks, conv_kernel=_kernel(seed=6),
                                     carry=carry)
    return out, carry[MAPS], last[MAPS]

  out, first_map, last_map = two_layers(first, second)
  changed = two_layers(*[tuple(_changed_at(padded, a, seed=20 + i) for a in layer)
                         for i, layer in enumerate((first, second))])
  valid = ~padded
  np.testing.assert_allclose(np.asarray(changed[0])[valid], np.asarray(out)[valid], rtol=1e-5,
                             atol=1e-6)
  for before, after in zip((first_map, last_map), changed[1:]):
    np.testing.assert_allclose(after, before, rtol=1e-5, atol=1e-6)
    # Zero rows at the padded queries, distributions over the valid keys elsewhere.
    rows = np.asarray(before).transpose(0, 2, 1, 3)  # [B, T, H, T]
    np.testing.assert_array_equal(rows[padded], 0.0)
    np.testing.assert_allclose(rows[valid].sum(-1), 1.0, rtol=1e-5)
  # The padded positions' own outputs do change: the test can tell them apart.
  assert np.abs(np.asarray(changed[0] - out)[padded]).max() > 1e-3


@pytest.mark.property("predictive")
@pytest.mark.parametrize("is_causal", [False, True])
def test_packed_segments_give_what_each_segment_gives_alone(is_causal):
  """Two layers over two packed sequences (segment_ids) equal the same two
  layers over each sequence alone: the convolution of the carried map reads
  the neighbouring rows and columns, which across a segment's border are
  another sequence's weights (made from its tokens), zero when it runs alone."""
  borders = (3, 8)  # segment 0: positions 0..2, segment 1: 3..7
  length = borders[-1]
  segment_ids = jnp.asarray(np.repeat([[0, 1]], B, 0).repeat([3, 5], axis=1))
  first = random_qkv(seed=31, batch=B, q_len=length, num_heads=H)
  second = random_qkv(seed=32, batch=B, q_len=length, num_heads=H)

  def two_layers(first, second, **segments):
    _, carry = predictive_attention(*first, conv_kernel=_kernel(seed=7), is_causal=is_causal,
                                    **segments)
    out, last = predictive_attention(*second, conv_kernel=_kernel(seed=8), carry=carry,
                                     is_causal=is_causal, **segments)
    return out, last[MAPS]

  packed_out, packed_map = (np.asarray(a) for a in jax.jit(
      lambda f, s: two_layers(f, s, segment_ids=segment_ids))(first, second))
  for start, stop in ((0, borders[0]), borders):
    part = lambda arrays: tuple(a[:, start:stop] for a in arrays)
    alone_out, alone_map = two_layers(part(first), part(second))
    np.testing.assert_allclose(packed_out[:, start:stop], alone_out, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(packed_map[:, :, start:stop, start:stop], alone_map, rtol=1e-5,
                               atol=1e-6)


@pytest.mark.parametrize("scan_layers", [False, True])
def test_encoder_outputs_at_valid_positions_ignore_the_padded_tokens(scan_layers):
  """Through the encoder, whose stack carries each predictive layer's map to
  the next (one dot_product layer between them hands it on untouched)."""
  config = _config(kind="classifier", num_layers=4, scan_layers=scan_layers,
                   layer_attention=("predictive", "predictive", "dot_product", "predictive"),
                   max_length=8)
  encoder = Encoder(config)
  tokens = _tokens(length=8)
  other = jnp.where(jnp.asarray(PADDED), (tokens % 10) + 1, tokens)
  assert not np.array_equal(other, tokens)
  variables = {"params": perturbed(nn.meta.unbox(
      jit_init(encoder, jax.random.PRNGKey(0), tokens,
               padding_mask=jnp.asarray(~PADDED))["params"]))}
  apply = lambda t, m: jit_apply(encoder, variables, t, padding_mask=m)
  out, out_other = apply(tokens, jnp.asarray(~PADDED)), apply(other, jnp.asarray(~PADDED))
  valid = ~PADDED
  np.testing.assert_allclose(np.asarray(out_other)[valid], np.asarray(out)[valid], rtol=1e-5,
                             atol=1e-5)
  # Without the mask the padded tokens matter: the test can fail.
  unmasked = jnp.ones_like(jnp.asarray(PADDED))
  assert np.abs(np.asarray(apply(other, unmasked) - apply(tokens, unmasked))[valid]).max() > 1e-3


def _config(**overrides):
  fields = dict(vocab_size=11, num_layers=3, embed_dim=16, num_heads=2, mlp_dim=32,
                max_length=12, dropout_rate=0.0, attention="predictive", kind="language_model")
  fields.update(overrides)
  return ModelConfig.from_config(fields)


def _tokens(seed=0, length=12):
  return jax.random.randint(jax.random.PRNGKey(seed), (B, length), 1, 11)


def test_a_model_with_zero_previous_weight_is_the_vanilla_model():
  tokens = _tokens()
  predictive = _config(attention_options={"previous_weight": 0.0})
  params = perturbed(jit_init(build_model(predictive), jax.random.PRNGKey(0), tokens)["params"])
  out = jit_apply(build_model(predictive), {"params": params}, tokens)
  # The vanilla model has the same parameters less the convolutions.
  flat = traverse_util.flatten_dict(params)
  vanilla_params = traverse_util.unflatten_dict(
      {path: leaf for path, leaf in flat.items() if "variant" not in path})
  assert len(vanilla_params) and len(flat) - len(traverse_util.flatten_dict(vanilla_params)) == 3
  expected = jit_apply(build_model(_config(attention="dot_product")), {"params": vanilla_params},
                       tokens)
  np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
  # ... and with the default weight the maps of one layer reach the next.
  default = jit_apply(build_model(_config()), {"params": params}, tokens)
  assert np.abs(np.asarray(default - expected)).max() > 1e-3


def test_the_stack_hands_each_layer_the_previous_layers_map():
  config = _config(kind="classifier")
  x = jax.random.normal(jax.random.PRNGKey(5), (B, 12, 16))
  stack = LayerStack(config)
  params = perturbed(nn.meta.unbox(jit_init(stack, jax.random.PRNGKey(0), x)["params"]))
  y, carry = jit_apply(stack, {"params": params}, x)
  stream, layer_carry = x, {MAPS: jnp.zeros((B, 2, 12, 12))}
  for i in range(config.num_layers):
    previous = layer_carry[MAPS]
    stream, layer_carry = Block(config).apply({"params": params[f"block_{i}"]}, stream,
                                              layer_carry)
    # Each map is a softmax over the keys: rows sum to one.
    np.testing.assert_allclose(layer_carry[MAPS].sum(-1), 1.0, rtol=1e-5)
    assert np.abs(np.asarray(layer_carry[MAPS] - previous)).max() > 1e-3
  np.testing.assert_allclose(y, stream, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(carry[MAPS], layer_carry[MAPS], rtol=1e-5, atol=1e-6)


def test_scanned_stack_equals_unrolled():
  x = jax.random.normal(jax.random.PRNGKey(6), (B, 12, 16))
  scanned = _config(kind="classifier", scan_layers=True)
  variables = jit_init(LayerStack(scanned), jax.random.PRNGKey(1), x)
  params = perturbed(nn.meta.unbox(variables["params"]))
  y, _ = jit_apply(LayerStack(scanned), {"params": params}, x)
  expected, _ = jit_apply(LayerStack(_config(kind="classifier")),
                          {"params": unstack_scanned(params, scanned)}, x)
  np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)


def test_causal_model_output_never_depends_on_a_later_token():
  """The convolution mixes neighbouring rows of the map; a causal stack must
  pad the query axis above only, or a later token's map leaks into an earlier
  query from the second layer on."""
  tokens = _tokens(seed=1)
  model = build_model(_config(attention_options={"kernel_size": 5}))
  params = perturbed(jit_init(model, jax.random.PRNGKey(0), tokens)["params"])
  logits = jit_apply(model, {"params": params}, tokens)
  cut = 5
  changed = tokens.at[:, cut + 1:].set((tokens[:, cut + 1:] % 10) + 1)
  changed_logits = jit_apply(model, {"params": params}, changed)
  np.testing.assert_allclose(changed_logits[:, :cut + 1], logits[:, :cut + 1], rtol=1e-5,
                             atol=1e-5)
  assert np.abs(np.asarray(changed_logits[:, cut + 1:] - logits[:, cut + 1:])).max() > 1e-3


def test_bad_arguments_name_themselves():
  query, key, value = random_qkv(seed=1, batch=B, q_len=TQ, kv_len=TK, num_heads=H)
  with pytest.raises(ValueError, match=r"previous_weight must be in \[0, 1\]"):
    predictive_attention(query, key, value, conv_kernel=_kernel(), previous_weight=1.5)
  with pytest.raises(ValueError, match="conv_kernel must be .* k odd"):
    predictive_attention(query, key, value, conv_kernel=_kernel(size=2))
  with pytest.raises(ValueError, match="conv_kernel"):
    predictive_attention(query, key, value, conv_kernel=jnp.zeros((3, 3, H, H + 1)))
  with pytest.raises(ValueError, match=r"carry\['attention_maps'\] must be"):
    predictive_attention(query, key, value, conv_kernel=_kernel(),
                         carry={MAPS: jnp.zeros((B, H, TQ, TQ))})
  tokens = _tokens()
  with pytest.raises(ValueError, match="kernel_size must be an odd positive int"):
    build_model(_config(attention_options={"kernel_size": 4})).init(jax.random.PRNGKey(0),
                                                                    tokens)
