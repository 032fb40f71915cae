"""A causal (decoder-only) language model: the encoder run causally, then logits
over the vocabulary at every position."""

from __future__ import annotations

from typing import Optional

import flax.linen as nn
import jax.numpy as jnp

from attention_jax.models.encoder import Encoder

Array = jnp.ndarray


class LanguageModel(nn.Module):
  """Next-token logits.

  Attributes:
    encoder: the (unbound) `Encoder`, run with `is_causal=True`; its attention
      variant must support causal masking.
  """

  encoder: Encoder

  @nn.compact
  def __call__(self, tokens: Array, *, padding_mask: Optional[Array] = None,
               deterministic: bool = True) -> Array:
    """tokens: `[B, T]` ids; padding_mask: `[B, T]` bool, True for real tokens.

    Returns:
      `[B, T, vocab_size]` float32 logits; position t predicts token t + 1.
    """
    x = self.encoder(tokens, padding_mask=padding_mask, is_causal=True,
                     deterministic=deterministic)  # [B, T, E]
    logits = nn.Dense(
        self.encoder.vocab_size, use_bias=False, dtype=self.encoder.dtype,
        param_dtype=self.encoder.param_dtype,
        kernel_init=nn.with_logical_partitioning(nn.initializers.lecun_normal(),
                                                 ("embed", "vocab")),
        name="lm_head")(x)
    return nn.with_logical_constraint(logits.astype(jnp.float32), ("batch", "length", "vocab"))
