"""Prior family: the Synthesizers (dense, random, factorised random)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attention_jax
from attention_jax.core import reference_attention
from attention_jax.variants import common
from attention_jax.variants.prior.synthesizer import (DenseSyntheticLogits,
                                                      FactorizedSyntheticLogits,
                                                      RandomSyntheticLogits, synthesizer_attention)
from attention_testing import (B, H, TK, TQ, VARIANT_MASK_CASES, assert_close, bias_and_mask,
                               jit_apply, jit_init, loop_mask, random_qkv)

SYNTHESIZERS = ["synthesizer_dense", "synthesizer_random", "synthesizer_factorized"]
ALL_SYNTHESIZERS = [pytest.mark.property(name) for name in SYNTHESIZERS]

MASK_CASES = VARIANT_MASK_CASES


def _with_marks(test):
  for mark in ALL_SYNTHESIZERS:
    test = mark(test)
  return test


@_with_marks
@pytest.mark.parametrize("case", sorted(MASK_CASES))
@pytest.mark.parametrize("with_bias_and_mask", [False, True])
def test_dot_product_logits_give_dot_product_attention(case, with_bias_and_mask):
  """With synthetic logits q k^T * scale, the synthesizer is dense attention: outputs
  equal the reference under the loop-built mask, and gradients w.r.t. the values and
  the logits equal the reference's w.r.t. its values and an additive bias."""
  kwargs, mask_args = MASK_CASES[case]
  query, key, value = random_qkv(batch=B, q_len=TQ, kv_len=TK, num_heads=H, num_kv_heads=2,
                                 value_dim=5)
  allowed = loop_mask(B, TQ, TK, **mask_args)
  bias, extra_mask = bias_and_mask(seed=1)
  if with_bias_and_mask:
    allowed = allowed & np.asarray(extra_mask)
  else:
    bias, extra_mask = jnp.zeros_like(bias), None
  logits = jnp.einsum("bqhd,bkhd->bhqk", query, jnp.repeat(key, 2, axis=2)) * 0.3
  cotangent = jax.random.normal(jax.random.PRNGKey(42), (B, TQ, H, 5))

  def ours(v, l):
    out = synthesizer_attention(query, key, v, bias, extra_mask, synthetic_logits=l,
                                **kwargs)
    return jnp.sum(out * cotangent), out

  def oracle(v, l):
    # Zero queries make the reference's logits exactly its additive bias l + bias.
    out = reference_attention(jnp.zeros_like(query), key, v, l + bias, jnp.array(allowed))
    return jnp.sum(out * cotangent), out

  (_, out), grads = jax.jit(jax.value_and_grad(ours, argnums=(0, 1), has_aux=True))(value, logits)
  (_, want), want_grads = jax.value_and_grad(oracle, argnums=(0, 1), has_aux=True)(value, logits)
  dense = reference_attention(query, key, value, bias, jnp.array(allowed), scale=0.3)
  assert_close(out, dense)
  assert_close(out, want)
  for name, got, expected in zip(["value", "logits"], grads, want_grads):
    assert_close(got, expected, err_msg=f"gradient of {name}")


@pytest.mark.property("synthesizer_random")
@pytest.mark.parametrize("case", ["plain", "everything"])
def test_mixed_dot_product_logits_are_added_before_one_softmax(case):
  """mix_dot_product: softmax(R + q k^T * scale + bias) v, grouped K/V heads,
  against the reference with R + bias as its additive bias."""
  kwargs, mask_args = MASK_CASES[case]
  query, key, value = random_qkv(seed=3, batch=B, q_len=TQ, kv_len=TK, num_heads=H,
                                 num_kv_heads=2)
  synthetic = jax.random.normal(jax.random.PRNGKey(4), (1, H, TQ, TK))
  bias, _ = bias_and_mask(seed=2)
  allowed = jnp.array(loop_mask(B, TQ, TK, **mask_args))
  out = synthesizer_attention(query, key, value, bias, synthetic_logits=synthetic,
                              mix_dot_product=True, scale=0.4, **kwargs)
  expected = reference_attention(query, key, value, synthetic + bias, allowed, scale=0.4)
  assert_close(out, expected)
  # The default scale is 1/sqrt(D).
  default = synthesizer_attention(query, key, value, synthetic_logits=synthetic,
                                  mix_dot_product=True)
  assert_close(default, reference_attention(query, key, value, synthetic, scale=8 ** -0.5))


@_with_marks
def test_masked_keys_get_zero_weight_and_padded_queries_output_zeros():
  query, key, value = random_qkv(batch=2, q_len=6, num_heads=2, head_dim=4)
  logits = jax.random.normal(jax.random.PRNGKey(1), (1, 2, 6, 6)) * 3.0
  lengths = jnp.array([6, 4])
  attend = jax.jit(lambda v: synthesizer_attention(
      query, key, v, is_causal=True, query_seq_lengths=lengths, key_value_seq_lengths=lengths,
      synthetic_logits=logits))
  # d out[b, i, h, 0] / d value[b, j, h, 0] is head h's weight of key j for query i.
  jacobian = np.asarray(jax.jit(jax.jacobian(lambda v: attend(v)[..., 0]))(value))[..., 0]
  weights = np.einsum("bihbjh->bhij", jacobian)  # [B, H, Tq, Tk]
  future = np.triu(np.ones((6, 6), bool), k=1)
  assert np.all(weights[:, :, future] == 0)  # Causal: no weight on future keys.
  assert np.all(weights[1, :, :, 4:] == 0)  # Padded keys get no weight...
  assert np.all(weights[1, :, 4:] == 0)  # ... and padded queries none at all.
  assert_close(weights[0].sum(-1), np.ones((2, 6)))
  assert_close(weights[1, :, :4].sum(-1), np.ones((2, 4)))
  assert np.all(np.asarray(attend(value))[1, 4:] == 0)


@pytest.mark.property("synthesizer_dense")
def test_dense_logits_are_an_mlp_of_each_token_alone():
  query, key, value = random_qkv(batch=2, q_len=5, kv_len=6, num_heads=2, head_dim=4)
  module = DenseSyntheticLogits(max_length=8, hidden_dim=3)
  variables = jit_init(module, jax.random.PRNGKey(0), query, key, value)
  p = {k: np.asarray(v) for k, v in variables["params"].items()}
  logits = jit_apply(module, variables, query, key, value)["synthetic_logits"]
  assert logits.shape == (2, 2, 5, 6)
  x = np.asarray(query)
  for b, i, h in np.ndindex(2, 5, 2):
    hidden = np.maximum(x[b, i, h] @ p["hidden_kernel"][h] + p["hidden_bias"][h], 0)
    row = hidden @ p["logits_kernel"][h] + p["logits_bias"][h]
    assert_close(logits[b, h, i], row[:6], rtol=1e-4, atol=1e-5)


@pytest.mark.property("synthesizer_random")
@pytest.mark.property("synthesizer_factorized")
@pytest.mark.parametrize("module_class", [RandomSyntheticLogits,
                                          FactorizedSyntheticLogits])
def test_fixed_random_logits_are_kept_per_layer_and_position_indexed(module_class):
  short = random_qkv(batch=1, q_len=4, kv_len=3, num_heads=2)
  long = random_qkv(batch=1, q_len=6, kv_len=7, num_heads=2)
  module = module_class(max_length=8, trainable=False)
  variables = jit_init(module, jax.random.PRNGKey(0), *short)
  # Not a parameter: the layer's draw, kept in the "random" collection.
  assert "params" not in variables and common.RANDOM_COLLECTION in variables
  logits = lambda qkv: jit_apply(module, variables, *qkv)["synthetic_logits"]
  first = logits(short)
  assert_close(first, logits(long)[:, :, :4, :3])  # R[h, i, j].
  # Never redrawn, not even by training calls with an "attention" stream.
  trained, _ = jit_apply(module, variables, *short, deterministic=False,
                            rngs={"attention": jax.random.PRNGKey(5)},
                            mutable=[common.RANDOM_COLLECTION])
  np.testing.assert_array_equal(np.asarray(trained["synthetic_logits"]), np.asarray(first))
  # Another initialisation (another layer, another seed) draws another matrix.
  other = jit_apply(module, jit_init(module, jax.random.PRNGKey(1), *short), *short)["synthetic_logits"]
  assert np.abs(np.asarray(first - other)).max() > 0.1


@pytest.mark.property("synthesizer_factorized")
def test_factorized_logits_have_rank_k():
  query, key, value = random_qkv(batch=1, q_len=12, num_heads=2)
  module = FactorizedSyntheticLogits(max_length=16, rank=3)
  logits, _ = module.init_with_output(jax.random.PRNGKey(0), query, key, value)
  for h in range(2):
    assert np.linalg.matrix_rank(np.asarray(logits["synthetic_logits"][0, h]), tol=1e-4) == 3


@_with_marks
@pytest.mark.parametrize("name", SYNTHESIZERS)
def test_trains_through_multi_head_attention_under_jit(name):
  x = jax.random.normal(jax.random.PRNGKey(0), (2, 10, 16))
  module = attention_jax.MultiHeadAttention(num_heads=4, num_kv_heads=2, attention=name,
                                            attention_options={"max_length": 12},
                                            dropout_rate=0.1)
  variables = jit_init(module, jax.random.PRNGKey(1), x)

  def loss(variables):
    out = jit_apply(module, variables, x, is_causal=True, key_value_seq_lengths=jnp.array([10, 7]),
                       deterministic=False, rngs={"dropout": jax.random.PRNGKey(2)})
    return jnp.sum(out ** 2)

  grads = jax.jit(jax.grad(loss))(variables)["params"]["variant"]
  assert grads
  for param_name, grad in grads.items():
    assert np.abs(np.asarray(grad)).max() > 0, param_name


def test_lengths_past_max_length_are_refused():
  x = jnp.ones((1, 10, 8))
  for name, match in [("synthesizer_dense", "max_length=8 positions, got key length Tk=10"),
                      ("synthesizer_random", "max_length=8 positions, got query length Tq=10"),
                      ("synthesizer_factorized", "max_length=8 positions, got query length Tq=10")]:
    module = attention_jax.MultiHeadAttention(num_heads=2, attention=name,
                                              attention_options={"max_length": 8})
    with pytest.raises(ValueError, match=match):
      jit_init(module, jax.random.PRNGKey(0), x)
  query, key, value = random_qkv(batch=1, q_len=4, kv_len=10, num_heads=2)
  with pytest.raises(ValueError, match="got key length Tk=10"):
    RandomSyntheticLogits(max_length=8).init(jax.random.PRNGKey(0), query, key, value)
  with pytest.raises(ValueError, match="rank must be an int >= 1, got 0"):
    FactorizedSyntheticLogits(max_length=16, rank=0).init(jax.random.PRNGKey(0), query,
                                                                 key, value)
  with pytest.raises(ValueError, match=r"synthetic_logits must be \[B\|1, H, Tq, Tk\]"):
    synthesizer_attention(query, key, value, synthetic_logits=jnp.ones((1, 2, 4, 9)))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.int32])
def test_a_mask_that_is_not_boolean_is_refused(dtype):
  """A mask is boolean, True may attend, as `dot_product_attention` demands:
  an additive mask (0 allowed, -1e9 masked) cast to bool would allow exactly
  the masked keys. Through `synthesizer_attention` and the hard-coded
  Gaussian's dense form (window=None), which is it."""
  from attention_jax.variants.prior.hard_coded import hard_coded_gaussian_attention
  query, key, value = random_qkv(batch=1, q_len=4, kv_len=6, num_heads=2)
  additive = jnp.where(jnp.arange(6) < 4, 0, -10 ** 9).astype(dtype)[None, None, None, :]
  message = rf"mask must be boolean \(True may attend\), got dtype {jnp.dtype(dtype).name}"
  with pytest.raises(ValueError, match=message):
    synthesizer_attention(query, key, value, mask=additive,
                          synthetic_logits=jnp.zeros((1, 2, 4, 6)))
  with pytest.raises(ValueError, match=message):
    hard_coded_gaussian_attention(query, key, value, mask=additive, window=None)
