"""tests/train/tiny_config.py with the toy mixer of toy_mixer.py (registered by
this file's import): `--config=tests/models/toy_mixer_config.py`."""

import importlib.util
import pathlib

_HERE = pathlib.Path(__file__).resolve().parent


def _load(path: pathlib.Path):
  spec = importlib.util.spec_from_file_location(path.stem, path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


_load(_HERE / "toy_mixer.py")  # registers "toy_gated_mean"


def get_config(arg: str = "toy_gated_mean"):
  config = _load(_HERE.parent / "train" / "tiny_config.py").get_config(arg)
  config.model.pooling = "mean"
  config.num_train_steps = 5
  config.eval_every = config.checkpoint_every = 5
  config.log_every = 1
  return config
