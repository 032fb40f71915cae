"""Generated sequence-to-sequence tasks: reverse or sort a string of symbols.

  task = attention_jax.data.get_task("reverse", min_length=20, max_length=30)

Each example is a source `inputs [T]` (symbols, EOS, padding) and a target
`targets [T]` (the symbols reversed or sorted, EOS, padding). Reversal is the
classic case for attention (Bahdanau et al. 2015; the D2L chapter): the first
output symbol is the last input one, so an encoder-decoder that passes only
its final state must hold the whole string in one vector, while attention
looks each symbol up where it is. Sorting needs counting instead, and no
single alignment.

Splits are a pure function of (seed, split): lengths uniform in
[min_length, max_length], symbols uniform, from `np.random.default_rng([seed,
split index])`, as ListOps is generated. Splits are not deduplicated against
each other: at 10 symbols and lengths of 10 or more a repeat has probability
below 1e-10 per pair.
"""

from __future__ import annotations

from typing import Dict

import numpy as np

from attention_jax.data.base import GeneratedTask, TaskInfo, check_split_sizes

PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
FIRST_SYMBOL = 3  # symbol s is token FIRST_SYMBOL + s
KINDS = ("reverse", "sort")
ARRAYS = ("inputs", "targets")


def transform(symbols: np.ndarray, kind: str) -> np.ndarray:
  """The target symbols of source `symbols` `[L]`."""
  return symbols[::-1] if kind == "reverse" else np.sort(symbols, kind="stable")


def generate(count: int, seed, *, kind: str, num_symbols: int, min_length: int,
             max_length: int) -> Dict[str, np.ndarray]:
  """`count` examples: `inputs` and `targets` `[count, max_length + 1]` int32.

  Tokens: 0 padding, 1 BOS (the decoder's first input; never in these arrays),
  2 EOS (after the last symbol of both), symbols from 3. `seed` is anything
  `np.random.default_rng` takes (a Generator is used as it is).
  """
  rng = np.random.default_rng(seed)
  lengths = rng.integers(min_length, max_length + 1, size=count)
  symbols = rng.integers(0, num_symbols, size=(count, max_length))
  width = max_length + 1
  inputs = np.zeros((count, width), np.int32)
  targets = np.zeros((count, width), np.int32)
  for row, (length, row_symbols) in enumerate(zip(lengths, symbols)):
    source = row_symbols[:length]
    inputs[row, :length] = FIRST_SYMBOL + source
    targets[row, :length] = FIRST_SYMBOL + transform(source, kind)
    inputs[row, length] = targets[row, length] = EOS_ID
  return dict(inputs=inputs, targets=targets)


def make_task(kind: str = "reverse", train_size: int = 20_000, validation_size: int = 1_000,
              test_size: int = 1_000, seed: int = 0, num_symbols: int = 10,
              min_length: int = 10, max_length: int = 30) -> GeneratedTask:
  """A reversal ("reverse") or sorting ("sort") task of `num_symbols` symbols
  and source lengths in [min_length, max_length]."""
  if kind not in KINDS:
    raise ValueError(f"kind must be one of {KINDS}, got {kind!r}.")
  if not 1 <= min_length <= max_length:
    raise ValueError(f"min_length and max_length must satisfy 1 <= min_length <= max_length, "
                     f"got min_length={min_length}, max_length={max_length}.")
  if num_symbols < 2:
    raise ValueError(f"num_symbols must be at least 2, got {num_symbols}.")
  sizes = check_split_sizes({"train": train_size, "validation": validation_size,
                             "test": test_size})
  vocab_size = FIRST_SYMBOL + num_symbols
  info = TaskInfo(name=kind, vocab_size=vocab_size, num_classes=vocab_size,
                  seq_len=max_length + 1, target_len=max_length + 1, split_sizes=sizes)
  return GeneratedTask(info, generate, generation=dict(kind=kind, num_symbols=num_symbols,
                                                       min_length=min_length,
                                                       max_length=max_length),
                       seed=seed, arrays=ARRAYS)
