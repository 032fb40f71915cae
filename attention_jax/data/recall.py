"""Generated recall tasks for causal language models: associative recall,
induction heads and selective copying.

  task = attention_jax.data.get_task("mqar", seq_len=128, pair_counts=(4, 8, 16, 32))

Each example is one token sequence `inputs [T]` read left to right by a
language model, a `target_mask [T]` that is 1 at the tokens it is scored on
(each predicted from the tokens before it) and a `group [ ]`, the index of the
example's difficulty in `TaskInfo.eval_groups` (evaluation reports accuracy
per group, e.g. per number of key-value pairs). The kinds:

* "mqar", multi-query associative recall (Zoology, Arora et al. 2023, sec.
  3): `num_pairs` key-value pairs `k1 v1 ... kN vN`, then every key once
  more in a random order, each followed by its value, at random places of a
  query region otherwise filled with a filler token. A value after a query
  key is scored: the model must look the key up among the pairs. A train
  set mixes the `pair_counts`; evaluation reports each. Keys and values are
  drawn without replacement from their own vocabularies, so a key has one
  value per example; the filler keeps the queries' gaps uneven, so no fixed
  offset finds the pair.
* "induction_heads" (Olsson et al. 2022; the H3 paper's synthetic task):
  random tokens, a trigger token at a random place in the first half
  followed by a random token, and the trigger again as the second-to-last
  token; the last token repeats the one that followed the first trigger
  and is the one scored.
* "selective_copying" (Gu & Dao 2023, Mamba sec. 3.1): `num_copy` data
  tokens at random places of a region of noise (a blank token), then a
  separator and the data tokens again in order, which are scored: the model
  must skip the blanks, which no fixed convolution kernel can.

Splits are a pure function of (seed, split) through `np.random.default_rng`,
as ListOps is generated. Train and test are drawn independently from the
same distribution: at these vocabularies a repeated example has negligible
probability, and memorising the train set could not answer unseen pairs.
"""

from __future__ import annotations

from typing import Dict, Sequence

import numpy as np

from attention_jax.data.base import GeneratedTask, TaskInfo, check_split_sizes

PAD_ID, FILLER_ID, TRIGGER_ID, SEPARATOR_ID = 0, 1, 2, 3
FIRST_SYMBOL = 4  # the first token id of keys / values / data tokens
KINDS = ("mqar", "induction_heads", "selective_copying")
ARRAYS = ("inputs", "target_mask", "group")


def mqar(count: int, rng: np.random.Generator, *, seq_len: int, pair_counts: Sequence[int],
         num_keys: int, num_values: int) -> Dict[str, np.ndarray]:
  """`count` associative-recall examples, pair counts cycling through `pair_counts`.

  Tokens: keys `FIRST_SYMBOL + [0, num_keys)`, values after the keys.
  Returns `inputs`, `target_mask` `[count, seq_len]` and `group [count]`
  (the index of the example's pair count).
  """
  inputs = np.full((count, seq_len), FILLER_ID, np.int32)
  target_mask = np.zeros((count, seq_len), np.int32)
  group = np.arange(count, dtype=np.int32) % len(pair_counts)
  for row in range(count):
    pairs = pair_counts[group[row]]
    keys = FIRST_SYMBOL + rng.choice(num_keys, size=pairs, replace=False)
    values = FIRST_SYMBOL + num_keys + rng.choice(num_values, size=pairs, replace=False)
    inputs[row, 0:2 * pairs:2], inputs[row, 1:2 * pairs:2] = keys, values
    # The query region holds `pairs` (key, value) slots of two tokens at random,
    # non-overlapping places: choose the slots' order among the filler tokens.
    region = seq_len - 2 * pairs
    gaps = region - 2 * pairs  # filler tokens in the query region
    starts = np.sort(rng.choice(gaps + pairs, size=pairs, replace=False))
    starts = 2 * pairs + starts + np.arange(pairs)  # each earlier slot shifts by one more token
    order = rng.permutation(pairs)
    inputs[row, starts], inputs[row, starts + 1] = keys[order], values[order]
    target_mask[row, starts + 1] = 1
  return dict(inputs=inputs, target_mask=target_mask, group=group)


def induction_heads(count: int, rng: np.random.Generator, *, seq_len: int,
                    num_symbols: int) -> Dict[str, np.ndarray]:
  """`count` induction-head examples; the last token is the one scored."""
  inputs = FIRST_SYMBOL + rng.integers(0, num_symbols, size=(count, seq_len)).astype(np.int32)
  first = rng.integers(0, seq_len // 2, size=count)
  rows = np.arange(count)
  inputs[rows, first] = TRIGGER_ID
  inputs[:, -2] = TRIGGER_ID
  inputs[:, -1] = inputs[rows, first + 1]
  target_mask = np.zeros((count, seq_len), np.int32)
  target_mask[:, -1] = 1
  return dict(inputs=inputs, target_mask=target_mask, group=np.zeros(count, np.int32))


def selective_copying(count: int, rng: np.random.Generator, *, seq_len: int, num_symbols: int,
                      num_copy: int) -> Dict[str, np.ndarray]:
  """`count` selective-copying examples: a region of `seq_len - num_copy - 1`
  tokens holding `num_copy` data tokens among blanks (FILLER_ID), the
  separator, then the data tokens in order (scored)."""
  region = seq_len - num_copy - 1
  inputs = np.full((count, seq_len), FILLER_ID, np.int32)
  data = FIRST_SYMBOL + rng.integers(0, num_symbols, size=(count, num_copy)).astype(np.int32)
  for row in range(count):
    inputs[row, np.sort(rng.choice(region, size=num_copy, replace=False))] = data[row]
  inputs[:, region] = SEPARATOR_ID
  inputs[:, region + 1:] = data
  target_mask = np.zeros((count, seq_len), np.int32)
  target_mask[:, region + 1:] = 1
  return dict(inputs=inputs, target_mask=target_mask, group=np.zeros(count, np.int32))


def _check_positive(**values: int) -> None:
  for name, value in values.items():
    if int(value) < 1:
      raise ValueError(f"{name} must be a positive integer, got {value!r}.")


def make_task(kind: str = "mqar", train_size: int = 20_000, validation_size: int = 1_000,
              test_size: int = 1_000, seed: int = 0, seq_len: int = 64,
              pair_counts: Sequence[int] = (2, 4, 8, 16), num_keys: int = 64,
              num_values: int = 64, num_symbols: int = 16, num_copy: int = 8) -> GeneratedTask:
  """A recall task of `kind` ("mqar", "induction_heads" or "selective_copying")
  over sequences of `seq_len` tokens.

  Args:
    pair_counts: mqar's numbers of key-value pairs, each an evaluation group
      ("pairs<n>"); each needs `4 n <= seq_len` (the pairs and their queries).
    num_keys, num_values: mqar's key and value vocabularies (each at least the
      largest pair count).
    num_symbols: the vocabulary of induction_heads' and selective_copying's tokens.
    num_copy: selective_copying's data tokens.
  """
  if kind not in KINDS:
    raise ValueError(f"kind must be one of {KINDS}, got {kind!r}.")
  sizes = check_split_sizes({"train": train_size, "validation": validation_size,
                             "test": test_size})
  _check_positive(seq_len=seq_len)
  if kind == "mqar":
    pair_counts = tuple(int(p) for p in pair_counts)
    if not pair_counts or min(pair_counts) < 1 or len(set(pair_counts)) != len(pair_counts):
      raise ValueError(f"pair_counts must be distinct positive integers, got {pair_counts!r}.")
    if 4 * max(pair_counts) > seq_len:
      raise ValueError(f"pair_counts {pair_counts} need seq_len >= 4 x {max(pair_counts)} (the "
                       f"pairs, then a key and its value per query), got seq_len={seq_len}.")
    if min(num_keys, num_values) < max(pair_counts):
      raise ValueError(f"num_keys and num_values must be at least the largest pair count "
                       f"{max(pair_counts)} (distinct keys and values per example), got "
                       f"num_keys={num_keys}, num_values={num_values}.")
    return _task(kind, sizes, seed, seq_len, mqar, dict(pair_counts=list(pair_counts),
                                                        num_keys=num_keys, num_values=num_values),
                 vocab_size=FIRST_SYMBOL + num_keys + num_values,
                 eval_groups=tuple(f"pairs{p}" for p in pair_counts))
  _check_positive(num_symbols=num_symbols)
  if kind == "induction_heads":
    if seq_len < 4:
      raise ValueError(f"induction_heads needs seq_len >= 4, got {seq_len}.")
    generation = dict(num_symbols=num_symbols)
  else:
    _check_positive(num_copy=num_copy)
    if seq_len < 2 * num_copy + 1:
      raise ValueError(f"selective_copying needs seq_len >= 2 x num_copy + 1 = "
                       f"{2 * num_copy + 1} (the data among at least as many tokens, the "
                       f"separator and the copy), got seq_len={seq_len}.")
    generation = dict(num_symbols=num_symbols, num_copy=num_copy)
  return _task(kind, sizes, seed, seq_len,
               induction_heads if kind == "induction_heads" else selective_copying, generation,
               vocab_size=FIRST_SYMBOL + num_symbols, eval_groups=())


def _task(kind, sizes, seed, seq_len, generate, generation, *, vocab_size, eval_groups):
  info = TaskInfo(name=kind, vocab_size=vocab_size, num_classes=vocab_size, seq_len=seq_len,
                  split_sizes=dict(sizes), eval_groups=eval_groups)
  # `kind` is recorded in the settings (a split of one kind never stands in for another's).
  return GeneratedTask(info, generate, generation=dict(generation, seq_len=seq_len), seed=seed,
                       arrays=ARRAYS, described=dict(kind=kind))
