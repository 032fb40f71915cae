"""Normalisation layers chosen by name, with logically partitioned parameters."""

from __future__ import annotations

from typing import Any, Optional

import flax.linen as nn
import jax.numpy as jnp

Dtype = Any

NORMS = ("layernorm", "rmsnorm")


def check_norm(kind: str) -> str:
  """Returns `kind` if it is one of `NORMS`, else raises ValueError."""
  if kind not in NORMS:
    raise ValueError(f"norm must be one of {NORMS}, got {kind!r}.")
  return kind


def make_norm(kind: str, dtype: Optional[Dtype] = None, *, param_dtype: Dtype = jnp.float32,
              epsilon: float = 1e-6, **module_kwargs) -> nn.Module:
  """A normalisation over the last axis (`[..., E] -> [..., E]`).

  Args:
    kind: "layernorm" (Ba et al. 2016) or "rmsnorm" (Zhang & Sennrich 2019).
    dtype, param_dtype: computation and parameter dtypes.
    epsilon: added to the variance.
    **module_kwargs: forwarded to the Flax module, e.g. `name=`.
  """
  scale_init = nn.with_logical_partitioning(nn.initializers.ones_init(), ("embed",))
  if check_norm(kind) == "layernorm":
    return nn.LayerNorm(
        epsilon=epsilon, dtype=dtype, param_dtype=param_dtype, scale_init=scale_init,
        bias_init=nn.with_logical_partitioning(nn.initializers.zeros_init(), ("embed",)),
        **module_kwargs)
  return nn.RMSNorm(epsilon=epsilon, dtype=dtype, param_dtype=param_dtype,
                    scale_init=scale_init, **module_kwargs)
