"""A mixture-of-experts feed-forward layer: top-k routing with a capacity per
expert (GShard, Lepikhin et al. 2021; Switch Transformer, Fedus et al. 2022).

Each token goes to the `top_k` experts its router scores highest, in order of
preference; an expert takes at most `capacity` tokens of an example, first
come first served (all first choices, in sequence order, before any second
choice), and a token an expert has no room for gets nothing from it (the
residual connection carries it on). The output is the tokens' expert outputs
weighted by their gates.

Routing is per example (one group per sequence), so it does not depend on how
the batch is split over devices. The expert weights `[N, E, F]` carry the
logical axis "expert", which the default rules map to the "fsdp" mesh axis
(expert parallelism: `jax.jit` inserts the all-to-all that sends each token to
its expert's device).

The Switch load-balancing loss `N * sum_n f_n * P_n` (f_n the fraction of
tokens whose first choice is expert n, P_n the mean router probability of
expert n) times `load_balancing_weight` is sown into "losses", which the
trainer adds to the task's loss.

Capacity makes tokens compete: a later token's first choice can take the slot
an earlier token's second choice needed, so a token's output depends on the
tokens after it. A causal model (a language model, a Transformer decoder)
calls the layer with `is_causal=True`, which routes every token to all of its
top-k experts with no capacity (every expert computed at every position and
combined by the gates: N times the FLOPs of capacity routing at factor 1), so
a token's output is a function of that token alone, as in decoding.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from attention_jax import axes
from attention_jax.layers.feedforward import _ACTIVATIONS, _GATES, check_activation

Array = jnp.ndarray
Dtype = Any


def expert_capacity(length: int, num_experts: int, top_k: int, capacity_factor: float) -> int:
  """Tokens an expert takes per example: `ceil(capacity_factor * top_k * T / N)`,
  at least 1 (`capacity_factor` 1: room for every choice if routing is balanced)."""
  return max(1, math.ceil(capacity_factor * top_k * length / num_experts))


def route(router_probs: Array, top_k: int, capacity: int):
  """The dispatch and combine tensors of top-k routing with a capacity.

  Args:
    router_probs: `[B, T, N]`, each row a distribution over the N experts.
    top_k: experts per token.
    capacity: tokens per expert per example.

  Returns:
    `(dispatch, combine)`, both `[B, T, N, C]`: dispatch is 1 where token t
    takes slot c of expert n, combine is its gate there. The gates are the
    router probabilities of the chosen experts, renormalised over them when
    `top_k > 1` (GShard's top-2; with one expert its raw probability, as Switch,
    so that the router is trained through it).
  """
  batch, length, num_experts = router_probs.shape
  gates, experts = jax.lax.top_k(router_probs, top_k)  # [B, T, k]
  if top_k > 1:
    gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
  # Choice-major priority: every token's first choice claims its slot before
  # any second choice, in sequence order within a choice.
  choices = jax.nn.one_hot(jnp.swapaxes(experts, 1, 2), num_experts, dtype=jnp.int32)
  choices = choices.reshape(batch, top_k * length, num_experts)  # [B, k T, N]
  slot = jnp.cumsum(choices, axis=1) * choices - 1  # -1 where not chosen
  slot = slot.reshape(batch, top_k, length, num_experts)
  # A slot at or beyond the capacity is dropped: one_hot of it is all zeros.
  slots = jax.nn.one_hot(slot, capacity, dtype=router_probs.dtype)  # [B, k, T, N, C]
  dispatch = jnp.sum(slots, axis=1)
  combine = jnp.einsum("bkt,bktnc->btnc", jnp.swapaxes(gates, 1, 2), slots)
  return dispatch, combine


def load_balancing_loss(router_probs: Array) -> Array:
  """`N * sum_n f_n * P_n` over the `[B, T, N]` router probabilities: 1 when
  routing is uniform, up to N when every token picks one expert."""
  num_experts = router_probs.shape[-1]
  first_choice = jax.nn.one_hot(jnp.argmax(router_probs, axis=-1), num_experts)
  fraction = jnp.mean(first_choice, axis=(0, 1))
  mean_prob = jnp.mean(router_probs, axis=(0, 1))
  return num_experts * jnp.sum(fraction * mean_prob)


class MixtureOfExperts(nn.Module):
  """`num_experts` feed-forward experts, each token routed to `top_k` of them.

  Attributes:
    mlp_dim: each expert's hidden size F.
    activation: as `FeedForward`'s (gated units have two input kernels).
    dropout_rate: dropout on the experts' hidden activations.
    num_experts: N.
    top_k: experts per token.
    capacity_factor: scales the expert capacity (`expert_capacity`).
    load_balancing_weight: multiplies the sown load-balancing loss (0: none sown).
    dtype, param_dtype: computation and parameter dtypes.
    kernel_init: initialiser of the expert kernels (per expert, `[E, F]`).
  """

  mlp_dim: int
  activation: str = "gelu"
  dropout_rate: float = 0.0
  num_experts: int = 8
  top_k: int = 2
  capacity_factor: float = 1.25
  load_balancing_weight: float = 0.01
  dtype: Optional[Dtype] = None
  param_dtype: Dtype = jnp.float32
  kernel_init: Callable[..., Array] = nn.initializers.xavier_uniform(batch_axis=(0,))

  def _check(self):
    check_activation(self.activation)
    if not isinstance(self.num_experts, int) or self.num_experts < 1:
      raise ValueError(f"MixtureOfExperts num_experts must be a positive integer, got "
                       f"{self.num_experts!r}.")
    if not isinstance(self.top_k, int) or not 1 <= self.top_k <= self.num_experts:
      raise ValueError(f"MixtureOfExperts top_k must be an integer in [1, num_experts="
                       f"{self.num_experts}], got {self.top_k!r}.")
    if not self.capacity_factor > 0:
      raise ValueError(f"MixtureOfExperts capacity_factor must be positive, got "
                       f"{self.capacity_factor!r}.")
    if self.load_balancing_weight < 0:
      raise ValueError(f"MixtureOfExperts load_balancing_weight must be >= 0, got "
                       f"{self.load_balancing_weight!r}.")

  def _kernel(self, name: str, shape, names) -> Array:
    return self.param(name, nn.with_logical_partitioning(self.kernel_init, names), shape,
                      self.param_dtype)

  def _bias(self, name: str, shape, names) -> Array:
    return self.param(name, nn.with_logical_partitioning(nn.initializers.zeros_init(), names),
                      shape, self.param_dtype)

  @nn.compact
  def __call__(self, x: Array, deterministic: bool = True, *, is_causal: bool = False) -> Array:
    """x: `[B, T, E]` -> `[B, T, E]`; `is_causal`: route without capacity, so
    that no position's output depends on another's (module docstring)."""
    self._check()
    if x.ndim != 3:
      raise ValueError(f"x must be [B, T, E], got shape {x.shape}.")
    length, features = x.shape[1], x.shape[2]
    experts, hidden = self.num_experts, self.mlp_dim
    dtype = self.dtype or x.dtype
    # The router stays in float32: its softmax decides the routing.
    router = nn.Dense(experts, use_bias=False, dtype=jnp.float32, param_dtype=self.param_dtype,
                      kernel_init=nn.with_logical_partitioning(
                          nn.initializers.normal(0.02), (axes.EMBED, None)),
                      name="router")
    router_probs = jax.nn.softmax(router(x.astype(jnp.float32)), axis=-1)  # [B, T, N]
    if is_causal:
      # Every token in a slot of its own of every expert: C = T, the identity dispatch.
      dispatch = None
      gates, chosen = jax.lax.top_k(router_probs, self.top_k)  # [B, T, k]
      if self.top_k > 1:
        gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
      combine = jnp.einsum("btk,btkn->btn", gates, jax.nn.one_hot(chosen, experts,
                                                                  dtype=gates.dtype))
    else:
      capacity = expert_capacity(length, experts, self.top_k, self.capacity_factor)
      dispatch, combine = route(router_probs, self.top_k, capacity)
    if self.load_balancing_weight:
      self.sow("losses", "load_balancing",
               self.load_balancing_weight * load_balancing_loss(router_probs))

    weight_axes = (axes.EXPERT, None, axes.MLP)
    gated = self.activation in _GATES
    inputs = [self._kernel(f"wi_{i}" if gated else "wi", (experts, features, hidden),
                           weight_axes) for i in range(2 if gated else 1)]
    input_biases = [self._bias(f"bi_{i}" if gated else "bi", (experts, hidden),
                               (axes.EXPERT, axes.MLP)) for i in range(2 if gated else 1)]
    output = self._kernel("wo", (experts, hidden, features), (axes.EXPERT, axes.MLP, None))
    output_bias = self._bias("bo", (experts, features), (axes.EXPERT, None))

    if dispatch is None:  # [N, B, T, E]: every position at every expert
      expert_inputs = jnp.broadcast_to(x.astype(dtype), (experts,) + x.shape)
    else:
      expert_inputs = jnp.einsum("btnc,bte->nbce", dispatch.astype(dtype), x.astype(dtype))
    projected = [jnp.einsum("nbce,nef->nbcf", expert_inputs, kernel.astype(dtype))
                 + bias.astype(dtype)[:, None, None, :]
                 for kernel, bias in zip(inputs, input_biases)]
    if gated:
      h = _GATES[self.activation](projected[0]) * projected[1]
    else:
      h = _ACTIVATIONS[self.activation](projected[0])
    h = nn.Dropout(self.dropout_rate)(h, deterministic=deterministic)
    expert_outputs = (jnp.einsum("nbcf,nfe->nbce", h, output.astype(dtype))
                      + output_bias.astype(dtype)[:, None, None, :])
    if dispatch is None:  # an expert not chosen has gate 0
      return jnp.einsum("btn,nbte->bte", combine.astype(dtype), expert_outputs)
    # An empty slot has zero combine weight, so its (bias-only) output adds nothing.
    return jnp.einsum("btnc,nbce->bte", combine.astype(dtype), expert_outputs)
