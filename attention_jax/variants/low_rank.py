"""Low-rank and compressed attention: the keys (or the attention matrix) are
summarised by far fewer than T rows.

* `linformer` (Wang et al. 2020): keys and values projected along the length,
  Tk -> k, by learned E and F; attention over the k projected rows, O(T k).
* `nystromformer` (Xiong et al. 2021): segment-mean landmarks and the Nystrom
  approximation softmax(Q K~^T) pinv(softmax(Q~ K~^T)) softmax(Q~ K^T) V with
  an iterative Moore-Penrose pseudo-inverse, O(T m + m^3).
* `low_rank_locality` (Guo et al. 2019): band attention (w keys each side,
  computed blockwise) plus a low-rank attention whose scores come from r-dim
  projections q W^Q, k W^K. The low-rank term is a softmax over all keys, so
  it costs O(T^2 r): quadratic, registered as such.
* `memory_compressed` (Liu et al. 2018): a strided convolution (kernel = stride
  = s) shortens K and V to Tk / s, then ordinary attention: O(T^2 / s).

The learned arrays of each (projections, convolutions) are made by the
`extras` module registered with it and passed to the pure function.
"""

from __future__ import annotations

from typing import Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from attention_jax import registry
from attention_jax.core.softmax import masked_softmax
from attention_jax.variants import common
from attention_jax.variants.dense import dot_product_attention

Array = jnp.ndarray


def _zero_padded_keys(key: Array, value: Array, key_valid: Optional[Array]):
  """key, value `[B, Tk, Hkv, .]` with the padded positions (`key_valid` False) zeroed."""
  if key_valid is None:
    return key, value
  keep = key_valid[:, :, None, None]
  return jnp.where(keep, key, 0.0), jnp.where(keep, value, 0.0)


def _key_mask(key_valid: Optional[Array]) -> Optional[Array]:
  """`[B, Tk]` -> the `[B, 1, 1, Tk]` mask dot_product_attention takes."""
  return None if key_valid is None else key_valid[:, None, None, :]


# ----------------------------------------------------------------------------
# linformer
# ----------------------------------------------------------------------------


def linformer_attention(query: Array, key: Array, value: Array, bias: Optional[Array] = None,
                        mask: Optional[Array] = None, *, is_causal: bool = False,
                        query_seq_lengths: Optional[Array] = None,
                        key_value_seq_lengths: Optional[Array] = None, segment_ids=None,
                        key_projection: Array, value_projection: Optional[Array] = None,
                        scale: Optional[float] = None, mask_padding: bool = True) -> Array:
  """softmax(Q (E^T K)^T * scale) (F^T V): attention over k length-projected keys.

  Padding is applied as in the paper, by zeroing padded keys and values before
  the projection. That is an approximation of masking: the padded content no
  longer matters, but the projected rows are mixtures of valid keys and zeros,
  not of the valid keys alone. `mask_padding=False` applies no padding at all,
  as the LRA release's Linformer (models/linformer/linformer_attention.py),
  which takes a padding mask and never uses it.

  Args:
    query: `[B, Tq, H, D]`; key: `[B, Tk, Hkv, D]`; value: `[B, Tk, Hkv, Dv]`.
    bias, is_causal, segment_ids: not supported (ValueError): the projection
      mixes every position.
    mask: key-padding mask `[B|1, 1, 1, Tk]` only.
    query_seq_lengths, key_value_seq_lengths: `[B]` padding.
    key_projection: E, `[L, k]` with L >= Tk (the length it was sized for);
      a shorter input uses its first Tk rows.
    value_projection: F, `[L, k]`; E when None (the paper's shared projection).
    scale: logit scale, 1/sqrt(D) by default.
    mask_padding: apply the padding (above); False: padded keys are projected
      like any other and padded queries get outputs (the LRA release).

  Returns:
    `[B, Tq, H, Dv]`.
  """
  common.reject_unsupported("linformer", bias=bias, is_causal=is_causal, segment_ids=segment_ids)
  batch, kv_len = key.shape[:2]
  max_len, projected_length = key_projection.shape
  if kv_len > max_len:
    raise ValueError(f"linformer's key_projection was sized for key length {max_len}, got "
                     f"Tk={kv_len}: build the module with the longest length it will see.")
  common.check_size("projected_length", projected_length, length=kv_len)
  value_projection = key_projection if value_projection is None else value_projection
  # Checked (a pairwise mask is refused) even when the padding is not applied.
  key_valid = common.key_padding("linformer", mask, key_value_seq_lengths, batch, kv_len)
  if mask_padding:
    key, value = _zero_padded_keys(key, value, key_valid)
  projected_key = jnp.einsum("bthd,tk->bkhd", key, key_projection[:kv_len].astype(key.dtype))
  projected_value = jnp.einsum("bthd,tk->bkhd", value,
                               value_projection[:kv_len].astype(value.dtype))
  out = dot_product_attention(query, projected_key, projected_value, scale=scale)
  return common.zero_padded_queries(out, query_seq_lengths) if mask_padding else out


LINFORMER_INITS = ("normal", "xavier_uniform")


class LinformerProjections(nn.Module):
  """E (and F) of `linformer`, `[Tk, k]`, sized from the key length at initialisation.

  Attributes:
    projected_length: k, at most the key length.
    share_kv: one projection for keys and values (E = F), the paper's
      key-value sharing (and the LRA release's single `lr_kernel`).
    projection_init: "normal": N(0, 1/Tk) entries, so that a projected row
      (a sum of Tk keys) keeps the scale of one key; "xavier_uniform": the LRA
      release's, U(-a, a) with a = sqrt(6 / (Tk + k)) (Glorot over the `[Tk, k]`
      matrix; the release sizes it for its max_len).
  """

  projected_length: int = 64
  share_kv: bool = False
  projection_init: str = "normal"

  @nn.compact
  def __call__(self, query, key, value, deterministic: bool = True):
    del query, value, deterministic
    kv_len = key.shape[1]
    common.check_size("projected_length", self.projected_length, length=kv_len)
    if self.projection_init not in LINFORMER_INITS:
      raise ValueError(f"projection_init must be one of {LINFORMER_INITS}, got "
                       f"{self.projection_init!r}.")
    names = ("key_projection",) if self.share_kv else ("key_projection", "value_projection")
    return {name: self._projection(name, kv_len) for name in names}

  def _projection(self, name: str, kv_len: int) -> Array:
    # Sized at initialisation; later (shorter) inputs use the stored array as
    # it is, and linformer_attention refuses longer ones.
    if self.has_variable("params", name):
      return self.get_variable("params", name)
    if self.projection_init == "xavier_uniform":
      init = nn.initializers.xavier_uniform()
    else:
      # Each projected row sums Tk keys: variance 1/Tk keeps its scale that of one key.
      init = nn.initializers.normal(stddev=kv_len ** -0.5)
    return self.param(name, init, (kv_len, self.projected_length))


# ----------------------------------------------------------------------------
# nystromformer
# ----------------------------------------------------------------------------


def segment_means(x: Array, num_segments: int, valid: Optional[Array] = None) -> Array:
  """`[B, T, H, D]` -> `[B, m, H, D]`: the mean of each of m consecutive segments
  of T/m tokens, over the valid tokens only (zeros for a segment with none)."""
  batch, length = x.shape[:2]
  segments = x.reshape((batch, num_segments, length // num_segments) + x.shape[2:])
  if valid is None:
    return segments.mean(axis=2)
  weights = valid.reshape(batch, num_segments, -1)[..., None, None].astype(x.dtype)
  count = weights.sum(axis=2)
  return (segments * weights).sum(axis=2) / jnp.maximum(count, 1.0)


def iterative_pinv(matrix: Array, iterations: int) -> Array:
  """Moore-Penrose pseudo-inverse of `[..., m, m]` by the iteration of Razavi et
  al. used by Nystromformer: Z <- Z (13 I - A Z (15 I - A Z (7 I - A Z))) / 4,
  from Z_0 = A^T / (|A|_1 |A|_inf), which converges for any A."""
  common.check_size("pinv_iterations", iterations, minimum=0)
  identity = jnp.eye(matrix.shape[-1], dtype=matrix.dtype)
  magnitude = jnp.abs(matrix)
  norm_1 = jnp.max(magnitude.sum(axis=-2), axis=-1)[..., None, None]
  norm_inf = jnp.max(magnitude.sum(axis=-1), axis=-1)[..., None, None]
  z = jnp.swapaxes(matrix, -1, -2) / (norm_1 * norm_inf)
  for _ in range(iterations):
    az = matrix @ z
    z = 0.25 * z @ (13 * identity - az @ (15 * identity - az @ (7 * identity - az)))
  return z


def nystromformer_attention(query: Array, key: Array, value: Array,
                            bias: Optional[Array] = None, mask: Optional[Array] = None, *,
                            is_causal: bool = False, query_seq_lengths: Optional[Array] = None,
                            key_value_seq_lengths: Optional[Array] = None, segment_ids=None,
                            num_landmarks: int = 64, pinv_iterations: int = 6,
                            scale: Optional[float] = None) -> Array:
  """Nystrom approximation of softmax(Q K^T * scale) V with m segment-mean landmarks.

  Landmark means are taken over valid tokens only (queries past
  `query_seq_lengths`, padded keys), so padded content does not reach the
  output. A key-padding mask says nothing about which queries are padding:
  pass `query_seq_lengths` to keep padded queries out of the query landmarks.

  Args:
    query: `[B, Tq, H, D]`; key: `[B, Tk, Hkv, D]`; value: `[B, Tk, Hkv, Dv]`.
    bias, is_causal, segment_ids: not supported (ValueError).
    mask: key-padding mask `[B|1, 1, 1, Tk]` only.
    query_seq_lengths, key_value_seq_lengths: `[B]` padding.
    num_landmarks: m; must divide Tq and Tk (pad the sequence otherwise).
    pinv_iterations: iterations of the pseudo-inverse (6 in the paper).
    scale: logit scale, 1/sqrt(D) by default.

  Returns:
    `[B, Tq, H, Dv]`.
  """
  common.reject_unsupported("nystromformer", bias=bias, is_causal=is_causal,
                            segment_ids=segment_ids)
  (batch, q_len, heads, dim), kv_len = query.shape, key.shape[1]
  common.check_size("num_landmarks", num_landmarks, length=q_len, divides=True)
  common.check_size("num_landmarks", num_landmarks, length=kv_len, divides=True)
  scale = dim ** -0.5 if scale is None else scale
  key_valid = common.key_padding("nystromformer", mask, key_value_seq_lengths, batch, kv_len)
  query_valid = None if query_seq_lengths is None else (
      jnp.arange(q_len)[None, :] < jnp.asarray(query_seq_lengths)[:, None])
  dtype = jnp.promote_types(query.dtype, jnp.float32)
  query = query.astype(dtype)
  key = common.repeat_kv_heads(key.astype(dtype), heads)
  value = common.repeat_kv_heads(value.astype(dtype), heads)

  query_landmarks = segment_means(query, num_landmarks, query_valid)  # [B, m, H, D]
  key_landmarks = segment_means(key, num_landmarks, key_valid)
  scores = lambda a, b: jnp.einsum("bqhd,bkhd->bhqk", a, b) * scale
  to_landmarks = masked_softmax(scores(query, key_landmarks))  # [B, H, Tq, m]
  between = masked_softmax(scores(query_landmarks, key_landmarks))  # [B, H, m, m]
  from_keys = masked_softmax(scores(query_landmarks, key),
                             None if key_valid is None else key_valid[:, None, None, :])
  landmark_values = jnp.einsum("bhmk,bkhd->bhmd", from_keys, value)  # [B, H, m, Dv]
  mixed = iterative_pinv(between, pinv_iterations) @ landmark_values
  out = jnp.einsum("bhqm,bhmd->bqhd", to_landmarks, mixed)
  return common.zero_padded_queries(out.astype(value.dtype), query_seq_lengths)


# ----------------------------------------------------------------------------
# low_rank_locality
# ----------------------------------------------------------------------------


def band_attention(query: Array, key: Array, value: Array, *, window_size: int,
                   is_causal: bool = False, key_valid: Optional[Array] = None,
                   scale: Optional[float] = None) -> Array:
  """Softmax attention of query i to keys j with |i - j| <= w (j <= i when
  causal), blockwise in O(T w): blocks of w queries see their own key block and
  the two beside it, 3w keys, masked to the band.

  Args:
    query: `[B, T, H, D]`; key: `[B, T, H, D]`; value: `[B, T, H, Dv]`.
    window_size: w >= 1 keys each side.
    is_causal: only keys j <= i.
    key_valid: `[B, T]`, False for padded keys.
    scale: logit scale, 1/sqrt(D) by default.

  Returns:
    `[B, T, H, Dv]` float32 (rows with no key in reach are zero).
  """
  (batch, length, heads, dim), window = query.shape, window_size
  scale = dim ** -0.5 if scale is None else scale
  num_blocks = -(-length // window)
  padded = num_blocks * window
  valid = jnp.ones((batch, length), bool) if key_valid is None else key_valid
  pad_time = lambda x, before, after: jnp.pad(
      x, [(0, 0), (before, after)] + [(0, 0)] * (x.ndim - 2))
  # One block of padding on each side so every block has a left and a right neighbour.
  key, value, valid = (pad_time(x, window, padded - length + window) for x in (key, value, valid))
  blocks = lambda x: x.reshape((batch, num_blocks + 2, window) + x.shape[2:])
  neighbourhood = lambda x: jnp.concatenate(
      [blocks(x)[:, :-2], blocks(x)[:, 1:-1], blocks(x)[:, 2:]], axis=2)  # [B, N, 3w, ...]
  block_keys, block_values, block_valid = map(neighbourhood, (key, value, valid))
  block_queries = pad_time(query, 0, padded - length).reshape(
      (batch, num_blocks, window, heads, dim))

  q_pos = jnp.arange(padded).reshape(num_blocks, window)[:, :, None]  # [N, w, 1]
  k_pos = q_pos[:, :1] - window + jnp.arange(3 * window)[None, None, :]  # [N, 1, 3w]
  allowed = jnp.abs(q_pos - k_pos) <= window
  if is_causal:
    allowed &= k_pos <= q_pos
  allowed = allowed[None, :, None] & block_valid[:, :, None, None, :]  # [B, N, 1, w, 3w]
  logits = jnp.einsum("bnqhd,bnkhd->bnhqk", block_queries, block_keys) * scale
  weights = masked_softmax(logits, allowed)
  out = jnp.einsum("bnhqk,bnkhd->bnqhd", weights, block_values.astype(jnp.float32))
  return out.reshape((batch, padded, heads, -1))[:, :length]


def low_rank_locality_attention(query: Array, key: Array, value: Array,
                                bias: Optional[Array] = None, mask: Optional[Array] = None, *,
                                is_causal: bool = False,
                                query_seq_lengths: Optional[Array] = None,
                                key_value_seq_lengths: Optional[Array] = None,
                                segment_ids=None, window_size: int = 16,
                                query_low_rank: Optional[Array] = None,
                                key_low_rank: Optional[Array] = None,
                                scale: Optional[float] = None) -> Array:
  """Band attention plus low-rank attention: out = A_band V + A_low-rank V.

  The two attention matrices are summed (each row-normalised on its own):
  A_band = softmax over the band |i - j| <= w of q . k * scale (full-rank
  scores, local), A_low-rank = softmax over all keys of (q W^Q) . (k W^K) /
  sqrt(r) (global, rank r). Their sum is the attention matrix constrained to
  "low rank plus band" of Guo et al. The band costs O(T w) (blockwise); the
  low-rank term is an exact softmax over all T keys, O(T^2 r) (it runs through
  `dot_product_attention`, which may pick a blockwise implementation so the
  T x T scores need not be stored).

  Args:
    query: `[B, T, H, D]`; key: `[B, T, Hkv, D]`; value: `[B, T, Hkv, Dv]`
      (self-attention: the band needs aligned positions).
    bias, segment_ids: not supported (ValueError).
    mask: key-padding mask `[B|1, 1, 1, Tk]` only.
    is_causal: both terms causal.
    query_seq_lengths, key_value_seq_lengths: `[B]` padding.
    window_size: w keys each side, at least 1.
    query_low_rank: W^Q `[H, D, r]`; key_low_rank: W^K `[Hkv, D, r]`. Both
      None switches the low-rank term off (band attention alone).
    scale: logit scale of the band, 1/sqrt(D) by default.

  Returns:
    `[B, T, H, Dv]`.
  """
  common.reject_unsupported("low_rank_locality", bias=bias, segment_ids=segment_ids)
  (batch, length, heads, _), kv_len = query.shape, key.shape[1]
  if length != kv_len:
    raise ValueError(f"attention variant 'low_rank_locality' is self-attention (its band needs "
                     f"aligned positions): Tq={length} must equal Tk={kv_len}.")
  common.check_size("window_size", window_size)
  if (query_low_rank is None) != (key_low_rank is None):
    raise ValueError("low_rank_locality needs both query_low_rank and key_low_rank, or neither.")
  key_valid = common.key_padding("low_rank_locality", mask, key_value_seq_lengths, batch, kv_len)
  out = band_attention(query, common.repeat_kv_heads(key, heads),
                       common.repeat_kv_heads(value, heads), window_size=window_size,
                       is_causal=is_causal, key_valid=key_valid, scale=scale)
  if query_low_rank is not None:
    low_query = jnp.einsum("bthd,hdr->bthr", query, query_low_rank.astype(query.dtype))
    low_key = jnp.einsum("bthd,hdr->bthr", key, key_low_rank.astype(key.dtype))
    out = out + dot_product_attention(low_query, low_key, value, mask=_key_mask(key_valid),
                                      is_causal=is_causal).astype(out.dtype)
  return common.zero_padded_queries(out.astype(value.dtype), query_seq_lengths)


class LowRankProjections(nn.Module):
  """W^Q `[H, D, r]` and W^K `[Hkv, D, r]` of `low_rank_locality`.

  Attributes:
    rank: r, at most the head dim D.
  """

  rank: int = 4

  @nn.compact
  def __call__(self, query, key, value, deterministic: bool = True):
    del value, deterministic
    dim = query.shape[-1]
    common.check_size("rank", self.rank, length=dim)
    init = nn.initializers.normal(stddev=dim ** -0.5)
    return {"query_low_rank": self.param("query_low_rank", init,
                                         (query.shape[2], dim, self.rank)),
            "key_low_rank": self.param("key_low_rank", init, (key.shape[2], dim, self.rank))}


# ----------------------------------------------------------------------------
# memory_compressed
# ----------------------------------------------------------------------------


def strided_convolution(x: Array, kernel: Array, bias: Optional[Array] = None) -> Array:
  """Per-head convolution with kernel size = stride = s: `[B, T, H, D]` ->
  `[B, T/s, H, E]`, with kernel `[s, H, D, E]` and bias `[H, E]`."""
  stride = kernel.shape[0]
  windows = x.reshape((x.shape[0], x.shape[1] // stride, stride) + x.shape[2:])
  out = jnp.einsum("bnshd,shde->bnhe", windows, kernel.astype(x.dtype))
  return out if bias is None else out + bias.astype(x.dtype)


def memory_compressed_attention(query: Array, key: Array, value: Array,
                                bias: Optional[Array] = None, mask: Optional[Array] = None, *,
                                is_causal: bool = False,
                                query_seq_lengths: Optional[Array] = None,
                                key_value_seq_lengths: Optional[Array] = None,
                                segment_ids=None, key_kernel: Array, value_kernel: Array,
                                key_bias: Optional[Array] = None,
                                value_bias: Optional[Array] = None,
                                scale: Optional[float] = None) -> Array:
  """Attention over K and V shortened by a strided convolution: O(Tq Tk / s).

  Padded keys and values are zeroed before the convolution, and a compressed
  slot is attended when its window holds at least one valid key. Causal: query
  i sees the compressed slots whose whole window lies at or before i (slot n
  covers keys [n s, n s + s - 1]); the first s - 1 queries then see nothing and
  output zeros.

  Args:
    query: `[B, Tq, H, D]`; key: `[B, Tk, Hkv, D]`; value: `[B, Tk, Hkv, Dv]`.
    bias, segment_ids: not supported (ValueError).
    mask: key-padding mask `[B|1, 1, 1, Tk]` only.
    is_causal: as above (Tq == Tk).
    query_seq_lengths, key_value_seq_lengths: `[B]` padding.
    key_kernel: `[s, Hkv, D, D]`; value_kernel: `[s, Hkv, Dv, Dv]`; the stride s
      is their first dimension and must divide Tk.
    key_bias, value_bias: `[Hkv, D]`, `[Hkv, Dv]` or None.
    scale: logit scale, 1/sqrt(D) by default.

  Returns:
    `[B, Tq, H, Dv]`.
  """
  common.reject_unsupported("memory_compressed", bias=bias, segment_ids=segment_ids)
  (batch, q_len), kv_len = query.shape[:2], key.shape[1]
  stride = key_kernel.shape[0]
  common.check_size("stride", stride, length=kv_len, divides=True)
  if value_kernel.shape[0] != stride:
    raise ValueError(f"value_kernel's stride {value_kernel.shape[0]} must equal key_kernel's "
                     f"{stride}.")
  if is_causal and q_len != kv_len:
    raise ValueError(f"attention variant 'memory_compressed': is_causal needs Tq == Tk, got "
                     f"Tq={q_len}, Tk={kv_len}.")
  key_valid = common.key_padding("memory_compressed", mask, key_value_seq_lengths, batch, kv_len)
  key, value = _zero_padded_keys(key, value, key_valid)
  memory_key = strided_convolution(key, key_kernel, key_bias)
  memory_value = strided_convolution(value, value_kernel, value_bias)
  slots = kv_len // stride
  memory_mask = None
  if key_valid is not None:
    memory_mask = key_valid.reshape(batch, slots, stride).any(-1)[:, None, None, :]
  if is_causal:
    slot_end = jnp.arange(slots) * stride + stride - 1
    causal = (slot_end[None, :] <= jnp.arange(q_len)[:, None])[None, None]  # [1, 1, Tq, Tk/s]
    memory_mask = causal if memory_mask is None else memory_mask & causal
  out = dot_product_attention(query, memory_key, memory_value, mask=memory_mask, scale=scale)
  return common.zero_padded_queries(out, query_seq_lengths)


def _mean_pooling_init(key, shape, dtype=jnp.float32):
  """[s, H, D, D] kernels that start as average pooling over each window."""
  del key
  stride, heads, dim, _ = shape
  return jnp.broadcast_to(jnp.eye(dim, dtype=dtype) / stride, shape)


class CompressionConvolutions(nn.Module):
  """The key and value convolutions of `memory_compressed` (kernel = stride = s),
  one per K/V head, initialised as average pooling.

  Attributes:
    stride: s, must divide the key length. 4 by default, where the paper
      uses 3: powers of two divide the sequence lengths of our tasks.
    use_bias: biases on the convolutions.
  """

  stride: int = 4
  use_bias: bool = True

  @nn.compact
  def __call__(self, query, key, value, deterministic: bool = True):
    del query, deterministic
    common.check_size("stride", self.stride, length=key.shape[1], divides=True)
    heads, key_dim, value_dim = key.shape[2], key.shape[3], value.shape[3]
    arrays = {
        "key_kernel": self.param("key_kernel", _mean_pooling_init,
                                 (self.stride, heads, key_dim, key_dim)),
        "value_kernel": self.param("value_kernel", _mean_pooling_init,
                                   (self.stride, heads, value_dim, value_dim)),
    }
    if self.use_bias:
      zeros = nn.initializers.zeros_init()
      arrays["key_bias"] = self.param("key_bias", zeros, (heads, key_dim))
      arrays["value_bias"] = self.param("value_bias", zeros, (heads, value_dim))
    return arrays


_LOW_RANK = dict(family="low_rank", exact=False)
registry.register(registry.VariantSpec(
    name="linformer", fn=linformer_attention, complexity="O(T k)", subquadratic=True,
    causal=False, cross=True, paper="Wang et al. 2020", extras=LinformerProjections,
    options=dict(projected_length="k, the length keys and values are projected to",
                 share_kv="one projection E = F for keys and values",
                 projection_init="'normal' (N(0, 1/Tk)) or 'xavier_uniform' (the LRA release)",
                 mask_padding="zero padded keys before projecting; False ignores padding "
                              "(the LRA release)",
                 scale="multiplies the logits; 1/sqrt(D) when None"),
    presets={"lra_release": registry.Preset(
        options=dict(projected_length=16, share_kv=True, projection_init="xavier_uniform",
                     mask_padding=False),
        doc="The release's LinformerAttention (models/linformer/linformer_attention.py) "
            "projects keys and values with one shared Glorot-uniform [max_len, 16] kernel "
            "(its blocks never pass low_rank_features; Text's config sets 32 where train.py "
            "does not read it) and ignores the padding mask.")},
    **_LOW_RANK))
registry.register(registry.VariantSpec(
    name="nystromformer", fn=nystromformer_attention, complexity="O(T m + m^3)",
    subquadratic=True, causal=False, cross=True, paper="Xiong et al. 2021",
    options=dict(num_landmarks="landmarks m (segment means of queries and keys)",
                 pinv_iterations="iterations of the Moore-Penrose pseudo-inverse", scale="multiplies the logits; 1/sqrt(D) when None"),
    **_LOW_RANK))
registry.register(registry.VariantSpec(
    name="low_rank_locality", fn=low_rank_locality_attention, complexity="O(T w + T^2 r)",
    subquadratic=False, causal=True, cross=False, paper="Guo et al. 2019",
    extras=LowRankProjections,
    options=dict(window_size="band: keys each side of the query",
                 rank="r, the width of the low-rank scores",
                 scale="multiplies the band's logits; 1/sqrt(D) when None (the low-rank "
                       "term's are always scaled by 1/sqrt(r))"), **_LOW_RANK))
registry.register(registry.VariantSpec(
    name="memory_compressed", fn=memory_compressed_attention, complexity="O(T^2 / s)",
    subquadratic=False, causal=True, cross=True, paper="Liu et al. 2018",
    extras=CompressionConvolutions,
    not_decodable="its strided convolution compresses the keys of the call at hand; decoding "
                  "would need a cache of compressed blocks",
    options=dict(stride="s: keys and values compressed by a strided convolution (4; the "
                        "paper's 3 divides few of our lengths)",
                 use_bias="biases in the compression convolutions", scale="multiplies the logits; 1/sqrt(D) when None"), **_LOW_RANK))
