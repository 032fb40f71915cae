"""Segment recurrence: Transformer-XL (Dai et al. 2019) and the Compressive
Transformer (Rae et al. 2020).

A long sequence is processed a segment at a time. Each layer keeps the last
M hidden states it saw (its inputs: the previous layer's outputs) as memory;
the next segment's keys and values are projected from `[memory; segment]`
with the memory's gradient stopped, so information flows forward across
segments (a reach of about M x layers) at the cost of one segment's backward
pass. Positions are relative (`positional.XLRelativePosition`): the same
distance scores the same wherever the segment lies.

The Compressive Transformer keeps, besides, the states that fall out of the
memory: every c of them compressed into one vector (mean pooling or a learned
convolution), the last Mc such vectors kept as a second, coarser memory in
front of the first (keys from `[compressed; memory; segment]`), which
stretches the reach to about (M + c Mc) x layers. Its compression network
learns from an attention-reconstruction loss of its own
(`attention_reconstruction_loss`); Transformer-XL is the same layer with
Mc = 0 (`CompressiveAttention`).

The memories live in the "memory" collection, one `[B, M, E]` (and
`[B, Mc, E]`) per layer (stacked under a scanned stack), as the KV cache
lives in "cache": pass it in and take it back each call,

    variables = model.init(rng, first_segment)       # memory: empty
    memory = variables["memory"]
    for segment in segments:
      logits, state = model.apply({"params": params, "memory": memory}, segment,
                                  mutable=["memory"])
      memory = state["memory"]

(add "losses" to `mutable` to collect the compressive layers' reconstruction
losses). Called without the collection, a layer has no memory: relative
attention within the call's tokens (what a classifier's training step does).
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.core import FrozenDict

from attention_jax import axes, positional, registry
from attention_jax.core.masks import and_masks, make_attention_mask
from attention_jax.variants import common
from attention_jax.variants.dense import dot_product_attention

Array = jnp.ndarray
Dtype = Any

MEMORY_COLLECTION = "memory"
# The Compressive Transformer's compression functions f_c (`compress_memory`).
COMPRESSIONS = ("pool", "conv")


def transformer_xl_attention(query: Array, key: Array, value: Array, bias: Optional[Array] = None,
                             mask: Optional[Array] = None, *, relative_key: Array,
                             content_bias: Array, position_bias: Array,
                             memory_length: int, is_causal: bool = False,
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


def compressive_attention(query: Array, key: Array, value: Array, bias: Optional[Array] = None,
                          mask: Optional[Array] = None, *, relative_key: Array,
                          content_bias: Array, position_bias: Array, compressed_memory_length: int,
                          memory_length: int, is_causal: bool = False,
                          scale: Optional[float] = None, **kwargs) -> Array:
  """The Compressive Transformer's attention of a segment over
  `[compressed; memory; segment]`: `transformer_xl_attention` with the Mc
  compressed slots as the keys just before the M memory slots, so query i
  sits at position `Mc + M + i` of the keys' axis (`CompressiveAttention`
  says why the compressed slots are numbered so).

  Args:
    query: `[B, T, H, D]`, the segment's queries.
    key, value: `[B, Mc + M + T, Hkv, D|Dv]`: the compressed memory's, the
      memory's, then the segment's (both memories already without gradient).
    bias, mask: broadcastable to `[B, H, T, Mc + M + T]` (e.g. empty slots of
      either memory masked out).
    relative_key: `W_{k,R} R` `[B|1, 2T + Mc + M - 1, H, D]` at the distances
      `Mc + M + T - 1, ..., -(T - 1)`.
    content_bias, position_bias: u and v, `[H, D]`.
    compressed_memory_length: Mc, the compressed slots before the memory.
    memory_length: M, the memory slots before the segment's first token.
    is_causal, scale, **kwargs: as `transformer_xl_attention`'s.

  Returns:
    `[B, T, H, Dv]`.
  """
  common.check_size("compressed_memory_length", compressed_memory_length, minimum=0)
  common.check_size("memory_length", memory_length, minimum=0)
  return transformer_xl_attention(query, key, value, bias, mask, relative_key=relative_key,
                                  content_bias=content_bias, position_bias=position_bias,
                                  memory_length=compressed_memory_length + memory_length,
                                  is_causal=is_causal, scale=scale, **kwargs)


def compress_memory(states: Array, rate: int, kind: str = "pool", kernel: Optional[Array] = None,
                    bias: Optional[Array] = None) -> Array:
  """The compression function f_c (Rae et al. 2020): every `rate` consecutive
  states into one vector.

      "pool":  out_n = mean_j states_{n c + j}                 (no parameters)
      "conv":  out_n = sum_j states_{n c + j} @ kernel[j] + bias

  "conv" is a 1-D convolution of kernel size and stride c (the paper's best
  compression); "pool" is mean pooling with stride c.

  Args:
    states: `[B, N, E]`, oldest first; N a multiple of `rate`.
    rate: c, the states per compressed vector.
    kind: one of `COMPRESSIONS`.
    kernel: `[c, E, F]`, the convolution's (for "conv").
    bias: `[F]` or None (for "conv").

  Returns:
    `[B, N / c, E]` ("pool") or `[B, N / c, F]` ("conv"), oldest first.
  """
  if kind not in COMPRESSIONS:
    raise registry.unknown_name_error("compression", kind, COMPRESSIONS)
  batch, length, features = states.shape
  common.check_size("compression_rate", rate, length=length, divides=True)
  windows = states.reshape(batch, length // rate, rate, features)  # [B, N / c, c, E]
  if kind == "pool":
    return jnp.mean(windows, axis=2)
  if kernel is None:
    raise ValueError("compression 'conv' needs its kernel [c, E, F], got kernel=None.")
  common.check_per_head("kernel", kernel, (rate, features, None))
  compressed = jnp.einsum("bnce,cef->bnf", windows, kernel)
  return compressed if bias is None else compressed + bias


def last_slots(size: int, count: Array) -> Array:
  """`[size]` bool, True on the last `count` slots: those of a memory (filled
  from its end) that hold states."""
  return jnp.arange(size) >= size - count


def attention_reconstruction_loss(hidden: Array, old_states: Array, compressed: Array,
                                  real_slots: Array,
                                  projections: Mapping[str, Mapping[str, Array]]) -> Array:
  """The attention-reconstruction loss of one layer (Rae et al. 2020, sec. 3.2,
  Algorithm 2): how far the layer's attention over the compressed states is
  from its attention over the states they replace,

      L = mean_{b, i, h, d} (attn(h, old)_{bihd} - attn(h, f_c(old))_{bihd})^2

  with attn(h, m) = softmax(Q K^T / sqrt(D)) V per head, Q = h W_q + b_q,
  K = m W_k + b_k, V = m W_v + b_v: content only (no positions) and before
  the output projection, as the paper's attn, scaled as the layer scales its
  content scores. The mean over batch, queries,
  heads and value features (the paper writes a norm) keeps the loss's size
  independent of the shapes. h, the old states and the projections are
  held fixed (stop-gradient), so only `compressed`, hence the compression
  network, learns from it.

  Only real states are compared: the last `real_slots` compressed slots with
  the `real_slots * c` states they were made from (the last of `old_states`;
  the states of a window only partly real are in neither). With no real slot
  the loss is 0.

  Args:
    hidden: h `[B, T, E]`, the layer's input (the segment's states).
    old_states: `[B, N, E]`, the states leaving the memory, oldest first.
    compressed: f_c(old_states) `[B, N / c, E]`.
    real_slots: int scalar (may be traced), how many of the compressed slots
      (the last ones) were made from real states only.
    projections: the attention layer's `{"query": {"kernel": [E, H, D],
      "bias": [H, D]}, "key": {[E, Hkv, D], [Hkv, D]}, "value": {[E, Hkv, Dv],
      [Hkv, Dv]}}` (the biases optional).

  Returns:
    The loss, a float32 scalar.
  """
  num_old, num_compressed = old_states.shape[1], compressed.shape[1]
  if num_compressed == 0 or num_old % num_compressed:
    raise ValueError(f"compressed must hold N / c slots for the N = {num_old} old states, got "
                     f"shape {list(compressed.shape)}.")
  rate = num_old // num_compressed
  hidden, old_states = jax.lax.stop_gradient(hidden), jax.lax.stop_gradient(old_states)
  projections = jax.lax.stop_gradient(
      {name: dict(projections[name]) for name in ("query", "key", "value")})

  def project(name, states):
    kernel, bias = projections[name]["kernel"], projections[name].get("bias")
    projected = jnp.einsum("bne,ehd->bnhd", states.astype(jnp.float32),
                           kernel.astype(jnp.float32))
    return projected if bias is None else projected + bias.astype(jnp.float32)

  query = project("query", hidden)

  def attend(states, real):  # -> [B, T, H, Dv]
    return dot_product_attention(query, project("key", states), project("value", states),
                                 mask=real[None, None, None, :])

  difference = (attend(old_states, last_slots(num_old, real_slots * rate))
                - attend(compressed, last_slots(num_compressed, real_slots)))
  return jnp.where(real_slots > 0, jnp.mean(jnp.square(difference)), 0.0)


class CompressiveAttention(nn.Module):
  """The Compressive Transformer's attention layer with its two memories (Rae
  et al. 2020; the mixer contract). With `compressed_memory_length=0` it is
  Transformer-XL's layer (`TransformerXLAttention`).

  The projections, heads and relative scores are `MultiHeadAttention` with
  `position="xl_relative"` (submodule "attention"), given
  `[compressed; memory; x]` as the keys' and values' input; this module keeps
  the memories, compresses, and sows the reconstruction loss.

  The "memory" collection holds, per layer:
    hidden `[B, M, E]`, filled: the last M states (the layer's inputs) seen,
      oldest first; its last `filled` slots hold states.
    compressed `[B, Mc, E]`, compressed_filled (only when Mc > 0): the
      compressed states, oldest first; its last `compressed_filled` slots are
      real.
  A call that may update them (the collection mutable, not initialising)
  with a segment of T states pushes the oldest T of `[memory; segment]` out
  of the memory (which keeps the last M). Those T are compressed by
  `compress_memory` into T / c slots appended to the compressed memory,
  which keeps its last Mc. A slot is real when all c states it was made from
  were: real states are the last of the evicted block, so floor(real
  evicted / c) slots are (a window only partly real, in the first segments
  when M is not a multiple of c, is dropped). Slots that are not real are
  masked from every query.

  Positions: the compressed slots are numbered as the Mc positions just
  before the memory (query i of the segment at Mc + M + i, memory slot s at
  Mc + s, compressed slot s at s), as attending over the concatenation
  `[cm; m; h]` (the paper's Algorithm 1) suggests. A slot stands for c
  tokens, so its distance is understated (the newest slot is one step before
  the oldest memory state); in exchange the keys' positions stay
  consecutive, which `XLRelativePosition`'s shift needs, and no parameter is
  added.

  Training the compression: the compressed memory is stored without gradient,
  so the task loss never reaches the convolution. Each update sows
  `reconstruction_weight * attention_reconstruction_loss` of the evicted block
  (h = this call's input x, the layer's own query/key/value projections) into
  "losses" as "attention_reconstruction": 0 when the block holds no real
  window. Its gradient reaches only the convolution (h, the old states and
  the projections are stopped). With compression "pool" there is nothing to
  train and no loss is sown. Padding (`key_value_seq_lengths`) is not tracked
  by the memories: padded tokens enter them as Transformer-XL's do.

  Attributes:
    num_heads, num_kv_heads, head_dim, qkv_features, out_features,
    dropout_rate, dtype, param_dtype: as `MultiHeadAttention`'s.
    memory_length: M, the hidden states each layer keeps (0: none).
      Transformer-XL trains with M equal to the segment length (and
      evaluates with more).
    compressed_memory_length: Mc, the compressed states each layer keeps
      (0: none, Transformer-XL).
    compression_rate: c, states per compressed state; it must divide the
      length of every segment that updates the memory (checked there, not at
      initialisation or in calls that leave the memory as it is, such as a
      trainer's calls without the collection).
    compression: "conv" (a learned convolution of kernel size and stride c,
      parameters "compression_kernel" `[c, E, E]` and "compression_bias"
      `[E]`; the paper's best) or "pool" (mean pooling, no parameters).
    reconstruction_weight: multiplies the sown reconstruction loss (0: none
      sown; the compression network then does not learn).
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
  compressed_memory_length: int = 64
  compression_rate: int = 4
  compression: str = "conv"
  reconstruction_weight: float = 1.0
  position: Optional[str] = None
  position_options: Mapping[str, Any] = FrozenDict()
  decode: bool = False

  # The registered name, in messages.
  variant_name = "compressive"

  @nn.compact
  def __call__(self, x: Array, context: Optional[Array] = None, *, mask: Optional[Array] = None,
               is_causal: bool = False, query_seq_lengths: Optional[Array] = None,
               key_value_seq_lengths: Optional[Array] = None, segment_ids=None,
               positions: Optional[Array] = None, deterministic: bool = True, carry=None):
    """The mixer contract. x: `[B, T, E]`; mask: broadcastable to
    `[B, H, T, T]` over the segment's keys (the memories' are added, visible
    where they hold states); positions: restarting positions are not
    supported with a memory. Returns `[B, T, E]` (with the carry when given
    one)."""
    memory_length = common.check_size("memory_length", self.memory_length, minimum=0)
    compressed_length = self._check_compression()
    common.reject_unsupported(self.variant_name, context=context, segment_ids=segment_ids)
    if self.position not in (None, "xl_relative"):
      raise ValueError(f"{self.variant_name} scores positions with its own relative terms "
                       f"(model.position 'xl_relative' or 'none'), got position="
                       f"{self.position!r}.")
    attention = registry.get_variant("dot_product").mixer_class(
        num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
        qkv_features=self.qkv_features, out_features=self.out_features,
        dropout_rate=self.dropout_rate, dtype=self.dtype, param_dtype=self.param_dtype,
        position="xl_relative", position_options=self.position_options, decode=self.decode,
        name="attention")
    compression_weights = self._compression_weights(x.shape[-1])
    arguments = dict(is_causal=is_causal, query_seq_lengths=query_seq_lengths,
                     deterministic=deterministic)
    memory = (None if self.decode or memory_length + compressed_length == 0
              else self._memory(x))
    if memory is None:
      y = attention(x, mask=mask, key_value_seq_lengths=key_value_seq_lengths,
                    positions=positions, **arguments)
      return common.mixer_output(y, carry)

    hidden, filled, compressed, compressed_filled = memory
    batch, length = x.shape[:2]
    if positions is not None:
      raise ValueError(f"{self.variant_name} with a memory numbers positions itself (the "
                       f"segment follows its memory); got positions.")
    # The keys before the segment's first: [compressed; memory], oldest first;
    # slot s of the memory holds the token M - s before the segment's first.
    # The slots not filled yet (the first segments) are hidden from every query.
    past = [(hidden, filled, memory_length)]
    if compressed is not None:
      past.insert(0, (compressed, compressed_filled, compressed_length))
    past_length = memory_length + (compressed_length if compressed is not None else 0)
    past_visible = jnp.concatenate([last_slots(size, count.value) for _, count, size in past])
    past_states = jnp.concatenate([jax.lax.stop_gradient(slots.value).astype(x.dtype)
                                   for slots, _, _ in past], axis=1)
    key_mask = jnp.ones((batch, length), bool)
    if key_value_seq_lengths is not None:
      key_mask = jnp.arange(length)[None, :] < key_value_seq_lengths[:, None]
    key_mask = jnp.concatenate(
        [jnp.broadcast_to(past_visible, (batch, past_length)), key_mask], axis=1)
    full_mask = key_mask[:, None, None, :]
    if mask is not None:
      segment_mask = jnp.broadcast_to(mask, jnp.broadcast_shapes(
          mask.shape, (batch, 1, length, length)))
      full_mask = and_masks(full_mask, jnp.concatenate([jnp.ones(
          segment_mask.shape[:3] + (past_length,), bool), segment_mask], axis=-1))
    if is_causal:
      full_mask = make_attention_mask(length, past_length + length, is_causal=True,
                                      q_offset=past_length, mask=full_mask)
    keys_input = jnp.concatenate([past_states, x], axis=1)
    y = attention(x, keys_input, mask=full_mask, positions=past_length + jnp.arange(length),
                  **{**arguments, "is_causal": False})
    if self.is_mutable_collection(MEMORY_COLLECTION) and not self.is_initializing():
      self._update_memories(x, keys_input[:, past_length - memory_length:], memory, attention,
                            compression_weights)
    return common.mixer_output(y, carry)

  def _update_memories(self, x: Array, states: Array, memory, attention: nn.Module,
                       compression_weights) -> None:
    """After a segment x `[B, T, E]`: the memory keeps the last M of `states`
    = `[memory; x]` `[B, M + T, E]`; the first T leave it, compressed into
    the compressed memory (with their reconstruction loss sown)."""
    hidden, filled, compressed, compressed_filled = memory
    length = x.shape[1]
    # The first M - filled slots of `states` hold no state yet.
    evicted_real = jnp.clip(filled.value + length - self.memory_length, 0, length)
    hidden.value = jax.lax.stop_gradient(states[:, length:]).astype(hidden.value.dtype)
    filled.value = jnp.minimum(filled.value + length, self.memory_length)
    if compressed is None:
      return
    evicted = jax.lax.stop_gradient(states[:, :length])
    new_slots = compress_memory(evicted, self.compression_rate, self.compression,
                                *compression_weights)  # [B, T / c, E]
    real_slots = evicted_real // self.compression_rate
    compressed.value = jnp.concatenate(
        [compressed.value, jax.lax.stop_gradient(new_slots).astype(compressed.value.dtype)],
        axis=1)[:, -self.compressed_memory_length:]
    compressed_filled.value = jnp.minimum(compressed_filled.value + real_slots,
                                          self.compressed_memory_length)
    if self.compression == "conv" and self.reconstruction_weight:
      loss = attention_reconstruction_loss(x, evicted, new_slots, real_slots,
                                           nn.meta.unbox(attention.variables["params"]))
      self.sow("losses", "attention_reconstruction", self.reconstruction_weight * loss)

  def _check_compression(self) -> int:
    """Validates the compression options; returns Mc."""
    compressed_length = common.check_size("compressed_memory_length",
                                          self.compressed_memory_length, minimum=0)
    common.check_size("compression_rate", self.compression_rate)
    if self.compression not in COMPRESSIONS:
      raise registry.unknown_name_error("compression", self.compression, COMPRESSIONS)
    return compressed_length

  def _compression_weights(self, features: int):
    """The convolution's (kernel `[c, E, E]`, bias `[E]`) with compression
    "conv" and a compressed memory, else (). Created in every call, memory
    or not, so that the parameters never depend on the call."""
    if self.compressed_memory_length == 0 or self.compression != "conv":
      return ()
    rate = self.compression_rate

    def init_kernel(rng, shape, dtype):
      # As a dense layer from the window's c * E features to E.
      flat = nn.initializers.lecun_normal()(rng, (rate * features, features), dtype)
      return flat.reshape(shape)

    kernel = self.param("compression_kernel",
                        nn.with_logical_partitioning(init_kernel, (None, axes.EMBED, None)),
                        (rate, features, features), self.param_dtype)
    bias = self.param("compression_bias",
                      nn.with_logical_partitioning(nn.initializers.zeros_init(), (None,)),
                      (features,), self.param_dtype)
    return kernel, bias

  def _memory(self, x: Array):
    """(hidden `[B, M, E]`, filled, compressed `[B, Mc, E]`, compressed_filled)
    as variables, the last two None when Mc = 0; the counts say how many of
    the slots hold states. None when the call has no memory collection."""
    if not (self.has_variable(MEMORY_COLLECTION, "hidden")
            or self.is_mutable_collection(MEMORY_COLLECTION)):
      return None
    count = lambda: jnp.array(0, jnp.int32)
    hidden = self._memory_slots("hidden", "memory_length", self.memory_length, x)
    filled = self.variable(MEMORY_COLLECTION, "filled", count)
    if self.compressed_memory_length == 0:
      return hidden, filled, None, None
    compressed = self._memory_slots("compressed", "compressed_memory_length",
                                    self.compressed_memory_length, x)
    return hidden, filled, compressed, self.variable(MEMORY_COLLECTION, "compressed_filled",
                                                     count)

  def _memory_slots(self, name: str, option: str, size: int, x: Array):
    """The memory variable `name` `[B, size, E]` (zeros when created)."""
    batch, _, features = x.shape
    slots = self.variable(MEMORY_COLLECTION, name, jnp.zeros, (batch, size, features), x.dtype)
    if slots.value.shape != (batch, size, features):
      raise ValueError(f"the memory {name!r} holds [B, {option}, E] = {list(slots.value.shape)}, "
                       f"but x is {list(x.shape)} with {option}={size}: segments must keep the "
                       f"batch size and width of the memory they continue.")
    return slots


class TransformerXLAttention(CompressiveAttention):
  """Transformer-XL's attention layer with its segment memory (the mixer
  contract): `CompressiveAttention` without the compressed memory
  (`compressed_memory_length` 0 by default here), one code path for both.

  The projections, heads and relative scores are `MultiHeadAttention` with
  `position="xl_relative"` (submodule "attention"), given `[memory; x]` as
  the keys' and values' input; this module keeps the memory ("hidden"
  `[B, M, E]` and "filled" in the "memory" collection).

  Attributes:
    as `CompressiveAttention`'s; only `memory_length` is the variant's option.
  """

  compressed_memory_length: int = 0

  variant_name = "transformer_xl"


registry.register(registry.VariantSpec(
    name="transformer_xl", fn=transformer_xl_attention, family="recurrence",
    complexity="O(T^2 + T M)", subquadratic=False, exact=False, causal=True, cross=False,
    paper="Dai et al. 2019", qkv=False, mixer=TransformerXLAttention,
    options=dict(memory_length="M, hidden states kept per layer from the previous segments "
                               "(0: none)")))

registry.register(registry.VariantSpec(
    name="compressive", fn=compressive_attention, family="recurrence",
    complexity="O(T^2 + T (M + Mc))", subquadratic=False, exact=False, causal=True, cross=False,
    paper="Rae et al. 2020", qkv=False, mixer=CompressiveAttention,
    options=dict(
        memory_length="M, hidden states kept per layer from the previous segments (0: none)",
        compressed_memory_length="Mc, compressed states kept per layer from the states that "
                                 "left the memory (0: none, Transformer-XL)",
        compression_rate="c, states compressed into one; must divide the segment length",
        compression="the compression function: 'conv' (learned, kernel and stride c) or "
                    "'pool' (mean of c)",
        reconstruction_weight="weight of the attention-reconstruction loss sown into "
                              "'losses' (trains the 'conv' compression only)")))
