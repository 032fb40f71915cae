"""LayerDrop (Fan et al. 2019): in training, each block of the standard stack
is skipped with probability `layer_drop_rate`; evaluation runs every block.

A skipped block is the identity on the stream and on the carry (but for what
its variant's `skipped_carry` advances, such as a layer count), and its compute
is skipped: the block runs in one branch of a `lax.cond` (lifted over Flax's
variables), so XLA executes it, and its backward pass, only when kept. The
keep/skip draw is one Bernoulli per block per step from the "dropout" stream,
which the trainer passes keyed by (seed, step), so a resumed run skips the
same blocks; under `scan_layers` the stream is split per scan step, so each
layer draws its own. Surviving blocks are not rescaled (the paper's
LayerDrop, unlike stochastic depth's test-time scaling), and no block is
pruned at evaluation.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.core import lift
from flax.linen import transforms

Array = jnp.ndarray


def run_or_skip(block: nn.Module, rate: float, x: Array, carry: Any, mask: Optional[Array],
                is_causal: bool, deterministic: bool,
                skipped_carry: Optional[Callable[[Any], Any]] = None) -> Tuple[Array, Any]:
  """`block(x, carry, mask, is_causal, deterministic)`, or
  `(x, skipped_carry(carry))` with probability `rate` in training.

  Args:
    block: a `Block` (or its `nn.remat` form) bound in the caller's scope.
    rate: the probability of skipping it; 0 (or `deterministic`) always runs it.
    x: `[B, T, E]`; carry, mask, is_causal, deterministic: as the block takes them.
    skipped_carry: the carry past a skipped block (its variant's
      `VariantSpec.skipped_carry`); None: the carry unchanged.

  Returns:
    `(x [B, T, E], carry)`.
  """
  # Initialisation must create the block's parameters whatever the draw.
  if rate == 0.0 or deterministic or block.is_initializing():
    return block(x, carry, mask, is_causal, deterministic)
  keep = jax.random.bernoulli(block.make_rng("dropout"), 1.0 - rate)
  past_skip = skipped_carry or (lambda carry: carry)
  return skip_unless(keep, lambda module, *operands: module(*operands, is_causal, deterministic),
                     lambda module, x, carry, mask: (x, past_skip(carry)), block, x, carry,
                     mask)


def skip_unless(keep: Array, run: Callable[..., Any], skip: Callable[..., Any], module: nn.Module,
                *operands) -> Any:
  """`nn.cond(keep, run, skip, module, *operands)`, where `skip` need not
  write the variables that `run` writes.

  `nn.cond` needs both branches to leave the mutable collections with the
  same structure. A block writes into some (it sows auxiliary losses into
  "losses", attention weights into "intermediates") and a skipped block
  writes nothing, so here the skipping branch returns zeros wherever the
  running branch writes something it did not: a skipped layer adds no
  auxiliary loss. Variables both branches hold (parameters, the "random"
  collection's draws and counters) pass through the skip unchanged.
  """
  return transforms.lift_direct_transform(_cond_filling_writes, (run, skip), module, keep,
                                          *operands, variables=True, rngs=True)


def _cond_filling_writes(run, skip, scope, keep, *operands, variables, rngs):
  """`flax.core.lift.cond` whose second branch's variable writes are padded
  to the first branch's structure with zeros."""

  def inner(scope_fn, repack_fn, variable_groups, rng_groups):

    def branch(fn, *args):
      branch_scope = scope_fn(variable_groups, rng_groups)
      return fn(branch_scope, *args), repack_fn(branch_scope)

    taken = functools.partial(branch, run)
    _, written_shapes = jax.eval_shape(taken, *operands)

    def skipped(*args):
      out, written = branch(skip, *args)
      return out, _fill_like(written, written_shapes)

    return jax.lax.cond(keep, taken, skipped, *operands)

  return lift.pack(inner, (variables,), (variables,), (rngs,), name="cond")(scope)


def _fill_like(written: Any, shapes: Any) -> Any:
  """`shapes`' tree with `written`'s leaf at each path where it has one of that
  shape, zeros elsewhere."""
  have = dict(jax.tree_util.tree_flatten_with_path(written)[0])
  leaves, tree = jax.tree_util.tree_flatten_with_path(shapes)
  filled = []
  for path, shape in leaves:
    leaf = have.get(path)
    same = leaf is not None and (jnp.shape(leaf), jnp.result_type(leaf)) == (shape.shape,
                                                                            shape.dtype)
    filled.append(leaf if same else jnp.zeros(shape.shape, shape.dtype))
  return jax.tree_util.tree_unflatten(tree, filled)
