"""masked_softmax: agrees with jax.nn.softmax where defined, zeros where nothing is allowed."""

import jax
import jax.numpy as jnp
import numpy as np

from attention_jax.core import masked_softmax


def test_equals_softmax_over_the_allowed_entries():
  logits = jax.random.normal(jax.random.PRNGKey(0), (3, 5)) * 10
  mask = jnp.array([[1, 1, 1, 1, 1], [1, 0, 1, 0, 0], [0, 0, 0, 0, 1]], bool)
  weights = masked_softmax(logits, mask)
  for row in range(3):
    allowed = np.asarray(mask[row])
    expected = np.zeros(5)
    expected[allowed] = jax.nn.softmax(logits[row][allowed])
    np.testing.assert_allclose(weights[row], expected, rtol=1e-6, atol=1e-7)


def test_fully_masked_row_is_zero_with_zero_gradient():
  logits = jnp.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
  mask = jnp.array([[True, False, True], [False, False, False]])
  weights = masked_softmax(logits, mask)
  np.testing.assert_array_equal(weights[1], 0.0)
  grad = jax.grad(lambda l: jnp.sum(masked_softmax(l, mask) * jnp.arange(3.0)))(logits)
  assert np.all(np.isfinite(grad))
  np.testing.assert_array_equal(grad[1], 0.0)
  np.testing.assert_array_equal(grad[0, 1], 0.0)


def test_large_logits_are_stable_and_output_is_float32():
  logits = jnp.array([[100.0, 99.0]], jnp.bfloat16)
  weights = masked_softmax(logits)
  assert weights.dtype == jnp.float32
  np.testing.assert_allclose(weights, jax.nn.softmax(jnp.array([[0.0, -1.0]])), rtol=1e-2)
