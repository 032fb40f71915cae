"""Generated document matching: the retrieval task's shape with pairs made here.

  task = attention_jax.data.get_task("matching", seq_len=256)

LRA's retrieval task (`retrieval.py`) asks whether two documents are related
and needs the AAN pairs of the LRA release, which cannot be generated. This
task keeps its shape (`inputs`, `inputs2` `[seq_len]` tokens with padding 0,
`label` 0/1, a dual-encoder model) with documents the project generates, so
that a dual encoder (and Sentence-BERT's pooling in it) trains on something
learnable where the release files are absent. It is not an LRA task.

Each of `num_topics` topics owns `words_per_topic` token ids of its own; the
other ids form a background shared by all. A document has a random length
between `seq_len // 2` and `seq_len` (the rest is padding); each of its
tokens is one of its topic's words with probability `topic_rate`, else a
background token, both uniform. A pair is related (label 1) when its two
documents share a topic; half the pairs are. No single token decides it:
a document's topic shows only in the frequencies of its words, so a model
must summarise each document (pooling) and compare the summaries.

Splits are a pure function of (seed, split), as the other generated tasks.
"""

from __future__ import annotations

from typing import Dict

import numpy as np

from attention_jax.data.base import GeneratedTask, TaskInfo

PAD_ID = 0
ARRAYS = ("inputs", "inputs2", "label")


def documents(topics: np.ndarray, rng: np.random.Generator, *, seq_len: int,
              num_topics: int, words_per_topic: int, topic_rate: float,
              vocab_size: int) -> np.ndarray:
  """`[len(topics), seq_len]` int16 token ids: one document per topic index.

  Ids `1 .. num_topics * words_per_topic` are the topics' words (topic t owns
  the block starting at `1 + t * words_per_topic`); the ids above them are the
  background.
  """
  count = len(topics)
  first_background = 1 + num_topics * words_per_topic
  topic_words = 1 + topics[:, None] * words_per_topic + rng.integers(
      0, words_per_topic, (count, seq_len))
  background = rng.integers(first_background, vocab_size, (count, seq_len))
  tokens = np.where(rng.random((count, seq_len)) < topic_rate, topic_words, background)
  lengths = rng.integers(seq_len // 2, seq_len + 1, count)
  tokens[np.arange(seq_len)[None, :] >= lengths[:, None]] = PAD_ID
  return tokens.astype(np.int16)


def pairs(count: int, rng: np.random.Generator, **generation) -> Dict[str, np.ndarray]:
  """`count` pairs, `inputs`, `inputs2` `[count, seq_len]` and `label [count]`:
  half related (the same topic), in a random order."""
  num_topics = generation["num_topics"]
  label = rng.permutation(np.arange(count) % 2).astype(np.uint8)
  first = rng.integers(0, num_topics, count)
  # Another topic for an unrelated pair: a shift of 1 .. num_topics - 1.
  second = np.where(label == 1, first, (first + rng.integers(1, num_topics, count)) % num_topics)
  return dict(inputs=documents(first, rng, **generation),
              inputs2=documents(second, rng, **generation), label=label)


def make_task(train_size: int = 20_000, validation_size: int = 1_000, test_size: int = 1_000,
              seed: int = 0, seq_len: int = 256, num_topics: int = 16, words_per_topic: int = 8,
              topic_rate: float = 0.1, vocab_size: int = 257) -> GeneratedTask:
  """The matching task over documents of at most `seq_len` tokens.

  Args:
    num_topics: how many topics the documents are drawn from (at least 2).
    words_per_topic: the token ids each topic owns.
    topic_rate: the probability that a token is its topic's word, in (0, 1].
    vocab_size: token ids are in [0, vocab_size) (257: the byte vocabulary of
      the retrieval task); it must leave at least one background id.
  """
  sizes = {"train": train_size, "validation": validation_size, "test": test_size}
  for name, value in dict(seq_len=seq_len, words_per_topic=words_per_topic,
                          **{f"{split}_size": size for split, size in sizes.items()}).items():
    if int(value) != value or value < 1:
      raise ValueError(f"{name} must be a positive integer, got {value!r}.")
  if seq_len < 2:
    raise ValueError(f"seq_len must be at least 2 (documents of seq_len // 2 tokens or more), "
                     f"got {seq_len}.")
  if int(num_topics) != num_topics or num_topics < 2:
    raise ValueError(f"num_topics must be an integer >= 2 (unrelated pairs need two topics), "
                     f"got {num_topics!r}.")
  if not 0.0 < topic_rate <= 1.0:
    raise ValueError(f"topic_rate must be in (0, 1], got {topic_rate!r}.")
  first_background = 1 + num_topics * words_per_topic
  if vocab_size <= first_background:
    raise ValueError(f"vocab_size must exceed 1 + num_topics * words_per_topic = "
                     f"{first_background} (padding, the topics' words and at least one "
                     f"background id), got {vocab_size}.")
  generation = dict(seq_len=int(seq_len), num_topics=int(num_topics),
                    words_per_topic=int(words_per_topic), topic_rate=float(topic_rate),
                    vocab_size=int(vocab_size))
  info = TaskInfo(name="matching", vocab_size=int(vocab_size), num_classes=2, seq_len=int(seq_len),
                  dual=True, split_sizes=sizes)
  return GeneratedTask(info, pairs, generation=generation, seed=seed, arrays=ARRAYS)
