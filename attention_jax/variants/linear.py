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
`RfaFeatures`), one draw per layer kept in the model's "random" collection
(`common.layer_random`): drawn at initialisation, redrawn in training every
`redraw_every` calls from the "attention" stream, fixed in evaluation.

The LRA release's variants of these computations (docs/lra_release.md) are
options: `mask_padding=False` (its linear attention and Performer apply no
padding mask), `epsilon` (its linear attention's 1 / (normaliser + 1e-6)), the
Performer's `kernel="relu"` (its generalized attention, relu(x) + 1e-3 with no
random features) and `numerical_stabilizer` (its FAVOR+ features and
normaliser stabilisation).
"""

from __future__ import annotations

import math
import numbers
from typing import Callable, Mapping, Optional

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


@jax.custom_jvp
def _safe_ratio(numerator: Array, denominator: Array) -> Array:
  """numerator / denominator[..., None], 0 where the denominator is 0 (no key
  to attend: all padded).

  The derivative is (dn - out dd) / d, dividing once: the built-in quotient
  rule squares the denominator, which overflows to inf (and NaN after a zero
  feature) once a query's normaliser falls below ~1e-19, while its output,
  a weighted mean of values, is still exact.
  """
  empty = denominator == 0
  safe = jnp.where(empty, 1.0, denominator)
  return jnp.where(empty[..., None], 0.0, numerator / safe[..., None])


@_safe_ratio.defjvp
def _safe_ratio_jvp(primals, tangents):
  numerator, denominator = primals
  d_numerator, d_denominator = tangents
  out = _safe_ratio(numerator, denominator)
  empty = denominator == 0
  safe = jnp.where(empty, 1.0, denominator)
  d_out = (d_numerator - out * d_denominator[..., None]) / safe[..., None]
  return out, jnp.where(empty[..., None], 0.0, d_out)


# A log-scale below every real one (finite, so that differences of two stay 0, not NaN).
_NO_KEY = -1e30


def _causal_chunk_scan(q_feat: Array, k_feat: Array, value: Array, log_gates: Array,
                       key_log_scale: Array, chunk_size: int,
                       initial_state: Optional[Array] = None,
                       initial_shift: Optional[Array] = None):
  """sum_{s <= t} exp(a_t - a_s + l_s) (phi(q_t) . phi(k_s)) v_s with a_t = sum_{r <= t} log g_r,
  plus exp(a_t + c_0) phi(q_t) S_0 for the keys before these, summed in `initial_state`;
  each query's sum is divided by exp(C_t), C_t the largest l_s (and c_0) it sees.

  Key s's features are phi(k_s) exp(l_s): a feature map whose scale varies
  over keys by more than float32 holds (Performer's exp(w . k - |k|^2 / 2))
  passes each key's features divided by its own largest one, and that
  largest's log as l_s. Dividing by a running maximum rather than one
  constant over the whole sequence keeps every query's largest term at 1: an
  early key far below a later one would otherwise underflow, and with it the
  only keys the early queries see. exp(C_t) cancels in `feature_attention`'s
  ratio (its normaliser rides in the same sums).

  q_feat, k_feat: `[B, T, H, F]`; value: `[B, T, H, Dv]`; log_gates: `[B, T, H]`
  (zeros for ungated attention); key_log_scale: l `[B, T, H]` (zeros: features
  as given; `_NO_KEY` for padding); initial_state: S_0 `[B, H, F, Dv]` (zeros
  when None) and initial_shift: its log-scale c_0 `[B, H]` (`_NO_KEY`: no key
  yet). Returns `([B, T, H, Dv], the state after the last key, its log-scale)`.
  """
  batch, length, heads, features = q_feat.shape
  chunk = min(chunk_size, length)
  padded = -(-length // chunk) * chunk
  if padded != length:
    # Zero features and zero log-gates make the padding a no-op on the state.
    pad = lambda x, fill=0.0: jnp.pad(x, [(0, 0), (0, padded - length)] + [(0, 0)] * (x.ndim - 2),
                                      constant_values=fill)
    q_feat, k_feat, value, log_gates = map(pad, (q_feat, k_feat, value, log_gates))
    key_log_scale = pad(key_log_scale, _NO_KEY)
  num_chunks = padded // chunk
  # Time-major chunks for the scan: [N, B, c, ...].
  to_chunks = lambda x: jnp.moveaxis(x.reshape((batch, num_chunks, chunk) + x.shape[2:]), 1, 0)
  lower = jnp.tril(jnp.ones((chunk, chunk), bool))[None, :, :, None]

  def step(carry, chunk_inputs):
    state, shift = carry  # [B, H, F, Dv], [B, H]
    q, k, v, log_g, log_scale = chunk_inputs  # [B, c, H, F] (q, k), [B, c, H, Dv], [B, c, H] x 2
    decay = jnp.cumsum(log_g, axis=1)  # a_t - a_start within the chunk, <= 0
    query_shift = jnp.maximum(shift[:, None], jax.lax.cummax(log_scale, axis=1))  # C_t
    # Within the chunk: pairs s <= t weighted by exp(a_t - a_s + l_s - C_t) (masked before exp).
    log_weights = (decay[:, :, None, :] - decay[:, None, :, :] + log_scale[:, None, :, :]
                   - query_shift[:, :, None, :])  # [B, t, s, H]
    weights = jnp.where(lower, jnp.exp(jnp.where(lower, log_weights, 0.0)), 0.0)
    scores = jnp.einsum("bthf,bshf->btsh", q, k) * weights
    out = jnp.einsum("btsh,bshd->bthd", scores, v)
    # Earlier chunks: the carried state, decayed to each position.
    carried = jnp.exp(decay + shift[:, None] - query_shift)
    out = out + jnp.einsum("bthf,bhfd->bthd", q * carried[..., None], state)
    last, new_shift = decay[:, -1], query_shift[:, -1]  # [B, H]
    k_to_end = k * jnp.exp(last[:, None] - decay + log_scale - new_shift[:, None])[..., None]
    state = (state * jnp.exp(last + shift - new_shift)[..., None, None]
             + jnp.einsum("bshf,bshd->bhfd", k_to_end, v))
    return (state, new_shift), out

  state = (jnp.zeros((batch, heads, features, value.shape[-1]), jnp.result_type(q_feat, value))
           if initial_state is None else initial_state)
  shift = (jnp.full((batch, heads), _NO_KEY, state.dtype) if initial_shift is None
           else initial_shift)
  (state, shift), out = jax.lax.scan(
      step, (state, shift),
      tuple(map(to_chunks, (q_feat, k_feat, value, log_gates, key_log_scale))))
  out = jnp.moveaxis(out, 0, 1).reshape((batch, padded) + out.shape[3:])
  return out[:, :length], state, shift


def feature_attention(q_feat: Array, k_feat: Array, value: Array, *, is_causal: bool = False,
                      key_valid: Optional[Array] = None, gates: Optional[Array] = None,
                      chunk_size: int = DEFAULT_CHUNK_SIZE,
                      normalizer: Optional[Callable[[Array], Array]] = None,
                      key_log_scale: Optional[Array] = None,
                      state: Optional[Mapping[str, Array]] = None):
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
    normalizer: applied to each query's normaliser `[B, Tq, H]` before the
      division (a stabiliser such as the LRA release's `+ eps`); None: as is.
    key_log_scale: l `[B, Tk, H]` (no gradient) when each key's features
      were divided by exp(l_s), to stay within float32: the features used are
      `k_feat * exp(l)`, brought to each query's largest l_s it sees (causal)
      or to the largest over all keys, factors that cancel in the ratio.
      None: zeros.
    state: causal decoding: what the keys before these left, `{"sums":
      [B, H, F, Dv + 1], "shift": [B, H], "started": [B, H]}` (all zeros, or
      `{}`: no key yet); the sums are divided by exp(shift), rescaled to a
      larger one as an online softmax does, so the outputs equal the causal
      pass over all the keys at once.

  Returns:
    `[B, Tq, H, Dv]`; a query with a zero normaliser (nothing to attend) gives
    zeros. With `state`: `(that, the state after these keys)`.
  """
  common.check_size("chunk_size", chunk_size)
  if gates is not None and not is_causal:
    raise ValueError("gates (gated recurrence) need is_causal=True: the gate orders the keys.")
  if is_causal and q_feat.shape[1] != k_feat.shape[1]:
    raise ValueError(f"causal feature attention needs Tq == Tk, got Tq={q_feat.shape[1]} and "
                     f"Tk={k_feat.shape[1]}.")
  if state is not None and not is_causal:
    raise ValueError("a recurrent state continues causal attention: pass is_causal=True.")
  key_log_scale = (jnp.zeros(k_feat.shape[:3], k_feat.dtype) if key_log_scale is None
                   else jax.lax.stop_gradient(key_log_scale))
  if key_valid is not None:
    k_feat = jnp.where(key_valid[:, :, None, None], k_feat, 0.0)
    key_log_scale = jnp.where(key_valid[:, :, None], key_log_scale, _NO_KEY)
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
    initial, shift = None, None
    if state is not None:
      initial, shift = _continued(state, k_feat.shape, value.shape[-1])
    out, final, shift = _causal_chunk_scan(q_feat, k_feat, value, log_gates, key_log_scale,
                                           chunk_size, initial, shift)
  else:
    largest = jnp.max(key_log_scale, axis=1, keepdims=True)
    k_feat = k_feat * jnp.exp(key_log_scale - largest)[..., None]
    sums = jnp.einsum("bshf,bshd->bhfd", k_feat, value)
    out = jnp.einsum("bthf,bhfd->bthd", q_feat, sums)
  denominator = out[..., -1] if normalizer is None else normalizer(out[..., -1])
  out = _safe_ratio(out[..., :-1], denominator)
  if state is None:
    return out
  return out, {"sums": final, "shift": shift, "started": jnp.ones_like(shift)}


def _continued(state: Mapping[str, Array], k_shape, value_dim: int):
  """A decoding state's sums `[B, H, F, Dv + 1]` and their log-scale `[B, H]`
  (`_NO_KEY` before the first key)."""
  batch, _, heads, features = k_shape
  sums = state.get("sums", jnp.zeros((batch, heads, features, value_dim), jnp.float32))
  if sums.shape != (batch, heads, features, value_dim):
    raise ValueError(f"state['sums'] must be [B, H, F, Dv + 1] = "
                     f"{[batch, heads, features, value_dim]}, got shape {list(sums.shape)}.")
  started = state.get("started", jnp.zeros((batch, heads), sums.dtype)) > 0
  shift = jnp.where(started, state.get("shift", jnp.zeros((batch, heads), sums.dtype)), _NO_KEY)
  return sums, shift


def _prepare(variant: str, query: Array, key: Array, bias, mask, is_causal, segment_ids,
             key_value_seq_lengths, mask_padding: bool = True):
  """Shared argument handling: refuses what O(T) cannot apply; the key padding
  `[B, Tk]` (None without padding, or when `mask_padding` is False: the LRA
  release's linear attention and Performer take no padding mask; a mask of
  another shape is still refused)."""
  common.reject_unsupported(variant, bias=bias, segment_ids=segment_ids)
  if is_causal and query.shape[1] != key.shape[1]:
    raise ValueError(f"attention variant {variant!r}: is_causal needs Tq == Tk, got "
                     f"Tq={query.shape[1]}, Tk={key.shape[1]}.")
  valid = common.key_padding(variant, mask, key_value_seq_lengths, key.shape[0], key.shape[1])
  return valid if mask_padding else None


def _padded_queries_zeroed(out: Array, query_seq_lengths: Optional[Array],
                           mask_padding: bool) -> Array:
  """Zeros padded queries' outputs, unless padding is not masked (the release)."""
  return common.zero_padded_queries(out, query_seq_lengths) if mask_padding else out


def _check_epsilon(name: str, value: float) -> float:
  if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
    raise ValueError(f"{name} must be a float >= 0, got {value!r}.")
  return float(value)


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
                     chunk_size: int = DEFAULT_CHUNK_SIZE, epsilon: float = 0.0,
                     mask_padding: bool = True,
                     recurrent_state: Optional[Mapping[str, Array]] = None):
  """Linear attention phi(Q) (phi(K)^T V) / (phi(Q) sum phi(K) + epsilon), phi = elu + 1.

  Args:
    query: `[B, Tq, H, D]`; key: `[B, Tk, Hkv, D]`; value: `[B, Tk, Hkv, Dv]`.
    bias, segment_ids: not supported (ValueError).
    mask: key-padding mask `[B|1, 1, 1, Tk]` only.
    is_causal: prefix sums over a chunked scan (Tq == Tk).
    query_seq_lengths, key_value_seq_lengths: `[B]` padding.
    chunk_size: chunk of the causal scan (O(c) extra work per token).
    epsilon: added to every normaliser (the LRA release's, and Katharopoulos
      et al.'s code's, 1e-6); 0 divides by the normaliser itself.
    mask_padding: apply the padding (lengths or key-padding mask). False
      ignores it, as the LRA release's linear attention does: padded keys are
      attended like any other and padded queries get outputs.
    recurrent_state: causal decoding: the state the keys before these left
      (`feature_attention`'s; `{}` for none), in O(F Dv) per head whatever
      their number; the function then returns `(out, the new state)`.

  Returns:
    `[B, Tq, H, Dv]` (and the state, with `recurrent_state`).
  """
  key_valid = _prepare("linear", query, key, bias, mask, is_causal, segment_ids,
                       key_value_seq_lengths, mask_padding)
  epsilon = _check_epsilon("epsilon", epsilon)
  heads = query.shape[2]
  # Sums over the whole sequence (and the causal state carried across chunks)
  # in float32 at least, as performer and rfa: in bfloat16 they drifted to ~20 times the
  # output's own rounding over 8k tokens. The output returns to the query dtype.
  dtype = jnp.promote_types(jnp.result_type(query, key, value), jnp.float32)
  features = lambda x: elu_feature_map(x.astype(dtype))
  out = feature_attention(features(query),
                          common.repeat_kv_heads(features(key), heads),
                          common.repeat_kv_heads(value.astype(dtype), heads),
                          is_causal=is_causal,
                          key_valid=key_valid, chunk_size=chunk_size,
                          normalizer=(lambda r: r + epsilon) if epsilon else None,
                          state=recurrent_state)
  return _with_state(out, recurrent_state, lambda out: _padded_queries_zeroed(
      out.astype(query.dtype), query_seq_lengths, mask_padding))


def _with_state(out, recurrent_state, finish: Callable[[Array], Array]):
  """`finish(out)`, with the new state beside it when decoding from one."""
  if recurrent_state is None:
    return finish(out)
  out, state = out
  return finish(out), state


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
  # Columns orthonormal, per block, one matrix per QR call (lax.map) rather than
  # one batched call: on CPU a batched LAPACK call hands its matrices to XLA's
  # intra-op thread pool and blocks a pool thread until they are done, so two
  # in one program (two layers redrawing their projections) can take both
  # threads of a 2-core pool and wait on each other forever (the chunkwise
  # engine's triangular solves did; docs/ARCHITECTURE.md). Same matrices, same
  # LAPACK routine: the same projection.
  orthonormal, upper = jax.lax.map(jnp.linalg.qr, gaussian)
  # Householder QR fixes the signs (e.g. column 1's first entry is always
  # negative); the signs of R's diagonal undo that, making Q uniform (Haar).
  orthonormal = orthonormal * jnp.sign(jnp.diagonal(upper, axis1=1, axis2=2))[:, None, :]
  rows = jnp.swapaxes(orthonormal, 1, 2).reshape(num_blocks * dim, dim)[:num_features]
  norms = jnp.linalg.norm(jax.random.normal(norm_rng, (num_features, dim)), axis=-1)
  return rows * norms[:, None]


def _layer_projection(module: nn.Module, num_features: int, dim: int, orthogonal: bool,
                      deterministic: bool, redraw_every: int) -> Array:
  """This layer's `[m, D]` Gaussian projection (`gaussian_projection`), kept in
  the "random" collection: drawn at initialisation, redrawn in training every
  `redraw_every` calls, fixed in evaluation (`common.layer_random`)."""
  common.check_size("num_features", num_features)
  draw = lambda rng: gaussian_projection(rng, num_features, dim, orthogonal=orthogonal)
  projection = common.layer_random(module, "projection", draw, deterministic=deterministic,
                                   redraw_every=redraw_every)
  return jax.lax.stop_gradient(projection)


def _scaled(query: Array, key: Array, scale: Optional[float]):
  """q and k each times sqrt(scale), so that q . k is scaled by `scale` (1/sqrt(D) default)."""
  scale = query.shape[-1] ** -0.5 if scale is None else scale
  # sqrt(scale) multiplies q and k: 0 would make every weight equal (silently),
  # a negative one would fail inside math.sqrt without naming the option.
  if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not scale > 0:
    raise ValueError(f"scale must be a float > 0 (it multiplies q . k), got {scale!r}.")
  root = math.sqrt(scale)
  return query * root, key * root


# ----------------------------------------------------------------------------
# performer: FAVOR+ positive random features, or the generalized ReLU kernel.
# ----------------------------------------------------------------------------

PERFORMER_KERNELS = ("softmax", "relu")


def positive_feature_logits(x: Array, projection: Array) -> Array:
  """log phi(x) = w_i^T x - |x|^2 / 2 - log(m) / 2: `[..., D]` -> `[..., m]`.

  E_w[phi(q) . phi(k)] = exp(q . k) for w ~ N(0, I) (FAVOR+).
  """
  num_features = projection.shape[0]
  return (jnp.einsum("...d,md->...m", x, projection)
          - 0.5 * jnp.sum(x * x, axis=-1, keepdims=True) - 0.5 * math.log(num_features))


def performer_features(query: Array, key: Array, projection: Array):
  """Positive features of q `[B, Tq, H, D]` and k `[B, Tk, Hkv, D]`, each row
  divided by its largest feature.

  exp(w_i^T x - |x|^2 / 2) spans more than float32 over the rows of one
  sequence (a key of large norm sits ~|k|^2 / 2 below the others). A query's
  factor cancels in its own ratio; a key's does not, so its log comes back as
  `feature_attention`'s `key_log_scale`, which restores it against the
  largest each query sees. Both are constants (stop_gradient): exp(c) exp(x - c)
  does not depend on c.

  Returns:
    `(phi(q) [B, Tq, H, m], phi(k) [B, Tk, Hkv, m], the keys' log-scale [B, Tk, Hkv])`.
  """
  q_logits = positive_feature_logits(query, projection)
  k_logits = positive_feature_logits(key, projection)
  q_max = jax.lax.stop_gradient(jnp.max(q_logits, axis=-1, keepdims=True))
  k_max = jax.lax.stop_gradient(jnp.max(k_logits, axis=-1, keepdims=True))
  return jnp.exp(q_logits - q_max), jnp.exp(k_logits - k_max), k_max[..., 0]


def stabilized_performer_features(query: Array, key: Array, projection: Array,
                                  key_valid: Optional[Array], epsilon: float):
  """FAVOR+ features as the Performer reference code (forked by the LRA release,
  `nonnegative_softmax_kernel_feature_creator`) stabilises them:

      phi(x) = (exp(w_i^T x - |x|^2 / 2 - c) + epsilon) / sqrt(m),

  with c the largest projection w_i^T x (not the largest logit): per query over
  its m features, and per (batch, head) over the features of every (valid) key.
  Unlike `performer_features` the result depends on c through `epsilon`, so it
  is reproduced as written (gradients flow through c, as there).

  query: `[B, Tq, H, D]`, key: `[B, Tk, Hkv, D]` (already scaled), projection
  `[m, D]`, key_valid `[B, Tk]` or None. Returns `([B, Tq, H, m], [B, Tk, Hkv, m])`.
  """
  ratio = projection.shape[0] ** -0.5
  q_dash = jnp.einsum("...d,md->...m", query, projection)
  k_dash = jnp.einsum("...d,md->...m", key, projection)
  q_diag = 0.5 * jnp.sum(query * query, axis=-1, keepdims=True)
  k_diag = 0.5 * jnp.sum(key * key, axis=-1, keepdims=True)
  q_shift = jnp.max(q_dash, axis=-1, keepdims=True)
  valid_dash = k_dash if key_valid is None else jnp.where(key_valid[:, :, None, None], k_dash,
                                                          -jnp.inf)
  k_shift = jnp.max(valid_dash, axis=(1, 3), keepdims=True)
  k_shift = jnp.where(jnp.isfinite(k_shift), k_shift, 0.0)
  q_feat = ratio * (jnp.exp(q_dash - q_diag - q_shift) + epsilon)
  k_feat = ratio * (jnp.exp(k_dash - k_diag - k_shift) + epsilon)
  return q_feat, k_feat


def relu_kernel_features(x: Array, epsilon: float) -> Array:
  """relu(x) + epsilon: the generalized-attention features of the Performer
  reference code with its ReLU kernel and no random projection (`features_type=
  'deterministic'`, what the LRA release's Performer runs by default)."""
  return jax.nn.relu(x) + epsilon


def check_performer_kernel(kernel: str) -> str:
  if kernel not in PERFORMER_KERNELS:
    raise ValueError(f"kernel must be one of {PERFORMER_KERNELS}, got {kernel!r}.")
  return kernel


def performer_attention(query: Array, key: Array, value: Array, bias: Optional[Array] = None,
                        mask: Optional[Array] = None, *, is_causal: bool = False,
                        query_seq_lengths: Optional[Array] = None,
                        key_value_seq_lengths: Optional[Array] = None, segment_ids=None,
                        projection: Optional[Array] = None, kernel: str = "softmax",
                        scale: Optional[float] = None, kernel_epsilon: float = 0.0,
                        numerical_stabilizer: float = 0.0, mask_padding: bool = True,
                        chunk_size: int = DEFAULT_CHUNK_SIZE,
                        recurrent_state: Optional[Mapping[str, Array]] = None):
  """Performer attention in O(T m): phi(Q) (phi(K)^T V) / (phi(Q) sum phi(K)).

  kernel="softmax" (FAVOR+, the paper's method): phi are positive orthogonal
  random features, an unbiased estimate of softmax(q k^T * scale) v.
  kernel="relu" (the paper's generalized attention with the ReLU kernel, no
  random features): phi(x) = relu(sqrt(scale) x) + kernel_epsilon.

  Args:
    query: `[B, Tq, H, D]`; key: `[B, Tk, Hkv, D]`; value: `[B, Tk, Hkv, Dv]`.
    bias, segment_ids: not supported (ValueError).
    mask: key-padding mask `[B|1, 1, 1, Tk]` only.
    is_causal: prefix sums over a chunked scan (Tq == Tk).
    query_seq_lengths, key_value_seq_lengths: `[B]` padding.
    projection: `[m, D]` random features (`gaussian_projection`, made by
      `PerformerFeatures`); needed by the softmax kernel, unused by relu.
    kernel: "softmax" or "relu", as above.
    scale: q and k are multiplied by sqrt(scale) before the features;
      1/sqrt(D) by default (the softmax kernel's temperature). The LRA release's
      ReLU kernel takes q and k as they are: scale=1.
    kernel_epsilon: relu only: added to every feature (the release: 1e-3).
    numerical_stabilizer: softmax only: eps > 0 gives the reference code's
      stabilised features (`stabilized_performer_features`, eps added to every
      feature) and adds 2 eps to normalisers with |R| <= eps (the release:
      1e-6). 0: exact features stabilised by their largest logit. Not with
      `is_causal` (ValueError): the key constant is taken over every key, so a
      later key would change earlier queries' outputs.
    mask_padding: apply the padding. False ignores it as the release's
      Performer does (it never applies its attention bias): padded keys are
      attended and padded queries get outputs.
    chunk_size: chunk of the causal scan.
    recurrent_state: causal decoding: the state the keys before these left
      (`feature_attention`'s; `{}` for none), in O(F Dv) per head whatever
      their number; the function then returns `(out, the new state)`.
      Not with `numerical_stabilizer`: its key constant is the largest
      projection over every key, later ones included, which no state of the
      earlier keys can know.

  Returns:
    `[B, Tq, H, Dv]` (and the state, with `recurrent_state`).
  """
  key_valid = _prepare("performer", query, key, bias, mask, is_causal, segment_ids,
                       key_value_seq_lengths, mask_padding)
  check_performer_kernel(kernel)
  kernel_epsilon = _check_epsilon("kernel_epsilon", kernel_epsilon)
  numerical_stabilizer = _check_epsilon("numerical_stabilizer", numerical_stabilizer)
  scaled_q, scaled_k = _scaled(query.astype(jnp.float32), key.astype(jnp.float32), scale)
  normalizer, key_log_scale = None, None
  if kernel == "relu":
    if numerical_stabilizer:
      raise ValueError(f"numerical_stabilizer is an option of the softmax kernel, got "
                       f"{numerical_stabilizer!r} with kernel='relu' (its features are "
                       f"relu(x) + kernel_epsilon).")
    q_feat = relu_kernel_features(scaled_q, kernel_epsilon)
    k_feat = relu_kernel_features(scaled_k, kernel_epsilon)
  else:
    if kernel_epsilon:
      raise ValueError(f"kernel_epsilon is an option of the relu kernel, got {kernel_epsilon!r} "
                       f"with kernel='softmax' (see numerical_stabilizer).")
    if projection is None:
      raise ValueError("performer's softmax kernel needs projection, its [m, D] random "
                       "features (MultiHeadAttention's extras module supplies them).")
    projection = projection.astype(jnp.float32)
    if numerical_stabilizer and is_causal and recurrent_state is None:
      raise ValueError(f"performer with numerical_stabilizer={numerical_stabilizer} with "
                       f"is_causal=True would let later keys change earlier outputs: the "
                       f"stabiliser's key constant is the largest projection over every key; "
                       f"use 0 (exact features, stabilised causally).")
    if numerical_stabilizer and recurrent_state is not None:
      raise ValueError(f"performer with numerical_stabilizer={numerical_stabilizer} cannot "
                       f"decode from a recurrent state: the stabiliser's key constant is the "
                       f"largest projection over every key, later ones included; use 0.")
    if numerical_stabilizer:
      q_feat, k_feat = stabilized_performer_features(scaled_q, scaled_k, projection, key_valid,
                                                     numerical_stabilizer)
      eps = numerical_stabilizer
      normalizer = lambda r: r + 2 * eps * (jnp.abs(r) <= eps)
    else:
      q_feat, k_feat, key_log_scale = performer_features(scaled_q, scaled_k, projection)
  heads = query.shape[2]
  out = feature_attention(q_feat, common.repeat_kv_heads(k_feat, heads),
                          common.repeat_kv_heads(value.astype(jnp.float32), heads),
                          is_causal=is_causal, key_valid=key_valid, chunk_size=chunk_size,
                          normalizer=normalizer, state=recurrent_state,
                          key_log_scale=None if key_log_scale is None else common.repeat_kv_heads(
                              key_log_scale[..., None], heads)[..., 0])
  return _with_state(out, recurrent_state, lambda out: _padded_queries_zeroed(
      out.astype(query.dtype), query_seq_lengths, mask_padding))


class PerformerFeatures(nn.Module):
  """The random projection of `performer`'s softmax kernel, `{"projection": [m, D]}`,
  one per layer (`common.layer_random`); nothing for the relu kernel.

  Attributes:
    num_features: m.
    orthogonal: orthogonal random features (FAVOR+); iid Gaussian otherwise.
    kernel: "softmax" (random features) or "relu" (none); also `performer_attention`'s.
    redraw_every: training calls between redraws (1: every step, as the
      Performer's reference code, which redraws at every call; 0: never).
  """

  num_features: int = 64
  orthogonal: bool = True
  kernel: str = "softmax"
  redraw_every: int = 1

  @nn.compact
  def __call__(self, query, key, value, deterministic: bool = True):
    del key, value
    if check_performer_kernel(self.kernel) == "relu":
      return {}
    return {"projection": _layer_projection(self, self.num_features, query.shape[-1],
                                            self.orthogonal, deterministic, self.redraw_every)}


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
                  chunk_size: int = DEFAULT_CHUNK_SIZE,
                  recurrent_state: Optional[Mapping[str, Array]] = None):
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
    recurrent_state: causal decoding: the state the keys before these left
      (`feature_attention`'s; `{}` for none), in O(F Dv) per head whatever
      their number; the function then returns `(out, the new state)`.

  Returns:
    `[B, Tq, H, Dv]` (and the state, with `recurrent_state`). Fourier features are not positive, so with few features
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
  # exp(|k|^2 / 2) turns the Gaussian kernel into exp(q . k): each key's
  # log-scale, which `feature_attention` brings to a common constant.
  log_norm = 0.5 * jnp.sum(scaled_k * scaled_k, axis=-1)
  k_feat = random_fourier_features(scaled_k, projection)
  if not normalize:
    # feature_attention takes the log-scale as a constant (no gradient), right
    # for a stabiliser but not for this factor, which is part of the kernel and
    # depends on k: exp(l - stop_gradient(l)) is 1 in value and carries its
    # derivative. (Normalised keys have |k|^2 = scale: no derivative to carry.)
    k_feat = k_feat * jnp.exp(log_norm - jax.lax.stop_gradient(log_norm))[..., None]
  heads = query.shape[2]
  out = feature_attention(
      q_feat, common.repeat_kv_heads(k_feat, heads),
      common.repeat_kv_heads(value.astype(jnp.float32), heads), is_causal=is_causal,
      key_valid=key_valid,
      gates=None if gates is None else common.repeat_kv_heads(gates[..., None], heads)[..., 0],
      chunk_size=chunk_size, state=recurrent_state,
      key_log_scale=common.repeat_kv_heads(log_norm[..., None], heads)[..., 0])
  return _with_state(out, recurrent_state, lambda out: common.zero_padded_queries(
      out.astype(value.dtype), query_seq_lengths))


class RfaFeatures(nn.Module):
  """The arrays of `rfa`: `{"projection": [m, D]}` (one per layer, `common.layer_random`)
  plus, when `gated`, the gate's `gate_kernel [Hkv, D]` and `gate_bias [Hkv]`
  (learned parameters).

  Attributes:
    num_features: m (the features are 2m: sin and cos).
    orthogonal: orthogonal blocks instead of iid Gaussian rows.
    gated: learned gate on the causal recurrence.
    redraw_every: training calls between redraws (1: every step; 0: never).
  """

  num_features: int = 64
  orthogonal: bool = False
  gated: bool = False
  redraw_every: int = 1

  @nn.compact
  def __call__(self, query, key, value, deterministic: bool = True):
    del value
    arrays = {"projection": _layer_projection(self, self.num_features, query.shape[-1],
                                              self.orthogonal, deterministic,
                                              self.redraw_every)}
    if self.gated:
      kv_heads, dim = key.shape[2], key.shape[3]
      arrays["gate_kernel"] = self.param("gate_kernel", nn.initializers.normal(dim ** -0.5),
                                         (kv_heads, dim))
      arrays["gate_bias"] = self.param("gate_bias", nn.initializers.zeros_init(), (kv_heads,))
    return arrays


# They decode from a recurrent state (`recurrent_state`), which
# MultiHeadAttention keeps in the cache instead of the keys and values.
_LINEAR = dict(family="linear", subquadratic=True, exact=False, causal=True, cross=True)
_CHUNK = dict(chunk_size="causal form: positions per chunk of the prefix-sum scan")
_MASK_PADDING = dict(mask_padding="apply the padding; False ignores it (the LRA release)")
_FEATURES = dict(num_features="random features m",
                 orthogonal="orthogonal random projections (else i.i.d. Gaussian)",
                 redraw_every="training calls between redraws of a layer's features "
                              "(1: every step; 0: never); evaluation keeps the last draw",
                 scale="multiplies q and k's product; 1/sqrt(D) when None")
registry.register(registry.VariantSpec(
    name="linear", takes=("recurrent_state",), fn=linear_attention, complexity="O(T D Dv)",
    paper="Katharopoulos et al. 2020",
    options=dict(_CHUNK, epsilon="added to the normaliser (the LRA release: 1e-6)",
                 **_MASK_PADDING),
    presets={"lra_release": registry.Preset(
        options=dict(epsilon=1e-6, mask_padding=False),
        doc="The release's linear attention (models/linear_transformer/linear_attention.py) "
            "is ours (elu + 1 features) with 1e-6 added to the normaliser, and it applies no "
            "padding mask (padded tokens are attended).")},
    **_LINEAR))
registry.register(registry.VariantSpec(
    name="performer", takes=("recurrent_state",), fn=performer_attention, complexity="O(T m D)",
    paper="Choromanski et al. 2021", extras=PerformerFeatures,
    options=dict(
        _FEATURES,
        kernel="'softmax' (FAVOR+ random features) or 'relu' (generalized attention, "
               "relu(x) + kernel_epsilon, no random features)",
        kernel_epsilon="relu kernel: added to every feature (the LRA release: 1e-3)",
        numerical_stabilizer="softmax kernel: the reference code's eps (features + eps after "
                             "its max-projection shift, 2 eps on tiny normalisers; the LRA "
                             "release: 1e-6; not causal); 0: exact features",
        **_MASK_PADDING, **_CHUNK),
    presets={"lra_release": registry.Preset(
        options=dict(kernel="relu", kernel_epsilon=1e-3, scale=1.0, mask_padding=False),
        tasks={"listops": dict(kernel="softmax", kernel_epsilon=0.0, scale=None,
                               num_features=2, numerical_stabilizer=1e-6, redraw_every=1)},
        doc="The release's Performer (models/performer/) defaults to generalized attention "
            "with the ReLU kernel: features relu(x) + 1e-3 of the unscaled q and k, no random "
            "features; ListOps's config runs FAVOR+ with 2 orthogonal features and the "
            "reference code's 1e-6 stabiliser, redrawn at every call. No padding mask, and "
            "no attention dropout, on any task.")},
    **_LINEAR))
registry.register(registry.VariantSpec(
    name="rfa", fn=rfa_attention, complexity="O(T m D)", paper="Peng et al. 2021",
    takes=("recurrent_state",),
    extras=RfaFeatures,
    options=dict(_FEATURES, gated="learned forget gates (causal RFA-Gate)",
                 scale="multiplies q and k's product; None: 1 with normalize (the paper's "
                       "1 / sigma^2 for unit vectors), 1/sqrt(D) without",
                 normalize="unit-norm queries and keys before the features", **_CHUNK),
    **_LINEAR))
