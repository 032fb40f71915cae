"""Vision Transformer (Dosovitskiy et al. 2021), `kind="vit"`: an image cut into
square patches, each patch a linear projection of its pixels, a learned [CLS]
in front, then the encoder (any registered mixer, the config's norm, residual
and feed-forward; the ViT's own are pre-LN and a GELU MLP) and the classifier
head on the [CLS] output.

The image tasks (`data/image.py`, `data/pathfinder.py`) give a grey image as
its pixels row by row, each token its 8-bit value + 1 (0 is padding), so a
`[B, H * W]` sequence is reshaped back to `[B, H, W, 1]` here.
"""

from __future__ import annotations

import math
from typing import Optional

import flax.linen as nn
import jax.numpy as jnp

from attention_jax import axes
from attention_jax.models.classifier import (classifier_head, cls_prefix, encode_pooled,
                                             pooling_module)
from attention_jax.models.config import ModelConfig
from attention_jax.models.encoder import VectorEncoder

Array = jnp.ndarray


def pixel_image(tokens: Array, vocab_size: int) -> Array:
  """Pixel tokens as a square grey image in [-1, 1] (ViT's input range).

  tokens: `[B, H * W]` ids, pixel value + 1 with `vocab_size - 1` values
  (257: 8-bit pixels), row by row. Returns `[B, H, W, 1]` float32.
  """
  batch, length = tokens.shape
  side = math.isqrt(length)
  if side * side != length:
    raise ValueError(f"tokens must be the pixels of a square image, [B, side^2]; got length "
                     f"{length}.")
  levels = vocab_size - 2  # the largest pixel value
  pixels = (tokens.astype(jnp.float32) - 1) / levels
  return (2 * pixels - 1).reshape(batch, side, side, 1)


def extract_patches(images: Array, patch_size: int) -> Array:
  """Non-overlapping square patches, flattened.

  images: `[B, H, W, C]`, H and W multiples of p = `patch_size`. Returns
  `[B, (H / p) * (W / p), p * p * C]`: patches in row-major order over the
  grid, and within a patch its pixels row by row, channels last, i.e. patch
  (i, j) is `images[:, i p : (i + 1) p, j p : (j + 1) p, :]` flattened.
  """
  batch, height, width, channels = images.shape
  if height % patch_size or width % patch_size:
    raise ValueError(f"patch_size={patch_size} must divide the image's height and width, got "
                     f"{height} x {width}.")
  rows, columns = height // patch_size, width // patch_size
  grid = images.reshape(batch, rows, patch_size, columns, patch_size, channels)
  grid = grid.transpose(0, 1, 3, 2, 4, 5)  # [B, rows, columns, p, p, C]
  return grid.reshape(batch, rows * columns, patch_size * patch_size * channels)


class VisionTransformer(nn.Module):
  """Logits of one label per image.

  Submodules: "patch_embedding" (Dense over a patch's pixels, the paper's
  linear projection E), "encoder" (`VectorEncoder` over the [CLS] and patch
  embeddings; "learned" or "sinusoidal" positions are added to the N patches,
  the [CLS] needs none: it is a learned vector already), and the head's
  layers. `config.pooling` "cls" is the paper's; the others pool the patches.

  Attributes:
    config: the model config; `max_length` is the image's pixel count (a
      square), `patch_size` the patches' side.
  """

  config: ModelConfig

  @nn.compact
  def __call__(self, tokens: Array, *, padding_mask: Optional[Array] = None,
               deterministic: bool = True) -> Array:
    """tokens: `[B, H * W]` pixel tokens, `H * W = max_length`; padding_mask is
    taken for the trainer's call and not read (an image is never padded).

    Returns:
      `[B, num_classes]` float32 logits.
    """
    del padding_mask
    config = self.config
    if tokens.ndim != 2 or tokens.shape[1] != config.max_length:
      raise ValueError(f"tokens must be [B, max_length={config.max_length}] pixels, got shape "
                       f"{tokens.shape}.")
    patches = extract_patches(pixel_image(tokens, config.vocab_size), config.patch_size)
    x = nn.Dense(
        config.embed_dim, dtype=config.jnp_dtype,
        kernel_init=nn.with_logical_partitioning(nn.initializers.lecun_normal(),
                                                 (None, axes.EMBED)),
        bias_init=nn.with_logical_partitioning(nn.initializers.zeros_init(), (axes.EMBED,)),
        name="patch_embedding")(patches)  # [B, N, E]
    encoder = VectorEncoder(config, num_positions=patches.shape[1], name="encoder")
    pooled = encode_pooled(encoder, x, None, cls_prefix(self, config),
                           pooling_module(config, "pooling"), deterministic)
    return classifier_head(pooled, config, deterministic)
