"""The validated arguments of `flex_attention` beside the query, key and value.

`AttentionInputs` (core/inputs.py) holds what every exact implementation
takes; `FlexInputs` holds what flex attention adds (the mods, the block mask
and the options score_mod cannot express), checked once here so that each
implementation receives the same validated values.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional, Tuple

import jax
import jax.numpy as jnp

from attention_jax.core import block_mask as block_masks
from attention_jax.core import mods, patterns
from attention_jax.core.inputs import AttentionInputs

Array = jax.Array
NORMALISERS = ("softmax", "sigmoid")


@dataclasses.dataclass(frozen=True)
class FlexInputs:
  """Validated flex options of one call.

  Attributes:
    score_mod, mask_mod: the user's functions (the dense reference calls them
      as they are); mask_mod is the block mask's when only that was given.
    lifted_score_mod, score_consts: the score_mod traced at scalars and the
      arrays it closes over (`mods.lift`), for the kernels.
    lifted_mask_mod, mask_consts: likewise for a mask_mod that is not static
      (a static one is called as it is).
    block_mask: the layout to skip blocks by, or None.
    softcap: logits become `softcap * tanh(logits / softcap)`, or None.
    sinks: `[H]` float sink logits, or None.
    normaliser: "softmax" or "sigmoid".
    sigmoid_bias: the sigmoid normaliser's bias (a float).
    dropout_rate, dropout_rng: dropout on the weights (rate 0: none).
  """

  score_mod: Optional[Callable] = None
  mask_mod: Optional[Callable] = None
  lifted_score_mod: Optional[mods.LiftedMod] = None
  score_consts: Tuple[Array, ...] = ()
  lifted_mask_mod: Optional[mods.LiftedMod] = None
  mask_consts: Tuple[Array, ...] = ()
  block_mask: Optional[block_masks.BlockMask] = None
  softcap: Optional[float] = None
  sinks: Optional[Array] = None
  normaliser: str = "softmax"
  sigmoid_bias: float = 0.0
  dropout_rate: float = 0.0
  dropout_rng: Optional[Array] = None

  @property
  def static_mask_mod(self) -> bool:
    return self.mask_mod is not None and self.lifted_mask_mod is None


def prepare_flex_inputs(inputs: AttentionInputs, *, score_mod=None, mask_mod=None,
                        block_mask: Optional[block_masks.BlockMask] = None, softcap=None,
                        sinks=None, normaliser: str = "softmax",
                        sigmoid_bias: Optional[float] = None, dropout_rate: float = 0.0,
                        dropout_rng: Optional[Array] = None,
                        return_residual: bool = False) -> FlexInputs:
  """Checks the flex options against `inputs` and lifts the mods (trace time).

  Raises:
    ValueError: naming the argument, what it was and what was expected.
  """
  batch, q_len, num_heads, _ = inputs.query.shape
  kv_len = inputs.key.shape[1]
  if block_mask is not None:
    if not isinstance(block_mask, block_masks.BlockMask):
      raise ValueError(f"block_mask must be a BlockMask (create_block_mask), got "
                       f"{type(block_mask).__name__}.")
    block_mask.check(q_len, kv_len, batch, num_heads)
    if mask_mod is not None:
      raise ValueError("mask_mod and block_mask were both given: pass the block mask alone "
                       "(it carries the mask_mod it was made from).")
    mask_mod = block_mask.mask_mod
  if score_mod is not None:
    lifted_score_mod, score_consts = mods.lift(score_mod, "score_mod")
  else:
    lifted_score_mod, score_consts = None, ()
  lifted_mask_mod, mask_consts = None, ()
  if mask_mod is not None:
    lifted, consts = mods.lift(mask_mod, "mask_mod")  # always: it checks the output
    num_mask_heads = patterns.num_heads_of(mask_mod)
    if num_mask_heads > 1 and num_mask_heads != num_heads:
      raise ValueError(f"mask_mod is defined for {num_mask_heads} heads, but the query has "
                       f"H={num_heads}.")
    if isinstance(mask_mod, mods.BoundMod):  # a block mask's, lifted already
      lifted_mask_mod, mask_consts = mask_mod.lifted, mask_mod.consts
    elif not patterns.is_static(mask_mod):
      lifted_mask_mod, mask_consts = lifted, consts
  if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, (int, float))
                              or not softcap > 0):
    raise ValueError(f"softcap must be a positive float or None, got {softcap!r}.")
  if normaliser not in NORMALISERS:
    raise ValueError(f"normaliser must be one of {NORMALISERS}, got {normaliser!r}.")
  if sinks is not None:
    sinks = jnp.asarray(sinks)
    if sinks.shape != (num_heads,) or not jnp.issubdtype(sinks.dtype, jnp.floating):
      raise ValueError(f"sinks must be float [H] = [{num_heads}] (one logit per query head), "
                       f"got {sinks.dtype}{list(sinks.shape)}.")
    if normaliser != "softmax":
      raise ValueError(f"sinks take part in the softmax's normaliser; normaliser={normaliser!r} "
                       "has none.")
  if normaliser == "sigmoid":
    if return_residual:
      raise ValueError("return_residual: the sigmoid normaliser has no log-sum-exp; ask for "
                       "return_residual=False.")
    # Ramapuram et al. 2024: b = -log(n) keeps the weights' sum near 1 at the start.
    sigmoid_bias = -math.log(max(kv_len, 1)) if sigmoid_bias is None else float(sigmoid_bias)
  elif sigmoid_bias is not None:
    raise ValueError(f"sigmoid_bias is for normaliser='sigmoid', got normaliser={normaliser!r}.")
  if isinstance(dropout_rate, bool) or not isinstance(dropout_rate, (int, float)) or not (
      0.0 <= dropout_rate < 1.0):
    raise ValueError(f"dropout_rate must be a float in [0, 1), got {dropout_rate!r}.")
  if dropout_rate > 0.0 and dropout_rng is None:
    raise ValueError(f"dropout_rate={dropout_rate} needs a dropout_rng (a PRNG key), got None.")
  return FlexInputs(score_mod=score_mod, mask_mod=mask_mod, lifted_score_mod=lifted_score_mod,
                    score_consts=score_consts, lifted_mask_mod=lifted_mask_mod,
                    mask_consts=mask_consts, block_mask=block_mask,
                    softcap=None if softcap is None else float(softcap), sinks=sinks,
                    normaliser=normaliser, sigmoid_bias=sigmoid_bias or 0.0,
                    dropout_rate=float(dropout_rate),
                    dropout_rng=dropout_rng if dropout_rate > 0.0 else None)
