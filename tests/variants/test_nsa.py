"""NSA's three branches written out query by query in numpy."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attention_jax as aj
from attention_jax.layers.attention import attention_weights
from attention_jax.variants.modern.nsa import nsa_attention, stack_branches
from attention_testing import (as_float64, assert_close, assert_same_outputs_and_grads,
                               jit_call, jit_init, np_softmax, random_qkv)

B, T, H, HKV, D = 2, 27, 4, 2, 8
SIZES = dict(compress_block_size=4, compress_stride=2, select_block_size=4, top_n=4, window=5)


def _arrays(seed=0, length=T):
  keys = jax.random.split(jax.random.PRNGKey(seed), 5)
  l = SIZES["compress_block_size"]
  return dict(gates=jax.nn.sigmoid(jax.random.normal(keys[0], (B, length, H, 3))),
              compress_key=jax.random.normal(keys[1], (l * D, D)) / np.sqrt(l * D),
              compress_value=jax.random.normal(keys[2], (l * D, D)) / np.sqrt(l * D),
              key_positions=0.1 * jax.random.normal(keys[3], (l, D)),
              value_positions=0.1 * jax.random.normal(keys[4], (l, D)))


def _attend(q, keys, values):
  if len(keys) == 0:
    return np.zeros(values.shape[-1])
  return np_softmax(keys @ q / np.sqrt(D)) @ values


def _numpy_nsa(query, key, value, arrays, local=2):
  """key, value: `[B, T, 3 HKV, D]`, each group's compressed, selected and
  sliding branches' sets side by side."""
  q, k, v = map(as_float64, (query, key, value))
  # [B, T, HKV, D] each: the compressed (c), selected (s) and sliding (w) sets.
  (kc, ks, kw), (vc, vs, vw) = ([x.reshape(B, T, HKV, 3, D)[:, :, :, i] for i in range(3)]
                                for x in (k, v))
  a = {name: as_float64(x) for name, x in arrays.items()}
  l, d, ls, n, w = (SIZES[name] for name in ("compress_block_size", "compress_stride",
                                             "select_block_size", "top_n", "window"))
  starts = list(range(0, T - l + 1, d))
  num_select, group = -(-T // ls), H // HKV
  out = np.zeros((B, T, H, D))
  for b in range(B):
    for g in range(HKV):
      phi = lambda x, weight, pos: np.stack(
          [(x[s:s + l] + pos).reshape(-1) @ weight for s in starts])
      ck = phi(kc[b, :, g], a["compress_key"], a["key_positions"])
      cv = phi(vc[b, :, g], a["compress_value"], a["value_positions"])
      for i in range(T):
        seen = [c for c, s in enumerate(starts) if s + l - 1 <= i]
        importance = np.zeros(num_select)
        branches = {}
        for h in range(g * group, (g + 1) * group):
          if seen:
            p = np_softmax(ck[seen] @ q[b, i, h] / np.sqrt(D))
            for weight, c in zip(p, seen):
              importance[starts[c] // ls] += weight
          branches[h] = [_attend(q[b, i, h], ck[seen], cv[seen])]
        own = i // ls
        forced = {0} | {j for j in range(own - local + 1, own + 1) if j >= 0}
        others = sorted((j for j in range(own + 1) if j not in forced),
                        key=lambda j: -importance[j])
        chosen = forced | set(others[:n - len(forced)])
        picked = [j for j in range(i + 1) if j // ls in chosen]
        recent = list(range(max(0, i - w + 1), i + 1))
        for h in range(g * group, (g + 1) * group):
          gate = a["gates"][b, i, h]
          out[b, i, h] = (gate[0] * branches[h][0]
                          + gate[1] * _attend(q[b, i, h], ks[b, picked, g], vs[b, picked, g])
                          + gate[2] * _attend(q[b, i, h], kw[b, recent, g], vw[b, recent, g]))
  return out


@pytest.mark.parametrize("implementation, local", [("blockwise", 2), ("xla", 2), ("xla", 1)])
@pytest.mark.property("nsa")
def test_equals_the_three_branches_written_out(implementation, local):
  query, key, value = random_qkv(batch=B, q_len=T, num_heads=H, num_kv_heads=3 * HKV,
                                 head_dim=D)
  arrays = _arrays()
  got = jax.jit(functools.partial(nsa_attention, is_causal=True, implementation=implementation,
                                  num_local_blocks=local, **SIZES))(query, key, value, **arrays)
  assert_close(got, _numpy_nsa(query, key, value, arrays, local), rtol=1e-4, atol=1e-5)


@pytest.mark.property("nsa")
def test_blockwise_gradients_equal_the_dense_reference_for_the_same_choice():
  qkv = random_qkv(seed=1, batch=B, q_len=T, num_heads=H, num_kv_heads=3 * HKV, head_dim=D)
  arrays = _arrays(2)

  def run(implementation, q, k, v, gates, compress_key):
    return nsa_attention(q, k, v, is_causal=True, implementation=implementation, gates=gates,
                         compress_key=compress_key,
                         **{n: arrays[n] for n in ("compress_value", "key_positions",
                                                   "value_positions")}, **SIZES)

  assert_same_outputs_and_grads(jax.jit(functools.partial(run, "blockwise")),
                                jax.jit(functools.partial(run, "xla")), *qkv, arrays["gates"],
                                arrays["compress_key"], rtol=1e-4, atol=1e-5)


def test_the_layer_gates_its_branches_from_its_input_and_learns_the_compression():
  layer = aj.MultiHeadAttention(num_heads=H, num_kv_heads=HKV, attention="nsa",
                                attention_options=SIZES)
  x = jax.random.normal(jax.random.PRNGKey(3), (B, T, 16))
  params = nn.meta.unbox(jit_init(layer, jax.random.PRNGKey(4), x, is_causal=True)["params"])
  variant = params["variant"]
  assert variant["gates"]["kernel"].shape == (16, 3 * H)
  assert variant["compress_key"].shape == (4 * 4, 4)  # l * D -> D, D = 16 / 4 heads
  grads = jax.jit(jax.grad(lambda p: jnp.sum(jnp.sin(
      layer.apply({"params": p}, x, is_causal=True)))))(params)["variant"]
  for name in ("compress_key", "compress_value", "key_positions"):
    assert float(jnp.abs(grads[name]).max()) > 0.0, name
  assert float(jnp.abs(grads["gates"]["kernel"]).max()) > 0.0


def test_bad_settings_are_named():
  query, key, value = random_qkv(batch=B, q_len=T, num_heads=H, num_kv_heads=3 * HKV,
                                 head_dim=D)
  arrays = _arrays()
  with pytest.raises(ValueError, match=r"top_n \(9\) must be at most the number of selection"):
    nsa_attention(query, key, value, is_causal=True, **arrays, **{**SIZES, "top_n": 9})
  with pytest.raises(ValueError, match=r"compress_stride \(3\) must divide"):
    nsa_attention(query, key, value, is_causal=True, **arrays, **{**SIZES, "compress_stride": 3})
  with pytest.raises(ValueError, match=r"num_local_blocks must be an int >= 1, got 0"):
    nsa_attention(query, key, value, is_causal=True, num_local_blocks=0, **arrays, **SIZES)
  with pytest.raises(ValueError, match=r"top_n \(3\) must be at least 1 \+ num_local_blocks = 4"):
    nsa_attention(query, key, value, is_causal=True, num_local_blocks=3, **arrays,
                  **{**SIZES, "top_n": 3})
  with pytest.raises(ValueError, match=r"a set per branch .* 3 Hkv heads; got 4 heads"):
    nsa_attention(query, key[:, :, :4], value[:, :, :4], is_causal=True, **arrays, **SIZES)
  with pytest.raises(ValueError, match="nsa is causal"):
    nsa_attention(query, key, value, **arrays, **SIZES)
  # Transformer-XL's relative terms score one set of keys per group.
  layer = aj.MultiHeadAttention(num_heads=H, qkv_features=H * D, attention="nsa",
                                position="xl_relative", attention_options=SIZES)
  with pytest.raises(ValueError, match=r"position='xl_relative' scores one set of keys per K/V "
                                       r"group, and attention variant 'nsa' reads 3"):
    layer.init(jax.random.PRNGKey(0), jnp.zeros((1, T, 16)), is_causal=True)


def _selected_blocks(query, key, arrays, sizes, **call):
  """The selection blocks each query's selected branch reads: `[B, H, Tq]`
  sets, from that branch alone (gates (0, 1, 0)) over one-hot values."""
  batch, q_len, num_heads = query.shape[:3]
  kv_len, l = key.shape[1], sizes["compress_block_size"]
  selected_only = dict(arrays, gates=jnp.broadcast_to(jnp.asarray([0.0, 1.0, 0.0]),
                                                      (batch, q_len, num_heads, 3)),
                       compress_value=jnp.zeros((l * kv_len, kv_len)),
                       value_positions=jnp.zeros((l, kv_len)))
  weights = attention_weights(jax.jit(lambda v: nsa_attention(
      query, key, v, is_causal=True, implementation="xla", **selected_only, **sizes, **call)),
      jnp.zeros(key.shape[:3] + (kv_len,)))
  seen = np.asarray(weights) > 0  # [B, H, Tq, Tk]
  return [[[{j // sizes["select_block_size"] for j in np.nonzero(seen[b, h, i])[0]}
            for i in range(q_len)] for h in range(num_heads)] for b in range(batch)]


@pytest.mark.property("nsa")
def test_the_initial_block_and_the_two_local_blocks_are_always_selected():
  """Section 4.1: n = 16 blocks "including fixed activating the 1 initial
  block and 2 local blocks": the query's own block and the one before it.
  top_n counts them, so one block in four is chosen by importance here."""
  length, sizes = 40, dict(SIZES, top_n=4)
  query, key, _ = random_qkv(seed=5, batch=1, q_len=length, num_heads=H, num_kv_heads=HKV,
                             head_dim=D)
  blocks = _selected_blocks(query, key, _arrays(6, length=length), sizes, shared_key_value=True)
  for i in range(length):
    own = i // sizes["select_block_size"]
    forced = {0, max(own - 1, 0), own}
    for h in range(H):
      assert forced <= blocks[0][h][i], (i, h, blocks[0][h][i])
      assert len(blocks[0][h][i]) == min(sizes["top_n"], own + 1), (i, h, blocks[0][h][i])


@pytest.mark.property("nsa")
def test_fewer_queries_than_keys_are_the_last_queries_of_the_full_pass():
  """Queries sit at arange(Tq) + Tk - Tq (the docstring): every branch,
  the sliding window included, treats the 4 queries as the last 4 of a full pass."""
  query, key, value = random_qkv(seed=7, batch=B, q_len=T, num_heads=H, num_kv_heads=3 * HKV,
                                 head_dim=D)
  arrays = _arrays(8)
  run = lambda query, **arrays: jit_call(nsa_attention, query, key, value, is_causal=True,
                                         implementation="xla", **SIZES, **arrays)
  full = run(query, **arrays)
  tail = run(query[:, -4:], **dict(arrays, gates=arrays["gates"][:, -4:]))
  assert_close(tail, full[:, -4:], rtol=1e-5, atol=1e-6)


def test_the_layer_gives_each_branch_its_own_keys_and_values():
  """Section 3.3.3: independent keys and values per branch (against shortcut
  learning across them): the layer projects, rotates and caches three sets
  per K/V group; `shared_key_value=True` projects one."""
  x = jax.random.normal(jax.random.PRNGKey(9), (B, T, 16))
  for shared, sets in ((False, 3), (True, 1)):
    layer = aj.MultiHeadAttention(num_heads=H, num_kv_heads=HKV, attention="nsa",
                                  position="rope",
                                  attention_options=dict(SIZES, shared_key_value=shared))
    params = nn.meta.unbox(jit_init(layer, jax.random.PRNGKey(4), x, is_causal=True)["params"])
    assert params["key"]["kernel"].shape == (16, sets * HKV, 4)
    assert params["value"]["kernel"].shape == (16, sets * HKV, 4)


@pytest.mark.property("nsa")
def test_each_branch_reads_only_its_own_keys_and_values():
  """A branch alone (its gate 1, the others 0) does not move when another
  branch's keys and values change, except the selected branch, whose blocks
  the compressed branch's keys choose (eq. 8)."""
  query, _, _ = random_qkv(seed=10, batch=B, q_len=T, num_heads=H, num_kv_heads=HKV, head_dim=D)
  sets = [random_qkv(seed=20 + i, batch=B, q_len=T, num_heads=HKV, head_dim=D)[1:]
          for i in range(3)]  # each branch's (keys, values)
  noise = jax.random.normal(jax.random.PRNGKey(12), (B, T, HKV, D))
  run = jax.jit(functools.partial(nsa_attention, is_causal=True, implementation="xla", **SIZES))
  attend = lambda sets, arrays: run(query, stack_branches(*[k for k, _ in sets]),
                                    stack_branches(*[v for _, v in sets]), **arrays)
  for branch in range(3):
    arrays = dict(_arrays(11), gates=jnp.zeros((B, T, H, 3)).at[..., branch].set(1.0))
    base = attend(sets, arrays)
    for other in range(3):
      changed = [(k + noise, v + noise) if i == other else (k, v) for i, (k, v) in enumerate(sets)]
      moved = float(jnp.abs(attend(changed, arrays) - base).max())
      assert (moved > 1e-3) == (other == branch or (branch, other) == (1, 0)), (branch, other)
