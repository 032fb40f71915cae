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
from attention_testing import assert_close

TASKS = ("listops", "text", "retrieval", "image", "pathfinder32", "pathx")


def _np(x):
  return np.asarray(x, np.float64)


def _np_softmax(logits):
  logits = logits - logits.max(-1, keepdims=True)
  weights = np.exp(logits)
  return weights / weights.sum(-1, keepdims=True)


def _np_project(x, p):
  """DenseGeneral into heads: x [B, T, E], kernel [E, H, D], bias [H, D]."""
  return np.einsum("bte,ehd->bthd", x, _np(p["kernel"])) + _np(p["bias"])


def _np_out(out, p):
  return np.einsum("bthd,hde->bte", out, _np(p["kernel"])) + _np(p["bias"])


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
  variables = layer.init(jax.random.PRNGKey(1), jnp.asarray(x))
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
  got = layer.apply({"params": params}, jnp.asarray(x))
  assert_close(got, expected, rtol=1e-4, atol=1e-4)
  # The release applies no padding mask: given padding changes nothing.
  got_padded = layer.apply({"params": params}, jnp.asarray(x),
                           key_value_seq_lengths=jnp.array([length, 9]))
  assert_close(got_padded, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.property("lsh")
def test_lsh_release_options_each_change_the_output():
  """Each release option is live: switching it back to the method changes the output."""
  key = jax.random.PRNGKey(3)
  q, v = (jax.random.normal(k, (1, 40, 2, 8)) for k in jax.random.split(key))
  release = registry.preset_options("lsh", "lra_release", "listops")
  base = hashing.lsh_attention(q, q, v, **release)
  for option, method_value in dict(scale_exponent=-0.5, normalize_keys=True,
                                   mask_buckets=True).items():
    changed = hashing.lsh_attention(q, q, v, **dict(release, **{option: method_value}))
    assert float(jnp.max(jnp.abs(changed - base))) > 1e-3, option
  # fixed rotations ignore hash_rng; without them hash_rng is required.
  assert_close(hashing.lsh_attention(q, q, v, hash_rng=jax.random.PRNGKey(9), **release), base)
  with pytest.raises(ValueError, match="needs hash_rng, .* or fixed_rotations=True"):
    hashing.lsh_attention(q, q, v, **dict(release, fixed_rotations=False))
  with pytest.raises(ValueError, match="num_chunks"):
    hashing.lsh_attention(q, q, v, **dict(release, num_chunks=0))
