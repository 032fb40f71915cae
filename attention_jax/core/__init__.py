"""Masks, the masked softmax and the dense reference attention."""

from attention_jax.core.masks import (and_masks, causal_predicate, length_predicate,
                                      make_attention_mask, normalize_window,
                                      segment_predicate, split_segment_ids,
                                      window_predicate)
from attention_jax.core.reference import reference_attention
from attention_jax.core.softmax import masked_softmax
