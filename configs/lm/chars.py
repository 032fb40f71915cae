"""A character-level language model on the generated corpus of
`attention_jax.data.chars` (or your own text file), reported in bits per
character.

  python -m experiments.train --config=configs/lm/chars.py:transformer_xl --workdir=runs/xl
  python -m experiments.train --config=configs/lm/chars.py:transformer_xl \
      --config.model.attention_options.memory_length=0 --workdir=runs/no_memory
  python -m experiments.train --config=configs/lm/chars.py:transformer_xl \
      --config.task_options.text_file=enwik8 --workdir=runs/enwik8

The corpus: 2,000,000 generated characters for training and 100,000 each for
validation and test (synthetic documents whose invented names recur thousands
of characters apart; 56 symbols), read as consecutive segments of 128
characters, each row of a batch continuing its own stretch of the corpus
(`data.stream_batches`), so a model with a memory (Transformer-XL,
compressive) carries it from one step to the next, as Dai et al. 2019 train.
Evaluation runs the split's streams from an empty memory.

The model: a 4-layer decoder of width 128 (4 heads, MLP 512), no dropout,
with Transformer-XL's relative positions (none for the chunkwise recurrent
mixers, which, as in their papers, order tokens by their recurrence). With `memory_length=128` (the
segment length, as the paper trains) each layer attends to the previous
segment too; with `memory_length=0` it is the same decoder, parameter for
parameter, seeing one segment at a time: the plain decoder of the same size
at the same segment length. Training: 3,000 steps of 16 streams (6.1 M
characters, three passes over the corpus) with Adam at 2e-3, cosine decay.
Bits per character ("bits_per_token") is the cross-entropy in bits of the
127 characters of each segment that a position of the segment predicts.
"""

from attention_jax import registry
from attention_jax.train.config import attention_preset_of, default_config, parse_config_arg

PRESETS = ()


def get_config(arg: str = "transformer_xl"):
  variant, presets = parse_config_arg(arg, PRESETS)
  config = default_config(variant, attention_preset_of(presets))
  config.task = "chars"
  config.task_options = dict(train_size=2_000_000, validation_size=100_000,
                             test_size=100_000, seq_len=128)
  config.model.update(kind="language_model", num_layers=4, embed_dim=128, num_heads=4,
                      mlp_dim=512, position="xl_relative", dropout_rate=0.0,
                      attention_dropout_rate=0.0)
  if variant in ("transformer_xl", "compressive"):
    config.model.attention_options.memory_length = 128
  if registry.get_variant(variant).family == "chunkwise":
    # The recurrent mixers order tokens by their recurrence; their papers
    # add no position encoding (and a relative one has no place in them).
    config.model.position = "none"
  config.num_train_steps = 3000
  config.batch_size = 16
  config.optimizer.update(learning_rate=2e-3, warmup_steps=200, schedule="cosine",
                          weight_decay=0.01, grad_clip_norm=1.0)
  config.eval_every = config.checkpoint_every = 500
  config.log_every = 100
  return config
