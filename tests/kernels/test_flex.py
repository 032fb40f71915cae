"""flex_attention: score and mask mods in the blockwise kernel, against the dense reference.

Three layers of checks. The dense path ("xla") against attention written out
in NumPy float64 with each mod's formula materialised (ALiBi, documents,
prefix-LM, windows, soft-capping, sinks, the sigmoid normaliser), so that
the oracle is independent of the mods' code. The blockwise kernel against the
dense path: outputs, log-sum-exp and gradients, those of the arrays a
score_mod closes over and of the sinks included (tests/kernels/
test_flex_properties.py draws random compositions). Block masks against a
brute-force evaluation of the mask_mod, and the bad inputs.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attention_jax as aj
from attention_jax.core import mods, patterns
from attention_jax.kernels import BlockSizes
from attention_jax.kernels.flash_attention import blockwise
from attention_testing import (as_float64, assert_close, intermediate_shapes, jit_call,
                               outputs_and_grads, random_qkv)

B, T, H, HKV, D = 2, 37, 4, 2, 8
BLOCKS = BlockSizes(8, 8)
SLOPES = np.asarray([0.5, 0.25, 0.125, 0.0625], np.float32)
SINKS = np.asarray([0.0, 1.5, -1.0, 3.0], np.float32)
DOCS = np.stack([np.arange(T) // 10, np.arange(T) // 15])  # [B, T]
PREFIX = np.asarray([4, 20])


def _qkv(seed=0, dtype=jnp.float32, q_len=T, kv_len=T):
  return random_qkv(seed, batch=B, q_len=q_len, kv_len=kv_len, num_heads=H, num_kv_heads=HKV,
                    head_dim=D, dtype=dtype)


def _numpy_attention(query, key, value, *, bias=0.0, allowed=True, softcap=None, sinks=None,
                     sigmoid_bias=None):
  """Attention written out in float64: `bias` and `allowed` broadcast to [B, H, Tq, Tk]."""
  query, key, value = (as_float64(x) for x in (query, key, value))
  group = query.shape[2] // key.shape[2]
  key, value = np.repeat(key, group, axis=2), np.repeat(value, group, axis=2)
  logits = np.einsum("bqhd,bkhd->bhqk", query, key) / np.sqrt(query.shape[-1])
  if softcap is not None:
    logits = softcap * np.tanh(logits / softcap)
  logits = logits + bias
  allowed = np.broadcast_to(allowed, logits.shape)
  if sigmoid_bias is not None:
    weights = np.where(allowed, 1.0 / (1.0 + np.exp(-(logits + sigmoid_bias))), 0.0)
  else:
    logits = np.where(allowed, logits, -np.inf)
    top = np.max(logits, -1, keepdims=True)
    if sinks is not None:
      top = np.maximum(top, sinks[None, :, None, None])
    top = np.where(np.isfinite(top), top, 0.0)
    exp = np.exp(logits - top)
    total = exp.sum(-1, keepdims=True)
    if sinks is not None:
      total = total + np.exp(sinks[None, :, None, None] - top)
    weights = exp / np.where(total == 0, 1.0, total)
  return np.einsum("bhqk,bkhd->bqhd", weights, value)


_Q = np.arange(T)[:, None]
_K = np.arange(T)[None, :]
# name: (flex options, the NumPy attention's arguments)
NAMED = {
    "alibi": (dict(score_mod=mods.alibi(SLOPES)),
              dict(bias=-SLOPES[:, None, None] * np.abs(_Q - _K))),
    "causal": (dict(mask_mod=mods.causal_mask), dict(allowed=_K <= _Q)),
    "sliding_window": (dict(mask_mod=mods.sliding_window(5, 2)),
                       dict(allowed=(_K >= _Q - 5) & (_K <= _Q + 2))),
    "document": (dict(mask_mod=mods.document_mask(jnp.asarray(DOCS))),
                 dict(allowed=(DOCS[:, :, None] == DOCS[:, None, :])[:, None])),
    "prefix_lm": (dict(mask_mod=mods.prefix_lm_mask(PREFIX)),
                  dict(allowed=((_K[None] < PREFIX[:, None, None]) | (_K <= _Q)[None])[:, None])),
    "softcap": (dict(softcap=2.0), dict(softcap=2.0)),
    "sinks": (dict(sinks=SINKS, mask_mod=mods.causal_mask),
              dict(sinks=SINKS, allowed=_K <= _Q)),
    "sigmoid": (dict(normaliser="sigmoid", mask_mod=mods.causal_mask),
                dict(sigmoid_bias=-np.log(T), allowed=_K <= _Q)),
    "head_temperature": (
        dict(score_mod=lambda s, b, h, q, k: s * jnp.asarray([1.0, 0.5, 2.0, 0.0])[h]),
        # s * t = s + (t - 1) s: a bias that depends on the logits, so written as a scale.
        None),
}


@pytest.mark.parametrize("name", [n for n in NAMED if NAMED[n][1] is not None])
def test_dense_flex_equals_attention_written_out_with_the_mod_materialised(name):
  options, numpy_args = NAMED[name]
  query, key, value = _qkv()
  out = jit_call(aj.flex_attention, query, key, value, implementation="xla", **options)
  assert_close(out, _numpy_attention(query, key, value, **numpy_args), rtol=2e-5, atol=2e-5)


def test_a_score_mod_sees_each_pair_by_batch_head_query_and_key():
  # score_mod replaces the logits by a function of the indices alone: the
  # weights are then softmax over keys of that function, known in closed form.
  query, key, value = _qkv()
  def by_index(score, b, h, q, k):
    return 0.0 * score + jnp.where(k == (q + h + b) % T, 50.0, 0.0)
  out = aj.flex_attention(query, key, value, score_mod=by_index, implementation="blockwise",
                          block_sizes=BLOCKS)
  chosen = (np.arange(T)[None, :, None] + np.arange(H)[None, None, :]
            + np.arange(B)[:, None, None]) % T  # [B, Tq, H]
  values = np.repeat(np.asarray(value), H // HKV, axis=2)  # [B, Tk, H, D]
  expected = values[np.arange(B)[:, None, None], chosen, np.arange(H)[None, None, :]]
  assert_close(out, expected, rtol=1e-4, atol=1e-4)


def _flex(implementation, **options):
  blocks = dict(block_sizes=BLOCKS) if implementation == "blockwise" else {}
  return lambda q, k, v: aj.flex_attention(q, k, v, implementation=implementation, **blocks,
                                           **options)


@pytest.mark.parametrize("name", list(NAMED))
def test_blockwise_flex_equals_the_dense_path_outputs_and_gradients(name):
  options, _ = NAMED[name]
  arrays = _qkv(seed=1)
  out, grads = outputs_and_grads(_flex("blockwise", **options), *arrays)
  want, want_grads = outputs_and_grads(_flex("xla", **options), *arrays)
  assert_close(out, want)
  for got, expected in zip(grads, want_grads):
    assert_close(got, expected, rtol=1e-4, atol=1e-5)


def _residual(implementation, **options):
  return jax.jit(lambda q, k, v: _flex(implementation, return_residual=True, **options)(q, k, v))


@pytest.mark.parametrize("name", ["alibi", "sinks", "document"])
def test_blockwise_flex_returns_the_dense_log_sum_exp(name):
  options, _ = NAMED[name]
  arrays = _qkv(seed=2)
  (_, lse), (_, want) = _residual("blockwise", **options)(*arrays), _residual("xla", **options)(
      *arrays)
  assert_close(lse, want)


def _closed_over_loss(implementation, slopes, table, sinks, arrays):
  """A loss through ALiBi with learned slopes, a learned bias table by
  relative distance and learned sinks, under a document mask."""
  bucket = lambda distance: jnp.clip(distance, -4, 4) + 4
  score_mod = lambda s, b, h, q, k: (mods.alibi(slopes)(s, b, h, q, k)
                                     + mods.relative_bias(table, bucket)(0.0, b, h, q, k))
  out = _flex(implementation, score_mod=score_mod, sinks=sinks, softcap=3.0,
              mask_mod=mods.document_mask(jnp.asarray(DOCS)))(*arrays)
  return jnp.sum(out * jnp.cos(out))


def test_gradients_reach_the_arrays_a_score_mod_closes_over_and_the_sinks():
  arrays = _qkv(seed=3)
  table = jax.random.normal(jax.random.PRNGKey(4), (H, 9))
  grad = lambda impl: jax.jit(jax.grad(
      lambda slopes, table, sinks, q, k, v: _closed_over_loss(impl, slopes, table, sinks,
                                                               (q, k, v)),
      argnums=(0, 1, 2, 3, 4, 5)))(jnp.asarray(SLOPES), table, jnp.asarray(SINKS), *arrays)
  got, want = grad("blockwise"), grad("xla")
  for name, g, w in zip(["slopes", "table", "sinks", "query", "key", "value"], got, want):
    assert np.abs(np.asarray(w)).max() > 1e-3, name  # a gradient that is there to check
    assert_close(g, w, rtol=1e-4, atol=1e-5, err_msg=name)


def test_flex_trains_in_bfloat16_on_cpu():
  arrays = _qkv(seed=5, dtype=jnp.bfloat16)
  options = dict(score_mod=mods.alibi(SLOPES), mask_mod=mods.sliding_window(6), sinks=SINKS)
  out, grads = outputs_and_grads(_flex("blockwise", **options), *arrays)
  want, want_grads = outputs_and_grads(_flex("xla", **options), *arrays)
  assert out.dtype == jnp.bfloat16 and all(g.dtype == jnp.bfloat16 for g in grads)
  assert_close(out.astype(jnp.float32), want.astype(jnp.float32), rtol=2e-2, atol=2e-2)
  for got, expected in zip(grads, want_grads):
    assert_close(got.astype(jnp.float32), expected.astype(jnp.float32), rtol=5e-2, atol=5e-2)


def test_mods_combine_with_the_dot_product_options():
  # lengths, segments, grouped heads, causal and an explicit bias, with a mod.
  query, key, value = _qkv(seed=6)
  bias = jax.random.normal(jax.random.PRNGKey(7), (1, H, T, T))
  options = dict(score_mod=mods.alibi(SLOPES), mask_mod=mods.sliding_window(9, 9),
                 is_causal=True, bias=bias, query_seq_lengths=jnp.asarray([30, 37]),
                 key_value_seq_lengths=jnp.asarray([25, 37]),
                 segment_ids=jnp.asarray(DOCS % 2))
  out, grads = outputs_and_grads(_flex("blockwise", **options), query, key, value)
  want, want_grads = outputs_and_grads(_flex("xla", **options), query, key, value)
  assert_close(out, want)
  for got, expected in zip(grads, want_grads):
    assert_close(got, expected, rtol=1e-4, atol=1e-5)


def test_qk_norm_normalises_queries_and_keys_before_the_product():
  query, key, value = _qkv(seed=8)
  scales = (jnp.full((D,), 2.0), jnp.linspace(0.5, 1.5, D))
  out = aj.flex_attention(query, key, value, qk_norm="rms", qk_norm_scales=scales)
  rms = lambda x: np.asarray(x) / np.sqrt(np.mean(np.asarray(x) ** 2, -1, keepdims=True) + 1e-6)
  want = _numpy_attention(rms(query) * 2.0, rms(key) * np.linspace(0.5, 1.5, D), value)
  assert_close(out, want, rtol=1e-4, atol=1e-4)
  l2 = aj.flex_attention(query, key, value, qk_norm="l2", scale=1.0)
  unit = lambda x: np.asarray(x) / np.linalg.norm(np.asarray(x), axis=-1, keepdims=True)
  assert_close(l2, _numpy_attention(unit(query) * np.sqrt(D), unit(key), value), rtol=1e-4,
               atol=1e-4)


# Block masks.

def _brute_force_layout(mask_mod, batch, heads, q_len, kv_len, block_q, block_k):
  """The layout from the whole grid: [B, H, nq, nk], padding counted as allowed."""
  index = mods.grid_indices(batch, heads, q_len, kv_len)
  allowed = np.asarray(jnp.broadcast_to(mask_mod(*index), (batch, heads, q_len, kv_len)))
  nq, nk = -(-q_len // block_q), -(-kv_len // block_k)
  padded = np.ones((batch, heads, nq * block_q, nk * block_k), bool)
  real = np.zeros_like(padded)
  padded[:, :, :q_len, :kv_len], real[:, :, :q_len, :kv_len] = allowed, True
  tiles = lambda x: x.reshape(batch, heads, nq, block_q, nk, block_k)
  some = (tiles(padded) & tiles(real)).any((3, 5))
  every = tiles(padded).all((3, 5))
  return np.where(some & every, patterns.FULL, np.where(some, patterns.PARTIAL, patterns.SKIP))


BLOCK_MASK_CASES = {
    "causal": (mods.causal_mask, None, None),
    "window_and_causal": (aj.and_masks(mods.sliding_window(7), mods.causal_mask), None, None),
    "document": (mods.document_mask(jnp.asarray(DOCS)), B, None),
    "prefix_or_window": (aj.or_masks(mods.prefix_lm_mask(PREFIX), mods.sliding_window(3, 3)),
                         B, None),
    "per_head": (lambda b, h, q, k: (k <= q) & (q - k <= 4 * (h + 1)), None, H),
}


@pytest.mark.parametrize("name", list(BLOCK_MASK_CASES))
def test_block_mask_equals_a_brute_force_evaluation_of_the_mask_mod(name):
  mask_mod, batch, heads = BLOCK_MASK_CASES[name]
  block_mask = aj.create_block_mask(mask_mod, batch, heads, T, T + 5, (8, 16))
  expected = _brute_force_layout(mask_mod, batch or 1, heads or 1, T, T + 5, 8, 16)
  np.testing.assert_array_equal(np.asarray(block_mask.layout), expected)
  assert int(block_mask.visited_blocks().sum()) == int((expected != patterns.SKIP).sum())


def test_block_mask_tiles_a_long_grid_a_chunk_at_a_time(monkeypatch):
  # The traced path with several key chunks per query block gives the same layout.
  from attention_jax.core import block_mask as block_mask_module
  mask_mod = mods.document_mask(jnp.asarray(DOCS))
  whole = aj.create_block_mask(mask_mod, B, None, T, T, 4)
  monkeypatch.setattr(block_mask_module, "_TILE_ELEMENTS", B * 4 * 4 * 3)  # 3 key blocks a step
  np.testing.assert_array_equal(
      np.asarray(aj.create_block_mask(mask_mod, B, None, T, T, 4).layout),
      np.asarray(whole.layout))


def test_the_kernel_visits_exactly_the_blocks_the_layout_does_not_skip():
  block_mask = aj.create_block_mask(BLOCK_MASK_CASES["document"][0], B, None, T, T, 8)
  layout = np.asarray(block_mask.layout)
  masks = blockwise._Masks(None, None, None, None, None,  # pylint: disable=protected-access
                           block_layout=jnp.asarray(layout))
  order, count = blockwise._visit_lists(masks, transpose=False)  # pylint: disable=protected-access
  visited = (layout != patterns.SKIP).any((0, 1))  # any batch row or head
  np.testing.assert_array_equal(np.asarray(count), visited.sum(-1))
  for row in range(visited.shape[0]):
    assert set(np.asarray(order[row, :count[row]])) == set(np.flatnonzero(visited[row]))


def test_a_block_the_layout_skips_contributes_nothing_even_where_the_mask_allows_it():
  # A layout that keeps only the diagonal blocks of an all-allowed mask: the
  # kernel must then compute block-diagonal attention.
  everything = lambda b, h, q, k: q >= 0
  block_mask = aj.create_block_mask(everything, None, None, T, T, 8)
  diagonal = np.where(np.eye(5, dtype=bool), patterns.FULL, patterns.SKIP).astype(np.int8)
  block_mask = aj.BlockMask(jnp.asarray(diagonal[None, None]), block_mask.lifted_mask_mod,
                            block_mask.mask_consts, T, T, 8, 8)
  query, key, value = _qkv(seed=9)
  out = aj.flex_attention(query, key, value, block_mask=block_mask)
  same_block = (_Q // 8) == (_K // 8)
  assert_close(out, _numpy_attention(query, key, value, allowed=same_block), rtol=1e-4,
               atol=1e-5)


def test_block_mask_passes_through_jit_and_between_calls():
  query, key, value = _qkv(seed=10)
  docs = jnp.asarray(DOCS)

  @jax.jit
  def make(docs):
    return aj.create_block_mask(mods.document_mask(docs), B, None, T, T, 8)

  block_mask = make(docs)
  out = jax.jit(lambda q, k, v, m: aj.flex_attention(q, k, v, block_mask=m))(
      query, key, value, block_mask)
  want = aj.flex_attention(query, key, value, mask_mod=mods.document_mask(docs),
                           implementation="xla")
  assert_close(out, want)


def test_at_64k_tokens_no_program_builds_a_tq_by_tk_array():
  length = 65536
  docs = jnp.zeros((1, length), jnp.int32)
  shapes = intermediate_shapes(
      lambda d: aj.create_block_mask(mods.document_mask(d), 1, None, length, length).layout, docs)
  shapes |= intermediate_shapes(
      lambda q, k, v, d: jax.grad(lambda q, k, v: aj.flex_attention(
          q, k, v, score_mod=mods.alibi(jnp.ones(2)), mask_mod=mods.document_mask(d),
          softcap=5.0, sinks=jnp.zeros(2)).sum(), argnums=(0, 1, 2))(q, k, v),
      *(jax.ShapeDtypeStruct((1, length, 2, 16), jnp.float32) for _ in range(3)), docs)
  largest = max(int(np.prod(shape)) for shape in shapes)
  assert largest < length * length // 64, sorted(shapes, key=np.prod)[-3:]


# Bad input.

def test_bad_mods_and_options_raise_a_value_error_naming_them():
  query, key, value = _qkv()
  cases = [
      (dict(mask_mod=lambda b, h, q, k: k - q), r"mask_mod must return a boolean .* got int32\[\]"),
      (dict(score_mod=lambda s, b, h, q, k: (s * 2).astype(jnp.bfloat16)),
       r"score_mod must return the score it was given .*float32\[\].* got bfloat16\[\]"),
      (dict(score_mod=lambda s, b, h, q, k: jnp.stack([s, s])),
       r"score_mod must return .* got float32\[2\]"),
      (dict(score_mod=lambda s, b: s), r"score_mod must be a JAX function of 5"),
      (dict(mask_mod=3), r"mask_mod must be a function, got 3"),
      (dict(softcap=-1.0), r"softcap must be a positive float or None, got -1.0"),
      (dict(sinks=jnp.zeros(3)), r"sinks must be float \[H\] = \[4\].* got float32\[3\]"),
      (dict(normaliser="sparsemax"), r"normaliser must be one of \('softmax', 'sigmoid'\)"),
      (dict(normaliser="sigmoid", return_residual=True), r"return_residual: the sigmoid"),
      (dict(sigmoid_bias=1.0), r"sigmoid_bias is for normaliser='sigmoid'"),
      (dict(implementation="pallas"),
       r"implementation must be one of \['blockwise', 'pallas_gpu', 'pallas_tpu', 'xla'\]"),
      (dict(qk_norm="layer"), r"qk_norm must be one of \('rms', 'l2'\) or None"),
      (dict(mask_mod=patterns.PerHead(((1, mods.causal_mask), (2, mods.causal_mask)))),
       r"mask_mod is defined for 3 heads, but the query has H=4"),
  ]
  for options, message in cases:
    with pytest.raises(ValueError, match=message):
      aj.flex_attention(query, key, value, **options)


def test_a_block_mask_for_other_lengths_or_blocks_is_refused():
  query, key, value = _qkv()
  other_length = aj.create_block_mask(mods.causal_mask, None, None, T + 1, T, 8)
  with pytest.raises(ValueError, match=r"block_mask was made for \(Tq, Tk\) = \(38, 37\), but "
                                       r"the query and key have lengths \(37, 37\)"):
    aj.flex_attention(query, key, value, block_mask=other_length)
  blocks_of_8 = aj.create_block_mask(mods.causal_mask, None, None, T, T, 8)
  with pytest.raises(ValueError, match=r"block_mask has blocks \(8, 8\), but block_sizes="):
    aj.flex_attention(query, key, value, block_mask=blocks_of_8, block_sizes=BlockSizes(16, 16))
  with pytest.raises(ValueError, match=r"mask_mod and block_mask were both given"):
    aj.flex_attention(query, key, value, block_mask=blocks_of_8, mask_mod=mods.sliding_window(2))
  with pytest.raises(ValueError, match=r"block_mask is for \(B, H\) = \(3, 1\)"):
    aj.flex_attention(query, key, value, block_mask=aj.create_block_mask(
        mods.document_mask(jnp.zeros((3, T), jnp.int32)), 3, None, T, T, 8))
  with pytest.raises(ValueError, match=r"mask_mod depends on its batch index, but batch=None"):
    aj.create_block_mask(mods.document_mask(jnp.asarray(DOCS)), None, None, T, T)
  with pytest.raises(ValueError, match=r"block_sizes must be \(block_q, block_k\)"):
    aj.create_block_mask(mods.causal_mask, None, None, T, T, (8, 0))


# Dropout on the weights: the kernel draws each tile's mask from the rng and
# the tile's indices; the dense form below assembles the same masks tile by
# tile, so the two compute the same function, outputs and gradients.

def _tile_dropout_mask(rng, rate, shape_bhqk, block):
  batch, heads, q_len, kv_len = shape_bhqk
  nq, nk = -(-q_len // block), -(-kv_len // block)
  tiles = [[blockwise.dropout_keep(rng, i, j, (batch, HKV, heads // HKV, block, block), rate)
            for j in range(nk)] for i in range(nq)]
  keep = jnp.concatenate([jnp.concatenate(row, -1) for row in tiles], -2)
  return keep.reshape(batch, heads, nq * block, nk * block)[:, :, :q_len, :kv_len]


@pytest.mark.parametrize("normaliser", ["softmax", "sigmoid"])
def test_dropout_in_the_kernel_is_dense_attention_with_the_same_tile_masks(normaliser):
  rng, rate = jax.random.PRNGKey(11), 0.3
  keep = _tile_dropout_mask(rng, rate, (B, H, T, T), 8)
  assert 0.55 < float(jnp.mean(keep > 0)) < 0.85  # about 1 - rate kept
  options = dict(mask_mod=mods.causal_mask, score_mod=mods.alibi(SLOPES), normaliser=normaliser)

  def dense(q, k, v):
    group = H // HKV
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(D) - (
        SLOPES[:, None, None] * np.abs(_Q - _K))
    if normaliser == "sigmoid":
      weights = jnp.where(_K <= _Q, jax.nn.sigmoid(logits - np.log(T)), 0.0)
    else:
      weights = jax.nn.softmax(jnp.where(_K <= _Q, logits, -jnp.inf), axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", weights * keep, v)

  arrays = _qkv(seed=12)
  out, grads = outputs_and_grads(
      _flex("blockwise", dropout_rate=rate, dropout_rng=rng, **options), *arrays)
  want, want_grads = outputs_and_grads(dense, *arrays)
  assert_close(out, want, rtol=1e-4, atol=1e-5)
  for got, expected in zip(grads, want_grads):
    assert_close(got, expected, rtol=1e-4, atol=1e-5)


def test_dropout_needs_an_rng_and_a_kernel_that_draws_it():
  query, key, value = _qkv()
  with pytest.raises(ValueError, match=r"dropout_rate=0.1 needs a dropout_rng"):
    aj.flex_attention(query, key, value, dropout_rate=0.1)
  with pytest.raises(ValueError, match=r"dropout_rate must be a float in \[0, 1\), got 1.0"):
    aj.flex_attention(query, key, value, dropout_rate=1.0, dropout_rng=jax.random.PRNGKey(0))
  with pytest.raises(ValueError, match=r"dropout on the weights runs on implementation in "
                                       r"\('blockwise', 'xla'\), got implementation='pallas_gpu'"):
    aj.flex_attention(query, key, value, dropout_rate=0.1, dropout_rng=jax.random.PRNGKey(0),
                      implementation="pallas_gpu")
