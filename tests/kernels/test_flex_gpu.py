"""flex_attention on the Triton kernels (implementation="pallas_gpu"), in interpret mode.

The kernels against the dense reference (implementation="xla"): outputs,
log-sum-exp and the gradients of q, k, v, the sinks and the arrays a
score_mod closes over, for a score_mod and mask_mod on the tile (ALiBi with
learned slopes under a causal mask; a learned relative-bias table under a
document block mask; a sliding window with soft-capping and sinks; a
data-dependent mask without a block mask, with the dot-product options),
grouped heads and odd lengths; a layout whose skipped blocks differ per batch
row; the options the Triton kernels refuse. Tiny shapes: the interpreter runs
every program of the grid one after another.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attention_jax as aj
from attention_jax import flex as flex_module
from attention_jax.core import mods, patterns
from attention_jax.kernels import BlockSizes
from attention_jax.kernels.flash_attention import flex as flex_kernels
from attention_testing import assert_close, outputs_and_grads, random_qkv

B, H, HKV, D = 2, 4, 2, 16
BLOCKS = BlockSizes(16, 16)
SLOPES = np.asarray([0.5, 0.25, 0.125, 0.0625], np.float32)
SINKS = np.asarray([0.0, 1.5, -1.0, 3.0], np.float32)
_bucket = lambda distance: jnp.clip(distance, -4, 4) + 4


def _documents(length):
  return jnp.asarray(np.stack([np.arange(length) // 10, np.arange(length) // 15]), jnp.int32)


def _causal_alibi(slopes, sinks, q_len, kv_len):
  del sinks, q_len, kv_len
  return dict(score_mod=mods.alibi(slopes), mask_mod=mods.causal_mask)


def _document_block_mask_with_a_bias_table(table, sinks, q_len, kv_len):
  del sinks
  docs = _documents(q_len)
  block_mask = aj.create_block_mask(mods.document_mask(docs), B, None, q_len, kv_len, (16, 16))
  return dict(score_mod=mods.relative_bias(table, _bucket), block_mask=block_mask)


def _window_softcap_sinks(slopes, sinks, q_len, kv_len):
  del q_len, kv_len
  # The slopes scale the logits per head: a score_mod that multiplies them.
  return dict(score_mod=lambda s, b, h, q, k: s * (1.0 + slopes[h]),
              mask_mod=mods.sliding_window(9, 3), softcap=2.0, sinks=sinks)


def _data_dependent_mask_with_options(slopes, sinks, q_len, kv_len):
  # A mask that reads a closed-over int array and a bool array (no block mask:
  # every tile partial), a score_mod over an int array and the slopes, with
  # causal, lengths and a bias.
  band = jnp.asarray([3, 5, 8, 30], jnp.int32)
  keep_head = jnp.asarray([True, True, False, True])
  offsets = jnp.arange(B, dtype=jnp.int32) * 2
  mask_mod = lambda b, h, q, k: ((q - k <= band[h]) | ~keep_head[h]) & (k != q - 1)
  score_mod = lambda s, b, h, q, k: s - slopes[h] * jnp.abs(q - k + offsets[b])
  bias = jax.random.normal(jax.random.PRNGKey(11), (1, H, q_len, kv_len))
  return dict(score_mod=score_mod, mask_mod=mask_mod, sinks=sinks, is_causal=True, bias=bias,
              query_seq_lengths=jnp.asarray([q_len - 4, q_len]),
              key_value_seq_lengths=jnp.asarray([kv_len - 9, kv_len]))


# name: (options from (learned array, sinks, Tq, Tk), the learned array, Tq, Tk, Hkv)
CASES = {
    "causal_alibi": (_causal_alibi, SLOPES, 37, 37, HKV),
    "document_block_mask": (_document_block_mask_with_a_bias_table,
                            np.asarray(jax.random.normal(jax.random.PRNGKey(4), (H, 9))),
                            40, 40, H),
    "window_softcap_sinks": (_window_softcap_sinks, SLOPES, 33, 40, 1),
    "data_dependent_mask": (_data_dependent_mask_with_options, SLOPES, 35, 33, HKV),
}


def _attention(case, implementation, return_residual=False):
  options_of, _, q_len, kv_len, _ = CASES[case]

  def attention(query, key, value, learned, sinks):
    blocks = dict(block_sizes=BLOCKS) if implementation == "pallas_gpu" else {}
    return aj.flex_attention(query, key, value, implementation=implementation,
                             return_residual=return_residual, **blocks,
                             **options_of(learned, sinks, q_len, kv_len))

  return attention


def _arrays(case, seed):
  _, learned, q_len, kv_len, num_kv_heads = CASES[case]
  query, key, value = random_qkv(seed, batch=B, q_len=q_len, kv_len=kv_len, num_heads=H,
                                 num_kv_heads=num_kv_heads, head_dim=D)
  return query, key, value, jnp.asarray(learned), jnp.asarray(SINKS)


@pytest.mark.parametrize("case", list(CASES))
def test_triton_flex_equals_the_dense_path_outputs_lse_and_gradients(case):
  arrays = _arrays(case, seed=sorted(CASES).index(case))
  out, grads = outputs_and_grads(_attention(case, "pallas_gpu"), *arrays)
  want, want_grads = outputs_and_grads(_attention(case, "xla"), *arrays)
  assert_close(out, want, rtol=1e-4, atol=1e-5)
  names = ["query", "key", "value", "closed-over array", "sinks"]
  uses_sinks = "sinks" in CASES[case][0](arrays[3], arrays[4], *CASES[case][2:4])
  for name, got, expected in zip(names, grads, want_grads):
    if name != "sinks" or uses_sinks:  # a gradient that is there to check
      assert np.abs(np.asarray(expected)).max() > 1e-3, name
    assert_close(got, expected, rtol=1e-4, atol=2e-5, err_msg=name)
  (_, lse), (_, want_lse) = (jax.jit(_attention(case, impl, return_residual=True))(*arrays)
                             for impl in ("pallas_gpu", "xla"))
  assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)


def test_each_batch_row_skips_its_own_blocks():
  # An all-allowed mask whose layout keeps only the diagonal blocks in batch
  # row 0 and every block in row 1: row 0 must get block-diagonal attention.
  length = 40
  query, key, value = random_qkv(5, batch=B, q_len=length, kv_len=length, num_heads=H,
                                 num_kv_heads=HKV, head_dim=D)
  everything = lambda b, h, q, k: q >= 0
  made = aj.create_block_mask(everything, B, None, length, length, 16)
  diagonal = np.where(np.eye(3, dtype=bool), patterns.FULL, patterns.SKIP)
  layout = np.stack([diagonal, np.full((3, 3), patterns.FULL)])[:, None].astype(np.int8)
  block_mask = aj.BlockMask(jnp.asarray(layout), made.lifted_mask_mod, made.mask_consts,
                            length, length, 16, 16)
  positions = np.arange(length) // 16
  allowed = np.stack([positions[:, None] == positions[None, :],
                      np.ones((length, length), bool)])[:, None]  # [B, 1, T, T]
  ours = lambda q, k, v: aj.flex_attention(q, k, v, block_mask=block_mask,
                                           implementation="pallas_gpu")
  dense = lambda q, k, v: aj.flex_attention(q, k, v, mask=jnp.asarray(allowed),
                                            implementation="xla")
  out, grads = outputs_and_grads(ours, query, key, value)
  want, want_grads = outputs_and_grads(dense, query, key, value)
  assert_close(out, want, rtol=1e-4, atol=1e-5)
  for got, expected in zip(grads, want_grads):
    assert_close(got, expected, rtol=1e-4, atol=2e-5)


def test_options_the_triton_kernels_refuse_raise_a_value_error():
  query, key, value = random_qkv(0, batch=B, q_len=20, kv_len=20, num_heads=H, head_dim=D)
  with pytest.raises(ValueError, match=r"normaliser='sigmoid' runs on implementation="
                                       r"'blockwise' or 'xla'"):
    aj.flex_attention(query, key, value, normaliser="sigmoid", implementation="pallas_gpu")
  with pytest.raises(ValueError, match=r"powers of two and at least 16"):
    aj.flex_attention(query, key, value, mask_mod=mods.causal_mask, implementation="pallas_gpu",
                      block_sizes=BlockSizes(8, 8))


@pytest.mark.parametrize("case", list(CASES))
def test_the_mods_lower_to_triton(case, monkeypatch):
  """Forward and backward lower with the Triton backend (no GPU needed): the
  mods' reads of their arrays (slopes[h], a bias table by head and distance,
  document ids by batch row and position) become loads at computed offsets,
  or one-hot sums where the dq kernel differentiates them. Triton's lowering
  has no gather or dynamic_slice (they failed on an H200 before)."""
  monkeypatch.setitem(flex_module.FLEX_IMPLEMENTATIONS, "pallas_gpu",
                      functools.partial(flex_kernels.flex_pallas_gpu, interpret=False))
  attention = _attention(case, "pallas_gpu")
  loss = lambda *arrays: jnp.sum(attention(*arrays).astype(jnp.float32))
  arrays = _arrays(case, seed=0)
  module = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4))).trace(*arrays).lower(
      lowering_platforms=("cuda",)).as_text()
  for kernel in ("flash_attention_forward", "flash_attention_dq", "flash_attention_dkv"):
    assert f'name = "{kernel}"' in module, kernel


def test_mods_the_triton_kernels_cannot_read_are_refused_by_name():
  query, key, value = random_qkv(0, batch=1, q_len=32, kv_len=32, num_heads=2, head_dim=D)
  table = jnp.arange(4.0)
  summed = lambda s, b, h, q, k: s + jnp.sum(table)  # a reduction over the array
  with pytest.raises(NotImplementedError, match=r"`reduce_sum` changes its operands' shape "
                                                r"\[\(4,\)\] -> \[\(\)\]"):
    aj.flex_attention(query, key, value, score_mod=summed, implementation="pallas_gpu")
  big = jnp.zeros((2, 2048))
  per_position = lambda s, b, h, q, k: s + big[h, k]
  aj.flex_attention(query, key, value, score_mod=per_position, implementation="pallas_gpu")
  with pytest.raises(ValueError, match=r"at most 1024; got one of shape \(2, 2048\)"):
    jax.grad(lambda q: aj.flex_attention(q, key, value, score_mod=per_position,
                                         implementation="pallas_gpu").sum())(query)
