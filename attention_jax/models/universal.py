"""The Universal Transformer (Dehghani et al. 2019): one block's weights
applied `num_layers` times, with Adaptive Computation Time halting per
position (Graves 2016).

Step n = 1..N (N = `num_layers`) adds the coordinate signal (the sinusoids of
the timestep n, and of the positions when `position` is "sinusoidal": other
position schemes act where they always do, at the embedding or in the
mixers) and applies the shared block: s_n = block(s_{n-1} + signal_n).
The encoders add "sinusoidal" (and "learned") positions to the embeddings
as for every stack, so with "sinusoidal" the first step sees the positions'
sinusoids twice (the paper's s_0 is the embeddings alone, its P^1 the one
position signal); kept, as the committed results were trained so.

ACT, per position: a halting unit h_n = sigmoid(w . s_n + b) reads each new
state. The position halts at the first step N' where h_1 + ... + h_N' reaches
`act_threshold` (1 - epsilon), or at step N; its remainder is
R = 1 - (h_1 + ... + h_{N'-1}), its step weights p_n = h_n before N' and
p_N' = R, and its output the weighted sum of its states, sum_n p_n s_n (the
weights sum to 1). Once halted, a position's state is copied to the later
steps unchanged (the paper's "its state is simply copied to the next step"):
the running positions still attend to it, and it adds nothing to its output.
Every step runs the block on the whole sequence: a position's state is read
by the others' attention, so halting decides the weights, not the compute.
The ponder cost N' + R, averaged over the real (unpadded) positions and
times `ponder_cost_weight`, is sown into "losses" as "ponder_cost"; only R
carries a gradient (N' is a step count).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, NamedTuple, Optional, Tuple

import flax.linen as nn
import jax.numpy as jnp

from attention_jax import positional
from attention_jax.models.blocks import block_class
from attention_jax.models.config import ModelConfig

Array = jnp.ndarray
Carry = Dict[str, Any]


class Halting(NamedTuple):
  """What ACT computed, per position (a pytree: it can leave a `jax.jit`).

  Attributes:
    output: `[B, T, E]`, sum_n p_n s_n.
    weights: `[N, B, T]`, p_n (0 after a position halts).
    halting_probabilities: `[N, B, T]`, h_n as the halting unit gave them
      (also after halting, where they are unused).
    steps: `[B, T]` int32, N' (the step at which the position halted).
    remainders: `[B, T]`, R.
  """

  output: Array
  weights: Array
  halting_probabilities: Array
  steps: Array
  remainders: Array

  @property
  def ponder_cost(self) -> Array:
    """`[B, T]`, N' + R."""
    return self.steps + self.remainders


def adaptive_computation(step: Callable[[Array, int], Array], halt: Callable[[Array], Array],
                         state: Array, num_steps: int, threshold: float) -> Halting:
  """ACT over `num_steps` steps of `step`, halting each position on its own.

  Args:
    step: `step(state [B, T, E], n) -> [B, T, E]`, step n = 0..num_steps-1.
    halt: `halt(state [B, T, E]) -> [B, T]` halting probabilities in (0, 1).
    state: `[B, T, E]`, the state before the first step.
    num_steps: N, the most steps a position takes.
    threshold: 1 - epsilon; a position halts once its summed halting
      probabilities reach it.

  Returns:
    The `Halting` record (output, weights, steps, remainders).
  """
  batch_shape = state.shape[:-1]
  running = jnp.ones(batch_shape, bool)
  cumulative = jnp.zeros(batch_shape, jnp.float32)  # sum of h_n before halting
  steps = jnp.zeros(batch_shape, jnp.int32)
  remainders = jnp.zeros(batch_shape, jnp.float32)
  output = jnp.zeros_like(state)
  weights, probabilities = [], []
  for n in range(num_steps):
    # A halted position keeps its state: the block's output there is dropped.
    state = jnp.where(running[..., None], step(state, n), state)
    h = halt(state).astype(jnp.float32)
    halts_now = running & ((cumulative + h >= threshold) | (n == num_steps - 1))
    p = jnp.where(halts_now, 1.0 - cumulative, jnp.where(running, h, 0.0))
    remainders = jnp.where(halts_now, 1.0 - cumulative, remainders)
    cumulative = cumulative + jnp.where(running & ~halts_now, h, 0.0)
    steps = steps + running.astype(jnp.int32)
    output = output + p[..., None].astype(state.dtype) * state
    running = running & ~halts_now
    weights.append(p)
    probabilities.append(h)
  return Halting(output, jnp.stack(weights), jnp.stack(probabilities), steps, remainders)


def coordinate_signal(config: ModelConfig, length: int, step: int) -> Array:
  """`[T, E]` (or `[1, E]`) added before step `step` (0-based): the timestep
  n = step + 1's sinusoid, plus the positions' when `position` is "sinusoidal"."""
  signal = positional.sinusoidal_embedding(jnp.array([step + 1]), config.embed_dim)  # [1, E]
  if config.position == "sinusoidal":
    signal = signal + positional.sinusoidal_embedding(jnp.arange(length), config.embed_dim)
  return signal


class UniversalStack(nn.Module):
  """One block (submodule `block`) applied `num_layers` times, with ACT
  (submodule `halting`, a Dense(1) whose bias starts at 1, as the paper's
  implementation) when `config.act_halting`.

  Attributes:
    config: the model config (`num_layers`, `act_halting`, `act_threshold`,
      `ponder_cost_weight`, and the block's fields; `remat_policy`
      rematerialises the shared block at each step). The block's mixer is
      the schedule's one variant.
  """

  config: ModelConfig

  @nn.compact
  def __call__(self, x: Array, carry: Optional[Carry] = None, *, mask: Optional[Array] = None,
               is_causal: bool = False, deterministic: bool = True) -> Tuple[Array, Carry]:
    """x: `[B, T, E]`; carry: the block's carry; mask: the mixers' mask, a key
    padding mask `[B, 1, 1, T]` marks the real positions of the ponder cost.

    Returns:
      `(x [B, T, E], carry)`.
    """
    config = self.config
    batch, length, _ = x.shape
    block = block_class(config)(config, config.schedule_period[0], name="block")
    carry = {} if carry is None else carry

    def step(state, n):
      nonlocal carry
      state = state + coordinate_signal(config, length, n).astype(state.dtype)
      state, carry = block(state, carry, mask, is_causal, deterministic)
      return state

    if not config.act_halting:
      for n in range(config.num_layers):
        x = step(x, n)
      return x, carry
    halting_unit = nn.Dense(1, dtype=config.jnp_dtype, bias_init=nn.initializers.constant(1.0),
                            name="halting")
    halted = adaptive_computation(step, lambda s: nn.sigmoid(halting_unit(s))[..., 0], x,
                                  config.num_layers, config.act_threshold)
    real = _real_positions(mask, batch, length)
    ponder = jnp.sum(halted.ponder_cost * real) / jnp.maximum(jnp.sum(real), 1.0)
    if config.ponder_cost_weight:
      self.sow("losses", "ponder_cost", config.ponder_cost_weight * ponder)
    return halted.output, carry


def _real_positions(mask: Optional[Array], batch: int, length: int) -> Array:
  """`[B, T]` float, 1 at real positions: from a key padding mask
  `[B|1, 1, 1, T]`, else every position."""
  if mask is None:
    return jnp.ones((batch, length), jnp.float32)
  if mask.ndim != 4 or mask.shape[1:3] != (1, 1) or mask.shape[3] != length:
    raise ValueError(f"model.stack='universal' averages the ponder cost over the positions a key "
                     f"padding mask [B, 1, 1, T] marks real (T={length}); got a mask of shape "
                     f"{mask.shape}.")
  return jnp.broadcast_to(mask[:, 0, 0, :], (batch, length)).astype(jnp.float32)
