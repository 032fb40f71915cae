"""Differential attention (Ye et al. 2024, "Differential Transformer"), `differential`.

Each head splits its query and key features into two halves and subtracts one
softmax map from the other, cancelling the attention both maps give to
irrelevant context (eq. 1):

    DiffAttn = (softmax(Q1 K1^T s) - lambda softmax(Q2 K2^T s)) V,   s = 1 / sqrt(D / 2),

with lambda reparameterised from four learned vectors (eq. 2),

    lambda = exp(lq1 . lk1) - exp(lq2 . lk2) + lambda_init,
    lambda_init = 0.8 - 0.6 exp(-0.3 (l - 1))   (l: the layer's depth, from 1),

then each head's output normalised over its features (RMSNorm with a learned
scale, the paper's "headwise normalisation") and multiplied by
(1 - lambda_init) (eq. 3).

Both maps are exact attention, so each runs through `dot_product_attention`
with any of its implementations (a flash kernel never builds the [T, T] maps);
the subtraction is of their outputs, which is the same thing since both weight
the same values.

Choices (docs/ARCHITECTURE.md): the halves are the even and the odd features,
so that RoPE's rotated pairs (feature i with i + D/2) stay within one half
when D is a multiple of 4 and each map stays relative (a rotated width that
is not a multiple of 4 is refused); the projections absorb the permutation,
though the second map's rotation frequencies are then the odd ones of the
head's, not the first map's as in the paper. The depth l is counted in the layer stack's carry over the
differential layers before this one (the paper's stacks are all differential),
a layer that LayerDrop skips in training included;
`lambda_init` set as an option replaces the schedule.
"""

from __future__ import annotations

from typing import Dict, Mapping, Optional, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from attention_jax import registry
from attention_jax.variants import common
from attention_jax.variants.dense import dot_product_attention

Array = jnp.ndarray

DEPTH = "differential_depth"  # the carry key: how many differential layers came before
RMS_EPSILON = 1e-5


def lambda_init_at(depth) -> Array:
  """The paper's lambda_init for the layer at `depth` (1 for the first layer)."""
  return 0.8 - 0.6 * jnp.exp(-0.3 * (jnp.asarray(depth, jnp.float32) - 1.0))


def differential_attention(
    query: Array,
    key: Array,
    value: Array,
    bias: Optional[Array] = None,
    mask: Optional[Array] = None,
    *,
    lambda_vectors: Tuple[Array, Array, Array, Array],
    norm_scale: Array,
    lambda_init: Optional[float] = None,
    carry: Optional[Mapping[str, Array]] = None,
    rotary_width: Optional[int] = None,
    is_causal: bool = False,
    query_seq_lengths: Optional[Array] = None,
    key_value_seq_lengths: Optional[Array] = None,
    segment_ids=None,
    local_window_size=None,
    scale: Optional[float] = None,
    implementation: Optional[str] = None,
    dropout_rate: float = 0.0,
    dropout_rng: Optional[jax.Array] = None,
) -> Tuple[Array, Dict[str, Array]]:
  """Differential attention: `([B, Tq, H, Dv], {"differential_depth": l})`.

  Args:
    query: `[B, Tq, H, D]`, D even: features 0, 2, 4, ... form Q1, the odd ones Q2.
    key: `[B, Tk, Hkv, D]`, split as the query.
    value: `[B, Tk, Hkv, Dv]`, weighted by both maps.
    bias, mask, is_causal, query_seq_lengths, key_value_seq_lengths,
      segment_ids, local_window_size, implementation: as
      `dot_product_attention`, applied to both maps.
    lambda_vectors: `(lq1, lk1, lq2, lk2)`, each `[D / 2]` (shared by the heads).
    norm_scale: `[Dv]`, the headwise RMSNorm's learned scale.
    lambda_init: a fixed lambda_init; None: the paper's schedule at this
      layer's depth, read from `carry`.
    carry: `{"differential_depth": l - 1}` from the layer before (the stack
      passes it); absent: l = 1.
    rotary_width: how many features the query and key were rotated over
      (`MultiHeadAttention` passes it with RoPE or xPos, which pair feature i
      with i + width / 2): a multiple of 4, so that each half holds whole
      pairs and each map stays a function of the distance; None: not rotated.
    scale: logit scale of both maps; 1/sqrt(D / 2) when None.
    dropout_rate, dropout_rng: dropout on both maps' weights (independent draws).

  Returns:
    The output in the query dtype, and the carry update `{"differential_depth": l}`.
  """
  head_dim = query.shape[-1]
  if head_dim % 2:
    raise ValueError(f"differential attention splits each head's query and key in two halves; "
                     f"the head dim must be even, got query of shape {list(query.shape)}.")
  common.check_query_key_sizes("differential", query, key)
  if rotary_width is not None and rotary_width % 4:
    raise ValueError(f"rotary_width must be a multiple of 4 for differential attention (RoPE "
                     f"pairs feature i with i + {rotary_width} / 2, and the even and odd halves "
                     f"must each hold whole pairs), got rotary_width={rotary_width} of head dim "
                     f"{head_dim}: choose a head dim (or rotary_fraction) that rotates a "
                     f"multiple of 4 features.")
  half = head_dim // 2
  for name, vector in zip(("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"), lambda_vectors):
    common.check_per_head(name, vector, (half,))
  common.check_per_head("norm_scale", norm_scale, (value.shape[-1],))
  previous = None if carry is None else carry.get(DEPTH)
  depth = (jnp.zeros((), jnp.int32) if previous is None else previous) + 1
  if lambda_init is None:
    init = lambda_init_at(depth)
  elif not 0.0 <= lambda_init < 1.0:
    raise ValueError(f"lambda_init must be in [0, 1) (the output is scaled by 1 - lambda_init), "
                     f"got {lambda_init}.")
  else:
    init = jnp.float32(lambda_init)
  lq1, lk1, lq2, lk2 = (v.astype(jnp.float32) for v in lambda_vectors)
  lam = jnp.exp(jnp.sum(lq1 * lk1)) - jnp.exp(jnp.sum(lq2 * lk2)) + init

  rngs = ((None, None) if dropout_rng is None else tuple(jax.random.split(dropout_rng)))
  attend = lambda q, k, rng: dot_product_attention(
      q, k, value, bias, mask, scale=scale, is_causal=is_causal,
      query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
      local_window_size=local_window_size, segment_ids=segment_ids,
      implementation=implementation, dropout_rate=dropout_rate, dropout_rng=rng)
  first = attend(query[..., 0::2], key[..., 0::2], rngs[0]).astype(jnp.float32)
  second = attend(query[..., 1::2], key[..., 1::2], rngs[1]).astype(jnp.float32)
  out = first - lam * second
  # Headwise RMSNorm; a row that attends to nothing is zero and stays zero.
  out = out * jax.lax.rsqrt(jnp.mean(jnp.square(out), axis=-1, keepdims=True) + RMS_EPSILON)
  out = out * norm_scale.astype(jnp.float32) * (1.0 - init)
  return out.astype(query.dtype), {DEPTH: depth}


class DifferentialParameters(nn.Module):
  """The learned lambda vectors (normal, std 0.1, as the paper's code) and the
  headwise RMSNorm's scale (ones)."""

  @nn.compact
  def __call__(self, query, key, value, deterministic: bool = True) -> dict:
    del key, deterministic
    if query.shape[-1] % 2:
      raise ValueError(f"differential attention needs an even head dim, got query of shape "
                       f"{list(query.shape)}.")
    half = query.shape[-1] // 2
    vectors = tuple(self.param(name, nn.initializers.normal(0.1), (half,))
                    for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"))
    norm_scale = self.param("norm_scale", nn.initializers.ones, (value.shape[-1],))
    return dict(lambda_vectors=vectors, norm_scale=norm_scale)


def _initial_carry(batch: int, length: int, num_heads: int) -> Dict[str, Array]:
  del batch, length, num_heads
  return {DEPTH: jnp.zeros((), jnp.int32)}


def _past_a_skipped_layer(carry: Dict[str, Array]) -> Dict[str, Array]:
  """A layer LayerDrop skips still counts: lambda_init is the layer index's."""
  return {**carry, DEPTH: carry[DEPTH] + 1}


registry.register(registry.VariantSpec(
    name="differential", fn=differential_attention, family="modern", complexity="O(T^2)",
    subquadratic=False, exact=False, causal=True, cross=True, paper="Ye et al. 2024",
    extras=DifferentialParameters, takes=("dropout", "rotary_width"),
    carries=(DEPTH,), initial_carry=_initial_carry, skipped_carry=_past_a_skipped_layer,
    options=dict(
        lambda_init="a fixed lambda_init in [0, 1); None: 0.8 - 0.6 exp(-0.3 (l - 1)) at "
                    "the layer's depth l",
        local_window_size=registry.VariantOption(
            "local_window_size", tuple, None,
            "(left, right): both maps see keys q - left .. q + right; None for all"),
        scale="multiplies both maps' logits; 1/sqrt(D / 2) when None",
        implementation="'xla', 'blockwise', 'pallas', ...: dot_product_attention's, for "
                       "both maps; None picks the best here")))
