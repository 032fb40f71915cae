"""The RNN encoder-decoder: teacher forcing against step-by-step decoding,
greedy and beam search, padding, the attention weights, and training."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_jax.data import seq2seq as seq2seq_data
from attention_jax.models import build_model, decoding
from attention_jax.models.seq2seq import shift_right
from attention_jax.train import config as train_config
from attention_jax.train.trainer import train_and_evaluate
from attention_testing import assert_close, jit_apply, jit_call, jit_init

VOCAB = 13


def _model(**overrides):
  config = dict(kind="rnn_seq2seq", attention="additive", vocab_size=VOCAB, num_classes=VOCAB,
                embed_dim=16, num_heads=1, dropout_rate=0.0)
  return build_model({**config, **overrides})


def _batch(count=4, min_length=3, max_length=7, seed=0):
  arrays = seq2seq_data.generate(count, (seed, 0), kind="reverse", num_symbols=10,
                                 min_length=min_length, max_length=max_length)
  return jnp.asarray(arrays["inputs"]), jnp.asarray(arrays["targets"])


def _init(model, inputs, targets, seed=0):
  return jit_init(model, jax.random.PRNGKey(seed), inputs, targets)


@pytest.mark.parametrize("overrides", [dict(), dict(rnn_cell="lstm", attention="luong_general"),
                                       dict(attention="luong_local",
                                            attention_options=dict(mode="monotonic")),
                                       dict(decoder_attention=False)])
def test_teacher_forcing_equals_decoding_one_step_at_a_time(overrides):
  model = _model(**overrides)
  inputs, targets = _batch()
  variables = _init(model, inputs, targets)
  logits = jit_apply(model, variables, inputs, targets)
  assert logits.shape == targets.shape + (VOCAB,)
  annotations, lengths, carry = jit_apply(model, variables, inputs, method=model.encode)
  previous = shift_right(targets)
  for t in range(targets.shape[1]):
    step_logits, carry = jit_apply(model, variables, previous[:, t], carry, annotations, lengths,
                                   method=model.decode_step)
    assert_close(step_logits, logits[:, t], rtol=1e-5, atol=1e-5)


def test_greedy_decoding_is_the_argmax_of_teacher_forcing_on_its_own_output():
  model = _model()
  inputs, targets = _batch(seed=1)
  variables = _init(model, inputs, targets, seed=3)
  tokens = decoding.decode(model, variables, inputs, max_length=targets.shape[1])
  argmax = np.argmax(jit_apply(model, variables, inputs, tokens), axis=-1)
  tokens = np.asarray(tokens)
  for row, predicted in zip(tokens, argmax):
    ended = np.flatnonzero((row == seq2seq_data.EOS_ID) | (row == seq2seq_data.PAD_ID))
    stop = ended[0] + 1 if len(ended) else len(row)
    np.testing.assert_array_equal(row[:stop], predicted[:stop])
    assert np.all(row[stop:] == seq2seq_data.PAD_ID)  # padding after the end


def _log_probability(model, variables, inputs, tokens):
  """log p(tokens | inputs) up to and including the first EOS or padding."""
  log_probs = jax.nn.log_softmax(jit_apply(model, variables, inputs, tokens))
  picked = np.take_along_axis(np.asarray(log_probs), np.asarray(tokens)[..., None], -1)[..., 0]
  totals = []
  for row, values in zip(np.asarray(tokens), picked):
    ended = np.flatnonzero((row == seq2seq_data.EOS_ID) | (row == seq2seq_data.PAD_ID))
    stop = ended[0] + 1 if len(ended) else len(row)
    totals.append(values[:stop].sum())
  return np.array(totals)


def test_beam_search_of_one_is_greedy_and_wider_beams_score_at_least_as_high():
  model = _model(embed_dim=8)
  inputs, targets = _batch(count=6, seed=2)
  variables = _init(model, inputs, targets, seed=5)
  length = targets.shape[1]
  # The building blocks `decode` compiles, each compiled whole (eager, every op
  # around the scan is a program of its own).
  greedy = jit_call(decoding.greedy_decode, model, variables, inputs, length)
  np.testing.assert_array_equal(jit_call(decoding.beam_search, model, variables, inputs, length, 1),
                                greedy)
  beam = decoding.decode(model, variables, inputs, max_length=length, beam_size=4)
  greedy_score = _log_probability(model, variables, inputs, greedy)
  beam_score = _log_probability(model, variables, inputs, beam)
  assert np.all(beam_score >= greedy_score - 1e-4)
  assert np.any(beam_score > greedy_score + 1e-3)  # the search finds better ones here


def test_source_padding_changes_nothing_and_weights_sum_to_one_over_the_source():
  model = _model()
  inputs, targets = _batch(seed=4)
  variables = _init(model, inputs, targets)
  logits, state = jit_apply(model, variables, inputs, targets, mutable=["intermediates"])
  longer = jnp.pad(inputs, ((0, 0), (0, 5)))  # five more padding tokens
  assert_close(jit_apply(model, variables, longer, targets), logits, rtol=1e-5, atol=1e-5)
  (weights,) = state["intermediates"]["step"]["attention"]["attention_weights"]
  weights = np.asarray(weights)[:, :, 0, 0]  # [B, Tt, Ts]: one head, one query a step
  lengths = np.sum(np.asarray(inputs) != 0, axis=1)
  assert_close(weights.sum(-1), np.ones(weights.shape[:2]), rtol=1e-5, atol=1e-5)
  for row, length in zip(weights, lengths):
    assert np.all(row[:, length:] == 0)


def test_without_attention_the_decoder_has_no_attention_parameters():
  model = _model(decoder_attention=False)
  inputs, targets = _batch()
  params = _init(model, inputs, targets)["params"]
  assert set(params["step"]) == {"cell", "logits"}
  assert "attention" in _init(_model(), inputs, targets)["params"]["step"]


@pytest.mark.parametrize("overrides, message", [
    (dict(rnn_cell="rnn"), "unknown rnn_cell 'rnn'"),
    (dict(beam_size=0), "model.beam_size must be a positive integer, got 0"),
    (dict(attention="local"), "attention 'local' has no cross-attention form"),
])
def test_bad_model_config_is_named(overrides, message):
  with pytest.raises(ValueError, match=message):
    _model(**overrides)


def test_bad_decoding_arguments_are_named():
  model = _model()
  inputs, targets = _batch()
  variables = _init(model, inputs, targets)
  with pytest.raises(ValueError, match="beam_size must be a positive integer, got 0"):
    decoding.decode(model, variables, inputs, max_length=4, beam_size=0)
  with pytest.raises(ValueError, match="max_length must be a positive integer, got 0"):
    decoding.decode(model, variables, inputs, max_length=0)


def _tiny_config(**model):
  config = train_config.default_config("luong_dot")
  config.task = "reverse"
  config.task_options = dict(train_size=256, validation_size=32, test_size=32, min_length=3,
                             max_length=6, num_symbols=5)
  config.model.update(kind="rnn_seq2seq", embed_dim=16, num_heads=1, dropout_rate=0.1, **model)
  config.num_train_steps = 8
  config.batch_size = 16
  config.optimizer.update(learning_rate=3e-3, warmup_steps=2, schedule="cosine")
  config.eval_every = config.checkpoint_every = 8
  config.log_every = 4
  config.progress = False
  return config


def test_the_trainer_trains_it_and_reports_decoding_accuracy(tmp_path):
  config = _tiny_config(beam_size=2)
  config.data_dir = str(tmp_path / "data")
  results = train_and_evaluate(config, tmp_path / "run", handle_signals=False)
  test = results["metrics"]["test"]
  for name in ("accuracy", "sequence_accuracy", "decoded_token_accuracy"):
    assert 0.0 <= test[name] <= 1.0
  assert test["count"] > 32  # tokens, not examples: every target token is scored
  assert json.loads((tmp_path / "run" / "results.json").read_text())["metrics"]["test"] == test


def test_a_classification_task_refuses_the_seq2seq_model_and_back(tmp_path):
  config = _tiny_config()
  config.task, config.task_options = "listops", {}
  with pytest.raises(ValueError, match="task 'listops' needs model.kind 'classifier' or 'vit' "
                                       "or 'funnel' or 'hierarchical' or 'masked_language_model' "
                                       "or 'language_model', got 'rnn_seq2seq'"):
    train_and_evaluate(config, tmp_path / "a", handle_signals=False)
  config = _tiny_config()
  config.model.kind = "classifier"
  with pytest.raises(ValueError, match="task 'reverse' needs model.kind 'rnn_seq2seq'"):
    train_and_evaluate(config, tmp_path / "b", handle_signals=False)


def test_the_heatmap_of_a_trained_run_and_its_restored_model(tmp_path):
  from attention_jax.train.restore import restore_run
  from experiments import attention_heatmap
  config = _tiny_config()
  config.data_dir = str(tmp_path / "data")
  workdir = tmp_path / "run"
  results = train_and_evaluate(config, workdir, handle_signals=False)
  run = restore_run(workdir)
  assert run.step == results["metrics"]["best_validation"]["step"]
  example = run.splits["test"].gather(np.arange(4))
  logits = jit_apply(run.model, run.variables, jnp.asarray(example["inputs"]),
                     jnp.asarray(example["targets"]))
  assert logits.shape == example["targets"].shape + (run.config.model.vocab_size,)
  out = tmp_path / "heatmap.png"
  assert attention_heatmap.main([f"--workdir={workdir}", f"--out={out}", "--example=1"]) == 0
  assert out.stat().st_size > 1000
  with pytest.raises(FileNotFoundError, match="config.json"):
    restore_run(tmp_path / "nowhere")


@pytest.mark.parametrize("arg", ["additive", "luong_local,smoke", "nadaraya_watson,smoke"])
def test_the_reverse_config_builds_its_model(arg):
  from attention_jax.data import get_task
  from attention_jax.train.config import load_config_module
  config = load_config_module("configs/seq2seq/reverse.py").get_config(arg)
  info = get_task(config.task, **config.task_options).info
  config.model.update(vocab_size=info.vocab_size, num_classes=info.num_classes,
                      max_length=info.seq_len)
  model = build_model(config.model)
  assert model.config.kind == "rnn_seq2seq" and model.config.attention == arg.split(",")[0]
  inputs, targets = _batch()
  logits = jax.eval_shape(lambda: model.init_with_output(
      jax.random.PRNGKey(0), inputs, targets)[0])
  assert logits.shape == targets.shape + (info.vocab_size,)
