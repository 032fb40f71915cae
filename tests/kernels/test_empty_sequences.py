"""Empty sequences (issue #36): Tq = 0 or Tk = 0 give what jax.nn gives, in every
implementation and kernel entry point, with zero gradients of the inputs' shapes.

jax.nn's answer: with no key, zeros `[B, Tq, H, Dv]` (its residual is -inf, ours
`MASKED_LOGSUMEXP`, as for any query with nothing to attend); with no query, an
empty `[B, 0, H, Dv]`. Before the fix "xla" took a maximum over an empty axis,
blockwise and the Mosaic TPU kernel divided by zero-length blocks, and the Triton
kernel sliced a 16-row block out of none.
"""

import contextlib
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attention_jax
from attention_jax.core import MASKED_LOGSUMEXP
from attention_jax.kernels.flash_attention import (BlockSizes, blockwise_dot_product_attention,
                                                   flash_dot_product_attention, pallas_gpu,
                                                   pallas_mgpu, pallas_tpu, ring)
from attention_jax.variants import dense

BATCH, HEADS, KV_HEADS, HEAD_DIM, VALUE_DIM = 2, 4, 2, 8, 5
# (Tq, Tk)
LENGTHS = {"no_keys": (6, 0), "no_queries": (0, 6), "neither": (0, 0)}
# name -> keyword arguments (key lengths are clipped to Tk when the case is built)
MASKS = {
    "plain": {},
    "causal": dict(is_causal=True),
    "causal_key_lengths": dict(is_causal=True, key_value_seq_lengths=np.array([6, 3])),
}

_ONE_DEVICE_RING = jax.make_mesh((1,), ("sequence",))
# name -> attention function with dot_product_attention's signature; "ring" is
# called inside `jax.set_mesh(_ONE_DEVICE_RING)`. Every registered implementation
# that runs on CPU goes through dot_product_attention; the rest, by their entry points.
IMPLEMENTATIONS = {
    **{name: functools.partial(attention_jax.dot_product_attention, implementation=name)
       for name in ("xla", "blockwise", "ring")},
    "blockwise_dot_product_attention": functools.partial(
        blockwise_dot_product_attention, block_sizes=BlockSizes(4, 4, 2, 8)),
    "ring_attention": functools.partial(ring.ring_attention, mesh=_ONE_DEVICE_RING),
    # implementation="pallas" off an accelerator: the Triton kernels, interpreted.
    "flash_dot_product_attention": flash_dot_product_attention,
    "gpu_dot_product_attention": functools.partial(pallas_gpu.gpu_dot_product_attention,
                                                   interpret=True),
    "tpu_dot_product_attention": functools.partial(pallas_tpu.tpu_dot_product_attention,
                                                   interpret=True),
}


def _inputs(q_len, kv_len, dtype=jnp.float32):
  keys = jax.random.split(jax.random.key(0), 3)
  query = jax.random.normal(keys[0], (BATCH, q_len, HEADS, HEAD_DIM), dtype)
  key = jax.random.normal(keys[1], (BATCH, kv_len, KV_HEADS, HEAD_DIM), dtype)
  value = jax.random.normal(keys[2], (BATCH, kv_len, KV_HEADS, VALUE_DIM), dtype)
  return query, key, value


def _masks(mask_name, kv_len):
  kwargs = dict(MASKS[mask_name])
  if "key_value_seq_lengths" in kwargs:
    kwargs["key_value_seq_lengths"] = jnp.minimum(jnp.array(kwargs["key_value_seq_lengths"]),
                                                  kv_len)
  return kwargs


@pytest.mark.parametrize("return_residual", [False, True])
@pytest.mark.parametrize("mask_name", sorted(MASKS))
@pytest.mark.parametrize("lengths", sorted(LENGTHS))
@pytest.mark.parametrize("implementation", sorted(IMPLEMENTATIONS))
def test_empty_sequences_give_what_jax_nn_gives(implementation, lengths, mask_name,
                                                return_residual):
  q_len, kv_len = LENGTHS[lengths]
  qkv = _inputs(q_len, kv_len)
  kwargs = _masks(mask_name, kv_len)
  attention = functools.partial(IMPLEMENTATIONS[implementation], return_residual=return_residual,
                                **kwargs)

  def loss(*args):
    result = attention(*args)
    out, residual = result if return_residual else (result, jnp.zeros(()))
    return jnp.sum(out) + jnp.sum(residual), result

  context = (jax.set_mesh(_ONE_DEVICE_RING) if implementation == "ring"
             else contextlib.nullcontext())
  with context:
    (_, result), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(*qkv)

  out, residual = result if return_residual else (result, None)
  assert out.shape == (BATCH, q_len, HEADS, VALUE_DIM) and out.dtype == jnp.float32
  np.testing.assert_array_equal(out, np.zeros(out.shape))  # as jax.nn (below)
  if return_residual:
    assert residual.shape == (BATCH, q_len, HEADS)
    np.testing.assert_array_equal(residual, np.full(residual.shape, MASKED_LOGSUMEXP,
                                                    np.float32))
  for name, grad, x in zip("qkv", grads, qkv):
    assert grad.shape == x.shape and grad.dtype == x.dtype, name
    np.testing.assert_array_equal(grad, np.zeros(x.shape), err_msg=f"gradient of {name}")


@pytest.mark.parametrize("mask_name", sorted(MASKS))
@pytest.mark.parametrize("lengths", sorted(LENGTHS))
def test_jax_nn_gives_zeros_without_keys_and_nothing_without_queries(lengths, mask_name):
  """The answer the implementations copy (jax.nn takes no Dv != D: value = key)."""
  q_len, kv_len = LENGTHS[lengths]
  query, key, _ = _inputs(q_len, kv_len)
  out = jax.nn.dot_product_attention(query, key, key, **_masks(mask_name, kv_len))
  assert out.shape == (BATCH, q_len, HEADS, HEAD_DIM)
  np.testing.assert_array_equal(out, np.zeros(out.shape))


def test_dispatch_answers_empty_sequences_before_any_implementation_runs(monkeypatch):
  """Every registered name, also those off this backend ("pallas", "cudnn",
  "pallas_mgpu"): dot_product_attention returns the empty answer itself."""
  def must_not_run(*args, **kwargs):
    raise AssertionError("an implementation ran on an empty sequence")

  registered = dense._IMPLEMENTATIONS  # pylint: disable=protected-access
  for name, impl in list(registered.items()):
    monkeypatch.setitem(registered, name, dataclasses.replace(
        impl, fn=must_not_run, is_available=lambda: True, rejects=lambda _: None))
  for name in sorted(registered):
    for q_len, kv_len in LENGTHS.values():
      out, residual = attention_jax.dot_product_attention(
          *_inputs(q_len, kv_len, jnp.bfloat16), implementation=name, return_residual=True)
      assert out.shape == (BATCH, q_len, HEADS, VALUE_DIM) and out.dtype == jnp.bfloat16, name
      assert not np.asarray(out, np.float32).any(), name
      assert residual.shape == (BATCH, q_len, HEADS), name


@pytest.mark.parametrize("lengths", sorted(LENGTHS))
def test_mosaic_gpu_entry_point_answers_empty_sequences(lengths):
  # Its own entry point, with the inputs it takes (16-bit, head dim 64, no mask).
  q_len, kv_len = LENGTHS[lengths]
  shape = lambda length: (BATCH, length, KV_HEADS, 64)
  query, key, value = (jnp.ones(shape(n), jnp.bfloat16) for n in (q_len, kv_len, kv_len))
  out, residual = pallas_mgpu.mgpu_dot_product_attention(query, key, value, interpret=True,
                                                         return_residual=True)
  np.testing.assert_array_equal(out, jnp.zeros((BATCH, q_len, KV_HEADS, 64), jnp.bfloat16))
  # The residual comes back in the query dtype, as from every entry point.
  np.testing.assert_array_equal(residual, jnp.full((BATCH, q_len, KV_HEADS), MASKED_LOGSUMEXP,
                                                   residual.dtype))
