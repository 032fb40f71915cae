"""Multi-head attention as a Flax token mixer around any registered Q/K/V variant."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Mapping, Optional, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.core import FrozenDict

from attention_jax import axes, positional, registry
from attention_jax.flex import normalised_qk
from attention_jax.core.masks import and_masks, make_attention_mask
from attention_jax.variants import dense
from attention_jax.variants.common import check_cache_room, check_size, mixer_output

Array = jnp.ndarray
Dtype = Any

# Logical axis names; the trainer's rules map them to mesh axes.
EMBED, HEADS, KV = axes.EMBED, axes.HEADS, axes.KV
ACTIVATION_AXES = (axes.ACTIVATION_BATCH, axes.ACTIVATION_LENGTH, axes.ACTIVATION_HEADS,
                   axes.ACTIVATION_KV)

_PROJECTIONS = ("query", "key")
OUTPUT_GATES = (None, "headwise", "elementwise")
# The layer stack's carry entries of value residual learning.
FIRST_VALUES, HAS_FIRST_VALUES = "first_values", "has_first_values"
VALUE_RESIDUAL_KEYS = (FIRST_VALUES, HAS_FIRST_VALUES)


def unused_projections(spec: "registry.VariantSpec", options: Mapping[str, Any]) -> frozenset:
  """The input projections ("query", "key") variant `spec` with `options`
  does not read, which `MultiHeadAttention` therefore neither creates nor
  computes: what the variant's `extras` module declares as
  `unused_projections(options)` (the Synthesizers: no key, and no query for
  the random ones, unless the dot-product logits are mixed in; LSH: no key,
  its keys are the normalised queries). Values are always projected."""
  declared = getattr(spec.extras, "unused_projections", None) if spec.extras else None
  unused = frozenset(declared(options)) if declared is not None else frozenset()
  unknown = unused - set(_PROJECTIONS)
  if unknown:
    raise ValueError(f"attention variant {spec.name!r} declares unused projections "
                     f"{sorted(unknown)}; only {_PROJECTIONS} can be left out.")
  return unused


def key_value_sets(spec: "registry.VariantSpec", options: Mapping[str, Any]) -> int:
  """How many sets of keys and values variant `spec` with `options` reads per
  K/V group: what its extras module declares as `key_value_sets(options)`
  (NSA: one per branch), 1 otherwise. `MultiHeadAttention` projects, rotates
  and caches `sets * Hkv` key and value heads, head `sets * g + i` set i of
  group g, so that sharding the heads keeps a group's sets together."""
  declared = getattr(spec.extras, "key_value_sets", None) if spec.extras else None
  sets = 1 if declared is None else declared(options)
  if not isinstance(sets, int) or isinstance(sets, bool) or sets < 1:
    raise ValueError(f"attention variant {spec.name!r} declares {sets!r} key/value sets; "
                     f"expected an int >= 1.")
  return sets


def attention_weights(attend: Callable[[Array], Array], value: Array) -> Array:
  """The weights `[B, H, Tq, Tk]` that `attend(value) -> [B, Tq, H, Dv]` applies
  to the values: `attend` of one-hot values, whose output row j is the weight
  of key j. Exact for every registered variant (each is linear in its values,
  whatever it does to the queries and keys); it costs a pass with Dv = Tk.
  """
  batch, kv_len, kv_heads = value.shape[:3]
  one_hot = jnp.broadcast_to(jnp.eye(kv_len, dtype=value.dtype)[None, :, None, :],
                             (batch, kv_len, kv_heads, kv_len))
  return jnp.swapaxes(attend(one_hot), 1, 2)


class MultiHeadAttention(nn.Module):
  """Q/K/V projections, head layout, position handling and KV cache; the
  attention itself is the pure function of the registered variant `attention`.

  Attributes:
    num_heads: query heads H.
    num_kv_heads: key/value heads Hkv (H for MHA, 1 for MQA, a divisor of H for
      GQA); defaults to `num_heads`.
    head_dim: per-head size D; defaults to `qkv_features // num_heads`. Setting it
      independently of `num_heads` gives the fixed-head-size layer.
    qkv_features: H * D when `head_dim` is None; defaults to the input features.
    out_features: output features; defaults to the input features.
    dropout_rate: dropout on the attention weights.
    use_bias: biases in the projections.
    dtype, param_dtype: computation and parameter dtypes.
    kernel_init, bias_init: initialisers of the projections.
    attention: registered Q/K/V variant whose pure function computes the attention.
    attention_options: extra keyword arguments of that function
      (e.g. `{"implementation": "xla"}`, `{"local_window_size": 64}`).
    position: relative position scheme applied here: None, "rope", "xpos",
      "alibi", "t5", "xl_relative" or "shaw" (absolute embeddings belong to
      the model's input layer).
    position_options: options of the scheme (for "rope" and "xpos" the fields
      of `positional.Rotary`: `max_wavelength`, `scaling` ("linear", "ntk",
      "yarn"), `scaling_factor`, `original_length`, `rotary_fraction`, and
      xPos's `scale_base`; `max_wavelength` for xl_relative; `num_buckets`,
      `max_distance` for T5).
    decode: autoregressive decoding with a KV cache in the `cache` collection.
      Initialise with a full-length input to size the cache, then call with one
      (or a few) tokens at a time. A variant whose function takes a
      `recurrent_state` (linear attention) keeps that state instead, of a
      size independent of the length.
    output_gate: gated attention (Qiu et al. 2025): the attention output is
      multiplied by sigmoid(x W_g + b_g) before the output projection, one
      gate per feature ("elementwise", W_g `[E, H, Dv]`, the paper's best
      form) or per head ("headwise", `[E, H]`); None: no gate.
    value_residual: value residual learning (Zhou et al. 2024, ResFormer):
      in self-attention every layer's values become (1 - w) V_n + w V_1,
      V_1 the first layer's values, handed on in the layer stack's carry
      (`VALUE_RESIDUAL_KEYS`); w = value_residual, None: off. The first
      layer to run one (the carry has no V_1 yet) puts its values there.
    streaming: `(sinks, window)`, StreamingLLM's attention (Xiao et al.
      2024) in causal self-attention: each query sees the first `sinks`
      tokens and the last `window` (itself included). The full pass applies
      it as a mask; decoding keeps a cache of `sinks + window` slots whatever
      the length generated (the sinks, then a ring of the latest tokens),
      each key rotated at its position in the text, so generation equals the
      full pass under the same mask.
  """

  num_heads: int
  num_kv_heads: Optional[int] = None
  head_dim: Optional[int] = None
  qkv_features: Optional[int] = None
  out_features: Optional[int] = None
  dropout_rate: float = 0.0
  use_bias: bool = True
  dtype: Optional[Dtype] = None
  param_dtype: Dtype = jnp.float32
  kernel_init: Callable[..., Array] = nn.initializers.lecun_normal()
  bias_init: Callable[..., Array] = nn.initializers.zeros_init()
  attention: str = "dot_product"
  attention_options: Mapping[str, Any] = FrozenDict()
  position: Optional[str] = None
  position_options: Mapping[str, Any] = FrozenDict()
  decode: bool = False
  output_gate: Optional[str] = None
  value_residual: Optional[float] = None
  streaming: Optional[Tuple[int, int]] = None

  def _dims(self, in_features: int):
    num_kv_heads = self.num_kv_heads or self.num_heads
    if self.num_heads % num_kv_heads:
      raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                       f"({num_kv_heads}).")
    qkv_features = self.qkv_features or in_features
    if self.head_dim is not None:
      head_dim = check_size("head_dim", self.head_dim)
    elif qkv_features % self.num_heads:
      raise ValueError(f"qkv_features ({qkv_features}) must be divisible by num_heads "
                       f"({self.num_heads}), or set head_dim.")
    else:
      head_dim = qkv_features // self.num_heads
    if self.output_gate not in OUTPUT_GATES:
      raise ValueError(f"output_gate must be one of {OUTPUT_GATES}, got {self.output_gate!r}.")
    check_streaming(self.streaming, "streaming")
    if self.value_residual is not None and not 0.0 <= self.value_residual <= 1.0:
      raise ValueError(f"value_residual is the first layer's weight w in (1 - w) V_n + w V_1, "
                       f"in [0, 1]; got {self.value_residual!r}.")
    if self.position is not None and self.position not in positional.RELATIVE_POSITIONS:
      raise ValueError(f"position must be None or one of {positional.RELATIVE_POSITIONS}, "
                       f"got {self.position!r}.")
    return num_kv_heads, head_dim

  def _projection(self, name: str, heads: int, head_dim: int) -> "HeadProjection":
    return HeadProjection(
        kernel_axes=(EMBED, HEADS, KV), split_output=(heads, head_dim),
        use_bias=self.use_bias, dtype=self.dtype, param_dtype=self.param_dtype,
        kernel_init=self.kernel_init, bias_init=self.bias_init, name=name)

  @nn.compact
  def __call__(
      self,
      x: Array,
      context: Optional[Array] = None,
      *,
      mask: Optional[Array] = None,
      bias: Optional[Array] = None,
      is_causal: bool = False,
      query_seq_lengths: Optional[Array] = None,
      key_value_seq_lengths: Optional[Array] = None,
      segment_ids: Optional[Array] = None,
      positions: Optional[Array] = None,
      deterministic: bool = True,
      carry: Optional[Mapping[str, Any]] = None,
      attention_arguments: Optional[Mapping[str, Any]] = None,
  ):
    """Attends from `x` to `context` (self-attention when `context` is None).

    Args:
      x: `[B, Tq, E]` queries' inputs.
      context: `[B, Tk, Ec]` keys' and values' inputs, or None.
      mask: boolean, broadcastable to `[B, H, Tq, Tk]`; True may attend.
      bias: additive logits bias broadcastable to `[B, H, Tq, Tk]`.
      is_causal: causal self-attention (implied when decoding).
      query_seq_lengths, key_value_seq_lengths: `[B]` valid lengths (padding).
      segment_ids: `[B, T]` packed-sequence ids (self-attention).
      positions: `[B, Tq]` or `[Tq]` token positions for relative schemes, e.g.
        restarting at each packed segment; `arange(T)` by default. Not taken
        with `decode=True`, which places new tokens after the cached ones.
        "xl_relative" reads only the first position of each row and numbers
        the rest consecutively from it (its relative shift needs that): in-
        segment distances of packed segments restarting at 0 come out right
        (with `segment_ids` masking the pairs across segments), other gaps in
        the positions are not seen.
      deterministic: disables dropout.
      carry: what the previous layer handed on (the layer stack passes it);
        a variant that `carries` keys reads and replaces them.
      attention_arguments: arrays for this call of the variant's function, by
        the keywords it takes (the graph variant's `senders` and `receivers`
        edge lists); unlike `attention_options`, fixed when the layer is
        built, they may change with every batch. A keyword the function does
        not take, or that the layer sets itself, is refused.

    Returns:
      `[B, Tq, out_features]`, or `(that, carry)` when called with a carry (the
      mixer contract, docs/ARCHITECTURE.md).
    """
    spec = registry.get_variant(self.attention)
    if not spec.qkv:
      raise ValueError(f"attention={self.attention!r} is not Q/K/V attention; build it with "
                       f"registry.get_variant({self.attention!r}).module instead.")
    num_kv_heads, head_dim = self._dims(x.shape[-1])
    if self.decode and context is not None:
      raise ValueError("decode=True caches self-attention keys; got a context for cross-attention.")
    if self.decode and positions is not None:
      # The cached keys sit at their cache slots (rotated, biased and placed
      # there), so a new token's only consistent position is its slot: other
      # positions would shift every relative scheme and misplace the
      # variants that choose key blocks by index (MoBA, NSA).
      raise ValueError("decode=True places the new tokens after those already cached "
                       "(positions arange(Tq) + the cache's count), so it takes no positions; "
                       f"got positions of shape {jnp.shape(positions)}.")
    kv_input = x if context is None else context
    unused = unused_projections(spec, self.attention_options)
    kv_heads = num_kv_heads * key_value_sets(spec, self.attention_options)

    # A projection the variant does not read is neither created nor computed:
    # the variant gets a shape-only stand-in (`jax.ShapeDtypeStruct`), which
    # gives Tq, Tk and the heads and fails loudly if its contents are used.
    projected_dtype = self.dtype or jnp.promote_types(x.dtype, self.param_dtype)
    query = (jax.ShapeDtypeStruct(x.shape[:2] + (self.num_heads, head_dim), projected_dtype)
             if "query" in unused else self._projection("query", self.num_heads, head_dim)(x))
    key = (jax.ShapeDtypeStruct(kv_input.shape[:2] + (kv_heads, head_dim), projected_dtype)
           if "key" in unused else self._projection("key", kv_heads, head_dim)(kv_input))
    value = self._projection("value", kv_heads, head_dim)(kv_input)
    value_residual_update = {}
    if self.value_residual is not None and context is None:
      value, value_residual_update = _mix_first_values(value, carry, self.value_residual)

    q_len, kv_len = x.shape[1], kv_input.shape[1]
    q_positions = jnp.arange(q_len) if positions is None else positions
    k_positions = q_positions if context is None else jnp.arange(kv_len)
    q_offset = 0
    window_in_mask = False
    # A variant with a recurrent state (linear attention) decodes from it: the
    # cache holds the state and a position counter, not the keys and values.
    recurrent = self.decode and spec.can("recurrent_state")
    if recurrent:
      q_offset = self._count_decoded(q_len)
      q_positions = q_positions + q_offset
      k_positions = q_positions
      is_causal = True
    elif self.decode and self.streaming is not None and self.has_variable("cache",
                                                                           "cached_value"):
      key, value, k_positions, q_offset = self._streaming_cache(key, value)
      q_positions = q_positions + q_offset
      visible = streaming_visible(jnp.arange(q_len) + q_offset, k_positions, *self.streaming)
      mask = and_masks(mask, visible[None, None])
      is_causal = False
    elif self.decode and self.has_variable("cache", "cached_value"):
      key, value, q_offset = self._update_cache(key, value)
      q_positions = q_positions + q_offset
      k_positions = jnp.arange(key.shape[1])
      # Causal over absolute positions covers both the new tokens and the
      # still-empty slots of the cache. A local window compares absolute
      # positions too, so it joins this mask instead of going to the variant
      # (which would place the first new query at the first cached key).
      window = self.attention_options.get("local_window_size")
      mask = make_attention_mask(q_len, key.shape[1], is_causal=True, q_offset=q_offset,
                                 local_window_size=window, mask=mask)
      window_in_mask = window is not None
      is_causal = False
    elif self.decode:
      self._init_cache(key, value)
      is_causal = True
    if self.streaming is not None and not self.decode:
      if context is not None or not is_causal:
        raise ValueError("streaming=(sinks, window) is causal self-attention's (StreamingLLM); "
                         "call the layer with is_causal=True and no context.")
      visible = streaming_visible(jnp.arange(q_len), jnp.arange(kv_len), *self.streaming)
      mask = and_masks(mask, visible[None, None])

    # A Q/K/V variant routes no option to the layer (`make_mixer` set those).
    routed = spec.route_options(self.attention_options)
    options = routed["fn"]
    attention_fn = spec.fn
    position_score_mod = None
    rotate = None
    if self.position in positional.ROTARY_POSITIONS:
      # RoPE, its scalings, partial RoPE or xPos; a cached key is rotated at
      # its absolute position each step, so a scaling set for evaluation
      # applies to the whole cache.
      rotary = positional.Rotary.from_options(self.position_options,
                                              xpos=self.position == "xpos")
      if spec.can("rotary_width"):
        options["rotary_width"] = rotary.rotary_width(query.shape[-1])
      center = rotary.xpos_center(q_positions, k_positions)
      rotate = lambda q, k: (
          _unless_unused(q, lambda q: rotary(q, q_positions, xpos_center=center)),
          _unless_unused(k, lambda k: rotary(k, k_positions, is_key=True, xpos_center=center)))
      if options.get("qk_norm") is None:
        query, key = rotate(query, key)
        rotate = None
    elif self.position in ("alibi", "t5") and spec.can("score_mod"):
      # The flex engine applies the bias per tile: no [B, H, Tq, Tk] array.
      position_score_mod = self._position_bias(_batched(q_positions), _batched(k_positions),
                                               as_score_mod=True)
    elif self.position in ("alibi", "t5"):
      bias = _add(bias, self._position_bias(_batched(q_positions), _batched(k_positions)))
    elif self.position == "shaw":
      attention_fn = self._shaw_relative(spec, q_positions, k_positions, head_dim,
                                         value.shape[-1])
    elif self.position == "xl_relative":
      bias = _add(bias, self._xl_relative_bias(query, key, q_positions, k_positions,
                                               x.shape[-1]))

    constrain = lambda a: nn.with_logical_constraint(a, ACTIVATION_AXES)
    query, key, value = (_unless_unused(a, constrain) for a in (query, key, value))

    if window_in_mask:
      options.pop("local_window_size", None)
    if spec.extras is not None:
      options.update(self._extras(spec, routed["extras"])(
          query, key, value, deterministic=deterministic,
          **({"inputs": x} if getattr(spec.extras, "reads_layer_input", False) else {})))
    if rotate is not None:
      # QK-norm normalises queries and keys before their positions rotate
      # them (as Qwen3 and OLMo 2 do): after the rotation, RMS's learned
      # per-feature scales would mix the rotated pairs and an L2 norm would
      # divide out xPos's length scale, so the scores would depend on where
      # the sequence starts, not only on the distance.
      query, key = rotate(*normalised_qk(query, key, options.pop("qk_norm"),
                                         options.pop("qk_norm_scales", None)))
    if self.dropout_rate > 0.0 and not deterministic:
      if not spec.can("dropout"):
        raise ValueError(f"attention variant {self.attention!r} has no attention weights to drop; "
                         f"got dropout_rate={self.dropout_rate}: set it to 0 for this variant.")
      options.update(dropout_rate=self.dropout_rate, dropout_rng=self.make_rng("dropout"))
    if spec.carries:
      options["carry"] = {k: carry[k] for k in spec.carries if carry and k in carry}
    if spec.can("query_positions"):
      # Variants that place each query (Luong's local-m) see its position,
      # offset while decoding.
      options["query_positions"] = q_positions
    if spec.can("aux_losses"):
      # Variants with auxiliary losses (disagreement regularisers) hand them
      # back through this callback; the trainer adds the "losses" collection
      # to the loss (`train.steps.sown_losses`).
      options["sow_loss"] = lambda name, loss: self.sow("losses", name, loss)
    if position_score_mod is not None:
      options["score_mod"] = position_score_mod
    if spec.can("decoding"):
      options["decoding"] = self.decode
    if attention_arguments:
      options.update(_call_arguments(spec, attention_arguments, options))
    if recurrent:
      has_state = self.has_variable("cache", "recurrent_state")
      options["recurrent_state"] = (self.get_variable("cache", "recurrent_state") if has_state
                                    else {})
    attend = functools.partial(attention_fn, query, key, bias=bias, mask=mask, is_causal=is_causal,
                               query_seq_lengths=query_seq_lengths,
                               key_value_seq_lengths=key_value_seq_lengths,
                               segment_ids=segment_ids, **options)
    out = attend(value)
    if recurrent:
      out, state = out
      if has_state:
        self.put_variable("cache", "recurrent_state", state)
      else:  # initialisation: the state of no token yet
        self.variable("cache", "recurrent_state", jax.tree.map, jnp.zeros_like, state)
    elif self.is_mutable_collection("intermediates") and not spec.carries:
      # The weights' extra pass must not sow the auxiliary losses a second time.
      weights_of = (functools.partial(attend, sow_loss=None) if "sow_loss" in options
                    else attend)
      self.sow("intermediates", "attention_weights", attention_weights(weights_of, value))
    if spec.carries:
      out, updates = out
      carry = None if carry is None else {**carry, **updates}
    if value_residual_update and carry is not None:
      carry = {**carry, **value_residual_update}
    if self.output_gate is not None:
      out = out * self._output_gate(x, out.shape[-1])
    out = nn.with_logical_constraint(out, ACTIVATION_AXES)

    y = HeadProjection(
        kernel_axes=(HEADS, KV, EMBED), split_output=(self.out_features or x.shape[-1],),
        merge_input=2, use_bias=self.use_bias, dtype=self.dtype,
        param_dtype=self.param_dtype, kernel_init=self.kernel_init, bias_init=self.bias_init,
        name="out")(out)
    return mixer_output(y, carry)

  def _extras(self, spec: registry.VariantSpec, options: Mapping[str, Any]):
    """The variant's extras module, which declares what it needs from the layer:
    the layer input when it `reads_layer_input` (FoX's forget gates), and the
    decoding flag when it has a `decode` field (it then keeps cache entries of
    its own)."""
    if "decode" in {field.name for field in dataclasses.fields(spec.extras)}:
      options = {**options, "decode": self.decode}
    return spec.extras(**options, name="variant")

  def _output_gate(self, x: Array, value_dim: int) -> Array:
    """sigmoid(x W_g + b_g): `[B, Tq, H, Dv]` ("elementwise") or `[B, Tq, H, 1]`."""
    features = value_dim if self.output_gate == "elementwise" else 1
    logits = self._projection("output_gate", self.num_heads, features)(x)
    return jax.nn.sigmoid(logits.astype(jnp.float32)).astype(logits.dtype)

  def _position_bias(self, q_positions: Array, k_positions: Array, as_score_mod: bool = False):
    """ALiBi or T5 bias, `[B|1, H, Tq, Tk]`, or (`as_score_mod`) the same as a
    flex score_mod, for a variant whose function takes one."""
    if self.position == "alibi":
      if as_score_mod:
        return positional.alibi_score_mod(self.num_heads, q_positions, k_positions)
      return positional.alibi_bias(self.num_heads, q_positions, k_positions)
    return positional.T5RelativePositionBias(
        num_heads=self.num_heads, name="relative_position_bias",
        **dict(self.position_options))(q_positions, k_positions, as_score_mod=as_score_mod)

  def _shaw_relative(self, spec: registry.VariantSpec, q_positions: Array, k_positions: Array,
                     head_dim: int, value_dim: int) -> Callable[..., Array]:
    """dot-product attention with Shaw et al.'s relative embeddings in its keys and values."""
    if spec.name != "dot_product":
      raise ValueError(f"position='shaw' adds embeddings to the values weighted by the "
                       f"attention weights, which only dot_product attention computes here; "
                       f"got attention={self.attention!r}. Use another position scheme.")
    embeddings = positional.ShawRelativeEmbeddings(param_dtype=self.param_dtype,
                                                   name="relative_position",
                                                   **dict(self.position_options))
    key_embeddings, value_embeddings = embeddings(head_dim, value_dim)
    index = positional.shaw_relative_index(_batched(q_positions), _batched(k_positions),
                                           embeddings.max_distance)
    return functools.partial(dense.shaw_relative_attention, key_embeddings=key_embeddings,
                             value_embeddings=value_embeddings, relative_index=index)

  def _xl_relative_bias(self, query: Array, key: Array, q_positions: Array,
                        k_positions: Array, features: int) -> Array:
    """Transformer-XL's relative terms, scaled as the variant scales q . k
    (its `scale` option, 1/sqrt(D) by default): `[B, H, Tq, Tk]`."""
    if _is_unused(query) or _is_unused(key):
      raise ValueError(f"position='xl_relative' scores the projected queries and keys, which "
                       f"attention variant {self.attention!r} does not compute; use another "
                       f"position scheme for it.")
    sets = key_value_sets(registry.get_variant(self.attention), self.attention_options)
    if sets > 1:
      raise ValueError(f"position='xl_relative' scores one set of keys per K/V group, and "
                       f"attention variant {self.attention!r} reads {sets} (one per branch); "
                       f"use another position scheme for it.")
    head_dim = query.shape[-1]
    key = jnp.repeat(key, self.num_heads // key.shape[2], axis=2)
    options = dict(self.position_options)
    relative = positional.XLRelativePosition(
        num_heads=self.num_heads, head_dim=head_dim, param_dtype=self.param_dtype,
        name="relative_position", **options)(query, key, q_positions, k_positions, features)
    scale = self.attention_options.get("scale")
    return relative * (1.0 / math.sqrt(head_dim) if scale is None else scale)

  def _count_decoded(self, new_len: int) -> Array:
    """Position of the first of `new_len` tokens decoded from a recurrent
    state; the counter advances past them (not at initialisation)."""
    initialised = self.has_variable("cache", "cache_index")
    index = self.variable("cache", "cache_index", lambda: jnp.array(0, jnp.int32))
    start = index.value
    if initialised:
      index.value = start + new_len
    return start

  def _init_cache(self, key: Array, value: Array) -> None:
    """Sizes the cache from the full-length input seen at initialisation (no
    key cache when the variant reads no key: `key` is then a stand-in)."""
    slots = key.shape[1] if self.streaming is None else sum(self.streaming)
    if not _is_unused(key):
      self.variable("cache", "cached_key", jnp.zeros, (key.shape[0], slots) + key.shape[2:],
                    key.dtype)
    self.variable("cache", "cached_value", jnp.zeros, (value.shape[0], slots) + value.shape[2:],
                  value.dtype)
    self.variable("cache", "cache_index", lambda: jnp.array(0, jnp.int32))
    if self.streaming is not None:  # the text position of each slot's token
      self.variable("cache", "slot_positions", jnp.zeros, (slots,), jnp.int32)

  def _streaming_cache(self, key: Array, value: Array):
    """StreamingLLM's step: the new tokens attend to the cached slots and to
    themselves, then are written in: token p to slot p while p < sinks, else
    to slot sinks + (p - sinks) % window, overwriting the oldest of the window.

    Returns `(keys [B, S + W + n, Hkv, D], values, their text positions
    [S + W + n] (unwritten slots at -1), position of the first new token)`.
    """
    sinks, window = self.streaming
    cached_value = self.variable("cache", "cached_value")
    slot_positions = self.variable("cache", "slot_positions")
    cache_index = self.variable("cache", "cache_index")
    index, new_len = cache_index.value, value.shape[1]
    slots = jnp.arange(sinks + window)
    written = jnp.where(slots < sinks, slots < index, slots - sinks < index - sinks)
    positions = jnp.concatenate([jnp.where(written, slot_positions.value, -1),
                                 index + jnp.arange(new_len)])
    has_key = not _is_unused(key)
    cached_key = self.variable("cache", "cached_key") if has_key else None
    keys = (jnp.concatenate([cached_key.value, key], axis=1) if has_key
            else jax.ShapeDtypeStruct((key.shape[0], sinks + window + new_len) + key.shape[2:],
                                      key.dtype))
    values = jnp.concatenate([cached_value.value, value], axis=1)

    def write(i, state):
      stored_key, stored_value, stored_positions = state
      position = index + i
      slot = jnp.where(position < sinks, position, sinks + (position - sinks) % window)
      at = (0, slot, 0, 0)
      if has_key:
        stored_key = jax.lax.dynamic_update_slice(
            stored_key, jax.lax.dynamic_slice_in_dim(key, i, 1, axis=1), at)
      stored_value = jax.lax.dynamic_update_slice(
          stored_value, jax.lax.dynamic_slice_in_dim(value, i, 1, axis=1), at)
      return stored_key, stored_value, stored_positions.at[slot].set(position)

    stored = jax.lax.fori_loop(0, new_len, write, (
        cached_key.value if has_key else None, cached_value.value, slot_positions.value))
    if has_key:
      cached_key.value = stored[0]
    cached_value.value, slot_positions.value = stored[1], stored[2]
    cache_index.value = index + new_len
    return keys, values, positions, index

  def _update_cache(self, key: Array, value: Array):
    """Writes the new tokens' K/V at the cache index; returns the whole cache.

    key, value: `[B, Tnew, Hkv, D]`. Returns `(cached_key [B, L, Hkv, D],
    cached_value, index of the first new token)`; the key is a stand-in of
    that shape when the variant reads no key.
    """
    cached_value = self.variable("cache", "cached_value")
    cache_index = self.variable("cache", "cache_index")
    max_len, new_len = cached_value.value.shape[1], value.shape[1]
    if new_len > max_len:
      raise ValueError(f"decoding {new_len} tokens at once exceeds the cache length {max_len}.")
    index = cache_index.value
    check_cache_room(index, new_len, max_len)
    start = (0, index, 0, 0)
    if _is_unused(key):
      cached = jax.ShapeDtypeStruct((key.shape[0], max_len) + key.shape[2:], key.dtype)
    else:
      cached_key = self.variable("cache", "cached_key")
      cached_key.value = jax.lax.dynamic_update_slice(cached_key.value, key, start)
      cached = cached_key.value
    cached_value.value = jax.lax.dynamic_update_slice(cached_value.value, value, start)
    cache_index.value = index + new_len
    return cached, cached_value.value, index


def check_streaming(streaming, name: str) -> None:
  """`(sinks >= 0, window >= 1)` or None; a ValueError naming `name` otherwise."""
  if streaming is None:
    return
  if (not isinstance(streaming, (tuple, list)) or len(streaming) != 2
      or any(not isinstance(n, int) or isinstance(n, bool) for n in streaming)
      or streaming[0] < 0 or streaming[1] < 1):
    raise ValueError(f"{name} must be (sinks, window): the first sinks >= 0 tokens and the last "
                     f"window >= 1 stay visible; got {streaming!r}.")


def streaming_visible(q_positions: Array, k_positions: Array, sinks: int, window: int) -> Array:
  """`[Tq, Tk]`: key at text position k is visible from position q when it is
  not later, and is a sink (k < sinks) or within the window (q - k < window);
  a negative key position is an unwritten cache slot."""
  q, k = q_positions[:, None], k_positions[None, :]
  return (k >= 0) & (k <= q) & ((k < sinks) | (q - k < window))


def _mix_first_values(value: Array, carry: Optional[Mapping[str, Any]], weight: float):
  """ResFormer's (1 - w) V_n + w V_1 for `value` `[B, T, Hkv, Dv]`, and the
  carry update: V_1 is `carry["first_values"]` when `carry["has_first_values"]`,
  else these values are V_1 (they are then returned unchanged and put in the
  carry). A call without a carry is a first layer."""
  carry = {} if carry is None else carry
  first = carry.get(FIRST_VALUES)
  if first is None:
    return value, {FIRST_VALUES: value, HAS_FIRST_VALUES: jnp.ones((), bool)}
  if tuple(first.shape) != tuple(value.shape):
    raise ValueError(f"value_residual mixes the first layer's values {list(first.shape)} into "
                     f"this layer's {list(value.shape)}; every layer with it needs the same "
                     f"[B, T, Hkv, Dv] (the same heads and head size).")
  has_first = carry[HAS_FIRST_VALUES]
  mixed = (1.0 - weight) * value + weight * first.astype(value.dtype)
  return (jnp.where(has_first, mixed, value),
          {FIRST_VALUES: jnp.where(has_first, first, value.astype(first.dtype)),
           HAS_FIRST_VALUES: jnp.ones((), bool)})


def initial_value_residual_carry(batch: int, length: int, num_kv_heads: int, value_dim: int,
                                 dtype) -> dict:
  """The carry's value-residual entries before the first layer: no V_1 yet
  (a scanned stack needs the entries, and their shapes, from the start)."""
  return {FIRST_VALUES: jnp.zeros((batch, length, num_kv_heads, value_dim), dtype),
          HAS_FIRST_VALUES: jnp.zeros((), bool)}


class HeadProjection(nn.Module):
  """`nn.DenseGeneral` into or out of the head layout, with logically named parameters.

  Into heads: `[..., E] -> [..., H, D]` with kernel `[E, H, D]` (`split_output=(H, D)`);
  out of heads: `[..., H, D] -> [..., O]` with kernel `[H, D, O]` (`merge_input=2`).
  The kernel is initialised as DenseGeneral does (as the flat matrix
  `[fan_in, fan_out]`, then reshaped), and the logical names are attached after
  the reshape: DenseGeneral attaches them to the flat matrix, whose rank does not
  match them, which fails as soon as a mesh is active (flax issue #3676).
  Parameter names and shapes are DenseGeneral's, so weights interchange with
  `flax.linen.MultiHeadDotProductAttention`.
  """

  kernel_axes: Tuple[str, ...]
  split_output: Tuple[int, ...]
  merge_input: int = 1
  use_bias: bool = True
  dtype: Optional[Dtype] = None
  param_dtype: Dtype = jnp.float32
  kernel_init: Callable[..., Array] = nn.initializers.lecun_normal()
  bias_init: Callable[..., Array] = nn.initializers.zeros_init()

  @nn.compact
  def __call__(self, x: Array) -> Array:
    in_shape = x.shape[-self.merge_input:]
    kernel_shape = in_shape + tuple(self.split_output)

    def init_kernel(rng, shape, dtype):
      flat = self.kernel_init(rng, (math.prod(in_shape), math.prod(self.split_output)), dtype)
      return flat.reshape(shape)

    kernel = self.param("kernel", nn.with_logical_partitioning(init_kernel, self.kernel_axes),
                        kernel_shape, self.param_dtype)
    bias = None
    if self.use_bias:
      out_axes = self.kernel_axes[self.merge_input:]
      bias = self.param("bias", nn.with_logical_partitioning(self.bias_init, out_axes),
                        tuple(self.split_output), self.param_dtype)
    x, kernel, bias = nn.dtypes.promote_dtype(x, kernel, bias, dtype=self.dtype)
    contract = tuple(range(x.ndim - self.merge_input, x.ndim))
    y = jax.lax.dot_general(x, kernel, ((contract, tuple(range(self.merge_input))), ((), ())))
    return y if bias is None else y + bias


def _call_arguments(spec: "registry.VariantSpec", arguments: Mapping[str, Any],
                    options: Mapping[str, Any]) -> dict:
  """`attention_arguments`, checked: each a keyword of `spec.fn` that neither
  the layer nor the options (or the variant's extras) already give."""
  for name in arguments:
    if name in options:
      raise ValueError(f"attention_arguments sets {name!r}, which attention_options or the "
                       f"variant's own arrays already set for {spec.name!r}.")
    if name not in spec.call_arguments:
      raise ValueError(f"attention variant {spec.name!r} takes no attention argument {name!r}; "
                       f"its function takes: {', '.join(spec.call_arguments) or 'none'} (masks, "
                       f"dropout and the carry are the layer's own arguments).")
  return dict(arguments)


def _is_unused(x) -> bool:
  """True for the shape-only stand-in of a projection the variant does not read."""
  return isinstance(x, jax.ShapeDtypeStruct)


def _unless_unused(x, fn: Callable[[Array], Array]):
  return x if _is_unused(x) else fn(x)


def _batched(positions: Array) -> Array:
  return positions if positions.ndim == 2 else positions[None]


def _add(a: Optional[Array], b: Array) -> Array:
  return b if a is None else a + b
