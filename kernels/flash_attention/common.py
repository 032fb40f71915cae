"""What every blockwise-softmax implementation shares: block sizes, the range of
blocks a block can see, the mask of one block, and the custom VJP around the
forward and backward passes.

Positions are absolute token indices. A structured mask (causal, window) is
summarised by its *reach*: query q may see keys k with q - left <= k <= q + right,
where `None` means unbounded. Blocks outside the reach are never visited.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Optional, Tuple, Union

import jax
import jax.numpy as jnp

from attention_jax.core import masks
from attention_jax.core.softmax import MASKED_LOGSUMEXP

Array = jnp.ndarray
Reach = masks.Reach
reach_of = masks.reach_of


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Query and key block lengths of the forward and backward passes.

  `block_q`/`block_k` tile the forward and the dq pass; `block_q_dkv`/`block_k_dkv`
  tile the pass that accumulates dk and dv (None: same as the forward).
  """

  block_q: int
  block_k: int
  block_q_dkv: Optional[int] = None
  block_k_dkv: Optional[int] = None

  def __post_init__(self):
    for field in dataclasses.fields(self):
      value = getattr(self, field.name)
      if value is not None and (not isinstance(value, int) or value <= 0):
        raise ValueError(f"BlockSizes.{field.name} must be a positive int, got {value!r}.")

  @property
  def dkv(self) -> Tuple[int, int]:
    return (self.block_q_dkv or self.block_q, self.block_k_dkv or self.block_k)


def _maximum(a, b):
  # Python ints stay Python ints: a grid's size is computed from them while
  # tracing (outside any device context, e.g. under an abstract mesh).
  return max(a, b) if isinstance(a, int) and isinstance(b, int) else jnp.maximum(a, b)


def _minimum(a, b):
  return min(a, b) if isinstance(a, int) and isinstance(b, int) else jnp.minimum(a, b)


def kv_block_range(q_block: Array, block_q: int, block_k: int, num_kv_blocks: int,
                   reach: Reach) -> Tuple[Array, Array]:
  """[lo, hi) of the key blocks that queries of block `q_block` can see.

  Python ints in, Python ints out; a traced `q_block` gives traced bounds.
  """
  left, right = reach
  first_q = q_block * block_q
  last_q = first_q + block_q - 1
  lo = 0 if left is None else _maximum(0, (first_q - left) // block_k)
  hi = num_kv_blocks if right is None else _minimum(num_kv_blocks,
                                                    (last_q + right) // block_k + 1)
  return lo, _maximum(hi, lo)


def q_block_range(kv_block: Array, block_q: int, block_k: int, num_q_blocks: int,
                  reach: Reach) -> Tuple[Array, Array]:
  """[lo, hi) of the query blocks that can see keys of block `kv_block`."""
  left, right = reach
  # q sees k when k - right <= q <= k + left: the key-block range, mirrored.
  return kv_block_range(kv_block, block_k, block_q, num_q_blocks, (right, left))


def block_mask(q_pos: Array, k_pos: Array, *, kv_len: Optional[int], reach: Reach,
               k_index: Optional[Array] = None,
               q_lengths: Optional[Array] = None, kv_lengths: Optional[Array] = None,
               q_segment_ids: Optional[Array] = None,
               kv_segment_ids: Optional[Array] = None) -> Optional[Array]:
  """The allowed pairs of one block from the structured masks: `[B|1, bq|1, bk]`,
  or None when every pair is allowed.

  Args:
    q_pos: `[bq]` absolute query positions; k_pos: `[bk]` absolute key positions.
    kv_len: the real Tk, where keys past it are block padding; None: no padding.
    reach: from `reach_of`.
    k_index: `[bk]` the keys' indices in the arrays where positions are not
      indices (ring attention's chunks); None: the positions.
    q_lengths, kv_lengths: `[B]` valid lengths.
    q_segment_ids: `[B, bq]`; kv_segment_ids: `[B, bk]` (this block's slices).
  """
  in_bounds = None if kv_len is None else (k_pos if k_index is None else k_index) < kv_len
  allowed = masks.and_masks(
      None if in_bounds is None else in_bounds[None, None, :],
      masks.reach_predicate(q_pos[None, :, None], k_pos[None, None, :], reach),
      None if q_lengths is None else masks.length_predicate(q_pos[None, :, None],
                                                            q_lengths[:, None, None]),
      None if kv_lengths is None else masks.length_predicate(k_pos[None, None, :],
                                                             kv_lengths[:, None, None]),
      None if q_segment_ids is None else masks.segment_predicate(q_segment_ids[:, :, None],
                                                                 kv_segment_ids[:, None, :]))
  return allowed


# The log-sum-exp the forward passes save for a row with nothing to attend:
# finite (jax.debug_infs), and harmless in the backward passes, where such a
# row's logits are all -inf (or masked out), so that its probabilities
# exp(logits - lse) are 0 whatever finite lse they meet.
EMPTY_ROW_LSE = MASKED_LOGSUMEXP


def attention_outputs(out: Array, lse: Array, query_seq_lengths: Optional[Array],
                      return_residual: bool) -> Union[Array, Tuple[Array, Array]]:
  """What a kernel's entry point returns: `out`, or `(out, lse)` with `return_residual`.

  Queries past `query_seq_lengths` attend nothing: output zeros and lse
  `EMPTY_ROW_LSE`. The kernels apply the lengths here rather than inside: such
  queries' cotangents (of out and lse), hence all the gradients they would
  contribute, vanish, as in the reference.

  Args:
    out: `[B, Tq, H, Dv]`; lse: `[B, Tq, H]` float32 (padding sliced off).
    query_seq_lengths: `[B]` or None.
    return_residual: whether the caller asked for lse.
  """
  if query_seq_lengths is not None:
    valid = masks.length_predicate(jnp.arange(out.shape[1])[None, :],
                                   query_seq_lengths[:, None])[:, :, None]  # [B, Tq, 1]
    out = jnp.where(valid[..., None], out, jnp.zeros((), out.dtype))
    lse = jnp.where(valid, lse, EMPTY_ROW_LSE)
  return (out, lse) if return_residual else out


def flash_attention_vjp(forward: Callable, backward: Callable) -> Callable:
  """`attention(cfg, operands, masks) -> (out, lse)` with a custom VJP built from
  a lowering's forward and backward passes.

  Every lowering differentiates the same way: the forward saves `out` and the
  log-sum-exp, the backward recomputes the probabilities from them. What
  differs is only how each pass runs, which the lowering supplies:

    forward(cfg, *operands, masks) -> (out, lse): `out` `[..., Dv]`, lse float32
      with shape `out.shape[:-1]` (one value per output row; `EMPTY_ROW_LSE` for
      a row with nothing to attend).
    backward(cfg, *operands, masks, lse, d_out, delta) -> the gradients of
      `operands` (a tuple as long, None for a None operand), with
      delta `out.shape[:-1]` float32 as below.

  `cfg` is static (hashable); `operands` (q, k, v and a bias or None, say) are
  differentiated; `masks` (a pytree of lengths, ids, boolean masks) is not.

  lse is an output, and differentiable: d lse / d logits = p, so its cotangent
  adds `p * d_lse` to the logits' gradient `ds = p * (dp - delta)`, where
  `delta = rowsum(d_out * out)`; the backward passes take `delta - d_lse` in
  place of delta and need nothing else.
  """

  @functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
  def attention(cfg, operands, masks):
    return forward(cfg, *operands, masks)

  def attention_fwd(cfg, operands, masks):
    out, lse = forward(cfg, *operands, masks)
    return (out, lse), (operands, masks, out, lse)

  def attention_bwd(cfg, residuals, cotangents):
    operands, masks, out, lse = residuals
    d_out, d_lse = cotangents
    delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1) - d_lse
    return tuple(backward(cfg, *operands, masks, lse, d_out, delta)), None

  attention.defvjp(attention_fwd, attention_bwd)
  return attention


@dataclasses.dataclass
class FlexArrays:
  """The differentiated inputs of flex attention beside q, k, v and the bias,
  one pytree for every lowering's custom VJP.

  sinks: per-head sink logits (a key with no value that every query sees), or
    None; `[Hkv, G]` in the blockwise layout, `[H]` in the Pallas kernels.
  score_consts: the floating arrays the score_mod closes over (`mods.lift`).
  """

  sinks: Optional[Array] = None
  score_consts: Tuple[Array, ...] = ()


jax.tree_util.register_dataclass(FlexArrays, data_fields=["sinks", "score_consts"],
                                 meta_fields=[])


def einsum_float32(subscripts: str, a: Array, b: Array) -> Array:
  """`jnp.einsum(subscripts, a, b)` accumulated in float32 and returned as float32.

  On GPU and TPU narrow operands (bfloat16, float16) go to the matrix units as
  they are: bf16 x bf16 -> f32 is their fast path. On CPU they are upcast to
  float32 first. XLA's CPU backend runs such a mixed product only where it
  hands it to its bfloat16 library kernels (YNNPACK), in the layouts those
  take; a product its simplifier has rewritten falls back to the generic dot,
  which has no bf16 x bf16 -> f32 and fails ("Unsupported element type for
  DotThunk::Execute"). The blockwise backward meets this when its key loop runs
  once: the transpose of the dk/dv accumulators is folded into their dot. The
  upcast changes no value: every bfloat16 or float16 is exactly a float32, and
  the product is accumulated in float32 either way.
  """
  product = lambda x, y: jnp.einsum(subscripts, x, y, preferred_element_type=jnp.float32)
  if all(jnp.dtype(x.dtype).itemsize >= 4 for x in (a, b)):
    return product(a, b)
  upcast = lambda x, y: product(x.astype(jnp.float32), y.astype(jnp.float32))
  # Resolved when lowering, for the platform compiled for: no branch at run time.
  return jax.lax.platform_dependent(a, b, cpu=upcast, default=product)


def sum_to_shape(x: Array, shape: Tuple[int, ...]) -> Array:
  """Sums `x` over the axes where an array of `shape` broadcasts (size 1), keeping them."""
  axes = tuple(a for a, (n, m) in enumerate(zip(x.shape, shape)) if m == 1 and n != 1)
  return jnp.sum(x, axis=axes, keepdims=True) if axes else x


def pad_axis(x: Array, axis: int, multiple: int, value=0, *, broadcast: bool = False) -> Array:
  """Pads `axis` of `x` up to a multiple of `multiple`. With `broadcast` (a
  bias or mask laid out `[.., Tq|1, Tk|1]`) an axis of size 1 stays as it is;
  otherwise it is a sequence of one token (a query decoded alone) and is padded."""
  size = x.shape[axis]
  if (broadcast and size == 1) or size % multiple == 0:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, multiple - size % multiple)
  return jnp.pad(x, widths, constant_values=value)


def slice_axis(x: Array, axis: int, start: Array, size: int) -> Array:
  """`x[..., start:start+size, ...]` along `axis`, unless that axis is broadcast (size 1)."""
  if x.shape[axis] == 1:
    return x
  return jax.lax.dynamic_slice_in_dim(x, start, size, axis)


def cdiv(a: int, b: int) -> int:
  return -(-a // b)
