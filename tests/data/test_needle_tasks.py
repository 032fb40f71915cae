"""The generated needle tasks (RULER's single, multi-key, multi-value and
variable tracking), each answered by an evaluator that reads the sequence."""

import numpy as np
import pytest

from attention_jax import data
from attention_jax.data import needle
from attention_testing import assert_generated_splits_follow_the_seed

NUM_FILLER, NUM_KEYS, NUM_VALUES = 10, 12, 12
FIRST_KEY = needle.FIRST_SYMBOL + NUM_FILLER
FIRST_VALUE = FIRST_KEY + NUM_KEYS
MARKERS = {needle.NEEDLE_ID: "needle", needle.ASSIGN_ID: "assign"}


def _read(row, answers):
  """The haystack of `row` as (filler tokens seen so far, marker, name, value)
  statements, and the question's key and the answer tokens."""
  haystack, asked, answer = row[:-2 - answers], row[-1 - answers], row[-answers:]
  assert row[-2 - answers] == needle.QUERY_ID
  statements, filler, position = [], 0, 0
  while position < len(haystack):
    token = haystack[position]
    if token in MARKERS:
      statements.append((filler, MARKERS[token], *haystack[position + 1:position + 3]))
      position += 3
    else:
      assert needle.FIRST_SYMBOL <= token < FIRST_KEY, f"not a filler token: {token}"
      filler, position = filler + 1, position + 1
  return statements, filler, asked, list(answer)


def _solve(statements, asked):
  """The answer by the task's definition: every value stored under the asked
  key, in order; or, for assignments, the value reached by following names."""
  if statements[0][1] == "needle":
    return [value for _, _, key, value in statements if key == asked]
  bound = {}
  for _, _, name, source in statements:
    bound[name] = bound[source] if source in bound else source
  return [bound[asked]]


@pytest.mark.parametrize("kind,answers,needles", [
    ("single", 1, 1), ("multi_key", 1, 4), ("multi_value", 2, 2), ("variable_tracking", 1, 3)])
def test_each_question_is_answered_by_reading_the_haystack(kind, answers, needles):
  depths = (0.0, 0.3, 0.5, 1.0)
  arrays = needle.generate(40, np.random.default_rng(0), kind=kind, seq_len=40, depths=depths,
                           num_filler=NUM_FILLER, num_keys=NUM_KEYS, num_values=NUM_VALUES,
                           num_distractors=3, num_answers=2, chain_length=3)
  assert arrays["inputs"].shape == arrays["target_mask"].shape == (40, 40)
  assert np.bincount(arrays["group"]).tolist() == [10] * 4
  for row, mask, group in zip(arrays["inputs"], arrays["target_mask"], arrays["group"]):
    statements, filler, asked, answer = _read(row, answers)
    assert len(statements) == needles
    assert np.flatnonzero(mask).tolist() == list(range(40 - answers, 40))
    assert _solve(statements, asked) == answer
    assert all(FIRST_VALUE <= a < FIRST_VALUE + NUM_VALUES for a in answer)
    # The depth: the share of the filler before the needle asked for (the
    # first of its values, the head of its chain).
    first = next(s for s in statements if s[2] == asked or kind == "variable_tracking")
    assert first[0] == round(depths[group] * filler)
    if kind == "multi_key":  # distinct keys: only the key tells them apart
      assert len({key for _, _, key, _ in statements}) == needles
    if kind == "variable_tracking":  # each name bound once, after its source
      names = [name for _, _, name, _ in statements]
      assert len(set(names)) == needles and asked == names[-1]
      assert all(source == names[i] for i, (_, _, _, source) in enumerate(statements[1:]))


def test_the_other_needles_are_not_all_at_the_same_place():
  """Distractors, further values and assignments are spread out (else a model
  could read the answer at a fixed offset from the first)."""
  for kind in ("multi_key", "multi_value", "variable_tracking"):
    arrays = needle.generate(30, np.random.default_rng(1), kind=kind, seq_len=64, depths=(0.0,),
                             num_filler=NUM_FILLER, num_keys=NUM_KEYS, num_values=NUM_VALUES,
                             num_distractors=3, num_answers=2, chain_length=3)
    places = {tuple(s[0] for s in _read(row, 2 if kind == "multi_value" else 1)[0])
              for row in arrays["inputs"]}
    assert len(places) > 20, kind


@pytest.mark.parametrize("kind", needle.KINDS)
def test_prepare_writes_splits_that_are_a_function_of_the_seed(tmp_path, kind):
  make = lambda seed: data.get_task("needle", kind=kind, train_size=12, validation_size=4,
                                    test_size=6, seq_len=48, depths=(0.25, 0.75), seed=seed)
  task = assert_generated_splits_follow_the_seed(make, tmp_path,
                                                 dict(train=12, validation=4, test=6))
  assert task.info.eval_groups == ("depth25", "depth75")
  assert task.info.vocab_size == needle.FIRST_SYMBOL + 32 + 32 + 32


@pytest.mark.parametrize("options,message", [
    (dict(depths=(0.5, 1.5)), r"depths must be distinct needle depths in \[0, 1\], got \(0.5, 1.5\)"),
    (dict(depths=(-0.1,)), r"depths must be distinct needle depths in \[0, 1\], got \(-0.1,\)"),
    (dict(depths=()), r"depths must be distinct needle depths in \[0, 1\], got \(\)"),
    (dict(kind="multi_key", num_distractors=4, seq_len=18),
     r"seq_len must hold the multi_key needles \(15 tokens\), the question \(3\) and a filler "
     r"token: at least 19, got 18"),
    (dict(kind="variable_tracking", chain_length=5, num_keys=4), "num_keys >= 5"),
    (dict(num_distractors=-1), "num_distractors must be an int >= 0, got -1"),
    (dict(chain_length=0), "chain_length must be a positive int, got 0"),
    (dict(kind="essay"), "kind must be one of"),
])
def test_bad_options_are_refused_by_name(options, message):
  with pytest.raises(ValueError, match=message):
    needle.make_task(**options)
