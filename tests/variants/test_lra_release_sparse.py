"""The `lra_release` presets of the sparse LRA rows (local, fixed, longformer,
bigbird) against numpy re-creations of the LRA release's code.

Each `_release_*` function below is written from the release's code
(google-research/long-range-arena, `lra_benchmarks/`), following its reshapes,
slices and masks step by step, and is independent of attention_jax's sparse
machinery. Where our variant deliberately differs from the release (it masks
padded keys; the release does not, see each function), the re-creation takes
the keys our variant masks as an argument, and says so.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_jax import registry
from attention_jax.core import reference_attention
from attention_jax.models import build_model
from attention_jax.variants import common
from attention_jax.variants.sparse.factorized import fixed_attention
from attention_jax.variants.sparse.global_window import longformer_attention
from attention_jax.variants.sparse.random_patterns import (bigbird_attention, bigbird_candidates,
                                                           bigbird_random_blocks, pattern_key)
from attention_jax.variants.sparse.windows import local_attention
from attention_testing import assert_close, jit_call, random_qkv

LRA_TASKS = ("listops", "text", "retrieval", "image", "pathfinder32", "pathfinder128")


def _dense(query, key, value, allowed):
  """The dense reference under `allowed` `[B|1, H|1, T, T]` (numpy bool)."""
  return jit_call(reference_attention, query, key, value, None, jnp.asarray(allowed))


def _key_padding(lengths, length):
  """`[B, T]` bool: positions before each sequence's length."""
  return np.arange(length)[None, :] < np.asarray(lengths)[:, None]


# ----------------------------------------------------------------------------
# local: lra_benchmarks/models/local/local_attention.py, LocalAttention.apply.


def _release_local(query, key, value, block_size, key_valid):
  """The release's local attention in numpy, `[B, T, H, D]` -> `[B, T, H, Dv]`.

  As `LocalAttention.apply`: pad T with `extra_len = block_size - T % block_size`
  (a whole block when it divides T), reshape q/k/v to `[B, block_size,
  T' / block_size, H, D]` and attend over axis 1 (`attention_axis=(1,)`) with
  `local_dot_product_attention`'s 1/sqrt(D) scaling and softmax.

  Masking: the release pads its boolean padding mask with -1e9 (True: the
  added positions are valid keys) and reshapes that mask to contiguous
  blocks `[B * T'/b, b]` while q/k/v are reshaped strided, so the mask it
  applies to a group is another group's. Our variant masks the keys that are
  padding instead: `key_valid` `[B, T]`, and the added positions.
  """
  query, key, value = (np.asarray(x, np.float64) for x in (query, key, value))
  batch, length, heads, depth = query.shape
  extra_len = block_size - (length % block_size)
  pad = lambda x: np.pad(x, [(0, 0), (0, extra_len)] + [(0, 0)] * (x.ndim - 2))
  query, key, value, valid = pad(query), pad(key), pad(value), pad(np.asarray(key_valid))
  padded = length + extra_len
  groups = padded // block_size
  block = lambda x: x.reshape(batch, block_size, groups, *x.shape[2:])
  query, key, value, valid = block(query), block(key), block(value), block(valid)
  # [B, n, H, a (query), a' (key)]
  logits = np.einsum("banhd,bcnhd->bnhac", query / np.sqrt(depth), key)
  logits = np.where(valid.transpose(0, 2, 1)[:, :, None, None, :], logits, -np.inf)
  weights = np.exp(logits - logits.max(-1, keepdims=True))
  weights /= weights.sum(-1, keepdims=True)
  out = np.einsum("bnhac,bcnhd->banhd", weights, value)
  return out.reshape(batch, padded, heads, -1)[:, :length]


@pytest.mark.parametrize("length,block_size", [(19, 4), (20, 4), (13, 13)])
def test_local_release_strided_matches_the_release_reshape(length, block_size):
  # 20: b divides T and the release still pads a whole block (T' = 24, 6 groups).
  query, key, value = random_qkv(seed=1, batch=2, q_len=length, num_heads=2, num_kv_heads=1,
                                 head_dim=4, value_dim=3)
  lengths = np.array([length, length - 3])  # every group keeps a valid key
  ours = jax.jit(functools.partial(local_attention, pattern="release_strided",
                                   block_size=block_size))(
      query, key, value, key_value_seq_lengths=jnp.asarray(lengths))
  key, value = (jnp.repeat(x, 2, axis=2) for x in (key, value))
  want = _release_local(query, key, value, block_size, _key_padding(lengths, length))
  assert_close(ours, want)


def test_local_release_strided_at_listops_length_spreads_keys_over_the_sequence():
  """T = 2001 (2,000 tokens and [CLS]), block_size 50: T' = 2050, 41 groups, so
  token 1000 sees 16, 57, 98, ..., 2025 (but not the padded 2025 .. 2049).
  With zero queries the output is the mean of the values it sees: here their
  positions."""
  length, block_size = 2001, 50
  positions = np.arange(length, dtype=np.float32)
  value = jnp.asarray(positions)[None, :, None, None]
  zeros = jnp.zeros((1, length, 1, 2))
  out = jax.jit(functools.partial(local_attention, pattern="release_strided",
                                  block_size=block_size))(zeros, zeros, value)
  groups = np.arange(2050).reshape(block_size, 41)  # the release's reshape
  seen = groups[:, 1000 % 41]
  assert list(seen[:3]) == [16, 57, 98]
  want = seen[seen < length].mean()
  np.testing.assert_allclose(float(out[0, 1000, 0, 0]), want, rtol=1e-6)
  # Every position, from the same reshape.
  want_all = np.array([groups[:, p % 41][groups[:, p % 41] < length].mean()
                       for p in range(length)])
  np.testing.assert_allclose(np.asarray(out[0, :, 0, 0]), want_all, rtol=1e-5)


# ----------------------------------------------------------------------------
# fixed: lra_benchmarks/models/sparse_transformer/sparse_attention.py and the
# patterns lra_benchmarks/utils/train_utils.py get_model passes.


def _release_fixed_mask(seq_len, block_size, c, use_cls_token):
  """`[1, 1, T, T]` bool: `SparseAttention.apply`'s sparse mask for
  `[Fixed1Pattern(block_size), Fixed2Pattern(block_size, c)]`: `build_mask`
  ORs the two `_build_mask`s, each ANDed with the lower triangle; with
  `use_cls_token` the mask is built for T - 1 and padded with ones before the
  first row and column."""
  n = seq_len - 1 if use_cls_token else seq_len
  r = np.arange(n)
  q, k = r[:, np.newaxis], r[np.newaxis, :]
  lower_triangular = k <= q
  fixed1 = np.floor_divide(q, block_size) == np.floor_divide(k, block_size)
  remainder = np.remainder(k, block_size)
  fixed2 = np.logical_or(remainder == 0, remainder >= block_size - c)
  mask = np.logical_or(np.logical_and(lower_triangular, fixed1),
                       np.logical_and(lower_triangular, fixed2))
  mask = mask.reshape(1, 1, n, n)
  if use_cls_token:
    mask = np.pad(mask, [(0, 0), (0, 0), (1, 0), (1, 0)], constant_values=True)
  return mask


FIXED_RELEASE = dict(summary_at_block_start=True, causal_pattern=True)


@pytest.mark.parametrize("length,stride,c,cls", [(23, 5, 2, True), (20, 5, 2, False),
                                                 (17, 4, 1, True)])
def test_fixed_release_options_match_the_release_mask(length, stride, c, cls):
  query, key, value = random_qkv(seed=2, batch=2, q_len=length, num_heads=2, head_dim=4)
  lengths = np.array([length, length - 6])
  ours = jax.jit(functools.partial(fixed_attention, stride=stride, num_summary=c,
                                   num_global=int(cls), **FIXED_RELEASE))(
      query, key, value, key_value_seq_lengths=jnp.asarray(lengths))
  allowed = (_release_fixed_mask(length, stride, c, cls)
             & _key_padding(lengths, length)[:, None, None, :])
  assert_close(ours, _dense(query, key, value, allowed))


def test_fixed_preset_at_listops_length_matches_the_release_mask():
  """The preset's options at T = 2001 (listops with [CLS]) against the release's
  mask built with get_model's Fixed1Pattern(50), Fixed2Pattern(50, c=10)."""
  length = 2001
  options = registry.preset_options("fixed", "lra_release", "listops")
  query, key, value = random_qkv(seed=3, batch=1, q_len=length, num_heads=1, head_dim=4)
  ours = jax.jit(functools.partial(fixed_attention, **options))(query, key, value)
  allowed = _release_fixed_mask(length, 50, 10, use_cls_token=True)
  assert_close(ours, _dense(query, key, value, allowed))
  # A query sees 241.9 keys on average here (the method's defaults, l = 45 and
  # c = 1: 87.8; SparseAttention's own default l = 128, c = 32, which get_model
  # overrides: 305.1 at T = 2000).
  assert abs(allowed[0, 0].sum(-1).mean() - 241.88) < 0.01


# ----------------------------------------------------------------------------
# longformer: lra_benchmarks/models/longformer/longformer_attention.py.


def _release_sliding_window_mask(seq_len, window_size):
  """`[1, 1, T, T]` bool: `_build_sliding_window_mask(window_size, global_mask)`
  with the all-False `global_mask` the encoders leave it at."""
  right_size = window_size // 2
  left_size = window_size - right_size
  left_mask = sum(np.eye(seq_len, k=-i) for i in range(left_size))
  right_mask = sum(np.eye(seq_len, k=i) for i in range(1, right_size + 1))
  mask = (left_mask + right_mask).astype(bool)
  return mask[np.newaxis, np.newaxis]


def _longformer_window(window):
  """Our options for the release's `sliding_window_size`."""
  return dict(window_size=window // 2, left_window_size=window - window // 2 - 1,
              dilated_heads=0, num_global=0)


@pytest.mark.parametrize("window", [8, 7])
def test_longformer_release_window_matches_the_release_mask(window):
  length = 19
  query, key, value = random_qkv(seed=4, batch=2, q_len=length, num_heads=2, head_dim=4)
  lengths = np.array([length, 12])
  ours = jax.jit(functools.partial(longformer_attention, **_longformer_window(window)))(
      query, key, value, key_value_seq_lengths=jnp.asarray(lengths))
  allowed = (_release_sliding_window_mask(length, window)
             & _key_padding(lengths, length)[:, None, None, :])
  assert_close(ours, _dense(query, key, value, allowed))


def test_longformer_preset_is_the_release_window_of_512():
  for task in (None, *LRA_TASKS):
    assert registry.preset_options("longformer", "lra_release", task) == _longformer_window(512)


# ----------------------------------------------------------------------------
# bigbird: lra_benchmarks/models/bigbird/bigbird_attention.py.


def _release_rand_candidates(m, wm, last_idx):
  """`get_block_rand_mask(m, m, wm, wm, r, last_idx)`'s candidate blocks for
  query blocks 1 .. m // wm - 2 (before its `permutation(...)[:r]`), with its
  slices and branches as written."""
  a = np.array(range(1, m // wm - 1))
  last = (m // wm) - 1
  if last_idx > (2 * wm):
    last = (last_idx // wm) - 1
  candidates = {}
  for i in range(1, m // wm - 1):
    start = i - 2
    end = i
    if i == 1:
      candidates[i] = a[2:last]
    elif i == 2:
      candidates[i] = a[3:last]
    elif i == m // wm - 3:
      candidates[i] = a[:last - 4]
    elif i == m // wm - 2:
      candidates[i] = a[:last - 3]
    else:
      if start > last:
        start = last
        candidates[i] = a[:start]
      elif (end + 1) == last:
        candidates[i] = a[:start]
      else:
        candidates[i] = np.concatenate((a[:start], a[end + 1:last]))
  return candidates


def _release_padded_length(length, block_size):
  """`BigBirdAttention.apply`'s padded length: T + block_size - T % block_size."""
  return length + block_size - (length % block_size)


@pytest.mark.parametrize("length,block_size,within", [
    (45, 4, 32),     # 12 blocks, the last drawable is 7: blocks 9 and 10 narrowed
    (45, 4, 1024),   # within past the end: every block
    (2001, 64, 1024), (4001, 64, 1024), (1025, 64, 1024), (1024, 64, 1024), (1001, 64, 1024)])
def test_bigbird_release_candidates_match_get_block_rand_mask(length, block_size, within):
  seq_length = _release_padded_length(length, block_size)
  num_blocks = seq_length // block_size
  release = _release_rand_candidates(seq_length, block_size, min(seq_length, within))
  ours = bigbird_candidates(num_blocks, within_blocks=within // block_size,
                            rule="lra_release")
  for n in range(num_blocks):
    want = set(release.get(n, ()))  # blocks 0 and nb - 1 are global: no draws
    assert set(np.flatnonzero(ours[n])) == want, (n, sorted(want))


def test_bigbird_exact_candidates_equal_the_release_ones_when_nothing_is_cut():
  for num_blocks in (8, 16, 17):
    seq_length = num_blocks * 4
    release = _release_rand_candidates(seq_length, 4, seq_length)
    ours = bigbird_candidates(num_blocks)
    for n in range(1, num_blocks - 1):
      assert set(np.flatnonzero(ours[n])) == set(release[n]), (num_blocks, n)


def _release_block_mask(num_blocks, rand_attn):
  """`[nb, nb]` bool, the key blocks each query block attends to in
  `band_start_block_rand_multi_attention_pad`, given `rand_attn` `[nb - 2, r]`
  (its random blocks of query blocks 1 .. nb - 2): the first and last query
  blocks attend to every key; the second to blocks 0, 1, 2, -1 and
  rand_attn[0]; the middle ones (2 .. nb - 3) to block 0, their band, block -1
  and rand_attn[i - 1]; the second last to blocks 0, -3, -2, -1 and rand_attn[-1]."""
  mask = np.zeros((num_blocks, num_blocks), bool)
  mask[0] = mask[-1] = True
  mask[1, [0, 1, 2, num_blocks - 1]] = True
  mask[1, rand_attn[0]] = True
  for i in range(2, num_blocks - 2):
    mask[i, [0, i - 1, i, i + 1, num_blocks - 1]] = True
    mask[i, rand_attn[i - 1]] = True
  mask[-2, [0, num_blocks - 3, num_blocks - 2, num_blocks - 1]] = True
  mask[-2, rand_attn[-1]] = True
  return mask


BIGBIRD_RELEASE = dict(block_padding="lra_release", random_candidates="lra_release")


@pytest.mark.parametrize("length,within", [(45, 32), (40, 1024)])
def test_bigbird_release_options_match_the_release_block_structure(length, within):
  """Ours (the preset's options at b = 4) equals dense attention under the
  release's block structure filled with the blocks ours drew, per head; the
  release pads 45 to 48 and 40 to 44 (12 and 11 blocks), its padded keys masked."""
  block_size, r, heads = 4, 2, 2
  rng = jax.random.PRNGKey(7)
  query, key, value = random_qkv(seed=5, batch=2, q_len=length, num_heads=heads, head_dim=4)
  lengths = np.array([length, length - 7])
  ours = jax.jit(functools.partial(
      bigbird_attention, rng=rng, block_size=block_size, num_random_blocks=r,
      random_blocks_within=within, **BIGBIRD_RELEASE))(
          query, key, value, key_value_seq_lengths=jnp.asarray(lengths))
  num_blocks = _release_padded_length(length, block_size) // block_size
  candidates = bigbird_candidates(num_blocks, within_blocks=within // block_size,
                                  rule="lra_release")
  drawn = np.asarray(jit_call(bigbird_random_blocks, rng, heads, candidates, r))
  release = _release_rand_candidates(num_blocks * block_size, block_size,
                                     min(num_blocks * block_size, within))
  allowed = []
  for h in range(heads):
    rand_attn = drawn[h, 1:num_blocks - 1]
    # The drawn blocks are r of the release's candidates, as its permutation(...)[:r].
    for n, row in enumerate(rand_attn, start=1):
      assert len(set(row)) == r and set(row) <= set(release[n]), (h, n, row)
    blocks = _release_block_mask(num_blocks, rand_attn)
    tokens = np.repeat(np.repeat(blocks, block_size, 0), block_size, 1)[:length, :length]
    allowed.append(tokens)
  allowed = np.stack(allowed)[None] & _key_padding(lengths, length)[:, None, None, :]
  assert_close(ours, _dense(query, key, value, allowed))


def test_bigbird_preset_draws_exactly_r_distinct_blocks_at_lra_lengths():
  """Before: r = 3 draws with replacement, repeats and window/global hits
  dropped, about 2.15 blocks kept at T = 1024. Now exactly 3 per head, query
  block and layer, from the first 1024 tokens."""
  options = registry.preset_options("bigbird", "lra_release", "listops")
  within = options["random_blocks_within"] // options["block_size"]
  for length in (1001, 1024, 1025, 2001, 4001):
    num_blocks = _release_padded_length(length, 64) // 64
    candidates = bigbird_candidates(num_blocks, within_blocks=within,
                                    rule=options["random_candidates"])
    drawn = np.asarray(jit_call(bigbird_random_blocks, jax.random.PRNGKey(length), 8,
                                candidates, options["num_random_blocks"]))
    rows = drawn[:, 1:num_blocks - 1]  # blocks 0 and nb - 1 are global
    assert np.all(rows >= 1) and np.all(rows < min(num_blocks - 1, within))
    assert all(len(set(row)) == 3 for row in rows.reshape(-1, 3))
    assert np.all(drawn[:, [0, num_blocks - 1]] == -1)


def test_bigbird_preset_runs_at_listops_length_with_padding():
  """T = 2001 pads to 2048 (32 blocks); the valid queries ignore padded keys."""
  options = registry.preset_options("bigbird", "lra_release", "listops")
  length = 2001
  query, key, value = random_qkv(seed=6, batch=1, q_len=length, num_heads=2, head_dim=4)
  fn = jax.jit(functools.partial(bigbird_attention, rng=jax.random.PRNGKey(0),
                                 **options))
  lengths = jnp.array([1500])
  out = fn(query, key, value, key_value_seq_lengths=lengths)
  changed = fn(query, key.at[:, 1500:].add(50.0), value.at[:, 1500:].add(50.0),
               key_value_seq_lengths=lengths)
  assert np.isfinite(np.asarray(out)).all()
  assert_close(out, changed)


def test_bigbird_patterns_differ_per_layer_in_a_scanned_encoder():
  """Under `scan_layers` the "random" collection stacks one kept key per layer."""
  model = build_model(dict(vocab_size=16, num_classes=2, num_layers=2, embed_dim=16, num_heads=2,
                           mlp_dim=16, max_length=64, attention="bigbird",
                           attention_options=dict(block_size=4, num_random_blocks=1),
                           scan_layers=True))
  tokens = jnp.ones((1, 32), jnp.int32)
  variables = jax.jit(model.init)(jax.random.PRNGKey(0), tokens)
  (kept,) = jax.tree.leaves(variables[common.RANDOM_COLLECTION])
  assert kept.shape == (2, 2)
  candidates = bigbird_candidates(9)  # 33 tokens with [CLS]: 9 blocks of 4
  patterns = [np.asarray(bigbird_random_blocks(pattern_key(k), 2, candidates, 1))
              for k in kept]
  assert np.any(patterns[0] != patterns[1])


# ----------------------------------------------------------------------------
# The presets by task, as the release's configs set them.


def test_presets_per_task_follow_the_release_configs():
  for task in LRA_TASKS:
    image = task in ("image", "pathfinder32", "pathfinder128")
    # local: block_size 50 (LocalTransformerEncoder's default), 64 in image/configs/*/local_base.py.
    assert registry.preset_options("local", "lra_release", task) == dict(
        pattern="release_strided", block_size=64 if image else 50)
    # fixed: [CLS] pooling makes token 0 global (use_cls_token); pathfinder pools by MEAN.
    fixed = registry.preset_options("fixed", "lra_release", task)
    assert fixed["num_global"] == (0 if task in ("pathfinder32", "pathfinder128") else 1)
    assert (fixed["stride"], fixed["num_summary"]) == (50, 10)
    bigbird = registry.preset_options("bigbird", "lra_release", task)
    assert (bigbird["block_size"], bigbird["num_random_blocks"]) == (64, 3)
