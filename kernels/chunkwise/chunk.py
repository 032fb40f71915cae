"""One chunk of the chunkwise recurrence, on the tiles a kernel program holds.

The recurrence is `attention_jax.variants.chunkwise.engine`'s,

    S_t = (diag(exp g_t) + w_t r_t^T) S_{t-1} + k_t v_t^T,      o_t = S_t^T q_t,

and `chunk_forward` maps one chunk's tiles and the state entering it to the
chunk's outputs and the state leaving it, by the same algebra as
`engine.chunkwise_form` (log-space decays cumulated within the chunk, every
exponent <= 0; the rank-one reads solved by the UT transform). It is written
for a kernel body rather than for XLA:

* every array is a 2-D tile (3-D for the per-dimension decay weights), with
  no scan, cumsum, gather or triangular-solve primitive: prefix sums are masked
  reductions and the unit lower-triangular inverse a product of log2(C)
  factors (`unit_lower_inverse`);
* the per-dimension decay weights are the exact C x C x Dk tensor, which is
  why the kernels use small chunks for them (16).

The backward kernels differentiate `chunk_forward` on the tile with `jax.vjp`
(recomputing the chunk from the state entering it), so forward and backward
share this one definition of the chunk.

Tiles: q, k, r, w `[C, Dk]`, v `[C, Dv]`, g `[C, 1]` (one log-decay per head)
or `[C, Dk]` (per key dimension), state `[Dk, Dv]`; all float32.
"""

from __future__ import annotations

from typing import Optional, Tuple

import jax
import jax.numpy as jnp
from jax import lax

Array = jax.Array


def _lower(size: int, *, strict: bool) -> Array:
  """[C, C] booleans: s <= t (s < t when `strict`) at row t, column s."""
  rows = lax.broadcasted_iota(jnp.int32, (size, size), 0)
  columns = lax.broadcasted_iota(jnp.int32, (size, size), 1)
  return rows > columns if strict else rows >= columns


def _dot(left: Array, right: Array) -> Array:
  return jnp.dot(left, right, preferred_element_type=jnp.float32)


def _prefix_sums(x: Array) -> Array:
  """Inclusive prefix sums along the chunk: `[C, F] -> [C, F]`."""
  keep = _lower(x.shape[0], strict=False)[:, :, None]
  return jnp.sum(jnp.where(keep, x[None, :, :], 0.0), axis=1)


def _last_row(x: Array) -> Array:
  """`x[-1:]` as a masked reduction: `[C, F] -> [1, F]`."""
  rows = lax.broadcasted_iota(jnp.int32, x.shape, 0)
  return jnp.sum(jnp.where(rows == x.shape[0] - 1, x, 0.0), axis=0, keepdims=True)


def decayed_products(left: Array, right: Array, left_log: Array, right_log: Array, *,
                     strict: bool) -> Array:
  """M[t, s] = sum_d left_td right_sd exp(left_log_td - right_log_sd) for s <= t
  (s < t when `strict`), 0 above: `[C, Dk]` x 2 -> `[C, C]`. The logs are
  `[C, 1]` (a matrix product times a C x C weight) or `[C, Dk]` (the exact
  C x C x Dk weights); exponents above the diagonal are masked before `exp`."""
  keep = _lower(left.shape[0], strict=strict)
  if left_log.shape[1] == 1:
    exponent = left_log - right_log.T
    weights = jnp.where(keep, jnp.exp(jnp.where(keep, exponent, 0.0)), 0.0)
    return _dot(left, right.T) * weights
  keep = keep[:, :, None]
  exponent = left_log[:, None, :] - right_log[None, :, :]
  weights = jnp.where(keep, jnp.exp(jnp.where(keep, exponent, 0.0)), 0.0)
  return jnp.sum(left[:, None, :] * right[None, :, :] * weights, axis=2)


def unit_lower_inverse(transfer: Array) -> Array:
  """(I - A)^{-1} for A `[C, C]` strictly lower triangular.

  A is nilpotent (A^C = 0), so the inverse is I + A + ... + A^(C-1) =
  (I + A)(I + A^2)(I + A^4)...: ceil(log2 C) factors, each power the square
  of the last, two products of C x C tiles per factor (the matrix units), and
  a gradient made of products too. The row-by-row forward substitution this
  replaces unrolled C - 1 dependent steps into the kernel (its Triton IR
  2.7x larger), and the delta rule's first benchmark cell at C = 64 had not
  finished after about two minutes on an H200 (2026-11-28).
  """
  size = transfer.shape[0]
  rows = lax.broadcasted_iota(jnp.int32, (size, size), 0)
  columns = lax.broadcasted_iota(jnp.int32, (size, size), 1)
  transfer = transfer.astype(jnp.float32)
  inverse = (rows == columns).astype(jnp.float32) + transfer
  power, reach = transfer, 2  # inverse = I + A + ... + A^(reach - 1)
  while reach < size:
    power = _dot(power, power)
    inverse = inverse + _dot(inverse, power)
    reach *= 2
  return inverse


def chunk_forward(query: Array, key: Array, value: Array, log_decay: Array,
                  read_key: Optional[Array], write_key: Optional[Array],
                  state: Array) -> Tuple[Array, Array]:
  """One chunk: `(outputs [C, Dv], the state leaving it [Dk, Dv])` from its
  tiles and the state entering it (shapes in the module docstring)."""
  decay = _prefix_sums(log_decay)  # G_t, cumulated within the chunk
  decay_before = decay - log_decay  # G_{t-1}
  decay_last = _last_row(decay)  # G_C, [1, Dk | 1]
  to_end = jnp.exp(decay_last - decay)  # <= 1
  out = (_dot(decayed_products(query, key, decay, decay, strict=False), value)
         + _dot(query * jnp.exp(decay), state))
  new_state = jnp.exp(decay_last).T * state + _dot((key * to_end).T, value)
  if read_key is not None:
    # The reads u_s = S_{s-1}^T r_s solve (I - A) u = R S_0 + B V (see the engine).
    solve = unit_lower_inverse(
        decayed_products(read_key, write_key, decay_before, decay, strict=True))
    reads = _dot(solve, _dot(read_key * jnp.exp(decay_before), state)
                 + _dot(decayed_products(read_key, key, decay_before, decay, strict=True),
                        value))
    out = out + _dot(decayed_products(query, write_key, decay, decay, strict=False), reads)
    new_state = new_state + _dot((write_key * to_end).T, reads)
  return out, new_state


def chunk_backward(tiles: Tuple[Optional[Array], ...], state: Array, d_out: Array,
                   d_new_state: Array) -> Tuple[Tuple[Optional[Array], ...], Array]:
  """The gradients of `chunk_forward(*tiles, state)`'s inputs from its outputs'
  cotangents: `(d_tiles, d_state)`, by recomputing the chunk (`jax.vjp`)."""
  present = [i for i, tile in enumerate(tiles) if tile is not None]

  def forward(arrays, state):
    full = list(tiles)
    for i, array in zip(present, arrays):
      full[i] = array
    return chunk_forward(*full, state)

  _, vjp = jax.vjp(forward, [tiles[i] for i in present], state)
  d_arrays, d_state = vjp((d_out, d_new_state))
  d_tiles = [None] * len(tiles)
  for i, d_array in zip(present, d_arrays):
    d_tiles[i] = d_array
  return tuple(d_tiles), d_state
