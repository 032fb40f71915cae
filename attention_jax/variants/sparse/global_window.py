"""Global tokens plus a sliding window: `global_tokens` (Star-Transformer /
ETC) and `longformer` (Beltagy et al. 2020, with its dilated heads). The
leading global tokens attend to every key and every query attends to them
(`engine.with_globals`); the other queries also see their window.
"""

from __future__ import annotations

from typing import Optional

import jax.numpy as jnp

from attention_jax import registry
from attention_jax.core import patterns
from attention_jax.variants import common
from attention_jax.variants.sparse import engine, kernel

Array = jnp.ndarray


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
  length = engine.self_attention_length(variant, query, key)
  kernel.check_implementation(variant, implementation)
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
  engine.check_at_most("dilated_heads", dilated_heads, "num_heads", num_heads, minimum=0)
  plain_heads = num_heads - dilated_heads
  if implementation is not None:
    groups = ((plain_heads, patterns.Band(left, window_size)),
              (dilated_heads, patterns.Band(left, window_size, dilation)))
    groups = tuple((count, band) for count, band in groups if count)
    windows = groups[0][1] if len(groups) == 1 else patterns.PerHead(groups)
    pattern = patterns.Global(0, num_global) | windows if num_global else windows
    return kernel.kernel_attention(variant, pattern, query, key, value, bias, mask,
                                   implementation=implementation, **kernel.call_masks(
                                       is_causal, query_seq_lengths, key_value_seq_lengths,
                                       segment_ids, scale))
  inputs = engine.prepare(variant, query, key, value, bias, mask, is_causal=is_causal,
                          key_value_seq_lengths=key_value_seq_lengths, segment_ids=segment_ids,
                          scale=scale, multiple=block * dilation)
  not_global = engine.keys_from(num_global) if num_global else None

  def window(inputs, d):
    return engine.windowed_part(inputs, left, window_size, block, d, not_global)

  head_parts = []
  if plain_heads:
    head_parts.append(window(engine.head_range(inputs, 0, plain_heads), 1))
  if dilated_heads:
    head_parts.append(window(engine.head_range(inputs, plain_heads, num_heads), dilation))
  out = engine.with_globals(inputs, num_global, [engine.concat_heads(head_parts)])
  return engine.finish(out, inputs, query_seq_lengths, query.dtype)


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


registry.register(registry.VariantSpec(
    name="global_tokens", fn=global_tokens_attention, complexity="O(T (w + g))",
    paper="Guo et al. 2019",
    options=dict(num_global="leading tokens that attend and are attended everywhere",
                 **engine.WINDOW_OPTION, **engine.SCALE_OPTION, **kernel.KERNEL_OPTION),
    **engine.SPARSE_SPEC))


registry.register(registry.VariantSpec(
    name="longformer", fn=longformer_attention, complexity="O(T (w + g))",
    paper="Beltagy et al. 2020",
    options=dict(window_size="keys after the query (w), and before it unless left_window_size",
                 left_window_size="keys before the query; window_size when None",
                 dilation="gap between keys on the dilated heads",
                 dilated_heads="heads that use the dilation; half of them when None",
                 num_global="leading global tokens", **engine.SCALE_OPTION, **kernel.KERNEL_OPTION),
    presets={"lra_release": registry.Preset(
        dict(window_size=256, left_window_size=255, dilated_heads=0, num_global=0),
        "the release's LongformerAttention (lra_benchmarks/models/longformer/"
        "longformer_attention.py) is a sliding window of sliding_window_size=512 keys (255 "
        "before the query, 256 after), no dilation, and no global token (its encoders pass no "
        "global_mask, so its separate global projections are never used)")},
    **engine.SPARSE_SPEC))
