"""The trainer's config: every key it reads, with its default, and the checks
that run before anything is compiled.

Experiment configs (`configs/lra/<task>.py`) start from `default_config()` and
set what their task and preset need; `check_config` rejects a key the trainer
does not know, so a typo in a config file or a `--config.a.b=value` override is
an error rather than a silently ignored setting.
"""

from __future__ import annotations

import importlib.util
import pathlib
from types import ModuleType
from typing import Any, Dict, Iterable, List, Tuple

import ml_collections

from attention_jax import attention_options, axes
from attention_jax.layers import FEED_FORWARD_LAYERS, feed_forward_options
from attention_jax.models import default_model_config
from attention_jax.registry import did_you_mean
from attention_jax.train.optim import default_optimizer_config

# Keys whose values are free-form options of the component they configure.
FREE_FORM = ("task_options", "model.attention_options", "model.position_options")

# Keys that may change between a run and its restart: they change how a run is
# watched or where it reads the same data from, not what it computes.
RESTARTABLE = ("progress", "data_dir", "prepare_data", "async_checkpoints")


def default_config(variant: str = "dot_product",
                   attention_preset: str = "method") -> ml_collections.ConfigDict:
  """Every key the trainer accepts, with its default, for attention `variant`
  (whose declared options `model.attention_options` lists, so that each can
  be overridden with `--config.model.attention_options.<name>=`) run with the
  option set `attention_preset` ("method" or "lra_release", see
  `registry.PRESETS`)."""
  placeholder = ml_collections.config_dict.placeholder
  config = ml_collections.ConfigDict()
  config.task = "listops"  # a name of attention_jax.data.list_tasks()
  config.task_options = {}  # keyword arguments of the task's make_task (sizes, lengths, ...)
  config.data_dir = "data"  # prepared splits live in <data_dir>/<task>/<split>/
  config.prepare_data = True  # generate / convert missing splits before training

  config.model = default_model_config()  # vocab_size, num_classes, max_length: from the task
  config.model.attention = variant
  config.model.attention_options = attention_options.options_config(variant)
  config.model.vocab_size = placeholder(int)
  config.model.num_classes = placeholder(int)
  config.model.max_length = placeholder(int)
  # The variant's named option set; the trainer applies it to the options the
  # config leaves at their defaults (`apply_attention_preset`).
  config.attention_preset = attention_preset

  config.num_train_steps = 1000  # batches (micro-batches when accumulating gradients)
  config.optimizer = default_optimizer_config()
  # The schedule's length in updates: set from num_train_steps by the trainer
  # (divided by optimizer.grad_accum_steps); the reference keeps it in step for
  # code that builds the optimiser from a config directly.
  config.optimizer.num_train_steps = config.get_ref("num_train_steps")
  config.batch_size = 32  # global, over all hosts and devices
  config.eval_batch_size = placeholder(int)  # None: batch_size
  config.eval_every = 200  # steps between validation passes (and the final step)
  config.eval_steps = placeholder(int)  # batches per validation pass; None: the whole split
  config.test_at_end = True  # evaluate the best checkpoint on the test split
  # The best checkpoint also tested at these longer lengths (the task made with
  # `task_options.seq_len` at each), RoPE scaled to each with `rope_scaling`
  # ("linear", "ntk" or "yarn"); see `train.lengths`.
  config.length_eval = ml_collections.ConfigDict(dict(lengths=(), rope_scaling=placeholder(str)))
  # Self-pretraining (`train.pretrain`): with objective "causal" or "masked", a
  # language-modelling phase on the task's own inputs in <workdir>/pretrain/
  # first, its encoder handed to the classifier; learning_rate, warmup_steps:
  # None, the run's; mask_rate: the masked objective's share of masked tokens.
  config.pretrain = ml_collections.ConfigDict(dict(
      objective=placeholder(str), num_train_steps=0, learning_rate=placeholder(float),
      warmup_steps=placeholder(int), mask_rate=0.15))

  config.log_every = 50  # steps between train-metric records
  config.checkpoint_every = 200  # steps between checkpoints (and the final step)
  config.keep_checkpoints = 2  # the latest K; the best by validation accuracy is kept too
  config.async_checkpoints = True
  config.progress = True  # the console progress bar

  config.mesh_shape = (-1, 1, 1)  # ("data", "fsdp", "tensor"); -1: the rest of the devices
  # Above 1: the sequence split over a "sequence" mesh axis of this many
  # devices (sequence parallelism; the -1 above takes the devices left), with
  # the attention as ring attention (`implementation="ring"`, exact attention
  # variants only). Lengths must split evenly: T a multiple of 2 x this.
  config.sequence_shards = 1
  # (logical axis, mesh axes) pairs: where parameters and activations live.
  config.logical_axis_rules = axes.DEFAULT_RULES
  config.seed = 0  # parameters, data order and dropout all derive from it
  # "attention": the key of the random draws that variants redraw as they train
  # (Performer features, LSH rotations); see variants.common.layer_random.
  config.rng_streams = ("dropout", "attention")
  return config


def apply_attention_preset(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """`config` with `model.attention` and `model.attention_options` completed
  from `attention_preset` for `config.task` (`attention_options.with_preset`:
  options the config sets to other than their defaults win).

  Raises:
    ValueError: on an unknown preset, or one the variant does not have.
  """
  config.model.attention, config.model.attention_options = attention_options.with_preset(
      config.model.attention, config.model.attention_options,
      config.get("attention_preset", "method"), config.get("task"))
  return config


def attention_preset_of(presets: Iterable[str]) -> str:
  """The attention preset among a config argument's presets ("method" if none).

  Raises:
    ValueError: when more than one is given.
  """
  from attention_jax.registry import PRESETS  # pylint: disable=g-import-not-at-top
  chosen = [p for p in presets if p in PRESETS]
  if len(chosen) > 1:
    raise ValueError(f"config argument names the attention presets {', '.join(chosen)}; "
                     f"choose one of {', '.join(PRESETS)}.")
  return chosen[0] if chosen else "method"


def _flatten(config: ml_collections.ConfigDict, prefix: str = "") -> Dict[str, Any]:
  """`{"a.b": value}` for every leaf key, not descending into free-form dicts."""
  flat = {}
  for key, value in config.items():
    path = f"{prefix}{key}"
    if isinstance(value, ml_collections.ConfigDict) and path not in FREE_FORM:
      flat.update(_flatten(value, path + "."))
    else:
      flat[path] = value
  return flat


def check_config(config: ml_collections.ConfigDict) -> None:
  """Raises ValueError on a key the trainer does not know, or a value out of range.

  The model's and the optimiser's own keys are checked by `build_model` and
  `make_optimizer`; the task name and options by `attention_jax.data.get_task`.
  """
  known = _flatten(default_config())
  # The default lists the options of the default feed-forward layer; a config
  # that picks another one sets that layer's options.
  kind = config.get("model", {}).get("feed_forward")
  if kind in FEED_FORWARD_LAYERS:
    known.update({f"model.feed_forward_options.{name}": default
                  for name, default in feed_forward_options(kind).items()})
  given = _flatten(config)
  known_prefixes = {".".join(key.split(".")[:n]) for key in known
                    for n in range(1, key.count(".") + 2)}

  def first_unknown(key: str) -> str:  # "optimiser" rather than "optimiser.learning_rate"
    parts = key.split(".")
    return next(".".join(parts[:n]) for n in range(1, len(parts) + 1)
                if ".".join(parts[:n]) not in known_prefixes)

  unknown = sorted({first_unknown(key) for key in set(given) - set(known)})
  if unknown:
    raise ValueError(f"unknown config key(s) {', '.join(map(repr, unknown))}."
                     f"{did_you_mean(unknown[0], known_prefixes)} Valid keys are: "
                     f"{', '.join(sorted(known))}.")
  positive = ("num_train_steps", "batch_size", "eval_every", "log_every", "checkpoint_every",
              "keep_checkpoints", "sequence_shards")
  for key in positive:
    if not isinstance(config[key], int) or config[key] < 1:
      raise ValueError(f"config.{key} must be a positive integer, got {config[key]!r}.")
  for key in ("eval_batch_size", "eval_steps"):
    if config[key] is not None and config[key] < 1:
      raise ValueError(f"config.{key} must be a positive integer or None, got {config[key]!r}.")


def config_differences(saved: Dict[str, Any], current: Dict[str, Any]) -> List[Tuple[str, Any,
                                                                                    Any]]:
  """`(key, saved value, current value)` for each key where two configs (as
  `to_dict()`s) differ in something that changes what a run computes.

  A model field the saved config lacks is no difference when the current
  config leaves it at its default: a field added to `ModelConfig` after the
  run started defaults to what the model did before it, so a killed run
  still resumes."""
  flat = lambda d, p="": {k2: v2 for k, v in d.items() for k2, v2 in (
      flat(v, f"{p}{k}.").items() if isinstance(v, dict) and f"{p}{k}" not in FREE_FORM
      else [(f"{p}{k}", v)])}
  a, b = flat(saved), flat(current)
  # Keys added to the trainer's config after a run started, at their defaults.
  added_keys = default_config()
  defaults = dict(flat({"model": default_model_config().to_dict(),
                        "length_eval": added_keys.length_eval.to_dict(),
                        "pretrain": added_keys.pretrain.to_dict()}),
                  sequence_shards=added_keys.sequence_shards)
  added_at_default = {key for key in set(b) - set(a)
                      if key in defaults and _normalise(b[key]) == _normalise(defaults[key])}
  return [(key, a.get(key), b.get(key)) for key in sorted(set(a) | set(b))
          if key not in RESTARTABLE and key not in added_at_default
          and _normalise(a.get(key)) != _normalise(b.get(key))]


def _normalise(value: Any) -> Any:
  """Tuples and lists compare equal (JSON turns tuples into lists)."""
  if isinstance(value, (tuple, list)):
    return [_normalise(v) for v in value]
  if isinstance(value, dict):
    return {k: _normalise(v) for k, v in value.items()}
  return value


def load_config_module(path: str | pathlib.Path) -> ModuleType:
  """The Python config file at `path` as a module (configs are files, not a
  package: `--config=configs/lra/listops.py` loads them by path too).

  Raises:
    ValueError: when `path` is not a file or has no `get_config`.
  """
  module = load_config_helpers(path)
  if not hasattr(module, "get_config"):
    raise ValueError(f"config file {str(path)!r} has no get_config().")
  return module


def load_config_helpers(path: str | pathlib.Path) -> ModuleType:
  """The Python file at `path` under configs/ as a module, with or without a
  `get_config`: how a config file reads the code it shares with others
  (configs/lra/_shared.py), since configs are files, not a package.

  Raises:
    ValueError: when `path` is not a file.
  """
  path = pathlib.Path(path)
  if not path.is_file():
    raise ValueError(f"config file {str(path)!r} does not exist.")
  spec = importlib.util.spec_from_file_location(f"_config_{path.stem}", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def parse_config_arg(arg: str, presets: Iterable[str]) -> Tuple[str, Tuple[str, ...]]:
  """Splits a config file's argument `"variant[,preset...]"`.

  A preset is one of the config file's `presets` or an attention preset of
  the registry ("method", "lra_release"; `attention_preset_of` picks it).

  Returns:
    `(variant, presets)`; the variant is checked against the registry.

  Raises:
    ValueError: on an unknown variant or preset.
  """
  # pylint: disable-next=g-import-not-at-top
  from attention_jax.registry import PRESETS, get_mixer, variant_presets
  variant, *chosen = [part.strip() for part in (arg or "dot_product").split(",")]
  get_mixer(variant)
  for preset in chosen:
    if preset in PRESETS and preset not in variant_presets(variant):
      raise ValueError(f"attention variant {variant!r} has no preset {preset!r} (config "
                       f"argument {arg!r}); its presets are: "
                       f"{', '.join(variant_presets(variant))}.")
  presets = tuple(presets) + tuple(PRESETS)
  for preset in chosen:
    if preset not in presets:
      raise ValueError(f"unknown preset {preset!r} in config argument {arg!r}; valid presets "
                       f"are: {', '.join(presets)}.")
  return variant, tuple(chosen)
