"""Transformer encoders: over token ids (`Encoder`: embeddings, positions, the
layer stack) and over vectors (`VectorEncoder`: image patches, chunk vectors).

Both are the same three steps, written once as functions that run inside the
calling module's compact method (so their parameters are the caller's, as
`run_layers`' blocks are): `embed_tokens`, `add_absolute_positions` and
`encode_embedded`. Architectures that embed or pool in their own way (ViT,
Funnel, hierarchical) call them instead of copying them.
"""

from __future__ import annotations

from typing import Optional, Tuple

import flax.linen as nn
import jax.numpy as jnp

from attention_jax import axes, positional
from attention_jax.layers.norms import make_norm
from attention_jax.models.blocks import EMBEDDED
from attention_jax.models.config import ModelConfig
from attention_jax.models.stack import LAYER_OUTPUTS, run_layers

Array = jnp.ndarray


def add_absolute_positions(config: ModelConfig, x: Array, num_positions: int,
                           positions: Optional[Array] = None) -> Array:
  """`x` plus the "sinusoidal" or "learned" position embedding of
  `config.position` (submodule "position_embedding" of the caller; the learned
  table has `num_positions` rows); other schemes add nothing here.

  x: `[B, T, E]`; positions: `[T]` or `[B, T]`, None for `arange(T)`.
  """
  if config.position == "sinusoidal":
    return positional.SinusoidalPositionEmbedding(name="position_embedding")(x, positions)
  if config.position == "learned":
    return positional.LearnedPositionEmbedding(num_positions,
                                               name="position_embedding")(x, positions)
  return x


def embed_tokens(config: ModelConfig, tokens: Array, positions: Optional[Array] = None) -> Array:
  """Token embeddings (submodule "token_embedding") with absolute positions:
  `[B, T]` ids -> `[B, T, E]` in the computation dtype. "complex" positions
  replace the embedding by waves over the positions."""
  dtype = config.jnp_dtype
  if config.position == "complex":
    return positional.ComplexWordEmbedding(config.vocab_size, config.embed_dim,
                                           name="token_embedding")(tokens, positions).astype(dtype)
  x = nn.Embed(
      config.vocab_size, config.embed_dim, dtype=dtype,
      embedding_init=nn.with_logical_partitioning(nn.initializers.normal(stddev=1.0),
                                                  (axes.VOCAB, axes.EMBED)),
      name="token_embedding")(tokens)
  return add_absolute_positions(config, x, config.max_length, positions)


def prepend(prefix: Optional[Array], x: Array,
            padding_mask: Optional[Array]) -> Tuple[Array, Optional[Array]]:
  """`[prefix; x]` and its padding mask (the prefix is never padded).

  prefix: `[B|1, P, E]` or None; x: `[B, T, E]`; padding_mask: `[B, T]` bool
  or None. Returns `([B, P + T, E], [B, P + T] or None)`.
  """
  if prefix is None:
    return x, padding_mask
  batch = x.shape[0]
  prefix = jnp.broadcast_to(prefix, (batch,) + prefix.shape[1:]).astype(x.dtype)
  x = jnp.concatenate([prefix, x], axis=1)
  if padding_mask is not None:
    padding_mask = jnp.concatenate([jnp.ones((batch, prefix.shape[1]), bool), padding_mask],
                                   axis=1)
  return x, padding_mask


def encode_embedded(config: ModelConfig, x: Array, *, padding_mask: Optional[Array] = None,
                    is_causal: bool = False, deterministic: bool = True,
                    prefix: Optional[Array] = None, return_layer_outputs: bool = False):
  """The encoder after its input layer: `prefix` prepended, dropout, the layer
  stack (`block_{i}` or `blocks`), and for pre-LN the final norm
  ("final_norm"), all submodules of the caller.

  x: `[B, T, E]`; padding_mask: `[B, T]` bool, True for real positions;
  prefix: `[B|1, P, E]`, never padded. Returns `[B, P + T, E]`; with
  `return_layer_outputs`, `(that, [B, L + 1, P + T, E])`: the stack's input and
  each of its L blocks' outputs (before the final norm), from its carry.
  """
  x, padding_mask = prepend(prefix, x, padding_mask)
  x = nn.with_logical_constraint(x, EMBEDDED)
  x = nn.Dropout(config.dropout_rate)(x, deterministic=deterministic)

  # Padding need not be a suffix, so it becomes a key mask, not sequence lengths.
  mask = None if padding_mask is None else padding_mask[:, None, None, :]
  x, carry = run_layers(config, x, mask=mask, is_causal=is_causal, deterministic=deterministic,
                        keep_layer_outputs=return_layer_outputs)
  if config.residual == "pre_norm":  # Pre-LN leaves the residual stream unnormalised.
    x = make_norm(config.norm, config.jnp_dtype, deterministic=deterministic,
                  name="final_norm")(x)
  if return_layer_outputs:
    return x, carry[LAYER_OUTPUTS]
  return x


class Encoder(nn.Module):
  """Token embedding, absolute positions, the layer stack, final norm.

  Attributes:
    config: the model config. "sinusoidal" and "learned" positions are added
      to the token embeddings here, "complex" replaces them by waves over the
      positions; "rope", "alibi" and "t5" act in every
      block's mixer; "none" uses no positions.
  """

  config: ModelConfig

  @nn.compact
  def __call__(
      self,
      tokens: Array,
      *,
      padding_mask: Optional[Array] = None,
      is_causal: bool = False,
      deterministic: bool = True,
      prefix: Optional[Array] = None,
      return_layer_outputs: bool = False,
  ):
    """Encodes `tokens`.

    Args:
      tokens: `[B, T]` integer ids, `T <= max_length`.
      padding_mask: `[B, T]` bool, True for real tokens. Padding may sit anywhere;
        padded tokens are hidden from every query as keys (their own outputs are
        computed but meaningless).
      is_causal: each position attends only to itself and earlier positions.
      deterministic: disables dropout.
      prefix: `[B|1, P, E]` embeddings placed before the tokens' (e.g. a learned
        [CLS] embedding). They get no absolute position embedding, are never
        padded, and count as positions `0..P-1` for relative schemes.
      return_layer_outputs: also return every layer's output (transparent
        attention reads them).

    Returns:
      `[B, P + T, E]`; with `return_layer_outputs`, `(that, [B, L + 1, P + T, E])`,
      the embeddings and each of the L blocks' outputs (before the final norm).
    """
    self._check_inputs(tokens, padding_mask, prefix)
    positions = self._decoded_positions(tokens.shape[1]) if self.config.decode else None
    x = embed_tokens(self.config, tokens, positions)
    return encode_embedded(self.config, x, padding_mask=padding_mask, is_causal=is_causal,
                           deterministic=deterministic, prefix=prefix,
                           return_layer_outputs=return_layer_outputs)

  def _decoded_positions(self, length: int) -> Optional[Array]:
    """While decoding, the positions of the `length` new tokens: they follow
    the tokens already decoded (a counter in the "cache" collection, as the
    mixers' caches). The call that creates the counter (`init`, with the
    whole cache's length) counts from 0 and leaves it at 0."""
    initialised = self.has_variable("cache", "decoded_length")
    decoded = self.variable("cache", "decoded_length", lambda: jnp.array(0, jnp.int32))
    if not initialised:
      return None
    positions = decoded.value + jnp.arange(length)
    decoded.value = decoded.value + length
    return positions

  def _check_inputs(self, tokens, padding_mask, prefix) -> None:
    if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
      raise ValueError(f"tokens must be [B, T] integer ids, got shape {tokens.shape} and "
                       f"dtype {tokens.dtype}.")
    if tokens.shape[1] > self.config.max_length:
      raise ValueError(f"tokens has sequence length {tokens.shape[1]}, more than "
                       f"max_length={self.config.max_length}.")
    if padding_mask is not None and (padding_mask.shape != tokens.shape
                                     or padding_mask.dtype != jnp.bool_):
      raise ValueError(f"padding_mask must be bool with the shape of tokens {tokens.shape}, "
                       f"got shape {padding_mask.shape} and dtype {padding_mask.dtype}.")
    if prefix is not None and (prefix.ndim != 3 or prefix.shape[0] not in (1, tokens.shape[0])
                               or prefix.shape[2] != self.config.embed_dim):
      raise ValueError(f"prefix must be [B|1, P, E] with B={tokens.shape[0]}, "
                       f"E={self.config.embed_dim}, got shape {prefix.shape}.")


class VectorEncoder(nn.Module):
  """The encoder over a sequence of vectors instead of token ids (ViT's patch
  embeddings, a hierarchical model's chunk vectors): absolute positions, then
  `encode_embedded`. Called as `Encoder` is, so the classifiers' pooling
  (`classifier.encode_pooled`) serves both.

  Attributes:
    config: the model config; "sinusoidal" and "learned" positions are added
      (not to the prefix), "complex" (a word embedding) is refused.
    num_positions: rows of the learned position table; None: `config.max_length`.
  """

  config: ModelConfig
  num_positions: Optional[int] = None

  @nn.compact
  def __call__(self, x: Array, *, padding_mask: Optional[Array] = None,
               is_causal: bool = False, deterministic: bool = True,
               prefix: Optional[Array] = None) -> Array:
    """x: `[B, T, E]`; the rest as `Encoder`'s. Returns `[B, P + T, E]`."""
    config = self.config
    if x.ndim != 3 or x.shape[2] != config.embed_dim:
      raise ValueError(f"x must be [B, T, E] with E={config.embed_dim}, got shape {x.shape}.")
    if padding_mask is not None and padding_mask.shape != x.shape[:2]:
      raise ValueError(f"padding_mask must be [B, T] = {x.shape[:2]}, got {padding_mask.shape}.")
    if config.position == "complex":
      raise ValueError("position 'complex' is a word embedding (it replaces the token "
                       "embedding); an encoder over vectors has no words to embed.")
    x = add_absolute_positions(config, x.astype(config.jnp_dtype),
                               self.num_positions or config.max_length)
    return encode_embedded(config, x, padding_mask=padding_mask, is_causal=is_causal,
                           deterministic=deterministic, prefix=prefix)
