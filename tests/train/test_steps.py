"""The train and eval steps on one device: the loss, sown auxiliary losses,
RNG streams from the step counter, and carried variable collections."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from attention_jax import train
from attention_jax.models import build_model
from attention_testing import jit_apply

VOCAB, EMBED, CLASSES, B, T = 8, 4, 3, 8, 6


class SowingClassifier(nn.Module):
  """Mean-pooled embeddings times a matrix; sows two auxiliary losses."""

  @nn.compact
  def __call__(self, tokens, *, padding_mask, deterministic):
    del deterministic
    embedded = nn.Embed(VOCAB, EMBED, embedding_init=nn.with_logical_partitioning(
        nn.initializers.normal(1.0), ("vocab", "embed")), name="embed")(tokens)
    pooled = (embedded * padding_mask[..., None]).sum(1) / padding_mask.sum(1, keepdims=True)
    kernel = self.param("kernel", nn.with_logical_partitioning(
        nn.initializers.normal(1.0), ("embed", "classes")), (EMBED, CLASSES))
    self.sow("losses", "l2", 0.01 * jnp.sum(kernel ** 2))
    self.sow("losses", "constant", jnp.float32(0.5))
    return pooled @ kernel


def _mesh():
  return train.make_mesh((1, 1, 1), devices=jax.devices()[:1])


def _batch(seed=0, vocab=VOCAB, length=T):
  rng = np.random.default_rng(seed)
  inputs = rng.integers(1, vocab, (B, length)).astype(np.int32)
  inputs[:, -2:] = 0
  return dict(inputs=inputs, label=rng.integers(0, CLASSES, B).astype(np.int32),
              weight=np.array([1, 1, 0, 1, 1, 0, 1, 1], np.float32))


def _numpy_cross_entropy(params, batch):
  table, kernel = params["embed"]["embedding"], params["kernel"]
  mask = batch["inputs"] != 0
  pooled = (table[batch["inputs"]] * mask[..., None]).sum(1) / mask.sum(1, keepdims=True)
  logits = pooled.astype(np.float64) @ kernel
  log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  per_example = -log_probs[np.arange(B), batch["label"]]
  return (per_example * batch["weight"]).sum() / batch["weight"].sum()


def test_loss_is_weighted_cross_entropy_plus_sown_losses():
  model, mesh, batch = SowingClassifier(), _mesh(), _batch()
  optimizer = train.make_optimizer(dict(warmup_steps=1, num_train_steps=10))
  state, shardings = train.create_sharded_state(model, optimizer, batch, mesh)
  params = jax.device_get(state.params)  # the step donates `state`
  step = train.make_train_step(model, optimizer, mesh, shardings)
  new_state, metrics = step(state, train.shard_batch(batch, train.batch_sharding(mesh)))

  aux = 0.01 * np.sum(params["kernel"] ** 2) + 0.5
  cross_entropy = _numpy_cross_entropy(params, batch)
  np.testing.assert_allclose(metrics["aux_loss"], aux, rtol=1e-5)
  np.testing.assert_allclose(metrics["cross_entropy"], cross_entropy, rtol=1e-5)
  np.testing.assert_allclose(metrics["loss"], cross_entropy + aux, rtol=1e-5)
  assert float(metrics["count"]) == 6.0
  assert int(new_state.step) == 1
  assert "losses" not in new_state.collections

  sums = train.make_eval_step(model, mesh, shardings)(
      new_state, train.shard_batch(batch, train.batch_sharding(mesh)))
  summary = train.summarize_eval(sums)
  np.testing.assert_allclose(summary["loss"], _numpy_cross_entropy(
      jax.device_get(new_state.params), batch), rtol=1e-5)
  assert summary["count"] == 6.0


def test_dropout_depends_on_the_step_counter_only_and_collections_are_carried():
  model = build_model(dict(vocab_size=VOCAB, num_classes=CLASSES, num_layers=1, embed_dim=8,
                           num_heads=2, mlp_dim=16, max_length=T, dropout_rate=0.5,
                           attention="routing", attention_options={"num_clusters": 2}))
  mesh, batch = _mesh(), _batch()
  optimizer = train.make_optimizer(dict(warmup_steps=0, num_train_steps=10, schedule="linear"))
  state, shardings = train.create_sharded_state(model, optimizer, batch, mesh)
  assert set(state.collections) == {"kmeans"}
  step = train.make_train_step(model, optimizer, mesh, shardings, seed=7)
  placed = train.shard_batch(batch, train.batch_sharding(mesh))

  snapshot = jax.device_get(state)
  copy = lambda step_number: jax.device_put(snapshot.replace(step=np.int32(step_number)),
                                            shardings)
  # The head starts at zero, so the first loss is log(C) whatever the dropout
  # masks; the gradient reflects them.
  grad_norms = {}
  for name, step_number in [("first", 0), ("again", 0), ("later", 5)]:
    new_state, metrics = step(copy(step_number), placed)
    grad_norms[name] = float(metrics["grad_norm"])
  assert grad_norms["first"] == grad_norms["again"]  # a restarted run draws the same masks
  assert grad_norms["first"] != grad_norms["later"]

  centroids = lambda s: jax.tree.leaves(s.collections["kmeans"])[0]
  assert not np.allclose(centroids(new_state), centroids(snapshot))


def test_language_model_loss_is_next_token_cross_entropy_over_real_tokens():
  model = build_model(dict(kind="language_model", vocab_size=VOCAB, num_layers=1, embed_dim=8,
                           num_heads=2, mlp_dim=16, max_length=T, dropout_rate=0.0))
  objective = train.get_objective("language_model")
  mesh, batch = _mesh(), _batch()
  optimizer = train.make_optimizer(dict(warmup_steps=1, num_train_steps=10))
  state, shardings = train.create_sharded_state(model, optimizer, batch, mesh,
                                                objective=objective)
  params = jax.device_get(state.params)
  logits = np.asarray(jit_apply(model, {"params": params}, jnp.asarray(batch["inputs"]),
                                padding_mask=jnp.asarray(batch["inputs"] != 0)), np.float64)
  # Position t predicts token t + 1; padded targets and zero-weight rows do not count.
  log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  targets = batch["inputs"][:, 1:]
  picked = np.take_along_axis(log_probs[:, :-1], targets[..., None], -1)[..., 0]
  weights = (targets != 0) * batch["weight"][:, None]
  expected = -(picked * weights).sum() / weights.sum()

  step = train.make_train_step(model, optimizer, mesh, shardings, objective=objective)
  _, metrics = step(state, train.shard_batch(batch, train.batch_sharding(mesh)))
  np.testing.assert_allclose(metrics["cross_entropy"], expected, rtol=1e-5)
  assert float(metrics["count"]) == weights.sum() == 18.0


def test_dual_classifier_step_reads_both_sequences():
  model = build_model(dict(kind="dual_classifier", vocab_size=VOCAB, num_classes=CLASSES,
                           num_layers=1, embed_dim=8, num_heads=2, mlp_dim=16, max_length=T,
                           head_mlp_dim=8))
  objective = train.get_objective("dual_classifier")
  mesh, batch = _mesh(), _batch()
  batch["inputs2"] = _batch(seed=1)["inputs"]
  optimizer = train.make_optimizer(dict(learning_rate=0.1, warmup_steps=0, num_train_steps=10,
                                        schedule="linear"))
  state, shardings = train.create_sharded_state(model, optimizer, batch, mesh,
                                                objective=objective)
  step = train.make_train_step(model, optimizer, mesh, shardings, objective=objective)
  state, _ = step(state, train.shard_batch(batch, train.batch_sharding(mesh)))
  evaluate = train.make_eval_step(model, mesh, shardings, objective=objective)
  sums = evaluate(state, train.shard_batch(batch, train.batch_sharding(mesh)))
  other = dict(batch, inputs2=_batch(seed=2)["inputs"])
  other_sums = evaluate(state, train.shard_batch(other, train.batch_sharding(mesh)))
  assert float(sums["count"]) == 6.0
  # The second document reaches the logits.
  assert float(sums["loss_sum"]) != float(other_sums["loss_sum"])
