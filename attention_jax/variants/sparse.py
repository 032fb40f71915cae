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
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, NamedTuple, Optional, Sequence, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from attention_jax import registry
from attention_jax.core import masks as mask_lib
from attention_jax.variants import common

Array = jnp.ndarray
# A pattern: (query positions, key positions) -> may attend, broadcasting.
Predicate = Callable[[Array, Array], Array]


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
             multiple: int) -> _Inputs:
  """Validates the call and pads T to a multiple of `multiple`."""
  common.reject_unsupported(variant, bias=bias)
  batch, q_len, num_heads, head_dim = query.shape
  kv_len = _self_attention_length(variant, query, key)
  key_ok = common.key_padding(variant, mask, key_value_seq_lengths, batch, kv_len)
  key_ok = jnp.ones((batch, kv_len), bool) if key_ok is None else key_ok
  key = common.repeat_kv_heads(key, num_heads)
  value = common.repeat_kv_heads(value, num_heads)
  scale = head_dim ** -0.5 if scale is None else scale
  query = query * jnp.asarray(scale, query.dtype)

  padded_len = -(-q_len // multiple) * multiple
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
                allowed: Optional[Predicate]) -> _Part:
  """Each query of a group attends to the allowed keys of the same group.

  Args:
    query: `[B, G, Q, H, D]` (scaled); key `[B, G, K, H, D]`; value `[B, G, K, H, Dv]`.
    q_pos: `[G, Q]`, k_pos: `[G, K]` positions in the sequence (for `allowed`).
    key_ok: `[B, G, K]` keys that exist (not padding, inside the sequence).
    q_seg, k_seg: `[B, G, Q]`, `[B, G, K]` segment ids, or None.
    allowed: the pattern over positions, or None for every pair.

  Returns:
    A `_Part` with leading dims `[B, G, Q]`.
  """
  logits = jnp.einsum("bgqhd,bgkhd->bghqk", query, key, preferred_element_type=jnp.float32)
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
  allowed key (m_i = -inf) contributes zero.

  Returns:
    `[..., H, Dv]` float32; queries with no allowed key at all give zeros.
  """
  row_max = _finite(parts[0].row_max)
  for part in parts[1:]:
    row_max = jnp.maximum(row_max, _finite(part.row_max))
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
                allowed: Optional[Predicate]) -> _Part:
  """Blocks of queries attend to gathered blocks of keys.

  Args:
    query, key, value: `[B, S, L, H, D]` (S stripes of length L, a multiple of `block`).
    positions: `[S, L]`; key_ok: `[B, S, L]`; segments: pair of `[B, S, L]` or None.
    block: the block size b.
    key_blocks: `[L / b, M]` int: query block n attends to key blocks
      `key_blocks[n]`; indices outside [0, L / b) stand for nothing.
    allowed: the exact pattern inside the gathered `[b, M b]` tiles.

  Returns:
    A `_Part` with leading dims `[B, S, L]`. Cost: O(S L M b) scores.
  """
  batch, stripes, length = query.shape[:3]
  num_blocks, per_query = key_blocks.shape[0], key_blocks.shape[1]
  inside = (key_blocks >= 0) & (key_blocks < num_blocks)
  gather_index = jnp.clip(key_blocks, 0, num_blocks - 1)

  def query_blocks(x):  # [B, S, L, ...] -> [B, S * nb, b, ...]
    return x.reshape(x.shape[0], stripes * num_blocks, block, *x.shape[3:])

  def gathered(x):  # [B, S, L, ...] -> [B, S * nb, M * b, ...]
    x = x.reshape(x.shape[0], stripes, num_blocks, block, *x.shape[3:])[:, :, gather_index]
    return x.reshape(x.shape[0], stripes * num_blocks, per_query * block, *x.shape[5:])

  inside_keys = jnp.repeat(inside, block, axis=1)  # [nb, M b]
  key_ok_tiles = gathered(key_ok) & jnp.tile(inside_keys, (stripes, 1))[None]
  pos = positions[None]
  q_seg, k_seg = (None, None) if segments is None else (
      query_blocks(segments[0]), gathered(segments[1]))
  part = _dense_part(query_blocks(query), gathered(key), gathered(value),
                     query_blocks(pos)[0], gathered(pos)[0], key_ok_tiles, q_seg, k_seg,
                     allowed)
  return _map_part(lambda x: x.reshape(batch, stripes, length, *x.shape[3:]), part)


def _windowed_part(inputs: _Inputs, left: int, right: int, block: int, dilation: int = 1,
                   extra: Optional[Predicate] = None) -> _Part:
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
  part = _block_part(query, key, value, positions, key_ok, segments, block, key_blocks, allowed)
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
  """Query i attends to the keys at `indices[i]` `[Tp, M]` where `index_ok`.

  Gathers `[B, Tp, M, H, D]` keys: cost O(T M).
  """
  positions = jnp.arange(inputs.padded_len)
  segments = (None, None)
  if inputs.segments is not None:
    segments = (inputs.segments[0][:, :, None], inputs.segments[1][:, indices])
  part = _dense_part(inputs.query[:, :, None], inputs.key[:, indices], inputs.value[:, indices],
                     positions[:, None], indices, inputs.key_ok[:, indices] & index_ok[None],
                     *segments, allowed)
  return _map_part(lambda x: x[:, :, 0], part)


def _global_rows(inputs: _Inputs, num_global: int) -> Array:
  """Outputs `[B, g, H, Dv]` of the first g queries, which attend to every key. O(g T)."""
  positions = jnp.arange(inputs.padded_len)
  segments = (None, None)
  if inputs.segments is not None:
    segments = (inputs.segments[0][:, None, :num_global], inputs.segments[1][:, None])
  part = _dense_part(inputs.query[:, None, :num_global], inputs.key[:, None],
                     inputs.value[:, None], positions[None, :num_global], positions[None],
                     inputs.key_ok[:, None], *segments, _causal(inputs.is_causal))
  return _merge_parts([_map_part(lambda x: x[:, 0], part)])


def _with_globals(inputs: _Inputs, num_global: int, local_parts: Sequence[_Part]) -> Array:
  """The first `num_global` tokens attend to all and are attended by all; the
  other queries attend to them plus `local_parts` (which exclude keys < g).

  Returns `[B, Tp, H, Dv]` float32.
  """
  if num_global == 0:
    return _merge_parts(local_parts)
  columns = _columns_part(inputs, np.arange(num_global), _causal(inputs.is_causal))
  out = _merge_parts([*local_parts, columns])
  return out.at[:, :num_global].set(_global_rows(inputs, num_global))


def _head_range(inputs: _Inputs, start: int, stop: int) -> _Inputs:
  return dataclasses.replace(inputs, query=inputs.query[:, :, start:stop],
                             key=inputs.key[:, :, start:stop], value=inputs.value[:, :, start:stop])


def _concat_heads(parts: Sequence[_Part]) -> _Part:
  """Parts of disjoint head ranges, `[B, T, h_i, ...]` -> `[B, T, H, ...]`."""
  return _Part(*(jnp.concatenate(xs, axis=2) for xs in zip(*parts)))


# ----------------------------------------------------------------------------
# The variants.

def local_attention(query: Array, key: Array, value: Array, bias=None, mask=None, *,
                    is_causal: bool = False, query_seq_lengths=None,
                    key_value_seq_lengths=None, segment_ids=None, window_size: int = 64,
                    scale: Optional[float] = None) -> Array:
  """Sliding-window (band) attention: query i sees keys [i - w, i + w]
  ([i - w, i] when causal), w = `window_size` (Parmar et al. 2018).

  Blockwise: queries in blocks of w attend to their own and neighbouring key
  blocks (`[B, T/w, 3w, H, D]`, 2w when causal), O(T w).
  """
  length = _self_attention_length("local", query, key)
  common.check_size("window_size", window_size, length=length)
  inputs = _prepare("local", query, key, value, bias, mask, is_causal=is_causal,
                    key_value_seq_lengths=key_value_seq_lengths, segment_ids=segment_ids,
                    scale=scale, multiple=window_size)
  out = _merge_parts([_windowed_part(inputs, window_size, window_size, window_size)])
  return _finish(out, inputs, query_seq_lengths, query.dtype)


def block_local_attention(query: Array, key: Array, value: Array, bias=None, mask=None, *,
                          is_causal: bool = False, query_seq_lengths=None,
                          key_value_seq_lengths=None, segment_ids=None, block_size: int = 64,
                          scale: Optional[float] = None) -> Array:
  """Blockwise self-attention (Qiu et al. 2019): non-overlapping blocks of
  `block_size` tokens attend only within their block (lower triangle when
  causal). T is padded to a multiple of the block size; the last, shorter
  block attends within itself. O(T b).
  """
  length = _self_attention_length("block_local", query, key)
  common.check_size("block_size", block_size, length=length)
  inputs = _prepare("block_local", query, key, value, bias, mask, is_causal=is_causal,
                    key_value_seq_lengths=key_value_seq_lengths, segment_ids=segment_ids,
                    scale=scale, multiple=block_size)
  out = _merge_parts([_own_block_part(inputs, block_size)])
  return _finish(out, inputs, query_seq_lengths, query.dtype)


def dilated_attention(query: Array, key: Array, value: Array, bias=None, mask=None, *,
                      is_causal: bool = False, query_seq_lengths=None,
                      key_value_seq_lengths=None, segment_ids=None, window_size: int = 32,
                      dilation: int = 2, scale: Optional[float] = None) -> Array:
  """Dilated sliding window (Beltagy et al. 2020): query i sees keys
  i + d m for |m| <= w (m <= 0 when causal), d = `dilation`, w = `window_size`.

  Those keys share i's residue modulo d, so the sequence is split into d
  stripes (positions r, r + d, ...) and each runs the blockwise band of w:
  O(T w) with no per-query gather.
  """
  length = _self_attention_length("dilated", query, key)
  common.check_size("window_size", window_size, length=length)
  common.check_size("dilation", dilation, length=length)
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
                pattern: Optional[str], layer_index: Optional[int]) -> Array:
  """Combines a Sparse Transformer's two factorised patterns.

  `first(inputs)` and `second(inputs, exclusive)` compute partial softmaxes;
  `exclusive=True` leaves out the keys `first` already covers, so that the
  merged union counts each key once.
  """
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
    return _merge_parts([first(inputs) if pattern == pattern_names[0] else
                         second(inputs, False)])
  if combine == "merged":
    return _merge_parts([first(inputs), second(inputs, True)])
  num_heads = inputs.query.shape[2]
  if num_heads < 2:
    raise ValueError(f"{variant}: combine='per_head' needs at least 2 heads (half use each "
                     f"pattern), got num_heads={num_heads}.")
  half = num_heads // 2
  return _merge_parts([_concat_heads([first(_head_range(inputs, 0, half)),
                                      second(_head_range(inputs, half, num_heads), False)])])


def strided_attention(query: Array, key: Array, value: Array, bias=None, mask=None, *,
                      is_causal: bool = False, query_seq_lengths=None,
                      key_value_seq_lengths=None, segment_ids=None,
                      stride: Optional[int] = None, combine: str = "merged",
                      pattern: Optional[str] = None, layer_index: Optional[int] = None,
                      scale: Optional[float] = None) -> Array:
  """Sparse Transformer strided attention (Child et al. 2019), stride l.

  Patterns: "local", |i - j| < l (0 <= i - j < l when causal), computed as a
  blockwise band; "strided", (i - j) mod l == 0 (j <= i when causal), computed
  as full attention within each of the l stripes of T/l positions.
  `combine`: "interleaved" (one pattern, picked by `pattern` or by the parity
  of `layer_index`), "merged" (one softmax over the union) or "per_head" (the
  first half of the heads use "local", the rest "strided"). l defaults to
  ceil(sqrt(T)); T is padded to a multiple of l. O(T sqrt(T)).
  """
  length = _self_attention_length("strided", query, key)
  stride = _default_stride(length) if stride is None else stride
  common.check_size("stride", stride, length=length)
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

  out = _factorized("strided", inputs, local, strided, ("local", "strided"), combine, pattern,
                    layer_index)
  return _finish(out, inputs, query_seq_lengths, query.dtype)


def fixed_attention(query: Array, key: Array, value: Array, bias=None, mask=None, *,
                    is_causal: bool = False, query_seq_lengths=None,
                    key_value_seq_lengths=None, segment_ids=None,
                    stride: Optional[int] = None, num_summary: int = 1,
                    combine: str = "merged", pattern: Optional[str] = None,
                    layer_index: Optional[int] = None, scale: Optional[float] = None) -> Array:
  """Sparse Transformer fixed attention (Child et al. 2019), stride l, c summaries.

  Patterns: "block", floor(j / l) == floor(i / l) (blockwise, lower triangle
  when causal); "summary", j mod l >= l - c: the last c positions of every
  block, attended by all queries (j <= i when causal), a gather of (T / l) c
  columns. `combine` as in `strided_attention` ("per_head": first half
  "block", rest "summary"). c = `num_summary` <= l. O(T (l + c T / l)).
  """
  length = _self_attention_length("fixed", query, key)
  stride = _default_stride(length) if stride is None else stride
  common.check_size("stride", stride, length=length)
  _check_at_most("num_summary", num_summary, "stride", stride)
  inputs = _prepare("fixed", query, key, value, bias, mask, is_causal=is_causal,
                    key_value_seq_lengths=key_value_seq_lengths, segment_ids=segment_ids,
                    scale=scale, multiple=stride)
  positions = np.arange(inputs.padded_len)
  summary = positions[positions % stride >= stride - num_summary]

  def block(inputs):
    return _own_block_part(inputs, stride)

  def summaries(inputs, exclusive):
    other_block = (lambda q, k: q // stride != k // stride) if exclusive else None
    return _columns_part(inputs, summary, _all_of(_causal(inputs.is_causal), other_block))

  out = _factorized("fixed", inputs, block, summaries, ("block", "summary"), combine, pattern,
                    layer_index)
  return _finish(out, inputs, query_seq_lengths, query.dtype)


def _window_with_globals(variant: str, query, key, value, bias, mask, *, is_causal,
                         query_seq_lengths, key_value_seq_lengths, segment_ids, scale,
                         window_size: int, num_global: int, dilation: int = 1,
                         dilated_heads: int = 0) -> Array:
  """Global tokens plus a sliding window, dilated on the last `dilated_heads` heads.

  The first `num_global` tokens attend to every key and every query attends
  to them; every other query also sees keys i + d m, |m| <= w, of the window
  (d = 1, or `dilation` on the dilated heads) that are not global. O(T (w + g)).
  """
  length = _self_attention_length(variant, query, key)
  common.check_size("window_size", window_size, length=length)
  common.check_size("num_global", num_global, length=length, minimum=0)
  common.check_size("dilation", dilation, length=length)
  num_heads = query.shape[2]
  _check_at_most("dilated_heads", dilated_heads, "num_heads", num_heads, minimum=0)
  inputs = _prepare(variant, query, key, value, bias, mask, is_causal=is_causal,
                    key_value_seq_lengths=key_value_seq_lengths, segment_ids=segment_ids,
                    scale=scale, multiple=window_size * dilation)
  not_global = _keys_from(num_global) if num_global else None

  def window(inputs, d):
    return _windowed_part(inputs, window_size, window_size, window_size, d, not_global)

  plain_heads = num_heads - dilated_heads
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
                            window_size: int = 64, scale: Optional[float] = None) -> Array:
  """Global tokens (Star-Transformer / ETC): the first `num_global` tokens
  attend to all and are attended by all; the rest also see a window of
  `window_size` each side (blockwise). Causal keeps j <= i everywhere. O(T (w + g)).
  """
  common.check_size("num_global", num_global, length=query.shape[1])
  return _window_with_globals(
      "global_tokens", query, key, value, bias, mask, is_causal=is_causal,
      query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
      segment_ids=segment_ids, scale=scale, window_size=window_size, num_global=num_global)


def longformer_attention(query: Array, key: Array, value: Array, bias=None, mask=None, *,
                         is_causal: bool = False, query_seq_lengths=None,
                         key_value_seq_lengths=None, segment_ids=None, window_size: int = 32,
                         dilation: int = 2, dilated_heads: Optional[int] = None,
                         num_global: int = 1, scale: Optional[float] = None) -> Array:
  """Longformer (Beltagy et al. 2020): a sliding window of `window_size` each
  side, dilated by `dilation` on the last `dilated_heads` heads (half of them
  by default), plus `num_global` global tokens at the start (e.g. [CLS]).
  O(T (w + g)).
  """
  dilated_heads = query.shape[2] // 2 if dilated_heads is None else dilated_heads
  return _window_with_globals(
      "longformer", query, key, value, bias, mask, is_causal=is_causal,
      query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
      segment_ids=segment_ids, scale=scale, window_size=window_size, num_global=num_global,
      dilation=dilation, dilated_heads=dilated_heads)


def _first_draws(indices: Array) -> Array:
  """`[N, M]` ints -> True where the index is not already drawn earlier in its row."""
  num = indices.shape[1]
  earlier = jnp.tril(jnp.ones((num, num), bool), k=-1)  # [m, m'] m' < m
  repeated = (indices[:, :, None] == indices[:, None, :]) & earlier[None]
  return ~jnp.any(repeated, axis=-1)


def random_indices(rng: jax.Array, length: int, num_random: int, is_causal: bool) -> Array:
  """`[length, num_random]` int32: row i holds draws uniform over [0, length)
  (over [0, i] when causal). Draws may repeat; a repeat counts once."""
  if is_causal:
    uniform = jax.random.uniform(rng, (length, num_random))
    drawn = jnp.floor(uniform * (jnp.arange(length)[:, None] + 1)).astype(jnp.int32)
    return jnp.minimum(drawn, jnp.arange(length)[:, None])
  return jax.random.randint(rng, (length, num_random), 0, length, dtype=jnp.int32)


def _require_rng(variant: str, rng) -> jax.Array:
  if rng is None:
    raise ValueError(f"attention variant {variant!r} draws its pattern from rng: pass a PRNG "
                     f"key (MultiHeadAttention supplies one through its 'extras' module).")
  return rng


def random_attention(query: Array, key: Array, value: Array, bias=None, mask=None, *,
                     is_causal: bool = False, query_seq_lengths=None,
                     key_value_seq_lengths=None, segment_ids=None, rng: jax.Array = None,
                     num_random: int = 16, window_size: Optional[int] = None,
                     scale: Optional[float] = None) -> Array:
  """Random attention (Zaheer et al. 2020): query i attends to the keys
  `random_indices(rng, T, num_random, is_causal)[i]`, plus its window of
  `window_size` each side when given (blockwise; the random draws inside the
  window count once). The random keys are gathered, `[B, T, r, H, D]`: O(T (w + r)).
  """
  length = _self_attention_length("random", query, key)
  rng = _require_rng("random", rng)
  common.check_size("num_random", num_random, length=length)
  if window_size is not None:
    common.check_size("window_size", window_size, length=length)
  inputs = _prepare("random", query, key, value, bias, mask, is_causal=is_causal,
                    key_value_seq_lengths=key_value_seq_lengths, segment_ids=segment_ids,
                    scale=scale, multiple=window_size or 1)
  pad = inputs.padded_len - length
  indices = random_indices(rng, length, num_random, inputs.is_causal)
  index_ok = jnp.pad(_first_draws(indices), [(0, pad), (0, 0)])
  indices = jnp.pad(indices, [(0, pad), (0, 0)])
  parts = []
  outside_window = None
  if window_size is not None:
    parts.append(_windowed_part(inputs, window_size, window_size, window_size))
    outside_window = lambda q, k: ~_window(window_size, window_size)(q, k)
  parts.append(_gathered_keys_part(inputs, indices, index_ok,
                                   _all_of(_causal(inputs.is_causal), outside_window)))
  return _finish(_merge_parts(parts), inputs, query_seq_lengths, query.dtype)


def bigbird_blocks(rng: jax.Array, num_blocks: int, num_random_blocks: int, num_global_blocks: int,
                   is_causal: bool) -> Array:
  """BigBird's random key blocks `[num_blocks, r]`: block indices drawn per
  query block, with -1 where a draw repeats an earlier one, falls in the
  window (blocks n - 1, n, n + 1) or is global (< num_global_blocks)."""
  drawn = random_indices(rng, num_blocks, num_random_blocks, is_causal)
  query_block = jnp.arange(num_blocks)[:, None]
  keep = (_first_draws(drawn) & (jnp.abs(drawn - query_block) > 1)
          & (drawn >= num_global_blocks))
  return jnp.where(keep, drawn, -1)


def bigbird_attention(query: Array, key: Array, value: Array, bias=None, mask=None, *,
                      is_causal: bool = False, query_seq_lengths=None,
                      key_value_seq_lengths=None, segment_ids=None, rng: jax.Array = None,
                      block_size: int = 64, num_global_blocks: int = 1,
                      num_random_blocks: int = 3, scale: Optional[float] = None) -> Array:
  """BigBird (Zaheer et al. 2020), blockified with blocks of b = `block_size`:
  query block n attends to key blocks n - 1, n, n + 1 (window), the first
  g = `num_global_blocks` blocks (global, which also attend to everything)
  and the r = `num_random_blocks` blocks `bigbird_blocks(rng, ...)[n]`.
  T is padded to a multiple of b. O(T b (3 + g + r)).
  """
  length = _self_attention_length("bigbird", query, key)
  rng = _require_rng("bigbird", rng)
  common.check_size("block_size", block_size, length=length)
  num_blocks = -(-length // block_size)
  _check_at_most("num_global_blocks", num_global_blocks, "the number of blocks", num_blocks,
                 minimum=0)
  _check_at_most("num_random_blocks", num_random_blocks, "the number of blocks", num_blocks,
                 minimum=0)
  inputs = _prepare("bigbird", query, key, value, bias, mask, is_causal=is_causal,
                    key_value_seq_lengths=key_value_seq_lengths, segment_ids=segment_ids,
                    scale=scale, multiple=block_size)
  num_global = num_global_blocks * block_size
  not_global = _keys_from(num_global) if num_global else None
  parts = [_block_window_part(inputs, block_size, not_global)]
  if num_random_blocks:
    random_blocks = bigbird_blocks(rng, num_blocks, num_random_blocks, num_global_blocks,
                                   inputs.is_causal)
    query_, key_, value_, positions, key_ok, segments = _striped(inputs, 1)
    part = _block_part(query_, key_, value_, positions, key_ok, segments, block_size,
                       random_blocks, _causal(inputs.is_causal))
    parts.append(_map_part(_from_stripes, part))
  out = _with_globals(inputs, num_global, parts)
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


class PatternRng(nn.Module):
  """The PRNG key `random` and `bigbird` draw their pattern from.

  From the "attention" RNG stream when the caller supplies one (a trainer that
  wants a new pattern each step), else a fixed key from `seed`.
  """

  seed: int = 0

  @nn.compact
  def __call__(self, query, key, value, deterministic: bool = True):
    del query, key, value, deterministic
    if self.has_rng("attention"):
      return {"rng": self.make_rng("attention")}
    return {"rng": jax.random.PRNGKey(self.seed)}


# ----------------------------------------------------------------------------
# Registration.

_SPARSE = dict(family="sparse", subquadratic=True, exact=True, causal=True, cross=False)

_SCALE = dict(scale="multiplies the logits; 1/sqrt(D) when None")
_WINDOW = dict(window_size="keys each side of the query (w)")
_SEED = dict(seed="pattern seed when the caller gives no 'attention' RNG stream")
_FACTORIZED = dict(
    stride="the stride l; ceil(sqrt(T)) when None",
    combine="'merged' (one softmax over both patterns), 'per_head' or 'interleaved'",
    pattern="with combine='interleaved': the pattern this layer uses",
    layer_index="with combine='interleaved': picks the pattern by its parity")

for _name in ("local", "band"):
  registry.register(registry.VariantSpec(name=_name, fn=local_attention, complexity="O(T w)",
                                         paper="Parmar et al. 2018",
                                         options={**_WINDOW, **_SCALE}, **_SPARSE))
registry.register(registry.VariantSpec(
    name="block_local", fn=block_local_attention, complexity="O(T b)", paper="Qiu et al. 2019",
    options=dict(block_size="queries attend within their own block of this many", **_SCALE),
    **_SPARSE))
registry.register(registry.VariantSpec(
    name="dilated", fn=dilated_attention, complexity="O(T w)", paper="Beltagy et al. 2020",
    options=dict(**_WINDOW, dilation="gap between attended keys", **_SCALE), **_SPARSE))
registry.register(registry.VariantSpec(name="strided", fn=strided_attention,
                                       complexity="O(T sqrt(T))", paper="Child et al. 2019",
                                       options={**_FACTORIZED, **_SCALE}, **_SPARSE))
registry.register(registry.VariantSpec(
    name="fixed", fn=fixed_attention, complexity="O(T sqrt(T))", paper="Child et al. 2019",
    options=dict(_FACTORIZED, num_summary="summary positions c at the end of each block",
                 **_SCALE), **_SPARSE))
registry.register(registry.VariantSpec(
    name="global_tokens", fn=global_tokens_attention, complexity="O(T (w + g))",
    paper="Guo et al. 2019",
    options=dict(num_global="leading tokens that attend and are attended everywhere",
                 **_WINDOW, **_SCALE), **_SPARSE))
registry.register(registry.VariantSpec(
    name="random", fn=random_attention, complexity="O(T (w + r))", paper="Zaheer et al. 2020",
    extras=PatternRng,
    options=dict(num_random="random keys per query",
                 window_size="also attend to this many keys each side; None for none",
                 **_SEED, **_SCALE), **_SPARSE))
registry.register(registry.VariantSpec(
    name="longformer", fn=longformer_attention, complexity="O(T (w + g))",
    paper="Beltagy et al. 2020",
    options=dict(**_WINDOW, dilation="gap between keys on the dilated heads",
                 dilated_heads="heads that use the dilation; half of them when None",
                 num_global="leading global tokens", **_SCALE), **_SPARSE))
registry.register(registry.VariantSpec(
    name="bigbird", fn=bigbird_attention, complexity="O(T b (3 + g + r))",
    paper="Zaheer et al. 2020", extras=PatternRng,
    options=dict(block_size="tokens per block b", num_global_blocks="leading global blocks g",
                 num_random_blocks="random key blocks per query block r", **_SEED, **_SCALE),
    **_SPARSE))
registry.register(registry.VariantSpec(
    name="axial", fn=axial_attention, complexity="O(T sqrt(T))", paper="Ho et al. 2019",
    family="sparse", subquadratic=True, exact=False, causal=True, cross=False,
    options=dict(shape="(rows, cols) with rows * cols = T; the most square when None",
                 **_SCALE)))
