"""Block masks: which tiles of the score grid a mask_mod leaves empty, partial or full.

`create_block_mask(mask_mod, B, H, Tq, Tk, block_sizes)` evaluates the mask
once, tile by tile, and keeps one int8 per (batch, head, query block, key
block): `patterns.SKIP` (no pair may attend: the kernels never visit it),
`PARTIAL` (the kernels evaluate the mask inside it) or `FULL` (every pair
may: no mask to evaluate). The mask_mod travels with it, so
`flex_attention(q, k, v, block_mask=mask)` needs nothing else.

A static mask_mod (`patterns.is_static`) gets its layout from NumPy at trace
time, a constant. Any other is evaluated with JAX, a query block at a time
and over at most `_TILE_ELEMENTS` pairs at once, so that no `Tq x Tk` array
exists at any length, and works under `jit` on traced arrays (document ids
of the batch, say). A `BlockMask` is a pytree: pass it between calls, in and
out of `jit`.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple, Union

import jax
import jax.numpy as jnp

from attention_jax.core import mods, patterns

Array = jax.Array

# The most (batch, head, query, key) pairs evaluated at once: 4M bools.
_TILE_ELEMENTS = 1 << 22


@dataclasses.dataclass(frozen=True)
class BlockMask:
  """A mask_mod and its block layout.

  Attributes:
    layout: `[B|1, H|1, nq, nk]` int8, `patterns.SKIP`, `PARTIAL` or `FULL` per
      (batch, head, query block of `block_q`, key block of `block_k`).
    lifted_mask_mod, mask_consts: the mask_mod it was made from (`mask_mod`).
    q_len, kv_len: the lengths it was made for.
    block_q, block_k: its blocks.
  """

  layout: Array
  # A static pattern as it is, or any other mask_mod lifted (`mods.lift`) with
  # the arrays it closes over as leaves: so that a mask made under `jit` from
  # the batch's document ids can leave it.
  lifted_mask_mod: Union[patterns.Pattern, mods.LiftedMod] = dataclasses.field(
      metadata=dict(static=True))
  mask_consts: Tuple[Array, ...]
  q_len: int = dataclasses.field(metadata=dict(static=True))
  kv_len: int = dataclasses.field(metadata=dict(static=True))
  block_q: int = dataclasses.field(metadata=dict(static=True))
  block_k: int = dataclasses.field(metadata=dict(static=True))

  @property
  def mask_mod(self) -> patterns.MaskMod:
    """The mask_mod it was made from, callable as `mask_mod(batch, head, q_idx, kv_idx)`."""
    if isinstance(self.lifted_mask_mod, mods.LiftedMod):
      return mods.BoundMod(self.lifted_mask_mod, self.mask_consts)
    return self.lifted_mask_mod

  @property
  def shape(self) -> Tuple[int, int, int, int]:
    return tuple(self.layout.shape)

  def visited_blocks(self) -> Array:
    """`[B|1, H|1]` int32: the blocks each (batch, head) visits."""
    return jnp.sum(self.layout != patterns.SKIP, axis=(-2, -1), dtype=jnp.int32)

  def density(self) -> Array:
    """The fraction of blocks visited, over every (batch, head)."""
    return jnp.mean(self.layout != patterns.SKIP)

  def check(self, q_len: int, kv_len: int, batch: int, num_heads: int,
            block_sizes: Optional[Tuple[int, int]] = None) -> None:
    """A ValueError unless the mask was made for these lengths, batch, heads and
    (when given) blocks."""
    made_for = (self.q_len, self.kv_len)
    if made_for != (q_len, kv_len):
      raise ValueError(f"block_mask was made for (Tq, Tk) = {made_for}, but the query and key "
                       f"have lengths ({q_len}, {kv_len}); make it with create_block_mask "
                       "for these lengths.")
    if block_sizes is not None and (self.block_q, self.block_k) != tuple(block_sizes):
      raise ValueError(f"block_mask has blocks (block_q, block_k) = ({self.block_q}, "
                       f"{self.block_k}), but the kernel was asked for {tuple(block_sizes)}; "
                       "make the mask with the kernel's block sizes, or pass none.")
    mask_batch, mask_heads = self.layout.shape[:2]
    if mask_batch not in (1, batch) or mask_heads not in (1, num_heads):
      raise ValueError(f"block_mask is for (B, H) = ({mask_batch}, {mask_heads}) (1: any), "
                       f"but the query has B={batch}, H={num_heads}.")


jax.tree_util.register_dataclass(BlockMask)


def create_block_mask(mask_mod: patterns.MaskMod, batch: Optional[int], num_heads: Optional[int],
                      q_len: int, kv_len: int,
                      block_sizes: Union[None, int, Tuple[int, int]] = None) -> BlockMask:
  """The block layout of `mask_mod` over a `Tq x Tk` grid.

  Args:
    mask_mod: `(batch, head, q_idx, kv_idx) -> bool`, a static pattern or any
      JAX function (which may close over arrays).
    batch, num_heads: B and H, or None where the mask is the same for every
      batch row (head): the layout then has size 1 there and the mod is
      evaluated at index 0.
    q_len, kv_len: Tq and Tk.
    block_sizes: `(block_q, block_k)`, an int for both, or None for 128.

  Blocks that run past Tq or Tk count their padding as allowed, so that
  padding alone never makes a block PARTIAL.
  """
  block_q, block_k = _block_pair(block_sizes)
  for name, value in (("batch", batch), ("num_heads", num_heads)):
    if value is not None and (not isinstance(value, int) or value <= 0):
      raise ValueError(f"create_block_mask: {name} must be a positive int or None, got {value!r}.")
  for name, value in (("q_len", q_len), ("kv_len", kv_len)):
    if not isinstance(value, int) or value <= 0:
      raise ValueError(f"create_block_mask: {name} must be a positive int, got {value!r}.")
  heads = num_heads or 1
  if patterns.is_static(mask_mod) and batch is None:
    layout = patterns.block_layout(mask_mod, q_len, kv_len, block_q, block_k,
                                   num_heads=heads if patterns.num_heads_of(mask_mod) > 1 else 1)
    layout = jnp.asarray(layout[None])
    if num_heads is not None and layout.shape[1] == 1:
      layout = jnp.broadcast_to(layout, (1, num_heads) + layout.shape[2:])
    return BlockMask(layout, mask_mod, (), q_len, kv_len, block_q, block_k)
  lifted, consts = mods.lift(mask_mod, "mask_mod")  # checks what it returns, with a clear error
  for name, value, axis in (("batch", batch, 0), ("num_heads", num_heads, 1)):
    if value is None and lifted.uses(axis):
      raise ValueError(f"create_block_mask: mask_mod depends on its {_ARGS[axis]} index, but "
                       f"{name}=None says it is the same for every one; pass {name}.")
  layout = _traced_layout(mask_mod, batch or 1, heads, q_len, kv_len, block_q, block_k)
  return BlockMask(layout, lifted, consts, q_len, kv_len, block_q, block_k)


def block_mask_from_blocks(mask_mod: patterns.MaskMod, visited: Array, q_len: int, kv_len: int,
                           block_sizes: Union[int, Tuple[int, int]],
                           full: Optional[Array] = None) -> BlockMask:
  """A block mask whose layout the caller already knows at the block level:
  a mechanism that picks key blocks per query block (MoBA's and NSA's top-k
  blocks) knows which tiles it visits without evaluating its mask pair by pair.

  Args:
    mask_mod: the pair-level mask, evaluated inside the visited tiles.
    visited: `[B|1, H|1, nq, nk]` bool; must cover every pair mask_mod allows.
    q_len, kv_len, block_sizes: as `create_block_mask`.
    full: `[B|1, H|1, nq, nk]` bool, tiles where mask_mod allows every pair (no
      mask evaluated there); None: every visited tile is partial.
  """
  block_q, block_k = _block_pair(block_sizes)
  expected = (-(-q_len // block_q), -(-kv_len // block_k))
  if visited.ndim != 4 or tuple(visited.shape[2:]) != expected:
    raise ValueError(f"visited must be [B|1, H|1, nq, nk] with (nq, nk) = {expected} for "
                     f"lengths ({q_len}, {kv_len}) and blocks ({block_q}, {block_k}), got shape "
                     f"{list(visited.shape)}.")
  layout = jnp.where(visited, patterns.PARTIAL, patterns.SKIP)
  if full is not None:
    layout = jnp.where(visited & full, patterns.FULL, layout)
  lifted, consts = mods.lift(mask_mod, "mask_mod")
  return BlockMask(layout.astype(jnp.int8), lifted, consts, q_len, kv_len, block_q, block_k)


_ARGS = ("batch", "head")


def _block_pair(block_sizes) -> Tuple[int, int]:
  if block_sizes is None:
    return 128, 128
  if isinstance(block_sizes, int):
    block_sizes = (block_sizes, block_sizes)
  if hasattr(block_sizes, "block_q"):  # a kernels BlockSizes
    block_sizes = (block_sizes.block_q, block_sizes.block_k)
  pair = tuple(block_sizes)
  if len(pair) != 2 or not all(isinstance(b, int) and b > 0 for b in pair):
    raise ValueError("create_block_mask: block_sizes must be (block_q, block_k) of positive "
                     f"ints, an int or None, got {block_sizes!r}.")
  return pair


def _traced_layout(mask_mod, batch, heads, q_len, kv_len, block_q, block_k) -> Array:
  """`[B, H, nq, nk]` int8, evaluated with JAX a query block and a key chunk at a time."""
  num_q_blocks, num_kv_blocks = -(-q_len // block_q), -(-kv_len // block_k)
  # Key blocks per step: as many as fit _TILE_ELEMENTS with this query block.
  per_step = max(1, min(num_kv_blocks, _TILE_ELEMENTS // (batch * heads * block_q * block_k)))
  num_steps = -(-num_kv_blocks // per_step)
  b = jnp.arange(batch, dtype=jnp.int32)[:, None, None, None]
  h = jnp.arange(heads, dtype=jnp.int32)[None, :, None, None]

  def chunk_entries(q_block, step):
    q_idx = q_block * block_q + jnp.arange(block_q, dtype=jnp.int32)
    kv_idx = step * per_step * block_k + jnp.arange(per_step * block_k, dtype=jnp.int32)
    allowed = mods.evaluate_mask(mask_mod, b, h, q_idx[None, None, :, None],
                                 kv_idx[None, None, None, :])
    real = (q_idx[:, None] < q_len) & (kv_idx[None, :] < kv_len)
    tiles = (batch, heads, block_q, per_step, block_k)
    allowed = allowed.reshape(tiles)
    real = jnp.broadcast_to(real.reshape(tiles[2:]), tiles)
    some = jnp.any(allowed & real, axis=(2, 4))
    every = jnp.all(allowed | ~real, axis=(2, 4))
    return jnp.where(some & every, patterns.FULL,
                     jnp.where(some, patterns.PARTIAL, patterns.SKIP)).astype(jnp.int8)

  def row(q_block):
    entries = jax.lax.map(lambda step: chunk_entries(q_block, step), jnp.arange(num_steps))
    # [steps, B, H, per_step] -> [B, H, steps * per_step]
    return jnp.moveaxis(entries, 0, 2).reshape(batch, heads, -1)[..., :num_kv_blocks]

  layout = jax.lax.map(row, jnp.arange(num_q_blocks))  # [nq, B, H, nk]
  return jnp.moveaxis(layout, 0, 2)
