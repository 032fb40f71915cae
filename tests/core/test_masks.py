"""make_attention_mask against masks written out pair by pair."""

import jax.numpy as jnp
import numpy as np
import pytest

from attention_jax.core import make_attention_mask
from attention_testing import loop_mask

B, TQ, TK = 2, 5, 6


@pytest.mark.parametrize("kwargs, loop_kwargs", [
    (dict(is_causal=True), dict(is_causal=True)),
    (dict(local_window_size=1), dict(window=1)),
    (dict(local_window_size=(0, 2)), dict(window=(0, 2))),
    (dict(query_seq_lengths=jnp.array([2, 5])), dict(q_lengths=[2, 5])),
    (dict(key_value_seq_lengths=jnp.array([0, 4])), dict(kv_lengths=[0, 4])),
    (dict(q_segment_ids=jnp.array([[0, 0, 1, 1, 1], [2, 2, 2, 2, 2]]),
          kv_segment_ids=jnp.array([[0, 1, 1, 1, 1, 1], [2, 2, 2, 3, 3, 3]])),
     dict(q_segments=[[0, 0, 1, 1, 1], [2, 2, 2, 2, 2]],
          kv_segments=[[0, 1, 1, 1, 1, 1], [2, 2, 2, 3, 3, 3]])),
    (dict(is_causal=True, local_window_size=(1, 0), key_value_seq_lengths=jnp.array([3, 6])),
     dict(is_causal=True, window=(1, 0), kv_lengths=[3, 6])),
])
def test_masks_match_their_definitions(kwargs, loop_kwargs):
  mask = make_attention_mask(TQ, TK, **kwargs)
  expected = loop_mask(B, TQ, TK, **loop_kwargs)
  np.testing.assert_array_equal(np.broadcast_to(mask, expected.shape), expected)


def test_no_mask_is_none_and_arbitrary_mask_is_anded():
  assert make_attention_mask(TQ, TK) is None
  arbitrary = np.random.default_rng(0).random((B, 1, TQ, TK)) > 0.5
  combined = make_attention_mask(TQ, TK, is_causal=True, mask=jnp.array(arbitrary))
  np.testing.assert_array_equal(combined, arbitrary & loop_mask(B, TQ, TK, is_causal=True))


def test_query_offset_shifts_causal_mask_to_absolute_positions():
  # Decoding query 3 of a 6-slot cache sees keys 0..3.
  mask = make_attention_mask(1, TK, is_causal=True, q_offset=3)
  np.testing.assert_array_equal(mask[0, 0, 0], [True, True, True, True, False, False])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.int32])
def test_a_mask_that_is_not_boolean_is_refused(dtype):
  # Cast to bool, an additive mask (0 allowed, -1e9 masked) would allow exactly
  # the masked pairs; the decoding cache of MultiHeadAttention, MLA and the
  # recurrence variants combine the caller's mask here.
  additive = jnp.where(jnp.arange(4) < 2, 0, -1e9).astype(dtype)[None, None, None, :]
  with pytest.raises(ValueError, match=f"mask must be boolean .* got dtype {jnp.dtype(dtype)}"):
    make_attention_mask(3, 4, mask=additive)
