"""Properties every registered variant must have, walked from the registry.

* it is reachable by name and runs under `jax.jit` as a Flax module, giving a
  finite output of the right shape (a variant with no test of its own here would
  still fail `tests/test_registry.py`);
* a variant registered as sub-quadratic never builds a T x T array, in the
  forward or the backward pass (checked on the traced program at T = 4096).
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_jax import registry
from attention_testing import largest_intermediate

EMBED, HEADS = 32, 2
# Variants that are exact dot-product attention or its head layouts; the rest
# of this file is about everything else.
SUBQUADRATIC = [n for n in registry.list_variants() if registry.get_variant(n).subquadratic]


def _module(name):
  spec = registry.get_variant(name)
  return spec.module(num_heads=HEADS)


def _loss_of_params(module, x):
  variables = jax.eval_shape(module.init, jax.random.PRNGKey(0), x)
  params = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), variables)

  def loss(params, x):
    return jnp.sum(module.apply(params, x) ** 2)

  return jax.grad(loss, argnums=(0, 1)), params


@pytest.mark.parametrize("name", registry.list_variants())
def test_runs_by_name_under_jit(name):
  x = jax.random.normal(jax.random.PRNGKey(1), (2, 256, EMBED))
  module = _module(name)
  variables = module.init(jax.random.PRNGKey(0), x)
  out = jax.jit(module.apply)(variables, x)
  assert out.shape == x.shape
  assert np.isfinite(np.asarray(out)).all()


@pytest.mark.parametrize("name", SUBQUADRATIC)
def test_subquadratic_variant_never_builds_a_length_squared_array(name):
  length = 4096
  x = jax.ShapeDtypeStruct((1, length, EMBED), jnp.float32)
  module = _module(name)
  grad_fn, params = _loss_of_params(module, jnp.zeros(x.shape, x.dtype))
  largest = largest_intermediate(grad_fn, params, jnp.zeros(x.shape, x.dtype))
  # A quarter of T^2 leaves room for bands and blocks (e.g. [H, T, 2w] windows)
  # while catching any T x T (or T x T/2) score matrix.
  assert largest < length * length // 4, (
      f"{name} builds an array of {largest} elements at T={length} (T^2 = {length ** 2})")
