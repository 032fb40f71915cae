"""The chunkwise recurrent mixers (variants/chunkwise): the engine's three forms
against each other and against an independent float64 loop, outputs and
gradients; long sequences with extreme gates; each mixer's forms, padding,
bidirectional pass and bad options. Decoding equals the full pass for every
mixer in tests/models/test_generation.py."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_jax import registry
from attention_jax.variants.chunkwise import delta_net, engine, gla, mamba2, retention, rwkv7
from attention_testing import (assert_close, forms_outputs_and_grads, jit_apply,
                               recurrence_inputs)

MIXERS = ("retention", "gla", "delta_net", "gated_delta_net", "mamba2", "rwkv7")
B, T, H, DK, DV = 2, 23, 2, 6, 5


def _inputs(per_dimension: bool, low_rank: bool, **options):
  return recurrence_inputs(per_dimension, low_rank, batch=B, heads=H, key_dim=DK, value_dim=DV,
                           **{"length": T, **options})


def _loop(query, key, value, log_decay, read, write, initial_state):
  """The recurrence by its definition, token by token, in float64 numpy:
  S_t = (diag(exp(g_t)) + w_t r_t^T) S_{t-1} + k_t v_t^T, o_t = S_t^T q_t."""
  arrays = [None if a is None else np.asarray(a, np.float64)
            for a in (query, key, value, log_decay, read, write, initial_state)]
  query, key, value, log_decay, read, write, state = arrays
  out = np.zeros(value.shape)
  for b in range(query.shape[0]):
    for h in range(query.shape[2]):
      s = state[b, h].copy()
      for t in range(query.shape[1]):
        g = np.broadcast_to(log_decay[b, t, h], (query.shape[3],))
        transition = np.diag(np.exp(g))
        if read is not None:
          transition = transition + np.outer(write[b, t, h], read[b, t, h])
        s = transition @ s + np.outer(key[b, t, h], value[b, t, h])
        out[b, t, h] = s.T @ query[b, t, h]
  return out


KINDS = [pytest.param(d, r, id=f"{'vector' if d else 'scalar'}_decay{'_delta' if r else ''}")
         for d in (False, True) for r in (False, True)]


@pytest.mark.parametrize("per_dimension, low_rank", KINDS)
def test_the_recurrent_form_is_the_recurrence_by_its_definition(per_dimension, low_rank):
  arrays = _inputs(per_dimension, low_rank)
  state = jax.random.normal(jax.random.PRNGKey(9), (B, H, DK, DV))
  out, _ = jax.jit(functools.partial(engine.recurrent_form, initial_state=state))(*arrays)
  assert_close(out, _loop(*arrays, state), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("per_dimension, low_rank", KINDS)
def test_chunkwise_and_parallel_forms_equal_the_recurrent_one_outputs_and_gradients(
    per_dimension, low_rank):
  """Chunk sizes 1, 5 and 7 (not dividing T = 23) and 8, and one chunk larger
  than T; an initial state, as while decoding."""
  arrays = _inputs(per_dimension, low_rank) + (
      jax.random.normal(jax.random.PRNGKey(9), (B, H, DK, DV)),)
  forms = {"recurrent": engine.recurrent_form, "parallel": engine.parallel_form}
  for chunk in (1, 5, 7, 8, 64):
    forms[f"chunk {chunk}"] = functools.partial(engine.chunkwise_form, chunk_size=chunk)
  results = forms_outputs_and_grads(arrays, forms)
  out, final, grads = results.pop("recurrent")
  for name, (other_out, other_final, other_grads) in results.items():
    assert_close(other_out, out, rtol=2e-4, atol=2e-4, err_msg=name)
    assert_close(other_final, final, rtol=2e-4, atol=2e-4, err_msg=name)
    for i, (a, b) in enumerate(zip(other_grads, grads)):
      assert_close(a, b, rtol=2e-4, atol=2e-4, err_msg=f"{name}, gradient {i}")


@pytest.mark.parametrize("per_dimension, length", [(False, 65536), (True, 256)],
                         ids=["per_head_65536", "per_dimension_256"])
@pytest.mark.parametrize("low_rank", [False, True], ids=["gated", "delta"])
@pytest.mark.parametrize("gate", ["near_0", "near_1"])
def test_no_overflow_with_gates_near_0_and_near_1(gate, low_rank, per_dimension, length):
  """Gates exp(-30) (near 0: each token forgets all before it) or exp(-1e-6)
  (near 1: the state keeps every token). The chunkwise form sums decays
  within a chunk only, so neither underflows into NaN nor overflows, at any
  length: a longer sequence adds chunks, not larger sums. Per head at
  T = 65536; per dimension at 256 (4 chunks of 64: the same sums, at a
  fraction of the time). Near 0 every output is the current token's alone;
  near 1, without the delta rule, the final state is the sum of all k v^T,
  each decayed by its distance to the end."""
  query, key, value, _, read, write = _inputs(False, low_rank, length=length)
  query, key, value = query[:1], key[:1], value[:1]
  log_decay = jnp.full((1, length, H) + ((DK,) if per_dimension else ()),
                       -30.0 if gate == "near_0" else -1e-6)
  if low_rank:  # the gated delta rule: the write decays with the state
    decay = jnp.exp(log_decay) if per_dimension else jnp.exp(log_decay)[..., None]
    read, write = read[:1], write[:1] * decay

  def run(query, key, value):
    out, state = engine.chunkwise_form(query, key, value, log_decay, read, write)
    return jnp.sum(out[:, -8:]) + jnp.sum(state), (out, state)

  grads, (out, state) = jax.jit(jax.grad(run, argnums=(0, 1, 2), has_aux=True))(query, key,
                                                                                 value)
  for array in (out, state, *grads):
    assert bool(jnp.all(jnp.isfinite(array)))
  if gate == "near_0":
    current = jnp.einsum("bthk,bthk->bth", query, key)[..., None] * value
    assert_close(out, current, rtol=1e-4, atol=1e-4)
  elif not low_rank:
    kept = np.exp(-1e-6 * np.arange(length - 1, -1, -1))  # key s kept exp(-1e-6 (T - 1 - s))
    expected = np.einsum("bthk,bthv,t->bhkv", np.asarray(key, np.float64),
                         np.asarray(value, np.float64), kept)
    assert_close(state, expected, rtol=1e-3, atol=1e-2)


def test_gated_linear_attention_in_the_parallel_form_is_the_masked_quadratic_one():
  """GLA's pure function, form="parallel", against (Q K^T * D) V written out:
  D_ts = prod_{s < r <= t} alpha_r per key dimension."""
  query, key, value, log_decay, _, _ = _inputs(True, False)
  out, _ = jax.jit(functools.partial(gla.gated_linear_attention, form="parallel"))(
      query, key, value, log_decay)
  cumulative = np.cumsum(np.asarray(log_decay, np.float64), axis=1)  # [B, T, H, K]
  scaled = np.asarray(query, np.float64) * DK ** -0.5
  weights = np.einsum("bthk,bshk,btshk->bhts", scaled, np.asarray(key, np.float64),
                      np.exp(cumulative[:, :, None] - cumulative[:, None, :]))
  weights = weights * np.tril(np.ones((T, T)))
  assert_close(out, np.einsum("bhts,bshv->bthv", weights, np.asarray(value, np.float64)),
               rtol=1e-4, atol=1e-4)


def test_retention_is_the_papers_parallel_form():
  """O = (Q K^T * D) V / sqrt(Dk), D_ts = gamma^(t - s): retention's pure function."""
  query, key, value, _, _, _ = _inputs(False, False)
  decays = retention.multi_scale_decays(H)
  out, _ = jax.jit(functools.partial(retention.multi_scale_retention, form="chunkwise",
                                     chunk_size=4))(query, key, value, decays)
  steps = np.arange(T)[:, None] - np.arange(T)[None, :]
  mask = np.power(np.asarray(decays, np.float64)[:, None, None], np.maximum(steps, 0)) * (
      steps >= 0)
  scores = np.einsum("bthk,bshk->bhts", np.asarray(query, np.float64),
                     np.asarray(key, np.float64)) * DK ** -0.5 * mask
  assert_close(out, np.einsum("bhts,bshv->bthv", scores, np.asarray(value, np.float64)),
               rtol=1e-4, atol=1e-4)


def test_the_delta_rule_moves_the_memory_towards_the_value():
  """With beta = 1 and one unit key written twice, the second write replaces
  the first: S^T k = v_2 exactly (the delta rule's defining property), where
  linear attention would return v_1 + v_2."""
  key = jnp.zeros((1, 2, 1, 4)).at[..., 0].set(1.0)
  value = jnp.array([[[[1.0, 2.0]], [[5.0, -1.0]]]])
  out, state = jax.jit(functools.partial(delta_net.delta_rule_attention, scale=1.0))(
      key, key, value, jnp.ones((1, 2, 1)))
  assert_close(state[0, 0].T @ key[0, 1, 0], value[0, 1, 0])
  assert_close(out[0, 1, 0], value[0, 1, 0])


def test_mamba2_ssd_is_the_selective_scan():
  """SSD against h_t = exp(dt A) h_{t-1} + B_t (dt x_t)^T, y = h^T C + D x, a
  numpy loop."""
  rng = np.random.default_rng(0)
  x, step = rng.normal(size=(1, 9, 2, 3)), np.log1p(np.exp(rng.normal(size=(1, 9, 2))))
  state_in, state_out = rng.normal(size=(1, 9, 1, 4)), rng.normal(size=(1, 9, 1, 4))
  rate_log, skip = rng.normal(size=(2,)), rng.normal(size=(2,))
  y, _ = jax.jit(functools.partial(mamba2.ssd, chunk_size=4))(
      *map(jnp.asarray, (x, step, rate_log, state_in, state_out, skip)))
  expected = np.zeros_like(x)
  for h in range(2):
    state = np.zeros((4, 3))
    for t in range(9):
      state = (np.exp(-np.exp(rate_log[h]) * step[0, t, h]) * state
               + np.outer(state_in[0, t, 0], step[0, t, h] * x[0, t, h]))
      expected[0, t, h] = state.T @ state_out[0, t, 0] + skip[h] * x[0, t, h]
  assert_close(y, expected, rtol=1e-4, atol=1e-4)


def test_rwkv7_adds_the_current_tokens_bonus():
  """With decays exp(-1e4) and no in-context learning (a = 0) the state holds
  the current token alone, and RWKV-7's output is (r . k~) v plus the bonus
  (r . (rho * k~)) v."""
  receptance, key, value, bonus = [jax.random.normal(jax.random.PRNGKey(i), (1, 5, H, DK))
                                   for i in range(4)]
  bonus = bonus[0, 0]
  zeros = jnp.zeros_like(key)
  out, _ = jax.jit(rwkv7.rwkv7_attention)(receptance, key, value, jnp.full_like(key, -1e4),
                                          zeros, zeros, bonus)
  expected = (jnp.sum(receptance * bonus * key, -1, keepdims=True) * value
              + jnp.einsum("bthk,bthk->bth", receptance, key)[..., None] * value)
  assert_close(out, expected, rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------
# The mixers.
# ----------------------------------------------------------------------------

EMBED = 16


def _mixer(name, **options):
  return registry.get_variant(name).module(num_heads=2, **options)


def _params_and_x(name, length=11, seed=0):
  x = jax.random.normal(jax.random.PRNGKey(seed), (2, length, EMBED))
  params = jax.jit(lambda x: _mixer(name).init(jax.random.PRNGKey(1), x, is_causal=True))(x)
  return params, x


@pytest.mark.property("retention")
@pytest.mark.property("gla")
@pytest.mark.property("delta_net")
@pytest.mark.property("gated_delta_net")
@pytest.mark.property("mamba2")
@pytest.mark.property("rwkv7")
@pytest.mark.parametrize("name", MIXERS)
def test_each_mixers_three_forms_agree_causal_and_bidirectional_with_gradients(name):
  """The layer's outputs and parameter gradients are the same whichever form
  runs its recurrence (chunks of 4 for 11 tokens); not causal, it is the
  causal pass plus the causal pass over the reversed sequence."""
  variables, x = _params_and_x(name)

  def run(form, is_causal, params):
    y = _mixer(name, form=form, chunk_size=4).apply({"params": params}, x, is_causal=is_causal)
    return jnp.sum(jnp.sin(y)), y

  for is_causal in (True, False):
    results = {form: jax.jit(jax.grad(functools.partial(run, form, is_causal), has_aux=True))(
        variables["params"]) for form in ("recurrent", "chunkwise", "parallel")}
    grads, y = results.pop("recurrent")
    for form, (other_grads, other_y) in results.items():
      assert_close(other_y, y, rtol=1e-4, atol=1e-4, err_msg=f"{form}, causal={is_causal}")
      jax.tree.map(lambda a, b: assert_close(a, b, rtol=2e-4, atol=2e-4,
                                             err_msg=f"{form} gradient"), other_grads, grads)
  causal = jit_apply(_mixer(name), variables, x, is_causal=True)
  reversed_causal = jit_apply(_mixer(name), variables, jnp.flip(x, 1), is_causal=True,
                              positions=jnp.arange(10, -1, -1))
  assert_close(jit_apply(_mixer(name), variables, x), causal + jnp.flip(reversed_causal, 1),
               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", MIXERS)
def test_padding_is_invisible_to_the_valid_tokens(name):
  """Right-padded sequences (lengths 7 and 11) give the valid tokens the
  outputs of the sequences alone, causal and bidirectional (reversed, the
  padding comes first and must leave the state as it was)."""
  variables, x = _params_and_x(name)
  lengths = jnp.array([7, 11])
  for is_causal in (True, False):
    padded = jax.jit(lambda x: _mixer(name).apply(
        variables, x, is_causal=is_causal, query_seq_lengths=lengths,
        key_value_seq_lengths=lengths))(x)
    alone = jit_apply(_mixer(name), variables, x[:1, :7], is_causal=is_causal)
    assert_close(padded[0, :7], alone[0], rtol=1e-5, atol=1e-5)
    assert float(jnp.abs(padded[0, 7:]).max()) == 0.0


@pytest.mark.parametrize("name, options, message", [
    ("gla", dict(chunk_size=0), "chunk_size must be an int >= 1, got 0"),
    ("gla", dict(form="scan"), "form must be one of .* got 'scan'"),
    ("gla", dict(expand_k=0.2), r"num_heads=2 must divide gla's expand_k x the model width \(3\)"),
    ("retention", dict(decays=(0.9, 1.0)), r"decays must be a number in \(0.0, 1.0\), got 1.0"),
    ("retention", dict(decays=(0.9,)), "decays must give one decay per head"),
    ("delta_net", dict(beta=2.5), r"beta must be a number in \(0.0, 2.0\), got 2.5"),
    ("delta_net", dict(head_dim=0), "head_dim must be an int >= 1, got 0"),
    ("mamba2", dict(head_dim=5), r"head_dim=5 must divide mamba2's inner width \(32\)"),
    ("mamba2", dict(state_size=0), "state_size must be an int >= 1, got 0"),
    ("rwkv7", dict(low_rank_dim=-1), "low_rank_dim must be an int >= 1, got -1"),
])
def test_bad_options_name_themselves(name, options, message):
  x = jnp.ones((1, 4, EMBED))
  with pytest.raises(ValueError, match=message):
    _mixer(name, **options).init(jax.random.PRNGKey(0), x, is_causal=True)


def test_heads_must_divide_the_width():
  with pytest.raises(ValueError, match=r"num_heads=3 must divide the model width \(16\)"):
    registry.get_variant("delta_net").module(num_heads=3).init(
        jax.random.PRNGKey(0), jnp.ones((1, 4, EMBED)), is_causal=True)


def test_engine_refuses_mismatched_shapes_by_name():
  query, key, value, log_decay, read, write = _inputs(False, True)
  with pytest.raises(ValueError, match=r"log_decay must be \[B, T, H\]"):
    engine.chunkwise_form(query, key, value, log_decay[..., :1])
  with pytest.raises(ValueError, match="read_key and write_key come together"):
    engine.chunkwise_form(query, key, value, log_decay, read)
  with pytest.raises(ValueError, match=r"initial_state must be \[B, H, Dk, Dv\]"):
    engine.recurrent_form(query, key, value, log_decay, initial_state=jnp.zeros((B, H, DK)))
