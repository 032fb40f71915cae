"""The generated document-matching task: pairs related exactly when their
documents share a topic, the documents' lengths and padding, the splits'
determinism, and its errors."""

import numpy as np
import pytest

from attention_jax import data
from attention_jax.data import matching

GENERATION = dict(seq_len=40, num_topics=5, words_per_topic=3, topic_rate=0.3, vocab_size=60)


def _topics(document, num_topics, words_per_topic):
  """The topic blocks a document's topic words fall in (ids 1 .. K * W)."""
  words = document[(document >= 1) & (document < 1 + num_topics * words_per_topic)]
  return set(((words - 1) // words_per_topic).tolist())


def test_a_pair_is_related_exactly_when_its_documents_share_a_topic():
  arrays = matching.pairs(400, np.random.default_rng(0), **GENERATION)
  assert arrays["inputs"].shape == arrays["inputs2"].shape == (400, 40)
  assert arrays["inputs"].dtype == np.int16 and set(np.unique(arrays["label"])) == {0, 1}
  assert arrays["label"].sum() == 200  # half related
  for first, second, label in zip(arrays["inputs"], arrays["inputs2"], arrays["label"]):
    topics_1, topics_2 = (_topics(d, 5, 3) for d in (first, second))
    # Each document draws its words from one topic (0.3 x >= 20 tokens: some are there).
    assert len(topics_1) == 1 and len(topics_2) == 1
    assert (topics_1 == topics_2) == bool(label)
  # Every topic and every background id occurs.
  tokens = np.concatenate([arrays["inputs"].ravel(), arrays["inputs2"].ravel()])
  assert set(np.unique(tokens).tolist()) == set(range(60))


def test_documents_have_half_to_all_of_seq_len_tokens_then_padding():
  arrays = matching.pairs(300, np.random.default_rng(1), **GENERATION)
  for document in np.concatenate([arrays["inputs"], arrays["inputs2"]]):
    length = int(np.count_nonzero(document))
    assert 20 <= length <= 40
    assert np.all(document[:length] != matching.PAD_ID) and np.all(document[length:] == 0)


def test_topic_rate_sets_the_fraction_of_topic_words():
  arrays = matching.pairs(200, np.random.default_rng(2), **dict(GENERATION, topic_rate=0.25))
  documents = arrays["inputs"]
  real = documents != 0
  topic_words = real & (documents < 1 + 5 * 3)
  assert topic_words.sum() / real.sum() == pytest.approx(0.25, abs=0.02)


def test_splits_are_a_function_of_the_seed(tmp_path):
  task = data.get_task("matching", train_size=30, validation_size=10, test_size=10, seed=3,
                       **GENERATION)
  assert task.info.dual and task.info.num_classes == 2 and task.info.vocab_size == 60
  assert task.prepare(tmp_path / "a", progress=False) == dict(train=30, validation=10, test=10)
  assert task.prepare(tmp_path / "a", progress=False) == dict(train=0, validation=0, test=0)
  again = data.get_task("matching", train_size=30, validation_size=10, test_size=10, seed=3,
                        **GENERATION)
  again.prepare(tmp_path / "b", progress=False)
  other = data.get_task("matching", train_size=30, validation_size=10, test_size=10, seed=4,
                        **GENERATION)
  other.prepare(tmp_path / "c", progress=False)
  splits = {name: t.splits(tmp_path / name) for name, t in
            (("a", task), ("b", again), ("c", other))}
  every = np.arange(30)
  first, repeat, reseeded = (splits[n]["train"].gather(every) for n in "abc")
  for name in matching.ARRAYS:
    np.testing.assert_array_equal(first[name], repeat[name])
  assert not np.array_equal(first["inputs"], reseeded["inputs"])
  # The splits differ from one another.
  assert not np.array_equal(splits["a"]["validation"].gather(np.arange(10))["inputs"],
                            splits["a"]["test"].gather(np.arange(10))["inputs"])


@pytest.mark.parametrize("options,message", [
    (dict(num_topics=1), "num_topics must be an integer >= 2"),
    (dict(topic_rate=0.0), r"topic_rate must be in \(0, 1\], got 0.0"),
    (dict(topic_rate=1.5), r"topic_rate must be in \(0, 1\], got 1.5"),
    (dict(seq_len=1), "seq_len must be at least 2"),
    (dict(words_per_topic=0), "words_per_topic must be a positive integer, got 0"),
    (dict(train_size=0), "train_size must be a positive integer, got 0"),
    (dict(vocab_size=16), r"vocab_size must exceed 1 \+ num_topics \* words_per_topic = 16"),
])
def test_bad_options_name_the_argument(options, message):
  with pytest.raises(ValueError, match=message):
    matching.make_task(**dict(GENERATION, **options))
