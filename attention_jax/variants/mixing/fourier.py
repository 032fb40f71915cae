"""FNet (Lee-Thorp et al. 2021), `fnet`: the real part of the 2-D discrete
Fourier transform over the sequence and hidden axes as the token mixer, no
parameters, O(T log T).
"""

from __future__ import annotations

from typing import Any, Optional

import flax.linen as nn
import jax.numpy as jnp

from attention_jax import registry
from attention_jax.variants import common
from attention_jax.variants.mixing import tokens

Array = jnp.ndarray
Dtype = Any


def fourier_mixing(x: Array, *, valid: Optional[Array] = None) -> Array:
  """FNet's Fourier sublayer (Lee-Thorp et al. 2021):

      y = Re(FFT_seq(FFT_hidden(x))),

  the real part of the 2-D DFT over the sequence and hidden axes,
  y[t, e] = sum_{s, c} x[s, c] cos(2 pi (t s / T + e c / E)). Computed by FFT,
  O(T E log(T E)); no T x T array (the paper's DFT-matrix form is a faster
  TPU route for short sequences, the same numbers).

  Args:
    x: `[B, T, E]`.
    valid: `[B, T]` bool, the real tokens; padded ones are zeroed before the
      transform (they contribute nothing) and their outputs are zero.

  Returns:
    `[B, T, E]` in x's dtype (the transform runs in float32 or wider).
  """
  tokens.check_tokens(x)
  inputs = tokens.zero_padding(x.astype(jnp.promote_types(x.dtype, jnp.float32)), valid)
  out = jnp.fft.fft2(inputs, axes=(1, 2)).real
  return tokens.zero_padding(out, valid).astype(x.dtype)


class FourierMixing(nn.Module):
  """`fnet` as a token mixer (the mixer contract): `fourier_mixing`, no parameters.

  Attributes:
    num_heads: not used (the transform has no heads); the model passes it to
      every mixer.
    dropout_rate: must be 0 in training: the transform has no weights to drop.
    dtype: the output dtype; x's when None.
  """

  num_heads: Optional[int] = None
  dropout_rate: float = 0.0
  dtype: Optional[Dtype] = None

  @nn.compact
  def __call__(self, x: Array, context: Optional[Array] = None, *, mask=None,
               is_causal: bool = False, query_seq_lengths=None, key_value_seq_lengths=None,
               segment_ids=None, positions=None, deterministic: bool = True, carry=None):
    """The mixer contract. x: `[B, T, E]`; mask: key padding `[B|1, 1, 1, T]`;
    query_seq_lengths / key_value_seq_lengths: `[B]`; positions: not needed
    (the transform is over the positions); carry: passed through. Returns
    `[B, T, E]` (with the carry when given one)."""
    del positions
    # Every output frequency sums every token: no causal or per-segment form.
    common.reject_unsupported("fnet", context=context, is_causal=is_causal,
                              segment_ids=segment_ids)
    if self.dropout_rate > 0.0 and not deterministic:
      raise ValueError(f"fnet has no mixing weights to drop; got dropout_rate="
                       f"{self.dropout_rate}: set it to 0 for this variant.")
    tokens.check_tokens(x)
    valid = tokens.real_tokens("fnet", x, mask, query_seq_lengths, key_value_seq_lengths)
    out = fourier_mixing(x, valid=valid)
    return common.mixer_output(out.astype(self.dtype or x.dtype), carry)


registry.register(registry.VariantSpec(
    name="fnet", fn=fourier_mixing, complexity="O(T log T)", subquadratic=True, causal=False,
    paper="Lee-Thorp et al. 2021", mixer=FourierMixing, **tokens.MIXING_SPEC))
