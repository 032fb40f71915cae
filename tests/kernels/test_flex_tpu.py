"""flex_attention on the Mosaic TPU kernels (implementation="pallas_tpu"), in interpret mode.

The kernels against the dense reference (implementation="xla"): outputs,
log-sum-exp and the gradients of q, k, v, the sinks and the arrays a
score_mod closes over, for a score_mod and mask_mod on the tile (ALiBi with
learned slopes under a causal mask; a learned relative-bias table under a
document block mask made per batch row under `jit`, so a traced layout; a
sliding window with soft-capping and sinks over grouped heads and Tq != Tk; a
data-dependent mask without a block mask, with causal, lengths and a bias);
the options the TPU kernels refuse; lowerings to Mosaic, where a mod reads
its arrays by head (SMEM, or one-hot sums at one offset) and not per position. Mosaic's blocks are large (queries a
multiple of 32, keys of 128) and TPU interpret mode simulates every grid step
one after another, so the shapes are small: two key blocks of 128, D = 16.
"""

import jax
from jax import export
import jax.numpy as jnp
import numpy as np
import pytest

import attention_jax as aj
from attention_jax.core import mods
from attention_jax.core.flex_inputs import prepare_flex_inputs
from attention_jax.core.inputs import prepare_inputs
from attention_jax.kernels import BlockSizes
from attention_jax.kernels.flash_attention import flex
from attention_testing import assert_close, outputs_and_grads, random_qkv

H, HKV, D = 4, 2, 16
BLOCKS = BlockSizes(64, 128)
SLOPES = np.asarray([0.5, 0.25, 0.125, 0.0625], np.float32)
SINKS = np.asarray([0.0, 1.5, -1.0, 3.0], np.float32)
_bucket = lambda distance: jnp.clip(distance, -4, 4) + 4


def _causal_alibi(slopes, sinks, q_len, kv_len):
  del sinks, q_len, kv_len
  return dict(score_mod=mods.alibi(slopes), mask_mod=mods.causal_mask)


def _document_block_mask_with_a_bias_table(table, sinks, q_len, kv_len):
  del sinks
  # Row 0: documents of 128 (its second key block is skipped by the first
  # query blocks); row 1: documents of 50 (partial blocks).
  docs = jnp.asarray(np.stack([np.arange(q_len) // 128, np.arange(q_len) // 50]), jnp.int32)
  block_mask = aj.create_block_mask(mods.document_mask(docs), 2, None, q_len, kv_len,
                                    (BLOCKS.block_q, BLOCKS.block_k))
  return dict(score_mod=mods.relative_bias(table, _bucket), block_mask=block_mask)


def _window_softcap_sinks(slopes, sinks, q_len, kv_len):
  del q_len, kv_len
  # The slopes scale the logits per head: a score_mod that multiplies them.
  return dict(score_mod=lambda s, b, h, q, k: s * (1.0 + slopes[h]),
              mask_mod=mods.sliding_window(40, 10), softcap=2.0, sinks=sinks)


def _data_dependent_mask_with_options(slopes, sinks, q_len, kv_len):
  # A mask that reads a closed-over int array and a bool array (no block mask:
  # every tile partial), a score_mod over an int array and the slopes, with
  # causal, lengths and a bias.
  band = jnp.asarray([3, 5, 8, 300], jnp.int32)
  keep_head = jnp.asarray([True, True, False, True])
  offsets = jnp.arange(2, dtype=jnp.int32) * 2
  mask_mod = lambda b, h, q, k: ((q - k <= band[h]) | ~keep_head[h]) & (k != q - 1)
  score_mod = lambda s, b, h, q, k: s - slopes[h] * jnp.abs(q - k + offsets[b]) * 0.1
  bias = jax.random.normal(jax.random.PRNGKey(11), (1, H, q_len, kv_len))
  return dict(score_mod=score_mod, mask_mod=mask_mod, sinks=sinks, is_causal=True, bias=bias,
              query_seq_lengths=jnp.asarray([q_len - 40, q_len]),
              key_value_seq_lengths=jnp.asarray([kv_len - 9, kv_len]))


# name: (options from (learned array, sinks, Tq, Tk), the learned array, B, Tq, Tk, Hkv)
CASES = {
    "causal_alibi": (_causal_alibi, SLOPES, 1, 160, 160, HKV),
    "document_block_mask": (_document_block_mask_with_a_bias_table,
                            np.asarray(jax.random.normal(jax.random.PRNGKey(4), (H, 9))),
                            2, 160, 160, H),
    "window_softcap_sinks": (_window_softcap_sinks, SLOPES, 1, 150, 200, 1),
    "data_dependent_mask": (_data_dependent_mask_with_options, SLOPES, 2, 100, 130, HKV),
}


def _attention(case, implementation, return_residual=False):
  options_of, _, _, q_len, kv_len, _ = CASES[case]

  def attention(query, key, value, learned, sinks):
    blocks = dict(block_sizes=BLOCKS) if implementation == "pallas_tpu" else {}
    return aj.flex_attention(query, key, value, implementation=implementation,
                             return_residual=return_residual, **blocks,
                             **options_of(learned, sinks, q_len, kv_len))

  return attention


def _arrays(case, seed):
  _, learned, batch, q_len, kv_len, num_kv_heads = CASES[case]
  query, key, value = random_qkv(seed, batch=batch, q_len=q_len, kv_len=kv_len, num_heads=H,
                                 num_kv_heads=num_kv_heads, head_dim=D)
  return query, key, value, jnp.asarray(learned), jnp.asarray(SINKS)


@pytest.mark.parametrize("case", list(CASES))
def test_mosaic_flex_equals_the_dense_path_outputs_lse_and_gradients(case):
  arrays = _arrays(case, seed=sorted(CASES).index(case))
  out, grads = outputs_and_grads(_attention(case, "pallas_tpu"), *arrays)
  want, want_grads = outputs_and_grads(_attention(case, "xla"), *arrays)
  assert_close(out, want, rtol=1e-4, atol=1e-5)
  names = ["query", "key", "value", "closed-over array", "sinks"]
  uses_sinks = "sinks" in CASES[case][0](arrays[3], arrays[4], *CASES[case][3:5])
  for name, got, expected in zip(names, grads, want_grads):
    if name != "sinks" or uses_sinks:  # a gradient that is there to check
      assert np.abs(np.asarray(expected)).max() > 1e-3, name
    assert_close(got, expected, rtol=1e-4, atol=2e-5, err_msg=name)
  (_, lse), (_, want_lse) = (jax.jit(_attention(case, impl, return_residual=True))(*arrays)
                             for impl in ("pallas_tpu", "xla"))
  assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)


def test_options_the_mosaic_kernels_refuse_raise_a_value_error():
  query, key, value = random_qkv(0, batch=1, q_len=40, kv_len=40, num_heads=H, head_dim=D)
  with pytest.raises(ValueError, match=r"normaliser='sigmoid' runs on implementation="
                                       r"'blockwise' or 'xla'"):
    aj.flex_attention(query, key, value, normaliser="sigmoid", implementation="pallas_tpu")
  # A block mask made with blocks Mosaic cannot take (queries: multiples of 32,
  # keys: of 128): refused as one made for other blocks than the kernel's.
  block_mask = aj.create_block_mask(mods.causal_mask, None, None, 40, 40, (16, 16))
  with pytest.raises(ValueError, match=r"block_mask has blocks \(16, 16\), but block_sizes="):
    aj.flex_attention(query, key, value, block_mask=block_mask, implementation="pallas_tpu")
  with pytest.raises(ValueError, match=r"multiple of 128 for the TPU kernel"):
    aj.flex_attention(query, key, value, mask_mod=mods.causal_mask, implementation="pallas_tpu",
                      block_sizes=BlockSizes(32, 32))


def _export_for_tpu(loss, *extra):
  qkv = jax.ShapeDtypeStruct((1, 256, H, 128), jnp.bfloat16)
  device = jax.sharding.AbstractDevice(device_kind="TPU v5e", num_cores=1, platform="tpu")
  with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",),
                                                                abstract_device=device)):
    return export.export(jax.jit(jax.grad(loss, argnums=tuple(range(3 + len(extra))))),
                         platforms=("tpu",))(qkv, qkv, qkv, *extra)


def _compiled_mosaic_loss(**flex_options):
  def loss(query, key, value, *arrays):
    inputs, _ = prepare_inputs(query, key, value, None, None)
    options = prepare_flex_inputs(inputs, **{
        name: option(*arrays) if callable(option) and name != "mask_mod" else option
        for name, option in flex_options.items()})
    out = flex.flex_pallas_tpu(inputs, options, BlockSizes(128, 128), interpret=False)
    return jnp.sum(out.astype(jnp.float32))
  return loss


def test_mods_that_read_their_arrays_by_head_lower_to_mosaic_for_tpu():
  """A static window, softcap, sinks and a score_mod over a closed-over scalar
  temperature and learned ALiBi slopes read by head (`slopes[h]`: an SMEM
  read or a one-hot sum at one offset, differentiated) lower to three Mosaic
  custom calls, forward and backward (they failed on `dynamic_slice` before
  the mods were walked on the tile)."""
  score_mod = lambda temperature, slopes, sinks: (
      lambda s, b, h, q, k: s * temperature + slopes[h] * (k - q))
  loss = _compiled_mosaic_loss(mask_mod=mods.sliding_window(40, 0), softcap=2.0,
                               sinks=lambda temperature, slopes, sinks: sinks,
                               score_mod=score_mod)
  scalar, per_head = (jax.ShapeDtypeStruct(shape, jnp.float32) for shape in ((), (H,)))
  exported = _export_for_tpu(loss, scalar, per_head, per_head)
  assert exported.mlir_module().count("tpu_custom_call") == 3


def test_a_mod_that_reads_its_arrays_per_position_is_refused_for_compiled_mosaic():
  # Document ids read at each query and key position are a gather, which
  # Mosaic cannot do (the interpreter can: the document cases above).
  docs = jnp.asarray(np.arange(256) // 100, jnp.int32)[None]
  loss = _compiled_mosaic_loss(mask_mod=mods.document_mask(docs))
  with pytest.raises(NotImplementedError, match=r"Mosaic TPU kernels read a mod's arrays at one "
                                                r"index per program .* of shape \(1, 256\) at a "
                                                r"tile of indices"):
    _export_for_tpu(loss)
