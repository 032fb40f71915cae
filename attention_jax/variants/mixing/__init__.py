"""Attention replaced or reorganised (section G of VARIANTS.md): token mixers
that are not softmax attention over tokens. One module per mechanism, each
with its pure functions, modules and registrations:

  tokens.py            what every mixer here shares: the padding rule (which
                       tokens are real) and the Flax modules' helpers
  fourier.py           fnet: the 2-D Fourier transform
  mlp.py               mlp_mixer, gmlp: MLPs across the tokens, weights sized by T
  cross_covariance.py  xca: attention over the channels (XCiT)
  long_short.py        lite: attention beside a convolution (Lite Transformer)

Importing this package registers the variants of every module. It also
re-exports the public names the family had as one file, since README.md
documents every variant's pure function at `attention_jax.variants.<family>`
(`attention_jax.variants.mixing.fourier_mixing`); the code and tests of this
repository import them from their modules.
"""

from attention_jax.variants.mixing.cross_covariance import (CrossCovarianceTemperature,
                                                            cross_covariance_attention)
from attention_jax.variants.mixing.fourier import FourierMixing, fourier_mixing
from attention_jax.variants.mixing.long_short import (LongShortRangeAttention,
                                                      depthwise_convolution,
                                                      long_short_range_attention)
from attention_jax.variants.mixing.mlp import (FixedLengthMixer, GatedMLP, LAYER_NORM_EPSILON,
                                               TokenMixingMLP, gated_mlp, near_zero_spatial_init,
                                               spatial_gating_unit, token_mixing_mlp)
from attention_jax.variants.mixing.tokens import real_tokens, zero_padding
