"""Drawn patterns: `random` attention and `bigbird` (Zaheer et al. 2020).

Both draw their pattern per head from a PRNG key `rng`; in a model that key
is the layer's own, drawn once at initialisation and kept (`LayerPattern`),
so each layer and head keeps one pattern for the run, as BigBird's code does.
`random` gathers each query's drawn keys; `bigbird` adds drawn key blocks to
a block window and global blocks.
"""

from __future__ import annotations

import functools
import operator
from typing import Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from attention_jax import registry
from attention_jax.core import patterns
from attention_jax.flex import flex_attention
from attention_jax.variants import common
from attention_jax.variants.sparse import engine, kernel

Array = jnp.ndarray


def _gathered_keys_part(inputs: engine.Inputs, indices: Array, index_ok: Array,
                        allowed: Optional[engine.Predicate]) -> engine.Part:
  """Query i of head h attends to the keys at `indices[h, i]` where `index_ok`.

  Args:
    indices: `[H, Tp, M]` key positions; index_ok: `[H, Tp, M]` bool.

  Every (query, head) pair is its own group of one query and one head, so
  each head gathers its own keys, `[B, Tp, H, M, D]`: cost O(T H M).
  """
  batch, padded_len, num_heads = inputs.query.shape[:3]
  groups, per_query = padded_len * num_heads, indices.shape[-1]
  index = jnp.transpose(indices, (1, 0, 2))  # [Tp, H, M]
  heads = jnp.arange(num_heads)[None, :, None]
  as_groups = lambda x: x.reshape(batch, groups, per_query, 1, *x.shape[4:])
  key = as_groups(inputs.key[:, index, heads])  # [B, Tp * H, M, 1, D]
  value = as_groups(inputs.value[:, index, heads])
  query = inputs.query.reshape(batch, groups, 1, 1, inputs.query.shape[-1])
  q_pos = jnp.repeat(jnp.arange(padded_len), num_heads)[:, None]  # [Tp * H, 1]
  k_pos = index.reshape(groups, per_query)
  key_ok = (inputs.key_ok[:, index].reshape(batch, groups, per_query)
            & jnp.transpose(index_ok, (1, 0, 2)).reshape(groups, per_query)[None])
  segments = (None, None)
  if inputs.segments is not None:
    segments = (jnp.repeat(inputs.segments[0], num_heads, axis=1)[:, :, None],
                inputs.segments[1][:, index].reshape(batch, groups, per_query))
  part = engine.dense_part(query, key, value, q_pos, k_pos, key_ok, *segments, allowed)
  # [B, Tp * H, 1, 1, ...] -> [B, Tp, H, ...]
  return engine.map_part(lambda x: x.reshape(batch, padded_len, num_heads, *x.shape[4:]), part)


def _heads_as_stripes(inputs: engine.Inputs):
  """`engine.striped`'s layout with one stripe per head (and one head per stripe),
  for patterns drawn per head: q/k/v `[B, H, Tp, 1, D]`, positions `[H, Tp]`,
  key_ok and segments `[B, H, Tp]`."""
  batch, padded_len, num_heads = inputs.query.shape[:3]
  heads = lambda x: jnp.swapaxes(x, 1, 2)[:, :, :, None]
  per_head = lambda x: jnp.broadcast_to(x[:, None], (batch, num_heads, padded_len))
  segments = None
  if inputs.segments is not None:
    segments = tuple(per_head(s) for s in inputs.segments)
  positions = jnp.broadcast_to(jnp.arange(padded_len), (num_heads, padded_len))
  return (heads(inputs.query), heads(inputs.key), heads(inputs.value), positions,
          per_head(inputs.key_ok), segments)


def _from_head_stripes(x: Array) -> Array:
  """`[B, H, Tp, 1, ...]` -> `[B, Tp, H, ...]`, the inverse of `_heads_as_stripes`."""
  return jnp.swapaxes(x[:, :, :, 0], 1, 2)


def _first_draws(indices: Array) -> Array:
  """`[..., N, M]` ints -> True where the index is not already drawn earlier in its row."""
  num = indices.shape[-1]
  earlier = jnp.tril(jnp.ones((num, num), bool), k=-1)  # [m, m'] m' < m
  repeated = (indices[..., :, None] == indices[..., None, :]) & earlier
  return ~jnp.any(repeated, axis=-1)


def random_indices(rng: jax.Array, num_heads: int, length: int, num_random: int,
                   is_causal: bool) -> Array:
  """`[num_heads, length, num_random]` int32: for each head, row i holds draws
  uniform over [0, length) (over [0, i] when causal). Draws may repeat; a
  repeat counts once."""
  shape = (num_heads, length, num_random)
  if is_causal:
    uniform = jax.random.uniform(rng, shape)
    drawn = jnp.floor(uniform * (jnp.arange(length)[:, None] + 1)).astype(jnp.int32)
    return jnp.minimum(drawn, jnp.arange(length)[:, None])
  return jax.random.randint(rng, shape, 0, length, dtype=jnp.int32)


def _require_rng(variant: str, rng) -> jax.Array:
  if rng is None:
    raise ValueError(f"attention variant {variant!r} draws its pattern from rng: pass a PRNG "
                     f"key (MultiHeadAttention supplies its layer's key through the "
                     f"'extras' module LayerPattern).")
  return rng


def random_attention(query: Array, key: Array, value: Array, bias=None, mask=None, *,
                     is_causal: bool = False, query_seq_lengths=None,
                     key_value_seq_lengths=None, segment_ids=None, rng: jax.Array = None,
                     num_random: int = 16, window_size: Optional[int] = None,
                     scale: Optional[float] = None,
                     implementation: Optional[str] = None) -> Array:
  """Random attention (Zaheer et al. 2020), `query [B, T, H, D]`, `key/value
  [B, T, Hkv, D|Dv]` -> `[B, T, H, Dv]`: query i of head h attends to the keys
  `random_indices(rng, H, T, num_random, is_causal)[h, i]`, plus its window of
  `window_size` each side when given (blockwise; the random draws inside the
  window count once). Each head gathers its random keys, `[B, T, H, r, D]`:
  O(T (w + r)). In a model the key `rng` is its layer's (`LayerPattern`): a
  pattern per layer and head, fixed for the run.

  `implementation`: None, the gathered form above (the reference); or a kernel
  of `flex_attention` ("blockwise", ...), the drawn keys and the window its
  mask_mod (a draw is a set member, so draws inside the window count once
  there too). The drawn keys are spread over every tile, so no tile is
  skipped: O(T^2) work, O(T) memory; exact.
  """
  length = engine.self_attention_length("random", query, key)
  rng = _require_rng("random", rng)
  common.check_size("num_random", num_random, length=length)
  if window_size is not None:
    common.check_size("window_size", window_size, length=length)
  if implementation is not None:
    # The family's input rules, as the pure form (`engine.prepare`) and the
    # other variants' kernel path (`kernel.kernel_attention`) apply them:
    # flex_attention itself would take a dense bias and a pairwise mask.
    common.reject_unsupported("random", bias=bias)
    common.key_padding("random", mask, key_value_seq_lengths, query.shape[0], length)
    indices = random_indices(rng, query.shape[2], length, num_random, is_causal)
    drawn = lambda b, h, q_idx, kv_idx: jnp.any(indices[h, q_idx] == kv_idx)
    mask_mod = drawn if window_size is None else patterns.or_masks(
        drawn, patterns.Band(window_size, window_size))
    return flex_attention(query, key, value, mask_mod=mask_mod, bias=bias, mask=mask,
                          is_causal=is_causal, query_seq_lengths=query_seq_lengths,
                          key_value_seq_lengths=key_value_seq_lengths, segment_ids=segment_ids,
                          scale=scale, implementation=implementation)
  inputs = engine.prepare("random", query, key, value, bias, mask, is_causal=is_causal,
                          key_value_seq_lengths=key_value_seq_lengths, segment_ids=segment_ids,
                          scale=scale, multiple=window_size or 1)
  pad = [(0, 0), (0, inputs.padded_len - length), (0, 0)]
  indices = random_indices(rng, query.shape[2], length, num_random, inputs.is_causal)
  index_ok = jnp.pad(_first_draws(indices), pad)
  indices = jnp.pad(indices, pad)
  parts = []
  outside_window = None
  if window_size is not None:
    parts.append(engine.windowed_part(inputs, window_size, window_size, window_size))
    outside_window = lambda q, k: ~engine.keys_within(window_size, window_size)(q, k)
  allowed = engine.all_of(engine.causal_keys(inputs.is_causal), outside_window)
  parts.append(_gathered_keys_part(inputs, indices, index_ok, allowed))
  return engine.finish(engine.merge_parts(parts), inputs, query_seq_lengths, query.dtype)


BIGBIRD_PADDINGS = ("minimal", "lra_release")
BIGBIRD_CANDIDATES = ("exact", "lra_release")


def bigbird_global_blocks(num_blocks: int, num_global_blocks: int,
                          last_block_global: bool) -> np.ndarray:
  """The global block indices (sorted): the first `num_global_blocks`, and the
  last block when `last_block_global`."""
  blocks = set(range(num_global_blocks)) | ({num_blocks - 1} if last_block_global else set())
  return np.array(sorted(blocks), dtype=np.int64)


def bigbird_candidates(num_blocks: int, *, num_global_blocks: int = 1,
                       last_block_global: bool = True, is_causal: bool = False,
                       within_blocks: Optional[int] = None,
                       rule: str = "exact") -> np.ndarray:
  """`[num_blocks, num_blocks]` bool: the key blocks query block n may draw
  as random blocks.

  rule="exact": every block outside n's window (n - 1, n, n + 1) and the
  global blocks, before n - 1 when causal, and among the first
  `within_blocks` blocks when given; none for global query blocks (they
  attend to everything). rule="lra_release" also keeps, as the release's
  `get_block_rand_mask` (lra_benchmarks/models/bigbird/bigbird_attention.py)
  does, query blocks nb - 3 and nb - 2 to blocks <= L - 4 and <= L - 3, L the
  last block it may draw (L = min(nb, within_blocks) - 1); this narrows their
  range only when `within_blocks` cuts it.
  """
  if rule not in BIGBIRD_CANDIDATES:
    raise ValueError(f"bigbird: random_candidates must be one of {BIGBIRD_CANDIDATES}, got "
                     f"{rule!r}.")
  query_block = np.arange(num_blocks)[:, None]
  key_block = np.arange(num_blocks)[None, :]
  is_global = np.zeros(num_blocks, bool)
  is_global[bigbird_global_blocks(num_blocks, num_global_blocks, last_block_global)] = True
  ok = (np.abs(key_block - query_block) > 1) & ~is_global[None, :] & ~is_global[:, None]
  if is_causal:
    ok &= key_block < query_block
  if within_blocks is not None:
    ok &= key_block < within_blocks
  if rule == "lra_release":
    last = min(num_blocks, within_blocks or num_blocks) - 1
    # Its branches for query blocks 1 and 2 come before those for nb - 3 and nb - 2.
    for row, limit in ((num_blocks - 3, last - 4), (num_blocks - 2, last - 3)):
      if row > 2:
        ok[row] &= key_block[0] <= limit
  return ok


def bigbird_random_blocks(rng: jax.Array, num_heads: int, candidates: np.ndarray,
                          num_random_blocks: int) -> Array:
  """BigBird's random key blocks `[num_heads, nb, r]` int32: for every head
  and query block n, r distinct blocks drawn uniformly, without replacement,
  among `candidates[n]` (`bigbird_candidates`); -1 fills the row where fewer
  than r are candidates (all of them are then taken)."""
  num_blocks = candidates.shape[0]
  scores = jax.random.uniform(rng, (num_heads, num_blocks, num_blocks))
  # The r largest of i.i.d. uniform scores are a uniform r-subset.
  scores = jnp.where(jnp.asarray(candidates), scores, -1.0)
  top, blocks = jax.lax.top_k(scores, num_random_blocks)
  return jnp.where(top >= 0.0, blocks, -1).astype(jnp.int32)


def bigbird_attention(query: Array, key: Array, value: Array, bias=None, mask=None, *,
                      is_causal: bool = False, query_seq_lengths=None,
                      key_value_seq_lengths=None, segment_ids=None, rng: jax.Array = None,
                      block_size: int = 64, num_global_blocks: int = 1,
                      last_block_global: bool = True, num_random_blocks: int = 3,
                      random_blocks_within: Optional[int] = None,
                      block_padding: str = "minimal", random_candidates: str = "exact",
                      scale: Optional[float] = None,
                      implementation: Optional[str] = None) -> Array:
  """BigBird-ITC (Zaheer et al. 2020), `query [B, T, H, D]`, `key/value
  [B, T, Hkv, D|Dv]` -> `[B, T, H, Dv]`, in blocks of b = `block_size`.

  Query block n attends to key blocks n - 1, n, n + 1 (window), the global
  blocks (the first g = `num_global_blocks`, and the last one when
  `last_block_global`: the paper's ITC, 2 x 64 global tokens), which also
  attend to everything, and r = `num_random_blocks` random blocks per head:
  `bigbird_random_blocks(rng, H, bigbird_candidates(...), r)[h, n]`, exactly r
  distinct blocks outside the window and the global blocks (fewer only where
  fewer exist), from the first `random_blocks_within` tokens when given. In a
  model `rng` is its layer's (`LayerPattern`): a pattern per layer and head,
  fixed for the run, as BigBird's code. O(T b (3 + g + r)).

  block_padding: "minimal" pads T to a multiple of b; "lra_release" to
  T + b - (T mod b) as the release's `BigBirdAttention` (at least one padded
  position: with T a multiple of b its last, global block is all padding).
  Padded keys are masked either way. random_candidates: see `bigbird_candidates`.

  `implementation`: as in `local_attention`; the kernel's blocks are then
  BigBird's, and the drawn blocks join its layout at run time.
  """
  length = engine.self_attention_length("bigbird", query, key)
  kernel.check_implementation("bigbird", implementation)
  rng = _require_rng("bigbird", rng)
  common.check_size("block_size", block_size, length=length)
  if block_padding not in BIGBIRD_PADDINGS:
    raise ValueError(f"bigbird: block_padding must be one of {BIGBIRD_PADDINGS}, got "
                     f"{block_padding!r}.")
  pad_always = block_padding == "lra_release"
  num_blocks = length // block_size + 1 if pad_always else engine.ceil_div(length, block_size)
  engine.check_at_most("num_global_blocks", num_global_blocks, "the number of blocks", num_blocks,
                       minimum=0)
  engine.check_at_most("num_random_blocks", num_random_blocks, "the number of blocks", num_blocks,
                       minimum=0)
  within_blocks = None
  if random_blocks_within is not None:
    common.check_size("random_blocks_within", random_blocks_within, minimum=block_size)
    within_blocks = random_blocks_within // block_size
  candidates = bigbird_candidates(num_blocks, num_global_blocks=num_global_blocks,
                                  last_block_global=last_block_global, is_causal=is_causal,
                                  within_blocks=within_blocks, rule=random_candidates)
  global_blocks = bigbird_global_blocks(num_blocks, num_global_blocks, last_block_global)
  if implementation is not None:
    pattern = functools.reduce(operator.or_, [
        patterns.Global(n * block_size, (n + 1) * block_size) for n in global_blocks.tolist()],
                               patterns.NearBlocks(block_size, 1))
    drawn = None
    if num_random_blocks:
      # The kernel's blocks cover T; with "lra_release" padding BigBird's last
      # block may be all padding, which nobody needs to visit.
      kernel_blocks = engine.ceil_div(length, block_size)
      drawn = bigbird_random_blocks(rng, query.shape[2], candidates, num_random_blocks)
      drawn = jnp.where(drawn < kernel_blocks, drawn, -1)[:, :kernel_blocks]
    return kernel.kernel_attention("bigbird", pattern, query, key, value, bias, mask,
                                   implementation=implementation, block_size=block_size,
                                   extra_blocks=drawn, **kernel.call_masks(
                                       is_causal, query_seq_lengths, key_value_seq_lengths,
                                       segment_ids, scale))
  inputs = engine.prepare("bigbird", query, key, value, bias, mask, is_causal=is_causal,
                          key_value_seq_lengths=key_value_seq_lengths, segment_ids=segment_ids,
                          scale=scale, multiple=block_size, pad_always=pad_always)
  is_global = np.zeros(num_blocks, bool)
  is_global[global_blocks] = True
  not_global = lambda q, k: ~jnp.asarray(is_global)[k // block_size]
  parts = [_block_window_part(inputs, block_size, not_global)]
  if num_random_blocks:
    blocks = bigbird_random_blocks(rng, query.shape[2], candidates, num_random_blocks)
    query_, key_, value_, positions, key_ok, segments = _heads_as_stripes(inputs)
    part = engine.block_part(query_, key_, value_, positions, key_ok, segments, block_size, blocks,
                             engine.causal_keys(inputs.is_causal))
    parts.append(engine.map_part(_from_head_stripes, part))
  global_positions = (global_blocks[:, None] * block_size + np.arange(block_size)).ravel()
  out = engine.with_globals(inputs, global_positions, parts)
  return engine.finish(out, inputs, query_seq_lengths, query.dtype)


def _block_window_part(inputs: engine.Inputs, block: int,
                       extra: Optional[engine.Predicate]) -> engine.Part:
  """Query block n attends to all of key blocks n - 1, n, n + 1 (n - 1, n when causal)."""
  query, key, value, positions, key_ok, segments = engine.striped(inputs, 1)
  num_blocks = positions.shape[1] // block
  offsets = jnp.arange(-1, 1 if inputs.is_causal else 2)
  key_blocks = jnp.arange(num_blocks)[:, None] + offsets[None, :]
  part = engine.block_part(query, key, value, positions, key_ok, segments, block, key_blocks,
                           engine.all_of(engine.causal_keys(inputs.is_causal), extra))
  return engine.map_part(engine.from_stripes, part)


def pattern_key(kept: Array) -> jax.Array:
  """The PRNG key of a layer's pattern from its kept `[2]` float32 draw (its
  bits are the key's data)."""
  bits = jax.lax.bitcast_convert_type(jnp.asarray(kept, jnp.float32), jnp.uint32)
  return jax.random.wrap_key_data(bits, impl="threefry2x32")


def _draw_pattern_seed(rng: jax.Array) -> Array:
  # Kept as floats, as every array of the "random" collection: state that
  # is differentiated along with the parameters (zero gradient) must be.
  return jax.random.uniform(rng, (2,), jnp.float32)


class LayerPattern(nn.Module):
  """The PRNG key `random` and `bigbird` draw their pattern from: one per layer.

  Drawn by `common.layer_random` with `redraw_every=0`: at initialisation,
  from the "params" stream, and kept in the "random" collection as `[2]`
  float32 whose bits are the key (`pattern_key`), never redrawn, as
  BigBird's code fixes its pattern per layer. The key, not the pattern, is
  kept because the pattern's shape depends on T; the variant draws one
  pattern per head from it.
  """

  @nn.compact
  def __call__(self, query, key, value, deterministic: bool = True):
    del query, key, value
    seed = common.layer_random(self, "pattern_key", _draw_pattern_seed,
                               deterministic=deterministic, redraw_every=0)
    return {"rng": pattern_key(seed)}


registry.register(registry.VariantSpec(
    name="random", fn=random_attention, complexity="O(T (w + r))", paper="Zaheer et al. 2020",
    extras=LayerPattern,
    options=dict(num_random="random keys per query, drawn per layer and head",
                 window_size="also attend to this many keys each side; None for none",
                 implementation="None: the gathered form (the reference); 'blockwise', 'xla', "
                                "...: flex_attention with the draws as its mask_mod (O(T^2))",
                 **engine.SCALE_OPTION), **engine.SPARSE_SPEC))


registry.register(registry.VariantSpec(
    name="bigbird", fn=bigbird_attention, complexity="O(T b (3 + g + r))",
    paper="Zaheer et al. 2020", extras=LayerPattern,
    options=dict(block_size="tokens per block b", num_global_blocks="leading global blocks g",
                 last_block_global="the last block is global too (BigBird-ITC: the first and "
                                   "last block)",
                 num_random_blocks="random key blocks per query block r, distinct, outside the "
                                   "window and the global blocks, drawn per layer and head",
                 random_blocks_within="draw random blocks only among those within the first "
                                      "this many tokens; None for all",
                 block_padding="'minimal' (T padded to a multiple of b) or 'lra_release' "
                               "(T + b - T mod b, as the release)",
                 random_candidates="'exact' or 'lra_release' (the release's narrower ranges "
                                   "for query blocks nb - 3 and nb - 2)",
                 **engine.SCALE_OPTION, **kernel.KERNEL_OPTION),
    presets={"lra_release": registry.Preset(
        dict(block_size=64, num_random_blocks=3, random_blocks_within=1024,
             block_padding="lra_release", random_candidates="lra_release"),
        "the release's BigBirdAttention (lra_benchmarks/models/bigbird/bigbird_attention.py): "
        "blocks of 64, the first and last block global, 3 random blocks per head and layer "
        "drawn from the first 1024 tokens by get_block_rand_mask, T padded to "
        "T + 64 - T mod 64")},
    **engine.SPARSE_SPEC))
