"""A dual encoder on generated document matching (attention_jax.data.matching).

  python -m experiments.train --config=configs/matching/dual_encoder.py:dot_product,smoke \\
      --config.model.pair_features=sentence_bert --config.model.pooling=mean --workdir=...

LRA's retrieval task needs the AAN pairs of the LRA release; this is its
shape (two documents of byte-sized token ids through one shared encoder,
related or not) over pairs the project generates: documents of 128 to 256
tokens, each drawn from one of 16 topics (three tenths of its tokens are
the topic's words, the rest shared background), half the pairs from one
topic. At a tenth, the smoke model's [CLS] pooling stayed at chance in 300
steps (mean pooling reached 69%); at three tenths [CLS] reaches 96%.
The model and training are retrieval's smoke preset (configs/lra/retrieval.py):
2 layers of width 64, [CLS] pooling, LRA's pair features [u, v, u*v, u-v]
unless `model.pair_features="sentence_bert"` ([u, v, |u-v|]); the
architectures table runs Sentence-BERT's pooling by [CLS], mean and max here.

Presets: smoke: 300 steps of batch 32 over 2,000 training pairs (the
default: 1,500 steps over 20,000).
"""

import ml_collections

from attention_jax.train.config import attention_preset_of, default_config, parse_config_arg

PRESETS = ("smoke",)


def get_config(arg: str = "dot_product"):
  variant, presets = parse_config_arg(arg, PRESETS)
  config = default_config(variant, attention_preset_of(presets))
  config.task = "matching"
  config.task_options = ml_collections.ConfigDict(dict(
      seq_len=256, topic_rate=0.3, train_size=20_000, validation_size=500, test_size=500))
  config.model.update(kind="dual_classifier", num_layers=2, embed_dim=64, num_heads=4,
                      mlp_dim=128, head_mlp_dim=128, pooling="cls", position="sinusoidal",
                      dropout_rate=0.1, attention_dropout_rate=0.0)
  config.num_train_steps = 1500
  config.batch_size = 32
  config.optimizer.update(learning_rate=1e-3, warmup_steps=30, schedule="cosine",
                          weight_decay=0.01, grad_clip_norm=1.0)
  config.eval_every = config.checkpoint_every = 100
  config.log_every = 25
  if "smoke" in presets:
    config.task_options.update(dict(train_size=2000, validation_size=256, test_size=256))
    config.num_train_steps = 300
  return config
