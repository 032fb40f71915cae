"""Multi-head mechanisms: MHA, multi-query and grouped-query attention.

The pure function takes the projection kernels as arrays; the Flax module is
`attention_jax.MultiHeadAttention`, which owns them (named in the registry by
its path, so this file imports no layer).
"""

from __future__ import annotations

from typing import Callable, Optional

import jax.numpy as jnp

from attention_jax import registry
from attention_jax.variants.dense import dot_product_attention

Array = jnp.ndarray


def multi_head_attention(
    inputs_q: Array,
    inputs_kv: Optional[Array],
    query_kernel: Array,
    key_kernel: Array,
    value_kernel: Array,
    out_kernel: Array,
    *,
    attention_fn: Callable[..., Array] = dot_product_attention,
    sum_of_heads: bool = False,
    **attention_kwargs,
) -> Array:
  """Concat(head_1, ..., head_H) W^O with head_i = attention(x W_i^Q, c W_i^K, c W_i^V).

  Args:
    inputs_q: `[B, Tq, E]`.
    inputs_kv: `[B, Tk, Ec]`, or None for self-attention.
    query_kernel: `[E, H, D]`.
    key_kernel, value_kernel: `[Ec, Hkv, D]`; Hkv = H (MHA), 1 (MQA) or a divisor (GQA).
    out_kernel: `[H, D, O]`.
    attention_fn: the pure attention function applied to the heads.
    sum_of_heads: compute sum_i head_i W_i^O instead of the concatenation; the
      two are the same linear map, written the way each paper writes it.
    **attention_kwargs: forwarded to `attention_fn` (mask, is_causal, ...).

  Returns:
    `[B, Tq, O]`.
  """
  inputs_kv = inputs_q if inputs_kv is None else inputs_kv
  query = jnp.einsum("bte,ehd->bthd", inputs_q, query_kernel)
  key = jnp.einsum("bte,ehd->bthd", inputs_kv, key_kernel)
  value = jnp.einsum("bte,ehd->bthd", inputs_kv, value_kernel)
  heads = attention_fn(query, key, value, **attention_kwargs)  # [B, Tq, H, D]
  if sum_of_heads:
    return jnp.einsum("bthd,hdo->bto", heads, out_kernel)
  batch, q_len, num_heads, head_dim = heads.shape
  concatenated = heads.reshape(batch, q_len, num_heads * head_dim)
  return concatenated @ out_kernel.reshape(num_heads * head_dim, -1)


# The heads run dot-product attention, so they take its options.
_HEADS = dict(fn=multi_head_attention, family="heads", complexity="O(T^2)", subquadratic=False,
              exact=True, causal=True, cross=True, qkv=False, mixer=registry.ATTENTION_MIXER,
              options=dict(
                  implementation=registry.VariantOption(
                      "implementation", str, None,
                      "'xla', 'blockwise', 'pallas', 'cudnn', ...; None picks the best here"),
                  local_window_size=registry.VariantOption(
                      "local_window_size", tuple, None,
                      "(left, right): each query sees keys q - left .. q + right; None for all"),
                  scale=registry.VariantOption("scale", float, None,
                                               "multiplies the logits; 1/sqrt(D) when None")))
registry.register(registry.VariantSpec(name="multi_head", paper="Vaswani et al. 2017", **_HEADS))
registry.register(registry.VariantSpec(name="multi_query", paper="Shazeer 2019",
                                       module_defaults={"num_kv_heads": 1}, **_HEADS))
# Grouped-query attention: pass num_kv_heads (a divisor of num_heads) to the module.
registry.register(registry.VariantSpec(name="grouped_query", paper="Ainslie et al. 2023",
                                       **_HEADS))
