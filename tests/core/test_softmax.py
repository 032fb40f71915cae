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


def test_gradients_equal_jax_nn_softmax_over_the_allowed_entries():
  logits = jax.random.normal(jax.random.PRNGKey(1), (4, 6)) * 3
  mask = jax.random.bernoulli(jax.random.PRNGKey(2), 0.7, (4, 6)).at[:, 0].set(True)
  cotangent = jax.random.normal(jax.random.PRNGKey(3), (4, 6))
  ours = jax.grad(lambda l: jnp.sum(masked_softmax(l, mask) * cotangent))(logits)
  reference = jax.grad(
      lambda l: jnp.sum(jax.nn.softmax(jnp.where(mask, l, -jnp.inf)) * cotangent))(logits)
  np.testing.assert_allclose(ours, jnp.where(mask, reference, 0.0), rtol=1e-5, atol=1e-6)
  # Second order too (the JVP rule is itself differentiable).
  hessian_diag = jax.grad(lambda l: jnp.sum(jax.grad(
      lambda m: jnp.sum(masked_softmax(m, mask) * cotangent))(l)))(logits)
  reference_diag = jax.grad(lambda l: jnp.sum(jnp.where(mask, jax.grad(
      lambda m: jnp.sum(jax.nn.softmax(jnp.where(mask, m, -jnp.inf)) * cotangent))(l), 0.0)))(
          logits)
  np.testing.assert_allclose(hessian_diag, jnp.where(mask, reference_diag, 0.0), rtol=1e-4,
                             atol=1e-5)


def test_backward_keeps_the_weights_alone():
  """Reverse mode saves the weights, not the exponentials and the quotient too:
  one logits-sized array without a mask, no more than jax.nn.softmax with one."""
  from jax._src.ad_checkpoint import saved_residuals  # pylint: disable=import-outside-toplevel
  shape = (2, 3, 64, 80)
  logits = jax.random.normal(jax.random.PRNGKey(4), shape)
  residuals = saved_residuals(masked_softmax, logits)
  assert [aval.shape for aval, _ in residuals] == [shape]

  mask = jnp.ones(shape[-2:], bool)
  size = lambda fn: sum(aval.size * aval.dtype.itemsize for aval, _ in saved_residuals(fn, logits))
  ours = size(lambda l: masked_softmax(l, mask))
  theirs = size(lambda l: jax.nn.softmax(jnp.where(mask, l, -jnp.inf)))
  assert ours <= theirs
