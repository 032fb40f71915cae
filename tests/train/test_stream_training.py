"""Training on a stream of consecutive segments: the train and eval steps carry
a model's "memory" collection (Transformer-XL) from batch to batch, and the
trainer runs the character corpus in bits per character."""

import functools
import math
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_jax import train
from attention_jax.models import build_model
from attention_jax.train.trainer import train_and_evaluate

B, T, VOCAB, M = 4, 8, 13, 8


def _xl_model(memory_length=M):
  return build_model(dict(kind="language_model", vocab_size=VOCAB, num_layers=2, embed_dim=16,
                          num_heads=2, mlp_dim=32, max_length=T, dropout_rate=0.0,
                          position="xl_relative", attention="transformer_xl",
                          attention_options={"memory_length": memory_length}))


def _segments(steps, seed=0):
  rng = np.random.default_rng(seed)
  return [dict(inputs=rng.integers(1, VOCAB, (B, T)).astype(np.int32),
               weight=np.ones(B, np.float32)) for _ in range(steps)]


def _state(model, memory_rows=B):
  objective = train.get_objective("language_model")
  mesh = train.make_mesh((1, 1, 1), devices=jax.devices()[:1])
  optimizer = train.make_optimizer(dict(warmup_steps=1, num_train_steps=10, learning_rate=1e-2))
  state, shardings = train.create_sharded_state(model, optimizer, _segments(1)[0], mesh,
                                                objective=objective, memory_rows=memory_rows)
  return state, shardings, mesh, optimizer, objective


def _manual_losses(model, params, segments):
  """Mean next-token cross-entropy per segment, applying the model segment by
  segment with its memory carried by hand from an empty one."""
  @jax.jit
  def segment_loss(variables, inputs):
    logits, updates = model.apply(variables, inputs, mutable=["memory"])
    log_probs = jax.nn.log_softmax(logits[:, :-1])
    loss = -jnp.mean(jnp.take_along_axis(log_probs, inputs[:, 1:, None], -1))
    return loss, updates["memory"]

  memory, losses = None, []
  for batch in segments:
    variables = {"params": params} if memory is None else {"params": params, "memory": memory}
    loss, memory = segment_loss(variables, jnp.asarray(batch["inputs"]))
    losses.append(float(loss))
  return losses


def test_the_state_carries_an_empty_memory_of_a_row_per_stream():
  state, shardings, *_ = _state(_xl_model())
  memory = state.collections["memory"]
  leaves = jax.tree_util.tree_flatten_with_path(memory)[0]
  hidden = [leaf for path, leaf in leaves if "hidden" in jax.tree_util.keystr(path)]
  filled = [leaf for path, leaf in leaves if "filled" in jax.tree_util.keystr(path)]
  assert len(hidden) == 2 and all(h.shape == (B, M, 16) for h in hidden)
  assert all(int(f) == 0 for f in filled)
  # Without streams the memory is not part of the state.
  state, *_ = _state(_xl_model(), memory_rows=None)
  assert "memory" not in state.collections


def test_eval_steps_carry_the_memory_as_applying_segment_by_segment_does():
  model = _xl_model()
  state, shardings, mesh, _, objective = _state(model)
  eval_step = train.make_eval_step(model, mesh, shardings, objective=objective)
  segments = _segments(3, seed=1)
  expected = _manual_losses(model, jax.device_get(state.params), segments)
  got = []
  for batch in segments:
    sums, memory = eval_step(state, train.shard_batch(batch, train.batch_sharding(mesh)))
    state = state.replace(collections={**state.collections, "memory": memory})
    got.append(float(sums["loss_sum"]) / float(sums["count"]))
  np.testing.assert_allclose(got, expected, rtol=1e-5)
  # The memory matters: the second segment's loss differs from the model's
  # loss on that segment alone.
  alone = _manual_losses(model, jax.device_get(state.params), segments[1:2])
  assert abs(alone[0] - expected[1]) > 1e-3


def test_a_train_step_leaves_the_memory_of_the_segment_it_read():
  model = _xl_model()
  state, shardings, mesh, optimizer, objective = _state(model)
  step = train.make_train_step(model, optimizer, mesh, shardings, objective=objective)
  batch = _segments(1, seed=2)[0]
  params = jax.device_get(state.params)
  # The layer's own pass, as one program: eager, it is tens of compiles.
  apply = jax.jit(functools.partial(model.apply, mutable=["memory"]))
  _, expected = apply({"params": params, "memory": state.collections["memory"]},
                      jnp.asarray(batch["inputs"]))
  state, _ = step(state, train.shard_batch(batch, train.batch_sharding(mesh)))
  for got, want in zip(jax.tree.leaves(state.collections["memory"]),
                       jax.tree.leaves(expected["memory"])):
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
  assert int(jax.tree.leaves(state.collections["memory"])[0].reshape(-1)[0]) == T


def _chars_config(tmp_path, variant, memory_length):
  from attention_jax.train.config import load_config_module  # pylint: disable=g-import-not-at-top
  root = pathlib.Path(__file__).resolve().parents[2]
  config = load_config_module(root / "configs" / "lm" / "chars.py").get_config(variant)
  config.data_dir = str(tmp_path / "data")
  config.task_options.update(train_size=20_000, validation_size=2_000, test_size=2_000,
                             seq_len=32)
  config.model.update(num_layers=1, embed_dim=16, num_heads=2, mlp_dim=32)
  config.model.attention_options.memory_length = memory_length
  config.update(num_train_steps=20, batch_size=8, eval_every=10, checkpoint_every=10,
                progress=False)
  config.optimizer.update(warmup_steps=2, learning_rate=1e-2)
  return config


@pytest.mark.parametrize("memory_length", [32, 0])
def test_the_character_model_trains_on_streams_in_bits_per_character(tmp_path, memory_length):
  config = _chars_config(tmp_path, "transformer_xl", memory_length)
  results = train_and_evaluate(config, tmp_path / "run")
  for split in ("validation", "test"):
    metrics = results["metrics"][split]
    assert metrics["bits_per_token"] == pytest.approx(metrics["loss"] / math.log(2))
    # 2,000 characters are 62 segments of 32: 7 steps of 8 streams, 31 scored each.
    assert metrics["count"] == 7 * 8 * 31
  # It learned: below a uniform guess over the corpus's 56 characters.
  assert results["metrics"]["test"]["bits_per_token"] < math.log2(56)


def test_a_stream_task_refuses_another_evaluation_batch(tmp_path):
  config = _chars_config(tmp_path, "transformer_xl", 32)
  config.eval_batch_size = 4
  with pytest.raises(ValueError, match="eval_batch_size must be 8 or None, got 4"):
    train_and_evaluate(config, tmp_path / "run")
