"""Transformer encoder over token ids: embeddings, positions, the layer stack."""

from __future__ import annotations

from typing import Optional

import flax.linen as nn
import jax.numpy as jnp

from attention_jax import axes, positional
from attention_jax.layers.norms import make_norm
from attention_jax.models.blocks import EMBEDDED
from attention_jax.models.config import ModelConfig
from attention_jax.models.stack import LAYER_OUTPUTS, run_layers

Array = jnp.ndarray


def embed_tokens(config: ModelConfig, tokens: Array, positions: Optional[Array] = None) -> Array:
  """Token embeddings with the absolute position scheme of `config.position`:
  `[B, T]` ids -> `[B, T, E]`. Called inside a compact method: the submodules
  "token_embedding" and "position_embedding" are the caller's.

  `positions`: `[T]` or `[B, T]` positions (None: 0..T-1).
  """
  dtype = config.jnp_dtype
  if config.position == "complex":
    x = positional.ComplexWordEmbedding(config.vocab_size, config.embed_dim,
                                        name="token_embedding")(tokens, positions).astype(dtype)
  else:
    x = nn.Embed(
        config.vocab_size, config.embed_dim, dtype=dtype,
        embedding_init=nn.with_logical_partitioning(nn.initializers.normal(stddev=1.0),
                                                    (axes.VOCAB, axes.EMBED)),
        name="token_embedding")(tokens)
  if config.position == "sinusoidal":
    x = positional.SinusoidalPositionEmbedding(name="position_embedding")(x, positions)
  elif config.position == "learned":
    x = positional.LearnedPositionEmbedding(config.max_length,
                                            name="position_embedding")(x, positions)
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
    config = self.config
    self._check_inputs(tokens, padding_mask, prefix)
    batch, length = tokens.shape
    dtype = config.jnp_dtype
    positions = self._decoded_positions(length) if config.decode else None
    x = embed_tokens(config, tokens, positions)

    if prefix is not None:
      prefix = jnp.broadcast_to(prefix, (batch,) + prefix.shape[1:]).astype(x.dtype)
      x = jnp.concatenate([prefix, x], axis=1)
      if padding_mask is not None:
        padding_mask = jnp.concatenate(
            [jnp.ones((batch, prefix.shape[1]), bool), padding_mask], axis=1)
    x = nn.with_logical_constraint(x, EMBEDDED)
    x = nn.Dropout(config.dropout_rate)(x, deterministic=deterministic)

    # Padding need not be a suffix, so it becomes a key mask, not sequence lengths.
    mask = None if padding_mask is None else padding_mask[:, None, None, :]
    x, carry = run_layers(config, x, mask=mask, is_causal=is_causal,
                          deterministic=deterministic, keep_layer_outputs=return_layer_outputs)
    if config.residual == "pre_norm":  # Pre-LN leaves the residual stream unnormalised.
      x = make_norm(config.norm, dtype, deterministic=deterministic, name="final_norm")(x)
    if return_layer_outputs:
      return x, carry[LAYER_OUTPUTS]
    return x

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
