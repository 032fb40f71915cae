"""Trains a mixture-of-experts classifier a few steps on meshes of 8 simulated
CPU devices and on one device; prints one JSON object on the last line.

Run as a script (tests/layers/test_moe.py does, in a subprocess): the device
count must be set before jax initialises.
"""

import json

import jax

# Simulated CPU devices, also on a host with an accelerator (before jax's first
# computation creates the backends).
jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 8)
# pylint: disable=wrong-import-position
import numpy as np

from attention_jax import train
from attention_jax.models import build_model


MODEL = dict(vocab_size=32, num_classes=4, num_layers=1, embed_dim=16, num_heads=2, mlp_dim=32,
             max_length=16, dropout_rate=0.0, feed_forward="moe",
             feed_forward_options=dict(num_experts=8, top_k=2, capacity_factor=1.0,
                                       load_balancing_weight=0.1))
# Adam's eps well above float32 noise: a gradient that is zero in exact
# arithmetic (the key bias's: softmax ignores a shift shared by every key) is
# rounding noise of a size that depends on the reduction order, which Adam's
# default eps would blow up to a full step.
OPTIMIZER = dict(learning_rate=0.05, warmup_steps=0, schedule="linear", num_train_steps=20,
                 grad_clip_norm=1.0, eps=1e-3)
BATCH, LENGTH, STEPS = 16, 16, 3


def random_batches():
  rng = np.random.default_rng(0)
  batches = []
  for _ in range(STEPS):
    inputs = rng.integers(1, MODEL["vocab_size"], (BATCH, LENGTH)).astype(np.int32)
    batches.append(dict(inputs=inputs,
                        label=rng.integers(0, MODEL["num_classes"], BATCH).astype(np.int32),
                        weight=np.ones(BATCH, np.float32)))
  return batches


def train_on_mesh(model, optimizer, batches, shape, devices=None):
  """The train state of `model` created on a mesh of `shape` (over `devices`,
  all by default) and stepped once per batch: `(state, losses)`. (The MoE
  model is built here, not from a config, so it does not go through build_run.)"""
  mesh = train.make_mesh(shape, devices=devices)
  state, shardings = train.create_sharded_state(model, optimizer, batches[0], mesh,
                                                rng=jax.random.key(1))
  step = train.make_train_step(model, optimizer, mesh, shardings, seed=3)
  losses = []
  for batch in batches:
    state, metrics = step(state, train.shard_batch(batch, train.batch_sharding(mesh)))
    losses.append(float(metrics["loss"]))
  return state, losses


def main():
  model = build_model(MODEL)
  optimizer = train.make_optimizer(OPTIMIZER)
  batches = random_batches()
  out = {"device_count": jax.device_count(), "losses": {}, "params": {}, "specs": {},
         "shard_shapes": {}}
  runs = [("1,8,1", (1, 8, 1), None), ("2,2,2", (2, 2, 2), None),
          ("one device", (1, 1, 1), jax.devices()[:1])]
  final = {}
  for name, shape, devices in runs:
    state, out["losses"][name] = train_on_mesh(model, optimizer, batches, shape, devices)
    experts = state.params["encoder"]["block_0"]["mlp"]["wi"]
    out["specs"][name] = [list(a) if isinstance(a, tuple) else a for a in experts.sharding.spec]
    out["shard_shapes"][name] = sorted({tuple(s.data.shape) for s in experts.addressable_shards})
    final[name] = jax.tree.map(np.asarray, state.params)
  reference = final["one device"]
  for name in final:
    out["params"][name] = max(float(np.max(np.abs(a - b))) for a, b in zip(
        jax.tree.leaves(final[name]), jax.tree.leaves(reference)))
  print(json.dumps(out))


if __name__ == "__main__":
  main()
