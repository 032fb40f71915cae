"""Score and mask mods: user functions that change attention, lifted for the kernels.

  score_mod(score, batch, head, q_idx, kv_idx) -> score
  mask_mod(batch, head, q_idx, kv_idx) -> bool

(the signatures of PyTorch's FlexAttention). Both are plain JAX, written as
for one element and called with broadcasting arrays: `score` float32 and the
indices int32, each broadcastable to `[B, H, Tq, Tk]` (a kernel passes one
block's indices, the dense reference the whole grid). They may close over
arrays: a bias table, learned slopes, document ids.

A kernel cannot take a Python closure through `jax.custom_vjp` and
differentiate what it closes over, so `lift` traces a mod once, at scalar
arguments, into a jaxpr, and lifts the arrays it closes over out as explicit
operands: the floating ones are differentiated (the kernels return their
gradients), the others (ids, lengths) ride along with the masks. `apply`
evaluates the jaxpr on a block, vectorised over the broadcast axes, which
costs what the broadcasting function would.

The named mods at the end are the common ones; each is a plain function of
the signature above (or a static `patterns` piece), usable anywhere a mod is.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
from jax.extend import core as jax_core

from attention_jax.core import patterns

Array = jax.Array
ScoreMod = Callable[..., Any]  # (score, batch, head, q_idx, kv_idx) -> score
MaskMod = patterns.MaskMod  # (batch, head, q_idx, kv_idx) -> bool


@dataclasses.dataclass(frozen=True)
class LiftedMod:
  """A mod traced at scalar arguments, with the arrays it closes over lifted out.

  Static in the kernels' configuration and in a `BlockMask`: two liftings are
  equal when their programs print the same (the same function over other
  arrays of the same shapes), so that `jit` does not retrace for new arrays.

  Attributes:
    jaxpr: the mod's program; its constants are the lifted arrays.
    differentiable: per constant, whether it is floating (differentiated).
    name: `"score_mod"` or `"mask_mod"`, for messages.
    program: the jaxpr as text: what equality and the hash compare.
  """

  jaxpr: Any = dataclasses.field(compare=False)
  differentiable: Tuple[bool, ...]
  name: str
  program: str

  def uses(self, arg: int) -> bool:
    """Whether the result depends on argument `arg` (its position in the
    signature, counting from the first index for a score_mod too)."""
    offset = 1 if self.name == "score_mod" else 0
    var = self.jaxpr.invars[arg + offset]
    return (any(var is v for eqn in self.jaxpr.eqns for v in eqn.invars)
            or any(var is v for v in self.jaxpr.outvars))

  def split(self, consts: Sequence[Array]) -> Tuple[Tuple[Array, ...], Tuple[Array, ...]]:
    """`(floating, other)` constants, in their order."""
    floating = tuple(c for c, d in zip(consts, self.differentiable) if d)
    other = tuple(c for c, d in zip(consts, self.differentiable) if not d)
    return floating, other

  def merge(self, floating: Sequence[Array], other: Sequence[Array]) -> Tuple[Array, ...]:
    """The constants in the jaxpr's order, from `split`'s two parts."""
    floating, other = iter(floating), iter(other)
    return tuple(next(floating) if d else next(other) for d in self.differentiable)


def lift(mod: Callable, name: str) -> Tuple[LiftedMod, Tuple[Array, ...]]:
  """Traces `mod` (a score_mod or mask_mod, as `name` says) and checks what it returns.

  Returns the lifted mod and the arrays it closes over (tracers under `jit`).

  Raises:
    ValueError: `mod` is not callable, fails on scalar arguments, or returns
      something other than a float32 score (score_mod) or a bool (mask_mod)
      of the arguments' broadcast shape.
  """
  if not callable(mod):
    raise ValueError(f"{name} must be a function, got {mod!r}.")
  index = jax.ShapeDtypeStruct((), jnp.int32)
  args = (index,) * 4
  if name == "score_mod":
    args = (jax.ShapeDtypeStruct((), jnp.float32),) + args
  try:
    closed = jax.make_jaxpr(mod)(*args)
  except (TypeError, IndexError, jax.errors.JAXTypeError) as error:
    raise ValueError(f"{name} must be a JAX function of {len(args)} broadcasting arrays "
                     f"({_SIGNATURES[name]}); calling it on scalars failed: {error}") from error
  outputs = closed.out_avals
  expected = "float32[]" if name == "score_mod" else "bool[]"
  got = ", ".join(str(aval.str_short()) for aval in outputs)
  if len(outputs) != 1 or outputs[0].shape != () or str(outputs[0].str_short()) != expected:
    what = "the score it was given" if name == "score_mod" else "a boolean"
    raise ValueError(f"{name} must return {what} of the broadcast shape of its arguments "
                     f"({expected} for scalars), got {got}.")
  differentiable = tuple(jnp.issubdtype(jnp.result_type(c), jnp.inexact) for c in closed.consts)
  return LiftedMod(closed.jaxpr, differentiable, name, str(closed.jaxpr)), tuple(closed.consts)


_SIGNATURES = {"score_mod": "score, batch, head, q_idx, kv_idx",
               "mask_mod": "batch, head, q_idx, kv_idx"}


def apply(mod: LiftedMod, consts: Sequence[Array], *args: Array) -> Array:
  """`mod(*args)` on broadcasting arrays, with `consts` as its closed-over arrays."""
  fn = jax_core.jaxpr_as_fun(jax_core.ClosedJaxpr(mod.jaxpr, list(consts)))
  return jnp.vectorize(lambda *scalars: fn(*scalars)[0])(*args)


@dataclasses.dataclass(frozen=True)
class BoundMod:
  """A lifted mod with its arrays: callable like the mod it was lifted from,
  and a pytree (the arrays are its leaves), so it can cross `jit`."""

  lifted: LiftedMod = dataclasses.field(metadata=dict(static=True))
  consts: Tuple[Array, ...] = ()

  def __call__(self, *args: Array) -> Array:
    return apply(self.lifted, self.consts, *args)


jax.tree_util.register_dataclass(BoundMod)


def evaluate_mask(mask_mod: MaskMod, batch: Array, head: Array, q_idx: Array,
                  kv_idx: Array) -> Array:
  """`mask_mod` on broadcasting indices, broadcast to their common shape."""
  shape = jnp.broadcast_shapes(batch.shape, head.shape, q_idx.shape, kv_idx.shape)
  return jnp.broadcast_to(mask_mod(batch, head, q_idx, kv_idx), shape)


def grid_indices(batch: int, heads: int, q_len: int, kv_len: int) -> Tuple[Array, ...]:
  """`[B, 1, 1, 1]`, `[1, H, 1, 1]`, `[1, 1, Tq, 1]`, `[1, 1, 1, Tk]` int32 indices."""
  return tuple(jnp.arange(n, dtype=jnp.int32).reshape([n if a == axis else 1 for a in range(4)])
               for axis, n in enumerate((batch, heads, q_len, kv_len)))


# The common mods. Static masks are `patterns` pieces (their layouts are
# constants); the others close over arrays.

causal_mask = patterns.Causal()


def sliding_window(left: int, right: int = 0) -> patterns.Pattern:
  """Query i sees keys i - left .. i + right (`right=0`: a causal window of left + 1)."""
  return patterns.Band(left, right)


def document_mask(q_segment_ids: Array, kv_segment_ids: Optional[Array] = None) -> MaskMod:
  """Tokens see tokens of their own document: ids `[B, Tq]` (and `[B, Tk]`)."""
  q_segment_ids = jnp.asarray(q_segment_ids)
  kv_segment_ids = q_segment_ids if kv_segment_ids is None else jnp.asarray(kv_segment_ids)
  return lambda b, h, q_idx, kv_idx: q_segment_ids[b, q_idx] == kv_segment_ids[b, kv_idx]


def prefix_lm_mask(prefix_lengths: Array) -> MaskMod:
  """Every query sees the first `prefix_lengths[b]` keys, and causally after them."""
  prefix_lengths = jnp.asarray(prefix_lengths)
  return lambda b, h, q_idx, kv_idx: (kv_idx < prefix_lengths[b]) | (kv_idx <= q_idx)


def key_padding_mask(kv_lengths: Array) -> MaskMod:
  """Keys past `kv_lengths[b]` are padding."""
  kv_lengths = jnp.asarray(kv_lengths)
  return lambda b, h, q_idx, kv_idx: kv_idx < kv_lengths[b]


def alibi(slopes: Array) -> ScoreMod:
  """ALiBi (Press et al. 2022): `score - slopes[h] * |q_idx - kv_idx|`; slopes `[H]`
  (learned, or the paper's `positional.alibi_slopes(H)`), differentiated when learned."""
  slopes = jnp.asarray(slopes)
  return lambda score, b, h, q_idx, kv_idx: score - slopes[h] * jnp.abs(q_idx - kv_idx)


def relative_bias(table: Array, bucket: Callable[[Array], Array]) -> ScoreMod:
  """A learned bias by head and relative position: `score + table[h, bucket(kv - q)]`,
  table `[H, num_buckets]` (T5's with `positional.t5_relative_position_bucket`)."""
  table = jnp.asarray(table)
  return lambda score, b, h, q_idx, kv_idx: score + table[h, bucket(kv_idx - q_idx)]


def cumulative_decay(query_log_decay: Array, key_log_decay: Array) -> ScoreMod:
  """A data-dependent decay (FoX, Lin et al. 2025): `score + c_q[b, h, q_idx] -
  c_k[b, h, kv_idx]`, where c are cumulative sums of log forget gates, `[B, H,
  Tq]` at the queries and `[B, H, Tk]` at the keys (the same array in
  self-attention; a decoding step's queries against the cache's keys), so
  that key j is weighted by the product of the gates after it up to query i."""
  query_log_decay, key_log_decay = jnp.asarray(query_log_decay), jnp.asarray(key_log_decay)
  return lambda score, b, h, q_idx, kv_idx: (score + query_log_decay[b, h, q_idx]
                                             - key_log_decay[b, h, kv_idx])


def head_temperature(temperature: Array) -> ScoreMod:
  """A per-head temperature: `score * temperature[h]`, temperature `[H]`."""
  temperature = jnp.asarray(temperature)
  return lambda score, b, h, q_idx, kv_idx: score * temperature[h]
