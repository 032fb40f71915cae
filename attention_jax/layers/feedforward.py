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
# The gated linear units of Shazeer 2020, "GLU Variants Improve Transformer":
# gate(x W) * (x V), the gate's function by name (Dauphin et al. 2017's GLU
# gates with the sigmoid, the bilinear layer with none).
_GATES = {
    "glu": jax.nn.sigmoid,
    "bilinear": lambda x: x,
    "reglu": jax.nn.relu,
    "geglu": gelu,
    "swiglu": jax.nn.silu,
}
ACTIVATIONS = tuple(_ACTIVATIONS) + tuple(_GATES)


def check_activation(activation: str) -> str:
  """Returns `activation` if it is one of `ACTIVATIONS`, else raises ValueError."""
  if activation not in ACTIVATIONS:
    raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}.")
  return activation


class FeedForward(nn.Module):
  """`act(x W_i + b_i) W_o + b_o`, or for the gated units `(gate(x W_0) * (x W_1)) W_o`.

  With `chunk_size`, the positions go through the layer `chunk_size` at a time
  in a scan (Reformer's chunked feed-forward, Kitaev et al. 2020): the
  `[B, T, F]` hidden activation is never whole, only `[B, chunk_size, F]`; the
  output and its gradients are those of the unchunked layer, with the same
  parameter tree.

  Attributes:
    mlp_dim: hidden size F.
    activation: one of `ACTIVATIONS`; "glu", "bilinear", "reglu", "geglu" and
      "swiglu" are gated.
    dropout_rate: dropout on the hidden activations.
    use_bias: biases in the projections.
    chunk_size: positions per chunk (a divisor of T); None: all at once.
    dtype, param_dtype: computation and parameter dtypes.
    kernel_init, bias_init: initialisers of the projections.
  """

  mlp_dim: int
  activation: str = "gelu"
  dropout_rate: float = 0.0
  use_bias: bool = True
  chunk_size: Optional[int] = None
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
    batch, length, features = x.shape
    if self.activation in _GATES:
      layers = (self._dense(self.mlp_dim, (EMBED, MLP), "wi_0"),
                self._dense(self.mlp_dim, (EMBED, MLP), "wi_1"))
    else:
      layers = (self._dense(self.mlp_dim, (EMBED, MLP), "wi"),)
    output = self._dense(features, (MLP, EMBED), "wo")
    dropout = nn.Dropout(self.dropout_rate)

    def positionwise(module, chunk):
      del module  # the layers above are this module's; the scan lifts their scope
      if self.activation in _GATES:
        h = _GATES[self.activation](layers[0](chunk)) * layers[1](chunk)
      else:
        h = _ACTIVATIONS[self.activation](layers[0](chunk))
      h = nn.with_logical_constraint(h, (axes.ACTIVATION_BATCH, axes.ACTIVATION_LENGTH,
                                         axes.ACTIVATION_MLP))
      return output(dropout(h, deterministic=deterministic))

    if self.chunk_size is None or self.chunk_size >= length:
      return positionwise(self, x)
    if self.chunk_size < 1 or length % self.chunk_size:
      raise ValueError(f"FeedForward chunk_size must be a positive divisor of the sequence "
                       f"length {length}, got {self.chunk_size!r}.")
    chunks = x.reshape(batch, length // self.chunk_size, self.chunk_size, features)
    # One chunk per scan step: the parameters are broadcast (shared by every
    # step), dropout draws a new mask per chunk.
    scan = nn.scan(lambda module, carry, chunk: (carry, positionwise(module, chunk)),
                   variable_broadcast="params", split_rngs={"params": False, "dropout": True},
                   in_axes=1, out_axes=1)
    _, y = scan(self, None, chunks)
    return y.reshape(batch, length, features)
