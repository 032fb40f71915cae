"""Attention with a prior: scores that do not come from query-key dot
products alone. One module per mechanism, each with its pure functions,
modules and registrations:

  synthesizer.py  logits synthesised without token-token interactions:
                  synthesizer_dense, synthesizer_random, synthesizer_factorized
  biases.py       a learned bias on the dot-product logits: gaussian_transformer,
                  gaussian_local, conditional_adapter
  hard_coded.py   fixed Gaussian weights from the positions alone:
                  hard_coded_gaussian
  average.py      a cumulative average with gates in place of attention: average
  carried.py      scores carried from layer to layer: realformer, predictive

Importing this package registers the variants of every module. It also
re-exports the public names the family had as one file, since README.md
documents every variant's pure function at `attention_jax.variants.<family>`
(`attention_jax.variants.prior.synthesizer_attention`); the code and tests of
this repository import them from their modules.
"""

from attention_jax.variants.prior.average import (AVERAGE_ARRAYS, AverageAttention,
                                                  average_attention, average_attention_step,
                                                  initial_average_state)
from attention_jax.variants.prior.biases import (GaussianDistancePrior, LocalnessPredictor,
                                                 TaskConditioning, conditional_adapter_attention,
                                                 conditional_block_bias, gaussian_local_attention,
                                                 gaussian_transformer_attention, task_film)
from attention_jax.variants.prior.carried import (MAPS, PredictiveConvolution, SCORES,
                                                  predict_maps, predictive_attention,
                                                  realformer_attention)
from attention_jax.variants.prior.hard_coded import NoQueryKey, hard_coded_gaussian_attention
from attention_jax.variants.prior.synthesizer import (DenseSyntheticLogits,
                                                      FactorizedSyntheticLogits,
                                                      RANDOM_LOGITS_INITS, RandomSyntheticLogits,
                                                      synthesizer_attention)
