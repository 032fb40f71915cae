"""The `lra_release` presets of lsh (Reformer) and sinkhorn against numpy
re-creations written from the LRA release's code (google-research/
long-range-arena, lra_benchmarks/models/reformer/reformer_attention.py and
models/sinkhorn_transformer/sinkhorn_attention.py)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attention_jax
from attention_jax import registry
from attention_jax.variants import hashing
from attention_testing import (as_float64 as _np, assert_close, jit_apply, jit_call, jit_init,
                               np_project_heads as _np_project, np_project_out as _np_out,
                               np_softmax as _np_softmax)

TASKS = ("listops", "text", "retrieval", "image", "pathfinder32", "pathx")


def _release_layer(name, task):
  variant = registry.preset_variant(name, "lra_release")
  return attention_jax.MultiHeadAttention(
      num_heads=2, attention=variant,
      attention_options=registry.preset_options(name, "lra_release", task))


# ---------------------------------------------------------------------------- lsh


def test_lsh_release_preset_is_the_same_on_every_task():
  for task in (None, *TASKS):
    assert registry.preset_options("lsh", "lra_release", task) == dict(
        n_hashes=1, n_buckets=10, num_chunks=10, scale_exponent=0.5, normalize_keys=False,
        mask_buckets=False, mask_padding=False, fixed_rotations=True)


def _np_release_lsh_head(query, value, rotation, n_buckets=10):
  """lsh_attention_single_head with n_hashes = 1: query [T, D] (already padded to
  a multiple of the 10 chunks), value [T, Dv], rotation [D, n_buckets / 2]."""
  length, dim = query.shape
  rotated = query @ rotation
  buckets = np.argmax(np.concatenate([rotated, -rotated], axis=-1), axis=-1)
  order = np.argsort(length * buckets + np.arange(length), kind="stable")
  undo = np.argsort(order, kind="stable")
  chunk = length // n_buckets  # `chunk_size = n_hashes * n_buckets` chunks
  bq = query[order].reshape(n_buckets, chunk, dim)
  bv = value[order].reshape(n_buckets, chunk, -1)
  look_one_back = lambda x: np.concatenate([x, np.concatenate([x[-1:], x[:-1]], 0)], axis=1)
  bk, bv = look_one_back(bq), look_one_back(bv)
  dots = np.einsum("hie,hje->hij", bq, bk) * dim ** 0.5  # times sqrt(D), no mask
  out = np.einsum("hij,hjv->hiv", _np_softmax(dots), bv).reshape(length, -1)
  return out[undo]


@pytest.mark.property("lsh")
@pytest.mark.parametrize("length", [37, 53, 101])
def test_lsh_release_is_the_release_reformer_head(length):
  embed = 16
  layer = _release_layer("lsh", "listops")
  x = np.asarray(jax.random.normal(jax.random.PRNGKey(0), (2, length, embed)))
  variables = jit_init(layer, jax.random.PRNGKey(1), jnp.asarray(x))
  params = nn.meta.unbox(variables["params"])
  assert "key" not in params  # shared QK
  assert "random" not in variables  # fixed rotations: nothing drawn per layer
  # ReformerAttention pads the *inputs* with zeros, so its padded tokens carry
  # the projections' biases; ours pads the projections with zeros. Zero
  # biases make the two the same.
  for name in ("query", "value"):
    params[name]["bias"] = jnp.zeros_like(params[name]["bias"])
  padded = -(-length // 10) * 10  # T not a multiple of 10: the release pads the same
  xp = np.pad(x, [(0, 0), (0, padded - length), (0, 0)])
  q, v = (_np_project(xp, params["query"]), _np_project(xp, params["value"]))
  head_dim = q.shape[-1]
  rotation = _np(hashing.fixed_rotations(head_dim, 10, 1))[0, 0]  # PRNGKey(0), every head
  out = np.stack([np.stack([_np_release_lsh_head(q[b, :, h], v[b, :, h], rotation)
                            for h in range(2)], axis=1) for b in range(2)])
  expected = _np_out(out[:, :length], params["out"])
  got = jit_apply(layer, {"params": params}, jnp.asarray(x))
  assert_close(got, expected, rtol=1e-4, atol=1e-4)
  # The release applies no padding mask: given padding changes nothing.
  got_padded = jit_apply(layer, {"params": params}, jnp.asarray(x),
                           key_value_seq_lengths=jnp.array([length, 9]))
  assert_close(got_padded, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.property("lsh")
def test_lsh_release_options_each_change_the_output():
  """Each release option is live: switching it back to the method changes the output."""
  key = jax.random.PRNGKey(3)
  q, v = (jax.random.normal(k, (1, 40, 2, 8)) for k in jax.random.split(key))
  release = registry.preset_options("lsh", "lra_release", "listops")
  base = jit_call(hashing.lsh_attention, q, q, v, **release)
  for option, method_value in dict(scale_exponent=-0.5, normalize_keys=True,
                                   mask_buckets=True).items():
    changed = jit_call(hashing.lsh_attention, q, q, v, **dict(release, **{option: method_value}))
    assert float(jnp.max(jnp.abs(changed - base))) > 1e-3, option
  # fixed rotations ignore hash_rng; without them hash_rng is required.
  assert_close(jit_call(hashing.lsh_attention, q, q, v, hash_rng=jax.random.PRNGKey(9),
                        **release), base)
  with pytest.raises(ValueError, match="needs hash_rng, .* or fixed_rotations=True"):
    hashing.lsh_attention(q, q, v, **dict(release, fixed_rotations=False))
  with pytest.raises(ValueError, match="num_chunks"):
    hashing.lsh_attention(q, q, v, **dict(release, num_chunks=0))


# ---------------------------------------------------------------------------- sinkhorn


def test_sinkhorn_release_preset_is_the_same_on_every_task():
  for task in (None, *TASKS):
    assert registry.preset_options("sinkhorn", "lra_release", task) == dict(
        sort="lra_release", block_layout="strided", padding="lra_release", block_size=50)


def _np_release_sinkhorn(q, k, v, token_valid, block_size, sort_logits):
  """SinkhornAttention.apply (non-causal, sort_activation='softmax') on projected
  q, k, v [B, T, H, D], padding_mask token_valid [B, T], the sort network's
  output sort_logits [B, nb, H, nb]."""
  batch, length, heads, dim = q.shape
  nb = length // block_size
  block = lambda x: x.reshape(batch, block_size, nb, heads, dim)  # the release's reshape
  bq, bk, bv = block(q), block(k), block(v)
  permutation = _np_softmax(sort_logits)
  sorted_k = np.einsum("bskhd,bnhl->bsnhd", bk, permutation)
  sorted_v = np.einsum("bskhd,bnhl->bsnhd", bv, permutation)
  runs = token_valid.reshape(batch * nb, block_size)  # padding_mask reshaped contiguously
  mask = (runs[:, :, None] & runs[:, None, :]).reshape(batch, nb, block_size, block_size)
  sorted_mask = np.einsum("bksj,bnhl->bnsj", mask.astype(np.float64), permutation) > 0

  def local_attention(keys, values, allowed):
    # local_dot_product_attention over axis 1: batch dims (b, n, h).
    logits = np.einsum("bsnhd,btnhd->bnhst", bq / np.sqrt(dim), keys)
    # The bias is added in float32, as the release ran: -1e10 swallows the
    # logit, so a row with nothing allowed is uniform (in float64 it would not be).
    logits = (logits.astype(np.float32) +
              np.where(allowed, 0.0, -1e10).astype(np.float32)[:, :, None]).astype(np.float64)
    return np.einsum("bnhst,btnhd->bsnhd", _np_softmax(logits), values)

  out = local_attention(bk, bv, mask) + local_attention(sorted_k, sorted_v, sorted_mask)
  return out.reshape(batch, length, heads, dim)


@pytest.mark.property("sinkhorn")
def test_sinkhorn_release_is_the_release_computation():
  batch, length, heads, dim, block_size = 2, 60, 2, 8, 10
  keys = jax.random.split(jax.random.PRNGKey(4), 4)
  q, k, v = (np.asarray(jax.random.normal(key, (batch, length, heads, dim))) for key in keys[:3])
  lengths = np.array([60, 33])
  token_valid = np.arange(length)[None, :] < lengths[:, None]
  sort_logits = np.asarray(jax.random.normal(keys[3], (batch, length // block_size, heads,
                                                       length // block_size)))
  expected = _np_release_sinkhorn(_np(q), _np(k), _np(v), token_valid, block_size, sort_logits)
  options = dict(registry.preset_options("sinkhorn", "lra_release", "listops"),
                 block_size=block_size)
  got = jit_call(hashing.sinkhorn_attention, jnp.asarray(q), jnp.asarray(k), jnp.asarray(v),
                 key_value_seq_lengths=jnp.asarray(lengths), **options)
  assert_close(got, expected, rtol=1e-4, atol=1e-5)
  # The sort network's output never mattered: any other one gives the same.
  assert_close(_np_release_sinkhorn(_np(q), _np(k), _np(v), token_valid, block_size,
                                    2.0 * sort_logits + 1.0), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.property("sinkhorn")
def test_sinkhorn_release_layer_has_no_sort_network_and_takes_any_length():
  layer = _release_layer("sinkhorn", "listops")
  x = jax.random.normal(jax.random.PRNGKey(0), (2, 101, 16))  # [CLS] + 100: padded to 150
  variables = jit_init(layer, jax.random.PRNGKey(1), x)
  assert set(nn.meta.unbox(variables["params"])) == {"query", "key", "value", "out"}
  out = jit_apply(layer, variables, x, key_value_seq_lengths=jnp.array([101, 40]))
  assert out.shape == x.shape and bool(jnp.all(jnp.isfinite(out)))


@pytest.mark.property("sinkhorn")
def test_sinkhorn_release_sort_with_exact_padding_ignores_padded_keys():
  """padding='exact': what padded keys hold changes no valid output."""
  q, k, v = (jax.random.normal(key, (1, 40, 2, 8)) for key in jax.random.split(
      jax.random.PRNGKey(5), 3))
  options = dict(sort="lra_release", block_layout="strided", padding="exact", block_size=8)
  lengths = jnp.array([29])
  garbage = lambda x: x.at[:, 29:].set(100.0)
  clean = jit_call(hashing.sinkhorn_attention, q, k, v, key_value_seq_lengths=lengths, **options)
  dirty = jit_call(hashing.sinkhorn_attention, q, garbage(k), garbage(v),
                   key_value_seq_lengths=lengths, **options)
  assert_close(clean[:, :29], dirty[:, :29], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("options, message", [
    (dict(sort="sorted"), "sort must be one of"),
    (dict(block_layout="strided"), "go with sort='lra_release'"),
    (dict(sort="lra_release", padding="none"), "padding must be one of"),
    (dict(sort="lra_release", is_causal=True), "not causal"),
])
def test_sinkhorn_release_options_reject_bad_values(options, message):
  q = jnp.zeros((1, 16, 1, 4))
  with pytest.raises(ValueError, match=message):
    hashing.sinkhorn_attention(q, q, q, block_size=4, sort_hidden_kernel=jnp.zeros((1, 4, 2)),
                               sort_output_kernel=jnp.zeros((1, 2, 4)), **options)
