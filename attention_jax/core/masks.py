"""Attention masks as predicates over query and key positions.

Every mask here is a function of position indices rather than of a materialised
[Tq, Tk] grid. The dense path evaluates the predicates on the full grid
(`positions(Tq)[:, None]`, `positions(Tk)[None, :]`); blockwise and sparse code
evaluates the same predicates on the positions of one block, so every
implementation agrees on what "causal" or "window" means by construction.

Conventions (those of `jax.nn.dot_product_attention`):
  * `True` means "may attend".
  * causal is top-left aligned: query i sees keys j <= i.
  * a window `(left, right)` lets query i see keys in [i - left, i + right].
  * padding lengths count valid tokens from the start of each sequence.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple, Union

import jax.numpy as jnp

Array = jnp.ndarray
Window = Union[int, Tuple[int, int]]


def normalize_window(local_window_size: Optional[Window]) -> Optional[Tuple[int, int]]:
  """Returns `(left, right)` from an int (symmetric) or a pair; validates it."""
  if local_window_size is None:
    return None
  if isinstance(local_window_size, int):
    window = (local_window_size, local_window_size)
  elif (isinstance(local_window_size, (tuple, list)) and len(local_window_size) == 2
        and all(isinstance(w, int) for w in local_window_size)):
    window = tuple(local_window_size)
  else:
    raise ValueError(
        "local_window_size must be an int or a pair of ints (left, right), got "
        f"{local_window_size!r}.")
  if min(window) < 0:
    raise ValueError(f"local_window_size must be non-negative, got {local_window_size!r}.")
  return window


Reach = Tuple[Optional[int], Optional[int]]


def reach_of(is_causal: bool, window: Optional[Tuple[int, int]]) -> Reach:
  """How far a query sees: keys k with q - left <= k <= q + right; None is unbounded.

  Causal attention is reach (None, 0), a window (left, right) is itself, and
  both together clip the right side to 0. Blockwise code uses the reach to skip
  blocks that no query of a block can see.
  """
  left, right = (None, None) if window is None else window
  if is_causal:
    right = 0 if right is None else min(right, 0)
  return left, right


def reach_predicate(q_pos: Array, k_pos: Array, reach: Reach) -> Optional[Array]:
  """Query at `q_pos` may see the key at `k_pos` (None when the reach is unbounded)."""
  left, right = reach
  allowed = None
  if right is not None:
    allowed = k_pos <= q_pos + right
  if left is not None:
    allowed = and_masks(allowed, k_pos >= q_pos - left)
  return allowed


def length_predicate(pos: Array, lengths: Array) -> Array:
  """Position `pos` is inside a sequence of `lengths` valid tokens."""
  return pos < lengths


def segment_predicate(q_segment_ids: Array, kv_segment_ids: Array) -> Array:
  """Tokens of packed sequences only see tokens of the same segment."""
  return q_segment_ids == kv_segment_ids


def and_masks(*masks: Optional[Array]) -> Optional[Array]:
  """Logical AND of the masks that are not None (None if all are)."""
  result = None
  for mask in masks:
    if mask is None:
      continue
    result = mask if result is None else jnp.logical_and(result, mask)
  return result


def check_boolean_mask(mask: Optional[Array]) -> None:
  """A ValueError unless `mask` is None or boolean. Cast to bool, an additive
  mask (0 allowed, -inf masked) would allow exactly the masked pairs."""
  if mask is not None and jnp.result_type(mask) != jnp.bool_:
    raise ValueError(f"mask must be boolean (True may attend), got dtype "
                     f"{jnp.result_type(mask)}.")


def make_attention_mask(
    q_len: int,
    kv_len: int,
    *,
    is_causal: bool = False,
    local_window_size: Optional[Window] = None,
    query_seq_lengths: Optional[Array] = None,
    key_value_seq_lengths: Optional[Array] = None,
    q_segment_ids: Optional[Array] = None,
    kv_segment_ids: Optional[Array] = None,
    mask: Optional[Array] = None,
    q_offset: Union[int, Array] = 0,
) -> Optional[Array]:
  """Combines every kind of mask into one boolean `[B|1, H|1, Tq, Tk]` array.

  Args:
    q_len, kv_len: Tq and Tk.
    is_causal: top-left aligned causal mask (shifted by `q_offset`).
    local_window_size: int or (left, right); see `normalize_window`.
    query_seq_lengths: `[B]` valid query tokens per sequence.
    key_value_seq_lengths: `[B]` valid key/value tokens per sequence.
    q_segment_ids: `[B, Tq]` segment of each query token (packed sequences).
    kv_segment_ids: `[B, Tk]` segment of each key token.
    mask: boolean, broadcastable to `[B, H, Tq, Tk]`; ANDed with the rest
      (another dtype is refused: cast, an additive mask would invert).
    q_offset: absolute position of query 0 (decoding with a KV cache), so that
      causal and window masks compare absolute positions.

  Returns:
    A boolean array of rank 4, or None when nothing is masked.
  """
  q_pos = (jnp.arange(q_len) + q_offset)[:, None]  # [Tq, 1]
  k_pos = jnp.arange(kv_len)[None, :]  # [1, Tk]
  window = normalize_window(local_window_size)

  masks = []
  structured = reach_predicate(q_pos, k_pos, reach_of(is_causal, window))
  if structured is not None:
    masks.append(structured[None, None])
  if query_seq_lengths is not None:
    # Padded queries see nothing; their outputs (and gradients) are zero.
    q_valid = length_predicate(jnp.arange(q_len)[None, :], query_seq_lengths[:, None])
    masks.append(q_valid[:, None, :, None])
  if key_value_seq_lengths is not None:
    k_valid = length_predicate(jnp.arange(kv_len)[None, :], key_value_seq_lengths[:, None])
    masks.append(k_valid[:, None, None, :])
  if q_segment_ids is not None:
    masks.append(segment_predicate(q_segment_ids[:, None, :, None],
                                   kv_segment_ids[:, None, None, :]))
  if mask is not None:
    check_boolean_mask(mask)
    masks.append(jnp.asarray(mask))
  return and_masks(*masks)


def split_segment_ids(
    segment_ids: Union[None, Array, Sequence[Array]]
) -> Tuple[Optional[Array], Optional[Array]]:
  """Accepts `[B, T]` (self-attention) or a pair `(q_segment_ids, kv_segment_ids)`."""
  if segment_ids is None:
    return None, None
  if isinstance(segment_ids, (tuple, list)):
    if len(segment_ids) != 2:
      raise ValueError(
          "segment_ids must be a [B, T] array or a pair (q_segment_ids, kv_segment_ids), "
          f"got a sequence of length {len(segment_ids)}.")
    return jnp.asarray(segment_ids[0]), jnp.asarray(segment_ids[1])
  segment_ids = jnp.asarray(segment_ids)
  return segment_ids, segment_ids
