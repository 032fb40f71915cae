"""Sparse attention patterns against the dense reference under the same pattern.

Each pattern is written here a second time, pair by pair from its definition
(`_pattern_mask`), and the dense `reference_attention` under that boolean mask
is the oracle for outputs and q/k/v gradients, of the pure-JAX forms and of
the block-sparse kernel (`implementation="blockwise"`), whose visited blocks
are counted against the blocks that hold an allowed pair.
"""

import functools
import itertools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_jax import registry
from attention_jax.core import patterns, reference_attention
from attention_jax.kernels.flash_attention import block_sparse, blockwise
from attention_jax.kernels.flash_attention.common import BlockSizes
from attention_jax.layers.attention import MultiHeadAttention
from attention_jax.variants import common, dense
from attention_jax.variants.sparse.factorized import (axial_attention, axial_shape, fixed_attention,
                                                      strided_attention)
from attention_jax.variants.sparse.global_window import (global_tokens_attention,
                                                         longformer_attention)
from attention_jax.variants.sparse.kernel import KERNEL_IMPLEMENTATIONS
from attention_jax.variants.sparse.random_patterns import (bigbird_attention, bigbird_candidates,
                                                           bigbird_random_blocks, pattern_key,
                                                           random_attention, random_indices)
from attention_jax.variants.sparse.windows import (block_local_attention, dilated_attention,
                                                   local_attention)
from attention_testing import assert_close, jit_init, outputs_and_grads, random_qkv

B, H = 2, 4
Q_LENGTHS = np.array([13, 19])
KV_LENGTHS = np.array([11, 19])


def _pattern_mask(length, allowed, *, q_lengths=None, kv_lengths=None, segments=None):
  """`[B, 1, T, T]` bool: `allowed(b, i, j)` and padding and segments, pair by pair."""
  mask = np.zeros((B, 1, length, length), bool)
  for b, i, j in itertools.product(range(B), range(length), range(length)):
    ok = allowed(b, i, j)
    if q_lengths is not None:
      ok = ok and i < q_lengths[b] and j < kv_lengths[b]
    if segments is not None:
      ok = ok and segments[b][i] == segments[b][j]
    mask[b, 0, i, j] = ok
  return mask


def _per_head_mask(length, allowed, **masks):
  """`[B, H, T, T]`: `_pattern_mask` of `allowed(h, b, i, j)` for each head h."""
  return np.concatenate([_pattern_mask(length, functools.partial(allowed, h), **masks)
                         for h in range(H)], axis=1)


def _assert_parity(attention_fn, allowed, *, length, num_kv_heads=H, logits_below_zero=False,
                   batch=B, **kwargs):
  """attention_fn(q, k, v, **kwargs) equals the reference under `allowed`, with gradients.

  logits_below_zero: q and k pulled apart along one direction, so that every
  logit is about -50 (a softmax does not change; exp of the logits underflows).
  The gradients then scale with |q| and |k| (~12): the tolerance with them.
  """
  tolerance = dict(rtol=1e-4, atol=2e-4) if logits_below_zero else {}
  query, key, value = random_qkv(seed=3, batch=batch, q_len=length, num_heads=H,
                                 num_kv_heads=num_kv_heads, head_dim=8, value_dim=6)
  if logits_below_zero:
    direction = jnp.zeros(8).at[0].set(12.0)
    query, key = query - direction, key + direction
  ours = jax.jit(lambda q, k, v: outputs_and_grads(
      lambda *a: attention_fn(*a, **kwargs), q, k, v))(query, key, value)
  theirs = _reference_outputs_and_grads(query, key, value, jnp.asarray(allowed))
  # Every query must see something for the comparison to say anything.
  assert allowed.any(-1).sum() > 0
  for name, got, want in zip(("out", "dq", "dk", "dv"), (ours[0], *ours[1]),
                             (theirs[0], *theirs[1])):
    assert_close(got, want, err_msg=name, **tolerance)


@jax.jit
def _reference_outputs_and_grads(query, key, value, allowed):
  """The dense reference under `allowed`, one program per shape: the mask is an
  argument, not a constant, so the tests of one shape share it."""
  return outputs_and_grads(lambda q, k, v: reference_attention(q, k, v, None, allowed),
                           query, key, value)


def _padding_args(length):
  """Keyword arguments for queries/keys padding and packed segments, and the same for the mask."""
  segments = np.array([[0] * 9 + [1] * (length - 9), [0] * 4 + [1] * (length - 4)])
  call = dict(query_seq_lengths=jnp.array(Q_LENGTHS), key_value_seq_lengths=jnp.array(KV_LENGTHS),
              segment_ids=jnp.array(segments))
  masks = dict(q_lengths=Q_LENGTHS, kv_lengths=KV_LENGTHS, segments=segments)
  return call, masks


# The patterns, written from their definitions: (b, i, j) -> may query i see key j.
def _local(w, causal):
  return lambda b, i, j: (i - w <= j <= i) if causal else abs(i - j) <= w


def _block(size, causal):
  return lambda b, i, j: i // size == j // size and (j <= i or not causal)


def _dilated(w, d, causal):
  return lambda b, i, j: (i - j) % d == 0 and abs(i - j) <= d * w and (j <= i or not causal)


T = 19  # not a multiple of any block size below: internal padding is exercised
KERNEL_BLOCK = 4  # the block-sparse kernel's blocks: 5 along T


@pytest.fixture
def kernel_blocks_of_4(monkeypatch):
  """The block-sparse kernel in blocks of 4: its default 128 would make T one
  block, with nothing to skip. (BigBird's kernel blocks are its own.)"""
  monkeypatch.setattr(block_sparse, "default_block_sizes",
                      lambda: BlockSizes(KERNEL_BLOCK, KERNEL_BLOCK))


@pytest.mark.parity("local")
@pytest.mark.parity("band")
@pytest.mark.parametrize("window,causal", [(1, True), (4, False), (19, True)])
def test_local_matches_dense_window(causal, window):
  _assert_parity(local_attention, _pattern_mask(T, _local(window, causal)), length=T,
                 is_causal=causal, window_size=window)


@pytest.mark.parity("local")
def test_local_matches_dense_attention_with_local_window_size():
  """The same band, as dot_product_attention's own window, with grouped K/V heads."""
  import attention_jax  # pylint: disable=import-outside-toplevel
  query, key, value = random_qkv(seed=5, batch=B, q_len=T, num_heads=H, num_kv_heads=2)
  ours = jax.jit(functools.partial(local_attention, window_size=3))(query, key, value)
  theirs = attention_jax.dot_product_attention(query, key, value, local_window_size=(3, 3),
                                               implementation="xla")
  assert_close(ours, theirs)
  assert registry.get_variant("band").fn is registry.get_variant("local").fn


@pytest.mark.parity("block_local")
@pytest.mark.parametrize("size,causal", [(1, False), (5, True), (19, False)])
def test_block_local_matches_dense_block_diagonal(causal, size):
  _assert_parity(block_local_attention, _pattern_mask(T, _block(size, causal)), length=T,
                 is_causal=causal, block_size=size)


@pytest.mark.parity("dilated")
@pytest.mark.parametrize("window,dilation,causal", [(2, 3, False), (3, 2, True), (5, 1, True)])
def test_dilated_matches_dense_dilated_band(causal, window, dilation):
  _assert_parity(dilated_attention, _pattern_mask(T, _dilated(window, dilation, causal)),
                 length=T, is_causal=causal, window_size=window, dilation=dilation)


def _strided_local(l, causal):
  return lambda b, i, j: abs(i - j) < l and (j <= i or not causal)


def _strided_strided(l, causal):
  return lambda b, i, j: (i - j) % l == 0 and (j <= i or not causal)


def _fixed_summary(l, c, causal):
  return lambda b, i, j: j % l >= l - c and (j <= i or not causal)


def _union(*patterns):
  return lambda b, i, j: any(p(b, i, j) for p in patterns)


def _per_head(first, second):
  """`[B, H, T, T]`: the first half of the heads under `first`, the rest under `second`."""
  return np.concatenate([np.repeat(first, H // 2, axis=1), np.repeat(second, H - H // 2, axis=1)],
                        axis=1)


STRIDE, SUMMARY = 5, 2
FACTORIZED = {
    "strided": (strided_attention, dict(),
                lambda c: _strided_local(STRIDE, c), lambda c: _strided_strided(STRIDE, c)),
    "fixed": (fixed_attention, dict(num_summary=SUMMARY),
              lambda c: _block(STRIDE, c), lambda c: _fixed_summary(STRIDE, SUMMARY, c)),
}


@pytest.mark.parity("strided")
@pytest.mark.parity("fixed")
@pytest.mark.parametrize("implementation", [None, "blockwise"])
@pytest.mark.parametrize("name", sorted(FACTORIZED))
@pytest.mark.parametrize("combine,choice,causal", [
    ("merged", {}, False), ("merged", {}, True),
    ("interleaved", dict(layer_index=2), False), ("interleaved", dict(layer_index=3), True),
    ("per_head", {}, True)])
def test_sparse_transformer_patterns_match_dense(name, combine, choice, causal, implementation,
                                                 kernel_blocks_of_4):
  fn, options, first, second = FACTORIZED[name]
  first, second = _pattern_mask(T, first(causal)), _pattern_mask(T, second(causal))
  if combine == "merged":
    allowed = first | second
  elif combine == "interleaved":
    allowed = first if choice["layer_index"] % 2 == 0 else second
  else:
    allowed = _per_head(first, second)
  _assert_parity(fn, allowed, length=T, is_causal=causal, stride=STRIDE, combine=combine,
                 implementation=implementation, **choice, **options)


@pytest.mark.parity("strided")
@pytest.mark.parity("fixed")
@pytest.mark.parametrize("name,pattern", [("strided", "strided"), ("fixed", "block")])
def test_interleaved_pattern_by_name(name, pattern):
  fn, options, first, second = FACTORIZED[name]
  allowed = _pattern_mask(T, (first if pattern in ("local", "block") else second)(False))
  _assert_parity(fn, allowed, length=T, stride=STRIDE, combine="interleaved", pattern=pattern,
                 **options)


def _global_window(g, w, causal, d=1):
  def allowed(b, i, j):
    in_window = (i - j) % d == 0 and abs(i - j) <= d * w
    return (i < g or j < g or in_window) and (j <= i or not causal)
  return allowed


@pytest.mark.parity("global_tokens")
@pytest.mark.parametrize("causal", [False, True])
def test_global_tokens_match_dense(causal):
  _assert_parity(global_tokens_attention, _pattern_mask(T, _global_window(3, 2, causal)),
                 length=T, is_causal=causal, num_global=3, window_size=2)


@pytest.mark.parity("longformer")
@pytest.mark.parametrize("implementation", [None, "blockwise"])
@pytest.mark.parametrize("causal", [False, True])
def test_longformer_matches_dense_with_dilated_heads(causal, implementation, kernel_blocks_of_4):
  plain = _pattern_mask(T, _global_window(2, 3, causal))
  dilated = _pattern_mask(T, _global_window(2, 3, causal, d=2))
  _assert_parity(longformer_attention, _per_head(plain, dilated), length=T,
                 is_causal=causal, num_global=2, window_size=3, dilation=2, dilated_heads=H // 2,
                 implementation=implementation)


@pytest.mark.parity("longformer")
@pytest.mark.parametrize("causal", [False, True])
def test_longformer_window_longer_than_the_sequence_is_full_attention(causal):
  # The release preset's 512-key window on a sequence shorter than it.
  everything = _pattern_mask(T, lambda b, i, j: j <= i or not causal)
  _assert_parity(longformer_attention, everything, length=T, is_causal=causal,
                 num_global=0, window_size=256, left_window_size=255, dilated_heads=0)


def _random_pattern(indices, w, causal):
  """(h, b, i, j) -> allowed: head h's drawn keys `indices[h, i]`, or the window."""
  indices = np.asarray(indices)
  def allowed(h, b, i, j):
    near = w is not None and abs(i - j) <= w
    return (j in indices[h, i] or near) and (j <= i or not causal)
  return allowed


@pytest.mark.parity("random")
@pytest.mark.parametrize("causal,window", [(False, None), (True, 2), (False, 3)])
def test_random_matches_dense_under_the_drawn_keys(causal, window):
  rng = jax.random.PRNGKey(4)
  indices = random_indices(rng, H, T, 5, causal)
  _assert_parity(random_attention,
                 _per_head_mask(T, _random_pattern(indices, window, causal)),
                 length=T, is_causal=causal, rng=rng, num_random=5, window_size=window)


@pytest.mark.parity("random")
@pytest.mark.parametrize("causal,window", [(False, None), (True, 2)])
def test_random_on_flex_matches_dense_under_the_drawn_keys(causal, window):
  rng = jax.random.PRNGKey(4)
  indices = random_indices(rng, H, T, 5, causal)
  _assert_parity(random_attention,
                 _per_head_mask(T, _random_pattern(indices, window, causal)),
                 length=T, is_causal=causal, rng=rng, num_random=5, window_size=window,
                 implementation="blockwise")


def test_random_on_flex_refuses_a_bias_and_a_pairwise_mask_as_its_pure_form_does():
  """The flex path took a dense [B, H, T, T] bias and a pairwise [B, 1, T, T]
  mask that the pure form (and every sparse variant's kernel path) refuses:
  a T x T input to a variant registered sub-quadratic, and a pattern other
  than the drawn one."""
  query, key, value = random_qkv(q_len=T, num_heads=2)
  fn = functools.partial(random_attention, rng=jax.random.PRNGKey(0), num_random=4,
                         implementation="blockwise")
  with pytest.raises(ValueError, match="does not support bias"):
    fn(query, key, value, jnp.zeros((1, 2, T, T)))
  with pytest.raises(ValueError, match="key-padding mask"):
    fn(query, key, value, None, jnp.ones((1, 1, T, T), bool))
  with pytest.raises(ValueError, match=r"query length \(19\).*key/value length \(7\)"):
    fn(query, key[:, :7], value[:, :7])


def test_random_draws_are_in_range_causal_and_vary_by_head():
  for causal in (False, True):
    indices = np.asarray(random_indices(jax.random.PRNGKey(0), 2, 64, 8, causal))
    assert indices.shape == (2, 64, 8) and indices.min() >= 0 and indices.max() < 64
    if causal:
      assert np.all(indices <= np.arange(64)[:, None])
    assert len({tuple(row) for row in np.sort(indices[0], axis=1)}) > 32
    assert np.any(indices[0] != indices[1])
  other = random_indices(jax.random.PRNGKey(1), 2, 64, 8, False)
  assert np.any(np.asarray(other) != indices)


def _bigbird_pattern(block, global_blocks, blocks, causal):
  """(h, b, i, j) -> allowed, from the definition: a global query or key
  block, the window of blocks, or one of head h's drawn blocks."""
  blocks = np.asarray(blocks)
  def allowed(h, b, i, j):
    qb, kb = i // block, j // block
    ok = qb in global_blocks or kb in global_blocks or abs(qb - kb) <= 1 or kb in blocks[h, qb]
    return ok and (j <= i or not causal)
  return allowed


def _bigbird_drawn(rng, num_blocks, r, causal, **options):
  candidates = bigbird_candidates(num_blocks, is_causal=causal, **options)
  return np.asarray(bigbird_random_blocks(rng, H, candidates, r))


@pytest.mark.parity("bigbird")
@pytest.mark.parametrize("implementation", [None, "blockwise"])
@pytest.mark.parametrize("causal,last_global", [(False, True), (True, True), (False, False)])
def test_bigbird_matches_dense_block_mask(causal, last_global, implementation):
  rng, block, length = jax.random.PRNGKey(2), 3, 26  # 9 blocks, the last one partial
  drawn = _bigbird_drawn(rng, 9, 2, causal, last_block_global=last_global)
  global_blocks = (0, 8) if last_global else (0,)
  _assert_parity(bigbird_attention,
                 _per_head_mask(length, _bigbird_pattern(block, global_blocks, drawn, causal)),
                 length=length, is_causal=causal, rng=rng, block_size=block,
                 num_global_blocks=1, last_block_global=last_global, num_random_blocks=2,
                 implementation=implementation)


@pytest.mark.parity("bigbird")
@pytest.mark.parity("global_tokens")
@pytest.mark.parametrize("name", ["bigbird", "global_tokens"])
def test_parts_with_every_logit_far_below_zero_keep_exact_gradients(name):
  # Causal queries before a later part's keys see an empty part. Its maximum
  # (-inf) once entered the common one as 0, so with every logit near -50 the
  # normaliser underflowed and the gradient came out NaN (the recall table's
  # diverged bigbird and global_tokens runs at T = 64).
  if name == "bigbird":
    rng, block, length = jax.random.PRNGKey(2), 3, 26
    drawn = _bigbird_drawn(rng, 9, 2, True, last_block_global=True)
    _assert_parity(bigbird_attention,
                   _per_head_mask(length, _bigbird_pattern(block, (0, 8), drawn, True)),
                   length=length, is_causal=True, rng=rng, block_size=block,
                   num_global_blocks=1, last_block_global=True, num_random_blocks=2,
                   logits_below_zero=True)
  else:
    _assert_parity(global_tokens_attention, _pattern_mask(T, _global_window(3, 2, True)),
                   length=T, is_causal=True, num_global=3, window_size=2,
                   logits_below_zero=True)


@pytest.mark.parametrize("causal", [False, True])
def test_bigbird_draws_exactly_r_distinct_blocks_outside_window_and_globals(causal):
  num_blocks, r, global_blocks = 16, 3, {0, 1, 15}
  drawn = _bigbird_drawn(jax.random.PRNGKey(0), num_blocks, r, causal, num_global_blocks=2)
  assert drawn.shape == (H, num_blocks, r)
  for h, n in itertools.product(range(H), range(num_blocks)):
    # Written from the definition: outside the window and the globals (and before n - 1).
    possible = [k for k in range(num_blocks) if abs(k - n) > 1 and k not in global_blocks
                and (k < n or not causal)]
    if n in global_blocks:
      possible = []
    row = drawn[h, n]
    kept = row[row >= 0]
    assert len(kept) == min(r, len(possible)), (h, n, row)
    assert len(set(kept)) == len(kept) and set(kept) <= set(possible), (h, n, row)
    assert np.all(row[len(kept):] == -1)
  # Heads draw their own blocks.
  assert all(np.any(drawn[0] != drawn[h]) for h in range(1, H))


def test_bigbird_draws_uniformly_among_the_candidates():
  # Query block 5 of 12, r = 2 among the 7 candidates (1..3, 7..10 with globals 0, 11):
  # each is drawn with probability 2/7.
  candidates = bigbird_candidates(12)
  draws = np.asarray(jax.vmap(lambda k: bigbird_random_blocks(k, 1, candidates, 2))(
      jax.random.split(jax.random.PRNGKey(3), 4000)))[:, 0, 5]
  counts = np.bincount(draws.ravel(), minlength=12) / len(draws)
  expected = np.zeros(12)
  expected[[1, 2, 3, 7, 8, 9, 10]] = 2 / 7
  np.testing.assert_allclose(counts, expected, atol=0.03)


# name -> (function, options, pattern) for the padding, segments and GQA checks.
PADDED_CASES = {
    "local": (local_attention, dict(window_size=3), _local(3, False)),
    "block_local": (block_local_attention, dict(block_size=4), _block(4, False)),
    "dilated": (dilated_attention, dict(window_size=2, dilation=2),
                _dilated(2, 2, False)),
    "strided": (strided_attention, dict(stride=4),
                _union(_strided_local(4, False), _strided_strided(4, False))),
    "fixed": (fixed_attention, dict(stride=4, num_summary=1),
              _union(_block(4, False), _fixed_summary(4, 1, False))),
    "global_tokens": (global_tokens_attention, dict(num_global=2, window_size=2),
                      _global_window(2, 2, False)),
    "longformer": (longformer_attention, dict(num_global=2, window_size=2,
                                              dilated_heads=0), _global_window(2, 2, False)),
    "local_release_strided": (local_attention,
                              dict(pattern="release_strided", block_size=4),
                              lambda b, i, j: i % 5 == j % 5),  # T' = 20, 5 groups of 4
    "fixed_release": (fixed_attention,
                      dict(stride=4, num_summary=1, summary_at_block_start=True,
                           causal_pattern=True, num_global=1),
                      lambda b, i, j: i == 0 or j == 0 or (
                          j <= i and ((i - 1) // 4 == (j - 1) // 4 or (j - 1) % 4 in (0, 3)))),
    "longformer_left": (longformer_attention,
                        dict(window_size=2, left_window_size=3, dilated_heads=0, num_global=0),
                        lambda b, i, j: -3 <= j - i <= 2),
    # Per head: (h, b, i, j) -> allowed.
    "random": (random_attention, dict(rng=jax.random.PRNGKey(3), num_random=4),
               _random_pattern(random_indices(jax.random.PRNGKey(3), H, T, 4, False),
                               None, False)),
    "bigbird": (bigbird_attention, dict(rng=jax.random.PRNGKey(3), block_size=3,
                                        num_random_blocks=1),  # 7 blocks, 0 and 6 global
                _bigbird_pattern(3, (0, 6), _bigbird_drawn(jax.random.PRNGKey(3), 7, 1, False),
                                 False)),
}
PER_HEAD = ("random", "bigbird")


@pytest.mark.parametrize("name", sorted(PADDED_CASES))
def test_padding_segments_and_grouped_heads_match_dense(name):
  fn, options, pattern = PADDED_CASES[name]
  call, masks = _padding_args(T)
  mask = (_per_head_mask if name in PER_HEAD else _pattern_mask)(T, pattern, **masks)
  _assert_parity(fn, mask, length=T, num_kv_heads=2, **call, **options)


@pytest.mark.parametrize("name", sorted(PADDED_CASES))
def test_padded_keys_do_not_change_valid_queries_and_padded_queries_are_zero(name):
  fn, options, _ = PADDED_CASES[name]
  fn = jax.jit(functools.partial(fn, **options))
  query, key, value = random_qkv(seed=1, batch=B, q_len=T, num_heads=2)
  lengths = jnp.array([12, T])
  out = fn(query, key, value, key_value_seq_lengths=lengths, query_seq_lengths=lengths)
  garbage = jnp.where(jnp.arange(T)[None, :, None, None] >= 12, 1e3, 0.0)
  again = fn(query, key + garbage, value - garbage, key_value_seq_lengths=lengths,
             query_seq_lengths=lengths)
  assert_close(out[0, :12], again[0, :12])
  assert np.all(np.asarray(out[0, 12:]) == 0.0)
  # A key-padding mask is the same as the lengths.
  key_mask = (jnp.arange(T)[None, :] < lengths[:, None])[:, None, None, :]
  with_mask = fn(query, key, value, mask=key_mask, query_seq_lengths=lengths)
  assert_close(with_mask, out)


KERNEL_CASES = sorted(set(PADDED_CASES) - {"random"})  # random draws keys, not blocks


@pytest.mark.parametrize("name", KERNEL_CASES)
def test_block_sparse_kernel_with_padding_segments_and_grouped_heads_matches_dense(
    name, kernel_blocks_of_4):
  fn, options, pattern = PADDED_CASES[name]
  call, masks = _padding_args(T)
  mask = (_per_head_mask if name in PER_HEAD else _pattern_mask)(T, pattern, **masks)
  _assert_parity(fn, mask, length=T, num_kv_heads=2, implementation="blockwise", **call,
                 **options)


def _blocks_with_a_pair(allowed: np.ndarray, block: int) -> np.ndarray:
  """`[H|1, T, T]` bool -> `[H|1, nq, nk]`: whether each block holds an allowed pair."""
  padded_len = -(-allowed.shape[-1] // block) * block
  pad = padded_len - allowed.shape[-1]
  allowed = np.pad(allowed, [(0, 0), (0, pad), (0, pad)])
  n = padded_len // block
  return allowed.reshape(-1, n, block, n, block).any(axis=(2, 4))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name", KERNEL_CASES)
def test_block_sparse_kernel_visits_exactly_the_blocks_with_an_allowed_pair(
    name, causal, kernel_blocks_of_4, monkeypatch):
  fn, options, pattern = PADDED_CASES[name]
  layouts = []
  attend = blockwise.flex_attend  # the flex engine's loops run every pattern
  def recording_attend(cfg, operands, masks):
    layouts.append(np.asarray(masks.block_layout[0]))  # [1, H|1, nq, nk]: one layout
    return attend(cfg, operands, masks)
  monkeypatch.setattr(blockwise, "flex_attend", recording_attend)
  query, key, value = random_qkv(batch=1, q_len=T, num_heads=H)
  fn(query, key, value, is_causal=causal, implementation="blockwise", **options)
  (layout,) = layouts
  if name == "bigbird":  # drawn among the blocks before the query's when causal
    pattern = _bigbird_pattern(3, (0, 6), _bigbird_drawn(jax.random.PRNGKey(3), 7, 1, causal),
                               causal)
  mask = (_per_head_mask if name in PER_HEAD else _pattern_mask)(T, pattern)[0]  # [H|1, T, T]
  if causal:
    mask = mask & np.tril(np.ones((T, T), bool))
  block = options["block_size"] if name == "bigbird" else KERNEL_BLOCK
  expected = _blocks_with_a_pair(mask, block)
  visited = layout != patterns.SKIP
  np.testing.assert_array_equal(np.broadcast_to(visited, expected.shape), expected)
  # The loops visit each block some head needs, once.
  order, count = blockwise._visit_lists(blockwise._Masks(  # pylint: disable=protected-access
      None, None, None, None, None, block_layout=jnp.asarray(layout)[None]), transpose=False)
  assert int(count.sum()) == int(expected.any(0).sum())
  assert all(set(np.asarray(order[i, :count[i]])) == set(np.flatnonzero(expected.any(0)[i]))
             for i in range(expected.shape[1]))
  # A block is FULL exactly when every pair in it (inside T) is allowed.
  full = layout == patterns.FULL
  every = _blocks_with_a_pair(~mask, block)  # some pair not allowed
  inside = _blocks_with_a_pair(np.ones_like(mask), block)
  np.testing.assert_array_equal(np.broadcast_to(full, expected.shape), inside & ~every)


def test_block_sparse_kernel_refuses_other_implementations_and_bad_layouts():
  query, key, value = random_qkv(q_len=T, num_heads=2)
  inputs, _ = dense.prepare_inputs(query, key, value)
  with pytest.raises(ValueError, match=r"implementation must be None \(the pure-JAX form\) or "
                                       r"one of \('blockwise', 'pallas_gpu', 'pallas_tpu'\), "
                                       r"got 'pallas'"):
    local_attention(query, key, value, window_size=2, implementation="pallas")
  with pytest.raises(ValueError, match=r"extra_blocks must have shape \[H, nq, r\] = "
                                       r"\[2, 5, r\], got \[2, 4, 1\]"):
    block_sparse.block_sparse_attention(inputs, patterns.Band(1, 1),
                                        block_sizes=BlockSizes(4, 4),
                                        extra_blocks=jnp.zeros((2, 4, 1), jnp.int32))
  with pytest.raises(ValueError, match=r"block_layout must have shape \[H\|1, nq, nk\] = "
                                       r"\[2\|1, 5, 5\], got \[3, 5, 5\]"):
    block_sparse.check_layout(jnp.zeros((3, 5, 5), jnp.int8), 2, 5, 5)
  with pytest.raises(ValueError, match="one block size for both passes"):
    block_sparse.block_sparse_attention(inputs, patterns.Band(1, 1),
                                        block_sizes=BlockSizes(4, 4, block_q_dkv=8))


def test_the_variants_know_every_block_sparse_kernel():
  assert KERNEL_IMPLEMENTATIONS == block_sparse.IMPLEMENTATIONS


def _kernel_cases(length, *, window, block, stride, summary, longformer_window,
                  bigbird_block):
  """name -> (function, options, causal -> `[B|1, H|1, T, T]` mask pair by pair):
  every sparse pattern at sizes that span several of a kernel's blocks."""
  mask = lambda allowed: _pattern_mask(length, allowed)
  bigbird_blocks = -(-length // bigbird_block)

  def bigbird_mask(causal):
    drawn = _bigbird_drawn(jax.random.PRNGKey(3), bigbird_blocks, 1, causal)
    return _per_head_mask(length, _bigbird_pattern(bigbird_block, (0, bigbird_blocks - 1),
                                                   drawn, causal))

  return {
      "local": (local_attention, dict(window_size=window),
                lambda c: mask(_local(window, c))),
      "block_local": (block_local_attention, dict(block_size=block),
                      lambda c: mask(_block(block, c))),
      "dilated": (dilated_attention, dict(window_size=window // 2, dilation=3),
                  lambda c: mask(_dilated(window // 2, 3, c))),
      "strided_per_head": (strided_attention, dict(stride=stride, combine="per_head"),
                           lambda c: _per_head(mask(_strided_local(stride, c)),
                                               mask(_strided_strided(stride, c)))),
      "fixed": (fixed_attention, dict(stride=stride, num_summary=summary),
                lambda c: mask(_union(_block(stride, c), _fixed_summary(stride, summary, c)))),
      "longformer": (longformer_attention,
                     dict(num_global=2, window_size=longformer_window, dilation=3,
                          dilated_heads=H // 2),
                     lambda c: _per_head(mask(_global_window(2, longformer_window, c)),
                                         mask(_global_window(2, longformer_window, c, d=3)))),
      "bigbird": (bigbird_attention, dict(rng=jax.random.PRNGKey(3),
                                          block_size=bigbird_block, num_random_blocks=1),
                  bigbird_mask),
  }


# implementation -> (T, the kernel's blocks, the cases). The Triton kernels take
# blocks of 16 at least: T = 64 in 4 blocks. The Mosaic TPU kernels take query
# blocks of 32 and key blocks of 128 (the lane width): T = 320 in 10 x 3 blocks.
# Each program follows its own head's blocks; GQA and per-head patterns included.
ACCELERATOR_KERNELS = {
    "pallas_gpu": (64, BlockSizes(16, 16), _kernel_cases(
        64, window=9, block=24, stride=8, summary=2, longformer_window=5, bigbird_block=16)),
    "pallas_tpu": (320, BlockSizes(32, 128), _kernel_cases(
        320, window=60, block=96, stride=40, summary=4, longformer_window=20,
        bigbird_block=128)),
}
# Triton: every pattern, causal and not. TPU (its interpreter takes 25-50 s a
# case here): three patterns that between them reach each path of its kernel
# (one layout for all heads and one per head, causal and not, blocks skipped,
# partial and full, GQA), since the layouts come from the code the Triton
# cases check for every pattern.
ACCELERATOR_CASES = (
    [("pallas_gpu", name, causal) for name in sorted(ACCELERATOR_KERNELS["pallas_gpu"][2])
     for causal in (False, True)]
    + [("pallas_tpu", name, causal) for name, causal in [
        ("dilated", False), ("strided_per_head", True), ("bigbird", True)]])


@pytest.mark.parametrize("implementation,name,causal", ACCELERATOR_CASES)
def test_block_sparse_accelerator_kernels_match_dense(implementation, name, causal,
                                                       monkeypatch):
  length, blocks, cases = ACCELERATOR_KERNELS[implementation]
  monkeypatch.setattr(block_sparse, "default_block_sizes", lambda: blocks)
  fn, options, mask = cases[name]
  # The TPU interpreter's time grows with the grid: one example of the batch
  # (the patterns are the same for every example).
  batch = 1 if implementation == "pallas_tpu" else B
  _assert_parity(fn, mask(causal)[:batch], length=length, num_kv_heads=2, is_causal=causal,
                 implementation=implementation, batch=batch, **options)


BAD_SIZES = [
    ("local", dict(window_size=0), "window_size must be an int >= 1"),
    ("local", dict(window_size=20), "window_size=20 must be at most the sequence length 19"),
    ("local", dict(pattern="strided"), "pattern must be one of \\('sliding', 'release_strided'\\), "
                                       "got 'strided'"),
    ("local", dict(block_size=4), "block_size applies to pattern='release_strided' only"),
    ("local", dict(pattern="release_strided"), "needs block_size"),
    ("local", dict(pattern="release_strided", block_size=20), "block_size=20 must be at most"),
    ("block_local", dict(block_size=2.5), "block_size must be an int"),
    ("block_local", dict(block_size=40), "block_size=40 must be at most"),
    ("dilated", dict(window_size=2, dilation=0), "dilation must be an int >= 1"),
    ("dilated", dict(window_size=30), "window_size=30 must be at most"),
    ("strided", dict(stride=0), "stride must be an int >= 1"),
    ("strided", dict(stride=20), "stride=20 must be at most the sequence length 19"),
    ("strided", dict(combine="sum"), "combine must be one of"),
    ("strided", dict(combine="interleaved"), "needs exactly one of layer_index"),
    ("strided", dict(combine="interleaved", pattern="block"), "pattern must be one of"),
    ("strided", dict(layer_index=1), "only with combine='interleaved'"),
    ("fixed", dict(stride=4, num_summary=5), "num_summary=5 must be at most stride=4"),
    ("fixed", dict(num_global=19), "num_global=19 must be at most the sequence length - 1=18"),
    ("longformer", dict(window_size=2, left_window_size=-1),
     "left_window_size must be an int >= 0, got -1"),
    ("global_tokens", dict(num_global=0), "num_global must be an int >= 1"),
    ("global_tokens", dict(num_global=20), "num_global=20 must be at most"),
    ("longformer", dict(window_size=2, dilated_heads=3),
     "dilated_heads=3 must be at most num_heads=2"),
    ("random", dict(), "draws its pattern from rng"),
    ("random", dict(rng=jax.random.PRNGKey(0), num_random=20), "num_random=20 must be at most"),
    ("bigbird", dict(rng=jax.random.PRNGKey(0)), "block_size=64 must be at most"),
    ("bigbird", dict(rng=jax.random.PRNGKey(0), block_size=4, num_global_blocks=6),
     "num_global_blocks=6 must be at most the number of blocks=5"),
    ("bigbird", dict(rng=jax.random.PRNGKey(0), block_size=4, block_padding="release"),
     "block_padding must be one of \\('minimal', 'lra_release'\\), got 'release'"),
    ("bigbird", dict(rng=jax.random.PRNGKey(0), block_size=4, random_candidates="paper"),
     "random_candidates must be one of \\('exact', 'lra_release'\\), got 'paper'"),
    ("bigbird", dict(rng=jax.random.PRNGKey(0), block_size=4, random_blocks_within=3),
     "random_blocks_within must be an int >= 4, got 3"),
    # lra_release padding: 19 // 4 + 1 = 5 blocks; 20 would need 6.
    ("bigbird", dict(rng=jax.random.PRNGKey(0), block_size=4, block_padding="lra_release",
                     num_random_blocks=6), "num_random_blocks=6 must be at most the number of "
                                           "blocks=5"),
    ("axial", dict(), "length 19 has no factorisation"),
    ("axial", dict(shape=(4, 5)), "rows \\* cols equal to the sequence length 19"),
]


def test_per_head_needs_two_heads():
  query, key, value = random_qkv(q_len=T, num_heads=1)
  with pytest.raises(ValueError, match="at least 2 heads"):
    strided_attention(query, key, value, combine="per_head")


@pytest.mark.parametrize("name,options,message", BAD_SIZES)
def test_bad_sizes_name_the_argument_and_the_constraint(name, options, message):
  query, key, value = random_qkv(q_len=T, num_heads=2)
  with pytest.raises(ValueError, match=message):
    registry.get_variant(name).fn(query, key, value, **options)


MODULE_OPTIONS = {
    "local": dict(window_size=8),
    "band": dict(window_size=8),
    "block_local": dict(block_size=8),
    "dilated": dict(window_size=4, dilation=3),
    "strided": dict(combine="per_head"),
    "fixed": dict(stride=8, num_summary=2),
    "global_tokens": dict(num_global=2, window_size=4),
    "longformer": dict(window_size=4, dilation=2, num_global=1),
    "random": dict(num_random=4, window_size=2),
    "bigbird": dict(block_size=4, num_random_blocks=2),
    "axial": dict(shape=(5, 8)),
}


@pytest.mark.parametrize("name", sorted(MODULE_OPTIONS))
def test_refuses_cross_attention_bias_and_pairwise_masks(name):
  fn = functools.partial(registry.get_variant(name).fn, **MODULE_OPTIONS[name])
  if registry.get_variant(name).extras is not None:
    fn = functools.partial(fn, rng=jax.random.PRNGKey(0))
  query, key, value = random_qkv(q_len=40, kv_len=12, num_heads=2)
  with pytest.raises(ValueError, match=r"query length \(40\).*key/value length \(12\)"):
    fn(query, key, value)
  query, key, value = random_qkv(q_len=40, num_heads=2)
  with pytest.raises(ValueError, match="bias"):
    fn(query, key, value, jnp.zeros((1, 2, 40, 40)))
  with pytest.raises(ValueError, match="key-padding mask"):
    fn(query, key, value, None, jnp.ones((1, 1, 40, 40), bool))


@pytest.mark.parametrize("name", sorted(MODULE_OPTIONS))
def test_refuses_lengths_that_are_not_integer_b_arrays(name):
  """Float lengths were taken as thresholds (3.5 let key 3 through, where
  dot_product_attention refuses them); a [B, 1] length broadcast to [B, B]."""
  fn = functools.partial(registry.get_variant(name).fn, **MODULE_OPTIONS[name])
  if registry.get_variant(name).extras is not None:
    fn = functools.partial(fn, rng=jax.random.PRNGKey(0))
  query, key, value = random_qkv(batch=2, q_len=40, num_heads=2)
  # Traced only (eval_shape): the refusals are made while tracing, and the
  # query lengths' only after the whole attention, which eagerly compiles op by op.
  trace = lambda **lengths: jax.eval_shape(lambda q, k, v: fn(q, k, v, **lengths),
                                           query, key, value)
  with pytest.raises(ValueError, match=r"key_value_seq_lengths must be an integer array of "
                                       r"shape \[B\] = \[2\], got float32 \[2\]"):
    trace(key_value_seq_lengths=jnp.array([35.5, 40.0]))
  with pytest.raises(ValueError, match=r"query_seq_lengths must be an integer array of "
                                       r"shape \[B\] = \[2\], got int32 \[2, 1\]"):
    trace(query_seq_lengths=jnp.array([[35], [40]]))


# Every registered variant runs by name in MultiHeadAttention under jit
# (test_every_variant.py); here with its options, GQA, a padding mask and causal.
@pytest.mark.parametrize("name", ["local", "longformer", "axial"])
def test_runs_in_multi_head_attention_under_jit(name):
  x = jax.random.normal(jax.random.PRNGKey(0), (2, 40, 16))
  layer = MultiHeadAttention(num_heads=4, num_kv_heads=2, attention=name,
                             attention_options=MODULE_OPTIONS[name])
  variables = jit_init(layer, jax.random.PRNGKey(1), x)
  key_mask = (jnp.arange(40)[None, :] < jnp.array([30, 40])[:, None])[:, None, None, :]
  apply = jax.jit(lambda v, x, m: layer.apply(v, x, mask=m, is_causal=True))
  out = apply(variables, x, key_mask)
  assert out.shape == x.shape and np.isfinite(np.asarray(out)).all()
  # Causal: a change at the end does not reach the start.
  changed = apply(variables, x.at[:, 30:].add(1.0), key_mask)
  assert_close(out[:, :30], changed[:, :30])


class TwoLayers(nn.Module):
  """Two attention layers of `variant`, as an encoder stacks them (own names)."""

  variant: str
  options: dict

  @nn.compact
  def __call__(self, x, deterministic=True):
    for i in range(2):
      x = MultiHeadAttention(num_heads=H, attention=self.variant, attention_options=self.options,
                             name=f"layer_{i}")(x, deterministic=deterministic)
    return x


def _kept_keys(variables):
  """The layers' kept pattern keys, in layer order, from the "random" collection."""
  kept = variables[common.RANDOM_COLLECTION]
  return [pattern_key(kept[f"layer_{i}"]["variant"]["pattern_key"]) for i in range(2)]


@pytest.mark.parametrize("name", ["random", "bigbird"])
def test_pattern_is_kept_per_layer_and_never_redrawn(name):
  x = jax.random.normal(jax.random.PRNGKey(0), (1, 40, 16))
  model = TwoLayers(name, MODULE_OPTIONS[name])
  variables = jax.jit(model.init)(jax.random.PRNGKey(1), x)
  first, second = _kept_keys(variables)
  if name == "random":
    patterns = [random_indices(k, H, 40, 4, False) for k in (first, second)]
  else:
    candidates = bigbird_candidates(10)
    patterns = [bigbird_random_blocks(k, H, candidates, 2) for k in (first, second)]
  assert np.any(np.asarray(patterns[0]) != np.asarray(patterns[1]))  # per layer
  assert all(np.any(np.asarray(p[0]) != np.asarray(p[h])) for p in patterns
             for h in range(1, H))  # per head
  # Training steps with different attention streams keep the pattern (redraw_every=0),
  # so training and evaluation agree.
  train = jax.jit(lambda v, rng: model.apply(v, x, False, rngs={"attention": rng},
                                             mutable=[common.RANDOM_COLLECTION]))
  evaluated = jax.jit(model.apply)(variables, x)
  for seed in (5, 6):
    out, updates = train(variables, jax.random.PRNGKey(seed))
    assert_close(out, evaluated)
    np.testing.assert_array_equal(
        np.asarray(jax.random.key_data(_kept_keys(updates)[0])),
        np.asarray(jax.random.key_data(first)))


@pytest.mark.parametrize("name", ["random", "bigbird"])
def test_layer_uses_the_kept_pattern_as_dense_attention_under_its_mask(name):
  """MultiHeadAttention with the variant equals it with dot_product attention
  (the same parameters) under the mask of the pattern drawn from the kept key."""
  length = 24
  x = jax.random.normal(jax.random.PRNGKey(0), (2, length, 16))
  options = dict(num_random=3) if name == "random" else dict(block_size=4, num_random_blocks=1)
  layer = MultiHeadAttention(num_heads=H, attention=name, attention_options=options)
  variables = jax.jit(layer.init)(jax.random.PRNGKey(1), x)
  rng = pattern_key(variables[common.RANDOM_COLLECTION]["variant"]["pattern_key"])
  if name == "random":
    pattern = _random_pattern(random_indices(rng, H, length, 3, False), None, False)
  else:  # 6 blocks, 0 and 5 global
    drawn = np.asarray(bigbird_random_blocks(rng, H, bigbird_candidates(6), 1))
    pattern = _bigbird_pattern(4, (0, 5), drawn, False)
  mask = jnp.asarray(_per_head_mask(length, pattern))
  dense = MultiHeadAttention(num_heads=H, attention="dot_product")
  want = jax.jit(dense.apply)({"params": variables["params"]}, x, mask=mask)
  assert_close(jax.jit(layer.apply)(variables, x), want)


# Axial attention: two dense passes composed; each is checked against the
# dense reference under the row (or column) mask.


def _same_row(cols):
  return lambda b, i, j: i // cols == j // cols


def _same_col(cols):
  return lambda b, i, j: i % cols == j % cols


@pytest.mark.property("axial")
@pytest.mark.parametrize("causal", [False, True])
def test_axial_is_row_attention_then_column_attention(causal):
  rows, cols, length = 3, 5, 15
  causal_pattern = lambda p: (lambda b, i, j: p(b, i, j) and (j <= i or not causal))
  call, masks = _padding_args(length)
  del call["segment_ids"], masks["segments"]
  call["query_seq_lengths"] = call["key_value_seq_lengths"] = jnp.array([11, 15])
  masks["q_lengths"] = masks["kv_lengths"] = np.array([11, 15])
  row_mask = jnp.asarray(_pattern_mask(length, causal_pattern(_same_row(cols)), **masks))
  col_mask = jnp.asarray(_pattern_mask(length, causal_pattern(_same_col(cols)), **masks))

  def two_dense_passes(q, k, v):
    return reference_attention(q, k, reference_attention(q, k, v, None, row_mask), None, col_mask)

  query, key, value = random_qkv(seed=6, batch=B, q_len=length, num_heads=H, num_kv_heads=2,
                                 head_dim=8, value_dim=6)
  key, value = (jnp.repeat(x, 2, axis=2) for x in (key, value))
  ours = jax.jit(lambda q, k, v: outputs_and_grads(
      lambda *a: axial_attention(*a, shape=(rows, cols), is_causal=causal, **call),
      q, k, v))(query, key, value)
  theirs = outputs_and_grads(two_dense_passes, query, key, value)
  for name, got, want in zip(("out", "dq", "dk", "dv"), (ours[0], *ours[1]),
                             (theirs[0], *theirs[1])):
    assert_close(got, want, err_msg=name)


@pytest.mark.property("axial")
def test_axial_with_one_row_is_full_attention():
  query, key, value = random_qkv(seed=2, batch=B, q_len=12, num_heads=2)
  ours = jax.jit(functools.partial(axial_attention, shape=(1, 12)))(query, key, value)
  assert_close(ours, reference_attention(query, key, value))


@pytest.mark.property("axial")
@pytest.mark.parametrize("causal", [False, True])
def test_axial_reaches_every_position_after_both_passes(causal):
  length = 12  # default shape 3 x 4
  query, key, value = random_qkv(seed=3, batch=1, q_len=length, num_heads=1, head_dim=4)
  jacobian = jax.jit(jax.jacobian(
      lambda v: axial_attention(query, key, v, is_causal=causal)))(value)
  # d out[i] / d value[j], summed in absolute value over the feature axes.
  reach = np.abs(np.asarray(jacobian)).reshape(length, 4, length, 4).sum(axis=(1, 3))
  if causal:
    lower = np.tril(np.ones((length, length), bool))
    assert np.all(reach[~lower] == 0.0)
    # Causal passes still reach j <= i whenever j's column is at most i's.
    cols = np.arange(length) % 4
    reachable = lower & (cols[None, :] <= cols[:, None])
    assert np.all(reach[reachable] > 0.0)
    # ... and only those (the docstring's departure from Ho et al.'s decoder).
    assert np.all(reach[~reachable] == 0.0)
  else:
    assert np.all(reach > 0.0)
  # Any single pass would not: the row pass alone leaves other rows out.
  assert axial_shape(length) == (3, 4)
