"""Hierarchical Transformer for long documents (Pappagari et al. 2019; the
encoder-over-segments form of HAT, Chalkidis et al. 2022), `kind="hierarchical"`.

  chunks:    [B, T] -> [B * n, L]        n = ceil(T / L) chunks of L = chunk_length tokens
  tokens:    Encoder + pooling per chunk -> [B * n, E]   (one shared encoder, one batch)
  sentences: VectorEncoder over the chunk vectors [B, n, E], all-padding chunks masked
  document:  pooling over the real chunks -> the classifier head

Both levels pool by `config.pooling` ("cls": a [CLS] of each level, "mean",
"max"); attention within a chunk costs O(n L^2) rather than O(T^2).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import flax.linen as nn
import jax.numpy as jnp

from attention_jax.models.classifier import classifier_head, cls_prefix, encode_pooled
from attention_jax.models.config import ModelConfig
from attention_jax.models.encoder import Encoder, VectorEncoder

Array = jnp.ndarray


def split_chunks(tokens: Array, padding_mask: Array, chunk_length: int):
  """A document as its chunks, the last one filled up with padding.

  tokens, padding_mask: `[B, T]`. Returns `(tokens [B, n, L], padding_mask
  [B, n, L])` with n = ceil(T / L); the filled-up positions are padding
  (id 0, mask False).
  """
  batch, length = tokens.shape
  chunks = math.ceil(length / chunk_length)
  fill = chunks * chunk_length - length
  tokens = jnp.pad(tokens, ((0, 0), (0, fill)))
  padding_mask = jnp.pad(padding_mask, ((0, 0), (0, fill)))
  return (tokens.reshape(batch, chunks, chunk_length),
          padding_mask.reshape(batch, chunks, chunk_length))


class HierarchicalTransformer(nn.Module):
  """Logits of one label per document from its chunks.

  Submodules: "token_encoder" (an `Encoder` of `num_layers` blocks whose
  positions count within a chunk) with "chunk_cls" for "cls" pooling,
  "sentence_encoder" (a `VectorEncoder` of `sentence_layers` blocks, its
  positions counting chunks) with "document_cls", the head's layers.

  Attributes:
    config: the model config; `chunk_length`, `sentence_layers`, and
      `pooling` "cls", "mean" or "max" (the E-wide ones).
  """

  config: ModelConfig

  @nn.compact
  def __call__(self, tokens: Array, *, padding_mask: Optional[Array] = None,
               deterministic: bool = True) -> Array:
    """tokens: `[B, T]` ids, `T <= max_length`; padding_mask: `[B, T]` bool,
    True for real tokens (None: all real).

    Returns:
      `[B, num_classes]` float32 logits.
    """
    config = self.config
    if tokens.ndim != 2 or tokens.shape[1] > config.max_length:
      raise ValueError(f"tokens must be [B, T] ids with T <= max_length={config.max_length}, "
                       f"got shape {tokens.shape}.")
    mask = jnp.ones(tokens.shape, bool) if padding_mask is None else padding_mask
    chunks, chunk_mask = split_chunks(tokens, mask, config.chunk_length)  # [B, n, L]
    batch, num_chunks, chunk_length = chunks.shape

    # Every chunk of every document in one batch through the shared encoder.
    token_encoder = Encoder(dataclasses.replace(config, max_length=chunk_length),
                            name="token_encoder")
    vectors = encode_pooled(token_encoder, chunks.reshape(batch * num_chunks, chunk_length),
                            chunk_mask.reshape(batch * num_chunks, chunk_length),
                            cls_prefix(self, config, "chunk_cls"), None, deterministic)
    vectors = vectors.reshape(batch, num_chunks, -1)  # [B, n, E]

    # A chunk of padding alone (the tail of a short document) is no sentence.
    real_chunks = chunk_mask.any(axis=2)  # [B, n]
    sentence_encoder = VectorEncoder(
        dataclasses.replace(config, num_layers=config.sentence_layers),
        num_positions=math.ceil(config.max_length / config.chunk_length),
        name="sentence_encoder")
    document = encode_pooled(sentence_encoder, vectors, real_chunks,
                             cls_prefix(self, config, "document_cls"), None, deterministic)
    return classifier_head(document, config, deterministic)
