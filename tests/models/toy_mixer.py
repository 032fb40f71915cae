"""A token mixer defined outside attention_jax, registered by importing this file.

`toy_mixer_config.py` imports it, so it is registered only in the process that
loads that config (experiments.train in a subprocess), never in the test
process, whose registry `tests/test_registry.py` checks.
"""

import flax.linen as nn
import jax.numpy as jnp

from attention_jax import registry
from attention_jax.variants.common import key_padding, mixer_output


def gated_mean_mixing(x, kernel, *, gain: float = 1.0, valid=None):
  """y_t = gain * (mean of the valid x_s) W: every token sees the same summary.

  x: `[B, T, E]`; kernel: `[E, E]`; valid: `[B, T]` bool or None.
  """
  weights = jnp.ones(x.shape[:2], x.dtype) if valid is None else valid.astype(x.dtype)
  mean = (x * weights[..., None]).sum(1) / jnp.maximum(weights.sum(1), 1.0)[:, None]
  return jnp.broadcast_to((gain * mean @ kernel)[:, None], x.shape)


class GatedMeanMixer(nn.Module):
  """The mixer contract around `gated_mean_mixing`."""

  num_heads: int
  dropout_rate: float = 0.0
  dtype: object = None
  gain: float = 1.0

  @nn.compact
  def __call__(self, x, context=None, *, mask=None, is_causal=False, deterministic=True,
               carry=None, **unused):
    kernel = self.param("kernel", nn.initializers.lecun_normal(), (x.shape[-1], x.shape[-1]))
    valid = key_padding("toy_gated_mean", mask, None, x.shape[0], x.shape[1])
    return mixer_output(gated_mean_mixing(x, kernel, gain=self.gain, valid=valid), carry)


registry.register(registry.VariantSpec(
    name="toy_gated_mean", fn=gated_mean_mixing, family="mixing", complexity="O(T)",
    subquadratic=True, exact=False, causal=False, cross=False, paper="(a test)", qkv=False,
    mixer=GatedMeanMixer, options=dict(gain="multiplies the summary")))
