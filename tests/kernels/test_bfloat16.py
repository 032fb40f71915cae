"""Every implementation trains in bfloat16 on CPU (issue #36): the output and the
gradients of bfloat16 inputs against float32 attention of the very same values.

"xla", "blockwise" and "ring" (on a one-device mesh, in process; the eight-device
ring runs in tests/kernels/test_ring.py's subprocess) are called through
`dot_product_attention`; the Triton and Mosaic TPU kernels run in their Pallas
interpreters, so their shapes stay small.
"""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attention_jax
from attention_jax.core import reference_attention
from attention_jax.kernels.flash_attention import BlockSizes, pallas_gpu, pallas_tpu
from attention_testing import assert_close

# bfloat16 keeps 8 significant bits: a relative error of 2^-8 per rounding, a few
# roundings deep (inputs to the products, the probabilities, the output).
BF16_TOL = dict(rtol=2e-2, atol=2e-2)

# (B, T, H, Hkv, D): the first two failed in the blockwise backward on CPU
# (issue #36: "Unsupported element type for DotThunk::Execute: BF16 x BF16 = F32"
# once the key loop ran a single block and XLA folded the transpose of the dk/dv
# accumulators into their product); the third adds grouped heads and a causal mask.
SHAPES = {
    "b2_t16_h2_d8": ((2, 16, 2, 2, 8), {}),
    "b2_t128_h4_d32": ((2, 128, 4, 4, 32), {}),
    "b2_t24_h4_hkv2_d16_causal": ((2, 24, 4, 2, 16), dict(is_causal=True)),
}

_ONE_DEVICE_RING = jax.make_mesh((1,), ("sequence",))


def _through_dispatch(implementation):
  return lambda q, k, v, **kwargs: attention_jax.dot_product_attention(
      q, k, v, implementation=implementation, **kwargs)


# name -> (attention function, the context it is traced and run in)
IMPLEMENTATIONS = {
    "xla": (_through_dispatch("xla"), contextlib.nullcontext),
    "blockwise": (_through_dispatch("blockwise"), contextlib.nullcontext),
    "ring": (_through_dispatch("ring"), lambda: jax.set_mesh(_ONE_DEVICE_RING)),
    # The smallest Triton tiles (powers of two >= 16) and TPU tiles (32 x 128),
    # each with its own dk/dv tiling.
    "pallas_triton": (lambda q, k, v, **kwargs: pallas_gpu.gpu_dot_product_attention(
        q, k, v, block_sizes=BlockSizes(16, 16, 32, 16), interpret=True, **kwargs),
                      contextlib.nullcontext),
    "pallas_mosaic_tpu": (lambda q, k, v, **kwargs: pallas_tpu.tpu_dot_product_attention(
        q, k, v, block_sizes=BlockSizes(32, 128), interpret=True, **kwargs),
                          contextlib.nullcontext),
}


def _inputs(shape):
  """bfloat16 q, k, v and a float32 cotangent of the output."""
  batch, length, num_heads, num_kv_heads, head_dim = shape
  keys = jax.random.split(jax.random.key(0), 4)
  q = jax.random.normal(keys[0], (batch, length, num_heads, head_dim), jnp.bfloat16)
  k = jax.random.normal(keys[1], (batch, length, num_kv_heads, head_dim), jnp.bfloat16)
  v = jax.random.normal(keys[2], (batch, length, num_kv_heads, head_dim), jnp.bfloat16)
  cotangent = jax.random.normal(keys[3], (batch, length, num_heads, head_dim))
  return (q, k, v), cotangent


def _output_and_grads(attention, qkv, cotangent):
  """attention(q, k, v) and the gradients of <out, cotangent> w.r.t. q, k and v."""
  def loss(*args):
    out = attention(*args)
    return jnp.sum(out.astype(jnp.float32) * cotangent), out

  (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(*qkv)
  return out, grads


@pytest.mark.parametrize("shape_name", sorted(SHAPES))
@pytest.mark.parametrize("implementation", sorted(IMPLEMENTATIONS))
def test_bfloat16_forward_and_gradients_match_float32(implementation, shape_name):
  shape, kwargs = SHAPES[shape_name]
  attention, context = IMPLEMENTATIONS[implementation]
  qkv, cotangent = _inputs(shape)
  with context():
    out, grads = jax.jit(lambda *a: _output_and_grads(
        lambda q, k, v: attention(q, k, v, **kwargs), a, cotangent))(*qkv)
  # The float32 reference of the same (bfloat16-representable) values.
  allowed = None
  if kwargs.get("is_causal"):
    allowed = jnp.tril(jnp.ones((shape[1], shape[1]), bool))
  expected_out, expected_grads = jax.jit(lambda *a: _output_and_grads(
      lambda q, k, v: reference_attention(q, k, v, mask=allowed), a, cotangent))(
          *(x.astype(jnp.float32) for x in qkv))

  assert out.dtype == jnp.bfloat16 and out.shape == expected_out.shape
  assert_close(out, expected_out, **BF16_TOL, err_msg=f"{implementation} output")
  for name, got, want in zip("qkv", grads, expected_grads):
    assert got.dtype == jnp.bfloat16, name
    assert np.isfinite(np.asarray(got, np.float32)).all(), name
    assert_close(got, want, **BF16_TOL, err_msg=f"{implementation} gradient of {name}")
