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

  Needs `block >= max(left, right)` (so the neighbouring blocks hold the
  window) and the padded length a multiple of `block * dilation`. Cost:
  O(T b) scores, b = `block`.
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


# ----------------------------------------------------------------------------
# Registration.

_SPARSE = dict(family="sparse", subquadratic=True, exact=True, causal=True, cross=False)

for _name in ("local", "band"):
  registry.register(registry.VariantSpec(name=_name, fn=local_attention, complexity="O(T w)",
                                         paper="Parmar et al. 2018", **_SPARSE))
registry.register(registry.VariantSpec(name="block_local", fn=block_local_attention,
                                       complexity="O(T b)", paper="Qiu et al. 2019", **_SPARSE))
registry.register(registry.VariantSpec(name="dilated", fn=dilated_attention, complexity="O(T w)",
                                       paper="Beltagy et al. 2020", **_SPARSE))
