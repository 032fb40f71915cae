"""Masks, the masked softmax, the dense reference attention, and the kernel interface
(`inputs`: `AttentionInputs`, `prepare_inputs`; `implementations`: the registry of
the ways to compute exact attention; `recurrence`: the chunkwise recurrence's input
contract), which the kernels import instead of a variant."""

from attention_jax.core.masks import (Reach, and_masks, length_predicate, make_attention_mask,
                                      normalize_window, reach_of, reach_predicate,
                                      segment_predicate, split_segment_ids)
from attention_jax.core.reference import reference_attention
from attention_jax.core.softmax import (MASKED_LOGSUMEXP, logsumexp_residual, masked_softmax,
                                        masked_softmax_and_logsumexp)
