"""The Transformer encoder-decoder (Vaswani et al. 2017), with any registered
Q/K/V variant that has a cross-attention form as the decoder's attention to
the source, and optionally transparent attention (Bapna et al. 2018).

  model = build_model(dict(kind="transformer_seq2seq", attention="dot_product",
                           cross_attention="additive", vocab_size=13, num_classes=13))
  logits = model.apply(variables, inputs, targets)            # teacher forcing
  tokens = decoding.decode(model, variables, inputs, max_length=31)

The encoder is `Encoder` (self-attention of `attention`); each decoder block
is causal self-attention (`attention`), cross-attention to the encoder
(`cross_attention`, default `attention`) and the feed-forward layer, each in
the config's residual arrangement. With `transparent_attention` the decoder's
block j attends to a learned mix `sum_i softmax(w_j)_i h_i` of the encoder's
embeddings h_0 and block outputs h_1..h_L (which the layer stack hands on in
its carry) instead of the last layer alone: each decoder layer chooses how
deep a source representation it reads.

Decoding (`decoding.decode`: greedy or beam search) runs the decoder over a
fixed `[N, max_length]` buffer of the tokens so far at every step and reads
the logits at the current one: no key/value cache, so any causal variant
decodes, at `max_length` positions per step (the seq2seq tasks here are a
few dozen tokens). The causal mask makes a step's logits those of the
teacher-forced pass (tested).
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from attention_jax import axes
from attention_jax.data.seq2seq import PAD_ID
from attention_jax.layers import make_feed_forward, make_norm
from attention_jax.models.blocks import (EMBEDDED, RESIDUAL_ARRANGEMENTS, feed_forward_arguments,
                                         make_mixer)
from attention_jax.models.config import ModelConfig
from attention_jax.models.encoder import Encoder, embed_tokens
from attention_jax.models.seq2seq import shift_right

Array = jnp.ndarray
Carry = Dict[str, Any]


class DecoderBlock(nn.Module):
  """Causal self-attention, cross-attention to the source, feed-forward.

  Sub-modules: `self_attention`, `cross_attention`, `mlp`, each after (pre-norm)
  or before (post-norm) its norm `<name>_norm`.

  Attributes:
    config: the model config.
  """

  config: ModelConfig

  @nn.compact
  def __call__(self, x: Array, source: Array, source_lengths: Array,
               deterministic: bool = True) -> Array:
    """x: `[B, Tt, E]`; source: `[B, Ts, E]`; source_lengths: `[B]` -> `[B, Tt, E]`."""
    config, dtype = self.config, self.config.jnp_dtype
    dropout = nn.Dropout(config.dropout_rate)
    residual = RESIDUAL_ARRANGEMENTS[config.residual]
    self_attention = make_mixer(config, config.attention, name="self_attention")
    cross_attention = make_mixer(config, config.cross_variant, name="cross_attention")
    mlp = make_feed_forward(config.feed_forward, mlp_dim=config.mlp_dim,
                            activation=config.activation, dropout_rate=config.dropout_rate,
                            dtype=dtype, options=config.feed_forward_options, name="mlp")
    norm = lambda name: make_norm(config.norm, dtype, deterministic=deterministic, name=name)

    branches = (
        ("self_attention", lambda y: self_attention(y, is_causal=True,
                                                    deterministic=deterministic)),
        ("cross_attention", lambda y: cross_attention(y, source,
                                                      key_value_seq_lengths=source_lengths,
                                                      deterministic=deterministic)),
        ("mlp", lambda y: mlp(y, deterministic=deterministic,
                              **feed_forward_arguments(config, is_causal=True))),
    )
    for name, branch in branches:
      x = residual(x, lambda y, f=branch: dropout(f(y), deterministic=deterministic),
                   norm(f"{name}_norm"))
      x = nn.with_logical_constraint(x, EMBEDDED)
    return x


class TransformerDecoder(nn.Module):
  """Target token embeddings, `num_layers` decoder blocks, logits.

  Attributes:
    config: the model config.
  """

  config: ModelConfig

  @nn.compact
  def __call__(self, tokens: Array, source: Array, source_lengths: Array,
               deterministic: bool = True) -> Array:
    """tokens: `[B, Tt]` (BOS first); source: `[B, Ts, E]`, or with
    transparent attention `[B, L + 1, Ts, E]` (every encoder layer's output);
    source_lengths: `[B]`. Returns `[B, Tt, V]` float32 logits."""
    config = self.config
    x = embed_tokens(config, tokens)
    x = nn.Dropout(config.dropout_rate)(x, deterministic=deterministic)
    if config.transparent_attention:
      # w [decoder layer, encoder layer], zero: each layer starts at the mean.
      mix = self.param("transparent_weights", nn.initializers.zeros_init(),
                       (config.num_layers, source.shape[1]), jnp.float32)
    for j in range(config.num_layers):
      context = source
      if config.transparent_attention:
        context = jnp.einsum("l,blte->bte", jax.nn.softmax(mix[j]).astype(source.dtype), source)
        # Pre-norm block outputs are unnormalised residual streams; the mix is
        # normalised as the encoder's last output is.
        context = make_norm(config.norm, config.jnp_dtype, deterministic=deterministic,
                            name=f"context_norm_{j}")(context)
      x = DecoderBlock(config, name=f"block_{j}")(x, context, source_lengths, deterministic)
    if config.residual == "pre_norm":
      x = make_norm(config.norm, config.jnp_dtype, deterministic=deterministic,
                    name="final_norm")(x)
    logits = nn.Dense(config.vocab_size, dtype=config.jnp_dtype,
                      kernel_init=nn.with_logical_partitioning(nn.initializers.lecun_normal(),
                                                               (axes.EMBED, axes.VOCAB)),
                      bias_init=nn.with_logical_partitioning(nn.initializers.zeros_init(),
                                                             (axes.VOCAB,)),
                      name="logits")(x)
    return logits.astype(jnp.float32)


class TransformerEncoderDecoder(nn.Module):
  """Source tokens `[B, Ts]` and target tokens `[B, Tt]` -> logits `[B, Tt, V]`.

  Token 0 is padding in both (the source left-aligned: its valid length is its
  count of non-padding tokens); the decoder starts from BOS (1). Answers
  `encode` and `decode_step` for `decoding.decode`, as `RNNEncoderDecoder` does.

  Attributes:
    config: the model config (`kind="transformer_seq2seq"`).
  """

  config: ModelConfig

  @property
  def max_decode_length(self) -> int:
    """The most steps `decoding.decode` may take: the decoder's buffer size."""
    return self.config.max_length

  def setup(self):
    self.encoder = Encoder(self.config)
    self.decoder = TransformerDecoder(self.config)

  def _source(self, inputs: Array, deterministic: bool) -> Tuple[Array, Array]:
    """The decoder's source (`[B, Ts, E]`, or `[B, L + 1, Ts, E]` with
    transparent attention) and the source lengths `[B]`."""
    padding_mask = inputs != PAD_ID
    source_lengths = jnp.sum(padding_mask, axis=1).astype(jnp.int32)
    if self.config.transparent_attention:
      _, layers = self.encoder(inputs, padding_mask=padding_mask, deterministic=deterministic,
                               return_layer_outputs=True)
      return layers, source_lengths
    return self.encoder(inputs, padding_mask=padding_mask,
                        deterministic=deterministic), source_lengths

  def __call__(self, inputs: Array, targets: Array, deterministic: bool = True) -> Array:
    """Teacher forcing: the logits of `targets` `[B, Tt]` given their prefixes."""
    source, source_lengths = self._source(inputs, deterministic)
    return self.decoder(shift_right(targets), source, source_lengths, deterministic)

  def encode(self, inputs: Array) -> Tuple[Array, Array, Carry]:
    """inputs: `[B, Ts]` -> (source, source lengths `[B]`, the decoding carry:
    a `[B, max_length]` buffer of the tokens so far and the step)."""
    source, source_lengths = self._source(inputs, deterministic=True)
    carry = dict(tokens=jnp.full((inputs.shape[0], self.config.max_length), PAD_ID, jnp.int32),
                 step=jnp.zeros((), jnp.int32))
    return source, source_lengths, carry

  def decode_step(self, tokens: Array, carry: Carry, source: Array,
                  source_lengths: Array) -> Tuple[Array, Carry]:
    """The previous tokens `[B]` -> (logits `[B, V]` of the next, carry)."""
    step = carry["step"]
    buffer = jax.lax.dynamic_update_slice(carry["tokens"], tokens[:, None].astype(jnp.int32),
                                          (0, step))
    logits = self.decoder(buffer, source, source_lengths, deterministic=True)
    logits = jax.lax.dynamic_index_in_dim(logits, step, axis=1, keepdims=False)
    return logits, dict(tokens=buffer, step=step + 1)


__all__ = ["DecoderBlock", "TransformerDecoder", "TransformerEncoderDecoder"]
