"""Runs the same tiny training on several meshes of 8 simulated CPU devices.

Run as a script (tests/train/test_sharded.py does, in a subprocess): the
device count must be set before jax initialises, which a pytest worker that
already imported jax cannot do. Prints one JSON object on the last line.
"""

import json
import pathlib
import sys

import jax

# Simulated CPU devices, also on a host with an accelerator (before jax's first
# computation creates the backends).
jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 8)
# pylint: disable=wrong-import-position
import numpy as np

from attention_jax import train
from attention_jax.train.config import default_config
from attention_jax.train.run import build_run

MODEL = dict(vocab_size=32, num_classes=4, num_layers=1, embed_dim=16, num_heads=2, mlp_dim=32,
             max_length=16, dropout_rate=0.1)
OPTIMIZER = dict(learning_rate=0.05, warmup_steps=0, schedule="linear", num_train_steps=20,
                 grad_clip_norm=1.0)
BATCH, LENGTH, STEPS = 16, 16, 4


def random_batches():
  rng = np.random.default_rng(0)
  batches = []
  for _ in range(STEPS):
    inputs = rng.integers(1, MODEL["vocab_size"], (BATCH, LENGTH)).astype(np.int32)
    inputs[:, 12:] = 0  # some padding
    batches.append(dict(inputs=inputs,
                        label=rng.integers(0, MODEL["num_classes"], BATCH).astype(np.int32),
                        weight=np.ones(BATCH, np.float32)))
  return batches


def spec_of(array):
  return [list(axes) if isinstance(axes, tuple) else axes for axes in array.sharding.spec]


def error_of(fn):
  try:
    fn()
  except ValueError as e:
    return str(e)
  return None


def run_config(shape):
  """The trainer's config of `MODEL` and `OPTIMIZER` on a mesh of `shape`."""
  config = default_config()
  config.model.update(MODEL)
  config.optimizer.update(OPTIMIZER)
  config.update(mesh_shape=shape, batch_size=BATCH, seed=3)
  return config


def train_on_mesh(batches, shape, devices=None):
  """The run of `run_config(shape)` (over `devices`, all by default), its state
  initialised and stepped once per batch: `(run, shardings, state, losses)`."""
  run = build_run(run_config(shape), devices=devices)
  state, shardings = run.init_state(batches[0], rng=jax.random.key(1))
  step = run.train_step(shardings)
  losses = []
  for batch in batches:
    state, metrics = step(state, train.shard_batch(batch, train.batch_sharding(run.mesh)))
    losses.append(float(metrics["loss"]))
  return run, shardings, state, losses


def main():
  out = {"device_count": jax.device_count()}
  out["mesh_shapes"] = {str(shape): dict(train.make_mesh(shape).shape)
                        for shape in [(-1, 2, 2), (-1, 1, 1), (2, -1, 1), (8, 1, 1)]}
  out["mesh_errors"] = {str(shape): error_of(lambda shape=shape: train.make_mesh(shape))
                        for shape in [(3, -1, 1), (2, 2, 1), (-1, -1, 1), (2, 2), (0, 8, 1)]}

  batches = random_batches()
  runs = [("8,1,1", (8, 1, 1), None), ("2,4,1", (2, 4, 1), None), ("2,2,2", (2, 2, 2), None),
          ("one device", (1, 1, 1), jax.devices()[:1])]
  out["losses"] = {}
  for name, shape, devices in runs:
    run, shardings, state, out["losses"][name] = train_on_mesh(batches, shape, devices)
    if shape == (2, 2, 2):
      params = state.params
      block = params["encoder"]["block_0"]
      mu = state.opt_state[1][0].mu  # chain(clip, adamw): adamw's scale_by_adam state
      query = block["attention"]["query"]["kernel"]
      out["specs"] = {
          "token_embedding": spec_of(params["encoder"]["token_embedding"]["embedding"]),
          "query_kernel": spec_of(query),
          "query_kernel_shard_shape": list(query.addressable_shards[0].data.shape),
          "out_kernel": spec_of(block["attention"]["out"]["kernel"]),
          "mlp_wi_kernel": spec_of(block["mlp"]["wi"]["kernel"]),
          "head_kernel": spec_of(params["head"]["kernel"]),
          "query_kernel_adam_mu": spec_of(mu["encoder"]["block_0"]["attention"]["query"]["kernel"]),
          "batch_inputs": spec_of(
              train.shard_batch(batches[0], train.batch_sharding(run.mesh))["inputs"]),
      }
      out["eval"] = train.summarize_eval(run.eval_step(shardings)(
          state, train.shard_batch(batches[0], train.batch_sharding(run.mesh))))
      uneven = {name: array[:12] for name, array in batches[0].items()}
      out["batch_error"] = error_of(
          lambda: train.shard_batch(uneven, train.batch_sharding(train.make_mesh((8, 1, 1)))))
  out["trainer"] = trainer_runs(pathlib.Path(sys.argv[1])) if len(sys.argv) > 1 else None
  print(json.dumps(out))


def trainer_runs(tmp):
  """The whole training loop (tests/train/tiny_config.py) on two meshes: its
  per-step train losses, and the error for a batch that does not split. (The
  step loop of `main` covers the other meshes; here the trainer's own path:
  its data, checkpoints and the config's sharding rules.)"""
  sys.path.insert(0, str(pathlib.Path(__file__).parent))
  import tiny_config  # pylint: disable=g-import-not-at-top
  from attention_jax.train import metrics  # pylint: disable=g-import-not-at-top
  from attention_jax.train.trainer import train_and_evaluate  # pylint: disable=g-import-not-at-top
  out = {"losses": {}}
  # The last run takes its sharding rules from the config: no FSDP, the heads
  # and the feed-forward over "tensor" (and the activations' batch over "data"
  # and "fsdp", as always).
  tensor_only = tuple((name, None if name == "embed" else target)
                      for name, target in tiny_config.get_config().logical_axis_rules)
  for shape, rules in [((8, 1, 1), None), ((2, 2, 2), tensor_only)]:
    config = tiny_config.get_config()
    config.update(data_dir=str(tmp / "data"), mesh_shape=shape, num_train_steps=6, log_every=1,
                  eval_every=6, checkpoint_every=6)
    name = "x".join(map(str, shape)) + ("-tensor-only-rules" if rules else "")
    if rules:
      config.logical_axis_rules = rules
    workdir = tmp / ("mesh-" + name)
    results = train_and_evaluate(config, workdir)
    out["losses"][name] = [r["loss"] for r in metrics.read_metrics(workdir, "train")]
    out.setdefault("validation", {})[name] = results["metrics"]["validation"]
  # The sequence split over 4 devices (ring attention), beside 2-way data
  # parallelism, against data parallelism alone. Mean pooling: the 40 tokens
  # split evenly, a [CLS] would make them 41.
  for name, shape, sequence_shards in [("8x1x1-mean", (8, 1, 1), 1),
                                       ("2x1x1-sequence4-mean", (2, 1, 1), 4)]:
    config = tiny_config.get_config()
    config.update(data_dir=str(tmp / "data"), mesh_shape=shape, num_train_steps=6, log_every=1,
                  eval_every=6, checkpoint_every=6, sequence_shards=sequence_shards)
    config.model.pooling = "mean"
    results = train_and_evaluate(config, tmp / ("mesh-" + name))
    out.setdefault("sequence_losses", {})[name] = [
        r["loss"] for r in metrics.read_metrics(tmp / ("mesh-" + name), "train")]
    out.setdefault("sequence_meshes", {})[name] = results["mesh"]
  config = tiny_config.get_config()
  config.update(data_dir=str(tmp / "data"), mesh_shape=(8, 1, 1), batch_size=12)
  out["batch_error"] = error_of(lambda: train_and_evaluate(config, tmp / "bad-batch"))
  out["bad_batch_workdir_exists"] = (tmp / "bad-batch").exists()
  return out


if __name__ == "__main__":
  main()
