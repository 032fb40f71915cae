"""Heads family, section B of issue #17: disagreement regularisation (Li et al.
2018) and the adaptive attention span (Sukhbaatar et al. 2019)."""

import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_jax.layers.attention import MultiHeadAttention
from attention_jax.variants import heads
from attention_jax.variants.dense import dot_product_attention
from attention_jax.variants.sparse.windows import local_attention
from attention_testing import (B, H, KV_LENGTHS, as_float64, assert_close, jit_apply, jit_call,
                               jit_init, largest_intermediate, random_qkv)

sys.path.insert(0, str(pathlib.Path(__file__).parent.parent / "train"))
import tiny_config  # pylint: disable=g-import-not-at-top,wrong-import-position


def np_softmax_attention(logits, allowed, value):
  """Weights and outputs of a masked softmax: logits/allowed [B, H, Tq, Tk], value
  [B, Tk, H, Dv] -> ([B, H, Tq, Tk], [B, Tq, H, Dv]) float64; rows with no key are 0."""
  logits = np.where(allowed, logits, -np.inf)
  row_max = np.max(logits, -1, keepdims=True)
  weights = np.exp(logits - np.where(np.isfinite(row_max), row_max, 0.0))
  total = weights.sum(-1, keepdims=True)
  weights = weights / np.where(total == 0, 1.0, total)
  return weights, np.einsum("bhqk,bkhd->bqhd", weights, as_float64(value))


def np_logits(query, key):
  query, key = as_float64(query), as_float64(key)
  return np.einsum("bqhd,bkhd->bhqk", query, key) / np.sqrt(query.shape[-1])


# ----------------------------------------------------------------------------------
# disagreement


def np_mean_cosine(x):
  """(1/H^2) sum_{i,j} cos(x_i, x_j), each head's [N, F] flattened; mean over the batch."""
  x = as_float64(x)
  totals = []
  for example in x:
    flat = [example[:, h].ravel() for h in range(x.shape[2])]
    totals.append(np.mean([[a @ b / np.linalg.norm(a) / np.linalg.norm(b) for b in flat]
                           for a in flat]))
  return np.mean(totals)


def np_position_disagreement(weights):
  weights = as_float64(weights)
  num_heads = weights.shape[1]
  per_example = [-sum(np.sum(w[i] * w[j]) for i in range(num_heads) for j in range(num_heads))
                 / num_heads ** 2 for w in weights]
  return np.mean(per_example)


@pytest.mark.property("disagreement")
def test_each_regularizer_is_its_formula():
  rng = np.random.default_rng(0)
  value = rng.normal(size=(B, 6, H, 5)).astype(np.float32)
  weights = rng.dirichlet(np.ones(7), size=(B, H, 6)).astype(np.float32)
  assert_close(heads.subspace_disagreement(jnp.asarray(value)), -np_mean_cosine(value))
  assert_close(heads.output_disagreement(jnp.asarray(value)), -np_mean_cosine(value))
  assert_close(heads.position_disagreement(jnp.asarray(weights)),
               np_position_disagreement(weights))
  # Identical heads agree fully: every cosine is 1.
  same = np.repeat(value[:, :, :1], H, axis=2)
  assert_close(heads.subspace_disagreement(jnp.asarray(same)), -1.0)


@pytest.mark.parity("disagreement")
@pytest.mark.parametrize("is_causal", [False, True])
def test_output_is_dot_product_attention_and_losses_are_the_formulas(is_causal):
  query, key, value = random_qkv(seed=3, batch=B, q_len=8, num_heads=H, num_kv_heads=2)
  masks = dict(is_causal=is_causal, key_value_seq_lengths=jnp.asarray([5, 8]))

  @jax.jit
  def attend_and_sow(query, key, value):
    """The output and the losses it sows, as one program."""
    sown = {}
    out = heads.disagreement_attention(query, key, value, weight=0.5, **masks,
                                       sow_loss=lambda name, loss: sown.setdefault(name, loss))
    return out, sown

  out, sown = attend_and_sow(query, key, value)
  assert_close(out, jit_call(dot_product_attention, query, key, value, **masks))

  expanded_key, expanded_value = (np.repeat(as_float64(a), 2, axis=2) for a in (key, value))
  positions = np.arange(8)
  allowed = np.ones((B, 1, 8, 8), bool) & (positions[None, :] < np.array([5, 8])[:, None, None])[
      :, None]
  if is_causal:
    allowed = allowed & (positions[None, :] <= positions[:, None])
  weights, np_out = np_softmax_attention(np_logits(query, expanded_key), allowed, expanded_value)
  assert sorted(sown) == ["output_disagreement", "position_disagreement",
                          "subspace_disagreement"]
  # The losses are weight * (-D): minimising them maximises the disagreement.
  # V_i is the values of the sequence's keys: example 0's padded keys are zero.
  valid_value = np.where(allowed.any(axis=(1, 2))[:, :, None, None], expanded_value, 0.0)
  assert_close(sown["subspace_disagreement"], 0.5 * np_mean_cosine(valid_value))
  assert_close(sown["position_disagreement"], -0.5 * np_position_disagreement(weights))
  assert_close(sown["output_disagreement"], 0.5 * np_mean_cosine(np_out))


@pytest.mark.property("disagreement")
@pytest.mark.parametrize("padding", ["lengths", "mask"])
def test_padded_tokens_change_no_regularizer(padding):
  """A padded token's query, key and value reach no loss: D_sub is the cosine
  of the valid values only (here from the first 4 keys of example 0)."""
  query, key, value = random_qkv(seed=5, batch=2, q_len=6, num_heads=H)
  lengths = jnp.asarray([4, 6])
  if padding == "lengths":
    masks = dict(query_seq_lengths=lengths, key_value_seq_lengths=lengths)
  else:
    valid = jnp.arange(6)[None, :] < lengths[:, None]  # padded queries and keys alike
    masks = dict(mask=valid[:, None, :, None] & valid[:, None, None, :])

  def sown_losses(query, key, value):
    sown = {}
    heads.disagreement_attention(query, key, value, **masks,
                                 sow_loss=lambda name, loss: sown.setdefault(name, loss))
    return sown

  before = sown_losses(query, key, value)
  after = sown_losses(*(a.at[0, 4:].set(a[0, 4:] * 7.0 + 3.0) for a in (query, key, value)))
  for name in before:
    assert_close(after[name], before[name])
  valid = [as_float64(value)[0:1, :4], as_float64(value)[1:2]]
  assert_close(before["subspace_disagreement"],
               np.mean([np_mean_cosine(v) for v in valid]))


@pytest.mark.property("disagreement")
def test_chosen_regularizers_only_and_bad_names_refused():
  query, key, value = random_qkv(seed=4, batch=1, q_len=5, num_heads=H)
  sown = {}
  heads.disagreement_attention(query, key, value, regularizers=("position",),
                               sow_loss=lambda name, loss: sown.setdefault(name, loss))
  assert list(sown) == ["position_disagreement"]
  with pytest.raises(ValueError, match="regularizers must be a tuple"):
    heads.disagreement_attention(query, key, value, regularizers=("heads",))


@pytest.mark.property("disagreement")
def test_the_layer_sows_each_loss_once_even_when_keeping_the_weights():
  layer = MultiHeadAttention(num_heads=2, attention="disagreement")
  x = jax.random.normal(jax.random.PRNGKey(0), (2, 6, 8))
  # Only the parameters: `init` sows too, and its losses would be appended to.
  variables = {"params": jit_init(layer, jax.random.PRNGKey(1), x)["params"]}
  _, state = jit_apply(layer, variables, x, is_causal=True, mutable=["losses", "intermediates"])
  losses = state["losses"]
  assert sorted(losses) == ["output_disagreement", "position_disagreement",
                            "subspace_disagreement"]
  assert all(len(value) == 1 for value in losses.values())


@pytest.mark.property("disagreement")
def test_the_trainer_adds_the_regularizers_to_the_loss(tmp_path):
  from attention_jax.train.trainer import train_and_evaluate  # pylint: disable=g-import-not-at-top
  config = tiny_config.get_config("disagreement")
  config.data_dir = str(tmp_path / "data")
  config.num_train_steps = 6
  config.optimizer.warmup_steps = 2
  config.eval_every = 6
  config.checkpoint_every = 6
  train_and_evaluate(config, tmp_path / "run")
  lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text()
           .splitlines()]
  logged = [line for line in lines if "aux_loss" in line]
  assert logged
  for line in logged:
    assert line["aux_loss"] != 0.0
    assert line["loss"] == pytest.approx(line["cross_entropy"] + line["aux_loss"], rel=1e-5)


# ----------------------------------------------------------------------------------
# adaptive_span


def np_adaptive_span(query, key, value, spans, ramp, is_causal, key_lengths=None):
  """a_ij = m(i - j) exp(s_ij) / sum_k m(i - k) exp(s_ik), dense, float64."""
  length = query.shape[1]
  distance = np.abs(np.arange(length)[:, None] - np.arange(length)[None, :])
  mask = np.clip((ramp + np.asarray(spans, np.float64)[:, None, None] - distance) / ramp, 0, 1)
  logits = np_logits(query, key)
  allowed = np.ones((1, 1, length, length), bool)
  if is_causal:
    allowed = allowed & (np.arange(length)[None, :] <= np.arange(length)[:, None])
  if key_lengths is not None:
    allowed = allowed & (np.arange(length)[None, None, None, :]
                         < np.asarray(key_lengths)[:, None, None, None])
  unnormalised = np.where(allowed, mask[None] * np.exp(logits - logits.max(-1, keepdims=True)), 0)
  total = unnormalised.sum(-1, keepdims=True)
  weights = unnormalised / np.where(total == 0, 1.0, total)
  return np.einsum("bhqk,bkhd->bqhd", weights, as_float64(value))


@pytest.mark.property("adaptive_span")
@pytest.mark.parametrize("is_causal", [True, False])
def test_adaptive_span_is_the_renormalised_masked_softmax(is_causal):
  length, max_span, ramp = 40, 9, 4
  query, key, value = random_qkv(seed=5, batch=B, q_len=length, num_heads=H)
  spans = jnp.asarray([0.0, 2.5, 6.25, 9.0])  # one per head, 0 and S included
  out = jit_call(heads.adaptive_span_attention, query, key, value, is_causal=is_causal,
                 spans=spans, max_span=max_span, ramp=ramp,
                 key_value_seq_lengths=jnp.asarray(KV_LENGTHS) * 4)
  expected = np_adaptive_span(query, key, value, spans, ramp, is_causal, KV_LENGTHS * 4)
  assert_close(out, expected, atol=2e-5)


@pytest.mark.property("adaptive_span")
def test_full_spans_with_a_unit_ramp_are_causal_local_attention():
  # z = S, R = 1: mask 1 at distances <= S, 0 from S + 1 on: local's window S.
  length, max_span = 48, 7
  query, key, value = random_qkv(seed=6, batch=B, q_len=length, num_heads=H, num_kv_heads=2)
  out = jit_call(heads.adaptive_span_attention, query, key, value, is_causal=True,
                 spans=jnp.full((H,), float(max_span)), max_span=max_span, ramp=1)
  assert_close(out, jit_call(local_attention, query, key, value, is_causal=True,
                             window_size=max_span))


@pytest.mark.property("adaptive_span")
def test_span_penalty_is_sown_and_spans_are_clamped_and_trainable():
  layer = MultiHeadAttention(num_heads=H, attention="adaptive_span",
                             attention_options={"max_span": 8, "ramp": 2, "span_penalty": 0.25})
  x = jax.random.normal(jax.random.PRNGKey(0), (1, 20, 16))
  params = jit_init(layer, jax.random.PRNGKey(1), x)["params"]
  assert_close(params["variant"]["span"], np.full(H, 4.0))
  raw = jnp.asarray([-3.0, 1.0, 5.5, 12.0])
  params = {**params, "variant": {"span": raw}}
  _, state = jit_apply(layer, {"params": params}, x, is_causal=True, mutable=["losses"])
  (penalty,) = state["losses"]["variant"]["span_penalty"]
  assert_close(penalty, 0.25 * np.mean([0.0, 1.0, 5.5, 8.0]))

  def loss(span):
    return jnp.sum(jit_apply(layer, {"params": {**params, "variant": {"span": span}}}, x,
                               is_causal=True) ** 2)
  grad = jax.grad(loss)(raw)
  assert np.isfinite(np.asarray(grad)).all()
  # Spans inside (0, S) learn from the mask; a clamped one only from a
  # gradient that brings it back (descending it raises -3, lowers 12).
  assert np.all(np.asarray(grad)[1:3] != 0) and grad[0] <= 0 and grad[3] >= 0


@pytest.mark.property("adaptive_span")
def test_a_span_pushed_past_a_bound_can_come_back():
  """The paper projects its spans into [0, S] after each update, so a span at
  a bound keeps learning. A span parameter an update pushed past a bound
  reads as the bound and takes the gradient that moves it back inside (and
  none that pushes it further out): it is not stuck there for good."""
  max_span = 8.0
  raw = jnp.asarray([-1.0, 3.0, 9.5])
  assert_close(heads.clamp_spans(raw, max_span), [0.0, 3.0, 8.0])
  # A loss that wants longer spans: its descent raises every span, which
  # brings -1 back and would push 9.5 further out.
  longer = jax.grad(lambda z: -jnp.sum(heads.clamp_spans(z, max_span)))(raw)
  assert_close(longer, [-1.0, -1.0, 0.0])
  # The span penalty wants shorter ones: 9.5 comes back, -1 stays.
  shorter = jax.grad(lambda z: heads.span_penalty_loss(heads.clamp_spans(z, max_span), 3.0))(raw)
  assert_close(shorter, [0.0, 1.0, 1.0])
  # Through the layer: a head at span -1 learns from the penalty's opposite
  # (sown with a negative weight) as the paper's projected span at 0 would.
  layer = heads.AdaptiveSpan(max_span=8, ramp=2, span_penalty=-1.0)
  query = jnp.zeros((1, 4, 3, 2))

  def sown_penalty(span):
    _, state = layer.apply({"params": {"span": span}}, query, query, query, mutable=["losses"])
    return state["losses"]["span_penalty"][0]
  assert_close(jax.grad(sown_penalty)(raw), [-1.0 / 3, -1.0 / 3, 0.0])


@pytest.mark.property("adaptive_span")
def test_adaptive_span_arrays_are_key_blocks_whatever_the_largest_span():
  length = 4096
  query, key, value = (jnp.zeros((1, length, 2, 16)) for _ in range(3))

  def largest(max_span):
    fn = lambda q: heads.adaptive_span_attention(q, key, value, is_causal=True,
                                                 spans=jnp.full((2,), 1.0), max_span=max_span,
                                                 ramp=32, block_size=32)
    return largest_intermediate(fn, query)
  # One key block offset at a time: the scores are [H, T, b], whatever S.
  assert largest(32) == largest(512) < length * length // 4


@pytest.mark.property("adaptive_span")
@pytest.mark.parametrize("is_causal", [True, False])
def test_keys_beyond_the_largest_span_are_never_computed(is_causal):
  """NaN values in key blocks past the largest span + R: a block computed
  there would carry NaN into the output (0 * NaN) or the gradients, though
  its weights are 0. Only the skipped blocks are out of reach."""
  length, block, ramp = 64, 8, 4
  query, key, value = random_qkv(seed=8, batch=1, q_len=length, num_heads=H)
  spans = jnp.asarray([2.0, 5.0, 7.5, 3.0])  # largest 7.5: keys 11.5 or more away get 0
  poisoned = value.at[:, :block].set(jnp.nan)  # the first key block
  far = 3 * block  # query blocks from 3 on are two blocks or more away from block 0

  @jax.jit
  def attend(q, v):
    return heads.adaptive_span_attention(q, key, v, is_causal=is_causal, spans=spans,
                                         max_span=24, ramp=ramp, block_size=block)
  out = attend(query, poisoned)
  assert np.isfinite(np.asarray(out[:, far:])).all()
  assert np.isnan(np.asarray(out[:, :block])).any()  # the poison is there to be found
  assert_close(out[:, far:], attend(query, value)[:, far:])
  # Backward too: the far queries' gradients never meet the poison (the near
  # blocks' do, through 0 * NaN, as any computed block would).
  grad = jax.grad(lambda q: jnp.sum(attend(q, poisoned)[:, far:] ** 2))(query)
  assert np.isfinite(np.asarray(grad[:, far:])).all()
  # The same band without skipping (spans at S) reaches the poison from query block 3.
  full = jit_call(heads.adaptive_span_attention, query, key, poisoned, is_causal=is_causal,
                  spans=jnp.full((H,), 24.0), max_span=24, ramp=ramp, block_size=block)
  assert np.isnan(np.asarray(full[:, far:far + block])).any()


@pytest.mark.property("adaptive_span")
def test_adaptive_span_refuses_bad_arguments():
  query, key, value = random_qkv(seed=7, batch=1, q_len=8, num_heads=H)
  with pytest.raises(ValueError, match="ramp must be an int >= 1"):
    heads.adaptive_span_attention(query, key, value, spans=jnp.ones(H), ramp=0)
  with pytest.raises(ValueError, match="spans"):
    heads.adaptive_span_attention(query, key, value, spans=jnp.ones(H + 1))
  with pytest.raises(ValueError, match="bias"):
    heads.adaptive_span_attention(query, key, value, jnp.zeros((1, H, 8, 8)), spans=jnp.ones(H))
