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
    name="persistent_memory", takes=("dropout",), fn=persistent_memory_attention, family="memory",
    complexity="O(T^2 + T N)", subquadratic=False, exact=True, causal=True, cross=True,
    paper="Sukhbaatar et al. 2019", extras=PersistentMemory,
    options=dict(num_memory_slots="N learned key/value vectors per K/V head",
                 implementation="the exact attention's implementation; None picks the best",
                 scale="multiplies the logits; 1/sqrt(D) when None")))


# --------------------------------------------------------------------------------------
# A few learned vectors between the sequence and itself: ISAB and Perceiver.

# block(queries [B, M, E], inputs [B, T, E] or None for self-attention,
#       inputs_valid [B, T] bool or None) -> [B, M, E]
Block = Callable[[Array, Optional[Array], Optional[Array]], Array]


def latent_bottleneck_attention(
    x: Array,
    latents: Array,
    encode: Block,
    decode: Block,
    *,
    context: Optional[Array] = None,
    process: Sequence[Block] = (),
    inputs_valid: Optional[Array] = None,
    query_valid: Optional[Array] = None,
) -> Array:
  """decode(x, process(encode(latents, inputs))): the sequence talks to itself
  through M learned vectors, O(T M) instead of O(T^2).

  * `inducing_points` (ISAB, Lee et al. 2019): `latents` are the inducing
    points I, `encode` and `decode` are MABs: H = MAB(I, X), out = MAB(X, H).
  * `perceiver` (Jaegle et al. 2021): `latents` cross-attend to the input,
    `process` is L latent self-attention blocks, and `decode` lets the input
    positions query the latents (Perceiver IO's decoder, with the mixer's own
    inputs as output queries) so that the layer returns one vector per token.

  The blocks are functions rather than parameter arrays because each is a
  whole attention + feed-forward sub-layer; the Flax modules pass their bound
  sub-modules, and a purely functional caller passes
  `functools.partial(block.apply, variables)`. Nothing here owns parameters.

  Args:
    x: `[B, Tq, E]` the sequence (and the decoder's queries).
    latents: `[M, E]` learned vectors, shared by the batch.
    encode: block with the latents as queries and the inputs as keys/values.
    decode: block with `x` as queries and the latents as keys/values.
    context: `[B, Tk, E]` inputs for cross-attention; `x` when None.
    process: blocks of latent self-attention (called with inputs None).
    inputs_valid: `[B, Tk]` bool, the inputs that exist (key padding). Padded
      inputs are masked in `encode`, the only place the latents read them, so
      they cannot change the outputs of the other positions.
    query_valid: `[B, Tq]` bool; outputs of other positions are zeroed.

  Returns:
    `[B, Tq, E]`.
  """
  inputs = x if context is None else context
  batch = inputs.shape[0]
  z = encode(jnp.broadcast_to(latents.astype(inputs.dtype), (batch,) + latents.shape), inputs,
             inputs_valid)
  for block in process:
    z = block(z, None, None)
  out = decode(x, z, None)
  if query_valid is not None:
    out = jnp.where(query_valid[:, :, None], out, jnp.zeros((), out.dtype))
  return out


class AttentionBlock(nn.Module):
  """Multi-head attention from `queries` to `inputs`, then a feed-forward layer.

  post-norm (the Set Transformer's MAB): h = LN(q + MHA(q, c)); LN(h + FFN(h)).
  pre-norm (Perceiver): h = q + MHA(LN(q), LN(c)); h + FFN(LN(h)); without
  `query_residual` the first sum drops q (Perceiver IO's decoder, whose output
  goes into the encoder block's residual branch already).

  Attributes:
    num_heads, num_kv_heads, dropout_rate, attention_options, dtype,
      param_dtype: of the inner `MultiHeadAttention`.
    mlp_ratio: feed-forward hidden size as a multiple of the features.
    pre_norm: Perceiver's pre-norm order instead of MAB's post-norm.
    query_residual: add the queries to the attention output.
  """

  num_heads: int
  num_kv_heads: Optional[int] = None
  mlp_ratio: int = 2
  pre_norm: bool = False
  query_residual: bool = True
  dropout_rate: float = 0.0
  attention_options: Mapping[str, Any] = FrozenDict()
  dtype: Optional[Dtype] = None
  param_dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, queries: Array, inputs: Optional[Array], inputs_valid: Optional[Array],
               *, deterministic: bool = True) -> Array:
    """queries `[B, M, E]`, inputs `[B, T, E]` (None: self-attention) -> `[B, M, E]`."""
    # The module half of this family builds on the layers; importing them here,
    # not at the top, keeps the pure functions above importable without them.
    from attention_jax.layers.attention import MultiHeadAttention  # pylint: disable=g-import-not-at-top
    from attention_jax.layers.feedforward import FeedForward  # pylint: disable=g-import-not-at-top
    norm = lambda name: nn.LayerNorm(dtype=self.dtype, param_dtype=self.param_dtype, name=name)
    attention = MultiHeadAttention(
        num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
        dropout_rate=self.dropout_rate, attention_options=self.attention_options,
        dtype=self.dtype, param_dtype=self.param_dtype, name="attention")
    feed_forward = FeedForward(self.mlp_ratio * queries.shape[-1], activation="relu",
                               dtype=self.dtype, param_dtype=self.param_dtype, name="mlp")
    mask = None if inputs_valid is None else inputs_valid[:, None, None, :]
    if self.pre_norm:
      context = None if inputs is None else norm("inputs_norm")(inputs)
      h = attention(norm("queries_norm")(queries), context, mask=mask,
                    deterministic=deterministic)
      h = queries + h if self.query_residual else h
      return h + feed_forward(norm("mlp_norm")(h), deterministic=deterministic)
    h = attention(queries, inputs, mask=mask, deterministic=deterministic)
    h = norm("attention_norm")(queries + h if self.query_residual else h)
    return norm("mlp_norm")(h + feed_forward(h, deterministic=deterministic))


class _LatentMixer(nn.Module):
  """What `InducingPointAttention` and `Perceiver` share: the mixer call contract.

  Attributes:
    num_heads, num_kv_heads, dropout_rate, dtype, param_dtype: of every inner
      `MultiHeadAttention` (dropout on its attention weights).
    mlp_ratio: feed-forward hidden size of each block, times the features.
    attention_options: options of the inner Q/K/V attention (`dot_product`).
    position, position_options: relative positions are meaningless between
      tokens and latents; only None / empty is accepted (absolute embeddings
      belong to the model's input layer).
  """

  num_heads: int
  num_kv_heads: Optional[int] = None
  mlp_ratio: int = 2
  dropout_rate: float = 0.0
  attention_options: Mapping[str, Any] = FrozenDict()
  position: Optional[str] = None
  position_options: Mapping[str, Any] = FrozenDict()
  dtype: Optional[Dtype] = None
  param_dtype: Dtype = jnp.float32

  variant = ""

  def _block(self, name: str, deterministic: bool, **options) -> Block:
    block = AttentionBlock(
        num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, mlp_ratio=self.mlp_ratio,
        dropout_rate=self.dropout_rate, attention_options=self.attention_options,
        dtype=self.dtype, param_dtype=self.param_dtype, name=name, **options)
    return lambda queries, inputs, valid: block(queries, inputs, valid,
                                                deterministic=deterministic)

  @nn.compact
  def __call__(self, x: Array, context: Optional[Array] = None, *, mask=None,
               is_causal: bool = False, query_seq_lengths=None, key_value_seq_lengths=None,
               segment_ids=None, positions=None, deterministic: bool = True, carry=None):
    """The mixer contract. x: `[B, Tq, E]`; context: `[B, Tk, E]` or None; mask:
    key padding `[B|1, 1, 1, Tk]`; key_value_seq_lengths / query_seq_lengths:
    `[B]`; carry: passed through. Returns `[B, Tq, E]` (with the carry when
    given one)."""
    # Every latent reads every token, so there is no causal form; segments would
    # need latents per segment.
    common.reject_unsupported(self.variant, is_causal=is_causal, segment_ids=segment_ids,
                              positions=positions, position=self.position,
                              position_options=dict(self.position_options) or None)
    inputs = x if context is None else context
    inputs_valid = common.key_padding(self.variant, mask, key_value_seq_lengths,
                                      inputs.shape[0], inputs.shape[1])
    query_valid = None
    if query_seq_lengths is not None:
      query_valid = jnp.arange(x.shape[1])[None, :] < jnp.asarray(query_seq_lengths)[:, None]
    out = self._attend(x, context, inputs_valid, query_valid, deterministic)
    return common.mixer_output(out, carry)

  def _attend(self, x: Array, context: Optional[Array], inputs_valid: Optional[Array],
              query_valid: Optional[Array], deterministic: bool) -> Array:
    """The variant's latents and blocks (called inside `__call__`'s compact scope)."""
    raise NotImplementedError


class InducingPointAttention(_LatentMixer):
  """Set Transformer's induced set attention block ISAB_m(X) = MAB(X, MAB(I, X)).

  A token mixer `[B, T, E] -> [B, T, E]` (or `x` attending to `context`
  through the inducing points). Cost O(T m).

  Attributes:
    num_inducing_points: m learned inducing points I `[m, E]`.
  """

  num_inducing_points: int = 32

  variant = "inducing_points"

  def _attend(self, x: Array, context: Optional[Array], inputs_valid: Optional[Array],
              query_valid: Optional[Array], deterministic: bool) -> Array:
    num_points = common.check_size("num_inducing_points", self.num_inducing_points)
    inducing_points = self.param("inducing_points", nn.initializers.xavier_uniform(),
                                 (num_points, x.shape[-1]), self.param_dtype)
    return latent_bottleneck_attention(
        x, inducing_points, self._block("induce", deterministic),
        self._block("attend", deterministic), context=context, inputs_valid=inputs_valid,
        query_valid=query_valid)


class Perceiver(_LatentMixer):
  """Perceiver: M latents cross-attend to the input, then self-attend L times;
  the input positions then query the latents (Perceiver IO decoding), so it is
  a token mixer `[B, T, E] -> [B, T, E]`. Cost O(T M + L M^2).

  Pre-norm blocks as in the paper; the decoder has no query residual because
  the encoder block around the mixer adds its input already.

  Attributes:
    num_latents: M learned latent vectors `[M, E]`.
    num_latent_layers: L latent self-attention blocks.
  """

  num_latents: int = 64
  num_latent_layers: int = 1

  variant = "perceiver"

  def _attend(self, x: Array, context: Optional[Array], inputs_valid: Optional[Array],
              query_valid: Optional[Array], deterministic: bool) -> Array:
    num_latents = common.check_size("num_latents", self.num_latents)
    num_layers = common.check_size("num_latent_layers", self.num_latent_layers, minimum=0)
    latents = self.param("latents", nn.initializers.truncated_normal(0.02),
                         (num_latents, x.shape[-1]), self.param_dtype)
    process = [self._block(f"latent_{i}", deterministic, pre_norm=True) for i in range(num_layers)]
    return latent_bottleneck_attention(
        x, latents, self._block("encode", deterministic, pre_norm=True),
        self._block("decode", deterministic, pre_norm=True, query_residual=False),
        context=context, process=process, inputs_valid=inputs_valid, query_valid=query_valid)


_LATENT = dict(fn=latent_bottleneck_attention, family="memory", subquadratic=True, exact=False,
               causal=False, cross=True, qkv=False)
_MLP_RATIO = dict(mlp_ratio="feed-forward width of each inner block, times the features")
registry.register(registry.VariantSpec(
    name="inducing_points", complexity="O(T m)", paper="Lee et al. 2019",
    mixer=InducingPointAttention,
    options=dict(num_inducing_points="m learned inducing points", **_MLP_RATIO), **_LATENT))
registry.register(registry.VariantSpec(
    name="perceiver", complexity="O(T M)", paper="Jaegle et al. 2021", mixer=Perceiver,
    options=dict(num_latents="M learned latent vectors",
                 num_latent_layers="L latent self-attention blocks", **_MLP_RATIO), **_LATENT))
