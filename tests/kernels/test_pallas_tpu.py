"""The Pallas TPU flash-attention kernels, run in TPU interpret mode, against the reference.

TPU interpret mode simulates Mosaic's memory model on CPU (VMEM scratch starts
as NaN, outputs are written back block by block), so these tests check the
kernels' logic; `test_lowers_to_mosaic_for_tpu` checks that they also lower
through Mosaic. The default grid is small because the interpreter is slow; the
full sweep is marked `slow`. The block-schedule tests read the module's private
grid helpers.
"""
# pylint: disable=protected-access

import itertools

import jax
from jax import export
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from attention_jax.core import patterns, reach_of, reference_attention
from attention_jax.kernels.flash_attention import BlockSizes, block_sparse, common, pallas_tpu
from attention_jax.variants.dense import prepare_inputs
from attention_testing import (MASK_CASES, assert_close, check_against_reference, jit_call,
                               loop_mask, random_qkv)

BF16_TOL = dict(rtol=2e-2, atol=2e-2)


_pallas = pallas_tpu.tpu_dot_product_attention


# ---------------------------------------------------------------------------
# The shared parity grid (Tq = 7, Tk = 9: shorter than one block, so padded).

# In CI each of these mask cases runs once, with K/V heads and bias+mask alternating (window,
# causal_window and kv_lengths also run in the multi-block tests); the full cross is slow.
_CI_CASES = ["causal", "everything", "plain", "q_lengths", "segments", "window_pair"]
_CI_PARITY = {(case, (4, 1)[n % 2], n % 3 != 1) for n, case in enumerate(_CI_CASES)}
_PARITY_GRID = [
    pytest.param(case, kv_heads, extra, marks=() if (case, kv_heads, extra) in _CI_PARITY
                 else pytest.mark.slow)
    for case, kv_heads, extra in itertools.product(sorted(MASK_CASES), [4, 1], [False, True])]


@pytest.mark.parity("flash")
@pytest.mark.parametrize("case, num_kv_heads, with_bias_and_mask", _PARITY_GRID)
def test_matches_reference_outputs_and_gradients(case, num_kv_heads, with_bias_and_mask):
  check_against_reference(_pallas, case, num_kv_heads, with_bias_and_mask)


@pytest.mark.parity("flash")
@pytest.mark.parametrize("case", [
    "everything",
    *(pytest.param(case, marks=pytest.mark.slow) for case in sorted(MASK_CASES)
      if case != "everything")])
def test_bfloat16_matches_reference(case):
  check_against_reference(_pallas, case, 2, True, dtype=jnp.bfloat16, **BF16_TOL)


# ---------------------------------------------------------------------------
# Sequences spanning several blocks: Tq = 300, Tk = 260 with 128-blocks (64/256 for dk/dv).

LONG_B, LONG_TQ, LONG_TK, LONG_H, LONG_HKV = 2, 300, 260, 2, 1
LONG_BLOCKS = BlockSizes(block_q=128, block_k=128, block_q_dkv=64, block_k_dkv=256)


def _packed_segments():
  """Segment ids whose ranges make some block pairs disjoint (skipped), and whose batch 1
  has a query segment (9) with no keys: fully masked rows."""
  q_ids = np.array([[0] * 100 + [1] * 120 + [2] * 80,
                    [0] * 40 + [9] * 60 + [1] * 200])
  kv_ids = np.array([[0] * 90 + [1] * 100 + [2] * 70,
                     [0] * 130 + [1] * 130])
  return q_ids, kv_ids


_Q_IDS, _KV_IDS = _packed_segments()
_LONG_Q_LENGTHS, _LONG_KV_LENGTHS = np.array([300, 100]), np.array([90, 260])

# name -> (dot_product_attention kwargs, loop_mask kwargs, bias shape, with a random mask)
LONG_CASES = {
    "causal": (dict(is_causal=True), dict(is_causal=True), (1, LONG_H, LONG_TQ, LONG_TK), False),
    "window": (dict(local_window_size=(40, 10)), dict(window=(40, 10)),
               (LONG_B, 1, 1, LONG_TK), False),
    "segments": (dict(segment_ids=(jnp.array(_Q_IDS), jnp.array(_KV_IDS))),
                 dict(q_segments=_Q_IDS, kv_segments=_KV_IDS), (LONG_B, 1, LONG_TQ, 1), False),
    "lengths": (dict(query_seq_lengths=jnp.array(_LONG_Q_LENGTHS),
                     key_value_seq_lengths=jnp.array(_LONG_KV_LENGTHS)),
                dict(q_lengths=_LONG_Q_LENGTHS, kv_lengths=_LONG_KV_LENGTHS), None, True),
    "everything": (dict(is_causal=True, local_window_size=(150, 0),
                        query_seq_lengths=jnp.array(_LONG_Q_LENGTHS),
                        key_value_seq_lengths=jnp.array(_LONG_KV_LENGTHS),
                        segment_ids=(jnp.array(_Q_IDS), jnp.array(_KV_IDS))),
                   dict(is_causal=True, window=(150, 0), q_lengths=_LONG_Q_LENGTHS,
                        kv_lengths=_LONG_KV_LENGTHS, q_segments=_Q_IDS, kv_segments=_KV_IDS),
                   (1, LONG_H, LONG_TQ, LONG_TK), True),
}


def _outputs_and_grads(fn, query, key, value, bias):
  """fn(q, k, v, bias) and the gradients of a fixed random projection of it (jitted)."""
  cotangent = jax.random.normal(jax.random.PRNGKey(7), query.shape[:3] + value.shape[-1:])

  def loss(*args):
    out = fn(*args)
    return jnp.sum(out.astype(jnp.float32) * cotangent), out

  argnums = (0, 1, 2) if bias is None else (0, 1, 2, 3)
  grad_fn = jax.value_and_grad(loss, argnums=argnums, has_aux=True)
  (_, out), grads = jax.jit(grad_fn)(query, key, value, bias)
  return out, grads


def _check_long_case(case, dtype, tol):
  kwargs, mask_args, bias_shape, with_mask = LONG_CASES[case]
  rng = np.random.default_rng(3)
  query, key, value = random_qkv(batch=LONG_B, q_len=LONG_TQ, kv_len=LONG_TK, num_heads=LONG_H,
                                 num_kv_heads=LONG_HKV, head_dim=64, value_dim=32, dtype=dtype)
  bias = None if bias_shape is None else jnp.array(rng.normal(size=bias_shape), dtype)
  allowed = loop_mask(LONG_B, LONG_TQ, LONG_TK, **mask_args)
  mask = None
  if with_mask:
    mask = rng.random((LONG_B, 1, LONG_TQ, LONG_TK)) > 0.1
    allowed &= mask
    mask = jnp.array(mask)
  # A random order of the parallel grid axes checks that they really are independent.
  interpret = pltpu.InterpretParams(random_seed=11)
  ours = lambda q, k, v, b: _pallas(q, k, v, b, mask, scale=0.2, block_sizes=LONG_BLOCKS,
                                    interpret=interpret, **kwargs)
  oracle = lambda q, k, v, b: reference_attention(q, k, v, b, jnp.array(allowed), scale=0.2)
  out, grads = _outputs_and_grads(ours, query, key, value, bias)
  expected_out, expected_grads = _outputs_and_grads(oracle, query, key, value, bias)
  assert out.dtype == dtype
  assert_close(out, expected_out, **tol)
  for name, got, want in zip("qkvb", grads, expected_grads):
    assert got.dtype == dtype and got.shape == want.shape
    assert_close(got, want, err_msg=f"gradient of {name}", **tol)


@pytest.mark.parity("flash")
@pytest.mark.parametrize("case", [
    "causal", "everything", "segments", "window",
    pytest.param("lengths", marks=pytest.mark.slow)])  # "everything" has lengths too
def test_several_blocks_match_reference(case):
  _check_long_case(case, jnp.float32, dict(rtol=1e-5, atol=1e-5))


@pytest.mark.parity("flash")
@pytest.mark.parametrize("case", [
    "window",  # its bias [B, 1, 1, Tk] has a gradient summed over 600 rows: float32 sums
    *(pytest.param(case, marks=pytest.mark.slow) for case in sorted(LONG_CASES)
      if case != "window")])
def test_several_blocks_bfloat16_match_reference(case):
  _check_long_case(case, jnp.bfloat16, BF16_TOL)


# ---------------------------------------------------------------------------
# Fully masked rows, head dims, API details.


def test_fully_masked_rows_give_zeros_and_zero_gradients():
  """Batch 0 has no valid keys at all; in batch 1 the mask leaves query row 3 nothing and
  queries past their length (5) are padding."""
  batch, q_len, kv_len, heads = 2, 40, 150, 2
  query, key, value = random_qkv(batch=batch, q_len=q_len, kv_len=kv_len, num_heads=heads)
  mask = np.ones((batch, 1, q_len, kv_len), bool)
  mask[1, 0, 3] = False
  bias = jnp.array(np.random.default_rng(0).normal(size=(batch, heads, q_len, kv_len)),
                   jnp.float32)
  kwargs = dict(key_value_seq_lengths=jnp.array([0, 150]),
                query_seq_lengths=jnp.array([40, 5]), is_causal=True)
  blocks = BlockSizes(block_q=32, block_k=128)
  ours = lambda q, k, v, b: _pallas(q, k, v, b, jnp.array(mask), block_sizes=blocks, **kwargs)
  out, (d_query, d_key, d_value, d_bias) = _outputs_and_grads(ours, query, key, value, bias)

  empty = np.zeros((batch, q_len), bool)
  empty[0] = True
  empty[1, 3] = True
  empty[1, 5:] = True
  for name, x in zip(("out", "dq", "dk", "dv", "dbias"), (out, d_query, d_key, d_value, d_bias)):
    assert np.all(np.isfinite(np.asarray(x))), name
  np.testing.assert_array_equal(np.asarray(out)[empty], 0.0)
  np.testing.assert_array_equal(np.asarray(d_query)[empty], 0.0)
  np.testing.assert_array_equal(np.asarray(d_bias).transpose(0, 2, 1, 3)[empty], 0.0)
  np.testing.assert_array_equal(np.asarray(d_key)[0], 0.0)  # batch 0 attends no key
  np.testing.assert_array_equal(np.asarray(d_value)[0], 0.0)
  assert np.abs(np.asarray(out)[~empty]).min() > 0.0  # the other rows did attend


@pytest.mark.parametrize("q_len, q_lengths", [(65, None), (33, [10])])
def test_query_blocks_the_forward_skips_pass_no_nan_to_key_gradients(q_len, q_lengths):
  """Issue #36: with block_q_dkv (64) > block_q (32) the dk/dv pass visits, beside
  valid rows, the rows of a forward query block wholly past the valid queries
  (the padding of Tq = 65 up to 128, or queries past a length of 10), whose lse
  is EMPTY_ROW_LSE while their logits are not masked: dk and dv were NaN."""
  query, key, value = random_qkv(batch=1, q_len=q_len, kv_len=1, num_heads=1, head_dim=1)
  kwargs = {} if q_lengths is None else dict(query_seq_lengths=jnp.array(q_lengths))
  allowed = jnp.array(loop_mask(1, q_len, 1, q_lengths=q_lengths))
  blocks = BlockSizes(block_q=32, block_k=128, block_q_dkv=64, block_k_dkv=128)
  ours = lambda q, k, v, b: _pallas(q, k, v, block_sizes=blocks, **kwargs)
  oracle = lambda q, k, v, b: reference_attention(q, k, v, mask=allowed)
  out, grads = _outputs_and_grads(ours, query, key, value, None)
  expected_out, expected_grads = _outputs_and_grads(oracle, query, key, value, None)
  assert_close(out, expected_out)
  for name, got, want in zip("qkv", grads, expected_grads):
    assert_close(got, want, err_msg=f"gradient of {name}")


def test_block_sparse_query_blocks_past_the_length_pass_no_nan_to_key_gradients():
  """The same hazard through the block-sparse lists (one block size for both
  passes): the dk/dv pass follows the layout, which ignores query lengths, into
  the query block (32..63) that the forward skipped as past the length 10."""
  query, key, value = random_qkv(batch=1, q_len=64, kv_len=1, num_heads=1, head_dim=1)
  q_lengths = jnp.array([10])
  allowed = jnp.array(loop_mask(1, 64, 1, q_lengths=[10]))

  def ours(q, k, v, b):
    inputs, _ = prepare_inputs(q, k, v, query_seq_lengths=q_lengths)
    return block_sparse.block_sparse_attention(
        inputs, patterns.Band(64, 64), implementation="pallas_tpu", block_sizes=BlockSizes(32, 128))

  oracle = lambda q, k, v, b: reference_attention(q, k, v, mask=allowed)
  out, grads = _outputs_and_grads(ours, query, key, value, None)
  expected_out, expected_grads = _outputs_and_grads(oracle, query, key, value, None)
  assert_close(out, expected_out)
  for name, got, want in zip("qkv", grads, expected_grads):
    assert_close(got, want, err_msg=f"gradient of {name}")


@pytest.mark.parametrize("head_dim", [32, 64, 80, 96, 128, 256])
def test_head_dims_match_reference(head_dim):
  """Forward for every head dim; gradients too for 80 (not a lane multiple) and 256."""
  query, key, value = random_qkv(batch=1, q_len=40, kv_len=150, num_heads=2, head_dim=head_dim)
  kv_lengths = jnp.array([140])
  allowed = jnp.array(loop_mask(1, 40, 150, is_causal=True, kv_lengths=[140]))
  blocks = BlockSizes(block_q=32, block_k=128)  # 2 x 2 blocks
  ours = lambda q, k, v, b: _pallas(q, k, v, is_causal=True, key_value_seq_lengths=kv_lengths,
                                    block_sizes=blocks)
  oracle = lambda q, k, v, b: reference_attention(q, k, v, mask=allowed)
  if head_dim in (80, 256):
    out, grads = _outputs_and_grads(ours, query, key, value, None)
    expected_out, expected_grads = _outputs_and_grads(oracle, query, key, value, None)
    for name, got, want in zip("qkv", grads, expected_grads):
      assert_close(got, want, err_msg=f"gradient of {name}")
  else:
    out = jax.jit(ours)(query, key, value, None)
    expected_out = oracle(query, key, value, None)
  assert out.shape == (1, 40, 2, head_dim)
  assert_close(out, expected_out)


def test_unbatched_inputs_and_default_block_sizes():
  query, key, value = random_qkv(batch=1, q_len=20, kv_len=30, num_heads=2, num_kv_heads=1)
  unbatched = _pallas(query[0], key[0], value[0], is_causal=True)
  expected = reference_attention(query, key, value,
                                 mask=jnp.array(loop_mask(1, 20, 30, is_causal=True)))
  assert unbatched.shape == expected.shape[1:]
  assert_close(unbatched, expected[0])


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_default_block_sizes_follow_the_block_rule(head_dim, dtype):
  blocks = pallas_tpu.default_block_sizes_tpu(head_dim, dtype)
  for block_q in (blocks.block_q, blocks.dkv[0]):
    assert block_q % pallas_tpu.QUERY_BLOCK_MULTIPLE == 0 and block_q >= 128
  for block_k in (blocks.block_k, blocks.dkv[1]):
    assert block_k % pallas_tpu.KEY_BLOCK_MULTIPLE == 0


def test_interpret_mode_is_the_default_off_tpu():
  assert jax.default_backend() != "tpu"
  assert isinstance(pallas_tpu._interpret_mode(None), pltpu.InterpretParams)
  assert pallas_tpu._interpret_mode(False) is False


# ---------------------------------------------------------------------------
# Bad input.


@pytest.mark.parametrize("shapes, dtypes, blocks, message", [
    (((8, 264), (8, 264), (8, 264)), None, None,
     "head dims up to 256, got query/key head dim 264"),
    (((8, 64), (8, 64), (8, 320)), None, None, "value head dim 320"),
    (None, (jnp.float16,) * 3, None, "float32 and bfloat16 inputs, got query of dtype float16"),
    (None, (jnp.float32, jnp.bfloat16, jnp.float32), None, "share one dtype"),
    (None, None, BlockSizes(block_q=48, block_k=128),
     "BlockSizes.block_q must be a multiple of 32"),
    (None, None, BlockSizes(block_q=64, block_k=64),
     "BlockSizes.block_k must be a multiple of 128"),
    (None, None, BlockSizes(block_q=64, block_k=128, block_q_dkv=100),
     "BlockSizes.block_q_dkv must be a multiple of 32"),
    (None, None, BlockSizes(block_q=64, block_k=128, block_k_dkv=200),
     "BlockSizes.block_k_dkv must be a multiple of 128"),
])
def test_unsupported_inputs_raise(shapes, dtypes, blocks, message):
  shapes = shapes or ((8, 64),) * 3
  dtypes = dtypes or (jnp.float32,) * 3
  query, key, value = (jnp.zeros((1, length, 2, dim), dtype)
                       for (length, dim), dtype in zip(shapes, dtypes))
  with pytest.raises(ValueError, match=message):
    _pallas(query, key, value, block_sizes=blocks)
  inputs, _ = prepare_inputs(query, key, value)
  assert message.split(",")[0] in pallas_tpu.tpu_rejects(inputs, blocks)


def test_supported_inputs_have_no_reason_to_reject():
  inputs, _ = prepare_inputs(*random_qkv(head_dim=256, dtype=jnp.bfloat16))
  assert pallas_tpu.tpu_rejects(inputs) is None
  assert pallas_tpu.tpu_rejects(inputs, LONG_BLOCKS) is None


# ---------------------------------------------------------------------------
# Block skipping: which blocks each grid step visits.


def _visits(coords, moving):
  """(batch, q block, kv block) of the fresh steps, checking the schedule on the way.

  coords: `_Coords` of arrays `[B, outer blocks, steps]`; moving: the field that the
  steps walk along ("kv_block" or "q_block").
  """
  fresh = set()
  batch, outer, steps = coords.fresh.shape
  for b, row in itertools.product(range(batch), range(outer)):
    # Along the last (arbitrary) axis the visited block never moves back, and once the
    # band is done it stays put: those steps issue no new DMA.
    visited = getattr(coords, moving)[b, row]
    assert np.all(np.diff(visited) >= 0)
    done = ~coords.fresh[b, row]
    assert np.all(np.diff(visited)[done[1:]] == 0)
    assert np.all(np.diff(coords.fresh[b, row].astype(int)) <= 0)  # fresh steps come first
    for s in range(steps):
      if coords.fresh[b, row, s]:
        pair = (coords.q_block[b, row, s], coords.kv_block[b, row, s])
        fresh.add((b,) + tuple(int(x) for x in pair))
  return fresh


def _needed_blocks(allowed, block_q, block_k):
  """(batch, q block, kv block) of the blocks holding at least one allowed pair."""
  batch, _, q_len, kv_len = allowed.shape
  return {(b, i, j) for b in range(batch)
          for i, j in itertools.product(range(q_len // block_q), range(kv_len // block_k))
          if allowed[b, 0, i * block_q:(i + 1) * block_q, j * block_k:(j + 1) * block_k].any()}


@pytest.mark.parametrize("reach_args, with_lengths", [
    ((False, None), False), ((True, None), True), ((False, (3, 1)), True),
    ((True, (5, 2)), False), ((False, (0, 6)), True)])
@pytest.mark.parametrize("blocks", [(4, 4), (2, 8), (8, 2)])
def test_grid_steps_visit_the_blocks_with_allowed_pairs(reach_args, with_lengths, blocks):
  is_causal, window = reach_args
  block_q, block_k = blocks
  q_len, kv_len = 24, 40
  # Lengths on block boundaries make the skipping exact; within a block it may visit more.
  q_lengths = np.array([24, 8]) if with_lengths else np.array([24, 24])
  kv_lengths = np.array([0, 16]) if with_lengths else np.array([40, 40])
  allowed = loop_mask(2, q_len, kv_len, is_causal=is_causal, window=window,
                      q_lengths=q_lengths, kv_lengths=kv_lengths)
  needed = _needed_blocks(allowed, block_q, block_k)
  cfg = pallas_tpu._Static(
      block_q=block_q, block_k=block_k, block_q_dkv=block_q, block_k_dkv=block_k, q_len=q_len,
      kv_len=kv_len, group=1, scale=1.0, reach=reach_of(is_causal, window), interpret=False)
  num_q_blocks, num_kv_blocks = q_len // block_q, kv_len // block_k
  lengths = jnp.array(q_lengths), jnp.array(kv_lengths)

  grid, _, coords_of = pallas_tpu._query_major_grid(cfg, 2, 1, block_q, block_k)
  b, i, s = np.meshgrid(np.arange(2), np.arange(num_q_blocks), np.arange(grid[-1]), indexing="ij")
  by_query = jit_call(coords_of, jnp.array(b), 0, jnp.array(i), jnp.array(s), *lengths)
  assert _visits(jax.tree.map(np.asarray, by_query), "kv_block") == needed

  steps = pallas_tpu._band_steps(num_kv_blocks, lambda j: common.q_block_range(
      j, block_q, block_k, num_q_blocks, cfg.reach))
  b, j, t = np.meshgrid(np.arange(2), np.arange(num_kv_blocks), np.arange(steps), indexing="ij")
  by_key = jit_call(pallas_tpu._key_major_coords, cfg, block_q, block_k, jnp.array(b), 0,
                    jnp.array(j), 0, jnp.array(t), *lengths)
  assert _visits(jax.tree.map(np.asarray, by_key), "q_block") == needed

  if window is not None:  # a band narrower than the sequence shortens the grid itself
    assert grid[-1] < num_kv_blocks and steps < num_q_blocks


# ---------------------------------------------------------------------------
# Mosaic lowering (no TPU needed: the kernels are lowered, not compiled).


@pytest.mark.parametrize("dtype, head_dim", [(jnp.float32, 80), (jnp.bfloat16, 256)])
def test_lowers_to_mosaic_for_tpu(dtype, head_dim):
  """Forward and backward, with every feature, lower to three Mosaic TPU custom calls."""
  batch, q_len, kv_len, heads, kv_heads = 2, 300, 260, 4, 2
  ids = lambda length: jnp.zeros((batch, length), jnp.int32)

  def loss(q, k, v, bias):
    out = _pallas(q, k, v, bias, jnp.ones((batch, 1, q_len, kv_len), bool), is_causal=True,
                  local_window_size=(100, 0), segment_ids=(ids(q_len), ids(kv_len)),
                  query_seq_lengths=jnp.array([300, 100]),
                  key_value_seq_lengths=jnp.array([200, 260]), block_sizes=LONG_BLOCKS,
                  interpret=False)
    return jnp.sum(out.astype(jnp.float32))

  shapes = [(batch, q_len, heads, head_dim), (batch, kv_len, kv_heads, head_dim),
            (batch, kv_len, kv_heads, head_dim), (1, heads, q_len, kv_len)]
  args = [jax.ShapeDtypeStruct(shape, dtype) for shape in shapes]
  # Mosaic lowering asks for the TPU generation; name one instead of the CPU device.
  device = jax.sharding.AbstractDevice(device_kind="TPU v5e", num_cores=1, platform="tpu")
  with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",),
                                                                abstract_device=device)):
    exported = export.export(jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))),
                                 platforms=("tpu",))(*args)
  assert exported.mlir_module().count("tpu_custom_call") == 3
