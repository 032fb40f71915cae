"""Sparse attention: fixed (or drawn) patterns of allowed query-key pairs.

Every variant here is exact softmax attention restricted to its pattern, and
none builds a T x T array. The patterns are assembled from three ways of
computing a *partial* softmax over a subset of keys:

  * blocks (`_block_part`): queries split into blocks of `b`; each block
    attends to a few gathered key blocks (its neighbours for a band, drawn
    blocks for BigBird), with the exact pattern as a predicate over positions
    inside that small `[b, M b]` tile;
  * stripes (`_to_stripes`): positions with the same residue modulo `d` form a
    subsequence; a dilated band is a plain band on it, and the Sparse
    Transformer's strided pattern is full attention within it;
  * a dense part over an explicit small set of queries or keys (global tokens,
    the fixed pattern's summary columns).

Partial softmaxes over disjoint key sets are combined exactly by
`_merge_parts` (log-sum-exp merging); each pattern excludes from one side the
keys the other already covers.

All functions take self-attention only (Tq == Tk), key padding
(`key_value_seq_lengths` or a `[B|1, 1, 1, Tk]` mask), query padding,
`segment_ids` and grouped K/V heads; a dense `bias` or a pairwise `mask` is
refused. Sequences are padded internally to a multiple of the block sizes, and
the padded keys are masked.

`random` and `bigbird` draw their pattern per head from a PRNG key `rng`; in a
model that key is the layer's own, drawn once and kept (`LayerPattern`).
Options named after the LRA release reproduce what its code ran where that
differs from the papers (the `lra_release` presets, docs/lra_release.md).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
from typing import Callable, List, NamedTuple, Optional, Sequence, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from attention_jax import registry
from attention_jax.core import masks as mask_lib
from attention_jax.core import patterns
from attention_jax.variants import common
from attention_jax.variants.dense import prepare_inputs

Array = jnp.ndarray
# A pattern: (query positions, key positions) -> may attend, broadcasting.
Predicate = Callable[[Array, Array], Array]
# Logits from positions alone: (query positions, key positions) -> float32, broadcasting.
# The positions come as `[G, 1, Q, 1]` and `[G, 1, 1, K]`, so the logits may
# have a head axis (`[G, H, Q, K]`, per-head spans) or not (`[G, 1, Q, K]`).
PositionLogits = Callable[[Array, Array], Array]


# ----------------------------------------------------------------------------
# Inputs: checks, padding, key validity.


@dataclasses.dataclass(frozen=True)
class _Inputs:
  """Self-attention inputs padded to `padded_len`, with what each key may be.

  query: `[B, Tp, H, D]`, already multiplied by the logit scale.
  key, value: `[B, Tp, H, D|Dv]`, K/V heads repeated to H.
  key_ok: `[B, Tp]` bool, False for padding (given or added here).
  segments: `(q_segment_ids, kv_segment_ids)`, each `[B, Tp]`, or None.
  length: the unpadded T.
  """

  query: Array
  key: Array
  value: Array
  key_ok: Array
  segments: Optional[Tuple[Array, Array]]
  length: int
  is_causal: bool

  @property
  def padded_len(self) -> int:
    return self.query.shape[1]


def _prepare(variant: str, query: Array, key: Array, value: Array, bias, mask, *,
             is_causal: bool, key_value_seq_lengths, segment_ids, scale: Optional[float],
             multiple: int, offset: int = 0, pad_always: bool = False) -> _Inputs:
  """Validates the call and pads T so that T - `offset` is a multiple of
  `multiple`: the fewest positions, or with `pad_always` the LRA release's
  `T + b - (T mod b)` (at least one, a whole block when b divides T)."""
  common.reject_unsupported(variant, bias=bias)
  batch, q_len, num_heads, head_dim = query.shape
  kv_len = _self_attention_length(variant, query, key)
  key_ok = common.key_padding(variant, mask, key_value_seq_lengths, batch, kv_len)
  key_ok = jnp.ones((batch, kv_len), bool) if key_ok is None else key_ok
  key = common.repeat_kv_heads(key, num_heads)
  value = common.repeat_kv_heads(value, num_heads)
  scale = head_dim ** -0.5 if scale is None else scale
  query = query * jnp.asarray(scale, query.dtype)

  rest = q_len - offset
  padded_len = offset + (rest // multiple + 1 if pad_always else -(-rest // multiple)) * multiple
  pad = padded_len - q_len
  pad_time = lambda x: jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
  segments = None
  if segment_ids is not None:
    q_seg, kv_seg = mask_lib.split_segment_ids(segment_ids)
    for name, ids in (("segment_ids", q_seg), ("segment_ids", kv_seg)):
      if ids.shape != (batch, q_len):
        raise ValueError(f"{name} must have shape [B, T] = [{batch}, {q_len}], got "
                         f"{list(ids.shape)}.")
    segments = (pad_time(q_seg), pad_time(kv_seg))
  return _Inputs(query=pad_time(query), key=pad_time(key), value=pad_time(value),
                 key_ok=pad_time(key_ok), segments=segments, length=q_len,
                 is_causal=bool(is_causal))


def _self_attention_length(variant: str, query: Array, key: Array) -> int:
  """T, after checking that queries and keys have the same length."""
  q_len, kv_len = query.shape[1], key.shape[1]
  if q_len != kv_len:
    raise ValueError(f"attention variant {variant!r} is self-attention only: the query length "
                     f"({q_len}) must equal the key/value length ({kv_len}).")
  return q_len


def _finish(out: Array, inputs: _Inputs, query_seq_lengths, dtype) -> Array:
  """`[B, Tp, H, Dv]` -> `[B, T, H, Dv]` in `dtype`, padded queries zeroed."""
  out = out[:, :inputs.length].astype(dtype)
  return common.zero_padded_queries(out, query_seq_lengths)


# ----------------------------------------------------------------------------
# Partial softmaxes and their exact merge.


class _Part(NamedTuple):
  """Softmax over a subset of keys, unnormalised: for each query and head,
  `acc = sum_k exp(s_k - row_max) v_k` `[..., H, Dv]`, `row_max` (a constant,
  -inf when no key is allowed) and `total = sum_k exp(s_k - row_max)` `[..., H]`."""

  acc: Array
  row_max: Array
  total: Array


def _finite(x: Array) -> Array:
  return jnp.where(jnp.isfinite(x), x, 0.0)


def _dense_part(query: Array, key: Array, value: Array, q_pos: Array, k_pos: Array,
                key_ok: Array, q_seg: Optional[Array], k_seg: Optional[Array],
                allowed: Optional[Predicate],
                position_logits: Optional[PositionLogits] = None) -> _Part:
  """Each query of a group attends to the allowed keys of the same group.

  Args:
    query: `[B, G, Q, H, D]` (scaled); key `[B, G, K, H, D]`; value `[B, G, K, H, Dv]`.
    q_pos: `[G, Q]`, k_pos: `[G, K]` positions in the sequence (for `allowed`).
    key_ok: `[B, G, K]` keys that exist (not padding, inside the sequence).
    q_seg, k_seg: `[B, G, Q]`, `[B, G, K]` segment ids, or None.
    allowed: the pattern over positions, or None for every pair.
    position_logits: logits that depend on the positions only (and perhaps the
      head), added to q . k; see `PositionLogits`.

  Returns:
    A `_Part` with leading dims `[B, G, Q]`.
  """
  logits = jnp.einsum("bgqhd,bgkhd->bghqk", query, key, preferred_element_type=jnp.float32)
  if position_logits is not None:
    logits = logits + position_logits(q_pos[:, None, :, None], k_pos[:, None, None, :])[None]
  ok = key_ok[:, :, None, None, :]
  if allowed is not None:
    ok = ok & allowed(q_pos[:, :, None], k_pos[:, None, :])[None, :, None]
  if q_seg is not None:
    ok = ok & (q_seg[:, :, None, :, None] == k_seg[:, :, None, None, :])
  logits = jnp.where(ok, logits, -jnp.inf)
  # As in core.masked_softmax: the maximum only stabilises the exponent.
  row_max = jax.lax.stop_gradient(jnp.max(logits, axis=-1))
  weights = jnp.exp(logits - _finite(row_max)[..., None])
  acc = jnp.einsum("bghqk,bgkhd->bgqhd", weights.astype(value.dtype), value,
                   preferred_element_type=jnp.float32)
  to_query_major = lambda x: jnp.swapaxes(x, 2, 3)  # [B, G, H, Q] -> [B, G, Q, H]
  return _Part(acc, to_query_major(row_max), to_query_major(jnp.sum(weights, axis=-1)))


def _merge_parts(parts: Sequence[_Part]) -> Array:
  """One exact softmax over the union of the parts' (disjoint) key sets.

  Each part's sums are rescaled from its own row maximum to the common one:
  `exp(m_i - m) * sum_k exp(s_k - m_i) = sum_k exp(s_k - m)`. The maxima are
  constants, so the rescaling is exact in value and gradient; a part with no
  allowed key (m_i = -inf) contributes zero. m is the largest of the parts'
  own maxima, so the part holding it keeps its own scale and the common
  normaliser is at least 1. (An empty part must not enter m as 0: with every
  allowed logit far below 0, the normaliser underflowed towards 0 and the
  quotient rule's 1 / normaliser^2 made the gradient NaN.)

  Returns:
    `[..., H, Dv]` float32; queries with no allowed key at all give zeros.
  """
  row_max = parts[0].row_max
  for part in parts[1:]:
    row_max = jnp.maximum(row_max, part.row_max)
  row_max = _finite(row_max)
  acc = total = 0.0
  for part in parts:
    rescale = jnp.where(jnp.isfinite(part.row_max), jnp.exp(_finite(part.row_max) - row_max), 0.0)
    acc = acc + part.acc * rescale[..., None]
    total = total + part.total * rescale
  return acc / jnp.where(total == 0.0, 1.0, total)[..., None]


# ----------------------------------------------------------------------------
# Patterns (predicates over positions) and ways of computing them.


def _all_of(*predicates: Optional[Predicate]) -> Optional[Predicate]:
  predicates = [p for p in predicates if p is not None]
  if not predicates:
    return None

  def allowed(q_pos, k_pos):
    result = predicates[0](q_pos, k_pos)
    for predicate in predicates[1:]:
      result = result & predicate(q_pos, k_pos)
    return result
  return allowed


def _causal(is_causal: bool) -> Optional[Predicate]:
  return (lambda q, k: k <= q) if is_causal else None


def _window(left: int, right: int) -> Predicate:
  """Keys in [q - left, q + right]."""
  return lambda q, k: (k >= q - left) & (k <= q + right)


def _keys_from(first: int) -> Predicate:
  """Keys at positions >= first (the ones global columns do not already cover)."""
  return lambda q, k: k >= first


def _to_stripes(x: Array, stride: int) -> Array:
  """`[B, T, ...]` -> `[B, stride, T / stride, ...]`: stripe r holds positions
  r, r + stride, r + 2 stride, ..."""
  batch, length = x.shape[:2]
  x = x.reshape(batch, length // stride, stride, *x.shape[2:])
  return jnp.swapaxes(x, 1, 2)


def _from_stripes(x: Array) -> Array:
  """Inverse of `_to_stripes`."""
  batch, stride, length = x.shape[:3]
  return jnp.swapaxes(x, 1, 2).reshape(batch, stride * length, *x.shape[3:])


def _striped(inputs: _Inputs, stride: int):
  """The inputs as `stride` stripes: q/k/v `[B, S, T/S, H, D]`, positions
  `[S, T/S]`, key_ok `[B, S, T/S]`, segments likewise (or None)."""
  positions = _to_stripes(jnp.arange(inputs.padded_len)[None], stride)[0]
  segments = None
  if inputs.segments is not None:
    segments = tuple(_to_stripes(s, stride) for s in inputs.segments)
  return (_to_stripes(inputs.query, stride), _to_stripes(inputs.key, stride),
          _to_stripes(inputs.value, stride), positions, _to_stripes(inputs.key_ok, stride),
          segments)


def _map_part(fn: Callable[[Array], Array], part: _Part) -> _Part:
  return _Part(*(fn(x) for x in part))


def _block_part(query: Array, key: Array, value: Array, positions: Array, key_ok: Array,
                segments: Optional[Tuple[Array, Array]], block: int, key_blocks: Array,
                allowed: Optional[Predicate],
                position_logits: Optional[PositionLogits] = None) -> _Part:
  """Blocks of queries attend to gathered blocks of keys.

  Args:
    query, key, value: `[B, S, L, H, D]` (S stripes of length L, a multiple of `block`).
    positions: `[S, L]`; key_ok: `[B, S, L]`; segments: pair of `[B, S, L]` or None.
    block: the block size b.
    key_blocks: `[L / b, M]` int, or `[S, L / b, M]` for blocks of each
      stripe: query block n attends to key blocks `key_blocks[n]`; indices
      outside [0, L / b) stand for nothing.
    allowed: the exact pattern inside the gathered `[b, M b]` tiles.
    position_logits: logits from the positions, added to q . k (see `_dense_part`).

  Returns:
    A `_Part` with leading dims `[B, S, L]`. Cost: O(S L M b) scores.
  """
  batch, stripes, length = query.shape[:3]
  num_blocks, per_query = key_blocks.shape[-2], key_blocks.shape[-1]
  inside = (key_blocks >= 0) & (key_blocks < num_blocks)
  gather_index = jnp.clip(key_blocks, 0, num_blocks - 1)
  per_stripe = key_blocks.ndim == 3

  def query_blocks(x):  # [B, S, L, ...] -> [B, S * nb, b, ...]
    return x.reshape(x.shape[0], stripes * num_blocks, block, *x.shape[3:])

  def gathered(x):  # [B, S, L, ...] -> [B, S * nb, M * b, ...]
    x = x.reshape(x.shape[0], stripes, num_blocks, block, *x.shape[3:])
    if per_stripe:  # stripe s gathers its own blocks: [B, S, nb, M, b, ...]
      x = x[:, jnp.arange(stripes)[:, None, None], gather_index]
    else:
      x = x[:, :, gather_index]
    return x.reshape(x.shape[0], stripes * num_blocks, per_query * block, *x.shape[5:])

  inside_keys = jnp.repeat(inside, block, axis=-1)  # [(S,) nb, M b]
  inside_keys = (inside_keys.reshape(stripes * num_blocks, per_query * block) if per_stripe
                 else jnp.tile(inside_keys, (stripes, 1)))
  key_ok_tiles = gathered(key_ok) & inside_keys[None]
  pos = positions[None]
  q_seg, k_seg = (None, None) if segments is None else (
      query_blocks(segments[0]), gathered(segments[1]))
  part = _dense_part(query_blocks(query), gathered(key), gathered(value),
                     query_blocks(pos)[0], gathered(pos)[0], key_ok_tiles, q_seg, k_seg,
                     allowed, position_logits)
  return _map_part(lambda x: x.reshape(batch, stripes, length, *x.shape[3:]), part)


def _windowed_part(inputs: _Inputs, left: int, right: int, block: int, dilation: int = 1,
                   extra: Optional[Predicate] = None,
                   position_logits: Optional[PositionLogits] = None) -> _Part:
  """Query i attends to keys i + dilation * m, -left <= m <= right (right = 0
  when causal), and `extra`; blockwise on the stripes of `dilation`.

  Each query block gathers the ceil(left / b) + ceil(right / b) + 1 key blocks
  that hold its window (3 when b = w, 2 when causal). The padded length must
  be a multiple of `block * dilation`. Cost: O(T (left + right + b)) scores.
  """
  right = 0 if inputs.is_causal else right
  query, key, value, positions, key_ok, segments = _striped(inputs, dilation)
  num_blocks = positions.shape[1] // block
  offsets = jnp.arange(-_ceil_div(left, block), _ceil_div(right, block) + 1)
  key_blocks = jnp.arange(num_blocks)[:, None] + offsets[None, :]
  # Keys of one stripe are `dilation` apart, so a window of m stripe steps is
  # m * dilation positions.
  allowed = _all_of(_window(left * dilation, right * dilation), _causal(inputs.is_causal), extra)
  part = _block_part(query, key, value, positions, key_ok, segments, block, key_blocks, allowed,
                     position_logits)
  return _map_part(_from_stripes, part)


def _check_at_most(name: str, value: int, limit_name: str, limit: int, minimum: int = 1) -> int:
  """Like `common.check_size`, for a size bounded by another option rather than by T."""
  common.check_size(name, value, minimum=minimum)
  if value > limit:
    raise ValueError(f"{name}={value} must be at most {limit_name}={limit}.")
  return value


def _ceil_div(a: int, b: int) -> int:
  return -(-a // b)


def _own_block_part(inputs: _Inputs, block: int, extra: Optional[Predicate] = None) -> _Part:
  """Query block n attends to key block n (lower triangle when causal). O(T b)."""
  num_blocks = inputs.padded_len // block
  query, key, value, positions, key_ok, segments = _striped(inputs, 1)
  part = _block_part(query, key, value, positions, key_ok, segments, block,
                     jnp.arange(num_blocks)[:, None], _all_of(_causal(inputs.is_causal), extra))
  return _map_part(_from_stripes, part)


def _columns_part(inputs: _Inputs, columns: np.ndarray, allowed: Optional[Predicate]) -> _Part:
  """Every query attends to the keys at the C positions `columns`. Cost O(T C)."""
  cols = jnp.asarray(columns, jnp.int32)
  segments = (None, None)
  if inputs.segments is not None:
    segments = (inputs.segments[0][:, None], inputs.segments[1][:, cols][:, None])
  part = _dense_part(inputs.query[:, None], inputs.key[:, cols][:, None],
                     inputs.value[:, cols][:, None], jnp.arange(inputs.padded_len)[None],
                     cols[None], inputs.key_ok[:, cols][:, None], *segments, allowed)
  return _map_part(lambda x: x[:, 0], part)


def _gathered_keys_part(inputs: _Inputs, indices: Array, index_ok: Array,
                        allowed: Optional[Predicate]) -> _Part:
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
  part = _dense_part(query, key, value, q_pos, k_pos, key_ok, *segments, allowed)
  # [B, Tp * H, 1, 1, ...] -> [B, Tp, H, ...]
  return _map_part(lambda x: x.reshape(batch, padded_len, num_heads, *x.shape[4:]), part)


def _global_rows(inputs: _Inputs, positions: np.ndarray) -> Array:
  """Outputs `[B, G, H, Dv]` of the queries at the G `positions`, which attend
  to every key. O(G T)."""
  rows = jnp.asarray(positions, jnp.int32)
  every = jnp.arange(inputs.padded_len)
  segments = (None, None)
  if inputs.segments is not None:
    segments = (inputs.segments[0][:, None, rows], inputs.segments[1][:, None])
  part = _dense_part(inputs.query[:, None, rows], inputs.key[:, None],
                     inputs.value[:, None], rows[None], every[None],
                     inputs.key_ok[:, None], *segments, _causal(inputs.is_causal))
  return _merge_parts([_map_part(lambda x: x[:, 0], part)])


def _with_globals(inputs: _Inputs, num_global, local_parts: Sequence[_Part]) -> Array:
  """Global tokens attend to all and are attended by all; the other queries
  attend to them plus `local_parts` (which must exclude the global keys).

  Args:
    num_global: g, for the first g tokens, or the global positions (numpy ints).

  Returns `[B, Tp, H, Dv]` float32.
  """
  positions = np.arange(num_global) if np.isscalar(num_global) else np.asarray(num_global)
  if positions.size == 0:
    return _merge_parts(local_parts)
  columns = _columns_part(inputs, positions, _causal(inputs.is_causal))
  out = _merge_parts([*local_parts, columns])
  return out.at[:, positions].set(_global_rows(inputs, positions))


def _head_range(inputs: _Inputs, start: int, stop: int) -> _Inputs:
  return dataclasses.replace(inputs, query=inputs.query[:, :, start:stop],
                             key=inputs.key[:, :, start:stop], value=inputs.value[:, :, start:stop])


def _concat_heads(parts: Sequence[_Part]) -> _Part:
  """Parts of disjoint head ranges, `[B, T, h_i, ...]` -> `[B, T, H, ...]`."""
  return _Part(*(jnp.concatenate(xs, axis=2) for xs in zip(*parts)))


def _tail(inputs: _Inputs, start: int, *, is_causal: bool) -> _Inputs:
  """The positions from `start` on, as a sequence of their own (position
  `start` becomes 0), causal as `is_causal`."""
  segments = None if inputs.segments is None else tuple(s[:, start:] for s in inputs.segments)
  return dataclasses.replace(inputs, query=inputs.query[:, start:], key=inputs.key[:, start:],
                             value=inputs.value[:, start:], key_ok=inputs.key_ok[:, start:],
                             segments=segments, length=inputs.length - start,
                             is_causal=is_causal)


def _pad_front(part: _Part, count: int) -> _Part:
  """`count` rows that attend to nothing before `part`'s `[B, T, ...]` rows."""
  pad = lambda x, fill: jnp.pad(x, [(0, 0), (count, 0)] + [(0, 0)] * (x.ndim - 2),
                                constant_values=fill)
  return _Part(pad(part.acc, 0.0), pad(part.row_max, -jnp.inf), pad(part.total, 0.0))


def _heads_as_stripes(inputs: _Inputs):
  """`_striped`'s layout with one stripe per head (and one head per stripe),
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


# ----------------------------------------------------------------------------
# The variants.

# ----------------------------------------------------------------------------
# The block-sparse kernels: the same patterns as predicates (core/patterns.py),
# computed by the flash kernel over only the blocks they allow.

# block_sparse.IMPLEMENTATIONS (the kernels cannot be imported here; a test checks).
KERNEL_IMPLEMENTATIONS = ("blockwise", "pallas_gpu", "pallas_tpu")


def _check_implementation(variant: str, implementation: Optional[str]):
  if implementation is not None and implementation not in KERNEL_IMPLEMENTATIONS:
    raise ValueError(f"{variant}: implementation must be None (the pure-JAX form) or one of "
                     f"{KERNEL_IMPLEMENTATIONS}, got {implementation!r}.")


def _kernel_attention(variant: str, pattern: patterns.Pattern, query: Array, key: Array,
                      value: Array, bias, mask, *, implementation: str, is_causal: bool,
                      query_seq_lengths, key_value_seq_lengths, segment_ids, scale,
                      block_size: Optional[int] = None,
                      extra_blocks: Optional[Array] = None) -> Array:
  """`variant` under `pattern` through the block-sparse flash kernel
  (kernels/flash_attention/block_sparse.py), with this module's input rules:
  self-attention, no bias, a key-padding mask at most."""
  # The kernels import the variants, so they are imported here, on use.
  # pylint: disable-next=import-outside-toplevel
  from attention_jax.kernels.flash_attention import block_sparse, common as kernel_common
  common.reject_unsupported(variant, bias=bias)
  length = _self_attention_length(variant, query, key)
  key_ok = common.key_padding(variant, mask, key_value_seq_lengths, query.shape[0], length)
  inputs, _ = prepare_inputs(
      query, key, value, None, None if key_ok is None else key_ok[:, None, None, :],
      scale=scale, is_causal=is_causal, query_seq_lengths=query_seq_lengths,
      segment_ids=segment_ids)
  block_sizes = None if block_size is None else kernel_common.BlockSizes(block_size, block_size)
  return block_sparse.block_sparse_attention(inputs, pattern, implementation=implementation,
                                             block_sizes=block_sizes, extra_blocks=extra_blocks)


def _call_masks(is_causal, query_seq_lengths, key_value_seq_lengths, segment_ids, scale):
  """The masking arguments every variant here passes on to `_kernel_attention`."""
  return dict(is_causal=is_causal, query_seq_lengths=query_seq_lengths,
              key_value_seq_lengths=key_value_seq_lengths, segment_ids=segment_ids, scale=scale)


LOCAL_PATTERNS = ("sliding", "release_strided")


def local_attention(query: Array, key: Array, value: Array, bias=None, mask=None, *,
                    is_causal: bool = False, query_seq_lengths=None,
                    key_value_seq_lengths=None, segment_ids=None, window_size: int = 64,
                    pattern: str = "sliding", block_size: Optional[int] = None,
                    scale: Optional[float] = None, implementation: Optional[str] = None) -> Array:
  """Local attention, `query [B, T, H, D]`, `key/value [B, T, Hkv, D|Dv]` -> `[B, T, H, Dv]`.

  pattern="sliding" (the method): query i sees keys [i - w, i + w] ([i - w, i]
  when causal), w = `window_size` (Parmar et al. 2018). Blockwise: queries in
  blocks of w attend to their own and neighbouring key blocks
  (`[B, T/w, 3w, H, D]`, 2w when causal), O(T w).

  pattern="release_strided": what the LRA release's `LocalAttention`
  (lra_benchmarks/models/local/local_attention.py) computes. It pads T to
  T' = T + b - (T mod b), b = `block_size` (always at least one position),
  and reshapes `[T', ...]` to `[b, T'/b, ...]`, attending over the first axis:
  the b keys of query i are the positions = i (mod T'/b), spread over the
  whole sequence, not a neighbourhood (T = 2001, b = 50: token 1000 sees 16,
  57, 98, ...). Computed as full attention within each of the T'/b stripes,
  O(T b); `window_size` is not used. Unlike the release, padded keys (given
  and added) are masked, and causal keeps j <= i within the stripe.

  implementation: None computes the forms above; "blockwise" the flash kernel
  over the blocks that `local_pattern` allows (kernels/flash_attention/block_sparse.py).
  """
  length = _self_attention_length("local", query, key)
  _check_implementation("local", implementation)
  pattern_ = local_pattern(length, window_size=window_size, pattern=pattern,
                           block_size=block_size)
  if implementation is not None:
    return _kernel_attention("local", pattern_, query, key, value, bias, mask,
                             implementation=implementation, **_call_masks(
                                 is_causal, query_seq_lengths, key_value_seq_lengths,
                                 segment_ids, scale))
  if pattern == "sliding":
    inputs = _prepare("local", query, key, value, bias, mask, is_causal=is_causal,
                      key_value_seq_lengths=key_value_seq_lengths, segment_ids=segment_ids,
                      scale=scale, multiple=window_size)
    out = _merge_parts([_windowed_part(inputs, window_size, window_size, window_size)])
    return _finish(out, inputs, query_seq_lengths, query.dtype)
  inputs = _prepare("local", query, key, value, bias, mask, is_causal=is_causal,
                    key_value_seq_lengths=key_value_seq_lengths, segment_ids=segment_ids,
                    scale=scale, multiple=block_size, pad_always=True)
  # The release's reshape to [b, T'/b]: position a * (T'/b) + n is row a of
  # group n, i.e. group n is the stripe of positions = n (mod T'/b).
  query_, key_, value_, positions, key_ok, segments = _striped(
      inputs, inputs.padded_len // block_size)
  segments = (None, None) if segments is None else segments
  part = _dense_part(query_, key_, value_, positions, positions, key_ok, *segments,
                     _causal(inputs.is_causal))
  out = _merge_parts([_map_part(_from_stripes, part)])
  return _finish(out, inputs, query_seq_lengths, query.dtype)


def local_pattern(length: int, *, window_size: int = 64, pattern: str = "sliding",
                  block_size: Optional[int] = None) -> patterns.Pattern:
  """The pairs `local_attention` allows at length T (checking the options)."""
  if pattern not in LOCAL_PATTERNS:
    raise ValueError(f"local: pattern must be one of {LOCAL_PATTERNS}, got {pattern!r}.")
  if pattern == "sliding":
    if block_size is not None:
      raise ValueError(f"local: block_size applies to pattern='release_strided' only, got "
                       f"block_size={block_size!r} with pattern='sliding'.")
    common.check_size("window_size", window_size, length=length)
    return patterns.Band(window_size, window_size)
  if block_size is None:
    raise ValueError("local: pattern='release_strided' needs block_size (the release's "
                     "block_size: 50 on the text tasks, 64 on the image ones), got None.")
  common.check_size("block_size", block_size, length=length)
  # The release's T' = T + b - (T mod b) in b rows: stripes of period T' / b.
  return patterns.SameResidue((length + block_size - length % block_size) // block_size)


def band_attention(variant: str, query: Array, key: Array, value: Array, left: int, right: int,
                   *, position_logits: Optional[PositionLogits] = None,
                   allowed: Optional[Predicate] = None, mask=None, is_causal: bool = False,
                   query_seq_lengths=None, key_value_seq_lengths=None, segment_ids=None,
                   scale: Optional[float] = None, block_size: Optional[int] = None,
                   reach: Optional[Array] = None) -> Array:
  """Self-attention over the band of keys [i - left, i + right] of query i.

  out_i = sum_j softmax_j(q_i . k_j * scale + position_logits(i, j)) v_j over
  the keys j of the band that `allowed(i, j)` and the masks let through.
  Computed as `local`'s band, blockwise with blocks of `block_size`
  (max(left, right, 1) when None): O(T (left + right)), no T x T array. A
  position logit of -inf removes a key.

  `reach`, a traced scalar, says that no key at distance >= reach can have
  weight (its position logit is -inf): the band is then computed one key
  block offset at a time, each under `lax.cond`, and an offset whose nearest
  key is that far is skipped, forward and backward. The shapes stay those of
  the static band; the work follows `reach` (adaptive span's largest span).

  Args:
    variant: the caller's name, for error messages.
    query: `[B, T, H, D]`; key: `[B, T, Hkv, D]`; value: `[B, T, Hkv, Dv]`.
    left, right: the band, >= 0 (right = 0 when causal).
    position_logits: `(q_pos, k_pos) -> logits` (`PositionLogits`), or None.
    allowed: a further pattern inside the band, or None.
    mask, is_causal, query_seq_lengths, key_value_seq_lengths, segment_ids:
      as in `local_attention` (a key-padding mask only).
    scale: multiplies q . k; 1/sqrt(D) when None.
    block_size: the blocks' length b, an int >= 1.
    reach: distance from which keys have no weight, or None.

  Returns:
    `[B, T, H, Dv]` in the query dtype.
  """
  _self_attention_length(variant, query, key)
  common.check_size("left", left, minimum=0)
  common.check_size("right", right, minimum=0)
  block = max(left, right, 1) if block_size is None else common.check_size("block_size",
                                                                            block_size)
  inputs = _prepare(variant, query, key, value, None, mask, is_causal=is_causal,
                    key_value_seq_lengths=key_value_seq_lengths, segment_ids=segment_ids,
                    scale=scale, multiple=block)
  if reach is None:
    parts = [_windowed_part(inputs, left, right, block, extra=allowed,
                            position_logits=position_logits)]
  else:
    parts = _offset_parts(inputs, left, right, block, reach, allowed, position_logits)
  return _finish(_merge_parts(parts), inputs, query_seq_lengths, query.dtype)


def _offset_parts(inputs: _Inputs, left: int, right: int, block: int, reach: Array,
                  extra: Optional[Predicate],
                  position_logits: Optional[PositionLogits]) -> List[_Part]:
  """The band as one part per key block offset o (query block n, key block
  n + o), each computed only when its nearest key, (|o| - 1) b + 1 away, is
  nearer than `reach`; a skipped offset is an empty part."""
  right = 0 if inputs.is_causal else right
  query, key, value, positions, key_ok, segments = _striped(inputs, 1)
  num_blocks = positions.shape[1] // block
  allowed = _all_of(_window(left, right), _causal(inputs.is_causal), extra)
  reach = jax.lax.stop_gradient(jnp.asarray(reach, jnp.float32))

  def offset_part(offset: int) -> _Part:
    key_blocks = jnp.arange(num_blocks)[:, None] + offset
    return _map_part(_from_stripes, _block_part(query, key, value, positions, key_ok, segments,
                                                block, key_blocks, allowed, position_logits))

  parts = []
  for offset in range(-_ceil_div(left, block), _ceil_div(right, block) + 1):
    if offset == 0:  # the query's own block: always within reach
      parts.append(offset_part(0))
      continue
    shapes = jax.eval_shape(offset_part, offset)
    empty = _Part(jnp.zeros(shapes.acc.shape, shapes.acc.dtype),
                  jnp.full(shapes.row_max.shape, -jnp.inf, shapes.row_max.dtype),
                  jnp.zeros(shapes.total.shape, shapes.total.dtype))
    nearest = (abs(offset) - 1) * block + 1
    parts.append(jax.lax.cond(nearest < reach, lambda o=offset: offset_part(o),
                              lambda e=empty: e))
  return parts


def positional_band_attention(variant: str, value: Array, num_heads: int,
                              position_logits: PositionLogits, left: int, right: int, *,
                              allowed: Optional[Predicate] = None, mask=None,
                              is_causal: bool = False, query_seq_lengths=None,
                              key_value_seq_lengths=None, segment_ids=None) -> Array:
  """Self-attention whose logits depend on the positions only, over a band.

  out_i = sum_j softmax_j(position_logits(i, j)) v_j over the keys j in
  [i - left, i + right] that `allowed(i, j)` and the masks let through; no
  queries or keys (a fixed prior such as hard-coded Gaussian attention).
  `band_attention` with zero-width queries and keys.

  Args:
    variant: the caller's name, for error messages.
    value: `[B, T, Hkv, Dv]`; query head h uses value head h // (H // Hkv).
    num_heads: H.
    position_logits: `(q_pos, k_pos) -> logits` (`PositionLogits`), float32.
    left, right, allowed, mask, is_causal, query_seq_lengths,
      key_value_seq_lengths, segment_ids: as in `band_attention`.

  Returns:
    `[B, T, H, Dv]` in the value dtype.
  """
  batch, length, num_kv_heads = value.shape[:3]
  # Zero-width queries and keys: their dot products are zeros, which leaves
  # only the position logits, at no cost.
  no_query = jnp.zeros((batch, length, num_heads, 0), value.dtype)
  no_key = jnp.zeros((batch, length, num_kv_heads, 0), value.dtype)
  return band_attention(variant, no_query, no_key, value, left, right,
                        position_logits=position_logits, allowed=allowed, mask=mask,
                        is_causal=is_causal, query_seq_lengths=query_seq_lengths,
                        key_value_seq_lengths=key_value_seq_lengths, segment_ids=segment_ids,
                        scale=1.0)


def block_local_attention(query: Array, key: Array, value: Array, bias=None, mask=None, *,
                          is_causal: bool = False, query_seq_lengths=None,
                          key_value_seq_lengths=None, segment_ids=None, block_size: int = 64,
                          scale: Optional[float] = None,
                          implementation: Optional[str] = None) -> Array:
  """Blockwise self-attention (Qiu et al. 2019): non-overlapping blocks of
  `block_size` tokens attend only within their block (lower triangle when
  causal). T is padded to a multiple of the block size; the last, shorter
  block attends within itself. O(T b). `implementation`: as in `local_attention`.
  """
  length = _self_attention_length("block_local", query, key)
  _check_implementation("block_local", implementation)
  common.check_size("block_size", block_size, length=length)
  if implementation is not None:
    return _kernel_attention("block_local", patterns.SameBlock(block_size), query, key, value,
                             bias, mask, implementation=implementation, **_call_masks(
                                 is_causal, query_seq_lengths, key_value_seq_lengths,
                                 segment_ids, scale))
  inputs = _prepare("block_local", query, key, value, bias, mask, is_causal=is_causal,
                    key_value_seq_lengths=key_value_seq_lengths, segment_ids=segment_ids,
                    scale=scale, multiple=block_size)
  out = _merge_parts([_own_block_part(inputs, block_size)])
  return _finish(out, inputs, query_seq_lengths, query.dtype)


def dilated_attention(query: Array, key: Array, value: Array, bias=None, mask=None, *,
                      is_causal: bool = False, query_seq_lengths=None,
                      key_value_seq_lengths=None, segment_ids=None, window_size: int = 32,
                      dilation: int = 2, scale: Optional[float] = None,
                      implementation: Optional[str] = None) -> Array:
  """Dilated sliding window (Beltagy et al. 2020): query i sees keys
  i + d m for |m| <= w (m <= 0 when causal), d = `dilation`, w = `window_size`.

  Those keys share i's residue modulo d, so the sequence is split into d
  stripes (positions r, r + d, ...) and each runs the blockwise band of w:
  O(T w) with no per-query gather. `implementation`: as in `local_attention`.
  """
  length = _self_attention_length("dilated", query, key)
  _check_implementation("dilated", implementation)
  common.check_size("window_size", window_size, length=length)
  common.check_size("dilation", dilation, length=length)
  if implementation is not None:
    band = patterns.Band(window_size, window_size, dilation)
    return _kernel_attention("dilated", band, query, key, value, bias, mask,
                             implementation=implementation, **_call_masks(
                                 is_causal, query_seq_lengths, key_value_seq_lengths,
                                 segment_ids, scale))
  inputs = _prepare("dilated", query, key, value, bias, mask, is_causal=is_causal,
                    key_value_seq_lengths=key_value_seq_lengths, segment_ids=segment_ids,
                    scale=scale, multiple=window_size * dilation)
  out = _merge_parts([_windowed_part(inputs, window_size, window_size, window_size, dilation)])
  return _finish(out, inputs, query_seq_lengths, query.dtype)


def _default_stride(length: int) -> int:
  """ceil(sqrt(T)): the Sparse Transformer's l ~ sqrt(T)."""
  return max(1, math.isqrt(length - 1) + 1) if length > 1 else 1


COMBINES = ("interleaved", "merged", "per_head")


def _factorized(variant: str, inputs: _Inputs, first: Callable[..., _Part],
                second: Callable[..., _Part], pattern_names: Tuple[str, str], combine: str,
                pattern: Optional[str], layer_index: Optional[int]) -> List[_Part]:
  """Combines a Sparse Transformer's two factorised patterns.

  `first(inputs)` and `second(inputs, exclusive)` compute partial softmaxes;
  `exclusive=True` leaves out the keys `first` already covers, so that the
  merged union counts each key once. Returns the parts to merge.
  """
  num_heads = inputs.query.shape[2]
  chosen = _factorized_choice(variant, pattern_names, combine, pattern, layer_index, num_heads)
  if chosen in pattern_names:
    return [first(inputs) if chosen == pattern_names[0] else second(inputs, False)]
  if chosen == "merged":
    return [first(inputs), second(inputs, True)]
  half = num_heads // 2
  return [_concat_heads([first(_head_range(inputs, 0, half)),
                         second(_head_range(inputs, half, num_heads), False)])]


def _factorized_choice(variant: str, pattern_names: Tuple[str, str], combine: str,
                       pattern: Optional[str], layer_index: Optional[int], num_heads: int) -> str:
  """Checks the options of a factorised pattern; returns "merged", "per_head"
  or, interleaved, the name of the one pattern this layer uses."""
  if combine not in COMBINES:
    raise ValueError(f"{variant}: combine must be one of {COMBINES}, got {combine!r}.")
  if combine != "interleaved" and (pattern is not None or layer_index is not None):
    raise ValueError(f"{variant}: pattern and layer_index choose a pattern only with "
                     f"combine='interleaved', got combine={combine!r}.")
  if combine == "interleaved":
    if (pattern is None) == (layer_index is None):
      raise ValueError(f"{variant}: combine='interleaved' needs exactly one of layer_index "
                       f"(even layers use {pattern_names[0]!r}, odd ones {pattern_names[1]!r}) "
                       f"or pattern (one of {pattern_names}).")
    if pattern is None:
      pattern = pattern_names[layer_index % 2]
    if pattern not in pattern_names:
      raise ValueError(f"{variant}: pattern must be one of {pattern_names}, got {pattern!r}.")
    return pattern
  if combine == "per_head" and num_heads < 2:
    raise ValueError(f"{variant}: combine='per_head' needs at least 2 heads (half use each "
                     f"pattern), got num_heads={num_heads}.")
  return combine


def _factorized_pattern(first: patterns.Pattern, second: patterns.Pattern, chosen: str,
                        pattern_names: Tuple[str, str], num_heads: int) -> patterns.Pattern:
  """The pattern `_factorized` computes, from `_factorized_choice`."""
  if chosen in pattern_names:
    return first if chosen == pattern_names[0] else second
  if chosen == "merged":
    return first | second
  half = num_heads // 2
  return patterns.PerHead(((half, first), (num_heads - half, second)))


def strided_attention(query: Array, key: Array, value: Array, bias=None, mask=None, *,
                      is_causal: bool = False, query_seq_lengths=None,
                      key_value_seq_lengths=None, segment_ids=None,
                      stride: Optional[int] = None, combine: str = "merged",
                      pattern: Optional[str] = None, layer_index: Optional[int] = None,
                      scale: Optional[float] = None,
                      implementation: Optional[str] = None) -> Array:
  """Sparse Transformer strided attention (Child et al. 2019), stride l.

  Patterns: "local", |i - j| < l (0 <= i - j < l when causal), computed as a
  blockwise band; "strided", (i - j) mod l == 0 (j <= i when causal), computed
  as full attention within each of the l stripes of T/l positions.
  `combine`: "interleaved" (one pattern, picked by `pattern` or by the parity
  of `layer_index`), "merged" (one softmax over the union) or "per_head" (the
  first half of the heads use "local", the rest "strided"). l defaults to
  ceil(sqrt(T)); T is padded to a multiple of l. O(T sqrt(T)).
  `implementation`: as in `local_attention`.
  """
  length = _self_attention_length("strided", query, key)
  _check_implementation("strided", implementation)
  stride = _default_stride(length) if stride is None else stride
  common.check_size("stride", stride, length=length)
  if implementation is not None:
    num_heads = query.shape[2]
    chosen = _factorized_choice("strided", ("local", "strided"), combine, pattern, layer_index,
                                num_heads)
    pattern_ = _factorized_pattern(patterns.Band(stride - 1, stride - 1),
                                   patterns.SameResidue(stride), chosen, ("local", "strided"),
                                   num_heads)
    return _kernel_attention("strided", pattern_, query, key, value, bias, mask,
                             implementation=implementation, **_call_masks(
                                 is_causal, query_seq_lengths, key_value_seq_lengths,
                                 segment_ids, scale))
  inputs = _prepare("strided", query, key, value, bias, mask, is_causal=is_causal,
                    key_value_seq_lengths=key_value_seq_lengths, segment_ids=segment_ids,
                    scale=scale, multiple=stride)

  def local(inputs):
    return _windowed_part(inputs, stride - 1, stride - 1, stride)

  def strided(inputs, exclusive):
    # Stripe r holds the positions = r (mod l): full attention within it.
    query, key, value, positions, key_ok, segments = _striped(inputs, stride)
    segments = (None, None) if segments is None else segments
    not_self = (lambda q, k: k != q) if exclusive else None
    part = _dense_part(query, key, value, positions, positions, key_ok, *segments,
                       _all_of(_causal(inputs.is_causal), not_self))
    return _map_part(_from_stripes, part)

  out = _merge_parts(_factorized("strided", inputs, local, strided, ("local", "strided"),
                                 combine, pattern, layer_index))
  return _finish(out, inputs, query_seq_lengths, query.dtype)


def fixed_attention(query: Array, key: Array, value: Array, bias=None, mask=None, *,
                    is_causal: bool = False, query_seq_lengths=None,
                    key_value_seq_lengths=None, segment_ids=None,
                    stride: Optional[int] = None, num_summary: int = 1,
                    combine: str = "merged", pattern: Optional[str] = None,
                    layer_index: Optional[int] = None, summary_at_block_start: bool = False,
                    causal_pattern: bool = False, num_global: int = 0,
                    scale: Optional[float] = None,
                    implementation: Optional[str] = None) -> Array:
  """Sparse Transformer fixed attention (Child et al. 2019), stride l, c summaries.

  `query [B, T, H, D]`, `key/value [B, T, Hkv, D|Dv]` -> `[B, T, H, Dv]`.
  Patterns: "block", floor(j / l) == floor(i / l) (blockwise, lower triangle
  when causal); "summary", j mod l >= l - c: the last c positions of every
  block, attended by all queries (j <= i when causal), a gather of (T / l) c
  columns. `combine` as in `strided_attention` ("per_head": first half
  "block", rest "summary"). c = `num_summary` <= l. O(T (l + c T / l)).

  The LRA release's `SparseAttention` (lra_benchmarks/models/sparse_transformer/
  sparse_attention.py, `Fixed1Pattern`/`Fixed2Pattern` merged) differs in
  three ways, each an option:
    summary_at_block_start: the first position of every block is a summary
      too (j mod l == 0, its `Fixed2Pattern`);
    causal_pattern: both patterns keep only j <= i even when the call is not
      causal (the release builds them causal, in its encoders too);
    num_global: the first g tokens attend to every key and every query
      attends to them, and the pattern is over the positions after them
      (position g starts the first block): the release's `use_cls_token` with g = 1.

  `implementation`: as in `local_attention`.
  """
  length = _self_attention_length("fixed", query, key)
  _check_implementation("fixed", implementation)
  _check_at_most("num_global", num_global, "the sequence length - 1", length - 1, minimum=0)
  stride = _default_stride(length) if stride is None else stride
  common.check_size("stride", stride, length=length)
  _check_at_most("num_summary", num_summary, "stride", stride)
  if implementation is not None:
    num_heads = query.shape[2]
    chosen = _factorized_choice("fixed", ("block", "summary"), combine, pattern, layer_index,
                                num_heads)
    residues = tuple(range(stride - num_summary, stride))
    residues += (0,) if summary_at_block_start and 0 not in residues else ()
    rest = _factorized_pattern(patterns.SameBlock(stride, num_global),
                               patterns.Columns(stride, residues, num_global), chosen,
                               ("block", "summary"), num_heads)
    if causal_pattern:
      rest &= patterns.Band(length, 0)  # k <= q
    pattern_ = patterns.Global(0, num_global) | rest if num_global else rest
    return _kernel_attention("fixed", pattern_, query, key, value, bias, mask,
                             implementation=implementation, **_call_masks(
                                 is_causal, query_seq_lengths, key_value_seq_lengths,
                                 segment_ids, scale))
  inputs = _prepare("fixed", query, key, value, bias, mask, is_causal=is_causal,
                    key_value_seq_lengths=key_value_seq_lengths, segment_ids=segment_ids,
                    scale=scale, multiple=stride, offset=num_global)
  # The pattern's positions count from the first token after the global ones.
  rest = _tail(inputs, num_global, is_causal=inputs.is_causal or causal_pattern)
  positions = np.arange(rest.padded_len)
  is_summary = positions % stride >= stride - num_summary
  if summary_at_block_start:
    is_summary |= positions % stride == 0
  summary = positions[is_summary]

  def block(inputs):
    return _own_block_part(inputs, stride)

  def summaries(inputs, exclusive):
    other_block = (lambda q, k: q // stride != k // stride) if exclusive else None
    return _columns_part(inputs, summary, _all_of(_causal(inputs.is_causal), other_block))

  parts = _factorized("fixed", rest, block, summaries, ("block", "summary"), combine, pattern,
                      layer_index)
  out = _with_globals(inputs, num_global, [_pad_front(p, num_global) for p in parts])
  return _finish(out, inputs, query_seq_lengths, query.dtype)


def _window_with_globals(variant: str, query, key, value, bias, mask, *, is_causal,
                         query_seq_lengths, key_value_seq_lengths, segment_ids, scale,
                         window_size: int, num_global: int, dilation: int = 1,
                         dilated_heads: int = 0, left_window_size: Optional[int] = None,
                         implementation: Optional[str] = None) -> Array:
  """Global tokens plus a sliding window, dilated on the last `dilated_heads` heads.

  The first `num_global` tokens attend to every key and every query attends
  to them; every other query also sees keys i + d m, -left <= m <= w, of the
  window (d = 1, or `dilation` on the dilated heads; left = `left_window_size`,
  w when None) that are not global. O(T (w + left + g)). `implementation`: as
  in `local_attention`.
  """
  length = _self_attention_length(variant, query, key)
  _check_implementation(variant, implementation)
  common.check_size("window_size", window_size)
  left = window_size if left_window_size is None else left_window_size
  common.check_size("left_window_size", left, minimum=0)
  # A side longer than the sequence reaches every key on that side, as T - 1
  # does (the release's 512-key window on a 101-token smoke sequence).
  reach = max(length - 1, 1)
  window_size, left = min(window_size, reach), min(left, reach)
  block = max(window_size, left)
  common.check_size("num_global", num_global, length=length, minimum=0)
  common.check_size("dilation", dilation, length=length)
  num_heads = query.shape[2]
  _check_at_most("dilated_heads", dilated_heads, "num_heads", num_heads, minimum=0)
  plain_heads = num_heads - dilated_heads
  if implementation is not None:
    groups = ((plain_heads, patterns.Band(left, window_size)),
              (dilated_heads, patterns.Band(left, window_size, dilation)))
    groups = tuple((count, band) for count, band in groups if count)
    windows = groups[0][1] if len(groups) == 1 else patterns.PerHead(groups)
    pattern = patterns.Global(0, num_global) | windows if num_global else windows
    return _kernel_attention(variant, pattern, query, key, value, bias, mask,
                             implementation=implementation, **_call_masks(
                                 is_causal, query_seq_lengths, key_value_seq_lengths,
                                 segment_ids, scale))
  inputs = _prepare(variant, query, key, value, bias, mask, is_causal=is_causal,
                    key_value_seq_lengths=key_value_seq_lengths, segment_ids=segment_ids,
                    scale=scale, multiple=block * dilation)
  not_global = _keys_from(num_global) if num_global else None

  def window(inputs, d):
    return _windowed_part(inputs, left, window_size, block, d, not_global)

  head_parts = []
  if plain_heads:
    head_parts.append(window(_head_range(inputs, 0, plain_heads), 1))
  if dilated_heads:
    head_parts.append(window(_head_range(inputs, plain_heads, num_heads), dilation))
  out = _with_globals(inputs, num_global, [_concat_heads(head_parts)])
  return _finish(out, inputs, query_seq_lengths, query.dtype)


def global_tokens_attention(query: Array, key: Array, value: Array, bias=None, mask=None, *,
                            is_causal: bool = False, query_seq_lengths=None,
                            key_value_seq_lengths=None, segment_ids=None, num_global: int = 4,
                            window_size: int = 64, scale: Optional[float] = None,
                            implementation: Optional[str] = None) -> Array:
  """Global tokens (Star-Transformer / ETC): the first `num_global` tokens
  attend to all and are attended by all; the rest also see a window of
  `window_size` each side (blockwise). Causal keeps j <= i everywhere. O(T (w + g)).
  """
  common.check_size("num_global", num_global, length=query.shape[1])
  return _window_with_globals(
      "global_tokens", query, key, value, bias, mask, is_causal=is_causal,
      query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
      segment_ids=segment_ids, scale=scale, window_size=window_size, num_global=num_global,
      implementation=implementation)


def longformer_attention(query: Array, key: Array, value: Array, bias=None, mask=None, *,
                         is_causal: bool = False, query_seq_lengths=None,
                         key_value_seq_lengths=None, segment_ids=None, window_size: int = 32,
                         dilation: int = 2, dilated_heads: Optional[int] = None,
                         num_global: int = 1, left_window_size: Optional[int] = None,
                         scale: Optional[float] = None,
                         implementation: Optional[str] = None) -> Array:
  """Longformer (Beltagy et al. 2020), `query [B, T, H, D]`, `key/value
  [B, T, Hkv, D|Dv]` -> `[B, T, H, Dv]`: a sliding window of `window_size`
  keys after the query and `left_window_size` (`window_size` when None)
  before it, dilated by `dilation` on the last `dilated_heads` heads (half of
  them when None), plus `num_global` global tokens at the start (e.g. [CLS]),
  which share the window's projections. O(T (w + g)).

  The LRA release's `LongformerAttention` (lra_benchmarks/models/longformer/
  longformer_attention.py) is this with `sliding_window_size` W = 512 keys:
  W // 2 after the query and W - W // 2 - 1 before it (window_size=256,
  left_window_size=255), no dilation and, as its encoders pass no
  `global_mask`, no global token.
  """
  dilated_heads = query.shape[2] // 2 if dilated_heads is None else dilated_heads
  return _window_with_globals(
      "longformer", query, key, value, bias, mask, is_causal=is_causal,
      query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
      segment_ids=segment_ids, scale=scale, window_size=window_size, num_global=num_global,
      dilation=dilation, dilated_heads=dilated_heads, left_window_size=left_window_size,
      implementation=implementation)


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
                     scale: Optional[float] = None) -> Array:
  """Random attention (Zaheer et al. 2020), `query [B, T, H, D]`, `key/value
  [B, T, Hkv, D|Dv]` -> `[B, T, H, Dv]`: query i of head h attends to the keys
  `random_indices(rng, H, T, num_random, is_causal)[h, i]`, plus its window of
  `window_size` each side when given (blockwise; the random draws inside the
  window count once). Each head gathers its random keys, `[B, T, H, r, D]`:
  O(T (w + r)). In a model the key `rng` is its layer's (`LayerPattern`): a
  pattern per layer and head, fixed for the run.
  """
  length = _self_attention_length("random", query, key)
  rng = _require_rng("random", rng)
  common.check_size("num_random", num_random, length=length)
  if window_size is not None:
    common.check_size("window_size", window_size, length=length)
  inputs = _prepare("random", query, key, value, bias, mask, is_causal=is_causal,
                    key_value_seq_lengths=key_value_seq_lengths, segment_ids=segment_ids,
                    scale=scale, multiple=window_size or 1)
  pad = [(0, 0), (0, inputs.padded_len - length), (0, 0)]
  indices = random_indices(rng, query.shape[2], length, num_random, inputs.is_causal)
  index_ok = jnp.pad(_first_draws(indices), pad)
  indices = jnp.pad(indices, pad)
  parts = []
  outside_window = None
  if window_size is not None:
    parts.append(_windowed_part(inputs, window_size, window_size, window_size))
    outside_window = lambda q, k: ~_window(window_size, window_size)(q, k)
  parts.append(_gathered_keys_part(inputs, indices, index_ok,
                                   _all_of(_causal(inputs.is_causal), outside_window)))
  return _finish(_merge_parts(parts), inputs, query_seq_lengths, query.dtype)


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
  length = _self_attention_length("bigbird", query, key)
  _check_implementation("bigbird", implementation)
  rng = _require_rng("bigbird", rng)
  common.check_size("block_size", block_size, length=length)
  if block_padding not in BIGBIRD_PADDINGS:
    raise ValueError(f"bigbird: block_padding must be one of {BIGBIRD_PADDINGS}, got "
                     f"{block_padding!r}.")
  pad_always = block_padding == "lra_release"
  num_blocks = length // block_size + 1 if pad_always else _ceil_div(length, block_size)
  _check_at_most("num_global_blocks", num_global_blocks, "the number of blocks", num_blocks,
                 minimum=0)
  _check_at_most("num_random_blocks", num_random_blocks, "the number of blocks", num_blocks,
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
      kernel_blocks = _ceil_div(length, block_size)
      drawn = bigbird_random_blocks(rng, query.shape[2], candidates, num_random_blocks)
      drawn = jnp.where(drawn < kernel_blocks, drawn, -1)[:, :kernel_blocks]
    return _kernel_attention("bigbird", pattern, query, key, value, bias, mask,
                             implementation=implementation, block_size=block_size,
                             extra_blocks=drawn, **_call_masks(
                                 is_causal, query_seq_lengths, key_value_seq_lengths,
                                 segment_ids, scale))
  inputs = _prepare("bigbird", query, key, value, bias, mask, is_causal=is_causal,
                    key_value_seq_lengths=key_value_seq_lengths, segment_ids=segment_ids,
                    scale=scale, multiple=block_size, pad_always=pad_always)
  is_global = np.zeros(num_blocks, bool)
  is_global[global_blocks] = True
  not_global = lambda q, k: ~jnp.asarray(is_global)[k // block_size]
  parts = [_block_window_part(inputs, block_size, not_global)]
  if num_random_blocks:
    blocks = bigbird_random_blocks(rng, query.shape[2], candidates, num_random_blocks)
    query_, key_, value_, positions, key_ok, segments = _heads_as_stripes(inputs)
    part = _block_part(query_, key_, value_, positions, key_ok, segments, block_size, blocks,
                       _causal(inputs.is_causal))
    parts.append(_map_part(_from_head_stripes, part))
  global_positions = (global_blocks[:, None] * block_size + np.arange(block_size)).ravel()
  out = _with_globals(inputs, global_positions, parts)
  return _finish(out, inputs, query_seq_lengths, query.dtype)


def _block_window_part(inputs: _Inputs, block: int, extra: Optional[Predicate]) -> _Part:
  """Query block n attends to all of key blocks n - 1, n, n + 1 (n - 1, n when causal)."""
  query, key, value, positions, key_ok, segments = _striped(inputs, 1)
  num_blocks = positions.shape[1] // block
  offsets = jnp.arange(-1, 1 if inputs.is_causal else 2)
  key_blocks = jnp.arange(num_blocks)[:, None] + offsets[None, :]
  part = _block_part(query, key, value, positions, key_ok, segments, block, key_blocks,
                     _all_of(_causal(inputs.is_causal), extra))
  return _map_part(_from_stripes, part)


def axial_shape(length: int, shape: Optional[Sequence[int]] = None) -> Tuple[int, int]:
  """(rows, cols) with rows * cols = T: `shape` checked, or by default the
  most square factorisation, which must have cols <= 4 rows (so the cost stays
  O(T sqrt(T)))."""
  if shape is not None:
    if (len(shape) != 2 or not all(isinstance(s, int) and s >= 1 for s in shape)
        or shape[0] * shape[1] != length):
      raise ValueError(f"shape must be (rows, cols) of positive ints with rows * cols equal to "
                       f"the sequence length {length}, got {tuple(shape)!r}.")
    return tuple(shape)
  rows = max(r for r in range(1, math.isqrt(length) + 1) if length % r == 0)
  cols = length // rows
  if cols > 4 * rows:
    raise ValueError(f"the sequence length {length} has no factorisation rows x cols with "
                     f"cols <= 4 rows (the closest is {rows} x {cols}); pass shape=(rows, cols) "
                     f"or pad the sequence.")
  return rows, cols


def axial_attention(query: Array, key: Array, value: Array, bias=None, mask=None, *,
                    is_causal: bool = False, query_seq_lengths=None,
                    key_value_seq_lengths=None, segment_ids=None,
                    shape: Optional[Sequence[int]] = None,
                    scale: Optional[float] = None) -> Array:
  """Axial attention (Ho et al. 2019) over a sequence that is a rows x cols
  image flattened row by row: attention within each row, then within each
  column, the second pass taking the row pass's outputs as its values (same
  queries and keys). Every output depends on every input after both passes.
  Causal: each pass is causal, so position i only ever sees positions <= i.
  Padded positions are neither keys nor values in either pass. O(T (rows + cols)).
  """
  length = _self_attention_length("axial", query, key)
  rows, cols = axial_shape(length, shape)
  inputs = _prepare("axial", query, key, value, bias, mask, is_causal=is_causal,
                    key_value_seq_lengths=key_value_seq_lengths, segment_ids=segment_ids,
                    scale=scale, multiple=1)
  positions = jnp.arange(length).reshape(rows, cols)
  by_row = lambda x: x.reshape(x.shape[0], rows, cols, *x.shape[2:])
  by_col = lambda x: jnp.swapaxes(by_row(x), 1, 2)

  def attend_along(split, positions, values):
    segments = (None, None) if inputs.segments is None else tuple(
        split(s) for s in inputs.segments)
    part = _dense_part(split(inputs.query), split(inputs.key), split(values), positions,
                       positions, split(inputs.key_ok), *segments, _causal(inputs.is_causal))
    return _merge_parts([part])

  rows_out = attend_along(by_row, positions, inputs.value).reshape(inputs.value.shape)
  out = attend_along(by_col, positions.T, rows_out.astype(inputs.value.dtype))
  out = jnp.swapaxes(out, 1, 2).reshape(inputs.value.shape)
  return _finish(out, inputs, query_seq_lengths, query.dtype)


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


# ----------------------------------------------------------------------------
# Registration.

_SPARSE = dict(family="sparse", subquadratic=True, exact=True, causal=True, cross=False)

_SCALE = dict(scale="multiplies the logits; 1/sqrt(D) when None")
_WINDOW = dict(window_size="keys each side of the query (w)")
# The variants whose pattern also runs on the block-sparse flash kernel.
_KERNEL = dict(implementation="None: the pure-JAX form; 'blockwise', 'pallas_gpu' or "
                              "'pallas_tpu': the block-sparse flash kernel (lax loops, Triton "
                              "or Mosaic TPU), visiting only the blocks the pattern allows")
_FACTORIZED = dict(
    stride="the stride l; ceil(sqrt(T)) when None",
    combine="'merged' (one softmax over both patterns), 'per_head' or 'interleaved'",
    pattern="with combine='interleaved': the pattern this layer uses",
    layer_index="with combine='interleaved': picks the pattern by its parity")
# The release's image configs (image/configs/{cifar10,pathfinder32}/*_base.py)
# set block_size 64; the text ones keep the model default (50 for local). The
# other Pathfinder sizes (Path-X is pathfinder128) have no release config for
# these rows: they follow pathfinder32.
_IMAGE_TASKS = ("image", "pathfinder32", "pathfinder64", "pathfinder128", "pathfinder256")

_LOCAL_OPTIONS = dict(
    _WINDOW,
    pattern="'sliding' (the method: the keys within w of the query) or 'release_strided' "
            "(the LRA release's LocalAttention: the block_size keys = i mod T'/block_size, "
            "T' = T + block_size - T mod block_size)",
    block_size="with pattern='release_strided': the release's block_size (keys per query)",
    **_SCALE, **_KERNEL)
registry.register(registry.VariantSpec(
    name="local", fn=local_attention, complexity="O(T w)", paper="Parmar et al. 2018",
    options=_LOCAL_OPTIONS,
    presets={"lra_release": registry.Preset(
        dict(pattern="release_strided", block_size=50),
        "the release's LocalAttention (lra_benchmarks/models/local/local_attention.py) reshapes "
        "[T', ...] to [block_size, T'/block_size, ...] and attends over the first axis: each "
        "query sees the block_size positions congruent to it modulo T'/block_size, spread over "
        "the sequence, not a window; block_size 50 (the model default), 64 on the image tasks",
        tasks={task: dict(block_size=64) for task in _IMAGE_TASKS})},
    **_SPARSE))
registry.register(registry.VariantSpec(name="band", fn=local_attention, complexity="O(T w)",
                                       paper="Parmar et al. 2018", options=_LOCAL_OPTIONS,
                                       **_SPARSE))
registry.register(registry.VariantSpec(
    name="block_local", fn=block_local_attention, complexity="O(T b)", paper="Qiu et al. 2019",
    options=dict(block_size="queries attend within their own block of this many", **_SCALE,
                 **_KERNEL),
    **_SPARSE))
registry.register(registry.VariantSpec(
    name="dilated", fn=dilated_attention, complexity="O(T w)", paper="Beltagy et al. 2020",
    options=dict(**_WINDOW, dilation="gap between attended keys", **_SCALE, **_KERNEL),
    **_SPARSE))
registry.register(registry.VariantSpec(name="strided", fn=strided_attention,
                                       complexity="O(T sqrt(T))", paper="Child et al. 2019",
                                       options={**_FACTORIZED, **_SCALE, **_KERNEL},
                                       **_SPARSE))
# The release pools by [CLS] (its use_cls_token) on every task but pathfinder32
# and pathfinder128 (image/configs/pathfinder{32,128}/base_*_config.py: MEAN).
_MEAN_POOLED_TASKS = ("pathfinder32", "pathfinder128")
registry.register(registry.VariantSpec(
    name="fixed", fn=fixed_attention, complexity="O(T sqrt(T))", paper="Child et al. 2019",
    options=dict(
        _FACTORIZED, num_summary="summary positions c at the end of each block",
        summary_at_block_start="the first position of each block is a summary too "
                               "(j mod l == 0; the LRA release's Fixed2Pattern)",
        causal_pattern="keep j <= i in both patterns even when the call is not causal "
                       "(the LRA release builds them causal in its encoders too)",
        num_global="leading tokens that attend to and are attended by all; the pattern starts "
                   "after them (the release's [CLS] handling: 1)",
        **_SCALE, **_KERNEL),
    presets={"lra_release": registry.Preset(
        dict(stride=50, num_summary=10, summary_at_block_start=True, causal_pattern=True,
             num_global=1),
        "lra_benchmarks/utils/train_utils.py get_model passes Fixed1Pattern(block_size=50) and "
        "Fixed2Pattern(block_size=50, c=10) (not SparseAttention's 128/32 default); "
        "sparse_attention.py merges them into one causal mask with the j mod l == 0 column, "
        "and with [CLS] pooling makes the first token global and starts the pattern after it",
        tasks={task: dict(num_global=0) for task in _MEAN_POOLED_TASKS})},
    **_SPARSE))
registry.register(registry.VariantSpec(
    name="global_tokens", fn=global_tokens_attention, complexity="O(T (w + g))",
    paper="Guo et al. 2019",
    options=dict(num_global="leading tokens that attend and are attended everywhere",
                 **_WINDOW, **_SCALE, **_KERNEL), **_SPARSE))
registry.register(registry.VariantSpec(
    name="random", fn=random_attention, complexity="O(T (w + r))", paper="Zaheer et al. 2020",
    extras=LayerPattern,
    options=dict(num_random="random keys per query, drawn per layer and head",
                 window_size="also attend to this many keys each side; None for none",
                 **_SCALE), **_SPARSE))
registry.register(registry.VariantSpec(
    name="longformer", fn=longformer_attention, complexity="O(T (w + g))",
    paper="Beltagy et al. 2020",
    options=dict(window_size="keys after the query (w), and before it unless left_window_size",
                 left_window_size="keys before the query; window_size when None",
                 dilation="gap between keys on the dilated heads",
                 dilated_heads="heads that use the dilation; half of them when None",
                 num_global="leading global tokens", **_SCALE, **_KERNEL),
    presets={"lra_release": registry.Preset(
        dict(window_size=256, left_window_size=255, dilated_heads=0, num_global=0),
        "the release's LongformerAttention (lra_benchmarks/models/longformer/"
        "longformer_attention.py) is a sliding window of sliding_window_size=512 keys (255 "
        "before the query, 256 after), no dilation, and no global token (its encoders pass no "
        "global_mask, so its separate global projections are never used)")},
    **_SPARSE))
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
                 **_SCALE, **_KERNEL),
    presets={"lra_release": registry.Preset(
        dict(block_size=64, num_random_blocks=3, random_blocks_within=1024,
             block_padding="lra_release", random_candidates="lra_release"),
        "the release's BigBirdAttention (lra_benchmarks/models/bigbird/bigbird_attention.py): "
        "blocks of 64, the first and last block global, 3 random blocks per head and layer "
        "drawn from the first 1024 tokens by get_block_rand_mask, T padded to "
        "T + 64 - T mod 64")},
    **_SPARSE))
registry.register(registry.VariantSpec(
    name="axial", fn=axial_attention, complexity="O(T sqrt(T))", paper="Ho et al. 2019",
    family="sparse", subquadratic=True, exact=False, causal=True, cross=False,
    options=dict(shape="(rows, cols) with rows * cols = T; the most square when None",
                 **_SCALE)))
