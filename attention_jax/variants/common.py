"""What the variant families share: the call contract, argument checks, key padding.

Every Q/K/V variant's pure function has the signature

    fn(query [B, Tq, H, D], key [B, Tk, Hkv, D], value [B, Tk, Hkv, Dv],
       bias=None, mask=None, *, is_causal=False, query_seq_lengths=None,
       key_value_seq_lengths=None, segment_ids=None, <its own options and arrays>)
    -> [B, Tq, H, Dv]

because `MultiHeadAttention` calls every variant the same way. A variant takes
the masks it can apply at its claimed cost and refuses the others with a
ValueError (`reject_unsupported`), never by silently ignoring them. Padding is
always supported: as key/value lengths, or as a boolean mask that only masks
keys (`[B|1, 1, 1, Tk]`, what `Encoder` passes for padding anywhere).
"""

from __future__ import annotations

import zlib
from typing import Callable, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from attention_jax.core import masks as mask_lib
from attention_jax.core.inputs import check_lengths

Array = jnp.ndarray


def mixer_output(y, carry):
  """What a token mixer returns: `y`, or `(y, carry)` when it was called with a
  carry (the layer stack always passes one; a direct call need not)."""
  return y if carry is None else (y, carry)


# The variable collection holding each layer's random arrays (Performer's
# features, LSH's rotations, BigBird's random blocks). The trainer carries it in
# its state and checkpoints it like the parameters; `nn.scan` stacks it per layer.
RANDOM_COLLECTION = "random"


def layer_random(module: nn.Module, name: str, draw: Callable[[jax.Array], Array], *,
                 deterministic: bool, redraw_every: int) -> Array:
  """A random array of one layer (features, rotations, a pattern) and its redraws.

  Drawn when the model is initialised, from the "params" stream: a different
  draw in every layer (and, under `nn.scan`, every scanned layer), which the
  model keeps in the "random" collection. In training (`deterministic=False`,
  the collection mutable, an "attention" RNG stream given) it is redrawn from
  the "attention" stream at every `redraw_every`-th call (calls 0, N, 2N, ...;
  1: every step, as Reformer's LSH; 0: never, as BigBird's patterns) and the
  new draw is kept. Evaluation uses the kept draw. The trainer's "attention"
  key is a function of (seed, step) and the module path folds in the layer,
  so every draw is a function of (seed, layer, step) and a resumed run draws
  what an uninterrupted one drew.

  Called with variables that lack the collection (e.g. `{"params": p}` only),
  the draw comes from a fixed key folded with the module's path: still one
  per (unscanned) layer, never redrawn.

  Args:
    module: the calling module (its scope names the variables).
    name: the variable's name in the collection.
    draw: `draw(key) -> array`, the random array from a PRNG key.
    deterministic: evaluation: never redraw.
    redraw_every: calls between redraws in training; 0 never redraws.

  Returns:
    The array to use for this call.
  """
  check_size("redraw_every", redraw_every, minimum=0)
  collection = RANDOM_COLLECTION
  if not module.has_variable(collection, name) and not module.is_mutable_collection(collection):
    path = "/".join(map(str, module.scope.path))
    return draw(jax.random.fold_in(jax.random.key(0), zlib.crc32(path.encode()) & 0x7FFFFFFF))
  kept = module.variable(collection, name, lambda: draw(module.make_rng("params")))
  if redraw_every == 0:
    return kept.value
  # Created at initialisation too, so the collection's structure (and the
  # trainer's state) never changes between steps.
  calls = module.variable(collection, f"{name}_calls", lambda: jnp.zeros((), jnp.int32))
  if (deterministic or module.is_initializing() or not module.has_rng("attention")
      or not module.is_mutable_collection(collection)):
    return kept.value
  fresh = draw(module.make_rng("attention"))
  kept.value = jnp.where(calls.value % redraw_every == 0, fresh, kept.value)
  calls.value = calls.value + 1
  return kept.value


def reject_unsupported(variant: str, **arguments) -> None:
  """Raises a ValueError naming the first argument given (not None/False) to
  `variant` that it does not support, e.g. `reject_unsupported("linformer",
  is_causal=is_causal, segment_ids=segment_ids)`."""
  for name, value in arguments.items():
    if value is None or value is False:
      continue
    shown = f"shape {list(jnp.shape(value))}" if hasattr(value, "shape") else repr(value)
    raise ValueError(f"attention variant {variant!r} does not support {name} (got {shown}); "
                     f"use a variant that does (see attention_jax.list_variants()).")


def key_padding(variant: str, mask: Optional[Array], key_value_seq_lengths: Optional[Array],
                batch: int, kv_len: int) -> Optional[Array]:
  """The keys each sequence may attend to, `[B, Tk]` bool, or None when all.

  Combines `key_value_seq_lengths` `[B]` with a boolean `mask` that masks keys
  only (shape `[B|1, 1, 1, Tk]`). Any other mask needs the dense pairwise
  pattern, which a sub-quadratic variant cannot apply: a ValueError says so,
  as it does for a mask that is not boolean.
  """
  valid = None
  # As `dot_product_attention` demands: a float length (3.5 let 4 keys
  # through) or a [B, 1] one (broadcast to B x B) is an error, not a guess.
  check_lengths("key_value_seq_lengths", key_value_seq_lengths, batch)
  if key_value_seq_lengths is not None:
    valid = mask_lib.length_predicate(jnp.arange(kv_len)[None, :],
                                      jnp.asarray(key_value_seq_lengths)[:, None])
  if mask is not None:
    mask_lib.check_boolean_mask(mask)  # as dot_product_attention demands
    shape = tuple(jnp.shape(mask))
    if len(shape) != 4 or shape[1:3] != (1, 1) or shape[0] not in (1, batch) or \
        shape[3] not in (1, kv_len):
      raise ValueError(
          f"attention variant {variant!r} takes only a key-padding mask of shape "
          f"[B|1, 1, 1, Tk] = [{batch}|1, 1, 1, {kv_len}], got shape {list(shape)}; pairwise "
          f"masks need a dense variant such as 'dot_product'.")
    valid = mask_lib.and_masks(valid, jnp.broadcast_to(jnp.asarray(mask, bool)[:, 0, 0, :],
                                                       (batch, kv_len)))
  return valid


def zero_padded_queries(out: Array, query_seq_lengths: Optional[Array]) -> Array:
  """Zeros the outputs `[B, Tq, H, Dv]` of queries past `query_seq_lengths` `[B]`.

  Such queries attend to nothing, as in `dot_product_attention`; the `where`
  also zeroes their gradients.
  """
  if query_seq_lengths is None:
    return out
  check_lengths("query_seq_lengths", query_seq_lengths, out.shape[0])
  valid = mask_lib.length_predicate(jnp.arange(out.shape[1])[None, :],
                                    jnp.asarray(query_seq_lengths)[:, None])
  return jnp.where(valid[:, :, None, None], out, jnp.zeros((), out.dtype))


def check_size(name: str, value: int, *, length: Optional[int] = None, divides: bool = False,
               minimum: int = 1) -> int:
  """Validates a window/block/bucket/feature size; returns it.

  Args:
    name: the argument's name, for the message.
    value: the size given.
    length: the sequence length it must fit (at most `length`, or dividing it
      when `divides`).
    divides: `length` must be a multiple of `value`.
    minimum: the smallest valid value.
  """
  if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
    raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}.")
  if length is not None and divides and length % value:
    raise ValueError(f"{name}={value} must divide the sequence length {length} "
                     f"(pad the sequence to a multiple of {value}).")
  if length is not None and not divides and value > length:
    raise ValueError(f"{name}={value} must be at most the sequence length {length}.")
  return value


def check_per_head(name: str, array: Array, expected: tuple) -> None:
  """A variant's own array `name` must have shape `expected` (None: any size
  there), e.g. `check_per_head("transition", t, (num_heads, 2, 2))`."""
  shape = tuple(jnp.shape(array))
  if len(shape) != len(expected) or any(e is not None and s != e
                                        for s, e in zip(shape, expected)):
    wanted = "[" + ", ".join("*" if e is None else str(e) for e in expected) + "]"
    raise ValueError(f"{name} must have shape {wanted}, got {list(shape)}.")


def query_positions(positions: Optional[Array], batch: int, q_len: int) -> Array:
  """The queries' positions `[B, Tq]` float32, for variants placing each query
  in the sequence (Luong's local-m, Gaussian priors on i - j).

  Args:
    positions: `[Tq]` or `[B, Tq]` (what `MultiHeadAttention` passes, offset
      while decoding), or None for `arange(Tq)`.
    batch, q_len: B and Tq.
  """
  positions = jnp.arange(q_len) if positions is None else jnp.asarray(positions)
  if positions.shape not in ((q_len,), (batch, q_len)):
    raise ValueError(f"query_positions must be [Tq] or [B, Tq] = [{q_len}] or "
                     f"[{batch}, {q_len}], got {list(positions.shape)}.")
  return jnp.broadcast_to(positions.astype(jnp.float32), (batch, q_len))


def check_query_key_sizes(variant: str, query: Array, key: Array) -> None:
  """For variants whose score is a function of q - k or q . k: one head size."""
  if query.shape[-1] != key.shape[-1]:
    raise ValueError(f"{variant} needs queries and keys of one size, got query dim "
                     f"{query.shape[-1]} and key dim {key.shape[-1]}.")


def repeat_kv_heads(key: Array, num_heads: int) -> Array:
  """`[B, T, Hkv, D]` -> `[B, T, H, D]`: query head h uses K/V head h // (H // Hkv).

  For variants whose per-head work is O(T): repeating costs O(T) memory.
  """
  num_kv_heads = key.shape[2]
  if num_heads % num_kv_heads:
    raise ValueError(f"the number of query heads ({num_heads}) must be a multiple of the "
                     f"number of key/value heads ({num_kv_heads}).")
  return jnp.repeat(key, num_heads // num_kv_heads, axis=2)


def dropout_weights(weights: Array, dropout_rate: float,
                    dropout_rng: Optional[jax.Array]) -> Array:
  """Inverted dropout on attention weights `[B, H, Tq, Tk]`: each kept with
  probability 1 - `dropout_rate` and scaled by its inverse; unchanged without
  an rng or at rate 0."""
  if dropout_rng is None or dropout_rate <= 0.0:
    return weights
  keep = jax.random.bernoulli(dropout_rng, 1.0 - dropout_rate, weights.shape)
  return jnp.where(keep, weights / (1.0 - dropout_rate), 0.0)


def weighted_values(weights: Array, value: Array) -> Array:
  """`weights @ value` per head, grouped value heads never repeated in memory.

  The G = H // Hkv query heads that share a value head are stacked along the
  query axis, `[B, Hkv, G * Tq, Tk]`, so the product is a plain batched matmul
  over (B, Hkv): on CPU about twice as fast as a 5-D grouped einsum.

  Args:
    weights: `[B, H, Tq, Tk]` (cast to the value dtype).
    value: `[B, Tk, Hkv, Dv]`; query head h uses value head h // (H // Hkv).

  Returns:
    `[B, Tq, H, Dv]` in float32.
  """
  batch, num_heads, q_len, kv_len = weights.shape
  num_kv_heads, value_dim = value.shape[2], value.shape[3]
  group = num_heads // num_kv_heads
  stacked = weights.astype(value.dtype).reshape(batch, num_kv_heads, group * q_len, kv_len)
  out = jnp.einsum("bhqk,bhkd->bhqd", stacked, value.transpose(0, 2, 1, 3),
                   preferred_element_type=jnp.float32)
  out = out.reshape(batch, num_kv_heads, group, q_len, value_dim).transpose(0, 3, 1, 2, 4)
  return out.reshape(batch, q_len, num_heads, value_dim)


def _cache_overflow(index, new_len: int, max_len: int) -> Optional[str]:
  index = int(index)
  if index + new_len <= max_len:
    return None
  return (f"the KV cache holds {max_len} tokens and {index} are in it: decoding {new_len} more "
          f"would write past its end (token {index + new_len} of {max_len}). Size the cache "
          f"(the length at init) for the prompt and every new token.")


def check_cache_room(index: Array, new_len: int, max_len: int) -> None:
  """A ValueError when the new tokens do not fit the cache. The index is a
  traced value under `jit`, where the check runs as a callback whose error
  aborts the computation (dynamic_update_slice would silently clamp the
  write onto the last slots instead)."""
  try:
    message = _cache_overflow(index, new_len, max_len)
  except jax.errors.ConcretizationTypeError:
    def check(index):
      message = _cache_overflow(index, new_len, max_len)
      if message:
        raise ValueError(message)
    jax.debug.callback(check, index)
    return
  if message:
    raise ValueError(message)
