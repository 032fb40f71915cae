"""Checkpoints of the train state: round trips into shardings, keep-latest-K plus
the best, corrupt and half-written checkpoints, async saves, bad arguments."""

import os
import re
import shutil
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from attention_jax import train
from attention_jax.models import build_model
from attention_jax.train.checkpoints import Checkpointer, CorruptCheckpointWarning
from attention_jax.train.state import TrainState, abstract_state_and_shardings

OPTIMIZER = dict(learning_rate=0.1, warmup_steps=1, num_train_steps=10)


def _mesh():
  return train.make_mesh((1, 1, 1), devices=jax.devices()[:1])


def _state(seed):
  """A small TrainState whose values depend on `seed`, with the real optimiser's
  state (clipping + masked AdamW namedtuples) after one update."""
  rng = np.random.default_rng(seed)
  params = {"embed": {"embedding": jnp.asarray(rng.normal(size=(16, 8)), jnp.float32)},
            "head": {"kernel": jnp.asarray(rng.normal(size=(8, 4)), jnp.float32),
                     "bias": jnp.asarray(rng.normal(size=(4,)), jnp.float32)}}
  optimizer = train.make_optimizer(OPTIMIZER)
  grads = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), p.dtype), params)
  _, opt_state = optimizer.update(grads, optimizer.init(params), params)
  return TrainState(step=jnp.asarray(seed, jnp.int32), params=params, opt_state=opt_state,
                    collections={"kmeans": {"centroids": jnp.full((2, 8), float(seed))}})


def _targets(state):
  mesh = _mesh()
  shardings = jax.tree.map(lambda _: NamedSharding(mesh, P()), state)
  abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), state)
  return abstract, shardings


def _assert_same(restored, expected):
  assert jax.tree.structure(restored) == jax.tree.structure(expected)
  for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(expected)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def _on_disk(directory):
  """The step directories under `directory` (not `corrupt/`)."""
  return sorted(int(name) for name in os.listdir(directory) if name.isdigit())


def _data_files(step_dir):
  """The files holding the array bytes (OCDBT data files under `d/`)."""
  files = [os.path.join(root, name) for root, _, names in os.walk(step_dir)
           if os.path.basename(root) == "d" for name in names]
  assert files, f"no array data files found under {step_dir}"
  return files


def test_round_trip_restores_the_state_into_the_requested_shardings(tmp_path):
  model = build_model(dict(vocab_size=16, num_classes=3, num_layers=1, embed_dim=8,
                           num_heads=2, mlp_dim=16, max_length=8))
  optimizer = train.make_optimizer(OPTIMIZER)
  batch = dict(inputs=np.ones((2, 8), np.int32), label=np.zeros(2, np.int32),
               weight=np.ones(2, np.float32))
  mesh = _mesh()
  state, _ = train.create_sharded_state(model, optimizer, batch, mesh)
  abstract, shardings = abstract_state_and_shardings(model, optimizer, batch, mesh)
  expected = jax.device_get(state)

  ckpt = Checkpointer(tmp_path, keep=2, async_save=False)
  assert ckpt.save(7, state)
  assert ckpt.all_steps() == [7] and ckpt.latest_step() == 7
  restored, step = ckpt.restore(abstract, shardings)
  ckpt.close()

  assert step == 7
  assert isinstance(restored, TrainState)
  # The optimiser's namedtuples come back as themselves, not as tuples or dicts.
  assert [type(s) for s in restored.opt_state] == [type(s) for s in state.opt_state]
  assert isinstance(restored.opt_state[1][0], optax.ScaleByAdamState)
  _assert_same(restored, expected)
  for leaf, sharding in zip(jax.tree.leaves(restored), jax.tree.leaves(shardings)):
    assert isinstance(leaf, jax.Array)
    assert leaf.sharding == sharding


# Runs with 4 simulated devices (set before jax initialises): the state is saved
# with one layout and restored into another; every device must hold exactly its
# own block of each array.
_SHARDED_SCRIPT = textwrap.dedent("""
    import sys
    import jax, numpy as np
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", 4)
    from jax.sharding import NamedSharding, PartitionSpec as P
    from attention_jax import train
    from attention_jax.train.checkpoints import Checkpointer

    assert jax.device_count() == 4
    values = {"kernel": np.arange(8 * 4, dtype=np.float32).reshape(8, 4),
              "bias": np.arange(4, dtype=np.float32)}
    rows = train.make_mesh((4, 1, 1))
    saved = {"kernel": jax.device_put(values["kernel"], NamedSharding(rows, P("data", None))),
             "bias": jax.device_put(values["bias"], NamedSharding(rows, P()))}
    ckpt = Checkpointer(sys.argv[1], keep=1, async_save=False)
    ckpt.save(3, saved)

    blocks = train.make_mesh((1, 2, 2))
    shardings = {"kernel": NamedSharding(blocks, P("fsdp", "tensor")),
                 "bias": NamedSharding(blocks, P("tensor"))}
    abstract = {name: jax.ShapeDtypeStruct(v.shape, v.dtype) for name, v in values.items()}
    restored, step = ckpt.restore(abstract, shardings)
    assert step == 3
    for name, array in restored.items():
      assert array.sharding == shardings[name], (name, array.sharding)
      shards = array.addressable_shards
      assert len(shards) == 4 and len({s.device for s in shards}) == 4
      for shard in shards:
        want = values[name][shard.index]
        assert shard.data.shape == want.shape == (
            (4, 2) if name == "kernel" else (2,)), (name, shard.data.shape)
        np.testing.assert_array_equal(np.asarray(shard.data), want)
    ckpt.close()
    print("ok")
""")


def test_restore_places_each_shard_on_its_device(tmp_path):
  result = subprocess.run([sys.executable, "-c", _SHARDED_SCRIPT, str(tmp_path / "ckpt")],
                          capture_output=True, text=True, env=dict(os.environ),
                          cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))),
                          timeout=300)
  assert result.returncode == 0, result.stderr[-4000:]
  assert result.stdout.strip().splitlines()[-1] == "ok"


@pytest.mark.parametrize("mode, metric, values", [
    ("max", "accuracy", {2: 0.9, 4: 0.5, 6: 0.7}),
    ("min", "loss", {2: 0.1, 4: 0.9, 6: 0.5}),
])
def test_keeps_exactly_the_latest_k_and_the_best(tmp_path, mode, metric, values):
  ckpt = Checkpointer(tmp_path, keep=2, best_metric=metric, best_mode=mode, async_save=False)
  for step in range(1, 7):
    metrics = {metric: values[step], "other": 1.0} if step in values else None
    assert ckpt.save(step, _state(step), metrics=metrics)
  ckpt.wait_until_finished()
  # Latest two (5, 6) and the best (2); 1 and 3 never had metrics, 4 was worse.
  assert _on_disk(tmp_path) == [2, 5, 6]
  assert ckpt.all_steps() == [2, 5, 6]
  assert ckpt.best_step() == 2
  ckpt.close()

  reopened = Checkpointer(tmp_path, keep=2, best_metric=metric, best_mode=mode,
                          async_save=False)
  assert reopened.all_steps() == [2, 5, 6]
  assert reopened.best_step() == 2
  state, step = reopened.restore_best(*_targets(_state(0)))
  assert step == 2
  _assert_same(state, _state(2))
  state, step = reopened.restore(*_targets(_state(0)))
  assert step == 6
  _assert_same(state, _state(6))
  # Retention goes on across restarts: the best stays, the oldest latest goes.
  assert reopened.save(7, _state(7), metrics={metric: values[4], "other": 0.0})
  assert _on_disk(tmp_path) == [2, 6, 7]
  reopened.close()


def test_without_best_metric_only_the_latest_k_remain(tmp_path):
  ckpt = Checkpointer(tmp_path, keep=3, async_save=False)
  for step in range(1, 7):
    ckpt.save(step, _state(step), metrics={"accuracy": 1.0 if step == 1 else 0.0})
  assert _on_disk(tmp_path) == [4, 5, 6]
  assert ckpt.best_step() is None
  assert ckpt.restore_best(*_targets(_state(0))) is None
  ckpt.close()


def test_step_path_names_the_directory_a_save_writes(tmp_path):
  ckpt = Checkpointer(tmp_path / "ckpts", keep=2, async_save=False)
  assert str(ckpt.step_path(12)) == str(tmp_path / "ckpts" / "12")
  assert not ckpt.step_path(12).exists()
  ckpt.save(12, _state(12))
  assert ckpt.step_path(12).is_dir()
  ckpt.close()


def test_saving_a_step_twice_is_a_no_op(tmp_path):
  ckpt = Checkpointer(tmp_path, keep=2, best_metric="accuracy", async_save=False)
  assert ckpt.save(5, _state(5))
  assert not ckpt.save(5, _state(99))
  assert not ckpt.save(5, _state(99), metrics={"accuracy": 1.0})
  state, step = ckpt.restore(*_targets(_state(0)))
  assert step == 5
  _assert_same(state, _state(5))
  assert ckpt.best_step() is None  # the ignored save's metrics were not recorded
  ckpt.close()


def _truncate_data(step_dir):
  for path in _data_files(step_dir):
    with open(path, "r+b") as f:
      f.truncate(os.path.getsize(path) // 2)


def _delete_data(step_dir):
  for path in _data_files(step_dir):
    os.remove(path)


def _garbage_data(step_dir):
  for path in _data_files(step_dir):
    with open(path, "wb") as f:
      f.write(b"\x00garbage" * 64)


def _garbage_tree_metadata(step_dir):
  with open(os.path.join(step_dir, "default", "_METADATA"), "w") as f:
    f.write("{not json")


def _garbage_metrics(step_dir):
  with open(os.path.join(step_dir, "metrics", "metrics"), "w") as f:
    f.write("{not json")


@pytest.mark.parametrize("corrupt", [_truncate_data, _delete_data, _garbage_data,
                                     _garbage_tree_metadata, _garbage_metrics])
def test_corrupt_newest_checkpoint_is_moved_aside_and_the_previous_restored(tmp_path, corrupt):
  ckpt = Checkpointer(tmp_path, keep=3, best_metric="accuracy", async_save=False)
  for step in (1, 2):
    ckpt.save(step, _state(step), metrics={"accuracy": 0.1 * step})
  ckpt.close()
  bad = tmp_path / "2"
  corrupt(str(bad))
  files_before = sorted(os.path.relpath(os.path.join(root, name), bad)
                        for root, _, names in os.walk(bad) for name in names)

  # The warning names the bad checkpoint (when the directory is opened for a
  # bad metrics file, at the restore otherwise).
  with pytest.warns(CorruptCheckpointWarning, match=re.escape(str(bad))):
    ckpt = Checkpointer(tmp_path, keep=3, best_metric="accuracy", async_save=False)
    state, step = ckpt.restore(*_targets(_state(0)))
  assert step == 1
  _assert_same(state, _state(1))
  assert ckpt.all_steps() == [1] and ckpt.latest_step() == 1

  # Moved aside with everything in it, not deleted.
  assert not bad.exists()
  aside = tmp_path / "corrupt" / "2"
  assert sorted(os.path.relpath(os.path.join(root, name), aside)
                for root, _, names in os.walk(aside) for name in names) == files_before

  # The same step can be saved again, and is then what a restart restores.
  assert ckpt.save(2, _state(22), metrics={"accuracy": 0.5})
  ckpt.close()
  reopened = Checkpointer(tmp_path, keep=3, best_metric="accuracy", async_save=False)
  state, step = reopened.restore(*_targets(_state(0)))
  assert step == 2
  _assert_same(state, _state(22))
  assert reopened.best_step() == 2
  reopened.close()


def test_a_checkpoint_of_another_structure_is_moved_aside(tmp_path):
  ckpt = Checkpointer(tmp_path, keep=2, async_save=False)
  ckpt.save(1, _state(1))
  abstract, shardings = _targets(_state(0))
  params = dict(abstract.params, extra=abstract.params["head"]["bias"])
  wrong = abstract.replace(params=params)
  wrong_shardings = shardings.replace(params=dict(shardings.params,
                                                  extra=shardings.params["head"]["bias"]))
  with pytest.warns(CorruptCheckpointWarning, match=re.escape(str(tmp_path / "1"))):
    assert ckpt.restore(wrong, wrong_shardings) is None
  assert (tmp_path / "corrupt" / "1").is_dir()
  assert ckpt.all_steps() == []
  ckpt.close()


def test_every_checkpoint_corrupt_restores_none(tmp_path):
  ckpt = Checkpointer(tmp_path, keep=2, async_save=False)
  for step in (1, 2):
    ckpt.save(step, _state(step))
    _delete_data(str(tmp_path / str(step)))
  with pytest.warns(CorruptCheckpointWarning) as record:
    assert ckpt.restore(*_targets(_state(0))) is None
  messages = " ".join(str(w.message) for w in record)
  assert str(tmp_path / "2") in messages and str(tmp_path / "1") in messages
  assert sorted(os.listdir(tmp_path / "corrupt")) == ["1", "2"]
  # A step that went bad twice does not overwrite the first bad copy.
  ckpt.save(2, _state(2))
  _delete_data(str(tmp_path / "2"))
  with pytest.warns(CorruptCheckpointWarning):
    assert ckpt.restore(*_targets(_state(0))) is None
  assert sorted(os.listdir(tmp_path / "corrupt")) == ["1", "2", "2.1"]
  ckpt.close()


def test_corrupt_best_falls_back_to_the_next_best(tmp_path):
  ckpt = Checkpointer(tmp_path, keep=2, best_metric="accuracy", async_save=False)
  for step, accuracy in ((1, 0.2), (2, 0.9), (3, 0.5), (4, 0.6)):
    ckpt.save(step, _state(step), metrics={"accuracy": accuracy})
  assert ckpt.all_steps() == [2, 3, 4]
  _truncate_data(str(tmp_path / "2"))
  with pytest.warns(CorruptCheckpointWarning, match=re.escape(str(tmp_path / "2"))):
    state, step = ckpt.restore_best(*_targets(_state(0)))
  assert step == 4
  _assert_same(state, _state(4))
  assert ckpt.best_step() == 4
  assert (tmp_path / "corrupt" / "2").is_dir()
  ckpt.close()


def test_half_written_checkpoints_are_never_restored(tmp_path):
  ckpt = Checkpointer(tmp_path, keep=5, async_save=False)
  ckpt.save(1, _state(1))
  ckpt.save(2, _state(2))
  ckpt.close()
  # What a SIGKILL during a save leaves: orbax writes into
  # "<step>.orbax-checkpoint-tmp" and renames it once complete, writing
  # commit_success.txt last (in place, without the rename, on object stores).
  # Both stand-ins hold complete arrays, so only their unfinished state can
  # keep them from being restored.
  shutil.copytree(tmp_path / "2", tmp_path / "3.orbax-checkpoint-tmp")
  os.remove(tmp_path / "3.orbax-checkpoint-tmp" / "commit_success.txt")
  shutil.copytree(tmp_path / "2", tmp_path / "4")
  os.remove(tmp_path / "4" / "commit_success.txt")

  with pytest.warns(CorruptCheckpointWarning) as record:
    ckpt = Checkpointer(tmp_path, keep=5, async_save=False)
  messages = " ".join(str(w.message) for w in record)
  assert str(tmp_path / "3.orbax-checkpoint-tmp") in messages
  assert str(tmp_path / "4") in messages
  assert ckpt.all_steps() == [1, 2]
  state, step = ckpt.restore(*_targets(_state(0)))
  assert step == 2
  _assert_same(state, _state(2))
  # Kept, out of the way; the steps can be saved again.
  assert sorted(os.listdir(tmp_path / "corrupt")) == ["3.orbax-checkpoint-tmp", "4"]
  assert ckpt.save(3, _state(3)) and ckpt.save(4, _state(4))
  state, step = ckpt.restore(*_targets(_state(0)))
  assert step == 4
  _assert_same(state, _state(4))
  ckpt.close()


def test_async_save_is_written_by_wait_until_finished(tmp_path):
  ckpt = Checkpointer(tmp_path, keep=2, best_metric="accuracy", async_save=True)
  expected = {}
  for step in (1, 2, 3):
    state = _state(step)
    expected[step] = jax.device_get(state)
    assert ckpt.save(step, state, metrics={"accuracy": 1.0 / step})
    # The trainer donates the state to the next step right after saving.
    for leaf in jax.tree.leaves(state):
      leaf.delete()
  ckpt.wait_until_finished()
  assert _on_disk(tmp_path) == [1, 2, 3]  # 1 is the best, 2 and 3 the latest

  other = Checkpointer(tmp_path, keep=2, best_metric="accuracy", async_save=False)
  assert other.all_steps() == [1, 2, 3] and other.best_step() == 1
  state, step = other.restore(*_targets(_state(0)))
  assert step == 3
  _assert_same(state, expected[3])
  state, step = other.restore_best(*_targets(_state(0)))
  assert step == 1
  _assert_same(state, expected[1])
  other.close()
  ckpt.close()


def test_empty_directory_restores_none(tmp_path):
  directory = tmp_path / "new" / "checkpoints"
  ckpt = Checkpointer(directory, keep=1, best_metric="accuracy")
  assert directory.is_dir() and str(ckpt.directory) == str(directory)
  assert ckpt.restore(*_targets(_state(0))) is None
  assert ckpt.restore_best(*_targets(_state(0))) is None
  assert ckpt.all_steps() == [] and ckpt.latest_step() is None and ckpt.best_step() is None
  ckpt.close()


@pytest.mark.parametrize("kwargs, words", [
    (dict(keep=0), ["keep", "0", ">= 1"]),
    (dict(keep=-2), ["keep", "-2"]),
    (dict(keep=1.5), ["keep", "1.5"]),
    (dict(best_mode="best"), ["best_mode", "'best'", "max", "min"]),
    (dict(best_metric=""), ["best_metric"]),
])
def test_bad_arguments_raise(tmp_path, kwargs, words):
  with pytest.raises(ValueError) as error:
    Checkpointer(tmp_path, **kwargs)
  for word in words:
    assert word in str(error.value)


def test_bad_save_and_restore_arguments_raise(tmp_path):
  ckpt = Checkpointer(tmp_path, keep=2, best_metric="accuracy", async_save=False)
  with pytest.raises(ValueError, match="accuracy"):
    ckpt.save(1, _state(1), metrics={"loss": 1.0})
  with pytest.raises(ValueError, match="'loss'"):
    ckpt.save(1, _state(1), metrics={"accuracy": 0.5, "loss": "low"})
  with pytest.raises(ValueError, match="step"):
    ckpt.save(-1, _state(1))
  assert ckpt.all_steps() == []
  ckpt.save(5, _state(5))
  with pytest.raises(ValueError, match="older than the latest checkpoint 5"):
    ckpt.save(3, _state(3))
  abstract, shardings = _targets(_state(0))
  with pytest.raises(ValueError, match="same tree structure"):
    ckpt.restore(abstract, shardings.params)
  assert ckpt.all_steps() == [5]  # a caller's mistake moves nothing aside
  ckpt.close()


@pytest.mark.parametrize("mode", ["max", "min"])
def test_a_nan_metric_is_never_the_best(tmp_path, mode):
  ckpt = Checkpointer(tmp_path, keep=1, best_metric="loss", best_mode=mode, async_save=False)
  ckpt.save(1, _state(1), metrics={"loss": 0.3})
  ckpt.save(2, _state(2), metrics={"loss": float("nan")})
  ckpt.save(3, _state(3))
  assert ckpt.best_step() == 1
  assert _on_disk(tmp_path) == [1, 3]
  ckpt.close()
