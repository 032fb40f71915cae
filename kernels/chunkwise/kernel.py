"""The chunkwise recurrence through the Pallas kernels, with its custom VJP.

`chunkwise_kernel` takes and returns what `engine.chunkwise_form` does and
computes the same outputs, final state and gradients: the kernels of
`pallas_gpu` (Triton) or `pallas_tpu` (Mosaic) do the forward pass and the
backward pass, and this wrapper only changes the layout, `[B, T, H, D] ->
[B H, T, D]`, and pads: T up to whole chunks (zero keys and values, decay 1:
tokens that change nothing), and on GPUs the key and value dimensions up to a
power of two of at least 16 (zero columns, which change no product).
"""

from __future__ import annotations

import functools
from typing import Optional, Tuple

import jax
import jax.numpy as jnp

from attention_jax.core.recurrence import check_inputs

from . import pallas_gpu, pallas_tpu

Array = jax.Array

BACKENDS = {"gpu": pallas_gpu, "tpu": pallas_tpu}
# Chunk sizes by decay kind: the per-dimension weights are a C x C x Dk tile.
DEFAULT_CHUNK = {"per_head": 64, "per_dimension": 16}
MIN_TILE = 16  # Triton's dots need every side >= 16, and powers of two


def _power_of_two_at_least(size: int, floor: int) -> int:
  return max(floor, 1 << (size - 1).bit_length())


def _rows(x: Optional[Array], length: int, width: Optional[int]) -> Optional[Array]:
  """`[B, T, H, D] -> [B H, T', D']`, zero-padded to `length` and `width`."""
  if x is None:
    return None
  batch, t, heads, dim = x.shape
  x = jnp.swapaxes(x, 1, 2).reshape(batch * heads, t, dim)
  return jnp.pad(x, [(0, 0), (0, length - t), (0, (width or dim) - dim)])


def _unrows(x: Optional[Array], like: Optional[Array]) -> Optional[Array]:
  """The inverse of `_rows`, cast to `like`'s dtype."""
  if x is None:
    return None
  batch, t, heads, dim = like.shape
  x = x[:, :t, :dim].reshape(batch, heads, t, dim)
  return jnp.swapaxes(x, 1, 2).astype(like.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _recurrence(tiles, initial_state, backend: str, chunk: int, interpret):
  out, _, final = BACKENDS[backend].forward(tiles, initial_state, chunk=chunk,
                                            interpret=interpret)
  return out, final


def _recurrence_forward(tiles, initial_state, backend, chunk, interpret):
  out, states, final = BACKENDS[backend].forward(tiles, initial_state, chunk=chunk,
                                                 interpret=interpret)
  return (out, final), (tiles, states)


def _recurrence_backward(backend, chunk, interpret, residuals, cotangents):
  tiles, states = residuals
  d_out, d_final = cotangents
  grads, d_initial = BACKENDS[backend].backward(
      tiles, states, d_out.astype(jnp.float32), d_final.astype(jnp.float32), chunk=chunk,
      interpret=interpret)
  grads = {name: None if tiles[name] is None else grads[name].astype(tiles[name].dtype)
           for name in tiles}
  return grads, d_initial


_recurrence.defvjp(_recurrence_forward, _recurrence_backward)


def chunkwise_kernel(query: Array, key: Array, value: Array, log_decay: Array,
                     read_key: Optional[Array] = None, write_key: Optional[Array] = None, *,
                     backend: str = "gpu", chunk_size: Optional[int] = None,
                     initial_state: Optional[Array] = None,
                     interpret=None) -> Tuple[Array, Array]:
  """`engine.chunkwise_form` through the Pallas kernels: `(outputs [B, T, H,
  Dv], final state [B, H, Dk, Dv] float32)`, shapes as the engine's.

  Args:
    backend: "gpu" (Triton) or "tpu" (Mosaic).
    chunk_size: C, tokens per kernel step; by default 64 with a decay per head
      and 16 with one per key dimension (whose weights are a C x C x Dk tile).
      On GPUs a power of two of at least 16.
    interpret: run the Pallas interpreter; None: only off the backend's device.
  """
  if backend not in BACKENDS:
    raise ValueError(f"backend must be one of {sorted(BACKENDS)}, got {backend!r}.")
  check_inputs(query, key, value, log_decay, read_key, write_key, initial_state)
  per_dimension = log_decay.ndim == 4
  if chunk_size is None:
    chunk_size = DEFAULT_CHUNK["per_dimension" if per_dimension else "per_head"]
  if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
    raise ValueError(f"chunk_size must be an int >= 1, got {chunk_size!r}.")
  if backend == "gpu" and _power_of_two_at_least(chunk_size, MIN_TILE) != chunk_size:
    raise ValueError(f"chunk_size must be a power of two of at least {MIN_TILE} for the "
                     f"GPU kernels (Triton's tiles), got {chunk_size}.")
  batch, length, heads, key_dim = query.shape
  value_dim = value.shape[-1]
  padded_length = -(-length // chunk_size) * chunk_size
  if backend == "gpu":
    key_width = _power_of_two_at_least(key_dim, MIN_TILE)
    value_width = _power_of_two_at_least(value_dim, MIN_TILE)
  else:
    key_width, value_width = key_dim, value_dim
  rows = lambda x, width: _rows(x, padded_length, width)
  tiles = dict(query=rows(query, key_width), key=rows(key, key_width),
               value=rows(value, value_width),
               log_decay=rows(log_decay if per_dimension else log_decay[..., None],
                              key_width if per_dimension else None),
               read_key=rows(read_key, key_width), write_key=rows(write_key, key_width))
  if initial_state is None:
    state = jnp.zeros((batch * heads, key_width, value_width), jnp.float32)
  else:
    state = jnp.pad(initial_state.astype(jnp.float32).reshape(batch * heads, key_dim, value_dim),
                    [(0, 0), (0, key_width - key_dim), (0, value_width - value_dim)])
  out, final = _recurrence(tiles, state, backend, chunk_size, interpret)
  final = final[:, :key_dim, :value_dim].reshape(batch, heads, key_dim, value_dim)
  return _unrows(out, value), final
