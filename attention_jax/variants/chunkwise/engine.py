"""One engine for the chunkwise recurrent mixers: a matrix-valued state

    S_t = (diag(exp(g_t)) + w_t r_t^T) S_{t-1} + k_t v_t^T,      o_t = S_t^T q_t,

S `[Dk, Dv]` per head. g_t <= 0 is the log-decay, one per head (a scalar
broadcast over the key dimensions: retention, Mamba-2, Gated DeltaNet) or one
per key dimension (GLA, RWKV-7). The optional rank-one term reads the state
along r_t and writes what it read back along w_t: the delta rule is r = k,
w = -beta k (with the key written as beta k), RWKV-7's generalised rule is
r = kappa, w = -a * kappa. Without it the recurrence is gated linear attention.

Three forms compute the same outputs and final state:

* `recurrent_form`: one `lax.scan` step per token. The reference, and O(1)
  per token with its state: decoding.
* `chunkwise_form`: chunks of C tokens. Within a chunk the outputs are a C x C
  quadratic form; between chunks only the `[Dk, Dv]` state passes (one
  `lax.scan` step per chunk). The rank-one terms within a chunk are solved
  at once: the state's reads u_s = S_{s-1}^T r_s obey a unit lower-triangular
  system (the UT transform of the WY representation of a product of
  Householder-like matrices), so u = W S_0 + U, with W and U from one
  unit lower-triangular inverse per chunk (`unit_lower_inverse`),
  independent of the state. Training memory is
  O(T C + T Dk / C Dv) (the chunk matrices and one state per chunk).
* `parallel_form`: the whole sequence as one chunk, (Q K^T * D) V for gated
  linear attention and the UT transform over all T for the delta rule;
  O(T^2), for short sequences and as a second reference.

The chunkwise form also runs in Pallas kernels, forward and backward
(`attention_jax.kernels.chunkwise`): forms "pallas_gpu" (Triton) and
"pallas_tpu" (Mosaic), interpreted off their device.

Decays are summed in log space within each chunk only, and every exponential
taken is of a difference G_t - G_s with s <= t (masked before `exp`), at most
0: gates near 0 underflow to exact zeros and gates near 1 lose nothing
however long the sequence, where a cumulative product over T would. With
per-dimension decay the C x C x Dk log-space weights are recomputed in the
backward pass (`jax.checkpoint`) rather than stored.

Shapes: query and key `[B, T, H, Dk]`, value `[B, T, H, Dv]`, log_decay
`[B, T, H]` or `[B, T, H, Dk]`, read_key and write_key `[B, T, H, Dk]`, state
`[B, H, Dk, Dv]`. The forms compute in float32 (or wider) and return the
value's dtype with a float32 state.
"""

from __future__ import annotations

from typing import Optional, Tuple

import jax
import jax.numpy as jnp

from attention_jax.core.recurrence import check_inputs
from attention_jax.variants import common

Array = jax.Array

DEFAULT_CHUNK_SIZE = 64


def _compute_dtype(*arrays) -> jnp.dtype:
  return jnp.promote_types(jnp.result_type(*[a for a in arrays if a is not None]), jnp.float32)


def _zero_state(query: Array, value: Array, dtype) -> Array:
  batch, _, heads, key_dim = query.shape
  return jnp.zeros((batch, heads, key_dim, value.shape[-1]), dtype)


# ----------------------------------------------------------------------------
# The recurrent form: the reference.
# ----------------------------------------------------------------------------


def recurrent_form(query: Array, key: Array, value: Array, log_decay: Array,
                   read_key: Optional[Array] = None, write_key: Optional[Array] = None, *,
                   initial_state: Optional[Array] = None) -> Tuple[Array, Array]:
  """The recurrence one token at a time: `(outputs [B, T, H, Dv], final state
  [B, H, Dk, Dv])`. O(T Dk Dv) time, O(Dk Dv) state."""
  check_inputs(query, key, value, log_decay, read_key, write_key, initial_state)
  dtype = _compute_dtype(query, key, value, log_decay, read_key, write_key)
  state = (_zero_state(query, value, dtype) if initial_state is None
           else initial_state.astype(dtype))
  low_rank = read_key is not None
  time_major = lambda x: None if x is None else jnp.moveaxis(x.astype(dtype), 1, 0)

  def step(state, inputs):
    q, k, v, g, r, w = inputs  # [B, H, Dk] (q, k, r, w), [B, H, Dv], [B, H] or [B, H, Dk]
    decay = jnp.exp(g)[..., None] if g.ndim == 3 else jnp.exp(g)[..., None, None]
    new = decay * state + k[..., :, None] * v[..., None, :]
    if low_rank:
      read = jnp.einsum("bhk,bhkv->bhv", r, state)
      new = new + w[..., :, None] * read[..., None, :]
    return new, jnp.einsum("bhk,bhkv->bhv", q, new)

  state, out = jax.lax.scan(step, state, tuple(map(time_major, (query, key, value, log_decay,
                                                                read_key, write_key))))
  return jnp.moveaxis(out, 0, 1).astype(value.dtype), state


# ----------------------------------------------------------------------------
# The chunkwise form.
# ----------------------------------------------------------------------------


# Per-dimension decays are applied exactly within sub-chunks of this many
# tokens (a [c, c, Dk] tensor each) and factorised between them.
SUB_CHUNK = 8


def _decayed_products(left: Array, right: Array, left_log: Array, right_log: Array, *,
                      strict: bool) -> Array:
  """M[t, s] = sum_d left_td right_sd exp(left_log_td - right_log_sd) for s <= t
  (s < t when `strict`), 0 above: `[..., C, Dk]` x 2 -> `[..., C, C]`.

  The logs are cumulative log-decays, non-increasing along the tokens, so that
  every exponent kept is <= 0 (the others are masked before `exp`). They are
  `[..., C, 1]` (one decay per head: a matrix product times a C x C weight)
  or `[..., C, Dk]` (per dimension: `_per_dimension_products`).
  """
  size = left.shape[-2]
  if left_log.shape[-1] != 1:
    # One leading axis: XLA:CPU (jaxlib 0.10.2) crashed running the backward
    # pass of these products over arrays of rank 7.
    flat = lambda x: x.reshape((-1,) + x.shape[-2:])
    # Recomputed in the backward pass rather than stored (jax.checkpoint).
    products = jax.checkpoint(lambda *arrays: _per_dimension_products(*arrays, strict=strict))(
        *map(flat, (left, right, left_log, right_log)))
    return products.reshape(left.shape[:-1] + (size,))
  keep = jnp.tril(jnp.ones((size, size), bool), -1 if strict else 0)
  exponent = left_log[..., :, None, 0] - right_log[..., None, :, 0]
  weights = jnp.where(keep, jnp.exp(jnp.where(keep, exponent, 0.0)), 0.0)
  return jnp.einsum("...tk,...sk->...ts", left, right) * weights


def _per_dimension_products(left, right, left_log, right_log, *, strict: bool) -> Array:
  """`_decayed_products` with a decay per dimension, in sub-chunks of c tokens:
  `[M, C, Dk]` x 2 -> `[M, C, C]`.

  Within a sub-chunk the c x c x Dk weights are taken in log space. Between
  sub-chunk i (rows) and an earlier one j the exponent splits at E_k, the
  right log at the last token of sub-chunk k, into three parts, each <= 0:

    (left_log_t - E_{i-1}) + (E_{i-1} - E_j) + (E_j - right_log_s),

  so the pair is a matrix product of the rows scaled by the first, the
  middle as a per-dimension factor, and the columns scaled by the last. What
  is stored is O(C Dk (c + C / c)) per chunk, not O(C^2 Dk).
  """
  size, features = left.shape[-2:]
  sub = min(SUB_CHUNK, size)
  padded = -(-size // sub) * sub
  if padded != size:  # zero rows and columns; their logs repeat the last one (no decay)
    pad = lambda x, edge: jnp.pad(x, [(0, 0)] * (x.ndim - 2) + [(0, padded - size), (0, 0)],
                                  mode="edge" if edge else "constant")
    left, right = pad(left, False), pad(right, False)
    left_log, right_log = pad(left_log, True), pad(right_log, True)
  blocks = padded // sub
  split = lambda x: x.reshape(x.shape[:-2] + (blocks, sub, features))
  left, right, left_log, right_log = map(split, (left, right, left_log, right_log))

  # Within each sub-chunk: [..., n, c, c] from the exact log-space weights.
  keep = jnp.tril(jnp.ones((sub, sub), bool), -1 if strict else 0)[..., None]
  exponent = left_log[..., :, None, :] - right_log[..., None, :, :]
  weights = jnp.where(keep, jnp.exp(jnp.where(keep, exponent, 0.0)), 0.0)
  within = jnp.sum(left[..., :, None, :] * right[..., None, :, :] * weights, axis=-1)

  # Between sub-chunks j < i: [..., n, c, n, c].
  ends = right_log[..., -1, :]  # E_k, [..., n, Dk]
  before = jnp.concatenate([jnp.zeros_like(ends[..., :1, :]), ends[..., :-1, :]], axis=-2)
  earlier = jnp.tril(jnp.ones((blocks, blocks), bool), -1)[..., None]
  rows = left * jnp.exp(left_log - before[..., None, :])
  columns = right * jnp.exp(ends[..., None, :] - right_log)
  middle_exponent = before[..., :, None, :] - ends[..., None, :, :]  # [..., n_i, n_j, Dk]
  middle = jnp.where(earlier, jnp.exp(jnp.where(earlier, middle_exponent, 0.0)), 0.0)
  # [M, n_j, n_i c, Dk] against [M, n_j, c, Dk]: a matrix product batched over (M, j).
  scaled_rows = rows[:, None, :, :, :] * jnp.swapaxes(middle, 1, 2)[:, :, :, None, :]
  scaled_rows = scaled_rows.reshape(scaled_rows.shape[0], blocks, padded, features)
  between = jnp.einsum("mjxk,mjsk->mjxs", scaled_rows, columns)  # [M, n_j, n_i c, c]
  between = between.reshape(-1, blocks, blocks, sub, sub).transpose(0, 2, 3, 1, 4)
  products = between + within[:, :, :, None, :] * jnp.eye(blocks, dtype=within.dtype)[
      :, None, :, None]
  products = products.reshape(-1, padded, padded)
  return products[..., :size, :size]


# Below this size `unit_lower_inverse` substitutes row by row.
SUBSTITUTION_SIZE = 16


def unit_lower_inverse(transfer: Array) -> Array:
  """(I - A)^{-1} for A `[M, C, C]` strictly lower triangular.

  In matrix products only, not `lax.linalg.triangular_solve`: on CPU that is
  LAPACK's trsm, whose batched kernel (jaxlib 0.10.2) hands its batch to
  XLA's intra-op thread pool and blocks a pool thread waiting for it; two
  solves running at once (the chunk's two right-hand sides, or a forward and
  a backward one) blocked both threads of a 2-core machine for ever. Here
  blocks of at most `SUBSTITUTION_SIZE` rows are forward substitution (row i
  of X = I + A X is e_i + A_i,<i X_<i), and larger ones split in two,

    (I - A)^{-1} = [[X_11, 0], [X_22 A_21 X_11, X_22]],

  so a chunk of 64 costs two levels of batched matrix products.
  """
  batch, size = transfer.shape[0], transfer.shape[-1]
  if size <= SUBSTITUTION_SIZE:
    identity = jnp.broadcast_to(jnp.eye(size, dtype=transfer.dtype), transfer.shape)
    rows = [identity[:, 0]]
    for i in range(1, size):
      earlier = jnp.stack(rows, axis=1)  # [M, i, C], final
      rows.append(identity[:, i] + jnp.einsum("mj,mjc->mc", transfer[:, i, :i], earlier))
    return jnp.stack(rows, axis=1)
  half = size // 2
  first = unit_lower_inverse(transfer[:, :half, :half])
  second = unit_lower_inverse(transfer[:, half:, half:])
  corner = second @ transfer[:, half:, :half] @ first
  top = jnp.concatenate([first, jnp.zeros((batch, half, size - half), transfer.dtype)], axis=-1)
  return jnp.concatenate([top, jnp.concatenate([corner, second], axis=-1)], axis=-2)


def chunkwise_form(query: Array, key: Array, value: Array, log_decay: Array,
                   read_key: Optional[Array] = None, write_key: Optional[Array] = None, *,
                   chunk_size: int = DEFAULT_CHUNK_SIZE,
                   initial_state: Optional[Array] = None) -> Tuple[Array, Array]:
  """The recurrence in chunks of `chunk_size` tokens: `(outputs [B, T, H, Dv],
  final state [B, H, Dk, Dv])`, equal to `recurrent_form`'s. A chunk size
  that does not divide T pads the last chunk with tokens that change nothing
  (zero keys, decay 1)."""
  common.check_size("chunk_size", chunk_size)
  check_inputs(query, key, value, log_decay, read_key, write_key, initial_state)
  dtype = _compute_dtype(query, key, value, log_decay, read_key, write_key)
  batch, length, heads, key_dim = query.shape
  value_dim = value.shape[-1]
  low_rank = read_key is not None
  per_dimension = log_decay.ndim == 4
  chunk = min(chunk_size, length)
  num_chunks = -(-length // chunk)
  padded = num_chunks * chunk

  # Every chunk of every sequence and head is one row of a 3-D batch, [N B H, C, ...]
  # (chunk-major, so that the scan over chunks reads [N, B H, C, ...] with a
  # reshape): batched products with one batch axis, which XLA:CPU runs as
  # plain batched matrix products.
  rows = num_chunks * batch * heads

  def to_chunks(x):  # [B, T, H, ...] -> [N B H, C, ...], zero-padded
    x = x.astype(dtype)
    if padded != length:
      x = jnp.pad(x, [(0, 0), (0, padded - length)] + [(0, 0)] * (x.ndim - 2))
    x = x.reshape((batch, num_chunks, chunk, heads) + x.shape[3:])
    x = jnp.moveaxis(x, (1, 0, 3), (0, 1, 2))  # [N, B, H, C, ...]
    return x.reshape((rows, chunk) + x.shape[4:])

  by_chunk = lambda x: x.reshape((num_chunks, batch * heads) + x.shape[1:])
  q, k, v = to_chunks(query), to_chunks(key), to_chunks(value)
  g = to_chunks(log_decay if per_dimension else log_decay[..., None])  # [N B H, C, Dk | 1]
  decay = jnp.cumsum(g, axis=1)  # G_t within the chunk
  decay_before = decay - g  # G_{t-1}
  decay_last = decay[:, -1:]  # G_C, [N B H, 1, Dk | 1]

  scores = _decayed_products(q, k, decay, decay, strict=False)  # [N B H, C, C]
  out = scores @ v
  q_from_start = q * jnp.exp(decay)
  to_end = jnp.exp(decay_last - decay)  # <= 1
  k_to_end = k * to_end
  if low_rank:
    r, w = to_chunks(read_key), to_chunks(write_key)
    # u_s = S_{s-1}^T r_s = (r_s e^{G_{s-1}})^T S_0 + sum_{j<s} (r_s . e^{G_{s-1} - G_j} w_j) u_j
    #                                          + (r_s . e^{G_{s-1} - G_j} k_j) v_j
    # solved for all s at once: (I - A) u = R S_0 + B V, A strictly lower triangular.
    inverse = unit_lower_inverse(_decayed_products(r, w, decay_before, decay, strict=True))
    reads_from_state = inverse @ (r * jnp.exp(decay_before))  # W `[N B H, C, Dk]`
    reads_from_values = inverse @ (_decayed_products(r, k, decay_before, decay,
                                                     strict=True) @ v)  # U
    w_to_end = w * to_end
    query_writes = _decayed_products(q, w, decay, decay, strict=False)

  def step(state, chunk_inputs):  # state [B H, Dk, Dv], the one entering the chunk
    if low_rank:
      k_end, v_c, decay_c, reads_state, reads_values, w_end = chunk_inputs
      reads = reads_state @ state + reads_values  # u `[B H, C, Dv]`
    else:
      k_end, v_c, decay_c = chunk_inputs
      reads = None
    new = jnp.exp(jnp.swapaxes(decay_c, -1, -2)) * state + jnp.swapaxes(k_end, -1, -2) @ v_c
    if low_rank:
      new = new + jnp.swapaxes(w_end, -1, -2) @ reads
    return new, (new, reads)

  scanned = (k_to_end, v, decay_last)
  if low_rank:
    scanned += (reads_from_state, reads_from_values, w_to_end)
  state = (jnp.zeros((batch, heads, key_dim, value_dim), dtype) if initial_state is None
           else initial_state.astype(dtype))
  initial = state.reshape(batch * heads, key_dim, value_dim)
  state, (leaving, reads) = jax.lax.scan(step, initial, tuple(map(by_chunk, scanned)))
  # The state entering each chunk: the initial one, then each chunk's result.
  entering = jnp.concatenate([initial[None], leaving[:-1]])
  unchunk = lambda x: x.reshape((rows,) + x.shape[2:])
  out = out + q_from_start @ unchunk(entering)
  if low_rank:
    out = out + query_writes @ unchunk(reads)
  out = out.reshape(num_chunks, batch, heads, chunk, value_dim)
  out = jnp.moveaxis(out, (0, 1, 2), (1, 0, 3)).reshape(batch, padded, heads, value_dim)
  return out[:, :length].astype(value.dtype), state.reshape(batch, heads, key_dim, value_dim)


def parallel_form(query: Array, key: Array, value: Array, log_decay: Array,
                  read_key: Optional[Array] = None, write_key: Optional[Array] = None, *,
                  initial_state: Optional[Array] = None) -> Tuple[Array, Array]:
  """The whole sequence as one chunk: `((Q K^T * D) V`, and for the delta
  rule the UT transform over all T tokens; the final state)`. O(T^2 Dk)."""
  return chunkwise_form(query, key, value, log_decay, read_key, write_key,
                        chunk_size=query.shape[1], initial_state=initial_state)


def _kernel_form(backend: str):
  """The chunkwise form in the Pallas kernels of `backend` ("gpu": Triton,
  "tpu": Mosaic; interpreted off that device), `attention_jax.kernels.chunkwise`."""

  def form(*arrays, chunk_size: int = DEFAULT_CHUNK_SIZE, initial_state=None):
    # The kernels import this module, so they are imported here, on use.
    # pylint: disable-next=import-outside-toplevel
    from attention_jax.kernels.chunkwise import chunkwise_kernel
    return chunkwise_kernel(*arrays, backend=backend, chunk_size=chunk_size,
                            initial_state=initial_state)

  return form


FORMS = {"chunkwise": chunkwise_form, "recurrent": recurrent_form, "parallel": parallel_form,
         "pallas_gpu": _kernel_form("gpu"), "pallas_tpu": _kernel_form("tpu")}
CHUNKED_FORMS = ("chunkwise", "pallas_gpu", "pallas_tpu")  # the forms that take chunk_size


def run(form: str, query: Array, key: Array, value: Array, log_decay: Array,
        read_key: Optional[Array] = None, write_key: Optional[Array] = None, *,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        initial_state: Optional[Array] = None) -> Tuple[Array, Array]:
  """The recurrence in the named form (`FORMS`); `chunk_size` serves the
  chunked ones (`CHUNKED_FORMS`; the GPU kernels need a power of two >= 16)."""
  if form not in FORMS:
    raise ValueError(f"form must be one of {sorted(FORMS)}, got {form!r}.")
  if form in CHUNKED_FORMS:
    return FORMS[form](query, key, value, log_decay, read_key, write_key,
                       chunk_size=chunk_size, initial_state=initial_state)
  common.check_size("chunk_size", chunk_size)
  return FORMS[form](query, key, value, log_decay, read_key, write_key,
                     initial_state=initial_state)
