"""Ring attention (Liu et al. 2023): exact attention over a sequence sharded along a mesh axis.

Each of the n devices of the mesh axis `axis_name` holds T / n of the
queries, keys and values. The key/value chunks travel round the ring
(`lax.ppermute` to the next device) while each device attends its own
queries to the chunk in hand with the blockwise loops of `blockwise.py`,
merging each step's output and log-sum-exp into its running ones. After n
steps every query has seen every key, and no device has held more than its own
chunk and the visiting one: memory per device is O(T / n) and the whole
sequence is never gathered.

The backward pass is a ring as well (a custom VJP): the chunks go round again,
each carrying its dk and dv accumulators; every device adds the gradients of
its queries against the chunk in hand (dq stays home, dk and dv travel), and
after n steps each chunk is home with its whole gradient. The probabilities
are recomputed from the saved log-sum-exp, as in the flash backward.

Causal balance. Cut into n contiguous chunks, causal attention leaves device
0 one chunk pair of work and device n - 1 n of them. `layout="zigzag"` cuts the
sequence into 2n chunks and gives device i chunks i and 2n - 1 - i, so that
every device has the same causal work (Brandon et al. 2023 balance the same
way with stripes); the blocks no query can see are skipped inside each step.
The inputs and outputs keep the plain layout (device i holds tokens
[i T / n, (i + 1) T / n)); the re-layout into zig-zag order and back is two
`ppermute`s each way, never a gather.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional, Tuple, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from attention_jax import axes
from attention_jax.core.inputs import (AttentionInputs, attention_of_empty_sequence,
                                       prepare_inputs, returned_outputs)

from . import blockwise, common

Array = jnp.ndarray
LAYOUTS = ("zigzag", "contiguous")
# The mesh axis that `dot_product_attention(..., implementation="ring")` shards over.
SEQUENCE_AXIS = axes.SEQUENCE_AXIS


def ring_attention(query: Array, key: Array, value: Array, bias=None, mask=None, *,
                   mesh=None, axis_name: str = SEQUENCE_AXIS, layout: str = "zigzag",
                   block_sizes: Optional[common.BlockSizes] = None,
                   return_residual: bool = False, **kwargs) -> Union[Array, Tuple[Array, Array]]:
  """Exact attention with the sequence sharded over `axis_name`; `[B, Tq, H, Dv]`.

  Args:
    query: `[B, Tq, H, D]`; key: `[B, Tk, Hkv, D]`; value: `[B, Tk, Hkv, Dv]`,
      sharded along T over `axis_name` (or not: the call shards them).
    bias: not taken (a `[Tq, Tk]` array is what the ring avoids).
    mask: only a key mask, `[B|1, 1, 1, Tk]` (padding anywhere, as the
      encoders pass it); the structured masks (`is_causal`,
      `local_window_size`, `segment_ids`, the lengths) are all taken.
    mesh: a `Mesh` (or `AbstractMesh`) with the axis `axis_name`; None: the
      mesh set with `jax.set_mesh`. Only `axis_name` is manual here; the
      other mesh axes (batch, heads) stay the compiler's.
    axis_name: the mesh axis the sequence is split over.
    layout: "zigzag" (balanced causal work) or "contiguous".
    block_sizes: the blockwise loops' blocks within a device's chunk.
    return_residual: also return the log-sum-exp `[B, Tq, H]` float32.
    **kwargs: `dot_product_attention`'s scale, is_causal, local_window_size,
      segment_ids, query_seq_lengths, key_value_seq_lengths.

  Raises:
    ValueError: for a bias or mask, a mesh without `axis_name`, an unknown
      layout, or a length that the ring cannot split evenly (T must be a
      multiple of n, of 2n for zig-zag).
  """
  inputs, unbatched = prepare_inputs(query, key, value, bias, mask, **kwargs)
  return returned_outputs(
      attention_over_ring(inputs, mesh=mesh, axis_name=axis_name, layout=layout,
                          block_sizes=block_sizes, return_residual=return_residual),
      unbatched)


def attention_over_ring(inputs: AttentionInputs, *, mesh=None, axis_name: str = SEQUENCE_AXIS,
                        layout: str = "zigzag", block_sizes: Optional[common.BlockSizes] = None,
                        return_residual: bool = False) -> Union[Array, Tuple[Array, Array]]:
  """`ring_attention` of validated inputs (`implementation="ring"`)."""
  reason = ring_rejects(inputs, mesh, axis_name, layout)
  if reason is not None:
    raise ValueError(reason)
  empty = attention_of_empty_sequence(inputs, return_residual)  # Tq = 0 or Tk = 0
  if empty is not None:
    return empty
  mesh, ring_size = _ring_mesh(mesh, axis_name)
  static = _RingStatic(axis_name=axis_name, ring_size=ring_size, layout=layout,
                       scale=float(inputs.scale), is_causal=inputs.is_causal,
                       window=inputs.local_window_size, block_sizes=block_sizes)
  sequence, replicated = P(None, axis_name), P()
  q_segment_ids, kv_segment_ids = _segments_with_key_mask(inputs)
  extras = dict(q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
                query_seq_lengths=inputs.query_seq_lengths,
                key_value_seq_lengths=inputs.key_value_seq_lengths)
  extras = {name: x for name, x in extras.items() if x is not None}
  extra_specs = {name: sequence if name.endswith("segment_ids") else replicated
                 for name in extras}
  local = jax.shard_map(functools.partial(_ring_local, static), mesh=mesh,
                        in_specs=(sequence, sequence, sequence, extra_specs),
                        out_specs=(sequence, sequence), axis_names={axis_name},
                        check_vma=False)
  arrays = (inputs.query, inputs.key, inputs.value, extras)
  if _is_explicit(mesh, axis_name):
    # Under explicit sharding (jax.make_mesh's default) shard_map takes its
    # inputs only as `in_specs` lays them out; an Auto axis (the trainer's
    # meshes) is resharded by the compiler.
    arrays = jax.sharding.reshard(
        arrays, jax.tree.map(lambda spec: NamedSharding(mesh, spec),
                             (sequence, sequence, sequence, extra_specs),
                             is_leaf=lambda x: isinstance(x, P)))
  out, lse = local(*arrays)
  return common.attention_outputs(out, lse, inputs.query_seq_lengths, return_residual)


# The segment id of masked keys: no query has it (unless a caller's own ids do).
_MASKED_KEY_SEGMENT = int(np.iinfo(np.int32).min)


def _segments_with_key_mask(inputs: AttentionInputs):
  """(q_segment_ids, kv_segment_ids) with the key mask folded in: a masked key
  gets a segment of its own, which travels round the ring with its chunk."""
  if inputs.mask is None:
    return inputs.q_segment_ids, inputs.kv_segment_ids
  batch, q_len, kv_len = inputs.query.shape[0], inputs.query.shape[1], inputs.key.shape[1]
  key_mask = jnp.broadcast_to(inputs.mask[:, 0, 0, :], (batch, kv_len))
  q_segment_ids, kv_segment_ids = inputs.q_segment_ids, inputs.kv_segment_ids
  if q_segment_ids is None:
    q_segment_ids = jnp.zeros((batch, q_len), jnp.int32)
    kv_segment_ids = jnp.zeros((batch, kv_len), jnp.int32)
  return q_segment_ids, jnp.where(key_mask, kv_segment_ids.astype(jnp.int32),
                                  _MASKED_KEY_SEGMENT)


def _is_explicit(mesh, axis_name: str) -> bool:
  types = dict(zip(mesh.axis_names, getattr(mesh, "axis_types", ())))
  return types.get(axis_name) == jax.sharding.AxisType.Explicit


def ring_rejects(inputs: AttentionInputs, mesh=None, axis_name: str = SEQUENCE_AXIS,
                 layout: str = "zigzag") -> Optional[str]:
  """Why the ring cannot take these inputs, or None."""
  if inputs.bias is not None:
    return ("ring attention takes no bias (a [Tq, Tk] array is what it avoids); use "
            "is_causal, local_window_size, segment_ids, the sequence lengths or a key mask.")
  if inputs.mask is not None and inputs.mask.shape[1:3] != (1, 1):
    return (f"ring attention takes a mask only as a key mask [B|1, 1, 1, Tk], got shape "
            f"{list(inputs.mask.shape)}; use is_causal, local_window_size, segment_ids or "
            f"the sequence lengths for the rest.")
  try:
    _, ring_size = _ring_mesh(mesh, axis_name)
    check_ring_inputs(inputs.query.shape[1], inputs.key.shape[1], ring_size, layout)
  except ValueError as e:
    return str(e)
  return None


def check_ring_inputs(q_len: int, kv_len: int, ring_size: int, layout: str) -> None:
  """ValueError unless the ring can split both sequences evenly in this layout."""
  if layout not in LAYOUTS:
    raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}.")
  pieces = 2 * ring_size if layout == "zigzag" else ring_size
  for name, length in (("query", q_len), ("key", kv_len)):
    if length % pieces:
      raise ValueError(
          f"ring attention over {ring_size} devices in the {layout!r} layout splits the "
          f"sequence into {pieces} equal chunks; the {name} length {length} is not a "
          f"multiple of {pieces} (pad it, or use layout='contiguous' for multiples of "
          f"{ring_size}).")


def _ring_mesh(mesh, axis_name: str):
  """The mesh to shard over (the ambient one when None) and the ring's size."""
  if mesh is None:
    mesh = jax.sharding.get_abstract_mesh()
  have = tuple(getattr(mesh, "axis_names", ()))
  if axis_name not in have:
    raise ValueError(f"ring attention shards the sequence over the mesh axis {axis_name!r}, "
                     f"which the mesh does not have (its axes: {have}); pass mesh= or set "
                     f"one with jax.set_mesh, and name its sequence axis in axis_name=.")
  return mesh, int(mesh.shape[axis_name])


@dataclasses.dataclass(frozen=True)
class _RingStatic:
  axis_name: str
  ring_size: int
  layout: str
  scale: float
  is_causal: bool
  window: Optional[Tuple[int, int]]
  block_sizes: Optional[common.BlockSizes]


def _ring_local(static: _RingStatic, query, key, value, extras):
  """One device's part: its chunks of q, k, v `[B, T / n, ...]` -> out, lse."""
  n, axis = static.ring_size, static.axis_name
  device = jax.lax.axis_index(axis)
  q_segment_ids = extras.get("q_segment_ids")
  kv_segment_ids = extras.get("kv_segment_ids")
  if static.layout == "zigzag":
    query, key, value = (_to_zigzag(x, axis, n) for x in (query, key, value))
    q_segment_ids, kv_segment_ids = (None if ids is None else _to_zigzag(ids, axis, n)
                                     for ids in (q_segment_ids, kv_segment_ids))
  inputs = AttentionInputs(
      query=query, key=key, value=value, bias=None, mask=None, scale=static.scale,
      is_causal=static.is_causal, query_seq_lengths=extras.get("query_seq_lengths"),
      key_value_seq_lengths=extras.get("key_value_seq_lengths"),
      local_window_size=static.window, q_segment_ids=q_segment_ids,
      kv_segment_ids=kv_segment_ids)
  cfg, (q, k, v, _), masks = blockwise.blocked_layout(inputs, static.block_sizes)
  pad_to = lambda x, length: jnp.pad(x, (0, length - x.shape[0]))
  masks = dataclasses.replace(
      masks,
      q_positions=pad_to(_positions(device, query.shape[1], n, static.layout), cfg.q_len),
      kv_positions=pad_to(_positions(device, key.shape[1], n, static.layout), cfg.kv_len))
  out, lse = _ring(cfg, axis, n, (q, k, v), masks)
  out, lse = blockwise.from_blocked_layout(out, lse, inputs)
  if static.layout == "zigzag":
    out, lse = _from_zigzag(out, axis, n), _from_zigzag(lse, axis, n)
  return out, lse


def _positions(device, local_len: int, n: int, layout: str) -> Array:
  """The positions in the whole sequence of a device's `local_len` tokens."""
  if layout == "contiguous":
    return device * local_len + jnp.arange(local_len, dtype=jnp.int32)
  chunk = local_len // 2  # chunks `device` and 2n - 1 - device
  offsets = jnp.arange(chunk, dtype=jnp.int32)
  return jnp.concatenate([device * chunk + offsets, (2 * n - 1 - device) * chunk + offsets])


def _zigzag_owner(chunk: int, n: int) -> int:
  """The device that holds chunk `chunk` of 2n in the zig-zag layout."""
  return chunk if chunk < n else 2 * n - 1 - chunk


def _to_zigzag(x: Array, axis: str, n: int) -> Array:
  """Device d's contiguous chunks 2d, 2d + 1 -> its zig-zag chunks d, 2n - 1 - d (axis 1).

  Each device sends its even-numbered chunk with one `ppermute` and its odd one
  with another; both are permutations of the devices. Device d then holds
  chunk d and chunk 2n - 1 - d, one of them even: which arrived first depends
  on d's parity.
  """
  half = x.shape[1] // 2
  even = jax.lax.ppermute(x[:, :half], axis, [(i, _zigzag_owner(2 * i, n)) for i in range(n)])
  odd = jax.lax.ppermute(x[:, half:], axis, [(i, _zigzag_owner(2 * i + 1, n)) for i in range(n)])
  device_is_even = jax.lax.axis_index(axis) % 2 == 0
  first = jnp.where(device_is_even, even, odd)
  second = jnp.where(device_is_even, odd, even)
  return jnp.concatenate([first, second], axis=1)


def _from_zigzag(x: Array, axis: str, n: int) -> Array:
  """The inverse of `_to_zigzag`."""
  half = x.shape[1] // 2
  device_is_even = jax.lax.axis_index(axis) % 2 == 0
  even = jnp.where(device_is_even, x[:, :half], x[:, half:])
  odd = jnp.where(device_is_even, x[:, half:], x[:, :half])
  even = jax.lax.ppermute(even, axis, [(_zigzag_owner(2 * i, n), i) for i in range(n)])
  odd = jax.lax.ppermute(odd, axis, [(_zigzag_owner(2 * i + 1, n), i) for i in range(n)])
  return jnp.concatenate([even, odd], axis=1)


def _with_chunk(masks, kv_segment_ids, kv_positions):
  return dataclasses.replace(masks, kv_segment_ids=kv_segment_ids, kv_positions=kv_positions)


def _merge(out, lse, chunk_out, chunk_lse):
  """Two partial softmax results over disjoint keys -> the result over both.

  An empty side has lse `EMPTY_ROW_LSE` (finite, hugely negative): its weight
  is 0, and two empty sides stay empty with output 0.
  """
  new_lse = jnp.logaddexp(lse, chunk_lse)
  weight = jnp.exp(lse - new_lse)[..., None]
  chunk_weight = jnp.exp(chunk_lse - new_lse)[..., None]
  return weight * out + chunk_weight * chunk_out.astype(jnp.float32), new_lse


def _ring_forward(cfg, axis: str, n: int, operands, masks):
  q, k, v = operands
  to_next = [(i, (i + 1) % n) for i in range(n)]

  def attend(chunk, result):
    k_chunk, v_chunk, kv_segment_ids, kv_positions = chunk
    chunk_out, chunk_lse = blockwise.forward(
        cfg, q, k_chunk, v_chunk, None, _with_chunk(masks, kv_segment_ids, kv_positions))
    return _merge(*result, chunk_out, chunk_lse)

  def step(carry, _):
    chunk, result = carry
    result = attend(chunk, result)
    return (jax.lax.ppermute(chunk, axis, to_next), result), None

  chunk = (k, v, masks.kv_segment_ids, masks.kv_positions)
  result = (jnp.zeros(q.shape[:-1] + (v.shape[-1],), jnp.float32),
            jnp.full(q.shape[:-1], common.EMPTY_ROW_LSE, jnp.float32))
  # n - 1 steps that pass the chunk on, and a last one that keeps it.
  (chunk, result), _ = jax.lax.scan(step, (chunk, result), None, length=n - 1)
  out, lse = attend(chunk, result)
  return out.astype(q.dtype), lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _ring(cfg, axis: str, n: int, operands, masks):
  """`(out, lse)` of q against every device's k, v: `[B, Hkv, G, Tq', Dv]`, `[B, Hkv, G, Tq']`."""
  return _ring_forward(cfg, axis, n, operands, masks)


def _ring_fwd(cfg, axis, n, operands, masks):
  out, lse = _ring_forward(cfg, axis, n, operands, masks)
  return (out, lse), (operands, masks, out, lse)


def _ring_bwd(cfg, axis, n, residuals, cotangents):
  (q, k, v), masks, out, lse = residuals
  d_out, d_lse = cotangents
  # As common.flash_attention_vjp: the lse cotangent enters through delta.
  delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1) - d_lse
  to_next = [(i, (i + 1) % n) for i in range(n)]

  def step(carry, _):
    chunk, dq = carry
    k_chunk, v_chunk, kv_segment_ids, kv_positions, dk, dv = chunk
    dq_chunk, dk_chunk, dv_chunk, _ = blockwise.backward(
        cfg, q, k_chunk, v_chunk, None, _with_chunk(masks, kv_segment_ids, kv_positions),
        lse, d_out, delta)
    chunk = (k_chunk, v_chunk, kv_segment_ids, kv_positions,
             dk + dk_chunk.astype(jnp.float32), dv + dv_chunk.astype(jnp.float32))
    # n passes bring every chunk, with its gradients, back to its own device.
    return (jax.lax.ppermute(chunk, axis, to_next), dq + dq_chunk.astype(jnp.float32)), None

  chunk = (k, v, masks.kv_segment_ids, masks.kv_positions,
           jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
  (chunk, dq), _ = jax.lax.scan(step, (chunk, jnp.zeros(q.shape, jnp.float32)), None, length=n)
  dk, dv = chunk[4], chunk[5]
  return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)), None


_ring.defvjp(_ring_fwd, _ring_bwd)


def visited_blocks(seq_len: int, ring_size: int, layout: str, block: int,
                   is_causal: bool = True) -> np.ndarray:
  """Per device, the (query block, key block) pairs its ring steps compute: `[n]` ints.

  The count the loops' skip rule (`blockwise._block_in_reach`) gives for
  self-attention of `seq_len` tokens in blocks of `block` (a divisor of each
  chunk), summed over the n steps: what balances (or not) the causal work.
  """
  check_ring_inputs(seq_len, seq_len, ring_size, layout)
  local_len = seq_len // ring_size
  starts = np.arange(0, local_len, block)
  positions = [np.asarray(_positions(device, local_len, ring_size, layout))
               for device in range(ring_size)]
  counts = np.zeros(ring_size, np.int64)
  for device in range(ring_size):
    q_max = np.array([positions[device][s:s + block].max() for s in starts])
    for kv_device in range(ring_size):
      k_min = np.array([positions[kv_device][s:s + block].min() for s in starts])
      visible = (k_min[None, :] <= q_max[:, None]) if is_causal else np.ones((len(starts),) * 2)
      counts[device] += int(visible.sum())
  return counts
