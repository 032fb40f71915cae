"""Funnel Transformer (Dai et al. 2020), `kind="funnel"`: stages of blocks with the
sequence halved between them, a classifier on the last (shortest) stage, and an
upsampling decoder for token-level outputs.

  stage 1:  h_1 = blocks(embed(tokens))                            [B, T, E]
  stage s:  q = pool(h_{s-1}); h_s = blocks(pooled_block(q, h_{s-1}))  [B, T_s, E]
  decoder:  g = blocks(repeat(h_S, 2^(S-1))[:T] + h_1)              [B, T, E]

`pool` is a mean over pairs of positions (stride 2). In the first block of a
pooled stage the queries are the pooled sequence and the keys and values the
unpooled one (the paper's "pool-query-only"); `funnel_pool_queries_only=False`
pools the whole sequence instead, which any mixer can run. The blocks, stacks,
embedding, pooling and head are the encoder's and the classifier's own.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

import flax.linen as nn
import jax.numpy as jnp

from attention_jax.layers.norms import make_norm
from attention_jax.models.blocks import Block
from attention_jax.models.classifier import (classifier_head, cls_prefix, pool_outputs,
                                             pooling_module)
from attention_jax.models.config import ModelConfig
from attention_jax.models.encoder import embed_tokens, prepend
from attention_jax.models.stack import LayerStack

Array = jnp.ndarray


def pool_pairs(x: Array, padding_mask: Array, prefix_length: int = 0) -> Tuple[Array, Array]:
  """Mean pooling with stride 2 over the real positions of each pair.

  Position i of the result is the mean of the real ones among positions 2i
  and 2i + 1 (one real: its value; none: zeros), and is real when either is.
  An odd length gets a padding position at the end. The first
  `prefix_length` positions ([CLS]) are kept apart, unpooled, as the paper
  does with its [CLS] token.

  x: `[B, P + T, E]`; padding_mask: `[B, P + T]` bool, True for real.
  Returns `([B, P + ceil(T / 2), E], [B, P + ceil(T / 2)])`.
  """
  prefix, body = x[:, :prefix_length], x[:, prefix_length:]
  prefix_mask, body_mask = padding_mask[:, :prefix_length], padding_mask[:, prefix_length:]
  batch, length, features = body.shape
  if length % 2:
    body = jnp.pad(body, ((0, 0), (0, 1), (0, 0)))
    body_mask = jnp.pad(body_mask, ((0, 0), (0, 1)))
  pairs = body.reshape(batch, -1, 2, features)
  weights = body_mask.reshape(batch, -1, 2, 1).astype(x.dtype)
  pooled = (pairs * weights).sum(axis=2) / jnp.maximum(weights.sum(axis=2), 1)
  pooled_mask = body_mask.reshape(batch, -1, 2).any(axis=2)
  return (jnp.concatenate([prefix, pooled], axis=1),
          jnp.concatenate([prefix_mask, pooled_mask], axis=1))


def upsample(x: Array, length: int, factor: int, prefix_length: int = 0) -> Array:
  """Each position repeated `factor` times, cut to `length` positions; the
  prefix is kept as it is. Output position t (after the prefix) is input
  position t // factor, the position that pooling `log2(factor)` times sent
  it to. x: `[B, P + T_s, E]` -> `[B, P + length, E]`."""
  body = jnp.repeat(x[:, prefix_length:], factor, axis=1)[:, :length]
  return jnp.concatenate([x[:, :prefix_length], body], axis=1)


def _key_mask(padding_mask: Array) -> Array:
  return padding_mask[:, None, None, :]  # [B, 1, 1, Tk]: a mixer's key mask


class FunnelTransformer(nn.Module):
  """Logits of one label per sequence from the last stage of a funnel, or the
  decoder's token outputs (`token_outputs`).

  Submodules: "token_embedding" (and "position_embedding"), "stage_{s}" (a
  `LayerStack` of the stage's blocks), "stage_{s}_pooling" (the pooling
  block of stage s > 0 when queries alone are pooled), "final_norm" (pre-LN),
  the head's layers; the decoder's "decoder" and "decoder_norm". Each stack
  starts `config.layer_attention` afresh. Relative position schemes see a
  pooled stage's positions as consecutive.

  Attributes:
    config: the model config; `funnel_blocks` (its `num_layers` is not read),
      `funnel_decoder_blocks`, `funnel_pool_queries_only`.
  """

  config: ModelConfig

  @nn.compact
  def __call__(self, tokens: Array, *, padding_mask: Optional[Array] = None,
               deterministic: bool = True, return_tokens: bool = False) -> Array:
    """tokens: `[B, T]` ids; padding_mask: `[B, T]` bool, True for real tokens.

    Returns:
      `[B, num_classes]` float32 logits; with `return_tokens`, the decoder's
      `[B, T, E]` outputs instead (`token_outputs`; the head is then not built).
    """
    config = self.config
    if tokens.ndim != 2 or tokens.shape[1] > config.max_length:
      raise ValueError(f"tokens must be [B, T] ids with T <= max_length={config.max_length}, "
                       f"got shape {tokens.shape}.")
    mask = jnp.ones(tokens.shape, bool) if padding_mask is None else padding_mask
    prefix = cls_prefix(self, config)
    prefix_length = 0 if prefix is None else prefix.shape[1]
    x, mask = prepend(prefix, embed_tokens(config, tokens), mask)
    x = nn.Dropout(config.dropout_rate)(x, deterministic=deterministic)

    first = None
    for stage, num_blocks in enumerate(config.funnel_blocks):
      if stage:
        pooled, pooled_mask = pool_pairs(x, mask, prefix_length)
        if config.funnel_pool_queries_only:
          pooling_block = Block(config, config.schedule_period[0], name=f"stage_{stage}_pooling")
          pooled, _ = pooling_block(pooled, {}, _key_mask(mask), False, deterministic, context=x)
          num_blocks -= 1
        x, mask = pooled, pooled_mask
      if num_blocks:
        stack = LayerStack(dataclasses.replace(config, num_layers=num_blocks),
                           name=f"stage_{stage}")
        x, _ = stack(x, mask=_key_mask(mask), deterministic=deterministic)
      if first is None:
        first, first_mask = x, mask

    if return_tokens:
      return self._decode(x, first, first_mask, prefix_length, deterministic)
    if config.residual == "pre_norm":  # Pre-LN leaves the residual stream unnormalised.
      x = make_norm(config.norm, config.jnp_dtype, deterministic=deterministic,
                    name="final_norm")(x)
    pooled = pool_outputs(config, x, mask[:, prefix_length:], pooling_module(config, "pooling"))
    return classifier_head(pooled, config, deterministic)

  def token_outputs(self, tokens: Array, *, padding_mask: Optional[Array] = None,
                    deterministic: bool = True) -> Array:
    """The decoder's outputs for every token: `[B, T]` ids -> `[B, T, E]`.
    Initialise with `method=model.token_outputs` for the decoder's parameters."""
    return self(tokens, padding_mask=padding_mask, deterministic=deterministic,
                return_tokens=True)

  def _decode(self, last: Array, first: Array, first_mask: Array, prefix_length: int,
              deterministic: bool) -> Array:
    """The last stage repeated back to full length plus the first stage's
    output (the paper's residual), then `funnel_decoder_blocks` blocks.
    Called from the compact `__call__`, so its layers are the model's."""
    config = self.config
    factor = 2 ** (len(config.funnel_blocks) - 1)
    x = upsample(last, first.shape[1] - prefix_length, factor, prefix_length) + first
    if config.funnel_decoder_blocks:
      stack = LayerStack(dataclasses.replace(config, num_layers=config.funnel_decoder_blocks),
                         name="decoder")
      x, _ = stack(x, mask=_key_mask(first_mask), deterministic=deterministic)
    if config.residual == "pre_norm":
      x = make_norm(config.norm, config.jnp_dtype, deterministic=deterministic,
                    name="decoder_norm")(x)
    return x[:, prefix_length:]
