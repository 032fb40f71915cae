"""The chunkwise recurrence as Pallas kernels for NVIDIA GPUs (Triton lowering).

One program per (sequence, head) row of `[BH, T, D]` arrays walks its chunks
in order, holding the `[Dk, Dv]` state in registers between them (the
recurrence between chunks is sequential; the work within a chunk is the
quadratic form of `chunk.chunk_forward`). The forward kernel also writes the
state entering each chunk, `[BH, N, Dk, Dv]`, so that the backward kernel,
walking the chunks in reverse with the state's gradient as its carry,
recomputes each chunk from its own entering state and differentiates it on
the tile (`chunk.chunk_backward`).

Triton loads power-of-two tiles of at least 16 a side: the wrapper
(`kernel.py`) pads the key and value dimensions and asks for such a chunk.
These kernels have run in the Pallas interpreter on CPU; they have not yet
been lowered and timed on a GPU (issue 41).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from . import chunk as chunk_lib

Array = jax.Array

NAMES = ("query", "key", "value", "log_decay", "read_key", "write_key")


def _whole_row(x: Array) -> pl.BlockSpec:
  """All of row b of `[BH, ...]`; the kernels slice chunks out of it."""
  return pl.BlockSpec((None,) + x.shape[1:], lambda b: (b,) + (0,) * (x.ndim - 1))


def present(tiles: Dict[str, Optional[Array]]) -> Tuple[List[str], List[Array]]:
  """The names (in `NAMES` order) and arrays of the tiles that are not None."""
  names = [n for n in NAMES if tiles[n] is not None]
  return names, [tiles[n] for n in names]


def forward_shapes(tiles: Dict[str, Optional[Array]], chunk: int):
  """The forward kernels' outputs: outputs `[BH, T, Dv]`, entering states
  `[BH, N, Dk, Dv]` and the final state `[BH, Dk, Dv]`, all float32."""
  rows, length, key_dim = tiles["query"].shape
  value_dim = tiles["value"].shape[-1]
  return (jax.ShapeDtypeStruct((rows, length, value_dim), jnp.float32),
          jax.ShapeDtypeStruct((rows, length // chunk, key_dim, value_dim), jnp.float32),
          jax.ShapeDtypeStruct((rows, key_dim, value_dim), jnp.float32))


def _interpret(interpret: Optional[bool]) -> bool:
  return jax.default_backend() != "gpu" if interpret is None else interpret


def _params(num_warps: int = 4):
  return plgpu.CompilerParams(num_warps=num_warps, num_stages=1)


def forward(tiles: Dict[str, Optional[Array]], initial_state: Array, *, chunk: int,
            interpret: Optional[bool] = None) -> Tuple[Array, Array, Array]:
  """`(outputs [BH, T, Dv] float32, entering states [BH, N, Dk, Dv], final
  state [BH, Dk, Dv])` of the `[BH, T, ...]` tiles (`NAMES`, read and write
  keys None without the rank-one term), T a multiple of `chunk`."""
  names, arrays = present(tiles)
  shapes = forward_shapes(tiles, chunk)
  num_chunks = tiles["query"].shape[1] // chunk

  def kernel(*refs):
    input_refs, initial_ref = refs[:len(names)], refs[len(names)]
    out_ref, states_ref, final_ref = refs[len(names) + 1:]

    def step(n, state):
      span = pl.ds(n * chunk, chunk)
      loaded = dict(zip(names, (ref[span, :].astype(jnp.float32) for ref in input_refs)))
      states_ref[n] = state
      out, new_state = chunk_lib.chunk_forward(*(loaded.get(name) for name in NAMES), state)
      out_ref[span, :] = out
      return new_state

    final_ref[...] = lax.fori_loop(0, num_chunks, step, initial_ref[...].astype(jnp.float32))

  return pl.pallas_call(
      kernel, grid=(tiles["query"].shape[0],), out_shape=shapes,
      in_specs=[_whole_row(x) for x in arrays + [initial_state]],
      out_specs=[_whole_row(s) for s in shapes],
      compiler_params=_params(), interpret=_interpret(interpret),
      name="chunkwise_forward")(*arrays, initial_state)


def backward(tiles: Dict[str, Optional[Array]], states: Array, d_out: Array, d_final: Array,
             *, chunk: int, interpret: Optional[bool] = None
             ) -> Tuple[Dict[str, Optional[Array]], Array]:
  """`(gradients of the tiles (float32, None where the tile is), gradient of
  the initial state)` from the outputs' and final state's cotangents."""
  names, arrays = present(tiles)
  num_chunks = tiles["query"].shape[1] // chunk

  def kernel(*refs):
    input_refs = refs[:len(names)]
    states_ref, d_out_ref, d_final_ref = refs[len(names):len(names) + 3]
    grad_refs, d_initial_ref = refs[len(names) + 3:-1], refs[-1]

    def step(i, d_state):
      n = num_chunks - 1 - i
      span = pl.ds(n * chunk, chunk)
      loaded = dict(zip(names, (ref[span, :].astype(jnp.float32) for ref in input_refs)))
      grads, d_state = chunk_lib.chunk_backward(
          tuple(loaded.get(name) for name in NAMES), states_ref[n], d_out_ref[span, :], d_state)
      for ref, grad in zip(grad_refs, (g for g in grads if g is not None)):
        ref[span, :] = grad
      return d_state

    d_initial_ref[...] = lax.fori_loop(0, num_chunks, step, d_final_ref[...])

  shapes = [jax.ShapeDtypeStruct(x.shape, jnp.float32) for x in arrays]
  shapes.append(jax.ShapeDtypeStruct(d_final.shape, jnp.float32))
  *grads, d_initial = pl.pallas_call(
      kernel, grid=(arrays[0].shape[0],), out_shape=shapes,
      in_specs=[_whole_row(x) for x in arrays + [states, d_out, d_final]],
      out_specs=[_whole_row(s) for s in shapes],
      compiler_params=_params(), interpret=_interpret(interpret),
      name="chunkwise_backward")(*arrays, states, d_out, d_final)
  by_name = dict(zip(names, grads))
  return {n: by_name.get(n) for n in NAMES}, d_initial
