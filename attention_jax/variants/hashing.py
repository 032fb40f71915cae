"""Content-based sparsity: each query attends to the keys its content selects.

* `lsh`: Reformer's shared-QK attention over locality-sensitive hash buckets
  (Kitaev et al. 2020).
* `routing`: Routing Transformer, attention within online k-means clusters
  (Roy et al. 2021).
* `sinkhorn`: Sparse Sinkhorn attention, each block attends to itself and to a
  learned soft permutation of the key blocks (Tay et al. 2020).
* `clustered`: queries grouped by k-means share their centroid's attention
  (Vyas et al. 2020).

All four select keys by sorting, top-k or clustering and then attend over
fixed-size groups that are gathered and reshaped into blocks, so no `T x T`
array is ever built. They are approximations of softmax attention; each
docstring names the special case in which it is exact.

Shared conventions: the work is done in the layout `[B, H, T, D]`; grouped
K/V heads are repeated (O(T) memory); padding comes from
`common.key_padding` and `common.zero_padded_queries`; sorting and clustering
decisions are integer indices, so no gradient flows through them.
"""

from __future__ import annotations

import math

from typing import Optional, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from attention_jax import registry
from attention_jax.core.softmax import masked_softmax
from attention_jax.variants import common

Array = jnp.ndarray

# Reformer's penalty on a token attending to itself: large enough to remove
# self-attention whenever another key is allowed, finite so that a token with no
# other key (the first token under a causal mask) still attends to itself.
SELF_ATTENTION_PENALTY = 1e5


def _heads_first(x: Array) -> Array:
  """`[B, T, H, D]` -> `[B, H, T, D]`."""
  return jnp.swapaxes(x, 1, 2)


def _normalize(x: Array, eps: float = 1e-6) -> Array:
  """Unit vectors along the last axis (zero vectors stay zero, with zero
  gradients: x / max(|x|, eps) written so that no sqrt is differentiated at 0,
  which gave NaN for the zero rows a padded sequence adds)."""
  return x * jax.lax.rsqrt(jnp.maximum(jnp.sum(jnp.square(x), axis=-1, keepdims=True), eps * eps))


def _attend(query: Array, key: Array, value: Array, allowed: Optional[Array], scale: float,
            logit_bias: Optional[Array] = None) -> Tuple[Array, Array]:
  """Softmax attention over one gathered group of keys, with its log-normaliser.

  Args:
    query: `[..., n, D]`.
    key: `[..., m, D]`.
    value: `[..., m, Dv]`.
    allowed: boolean broadcastable to `[..., n, m]`, or None.
    scale: logit scale.
    logit_bias: added to the logits, broadcastable to `[..., n, m]`.

  Returns:
    `(out [..., n, Dv], lse [..., n])`: the normalised output and the
    log-sum-exp of the allowed logits, so that groups can be merged later
    (`-inf` and a zero output for a query with no allowed key; never NaN).
  """
  logits = jnp.einsum("...nd,...md->...nm", query, key) * scale
  if logit_bias is not None:
    logits = logits + logit_bias
  if allowed is not None:
    logits = jnp.where(allowed, logits, -jnp.inf)
  row_max = jnp.max(logits, axis=-1, keepdims=True)
  row_max = jax.lax.stop_gradient(jnp.where(jnp.isfinite(row_max), row_max, 0.0))
  unnormalized = jnp.exp(logits - row_max)
  normalizer = jnp.sum(unnormalized, axis=-1)
  attended = normalizer > 0.0
  safe_normalizer = jnp.where(attended, normalizer, 1.0)
  out = jnp.einsum("...nm,...mv->...nv", unnormalized, value) / safe_normalizer[..., None]
  lse = jnp.where(attended, jnp.log(safe_normalizer) + row_max[..., 0], -jnp.inf)
  return out, lse


def _merge_by_lse(outputs: Array, lse: Array, axis: int = 0) -> Array:
  """Merges attention outputs over key groups into attention over their union.

  outputs: `[..., Dv]` with the groups along `axis`; lse: the same without the
  last axis. Each group's output is weighted by its share of the total
  normaliser, exp(lse_r) / sum_r exp(lse_r); groups with nothing attended
  (lse = -inf) get weight 0.
  """
  weights = masked_softmax(lse, jnp.isfinite(lse), axis=axis)
  return jnp.sum(weights[..., None] * outputs, axis=axis)


def _check_self_attention(variant: str, query: Array, key: Array) -> None:
  if query.shape[1] != key.shape[1]:
    raise ValueError(f"attention variant {variant!r} is self-attention only: the key length "
                     f"({key.shape[1]}) must equal the query length ({query.shape[1]}).")


def _valid_keys(variant: str, mask, key_value_seq_lengths, batch: int, length: int) -> Array:
  """`[B, T]` bool: the keys that may be attended (all when no padding is given)."""
  valid = common.key_padding(variant, mask, key_value_seq_lengths, batch, length)
  return jnp.ones((batch, length), bool) if valid is None else valid


def _padded_to_multiple(variant: str, multiple: int, query: Array, key: Array, value: Array,
                        mask: Optional[Array], key_value_seq_lengths: Optional[Array]):
  """q, k, v `[B, T, ...]` zero-padded to T' = the next multiple of `multiple`,
  and the key mask `[B, 1, 1, T']` that masks the added keys (and the given
  padding); None when T is already a multiple. For the block and chunk
  variants, so that a sequence of any length (T + 1 with a [CLS] token) runs
  without a pooling change; the caller drops the added queries' outputs."""
  batch, length = query.shape[:2]
  padded = -(-length // multiple) * multiple
  if padded == length:
    return None
  valid = _valid_keys(variant, mask, key_value_seq_lengths, batch, length)
  def extend(x):
    if isinstance(x, jax.ShapeDtypeStruct):  # a projection the layer did not make (LSH's key)
      return jax.ShapeDtypeStruct((x.shape[0], padded) + tuple(x.shape[2:]), x.dtype)
    return jnp.pad(x, [(0, 0), (0, padded - length)] + [(0, 0)] * (x.ndim - 2))
  return extend(query), extend(key), extend(value), extend(valid)[:, None, None, :]


def _gather(x: Array, indices: Array) -> Array:
  """x `[..., T, D]`, indices `[..., n]` (same or broadcastable leading axes) -> `[..., n, D]`."""
  indices = jnp.broadcast_to(indices, jnp.broadcast_shapes(indices.shape, x.shape[:-2] + (1,)))
  x = jnp.broadcast_to(x, indices.shape[:-1] + x.shape[-2:])
  return jnp.take_along_axis(x, indices[..., None], axis=-2)


# ---------------------------------------------------------------------------
# LSH attention (Reformer).
# ---------------------------------------------------------------------------


def fixed_rotations(dim: int, n_buckets: int, n_hashes: int) -> Array:
  """The rotations of `fixed_rotations=True`: `[n_hashes, 1, D, n_buckets / 2]`
  float32 from `PRNGKey(0)`, one per round shared by every head, layer and step
  (as the LRA release draws them, from a fixed key, in every call)."""
  return jax.random.normal(jax.random.PRNGKey(0), (n_hashes, 1, dim, n_buckets // 2))


def _hash_buckets(vectors: Array, rng: Optional[jax.Array], n_buckets: int,
                  n_hashes: int) -> Array:
  """Angular LSH: bucket = argmax([x R, -x R]) for a random rotation R per round.

  vectors: `[B, H, T, D]` -> `[n_hashes, B, H, T]` int32 in [0, n_buckets).
  One rotation `[D, n_buckets / 2]` per round and head, drawn from `rng`; with
  `rng=None` the `fixed_rotations`, the same for every head.
  """
  batch, heads, length, dim = vectors.shape
  if n_buckets == 1:
    return jnp.zeros((n_hashes, batch, heads, length), jnp.int32)
  if rng is None:
    rotations = fixed_rotations(dim, n_buckets, n_hashes).astype(vectors.dtype)
  else:
    rotations = jax.random.normal(rng, (n_hashes, heads, dim, n_buckets // 2), vectors.dtype)
  rotated = jnp.einsum("bhtd,rhdn->rbhtn", vectors, rotations)
  return jnp.argmax(jnp.concatenate([rotated, -rotated], axis=-1), axis=-1).astype(jnp.int32)


def _chunks(x: Array, chunk_size: int, axis: int) -> Array:
  """Splits `axis` (length T) into `[T / chunk_size, chunk_size]`."""
  axis = axis % x.ndim
  return x.reshape(x.shape[:axis] + (-1, chunk_size) + x.shape[axis + 1:])


def _with_previous_chunk(x: Array, chunk_axis: int) -> Array:
  """Appends chunk i - 1 (cyclically) to chunk i: the chunk's axis after
  `chunk_axis` doubles. With a single chunk there is no other chunk to add."""
  chunk_axis = chunk_axis % x.ndim
  if x.shape[chunk_axis] == 1:
    return x
  return jnp.concatenate([x, jnp.roll(x, 1, axis=chunk_axis)], axis=chunk_axis + 1)


def lsh_attention(
    query: Array,
    key: Array,
    value: Array,
    bias: Optional[Array] = None,
    mask: Optional[Array] = None,
    *,
    is_causal: bool = False,
    query_seq_lengths: Optional[Array] = None,
    key_value_seq_lengths: Optional[Array] = None,
    segment_ids: Optional[Array] = None,
    hash_rng: Optional[jax.Array] = None,
    n_buckets: Optional[int] = None,
    n_hashes: int = 2,
    chunk_size: int = 64,
    num_chunks: Optional[int] = None,
    scale: Optional[float] = None,
    scale_exponent: float = -0.5,
    normalize_keys: bool = True,
    mask_buckets: bool = True,
    mask_padding: bool = True,
    fixed_rotations: bool = False,
) -> Array:
  """Reformer LSH attention with shared queries and keys (Kitaev et al. 2020).

  Keys are the unit-normalised queries, k_j = q_j / |q_j|; `key` only fixes
  the shapes (MultiHeadAttention's key projection is unused, Reformer shares
  it with the query's). In each of `n_hashes` rounds the queries are hashed by
  a random rotation into `n_buckets` buckets, sorted by (bucket, position) and
  split into chunks of `chunk_size`; each chunk attends to itself and to the
  previous chunk (cyclically), only to keys of the same bucket. A token
  attends to itself only when nothing else is allowed (its logit is lowered by
  `SELF_ATTENTION_PENALTY`). The rounds are merged by their log-sum-exp
  weights, with each logit lowered by log N_ij (N_ij: the rounds in which i
  and j share a bucket) so that a key found by several rounds is counted once.
  Cost O(n_hashes T chunk_size) time and memory.

  With `n_buckets=1` and `chunk_size=T` this is exactly dense shared-QK
  attention with the self penalty.

  Args:
    query: `[B, T, H, D]`; also the keys (shared QK).
    key: `[B, T, Hkv, D]`; ignored except for its length, which must be T.
    value: `[B, T, Hkv, Dv]`, Hkv dividing H.
    bias, segment_ids: not supported (ValueError).
    mask: only a key-padding mask `[B|1, 1, 1, T]`.
    is_causal: token i attends to tokens j <= i. The hashing, the sort and
      the chunks still span the whole sequence (as in Reformer): a later token
      sorted before i shifts the chunk boundaries, and so which earlier keys
      share i's two chunks, so an earlier output can change with a later
      token (not strictly autoregressive; `lsh` cannot decode).
    query_seq_lengths: `[B]`; later queries output zeros.
    key_value_seq_lengths: `[B]`; later tokens are not attended. Padded tokens
      (by lengths or mask) are sorted after every valid token, so they never
      change the chunks of valid ones; their own outputs are zero.
    hash_rng: PRNG key of the random rotations (required).
    n_buckets: 1 or an even number; by default 2 T / chunk_size, Reformer's
      choice: a chunk then holds about two buckets' worth of tokens.
    n_hashes: hashing rounds; more rounds miss fewer keys.
    chunk_size: queries per chunk; a T that it does not divide is padded to
      its next multiple (the added keys masked, their outputs dropped).
    num_chunks: when given, the chunk count instead: T is padded to a multiple
      of it and `chunk_size` is T' / num_chunks (the LRA release: 10 chunks).
    scale: multiplies the logits; D ** scale_exponent when None.
    scale_exponent: the logit scale's power of D: -0.5 (1/sqrt(D), the
      default), 0 (trax's Reformer: no scale on the normalised keys) or 0.5
      (the LRA release multiplies by sqrt(D)).
    normalize_keys: keys are the unit-normalised queries (Reformer); False
      uses the queries themselves (the LRA release).
    mask_buckets: a query attends only to keys of its own bucket, itself only
      when nothing else is allowed, and a key found by several rounds counts
      once; False attends to every key of its chunk and the previous one, with
      no self penalty (the LRA release).
    mask_padding: False ignores the padding given (mask, key_value_seq_lengths)
      and the padding added to a chunk multiple: padded keys are attended and
      hashed like the others (the LRA release, whose padded tokens carry the
      projections' biases where ours carry zeros).
    fixed_rotations: ignore `hash_rng` and hash with `fixed_rotations(...)`,
      one rotation for every head, layer and step (the LRA release).

  Returns:
    `[B, T, H, Dv]` in the query dtype.
  """
  common.reject_unsupported("lsh", bias=bias, segment_ids=segment_ids)
  _check_self_attention("lsh", query, key)
  if hash_rng is None and not fixed_rotations:
    raise ValueError("attention variant 'lsh' needs hash_rng, a PRNG key for its random "
                     "rotations (MultiHeadAttention's extras module supplies one), or "
                     "fixed_rotations=True.")
  batch, length, num_heads, head_dim = query.shape
  if num_chunks is not None:
    common.check_size("num_chunks", num_chunks)
    chunk_size = -(-length // num_chunks)
  common.check_size("chunk_size", chunk_size)
  if not mask_padding:
    # Ignored, but checked first: a pairwise or non-boolean mask is an error
    # whatever mask_padding says.
    _valid_keys("lsh", mask, key_value_seq_lengths, batch, length)
    mask = key_value_seq_lengths = None
  # num_chunks chunks of chunk_size: T' = num_chunks * chunk_size.
  multiple = chunk_size * (num_chunks or 1)
  padded = _padded_to_multiple("lsh", multiple, query, key, value, mask, key_value_seq_lengths)
  if padded is not None:
    query, key, value, mask = padded
    out = lsh_attention(query, key, value, mask=mask if mask_padding else None,
                        is_causal=is_causal, query_seq_lengths=query_seq_lengths,
                        hash_rng=hash_rng, n_buckets=n_buckets, n_hashes=n_hashes,
                        chunk_size=chunk_size, scale=scale, scale_exponent=scale_exponent,
                        normalize_keys=normalize_keys, mask_buckets=mask_buckets,
                        mask_padding=mask_padding, fixed_rotations=fixed_rotations)
    return out[:, :length]
  common.check_size("n_hashes", n_hashes)
  if n_buckets is None:
    n_buckets = 2 * length // chunk_size
  common.check_size("n_buckets", n_buckets)
  if n_buckets != 1 and n_buckets % 2:
    raise ValueError(f"n_buckets must be 1 or even (hashing takes the argmax over a rotation "
                     f"and its negation), got {n_buckets}.")
  scale = head_dim ** scale_exponent if scale is None else scale

  valid = _valid_keys("lsh", mask, key_value_seq_lengths, batch, length)  # [B, T]
  q = _heads_first(query)  # [B, H, T, D]
  k = _normalize(q) if normalize_keys else q
  v = _heads_first(common.repeat_kv_heads(value, num_heads))
  positions = jnp.arange(length)

  # Padded tokens get bucket n_buckets, after every real bucket.
  buckets = _hash_buckets(jax.lax.stop_gradient(q), None if fixed_rotations else hash_rng,
                          n_buckets, n_hashes)
  buckets = jnp.where(valid[None, :, None, :], buckets, n_buckets)  # [R, B, H, T]
  order = jnp.argsort(buckets * length + positions, axis=-1)  # [R, B, H, T]

  sorted_q = _chunks(_gather(q, order), chunk_size, -2)  # [R, B, H, n, c, D]
  sorted_k = _with_previous_chunk(_chunks(_gather(k, order), chunk_size, -2), -3)
  sorted_v = _with_previous_chunk(_chunks(_gather(v, order), chunk_size, -2), -3)
  q_pos = _chunks(order, chunk_size, -1)  # [R, B, H, n, c]
  k_pos = _with_previous_chunk(q_pos, -2)  # [R, B, H, n, c'] with c' = c or 2c
  k_valid = jnp.take_along_axis(jnp.broadcast_to(valid[None, :, None, :], order.shape), order,
                                axis=-1)
  k_valid = _with_previous_chunk(_chunks(k_valid, chunk_size, -1), -2)

  # Sorted buckets of every round at each round's sorted positions: [R, R', B, H, T].
  buckets_at = jnp.take_along_axis(buckets[None], order[:, None], axis=-1)
  q_buckets = _chunks(buckets_at, chunk_size, -1)  # [R, R', B, H, n, c]
  k_buckets = _with_previous_chunk(q_buckets, -2)
  own = jnp.arange(n_hashes)
  q_bucket = q_buckets[own, own][..., :, None]  # this round's buckets, [R, B, H, n, c, 1]
  k_bucket = k_buckets[own, own][..., None, :]
  allowed = k_valid[..., None, :]
  if mask_buckets:
    allowed = allowed & (q_bucket == k_bucket)
  if is_causal:
    allowed &= k_pos[..., None, :] <= q_pos[..., :, None]
  is_self = q_pos[..., :, None] == k_pos[..., None, :]
  logit_bias = jnp.where(is_self & mask_buckets, -SELF_ATTENTION_PENALTY, 0.0)
  if n_hashes > 1 and mask_buckets:
    shared_rounds = sum((q_buckets[:, r, ..., :, None] == k_buckets[:, r, ..., None, :])
                        .astype(q.dtype) for r in range(n_hashes))
    logit_bias = logit_bias - jnp.log(jnp.maximum(shared_rounds, 1.0))

  out, lse = _attend(sorted_q, sorted_k, sorted_v, allowed, scale, logit_bias)
  undo = jnp.argsort(order, axis=-1)  # [R, B, H, T]
  out = _gather(out.reshape(order.shape + out.shape[-1:]), undo)  # [R, B, H, T, Dv]
  lse = jnp.take_along_axis(lse.reshape(order.shape), undo, axis=-1)
  out = jnp.swapaxes(_merge_by_lse(out, lse, axis=0), 1, 2)  # [B, T, H, Dv]
  return common.zero_padded_queries(out.astype(query.dtype), query_seq_lengths)


def _key_as_floats(rng: jax.Array) -> Array:
  """A PRNG key as two float32 carrying its bits (the "random" collection stays
  float, so code that differentiates every variable does not meet integers)."""
  data = jax.random.key_data(rng) if jax.dtypes.issubdtype(rng.dtype, jax.dtypes.prng_key) \
      else rng
  return jax.lax.bitcast_convert_type(data.reshape(-1)[-2:].astype(jnp.uint32), jnp.float32)


class LSHHashKey(nn.Module):
  """Supplies `hash_rng`, the key of the layer's random rotations: drawn per
  layer and redrawn every `redraw_every` training steps (1: every step, as
  Reformer), fixed in evaluation (`common.layer_random`).

  Declares that the layer makes no key projection (shared QK).
  """

  redraw_every: int = 1
  fixed_rotations: bool = False  # then no key: the function hashes with fixed_rotations()

  unused_projections = staticmethod(lambda options: frozenset({"key"}))

  @nn.compact
  def __call__(self, query, key, value, deterministic: bool = True) -> dict:
    del query, key, value  # The rotations do not depend on the inputs.
    if self.fixed_rotations:
      return {}
    bits = common.layer_random(self, "hash_key", _key_as_floats, deterministic=deterministic,
                               redraw_every=self.redraw_every)
    return {"hash_rng": jax.random.wrap_key_data(
        jax.lax.bitcast_convert_type(bits, jnp.uint32))}


registry.register(registry.VariantSpec(
    name="lsh", fn=lsh_attention, family="hashing", complexity="O(T c)", subquadratic=True,
    exact=False, causal=True, cross=False, paper="Kitaev et al. 2020", extras=LSHHashKey,
    options=dict(n_buckets="hash buckets; about 2 T / chunk_size when None",
                 n_hashes="hash rounds", chunk_size="queries per chunk (each sees 2 chunks)",
                 num_chunks="the chunk count instead of chunk_size (the LRA release: 10)",
                 redraw_every="training steps between new rotations (1: every step, as "
                              "Reformer; 0: never); fixed in evaluation",
                 scale="multiplies the logits; D ** scale_exponent when None",
                 scale_exponent="-0.5: 1/sqrt(D); 0: trax's Reformer (none); 0.5: the LRA "
                                "release (times sqrt(D))",
                 normalize_keys="keys are the unit-normalised queries; False: the queries "
                                "(the LRA release)",
                 mask_buckets="attend within the bucket, self only as a fallback; False: "
                              "every key of the two chunks (the LRA release)",
                 mask_padding="apply the padding; False ignores it (the LRA release)",
                 fixed_rotations="one rotation from PRNGKey(0) for every head, layer and "
                                 "step (the LRA release)"),
    presets={"lra_release": registry.Preset(
        options=dict(n_hashes=1, n_buckets=10, num_chunks=10, scale_exponent=0.5,
                     normalize_keys=False, mask_buckets=False, mask_padding=False,
                     fixed_rotations=True),
        doc="The release's ReformerAttention (models/reformer/reformer_attention.py, "
            "lsh_attention_single_head) hashes the raw queries once into 10 buckets with "
            "rotations from a fixed PRNGKey(0), splits the sorted sequence into 10 chunks, "
            "and attends each chunk to itself and the previous one with logits q.q' times "
            "sqrt(D): no bucket, self or padding mask.")}))


# ---------------------------------------------------------------------------
# Routing attention (Routing Transformer).
# ---------------------------------------------------------------------------


def _gather_rows(x: Array, indices: Array) -> Array:
  """x `[B, H, T, D]`, indices `[B, H, *S]` -> `[B, H, *S, D]`, without broadcasting x."""
  flat = indices.reshape(indices.shape[:2] + (-1,))
  rows = jnp.take_along_axis(x, flat[..., None], axis=-2)
  return rows.reshape(indices.shape + x.shape[-1:])


def _centroid_affinity(unit_vectors: Array, centroids: Array) -> Array:
  """-|x - mu|^2 + |x|^2 for unit x: larger means closer; `[B, H, T, D]`, `[H, C, D]` ->
  `[B, H, C, T]`."""
  dots = jnp.einsum("bhtd,hcd->bhct", unit_vectors, centroids)
  return 2.0 * dots - jnp.sum(jnp.square(centroids), axis=-1)[None, :, :, None]


def _nearest_members(unit_vectors: Array, centroids: Array, valid: Array, window: int) -> Array:
  """The `window` positions closest to each centroid, `[B, H, C, window]`; invalid
  (padded) positions rank after every valid one."""
  affinity = _centroid_affinity(jax.lax.stop_gradient(unit_vectors), centroids)
  affinity = jnp.where(valid[:, None, None, :], affinity, -jnp.inf)
  return jax.lax.top_k(affinity, window)[1]


def _scatter_merge(out: Array, lse: Array, indices: Array, length: int) -> Array:
  """Merges the outputs of every group a query belongs to, weighted by their
  log-sum-exp (softmax over the union of the groups' keys).

  out: `[B, H, C, w, Dv]`, lse and indices: `[B, H, C, w]` -> `[B, H, length, Dv]`;
  a position in no group gets zeros.
  """
  def merge_one(out, lse, indices):  # One batch element and head.
    out, lse, indices = out.reshape(-1, out.shape[-1]), lse.reshape(-1), indices.reshape(-1)
    best = jnp.full((length,), -jnp.inf, lse.dtype).at[indices].max(lse)
    best = jax.lax.stop_gradient(jnp.where(jnp.isfinite(best), best, 0.0))
    weight = jnp.where(jnp.isfinite(lse), jnp.exp(lse - best[indices]), 0.0)
    total = jnp.zeros((length,), lse.dtype).at[indices].add(weight)
    summed = jnp.zeros((length, out.shape[-1]), out.dtype).at[indices].add(weight[:, None] * out)
    return summed / jnp.where(total > 0.0, total, 1.0)[:, None]

  return jax.vmap(jax.vmap(merge_one))(out, lse, indices)


def routing_attention(
    query: Array,
    key: Array,
    value: Array,
    bias: Optional[Array] = None,
    mask: Optional[Array] = None,
    *,
    is_causal: bool = False,
    query_seq_lengths: Optional[Array] = None,
    key_value_seq_lengths: Optional[Array] = None,
    segment_ids: Optional[Array] = None,
    centroids: Optional[Array] = None,
    window_size: Optional[int] = None,
    scale: Optional[float] = None,
) -> Array:
  """Routing attention: attention within k-means clusters (Roy et al. 2021).

  Queries and keys are unit-normalised and routed to the centroids (by
  Euclidean distance). As in the paper, each centroid takes the `window_size`
  queries and the `window_size` keys nearest to it (top-k, a static shape)
  and its queries attend to its keys, masked by original positions for
  causality and padding. A query chosen by several centroids merges their
  outputs by log-sum-exp weights (softmax over the union, a key chosen twice
  counting twice); a query chosen by none outputs zeros (the residual carries
  it). Cost O(C w^2) = O(T^2 / C): O(T sqrt(T)) with C ~ sqrt(T) clusters.

  With one centroid (window = T) this is exactly dense attention.

  Args:
    query: `[B, Tq, H, D]`.
    key: `[B, Tk, Hkv, D]`, Hkv dividing H.
    value: `[B, Tk, Hkv, Dv]`.
    bias, segment_ids: not supported (ValueError).
    mask: only a key-padding mask `[B|1, 1, 1, Tk]`.
    is_causal: query i attends keys j <= i (top-left aligned). The members
      of each cluster are still the top-k over the whole sequence (as the
      paper's balanced clusters): a later token can push an earlier query or
      key out of a cluster, so an earlier output can change with a later
      token (not strictly autoregressive; see `not_decodable`).
    query_seq_lengths: `[B]`; later queries output zeros and are never routed.
    key_value_seq_lengths: `[B]`; later keys are never routed or attended.
    centroids: `[H, C, D]` cluster centres (a variable of `RoutingCentroids`);
      no gradient flows into them.
    window_size: members per centroid, for queries and keys; by default
      Tq // C and Tk // C, so that the clusters cover the sequence once.
    scale: logit scale, 1/sqrt(D) by default.

  Returns:
    `[B, Tq, H, Dv]` in the query dtype.
  """
  common.reject_unsupported("routing", bias=bias, segment_ids=segment_ids)
  batch, q_len, num_heads, head_dim = query.shape
  kv_len = key.shape[1]
  if centroids is None or centroids.ndim != 3 or centroids.shape[0] != num_heads or \
      centroids.shape[2] != head_dim:
    raise ValueError(f"attention variant 'routing' needs centroids of shape [H, C, D] = "
                     f"[{num_heads}, C, {head_dim}], got "
                     f"{None if centroids is None else list(centroids.shape)}.")
  num_clusters = centroids.shape[1]
  if num_clusters > min(q_len, kv_len):
    raise ValueError(f"num_clusters={num_clusters} must be at most the sequence lengths "
                     f"(Tq={q_len}, Tk={kv_len}).")
  if window_size is None:
    q_window, k_window = q_len // num_clusters, kv_len // num_clusters
  else:
    q_window = k_window = common.check_size("window_size", window_size,
                                            length=min(q_len, kv_len))
  scale = head_dim ** -0.5 if scale is None else scale

  k_valid = _valid_keys("routing", mask, key_value_seq_lengths, batch, kv_len)
  q_valid = jnp.ones((batch, q_len), bool)
  if query_seq_lengths is not None:
    q_valid = jnp.arange(q_len)[None, :] < jnp.asarray(query_seq_lengths)[:, None]
  q = _heads_first(query)
  k = _heads_first(common.repeat_kv_heads(key, num_heads))
  v = _heads_first(common.repeat_kv_heads(value, num_heads))
  centroids = jax.lax.stop_gradient(centroids).astype(q.dtype)

  q_members = _nearest_members(_normalize(q), centroids, q_valid, q_window)  # [B, H, C, wq]
  k_members = _nearest_members(_normalize(k), centroids, k_valid, k_window)  # [B, H, C, wk]
  allowed = jnp.take_along_axis(k_valid[:, None], k_members.reshape(batch, num_heads, -1),
                                axis=-1).reshape(k_members.shape)[..., None, :]
  if is_causal:
    allowed = allowed & (k_members[..., None, :] <= q_members[..., :, None])
  out, lse = _attend(_gather_rows(q, q_members), _gather_rows(k, k_members),
                     _gather_rows(v, k_members), allowed, scale)
  out = jnp.swapaxes(_scatter_merge(out, lse, q_members, q_len), 1, 2)
  return common.zero_padded_queries(out.astype(query.dtype), query_seq_lengths)


def kmeans_update(centroids: Array, points: Array, decay: float) -> Array:
  """One online k-means step: each centroid moves towards the mean of its points.

  mu <- decay * mu + (1 - decay) * mean{x : x nearest to mu}; centroids with
  no point stay. (The paper averages the queries' and the keys' sums; the mean
  keeps the centroids on the scale of the unit points.)

  Args:
    centroids: `[H, C, D]`.
    points: `[B, N, H, D]` unit vectors; no gradient flows through the update.
    decay: in [0, 1).

  Returns:
    the updated `[H, C, D]`.
  """
  points = _heads_first(jax.lax.stop_gradient(points))  # [B, H, N, D]
  nearest = jnp.argmax(_centroid_affinity(points, centroids), axis=-2)  # [B, H, N]
  members = jax.nn.one_hot(nearest, centroids.shape[1], dtype=points.dtype)  # [B, H, N, C]
  sums = jnp.einsum("bhnc,bhnd->hcd", members, points)
  counts = jnp.sum(members, axis=(0, 2))[..., None]  # [H, C, 1]
  means = sums / jnp.maximum(counts, 1.0)
  return jnp.where(counts > 0, decay * centroids + (1.0 - decay) * means, centroids)


class RoutingCentroids(nn.Module):
  """The routing centroids, `[H, num_clusters, D]` in the `kmeans` collection.

  They are updated by `kmeans_update` on the unit queries and keys when the
  call is not deterministic and the `kmeans` collection is mutable
  (`apply(..., mutable=["kmeans"])`); the attention uses the values from
  before the update, with no gradient.

  `num_clusters=None` takes round(sqrt(T)) for the length T seen at
  initialisation, the choice that makes the cost O(T sqrt(T)); a fixed C costs
  O(T^2 / C) at longer lengths.
  """

  num_clusters: Optional[int] = None
  decay: float = 0.999
  seed: int = 0

  @nn.compact
  def __call__(self, query, key, value, deterministic: bool = True) -> dict:
    del value
    num_heads, head_dim = query.shape[2], query.shape[3]
    num_clusters = self.num_clusters
    if num_clusters is None:
      num_clusters = max(1, round(math.sqrt(min(query.shape[1], key.shape[1]))))
    centroids = self.variable(
        "kmeans", "centroids",
        lambda: _normalize(jax.random.normal(jax.random.PRNGKey(self.seed),
                                             (num_heads, num_clusters, head_dim))))
    current = centroids.value
    if not deterministic and self.is_mutable_collection("kmeans") and not self.is_initializing():
      points = jnp.concatenate([query, common.repeat_kv_heads(key, num_heads)], axis=1)
      centroids.value = kmeans_update(current, _normalize(points), self.decay)
    return {"centroids": jax.lax.stop_gradient(current)}


registry.register(registry.VariantSpec(
    name="routing", fn=routing_attention, family="hashing", complexity="O(T sqrt(T))",
    subquadratic=True, exact=False, causal=True, cross=True, paper="Roy et al. 2021",
    extras=RoutingCentroids,
    not_decodable="its clusters take T / k queries each from the whole sequence at once, and a "
                  "decoding step has one query",
    options=dict(num_clusters="k-means centroids; round(sqrt(T)) when None",
                 decay="exponential moving average of the centroid updates",
                 window_size="queries and keys each centroid takes; T / clusters when None",
                 seed="initial-centroid seed", scale="multiplies the logits; 1/sqrt(D) when None")))


# ---------------------------------------------------------------------------
# Sparse Sinkhorn attention.
# ---------------------------------------------------------------------------


def sinkhorn(logits: Array, iterations: int, temperature: float = 1.0) -> Array:
  """Soft permutation matrices by Sinkhorn normalisation in log space.

  Alternately normalises the rows and the columns of exp(logits / temperature)
  `iterations` times; the result converges to a doubly stochastic matrix (a
  permutation as temperature -> 0).

  Args:
    logits: `[..., n, n]`.
    iterations: normalisation rounds (rows then columns each).
    temperature: > 0; lower is closer to a hard permutation.

  Returns:
    `[..., n, n]` non-negative, columns summing to 1 and rows to 1 up to the
    convergence of the iterations.
  """
  def normalize(_, log_p):
    log_p = log_p - jax.nn.logsumexp(log_p, axis=-1, keepdims=True)
    return log_p - jax.nn.logsumexp(log_p, axis=-2, keepdims=True)

  return jnp.exp(jax.lax.fori_loop(0, iterations, normalize, logits / temperature))


def _block_means(x: Array, valid: Array) -> Array:
  """Mean of the valid rows of each block: x `[B, H, nb, b, D]`, valid `[B, 1, nb, b]`
  -> `[B, H, nb, D]` (zero for a block with no valid row)."""
  weights = valid.astype(x.dtype)[..., None]
  return jnp.sum(x * weights, axis=-2) / jnp.maximum(jnp.sum(weights, axis=-2), 1.0)


def _past_means(x: Array, valid: Array) -> Array:
  """Mean of the valid rows of all blocks *before* each block: `[B, H, nb, D]`
  (zero for the first block). The causal sort may only look at the past."""
  weights = valid.astype(x.dtype)[..., None]
  sums = jnp.cumsum(jnp.sum(x * weights, axis=-2), axis=-2)
  counts = jnp.cumsum(jnp.sum(weights, axis=-2), axis=-2)
  exclusive = lambda c: jnp.pad(c, [(0, 0)] * (c.ndim - 2) + [(1, 0), (0, 0)])[..., :-1, :]
  return exclusive(sums) / jnp.maximum(exclusive(counts), 1.0)


def causal_sort(logits: Array, temperature: float = 1.0) -> Array:
  """The causal soft sort: block i draws only from blocks j < i.

  A strictly lower-triangular support admits no doubly stochastic matrix (its
  last column is empty), so only the rows are normalised (a softmax over the
  past blocks); the first block has no past and gets an all-zero row.

  Args:
    logits: `[..., n, n]`.
    temperature: > 0.

  Returns:
    `[..., n, n]`, zero on and above the diagonal, rows 1.. summing to 1.
  """
  n = logits.shape[-1]
  past = jnp.tril(jnp.ones((n, n), bool), k=-1)
  masked = jnp.where(past, logits / temperature, -jnp.inf)
  row_max = jnp.max(masked, axis=-1, keepdims=True)
  weights = jnp.exp(masked - jnp.where(jnp.isfinite(row_max), row_max, 0.0))
  return weights / jnp.maximum(jnp.sum(weights, axis=-1, keepdims=True), 1e-30)


def _sort_network_logits(q_blocks: Array, k_blocks: Array, valid: Array, hidden_kernel: Array,
                         output_kernel: Array, causal: bool = False) -> Array:
  """Block-to-block sorting scores from block-pooled representations: `[B, H, nb, nb]`.

  Each query block's mean goes through a two-layer network to a "sort query",
  matched by a scaled dot product with each key block's mean; this form does
  not depend on the number of blocks, so one network serves every length.
  Causal: block i's sort query pools the blocks before it, not its own tokens
  (a token must not see later tokens of its block through the sort).
  """
  pooled_q = _past_means(q_blocks, valid) if causal else _block_means(q_blocks, valid)
  pooled_k = _block_means(k_blocks, valid)
  hidden = jax.nn.relu(jnp.einsum("bhnd,hds->bhns", pooled_q, hidden_kernel))
  sort_query = jnp.einsum("bhns,hsd->bhnd", hidden, output_kernel)
  return jnp.einsum("bhnd,bhmd->bhnm", sort_query, pooled_k) * pooled_k.shape[-1] ** -0.5


SINKHORN_SORTS = ("sinkhorn", "lra_release")
SINKHORN_LAYOUTS = ("contiguous", "strided")
SINKHORN_PADDINGS = ("exact", "lra_release")
# The LRA release's masked-logit value (an added bias, not -inf: a row with no
# allowed key is uniform over its block rather than empty).
_RELEASE_MASKED_LOGIT = -1e10


def _to_blocks(x: Array, block_size: int, layout: str) -> Array:
  """`[B, H, T, ...]` -> `[B, H, nb, b, ...]`: contiguous runs of `block_size`
  tokens, or (`"strided"`, the LRA release's reshape to `[b, nb]`) block n
  holding the tokens t with t mod nb == n."""
  if layout == "contiguous":
    return _chunks(x, block_size, 2)
  num_blocks = x.shape[2] // block_size
  return jnp.swapaxes(x.reshape(x.shape[:2] + (block_size, num_blocks) + x.shape[3:]), 2, 3)


def _from_blocks(x: Array, layout: str) -> Array:
  """The inverse of `_to_blocks`: `[B, H, nb, b, ...]` -> `[B, H, T, ...]`."""
  if layout == "strided":
    x = jnp.swapaxes(x, 2, 3)
  return x.reshape(x.shape[:2] + (-1,) + x.shape[4:])


def _release_sinkhorn(q: Array, k: Array, v: Array, valid: Array, block_size: int, layout: str,
                      padding: str, scale: float) -> Array:
  """What the LRA release's SinkhornAttention computes (sort_activation='softmax').

  q, k, v: `[B, H, T, D]`; valid: `[B, T]`. Each query block attends to its own
  block, and separately to the position-wise sum of *all* key (value) blocks
  (the release's einsum sums the sort away, so its sort network has no effect);
  the two outputs are added. Padding "lra_release": the mask of block n is the
  token validity of the *contiguous* run n (query and key alike), whatever the
  layout, and the summed block's is its OR over the runs; masked logits get
  -1e10. "exact": keys masked by their own validity, padded keys left out of
  the sum.
  """
  batch, length = valid.shape
  num_blocks = length // block_size
  qb, kb, vb = (_to_blocks(x, block_size, layout) for x in (q, k, v))  # [B, H, nb, b, D]
  if padding == "lra_release":
    runs = valid.reshape(batch, num_blocks, block_size)
    own = runs[:, :, :, None] & runs[:, :, None, :]  # [B, nb, b, b]
    summed = jnp.any(own, axis=1)[:, None]  # [B, 1, b, b]
    k_sum, v_sum = (jnp.sum(x, axis=2, keepdims=True) for x in (kb, vb))
  else:
    key_valid = _to_blocks(valid[:, None], block_size, layout)[:, 0]  # [B, nb, b]
    own = jnp.broadcast_to(key_valid[:, :, None, :], (batch, num_blocks, block_size, block_size))
    summed = jnp.any(own, axis=1)[:, None]
    weights = key_valid[:, None, :, :, None].astype(kb.dtype)
    k_sum, v_sum = (jnp.sum(x * weights, axis=2, keepdims=True) for x in (kb, vb))

  def attend(keys, values, allowed):  # allowed: [B, nb|1, b, b]
    logits = jnp.einsum("bhnsd,bhntd->bhnst", qb, keys) * scale
    logits = logits + jnp.where(allowed[:, None], 0.0, _RELEASE_MASKED_LOGIT)
    return jnp.einsum("bhnst,bhntd->bhnsd", jax.nn.softmax(logits, axis=-1), values)

  out = attend(kb, vb, own) + attend(k_sum, v_sum, summed)
  return _from_blocks(out, layout)


def sinkhorn_attention(
    query: Array,
    key: Array,
    value: Array,
    bias: Optional[Array] = None,
    mask: Optional[Array] = None,
    *,
    is_causal: bool = False,
    query_seq_lengths: Optional[Array] = None,
    key_value_seq_lengths: Optional[Array] = None,
    segment_ids: Optional[Array] = None,
    block_size: int = 64,
    sinkhorn_iterations: int = 8,
    temperature: float = 0.75,
    sort_logits: Optional[Array] = None,
    sort_hidden_kernel: Optional[Array] = None,
    sort_output_kernel: Optional[Array] = None,
    scale: Optional[float] = None,
    sort: str = "sinkhorn",
    block_layout: str = "contiguous",
    padding: str = "exact",
) -> Array:
  """Sparse Sinkhorn attention (Tay et al. 2020).

  The sequence is split into blocks of `block_size`. A sorting network scores
  block pairs from block-pooled queries and keys; Sinkhorn normalisation
  turns the scores into a soft permutation P `[nb, nb]`, and key block i of
  the sorted sequence is sum_j P_ij K_j (values alike). Each query block
  attends to its own block and to its sorted key block together (one softmax
  over 2 * block_size keys). Cost O(T b) for the attention plus O(T nb D)
  for the soft sort: O(T sqrt(T)) with b ~ sqrt(T).

  With P the identity, every block attends to its own keys (twice, which
  leaves the softmax unchanged): block-local attention exactly.

  Causal (the paper's causal Sinkhorn attention, in this form): a query sees
  the keys of its own block up to itself, and a sorted block mixed only from
  earlier blocks (`causal_sort`: rows normalised over the past, the sort query
  pooled from earlier blocks), so no output depends on a later token.

  Padding: padded keys enter the sorted blocks as zero vectors, and each
  sorted key's logit gets log(its valid share), so a sorted key made only of
  padding is masked; padded keys never change valid outputs.

  Args:
    query: `[B, T, H, D]`.
    key: `[B, T, Hkv, D]`, Hkv dividing H (self-attention: same length).
    value: `[B, T, Hkv, Dv]`.
    bias, segment_ids: not supported (ValueError).
    is_causal: causal Sinkhorn attention (see above).
    mask: only a key-padding mask `[B|1, 1, 1, T]`.
    query_seq_lengths: `[B]`; later queries output zeros.
    key_value_seq_lengths: `[B]`; later keys are not attended.
    block_size: tokens per block; a T that it does not divide is padded to its
      next multiple (the added keys masked, their outputs dropped).
    sinkhorn_iterations: Sinkhorn normalisation rounds (0: the sort is
      exp(logits / temperature), not normalised).
    temperature: Sinkhorn temperature (> 0). No Gumbel noise is added: the
      sort is deterministic (the paper's Gumbel-Sinkhorn samples one).
    sort_logits: `[B|1, H|1, nb, nb]` block-sorting scores given directly;
      otherwise computed by the sorting network from
    sort_hidden_kernel: `[H, D, S]` and
    sort_output_kernel: `[H, S, D]` (the `SinkhornSortNet` parameters).
    scale: logit scale, 1/sqrt(D) by default.
    sort: "sinkhorn" (the method above) or "lra_release": what the LRA
      release's code computes (`_release_sinkhorn`): no sort at all, each
      query block attending to its own block and, in a second softmax whose
      output is added, to the sum of all key blocks. Not causal.
    block_layout: "contiguous" blocks of `block_size` tokens, or "strided"
      (the release's reshape: block n holds the tokens t = n mod T / block_size).
      Only with sort="lra_release".
    padding: "exact" or "lra_release" (the release's masks, built from
      contiguous runs whatever the layout, -1e10 on masked logits). Only with
      sort="lra_release".

  Returns:
    `[B, T, H, Dv]` in the query dtype.
  """
  common.reject_unsupported("sinkhorn", bias=bias, segment_ids=segment_ids)
  _check_self_attention("sinkhorn", query, key)
  batch, length, num_heads, head_dim = query.shape
  common.check_size("block_size", block_size)
  common.check_size("sinkhorn_iterations", sinkhorn_iterations, minimum=0)
  if not temperature > 0:
    raise ValueError(f"temperature must be > 0, got {temperature!r}.")
  for name, value_, choices in (("sort", sort, SINKHORN_SORTS),
                                ("block_layout", block_layout, SINKHORN_LAYOUTS),
                                ("padding", padding, SINKHORN_PADDINGS)):
    if value_ not in choices:
      raise ValueError(f"{name} must be one of {choices}, got {value_!r}.")
  if sort == "sinkhorn" and (block_layout, padding) != ("contiguous", "exact"):
    raise ValueError(f"block_layout={block_layout!r} and padding={padding!r} go with "
                     "sort='lra_release'; the Sinkhorn sort takes contiguous blocks and "
                     "exact padding.")
  if sort == "lra_release" and is_causal:
    raise ValueError("sort='lra_release' is not causal (the release's causal branch was "
                     "never finished); use sort='sinkhorn'.")
  padded = _padded_to_multiple("sinkhorn", block_size, query, key, value, mask,
                               key_value_seq_lengths)
  if padded is not None:
    query, key, value, mask = padded
    out = sinkhorn_attention(
        query, key, value, mask=mask, is_causal=is_causal, query_seq_lengths=query_seq_lengths,
        block_size=block_size, sinkhorn_iterations=sinkhorn_iterations,
        temperature=temperature, sort_logits=sort_logits,
        sort_hidden_kernel=sort_hidden_kernel, sort_output_kernel=sort_output_kernel,
        scale=scale, sort=sort, block_layout=block_layout, padding=padding)
    return out[:, :length]
  num_blocks = length // block_size
  scale = head_dim ** -0.5 if scale is None else scale

  if sort == "lra_release":
    out = _release_sinkhorn(
        _heads_first(query), _heads_first(common.repeat_kv_heads(key, num_heads)),
        _heads_first(common.repeat_kv_heads(value, num_heads)),
        _valid_keys("sinkhorn", mask, key_value_seq_lengths, batch, length), block_size,
        block_layout, padding, scale)
    return common.zero_padded_queries(jnp.swapaxes(out, 1, 2).astype(query.dtype),
                                      query_seq_lengths)
  valid = _chunks(_valid_keys("sinkhorn", mask, key_value_seq_lengths, batch, length)[:, None],
                  block_size, -1)  # [B, 1, nb, b]
  blocks = lambda x: _chunks(_heads_first(x), block_size, -2)  # [B, H, nb, b, D]
  q = blocks(query)
  k = blocks(common.repeat_kv_heads(key, num_heads))
  v = blocks(common.repeat_kv_heads(value, num_heads))
  if sort_logits is None:
    if sort_hidden_kernel is None or sort_output_kernel is None:
      raise ValueError("attention variant 'sinkhorn' needs sort_logits [B|1, H|1, nb, nb] or the "
                       "sorting network's sort_hidden_kernel and sort_output_kernel "
                       "(MultiHeadAttention's extras module supplies them).")
    sort_logits = _sort_network_logits(q, k, valid, sort_hidden_kernel, sort_output_kernel,
                                       causal=is_causal)
  elif sort_logits.shape[-2:] != (num_blocks, num_blocks):
    raise ValueError(f"sort_logits must end in [nb, nb] = [{num_blocks}, {num_blocks}] "
                     f"(T / block_size blocks), got shape {list(sort_logits.shape)}.")
  if is_causal:
    permutation = causal_sort(sort_logits.astype(q.dtype), temperature)
  else:
    permutation = sinkhorn(sort_logits.astype(q.dtype), sinkhorn_iterations, temperature)

  k_zeroed, v_zeroed = (jnp.where(valid[..., None], x, 0.0) for x in (k, v))
  sorted_k = jnp.einsum("bhij,bhjtd->bhitd", permutation, k_zeroed)
  sorted_v = jnp.einsum("bhij,bhjtd->bhitd", permutation, v_zeroed)
  sorted_share = jnp.einsum("bhij,bhjt->bhit", permutation, valid.astype(q.dtype))
  sorted_valid = sorted_share > 0.0
  own_valid = jnp.broadcast_to(valid, sorted_valid.shape)[..., None, :]  # [B, H, nb, 1, b]
  if is_causal:  # Within its own block a query sees keys up to itself.
    own_valid = own_valid & jnp.tril(jnp.ones((block_size, block_size), bool))
  own_valid, sorted_allowed = jnp.broadcast_arrays(own_valid, sorted_valid[..., None, :])
  allowed = jnp.concatenate([own_valid, sorted_allowed], axis=-1)
  log_share = jnp.log(jnp.where(sorted_valid, sorted_share, 1.0))
  logit_bias = jnp.concatenate([jnp.zeros_like(log_share), log_share], axis=-1)[..., None, :]
  out, _ = _attend(q, jnp.concatenate([k, sorted_k], axis=-2),
                   jnp.concatenate([v, sorted_v], axis=-2), allowed, scale, logit_bias)
  out = jnp.swapaxes(out.reshape(out.shape[:2] + (length, -1)), 1, 2)
  return common.zero_padded_queries(out.astype(query.dtype), query_seq_lengths)


class SinkhornSortNet(nn.Module):
  """The sorting network's parameters: `sort_hidden_kernel [H, D, S]` and
  `sort_output_kernel [H, S, D]` with S = `sort_hidden_dim`."""

  sort_hidden_dim: int = 32
  sort: str = "sinkhorn"  # "lra_release" sorts nothing: no network

  @nn.compact
  def __call__(self, query, key, value, deterministic: bool = True) -> dict:
    del key, value, deterministic
    if self.sort == "lra_release":
      return {}
    num_heads, head_dim = query.shape[2], query.shape[3]
    init = nn.initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=(0,))
    hidden = self.param("sort_hidden_kernel", init, (num_heads, head_dim, self.sort_hidden_dim))
    output = self.param("sort_output_kernel", init, (num_heads, self.sort_hidden_dim, head_dim))
    return {"sort_hidden_kernel": hidden, "sort_output_kernel": output}


registry.register(registry.VariantSpec(
    name="sinkhorn", fn=sinkhorn_attention, family="hashing", complexity="O(T (b + T/b))",
    subquadratic=True, exact=False, causal=True, cross=False, paper="Tay et al. 2020",
    extras=SinkhornSortNet,
    options=dict(block_size="tokens per block", sinkhorn_iterations="balancing iterations",
                 temperature="of the Sinkhorn sort (no Gumbel noise: deterministic)", sort_hidden_dim="sort network width",
                 scale="multiplies the logits; 1/sqrt(D) when None",
                 sort="'sinkhorn' (the method) or 'lra_release' (no sort: own block plus the "
                      "sum of all blocks, two softmaxes added)",
                 block_layout="'contiguous' or 'strided' (the LRA release's reshape); "
                              "with sort='lra_release'",
                 padding="'exact' or 'lra_release' (masks from contiguous runs, -1e10 "
                         "logits); with sort='lra_release'"),
    presets={"lra_release": registry.Preset(
        options=dict(sort="lra_release", block_layout="strided", padding="lra_release",
                     block_size=50),
        doc="The release's SinkhornAttention (models/sinkhorn_transformer/"
            "sinkhorn_attention.py, sort_activation='softmax') reshapes tokens into strided "
            "blocks of 50, and its einsum sums every key block instead of permuting them (the "
            "sort network has no effect): each block attends to itself and, in a second "
            "softmax added to the first, to the sum of all blocks; its padding masks come "
            "from contiguous runs.")}))


# ---------------------------------------------------------------------------
# Clustered attention.
# ---------------------------------------------------------------------------


def _nearest_centroid(points: Array, centroids: Array) -> Array:
  """points `[B, H, T, D]`, centroids `[B, H, C, D]` -> `[B, H, T]` index of the nearest."""
  closeness = 2.0 * jnp.einsum("bhtd,bhcd->bhtc", points, centroids) \
      - jnp.sum(jnp.square(centroids), axis=-1)[:, :, None, :]
  return jnp.argmax(closeness, axis=-1)


def _cluster_means(points: Array, assignment: Array, valid: Array, previous: Array) -> Array:
  """Mean of the valid points of each cluster, `[B, H, C, D]`; an empty cluster keeps
  its `previous` centroid."""
  members = jax.nn.one_hot(assignment, previous.shape[2], dtype=points.dtype)
  members = members * valid[:, None, :, None].astype(points.dtype)  # [B, H, T, C]
  sums = jnp.einsum("bhtc,bhtd->bhcd", members, points)
  counts = jnp.sum(members, axis=2)[..., None]
  return jnp.where(counts > 0, sums / jnp.maximum(counts, 1.0), previous)


def clustered_attention(
    query: Array,
    key: Array,
    value: Array,
    bias: Optional[Array] = None,
    mask: Optional[Array] = None,
    *,
    is_causal: bool = False,
    query_seq_lengths: Optional[Array] = None,
    key_value_seq_lengths: Optional[Array] = None,
    segment_ids: Optional[Array] = None,
    num_clusters: int = 32,
    lloyd_iterations: int = 5,
    scale: Optional[float] = None,
) -> Array:
  """Clustered attention (Vyas et al. 2020): queries share their centroid's attention.

  The queries of each sequence and head are grouped into `num_clusters`
  clusters by `lloyd_iterations` Lloyd (k-means) steps, starting from C
  queries evenly spaced over the valid ones. Each centroid attends to all
  keys, and every query takes its centroid's output: O(T C) time and memory.
  (The paper clusters Hamming codes of hashed queries for speed; this clusters
  the queries themselves.) Cluster assignments carry no gradient; the final
  centroids are the means of their queries, so gradients reach the queries.

  With C = Tq every query is its own centroid: exactly dense attention.

  Args:
    query: `[B, Tq, H, D]`.
    key: `[B, Tk, Hkv, D]`, Hkv dividing H.
    value: `[B, Tk, Hkv, Dv]`.
    bias, segment_ids, is_causal: not supported (ValueError): a query's
      centroid attends to every key, so no per-query mask fits.
    mask: only a key-padding mask `[B|1, 1, 1, Tk]`.
    query_seq_lengths: `[B]`; later queries take no part in the clustering
      and output zeros.
    key_value_seq_lengths: `[B]`; later keys are not attended.
    num_clusters: C, at most Tq.
    lloyd_iterations: k-means steps before the final assignment.
    scale: logit scale, 1/sqrt(D) by default.

  Returns:
    `[B, Tq, H, Dv]` in the query dtype.
  """
  common.reject_unsupported("clustered", bias=bias, segment_ids=segment_ids,
                            is_causal=is_causal)
  batch, q_len, num_heads, head_dim = query.shape
  common.check_size("num_clusters", num_clusters, length=q_len)
  common.check_size("lloyd_iterations", lloyd_iterations, minimum=0)
  scale = head_dim ** -0.5 if scale is None else scale

  k_valid = _valid_keys("clustered", mask, key_value_seq_lengths, batch, key.shape[1])
  q_lengths = jnp.full((batch,), q_len) if query_seq_lengths is None else \
      jnp.asarray(query_seq_lengths)
  q_valid = jnp.arange(q_len)[None, :] < q_lengths[:, None]
  q = _heads_first(query)
  k = _heads_first(common.repeat_kv_heads(key, num_heads))
  v = _heads_first(common.repeat_kv_heads(value, num_heads))

  points = jax.lax.stop_gradient(q)
  first = (jnp.arange(num_clusters)[None, :] * q_lengths[:, None]) // num_clusters  # [B, C]
  centroids = _gather_rows(points, jnp.broadcast_to(first[:, None], (batch, num_heads,
                                                                     num_clusters)))
  for _ in range(lloyd_iterations):
    centroids = _cluster_means(points, _nearest_centroid(points, centroids), q_valid, centroids)
  assignment = _nearest_centroid(points, centroids)  # [B, H, Tq]
  centroids = _cluster_means(q, assignment, q_valid, centroids)

  centroid_out, _ = _attend(centroids, k, v, k_valid[:, None, None, :], scale)  # [B, H, C, Dv]
  out = jnp.take_along_axis(centroid_out, assignment[..., None], axis=2)
  out = jnp.swapaxes(out, 1, 2)
  return common.zero_padded_queries(out.astype(query.dtype), query_seq_lengths)


registry.register(registry.VariantSpec(
    name="clustered", fn=clustered_attention, family="hashing", complexity="O(T C)",
    subquadratic=True, exact=False, causal=False, cross=True, paper="Vyas et al. 2020",
    options=dict(num_clusters="query clusters C", lloyd_iterations="k-means iterations",
                 scale="multiplies the logits; 1/sqrt(D) when None")))
