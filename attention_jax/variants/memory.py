"""Attention with learned memories: persistent key/value vectors, inducing points, latents.

* `persistent_memory` (Sukhbaatar et al. 2019, the all-attention layer): N
  learned key and value vectors per K/V head are prepended to the keys and
  values of every sequence. Every query sees them whatever the masks say; the
  sequence's own keys follow the given masks. Exact softmax attention over the
  extended keys, computed by `dot_product_attention`, so it runs on every
  implementation (XLA, blockwise, Pallas).
* `inducing_points` (Lee et al. 2019, Set Transformer ISAB) and `perceiver`
  (Jaegle et al. 2021, decoded Perceiver IO style): a few learned vectors
  attend to the long input and the input attends back to them, O(T m). Both are
  `latent_bottleneck_attention` with different blocks.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Sequence

import flax.linen as nn
import jax.numpy as jnp
from flax.core import FrozenDict

from attention_jax import registry
from attention_jax.core.masks import and_masks, make_attention_mask, split_segment_ids
from attention_jax.layers.attention import MultiHeadAttention
from attention_jax.layers.feedforward import FeedForward
from attention_jax.variants import common
from attention_jax.variants.dense import dot_product_attention

Array = jnp.ndarray
Dtype = Any


# --------------------------------------------------------------------------------------
# Persistent memory (all-attention layer).


def _prepend_memory(memory: Array, sequence: Array) -> Array:
  """memory `[N, Hkv, D]`, sequence `[B, T, Hkv, D]` -> `[B, N + T, Hkv, D]`."""
  batch = sequence.shape[0]
  memory = jnp.broadcast_to(memory.astype(sequence.dtype), (batch,) + memory.shape)
  return jnp.concatenate([memory, sequence], axis=1)


def _pad_key_axis(array: Optional[Array], kv_len: int, num_memory: int, fill) -> Optional[Array]:
  """A `[B|1, H|1, Tq|1, Tk|1]` mask or bias -> `[..., N + Tk]`, `fill` on the memory slots."""
  if array is None:
    return None
  array = jnp.asarray(array)
  if array.ndim != 4 or array.shape[3] not in (1, kv_len):
    raise ValueError(f"mask and bias must have rank 4, broadcastable to [B, H, Tq, Tk] with "
                     f"Tk = {kv_len}, got shape {list(array.shape)}.")
  array = jnp.broadcast_to(array, array.shape[:3] + (kv_len,))
  return jnp.pad(array, ((0, 0), (0, 0), (0, 0), (num_memory, 0)), constant_values=fill)


def persistent_memory_attention(
    query: Array,
    key: Array,
    value: Array,
    bias: Optional[Array] = None,
    mask: Optional[Array] = None,
    *,
    is_causal: bool = False,
    query_seq_lengths: Optional[Array] = None,
    key_value_seq_lengths: Optional[Array] = None,
    segment_ids=None,
    memory_key: Array,
    memory_value: Array,
    scale: Optional[float] = None,
    implementation: Optional[str] = None,
    dropout_rate: float = 0.0,
    dropout_rng=None,
) -> Array:
  """softmax over [memory keys; keys] of q k^T * scale, times [memory values; values].

  The memory slots are always visible: padding, causal, segment masks and
  `mask` only apply to the sequence's own keys. They are translated for the
  extended key axis `[N memory slots, Tk keys]` so that `dot_product_attention`
  keeps its structured masks where it can:
  key lengths `L` become `L + N`; causal (key j <= query i) becomes the window
  "extended key j' <= i + N"; `mask` and `bias` get N always-visible (zero
  bias) columns. Segment ids have no structured equivalent (no one memory
  segment id matches every query), so they become a dense boolean mask; the
  layer costs O(Tq (N + Tk)) anyway.

  Args:
    query: `[B, Tq, H, D]`.
    key: `[B, Tk, Hkv, D]`.
    value: `[B, Tk, Hkv, Dv]`.
    bias: additive, rank 4, broadcastable to `[B, H, Tq, Tk]`.
    mask: boolean, rank 4, broadcastable to `[B, H, Tq, Tk]`; True may attend.
    is_causal: query i sees keys j <= i (and all memory slots).
    query_seq_lengths: `[B]`; queries past it output zeros.
    key_value_seq_lengths: `[B]`; keys past it are ignored (memory is not).
    segment_ids: `[B, T]` or `(q_segment_ids [B, Tq], kv_segment_ids [B, Tk])`.
    memory_key: `[N, Hkv, D]` persistent keys.
    memory_value: `[N, Hkv, Dv]` persistent values.
    scale, implementation, dropout_rate, dropout_rng: as in `dot_product_attention`.

  Returns:
    `[B, Tq, H, Dv]`.
  """
  num_memory, kv_len, q_len = memory_key.shape[0], key.shape[1], query.shape[1]
  if memory_key.ndim != 3 or memory_key.shape[1:] != key.shape[2:]:
    raise ValueError(f"memory_key must be [N, Hkv, D] = [N, {key.shape[2]}, {key.shape[3]}], "
                     f"got shape {list(memory_key.shape)}.")
  if memory_value.ndim != 3 or memory_value.shape != (num_memory,) + value.shape[2:]:
    raise ValueError(f"memory_value must be [N, Hkv, Dv] = [{num_memory}, {value.shape[2]}, "
                     f"{value.shape[3]}], got shape {list(memory_value.shape)}.")
  extended_mask = _pad_key_axis(mask, kv_len, num_memory, True)
  q_segments, kv_segments = split_segment_ids(segment_ids)
  if q_segments is not None:
    same_segment = make_attention_mask(q_len, kv_len, q_segment_ids=q_segments,
                                       kv_segment_ids=kv_segments)
    extended_mask = and_masks(
        extended_mask, _pad_key_axis(same_segment, kv_len, num_memory, True))
  lengths = None
  if key_value_seq_lengths is not None:
    lengths = jnp.asarray(key_value_seq_lengths) + num_memory
  # Causal shifted by N: query i sees extended keys [i - q_len, i + N], i.e. all of them up to i + N.
  window = (q_len, num_memory) if is_causal else None
  return dot_product_attention(
      query, _prepend_memory(memory_key, key), _prepend_memory(memory_value, value),
      _pad_key_axis(bias, kv_len, num_memory, 0), extended_mask, scale=scale,
      query_seq_lengths=query_seq_lengths, key_value_seq_lengths=lengths,
      local_window_size=window, implementation=implementation, dropout_rate=dropout_rate,
      dropout_rng=dropout_rng)


class PersistentMemory(nn.Module):
  """The persistent key and value vectors of `persistent_memory_attention`.

  Built by `MultiHeadAttention(attention="persistent_memory",
  attention_options={"num_memory_slots": N})`. Initialised as in the paper:
  keys ~ N(0, 1/D), values ~ N(0, 1/N).

  Attributes:
    num_memory_slots: N learned key/value vectors per K/V head.
    param_dtype: dtype of the memories.
  """

  num_memory_slots: int = 16
  param_dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, query: Array, key: Array, value: Array, *, deterministic: bool = True):
    """key `[B, Tk, Hkv, D]`, value `[B, Tk, Hkv, Dv]` -> the memories for the function."""
    del query, deterministic
    num_memory = common.check_size("num_memory_slots", self.num_memory_slots)
    _, _, num_kv_heads, head_dim = key.shape
    value_dim = value.shape[-1]
    memory_key = self.param("memory_key", nn.initializers.normal(head_dim ** -0.5),
                            (num_memory, num_kv_heads, head_dim), self.param_dtype)
    memory_value = self.param("memory_value", nn.initializers.normal(num_memory ** -0.5),
                              (num_memory, num_kv_heads, value_dim), self.param_dtype)
    return dict(memory_key=memory_key, memory_value=memory_value)


registry.register(registry.VariantSpec(
    name="persistent_memory", fn=persistent_memory_attention, family="memory",
    complexity="O(T^2 + T N)", subquadratic=False, exact=True, causal=True, cross=True,
    paper="Sukhbaatar et al. 2019", extras=PersistentMemory))
