"""Segment recurrence: Transformer-XL (Dai et al. 2019).

A long sequence is processed a segment at a time. Each layer keeps the last
M hidden states it saw (its inputs: the previous layer's outputs) as memory;
the next segment's keys and values are projected from `[memory; segment]`
with the memory's gradient stopped, so information flows forward across
segments (a reach of about M x layers) at the cost of one segment's backward
pass. Positions are relative (`positional.XLRelativePosition`): the same
distance scores the same wherever the segment lies.

The memory lives in the "memory" collection, one `[B, M, E]` per layer
(stacked under a scanned stack), as the KV cache lives in "cache": pass it
in and take it back each call,

    variables = model.init(rng, first_segment)       # memory: empty
    memory = variables["memory"]
    for segment in segments:
      logits, state = model.apply({"params": params, "memory": memory}, segment,
                                  mutable=["memory"])
      memory = state["memory"]

Called without the collection, a layer has no memory: relative attention
within the call's tokens (what a classifier's training step does).
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.core import FrozenDict

from attention_jax import positional, registry
from attention_jax.core.masks import and_masks, make_attention_mask
from attention_jax.variants import common
from attention_jax.variants.dense import dot_product_attention

Array = jnp.ndarray
Dtype = Any

MEMORY_COLLECTION = "memory"


def transformer_xl_attention(query: Array, key: Array, value: Array, bias: Optional[Array] = None,
                             mask: Optional[Array] = None, *, relative_key: Array,
                             content_bias: Array, position_bias: Array,
                             memory_length: int = 0, is_causal: bool = False,
                             scale: Optional[float] = None, **kwargs) -> Array:
  """Transformer-XL's attention of a segment over `[memory; segment]` (eq. 4):

      A_ij = q_i . k_j + q_i . W_{k,R} R_{i-j} + u . k_j + v . W_{k,R} R_{i-j}

  times `scale`, softmax over j, then the values. The memory's keys and
  values come first, so query i sits at position `memory_length + i` of the
  keys' axis.

  Args:
    query: `[B, T, H, D]`, the segment's queries.
    key, value: `[B, M + T, Hkv, D|Dv]`, the memory's then the segment's
      (the memory's already without gradient).
    bias, mask: broadcastable to `[B, H, T, M + T]` (e.g. empty memory slots
      masked out).
    relative_key: `W_{k,R} R` `[B|1, 2T + M - 1, H, D]` at the distances
      `M + T - 1, ..., -(T - 1)` (`positional.xl_relative_distances`).
    content_bias, position_bias: u and v, `[H, D]`.
    memory_length: M, the keys before the segment's first.
    is_causal: query i attends keys up to position `M + i` (the memory and
      the segment's tokens up to itself).
    scale: multiplies every term; 1/sqrt(D) by default.
    **kwargs: the rest of `dot_product_attention`'s arguments (padding,
      dropout); its own causal mask is top-left aligned, so causality is
      applied here.

  Returns:
    `[B, T, H, Dv]`.
  """
  q_len, kv_len, head_dim = query.shape[1], key.shape[1], query.shape[-1]
  common.check_size("memory_length", memory_length, minimum=0)
  if kv_len != memory_length + q_len:
    raise ValueError(f"key must hold memory_length + T = {memory_length} + {q_len} tokens, got "
                     f"shape {key.shape}.")
  scale = 1.0 / head_dim ** 0.5 if scale is None else scale
  relative = positional.xl_relative_logits(
      query, common.repeat_kv_heads(key, query.shape[2]), relative_key, content_bias,
      position_bias)
  bias = relative * scale if bias is None else bias + relative * scale
  if is_causal:
    mask = make_attention_mask(q_len, kv_len, is_causal=True, q_offset=memory_length, mask=mask)
  return dot_product_attention(query, key, value, bias=bias, mask=mask, scale=scale, **kwargs)


class TransformerXLAttention(nn.Module):
  """Transformer-XL's attention layer with its segment memory (the mixer contract).

  The projections, heads and relative scores are `MultiHeadAttention` with
  `position="xl_relative"` (submodule "attention"), given `[memory; x]` as
  the keys' and values' input; this module keeps the memory.

  Attributes:
    num_heads, num_kv_heads, head_dim, qkv_features, out_features,
    dropout_rate, dtype, param_dtype: as `MultiHeadAttention`'s.
    memory_length: M, the hidden states each layer keeps (0: none). The paper
      trains with M equal to the segment length (and evaluates with more).
    position: None or "xl_relative" (the model's position setting; the
      layer scores relative positions either way).
    position_options: `max_wavelength` of the relative sinusoids.
    decode: one token at a time with a KV cache of every past token (the
      memory of an unbounded M); the memory collection is then not used.
  """

  num_heads: int
  num_kv_heads: Optional[int] = None
  head_dim: Optional[int] = None
  qkv_features: Optional[int] = None
  out_features: Optional[int] = None
  dropout_rate: float = 0.0
  dtype: Optional[Dtype] = None
  param_dtype: Dtype = jnp.float32
  memory_length: int = 64
  position: Optional[str] = None
  position_options: Mapping[str, Any] = FrozenDict()
  decode: bool = False

  @nn.compact
  def __call__(self, x: Array, context: Optional[Array] = None, *, mask: Optional[Array] = None,
               is_causal: bool = False, query_seq_lengths: Optional[Array] = None,
               key_value_seq_lengths: Optional[Array] = None, segment_ids=None,
               positions: Optional[Array] = None, deterministic: bool = True, carry=None):
    """The mixer contract. x: `[B, T, E]`; mask: broadcastable to
    `[B, H, T, T]` over the segment's keys (the memory's are added, visible
    where filled); positions: restarting positions are not supported with a
    memory. Returns `[B, T, E]` (with the carry when given one)."""
    memory_length = common.check_size("memory_length", self.memory_length, minimum=0)
    common.reject_unsupported("transformer_xl", context=context, segment_ids=segment_ids)
    if self.position not in (None, "xl_relative"):
      raise ValueError(f"transformer_xl scores positions with its own relative terms "
                       f"(model.position 'xl_relative' or 'none'), got position="
                       f"{self.position!r}.")
    attention = registry.get_variant("dot_product").mixer_class(
        num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
        qkv_features=self.qkv_features, out_features=self.out_features,
        dropout_rate=self.dropout_rate, dtype=self.dtype, param_dtype=self.param_dtype,
        position="xl_relative", position_options=self.position_options, decode=self.decode,
        name="attention")
    arguments = dict(is_causal=is_causal, query_seq_lengths=query_seq_lengths,
                     deterministic=deterministic)
    memory = None if self.decode or memory_length == 0 else self._memory(x)
    if memory is None:
      y = attention(x, mask=mask, key_value_seq_lengths=key_value_seq_lengths,
                    positions=positions, **arguments)
      return common.mixer_output(y, carry)

    hidden, filled = memory
    batch, length = x.shape[:2]
    if positions is not None:
      raise ValueError("transformer_xl with a memory numbers positions itself (the segment "
                       "follows its memory); got positions.")
    # Slot s of the memory holds the token M - s before the segment's first;
    # the slots not filled yet (the first segments) are hidden from every query.
    memory_visible = (jnp.arange(memory_length) >= memory_length - filled.value)
    key_mask = jnp.ones((batch, length), bool)
    if key_value_seq_lengths is not None:
      key_mask = jnp.arange(length)[None, :] < key_value_seq_lengths[:, None]
    key_mask = jnp.concatenate(
        [jnp.broadcast_to(memory_visible, (batch, memory_length)), key_mask], axis=1)
    full_mask = key_mask[:, None, None, :]
    if mask is not None:
      segment_mask = jnp.broadcast_to(mask, jnp.broadcast_shapes(
          mask.shape, (batch, 1, length, length)))
      full_mask = and_masks(full_mask, jnp.concatenate([jnp.ones(
          segment_mask.shape[:3] + (memory_length,), bool), segment_mask], axis=-1))
    if is_causal:
      full_mask = make_attention_mask(length, memory_length + length, is_causal=True,
                                      q_offset=memory_length, mask=full_mask)
    keys_input = jnp.concatenate([jax.lax.stop_gradient(hidden.value).astype(x.dtype), x],
                                 axis=1)
    y = attention(x, keys_input, mask=full_mask, positions=memory_length + jnp.arange(length),
                  **{**arguments, "is_causal": False})
    if self.is_mutable_collection(MEMORY_COLLECTION) and not self.is_initializing():
      hidden.value = jax.lax.stop_gradient(keys_input[:, -memory_length:]).astype(
          hidden.value.dtype)
      filled.value = jnp.minimum(filled.value + length, memory_length)
    return common.mixer_output(y, carry)

  def _memory(self, x: Array):
    """(hidden `[B, M, E]`, filled: how many of its slots hold tokens), or None
    when the call has no memory collection."""
    if not (self.has_variable(MEMORY_COLLECTION, "hidden")
            or self.is_mutable_collection(MEMORY_COLLECTION)):
      return None
    batch, _, features = x.shape
    hidden = self.variable(MEMORY_COLLECTION, "hidden", jnp.zeros,
                           (batch, self.memory_length, features), x.dtype)
    filled = self.variable(MEMORY_COLLECTION, "filled", lambda: jnp.array(0, jnp.int32))
    if hidden.value.shape != (batch, self.memory_length, features):
      raise ValueError(f"the memory holds [B, M, E] = {list(hidden.value.shape)}, but x is "
                       f"{list(x.shape)} with memory_length={self.memory_length}: segments "
                       f"must keep the batch size and width of the memory they continue.")
    return hidden, filled


registry.register(registry.VariantSpec(
    name="transformer_xl", fn=transformer_xl_attention, family="recurrence",
    complexity="O(T^2 + T M)", subquadratic=False, exact=False, causal=True, cross=False,
    paper="Dai et al. 2019", qkv=False, mixer=TransformerXLAttention,
    options=dict(memory_length="M, hidden states kept per layer from the previous segments "
                               "(0: none)")))
