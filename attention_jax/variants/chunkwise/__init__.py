"""Chunkwise recurrent mixers, linear attention's successors (VARIANTS.md L), on
one engine (`engine`: recurrent, chunkwise and parallel forms of
S_t = (diag(exp(g_t)) + w_t r_t^T) S_{t-1} + k_t v_t^T) and one shell
(`parts.RecurrentMixer`: padding, the bidirectional pass, decoding):

  retention.py   fixed multi-scale decays per head (RetNet): retention
  gla.py         gated linear attention, per-dimension data-dependent decay: gla
  delta_net.py   the delta rule, and with a decay gate: delta_net, gated_delta_net
  mamba2.py      state space duality, a scalar data-dependent decay per head: mamba2
  rwkv7.py       the generalised delta rule with per-dimension decay: rwkv7

Importing this package registers the variants of every module.
"""

from attention_jax.variants.chunkwise import engine, parts
from attention_jax.variants.chunkwise.delta_net import (DeltaNet, GatedDeltaNet,
                                                        delta_rule_attention)
from attention_jax.variants.chunkwise.gla import GatedLinearAttention, gated_linear_attention
from attention_jax.variants.chunkwise.mamba2 import Mamba2, ssd
from attention_jax.variants.chunkwise.retention import (MultiScaleRetention,
                                                        multi_scale_retention)
from attention_jax.variants.chunkwise.rwkv7 import RWKV7TimeMix, rwkv7_attention
