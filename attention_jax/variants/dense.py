"""Exact scaled dot-product attention (Vaswani et al. 2017).

`dot_product_attention` is a drop-in for `jax.nn.dot_product_attention`: the
same argument names and `[B, T, H, D]` layout, grouped K/V heads when K/V have
fewer heads than the query, a bias or mask of rank below 4 padded with leading
1s, `return_residual` for the log-sum-exp, finite values throughout (it runs
under `jax.debug_infs(True)`); plus `segment_ids` for packed sequences, and an
`implementation` switch. Where it differs on purpose: a query with nothing to
attend outputs zeros (jax.nn averages the values), and the residual has true
gradients (jax.nn stops them). The kernel interface it dispatches through
lives in core (`core/inputs.py`: `AttentionInputs`, `prepare_inputs`;
`core/implementations.py`: the registry, `register_implementation`); this file
registers "xla" and "cudnn", the kernels add "blockwise", "pallas" and the rest.
The core names stay importable from here.

`implementation=None` takes the available implementation of highest priority
for these inputs that accepts them (`select_implementation` says which, and
why); when the preferred one declines (say a head dim the Pallas kernel cannot
take) a warning names the reason and the implementation used instead.
"""

from __future__ import annotations

import warnings
from typing import Optional, Tuple, Union

import jax
import jax.numpy as jnp

from attention_jax import registry
from attention_jax.core import implementations
# The kernel interface (core/inputs.py, core/implementations.py), also served
# from here, where it was defined before it moved to core.
from attention_jax.core.implementations import (Implementation, available_implementations,
                                                register_implementation, select_implementation)
from attention_jax.core.inputs import (AttentionInputs, SegmentIds, attention_of_empty_sequence,
                                       prepare_inputs, returned_outputs)
from attention_jax.core.masks import Window
from attention_jax.core.softmax import masked_softmax_and_logsumexp
from attention_jax.variants import common

__all__ = ["AttentionInputs", "Implementation", "attention_of_empty_sequence",
           "available_implementations", "dot_product_attention", "prepare_batched_inputs",
           "prepare_inputs", "register_implementation", "returned_outputs",
           "select_implementation", "shaw_relative_attention"]

Array = jnp.ndarray
# The registry's table itself (one dict, core's), for the tests that read it.
_IMPLEMENTATIONS = implementations._IMPLEMENTATIONS  # pylint: disable=protected-access


def dot_product_attention(
    query: Array,
    key: Array,
    value: Array,
    bias: Optional[Array] = None,
    mask: Optional[Array] = None,
    *,
    scale: Optional[float] = None,
    is_causal: bool = False,
    query_seq_lengths: Optional[Array] = None,
    key_value_seq_lengths: Optional[Array] = None,
    local_window_size: Optional[Window] = None,
    segment_ids: SegmentIds = None,
    implementation: Optional[str] = None,
    return_residual: bool = False,
    dropout_rate: float = 0.0,
    dropout_rng: Optional[jax.Array] = None,
) -> Union[Array, Tuple[Array, Array]]:
  """Scaled dot-product attention softmax(q k^T * scale + bias) v.

  Args:
    query: `[B, Tq, H, D]` (or `[Tq, H, D]`).
    key: `[B, Tk, Hkv, D]`; `H` must be a multiple of `Hkv` (MQA: Hkv = 1, GQA).
    value: `[B, Tk, Hkv, Dv]`.
    bias: additive logits bias broadcastable to `[B, H, Tq, Tk]`; a lower rank
      gains leading 1s (`[Tq, Tk]`, `[Tk]`), as in jax.nn.
    mask: boolean broadcastable to `[B, H, Tq, Tk]` (lower ranks as for bias);
      True may attend.
    scale: logit scale, 1/sqrt(D) by default.
    is_causal: query i attends keys j <= i (top-left aligned, as jax.nn).
    query_seq_lengths: `[B]` int; queries past the length output zeros.
    key_value_seq_lengths: `[B]` int; keys past the length are ignored.
    local_window_size: int or (left, right): query i sees keys [i - left, i + right].
    segment_ids: `[B, T]` for self-attention over packed sequences, or a pair
      `(q_segment_ids [B, Tq], kv_segment_ids [B, Tk])`; tokens only attend
      within their own segment.
    implementation: one of `available_implementations()`, or None for the best
      that takes these inputs (see `select_implementation`).
    return_residual: also return the residual, the log-sum-exp of each query's
      (scaled, biased) logits over the keys it may attend, as jax.nn does.
    dropout_rate: dropout on the attention weights (only with a `dropout_rng`).
    dropout_rng: PRNG key for the dropout; None disables dropout.

  Returns:
    `[B, Tq, H, Dv]` in the query dtype. A query that may attend to no key
    returns zeros (and passes zero gradients), never NaN. With
    `return_residual`, `(out, residual)`: residual `[B, Tq, H]` (or `[Tq, H]`)
    in the query dtype, as jax.nn's. A query that may attend to no key (past
    `query_seq_lengths` too) has the residual `MASKED_LOGSUMEXP` = -0.7 * the
    largest float32, finite where log 0 would be -inf (what jax.nn returns
    there, except that float16, whose range stops at 65504, gets -65504 where
    jax.nn's overflows to -inf). Unlike jax.nn's, the residual is
    differentiable (d lse / d logits = the attention weights), in every
    implementation but "cudnn", whose residual passes no gradient (as jax.nn's).
    An empty sequence gives what jax.nn gives (`attention_of_empty_sequence`):
    Tk = 0 zeros `[B, Tq, H, Dv]` (the residual `MASKED_LOGSUMEXP`), Tq = 0
    empty arrays, in every implementation, with zero gradients.
  """
  inputs, unbatched = prepare_inputs(
      query, key, value, bias, mask, scale=scale, is_causal=is_causal,
      query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
      local_window_size=local_window_size, segment_ids=segment_ids)
  dropout = dropout_rng is not None and dropout_rate > 0.0
  implementation, note = select_implementation(inputs, implementation, dropout)
  if note is not None:
    # Seen once per call site (the warnings module's default), at trace time.
    warnings.warn(f"dot_product_attention: using implementation {implementation!r}; {note}.",
                  stacklevel=2)
  empty = attention_of_empty_sequence(inputs, return_residual)
  if empty is not None:
    return returned_outputs(empty, unbatched)
  options = dict(dropout_rate=dropout_rate, dropout_rng=dropout_rng) if dropout else {}
  if return_residual:
    options["return_residual"] = True
  return returned_outputs(
      implementations.registered_implementation(implementation).fn(inputs, **options),
      unbatched)


def prepare_batched_inputs(variant: str, query, key, value, bias=None, mask=None,
                           **kwargs) -> AttentionInputs:
  """`prepare_inputs` for a variant that needs a batch axis (its own
  per-example arrays: carried maps, relative indices); refuses `[Tq, H, D]`."""
  inputs, unbatched = prepare_inputs(query, key, value, bias, mask, **kwargs)
  if unbatched:
    raise ValueError(f"{variant} takes a batched query [B, Tq, H, D], got shape "
                     f"{list(jnp.shape(query))}.")
  return inputs


def shaw_relative_attention(query: Array, key: Array, value: Array, bias: Optional[Array] = None,
                            mask: Optional[Array] = None, *, key_embeddings: Array,
                            value_embeddings: Array, relative_index: Array,
                            scale: Optional[float] = None, is_causal: bool = False,
                            query_seq_lengths: Optional[Array] = None,
                            key_value_seq_lengths: Optional[Array] = None,
                            segment_ids: SegmentIds = None, dropout_rate: float = 0.0,
                            dropout_rng: Optional[jax.Array] = None) -> Array:
  """Attention with relative position representations (Shaw et al. 2018, eqs. 3-5):

      e_ij = q_i . (k_j + a^K_ij) * scale,   z_i = sum_j softmax_j(e_ij) (v_j + a^V_ij)

  with a_ij the row `relative_index[i, j]` (the clipped distance,
  `positional.shaw_relative_index`) of each table. The `[Tq, Tk, D]` array
  a_ij is never built: q_i . a^K_r is computed for the 2k + 1 rows r and
  gathered to `[Tq, Tk]`, and sum_j w_ij a^V_ij = sum_r (sum of the w_ij in
  row r) a^V_r, one `[Tq, Tk]` reduction per row: O(T^2 (D + k)), memory
  O(T^2 + T k), as the paper's efficient form.

  Args:
    query: `[B, Tq, H, D]`; key: `[B, Tk, Hkv, D]`; value: `[B, Tk, Hkv, Dv]`.
    bias, mask, scale, is_causal, query_seq_lengths, key_value_seq_lengths,
    segment_ids, dropout_rate, dropout_rng: as `dot_product_attention`'s.
    key_embeddings: a^K `[2k + 1, D]`; value_embeddings: a^V `[2k + 1, Dv]`.
    relative_index: `[B|1, Tq, Tk]` int, the row of each pair.

  Returns:
    `[B, Tq, H, Dv]` in query's dtype.
  """
  inputs = prepare_batched_inputs(
      "shaw_relative_attention", query, key, value, bias, mask, scale=scale,
      is_causal=is_causal, query_seq_lengths=query_seq_lengths,
      key_value_seq_lengths=key_value_seq_lengths, segment_ids=segment_ids)
  batch, q_len, num_heads, head_dim = inputs.query.shape
  kv_len, value_dim = inputs.key.shape[1], inputs.value.shape[-1]
  rows = key_embeddings.shape[0]
  if key_embeddings.shape != (rows, head_dim) or value_embeddings.shape != (rows, value_dim):
    raise ValueError(f"key_embeddings and value_embeddings must be [2k + 1, D] = [{rows}, "
                     f"{head_dim}] and [2k + 1, Dv] = [{rows}, {value_dim}], got shapes "
                     f"{list(key_embeddings.shape)} and {list(value_embeddings.shape)}.")
  if jnp.ndim(relative_index) != 3 or tuple(jnp.shape(relative_index))[1:] != (q_len, kv_len):
    raise ValueError(f"relative_index must be [B|1, Tq, Tk] = [B|1, {q_len}, {kv_len}], got "
                     f"shape {list(jnp.shape(relative_index))}.")
  query32 = inputs.query.astype(jnp.float32)
  keys = common.repeat_kv_heads(inputs.key, num_heads).astype(jnp.float32)
  index = jnp.broadcast_to(relative_index[:, None], (batch, num_heads, q_len, kv_len))
  by_row = jnp.einsum("bqhd,rd->bhqr", query32, key_embeddings.astype(jnp.float32))
  logits = (jnp.einsum("bqhd,bkhd->bhqk", query32, keys)
            + jnp.take_along_axis(by_row, index, axis=-1)) * inputs.scale
  if inputs.bias is not None:
    logits = logits + inputs.bias.astype(jnp.float32)
  weights, _ = masked_softmax_and_logsumexp(logits, inputs.dense_mask())
  weights = common.dropout_weights(weights, dropout_rate, dropout_rng)
  row_weights = jnp.stack([jnp.sum(jnp.where(index == r, weights, 0.0), axis=-1)
                           for r in range(rows)], axis=-1)  # [B, H, Tq, 2k + 1]
  out = common.weighted_values(weights, inputs.value) + jnp.einsum(
      "bhqr,rd->bqhd", row_weights, value_embeddings.astype(jnp.float32))
  return out.astype(inputs.query.dtype)


def _xla_attention(inputs: AttentionInputs, dropout_rate: float = 0.0,
                   dropout_rng: Optional[jax.Array] = None,
                   return_residual: bool = False) -> Union[Array, Tuple[Array, Array]]:
  """Materialises the [B, H, Tq, Tk] logits; grouped heads are never repeated in memory.

  The G = H // Hkv query heads that share a K/V head are stacked along the
  query axis, `[B, Hkv, G * Tq, D]`, so both products are plain batched
  matmuls over (B, Hkv). On CPU this runs about twice as fast as a 5-D
  grouped einsum, and faster than repeating K/V as jax.nn does.
  """
  query, key, value = inputs.query, inputs.key, inputs.value
  batch, q_len, num_heads, head_dim = query.shape
  kv_len, num_kv_heads = key.shape[1], key.shape[2]
  group = num_heads // num_kv_heads
  # Query head h * G + g shares K/V head h, as jnp.repeat(key, G, axis=2) would.
  stacked_query = query.reshape(batch, q_len, num_kv_heads, group, head_dim)
  stacked_query = stacked_query.transpose(0, 2, 3, 1, 4).reshape(
      batch, num_kv_heads, group * q_len, head_dim)
  key = key.transpose(0, 2, 1, 3)  # [B, Hkv, Tk, D]
  logits = jnp.einsum("bhqd,bhkd->bhqk", stacked_query, key, preferred_element_type=jnp.float32)
  logits = logits.reshape(batch, num_heads, q_len, kv_len) * inputs.scale
  if inputs.bias is not None:
    logits = logits + inputs.bias.astype(jnp.float32)
  weights, lse = masked_softmax_and_logsumexp(logits, inputs.dense_mask())
  weights = common.dropout_weights(weights, dropout_rate, dropout_rng)
  out = common.weighted_values(weights, value).astype(query.dtype)
  return (out, lse.transpose(0, 2, 1)) if return_residual else out


def _cudnn_attention(inputs: AttentionInputs,
                     return_residual: bool = False) -> Union[Array, Tuple[Array, Array]]:
  """cuDNN's fused kernel through jax.nn, for the masks it supports.

  Its residual is cuDNN's own, in the input dtype and with no gradient (jax's
  cuDNN backward drops the residual's cotangent; the stop_gradient says so).
  """
  result = jax.nn.dot_product_attention(
      inputs.query, inputs.key, inputs.value, inputs.bias, inputs.mask,
      scale=inputs.scale, is_causal=inputs.is_causal,
      query_seq_lengths=inputs.query_seq_lengths,
      key_value_seq_lengths=inputs.key_value_seq_lengths,
      local_window_size=inputs.local_window_size, implementation="cudnn",
      return_residual=return_residual)
  if not return_residual:
    return result
  out, residual = result
  return out, jax.lax.stop_gradient(residual.astype(jnp.float32))


def _cudnn_rejects(inputs: AttentionInputs) -> Optional[str]:
  if inputs.q_segment_ids is not None:
    return "cuDNN's attention through jax.nn takes no segment_ids."
  if inputs.query.dtype not in (jnp.float16, jnp.bfloat16):
    return f"cuDNN's attention takes float16 or bfloat16 inputs, got {inputs.query.dtype}."
  return None


register_implementation("xla", _xla_attention, priority=0, takes_dropout=True)
# Chosen only when asked for: the Pallas kernel covers every argument.
register_implementation("cudnn", _cudnn_attention, priority=-1, rejects=_cudnn_rejects,
                        is_available=lambda: jax.default_backend() == "gpu")


registry.register(registry.VariantSpec(
    name="dot_product", fn=dot_product_attention, family="dense", complexity="O(T^2)",
    takes=("dropout",),
    subquadratic=False, exact=True, causal=True, cross=True, paper="Vaswani et al. 2017",
    options=dict(
        implementation="'xla', 'blockwise', 'pallas', 'cudnn', ...; None picks the best here",
        local_window_size=registry.VariantOption(
            "local_window_size", tuple, None,
            "(left, right): each query sees keys q - left .. q + right; None for all"),
        scale="multiplies the logits; 1/sqrt(D) when None"),
    presets={"lra_release": registry.Preset(
        {}, "the release's Transformer (lra_benchmarks/models/transformer/transformer.py) is "
            "softmax attention scaled by 1/sqrt(D): the method, unchanged")}))
