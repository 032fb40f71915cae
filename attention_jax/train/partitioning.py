"""The device mesh, the logical-axis rules, and where parameters and batches live.

Modules name the axes of their parameters and activations logically ("embed",
"heads", ...; see `nn.with_logical_partitioning`). `LOGICAL_AXIS_RULES` maps
those names to the axes of a ("data", "fsdp", "tensor") mesh:

- "data": pure data parallelism; parameters are replicated over it.
- "fsdp": data parallelism whose parameters (and optimiser state) are split
  along their "embed" dimension and gathered when used (ZeRO-3 / FSDP).
- "tensor": Megatron-style model parallelism over heads, MLP units and the
  vocabulary.

The same code runs on one device (mesh (1, 1, 1)), on one host with many
devices, and on many hosts: batches arrive as each host's rows and are
assembled into global arrays by `shard_batch`.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from attention_jax import axes

MESH_AXES = ("data", "fsdp", "tensor")
# Added as the last (fastest-varying, so neighbouring) mesh axis when a
# sequence is split: ring attention passes chunks to the next device on it.
SEQUENCE_AXIS = axes.SEQUENCE_AXIS
# Every data-parallel axis splits the batch: FSDP is data parallelism too.
DATA_AXES = axes.DATA_AXES
# The default logical -> mesh axis rules (weights and activations have names of
# their own, so no rule's order matters); configs may replace them
# (`config.logical_axis_rules`).
LOGICAL_AXIS_RULES: Tuple[Tuple[str, Any], ...] = axes.DEFAULT_RULES


def axis_rules(rules: Sequence[Sequence[Any]]) -> Tuple[Tuple[str, Any], ...]:
  """Checked `(logical axis, mesh axes)` rules, e.g. `config.logical_axis_rules`
  (which JSON may have turned into lists).

  Raises:
    ValueError: when an entry is not a pair of a name and None, a mesh axis or
      a sequence of mesh axes, or names a mesh axis that is not in `MESH_AXES`.
  """
  checked = []
  for rule in rules:
    if (not isinstance(rule, (tuple, list)) or len(rule) != 2
        or not isinstance(rule[0], str)):
      raise ValueError(f"logical_axis_rules entries must be (logical axis, mesh axes) pairs, "
                       f"got {rule!r}.")
    name, targets = rule
    targets = tuple(targets) if isinstance(targets, (tuple, list)) else targets
    for target in (targets if isinstance(targets, tuple) else (targets,)):
      if target is not None and target not in MESH_AXES + (SEQUENCE_AXIS,):
        raise ValueError(f"logical_axis_rules maps {name!r} to {target!r}, which is not a mesh "
                         f"axis; mesh axes are {MESH_AXES + (SEQUENCE_AXIS,)}.")
    checked.append((name, targets))
  return tuple(checked)


def make_mesh(mesh_shape: Sequence[int], axis_names: Sequence[str] = MESH_AXES, *,
              devices: Optional[Sequence[jax.Device]] = None, sequence_shards: int = 1) -> Mesh:
  """A device mesh of `mesh_shape` over all (or the given) devices.

  Args:
    mesh_shape: one size per axis name; a single -1 stands for "the rest of the
      devices", e.g. (-1, 1, 1) is pure data parallelism on any device count.
    axis_names: the mesh axes, `MESH_AXES` by default.
    devices: the devices to lay out; `jax.devices()` (all hosts) by default.
    sequence_shards: above 1, a last axis `SEQUENCE_AXIS` of this size is added
      (the -1 takes the devices left after it).

  Raises:
    ValueError: when the shape and the names differ in length, a size is
      neither positive nor -1, -1 appears twice, or the product of the sizes
      does not use exactly the devices available.
  """
  devices = list(jax.devices() if devices is None else devices)
  shape = tuple(int(size) for size in mesh_shape)
  if len(shape) != len(axis_names):
    raise ValueError(f"mesh shape {tuple(mesh_shape)} has {len(shape)} sizes but the mesh has "
                     f"{len(axis_names)} axes {tuple(axis_names)}.")
  if not isinstance(sequence_shards, int) or sequence_shards < 1:
    raise ValueError(f"sequence_shards must be a positive integer, got {sequence_shards!r}.")
  described = f"mesh shape {tuple(mesh_shape)}"
  if sequence_shards > 1:
    if SEQUENCE_AXIS in axis_names:
      raise ValueError(f"axis_names {tuple(axis_names)} already hold {SEQUENCE_AXIS!r}; "
                       f"give its size there or in sequence_shards, not both.")
    shape, axis_names = shape + (sequence_shards,), tuple(axis_names) + (SEQUENCE_AXIS,)
    described += f" with sequence_shards={sequence_shards}"
  if any(size == 0 or size < -1 for size in shape) or shape.count(-1) > 1:
    raise ValueError(f"{described} must hold positive sizes and at most one -1 (the rest of "
                     f"the devices).")
  known = math.prod(size for size in shape if size != -1)
  if -1 in shape:
    if len(devices) % known:
      raise ValueError(f"{described}: {len(devices)} devices do not divide into groups of "
                       f"{known}.")
    shape = tuple(len(devices) // known if size == -1 else size for size in shape)
  elif known != len(devices):
    raise ValueError(f"{described} needs {known} devices but there are {len(devices)}; use -1 "
                     f"for one axis to take the rest.")
  # Auto axes: the model places its activations with `with_sharding_constraint`
  # hints and leaves the rest to the partitioner (the jit/GSPMD model). Explicit
  # axes, jax.make_mesh's default, would need sharding types on every operation.
  return jax.make_mesh(shape, tuple(axis_names), axis_types=(AxisType.Auto,) * len(shape),
                       devices=devices)


def _drop_indivisible(spec: P, shape: Tuple[int, ...], mesh: Mesh) -> P:
  """`spec` with each dimension that its mesh axes do not divide replicated.

  A vocabulary of 18 tokens cannot be split over 4 tensor shards; keeping it
  whole costs a little memory and is what a default config should do rather
  than fail.
  """
  entries = []
  for size, axes in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
    names = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
    shards = math.prod(mesh.shape[name] for name in names)
    entries.append(axes if size % shards == 0 else None)
  return P(*entries)


def logical_to_mesh_shardings(abstract_variables: Any, mesh: Mesh,
                              rules: Sequence[Tuple[str, Any]] = LOGICAL_AXIS_RULES) -> Any:
  """`NamedSharding`s for a tree of (abstract) logically partitioned values.

  Args:
    abstract_variables: a tree whose leaves are `nn.LogicallyPartitioned` boxes
      (as `jax.eval_shape(model.init, ...)` returns them) or plain arrays /
      `ShapeDtypeStruct`s, which are replicated.
    mesh: the device mesh.
    rules: logical axis name -> mesh axis (or axes, or None).

  Returns:
    The tree of the unboxed values, each leaf its `NamedSharding`. A dimension
    that its mesh axes do not divide is replicated.
  """
  logical_specs = nn.get_partition_spec(abstract_variables)
  mesh_specs = nn.logical_to_mesh(logical_specs, rules)
  abstract_values = nn.meta.unbox(abstract_variables)
  return jax.tree.map(
      lambda spec, value: NamedSharding(mesh, _drop_indivisible(spec, value.shape, mesh)),
      mesh_specs, abstract_values, is_leaf=lambda x: isinstance(x, P))


def data_parallel_size(mesh: Mesh) -> int:
  """The number of ways the batch is split: the product of the `DATA_AXES` sizes."""
  return math.prod(mesh.shape[name] for name in DATA_AXES)


def check_batch_size(global_batch_size: int, mesh: Mesh) -> None:
  """Raises ValueError unless `global_batch_size` splits evenly over `DATA_AXES`."""
  shards = data_parallel_size(mesh)
  if global_batch_size % shards:
    sizes = " x ".join(f"{name}={mesh.shape[name]}" for name in DATA_AXES)
    raise ValueError(f"the global batch size {global_batch_size} must be a multiple of the "
                     f"data-parallel mesh size {shards} ({sizes}).")


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """The sharding of every batch array: rows split over `DATA_AXES`, the rest whole."""
  return NamedSharding(mesh, P(DATA_AXES))


def shard_batch(host_batch: Dict[str, np.ndarray], sharding: NamedSharding) -> Dict[str, jax.Array]:
  """Global arrays from this host's rows of a global batch.

  Args:
    host_batch: arrays `[rows, ...]`, this host's consecutive rows of the global
      batch (`attention_jax.data.batches` with this process's index and count).
    sharding: `batch_sharding(mesh)`.

  Returns:
    The same keys as `[rows * process_count, ...]` arrays placed by `sharding`.

  Raises:
    ValueError: when the arrays disagree on the row count, or the global batch
      does not split over the data-parallel axes.
  """
  rows = {name: np.shape(array)[0] for name, array in host_batch.items()}
  if len(set(rows.values())) != 1:
    raise ValueError(f"every batch array needs the same number of rows, got {rows}.")
  check_batch_size(next(iter(rows.values())) * jax.process_count(), sharding.mesh)
  return {name: jax.make_array_from_process_local_data(sharding, np.asarray(array))
          for name, array in host_batch.items()}


def sequence_parallel_rules(rules: Sequence[Tuple[str, Any]], sequence_shards: int
                            ) -> Tuple[Tuple[str, Any], ...]:
  """`rules` with the activations' length on `SEQUENCE_AXIS` when the sequence is
  split (`sequence_shards` > 1); unchanged otherwise, or where the rules
  already place it."""
  if sequence_shards <= 1:
    return tuple(rules)
  return tuple((name, SEQUENCE_AXIS if name == axes.ACTIVATION_LENGTH and target is None
                else target) for name, target in rules)


def under_mesh(fn: Callable[..., Any], mesh: Mesh,
               rules: Sequence[Tuple[str, Any]] = LOGICAL_AXIS_RULES) -> Callable[..., Any]:
  """`fn` called with `mesh` current and the logical-axis `rules` set, so that the
  models' `nn.with_logical_constraint` hints resolve to mesh axes when it traces."""

  @functools.wraps(fn)
  def wrapped(*args, **kwargs):
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
      return fn(*args, **kwargs)

  return wrapped
