"""flex_attention's mods evaluated on a Triton tile, their arrays read by index.

`mods.apply` runs a lifted mod with `jnp.vectorize`: batching the mod's scalar
program turns `slopes[h]` into a `dynamic_slice` and `ids[b, q_idx]` into a
`gather`, neither of which Pallas's Triton lowering has (seen on an H200,
jax 0.11.2). `apply_on_tile` walks the scalar program itself instead. Each
value of the program is held as a NumPy object array of the program's
(small) shape whose entries are tiles: arrays that broadcast against the
kernel's `[bq, bk]` block (`[bq, 1]` for a query position, a scalar for the
head). Elementwise equations run entry by entry on broadcast tiles, shape
equations (reshape, broadcast, concatenate, slices) move entries, and an
equation that indexes one of the mod's arrays becomes, per entry, a read at
the flat offset it computes:

* from a ref (`Indexed(by_value=False)`): a load at those offsets, which
  Triton does by pointer arithmetic, whatever the array's shape;
* from a value (`Indexed(by_value=True)`, the score_mod's floating arrays in
  the dq kernel, where they are differentiated): a one-hot sum over the
  array's flattened entries, whose gradient is the scatter-add the kernel
  cannot write. The array is padded to a power of two (Triton's shapes).

Indices are clamped into the array (as `lax.dynamic_slice` clamps its
starts); a mod is expected to index in bounds. An array used whole (a scalar
temperature) is read entry by entry, up to `MAX_WHOLE` entries; a primitive
that changes shape on tiles (a reduction, a sort) is refused by name.

The Mosaic TPU kernels use the same walk (`Indexed.gathers=False`): their
non-floating arrays are in SMEM, read one entry at a time, and their
floating ones are `[1, P]` values read by one-hot sums at one offset, so a
compiled Mosaic kernel reads a mod's arrays by the program's batch row and
head only; a per-position read is refused at trace time.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence, Tuple

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jax_core

from attention_jax.core import mods

Array = jnp.ndarray

# Primitives that call a sub-program: evaluated by walking it too.
_CALLS = {"pjit": "jaxpr", "jit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr",
          "custom_jvp_call": "call_jaxpr", "custom_vjp_call": "call_jaxpr",
          "custom_vjp_call_jaxpr": "fun_jaxpr", "remat": "jaxpr", "checkpoint": "jaxpr"}
# Above this many entries, a differentiated array indexed per position would
# make a [bq, bk, size] one-hot tile in the dq kernel.
MAX_ONE_HOT = 1024
# An array a mod uses whole (not indexed) is read entry by entry, up to this size.
MAX_WHOLE = 64


@dataclasses.dataclass(frozen=True)
class Indexed:
  """One of the mod's arrays as a kernel holds it: flattened (`kernel_array`),
  read through a ref or, `by_value`, from its loaded value by one-hot sums.

  Attributes:
    flat: the ref of the flattened array, or (`by_value`) its value `[P]` or
      `[1, P]`.
    shape, dtype: the array as the mod indexes it (bool stored in a wider int).
    by_value: read from `flat`'s value by one-hot sums.
    gathers: how a tile of offsets is read from the ref: "ref", a load at
      them (Triton's pointers); "value", the ref's whole value indexed (the
      TPU interpreter, which loads no ref at a tile of offsets); "none": not
      at all (Mosaic reads one SMEM entry at a time).
  """

  flat: Any
  shape: Tuple[int, ...]
  dtype: Any
  by_value: bool = False
  gathers: str = "ref"

  def read(self, flat_index: Array) -> Array:
    """The entries at `flat_index` (any broadcasting tile shape, int32)."""
    if jnp.ndim(flat_index) and self.gathers == "none":
      raise NotImplementedError(
          f"the Mosaic TPU kernels read a mod's arrays at one index per program (slopes[h], "
          f"table[h, 3]); this mod reads one of shape {self.shape} at a tile of indices "
          f"{jnp.shape(flat_index)} (per query or key position), a gather Mosaic cannot do. "
          "Use implementation='blockwise' for it (or interpret mode).")
    if self.by_value and not jnp.ndim(flat_index):
      # One offset: a one-hot sum over the `[1, P]` row, which Mosaic lays out.
      row = self.flat.reshape(1, -1)
      hits = lax.broadcasted_iota(jnp.int32, row.shape, 1) == flat_index
      entries = jnp.sum(jnp.where(hits, row, jnp.zeros((), row.dtype)))
    elif self.by_value:
      flat = self.flat.reshape(-1)
      hits = flat_index[..., None] == lax.broadcasted_iota(
          jnp.int32, flat_index.shape + (flat.shape[0],), flat_index.ndim)
      entries = jnp.sum(jnp.where(hits, flat, jnp.zeros((), flat.dtype)), axis=-1)
    elif jnp.ndim(flat_index) and self.gathers == "value":
      entries = self.flat[...][flat_index]
    else:
      entries = self.flat[flat_index]
    if self.dtype == jnp.bool_:
      return entries != 0
    return entries.astype(self.dtype)


def kernel_array(x: Array, *, pad_to_power_of_two: bool = False) -> Array:
  """A mod's array as a Triton kernel input: flattened, bool as int8; padded
  with zeros to a power of two where the kernel loads it whole (`by_value`)."""
  x = jnp.asarray(x)
  if x.dtype == jnp.bool_:
    x = x.astype(jnp.int8)
  x = x.reshape(-1)
  if pad_to_power_of_two:
    size = 1 << max(0, x.shape[0] - 1).bit_length()
    x = jnp.pad(x, (0, size - x.shape[0]))
  return x


def indexed(lifted: mods.LiftedMod, flats: Sequence[Any], by_value: Sequence[bool]
            ) -> Tuple[Indexed, ...]:
  """The mod's arrays (its jaxpr's constants, in order) from the kernel's."""
  return tuple(Indexed(flat, tuple(var.aval.shape), var.aval.dtype, value)
               for flat, var, value in zip(flats, lifted.jaxpr.constvars, by_value))


def check_differentiable(lifted: mods.LiftedMod) -> None:
  """Refuses, by name, a floating array too large for the dq kernel's one-hot sums."""
  for var, floating in zip(lifted.jaxpr.constvars, lifted.differentiable):
    size = int(np.prod(var.aval.shape))
    if floating and size > MAX_ONE_HOT:
      raise ValueError(
          f"the Triton kernels differentiate a {lifted.name}'s floating arrays by one-hot sums "
          f"over their entries, at most {MAX_ONE_HOT}; got one of shape {tuple(var.aval.shape)} "
          "(pass a dense bias as bias=, or use implementation='blockwise').")


def apply_on_tile(lifted: mods.LiftedMod, arrays: Sequence[Indexed], *args: Array) -> Array:
  """`mod(*args)` on broadcasting tiles, its arrays read through `arrays`."""
  env_args = [_entries(arg) for arg in args]
  (out,) = _evaluate(lifted.jaxpr, list(arrays), env_args)
  # As `mods.apply`: the result has the shape of the arguments broadcast.
  return jnp.broadcast_to(out[()], jnp.broadcast_shapes(*(jnp.shape(arg) for arg in args)))


def _entries(x: Any) -> np.ndarray:
  """A 0-d object array holding one tile."""
  holder = np.empty((), object)
  holder[()] = x
  return holder


def _literal(value: Any, aval) -> np.ndarray:
  """A literal (or a sub-program's constant) as an object array of scalars."""
  value = np.asarray(value, dtype=aval.dtype)
  held = np.empty(value.shape, object)
  for index in np.ndindex(*value.shape):
    held[index] = jnp.asarray(value[index], aval.dtype)
  return held


def _evaluate(jaxpr, consts: list, args: list) -> list:
  env = {}
  for var, value in zip(jaxpr.constvars, consts):
    env[var] = value if isinstance(value, (Indexed, np.ndarray)) else _literal(value, var.aval)
  for var, value in zip(jaxpr.invars, args):
    env[var] = value

  def read(atom):
    if isinstance(atom, jax_core.Literal):
      return _literal(atom.val, atom.aval)
    return env[atom]

  for eqn in jaxpr.eqns:
    values = [read(atom) for atom in eqn.invars]
    outs = _equation(eqn, values)
    for var, value in zip(eqn.outvars, outs):
      env[var] = value
  return [read(atom) for atom in jaxpr.outvars]


def _equation(eqn, values: list) -> list:
  name = eqn.primitive.name
  if name in _CALLS:
    inner = eqn.params[_CALLS[name]]
    if hasattr(inner, "consts"):  # a ClosedJaxpr
      return _evaluate(inner.jaxpr, list(inner.consts), values)
    return _evaluate(inner, [], values)
  if any(isinstance(v, Indexed) for v in values):
    if name == "dynamic_slice" and isinstance(values[0], Indexed):
      return [_dynamic_slice(values[0], values[1:], eqn.params["slice_sizes"])]
    if name == "gather" and isinstance(values[0], Indexed):
      return [_gather(values[0], values[1], eqn.params)]
    # An array used whole (a scalar temperature, `table * 2`): its entries, read one by one.
    values = [_whole(v, name) if isinstance(v, Indexed) else v for v in values]
  shape_rule = _SHAPE_RULES.get(name)
  if shape_rule is not None:
    return [shape_rule(eqn, *values)]
  out_avals = [v.aval for v in eqn.outvars]
  in_shapes = [v.aval.shape for v in eqn.invars]
  if any(aval.shape != in_shapes[0] for aval in out_avals) or \
      any(shape != in_shapes[0] for shape in in_shapes):
    raise NotImplementedError(
        f"the Pallas kernels evaluate a mod's program entry by entry; `{name}` changes its "
        f"operands' shape {in_shapes} -> {[a.shape for a in out_avals]}. Use "
        "implementation='blockwise' for this mod.")
  shape = out_avals[0].shape
  results = [np.empty(shape, object) for _ in out_avals]
  for index in np.ndindex(*shape):
    tiles = [v[index] for v in values]
    tiles = jnp.broadcast_arrays(*tiles) if len(tiles) > 1 else tiles
    out = eqn.primitive.bind(*tiles, **eqn.params)
    for result, tile in zip(results, out if eqn.primitive.multiple_results else [out]):
      result[index] = tile
  return results


def _whole(array: Indexed, primitive: str) -> np.ndarray:
  """Every entry of `array` as a tile (one read each), for `primitive` to use it whole."""
  size = int(np.prod(array.shape))
  if size > MAX_WHOLE:
    raise NotImplementedError(
        f"the Pallas kernels read a mod's arrays by indexing them (x[i], x[b, q_idx]) or, up to "
        f"{MAX_WHOLE} entries, whole; this mod applies `{primitive}` to one of shape "
        f"{array.shape}. Use implementation='blockwise' for it.")
  out = np.empty(array.shape, object)
  for offset, index in enumerate(np.ndindex(*array.shape)):
    out[index] = array.read(jnp.int32(offset))
  return out


def _flat_index(array: Indexed, index: Sequence[Any]) -> Array:
  """Row-major offset of `index` (tiles, one per dim, clamped into the array)."""
  flat = jnp.zeros((), jnp.int32)
  stride = 1
  for dim in reversed(range(len(array.shape))):
    position = jnp.clip(jnp.asarray(index[dim], jnp.int32), 0, array.shape[dim] - 1)
    flat = flat + position * stride
    stride *= array.shape[dim]
  return flat


def _dynamic_slice(array: Indexed, starts: Sequence[np.ndarray], sizes) -> np.ndarray:
  starts = [jnp.clip(jnp.asarray(s[()], jnp.int32), 0, dim - size)
            for s, dim, size in zip(starts, array.shape, sizes)]
  out = np.empty(tuple(sizes), object)
  for offset in np.ndindex(*sizes):
    out[offset] = array.read(_flat_index(array, [s + o for s, o in zip(starts, offset)]))
  return out


def _gather(array: Indexed, indices: np.ndarray, params) -> np.ndarray:
  numbers = params["dimension_numbers"]
  if numbers.operand_batching_dims:
    raise NotImplementedError("the Triton kernels do not read a mod's array by a batched gather.")
  sizes = params["slice_sizes"]
  kept = [d for d in range(len(array.shape)) if d not in numbers.collapsed_slice_dims]
  batch_shape = indices.shape[:-1]
  out_ndim = len(batch_shape) + len(kept)
  offset_dims = tuple(numbers.offset_dims)
  batch_axes = [axis for axis in range(out_ndim) if axis not in offset_dims]
  out_shape = [0] * out_ndim
  for axis, size in zip(batch_axes, batch_shape):
    out_shape[axis] = size
  for axis, dim in zip(offset_dims, kept):
    out_shape[axis] = sizes[dim]
  out = np.empty(tuple(out_shape), object)
  for position in np.ndindex(*out_shape):
    vector = indices[tuple(position[axis] for axis in batch_axes)]
    full = [jnp.zeros((), jnp.int32)] * len(array.shape)
    for column, dim in enumerate(numbers.start_index_map):
      full[dim] = jnp.clip(jnp.asarray(vector[column], jnp.int32), 0,
                           array.shape[dim] - sizes[dim])
    for axis, dim in zip(offset_dims, kept):
      full[dim] = full[dim] + position[axis]
    out[position] = array.read(_flat_index(array, full))
  return out


def _reshape(eqn, x, *dynamic):
  del dynamic
  return x.reshape(eqn.outvars[0].aval.shape)


def _broadcast_in_dim(eqn, x, *dynamic):
  del dynamic
  shape, dims = eqn.params["shape"], eqn.params["broadcast_dimensions"]
  expanded = x.reshape([x.shape[dims.index(d)] if d in dims else 1 for d in range(len(shape))])
  return np.broadcast_to(expanded, shape)


def _concatenate(eqn, *xs):
  return np.concatenate(xs, axis=eqn.params["dimension"])


def _slice(eqn, x):
  strides = eqn.params["strides"] or (1,) * x.ndim
  return x[tuple(slice(a, b, s) for a, b, s in
                 zip(eqn.params["start_indices"], eqn.params["limit_indices"], strides))]


def _transpose(eqn, x):
  return x.transpose(eqn.params["permutation"])


def _iota(eqn):
  aval = eqn.outvars[0].aval
  values = lax.broadcasted_iota(aval.dtype, aval.shape, eqn.params["dimension"])
  return _literal(np.asarray(values), aval)


_SHAPE_RULES = {
    "reshape": _reshape, "squeeze": lambda eqn, x: x.reshape(eqn.outvars[0].aval.shape),
    "expand_dims": lambda eqn, x: x.reshape(eqn.outvars[0].aval.shape),
    "broadcast_in_dim": _broadcast_in_dim, "concatenate": _concatenate, "slice": _slice,
    "transpose": _transpose, "iota": _iota,
}
