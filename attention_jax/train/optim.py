"""The optimiser: AdamW with a warm-up/decay schedule, clipping and accumulation."""

from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp
import ml_collections
import optax

from attention_jax.registry import unknown_name_error

SCHEDULES = ("linear", "cosine", "rsqrt")


def default_optimizer_config() -> ml_collections.ConfigDict:
  """Every key `make_optimizer` accepts, with its default."""
  return ml_collections.ConfigDict(dict(
      learning_rate=1e-3,  # the peak, reached at the end of the warm-up
      warmup_steps=1000,  # linear from 0
      schedule="cosine",  # decay after the warm-up: one of SCHEDULES
      num_train_steps=10_000,  # where "linear" and "cosine" reach end_learning_rate
      end_learning_rate=0.0,
      weight_decay=0.1,  # decoupled; not applied to biases and norm scales
      b1=0.9,
      b2=0.98,
      eps=1e-9,
      grad_clip_norm=1.0,  # global-norm clipping; 0 or None disables it
      grad_accum_steps=1,  # micro-batches per update (optax.MultiSteps when > 1)
  ))


def _checked(config: Mapping[str, Any]) -> dict:
  """`config` completed with defaults; unknown keys and bad values raise ValueError."""
  defaults = default_optimizer_config()
  config = dict(config.items())
  for key in config:
    if key not in defaults:
      raise unknown_name_error("optimizer config key", key, sorted(defaults.keys()))
  c = {key: config.get(key, defaults[key]) for key in defaults.keys()}
  if c["schedule"] not in SCHEDULES:
    raise ValueError(f"schedule must be one of {SCHEDULES}, got {c['schedule']!r}.")
  if c["learning_rate"] <= 0:
    raise ValueError(f"learning_rate must be positive, got {c['learning_rate']}.")
  if c["warmup_steps"] < 0:
    raise ValueError(f"warmup_steps must be >= 0, got {c['warmup_steps']}.")
  if c["schedule"] != "rsqrt" and c["num_train_steps"] <= c["warmup_steps"]:
    raise ValueError(f"num_train_steps ({c['num_train_steps']}) must exceed warmup_steps "
                     f"({c['warmup_steps']}) for the {c['schedule']!r} decay.")
  if int(c["grad_accum_steps"]) < 1:
    raise ValueError(f"grad_accum_steps must be >= 1, got {c['grad_accum_steps']}.")
  return c


def make_schedule(config: Mapping[str, Any]) -> optax.Schedule:
  """The learning rate at each optimiser update: linear warm-up from 0 to the
  peak over `warmup_steps`, then the `schedule` decay.

  - "linear": straight down to `end_learning_rate` at `num_train_steps`.
  - "cosine": half a cosine down to `end_learning_rate` at `num_train_steps`.
  - "rsqrt": `peak * sqrt(w / step)` with `w = max(warmup_steps, 1)` (the
    Transformer's inverse square root); `num_train_steps` is not used.

  Raises:
    ValueError: on an unknown schedule name or key, or inconsistent steps.
  """
  c = _checked(config)
  peak, warmup, end = c["learning_rate"], int(c["warmup_steps"]), c["end_learning_rate"]
  decay_steps = int(c["num_train_steps"]) - warmup
  if c["schedule"] == "linear":
    decay = optax.linear_schedule(peak, end, decay_steps)
  elif c["schedule"] == "cosine":
    decay = optax.cosine_decay_schedule(peak, decay_steps, alpha=end / peak)
  else:
    # optax has no inverse-square-root schedule. `join_schedules` passes the
    # steps since the warm-up ended (negative before it, where the value is
    # computed and discarded), so the decay starts at the peak.
    offset = max(warmup, 1)
    decay = lambda count: peak * jnp.sqrt(offset / (offset + jnp.maximum(count, 0)))
  if warmup == 0:
    return decay
  return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup), decay], [warmup])


def weight_decay_mask(params: Any) -> Any:
  """True for the parameters that weight decay applies to: matrices and higher
  (kernels, embeddings), not biases, norm scales or other vectors.

  Shrinking a bias or a norm's scale towards 0 only constrains the offset and
  the gain of a layer, which is why decoupled decay usually skips them.
  """
  def decays(path, leaf) -> bool:
    # The last dictionary key is the parameter's name, also when the leaf sits
    # in a partitioning box (whose own path entry is an attribute).
    names = [entry.key for entry in path if isinstance(entry, jax.tree_util.DictKey)]
    name = str(names[-1]) if names else ""
    return len(leaf.shape) >= 2 and not name.endswith("bias")
  return jax.tree_util.tree_map_with_path(decays, params)


def make_optimizer(config: Mapping[str, Any]) -> optax.GradientTransformation:
  """AdamW on the `make_schedule` learning rate, after global-norm clipping,
  optionally accumulating `grad_accum_steps` micro-batches per update.

  Args:
    config: keys of `default_optimizer_config()`; missing keys take defaults.

  Raises:
    ValueError: on an unknown key or schedule, or inconsistent values.
  """
  c = _checked(config)
  adamw = optax.adamw(make_schedule(c), b1=c["b1"], b2=c["b2"], eps=c["eps"],
                      weight_decay=c["weight_decay"], mask=weight_decay_mask)
  tx = (optax.chain(optax.clip_by_global_norm(c["grad_clip_norm"]), adamw)
        if c["grad_clip_norm"] else adamw)
  if int(c["grad_accum_steps"]) > 1:
    # The schedule counts updates, not micro-batches: MultiSteps only calls the
    # inner optimiser once per `grad_accum_steps` gradients (their mean).
    tx = optax.MultiSteps(tx, every_k_schedule=int(c["grad_accum_steps"]))
  return tx
