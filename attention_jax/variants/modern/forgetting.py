"""Forgetting attention (FoX, Lin et al. 2025), `forgetting`.

Softmax attention with a data-dependent forget gate per head and token,
f_t = sigmoid(w_h . x_t + b_h), whose products down-weight older keys (eq. 4):

    out_i = sum_j softmax_j(q_i . k_j * scale + D_ij) v_j,
    D_ij = sum_{l = j + 1}^{i} log f_l = c_i - c_j,   c_t = sum_{l <= t} log f_l,

a score change that reads two arrays (c at the queries and at the keys), so it
runs on the flex engine as a score_mod (`mods.cumulative_decay`): the blockwise
loops and the kernels apply it per tile, and the gate's gradient comes back
through the kernel's backward pass. The paper's FoX needs no position
encoding. Causal only: a later key would have a growing bias, so a call
needs `is_causal=True` or a mask that hides each query's later keys (what
`MultiHeadAttention` passes while decoding from a cache).

Decoding keeps every cached position's c beside the KV cache (`ForgetGate`'s
own cache entries), so a new token's query sees c_i - c_j for every cached key.
"""

from __future__ import annotations

from typing import ClassVar, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from attention_jax import registry
from attention_jax.core import mods as mod_lib
from attention_jax.flex import flex_attention

Array = jax.Array


def forgetting_attention(query: Array, key: Array, value: Array, bias: Optional[Array] = None,
                         mask: Optional[Array] = None, *, query_log_decay: Array,
                         key_log_decay: Array, score_mod: Optional[mod_lib.ScoreMod] = None,
                         scale: Optional[float] = None, local_window_size=None,
                         implementation: Optional[str] = None, dropout_rate: float = 0.0,
                         dropout_rng: Optional[Array] = None, is_causal: bool = False,
                         query_seq_lengths=None, key_value_seq_lengths=None,
                         segment_ids=None) -> Array:
  """Forgetting attention: `[B, Tq, H, Dv]`.

  Args:
    query, key, value, bias, mask, is_causal, query_seq_lengths,
      key_value_seq_lengths, segment_ids, local_window_size, scale: as
      `dot_product_attention`.
    query_log_decay: `[B, Tq, H]`, c at each query (cumulative log forget gates).
    key_log_decay: `[B, Tk, H]`, c at each key (in self-attention, the same).
    score_mod: applied after the decay (the layer's ALiBi or T5 bias).
    implementation: `flex_attention`'s ("blockwise" by default).
    dropout_rate, dropout_rng: dropout on the weights ("blockwise", "xla").
  """
  if not is_causal and mask is None:
    raise ValueError("forgetting attention is causal: pass is_causal=True, or a mask that "
                     "hides each query's later keys (as decoding from a cache does); got "
                     "is_causal=False and mask=None.")
  batch, q_len, num_heads = query.shape[:3]
  kv_len = key.shape[1]
  for name, array, length in (("query_log_decay", query_log_decay, q_len),
                              ("key_log_decay", key_log_decay, kv_len)):
    if tuple(jnp.shape(array)) != (batch, length, num_heads):
      raise ValueError(f"{name} must be [B, T, H] = [{batch}, {length}, {num_heads}], got "
                       f"shape {list(jnp.shape(array))}.")
  decay = mod_lib.cumulative_decay(jnp.swapaxes(query_log_decay, 1, 2).astype(jnp.float32),
                                   jnp.swapaxes(key_log_decay, 1, 2).astype(jnp.float32))
  chained = decay if score_mod is None else (
      lambda score, b, h, q, k: score_mod(decay(score, b, h, q, k), b, h, q, k))
  return flex_attention(
      query, key, value, score_mod=chained, scale=scale, bias=bias, mask=mask,
      is_causal=is_causal, query_seq_lengths=query_seq_lengths,
      key_value_seq_lengths=key_value_seq_lengths, local_window_size=local_window_size,
      segment_ids=segment_ids, implementation=implementation, dropout_rate=dropout_rate,
      dropout_rng=dropout_rng)


class ForgetGate(nn.Module):
  """The forget gates from the layer input, as cumulative log gates.

  Reads the layer's input x `[B, T, E]` (`reads_layer_input`): log f =
  log sigmoid(x W + b), W `[E, H]`, summed along the tokens. With `decode`
  (set by `MultiHeadAttention`), the cache collection holds every position's
  c and the count of tokens seen: a step's c continues from the last one.

  Attributes:
    forget_bias_init: b's initial value (0: gates start at 1/2).
    decode: keep the cumulative gates of the decoded tokens.
  """

  forget_bias_init: float = 0.0
  decode: bool = False
  reads_layer_input: ClassVar[bool] = True

  @nn.compact
  def __call__(self, query, key, value, deterministic: bool = True, *, inputs: Array) -> dict:
    del key, value, deterministic
    num_heads = query.shape[2]
    logits = nn.Dense(num_heads, bias_init=nn.initializers.constant(self.forget_bias_init),
                      name="forget_gate")(inputs)
    log_forget = jax.nn.log_sigmoid(logits.astype(jnp.float32))  # [B, T, H]
    cumulative = jnp.cumsum(log_forget, axis=1)
    if not self.decode:
      return dict(query_log_decay=cumulative, key_log_decay=cumulative)
    initialised = self.has_variable("cache", "cumulative_log_forget")
    cached = self.variable("cache", "cumulative_log_forget", jnp.zeros, cumulative.shape,
                           jnp.float32)
    index = self.variable("cache", "cache_index", lambda: jnp.array(0, jnp.int32))
    if not initialised:  # the full-length input that sizes the cache
      return dict(query_log_decay=cumulative, key_log_decay=cumulative)
    start = index.value
    last = jax.lax.dynamic_index_in_dim(cached.value, jnp.maximum(start - 1, 0), axis=1,
                                        keepdims=False)
    new = cumulative + jnp.where(start > 0, last, 0.0)[:, None, :]
    cached.value = jax.lax.dynamic_update_slice(cached.value, new, (0, start, 0))
    index.value = start + new.shape[1]
    return dict(query_log_decay=new, key_log_decay=cached.value)


registry.register(registry.VariantSpec(
    name="forgetting", fn=forgetting_attention, family="modern",
    complexity="O(T^2); O(T w) with a window", subquadratic=False, exact=False, causal=True,
    cross=False, bidirectional=False, steps_from_cache=True, paper="Lin et al. 2025",
    extras=ForgetGate,
    takes=("dropout", "score_mod"),
    options=dict(
        forget_bias_init="the forget gates' bias at initialisation (0: f = 1/2)",
        local_window_size=registry.VariantOption(
            "local_window_size", tuple, None,
            "(left, right): each query sees keys q - left .. q + right; None for all"),
        scale="multiplies the logits; 1/sqrt(D) when None",
        implementation="'blockwise' (default), 'pallas_gpu', 'pallas_tpu' or 'xla' (the "
                       "dense reference)")))
