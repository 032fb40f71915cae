"""The model config: one frozen dataclass, checked when made, passed whole.

  model_config = ModelConfig.from_config(config.model)   # what `build_model` does
  SequenceClassifier(model_config)

Every model-level module (the classifiers, the encoder, the layer stack and its
blocks) takes this one object instead of a dozen keyword fields, as flax's
lm1b `TransformerConfig` does. A new field is added here, with its default and
its check, and nowhere else: `default_model_config()` (the ml_collections form
that experiment configs and `--config.model.<key>=` overrides edit) is
generated from the fields.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from typing import Any, Mapping, Optional, Tuple

import jax
import jax.numpy as jnp
import ml_collections
from flax.core import FrozenDict

from attention_jax import positional, registry
# Its functions by name: `attention_options` is also a field of ModelConfig.
from attention_jax.attention_options import (check_options, explicit_options, options_config,
                                             options_of, without_defaults)
from attention_jax.layers import ACTIVATIONS, FEED_FORWARD_LAYERS, NORMS, feed_forward_options

if typing.TYPE_CHECKING:
  from attention_jax.models.kinds import ModelKind

RNN_CELLS = ("gru", "lstm")
POOLINGS = ("cls", "mean", "max", "attention")
# What a dual classifier's head sees of the pooled pair u, v: the LRA matching
# model's [u, v, u * v, u - v], or Sentence-BERT's [u, v, |u - v|] (Reimers &
# Gurevych 2019).
PAIR_FEATURES = ("lra", "sentence_bert")
# The registered pooling module (role "pooling") of each pooling that has one;
# `pooling_options` are its declared options.
POOLING_VARIANTS = {"attention": "attention_pooling"}
# How a block combines a sub-layer f with its input: pre-LN (Xiong et al. 2020),
# x + f(norm(x)); post-LN (Vaswani et al. 2017), norm(x + f(x)).
RESIDUALS = ("pre_norm", "post_norm")
FEED_FORWARDS = tuple(FEED_FORWARD_LAYERS)
# Rematerialisation of each block in the backward pass: what the forward keeps.
# How the layers are stacked (docs/ARCHITECTURE.md, "Layer stacks"): "standard",
# `num_layers` blocks in sequence; "reversible", Reformer's reversible residual
# layers (Kitaev et al. 2020), activations recomputed in the backward pass;
# "universal", one block applied `num_layers` times with ACT halting
# (Dehghani et al. 2019).
STACKS = ("standard", "reversible", "universal")
REMAT_POLICIES = {
    "none": None,  # no remat: every activation is kept
    "full": jax.checkpoint_policies.nothing_saveable,  # only the blocks' inputs
    "dots": jax.checkpoint_policies.checkpoint_dots,  # matmul outputs too
    "dots_with_no_batch_dims": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """What a model is built from; every field is checked when it is made.

  Attributes:
    kind: a model kind of `kinds.KINDS` (what is built, and which of the
      fields below it reads).
    vocab_size: number of token ids.
    num_classes: labels of a classifier.
    num_layers: blocks in the stack.
    embed_dim: model width E.
    num_heads: attention heads H.
    num_kv_heads: key/value heads (grouped-query attention); None: the
      variant's own default (all heads, or 1 for multi_query).
    qkv_dim: the width of the queries, keys and values over all heads (H * D);
      None: embed_dim. The LRA release's Pathfinder models are 32 wide with
      qkv_dim 16.
    mlp_dim: feed-forward hidden size F.
    max_length: longest token sequence (the learned position table's size).
    attention: the registered variant of every block's mixer.
    attention_options: its declared options (`registry.variant_options`).
    layer_attention: a per-layer schedule of variant names, repeated to
      `num_layers` (e.g. ("local", "local", "local", "dot_product")); empty:
      every layer uses `attention`. Options go to every scheduled variant
      that declares them.
    position: one of `positional.POSITION_ENCODINGS`; "sinusoidal" and "learned"
      are added to the embeddings, "complex" replaces them (Wang et al.
      2020), "rope", "xpos", "alibi", "t5", "xl_relative" and "shaw" act in every mixer;
      "none" (NoPE, Kazemnejad et al. 2023) only in a language model.
    position_options: options of the position scheme.
    residual: one of `RESIDUALS`.
    norm: one of `NORMS`: "layernorm", "rmsnorm", "scalenorm", "powernorm"
      (batch statistics in the "batch_stats" collection), "adanorm".
    feed_forward: one of `FEED_FORWARDS`: "mlp" (`FeedForward`, chunked with
      the option `chunk_size`), "moe" (`MixtureOfExperts`), "product_key"
      (`ProductKeyMemory`).
    feed_forward_options: the options of that layer
      (`layers.feed_forward_options(kind)`), e.g. `num_experts`, `top_k`.
    activation: the feed-forward activation, one of `ACTIVATIONS` (the gated
      units "glu", "bilinear", "reglu", "geglu", "swiglu" among them).
    pooling: how a classifier pools the encoder's outputs, one of `POOLINGS`:
      "cls" reads a prepended [CLS] token, "mean" and "max" reduce over the
      real tokens, "attention" is `AttentionPooling` (learned queries; HAN's
      two levels with `pooling_options.sentence_length`).
    pooling_options: the declared options of the pooling's registered module
      (`POOLING_VARIANTS`; e.g. `num_queries`), set only for a pooling that
      has one.
    pair_features: a dual classifier's combination of the pooled pair, one of
      `PAIR_FEATURES`.
    head_mlp_dim: a hidden layer of this size in the classifier head; None: linear.
    dropout_rate: on embeddings, sub-layer outputs and feed-forward activations.
    attention_dropout_rate: on the attention weights.
    dtype: computation dtype ("float32", "bfloat16"); parameters stay float32.
    scan_layers: run the blocks under `nn.scan` (one compiled block, stacked
      parameters) instead of unrolled; the schedule's period is scanned.
    remat_policy: rematerialise each block in the backward pass, one of
      `REMAT_POLICIES` ("none": keep every activation).
    stack: how the layers are stacked, one of `STACKS`: "standard" (the
      blocks in sequence), "reversible" (Reformer's two-stream reversible
      layers, pre-norm; no scan, remat or carry) or "universal" (one block
      applied `num_layers` times, with ACT halting when `act_halting`).
    layer_drop_rate: LayerDrop (Fan et al. 2019), standard stack only: in
      training each block is skipped with this probability (one Bernoulli per
      block and step from the "dropout" stream); evaluation runs every block.
    act_halting: the universal stack halts each position with Adaptive
      Computation Time (Graves 2016); False: every position takes
      `num_layers` steps.
    act_threshold: a position halts at the first step where its summed
      halting probabilities reach this (1 - epsilon of Graves 2016), or at
      step `num_layers`; in (0, 1].
    ponder_cost_weight: the ponder cost (N + R, averaged over real
      positions) times this is sown into "losses"; 0: none.
    rnn_cell: the RNN encoder-decoder's cell, one of `RNN_CELLS`.
    decoder_attention: the RNN decoder attends to the encoder's annotations
      with `attention`; False: the final encoder states are its only context.
    beam_size: the RNN encoder-decoder's decoding in evaluation: 1 greedy,
      more a beam search of that many hypotheses.
    mask_rate: the masked language model's share of real tokens replaced by
      [MASK] (and scored) in each sequence, in (0, 1); BERT's is 0.15.
    cross_attention: the Transformer encoder-decoder's attention to the
      source, a variant with a cross-attention form; None: `attention`.
    transparent_attention: the Transformer decoder's layer j attends to a
      learned mix of every encoder layer's output (Bapna et al. 2018).
    decode: build the language model for incremental decoding (each mixer
      keeps its cache in the "cache" collection, absolute positions count
      from the tokens already decoded); `generation.generate` sets it.
    patch_size: the ViT's square patches are patch_size pixels a side; it
      must divide the image's side (a ViT reads max_length = side^2 pixels).
    funnel_blocks: the Funnel Transformer's blocks per stage (its
      `num_layers`); the sequence is halved between stages.
    funnel_decoder_blocks: blocks of the Funnel's upsampling decoder
      (`FunnelTransformer.token_outputs`).
    funnel_pool_queries_only: the first block of each pooled stage attends
      from the pooled queries to the unpooled keys and values (Dai et al.
      2020; needs a variant with a cross-attention form); False pools the
      whole sequence before the stage (any mixer).
    chunk_length: tokens per chunk of the hierarchical Transformer.
    output_gate: gated attention (Qiu et al. 2025) in every Q/K/V attention
      layer: "elementwise" or "headwise" sigmoid gates on the attention output
      from the layer input (`MultiHeadAttention.output_gate`); None: off.
    value_residual: value residual learning (Zhou et al. 2024) in every Q/K/V
      self-attention layer: its values become (1 - w) V_n + w V_1, V_1 the
      first layer's (`MultiHeadAttention.value_residual`); w in [0, 1], the
      paper's 0.5; None: off. Standard and universal stacks (the carry).
    streaming_attention: `(sinks, window)`: StreamingLLM (Xiao et al. 2024)
      in every Q/K/V attention layer of a language model: each token sees the
      first `sinks` tokens and the last `window`, in training as a mask and in
      decoding from a cache of sinks + window slots, whatever the length
      generated (`MultiHeadAttention.streaming`); None: off.
    sentence_layers: blocks of the hierarchical Transformer's encoder over
      the chunk vectors (the token-level encoder has `num_layers`).
  """

  kind: str = "classifier"
  vocab_size: int = 256
  num_classes: int = 2
  num_layers: int = 2
  embed_dim: int = 64
  num_heads: int = 4
  num_kv_heads: Optional[int] = None
  qkv_dim: Optional[int] = None
  mlp_dim: int = 128
  max_length: int = 512
  attention: str = "dot_product"
  attention_options: Mapping[str, Any] = FrozenDict()
  layer_attention: Tuple[str, ...] = ()
  position: str = "sinusoidal"
  position_options: Mapping[str, Any] = FrozenDict()
  residual: str = "pre_norm"
  norm: str = "layernorm"
  feed_forward: str = "mlp"
  feed_forward_options: Mapping[str, Any] = FrozenDict()
  activation: str = "gelu"
  pooling: str = "cls"
  pooling_options: Mapping[str, Any] = FrozenDict()
  pair_features: str = "lra"
  head_mlp_dim: Optional[int] = None
  dropout_rate: float = 0.1
  attention_dropout_rate: float = 0.0
  dtype: str = "float32"
  scan_layers: bool = False
  remat_policy: str = "none"
  stack: str = "standard"
  layer_drop_rate: float = 0.0
  act_halting: bool = True
  act_threshold: float = 0.99
  ponder_cost_weight: float = 0.01
  rnn_cell: str = "gru"
  decoder_attention: bool = True
  beam_size: int = 1
  mask_rate: float = 0.15
  cross_attention: Optional[str] = None
  transparent_attention: bool = False
  decode: bool = False
  # Section H's architectures (read by their kind only).
  patch_size: int = 4
  funnel_blocks: Tuple[int, ...] = (2, 2, 2)
  funnel_decoder_blocks: int = 2
  funnel_pool_queries_only: bool = True
  chunk_length: int = 64
  sentence_layers: int = 2
  output_gate: Optional[str] = None
  value_residual: Optional[float] = None
  streaming_attention: Optional[Tuple[int, int]] = None

  def __post_init__(self):
    # Every ModelConfig is checked and hashable (Flax hashes module fields),
    # however it was made: mappings frozen, lists made tuples.
    for field in dataclasses.fields(self):
      object.__setattr__(self, field.name, _frozen(getattr(self, field.name)))
    # Options left unset (None) or at their declared default are dropped:
    # configs list every option of their variant so that each can be
    # overridden from the command line, and only what differs is passed on.
    registry.get_mixer(self.attention)
    for name in self.layer_attention:
      registry.get_mixer(name)
    if self.cross_attention is not None:
      registry.get_mixer(self.cross_attention)
    object.__setattr__(self, "attention_options", FrozenDict(explicit_options(
        self.attention_options, self.attention_variants)))
    # The default config lists every pooling option (so that each can be set
    # from the command line) whatever the pooling; those left unset are dropped.
    object.__setattr__(self, "pooling_options", FrozenDict(explicit_options(
        self.pooling_options, tuple(POOLING_VARIANTS.values()))))
    if self.feed_forward in FEED_FORWARD_LAYERS:
      defaults = {k: [v] for k, v in feed_forward_options(self.feed_forward).items()}
      object.__setattr__(self, "feed_forward_options", FrozenDict(
          without_defaults(self.feed_forward_options, defaults)))
    self.check()

  @classmethod
  def from_config(cls, config: Mapping[str, Any]) -> "ModelConfig":
    """The config from a `ConfigDict` or mapping; missing keys take defaults.

    Raises:
      ValueError: on an unknown key (with the closest valid one), an unknown
        kind, variant, option, position, norm, activation, pooling, residual,
        remat policy or dtype, or sizes that do not fit together.
    """
    if isinstance(config, ml_collections.ConfigDict):
      config = config.to_dict()
    given = dict(config)
    fields = [field.name for field in dataclasses.fields(cls)]
    for key in given:
      if key not in fields:
        raise registry.unknown_name_error("model config key", key, sorted(fields))
    return cls(**given)

  @property
  def schedule(self) -> Tuple[str, ...]:
    """The variant of each layer, `num_layers` names."""
    period = self.layer_attention or (self.attention,)
    return tuple(period[i % len(period)] for i in range(self.num_layers))

  @property
  def schedule_period(self) -> Tuple[str, ...]:
    """The repeating unit of the schedule (what `scan_layers` scans)."""
    return tuple(self.layer_attention) or (self.attention,)

  @property
  def cross_variant(self) -> str:
    """The encoder-decoder's cross-attention variant."""
    return self.cross_attention or self.attention

  @property
  def attention_variants(self) -> Tuple[str, ...]:
    """Every variant the model runs (the schedule's, and the cross-attention's
    in an encoder-decoder): the ones `attention_options` may address."""
    variants = tuple(self.layer_attention) or (self.attention,)
    if self.cross_attention is not None and self.cross_attention not in variants:
      variants += (self.cross_attention,)
    return variants

  @property
  def jnp_dtype(self) -> jnp.dtype:
    return jnp.dtype(self.dtype)

  def options_for(self, variant: str) -> FrozenDict:
    """The attention options that `variant` declares."""
    return FrozenDict(options_of(variant, self.attention_options))

  def check(self) -> None:
    """Raises ValueError naming the first field that is out of range."""
    # Imported here: the table of kinds holds the model classes, which import this module.
    from attention_jax.models import kinds  # pylint: disable=g-import-not-at-top
    kind = kinds.get_kind(self.kind)
    for name in set(self.schedule_period) | {self.attention}:
      registry.get_mixer(name)
    check_options(self.attention_options, self.attention_variants)
    if kind.causal:
      for name in self.schedule_period:
        if not registry.get_variant(name).causal:
          causal = [n for n in registry.list_variants("mixer") if registry.get_variant(n).causal]
          raise ValueError(f"{kind.causal} needs causal attention; attention {name!r} has "
                           f"no causal form. Causal variants: {', '.join(causal)}.")
    if kind.bidirectional:
      for name in self.schedule_period:
        if not registry.get_variant(name).bidirectional:
          raise ValueError(f"attention {name!r} is causal only, and {kind.bidirectional} (model."
                           f"kind={self.kind!r}) attends both ways; use it in a language model.")
    positional.check_position_encoding(self.position)
    if self.position == "none" and kind.bidirectional:
      raise ValueError(f"model.position='none' (NoPE) leaves order to the causal mask, and "
                       f"{kind.bidirectional} (model.kind={self.kind!r}) attends both ways, "
                       f"where attention without positions is blind to order; choose a position "
                       f"encoding, or NoPE in a language model.")
    if self.position in positional.ROTARY_POSITIONS:
      positional.Rotary.from_options(self.position_options, xpos=self.position == "xpos")
    _one_of("residual", self.residual, RESIDUALS)
    _one_of("norm", self.norm, NORMS)
    _one_of("feed_forward", self.feed_forward, FEED_FORWARDS)
    valid = feed_forward_options(self.feed_forward)
    for key in self.feed_forward_options:
      if key not in valid:
        raise ValueError(f"model.feed_forward_options has {key!r}, which feed_forward "
                         f"{self.feed_forward!r} does not take.{registry.did_you_mean(key, valid)} "
                         f"Its options are: {', '.join(sorted(valid))}.")
    _one_of("activation", self.activation, ACTIVATIONS)
    _one_of("pooling", self.pooling, POOLINGS)
    _one_of("pair_features", self.pair_features, PAIR_FEATURES)
    if self.pooling in POOLING_VARIANTS:
      registry.check_options(POOLING_VARIANTS[self.pooling], self.pooling_options)
    elif self.pooling_options:
      raise ValueError(f"model.pooling_options {dict(self.pooling_options)} are set, but pooling "
                       f"{self.pooling!r} takes no options; only {', '.join(POOLING_VARIANTS)} "
                       f"pooling does.")
    _one_of("remat_policy", self.remat_policy, tuple(REMAT_POLICIES))
    _one_of("rnn_cell", self.rnn_cell, RNN_CELLS)
    if "cross_attention" in kind.fields and not registry.get_variant(self.cross_variant).cross:
      crossing = [n for n in registry.list_variants("mixer") if registry.get_variant(n).cross]
      raise ValueError(f"model.cross_attention {self.cross_variant!r} has no cross-attention "
                       f"form; variants with one: {', '.join(crossing)}.")
    if self.cross_attention is not None and "cross_attention" not in kind.fields:
      raise ValueError(f"model.cross_attention={self.cross_attention!r} is set, but only "
                       f"kind {_either(kinds.kinds_reading('cross_attention'))} has "
                       f"cross-attention; got kind {self.kind!r}.")
    if self.transparent_attention and "transparent_attention" not in kind.fields:
      raise ValueError(f"model.transparent_attention is set, but only kind "
                       f"{_either(kinds.kinds_reading('transparent_attention'))} has a decoder to "
                       f"attend to every encoder layer; got kind {self.kind!r}.")
    self._check_stack(kind, stacked_kinds=kinds.stacked_kinds())
    self._check_attention_layer_options()
    if "decoder_attention" in kind.fields and self.decoder_attention and not registry.get_variant(
        self.attention).cross:
      raise ValueError(f"the RNN decoder attends to the encoder (cross-attention); attention "
                       f"{self.attention!r} has no cross-attention form.")
    for name in ("vocab_size", "num_classes", "num_layers", "embed_dim", "num_heads", "mlp_dim",
                 "max_length", "beam_size"):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"model.{name} must be a positive integer, got {value!r}.")
    for name in ("dropout_rate", "attention_dropout_rate"):
      if not 0.0 <= getattr(self, name) < 1.0:
        raise ValueError(f"model.{name} must be in [0, 1), got {getattr(self, name)!r}.")
    if isinstance(self.mask_rate, bool) or not 0.0 < self.mask_rate < 1.0:
      raise ValueError(f"model.mask_rate must be in (0, 1), got {self.mask_rate!r}.")
    if self.qkv_dim is not None and (not isinstance(self.qkv_dim, int) or self.qkv_dim < 1
                                     or self.qkv_dim % self.num_heads):
      raise ValueError(f"model.qkv_dim must be a positive multiple of num_heads="
                       f"{self.num_heads} (or None for embed_dim), got {self.qkv_dim!r}.")
    if self.num_kv_heads is not None and (self.num_kv_heads < 1
                                          or self.num_heads % self.num_kv_heads):
      raise ValueError(f"model.num_kv_heads must divide num_heads={self.num_heads}, got "
                       f"{self.num_kv_heads!r}.")
    if self.scan_layers and self.num_layers % len(self.schedule_period):
      raise ValueError(f"model.scan_layers scans whole periods of layer_attention "
                       f"{tuple(self.layer_attention)}; num_layers={self.num_layers} is not a "
                       f"multiple of its {len(self.schedule_period)} entries.")
    try:
      jnp.dtype(self.dtype)
    except TypeError as e:
      raise ValueError(f"model.dtype must name a JAX dtype such as 'float32' or 'bfloat16', "
                       f"got {self.dtype!r}.") from e
    self._check_architectures(kind)

  def _check_architectures(self, kind: "ModelKind") -> None:
    """The fields of section H's architectures, each checked for the kinds
    that read it (`kind`: this config's kind)."""
    for name in ("patch_size", "chunk_length", "sentence_layers", "funnel_decoder_blocks"):
      value, low = getattr(self, name), 0 if name == "funnel_decoder_blocks" else 1
      if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"model.{name} must be an integer >= {low}, got {value!r}.")
    blocks = self.funnel_blocks
    if (not isinstance(blocks, tuple) or not blocks
        or any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in blocks)):
      raise ValueError(f"model.funnel_blocks must be a non-empty tuple of positive block counts, "
                       f"one per stage (e.g. (2, 2, 2)), got {blocks!r}.")
    if kind.encodes_vectors and self.position == "complex":
      raise ValueError(f"model.position 'complex' is a word embedding; kind {self.kind!r} "
                       f"encodes vectors (patches, chunks) with it. Use 'learned' or "
                       f"'sinusoidal'.")
    period = len(self.schedule_period)
    if "patch_size" in kind.fields:
      side = math.isqrt(self.max_length)
      if side * side != self.max_length:
        raise ValueError(f"a ViT reads a square image of max_length = side^2 pixels; "
                         f"model.max_length={self.max_length} is not a square.")
      if side % self.patch_size:
        raise ValueError(f"model.patch_size={self.patch_size} must divide the image side "
                         f"{side} (max_length={self.max_length} pixels).")
    if "funnel_blocks" in kind.fields:
      pooled_queries = self.funnel_pool_queries_only and len(blocks) > 1
      for name in self.schedule_period if pooled_queries else ():
        if not registry.get_variant(name).cross:
          raise ValueError(f"model.funnel_pool_queries_only=True attends from the pooled "
                           f"queries to the unpooled keys (cross-attention), and attention "
                           f"{name!r} has no cross-attention form; set it False to pool the "
                           f"whole sequence instead.")
      # Each stage (without its pooling block) and the decoder run as stacks of their own.
      stacks = [n - (pooled_queries and s > 0) for s, n in enumerate(blocks)]
      stacks += [self.funnel_decoder_blocks]
      if self.scan_layers and any(n % period for n in stacks):
        raise ValueError(f"model.scan_layers scans whole periods of layer_attention "
                         f"{self.schedule_period}; the Funnel's stacks of "
                         f"funnel_blocks={blocks} and funnel_decoder_blocks="
                         f"{self.funnel_decoder_blocks} have {tuple(stacks)} blocks (a pooling "
                         f"block not counted), not multiples of {period}.")
    if "chunk_length" in kind.fields:
      if self.pooling not in ("cls", "mean", "max"):
        raise ValueError(f"model.pooling of a hierarchical Transformer must be 'cls', 'mean' or "
                         f"'max' (a chunk's vector is the sentence encoder's E-wide input), got "
                         f"{self.pooling!r}.")
      if self.chunk_length > self.max_length:
        raise ValueError(f"model.chunk_length={self.chunk_length} must be at most "
                         f"max_length={self.max_length}.")
      if self.scan_layers and self.sentence_layers % period:
        raise ValueError(f"model.scan_layers scans whole periods of layer_attention "
                         f"{self.schedule_period}; model.sentence_layers="
                         f"{self.sentence_layers} is not a multiple of {period}.")

  def _check_attention_layer_options(self) -> None:
    """output_gate, value_residual and streaming_attention, which every Q/K/V
    attention layer takes."""
    # pylint: disable-next=g-import-not-at-top
    from attention_jax.layers.attention import OUTPUT_GATES, check_streaming
    check_streaming(self.streaming_attention, "model.streaming_attention")
    if self.output_gate not in OUTPUT_GATES:
      raise ValueError(f"model.output_gate must be one of {OUTPUT_GATES}, got "
                       f"{self.output_gate!r}.")
    if self.value_residual is not None and not (
        isinstance(self.value_residual, (int, float)) and 0.0 <= self.value_residual <= 1.0):
      raise ValueError(f"model.value_residual is w in (1 - w) V_n + w V_1, in [0, 1] (the "
                       f"paper's 0.5), or None; got {self.value_residual!r}.")
    set_options = [name for name in ("output_gate", "value_residual", "streaming_attention")
                   if getattr(self, name) is not None]
    if not set_options:
      return
    name = set_options[0]
    if self.streaming_attention is not None and self.kind != "language_model":
      raise ValueError(f"model.streaming_attention is causal self-attention's (StreamingLLM), "
                       f"for a language model; model.kind is {self.kind!r}.")
    for variant in self.schedule_period:
      if not registry.get_variant(variant).in_attention_layer:
        raise ValueError(f"model.{name} is an option of the Q/K/V attention layer; attention "
                         f"{variant!r} is a mixer of its own without one: leave it None.")
    if self.value_residual is not None and self.stack == "reversible":
      raise ValueError("model.value_residual hands the first layer's values on in the carry, "
                       "which the reversible stack has not: use stack='standard'.")

  def _check_stack(self, kind: "ModelKind", stacked_kinds: Tuple[str, ...]) -> None:
    """The stack and its fields; each error names the field, the value and what
    would be accepted (`kind`: this config's kind;
    `stacked_kinds`: the kinds whose stack may be chosen)."""
    _one_of("stack", self.stack, STACKS)
    if not 0.0 <= self.layer_drop_rate <= 1.0:
      raise ValueError(f"model.layer_drop_rate must be in [0, 1], got {self.layer_drop_rate!r}.")
    if not 0.0 < self.act_threshold <= 1.0:
      raise ValueError(f"model.act_threshold must be in (0, 1] (1 - epsilon of ACT), got "
                       f"{self.act_threshold!r}.")
    if not self.ponder_cost_weight >= 0.0:
      raise ValueError(f"model.ponder_cost_weight must be >= 0, got "
                       f"{self.ponder_cost_weight!r}.")
    if self.stack == "standard":
      return
    if not kind.stacked:
      raise ValueError(f"model.stack={self.stack!r} stacks the layers of the models built on the "
                       f"layer stack ({', '.join(stacked_kinds)}); model.kind={self.kind!r} has "
                       f"none: use stack='standard'.")
    if self.layer_drop_rate > 0.0:
      raise ValueError(f"model.layer_drop_rate={self.layer_drop_rate} skips blocks of the "
                       f"standard stack; model.stack={self.stack!r} takes 0.")
    if self.scan_layers:
      raise ValueError(f"model.scan_layers scans the standard stack's blocks; model.stack="
                       f"{self.stack!r} runs its own loop over the layers: set scan_layers=False.")
    if self.stack == "universal" and self.decode:
      raise ValueError("model.stack='universal' cannot decode one token at a time (its one block "
                       "would need a cache per step); decode must be False.")
    if self.stack == "universal" and len(self.schedule_period) > 1:
      raise ValueError(f"model.stack='universal' shares one block over its steps; "
                       f"model.layer_attention={tuple(self.layer_attention)} schedules several: "
                       f"leave it empty and set model.attention.")
    if self.stack != "reversible":
      return
    if self.residual != "pre_norm":
      raise ValueError(f"model.stack='reversible' computes y1 = x1 + F(norm(x2)), y2 = x2 + "
                       f"G(norm(y1)), a pre-norm arrangement; model.residual={self.residual!r} "
                       f"must be 'pre_norm'.")
    if self.norm == "powernorm":
      # The layers run as pure functions of their parameters (the backward
      # recomputes them), so no running statistic could be updated or kept.
      raise ValueError("model.stack='reversible' re-runs each layer from its parameters alone; "
                       "model.norm='powernorm' keeps a running statistic in 'batch_stats': use "
                       "another norm or stack='standard'.")
    if self.remat_policy != "none":
      raise ValueError(f"model.stack='reversible' already recomputes every layer in the backward "
                       f"pass; model.remat_policy={self.remat_policy!r} must be 'none'.")
    carrying = [name for name in self.schedule_period if registry.get_variant(name).carries]
    if carrying:
      raise ValueError(f"model.stack='reversible' cannot pass a carry between layers (a layer "
                       f"is inverted from its outputs alone); attention {carrying[0]!r} carries "
                       f"{registry.get_variant(carrying[0]).carries}: use stack='standard'.")


def default_model_config() -> ml_collections.ConfigDict:
  """Every key of `ModelConfig` with its default, as a ConfigDict.

  Fields whose default is None become typed placeholders, so that
  `--config.model.num_kv_heads=2` is accepted; `attention_options` lists the
  default variant's options (see `attention_options.options_config`), `pooling_options`
  those of every pooling module.
  """
  config = ml_collections.ConfigDict()
  hints = typing.get_type_hints(ModelConfig)
  for field in dataclasses.fields(ModelConfig):
    if field.default is None:
      (inner,) = [t for t in typing.get_args(hints[field.name]) if t is not type(None)]
      # A placeholder takes a class: Tuple[int, int] is a tuple.
      config[field.name] = ml_collections.config_dict.placeholder(typing.get_origin(inner)
                                                                  or inner)
    elif isinstance(field.default, Mapping):
      config[field.name] = dict(field.default)
    else:
      config[field.name] = field.default
  config.attention_options = options_config(config.attention)
  config.pooling_options = options_config(*POOLING_VARIANTS.values())
  config.feed_forward_options = feed_forward_options_config(config.feed_forward)
  return config


def feed_forward_options_config(kind: str) -> ml_collections.ConfigDict:
  """The options of feed-forward layer `kind` at their defaults, as a
  ConfigDict (`config.model.feed_forward_options`), so that each can be set
  with `--config.model.feed_forward_options.<name>=<value>`."""
  hints = typing.get_type_hints(FEED_FORWARD_LAYERS[kind])
  options = ml_collections.ConfigDict()
  for name, default in feed_forward_options(kind).items():
    if default is None:
      (inner,) = [t for t in typing.get_args(hints[name]) if t is not type(None)]
      options[name] = ml_collections.config_dict.placeholder(inner)
    else:
      options[name] = default
  return options


def _frozen(value: Any) -> Any:
  if isinstance(value, ml_collections.ConfigDict):
    value = value.to_dict()
  if isinstance(value, Mapping):
    return FrozenDict({k: _frozen(v) for k, v in value.items()})
  if isinstance(value, list):
    return tuple(value)
  return value


def _either(names: Tuple[str, ...]) -> str:
  """`'a'`, or `'a' or 'b'`, for an error message."""
  return " or ".join(map(repr, names))


def _one_of(what: str, value: Any, valid: Tuple[str, ...]) -> None:
  if value not in valid:
    raise registry.unknown_name_error(what, value, valid)
