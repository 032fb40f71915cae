"""Programmable attention: your score and mask functions, compiled into the kernels.

  out = flex_attention(q, k, v, score_mod=..., mask_mod=..., block_mask=...)

`score_mod(score, batch, head, q_idx, kv_idx) -> score` changes a logit
(a bias, a temperature, ALiBi); `mask_mod(batch, head, q_idx, kv_idx) ->
bool` says which pairs may attend (the signatures of PyTorch's
FlexAttention). Both are plain JAX, written as for one element, and may close
over arrays; gradients reach those arrays (learned slopes, a bias table).
`create_block_mask` evaluates a mask_mod once, tile by tile, into a layout of
skipped, partial and full tiles; the kernels never visit skipped tiles and
evaluate the mask only inside partial ones. `core/mods.py` has the common
mods (causal, sliding window, document, prefix-LM, ALiBi, relative bias) and
`and_masks` / `or_masks` compose masks.

What a score_mod cannot express is an option of the same engine: `softcap`
(Gemma 2's logit soft-capping), `sinks` (a learned per-head logit in the
normaliser: gpt-oss, StreamingLLM), `qk_norm` (RMS or L2 normalised queries
and keys, with learned scales), and the `normaliser`, softmax or sigmoid
(Ramapuram et al. 2024).

Implementations: "blockwise" (the lax loops, every backend, the default),
"pallas_gpu" (the Triton kernels; interpreted off a GPU), "pallas_tpu" (the
Mosaic TPU kernels; interpreted off a TPU; mods that index their arrays do
not lower to Mosaic yet), and "xla" (the dense reference: every logit and
the mask materialised, then jax.nn-style softmax; the oracle the kernels are
tested against).
"""

from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple, Union

import jax
import jax.numpy as jnp

from attention_jax.core import mods
from attention_jax.core.flex_inputs import FlexInputs, prepare_flex_inputs
from attention_jax.core.inputs import (AttentionInputs, attention_of_empty_sequence,
                                       prepare_inputs, returned_outputs)
from attention_jax.core.softmax import masked_softmax_and_logsumexp
from attention_jax.kernels.flash_attention import common, flex as flex_kernels

Array = jax.Array
QK_NORMS = ("rms", "l2")
DROPOUT_IMPLEMENTATIONS = ("blockwise", "xla")


def _dense_flex(inputs: AttentionInputs, flex: FlexInputs, block_sizes=None, *,
                return_residual: bool = False) -> Union[Array, Tuple[Array, Array]]:
  """Every logit materialised, `[B, H, Tq, Tk]` float32: the reference."""
  del block_sizes
  empty = attention_of_empty_sequence(inputs, return_residual)
  if empty is not None:
    return empty
  query, key, value = (x.astype(jnp.float32) for x in (inputs.query, inputs.key, inputs.value))
  batch, q_len, num_heads, _ = query.shape
  group = num_heads // key.shape[2]
  key, value = jnp.repeat(key, group, axis=2), jnp.repeat(value, group, axis=2)
  logits = jnp.einsum("bqhd,bkhd->bhqk", query, key,
                      precision=jax.lax.Precision.HIGHEST) * inputs.scale
  if inputs.bias is not None:
    logits += inputs.bias.astype(jnp.float32)
  if flex.softcap is not None:
    logits = flex.softcap * jnp.tanh(logits / flex.softcap)
  index = mods.grid_indices(batch, num_heads, q_len, key.shape[1])
  if flex.score_mod is not None:
    logits = flex.score_mod(logits, *index)
  mask = inputs.dense_mask()
  if flex.mask_mod is not None:
    allowed = mods.evaluate_mask(flex.mask_mod, *index)
    mask = allowed if mask is None else mask & allowed
  if flex.normaliser == "sigmoid":
    weights = jax.nn.sigmoid(logits + flex.sigmoid_bias)
    weights = weights if mask is None else jnp.where(mask, weights, 0.0)
    lse = jnp.zeros(weights.shape[:3])
  elif flex.sinks is not None:  # the sink: one more logit in every row, with no value
    sink = jnp.broadcast_to(flex.sinks.astype(jnp.float32)[None, :, None, None],
                            logits.shape[:3] + (1,))
    mask = jnp.ones(logits.shape, bool) if mask is None else jnp.broadcast_to(mask, logits.shape)
    weights, lse = masked_softmax_and_logsumexp(
        jnp.concatenate([logits, sink], -1),
        jnp.concatenate([mask, jnp.ones(sink.shape, bool)], -1))
    weights = weights[..., :-1]
  else:
    weights, lse = masked_softmax_and_logsumexp(logits, mask)
  if flex.dropout_rate > 0.0:  # its own draws: the kernels draw theirs per tile
    keep = jax.random.bernoulli(flex.dropout_rng, 1.0 - flex.dropout_rate, weights.shape)
    weights = jnp.where(keep, weights / (1.0 - flex.dropout_rate), 0.0)
  out = jnp.einsum("bhqk,bkhd->bqhd", weights, value, precision=jax.lax.Precision.HIGHEST)
  return common.attention_outputs(out.astype(inputs.query.dtype), lse.transpose(0, 2, 1),
                                  inputs.query_seq_lengths, return_residual)


# name -> fn(inputs, flex, block_sizes, return_residual=...)
FLEX_IMPLEMENTATIONS: Dict[str, Callable] = {
    "blockwise": flex_kernels.flex_blockwise,
    "xla": _dense_flex,
    "pallas_gpu": flex_kernels.flex_pallas_gpu,
    "pallas_tpu": flex_kernels.flex_pallas_tpu,
}


def flex_attention(query: Array, key: Array, value: Array, *,
                   score_mod: Optional[mods.ScoreMod] = None,
                   mask_mod: Optional[mods.MaskMod] = None,
                   block_mask=None,
                   scale: Optional[float] = None,
                   softcap: Optional[float] = None,
                   sinks: Optional[Array] = None,
                   qk_norm: Optional[str] = None,
                   qk_norm_scales: Optional[Tuple[Array, Array]] = None,
                   normaliser: str = "softmax",
                   sigmoid_bias: Optional[float] = None,
                   dropout_rate: float = 0.0,
                   dropout_rng: Optional[Array] = None,
                   bias: Optional[Array] = None,
                   mask: Optional[Array] = None,
                   is_causal: bool = False,
                   query_seq_lengths: Optional[Array] = None,
                   key_value_seq_lengths: Optional[Array] = None,
                   local_window_size=None,
                   segment_ids=None,
                   implementation: Optional[str] = None,
                   block_sizes: Optional[common.BlockSizes] = None,
                   return_residual: bool = False) -> Union[Array, Tuple[Array, Array]]:
  """Attention with your score and mask functions: `[B, Tq, H, Dv]`.

  Args:
    query: `[B, Tq, H, D]` (or `[Tq, H, D]`); key `[B, Tk, Hkv, D]`, value
      `[B, Tk, Hkv, Dv]`, H a multiple of Hkv (grouped heads).
    score_mod: `(score, batch, head, q_idx, kv_idx) -> score`, applied to the
      scaled (biased, soft-capped) logits; may close over arrays, which are
      differentiated.
    mask_mod: `(batch, head, q_idx, kv_idx) -> bool`, True where a pair may
      attend; a static `patterns` piece or any JAX function.
    block_mask: from `create_block_mask`, for the kernel's blocks; carries its
      mask_mod (pass the same or none). Without one, a static mask_mod's
      layout is made at trace time and a data-dependent one is evaluated in
      every tile.
    scale: the logits' scale; 1/sqrt(D) when None.
    softcap: logits become `softcap * tanh(logits / softcap)` (before score_mod).
      The cap applies to the scaled logits plus `bias`, so a large negative
      bias used as a mask is capped too (to -softcap, which still weighs
      exp(-2 softcap) against a logit at the cap): mask with `mask` or a
      mask_mod instead.
    sinks: `[H]` float, a learned logit per head added to the normaliser (a key
      that every query sees and whose value is zero); differentiated.
    qk_norm: "rms" or "l2": queries and keys normalised over D before the
      product, times `qk_norm_scales = (query_scale, key_scale)` (each
      broadcastable to `[D]`; learned in `MultiHeadAttention`). With "l2"
      (Henry et al. 2020) pass the learned temperature as a scale and
      `scale=1.0`. Normalise before rotary positions: given rotated queries
      and keys, pass them through `normalised_qk` before rotating instead
      (`MultiHeadAttention` does, with `position="rope"` or "xpos").
    normaliser: "softmax", or "sigmoid" (each pair weighted by
      `sigmoid(logit + sigmoid_bias)`, no normalisation over keys;
      `sigmoid_bias` defaults to -log(Tk)).
    dropout_rate, dropout_rng: dropout on the weights. The blockwise kernel
      draws each tile's keep mask from the rng folded with the tile's
      indices (the backward redraws it); "xla" draws its own, so the two
      drop different weights.
    bias, mask, is_causal, query_seq_lengths, key_value_seq_lengths,
      local_window_size, segment_ids: as in `dot_product_attention`; applied
      with the mods (causal and the window also skip blocks).
    implementation: "blockwise" (default), "pallas_gpu" (Triton), "pallas_tpu"
      (Mosaic) or "xla" (the dense reference); `FLEX_IMPLEMENTATIONS` lists them.
      On Triton a mod may only index its arrays (`slopes[h]`, `ids[b, q_idx]`:
      `kernels/flash_attention/tile_mods.py`), and a floating array it
      differentiates has at most 1,024 entries.
    block_sizes: the blockwise kernel's blocks (one size for both passes);
      default the block mask's, else 128 x 128.
    return_residual: also return the log-sum-exp `[B, Tq, H]` float32
      (softmax only).

  Raises:
    ValueError: at trace time, naming the argument: a mod that fails on
      scalars or returns the wrong shape or dtype, a block mask made for other
      lengths or blocks, an unknown option or implementation.
  """
  if implementation is None:
    implementation = "blockwise"
  if implementation not in FLEX_IMPLEMENTATIONS:
    raise ValueError(f"implementation must be one of {sorted(FLEX_IMPLEMENTATIONS)} or None, "
                     f"got {implementation!r}.")
  if qk_norm is not None:
    query, key = normalised_qk(query, key, qk_norm, qk_norm_scales)
  elif qk_norm_scales is not None:
    raise ValueError("qk_norm_scales needs qk_norm ('rms' or 'l2'), got qk_norm=None.")
  inputs, unbatched = prepare_inputs(
      query, key, value, bias, mask, scale=scale, is_causal=is_causal,
      query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
      local_window_size=local_window_size, segment_ids=segment_ids)
  flex = prepare_flex_inputs(inputs, score_mod=score_mod, mask_mod=mask_mod,
                             block_mask=block_mask, softcap=softcap, sinks=sinks,
                             normaliser=normaliser, sigmoid_bias=sigmoid_bias,
                             dropout_rate=dropout_rate, dropout_rng=dropout_rng,
                             return_residual=return_residual)
  if flex.dropout_rate > 0.0 and implementation not in DROPOUT_IMPLEMENTATIONS:
    raise ValueError(f"dropout on the weights runs on implementation in "
                     f"{DROPOUT_IMPLEMENTATIONS}, got implementation={implementation!r}.")
  result = FLEX_IMPLEMENTATIONS[implementation](inputs, flex, block_sizes,
                                                return_residual=return_residual)
  return returned_outputs(result, unbatched)


def normalised_qk(query: Array, key: Array, qk_norm: str,
                   qk_norm_scales: Optional[Tuple[Array, Array]]) -> Tuple[Array, Array]:
  """Queries and keys normalised over their last axis (float32 statistics)."""
  if qk_norm not in QK_NORMS:
    raise ValueError(f"qk_norm must be one of {QK_NORMS} or None, got {qk_norm!r}.")
  if qk_norm_scales is not None and (not isinstance(qk_norm_scales, (tuple, list))
                                     or len(qk_norm_scales) != 2):
    raise ValueError("qk_norm_scales must be a pair (query_scale, key_scale), got "
                     f"{type(qk_norm_scales).__name__}.")

  def normalise(x, scale):
    x32 = jnp.asarray(x).astype(jnp.float32)
    if qk_norm == "rms":
      x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-6)
    else:
      x32 = x32 * jax.lax.rsqrt(jnp.maximum(jnp.sum(x32 * x32, axis=-1, keepdims=True), 1e-12))
    if scale is not None:
      x32 = x32 * jnp.asarray(scale).astype(jnp.float32)
    return x32.astype(jnp.asarray(x).dtype)

  query_scale, key_scale = (None, None) if qk_norm_scales is None else qk_norm_scales
  return normalise(query, query_scale), normalise(key, key_scale)
