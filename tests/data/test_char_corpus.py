"""The character corpus (generated or from a text file) and stream batches."""

import numpy as np
import pytest

from attention_jax import data
from attention_jax.data import chars


def test_generated_corpus_is_documents_whose_names_recur_beyond_a_segment():
  words = chars.vocabulary(0)
  text = chars.synthetic_documents(30_000, np.random.default_rng([0, 0]), words)
  assert len(text) == 30_000 and set(text) <= set(chars.CHARS)
  np.testing.assert_array_equal(chars.encode(text), chars.encode(text))
  assert chars.decode(chars.encode(text)) == text
  documents = [d for d in text.split("\n\n") if d][:-1]  # the last is cut short
  assert len(documents) >= 3
  common = set(words)
  for document in documents:
    tokens = document.replace(".", " ").split()
    # A name: a capitalised word not in the common vocabulary, recurring in its
    # document at distances of more than a 128-character segment.
    names = {t for t in tokens if t[0].isupper() and t.lower() not in common and
             not any(w == t.lower() for w in words)}
    recurring = [n for n in names if document.count(n) >= 5]
    assert len(recurring) >= 3
    assert any(document.rindex(n) - document.index(n) > 1000 for n in recurring)


def test_generation_is_a_pure_function_of_the_seed():
  words = chars.vocabulary(3)
  assert words == chars.vocabulary(3) and words != chars.vocabulary(4)
  make = lambda seed: chars.synthetic_documents(5000, np.random.default_rng(seed), words)
  assert make((3, 0)) == make((3, 0)) and make((3, 0)) != make((3, 1))


def test_prepare_and_read_consecutive_segments(tmp_path):
  task = data.get_task("chars", train_size=5000, validation_size=1000, test_size=1000,
                       seq_len=64)
  assert task.info.vocab_size == len(chars.CHARS) + 1 and task.info.seq_len == 64
  assert task.prepare(tmp_path, progress=False) == dict(train=5000, validation=1000, test=1000)
  assert task.prepare(tmp_path, progress=False) == dict(train=0, validation=0, test=0)
  splits = task.splits(tmp_path)
  assert len(splits["train"]) == 5000 // 64
  segments = splits["train"].gather(np.arange(len(splits["train"])))["inputs"]
  stored = np.load(tmp_path / "chars" / "train" / "tokens.npy")
  np.testing.assert_array_equal(segments.reshape(-1), stored[:len(segments) * 64])
  assert (segments > 0).all()  # no padding in a corpus


def test_a_text_file_is_bytes_split_90_5_5(tmp_path):
  path = tmp_path / "corpus.txt"
  content = bytes(range(256)) * 40  # 10,240 bytes
  path.write_bytes(content)
  task = data.get_task("chars", text_file=str(path), seq_len=16)
  assert task.info.vocab_size == 257
  task.prepare(tmp_path / "data", progress=False)
  folder = tmp_path / "data" / "chars_corpus"
  parts = [np.load(folder / split / "tokens.npy") for split in data.SPLITS]
  assert [len(p) for p in parts] == [9216, 512, 512]
  np.testing.assert_array_equal(np.concatenate(parts) - 1, np.frombuffer(content, np.uint8))


@pytest.mark.parametrize("options,message", [
    (dict(seq_len=0), "seq_len must be a positive integer, got 0"),
    (dict(train_size=-5), "train_size must be a positive integer"),
    (dict(text_file="/no/such/file.txt"), "text_file '/no/such/file.txt' is not a file"),
])
def test_bad_options_are_refused_by_name(options, message):
  with pytest.raises(ValueError, match=message):
    chars.make_task(**options)


def test_a_split_shorter_than_a_segment_is_an_error(tmp_path):
  task = data.get_task("chars", train_size=500, validation_size=10, test_size=500, seq_len=64)
  task.prepare(tmp_path, progress=False)
  with pytest.raises(ValueError, match="the validation split has 10 characters, fewer than one "
                                       "segment of seq_len=64"):
    task.splits(tmp_path)


def test_stream_batches_continue_each_row_and_resume_exactly():
  # 22 examples numbered in order, 4 lanes of 5 (the last 2 unused).
  source = data.ArraySource(dict(inputs=np.arange(22)[:, None]))
  stream = list(data.stream_batches(source, batch_size=4, num_steps=7))
  rows = np.stack([b["inputs"][:, 0] for b in stream])  # [step, lane]
  np.testing.assert_array_equal(rows[:5], np.arange(5)[:, None] + 5 * np.arange(4)[None, :])
  np.testing.assert_array_equal(rows[5:], rows[:2])  # each lane starts again after 5
  resumed = next(data.stream_batches(source, batch_size=4, start_step=3))
  np.testing.assert_array_equal(resumed["inputs"], stream[3]["inputs"])
  # Two hosts take their halves of the same global batch.
  halves = [next(data.stream_batches(source, batch_size=4, start_step=2, process_index=i,
                                     process_count=2))["inputs"] for i in (0, 1)]
  np.testing.assert_array_equal(np.concatenate(halves), stream[2]["inputs"])
  assert (stream[0]["weight"] == 1).all()
  with pytest.raises(ValueError, match="needs at least 30 examples, got 22"):
    next(data.stream_batches(source, batch_size=30))
