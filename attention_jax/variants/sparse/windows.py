"""Sliding and block windows: `local` (also registered as `band`),
`block_local` and `dilated`, and the band that other families compute on
(`band_attention`, `positional_band_attention`: adaptive span in `heads`,
hard-coded Gaussian attention in `prior`).

A window is the band of key blocks around each query block
(`engine.windowed_part`), on the stripes of the dilation for `dilated`; the LRA
release's "local" pattern (`pattern="release_strided"`) is full attention
within stripes instead.
"""

from __future__ import annotations

from typing import List, Optional

import jax
import jax.numpy as jnp

from attention_jax import registry
from attention_jax.core import patterns
from attention_jax.variants import common
from attention_jax.variants.sparse import engine, kernel

Array = jnp.ndarray


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
  length = engine.self_attention_length("local", query, key)
  kernel.check_implementation("local", implementation)
  pattern_ = local_pattern(length, window_size=window_size, pattern=pattern,
                           block_size=block_size)
  if implementation is not None:
    return kernel.kernel_attention("local", pattern_, query, key, value, bias, mask,
                                   implementation=implementation, **kernel.call_masks(
                                       is_causal, query_seq_lengths, key_value_seq_lengths,
                                       segment_ids, scale))
  if pattern == "sliding":
    inputs = engine.prepare("local", query, key, value, bias, mask, is_causal=is_causal,
                            key_value_seq_lengths=key_value_seq_lengths, segment_ids=segment_ids,
                            scale=scale, multiple=window_size)
    out = engine.merge_parts([engine.windowed_part(inputs, window_size, window_size, window_size)])
    return engine.finish(out, inputs, query_seq_lengths, query.dtype)
  inputs = engine.prepare("local", query, key, value, bias, mask, is_causal=is_causal,
                          key_value_seq_lengths=key_value_seq_lengths, segment_ids=segment_ids,
                          scale=scale, multiple=block_size, pad_always=True)
  # The release's reshape to [b, T'/b]: position a * (T'/b) + n is row a of
  # group n, i.e. group n is the stripe of positions = n (mod T'/b).
  query_, key_, value_, positions, key_ok, segments = engine.striped(
      inputs, inputs.padded_len // block_size)
  segments = (None, None) if segments is None else segments
  part = engine.dense_part(query_, key_, value_, positions, positions, key_ok, *segments,
                           engine.causal_keys(inputs.is_causal))
  out = engine.merge_parts([engine.map_part(engine.from_stripes, part)])
  return engine.finish(out, inputs, query_seq_lengths, query.dtype)


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
                   *, position_logits: Optional[engine.PositionLogits] = None,
                   allowed: Optional[engine.Predicate] = None, mask=None, is_causal: bool = False,
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
    position_logits: `(q_pos, k_pos) -> logits` (`engine.PositionLogits`), or None.
    allowed: a further pattern inside the band, or None.
    mask, is_causal, query_seq_lengths, key_value_seq_lengths, segment_ids:
      as in `local_attention` (a key-padding mask only).
    scale: multiplies q . k; 1/sqrt(D) when None.
    block_size: the blocks' length b, an int >= 1.
    reach: distance from which keys have no weight, or None.

  Returns:
    `[B, T, H, Dv]` in the query dtype.
  """
  engine.self_attention_length(variant, query, key)
  common.check_size("left", left, minimum=0)
  common.check_size("right", right, minimum=0)
  block = max(left, right, 1) if block_size is None else common.check_size("block_size",
                                                                            block_size)
  inputs = engine.prepare(variant, query, key, value, None, mask, is_causal=is_causal,
                          key_value_seq_lengths=key_value_seq_lengths, segment_ids=segment_ids,
                          scale=scale, multiple=block)
  if reach is None:
    parts = [engine.windowed_part(inputs, left, right, block, extra=allowed,
                                  position_logits=position_logits)]
  else:
    parts = _offset_parts(inputs, left, right, block, reach, allowed, position_logits)
  return engine.finish(engine.merge_parts(parts), inputs, query_seq_lengths, query.dtype)


def _offset_parts(inputs: engine.Inputs, left: int, right: int, block: int, reach: Array,
                  extra: Optional[engine.Predicate],
                  position_logits: Optional[engine.PositionLogits]) -> List[engine.Part]:
  """The band as one part per key block offset o (query block n, key block
  n + o), each computed only when its nearest key, (|o| - 1) b + 1 away, is
  nearer than `reach`; a skipped offset is an empty part."""
  right = 0 if inputs.is_causal else right
  query, key, value, positions, key_ok, segments = engine.striped(inputs, 1)
  num_blocks = positions.shape[1] // block
  allowed = engine.all_of(engine.keys_within(left, right), engine.causal_keys(inputs.is_causal),
                          extra)
  reach = jax.lax.stop_gradient(jnp.asarray(reach, jnp.float32))

  def offset_part(offset: int) -> engine.Part:
    key_blocks = jnp.arange(num_blocks)[:, None] + offset
    part = engine.block_part(query, key, value, positions, key_ok, segments, block, key_blocks,
                             allowed, position_logits)
    return engine.map_part(engine.from_stripes, part)

  parts = []
  for offset in range(-engine.ceil_div(left, block), engine.ceil_div(right, block) + 1):
    if offset == 0:  # the query's own block: always within reach
      parts.append(offset_part(0))
      continue
    shapes = jax.eval_shape(offset_part, offset)
    empty = engine.Part(jnp.zeros(shapes.acc.shape, shapes.acc.dtype),
                        jnp.full(shapes.row_max.shape, -jnp.inf, shapes.row_max.dtype),
                        jnp.zeros(shapes.total.shape, shapes.total.dtype))
    nearest = (abs(offset) - 1) * block + 1
    parts.append(jax.lax.cond(nearest < reach, lambda o=offset: offset_part(o),
                              lambda e=empty: e))
  return parts


def positional_band_attention(variant: str, value: Array, num_heads: int,
                              position_logits: engine.PositionLogits, left: int, right: int, *,
                              allowed: Optional[engine.Predicate] = None, mask=None,
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
    position_logits: `(q_pos, k_pos) -> logits` (`engine.PositionLogits`), float32.
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
  length = engine.self_attention_length("block_local", query, key)
  kernel.check_implementation("block_local", implementation)
  common.check_size("block_size", block_size, length=length)
  if implementation is not None:
    return kernel.kernel_attention("block_local", patterns.SameBlock(block_size), query, key, value,
                                   bias, mask, implementation=implementation, **kernel.call_masks(
                                       is_causal, query_seq_lengths, key_value_seq_lengths,
                                       segment_ids, scale))
  inputs = engine.prepare("block_local", query, key, value, bias, mask, is_causal=is_causal,
                          key_value_seq_lengths=key_value_seq_lengths, segment_ids=segment_ids,
                          scale=scale, multiple=block_size)
  out = engine.merge_parts([engine.own_block_part(inputs, block_size)])
  return engine.finish(out, inputs, query_seq_lengths, query.dtype)


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
  length = engine.self_attention_length("dilated", query, key)
  kernel.check_implementation("dilated", implementation)
  common.check_size("window_size", window_size, length=length)
  common.check_size("dilation", dilation, length=length)
  if implementation is not None:
    band = patterns.Band(window_size, window_size, dilation)
    return kernel.kernel_attention("dilated", band, query, key, value, bias, mask,
                                   implementation=implementation, **kernel.call_masks(
                                       is_causal, query_seq_lengths, key_value_seq_lengths,
                                       segment_ids, scale))
  inputs = engine.prepare("dilated", query, key, value, bias, mask, is_causal=is_causal,
                          key_value_seq_lengths=key_value_seq_lengths, segment_ids=segment_ids,
                          scale=scale, multiple=window_size * dilation)
  out = engine.merge_parts([engine.windowed_part(inputs, window_size, window_size, window_size,
                                                dilation)])
  return engine.finish(out, inputs, query_seq_lengths, query.dtype)


# The release's image configs (image/configs/{cifar10,pathfinder32}/*_base.py)
# set block_size 64; the text ones keep the model default (50 for local). The
# other Pathfinder sizes (Path-X is pathfinder128) have no release config for
# these rows: they follow pathfinder32.
_IMAGE_TASKS = ("image", "pathfinder32", "pathfinder64", "pathfinder128", "pathfinder256")

_LOCAL_OPTIONS = dict(
    engine.WINDOW_OPTION,
    pattern="'sliding' (the method: the keys within w of the query) or 'release_strided' "
            "(the LRA release's LocalAttention: the block_size keys = i mod T'/block_size, "
            "T' = T + block_size - T mod block_size)",
    block_size="with pattern='release_strided': the release's block_size (keys per query)",
    **engine.SCALE_OPTION, **kernel.KERNEL_OPTION)
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
    **engine.SPARSE_SPEC))
registry.register(registry.VariantSpec(name="band", fn=local_attention, complexity="O(T w)",
                                       paper="Parmar et al. 2018", options=_LOCAL_OPTIONS,
                                       **engine.SPARSE_SPEC))
registry.register(registry.VariantSpec(
    name="block_local", fn=block_local_attention, complexity="O(T b)", paper="Qiu et al. 2019",
    options=dict(block_size="queries attend within their own block of this many",
                 **engine.SCALE_OPTION, **kernel.KERNEL_OPTION),
    **engine.SPARSE_SPEC))
registry.register(registry.VariantSpec(
    name="dilated", fn=dilated_attention, complexity="O(T w)", paper="Beltagy et al. 2020",
    options=dict(**engine.WINDOW_OPTION, dilation="gap between attended keys",
                 **engine.SCALE_OPTION, **kernel.KERNEL_OPTION),
    **engine.SPARSE_SPEC))
