"""The sparse family's engine: exact softmax attention over a pattern of
allowed query-key pairs, assembled from partial softmaxes, never a T x T array.

A pattern is computed as one or more *parts*, each a softmax over a subset of
the keys, kept unnormalised (`Part`), made in one of three ways:

  * blocks (`block_part`): queries split into blocks of `b`; each block
    attends to a few gathered key blocks (its neighbours for a band, drawn
    blocks for BigBird), with the exact pattern as a predicate over positions
    inside that small `[b, M b]` tile;
  * stripes (`to_stripes`): positions with the same residue modulo `d` form a
    subsequence; a dilated band is a plain band on it, and the Sparse
    Transformer's strided pattern is full attention within it;
  * a dense part over an explicit small set of queries or keys (global tokens,
    the fixed pattern's summary columns).

Partial softmaxes over disjoint key sets are combined exactly by
`merge_parts` (log-sum-exp merging); each pattern excludes from one side the
keys the other already covers. `prepare` checks a call and pads it to the
block sizes (`Inputs`), `finish` cuts the padding off again; the family
modules beside this one build their variants from these pieces.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from attention_jax.core import masks as mask_lib
from attention_jax.variants import common

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
class Inputs:
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


def prepare(variant: str, query: Array, key: Array, value: Array, bias, mask, *,
            is_causal: bool, key_value_seq_lengths, segment_ids, scale: Optional[float],
            multiple: int, offset: int = 0, pad_always: bool = False) -> Inputs:
  """Validates the call and pads T so that T - `offset` is a multiple of
  `multiple`: the fewest positions, or with `pad_always` the LRA release's
  `T + b - (T mod b)` (at least one, a whole block when b divides T)."""
  common.reject_unsupported(variant, bias=bias)
  batch, q_len, num_heads, head_dim = query.shape
  kv_len = self_attention_length(variant, query, key)
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
  return Inputs(query=pad_time(query), key=pad_time(key), value=pad_time(value),
                key_ok=pad_time(key_ok), segments=segments, length=q_len,
                is_causal=bool(is_causal))


def self_attention_length(variant: str, query: Array, key: Array) -> int:
  """T, after checking that queries and keys have the same length."""
  q_len, kv_len = query.shape[1], key.shape[1]
  if q_len != kv_len:
    raise ValueError(f"attention variant {variant!r} is self-attention only: the query length "
                     f"({q_len}) must equal the key/value length ({kv_len}).")
  return q_len


def finish(out: Array, inputs: Inputs, query_seq_lengths, dtype) -> Array:
  """`[B, Tp, H, Dv]` -> `[B, T, H, Dv]` in `dtype`, padded queries zeroed."""
  out = out[:, :inputs.length].astype(dtype)
  return common.zero_padded_queries(out, query_seq_lengths)


# ----------------------------------------------------------------------------
# Partial softmaxes and their exact merge.


class Part(NamedTuple):
  """Softmax over a subset of keys, unnormalised: for each query and head,
  `acc = sum_k exp(s_k - row_max) v_k` `[..., H, Dv]`, `row_max` (a constant,
  -inf when no key is allowed) and `total = sum_k exp(s_k - row_max)` `[..., H]`."""

  acc: Array
  row_max: Array
  total: Array


def _finite(x: Array) -> Array:
  return jnp.where(jnp.isfinite(x), x, 0.0)


def dense_part(query: Array, key: Array, value: Array, q_pos: Array, k_pos: Array,
               key_ok: Array, q_seg: Optional[Array], k_seg: Optional[Array],
               allowed: Optional[Predicate],
               position_logits: Optional[PositionLogits] = None) -> Part:
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
    A `Part` with leading dims `[B, G, Q]`.
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
  return Part(acc, to_query_major(row_max), to_query_major(jnp.sum(weights, axis=-1)))


def merge_parts(parts: Sequence[Part]) -> Array:
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


def all_of(*predicates: Optional[Predicate]) -> Optional[Predicate]:
  predicates = [p for p in predicates if p is not None]
  if not predicates:
    return None

  def allowed(q_pos, k_pos):
    result = predicates[0](q_pos, k_pos)
    for predicate in predicates[1:]:
      result = result & predicate(q_pos, k_pos)
    return result
  return allowed


def causal_keys(is_causal: bool) -> Optional[Predicate]:
  return (lambda q, k: k <= q) if is_causal else None


def keys_within(left: int, right: int) -> Predicate:
  """Keys in [q - left, q + right]."""
  return lambda q, k: (k >= q - left) & (k <= q + right)


def keys_from(first: int) -> Predicate:
  """Keys at positions >= first (the ones global columns do not already cover)."""
  return lambda q, k: k >= first


def to_stripes(x: Array, stride: int) -> Array:
  """`[B, T, ...]` -> `[B, stride, T / stride, ...]`: stripe r holds positions
  r, r + stride, r + 2 stride, ..."""
  batch, length = x.shape[:2]
  x = x.reshape(batch, length // stride, stride, *x.shape[2:])
  return jnp.swapaxes(x, 1, 2)


def from_stripes(x: Array) -> Array:
  """Inverse of `to_stripes`."""
  batch, stride, length = x.shape[:3]
  return jnp.swapaxes(x, 1, 2).reshape(batch, stride * length, *x.shape[3:])


def striped(inputs: Inputs, stride: int):
  """The inputs as `stride` stripes: q/k/v `[B, S, T/S, H, D]`, positions
  `[S, T/S]`, key_ok `[B, S, T/S]`, segments likewise (or None)."""
  positions = to_stripes(jnp.arange(inputs.padded_len)[None], stride)[0]
  segments = None
  if inputs.segments is not None:
    segments = tuple(to_stripes(s, stride) for s in inputs.segments)
  return (to_stripes(inputs.query, stride), to_stripes(inputs.key, stride),
          to_stripes(inputs.value, stride), positions, to_stripes(inputs.key_ok, stride),
          segments)


def map_part(fn: Callable[[Array], Array], part: Part) -> Part:
  return Part(*(fn(x) for x in part))


def block_part(query: Array, key: Array, value: Array, positions: Array, key_ok: Array,
               segments: Optional[Tuple[Array, Array]], block: int, key_blocks: Array,
               allowed: Optional[Predicate],
               position_logits: Optional[PositionLogits] = None) -> Part:
  """Blocks of queries attend to gathered blocks of keys.

  Args:
    query, key, value: `[B, S, L, H, D]` (S stripes of length L, a multiple of `block`).
    positions: `[S, L]`; key_ok: `[B, S, L]`; segments: pair of `[B, S, L]` or None.
    block: the block size b.
    key_blocks: `[L / b, M]` int, or `[S, L / b, M]` for blocks of each
      stripe: query block n attends to key blocks `key_blocks[n]`; indices
      outside [0, L / b) stand for nothing.
    allowed: the exact pattern inside the gathered `[b, M b]` tiles.
    position_logits: logits from the positions, added to q . k (see `dense_part`).

  Returns:
    A `Part` with leading dims `[B, S, L]`. Cost: O(S L M b) scores.
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
  part = dense_part(query_blocks(query), gathered(key), gathered(value),
                    query_blocks(pos)[0], gathered(pos)[0], key_ok_tiles, q_seg, k_seg,
                    allowed, position_logits)
  return map_part(lambda x: x.reshape(batch, stripes, length, *x.shape[3:]), part)


def windowed_part(inputs: Inputs, left: int, right: int, block: int, dilation: int = 1,
                  extra: Optional[Predicate] = None,
                  position_logits: Optional[PositionLogits] = None) -> Part:
  """Query i attends to keys i + dilation * m, -left <= m <= right (right = 0
  when causal), and `extra`; blockwise on the stripes of `dilation`.

  Each query block gathers the ceil(left / b) + ceil(right / b) + 1 key blocks
  that hold its window (3 when b = w, 2 when causal). The padded length must
  be a multiple of `block * dilation`. Cost: O(T (left + right + b)) scores.
  """
  right = 0 if inputs.is_causal else right
  query, key, value, positions, key_ok, segments = striped(inputs, dilation)
  num_blocks = positions.shape[1] // block
  offsets = jnp.arange(-ceil_div(left, block), ceil_div(right, block) + 1)
  key_blocks = jnp.arange(num_blocks)[:, None] + offsets[None, :]
  # Keys of one stripe are `dilation` apart, so a window of m stripe steps is
  # m * dilation positions.
  allowed = all_of(keys_within(left * dilation, right * dilation),
                   causal_keys(inputs.is_causal), extra)
  part = block_part(query, key, value, positions, key_ok, segments, block, key_blocks, allowed,
                    position_logits)
  return map_part(from_stripes, part)


def check_at_most(name: str, value: int, limit_name: str, limit: int, minimum: int = 1) -> int:
  """Like `common.check_size`, for a size bounded by another option rather than by T."""
  common.check_size(name, value, minimum=minimum)
  if value > limit:
    raise ValueError(f"{name}={value} must be at most {limit_name}={limit}.")
  return value


def ceil_div(a: int, b: int) -> int:
  return -(-a // b)


def own_block_part(inputs: Inputs, block: int, extra: Optional[Predicate] = None) -> Part:
  """Query block n attends to key block n (lower triangle when causal). O(T b)."""
  num_blocks = inputs.padded_len // block
  query, key, value, positions, key_ok, segments = striped(inputs, 1)
  part = block_part(query, key, value, positions, key_ok, segments, block,
                    jnp.arange(num_blocks)[:, None], all_of(causal_keys(inputs.is_causal), extra))
  return map_part(from_stripes, part)


def columns_part(inputs: Inputs, columns: np.ndarray, allowed: Optional[Predicate]) -> Part:
  """Every query attends to the keys at the C positions `columns`. Cost O(T C)."""
  cols = jnp.asarray(columns, jnp.int32)
  segments = (None, None)
  if inputs.segments is not None:
    segments = (inputs.segments[0][:, None], inputs.segments[1][:, cols][:, None])
  part = dense_part(inputs.query[:, None], inputs.key[:, cols][:, None],
                    inputs.value[:, cols][:, None], jnp.arange(inputs.padded_len)[None],
                    cols[None], inputs.key_ok[:, cols][:, None], *segments, allowed)
  return map_part(lambda x: x[:, 0], part)


def _global_rows(inputs: Inputs, positions: np.ndarray) -> Array:
  """Outputs `[B, G, H, Dv]` of the queries at the G `positions`, which attend
  to every key. O(G T)."""
  rows = jnp.asarray(positions, jnp.int32)
  every = jnp.arange(inputs.padded_len)
  segments = (None, None)
  if inputs.segments is not None:
    segments = (inputs.segments[0][:, None, rows], inputs.segments[1][:, None])
  part = dense_part(inputs.query[:, None, rows], inputs.key[:, None],
                    inputs.value[:, None], rows[None], every[None],
                    inputs.key_ok[:, None], *segments, causal_keys(inputs.is_causal))
  return merge_parts([map_part(lambda x: x[:, 0], part)])


def with_globals(inputs: Inputs, num_global, local_parts: Sequence[Part]) -> Array:
  """Global tokens attend to all and are attended by all; the other queries
  attend to them plus `local_parts` (which must exclude the global keys).

  Args:
    num_global: g, for the first g tokens, or the global positions (numpy ints).

  Returns `[B, Tp, H, Dv]` float32.
  """
  positions = np.arange(num_global) if np.isscalar(num_global) else np.asarray(num_global)
  if positions.size == 0:
    return merge_parts(local_parts)
  columns = columns_part(inputs, positions, causal_keys(inputs.is_causal))
  out = merge_parts([*local_parts, columns])
  return out.at[:, positions].set(_global_rows(inputs, positions))


def head_range(inputs: Inputs, start: int, stop: int) -> Inputs:
  return dataclasses.replace(inputs, query=inputs.query[:, :, start:stop],
                             key=inputs.key[:, :, start:stop], value=inputs.value[:, :, start:stop])


def concat_heads(parts: Sequence[Part]) -> Part:
  """Parts of disjoint head ranges, `[B, T, h_i, ...]` -> `[B, T, H, ...]`."""
  return Part(*(jnp.concatenate(xs, axis=2) for xs in zip(*parts)))


# ----------------------------------------------------------------------------
# What every sparse variant registers with.

SPARSE_SPEC = dict(family="sparse", subquadratic=True, exact=True, causal=True, cross=False)

SCALE_OPTION = dict(scale="multiplies the logits; 1/sqrt(D) when None")
WINDOW_OPTION = dict(window_size="keys each side of the query (w)")
