"""Sigmoid attention (Ramapuram et al. 2024), `sigmoid`.

Each weight is a sigmoid of its own logit, with no normalisation over the row:

    out_i = sum_j sigmoid(q_i . k_j * scale + b) v_j,   b = -log(Tk) by default,

the bias keeping the row's total weight near that of a softmax at the start
of training (the paper's Theorem and section 3.2; it pairs it with ALiBi or
RoPE). It is `flex_attention` with `normaliser="sigmoid"`, so the blockwise
loops and the Pallas kernels run it, skipping empty blocks of its masks, and
position biases reach it as score_mods. A masked key weighs 0, so a row that
sees no key returns zeros. Tk is the keys' axis, padding included (not
`key_value_seq_lengths`), so b is one constant for the batch; in decoding it
is the cache's length, as in the full pass over a sequence of that length.
Set `sigmoid_bias` to fix b whatever the padding or cache.
"""

from __future__ import annotations

from typing import Optional

import jax

from attention_jax import registry
from attention_jax.core import mods as mod_lib
from attention_jax.flex import flex_attention

Array = jax.Array


def sigmoid_attention(query: Array, key: Array, value: Array, bias: Optional[Array] = None,
                      mask: Optional[Array] = None, *, sigmoid_bias: Optional[float] = None,
                      score_mod: Optional[mod_lib.ScoreMod] = None,
                      scale: Optional[float] = None, local_window_size=None,
                      implementation: Optional[str] = None, dropout_rate: float = 0.0,
                      dropout_rng: Optional[Array] = None, is_causal: bool = False,
                      query_seq_lengths=None, key_value_seq_lengths=None,
                      segment_ids=None) -> Array:
  """Sigmoid attention: `[B, Tq, H, Dv]`.

  Args:
    query, key, value, bias, mask, is_causal, query_seq_lengths,
      key_value_seq_lengths, segment_ids, local_window_size, scale: as
      `dot_product_attention`.
    sigmoid_bias: b; -log(Tk) when None.
    score_mod: applied to the scaled logits before the sigmoid
      (`MultiHeadAttention` passes its ALiBi or T5 bias as one).
    implementation: `flex_attention`'s: "blockwise" (default), "pallas_gpu",
      "pallas_tpu" or "xla" (the dense reference).
    dropout_rate, dropout_rng: dropout on the weights ("blockwise", "xla").
  """
  return flex_attention(
      query, key, value, score_mod=score_mod, scale=scale, normaliser="sigmoid",
      sigmoid_bias=sigmoid_bias, bias=bias, mask=mask, is_causal=is_causal,
      query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
      local_window_size=local_window_size, segment_ids=segment_ids,
      implementation=implementation, dropout_rate=dropout_rate, dropout_rng=dropout_rng)


registry.register(registry.VariantSpec(
    name="sigmoid", fn=sigmoid_attention, family="modern", complexity="O(T^2); O(T w) with a window",
    subquadratic=False, exact=False, causal=True, cross=True, paper="Ramapuram et al. 2024",
    takes=("dropout", "score_mod"),
    options=dict(
        sigmoid_bias="b in sigmoid(logit + b); -log(Tk) when None",
        local_window_size=registry.VariantOption(
            "local_window_size", tuple, None,
            "(left, right): each query sees keys q - left .. q + right; None for all"),
        scale="multiplies the logits; 1/sqrt(D) when None",
        implementation="'blockwise' (default), 'pallas_gpu', 'pallas_tpu' or 'xla' (the "
                       "dense reference)")))
