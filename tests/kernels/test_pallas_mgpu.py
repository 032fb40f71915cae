"""The Mosaic GPU (Hopper) flash-attention kernels against the dense reference.

There is no GPU in CI: the forward, dq and dk/dv kernels run in the Pallas GPU
interpreter on CPU (TMA copies, barriers and wgmma simulated), and
`test_lowers_for_cuda` checks that the very same kernels lower through Mosaic
GPU to CUDA custom calls (no device needed).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

import attention_jax
from attention_jax.core import reference_attention
from attention_jax.kernels.flash_attention import BlockSizes, pallas_mgpu
from attention_testing import assert_close, loop_mask, random_qkv

# The smallest legal blocks: several per sequence; lengths that are not
# multiples of 64 (Tq = 100 pads to two query blocks, Tk = 150 to three).
SMALL_KEY_BLOCKS = BlockSizes(block_q=64, block_k=64, block_q_dkv=64, block_k_dkv=64)
BATCH, TQ, TK, HEADS, KV_HEADS = 2, 100, 150, 4, 2
KV_LENGTHS = np.array([70, 0])  # batch 1 sees nothing at all
Q_LENGTHS = np.array([90, 33])
SCALE = 0.2

# name -> (keyword arguments of dot_product_attention, arguments of loop_mask)
CASES = {
    "plain": ({}, {}),
    "causal": (dict(is_causal=True), dict(is_causal=True)),
    "window": (dict(local_window_size=(40, 20)), dict(window=(40, 20))),
    "lengths": (dict(key_value_seq_lengths=jnp.array(KV_LENGTHS),
                     query_seq_lengths=jnp.array(Q_LENGTHS)),
                dict(kv_lengths=KV_LENGTHS, q_lengths=Q_LENGTHS)),
    "everything": (dict(is_causal=True, local_window_size=(80, 0),
                        key_value_seq_lengths=jnp.array([140, 64]),
                        query_seq_lengths=jnp.array(Q_LENGTHS)),
                   dict(is_causal=True, window=(80, 0), kv_lengths=np.array([140, 64]),
                        q_lengths=Q_LENGTHS)),
}


def _output_and_grads(fn, args, cotangent):
  out, vjp = jax.vjp(fn, *args)
  return out, vjp(cotangent.astype(out.dtype))


def _compare(case, *, dtype=jnp.bfloat16, head_dim=64, block_sizes=SMALL_KEY_BLOCKS,
             q_len=TQ, kv_len=TK, heads=HEADS, kv_heads=KV_HEADS, grads=True):
  """Output (and q/k/v gradients) equal the float32 reference on the same 16-bit inputs."""
  kwargs, mask_args = CASES[case]
  query, key, value = random_qkv(seed=head_dim, batch=BATCH, q_len=q_len, kv_len=kv_len,
                                 num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                                 dtype=dtype)
  allowed = jnp.array(loop_mask(BATCH, q_len, kv_len, **mask_args))

  def ours(q, k, v):
    return pallas_mgpu.mgpu_dot_product_attention(q, k, v, scale=SCALE, block_sizes=block_sizes,
                                                  **kwargs)

  def oracle(q, k, v):
    f32 = lambda x: x.astype(jnp.float32)
    return reference_attention(f32(q), f32(k), f32(v), None, allowed, scale=SCALE)

  args = (query, key, value)
  if not grads:
    out = jax.jit(ours)(*args)
    assert out.dtype == dtype
    assert_close(out, oracle(*args), rtol=2e-2, atol=2e-2)
    return
  cotangent = jax.random.normal(jax.random.PRNGKey(7), query.shape)
  out, got = jax.jit(lambda *a: _output_and_grads(ours, a, cotangent))(*args)
  expected_out, expected = jax.jit(lambda *a: _output_and_grads(oracle, a, cotangent))(*args)
  assert out.dtype == dtype
  assert_close(out, expected_out, rtol=2e-2, atol=2e-2)
  for name, g, want in zip("qkv", got, expected):
    assert g.dtype == dtype
    # Gradients sum over a row's keys (or a key's queries) in 16-bit inputs:
    # the tolerance is relative to the gradient's own scale.
    scale = float(jnp.max(jnp.abs(want)))
    assert_close(g, want, rtol=2e-2, atol=2e-2 * max(scale, 1.0), err_msg=f"gradient of {name}")


# The interpreter takes ~20 s a case here, so each path is run once: "causal"
# in float16 with the default blocks below, causal with a window in "everything".
@pytest.mark.parity("flash")
@pytest.mark.parametrize("case", ["plain", "window", "lengths", "everything"])
def test_matches_reference_outputs_and_gradients(case):
  _compare(case)


@pytest.mark.parity("flash")
def test_float16_head_dim_128_default_blocks():
  _compare("causal", dtype=jnp.float16, head_dim=128, block_sizes=None, kv_heads=1)


@pytest.mark.parity("flash")
def test_head_dim_256_forward():
  _compare("causal", head_dim=256, block_sizes=None, q_len=64, kv_len=130, heads=2,
           kv_heads=2, grads=False)


def test_fully_masked_rows_give_zeros_and_zero_gradients():
  query, key, value = random_qkv(seed=4, batch=2, q_len=70, kv_len=90, num_heads=2,
                                 head_dim=64, dtype=jnp.bfloat16)
  lengths = jnp.array([90, 0])  # batch 1 sees nothing

  def loss(q, k, v):
    out = pallas_mgpu.mgpu_dot_product_attention(q, k, v, key_value_seq_lengths=lengths,
                                                 block_sizes=SMALL_KEY_BLOCKS)
    return jnp.sum(out.astype(jnp.float32) * jnp.arange(out.size).reshape(out.shape) / out.size), out

  (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(
      query, key, value)
  for x in (out,) + grads:
    assert np.isfinite(np.asarray(x, np.float32)).all()
  np.testing.assert_array_equal(np.asarray(out[1], np.float32), 0.0)
  for grad in grads:
    np.testing.assert_array_equal(np.asarray(grad[1], np.float32), 0.0)
  assert np.abs(np.asarray(out[0], np.float32)).sum() > 0


@pytest.mark.parametrize("case", ["causal", "window"])
def test_blocks_nobody_can_see_are_never_read(case):
  """NaN in every block outside the band changes nothing: it is never loaded.

  Queries 0-127 reach no key past 137, so key block 3 (192-255) is hidden from
  the forward and dq passes; and no key of blocks 0-1 (0-127) is seen by
  query block 3 (192-255) under a window of 10, so the dk/dv pass never reads
  it for those keys.
  """
  kwargs = dict(is_causal=True) if case == "causal" else dict(local_window_size=(10, 10))
  query, key, value = random_qkv(seed=5, batch=1, q_len=256, kv_len=256, num_heads=1,
                                 head_dim=64, dtype=jnp.bfloat16)
  cotangent = jax.random.normal(jax.random.PRNGKey(1), query.shape, jnp.bfloat16)
  attend = functools.partial(pallas_mgpu.mgpu_dot_product_attention,
                             block_sizes=SMALL_KEY_BLOCKS, **kwargs)
  fn = jax.jit(lambda q, k, v, d_out: _output_and_grads(attend, (q, k, v), d_out))
  clean_out, (clean_dq, clean_dk, clean_dv) = fn(query, key, value, cotangent)
  f32 = lambda x: np.asarray(x, np.float32)
  hide_keys = lambda x: x.at[:, 192:].set(jnp.nan)
  out, (dq, _, _) = fn(query, hide_keys(key), hide_keys(value), cotangent)
  np.testing.assert_array_equal(f32(out[:, :128]), f32(clean_out[:, :128]))
  np.testing.assert_array_equal(f32(dq[:, :128]), f32(clean_dq[:, :128]))
  if case == "window":
    hide_queries = lambda x: x.at[:, 192:].set(jnp.nan)
    _, (_, dk, dv) = fn(hide_queries(query), key, value, hide_queries(cotangent))
    np.testing.assert_array_equal(f32(dk[:, :128]), f32(clean_dk[:, :128]))
    np.testing.assert_array_equal(f32(dv[:, :128]), f32(clean_dv[:, :128]))


def test_default_block_sizes_follow_the_head_dim():
  assert pallas_mgpu.default_block_sizes_mgpu(64) == BlockSizes(64, 128, 64, 64)
  assert pallas_mgpu.default_block_sizes_mgpu(128) == BlockSizes(64, 128, 64, 64)
  assert pallas_mgpu.default_block_sizes_mgpu(256) == BlockSizes(64, 64, 64, 64)


@pytest.mark.parametrize("dtype, head_dim, value_dim, extra, match", [
    (jnp.float32, 64, 64, {}, "bfloat16 or float16 inputs, got float32"),
    (jnp.bfloat16, 80, 80, {}, "multiples of 64 up to 256, got 80"),
    (jnp.bfloat16, 320, 320, {}, "multiples of 64 up to 256, got 320"),
    (jnp.bfloat16, 64, 128, {}, "value head dim == head dim, got 128 != 64"),
    (jnp.bfloat16, 64, 64, dict(bias=True), "does not take bias"),
    (jnp.bfloat16, 64, 64, dict(segment_ids=True), "does not take segment ids"),
])
def test_rejects_what_it_does_not_take_by_name(dtype, head_dim, value_dim, extra, match):
  query, key, value = random_qkv(q_len=8, head_dim=head_dim, value_dim=value_dim, dtype=dtype)
  kwargs = {}
  if "bias" in extra:
    kwargs["bias"] = jnp.zeros((1, 1, 8, 8), dtype)
  if "segment_ids" in extra:
    kwargs["segment_ids"] = jnp.zeros((2, 8), jnp.int32)
  with pytest.raises(ValueError, match=match):
    pallas_mgpu.mgpu_dot_product_attention(query, key, value, **kwargs)


@pytest.mark.parametrize("blocks, match", [
    (BlockSizes(block_q=128, block_k=64), "block_q=64 .*got 128"),
    (BlockSizes(block_q=64, block_k=96), "block_k to be a multiple of 64 up to 256, got 96"),
    (BlockSizes(64, 64, block_q_dkv=48, block_k_dkv=64), "block_q_dkv to be a multiple .*48"),
    (BlockSizes(64, 64, block_q_dkv=64, block_k_dkv=128), "block_k_dkv=64 .*got 128"),
])
def test_rejects_block_sizes_it_cannot_tile(blocks, match):
  query, key, value = random_qkv(q_len=8, head_dim=64, dtype=jnp.bfloat16)
  with pytest.raises(ValueError, match=match):
    pallas_mgpu.mgpu_dot_product_attention(query, key, value, block_sizes=blocks)


def test_blocks_beyond_shared_memory_are_refused_by_name():
  """At head dim 256, key steps of 256 need 320 KiB for the forward: named, not miscompiled."""
  query, key, value = random_qkv(q_len=8, head_dim=256, dtype=jnp.bfloat16)
  with pytest.raises(ValueError, match="forward kernel needs .* bytes of shared memory at "
                                       "block_q=64, block_k=256"):
    pallas_mgpu.mgpu_dot_product_attention(query, key, value,
                                           block_sizes=BlockSizes(64, 256, 64, 64))


def test_registered_but_only_available_on_hopper():
  """Available on a Hopper GPU; elsewhere, asked for by name, the error names the backend."""
  query, key, value = random_qkv(q_len=8, head_dim=64, dtype=jnp.bfloat16)
  on_hopper = pallas_mgpu.is_hopper_or_newer()
  assert on_hopper == (jax.default_backend() == "gpu" and
                       float(jax.devices()[0].compute_capability) >= 9.0)
  assert ("pallas_mgpu" in attention_jax.available_implementations()) == on_hopper
  if on_hopper:
    out = attention_jax.dot_product_attention(query, key, value, implementation="pallas_mgpu")
    assert_close(out, attention_jax.dot_product_attention(query, key, value,
                                                          implementation="xla"),
                 rtol=2e-2, atol=2e-2)
  else:
    backend = jax.default_backend()
    with pytest.raises(ValueError,
                       match=f"'pallas_mgpu' is not available on backend '{backend}'"):
      attention_jax.dot_product_attention(query, key, value, implementation="pallas_mgpu")


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_lowers_for_cuda(head_dim):
  """The forward, dq and dk/dv kernels lower for CUDA without a GPU.

  Lowering runs Mosaic GPU's layout inference and wgmma/TMA checks; it does not
  compile to PTX or check shared-memory capacity.
  """
  query, key, value = random_qkv(batch=2, q_len=300, kv_len=520, num_heads=4, num_kv_heads=2,
                                 head_dim=head_dim, dtype=jnp.bfloat16)
  kwargs = dict(is_causal=True, local_window_size=(200, 0),
                key_value_seq_lengths=jnp.array([500, 3]))

  def loss(q, k, v):
    out = pallas_mgpu.mgpu_dot_product_attention(q, k, v, interpret=False, **kwargs)
    return jnp.sum(out.astype(jnp.float32))

  exported = export.export(jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))),
                           platforms=["cuda"])(query, key, value)
  module = exported.mlir_module()
  assert module.count("stablehlo.custom_call @mosaic_gpu") == 3
  # (Export would also refuse a Triton call, which needs an explicit opt-in.)
  assert "__gpu$xla.gpu.triton" not in module
