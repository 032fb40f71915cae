"""Reversing a string of symbols with the RNN encoder-decoder and attention.

  python -m experiments.train --config=configs/seq2seq/reverse.py:additive --workdir=runs/rev
  python -m experiments.train --config=configs/seq2seq/reverse.py:luong_dot,smoke \
      --config.model.decoder_attention=False --workdir=runs/rev_no_attention

The variant is the decoder's attention (any Q/K/V variant with a
cross-attention form; `--config.model.decoder_attention=False` removes it).
A one-layer bidirectional GRU encoder and GRU decoder of width 64, one head,
trained with teacher forcing; evaluation also decodes greedily
(`--config.model.beam_size=K` for beam search) and reports
"sequence_accuracy", the share of outputs right to the last symbol and EOS.

Presets:
- smoke: sources of 20 to 30 symbols from 10 and 2,000 steps of batch 64 (a
  few minutes on a 2-core CPU): long enough that the decoder without
  attention, which must carry the whole string in its 64-wide state, fails
  where the attention models succeed.
"""

from attention_jax.train.config import attention_preset_of, default_config, parse_config_arg

PRESETS = ("smoke",)


def get_config(arg: str = "additive"):
  variant, presets = parse_config_arg(arg, PRESETS)
  config = default_config(variant, attention_preset_of(presets))
  config.task = "reverse"
  config.task_options = dict(num_symbols=10, min_length=10, max_length=50)
  config.model.update(kind="rnn_seq2seq", rnn_cell="gru", embed_dim=128, num_heads=1,
                      dropout_rate=0.1, attention_dropout_rate=0.0, beam_size=1)
  config.num_train_steps = 10_000
  config.batch_size = 64
  config.optimizer.update(learning_rate=1e-3, warmup_steps=200, schedule="cosine",
                          weight_decay=0.0, grad_clip_norm=1.0)
  config.eval_every = config.checkpoint_every = 1000
  config.log_every = 100

  if "smoke" in presets:
    config.task_options = dict(train_size=20_000, validation_size=500, test_size=500,
                               num_symbols=10, min_length=20, max_length=30)
    config.model.update(embed_dim=64, dropout_rate=0.0)
    config.num_train_steps = 2000
    config.optimizer.update(learning_rate=3e-3, warmup_steps=100)
    config.eval_every = config.checkpoint_every = 500
  return config
