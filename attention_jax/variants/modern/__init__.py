"""The attention of 2023-2026 (VARIANTS.md K): one module per mechanism, each
with its pure function, its module and its registration:

  differential.py    two softmax maps subtracted with a learned lambda: differential
  stick_breaking.py  weights as breaks of a stick over the earlier keys: stick_breaking
  sigmoid.py         each weight a sigmoid of its logit, no normalisation: sigmoid
  forgetting.py      softmax with data-dependent forget gates (FoX): forgetting
  mla.py             multi-head latent attention, a latent KV cache: mla
  moba.py            top-k key blocks per query by pooled-key gating: moba
  nsa.py             compressed, selected and sliding branches with gates: nsa

Importing this package registers the variants of every module.
"""

from attention_jax.variants.modern.differential import (DifferentialParameters,
                                                        differential_attention)
from attention_jax.variants.modern.stick_breaking import stick_breaking_attention
from attention_jax.variants.modern.sigmoid import sigmoid_attention
from attention_jax.variants.modern.forgetting import ForgetGate, forgetting_attention
from attention_jax.variants.modern.mla import MultiHeadLatentAttention, latent_attention
from attention_jax.variants.modern.moba import block_choice, moba_attention
from attention_jax.variants.modern.nsa import NSAParameters, nsa_attention
