"""What the token mixers of the mixing family share: which tokens are real,
the shape check of their input, and the helpers of their Flax modules.

Padding, the same in every mixer of the family: a token is padding when it is
past `key_value_seq_lengths` or `query_seq_lengths`, or masked by a
key-padding mask `[B|1, 1, 1, T]` (`real_tokens`). Padded tokens are zeroed
before the mixing (`zero_padding`), so they contribute nothing to a real
token's output, and their own outputs are zero (tested: a real token's output
does not change with a padded token's value). A padded sequence is not its
unpadded self, though: the Fourier transform's frequencies and a fixed-length
mixer's weights follow the padded length T.
"""

from __future__ import annotations

from typing import Any, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from attention_jax.core import masks as mask_lib
from attention_jax.variants import common

Array = jnp.ndarray
Dtype = Any


def real_tokens(variant: str, x: Array, mask: Optional[Array] = None,
                query_seq_lengths: Optional[Array] = None,
                key_value_seq_lengths: Optional[Array] = None) -> Optional[Array]:
  """The real tokens of `x` `[B, T, ...]` as `[B, T]` bool, None when all are.

  A self-mixer's queries and keys are the same tokens, so a token is padding
  when any of the padding arguments says so: past either length, or masked by
  a key-padding mask `[B|1, 1, 1, T]` (a pairwise mask is refused by name).
  """
  batch, length = x.shape[:2]
  valid = common.key_padding(variant, mask, key_value_seq_lengths, batch, length)
  if query_seq_lengths is not None:
    valid = mask_lib.and_masks(valid, mask_lib.length_predicate(
        jnp.arange(length)[None, :], jnp.asarray(query_seq_lengths)[:, None]))
  return valid


def zero_padding(x: Array, valid: Optional[Array]) -> Array:
  """`x` `[B, T, ...]` with the tokens that `valid` `[B, T]` marks False set to 0."""
  if valid is None:
    return x
  if tuple(jnp.shape(valid)) != x.shape[:2]:
    raise ValueError(f"valid must be [B, T] = {list(x.shape[:2])}, got shape "
                     f"{list(jnp.shape(valid))}.")
  return jnp.where(valid.reshape(valid.shape + (1,) * (x.ndim - 2)), x, jnp.zeros((), x.dtype))


def check_tokens(x: Array) -> None:
  if jnp.ndim(x) != 3:
    raise ValueError(f"x must be [B, T, E], got shape {list(jnp.shape(x))}.")


def split_in_half(what: str, size: int) -> int:
  if size % 2:
    raise ValueError(f"{what} must be even to be split in two halves, got {size}.")
  return size // 2


def module_dropout_rng(module: nn.Module, deterministic: bool) -> Optional[jax.Array]:
  return module.make_rng("dropout") if module.dropout_rate > 0.0 and not deterministic else None


def make_params(module: nn.Module, dtype: Dtype, **shapes_and_inits) -> dict:
  """`{name: param}` from `name=(shape, initialiser)`, cast to the computation dtype."""
  return {name: module.param(name, init, shape, module.param_dtype).astype(dtype)
          for name, (shape, init) in shapes_and_inits.items()}


def computation_dtype(module: nn.Module, x: Array) -> Dtype:
  return module.dtype or jnp.promote_types(x.dtype, module.param_dtype)


# What every mixer of the family registers with (xca spells its own out).
MIXING_SPEC = dict(family="mixing", exact=False, cross=False, qkv=False)
