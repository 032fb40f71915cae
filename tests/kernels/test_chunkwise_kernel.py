"""The chunkwise recurrence's Pallas kernels (kernels/chunkwise) in the Pallas
interpreters: the Triton (GPU) and Mosaic (TPU) kernels equal the pure-JAX
chunkwise form, outputs, final state and every gradient, for each kind of
recurrence; the mixers run their recurrence in them; bad options are refused."""

import functools

import jax
import jax.numpy as jnp
import pytest

from attention_jax import registry
from attention_jax.kernels.chunkwise import chunkwise_kernel
from attention_jax.variants.chunkwise import engine
from attention_testing import assert_close, forms_outputs_and_grads, recurrence_inputs

# T = 37: not a whole number of 16-token chunks; key and value widths that are
# not powers of two (the GPU wrapper pads them).
SHAPES = dict(batch=1, length=37, heads=2, key_dim=6, value_dim=5)


@pytest.mark.parametrize("backend, per_dimension, low_rank", [
    ("gpu", False, False), ("gpu", True, False), ("gpu", False, True), ("gpu", True, True),
    ("tpu", False, True), ("tpu", True, False),
], ids=["gpu-per_head", "gpu-per_dimension", "gpu-per_head_delta", "gpu-per_dimension_delta",
        "tpu-per_head_delta", "tpu-per_dimension"])
def test_kernels_equal_the_chunkwise_form_outputs_and_gradients(backend, per_dimension,
                                                                 low_rank):
  """From an initial state (as when a prompt is decoded): outputs, final state
  and the gradients of every input including the state."""
  arrays = recurrence_inputs(per_dimension, low_rank, **SHAPES) + (
      jax.random.normal(jax.random.PRNGKey(9), (1, 2, 6, 5)),)
  results = forms_outputs_and_grads(arrays, {
      "reference": functools.partial(engine.chunkwise_form, chunk_size=16),
      "kernel": functools.partial(chunkwise_kernel, backend=backend, chunk_size=16)})
  (out, final, grads), (kernel_out, kernel_final, kernel_grads) = results.values()
  assert_close(kernel_out, out, rtol=1e-4, atol=1e-4)
  assert_close(kernel_final, final, rtol=1e-4, atol=1e-4)
  for i, (a, b) in enumerate(zip(kernel_grads, grads)):
    assert_close(a, b, rtol=2e-4, atol=2e-4, err_msg=f"gradient {i}")


@pytest.mark.property("gla")
@pytest.mark.property("gated_delta_net")
@pytest.mark.property("mamba2")
@pytest.mark.parametrize("name, form", [("gla", "pallas_gpu"), ("gated_delta_net", "pallas_gpu"),
                                        ("mamba2", "pallas_gpu"), ("mamba2", "pallas_tpu")])
def test_mixers_run_their_recurrence_in_the_kernels(name, form):
  """The layer's outputs and parameter gradients with `form` equal the
  pure-JAX chunkwise form's (20 tokens in chunks of 16)."""
  x = jax.random.normal(jax.random.PRNGKey(0), (2, 20, 16))
  mixer = lambda form: registry.get_variant(name).module(num_heads=2, form=form, chunk_size=16)
  variables = jax.jit(lambda x: mixer("chunkwise").init(jax.random.PRNGKey(1), x,
                                                        is_causal=True))(x)

  def run(form, params):
    y = mixer(form).apply({"params": params}, x, is_causal=True)
    return jnp.sum(jnp.sin(y)), y

  grads, y = jax.jit(jax.grad(functools.partial(run, "chunkwise"), has_aux=True))(
      variables["params"])
  kernel_grads, kernel_y = jax.jit(jax.grad(functools.partial(run, form), has_aux=True))(
      variables["params"])
  assert_close(kernel_y, y, rtol=1e-4, atol=1e-4)
  jax.tree.map(lambda a, b: assert_close(a, b, rtol=2e-4, atol=2e-4), kernel_grads, grads)


def test_bad_options_name_themselves():
  query, key, value, log_decay, _, _ = recurrence_inputs(False, False, **SHAPES)
  with pytest.raises(ValueError, match="chunk_size must be a power of two of at least 16 for "
                                       "the GPU kernels .*, got 24"):
    chunkwise_kernel(query, key, value, log_decay, chunk_size=24)
  with pytest.raises(ValueError, match="chunk_size must be an int >= 1, got 0"):
    chunkwise_kernel(query, key, value, log_decay, backend="tpu", chunk_size=0)
  with pytest.raises(ValueError, match=r"backend must be one of \['gpu', 'tpu'\], got 'cuda'"):
    chunkwise_kernel(query, key, value, log_decay, backend="cuda")
  with pytest.raises(ValueError, match="log_decay must be"):
    chunkwise_kernel(query, key, value, log_decay[..., :1])
