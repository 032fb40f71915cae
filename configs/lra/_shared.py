"""What the LRA task configs (configs/lra/<task>.py) share: the start of a
config, the release's model and training blocks, the smoke runs and the
architecture presets. Not a config itself (no `get_config`); each task file
loads it by path, as configs are files, not a package:

  shared = load_config_helpers(pathlib.Path(__file__).with_name("_shared.py"))

Attention dropout is 0 on every task, not the release's 0.1 (0.2 on Image):
most of our variants have no attention weights to drop and refuse a rate
above 0 in training, and a comparison should not favour those that do
(docs/ARCHITECTURE.md).
"""

from attention_jax.train.config import attention_preset_of, default_config, parse_config_arg

# The smoke model of the text-like tasks (ListOps, Text, Retrieval).
SMOKE_MODEL = dict(num_layers=2, embed_dim=64, num_heads=4, mlp_dim=128, head_mlp_dim=128)
# Their smoke runs trade the release's rsqrt schedule for a short cosine, with
# clipping and a little weight decay.
SMOKE_OPTIMIZER = dict(schedule="cosine", weight_decay=0.01, grad_clip_norm=1.0)
# The `vit` preset of the image tasks: a Vision Transformer (models/vit.py) over
# patches of 4 x 4 pixels and a [CLS], learned positions, pre-LN with a GELU MLP.
VIT_MODEL = dict(kind="vit", patch_size=4, pooling="cls", position="learned",
                 residual="pre_norm", activation="gelu")


def task_config(arg: str, presets, task: str):
  """`(config, variant, chosen presets)` for the argument `"variant[,preset...]"`
  of a task's config file (its `presets`, or an attention preset)."""
  variant, chosen = parse_config_arg(arg, presets)
  config = default_config(variant, attention_preset_of(chosen))
  config.task = task
  return config, variant, chosen


def release_model(config, **model) -> None:
  """The release's model `model` (sizes, pooling, positions, dropout), with the
  classifier head's hidden layer as wide as the MLP (the release's
  classifier_head(..., mlp_dim)) and no attention dropout (see above)."""
  config.model.update(model, head_mlp_dim=model["mlp_dim"], attention_dropout_rate=0.0)


def rsqrt_run(config, *, num_train_steps: int, warmup_steps: int, eval_every: int) -> None:
  """The release's run on the text-like tasks: batch 32, Adam (0.9, 0.98,
  1e-9) with decoupled weight decay 0.1, no gradient clipping, and its
  default schedule "constant * linear_warmup * rsqrt_decay" with constant
  0.05, i.e. 0.05 * min(1, s / warmup) / sqrt(max(s, warmup)): our "rsqrt"
  with a peak of the constant over sqrt(warmup)."""
  config.num_train_steps = num_train_steps
  config.batch_size = 32
  config.optimizer.update(learning_rate=0.05 / warmup_steps ** 0.5, warmup_steps=warmup_steps,
                          schedule="rsqrt", weight_decay=0.1, grad_clip_norm=0.0)
  # Every evaluation is checkpointed too (the trainer keeps the best one).
  config.eval_every = config.checkpoint_every = eval_every


def epoch_run(config, *, batch_size: int, train_examples: int, num_epochs: int,
              learning_rate: float, grad_clip_norm: float = 0.0) -> None:
  """The release's run on the image tasks: `num_epochs` epochs of
  `train_examples // batch_size` steps, Adam (0.9, 0.98, 1e-9) without weight
  decay, "constant * linear_warmup * cosine_decay" with one epoch of warm-up
  (our "cosine"), and an evaluation every epoch."""
  config.batch_size = batch_size
  steps_per_epoch = train_examples // batch_size
  config.num_train_steps = num_epochs * steps_per_epoch
  config.optimizer.update(learning_rate=learning_rate, warmup_steps=steps_per_epoch,
                          schedule="cosine", weight_decay=0.0, grad_clip_norm=grad_clip_norm)
  # Every evaluation is checkpointed too (the trainer keeps the best one).
  config.eval_every = config.checkpoint_every = steps_per_epoch


def release_variant_run(config, variant: str, presets, models, optimizers=None) -> None:
  """Under the lra_release preset (not with smoke), what the release's
  per-variant config of the task changes: the model `models[variant]` (the
  head's hidden layer following its mlp_dim) and the optimiser
  `optimizers[variant]`."""
  if config.attention_preset == "lra_release" and "smoke" not in presets:
    release = models.get(variant, {})
    config.model.update(release, head_mlp_dim=release.get("mlp_dim", config.model.mlp_dim))
    config.optimizer.update((optimizers or {}).get(variant, {}))


def smoke_run(config, *, num_train_steps: int, learning_rate: float, warmup_steps: int,
              eval_every: int, log_every: int = 25, **optimizer) -> None:
  """A smoke preset's run: `num_train_steps` steps, the optimiser's rate,
  warm-up and `optimizer` changes, an evaluation (and checkpoint) every
  `eval_every` steps."""
  config.num_train_steps = num_train_steps
  config.optimizer.update(learning_rate=learning_rate, warmup_steps=warmup_steps, **optimizer)
  config.eval_every = config.checkpoint_every = eval_every
  config.log_every = log_every


def text_smoke(config) -> None:
  """The smoke preset of Text and Retrieval: the first 2,000 / 256 / 256
  examples cut to 256 bytes, `SMOKE_MODEL` and 300 steps."""
  config.task_options.update(dict(seq_len=256, train_size=2000, validation_size=256,
                                  test_size=256))
  config.model.update(SMOKE_MODEL)
  smoke_run(config, num_train_steps=300, learning_rate=1e-3, warmup_steps=30, eval_every=100,
            **SMOKE_OPTIMIZER)


def funnel_and_hierarchical(config, presets, chunk_length: int) -> None:
  """The `funnel` and `hierarchical` presets of the text-like tasks: a Funnel
  Transformer (models/funnel.py) of three stages of two blocks, or a
  hierarchical Transformer (models/hierarchical.py) over chunks of
  `chunk_length` tokens with 2 blocks over the chunk vectors."""
  if "funnel" in presets:
    config.model.update(kind="funnel", funnel_blocks=(2, 2, 2))
  if "hierarchical" in presets:
    config.model.update(kind="hierarchical", chunk_length=chunk_length, sentence_layers=2)
