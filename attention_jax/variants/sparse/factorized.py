"""Factorised patterns, which reach every key in two steps of about sqrt(T):
the Sparse Transformer's `strided` and `fixed` (Child et al. 2019), two
patterns combined in one layer, per head or by layer parity, and `axial`
(Ho et al. 2019), attention along the rows and then the columns of the
sequence laid out as an image.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, List, Optional, Sequence, Tuple

import jax.numpy as jnp
import numpy as np

from attention_jax import registry
from attention_jax.core import patterns
from attention_jax.variants import common
from attention_jax.variants.sparse import engine, kernel

Array = jnp.ndarray


def _tail(inputs: engine.Inputs, start: int, *, is_causal: bool) -> engine.Inputs:
  """The positions from `start` on, as a sequence of their own (position
  `start` becomes 0), causal as `is_causal`."""
  segments = None if inputs.segments is None else tuple(s[:, start:] for s in inputs.segments)
  return dataclasses.replace(inputs, query=inputs.query[:, start:], key=inputs.key[:, start:],
                             value=inputs.value[:, start:], key_ok=inputs.key_ok[:, start:],
                             segments=segments, length=inputs.length - start,
                             is_causal=is_causal)


def _pad_front(part: engine.Part, count: int) -> engine.Part:
  """`count` rows that attend to nothing before `part`'s `[B, T, ...]` rows."""
  pad = lambda x, fill: jnp.pad(x, [(0, 0), (count, 0)] + [(0, 0)] * (x.ndim - 2),
                                constant_values=fill)
  return engine.Part(pad(part.acc, 0.0), pad(part.row_max, -jnp.inf), pad(part.total, 0.0))


def _default_stride(length: int) -> int:
  """ceil(sqrt(T)): the Sparse Transformer's l ~ sqrt(T)."""
  return max(1, math.isqrt(length - 1) + 1) if length > 1 else 1


COMBINES = ("interleaved", "merged", "per_head")


def _factorized(variant: str, inputs: engine.Inputs, first: Callable[..., engine.Part],
                second: Callable[..., engine.Part], pattern_names: Tuple[str, str], combine: str,
                pattern: Optional[str], layer_index: Optional[int]) -> List[engine.Part]:
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
  return [engine.concat_heads([first(engine.head_range(inputs, 0, half)),
                               second(engine.head_range(inputs, half, num_heads), False)])]


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
  length = engine.self_attention_length("strided", query, key)
  kernel.check_implementation("strided", implementation)
  stride = _default_stride(length) if stride is None else stride
  common.check_size("stride", stride, length=length)
  if implementation is not None:
    num_heads = query.shape[2]
    chosen = _factorized_choice("strided", ("local", "strided"), combine, pattern, layer_index,
                                num_heads)
    pattern_ = _factorized_pattern(patterns.Band(stride - 1, stride - 1),
                                   patterns.SameResidue(stride), chosen, ("local", "strided"),
                                   num_heads)
    return kernel.kernel_attention("strided", pattern_, query, key, value, bias, mask,
                                   implementation=implementation, **kernel.call_masks(
                                       is_causal, query_seq_lengths, key_value_seq_lengths,
                                       segment_ids, scale))
  inputs = engine.prepare("strided", query, key, value, bias, mask, is_causal=is_causal,
                          key_value_seq_lengths=key_value_seq_lengths, segment_ids=segment_ids,
                          scale=scale, multiple=stride)

  def local(inputs):
    return engine.windowed_part(inputs, stride - 1, stride - 1, stride)

  def strided(inputs, exclusive):
    # Stripe r holds the positions = r (mod l): full attention within it.
    query, key, value, positions, key_ok, segments = engine.striped(inputs, stride)
    segments = (None, None) if segments is None else segments
    not_self = (lambda q, k: k != q) if exclusive else None
    part = engine.dense_part(query, key, value, positions, positions, key_ok, *segments,
                             engine.all_of(engine.causal_keys(inputs.is_causal), not_self))
    return engine.map_part(engine.from_stripes, part)

  out = engine.merge_parts(_factorized("strided", inputs, local, strided, ("local", "strided"),
                                       combine, pattern, layer_index))
  return engine.finish(out, inputs, query_seq_lengths, query.dtype)


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
  length = engine.self_attention_length("fixed", query, key)
  kernel.check_implementation("fixed", implementation)
  engine.check_at_most("num_global", num_global, "the sequence length - 1", length - 1, minimum=0)
  stride = _default_stride(length) if stride is None else stride
  common.check_size("stride", stride, length=length)
  engine.check_at_most("num_summary", num_summary, "stride", stride)
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
    return kernel.kernel_attention("fixed", pattern_, query, key, value, bias, mask,
                                   implementation=implementation, **kernel.call_masks(
                                       is_causal, query_seq_lengths, key_value_seq_lengths,
                                       segment_ids, scale))
  inputs = engine.prepare("fixed", query, key, value, bias, mask, is_causal=is_causal,
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
    return engine.own_block_part(inputs, stride)

  def summaries(inputs, exclusive):
    other_block = (lambda q, k: q // stride != k // stride) if exclusive else None
    allowed = engine.all_of(engine.causal_keys(inputs.is_causal), other_block)
    return engine.columns_part(inputs, summary, allowed)

  parts = _factorized("fixed", rest, block, summaries, ("block", "summary"), combine, pattern,
                      layer_index)
  out = engine.with_globals(inputs, num_global, [_pad_front(p, num_global) for p in parts])
  return engine.finish(out, inputs, query_seq_lengths, query.dtype)


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
  Causal: each pass is causal, so position i only ever sees positions <= i,
  and of those only the ones in a column at most i's (an earlier row's later
  columns are out of reach); Ho et al.'s causal Axial Transformer reaches
  every earlier position (its outer decoder also attends over whole earlier
  rows), which this does not do. Padded positions are neither keys nor values
  in either pass. O(T (rows + cols)).
  """
  length = engine.self_attention_length("axial", query, key)
  rows, cols = axial_shape(length, shape)
  inputs = engine.prepare("axial", query, key, value, bias, mask, is_causal=is_causal,
                          key_value_seq_lengths=key_value_seq_lengths, segment_ids=segment_ids,
                          scale=scale, multiple=1)
  positions = jnp.arange(length).reshape(rows, cols)
  by_row = lambda x: x.reshape(x.shape[0], rows, cols, *x.shape[2:])
  by_col = lambda x: jnp.swapaxes(by_row(x), 1, 2)

  def attend_along(split, positions, values):
    segments = (None, None) if inputs.segments is None else tuple(
        split(s) for s in inputs.segments)
    part = engine.dense_part(split(inputs.query), split(inputs.key), split(values), positions,
                             positions, split(inputs.key_ok), *segments,
                             engine.causal_keys(inputs.is_causal))
    return engine.merge_parts([part])

  rows_out = attend_along(by_row, positions, inputs.value).reshape(inputs.value.shape)
  out = attend_along(by_col, positions.T, rows_out.astype(inputs.value.dtype))
  out = jnp.swapaxes(out, 1, 2).reshape(inputs.value.shape)
  return engine.finish(out, inputs, query_seq_lengths, query.dtype)


_FACTORIZED = dict(
    stride="the stride l; ceil(sqrt(T)) when None",
    combine="'merged' (one softmax over both patterns), 'per_head' or 'interleaved'",
    pattern="with combine='interleaved': the pattern this layer uses",
    layer_index="with combine='interleaved': picks the pattern by its parity")


registry.register(registry.VariantSpec(name="strided", fn=strided_attention,
                                       complexity="O(T sqrt(T))", paper="Child et al. 2019",
                                       options={**_FACTORIZED, **engine.SCALE_OPTION,
                                                **kernel.KERNEL_OPTION},
                                       **engine.SPARSE_SPEC))
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
        **engine.SCALE_OPTION, **kernel.KERNEL_OPTION),
    presets={"lra_release": registry.Preset(
        dict(stride=50, num_summary=10, summary_at_block_start=True, causal_pattern=True,
             num_global=1),
        "lra_benchmarks/utils/train_utils.py get_model passes Fixed1Pattern(block_size=50) and "
        "Fixed2Pattern(block_size=50, c=10) (not SparseAttention's 128/32 default); "
        "sparse_attention.py merges them into one causal mask with the j mod l == 0 column, "
        "and with [CLS] pooling makes the first token global and starts the pattern after it",
        tasks={task: dict(num_global=0) for task in _MEAN_POOLED_TASKS})},
    **engine.SPARSE_SPEC))


registry.register(registry.VariantSpec(
    name="axial", fn=axial_attention, complexity="O(T sqrt(T))", paper="Ho et al. 2019",
    family="sparse", subquadratic=True, exact=False, causal=True, cross=False,
    options=dict(shape="(rows, cols) with rows * cols = T; the most square when None",
                 **engine.SCALE_OPTION)))
