"""The position-wise feed-forward layer of a Transformer block, plain or gated (GLU)."""

from __future__ import annotations

from typing import Any, Callable, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

Array = jnp.ndarray
Dtype = Any

from attention_jax import axes

# Logical axis names; the trainer's rules map them to mesh axes.
EMBED, MLP = axes.EMBED, axes.MLP


@jax.custom_jvp
def gelu(x: Array) -> Array:
  """The exact (erf) GELU of Hendrycks & Gimpel 2016, x * Phi(x), within 1e-6
  of `jax.nn.gelu(x, approximate=False)` in float32, with a JVP that keeps one array for
  reverse mode (the derivative) where autodiff of jax's form keeps three.
  Phi is written with erf rather than jax's erfc: XLA fuses erf's rational
  approximation into one loop but materialises erfc's pieces on CPU."""
  return x * _normal_cdf(x)


def _normal_cdf(x: Array) -> Array:
  return 0.5 * (1.0 + jax.lax.erf(x * (0.5 ** 0.5)))


@gelu.defjvp
def _gelu_jvp(primals, tangents):
  """d gelu(x) = (Phi(x) + x phi(x)) dx, phi the standard normal density."""
  (x,), (tangent,) = primals, tangents
  cdf = _normal_cdf(x)
  density = jnp.exp(-0.5 * x * x) * ((2.0 * jnp.pi) ** -0.5)
  return x * cdf, (cdf + x * density).astype(x.dtype) * tangent


# "gelu" is the exact (erf) GELU, not the tanh approximation.
_ACTIVATIONS = {
    "relu": jax.nn.relu,
    "gelu": gelu,
    "swish": jax.nn.silu,
}
# Gated linear units (Shazeer 2020): act(x W) * (x V).
_GATED = {"swiglu": "swish", "geglu": "gelu"}
ACTIVATIONS = tuple(_ACTIVATIONS) + tuple(_GATED)


def check_activation(activation: str) -> str:
  """Returns `activation` if it is one of `ACTIVATIONS`, else raises ValueError."""
  if activation not in ACTIVATIONS:
    raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}.")
  return activation


class FeedForward(nn.Module):
  """`act(x W_i + b_i) W_o + b_o`, or for GLU variants `(act(x W_0) * (x W_1)) W_o`.

  Attributes:
    mlp_dim: hidden size F.
    activation: one of `ACTIVATIONS`; "swiglu" and "geglu" are gated.
    dropout_rate: dropout on the hidden activations.
    use_bias: biases in the projections.
    dtype, param_dtype: computation and parameter dtypes.
    kernel_init, bias_init: initialisers of the projections.
  """

  mlp_dim: int
  activation: str = "gelu"
  dropout_rate: float = 0.0
  use_bias: bool = True
  dtype: Optional[Dtype] = None
  param_dtype: Dtype = jnp.float32
  kernel_init: Callable[..., Array] = nn.initializers.xavier_uniform()
  bias_init: Callable[..., Array] = nn.initializers.zeros_init()

  def _dense(self, features: int, axes, name: str) -> nn.Dense:
    return nn.Dense(
        features, use_bias=self.use_bias, dtype=self.dtype, param_dtype=self.param_dtype,
        kernel_init=nn.with_logical_partitioning(self.kernel_init, axes),
        bias_init=nn.with_logical_partitioning(self.bias_init, axes[1:]),
        name=name)

  @nn.compact
  def __call__(self, x: Array, deterministic: bool = True) -> Array:
    """x: `[B, T, E]` -> `[B, T, E]`."""
    check_activation(self.activation)
    if x.ndim != 3:
      raise ValueError(f"x must be [B, T, E], got shape {x.shape}.")
    features = x.shape[-1]
    if self.activation in _GATED:
      act = _ACTIVATIONS[_GATED[self.activation]]
      gate = self._dense(self.mlp_dim, (EMBED, MLP), "wi_0")(x)
      linear = self._dense(self.mlp_dim, (EMBED, MLP), "wi_1")(x)
      h = act(gate) * linear
    else:
      h = _ACTIVATIONS[self.activation](self._dense(self.mlp_dim, (EMBED, MLP), "wi")(x))
    h = nn.with_logical_constraint(h, (axes.ACTIVATION_BATCH, axes.ACTIVATION_LENGTH,
                                       axes.ACTIVATION_MLP))
    h = nn.Dropout(self.dropout_rate)(h, deterministic=deterministic)
    return self._dense(features, (MLP, EMBED), "wo")(h)
