"""Reversing a string of symbols with the Transformer encoder-decoder.

  python -m experiments.train --config=configs/seq2seq/transformer.py:dot_product,smoke --workdir=...
  python -m experiments.train --config=configs/seq2seq/transformer.py:additive,transparent,smoke ...

The variant is the decoder's cross-attention to the source (any Q/K/V
variant with a cross-attention form); the encoder's and the decoder's
self-attention are dot_product. Two encoder and two decoder layers of width
64, 4 heads, learned positions. Evaluation decodes greedily and
reports "sequence_accuracy" as `configs/seq2seq/reverse.py` does.

Presets:
- smoke: sources of 20 to 30 symbols from 10 (the RNN smoke task), 2,000
  steps of batch 64.
- transparent: the decoder attends to a learned mix of every encoder layer's
  output (Bapna et al. 2018).
"""

from attention_jax.models import attention_options_config
from attention_jax.train.config import attention_preset_of, default_config, parse_config_arg

PRESETS = ("smoke", "transparent")


def get_config(arg: str = "dot_product"):
  variant, presets = parse_config_arg(arg, PRESETS)
  config = default_config("dot_product", attention_preset_of(presets))
  config.task = "reverse"
  config.task_options = dict(num_symbols=10, min_length=10, max_length=50)
  config.model.update(kind="transformer_seq2seq", cross_attention=variant, num_layers=2,
                      embed_dim=64, num_heads=4, mlp_dim=128, position="learned",
                      dropout_rate=0.1, attention_dropout_rate=0.0, beam_size=1,
                      transparent_attention="transparent" in presets)
  # Every option of the cross-attention variant, settable from the command line.
  config.model.attention_options = attention_options_config("dot_product", variant)
  config.num_train_steps = 10_000
  config.batch_size = 64
  config.optimizer.update(learning_rate=1e-3, warmup_steps=200, schedule="cosine",
                          weight_decay=0.0, grad_clip_norm=1.0)
  config.eval_every = config.checkpoint_every = 1000
  config.log_every = 100

  if "smoke" in presets:
    config.task_options = dict(train_size=20_000, validation_size=500, test_size=500,
                               num_symbols=10, min_length=20, max_length=30)
    config.model.update(dropout_rate=0.0)
    config.num_train_steps = 2000
    config.optimizer.update(learning_rate=1e-3, warmup_steps=100)
    config.eval_every = config.checkpoint_every = 500
  return config
