"""Generated needle-in-a-haystack tasks for causal language models, in the
manner of RULER (Hsieh et al. 2024), for models trained from scratch.

  task = attention_jax.data.get_task("needle", kind="multi_key", seq_len=256)

An example is a haystack of random filler tokens holding one or more needles,
then a question at the end whose answer tokens are scored; the format is the
recall tasks' (`inputs [T]`, `target_mask [T]`, `group [ ]`,
attention_jax/data/recall.py), so the recall language model trains on it
unchanged. `group` is the index of the example's needle depth in `depths`
(evaluation reports accuracy per depth: with a task per length, the table's
heatmap of length against depth). A needle's depth is the fraction of the
haystack's filler tokens that come before it: 0 at the first token, 1 just
before the question.

The kinds (RULER sec. 3.1, its retrieval and multi-hop tracing families):

* "single": one needle `NEEDLE key value`; the question `QUERY key` is
  answered by `value`.
* "multi_key": the same, among `num_distractors` needles with other keys
  (and values) at random places: the key must be matched, not the marker.
* "multi_value": `num_answers` needles with the same key, each with its own
  value; the question is answered by every value, in the order they appear.
  The first sits at the depth; the others at random places after it.
* "variable_tracking": a chain `ASSIGN x1 value`, `ASSIGN x2 x1`, ...,
  `ASSIGN xc x(c-1)` of `chain_length` assignments in order, the first at the
  depth and the others at random places after it; `QUERY xc` is answered by
  `value`, found by following the chain back.

Token ids: PAD 0, then the markers NEEDLE, QUERY and ASSIGN, then the filler
symbols, the keys (also the variable names) and the values, each from its
own range, so no filler token reads as a marker, key or value. Splits are a
pure function of (seed, split) through `np.random.default_rng`.
"""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import numpy as np

from attention_jax.data.base import GeneratedTask, TaskInfo, check_split_sizes

PAD_ID, NEEDLE_ID, QUERY_ID, ASSIGN_ID = 0, 1, 2, 3
FIRST_SYMBOL = 4  # the first filler token id
KINDS = ("single", "multi_key", "multi_value", "variable_tracking")
ARRAYS = ("inputs", "target_mask", "group")


def vocabulary(num_filler: int, num_keys: int, num_values: int) -> Tuple[int, int, int]:
  """The first token id of the keys and of the values, and the vocabulary size."""
  first_key = FIRST_SYMBOL + num_filler
  first_value = first_key + num_keys
  return first_key, first_value, first_value + num_values


def _place(blocks: Sequence[List[int]], slots: Sequence[int], filler: np.ndarray) -> np.ndarray:
  """`filler` with block i inserted before filler token `slots[i]` (blocks at
  the same slot keep their order)."""
  pieces, start = [], 0
  for i in sorted(range(len(blocks)), key=lambda i: (slots[i], i)):
    pieces += [filler[start:slots[i]], np.asarray(blocks[i], np.int32)]
    start = slots[i]
  pieces.append(filler[start:])
  return np.concatenate(pieces)


def generate(count: int, rng: np.random.Generator, *, kind: str, seq_len: int,
             depths: Sequence[float], num_filler: int, num_keys: int, num_values: int,
             num_distractors: int, num_answers: int, chain_length: int) -> Dict[str, np.ndarray]:
  """`count` examples of `kind`, their depths cycling through `depths`.

  Returns `inputs`, `target_mask` `[count, seq_len]` and `group [count]`.
  """
  first_key, first_value, _ = vocabulary(num_filler, num_keys, num_values)
  answers = num_answers if kind == "multi_value" else 1
  question = 2 + answers  # QUERY, the key, the answer tokens
  inputs = np.zeros((count, seq_len), np.int32)
  target_mask = np.zeros((count, seq_len), np.int32)
  target_mask[:, seq_len - answers:] = 1
  group = np.arange(count, dtype=np.int32) % len(depths)
  for row in range(count):
    if kind == "variable_tracking":
      names = first_key + rng.choice(num_keys, size=chain_length, replace=False)
      value = first_value + rng.integers(num_values)
      blocks = [[ASSIGN_ID, names[0], value]] + [
          [ASSIGN_ID, names[i], names[i - 1]] for i in range(1, chain_length)]
      asked, answer = names[-1], [value]
    else:
      keys = first_key + rng.choice(num_keys, size=1 + (num_distractors if kind == "multi_key"
                                                        else 0), replace=False)
      values = first_value + rng.choice(num_values, size=answers if kind == "multi_value"
                                        else len(keys), replace=False)
      if kind == "multi_value":
        blocks = [[NEEDLE_ID, keys[0], v] for v in values]
      else:
        blocks = [[NEEDLE_ID, k, v] for k, v in zip(keys, values)]
      asked, answer = keys[0], list(values[:answers])
    # The first block sits at the depth; the rest of a chain or of one key's
    # values after it, distractors anywhere.
    num_filler_tokens = seq_len - question - 3 * len(blocks)
    first = int(round(depths[group[row]] * num_filler_tokens))
    if kind == "multi_key":
      later = rng.integers(0, num_filler_tokens + 1, size=len(blocks) - 1)
    else:
      later = np.sort(rng.integers(first, num_filler_tokens + 1, size=len(blocks) - 1))
    filler = FIRST_SYMBOL + rng.integers(0, num_filler, size=num_filler_tokens).astype(np.int32)
    haystack = _place(blocks, [first, *later], filler)
    inputs[row] = np.concatenate([haystack, [QUERY_ID, asked], answer])
  return dict(inputs=inputs, target_mask=target_mask, group=group)


def make_task(kind: str = "single", train_size: int = 20_000, validation_size: int = 1_000,
              test_size: int = 1_000, seed: int = 0, seq_len: int = 128,
              depths: Sequence[float] = (0.0, 0.25, 0.5, 0.75, 1.0), num_filler: int = 32,
              num_keys: int = 32, num_values: int = 32, num_distractors: int = 3,
              num_answers: int = 2, chain_length: int = 3) -> GeneratedTask:
  """A needle task of `kind` over sequences of `seq_len` tokens.

  Args:
    depths: the needle depths, each in [0, 1] and an evaluation group
      ("depth<percent>", e.g. "depth25"); examples cycle through them.
    num_filler, num_keys, num_values: the vocabularies of the haystack, the
      keys (and variable names) and the values.
    num_distractors: multi_key's needles besides the one asked for.
    num_answers: multi_value's values of the one key.
    chain_length: variable_tracking's assignments (1: the single needle's
      lookup under another syntax).
  """
  if kind not in KINDS:
    raise ValueError(f"kind must be one of {KINDS}, got {kind!r}.")
  sizes = check_split_sizes({"train": train_size, "validation": validation_size,
                             "test": test_size})
  counts = dict(seq_len=seq_len, num_filler=num_filler, num_keys=num_keys,
                num_values=num_values, num_answers=num_answers, chain_length=chain_length)
  for name, value in counts.items():
    if not isinstance(value, (int, np.integer)) or value < 1:
      raise ValueError(f"{name} must be a positive int, got {value!r}.")
  if not isinstance(num_distractors, (int, np.integer)) or num_distractors < 0:
    raise ValueError(f"num_distractors must be an int >= 0, got {num_distractors!r}.")
  depths = tuple(float(d) for d in depths)
  if not depths or any(not 0.0 <= d <= 1.0 for d in depths) or len(set(depths)) != len(depths):
    raise ValueError(f"depths must be distinct needle depths in [0, 1], got {depths!r}.")
  blocks, keys, values, answers = {
      "single": (1, 1, 1, 1),
      "multi_key": (1 + num_distractors, 1 + num_distractors, 1 + num_distractors, 1),
      "multi_value": (num_answers, 1, num_answers, num_answers),
      "variable_tracking": (chain_length, chain_length, 1, 1)}[kind]
  if num_keys < keys or num_values < values:
    raise ValueError(f"{kind} needs num_keys >= {keys} and num_values >= {values} (distinct "
                     f"keys and values per example), got num_keys={num_keys}, "
                     f"num_values={num_values}.")
  least = 3 * blocks + 2 + answers + 1
  if seq_len < least:
    raise ValueError(f"seq_len must hold the {kind} needles ({3 * blocks} tokens), the "
                     f"question ({2 + answers}) and a filler token: at least {least}, got "
                     f"{seq_len}.")
  vocab_size = vocabulary(num_filler, num_keys, num_values)[2]
  info = TaskInfo(name=f"needle_{kind}", vocab_size=vocab_size, num_classes=vocab_size,
                  seq_len=seq_len,
                  split_sizes=dict(sizes),
                  eval_groups=tuple(f"depth{100 * d:g}" for d in depths))
  generation = dict(kind=kind, seq_len=seq_len, depths=list(depths), num_filler=num_filler,
                    num_keys=num_keys, num_values=num_values, num_distractors=num_distractors,
                    num_answers=num_answers, chain_length=chain_length)
  return GeneratedTask(info, generate, generation=generation, seed=seed, arrays=ARRAYS)
