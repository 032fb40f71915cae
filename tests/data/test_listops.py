"""ListOps: the evaluator on hand-worked expressions, the generator's constraints and
labels against an evaluator written differently, determinism, prepare/splits, and
the LRA release TSV loader."""

import random
import re

import numpy as np
import pytest

from attention_jax import data
from attention_jax.data import listops

_OPS = {"MIN": lambda *a: min(a), "MAX": lambda *a: max(a),
        "MED": lambda *a: int(np.median(a)), "SM": lambda *a: sum(a) % 10}


def _python_value(source):
  """Independent evaluator: rewrites `[MAX 2 [SM 3 4 ] ]` (parentheses dropped) as the
  Python call `MAX(2,SM(3,4,),)`, with MED as LRA's int(np.median(...))."""
  pieces = []
  for token in source.replace("(", " ").replace(")", " ").split():
    if token.startswith("["):
      pieces.append(token[1:] + "(")
    elif token == "]":
      pieces.append("),")
    else:
      pieces.append(token + ",")
  return int(eval("".join(pieces).rstrip(","), {"__builtins__": {}}, dict(_OPS)))


def _source(ids):
  return " ".join(listops.decode(ids))


@pytest.mark.parametrize("source, value", [
    ("7", 7),
    ("[MAX 2 9 ]", 9),
    ("[MIN 4 7 2 ]", 2),
    ("[MED 3 1 2 ]", 2),
    ("[MED 2 9 ]", 5),           # median 5.5, truncated
    ("[MED 1 2 ]", 1),           # 1.5 -> 1
    ("[MED 9 0 9 0 ]", 4),       # 0 0 9 9 -> 4.5 -> 4
    ("[SM 5 5 ]", 0),
    ("[SM 9 9 9 9 9 9 9 9 9 9 9 ]", 9),  # eleven nines: 99
    ("[MAX 2 9 [MIN 4 7 ] 0 ]", 9),
    ("[SM [MAX 2 9 ] [MED 1 2 3 4 ] 5 ]", 6),  # 9 + 2 + 5 = 16
    ("[MAX 4 3 [MIN 2 3 ] 1 0 [MED 1 5 8 9 2 ] ]", 5),  # the LRA paper's example
    ("[MIN [MAX [MED [SM 7 ] ] ] ]", 7),  # single-argument operators
    ("[MIN 1 ]", 1),
    ("( ( ( [MAX 2 ) 9 ) ] )", 9),  # the release's parenthesised form
    ("( ( ( [MIN 1 ) ( ( ( [SM 2 ) 3 ) ] ) ) ] )", 1),
])
def test_evaluate_hand_worked_expressions(source, value):
  assert listops.evaluate(source) == value
  assert listops.evaluate(source.split()) == value
  assert listops.evaluate(listops.encode(source, seq_len=64)) == value  # ids with padding


def test_evaluate_deep_nesting_and_many_arguments():
  deep = "[SM " * 60 + "3" + " ]" * 60
  assert listops.evaluate(deep) == 3
  deep_med = "[MED " * 30 + "4 8" + " ]" * 30  # 6, then 6 all the way up
  assert listops.evaluate(deep_med) == 6
  many = "[SM " + " ".join(["7"] * 1000) + " ]"
  assert listops.evaluate(many) == 7000 % 10
  assert listops.evaluate("[MAX " + " ".join("0123456789" * 50) + " ]") == 9


def test_median_is_lras_int_of_numpy_median():
  rng = random.Random(0)
  for _ in range(200):
    args = [rng.randrange(10) for _ in range(rng.randint(1, 12))]
    assert listops.apply_operator("[MED", args) == int(np.median(args)), args


@pytest.mark.parametrize("source, message", [
    ("[MAX 2 9", "not closed"),
    ("[MAX ]", "no arguments"),
    ("2 3", "follows a complete expression"),
    ("[MAX 1 ] ]", "follows a complete expression"),
    ("]", "unmatched"),
    ("[FOO 1 ]", "unknown token '\\[FOO'"),
    ("( [MAX 2 ]", "not closed"),
    ("[MAX 2 ] )", "unmatched"),
    ("", "empty"),
])
def test_evaluate_rejects_malformed_expressions(source, message):
  with pytest.raises(ValueError, match=message):
    listops.evaluate(source)


def test_vocabulary_and_tokenizer():
  assert listops.VOCAB_SIZE == 18 and listops.VOCAB[0] == "<pad>"
  ids = listops.encode("( ( ( [MAX 2 ) 9 ) ] )", seq_len=8)
  # digits d -> d + 1, [MIN [MAX [MED [SM -> 11..14, ] -> 15; parentheses dropped.
  np.testing.assert_array_equal(ids, [12, 3, 10, 15, 0, 0, 0, 0])
  assert ids.dtype == np.uint8
  np.testing.assert_array_equal(listops.encode("( [SM 0 ) ] )", token_format="parens"),
                                [16, 14, 1, 17, 15, 17])
  np.testing.assert_array_equal(listops.encode("( ( [MED 1 ) ] )", token_format="alphanumeric"),
                                [13, 2])
  np.testing.assert_array_equal(listops.encode("MIN 5"), [11, 6])  # LRA's tokenizer output
  assert listops.decode(ids) == ["[MAX", "2", "9", "]"]
  with pytest.raises(ValueError, match="more than seq_len=3"):
    listops.encode("[MAX 2 9 ]", seq_len=3)
  with pytest.raises(ValueError, match="unknown token '7.5'"):
    listops.encode("[MAX 7.5 ]")


def test_release_source_is_lras_curried_form():
  # Hand-derived from the LRA generator's tuples: (((op, a1), a2), ']').
  assert listops.to_release_source("[MAX 2 9 ]") == "( ( ( [MAX 2 ) 9 ) ] )"
  assert (listops.to_release_source("[MIN 1 [SM 2 3 ] ]")
          == "( ( ( [MIN 1 ) ( ( ( [SM 2 ) 3 ) ] ) ) ] )")
  assert listops.to_release_source("4") == "4"


def _operator_stats(tokens):
  """Max nesting of operators and the argument count of each, by an explicit scan."""
  depth = max_depth = 0
  counts, open_counts = [], []
  for token in tokens:
    if token.startswith("["):
      if open_counts:
        open_counts[-1] += 1
      open_counts.append(0)
      depth += 1
      max_depth = max(max_depth, depth)
    elif token == "]":
      counts.append(open_counts.pop())
      depth -= 1
    elif open_counts:
      open_counts[-1] += 1
  return max_depth, counts


@pytest.mark.parametrize("settings", [
    dict(max_depth=10, max_args=10, min_length=500, max_length=2000),  # LRA's
    dict(max_depth=4, max_args=3, min_length=20, max_length=60),
])
def test_generated_examples_respect_the_constraints_and_labels_match(settings):
  inputs, labels = listops.generate(40, (7,), **settings)
  assert inputs.shape == (40, settings["max_length"]) and inputs.dtype == np.uint8
  for row, label in zip(inputs, labels):
    length = int((row != 0).sum())
    assert settings["min_length"] < length < settings["max_length"]
    assert not row[length:].any()  # padding only at the end
    tokens = listops.decode(row)
    depth, counts = _operator_stats(tokens)
    assert depth <= settings["max_depth"] - 1  # digits take the last level
    assert min(counts) >= 2 and max(counts) <= settings["max_args"]
    assert label == _python_value(" ".join(tokens)) == listops.evaluate(row)


def _reference_tree(rnd, depth, max_depth, max_args):
  """The LRA procedure, recursively with Python's random: (tokens, length)."""
  if depth < max_depth and rnd.random() <= 0.25:
    tokens = [rnd.choice(listops.OPERATORS)]
    for _ in range(rnd.randint(2, max_args)):
      tokens += _reference_tree(rnd, depth + 1, max_depth, max_args)
    return tokens + ["]"]
  return [str(rnd.randrange(10))]


def test_generated_distribution_matches_a_recursive_reference():
  settings = dict(max_depth=6, max_args=5, min_length=30, max_length=150)
  rnd, reference = random.Random(1), []
  while len(reference) < 1500:
    tokens = _reference_tree(rnd, 1, settings["max_depth"], settings["max_args"])
    if settings["min_length"] < len(tokens) < settings["max_length"]:
      reference.append((len(tokens), _python_value(" ".join(tokens))))
  inputs, labels = listops.generate(1500, (3,), **settings)
  lengths = (inputs != 0).sum(1)
  ref_lengths = np.array([r[0] for r in reference])
  ref_labels = np.array([r[1] for r in reference])
  assert abs(lengths.mean() - ref_lengths.mean()) < 0.06 * ref_lengths.mean()
  np.testing.assert_allclose(np.bincount(labels, minlength=10) / 1500,
                             np.bincount(ref_labels, minlength=10) / 1500, atol=0.04)


def test_label_distribution_is_not_degenerate():
  _, labels = listops.generate(1000, (0, 0))
  frequencies = np.bincount(labels, minlength=10) / len(labels)
  assert (frequencies > 0.04).all() and frequencies.max() < 0.3


def _tiny(**options):
  return data.get_task("listops", train_size=12, validation_size=4, test_size=4,
                       min_length=20, max_length=80, **options)


def test_info_at_the_release_settings():
  info = listops.make_task().info
  assert (info.name, info.vocab_size, info.num_classes, info.seq_len, info.pad_id) == (
      "listops", 18, 10, 2000, 0)
  assert dict(info.split_sizes) == {"train": 96000, "validation": 2000, "test": 2000}
  assert listops.make_task(token_format="parens").info.seq_len == 3 * 1999 - 2


def test_prepare_is_deterministic_writes_and_skips(tmp_path):
  task = _tiny(seed=5)
  assert task.prepare(tmp_path / "a", progress=False) == {"train": 12, "validation": 4, "test": 4}
  assert task.prepare(tmp_path / "a", progress=False) == {"train": 0, "validation": 0, "test": 0}
  _tiny(seed=5).prepare(tmp_path / "b", progress=False)
  _tiny(seed=6).prepare(tmp_path / "c", progress=False)
  for split in ("train", "validation", "test"):
    for name in ("inputs.npy", "label.npy"):
      a = (tmp_path / "a" / "listops" / split / name).read_bytes()
      assert a == (tmp_path / "b" / "listops" / split / name).read_bytes()
    assert ((tmp_path / "a" / "listops" / split / "inputs.npy").read_bytes()
            != (tmp_path / "c" / "listops" / split / "inputs.npy").read_bytes())
  # A lost split is regenerated alone, identically.
  before = (tmp_path / "a" / "listops" / "test" / "inputs.npy").read_bytes()
  (tmp_path / "a" / "listops" / "test" / "label.npy").unlink()
  assert task.prepare(tmp_path / "a", progress=False) == {"train": 0, "validation": 0, "test": 4}
  assert (tmp_path / "a" / "listops" / "test" / "inputs.npy").read_bytes() == before
  splits = task.splits(tmp_path / "a")
  batch = splits["train"].gather(np.arange(12))
  assert batch["inputs"].shape == (12, 80) and batch["inputs"].dtype == np.int32
  for row, label in zip(batch["inputs"], batch["label"]):
    assert listops.evaluate(row) == label


def test_token_formats_of_generated_data(tmp_path):
  _tiny().prepare(tmp_path / "b", progress=False)
  _tiny(token_format="parens").prepare(tmp_path / "p", progress=False)
  _tiny(token_format="alphanumeric").prepare(tmp_path / "a", progress=False)
  rows = {name: np.load(tmp_path / name / "listops" / "train" / "inputs.npy")
          for name in ("b", "p", "a")}
  for b, p, a in zip(rows["b"], rows["p"], rows["a"]):
    source = _source(b)
    assert _source(p) == listops.to_release_source(source)
    assert _source(a) == " ".join(t for t in source.split() if t != "]")


def test_splits_names_a_missing_directory(tmp_path):
  with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path / "nowhere" / "listops"))):
    _tiny().splits(tmp_path / "nowhere")
  (tmp_path / "half" / "listops").mkdir(parents=True)
  with pytest.raises(FileNotFoundError, match=r"train[/\\]inputs.npy"):
    _tiny().splits(tmp_path / "half")


_RELEASE = {
    "basic_train.tsv": [("( ( ( [MAX 2 ) 9 ) ] )", 9),
                        ("( ( ( [MIN 1 ) ( ( ( [SM 2 ) 3 ) ] ) ) ] )", 1),
                        ("[MED 2 9 ]", 5)],  # also read without parentheses
    "basic_val.tsv": [("( ( [SM 4 ) ] )", 4)],
    "basic_test.tsv": [("( ( ( [MED 1 ) 2 ) ] )", 1), ("7", 7)],
}


def _write_release(folder, files=_RELEASE, header="Source\tTarget"):
  folder.mkdir(parents=True, exist_ok=True)
  for name, rows in files.items():
    lines = [header] + [f"{source}\t{target}" for source, target in rows]
    (folder / name).write_text("\n".join(lines) + "\n")
  return folder


def test_release_loader_converts_the_tsv_files(tmp_path):
  release = _write_release(tmp_path / "lra_release" / "listops")
  task = data.get_task("listops", release_dir=release)
  assert task.prepare(tmp_path / "data", progress=False) == {"train": 3, "validation": 1,
                                                             "test": 2}
  splits = task.splits(tmp_path / "data")
  got = splits["train"].gather(np.arange(3))
  np.testing.assert_array_equal(got["label"], [9, 1, 5])
  assert got["inputs"].shape == (3, 2000)
  np.testing.assert_array_equal(got["inputs"][0, :5], [12, 3, 10, 15, 0])
  assert _source(got["inputs"][1]) == "[MIN 1 [SM 2 3 ] ]"
  assert _source(splits["test"].gather(np.arange(2))["inputs"][1]) == "7"
  assert task.prepare(tmp_path / "data", progress=False) == {"train": 0, "validation": 0,
                                                             "test": 0}


def test_release_files_written_from_generated_data_load_back_identically(tmp_path):
  _tiny(seed=2).prepare(tmp_path / "generated", progress=False)
  files = {}
  for split, name in listops.RELEASE_FILES.items():
    folder = tmp_path / "generated" / "listops" / split
    inputs, labels = np.load(folder / "inputs.npy"), np.load(folder / "label.npy")
    files[name] = [(listops.to_release_source(row), int(label))
                   for row, label in zip(inputs, labels)]
  release = _write_release(tmp_path / "release", files)
  task = _tiny(release_dir=release)
  task.prepare(tmp_path / "converted", progress=False)
  for split in listops.RELEASE_FILES:
    for name in ("inputs.npy", "label.npy"):
      np.testing.assert_array_equal(
          np.load(tmp_path / "converted" / "listops" / split / name),
          np.load(tmp_path / "generated" / "listops" / split / name))


@pytest.mark.parametrize("row, message", [
    ("( [MAX 2 ) ] )\t2\textra", "line 3: expected 2 tab-separated fields"),
    ("[MAX 2 ]\tnine", "line 3: invalid literal"),
    ("[MAX 2 ]\t12", "line 3: Target 12 is not in 0..9"),
    ("[MAX 2 {3} ]\t3", "line 3: unknown token '\\{3\\}'"),
])
def test_release_loader_names_the_file_and_line_of_a_malformed_row(tmp_path, row, message):
  release = _write_release(tmp_path / "release")
  path = release / "basic_train.tsv"
  path.write_text("Source\tTarget\n[MAX 1 ]\t1\n" + row + "\n")
  task = listops.make_task(release_dir=release)
  with pytest.raises(ValueError, match=re.escape(str(path)) + ", " + message):
    task.prepare(tmp_path / "data", progress=False)


def test_release_loader_missing_file_and_bad_header(tmp_path):
  release = _write_release(tmp_path / "release")
  (release / "basic_val.tsv").unlink()
  task = listops.make_task(release_dir=release)
  with pytest.raises(FileNotFoundError, match=re.escape(str(release / "basic_val.tsv"))):
    task.prepare(tmp_path / "data", progress=False)
  bad = _write_release(tmp_path / "bad", header="Input\tLabel")
  with pytest.raises(ValueError, match=re.escape(str(bad / "basic_train.tsv")) + ", line 1"):
    listops.make_task(release_dir=bad).prepare(tmp_path / "data2", progress=False)
