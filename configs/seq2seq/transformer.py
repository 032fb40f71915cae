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

import pathlib

from attention_jax.attention_options import options_config
from attention_jax.train.config import load_config_module, parse_config_arg

PRESETS = ("smoke", "transparent")


def get_config(arg: str = "dot_product"):
  variant, presets = parse_config_arg(arg, PRESETS)
  # The task, its sizes and the training schedule are the RNN's
  # (configs/seq2seq/reverse.py, with its smoke preset); the model is replaced.
  rnn_presets = [p for p in presets if p != "transparent"]
  config = load_config_module(pathlib.Path(__file__).with_name("reverse.py")).get_config(
      ",".join([variant, *rnn_presets]))
  config.model.update(kind="transformer_seq2seq", attention="dot_product",
                      cross_attention=variant, num_layers=2, embed_dim=64, num_heads=4,
                      mlp_dim=128, position="learned",
                      dropout_rate=0.0 if "smoke" in presets else 0.1,
                      transparent_attention="transparent" in presets)
  # Every option of the cross-attention variant, settable from the command line.
  config.model.attention_options = options_config("dot_product", variant)
  config.optimizer.learning_rate = 1e-3  # the RNN's smoke preset trains at 3e-3
  return config
