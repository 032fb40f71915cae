"""A character-level language-modelling corpus, generated here or read from a
text file, cut into consecutive segments.

  task = attention_jax.data.get_task("chars", seq_len=128)            # generated
  task = attention_jax.data.get_task("chars", text_file="enwik8.txt") # your own

The generated corpus ("synthetic documents") is made for what a recurrence
memory is for: dependencies longer than a segment. It is a sequence of
documents; each document invents a handful of names (capitalised pseudo-words
of 5 to 10 letters, never in the common vocabulary) and writes sentences of
common pseudo-words (a fixed vocabulary of 2,000 drawn once per seed, used
with Zipfian frequencies) into which its names recur. A document runs to
several thousand characters, so a name's later occurrences are usually
segments away from its first: a model that remembers earlier segments can
copy the name after its first letters, one that sees a segment alone must
guess them. The default sizes are 2,000,000 training characters and 100,000
each for validation and test, from `np.random.default_rng([seed, split])`.

A text file (`text_file=`) is read as bytes, each byte a token, and split
90 / 5 / 5 into train, validation and test in file order (enwik8's split).

Tokens: 0 is padding (never in the corpus); a generated corpus's characters
are `CHARS` from 1; a byte b of a text file is b + 1. A split's examples are
its consecutive segments of `seq_len` tokens, in corpus order
(`inputs [N, seq_len]`; the tail shorter than a segment is dropped), so
segment i + 1 continues segment i: `data.stream_batches` hands each row of a
batch the next segment of its own stretch of the corpus.
"""

from __future__ import annotations

import pathlib
import string
from typing import Dict, Optional

import numpy as np

from attention_jax.data.base import SPLITS, ArraySource, ExampleSource, Task, TaskInfo, \
    prepare_generated

CHARS = string.ascii_lowercase + string.ascii_uppercase + " .,\n"
CONSONANTS, VOWELS = "bcdfghjklmnprstvwz", "aeiou"
VOCABULARY_SIZE = 2000


def _pseudo_word(rng: np.random.Generator, syllables: int) -> str:
  return "".join(CONSONANTS[rng.integers(len(CONSONANTS))] + VOWELS[rng.integers(len(VOWELS))]
                 + (CONSONANTS[rng.integers(len(CONSONANTS))] if rng.random() < 0.3 else "")
                 for _ in range(syllables))


def vocabulary(seed: int) -> list:
  """The common pseudo-words of a corpus, most frequent first (one per seed, all splits)."""
  rng = np.random.default_rng([seed, 99])
  words = set()
  while len(words) < VOCABULARY_SIZE:
    words.add(_pseudo_word(rng, int(rng.integers(1, 4))))
  return sorted(words, key=lambda w: (len(w), w))  # short words are the frequent ones


def synthetic_documents(num_chars: int, rng: np.random.Generator, words: list) -> str:
  """At least `num_chars` characters of documents (see the module docstring),
  cut to exactly `num_chars`."""
  zipf = 1.0 / np.arange(1, len(words) + 1)
  zipf /= zipf.sum()
  common = set(words)
  pieces, total = [], 0
  while total < num_chars:
    names = []
    while len(names) < int(rng.integers(3, 7)):
      name = _pseudo_word(rng, int(rng.integers(2, 4))).capitalize()
      if name.lower() not in common and name not in names:
        names.append(name)
    sentences = []
    for _ in range(int(rng.integers(40, 80))):
      sentence = list(rng.choice(words, size=int(rng.integers(4, 12)), p=zipf))
      for _ in range(int(rng.integers(1, 3))):  # one or two names per sentence
        sentence.insert(int(rng.integers(0, len(sentence) + 1)), names[rng.integers(len(names))])
      text = " ".join(sentence)
      sentences.append(text[0].upper() + text[1:] + ".")
    document = "\n".join(" ".join(sentences[i:i + 5]) for i in range(0, len(sentences), 5))
    pieces.append(document + "\n\n")
    total += len(pieces[-1])
  return "".join(pieces)[:num_chars]


def encode(text: str) -> np.ndarray:
  """Characters of `CHARS` as tokens from 1 `[len(text)]` int32."""
  table = np.zeros(128, np.int32)
  table[[ord(c) for c in CHARS]] = np.arange(1, len(CHARS) + 1)
  codes = np.frombuffer(text.encode("ascii"), np.uint8)
  return table[codes]


def decode(tokens: np.ndarray) -> str:
  """The inverse of `encode` (padding dropped)."""
  return "".join(CHARS[t - 1] for t in np.asarray(tokens).tolist() if t > 0)


class CharTask(Task):
  """Consecutive segments of a character corpus (see the module docstring)."""

  def __init__(self, *, sizes: Dict[str, int], seed: int, seq_len: int,
               text_file: Optional[str]):
    self.sizes, self.seed, self.seq_len = sizes, seed, seq_len
    self.text_file = None if text_file is None else str(pathlib.Path(text_file).resolve())
    vocab_size = 1 + (256 if text_file else len(CHARS))
    split_sizes = {split: size // seq_len for split, size in sizes.items()}
    self.info = TaskInfo(name="chars", vocab_size=vocab_size, num_classes=vocab_size,
                         seq_len=seq_len, split_sizes=split_sizes, stream=True)

  def _settings(self, split: str) -> dict:
    if self.text_file:
      return dict(text_file=self.text_file, size=pathlib.Path(self.text_file).stat().st_size)
    return dict(seed=self.seed, num_chars=self.sizes[split])

  def _tokens(self, index: int, split: str) -> Dict[str, np.ndarray]:
    if self.text_file:
      data = np.fromfile(self.text_file, np.uint8).astype(np.int32) + 1
      bounds = np.cumsum([0, int(0.9 * len(data)), int(0.05 * len(data)), len(data)])
      bounds[-1] = len(data)
      return dict(tokens=data[bounds[index]:bounds[index + 1]])
    rng = np.random.default_rng([self.seed, index])
    return dict(tokens=encode(synthetic_documents(self.sizes[split], rng,
                                                  vocabulary(self.seed))))

  def prepare(self, data_dir: pathlib.Path, *, progress: bool = True) -> Dict[str, int]:
    return prepare_generated(self._folder_name(), data_dir, self._settings, self._tokens,
                             progress=progress)

  def _folder_name(self) -> str:
    # Generated and file corpora are kept apart; the segment length is not part
    # of the data (it is cut at reading).
    return "chars" if self.text_file is None else f"chars_{pathlib.Path(self.text_file).stem}"

  def splits(self, data_dir: pathlib.Path) -> Dict[str, ExampleSource]:
    root = pathlib.Path(data_dir) / self._folder_name()
    out = {}
    for split in SPLITS:
      tokens = ArraySource.load(root / split, names=("tokens",)).arrays["tokens"]
      count = len(tokens) // self.seq_len
      if count == 0:
        raise ValueError(f"the {split} split has {len(tokens)} characters, fewer than one "
                         f"segment of seq_len={self.seq_len}.")
      out[split] = ArraySource(dict(inputs=tokens[:count * self.seq_len].reshape(
          count, self.seq_len)))
    return out


def make_task(train_size: int = 2_000_000, validation_size: int = 100_000,
              test_size: int = 100_000, seed: int = 0, seq_len: int = 128,
              text_file: Optional[str] = None) -> CharTask:
  """Segments of `seq_len` characters of the generated corpus (sizes in
  characters) or of `text_file` (its bytes, split 90 / 5 / 5; the sizes are
  then unused)."""
  sizes = {"train": train_size, "validation": validation_size, "test": test_size}
  for name, value in dict(seq_len=seq_len, **{f"{s}_size": v for s, v in sizes.items()}).items():
    if int(value) < 1:
      raise ValueError(f"{name} must be a positive integer, got {value!r}.")
  if text_file is not None and not pathlib.Path(text_file).is_file():
    raise ValueError(f"text_file {text_file!r} is not a file.")
  return CharTask(sizes=sizes, seed=seed, seq_len=seq_len, text_file=text_file)
