"""conditional_adapter (Pilault et al. 2021): a block-diagonal bias on the logits,
modulated per example by a FiLM of its task's embedding."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attention_jax
from attention_jax.layers.attention import MultiHeadAttention
from attention_jax.variants.prior.biases import (conditional_adapter_attention,
                                                 conditional_block_bias)
from attention_testing import (B, H, VARIANT_MASK_CASES, as_float64, assert_close,
                               assert_same_outputs_and_grads, jit_apply, jit_call, jit_init,
                               loop_mask, random_qkv)
from test_priors import np_masked_attention

T, BLOCK, NUM_BLOCKS, TASKS, TASK_DIM = 9, 3, 3, 3, 5  # T = TK of the mask grid
# The grid's query segments are shorter than T: self-attention takes no (q, kv) pair.
MASK_CASES = {name: case for name, case in VARIANT_MASK_CASES.items() if name != "everything"}


def random_arrays(seed, gamma_one_beta_zero=False):
  rng = np.random.default_rng(seed)
  arrays = dict(block_logits=rng.normal(size=(H, NUM_BLOCKS, BLOCK, BLOCK)) * 2,
                task_embeddings=rng.normal(size=(TASKS, TASK_DIM)),
                film_kernel=rng.normal(size=(TASK_DIM, 2 * BLOCK)),
                film_bias=rng.normal(size=(2 * BLOCK,)))
  if gamma_one_beta_zero:
    arrays.update(film_kernel=np.zeros((TASK_DIM, 2 * BLOCK)),
                  film_bias=np.concatenate([np.ones(BLOCK), np.zeros(BLOCK)]))
  return {name: jnp.asarray(a, jnp.float32) for name, a in arrays.items()}


def np_task_bias(arrays, task_ids):
  """M(z) written out entry by entry: [B, H, T, T] float64."""
  a = {name: as_float64(x) for name, x in arrays.items()}
  film = a["task_embeddings"][task_ids] @ a["film_kernel"] + a["film_bias"]
  gamma, beta = film[:, :BLOCK], film[:, BLOCK:]
  bias = np.zeros((len(task_ids), H, T, T))
  for b in range(len(task_ids)):
    for i in range(T):
      for j in range(T):
        if i // BLOCK == j // BLOCK:
          bias[b, :, i, j] = (a["block_logits"][:, i // BLOCK, i % BLOCK, j % BLOCK]
                              * gamma[b, j % BLOCK] + beta[b, j % BLOCK])
  return bias


@pytest.mark.property("conditional_adapter")
@pytest.mark.parametrize("case", ["plain", "causal", "lengths"])
def test_conditional_adapter_with_zero_blocks_and_identity_film_is_dot_product(case):
  """gamma = 1, beta = 0 leaves A unmodulated, so with A = 0 (the initial layer)
  it is vanilla; outputs and gradients."""
  query, key, value = random_qkv(seed=1, batch=B, q_len=T, num_heads=H, num_kv_heads=2)
  arrays = dict(random_arrays(0, gamma_one_beta_zero=True),
                block_logits=jnp.zeros((H, NUM_BLOCKS, BLOCK, BLOCK)))
  kwargs = MASK_CASES[case][0]
  ours = lambda q, k, v: conditional_adapter_attention(
      q, k, v, task_ids=jnp.array([0, 2]), **arrays, **kwargs)
  theirs = lambda q, k, v: attention_jax.dot_product_attention(q, k, v, **kwargs)
  assert_same_outputs_and_grads(ours, theirs, query, key, value)


@pytest.mark.property("conditional_adapter")
def test_conditional_adapter_identity_film_adds_the_blocks_unmodulated():
  query, key, value = random_qkv(seed=2, batch=B, q_len=T, num_heads=H)
  arrays = random_arrays(1, gamma_one_beta_zero=True)
  out = jit_call(conditional_adapter_attention, query, key, value, task_ids=jnp.array([1, 2]),
                 **arrays)

  @jax.jit
  def written_out(query, key, value, block_logits):
    """Dot-product attention under the block bias with gamma = 1, beta = 0."""
    bias = conditional_block_bias(block_logits, jnp.ones((B, BLOCK)), jnp.zeros((B, BLOCK)), T)
    return attention_jax.dot_product_attention(query, key, value, bias)

  want = written_out(query, key, value, arrays["block_logits"])
  assert_close(out, want)


@pytest.mark.property("conditional_adapter")
@pytest.mark.parametrize("case", sorted(MASK_CASES))
def test_conditional_adapter_against_numpy(case):
  query, key, value = random_qkv(seed=3, batch=B, q_len=T, num_heads=H, num_kv_heads=2)
  arrays = random_arrays(2)
  task_ids = np.array([2, 0])
  kwargs, mask_args = MASK_CASES[case]
  out = jax.jit(lambda q, k, v, ids: conditional_adapter_attention(
      q, k, v, task_ids=ids, **arrays, **kwargs))(query, key, value, jnp.asarray(task_ids))
  scores = np.einsum("bqhd,bkhd->bhqk", as_float64(query),
                     np.repeat(as_float64(key), 2, axis=2)) / np.sqrt(query.shape[-1])
  allowed = loop_mask(B, T, T, **mask_args)
  want = np_masked_attention(scores + np_task_bias(arrays, task_ids), allowed, value, H)
  assert_close(out, want, rtol=1e-4, atol=1e-5)


@pytest.mark.property("conditional_adapter")
def test_conditional_adapter_tasks_differ_and_default_to_task_zero():
  query, key, value = random_qkv(seed=4, batch=1, q_len=T, num_heads=H)
  arrays = random_arrays(3)
  run = jax.jit(lambda ids: conditional_adapter_attention(query, key, value, task_ids=ids,
                                                          **arrays))
  outputs = [np.asarray(run(jnp.array([task]))) for task in range(TASKS)]
  for a in range(TASKS):
    for b in range(a + 1, TASKS):
      assert np.abs(outputs[a] - outputs[b]).max() > 1e-3
  assert_close(jit_call(conditional_adapter_attention, query, key, value, **arrays), outputs[0])


@pytest.mark.property("conditional_adapter")
@pytest.mark.parametrize("change, message", [
    (dict(task_ids=jnp.array([0, 3])), "task_ids"),
    (dict(task_ids=jnp.array([-1, 0])), "task_ids"),
    (dict(task_ids=jnp.array([0])), "task_ids"),
    (dict(task_ids=jnp.array([0.0, 1.0])), "task_ids"),
    (dict(block_logits=jnp.zeros((H, 2, BLOCK, BLOCK))), "block_logits"),
    (dict(block_logits=jnp.zeros((H + 1, NUM_BLOCKS, BLOCK, BLOCK))), "block_logits"),
    (dict(film_kernel=jnp.zeros((TASK_DIM, 2 * BLOCK + 2)),
          film_bias=jnp.zeros((2 * BLOCK + 2,))), "film_kernel"),
    (dict(film_bias=jnp.zeros((3,))), "film_bias"),
])
def test_conditional_adapter_rejects_bad_arguments(change, message):
  query, key, value = random_qkv(batch=B, q_len=T, num_heads=H)
  arrays = dict(random_arrays(4), task_ids=jnp.array([0, 1]))
  arrays.update(change)
  with pytest.raises(ValueError, match=message):
    conditional_adapter_attention(query, key, value, **arrays)


@pytest.mark.property("conditional_adapter")
def test_conditional_adapter_layer_takes_task_ids_per_call():
  layer = MultiHeadAttention(num_heads=2, attention="conditional_adapter",
                             attention_options=dict(num_tasks=3, block_size=4, max_length=8))
  x = jax.random.normal(jax.random.PRNGKey(0), (2, 8, 16))
  params = jit_init(layer, jax.random.PRNGKey(1), x)["params"]
  vanilla = MultiHeadAttention(num_heads=2).apply(
      {"params": {k: v for k, v in params.items() if k != "variant"}}, x)
  assert_close(jit_apply(layer, {"params": params}, x), vanilla)  # a new layer is vanilla
  params["variant"]["block_logits"] = jax.random.normal(jax.random.PRNGKey(2), (2, 2, 4, 4))
  params["variant"]["film_kernel"] = jax.random.normal(jax.random.PRNGKey(3), (32, 8))
  apply = jax.jit(lambda ids: layer.apply({"params": params}, x,
                                          attention_arguments={"task_ids": ids}))
  assert np.abs(np.asarray(apply(jnp.array([0, 0])) - apply(jnp.array([1, 2])))).max() > 1e-3
