"""masked_softmax: agrees with jax.nn.softmax where defined, zeros where nothing is allowed;
its log-sum-exp agrees with jax.nn.logsumexp, finite where nothing is allowed."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_jax.core import (MASKED_LOGSUMEXP, logsumexp_residual, masked_softmax,
                                masked_softmax_and_logsumexp)


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


def test_logsumexp_equals_jax_nn_over_the_allowed_entries_and_is_finite_on_empty_rows():
  logits = jax.random.normal(jax.random.PRNGKey(5), (3, 5)) * 10
  mask = jnp.array([[1, 1, 1, 1, 1], [1, 0, 1, 0, 0], [0, 0, 0, 0, 0]], bool)
  weights, lse = masked_softmax_and_logsumexp(logits, mask)
  np.testing.assert_array_equal(weights, masked_softmax(logits, mask))
  assert lse.shape == (3,) and lse.dtype == jnp.float32
  for row in range(2):
    expected = jax.nn.logsumexp(logits[row][np.asarray(mask[row])])
    np.testing.assert_allclose(lse[row], expected, rtol=1e-6)
  # log 0 is reported as jax.nn's mask fill (finite), not -inf.
  assert lse[2] == MASKED_LOGSUMEXP == np.float32(-0.7) * np.finfo(np.float32).max


def test_logsumexp_gradient_is_the_weights_and_zero_on_empty_rows():
  logits = jax.random.normal(jax.random.PRNGKey(6), (3, 6)) * 3
  mask = jax.random.bernoulli(jax.random.PRNGKey(7), 0.6, (3, 6)).at[:2, 0].set(True)
  mask = mask.at[2].set(False)
  cotangent = jnp.array([0.5, -2.0, 3.0])
  grad = jax.grad(lambda l: jnp.sum(masked_softmax_and_logsumexp(l, mask)[1] * cotangent))(logits)
  np.testing.assert_allclose(grad, masked_softmax(logits, mask) * cotangent[:, None], rtol=1e-6)
  np.testing.assert_array_equal(grad[2], 0.0)


def test_finite_under_debug_infs_with_a_fully_masked_row():
  """Masked logits take a finite fill, so jax.debug_infs (which checks every
  operation run eagerly) finds nothing, forward or backward."""
  logits = jnp.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
  mask = jnp.array([[True, False, True], [False, False, False]])
  with jax.debug_infs(True):
    weights, lse = masked_softmax_and_logsumexp(logits, mask)
    grad = jax.grad(lambda l: jnp.sum(masked_softmax(l, mask) * jnp.arange(3.0)))(logits)
  np.testing.assert_array_equal(weights[1], 0.0)
  np.testing.assert_array_equal(grad[1], 0.0)
  assert np.isfinite(lse[1])


@pytest.mark.parametrize("with_mask", [False, True])
def test_differentiating_the_logsumexp_too_saves_nothing_more(with_mask):
  """d lse = <t, weights> is a term of d weights: reverse mode keeps the same arrays."""
  from jax._src.ad_checkpoint import saved_residuals  # pylint: disable=import-outside-toplevel
  shape = (2, 3, 64, 80)
  logits = jax.random.normal(jax.random.PRNGKey(8), shape)
  mask = jnp.ones(shape[-2:], bool) if with_mask else None
  saved = lambda fn: sorted((aval.shape, str(aval.dtype)) for aval, _ in saved_residuals(fn, logits))
  both = lambda l: sum(jnp.sum(x) for x in masked_softmax_and_logsumexp(l, mask))
  weights_alone = lambda l: jnp.sum(masked_softmax(l, mask))
  assert saved(both) == saved(weights_alone)
  if not with_mask:
    assert saved(both) == [(shape, "float32")]


def test_residual_dtype_clips_into_its_finite_range():
  lse = jnp.array([MASKED_LOGSUMEXP, 3.25])
  np.testing.assert_array_equal(logsumexp_residual(lse, jnp.float32), lse)
  np.testing.assert_array_equal(logsumexp_residual(lse, jnp.float16),
                                jnp.array([-65504.0, 3.25], jnp.float16))
  assert logsumexp_residual(lse, jnp.bfloat16).dtype == jnp.bfloat16
  assert np.isfinite(np.asarray(logsumexp_residual(lse, jnp.bfloat16), np.float32)).all()
