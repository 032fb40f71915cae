"""A causal (decoder-only) language model: the encoder run causally, then logits
over the vocabulary at every position."""

from __future__ import annotations

from typing import Optional

import flax.linen as nn
import jax.numpy as jnp

from attention_jax import axes
from attention_jax.models.config import ModelConfig
from attention_jax.models.encoder import Encoder

Array = jnp.ndarray


class LanguageModel(nn.Module):
  """Next-token logits: the encoder (submodule "encoder") run with
  `is_causal=True`, then a projection to the vocabulary.

  Attributes:
    config: the model config; its variants must support causal masking.
  """

  config: ModelConfig

  @nn.compact
  def __call__(self, tokens: Array, *, padding_mask: Optional[Array] = None,
               deterministic: bool = True) -> Array:
    """tokens: `[B, T]` ids; padding_mask: `[B, T]` bool, True for real tokens.

    Returns:
      `[B, T, vocab_size]` float32 logits; position t predicts token t + 1.
    """
    x = Encoder(self.config, name="encoder")(tokens, padding_mask=padding_mask, is_causal=True,
                                             deterministic=deterministic)  # [B, T, E]
    logits = nn.Dense(
        self.config.vocab_size, use_bias=False, dtype=self.config.jnp_dtype,
        kernel_init=nn.with_logical_partitioning(nn.initializers.lecun_normal(),
                                                 (axes.EMBED, axes.VOCAB)),
        name="lm_head")(x)
    return nn.with_logical_constraint(logits.astype(jnp.float32), (
        axes.ACTIVATION_BATCH, axes.ACTIVATION_LENGTH, axes.ACTIVATION_VOCAB))
