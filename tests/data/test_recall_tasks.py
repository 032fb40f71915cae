"""The generated recall tasks: associative recall, induction heads, selective copying."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_jax import data, train
from attention_jax.data import recall
from attention_jax.models import build_model
from attention_testing import assert_generated_splits_follow_the_seed, jit_apply


def _answers_by_lookup(row, mask):
  """mqar by definition: each scored token is the value that followed the
  query key (the token before it) among the pairs at the start."""
  keys = []
  for position in np.flatnonzero(mask):
    key = row[position - 1]
    first = int(np.flatnonzero(row == key)[0])
    keys.append(key)
    assert first % 2 == 0 and row[position] == row[first + 1]
  return keys


@pytest.mark.parametrize("seq_len,pair_counts", [(32, (2, 4, 8)), (40, (3, 10))])
def test_mqar_queries_every_key_once_and_scores_its_value(seq_len, pair_counts):
  arrays = recall.mqar(60, np.random.default_rng(0), seq_len=seq_len, pair_counts=pair_counts,
                       num_keys=12, num_values=12)
  assert arrays["inputs"].shape == arrays["target_mask"].shape == (60, seq_len)
  for row, mask, group in zip(arrays["inputs"], arrays["target_mask"], arrays["group"]):
    pairs = pair_counts[group]
    keys, values = row[:2 * pairs:2], row[1:2 * pairs:2]
    assert len(set(keys)) == pairs and len(set(values)) == pairs  # one value per key
    assert np.all((keys >= recall.FIRST_SYMBOL) & (keys < recall.FIRST_SYMBOL + 12))
    assert np.all(values >= recall.FIRST_SYMBOL + 12)
    assert int(mask.sum()) == pairs and not mask[:2 * pairs].any()
    assert sorted(_answers_by_lookup(row, mask)) == sorted(keys)
    # Everything else in the query region is filler.
    region = row[2 * pairs:].copy()
    scored = np.flatnonzero(mask) - 2 * pairs
    region[np.concatenate([scored, scored - 1])] = recall.FILLER_ID
    assert np.all(region == recall.FILLER_ID)
  assert np.bincount(arrays["group"]).tolist() == [60 // len(pair_counts)] * len(pair_counts)


def test_mqar_query_gaps_vary():
  """No fixed offset from a query back to its pair answers it."""
  arrays = recall.mqar(40, np.random.default_rng(1), seq_len=64, pair_counts=(4,), num_keys=16,
                       num_values=16)
  offsets = set()
  for row, mask in zip(arrays["inputs"], arrays["target_mask"]):
    for position in np.flatnonzero(mask):
      offsets.add(position - int(np.flatnonzero(row == row[position - 1])[0]))
  assert len(offsets) > 20


def test_induction_heads_repeats_the_token_after_the_trigger():
  arrays = recall.induction_heads(50, np.random.default_rng(2), seq_len=20, num_symbols=6)
  for row, mask in zip(arrays["inputs"], arrays["target_mask"]):
    triggers = np.flatnonzero(row == recall.TRIGGER_ID)
    assert len(triggers) == 2 and triggers[0] < 10 and triggers[1] == 18
    assert row[-1] == row[triggers[0] + 1]
    assert mask.tolist() == [0] * 19 + [1]


def test_selective_copying_copies_the_data_tokens_in_order():
  arrays = recall.selective_copying(50, np.random.default_rng(3), seq_len=30, num_symbols=6,
                                    num_copy=5)
  for row, mask in zip(arrays["inputs"], arrays["target_mask"]):
    separator = 30 - 5 - 1
    assert row[separator] == recall.SEPARATOR_ID
    data_tokens = row[:separator][row[:separator] != recall.FILLER_ID]
    np.testing.assert_array_equal(data_tokens, row[separator + 1:])
    assert np.flatnonzero(mask).tolist() == list(range(separator + 1, 30))


@pytest.mark.parametrize("kind", recall.KINDS)
def test_prepare_writes_splits_that_are_a_function_of_the_seed(tmp_path, kind):
  make = lambda seed: data.get_task(kind, train_size=20, validation_size=8, test_size=8,
                                    seq_len=32, pair_counts=(2, 4), seed=seed)
  task = assert_generated_splits_follow_the_seed(make, tmp_path,
                                                 dict(train=20, validation=8, test=8))
  assert task.info.eval_groups == (("pairs2", "pairs4") if kind == "mqar" else ())


@pytest.mark.parametrize("options,message", [
    (dict(kind="mqar", seq_len=30, pair_counts=(2, 8)), r"seq_len >= 4 x 8"),
    (dict(kind="mqar", pair_counts=(2, 2)), "pair_counts must be distinct"),
    (dict(kind="mqar", pair_counts=(4,), num_keys=3), "num_keys and num_values"),
    (dict(kind="selective_copying", seq_len=10, num_copy=5), r"seq_len >= 2 x num_copy \+ 1"),
    (dict(kind="induction_heads", seq_len=0), "seq_len must be a positive integer, got 0"),
    (dict(kind="copy"), "kind must be one of"),
])
def test_bad_options_are_refused_by_name(options, message):
  with pytest.raises(ValueError, match=message):
    recall.make_task(**options)


def test_evaluation_reports_accuracy_per_group_over_the_scored_tokens_only():
  """The eval step's per-group sums equal a numpy count of right answers among
  the scored tokens of each group's examples."""
  arrays = recall.mqar(8, np.random.default_rng(4), seq_len=16, pair_counts=(2, 3),
                       num_keys=6, num_values=6)
  batch = dict(arrays, weight=np.array([1, 1, 1, 1, 1, 1, 0, 1], np.float32))
  model = build_model(dict(kind="language_model", vocab_size=16, num_layers=1, embed_dim=8,
                           num_heads=2, mlp_dim=16, max_length=16, dropout_rate=0.0))
  objective = train.get_objective("language_model")
  mesh = train.make_mesh((1, 1, 1), devices=jax.devices()[:1])
  optimizer = train.make_optimizer(dict(warmup_steps=1, num_train_steps=10))
  state, shardings = train.create_sharded_state(model, optimizer, batch, mesh,
                                                objective=objective)
  eval_step = train.make_eval_step(model, mesh, shardings, objective=objective,
                                   eval_groups=("pairs2", "pairs3"))
  sums = jax.device_get(eval_step(state, train.shard_batch(batch, train.batch_sharding(mesh))))

  logits = np.asarray(jit_apply(model, {"params": jax.device_get(state.params)},
                                jnp.asarray(arrays["inputs"])))
  right = logits[:, :-1].argmax(-1) == arrays["inputs"][:, 1:]
  scored = arrays["target_mask"][:, 1:] * batch["weight"][:, None]
  for index, name in enumerate(("pairs2", "pairs3")):
    in_group = (arrays["group"] == index)[:, None]
    assert float(sums[f"{name}_count"]) == (scored * in_group).sum() > 0
    assert float(sums[f"{name}_correct"]) == (right * scored * in_group).sum()
  assert float(sums["count"]) == scored.sum()
  summary = train.summarize_eval(sums)
  assert summary["pairs2_accuracy"] == float(sums["pairs2_correct"]) / float(sums["pairs2_count"])
