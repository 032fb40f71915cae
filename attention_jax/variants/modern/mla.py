"""Multi-head latent attention (DeepSeek-AI 2024, DeepSeek-V2 section 2.1), `mla`.

Keys and values come from one low-rank latent per token, and positions from a
small key shared by the heads, so that decoding caches only those two:

    c_KV = RMSNorm(W_DKV h)                   [d_c]       (eq. 9)
    k_C = W_UK c_KV,  v = W_UV c_KV           [H, d_h]    (eqs. 10, 11)
    k_R = RoPE(W_KR h)                        [d_R]       (eq. 15; one for all heads)
    c_Q = RMSNorm(W_DQ h),  q_C = W_UQ c_Q,  q_R = RoPE(W_QR c_Q)   (eqs. 12-14)
    o = softmax([q_C; q_R] . [k_C; k_R] / sqrt(d_h + d_R)) v,  out = W_O o

Decoding caches [c_KV; k_R], d_c + d_R numbers per token, where multi-head
attention caches 2 H d_h. The absorbed path (section 2.1.2) never rebuilds
the keys and values: q_C . (W_UK c) = (W_UK^T q_C) . c folds the key
up-projection into the query, and sum_j a_j W_UV c_j = W_UV sum_j a_j c_j folds
the value up-projection into the output, so a step is multi-query attention
over the latents, `[B, Tq, H, d_c + d_R]` against `[B, L, 1, d_c + d_R]`.
Both paths run `dot_product_attention`, so every exact implementation serves.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from attention_jax import positional, registry
from attention_jax.core.masks import make_attention_mask
from attention_jax.variants import common
from attention_jax.variants.dense import dot_product_attention

Array = jnp.ndarray
RMS_EPSILON = 1e-6


def latent_attention(query_content: Array, query_rope: Array, kv_latent: Array, key_rope: Array,
                     key_up: Array, value_up: Array, *, absorb: bool,
                     mask: Optional[Array] = None, is_causal: bool = False,
                     query_seq_lengths: Optional[Array] = None,
                     key_value_seq_lengths: Optional[Array] = None, segment_ids=None,
                     implementation: Optional[str] = None, dropout_rate: float = 0.0,
                     dropout_rng: Optional[jax.Array] = None) -> Array:
  """Attention over latent keys and values: `[B, Tq, H, d_h]`.

  Args:
    query_content: q_C `[B, Tq, H, d_h]`.
    query_rope: q_R `[B, Tq, H, d_R]`, rotated.
    kv_latent: c_KV `[B, Tk, d_c]`.
    key_rope: k_R `[B, Tk, d_R]`, rotated, shared by the heads.
    key_up: W_UK `[d_c, H, d_h]`.
    value_up: W_UV `[d_c, H, d_h]`.
    absorb: fold W_UK into the queries and W_UV into the output (the decoding
      path); False: rebuild k_C and v (the training path). Equal results.
      No default: the layer's `absorb` field holds the option's one, which
      the registry reports and a config's value is compared with.
    mask, is_causal, query_seq_lengths, key_value_seq_lengths, segment_ids,
      implementation, dropout_rate, dropout_rng: as `dot_product_attention`.
  """
  head_dim, rope_dim = query_content.shape[-1], query_rope.shape[-1]
  scale = 1.0 / math.sqrt(head_dim + rope_dim)
  masks = dict(mask=mask, is_causal=is_causal, query_seq_lengths=query_seq_lengths,
               key_value_seq_lengths=key_value_seq_lengths, segment_ids=segment_ids,
               implementation=implementation, dropout_rate=dropout_rate,
               dropout_rng=dropout_rng, scale=scale)
  num_heads = query_content.shape[2]
  if not absorb:
    key_content = jnp.einsum("btc,chd->bthd", kv_latent, key_up)
    value = jnp.einsum("btc,chd->bthd", kv_latent, value_up)
    shared_rope = jnp.broadcast_to(key_rope[:, :, None], key_rope.shape[:2] + (num_heads,
                                                                               rope_dim))
    query = jnp.concatenate([query_content, query_rope], axis=-1)
    key = jnp.concatenate([key_content, shared_rope.astype(key_content.dtype)], axis=-1)
    return dot_product_attention(query, key, value, **masks)
  query_latent = jnp.einsum("bqhd,chd->bqhc", query_content, key_up)
  query = jnp.concatenate([query_latent, query_rope.astype(query_latent.dtype)], axis=-1)
  key = jnp.concatenate([kv_latent, key_rope.astype(kv_latent.dtype)], axis=-1)[:, :, None]
  context = dot_product_attention(query, key, kv_latent[:, :, None], **masks)  # [B, Tq, H, d_c]
  return jnp.einsum("bqhc,chd->bqhd", context, value_up)


def _rms_norm(x: Array, scale: Array) -> Array:
  x32 = x.astype(jnp.float32)
  normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + RMS_EPSILON)
  return (normed * scale).astype(x.dtype)


class MultiHeadLatentAttention(nn.Module):
  """MLA as a token mixer (the mixer contract), with its latent KV cache.

  Attributes:
    num_heads: H.
    head_dim: d_h, the content part of a head; width / H when None.
    latent_dim: d_c, the KV latent; min(4 d_h, width) when None (DeepSeek-V2:
      4 d_h). At most the model width.
    query_latent_dim: d_c', the query latent; min(12 d_h, width) when None
      (DeepSeek-V2: 1536 = 12 d_h).
    rope_dim: d_R, the decoupled RoPE part of queries and keys; d_h / 2 when
      None (DeepSeek-V2's 64 for d_h = 128). Even.
    max_wavelength: RoPE's base.
    absorb: decode through the absorbed path (the default; False rebuilds
      keys and values from the cache each step).
    dropout_rate: on the attention weights.
    dtype, param_dtype: computation and parameter dtypes.
    decode: cache [c_KV; k_R] per token in the "cache" collection.
  """

  num_heads: int
  head_dim: Optional[int] = None
  latent_dim: Optional[int] = None
  query_latent_dim: Optional[int] = None
  rope_dim: Optional[int] = None
  max_wavelength: float = 10_000.0
  absorb: bool = True
  dropout_rate: float = 0.0
  dtype: Optional[Any] = None
  param_dtype: Any = jnp.float32
  decode: bool = False

  def sizes(self, width: int):
    """`(d_h, d_c, d_c', d_R)` for a model of this width, checked."""
    head_dim = common.check_size("head_dim", self.head_dim or width // self.num_heads)
    latent = self.latent_dim or min(4 * head_dim, width)
    query_latent = self.query_latent_dim or min(12 * head_dim, width)
    rope_dim = self.rope_dim or max(2, head_dim // 2)
    for name, value in (("latent_dim", latent), ("query_latent_dim", query_latent)):
      common.check_size(name, value)
      if value > width:
        raise ValueError(f"mla's {name} ({value}) must be at most the model width {width}: a "
                         f"latent is a compression of the token's vector.")
    if common.check_size("rope_dim", rope_dim) % 2:
      raise ValueError(f"mla's rope_dim must be even (RoPE rotates pairs), got {rope_dim}.")
    return head_dim, latent, query_latent, rope_dim

  @nn.compact
  def __call__(self, x: Array, context: Optional[Array] = None, *, mask=None,
               is_causal: bool = False, query_seq_lengths=None, key_value_seq_lengths=None,
               segment_ids=None, positions=None, deterministic: bool = True, carry=None):
    """The mixer contract. x: `[B, T, E]`; positions `[B, T]` or `[T]` for
    RoPE (`arange(T)`, offset by the cache while decoding). Returns
    `[B, T, E]` (with the carry when given one)."""
    common.reject_unsupported("mla", context=context)
    batch, length, width = x.shape
    head_dim, latent, query_latent, rope_dim = self.sizes(width)
    dtype = self.dtype or jnp.promote_types(x.dtype, self.param_dtype)
    init = nn.initializers.lecun_normal()
    # A kernel into the heads, [d_in, H, d], has fan-in d_in: lecun_normal's
    # default axes read it as H d_in and started q, k and v sqrt(H) too small.
    # The output kernel [H, d_h, E] sums over H d_h, which the default reads.
    into_heads = nn.initializers.lecun_normal(in_axis=0, out_axis=(1, 2))

    def param(name, *shape, initializer=init):
      return self.param(name, initializer, shape, self.param_dtype).astype(dtype)

    ones = lambda name, size: self.param(name, nn.initializers.ones, (size,), self.param_dtype)
    x = x.astype(dtype)
    kv_latent = _rms_norm(x @ param("kv_down", width, latent), ones("kv_norm", latent))
    query_latent_x = _rms_norm(x @ param("query_down", width, query_latent),
                               ones("query_norm", query_latent))
    query_content = jnp.einsum("btc,chd->bthd", query_latent_x,
                               param("query_up", query_latent, self.num_heads, head_dim,
                                     initializer=into_heads))
    query_rope = jnp.einsum("btc,chd->bthd", query_latent_x,
                            param("query_rope", query_latent, self.num_heads, rope_dim,
                                  initializer=into_heads))
    key_rope = x @ param("key_rope", width, rope_dim)

    q_positions = jnp.arange(length) if positions is None else positions
    q_offset = 0
    absorb = False
    decoding = self.decode and self.has_variable("cache", "cached_latent")
    if decoding:
      q_offset = self.get_variable("cache", "cache_index")
      q_positions = q_positions + q_offset
    rotate = lambda a, p: positional.apply_rope(a, p, max_wavelength=self.max_wavelength)
    query_rope = rotate(query_rope, q_positions)
    key_rope = rotate(key_rope[:, :, None], q_positions)[:, :, 0]
    if decoding:
      kv_latent, key_rope = self._update_cache(kv_latent, key_rope)
      mask = make_attention_mask(length, kv_latent.shape[1], is_causal=True, q_offset=q_offset,
                                 mask=mask)
      is_causal, absorb = False, self.absorb
    elif self.decode:  # initialisation with the full length sizes the cache
      self.variable("cache", "cached_latent", jnp.zeros, kv_latent.shape, kv_latent.dtype)
      self.variable("cache", "cached_key_rope", jnp.zeros, key_rope.shape, key_rope.dtype)
      self.variable("cache", "cache_index", lambda: jnp.array(0, jnp.int32))
      is_causal = True
    dropout_rng = (self.make_rng("dropout") if self.dropout_rate > 0.0 and not deterministic
                   else None)
    out = latent_attention(
        query_content, query_rope, kv_latent, key_rope,
        param("key_up", latent, self.num_heads, head_dim, initializer=into_heads),
        param("value_up", latent, self.num_heads, head_dim, initializer=into_heads),
        absorb=absorb, mask=mask,
        is_causal=is_causal, query_seq_lengths=query_seq_lengths,
        key_value_seq_lengths=key_value_seq_lengths, segment_ids=segment_ids,
        dropout_rate=self.dropout_rate if dropout_rng is not None else 0.0,
        dropout_rng=dropout_rng)
    y = jnp.einsum("bthd,hde->bte", out, param("out", self.num_heads, head_dim, width))
    return common.mixer_output(y, carry)

  def _update_cache(self, kv_latent: Array, key_rope: Array):
    """Writes the new tokens' [c_KV; k_R] at the cache index; returns the whole cache."""
    cached_latent = self.variable("cache", "cached_latent")
    cached_rope = self.variable("cache", "cached_key_rope")
    index = self.variable("cache", "cache_index")
    new_len, max_len = kv_latent.shape[1], cached_latent.value.shape[1]
    common.check_cache_room(index.value, new_len, max_len)
    cached_latent.value = jax.lax.dynamic_update_slice(cached_latent.value, kv_latent,
                                                       (0, index.value, 0))
    cached_rope.value = jax.lax.dynamic_update_slice(cached_rope.value, key_rope,
                                                     (0, index.value, 0))
    index.value = index.value + new_len
    return cached_latent.value, cached_rope.value


registry.register(registry.VariantSpec(
    name="mla", fn=latent_attention, family="modern", complexity="O(T^2)",
    subquadratic=False, exact=False, causal=True, cross=False, paper="DeepSeek-AI 2024",
    qkv=False, mixer=MultiHeadLatentAttention,
    options=dict(
        head_dim="d_h, each head's content part; width / H when None",
        latent_dim="d_c, the KV latent cached per token; min(4 d_h, width) when None",
        query_latent_dim="d_c', the query latent; min(12 d_h, width) when None",
        rope_dim="d_R, the decoupled RoPE key (shared by the heads) and query part; d_h / 2 "
                 "when None",
        max_wavelength="RoPE's base",
        absorb="decode with W_UK folded into the queries and W_UV into the output")))
