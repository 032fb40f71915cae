"""Normalisation layers chosen by name, with logically partitioned parameters.

  LayerNorm (Ba et al. 2016)       g * (x - mean) / sqrt(var + eps) + b
  RMSNorm (Zhang & Sennrich 2019)  g * x / sqrt(mean(x^2) + eps)
  ScaleNorm (Nguyen & Salazar 2019) g * x / max(||x||, eps), one scalar g
  PowerNorm (Shen et al. 2020)     g * x / psi + b, psi^2 a running quadratic
                                   mean per feature over the batch
  AdaNorm (Xu et al. 2019)         C * (1 - k * y) * y, y = (x - mean) / sqrt(var + eps),
                                   with no gradient through (1 - k * y)

All normalise over the last axis `[..., E] -> [..., E]`; PowerNorm's statistic
is over every other axis (the batch and the sequence) as in batch norm.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from attention_jax import axes

Array = jnp.ndarray
Dtype = Any

NORMS = ("layernorm", "rmsnorm", "scalenorm", "powernorm", "adanorm")
# The variable collection of PowerNorm's running statistic; the trainer
# carries it from step to step as it carries routing attention's "kmeans".
BATCH_STATS = "batch_stats"


def check_norm(kind: str) -> str:
  """Returns `kind` if it is one of `NORMS`, else raises ValueError."""
  if kind not in NORMS:
    raise ValueError(f"norm must be one of {NORMS}, got {kind!r}.")
  return kind


class ScaleNorm(nn.Module):
  """`g * x / max(||x||_2, epsilon)` with one learned scalar g, initialised to
  sqrt(E) so that a unit-variance input keeps its scale (Nguyen & Salazar 2019).

  Attributes:
    epsilon: the smallest norm divided by.
    dtype, param_dtype: computation and parameter dtypes.
  """

  epsilon: float = 1e-5
  dtype: Optional[Dtype] = None
  param_dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, x: Array) -> Array:
    """x: `[..., E]` -> `[..., E]`."""
    scale = self.param("scale", nn.initializers.constant(math.sqrt(x.shape[-1])), (),
                       self.param_dtype)
    x32 = x.astype(jnp.float32)
    norm = jnp.sqrt(jnp.sum(x32 * x32, axis=-1, keepdims=True))
    y = scale * x32 / jnp.maximum(norm, self.epsilon)
    return y.astype(self.dtype or x.dtype)


class PowerNorm(nn.Module):
  """Batch normalisation by the running quadratic mean (Shen et al. 2020, Alg. 1).

  In training (`use_running_average=False`) the output is
  `g * x / psi_{t-1} + b`, normalised by the running statistic of the steps
  before, which is then updated to
  `psi_t^2 = momentum * psi_{t-1}^2 + (1 - momentum) * mean(x^2)`, the mean
  over every axis but the last (the batch and the sequence; under `jax.jit`
  with a sharded batch that mean is global, as synchronised batch norm).
  In evaluation the running statistic is read and not updated.

  The running statistic does not depend on the current batch, so the gradient
  is exactly `g / psi_{t-1}`. The paper adds a correction to the backward
  pass (its "approximate backpropagation", a second running statistic updated
  in the backward pass); that needs state written from inside a VJP, which a
  functional JAX step has no place for, and is left out (docs/ARCHITECTURE.md).
  Padding positions count in the statistic: the layer does not see the mask.

  Attributes:
    momentum: alpha of the running average.
    epsilon: added to psi^2.
    use_running_average: evaluation mode (read the statistic, do not update it).
    dtype, param_dtype: computation and parameter dtypes.
  """

  momentum: float = 0.9
  epsilon: float = 1e-5
  use_running_average: bool = True
  dtype: Optional[Dtype] = None
  param_dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, x: Array) -> Array:
    """x: `[..., E]` -> `[..., E]`."""
    if not 0.0 <= self.momentum < 1.0:
      raise ValueError(f"PowerNorm momentum must be in [0, 1), got {self.momentum!r}.")
    features = x.shape[-1]
    scale = self.param("scale", nn.with_logical_partitioning(nn.initializers.ones_init(),
                                                             (axes.EMBED,)),
                       (features,), self.param_dtype)
    bias = self.param("bias", nn.with_logical_partitioning(nn.initializers.zeros_init(),
                                                           (axes.EMBED,)),
                      (features,), self.param_dtype)
    # psi^2 starts at 1: the first steps normalise by nothing until the
    # statistic has seen a few batches (momentum 0.9: about ten).
    quadratic_mean = self.variable(BATCH_STATS, "quadratic_mean",
                                   lambda: jnp.ones((features,), jnp.float32))
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(quadratic_mean.value + self.epsilon)
    if not self.use_running_average and not self.is_initializing():
      batch_mean = jnp.mean(jax.lax.stop_gradient(x32) ** 2, axis=tuple(range(x.ndim - 1)))
      quadratic_mean.value = (self.momentum * quadratic_mean.value
                              + (1.0 - self.momentum) * batch_mean)
    return (scale * y + bias).astype(self.dtype or x.dtype)


class AdaNorm(nn.Module):
  """`C * (1 - k * y) * y` with `y = (x - mean) / sqrt(var + epsilon)` and no
  gradient through the factor `(1 - k * y)` (Xu et al. 2019, "Understanding
  and Improving Layer Normalization"): no gain or bias to learn, the factor
  adapts the scale to the input. k = 1/10 as in the paper; C scales the output.

  Attributes:
    scale: C.
    k: the factor's slope.
    epsilon: added to the variance.
    dtype: computation dtype.
  """

  scale: float = 1.0
  k: float = 0.1
  epsilon: float = 1e-6
  dtype: Optional[Dtype] = None

  @nn.compact
  def __call__(self, x: Array) -> Array:
    """x: `[..., E]` -> `[..., E]`."""
    x32 = x.astype(jnp.float32)
    centred = x32 - jnp.mean(x32, axis=-1, keepdims=True)
    y = centred * jax.lax.rsqrt(jnp.mean(centred * centred, axis=-1, keepdims=True)
                                + self.epsilon)
    factor = jax.lax.stop_gradient(1.0 - self.k * y)
    return (self.scale * factor * y).astype(self.dtype or x.dtype)


def make_norm(kind: str, dtype: Optional[Dtype] = None, *, param_dtype: Dtype = jnp.float32,
              deterministic: bool = True, **module_kwargs) -> nn.Module:
  """A normalisation over the last axis (`[..., E] -> [..., E]`).

  Args:
    kind: one of `NORMS` (see the module docstring).
    dtype, param_dtype: computation and parameter dtypes.
    deterministic: evaluation mode; only PowerNorm, which updates its running
      statistic in training, reads it.
    **module_kwargs: forwarded to the Flax module, e.g. `name=`.
  """
  check_norm(kind)
  scale_init = nn.with_logical_partitioning(nn.initializers.ones_init(), (axes.EMBED,))
  if kind == "layernorm":
    return nn.LayerNorm(
        epsilon=1e-6, dtype=dtype, param_dtype=param_dtype, scale_init=scale_init,
        bias_init=nn.with_logical_partitioning(nn.initializers.zeros_init(), (axes.EMBED,)),
        **module_kwargs)
  if kind == "rmsnorm":
    return nn.RMSNorm(epsilon=1e-6, dtype=dtype, param_dtype=param_dtype,
                      scale_init=scale_init, **module_kwargs)
  if kind == "scalenorm":
    return ScaleNorm(dtype=dtype, param_dtype=param_dtype, **module_kwargs)
  if kind == "powernorm":
    return PowerNorm(use_running_average=deterministic, dtype=dtype, param_dtype=param_dtype,
                     **module_kwargs)
  return AdaNorm(dtype=dtype, **module_kwargs)
