"""Mask mods: which query-key pairs may attend, as predicates over indices.

A mask mod is `mask_mod(batch, head, q_idx, kv_idx) -> bool` (the signature
of PyTorch's FlexAttention), called with broadcasting integer arrays; True
means "may attend". One definition serves every implementation: the sparse
variants' pure-JAX forms, `attention_jax.flex_attention`, the block-sparse
kernels (which evaluate it on one block's indices) and the dense reference
(which evaluates it on the whole grid, for tests only).

There is one algebra. The pieces here (`Band`, `SameBlock`, `Causal`, ...)
are *static* mask mods: frozen dataclasses of Python ints, hashable, static
under `jax.jit`, evaluable with NumPy at trace time, so their block layouts
are constants. Any other function of the same signature is a mask mod too,
and may close over arrays (document ids, prefix lengths); `and_masks`,
`or_masks`, `&` and `|` combine both kinds, and a combination is static when
all its parts are (`is_static`). Patterns that differ by head (Longformer's
dilated heads, the Sparse Transformer's "per_head") are `PerHead`.

`block_layout` is what the kernels need from a pattern: for each (query
block, key block) whether no pair, some pairs or every pair may attend.

A pattern knows nothing of causality, padding or segments: the kernels apply
those from the call, as they do without a pattern.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Tuple

import numpy as np

# Block layout entries.
SKIP, PARTIAL, FULL = 0, 1, 2


MaskMod = Callable[..., Any]  # (batch, head, q_idx, kv_idx) -> bool


class Pattern:
  """Base of the static mask mods: `pattern(batch, head, q_idx, kv_idx) -> bool`."""

  num_heads = 1  # 1: the same for every head

  def __call__(self, batch, head, q_pos, k_pos):
    raise NotImplementedError

  def __or__(self, other: MaskMod) -> "Pattern":
    return AnyOf((self, other))

  def __ror__(self, other: MaskMod) -> "Pattern":
    return AnyOf((other, self))

  def __and__(self, other: MaskMod) -> "Pattern":
    return AllOf((self, other))

  def __rand__(self, other: MaskMod) -> "Pattern":
    return AllOf((other, self))


def and_masks(*mask_mods: MaskMod) -> MaskMod:
  """The pairs that every one of `mask_mods` allows."""
  _check_mask_mods("and_masks", mask_mods)
  return mask_mods[0] if len(mask_mods) == 1 else AllOf(tuple(mask_mods))


def or_masks(*mask_mods: MaskMod) -> MaskMod:
  """The pairs that some one of `mask_mods` allows."""
  _check_mask_mods("or_masks", mask_mods)
  return mask_mods[0] if len(mask_mods) == 1 else AnyOf(tuple(mask_mods))


def _check_mask_mods(name, mask_mods):
  if not mask_mods:
    raise ValueError(f"{name} needs at least one mask_mod, got none.")
  for mod in mask_mods:
    if not callable(mod):
      raise ValueError(f"{name} takes mask mods, callables (batch, head, q_idx, kv_idx) -> "
                       f"bool; got {mod!r}.")


def is_static(mask_mod: MaskMod) -> bool:
  """Whether `mask_mod` is made of static pieces only (its layout is a constant)."""
  if isinstance(mask_mod, (AnyOf, AllOf)):
    return all(is_static(part) for part in mask_mod.parts)
  if isinstance(mask_mod, PerHead):
    return all(is_static(part) for _, part in mask_mod.groups)
  return isinstance(mask_mod, Pattern)


def num_heads_of(mask_mod: MaskMod) -> int:
  """The heads a mask mod is defined for: 1 when it is the same for every head."""
  return getattr(mask_mod, "num_heads", 1)


@dataclasses.dataclass(frozen=True)
class Causal(Pattern):
  """Keys at or before the query (top-left aligned, as `is_causal`)."""

  def __call__(self, batch, head, q_pos, k_pos):
    return k_pos <= q_pos


@dataclasses.dataclass(frozen=True)
class Band(Pattern):
  """Keys k = q + d m for -left <= m <= right (d = `dilation`): a sliding window."""

  left: int
  right: int
  dilation: int = 1

  def __call__(self, batch, head, q_pos, k_pos):
    offset = k_pos - q_pos
    inside = (offset >= -self.left * self.dilation) & (offset <= self.right * self.dilation)
    return inside if self.dilation == 1 else inside & (offset % self.dilation == 0)


@dataclasses.dataclass(frozen=True)
class SameBlock(Pattern):
  """Query and key in the same block of `size` positions, blocks counted from `start`
  (positions before `start` are in no block)."""

  size: int
  start: int = 0

  def __call__(self, batch, head, q_pos, k_pos):
    return ((q_pos >= self.start) & (k_pos >= self.start)
            & ((q_pos - self.start) // self.size == (k_pos - self.start) // self.size))


@dataclasses.dataclass(frozen=True)
class SameResidue(Pattern):
  """(q - k) mod `stride` == 0: the Sparse Transformer's strided pattern."""

  stride: int

  def __call__(self, batch, head, q_pos, k_pos):
    return (q_pos - k_pos) % self.stride == 0


@dataclasses.dataclass(frozen=True)
class Columns(Pattern):
  """Keys whose position from `start` has a residue modulo `period` in
  `residues`: the fixed pattern's summary columns, seen by every query."""

  period: int
  residues: Tuple[int, ...]
  start: int = 0

  def __call__(self, batch, head, q_pos, k_pos):
    residue = (k_pos - self.start) % self.period
    in_pattern = (k_pos >= self.start) & (q_pos >= self.start)
    return in_pattern & _any([residue == r for r in self.residues])


@dataclasses.dataclass(frozen=True)
class Global(Pattern):
  """Positions in [start, stop) attend to every key and every query attends to them."""

  start: int
  stop: int

  def __call__(self, batch, head, q_pos, k_pos):
    inside = lambda pos: (pos >= self.start) & (pos < self.stop)
    return inside(q_pos) | inside(k_pos)


@dataclasses.dataclass(frozen=True)
class NearBlocks(Pattern):
  """Query and key blocks (of `size` positions) at most `radius` blocks apart:
  BigBird's window of blocks."""

  size: int
  radius: int = 1

  def __call__(self, batch, head, q_pos, k_pos):
    distance = q_pos // self.size - k_pos // self.size
    return (distance <= self.radius) & (distance >= -self.radius)


@dataclasses.dataclass(frozen=True)
class AnyOf(Pattern):
  """Some part allows the pair (`or_masks`); parts are any mask mods."""

  parts: Tuple[MaskMod, ...]

  @property
  def num_heads(self):
    return max(num_heads_of(p) for p in self.parts)

  def __call__(self, batch, head, q_pos, k_pos):
    return _any([p(batch, head, q_pos, k_pos) for p in self.parts])


@dataclasses.dataclass(frozen=True)
class AllOf(Pattern):
  """Every part allows the pair (`and_masks`); parts are any mask mods."""

  parts: Tuple[MaskMod, ...]

  @property
  def num_heads(self):
    return max(num_heads_of(p) for p in self.parts)

  def __call__(self, batch, head, q_pos, k_pos):
    return functools.reduce(lambda a, b: a & b,
                            [p(batch, head, q_pos, k_pos) for p in self.parts])


@dataclasses.dataclass(frozen=True)
class PerHead(Pattern):
  """Consecutive groups of heads under different patterns: `groups` is
  `((count, pattern), ...)`, the counts summing to the number of heads."""

  groups: Tuple[Tuple[int, MaskMod], ...]

  @property
  def num_heads(self):
    return sum(count for count, _ in self.groups)

  def __call__(self, batch, head, q_pos, k_pos):
    starts = np.cumsum([0] + [count for count, _ in self.groups])
    # Operators only, so that NumPy and JAX arrays both work.
    return _any([(head >= start) & (head < start + count) & pattern(batch, head, q_pos, k_pos)
                 for start, (count, pattern) in zip(starts.tolist(), self.groups)])


def _any(predicates):
  return functools.reduce(lambda a, b: a | b, predicates)


def dense_mask(pattern: Pattern, q_len: int, kv_len: int, num_heads: int = 1) -> np.ndarray:
  """`[H|1, Tq, Tk]` bool: the pattern on the whole grid (tests and small inputs)."""
  heads = pattern.num_heads if pattern.num_heads > 1 else 1
  if pattern.num_heads > 1 and pattern.num_heads != num_heads:
    raise ValueError(f"the pattern is defined for {pattern.num_heads} heads, got "
                     f"num_heads={num_heads}.")
  head = np.arange(heads)[:, None, None]
  allowed = pattern(np.zeros((), np.int32), head, np.arange(q_len)[None, :, None],
                    np.arange(kv_len)[None, None, :])
  return np.broadcast_to(allowed, (heads, q_len, kv_len))


def block_layout(pattern: Pattern, q_len: int, kv_len: int, block_q: int, block_k: int, *,
                 is_causal: bool = False, num_heads: int = 1) -> np.ndarray:
  """`[H|1, nq, nk]` int8: `FULL` where every pair of the block may attend,
  `PARTIAL` where some may, `SKIP` where none may, for the pattern (and the
  causal mask with `is_causal`) over `q_len` x `kv_len` positions in blocks
  of `block_q` x `block_k` (the last ones may run past the ends: those
  positions count as allowed, so that padding alone never makes a block partial).

  Evaluated with NumPy on one query block at a time: O(Tq Tk) work at trace
  time and O(block_q Tk) memory, never the whole grid.
  """
  return _block_layout(pattern, q_len, kv_len, block_q, block_k, is_causal, num_heads).copy()


@functools.lru_cache(maxsize=64)
def _block_layout(pattern, q_len, kv_len, block_q, block_k, is_causal, num_heads):
  heads = pattern.num_heads if pattern.num_heads > 1 else 1
  if pattern.num_heads > 1 and pattern.num_heads != num_heads:
    raise ValueError(f"the pattern is defined for {pattern.num_heads} heads, got "
                     f"num_heads={num_heads}.")
  num_q_blocks, num_kv_blocks = -(-q_len // block_q), -(-kv_len // block_k)
  layout = np.zeros((heads, num_q_blocks, num_kv_blocks), np.int8)
  head = np.arange(heads)[:, None, None]
  k_pos = np.arange(num_kv_blocks * block_k)[None, None, :]
  for i in range(num_q_blocks):
    q_pos = np.arange(i * block_q, (i + 1) * block_q)[None, :, None]
    allowed = np.broadcast_to(pattern(np.zeros((), np.int32), head, q_pos, k_pos),
                              (heads, block_q, k_pos.shape[-1]))
    if is_causal:
      allowed = allowed & (k_pos <= q_pos)
    real = (q_pos < q_len) & (k_pos < kv_len)
    blocks = allowed.reshape(heads, block_q, num_kv_blocks, block_k)
    real_blocks = np.broadcast_to(real, allowed.shape).reshape(blocks.shape)
    some = np.any(blocks & real_blocks, axis=(1, 3))
    every = np.all(blocks | ~real_blocks, axis=(1, 3))
    layout[:, i] = np.where(every & some, FULL, np.where(some, PARTIAL, SKIP))
  layout.setflags(write=False)
  return layout
