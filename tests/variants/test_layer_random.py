"""`common.layer_random`: one random draw per layer, redrawn on schedule in
training, kept in evaluation, a function of (seed, layer, step)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_jax.variants import common
from attention_testing import jit_apply, jit_init


def _draw(key):
  return jax.random.normal(key, (4,))


class Drawer(nn.Module):
  """Returns its layer's random array; `redraw_every` as the variants take it."""

  redraw_every: int = 1

  @nn.compact
  def __call__(self, x, deterministic=True):
    return common.layer_random(self, "features", _draw, deterministic=deterministic,
                               redraw_every=self.redraw_every)


class TwoLayers(nn.Module):
  redraw_every: int = 1
  scan: bool = False

  @nn.compact
  def __call__(self, x, deterministic=True):
    if not self.scan:
      return jnp.stack([Drawer(self.redraw_every, name=f"layer_{i}")(x, deterministic)
                        for i in range(2)])

    class Step(nn.Module):
      redraw_every: int

      @nn.compact
      def __call__(self, carry, _):
        return carry, Drawer(self.redraw_every, name="layer")(carry, deterministic)

    scanned = nn.scan(Step, variable_axes={"params": 0, common.RANDOM_COLLECTION: 0},
                      split_rngs={"params": True, "attention": True}, length=2)
    return scanned(self.redraw_every, name="layers")(x, None)[1]


def _train_calls(model, variables, steps, seed=0):
  """The draws of `steps` training calls, the collection carried between them
  and the attention key a function of (seed, step), as the trainer does."""
  draws = []
  for step in range(steps):
    key = jax.random.fold_in(jax.random.key(seed), step)
    out, updates = jit_apply(model, variables, jnp.zeros(()), False, rngs={"attention": key},
                               mutable=[common.RANDOM_COLLECTION])
    variables = {**variables, **updates}
    draws.append(np.asarray(out))
  return draws, variables


@pytest.mark.parametrize("scan", [False, True])
def test_each_layer_draws_its_own_array_unrolled_and_scanned(scan):
  model = TwoLayers(redraw_every=0, scan=scan)
  variables = jit_init(model, {"params": jax.random.key(0)}, jnp.zeros(()))
  out = np.asarray(jit_apply(model, variables, jnp.zeros(())))
  assert out.shape == (2, 4)
  assert not np.allclose(out[0], out[1])
  # redraw_every=0: training never redraws.
  draws, _ = _train_calls(model, variables, 3)
  for draw in draws:
    np.testing.assert_array_equal(draw, out)


@pytest.mark.parametrize("scan", [False, True])
def test_training_redraws_at_calls_0_n_2n_and_evaluation_keeps_the_last_draw(scan):
  model = TwoLayers(redraw_every=3, scan=scan)
  variables = jit_init(model, {"params": jax.random.key(0)}, jnp.zeros(()))
  initial = np.asarray(jit_apply(model, variables, jnp.zeros(())))
  draws, trained = _train_calls(model, variables, 7)
  changed = [not np.array_equal(draws[i], draws[i - 1] if i else initial) for i in range(7)]
  assert changed == [True, False, False, True, False, False, True]
  assert not np.allclose(draws[0][0], draws[0][1])  # per layer at every redraw
  # Evaluation uses the kept (last) draw, the same in every call.
  for _ in range(2):
    np.testing.assert_array_equal(np.asarray(jit_apply(model, trained, jnp.zeros(()))), draws[-1])


def test_draws_are_a_function_of_seed_layer_and_step():
  model = TwoLayers(redraw_every=1)
  variables = jit_init(model, {"params": jax.random.key(0)}, jnp.zeros(()))
  full, _ = _train_calls(model, variables, 4)
  again, _ = _train_calls(model, variables, 4)
  np.testing.assert_array_equal(np.stack(full), np.stack(again))
  other_seed, _ = _train_calls(model, variables, 4, seed=1)
  assert not np.allclose(np.stack(full), np.stack(other_seed))
  # A run resumed from the collection after step 2 draws what the uninterrupted one drew.
  _, after_two = _train_calls(model, variables, 2)
  key = jax.random.fold_in(jax.random.key(0), 2)
  resumed = jit_apply(model, after_two, jnp.zeros(()), False, rngs={"attention": key},
                        mutable=[common.RANDOM_COLLECTION])[0]
  np.testing.assert_array_equal(np.asarray(resumed), full[2])


def test_without_the_collection_or_the_stream_the_draw_is_fixed_per_layer():
  model = TwoLayers(redraw_every=1)
  variables = jit_init(model, {"params": jax.random.key(0)}, jnp.zeros(()))
  # No "attention" stream: training keeps the initial draw.
  kept = np.asarray(jit_apply(model, variables, jnp.zeros(()), False,
                                mutable=[common.RANDOM_COLLECTION])[0])
  np.testing.assert_array_equal(kept, np.asarray(jit_apply(model, variables, jnp.zeros(()))))
  # Only the parameters: a fixed draw per layer path, never redrawn.
  bare = jit_apply(model, {"params": variables.get("params", {})}, jnp.zeros(()), False,
                     rngs={"attention": jax.random.key(5)})
  bare_again = jit_apply(model, {"params": {}}, jnp.zeros(()))
  np.testing.assert_array_equal(np.asarray(bare), np.asarray(bare_again))
  assert not np.allclose(bare[0], bare[1])


def test_a_negative_redraw_interval_is_refused_by_name():
  with pytest.raises(ValueError, match="redraw_every"):
    TwoLayers(redraw_every=-1).init({"params": jax.random.key(0)}, jnp.zeros(()))
