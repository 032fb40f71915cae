"""gaussian_local (Yang et al. 2018): a Gaussian bias whose centre and window each
query predicts, added to the dot-product logits."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_jax.layers.attention import MultiHeadAttention
from attention_jax.variants.prior.biases import gaussian_local_attention
from attention_testing import (B, H, KV_LENGTHS, TK, TQ, VARIANT_MASK_CASES, as_float64,
                               assert_close, jit_call, jit_init, loop_mask, random_qkv)
from test_priors import np_masked_attention

HEAD_DIM = 8


def random_predictor(seed, num_heads=H, head_dim=HEAD_DIM):
  """W_p [H, D, D], U_p, U_d [H, D], large enough that centres and windows vary."""
  rng = np.random.default_rng(seed)
  return dict(position_kernel=rng.normal(size=(num_heads, head_dim, head_dim)).astype(np.float32)
              * 0.5,
              center_vector=rng.normal(size=(num_heads, head_dim)).astype(np.float32) * 2,
              window_vector=rng.normal(size=(num_heads, head_dim)).astype(np.float32) * 2)


def np_localness_bias(query, arrays, lengths):
  """The paper's eqs. written out: G [B, H, Tq, Tk] float64 with T = lengths[b]."""
  sigmoid = lambda x: 1.0 / (1.0 + np.exp(-x))
  hidden = np.tanh(np.einsum("bqhd,hde->bhqe", as_float64(query),
                             as_float64(arrays["position_kernel"])))
  total = np.asarray(lengths, np.float64)[:, None, None]
  center = total * sigmoid(np.einsum("bhqe,he->bhq", hidden, arrays["center_vector"]))
  window = total * sigmoid(np.einsum("bhqe,he->bhq", hidden, arrays["window_vector"]))
  sigma = window / 2
  j = np.arange(TK, dtype=np.float64)
  return -(j - center[..., None]) ** 2 / (2 * sigma[..., None] ** 2)


@pytest.mark.property("gaussian_local")
@pytest.mark.parametrize("case", sorted(VARIANT_MASK_CASES))
def test_gaussian_local_against_numpy(case):
  query, key, value = random_qkv(seed=4, batch=B, q_len=TQ, kv_len=TK, num_heads=H,
                                 num_kv_heads=2, head_dim=HEAD_DIM)
  arrays = random_predictor(0)
  kwargs, mask_args = VARIANT_MASK_CASES[case]
  out = jax.jit(lambda q, k, v: gaussian_local_attention(q, k, v, **arrays, **kwargs))(
      query, key, value)
  # T is the valid key count of the row when lengths are given.
  lengths = KV_LENGTHS if "key_value_seq_lengths" in kwargs else np.full(B, TK)
  scores = np.einsum("bqhd,bkhd->bhqk", as_float64(query),
                     np.repeat(as_float64(key), 2, axis=2)) / np.sqrt(HEAD_DIM)
  allowed = loop_mask(B, TQ, TK, **mask_args)
  want = np_masked_attention(scores + np_localness_bias(query, arrays, lengths), allowed,
                             value, H)
  assert_close(out, want, rtol=1e-4, atol=1e-5)


@pytest.mark.property("gaussian_local")
def test_gaussian_local_gives_padded_keys_no_weight_and_centres_on_the_valid_length():
  """Padded keys get weight 0, and a padded row equals the unpadded sequence's."""
  query, key, value = random_qkv(seed=5, batch=1, q_len=TK, num_heads=H, head_dim=HEAD_DIM)
  arrays = random_predictor(1)
  valid = 5
  padded = jit_call(gaussian_local_attention, query, key, value,
                    key_value_seq_lengths=jnp.array([valid]), **arrays)
  alone = jit_call(gaussian_local_attention, query, key[:, :valid], value[:, :valid], **arrays)
  assert_close(padded, alone, rtol=1e-5, atol=1e-6)
  noise = jax.random.normal(jax.random.PRNGKey(9), value.shape)
  changed = jit_call(
      gaussian_local_attention, query, key, value.at[:, valid:].set(noise[:, valid:]),
      key_value_seq_lengths=jnp.array([valid]), **arrays)
  assert_close(changed, padded, rtol=0, atol=0)


@pytest.mark.property("gaussian_local")
def test_gaussian_local_bias_peaks_at_the_predicted_centre():
  """A query whose prediction puts P_i on key 3 with a narrow window attends there
  almost only (zero q . k: the bias alone decides)."""
  query, key, value = random_qkv(seed=6, batch=1, q_len=2, kv_len=TK, num_heads=1,
                                 head_dim=HEAD_DIM)
  position_kernel = np.eye(HEAD_DIM, dtype=np.float32)[None] * 20  # tanh(20 q) ~ sign(q)
  sign = np.sign(np.asarray(query[0, 0, 0]))
  centre = 3.0 / TK
  center_vector = sign * np.log(centre / (1 - centre)) / HEAD_DIM
  window_vector = sign * -4.0 / HEAD_DIM  # D_i = T sigmoid(-4): sigma below 0.1 positions
  out = jit_call(
      gaussian_local_attention, query[:, :1], jnp.zeros_like(key), value,
      position_kernel=position_kernel,
      center_vector=center_vector[None].astype(np.float32),
      window_vector=window_vector[None].astype(np.float32))
  assert_close(out[0, 0, 0], value[0, 3, 0], rtol=1e-3, atol=1e-3)


@pytest.mark.property("gaussian_local")
@pytest.mark.parametrize("argument, shape", [("position_kernel", (H, HEAD_DIM, HEAD_DIM + 1)),
                                             ("center_vector", (H + 1, HEAD_DIM)),
                                             ("window_vector", (HEAD_DIM,))])
def test_gaussian_local_rejects_bad_shapes(argument, shape):
  query, key, value = random_qkv(batch=B, q_len=TQ, num_heads=H, head_dim=HEAD_DIM)
  arrays = dict(random_predictor(2), **{argument: np.zeros(shape, np.float32)})
  with pytest.raises(ValueError, match=argument):
    gaussian_local_attention(query, key, value, **arrays)


@pytest.mark.property("gaussian_local")
def test_gaussian_local_rejects_lengths_of_a_bad_shape():
  query, key, value = random_qkv(batch=B, q_len=TQ, num_heads=H, head_dim=HEAD_DIM)
  with pytest.raises(ValueError, match="key_value_seq_lengths"):
    gaussian_local_attention(query, key, value, key_value_seq_lengths=jnp.array([[3]]),
                             **random_predictor(2))


@pytest.mark.property("gaussian_local")
def test_gaussian_local_layer_learns_its_predictor():
  layer = MultiHeadAttention(num_heads=2, attention="gaussian_local")
  x = jax.random.normal(jax.random.PRNGKey(0), (2, 6, 16))
  params = jit_init(layer, jax.random.PRNGKey(1), x)["params"]
  assert params["variant"]["position_kernel"].shape == (2, 8, 8)
  loss = lambda p: jnp.sum(layer.apply({"params": p}, x, is_causal=True) ** 2)
  grads = jax.jit(jax.grad(loss))(params)
  assert all(np.abs(np.asarray(g)).max() > 0 for g in jax.tree.leaves(grads["variant"]))
