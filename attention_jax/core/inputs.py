"""The kernel interface: one attention call's validated inputs, and its outputs.

Every implementation of exact attention (the dense XLA one in
`variants/dense.py`, the blockwise and Pallas kernels under `kernels/`)
receives an `AttentionInputs` that `prepare_inputs` built and checked, so
argument checking is written once; `returned_outputs` brings its result back
to the caller's rank, and `attention_of_empty_sequence` answers Tq = 0 or
Tk = 0 before any implementation's arithmetic. It lives in core, below the
variants, so that a kernel imports only core and a variant can call a kernel
without an import cycle.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence, Tuple, Union

import jax
import jax.numpy as jnp
import numpy as np

from attention_jax.core.masks import (Window, check_boolean_mask, make_attention_mask,
                                      normalize_window, split_segment_ids)
from attention_jax.core.softmax import MASKED_LOGSUMEXP, logsumexp_residual

Array = jnp.ndarray
SegmentIds = Union[None, Array, Tuple[Array, Array]]


@dataclasses.dataclass(frozen=True)
class AttentionInputs:
  """Validated rank-4 inputs of one attention call, shared by all implementations.

  query: [B, Tq, H, D]; key: [B, Tk, Hkv, D]; value: [B, Tk, Hkv, Dv];
  bias: float broadcastable to [B, H, Tq, Tk] or None; scale: float;
  the structured masks are kept separate (not materialised) so that blockwise
  implementations can evaluate them per block.
  """

  query: Array
  key: Array
  value: Array
  bias: Optional[Array]
  mask: Optional[Array]
  scale: float
  is_causal: bool
  query_seq_lengths: Optional[Array]
  key_value_seq_lengths: Optional[Array]
  local_window_size: Optional[Tuple[int, int]]
  q_segment_ids: Optional[Array]
  kv_segment_ids: Optional[Array]

  def dense_mask(self) -> Optional[Array]:
    """All masks combined into one boolean [B|1, H|1, Tq, Tk] array."""
    return make_attention_mask(
        self.query.shape[1], self.key.shape[1],
        is_causal=self.is_causal,
        local_window_size=self.local_window_size,
        query_seq_lengths=self.query_seq_lengths,
        key_value_seq_lengths=self.key_value_seq_lengths,
        q_segment_ids=self.q_segment_ids,
        kv_segment_ids=self.kv_segment_ids,
        mask=self.mask)


def _pairwise_rank4(name: str, array, target: Sequence[int]) -> Optional[Array]:
  """A bias or mask as `[B|1, H|1, Tq|1, Tk|1]`.

  Lower ranks gain leading 1s, jax.nn's rule (a `[Tk]` mask masks keys for
  every query, a `[Tq, Tk]` one is shared by batch and heads).
  """
  if array is None:
    return None
  array = jnp.asarray(array)
  shape = tuple(array.shape)
  if len(shape) > len(target):
    raise ValueError(f"{name} must have rank at most 4, [B, H, Tq, Tk] = {list(target)} (lower "
                     f"ranks gain leading 1s, as in jax.nn), got shape {list(shape)}.")
  padded = (1,) * (len(target) - len(shape)) + shape
  if not all(s in (1, t) for s, t in zip(padded, target)):
    raise ValueError(
        f"{name} must broadcast to [B, H, Tq, Tk] = {list(target)} (each dimension equal or 1; "
        f"lower ranks gain leading 1s, as in jax.nn), got shape {list(shape)}.")
  return array.reshape(padded)


def check_lengths(name: str, lengths: Optional[Array], batch: int,
                  max_len: Optional[int] = None) -> None:
  """A ValueError unless `lengths` is None or an integer `[B]` array, with
  values in [0, max_len] when `max_len` is given and the values are concrete."""
  if lengths is None:
    return
  if jnp.shape(lengths) != (batch,) or not jnp.issubdtype(jnp.asarray(lengths).dtype, jnp.integer):
    raise ValueError(f"{name} must be an integer array of shape [B] = [{batch}], "
                     f"got {jnp.asarray(lengths).dtype} {list(jnp.shape(lengths))}.")
  if max_len is not None and batch and not isinstance(lengths, jax.core.Tracer):
    # Values are only checkable outside jit.
    values = np.asarray(lengths)
    low, high = int(values.min()), int(values.max())
    if low < 0 or high > max_len:
      raise ValueError(f"{name} must lie in [0, {max_len}], got values in [{low}, {high}].")


def _check_segment_ids(name: str, ids: Optional[Array], batch: int, length: int) -> None:
  if ids is not None and jnp.shape(ids) != (batch, length):
    raise ValueError(f"{name} must have shape [B, T] = [{batch}, {length}], "
                     f"got {list(jnp.shape(ids))}.")


def prepare_inputs(query, key, value, bias=None, mask=None, *, scale=None, is_causal=False,
                   query_seq_lengths=None, key_value_seq_lengths=None,
                   local_window_size: Optional[Window] = None,
                   segment_ids: SegmentIds = None) -> Tuple[AttentionInputs, bool]:
  """Validates the arguments of `dot_product_attention` and brings them to rank 4.

  A bias or mask of rank below 4 gains leading 1s (as in jax.nn), also for an
  unbatched call, whose batch is then 1.

  Returns the inputs and whether the call was unbatched (rank 3).
  """
  query, key, value = jnp.asarray(query), jnp.asarray(key), jnp.asarray(value)
  if query.ndim not in (3, 4):
    raise ValueError(f"query must have rank 4 [B, Tq, H, D] (or 3 [Tq, H, D]), got shape "
                     f"{list(query.shape)}.")
  for name, x in (("key", key), ("value", value)):
    if x.ndim != query.ndim:
      raise ValueError(f"{name} must have the rank of query ({query.ndim}), got shape "
                       f"{list(x.shape)}.")
  unbatched = query.ndim == 3
  if unbatched:
    query, key, value = query[None], key[None], value[None]

  batch, q_len, num_heads, head_dim = query.shape
  if key.shape[0] != batch or value.shape[0] != batch:
    raise ValueError(f"query, key and value must share the batch size, got "
                     f"{query.shape[0]}, {key.shape[0]}, {value.shape[0]}.")
  if key.shape[1] != value.shape[1]:
    raise ValueError(f"key and value must have the same length Tk, got key {list(key.shape)} "
                     f"and value {list(value.shape)}.")
  if key.shape[3] != head_dim:
    raise ValueError(f"key head dim must equal query head dim {head_dim}, got key shape "
                     f"{list(key.shape)}.")
  num_kv_heads = key.shape[2]
  if value.shape[2] != num_kv_heads:
    raise ValueError(f"key and value must have the same number of heads, got key "
                     f"{list(key.shape)} and value {list(value.shape)}.")
  if num_heads % num_kv_heads:
    raise ValueError(f"the number of query heads ({num_heads}) must be a multiple of the "
                     f"number of key/value heads ({num_kv_heads}).")

  kv_len = key.shape[1]
  target = (batch, num_heads, q_len, kv_len)
  bias = _pairwise_rank4("bias", bias, target)
  mask = _pairwise_rank4("mask", mask, target)
  check_boolean_mask(mask)
  check_lengths("query_seq_lengths", query_seq_lengths, batch, q_len)
  check_lengths("key_value_seq_lengths", key_value_seq_lengths, batch, kv_len)
  q_segment_ids, kv_segment_ids = split_segment_ids(segment_ids)
  if unbatched and q_segment_ids is not None:
    q_segment_ids, kv_segment_ids = q_segment_ids[None], kv_segment_ids[None]
  _check_segment_ids("segment_ids (query side)", q_segment_ids, batch, q_len)
  _check_segment_ids("segment_ids (key/value side)", kv_segment_ids, batch, kv_len)
  if scale is None:
    scale = head_dim ** -0.5

  inputs = AttentionInputs(
      query=query, key=key, value=value,
      bias=bias, mask=mask,
      scale=scale, is_causal=bool(is_causal),
      query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
      local_window_size=normalize_window(local_window_size),
      q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids)
  return inputs, unbatched


def attention_of_empty_sequence(inputs: AttentionInputs, return_residual: bool = False
                                ) -> Union[None, Array, Tuple[Array, Array]]:
  """What attention over `inputs` returns when Tq = 0 or Tk = 0; None otherwise.

  With no key every query attends nothing: out zeros `[B, Tq, H, Dv]` (as
  jax.nn's) and lse `MASKED_LOGSUMEXP` `[B, Tq, H]` float32 (jax.nn: -inf).
  With no query both are empty. Every implementation answers these here,
  before its own arithmetic: the kernels divide by block sizes fitted to the
  lengths (0), XLA's softmax takes a maximum over an empty axis. The result
  does not depend on q, k, v or the bias, so their gradients are zeros of their
  own shapes (empty for empty inputs).
  """
  batch, q_len, num_heads, _ = inputs.query.shape
  if q_len and inputs.key.shape[1]:
    return None
  out = jnp.zeros((batch, q_len, num_heads, inputs.value.shape[-1]), inputs.query.dtype)
  lse = jnp.full((batch, q_len, num_heads), MASKED_LOGSUMEXP, jnp.float32)
  return (out, lse) if return_residual else out


def returned_outputs(result, unbatched: bool):
  """An implementation's result as `dot_product_attention` returns it.

  Args:
    result: `out` `[B, Tq, H, Dv]`, or `(out, lse)` with lse `[B, Tq, H]` float32.
    unbatched: the call had rank-3 inputs; the batch axis of 1 is dropped again.

  Returns:
    `out`, or `(out, residual)` with the residual in the output dtype
    (`logsumexp_residual`).
  """
  if isinstance(result, tuple):
    out, lse = result
    result = (out, logsumexp_residual(lse, out.dtype))
  return jax.tree.map(lambda x: x[0], result) if unbatched else result
