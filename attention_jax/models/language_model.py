"""Language models over the encoder: a causal (decoder-only) one, logits of the
next token at every position, and a masked one (BERT's objective), logits of
each position's own token from the encoder run both ways."""

from __future__ import annotations

from typing import ClassVar, Optional

import flax.linen as nn
import jax.numpy as jnp

from attention_jax import axes
from attention_jax.models.config import ModelConfig
from attention_jax.models.encoder import Encoder

Array = jnp.ndarray


class LanguageModel(nn.Module):
  """Next-token logits: the encoder (submodule "encoder") run with
  `is_causal=True`, then a projection to the vocabulary ("lm_head").

  Attributes:
    config: the model config; its variants must support causal masking.
  """

  config: ModelConfig
  # Whether the encoder runs causally (what a subclass changes).
  is_causal: ClassVar[bool] = True

  @nn.compact
  def __call__(self, tokens: Array, *, padding_mask: Optional[Array] = None,
               deterministic: bool = True) -> Array:
    """tokens: `[B, T]` ids; padding_mask: `[B, T]` bool, True for real tokens.

    Returns:
      `[B, T, vocab_size]` float32 logits; position t predicts token t + 1
      (causal), or token t itself where it was masked (`MaskedLanguageModel`).
    """
    x = Encoder(self.config, name="encoder")(tokens, padding_mask=padding_mask,
                                             is_causal=self.is_causal,
                                             deterministic=deterministic)  # [B, T, E]
    logits = nn.Dense(
        self.config.vocab_size, use_bias=False, dtype=self.config.jnp_dtype,
        kernel_init=nn.with_logical_partitioning(nn.initializers.lecun_normal(),
                                                 (axes.EMBED, axes.VOCAB)),
        name="lm_head")(x)
    return nn.with_logical_constraint(logits.astype(jnp.float32), (
        axes.ACTIVATION_BATCH, axes.ACTIVATION_LENGTH, axes.ACTIVATION_VOCAB))


class MaskedLanguageModel(LanguageModel):
  """A masked language model (Devlin et al. 2019): the same encoder and head
  as `LanguageModel`, the encoder run both ways. Its inputs have some tokens
  replaced by the [MASK] id, the vocabulary's last (`objectives`'s
  "masked_token" draws them), and it is scored on those positions.

  Attributes:
    config: the model config; `vocab_size` counts the [MASK] id.
  """

  is_causal: ClassVar[bool] = False
