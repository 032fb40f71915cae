"""The chunkwise recurrence as Pallas kernels for TPUs (Mosaic lowering).

The grid is (row of `[BH, T, D]`, chunk): the chunk axis is sequential
("arbitrary") and the `[Dk, Dv]` state lives in a VMEM scratch between its
steps, so each step holds only one chunk's tiles (Mosaic pipelines the next
chunk's copy-in behind the current one's work). The forward kernel writes the
state entering each chunk, `[BH, N, Dk, Dv]`; the backward kernel visits the
chunks in reverse (its index maps count down) with the state's gradient in
the scratch, recomputing each chunk from its entering state and
differentiating it on the tile (`chunk.chunk_backward`).

These kernels have run in the Pallas TPU interpreter on CPU only; they have
not been lowered for, or timed on, a TPU.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple, Union

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from . import chunk as chunk_lib
from .pallas_gpu import NAMES, forward_shapes, present

Array = jax.Array


def _interpret(interpret: Union[None, bool, pltpu.InterpretParams]):
  """pallas_call's `interpret`: TPU interpret mode off a TPU unless told otherwise."""
  if isinstance(interpret, pltpu.InterpretParams):
    return interpret
  if interpret is None:
    interpret = jax.default_backend() != "tpu"
  return pltpu.InterpretParams() if interpret else False


def _chunk_spec(x: Array, chunk: int, num_chunks: int, reverse: bool) -> pl.BlockSpec:
  """Chunk n (N - 1 - n when `reverse`) of row b of a `[BH, T, D]` array."""
  at = (lambda n: num_chunks - 1 - n) if reverse else (lambda n: n)
  return pl.BlockSpec((None, chunk, x.shape[-1]), lambda b, n: (b, at(n), 0))


def _state_spec(shape, num_chunks: int = 0, reverse: bool = False) -> pl.BlockSpec:
  """Row b's `[Dk, Dv]` state, or its chunk n of a `[BH, N, Dk, Dv]` array."""
  if len(shape) == 3:
    return pl.BlockSpec((None,) + tuple(shape[1:]), lambda b, n: (b, 0, 0))
  at = (lambda n: num_chunks - 1 - n) if reverse else (lambda n: n)
  return pl.BlockSpec((None, None) + tuple(shape[2:]), lambda b, n: (b, at(n), 0, 0))


def _call(kernel, arrays, in_specs, shapes, out_specs, state_shape, num_chunks, interpret, name):
  return pl.pallas_call(
      kernel, out_shape=shapes,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=0, grid=(arrays[0].shape[0], num_chunks), in_specs=in_specs,
          out_specs=out_specs, scratch_shapes=[pltpu.VMEM(state_shape, jnp.float32)]),
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
      interpret=_interpret(interpret), name=name)(*arrays)


def forward(tiles: Dict[str, Optional[Array]], initial_state: Array, *, chunk: int,
            interpret=None) -> Tuple[Array, Array, Array]:
  """As `pallas_gpu.forward`: `(outputs, entering states, final state)`."""
  names, arrays = present(tiles)
  shapes = forward_shapes(tiles, chunk)
  num_chunks = tiles["query"].shape[1] // chunk

  def kernel(*refs):
    input_refs, initial_ref = refs[:len(names)], refs[len(names)]
    out_ref, states_ref, final_ref, state_ref = refs[len(names) + 1:]

    @pl.when(pl.program_id(1) == 0)
    def _():
      state_ref[...] = initial_ref[...].astype(jnp.float32)

    loaded = dict(zip(names, (ref[...].astype(jnp.float32) for ref in input_refs)))
    state = state_ref[...]
    states_ref[...] = state
    out, new_state = chunk_lib.chunk_forward(*(loaded.get(name) for name in NAMES), state)
    out_ref[...] = out
    state_ref[...] = new_state

    @pl.when(pl.program_id(1) == num_chunks - 1)
    def _():
      final_ref[...] = new_state

  in_specs = [_chunk_spec(x, chunk, num_chunks, False) for x in arrays]
  in_specs.append(_state_spec(initial_state.shape))
  out_specs = [_chunk_spec(shapes[0], chunk, num_chunks, False),
               _state_spec(shapes[1].shape, num_chunks), _state_spec(shapes[2].shape)]
  return _call(kernel, arrays + [initial_state], in_specs, shapes, out_specs,
               initial_state.shape[1:], num_chunks, interpret, "chunkwise_forward")


def backward(tiles: Dict[str, Optional[Array]], states: Array, d_out: Array, d_final: Array,
             *, chunk: int, interpret=None) -> Tuple[Dict[str, Optional[Array]], Array]:
  """As `pallas_gpu.backward`: `(gradients of the tiles, of the initial state)`."""
  names, arrays = present(tiles)
  num_chunks = tiles["query"].shape[1] // chunk

  def kernel(*refs):
    input_refs = refs[:len(names)]
    states_ref, d_out_ref, d_final_ref = refs[len(names):len(names) + 3]
    grad_refs, d_initial_ref, d_state_ref = refs[len(names) + 3:-2], refs[-2], refs[-1]

    @pl.when(pl.program_id(1) == 0)
    def _():
      d_state_ref[...] = d_final_ref[...]

    loaded = dict(zip(names, (ref[...].astype(jnp.float32) for ref in input_refs)))
    grads, d_state = chunk_lib.chunk_backward(
        tuple(loaded.get(name) for name in NAMES), states_ref[...], d_out_ref[...],
        d_state_ref[...])
    for ref, grad in zip(grad_refs, (g for g in grads if g is not None)):
      ref[...] = grad
    d_state_ref[...] = d_state

    @pl.when(pl.program_id(1) == num_chunks - 1)
    def _():
      d_initial_ref[...] = d_state

  shapes = [jax.ShapeDtypeStruct(x.shape, jnp.float32) for x in arrays]
  shapes.append(jax.ShapeDtypeStruct(d_final.shape, jnp.float32))
  in_specs = [_chunk_spec(x, chunk, num_chunks, True) for x in arrays]
  in_specs += [_state_spec(states.shape, num_chunks, reverse=True),
               _chunk_spec(d_out, chunk, num_chunks, True), _state_spec(d_final.shape)]
  out_specs = [_chunk_spec(s, chunk, num_chunks, True) for s in shapes[:-1]]
  out_specs.append(_state_spec(d_final.shape))
  *grads, d_initial = _call(kernel, arrays + [states, d_out, d_final], in_specs, shapes,
                            out_specs, d_final.shape[1:], num_chunks, interpret,
                            "chunkwise_backward")
  by_name = dict(zip(names, grads))
  return {n: by_name.get(n) for n in NAMES}, d_initial
