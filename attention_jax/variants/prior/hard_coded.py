"""Hard-coded Gaussian attention (You et al. 2020), `hard_coded_gaussian`:
fixed weights exp(-(j - (i + offset))^2 / (2 sigma^2)) normalised over the
allowed keys, no queries or keys; within `window` keys of the centre it is
the sparse family's band with logits from the positions, O(T w).
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import flax.linen as nn
import jax.numpy as jnp

from attention_jax import registry
from attention_jax.core import patterns
from attention_jax.flex import flex_attention
from attention_jax.variants import common
from attention_jax.variants.prior.synthesizer import synthesizer_attention
from attention_jax.variants.sparse.windows import positional_band_attention

Array = jnp.ndarray


def hard_coded_gaussian_attention(
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
    offset: int = 0,
    sigma: float = 1.0,
    window: Optional[int] = 8,
    implementation: Optional[str] = None,
) -> Array:
  """Hard-coded Gaussian attention (You et al. 2020):

      weights_ij = exp(-(j - c_i)^2 / (2 sigma^2)) / sum_{j' allowed} (same),
      c_i = i + offset,   out_i = sum_j weights_ij v_j,

  over the keys that the masks allow (and, with `window`, |j - c_i| <= w);
  queries that see no key output zeros. The paper centres heads on the token
  (offset 0) or its neighbours (-1, +1). Query and key contents are not read
  (`MultiHeadAttention` makes neither projection): they only give the shapes.

  Args:
    query: `[B, T, H, D]` (shape only; a `jax.ShapeDtypeStruct` will do).
    key: `[B, T, Hkv, D]` (shape only).
    value: `[B, T, Hkv, Dv]`; query head h uses value head h // (H // Hkv).
    bias: additive logits `[B|1, H|1, Tq, Tk]`; only with `window=None`.
    mask: boolean, broadcastable to `[B, H, Tq, Tk]`; with a window only a key
      padding mask `[B|1, 1, 1, Tk]`.
    is_causal, query_seq_lengths, key_value_seq_lengths, segment_ids: as in
      `dot_product_attention`.
    offset: the centre's offset from the query position, an int.
    sigma: the Gaussian's standard deviation, in positions, > 0.
    window: w, keys farther than w from the centre get weight 0, computed as a
      band, O(T w), self-attention only (Tq == Tk); the weights are those of
      the untruncated Gaussian renormalised over the band (w = 8, sigma = 1:
      the mass left out is below 1e-14). None: every key, O(T^2), a
      `[Tq, Tk]` array of logits; Tq may differ from Tk.
    implementation: None, the forms above (the reference); or a kernel of
      `flex_attention` ("blockwise", ...): the Gaussian's logits its
      score_mod over empty queries and keys, the window its (static) mask,
      so "blockwise" skips the tiles outside the window; cross-attention
      too.

  Returns:
    `[B, Tq, H, Dv]` in the value dtype.
  """
  if not isinstance(offset, int) or isinstance(offset, bool):
    raise ValueError(f"offset must be an int (0: on the token, -1/+1: previous/next), got "
                     f"{offset!r}.")
  if not sigma > 0:
    raise ValueError(f"sigma must be > 0, got {sigma!r}.")
  num_heads = query.shape[2]
  inverse_variance = 1.0 / (2.0 * float(sigma) ** 2)

  def position_logits(q_pos, k_pos):
    distance = (k_pos - (q_pos + offset)).astype(jnp.float32)
    return -jnp.square(distance) * inverse_variance

  if implementation is not None:
    # No content: queries and keys of one zero feature give logits 0 (scale 1),
    # to which the score_mod adds the Gaussian's.
    batch, q_len, kv_len, num_kv_heads = value.shape[0], query.shape[1], value.shape[1], \
        value.shape[2]
    if window is not None:
      common.check_size("window", window, minimum=0)
    empty_query = jnp.zeros((batch, q_len, num_heads, 1), value.dtype)
    empty_key = jnp.zeros((batch, kv_len, num_kv_heads, 1), value.dtype)
    return flex_attention(
        empty_query, empty_key, value, scale=1.0, bias=bias, mask=mask,
        score_mod=lambda score, b, h, q_idx, kv_idx: score + position_logits(q_idx, kv_idx),
        mask_mod=None if window is None else patterns.Band(window - offset, window + offset),
        is_causal=is_causal, query_seq_lengths=query_seq_lengths,
        key_value_seq_lengths=key_value_seq_lengths, segment_ids=segment_ids,
        implementation=implementation)
  if window is None:
    q_len, kv_len = query.shape[1], value.shape[1]
    logits = position_logits(jnp.arange(q_len)[:, None], jnp.arange(kv_len)[None, :])
    return synthesizer_attention(
        query, key, value, bias, mask, is_causal=is_causal, query_seq_lengths=query_seq_lengths,
        key_value_seq_lengths=key_value_seq_lengths, segment_ids=segment_ids,
        synthetic_logits=jnp.broadcast_to(logits, (1, num_heads, q_len, kv_len)))
  common.check_size("window", window, minimum=0)
  if key.shape[1] != query.shape[1]:
    raise ValueError(f"hard_coded_gaussian with a window is self-attention only: the query "
                     f"length ({query.shape[1]}) must equal the key length ({key.shape[1]}); "
                     f"use window=None for cross-attention.")
  # A dense bias is T x T, which the band exists to avoid.
  common.reject_unsupported("hard_coded_gaussian (with a window)", bias=bias)
  in_window = lambda q_pos, k_pos: jnp.abs(k_pos - (q_pos + offset)) <= window
  # The band [i - left, i + right] holds [c_i - w, c_i + w]; `in_window` trims it.
  return positional_band_attention(
      "hard_coded_gaussian", value, num_heads, position_logits, left=max(window - offset, 0),
      right=max(window + offset, 0), allowed=in_window, mask=mask, is_causal=is_causal,
      query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
      segment_ids=segment_ids)


class NoQueryKey(nn.Module):
  """The extras of a variant that reads neither queries nor keys
  (`hard_coded_gaussian`): no arrays, only the projections to leave out."""

  @staticmethod
  def unused_projections(options: Mapping[str, Any]) -> frozenset:
    del options
    return frozenset({"query", "key"})

  @nn.compact
  def __call__(self, query, key, value, deterministic: bool = True) -> dict:
    del query, key, value, deterministic
    return {}


registry.register(registry.VariantSpec(
    name="hard_coded_gaussian", fn=hard_coded_gaussian_attention, family="prior",
    complexity="O(T w)", subquadratic=True, exact=False, causal=True, cross=False,
    paper="You et al. 2020", extras=NoQueryKey,
    options=dict(offset="the Gaussian's centre relative to the query (0: the token, -1/+1: "
                        "the previous/next one)",
                 sigma="the Gaussian's standard deviation, in positions",
                 window="w: only keys within w of the centre, O(T w); None: every key, "
                        "O(T^2) (and cross-attention)",
                 implementation="None: the band or the dense logits (the reference); "
                                "'blockwise', 'xla', ...: flex_attention, the Gaussian its "
                                "score_mod and the window its mask")))
