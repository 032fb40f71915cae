"""Transformer encoder over token ids: embeddings, positions, a stack of blocks."""

from __future__ import annotations

from typing import Any, Mapping, Optional

import flax.linen as nn
import jax.numpy as jnp
from flax.core import FrozenDict

from attention_jax import positional
from attention_jax.layers.blocks import EncoderBlock
from attention_jax.layers.norms import make_norm

Array = jnp.ndarray
Dtype = Any

# Schemes that act inside attention; the others are added to the embeddings here.
RELATIVE_POSITIONS = ("rope", "alibi", "t5")


class Encoder(nn.Module):
  """Token embedding, absolute positions, `num_layers` `EncoderBlock`s, final norm.

  Attributes:
    vocab_size: number of token ids.
    num_layers: number of blocks.
    embed_dim: model width E.
    num_heads: attention heads.
    mlp_dim: feed-forward hidden size.
    max_length: longest token sequence accepted (the learned position table's size).
    position: one of `positional.POSITION_ENCODINGS`. "sinusoidal" and "learned"
      are added to the token embeddings; "rope", "alibi" and "t5" are applied by
      every block's mixer; "none" uses no positions.
    position_options: options of the relative scheme (see `MultiHeadAttention`).
    attention, attention_options, num_kv_heads, activation, norm, pre_norm,
      attention_dropout_rate: as in `EncoderBlock`.
    dropout_rate: dropout on the embeddings and in every block.
    dtype, param_dtype: computation and parameter dtypes.
  """

  vocab_size: int
  num_layers: int = 2
  embed_dim: int = 64
  num_heads: int = 4
  mlp_dim: int = 128
  max_length: int = 512
  position: str = "sinusoidal"
  position_options: Mapping[str, Any] = FrozenDict()
  attention: str = "dot_product"
  attention_options: Mapping[str, Any] = FrozenDict()
  num_kv_heads: Optional[int] = None
  activation: str = "gelu"
  norm: str = "layernorm"
  pre_norm: bool = True
  dropout_rate: float = 0.0
  attention_dropout_rate: float = 0.0
  dtype: Optional[Dtype] = None
  param_dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(
      self,
      tokens: Array,
      *,
      padding_mask: Optional[Array] = None,
      is_causal: bool = False,
      deterministic: bool = True,
      prefix: Optional[Array] = None,
  ) -> Array:
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

    Returns:
      `[B, P + T, E]`.
    """
    self._check_inputs(tokens, padding_mask, prefix)
    batch, length = tokens.shape
    embed = nn.Embed(
        self.vocab_size, self.embed_dim, dtype=self.dtype, param_dtype=self.param_dtype,
        embedding_init=nn.with_logical_partitioning(nn.initializers.normal(stddev=1.0),
                                                    ("vocab", "embed")),
        name="token_embedding")
    x = embed(tokens)
    if self.position == "sinusoidal":
      x = positional.SinusoidalPositionEmbedding(name="position_embedding")(x)
    elif self.position == "learned":
      x = positional.LearnedPositionEmbedding(self.max_length, param_dtype=self.param_dtype,
                                              name="position_embedding")(x)

    if prefix is not None:
      prefix = jnp.broadcast_to(prefix, (batch,) + prefix.shape[1:]).astype(x.dtype)
      x = jnp.concatenate([prefix, x], axis=1)
      if padding_mask is not None:
        padding_mask = jnp.concatenate(
            [jnp.ones((batch, prefix.shape[1]), bool), padding_mask], axis=1)
    x = nn.with_logical_constraint(x, ("batch", "length", "embed"))
    x = nn.Dropout(self.dropout_rate)(x, deterministic=deterministic)

    # Padding need not be a suffix, so it becomes a key mask, not sequence lengths.
    mask = None if padding_mask is None else padding_mask[:, None, None, :]
    for i in range(self.num_layers):
      x = EncoderBlock(
          num_heads=self.num_heads, mlp_dim=self.mlp_dim, attention=self.attention,
          attention_options=self.attention_options, num_kv_heads=self.num_kv_heads,
          position=self.position if self.position in RELATIVE_POSITIONS else None,
          position_options=self.position_options, activation=self.activation,
          norm=self.norm, pre_norm=self.pre_norm, dropout_rate=self.dropout_rate,
          attention_dropout_rate=self.attention_dropout_rate, dtype=self.dtype,
          param_dtype=self.param_dtype, name=f"block_{i}",
      )(x, mask=mask, is_causal=is_causal, deterministic=deterministic)
    if self.pre_norm:  # Pre-LN leaves the residual stream unnormalised.
      x = make_norm(self.norm, self.dtype, param_dtype=self.param_dtype, name="final_norm")(x)
    return x

  def _check_inputs(self, tokens, padding_mask, prefix) -> None:
    positional.check_position_encoding(self.position)
    if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
      raise ValueError(f"tokens must be [B, T] integer ids, got shape {tokens.shape} and "
                       f"dtype {tokens.dtype}.")
    if tokens.shape[1] > self.max_length:
      raise ValueError(f"tokens has sequence length {tokens.shape[1]}, more than "
                       f"max_length={self.max_length}.")
    if padding_mask is not None and (padding_mask.shape != tokens.shape
                                     or padding_mask.dtype != jnp.bool_):
      raise ValueError(f"padding_mask must be bool with the shape of tokens {tokens.shape}, "
                       f"got shape {padding_mask.shape} and dtype {padding_mask.dtype}.")
    if prefix is not None and (prefix.ndim != 3 or prefix.shape[0] not in (1, tokens.shape[0])
                               or prefix.shape[2] != self.embed_dim):
      raise ValueError(f"prefix must be [B|1, P, E] with B={tokens.shape[0]}, "
                       f"E={self.embed_dim}, got shape {prefix.shape}.")
