"""Sparse attention: fixed (or drawn) patterns of allowed query-key pairs.

Every variant here but `axial` (two passes, registered as not exact) is
exact softmax attention restricted to its pattern, and none builds a T x T
array. One module per mechanism, each with its pure functions, modules and
registrations, over one engine and one kernel dispatch:

  engine.py           the engine: inputs padded to the block sizes, partial
                      softmaxes over subsets of keys (blocks, stripes, columns)
                      and their exact merge
  kernel.py           `implementation=`: the same patterns on the block-sparse
                      flash kernel
  windows.py          sliding and block windows: local (band), block_local,
                      dilated; the band other families compute on
  factorized.py       factorised patterns: strided, fixed, axial
  global_window.py    global tokens plus a window: global_tokens, longformer
  random_patterns.py  drawn patterns: random, bigbird, and `LayerPattern`

All functions take self-attention only (Tq == Tk), key padding
(`key_value_seq_lengths` or a `[B|1, 1, 1, Tk]` mask), query padding,
`segment_ids` and grouped K/V heads; a dense `bias` or a pairwise `mask` is
refused. Sequences are padded internally to a multiple of the block sizes, and
the padded keys are masked. Options named after the LRA release reproduce
what its code ran where that differs from the papers (the `lra_release`
presets, docs/lra_release.md).

Importing this package registers the variants of every module. It also
re-exports the public names the family had as one file, since README.md
documents every variant's pure function at `attention_jax.variants.<family>`
(`attention_jax.variants.sparse.local_attention`); the code and tests of this
repository import them from their modules.
"""

from attention_jax.variants.sparse.engine import PositionLogits, Predicate
from attention_jax.variants.sparse.factorized import (COMBINES, axial_attention, axial_shape,
                                                      fixed_attention, strided_attention)
from attention_jax.variants.sparse.global_window import (global_tokens_attention,
                                                         longformer_attention)
from attention_jax.variants.sparse.kernel import KERNEL_IMPLEMENTATIONS
from attention_jax.variants.sparse.random_patterns import (BIGBIRD_CANDIDATES, BIGBIRD_PADDINGS,
                                                           LayerPattern, bigbird_attention,
                                                           bigbird_candidates,
                                                           bigbird_global_blocks,
                                                           bigbird_random_blocks, pattern_key,
                                                           random_attention, random_indices)
from attention_jax.variants.sparse.windows import (LOCAL_PATTERNS, band_attention,
                                                   block_local_attention, dilated_attention,
                                                   local_attention, local_pattern,
                                                   positional_band_attention)
