"""How `dot_product_attention` chooses and reports its implementation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attention_jax
from attention_jax.core import implementations
from attention_jax.variants import dense
from attention_jax.variants.dense import prepare_inputs, select_implementation
from attention_testing import random_qkv


def _inputs(q_len, kv_len, head_dim=8):
  query = jnp.zeros((1, q_len, 2, head_dim))
  key = value = jnp.zeros((1, kv_len, 2, head_dim))
  return prepare_inputs(query, key, value)[0]


def test_cpu_prefers_dense_for_short_and_blockwise_for_long_sequences():
  assert jax.default_backend() == "cpu"
  assert select_implementation(_inputs(64, 64)) == ("xla", None)
  assert select_implementation(_inputs(1024, 1024)) == ("blockwise", None)


def test_dropout_selects_the_implementation_that_computes_it():
  assert select_implementation(_inputs(1024, 1024), dropout=True) == ("xla", None)
  with pytest.raises(ValueError, match="dropout on attention weights needs implementation='xla', "
                                       "got 'blockwise'"):
    select_implementation(_inputs(8, 8), "blockwise", dropout=True)


def test_explicit_names_are_checked():
  with pytest.raises(ValueError, match=r"implementation must be one of \[.*'blockwise'.*'xla'.*\] "
                                       "or None, got 'flashy'"):
    select_implementation(_inputs(8, 8), "flashy")
  with pytest.raises(ValueError, match="implementation 'cudnn' is not available on backend 'cpu'"):
    select_implementation(_inputs(8, 8), "cudnn")


@pytest.fixture
def picky_implementation(monkeypatch):
  """A top-priority implementation that declines head dims above 8."""
  # The table is core's (dense re-exports it): a copy there keeps "picky" out of other tests.
  monkeypatch.setattr(implementations, "_IMPLEMENTATIONS", dict(implementations._IMPLEMENTATIONS))
  dense.register_implementation(
      "picky", lambda inputs: dense._xla_attention(inputs) * 0.0, priority=100,
      rejects=lambda inputs: (None if inputs.query.shape[-1] <= 8 else
                              f"head dim {inputs.query.shape[-1]} is above the limit 8"))
  return "picky"


def test_a_declining_implementation_falls_back_visibly(picky_implementation):
  assert select_implementation(_inputs(16, 16, head_dim=8)) == (picky_implementation, None)
  name, note = select_implementation(_inputs(16, 16, head_dim=16))
  assert name == "xla"
  assert note == "'picky' declined: head dim 16 is above the limit 8"

  query, key, value = random_qkv(head_dim=16)
  with pytest.warns(UserWarning, match="using implementation 'xla'; 'picky' declined: head dim "
                                       "16 is above the limit 8"):
    out = attention_jax.dot_product_attention(query, key, value)
  np.testing.assert_allclose(out, attention_jax.reference_attention(query, key, value),
                             rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError, match="implementation 'picky' cannot take these inputs: head "
                                       "dim 16 is above the limit 8"):
    attention_jax.dot_product_attention(query, key, value, implementation="picky")


def test_pallas_is_an_accelerator_implementation_that_declines_what_its_kernel_cannot_take():
  from attention_jax.kernels import flash_attention  # pylint: disable=import-outside-toplevel
  with pytest.raises(ValueError, match="implementation 'pallas' is not available on backend 'cpu'"):
    select_implementation(_inputs(8, 8), "pallas")
  # The Triton kernel's limits, which select_implementation consults on GPU.
  assert flash_attention.pallas_gpu.gpu_rejects(_inputs(8, 8)) is None
  assert "head dim of 1 to 256" in flash_attention.pallas_gpu.gpu_rejects(_inputs(8, 8, 512))
  assert "up to 256" in flash_attention.pallas_tpu.tpu_rejects(_inputs(8, 8, 512))
