"""Linearised attention: a feature map phi replaces exp(q . k), so that
attention is phi(Q) (phi(K)^T V) / (phi(Q) sum_k phi(K)) in O(T).

Three feature maps share one computation (`feature_attention`):

* `linear` (Katharopoulos et al. 2020): phi(x) = elu(x) + 1. Exact with respect
  to its own kernel phi(q) . phi(k), which is not the softmax kernel.
* `performer` (FAVOR+, Choromanski et al. 2021): positive orthogonal random
  features exp(w^T x - |x|^2 / 2) / sqrt(m), an unbiased estimate of
  exp(q . k * scale).
* `rfa` (Peng et al. 2021): random Fourier features [sin(w^T x), cos(w^T x)] /
  sqrt(m) of (by default l2-normalised) queries and keys, with an optional
  learned gate on the causal recurrence S_t = g_t S_{t-1} + (1 - g_t) phi(k_t) v_t^T.

Causal attention is a chunked prefix sum: within a chunk of c tokens the
c x c quadratic form, across chunks a running [F, Dv] state carried by a
`lax.scan`, so memory stays O(T F + F Dv) rather than the O(T F Dv) of a
per-token cumulative sum. The normaliser rides along as an extra value column
of ones, so numerator and denominator are one computation (and one gating).

Random features live in the `extras` modules (`PerformerFeatures`,
`RfaFeatures`): drawn from the `attention` PRNG stream when the caller supplies
one (a trainer that wants redraws), else from a fixed `seed`.
"""

from __future__ import annotations

import math
from typing import Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from attention_jax import registry
from attention_jax.variants import common

Array = jnp.ndarray

DEFAULT_CHUNK_SIZE = 64


# ----------------------------------------------------------------------------
# The shared computation: normalised feature attention, non-causal or causal.
# ----------------------------------------------------------------------------


def _safe_ratio(numerator: Array, denominator: Array) -> Array:
  """numerator / denominator[..., None], 0 where the denominator is 0 (no key
  to attend: all padded), with finite gradients there."""
  empty = denominator == 0
  safe = jnp.where(empty, 1.0, denominator)
  return jnp.where(empty[..., None], 0.0, numerator / safe[..., None])


def _causal_chunk_scan(q_feat: Array, k_feat: Array, value: Array, log_gates: Array,
                       chunk_size: int) -> Array:
  """sum_{s <= t} exp(a_t - a_s) (phi(q_t) . phi(k_s)) v_s with a_t = sum_{r <= t} log g_r.

  q_feat, k_feat: `[B, T, H, F]`; value: `[B, T, H, Dv]`; log_gates: `[B, T, H]`
  (zeros for ungated attention). Returns `[B, T, H, Dv]`.
  """
  batch, length, heads, features = q_feat.shape
  chunk = min(chunk_size, length)
  padded = -(-length // chunk) * chunk
  if padded != length:
    # Zero features and zero log-gates make the padding a no-op on the state.
    pad = lambda x: jnp.pad(x, [(0, 0), (0, padded - length)] + [(0, 0)] * (x.ndim - 2))
    q_feat, k_feat, value, log_gates = map(pad, (q_feat, k_feat, value, log_gates))
  num_chunks = padded // chunk
  # Time-major chunks for the scan: [N, B, c, ...].
  to_chunks = lambda x: jnp.moveaxis(x.reshape((batch, num_chunks, chunk) + x.shape[2:]), 1, 0)
  lower = jnp.tril(jnp.ones((chunk, chunk), bool))

  def step(state, chunk_inputs):
    q, k, v, log_g = chunk_inputs  # [B, c, H, F], [B, c, H, F], [B, c, H, Dv], [B, c, H]
    decay = jnp.cumsum(log_g, axis=1)  # a_t - a_start within the chunk, <= 0
    # Within the chunk: pairs s <= t weighted by exp(a_t - a_s) (masked before exp).
    gap = decay[:, :, None, :] - decay[:, None, :, :]  # [B, t, s, H]
    weights = jnp.where(lower[None, :, :, None], jnp.exp(jnp.where(lower[None, :, :, None],
                                                                    gap, 0.0)), 0.0)
    scores = jnp.einsum("bthf,bshf->btsh", q, k) * weights
    out = jnp.einsum("btsh,bshd->bthd", scores, v)
    # Earlier chunks: the carried state, decayed to each position.
    out = out + jnp.einsum("bthf,bhfd->bthd", q * jnp.exp(decay)[..., None], state)
    last = decay[:, -1]  # [B, H]
    k_to_end = k * jnp.exp(last[:, None] - decay)[..., None]
    state = (state * jnp.exp(last)[..., None, None]
             + jnp.einsum("bshf,bshd->bhfd", k_to_end, v))
    return state, out

  state = jnp.zeros((batch, heads, features, value.shape[-1]), jnp.result_type(q_feat, value))
  _, out = jax.lax.scan(step, state, tuple(map(to_chunks, (q_feat, k_feat, value, log_gates))))
  out = jnp.moveaxis(out, 0, 1).reshape((batch, padded) + out.shape[3:])
  return out[:, :length]


def feature_attention(q_feat: Array, k_feat: Array, value: Array, *, is_causal: bool = False,
                      key_valid: Optional[Array] = None, gates: Optional[Array] = None,
                      chunk_size: int = DEFAULT_CHUNK_SIZE) -> Array:
  """sum_s phi(q_t) . phi(k_s) v_s / sum_s phi(q_t) . phi(k_s) over the keys s each query sees.

  Args:
    q_feat: `[B, Tq, H, F]` query features phi(q).
    k_feat: `[B, Tk, H, F]` key features phi(k) (heads already matched to the query).
    value: `[B, Tk, H, Dv]`.
    is_causal: query t sees keys s <= t (needs Tq == Tk); chunked prefix sums.
    key_valid: `[B, Tk]` bool, False for padded keys, which then contribute
      nothing (and, gated, do not decay the state).
    gates: `[B, Tk, H]` in (0, 1), causal only: S_t = g_t S_{t-1} + (1 - g_t) phi(k_t) v_t^T
      (and the normaliser likewise), as in gated RFA.
    chunk_size: tokens per chunk of the causal scan.

  Returns:
    `[B, Tq, H, Dv]`; a query with a zero normaliser (nothing to attend) gives zeros.
  """
  common.check_size("chunk_size", chunk_size)
  if gates is not None and not is_causal:
    raise ValueError("gates (gated recurrence) need is_causal=True: the gate orders the keys.")
  if is_causal and q_feat.shape[1] != k_feat.shape[1]:
    raise ValueError(f"causal feature attention needs Tq == Tk, got Tq={q_feat.shape[1]} and "
                     f"Tk={k_feat.shape[1]}.")
  if key_valid is not None:
    k_feat = jnp.where(key_valid[:, :, None, None], k_feat, 0.0)
  if gates is not None:
    k_feat = k_feat * (1.0 - gates)[..., None]
  # A column of ones carries the normaliser through the same sums.
  value = jnp.concatenate([value, jnp.ones(value.shape[:-1] + (1,), value.dtype)], axis=-1)
  if is_causal:
    if gates is None:
      log_gates = jnp.zeros(k_feat.shape[:3], k_feat.dtype)
    else:
      log_gates = jnp.log(gates)
      if key_valid is not None:
        log_gates = jnp.where(key_valid[:, :, None], log_gates, 0.0)
    out = _causal_chunk_scan(q_feat, k_feat, value, log_gates, chunk_size)
  else:
    state = jnp.einsum("bshf,bshd->bhfd", k_feat, value)
    out = jnp.einsum("bthf,bhfd->bthd", q_feat, state)
  return _safe_ratio(out[..., :-1], out[..., -1])


def _prepare(variant: str, query: Array, key: Array, bias, mask, is_causal, segment_ids,
             key_value_seq_lengths):
  """Shared argument handling: refuses what O(T) cannot apply; the key padding `[B, Tk]`."""
  common.reject_unsupported(variant, bias=bias, segment_ids=segment_ids)
  if is_causal and query.shape[1] != key.shape[1]:
    raise ValueError(f"attention variant {variant!r}: is_causal needs Tq == Tk, got "
                     f"Tq={query.shape[1]}, Tk={key.shape[1]}.")
  return common.key_padding(variant, mask, key_value_seq_lengths, key.shape[0], key.shape[1])


# ----------------------------------------------------------------------------
# linear: phi(x) = elu(x) + 1.
# ----------------------------------------------------------------------------


def elu_feature_map(x: Array) -> Array:
  """phi(x) = elu(x) + 1 > 0, the feature map of Katharopoulos et al."""
  return jax.nn.elu(x) + 1.0


def linear_attention(query: Array, key: Array, value: Array, bias: Optional[Array] = None,
                     mask: Optional[Array] = None, *, is_causal: bool = False,
                     query_seq_lengths: Optional[Array] = None,
                     key_value_seq_lengths: Optional[Array] = None, segment_ids=None,
                     chunk_size: int = DEFAULT_CHUNK_SIZE) -> Array:
  """Linear attention phi(Q) (phi(K)^T V) / (phi(Q) sum phi(K)), phi = elu + 1.

  Args:
    query: `[B, Tq, H, D]`; key: `[B, Tk, Hkv, D]`; value: `[B, Tk, Hkv, Dv]`.
    bias, segment_ids: not supported (ValueError).
    mask: key-padding mask `[B|1, 1, 1, Tk]` only.
    is_causal: prefix sums over a chunked scan (Tq == Tk).
    query_seq_lengths, key_value_seq_lengths: `[B]` padding.
    chunk_size: chunk of the causal scan (O(c) extra work per token).

  Returns:
    `[B, Tq, H, Dv]`.
  """
  key_valid = _prepare("linear", query, key, bias, mask, is_causal, segment_ids,
                       key_value_seq_lengths)
  heads = query.shape[2]
  out = feature_attention(elu_feature_map(query),
                          common.repeat_kv_heads(elu_feature_map(key), heads),
                          common.repeat_kv_heads(value, heads), is_causal=is_causal,
                          key_valid=key_valid, chunk_size=chunk_size)
  return common.zero_padded_queries(out.astype(query.dtype), query_seq_lengths)


# ----------------------------------------------------------------------------
# Random projections (Performer, RFA).
# ----------------------------------------------------------------------------


def gaussian_projection(rng: Array, num_features: int, dim: int, *,
                        orthogonal: bool = True) -> Array:
  """`[m, D]` rows w_i ~ N(0, I_D): iid, or orthogonal within blocks of D rows.

  Orthogonal blocks come from the QR decomposition of a Gaussian matrix; each
  row's norm is then redrawn from the chi(D) distribution (the norm of a
  Gaussian vector) so every row is still marginally N(0, I) (Choromanski et al.).
  """
  common.check_size("num_features", num_features)
  if not orthogonal:
    return jax.random.normal(rng, (num_features, dim))
  num_blocks = -(-num_features // dim)
  block_rng, norm_rng = jax.random.split(rng)
  gaussian = jax.random.normal(block_rng, (num_blocks, dim, dim))
  orthonormal, upper = jnp.linalg.qr(gaussian)  # columns orthonormal, per block
  # Householder QR fixes the signs (e.g. column 1's first entry is always
  # negative); the signs of R's diagonal undo that, making Q uniform (Haar).
  orthonormal = orthonormal * jnp.sign(jnp.diagonal(upper, axis1=1, axis2=2))[:, None, :]
  rows = jnp.swapaxes(orthonormal, 1, 2).reshape(num_blocks * dim, dim)[:num_features]
  norms = jnp.linalg.norm(jax.random.normal(norm_rng, (num_features, dim)), axis=-1)
  return rows * norms[:, None]


def _draw_rng(module: nn.Module, seed: int) -> Array:
  """The `attention` stream when the caller provides it (redraws), else a fixed seed."""
  if module.has_rng("attention"):
    return module.make_rng("attention")
  return jax.random.PRNGKey(seed)


def _scaled(query: Array, key: Array, scale: Optional[float]):
  """q and k each times sqrt(scale), so that q . k is scaled by `scale` (1/sqrt(D) default)."""
  scale = query.shape[-1] ** -0.5 if scale is None else scale
  root = math.sqrt(scale)
  return query * root, key * root


# ----------------------------------------------------------------------------
# performer: FAVOR+ positive random features.
# ----------------------------------------------------------------------------


def positive_feature_logits(x: Array, projection: Array) -> Array:
  """log phi(x) = w_i^T x - |x|^2 / 2 - log(m) / 2: `[..., D]` -> `[..., m]`.

  E_w[phi(q) . phi(k)] = exp(q . k) for w ~ N(0, I) (FAVOR+).
  """
  num_features = projection.shape[0]
  return (jnp.einsum("...d,md->...m", x, projection)
          - 0.5 * jnp.sum(x * x, axis=-1, keepdims=True) - 0.5 * math.log(num_features))


def performer_features(query: Array, key: Array, projection: Array,
                       key_valid: Optional[Array] = None):
  """Positive features of q `[B, Tq, H, D]` and k `[B, Tk, Hkv, D]`, stabilised.

  A constant factor exp(-c) cancels between numerator and denominator: per
  query row for the queries, and one constant per (batch, head) over all valid
  keys for the keys (a per-key factor would not cancel). The constants are
  treated as such (stop_gradient).
  """
  q_logits = positive_feature_logits(query, projection)
  k_logits = positive_feature_logits(key, projection)
  q_max = jax.lax.stop_gradient(jnp.max(q_logits, axis=-1, keepdims=True))
  valid_logits = k_logits if key_valid is None else jnp.where(
      key_valid[:, :, None, None], k_logits, -jnp.inf)
  k_max = jnp.max(valid_logits, axis=(1, 3), keepdims=True)
  k_max = jax.lax.stop_gradient(jnp.where(jnp.isfinite(k_max), k_max, 0.0))
  return jnp.exp(q_logits - q_max), jnp.exp(k_logits - k_max)


def performer_attention(query: Array, key: Array, value: Array, bias: Optional[Array] = None,
                        mask: Optional[Array] = None, *, is_causal: bool = False,
                        query_seq_lengths: Optional[Array] = None,
                        key_value_seq_lengths: Optional[Array] = None, segment_ids=None,
                        projection: Array, scale: Optional[float] = None,
                        chunk_size: int = DEFAULT_CHUNK_SIZE) -> Array:
  """FAVOR+ estimate of softmax(q k^T * scale) v in O(T m).

  Args:
    query: `[B, Tq, H, D]`; key: `[B, Tk, Hkv, D]`; value: `[B, Tk, Hkv, Dv]`.
    bias, segment_ids: not supported (ValueError).
    mask: key-padding mask `[B|1, 1, 1, Tk]` only.
    is_causal: prefix sums over a chunked scan (Tq == Tk).
    query_seq_lengths, key_value_seq_lengths: `[B]` padding.
    projection: `[m, D]` random features (`gaussian_projection`, made by `PerformerFeatures`).
    scale: logit scale, 1/sqrt(D) by default.
    chunk_size: chunk of the causal scan.

  Returns:
    `[B, Tq, H, Dv]`.
  """
  key_valid = _prepare("performer", query, key, bias, mask, is_causal, segment_ids,
                       key_value_seq_lengths)
  scaled_q, scaled_k = _scaled(query.astype(jnp.float32), key.astype(jnp.float32), scale)
  q_feat, k_feat = performer_features(scaled_q, scaled_k, projection.astype(jnp.float32),
                                      key_valid)
  heads = query.shape[2]
  out = feature_attention(q_feat, common.repeat_kv_heads(k_feat, heads),
                          common.repeat_kv_heads(value.astype(jnp.float32), heads),
                          is_causal=is_causal, key_valid=key_valid, chunk_size=chunk_size)
  return common.zero_padded_queries(out.astype(query.dtype), query_seq_lengths)


class PerformerFeatures(nn.Module):
  """The random projection of `performer`: `{"projection": [m, D]}`.

  Attributes:
    num_features: m.
    orthogonal: orthogonal random features (FAVOR+); iid Gaussian otherwise.
    seed: used when no `attention` PRNG stream is given (fixed features).
  """

  num_features: int = 64
  orthogonal: bool = True
  seed: int = 0

  @nn.compact
  def __call__(self, query, key, value, deterministic: bool = True):
    del key, value, deterministic  # Redraws follow the `attention` stream, not dropout.
    projection = gaussian_projection(_draw_rng(self, self.seed), self.num_features,
                                     query.shape[-1], orthogonal=self.orthogonal)
    return {"projection": jax.lax.stop_gradient(projection)}


# ----------------------------------------------------------------------------
# rfa: random Fourier features, optional gating.
# ----------------------------------------------------------------------------


def random_fourier_features(x: Array, projection: Array) -> Array:
  """[sin(W x), cos(W x)] / sqrt(m): `[..., D]` -> `[..., 2m]`.

  phi(x) . phi(y) = mean_i cos(w_i . (x - y)), whose expectation for
  w ~ N(0, I) is the Gaussian kernel exp(-|x - y|^2 / 2).
  """
  angles = jnp.einsum("...d,md->...m", x, projection)
  return jnp.concatenate([jnp.sin(angles), jnp.cos(angles)], axis=-1) / math.sqrt(
      projection.shape[0])


def rfa_gates(key: Array, gate_kernel: Array, gate_bias: Array) -> Array:
  """g_t = sigmoid(w_h . k_t + b_h): key `[B, T, Hkv, D]`, kernel `[Hkv, D]`,
  bias `[Hkv]` -> `[B, T, Hkv]`."""
  return jax.nn.sigmoid(jnp.einsum("bthd,hd->bth", key, gate_kernel) + gate_bias)


def rfa_attention(query: Array, key: Array, value: Array, bias: Optional[Array] = None,
                  mask: Optional[Array] = None, *, is_causal: bool = False,
                  query_seq_lengths: Optional[Array] = None,
                  key_value_seq_lengths: Optional[Array] = None, segment_ids=None,
                  projection: Array, gate_kernel: Optional[Array] = None,
                  gate_bias: Optional[Array] = None, normalize: bool = True,
                  scale: Optional[float] = None,
                  chunk_size: int = DEFAULT_CHUNK_SIZE) -> Array:
  """Random feature attention: estimates softmax(q k^T * scale) v in O(T m).

  With `normalize` (the paper's setting) q and k are l2-normalised first, so the
  Gaussian kernel exp(-s |q - k|^2 / 2) the features estimate is exp(s q . k)
  up to a constant that cancels; `scale` s plays the paper's 1 / sigma^2
  (1 by default then; 1/sqrt(D) without normalisation). Without `normalize`
  each key's features carry the factor exp(s |k|^2 / 2) that turns the
  Gaussian kernel into exp(s q . k) (the query's factor cancels).

  Args:
    query: `[B, Tq, H, D]`; key: `[B, Tk, Hkv, D]`; value: `[B, Tk, Hkv, Dv]`.
    bias, segment_ids: not supported (ValueError).
    mask: key-padding mask `[B|1, 1, 1, Tk]` only.
    is_causal: prefix sums over a chunked scan (Tq == Tk).
    query_seq_lengths, key_value_seq_lengths: `[B]` padding.
    projection: `[m, D]` Gaussian rows (made by `RfaFeatures`).
    gate_kernel, gate_bias: `[Hkv, D]`, `[Hkv]`: the gated recurrence
      S_t = g_t S_{t-1} + (1 - g_t) phi(k_t) v_t^T with g_t = sigmoid(w . k_t + b)
      (causal only; the gate is computed from the projected key of each head).
    normalize: l2-normalise q and k.
    scale: see above.
    chunk_size: chunk of the causal scan.

  Returns:
    `[B, Tq, H, Dv]`. Fourier features are not positive, so with few features
    the normaliser can come near zero (a known weakness of RFA's estimator).
  """
  key_valid = _prepare("rfa", query, key, bias, mask, is_causal, segment_ids,
                       key_value_seq_lengths)
  if (gate_kernel is None) != (gate_bias is None):
    raise ValueError("rfa needs both gate_kernel and gate_bias, or neither.")
  if gate_kernel is not None and not is_causal:
    raise ValueError("rfa's gating is a causal recurrence: pass is_causal=True or gated=False.")
  query, key = query.astype(jnp.float32), key.astype(jnp.float32)
  gates = None if gate_kernel is None else rfa_gates(key, gate_kernel, gate_bias)
  if normalize:
    unit = lambda x: x * jax.lax.rsqrt(jnp.maximum(jnp.sum(x * x, -1, keepdims=True), 1e-12))
    query, key = unit(query), unit(key)
    scale = 1.0 if scale is None else scale
  scaled_q, scaled_k = _scaled(query, key, scale)
  projection = projection.astype(jnp.float32)
  q_feat = random_fourier_features(scaled_q, projection)
  # exp(|k|^2 / 2) turns the Gaussian kernel into exp(q . k); one stabilising
  # constant per (batch, head) over the valid keys cancels in the ratio.
  log_norm = 0.5 * jnp.sum(scaled_k * scaled_k, axis=-1, keepdims=True)
  valid_norm = log_norm if key_valid is None else jnp.where(key_valid[:, :, None, None],
                                                            log_norm, -jnp.inf)
  norm_max = jnp.max(valid_norm, axis=1, keepdims=True)
  norm_max = jax.lax.stop_gradient(jnp.where(jnp.isfinite(norm_max), norm_max, 0.0))
  k_feat = random_fourier_features(scaled_k, projection) * jnp.exp(log_norm - norm_max)
  heads = query.shape[2]
  out = feature_attention(
      q_feat, common.repeat_kv_heads(k_feat, heads),
      common.repeat_kv_heads(value.astype(jnp.float32), heads), is_causal=is_causal,
      key_valid=key_valid,
      gates=None if gates is None else common.repeat_kv_heads(gates[..., None], heads)[..., 0],
      chunk_size=chunk_size)
  return common.zero_padded_queries(out.astype(value.dtype), query_seq_lengths)


class RfaFeatures(nn.Module):
  """The arrays of `rfa`: `{"projection": [m, D]}` plus, when `gated`, the gate's
  `gate_kernel [Hkv, D]` and `gate_bias [Hkv]` (learned parameters).

  Attributes:
    num_features: m (the features are 2m: sin and cos).
    orthogonal: orthogonal blocks instead of iid Gaussian rows.
    gated: learned gate on the causal recurrence.
    seed: used when no `attention` PRNG stream is given (fixed features).
  """

  num_features: int = 64
  orthogonal: bool = False
  gated: bool = False
  seed: int = 0

  @nn.compact
  def __call__(self, query, key, value, deterministic: bool = True):
    del value, deterministic
    projection = gaussian_projection(_draw_rng(self, self.seed), self.num_features,
                                     query.shape[-1], orthogonal=self.orthogonal)
    arrays = {"projection": jax.lax.stop_gradient(projection)}
    if self.gated:
      kv_heads, dim = key.shape[2], key.shape[3]
      arrays["gate_kernel"] = self.param("gate_kernel", nn.initializers.normal(dim ** -0.5),
                                         (kv_heads, dim))
      arrays["gate_bias"] = self.param("gate_bias", nn.initializers.zeros_init(), (kv_heads,))
    return arrays


_LINEAR = dict(family="linear", subquadratic=True, exact=False, causal=True, cross=True)
_CHUNK = dict(chunk_size="causal form: positions per chunk of the prefix-sum scan")
_FEATURES = dict(num_features="random features m",
                 orthogonal="orthogonal random projections (else i.i.d. Gaussian)",
                 seed="feature seed when the caller gives no 'attention' RNG stream",
                 scale="multiplies q and k's product; 1/sqrt(D) when None")
registry.register(registry.VariantSpec(
    name="linear", fn=linear_attention, complexity="O(T D Dv)",
    paper="Katharopoulos et al. 2020", options=_CHUNK, **_LINEAR))
registry.register(registry.VariantSpec(
    name="performer", fn=performer_attention, complexity="O(T m D)",
    paper="Choromanski et al. 2021", extras=PerformerFeatures, options={**_FEATURES, **_CHUNK},
    **_LINEAR))
registry.register(registry.VariantSpec(
    name="rfa", fn=rfa_attention, complexity="O(T m D)", paper="Peng et al. 2021",
    extras=RfaFeatures,
    options=dict(_FEATURES, gated="learned forget gates (causal RFA-Gate)",
                 normalize="unit-norm queries and keys before the features", **_CHUNK),
    **_LINEAR))
