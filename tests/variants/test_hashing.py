"""Content-based sparse attention (lsh, routing, sinkhorn, clustered).

Each variant is checked in the special case where it is exact against the dense
reference under a loop-built mask (outputs and gradients), and for the
property that makes it a good approximation otherwise.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_jax.core import reference_attention
from attention_jax.layers.attention import MultiHeadAttention
from attention_jax.variants import hashing
from attention_testing import (assert_close, assert_same_outputs_and_grads, jit_apply, jit_call,
                               jit_init, loop_mask, random_qkv)

RNG = jax.random.PRNGKey(3)


def _jit_module_output(module, x, **apply_kwargs):
  variables = jit_init(module, jax.random.PRNGKey(0), x)
  out = jax.jit(lambda v, x: module.apply(v, x, **apply_kwargs))(variables, x)
  assert out.shape == x.shape
  assert np.isfinite(np.asarray(out)).all()
  return variables, out


# ---------------------------------------------------------------------------
# lsh
# ---------------------------------------------------------------------------


def _shared_qk_oracle(query, value, allowed, scale=None):
  """Dense shared-QK attention: keys are the unit queries, self penalised by 1e5."""
  keys = query / jnp.linalg.norm(query, axis=-1, keepdims=True)
  length = query.shape[1]
  self_penalty = jnp.asarray(-1e5 * np.eye(length, dtype=np.float32))[None, None]
  # Query head h reads value head h // (H // Hkv).
  value = jnp.repeat(value, query.shape[2] // value.shape[2], axis=2)
  return reference_attention(query, keys, value, self_penalty, jnp.asarray(allowed), scale=scale)


@pytest.mark.property("lsh")
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("n_hashes", [1, 3])
def test_lsh_with_one_bucket_and_one_chunk_is_dense_shared_qk_attention(is_causal, n_hashes):
  batch, length = 2, 12
  query, key, value = random_qkv(batch=batch, q_len=length, num_heads=4, num_kv_heads=2)
  allowed = loop_mask(batch, length, length, is_causal=is_causal)
  ours = lambda q, v: hashing.lsh_attention(q, key, v, is_causal=is_causal, hash_rng=RNG,
                                            n_buckets=1, n_hashes=n_hashes, chunk_size=length)
  assert_same_outputs_and_grads(ours, lambda q, v: _shared_qk_oracle(q, v, allowed),
                                 query, value)


@pytest.mark.property("lsh")
def test_lsh_causal_first_token_attends_to_itself():
  query, key, value = random_qkv(batch=1, q_len=8, num_heads=2)
  out = jax.jit(lambda q, v: hashing.lsh_attention(
      q, key, v, is_causal=True, hash_rng=RNG, n_buckets=4, chunk_size=4))(query, value)
  # Nothing but itself is allowed, so it takes its own value despite the penalty.
  assert_close(out[:, 0], value[:, 0])


@pytest.mark.property("lsh")
def test_lsh_more_hash_rounds_reduce_the_error():
  batch, length = 2, 64
  query, key, value = random_qkv(seed=5, batch=batch, q_len=length, num_heads=2, head_dim=4)
  query = 3.0 * query  # Peaked attention, where hashing finds the keys that matter.
  exact = _shared_qk_oracle(query, value, loop_mask(batch, length, length))

  def mean_error(n_hashes):
    error = jax.jit(lambda rng: jnp.mean(jnp.abs(hashing.lsh_attention(
        query, key, value, hash_rng=rng, n_buckets=8, n_hashes=n_hashes, chunk_size=8) - exact)))
    return float(np.mean([error(jax.random.PRNGKey(seed)) for seed in range(3)]))

  errors = [mean_error(n) for n in (1, 2, 4, 8)]
  assert all(a > b for a, b in zip(errors, errors[1:])), errors
  assert errors[-1] < 0.5 * errors[0], errors


@pytest.mark.property("lsh")
def test_lsh_padding():
  batch, length = 2, 16
  lengths = np.array([11, 16])
  query, key, value = random_qkv(seed=1, batch=batch, q_len=length, num_heads=2)
  padded = ~loop_mask(batch, 1, length, kv_lengths=lengths)[:, 0, 0]  # [B, T]
  lsh = jax.jit(lambda q, v: hashing.lsh_attention(
      q, key, v, key_value_seq_lengths=jnp.array(lengths), hash_rng=RNG, n_buckets=4,
      n_hashes=2, chunk_size=4))
  out = lsh(query, value)
  # Whatever the padded tokens hold, the valid ones see the same chunks and keys.
  noise_q, _, noise_v = random_qkv(seed=9, batch=batch, q_len=length, num_heads=2)
  where_padded = jnp.asarray(padded)[:, :, None, None]
  other = lsh(jnp.where(where_padded, noise_q, query), jnp.where(where_padded, noise_v, value))
  assert_close(np.asarray(other)[~padded], np.asarray(out)[~padded])
  assert np.abs(np.asarray(out)[padded]).max() == 0.0
  # The same padding as a key mask, and padded queries by length.
  by_mask = jit_call(hashing.lsh_attention, query, key, value,
                     mask=jnp.asarray(~padded)[:, None, None, :],
                     query_seq_lengths=jnp.array(lengths), hash_rng=RNG, n_buckets=4, n_hashes=2,
                     chunk_size=4)
  assert_close(by_mask, out)
  # With one bucket and chunk the valid rows are dense attention over valid keys.
  allowed = loop_mask(batch, length, length, q_lengths=lengths, kv_lengths=lengths)
  ours = lambda q, v: hashing.lsh_attention(
      q, key, v, query_seq_lengths=jnp.array(lengths), key_value_seq_lengths=jnp.array(lengths),
      hash_rng=RNG, n_buckets=1, chunk_size=length)
  assert_same_outputs_and_grads(ours, lambda q, v: _shared_qk_oracle(q, v, allowed),
                                 query, value, rows=~padded)


@pytest.mark.parametrize("options, message", [
    (dict(chunk_size=0), "chunk_size must be an int >= 1"),
    (dict(n_buckets=3), "n_buckets must be 1 or even"),
    (dict(n_hashes=0), "n_hashes must be an int >= 1"),
    (dict(hash_rng=None), "needs hash_rng"),
    (dict(bias=jnp.zeros((1, 1, 16, 16))), "does not support bias"),
    (dict(is_causal=True, mask=jnp.ones((1, 1, 16, 16), bool)), "key-padding mask"),
    # mask_padding=False ignores the padding, not the rules a mask must follow:
    # a pairwise or an additive mask was dropped without a word.
    (dict(mask_padding=False, mask=jnp.ones((1, 1, 16, 16), bool)), "key-padding mask"),
    (dict(mask_padding=False, mask=jnp.zeros((1, 1, 1, 16))), "mask must be boolean"),
])
def test_lsh_rejects_bad_arguments(options, message):
  query, key, value = random_qkv(batch=1, q_len=16, num_heads=2)
  options = {"hash_rng": RNG, "chunk_size": 4, **options}
  with pytest.raises(ValueError, match=message):
    hashing.lsh_attention(query, key, value, **options)


def test_lsh_rejects_cross_attention():
  query, key, value = random_qkv(batch=1, q_len=8, kv_len=16, num_heads=2)
  with pytest.raises(ValueError, match="self-attention only"):
    hashing.lsh_attention(query, key, value, hash_rng=RNG, chunk_size=4)


def test_lsh_rotations_are_per_layer_redrawn_each_training_step_and_fixed_in_evaluation():
  x = jax.random.normal(jax.random.PRNGKey(1), (2, 32, 16))
  module = MultiHeadAttention(num_heads=2, attention="lsh",
                              attention_options={"chunk_size": 8, "n_hashes": 2})
  variables, fixed = _jit_module_output(module, x)
  assert "key" not in variables["params"]  # shared QK: no key projection
  _, again = _jit_module_output(module, x)
  assert_close(again, fixed)  # Evaluation: the kept rotations.

  def train_step(variables, step):
    rng = jax.random.fold_in(jax.random.PRNGKey(0), step)
    out, updates = jit_apply(module, variables, x, deterministic=False, rngs={"attention": rng},
                                mutable=["random"])
    return out, {**variables, **updates}

  kept = lambda v: np.asarray(jax.tree.leaves(v["random"])[0])
  out_1, after_1 = train_step(variables, 1)
  out_2, after_2 = train_step(after_1, 2)
  assert not np.array_equal(kept(after_1), kept(variables))  # redrawn at every step
  assert not np.array_equal(kept(after_2), kept(after_1))
  assert not np.allclose(out_1, out_2)
  # Evaluation after training uses the last draw, the same in every call.
  eval_1, eval_2 = (jit_apply(module, after_2, x) for _ in range(2))
  assert_close(eval_1, eval_2)
  # Another initialisation (another layer, seed) draws other rotations.
  other = jit_init(module, {"params": jax.random.PRNGKey(5)}, x)
  assert not np.array_equal(kept(other), kept(variables))


# ---------------------------------------------------------------------------
# routing
# ---------------------------------------------------------------------------


def _centroids(num_heads, num_clusters, head_dim, seed=0):
  return jax.random.normal(jax.random.PRNGKey(seed), (num_heads, num_clusters, head_dim))


@pytest.mark.property("routing")
@pytest.mark.parametrize("is_causal, q_len, kv_len", [(False, 10, 10), (True, 10, 10),
                                                      (False, 6, 10)])
def test_routing_with_one_cluster_is_dense_attention(is_causal, q_len, kv_len):
  batch = 2
  query, key, value = random_qkv(batch=batch, q_len=q_len, kv_len=kv_len, num_heads=4,
                                 num_kv_heads=2)
  centroids = _centroids(4, 1, 8)
  allowed = jnp.asarray(loop_mask(batch, q_len, kv_len, is_causal=is_causal))
  ours = lambda q, k, v: hashing.routing_attention(q, k, v, is_causal=is_causal,
                                                   centroids=centroids)
  oracle = lambda q, k, v: reference_attention(q, k, v, None, allowed)
  assert_same_outputs_and_grads(ours, oracle, query, key, value)


def _within_cluster_distance(centroids, points):
  """Mean squared distance of each unit point to its nearest centroid (numpy)."""
  points = np.asarray(points, np.float64)
  points = points / np.linalg.norm(points, axis=-1, keepdims=True)  # [B, N, H, D]
  centroids = np.asarray(centroids, np.float64)  # [H, C, D]
  distances = ((points[:, :, :, None, :] - centroids[None, None]) ** 2).sum(-1)  # [B, N, H, C]
  return distances.min(-1).mean()


@pytest.mark.property("routing")
def test_routing_kmeans_updates_move_centroids_towards_their_members():
  # Points scattered around four directions per head; the centroids start random.
  directions = np.random.default_rng(0).normal(size=(4, 2, 8))
  labels = np.random.default_rng(1).integers(0, 4, size=(2, 32))
  noise = np.random.default_rng(2).normal(scale=0.3, size=(2, 32, 2, 8))
  query = jnp.asarray(directions[labels] + noise, jnp.float32)  # [B, N, H, D]
  key = jnp.asarray(directions[labels[:, ::-1]] + noise[:, ::-1], jnp.float32)
  module = hashing.RoutingCentroids(num_clusters=4, decay=0.5)
  variables = jit_init(module, jax.random.PRNGKey(0), query, key, key)
  step = jax.jit(lambda variables: module.apply(variables, query, key, key, deterministic=False,
                                                mutable=["kmeans"])[1])
  points = jnp.concatenate([query, key], axis=1)
  distances = [_within_cluster_distance(variables["kmeans"]["centroids"], points)]
  for _ in range(4):
    variables = step(variables)
    distances.append(_within_cluster_distance(variables["kmeans"]["centroids"], points))
  assert all(a > b for a, b in zip(distances, distances[1:])), distances
  assert distances[-1] < 0.5 * distances[0], distances
  # Deterministic calls (evaluation) leave the centroids alone.
  _, frozen = jit_apply(module, variables, query, key, key, deterministic=True, mutable=["kmeans"])
  assert_close(frozen["kmeans"]["centroids"], variables["kmeans"]["centroids"])


@pytest.mark.property("routing")
def test_routing_padding():
  batch, length = 2, 16
  lengths = np.array([11, 16])
  query, key, value = random_qkv(seed=4, batch=batch, q_len=length, num_heads=2)
  padded = ~loop_mask(batch, 1, length, kv_lengths=lengths)[:, 0, 0]  # [B, T]
  routing = jax.jit(lambda q, k, v: hashing.routing_attention(
      q, k, v, query_seq_lengths=jnp.array(lengths), key_value_seq_lengths=jnp.array(lengths),
      centroids=_centroids(2, 4, 8)))
  out = routing(query, key, value)
  # Padded tokens are never routed: their content cannot change the valid rows.
  noise = random_qkv(seed=9, batch=batch, q_len=length, num_heads=2)
  where_padded = jnp.asarray(padded)[:, :, None, None]
  other = routing(*(jnp.where(where_padded, n, x) for n, x in zip(noise, (query, key, value))))
  assert_close(np.asarray(other)[~padded], np.asarray(out)[~padded])
  assert np.abs(np.asarray(out)[padded]).max() == 0.0
  # With one cluster the valid rows are dense attention over the valid keys.
  allowed = jnp.asarray(loop_mask(batch, length, length, q_lengths=lengths, kv_lengths=lengths))
  ours = lambda q, k, v: hashing.routing_attention(
      q, k, v, mask=jnp.asarray(~padded)[:, None, None, :], query_seq_lengths=jnp.array(lengths),
      centroids=_centroids(2, 1, 8))
  assert_same_outputs_and_grads(ours, lambda q, k, v: reference_attention(q, k, v, None, allowed),
                                 query, key, value)


@pytest.mark.parametrize("options, message", [
    (dict(centroids=_centroids(2, 17, 8)), "num_clusters=17 must be at most"),
    (dict(window_size=17), "window_size=17 must be at most the sequence length 16"),
    (dict(window_size=0), "window_size must be an int >= 1"),
    (dict(centroids=None), r"needs centroids of shape \[H, C, D\]"),
    (dict(centroids=_centroids(3, 4, 8)), r"needs centroids of shape \[H, C, D\]"),
    (dict(segment_ids=jnp.zeros((1, 16), int)), "does not support segment_ids"),
])
def test_routing_rejects_bad_arguments(options, message):
  query, key, value = random_qkv(batch=1, q_len=16, num_heads=2)
  options = {"centroids": _centroids(2, 4, 8), **options}
  with pytest.raises(ValueError, match=message):
    hashing.routing_attention(query, key, value, **options)


def test_routing_module_runs_under_jit_and_updates_centroids_in_training():
  x = jax.random.normal(jax.random.PRNGKey(1), (2, 32, 16))
  module = MultiHeadAttention(num_heads=2, attention="routing",
                              attention_options={"num_clusters": 4, "decay": 0.9})
  variables, _ = _jit_module_output(module, x, is_causal=True)
  assert variables["kmeans"]["variant"]["centroids"].shape == (2, 4, 8)
  train = jax.jit(lambda variables: module.apply(variables, x, deterministic=False,
                                                 mutable=["kmeans"]))
  out, updated = train(variables)
  assert out.shape == x.shape
  assert not np.allclose(updated["kmeans"]["variant"]["centroids"],
                         variables["kmeans"]["variant"]["centroids"])
  # No gradient reaches the centroids.
  loss = lambda variables: jnp.sum(jit_apply(module, variables, x) ** 2)
  grads = jax.jit(jax.grad(loss))(variables)
  assert np.abs(np.asarray(grads["kmeans"]["variant"]["centroids"])).max() == 0.0
  assert np.abs(np.asarray(nn.unbox(grads["params"])["query"]["kernel"])).max() > 0.0


# ---------------------------------------------------------------------------
# sinkhorn
# ---------------------------------------------------------------------------


@pytest.mark.property("sinkhorn")
def test_sinkhorn_normalisation_is_doubly_stochastic():
  logits = jax.random.normal(jax.random.PRNGKey(0), (2, 3, 6, 6))
  normalize = jax.jit(hashing.sinkhorn, static_argnums=1)
  permutation = np.asarray(normalize(logits, 50, 0.75))
  assert (permutation >= 0).all()
  assert_close(permutation.sum(-1), np.ones((2, 3, 6)), atol=1e-4)
  assert_close(permutation.sum(-2), np.ones((2, 3, 6)), atol=1e-5)
  # The rows converge as the iterations go on.
  row_error = lambda n: np.abs(np.asarray(normalize(logits, n, 0.75)).sum(-1) - 1.0).max()
  assert row_error(1) > row_error(4) > row_error(16) > 0.0


def _block_local_mask(batch, length, block_size, kv_lengths=None, q_lengths=None):
  allowed = loop_mask(batch, length, length, kv_lengths=kv_lengths, q_lengths=q_lengths)
  for i in range(length):
    for j in range(length):
      if i // block_size != j // block_size:
        allowed[:, :, i, j] = False
  return jnp.asarray(allowed)


@pytest.mark.property("sinkhorn")
@pytest.mark.parametrize("lengths", [None, np.array([9, 16])])
def test_sinkhorn_with_identity_sort_is_block_local_attention(lengths):
  batch, length, block_size = 2, 16, 4
  query, key, value = random_qkv(batch=batch, q_len=length, num_heads=4, num_kv_heads=2)
  identity = jnp.where(jnp.eye(length // block_size, dtype=bool), 0.0, -1e9)[None, None]
  padding = {} if lengths is None else dict(query_seq_lengths=jnp.array(lengths),
                                            key_value_seq_lengths=jnp.array(lengths))
  ours = lambda q, k, v: hashing.sinkhorn_attention(q, k, v, block_size=block_size,
                                                    sort_logits=identity, **padding)
  allowed = _block_local_mask(batch, length, block_size, lengths, lengths)
  oracle = lambda q, k, v: reference_attention(q, k, v, None, allowed)
  assert_same_outputs_and_grads(ours, oracle, query, key, value)


@pytest.mark.property("sinkhorn")
def test_causal_sinkhorn_with_a_hard_previous_block_sort_matches_its_dense_mask():
  """Block i sorted onto block i - 1: each query sees its own block up to itself
  and the whole previous block (the first block only its own)."""
  batch, length, block_size = 2, 16, 4
  num_blocks = length // block_size
  query, key, value = random_qkv(seed=2, batch=batch, q_len=length, num_heads=4,
                                 num_kv_heads=2)
  previous = jnp.where(jnp.eye(num_blocks, k=-1, dtype=bool), 0.0, -1e9)[None, None]
  ours = lambda q, k, v: hashing.sinkhorn_attention(q, k, v, block_size=block_size,
                                                    sort_logits=previous, is_causal=True)
  allowed = loop_mask(batch, length, length, is_causal=True)
  for i in range(length):
    for j in range(length):
      block_i, block_j = i // block_size, j // block_size
      allowed[:, :, i, j] &= block_j in (block_i, block_i - 1)
  oracle = lambda q, k, v: reference_attention(q, k, v, None, jnp.asarray(allowed))
  assert_same_outputs_and_grads(ours, oracle, query, key, value)


@pytest.mark.property("lsh")
@pytest.mark.property("routing")
@pytest.mark.parametrize("variant", ["lsh", "routing"])
def test_causal_lsh_and_routing_choose_their_groups_over_the_whole_sequence(variant):
  """What their docstrings state: the causal mask keeps j <= i inside a group,
  but the groups (sorted chunks, top-k cluster members) are chosen over the
  whole sequence, so changing only the tokens after position 30 changes
  earlier outputs (unlike causal sinkhorn, above, and the sparse patterns)."""
  length, cut = 48, 30
  query, key, value = random_qkv(seed=1, batch=1, q_len=length, num_heads=4, head_dim=8)
  later = random_qkv(seed=2, batch=1, q_len=length, num_heads=4, head_dim=8)
  replaced = [x.at[:, cut:].set(3.0 * y[:, cut:]) for x, y in zip((query, key, value), later)]
  centroids = hashing._normalize(jax.random.normal(jax.random.PRNGKey(5), (4, 7, 8)))
  attend = {
      "lsh": lambda q, k, v: hashing.lsh_attention(q, k, v, is_causal=True, hash_rng=RNG,
                                                   chunk_size=8, n_buckets=4),
      "routing": lambda q, k, v: hashing.routing_attention(q, k, v, is_causal=True,
                                                           centroids=centroids),
  }[variant]
  before, after = jit_call(attend, query, key, value), jit_call(attend, *replaced)
  assert np.abs(np.asarray(before - after)[:, :cut]).max() > 1e-3


@pytest.mark.property("sinkhorn")
def test_causal_sinkhorn_output_never_depends_on_later_tokens():
  length, block_size = 16, 4
  query, key, value = random_qkv(seed=5, batch=1, q_len=length, num_heads=2)
  attend = lambda q, k, v: hashing.sinkhorn_attention(
      q, k, v, block_size=block_size, is_causal=True, **_sort_kernels())
  jacobians = jax.jit(jax.jacobian(attend, argnums=(0, 1, 2)))(query, key, value)
  for name, jacobian in zip("qkv", jacobians):
    # [1, Tq, H, Dv, 1, T, H, D] -> dependence of output position t on input position s.
    dependence = np.abs(np.asarray(jacobian)).sum(axis=(0, 2, 3, 4, 6, 7))
    later = np.triu(np.ones((length, length), bool), k=1)
    assert dependence[later].max() == 0.0, f"an output depends on a later {name}"
    assert dependence[~later].max() > 0.0


def test_causal_sort_rows_cover_only_the_past():
  logits = jax.random.normal(jax.random.PRNGKey(0), (3, 5, 5))
  weights = np.asarray(hashing.causal_sort(logits, temperature=0.5))
  assert (weights[:, np.triu_indices(5)[0], np.triu_indices(5)[1]] == 0).all()
  np.testing.assert_allclose(weights.sum(-1)[:, 1:], 1.0, rtol=1e-6)
  np.testing.assert_array_equal(weights.sum(-1)[:, 0], 0.0)


def _sort_kernels(num_heads=2, head_dim=8, hidden=6):
  first, second = jax.random.split(jax.random.PRNGKey(7))
  return dict(sort_hidden_kernel=jax.random.normal(first, (num_heads, head_dim, hidden)),
              sort_output_kernel=jax.random.normal(second, (num_heads, hidden, head_dim)))


@pytest.mark.property("sinkhorn")
def test_sinkhorn_padding():
  batch, length = 2, 16
  lengths = np.array([10, 16])
  query, key, value = random_qkv(seed=4, batch=batch, q_len=length, num_heads=2)
  padded = ~loop_mask(batch, 1, length, kv_lengths=lengths)[:, 0, 0]  # [B, T]
  sinkhorn = jax.jit(lambda q, k, v: hashing.sinkhorn_attention(
      q, k, v, mask=jnp.asarray(~padded)[:, None, None, :], query_seq_lengths=jnp.array(lengths),
      block_size=4, **_sort_kernels()))
  out = sinkhorn(query, key, value)
  noise = random_qkv(seed=9, batch=batch, q_len=length, num_heads=2)
  where_padded = jnp.asarray(padded)[:, :, None, None]
  other = sinkhorn(*(jnp.where(where_padded, n, x) for n, x in zip(noise, (query, key, value))))
  assert_close(np.asarray(other)[~padded], np.asarray(out)[~padded])
  assert np.abs(np.asarray(out)[padded]).max() == 0.0
  # The learned sort does mix other blocks in: not block-local attention.
  local = reference_attention(query, key, value, None,
                              _block_local_mask(batch, length, 4, lengths, lengths))
  assert not np.allclose(np.asarray(out)[~padded], np.asarray(local)[~padded], atol=1e-3)


@pytest.mark.parametrize("options, message", [
    (dict(block_size=0), "block_size must be an int >= 1"),
    (dict(temperature=0.0), "temperature must be > 0"),
    (dict(sort_output_kernel=None), "needs sort_logits"),
    (dict(sort_logits=jnp.zeros((1, 1, 3, 3))), r"sort_logits must end in \[nb, nb\] = \[4, 4\]"),
])
def test_sinkhorn_rejects_bad_arguments(options, message):
  query, key, value = random_qkv(batch=1, q_len=16, num_heads=2)
  options = {"block_size": 4, **_sort_kernels(), **options}
  with pytest.raises(ValueError, match=message):
    hashing.sinkhorn_attention(query, key, value, **options)


def test_sinkhorn_rejects_cross_attention():
  query, key, value = random_qkv(batch=1, q_len=8, kv_len=16, num_heads=2)
  with pytest.raises(ValueError, match="self-attention only"):
    hashing.sinkhorn_attention(query, key, value, block_size=4, **_sort_kernels())


def test_sinkhorn_module_runs_under_jit_and_trains_its_sorting_network():
  x = jax.random.normal(jax.random.PRNGKey(1), (2, 32, 16))
  module = MultiHeadAttention(num_heads=2, attention="sinkhorn",
                              attention_options={"block_size": 8, "sort_hidden_dim": 4})
  variables, _ = _jit_module_output(module, x)
  sort_params = nn.unbox(variables["params"]["variant"])
  assert sort_params["sort_hidden_kernel"].shape == (2, 8, 4)
  loss = lambda variables: jnp.sum(jit_apply(module, variables, x) ** 2)
  grads = nn.unbox(jax.jit(jax.grad(loss))(variables)["params"]["variant"])
  assert np.abs(np.asarray(grads["sort_output_kernel"])).max() > 0.0


# ---------------------------------------------------------------------------
# clustered
# ---------------------------------------------------------------------------


@pytest.mark.property("clustered")
@pytest.mark.parametrize("q_len, kv_len", [(8, 8), (6, 11)])
def test_clustered_with_a_cluster_per_query_is_dense_attention(q_len, kv_len):
  batch = 2
  query, key, value = random_qkv(batch=batch, q_len=q_len, kv_len=kv_len, num_heads=4,
                                 num_kv_heads=2)
  allowed = jnp.asarray(loop_mask(batch, q_len, kv_len))
  ours = lambda q, k, v: hashing.clustered_attention(q, k, v, num_clusters=q_len)
  oracle = lambda q, k, v: reference_attention(q, k, v, None, allowed)
  assert_same_outputs_and_grads(ours, oracle, query, key, value)


@pytest.mark.property("clustered")
def test_clustered_error_falls_as_clusters_grow():
  batch, length = 2, 64
  query, key, value = random_qkv(seed=6, batch=batch, q_len=length, num_heads=2)
  exact = reference_attention(query, key, value)
  error = lambda c: float(jnp.mean(jnp.abs(jax.jit(
      lambda q, k, v: hashing.clustered_attention(q, k, v, num_clusters=c))(query, key, value)
                                           - exact)))
  errors = [error(c) for c in (2, 8, 32, 64)]
  assert all(a > b for a, b in zip(errors, errors[1:])), errors
  assert errors[-1] < 1e-5, errors


@pytest.mark.property("clustered")
def test_clustered_padding():
  batch, q_len, kv_len = 2, 12, 10
  q_lengths, kv_lengths = np.array([7, 12]), np.array([10, 6])
  query, key, value = random_qkv(seed=4, batch=batch, q_len=q_len, kv_len=kv_len, num_heads=2)
  clustered = jax.jit(lambda q, k, v: hashing.clustered_attention(
      q, k, v, query_seq_lengths=jnp.array(q_lengths),
      key_value_seq_lengths=jnp.array(kv_lengths), num_clusters=3))
  out = clustered(query, key, value)
  q_padded = ~loop_mask(batch, 1, q_len, kv_lengths=q_lengths)[:, 0, 0]  # [B, Tq]
  kv_padded = ~loop_mask(batch, 1, kv_len, kv_lengths=kv_lengths)[:, 0, 0]  # [B, Tk]
  noise = random_qkv(seed=9, batch=batch, q_len=q_len, kv_len=kv_len, num_heads=2)
  q_where = jnp.asarray(q_padded)[:, :, None, None]
  kv_where = jnp.asarray(kv_padded)[:, :, None, None]
  other = clustered(jnp.where(q_where, noise[0], query), jnp.where(kv_where, noise[1], key),
                    jnp.where(kv_where, noise[2], value))
  assert_close(np.asarray(other)[~q_padded], np.asarray(out)[~q_padded])
  assert np.abs(np.asarray(out)[q_padded]).max() == 0.0
  # With a cluster per query, the valid rows are dense attention over valid keys.
  allowed = jnp.asarray(loop_mask(batch, q_len, kv_len, kv_lengths=kv_lengths))
  full = jit_call(hashing.clustered_attention, query, key, value,
                  mask=jnp.asarray(~kv_padded)[:, None, None], num_clusters=q_len)
  assert_close(full, jit_call(reference_attention, query, key, value, None, allowed))


@pytest.mark.parametrize("options, message", [
    (dict(num_clusters=17), "num_clusters=17 must be at most the sequence length 16"),
    (dict(num_clusters=0), "num_clusters must be an int >= 1"),
    (dict(lloyd_iterations=-1), "lloyd_iterations must be an int >= 0"),
    (dict(bias=jnp.zeros((1, 1, 16, 16))), "does not support bias"),
])
def test_clustered_rejects_bad_arguments(options, message):
  query, key, value = random_qkv(batch=1, q_len=16, num_heads=2)
  with pytest.raises(ValueError, match=message):
    hashing.clustered_attention(query, key, value, **{"num_clusters": 4, **options})


def test_clustered_module_runs_under_jit():
  x = jax.random.normal(jax.random.PRNGKey(1), (2, 32, 16))
  module = MultiHeadAttention(num_heads=2, attention="clustered",
                              attention_options={"num_clusters": 4, "lloyd_iterations": 2})
  _jit_module_output(module, x)


@pytest.mark.property("routing")
@pytest.mark.parametrize("length, expected_clusters", [(64, 8), (256, 16), (1000, 32)])
def test_routing_default_cluster_count_is_the_square_root_of_the_length(length, expected_clusters):
  query = key = value = jnp.zeros((1, length, 2, 8))
  variables = jax.eval_shape(hashing.RoutingCentroids().init, jax.random.PRNGKey(0),
                             query, key, value)
  assert variables["kmeans"]["centroids"].shape == (2, expected_clusters, 8)


@pytest.mark.parametrize("variant", ["lsh", "sinkhorn"])
@pytest.mark.parametrize("causal", [False, True])
def test_a_length_that_is_no_block_multiple_is_padded_inside(variant, causal):
  """T = 13 with blocks of 4 (as T + 1 = 101 with [CLS]): the outputs at the 13
  positions equal the computation on the input padded to 16 with the added
  keys masked, whatever the padded positions hold; their weight is zero and
  the gradients are finite."""
  length, padded_length, batch = 13, 16, 2
  query, key, value = random_qkv(batch=batch, q_len=length, num_heads=2)
  lengths = jnp.array([13, 10])
  if variant == "lsh":
    fn = jax.jit(lambda q, k, v, **kw: hashing.lsh_attention(
        q, k, v, hash_rng=RNG, n_buckets=2, chunk_size=4, is_causal=causal, **kw))
  else:
    fn = jax.jit(lambda q, k, v, **kw: hashing.sinkhorn_attention(
        q, k, v, block_size=4, is_causal=causal, **_sort_kernels(), **kw))
  out = fn(query, key, value, key_value_seq_lengths=lengths, query_seq_lengths=lengths)
  assert out.shape == query.shape
  noise = random_qkv(seed=7, batch=batch, q_len=padded_length - length, num_heads=2)
  explicit = fn(*(jnp.concatenate([x, n], axis=1) for x, n in zip((query, key, value), noise)),
                key_value_seq_lengths=lengths, query_seq_lengths=lengths)
  assert_close(out, explicit[:, :length])
  grads = jax.grad(lambda q, v: jnp.sum(fn(q, key, v, key_value_seq_lengths=lengths) ** 2),
                   argnums=(0, 1))(query, value)
  assert all(np.isfinite(np.asarray(g)).all() for g in grads)


@pytest.mark.parametrize("variant", ["lsh", "sinkhorn"])
def test_the_layer_runs_a_length_that_is_no_block_multiple(variant):
  # 13 tokens, blocks of 4, as [CLS] + 100 tokens in the smoke ListOps model.
  x = jax.random.normal(jax.random.PRNGKey(1), (2, 13, 16))
  options = {"chunk_size": 4} if variant == "lsh" else {"block_size": 4}
  module = MultiHeadAttention(num_heads=2, attention=variant, attention_options=options)
  _jit_module_output(module, x)
  variables = jit_init(module, jax.random.PRNGKey(0), x)
  grads = jax.grad(lambda p: jnp.sum(jit_apply(module, {**variables, "params": p}, x) ** 2))(
      variables["params"])
  assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))


@pytest.mark.parametrize("variant", ["lsh", "sinkhorn"])
def test_a_classifier_pooling_by_cls_trains_with_finite_gradients(variant):
  # [CLS] + 12 tokens with padding: the added rows are zeros, whose
  # normalisation once gave NaN gradients.
  from attention_jax.models import build_model  # pylint: disable=g-import-not-at-top
  options = {"chunk_size": 4} if variant == "lsh" else {"block_size": 4}
  model = build_model(dict(attention=variant, attention_options=options, vocab_size=20,
                           num_classes=3, max_length=12, embed_dim=16, num_heads=2, mlp_dim=16,
                           pooling="cls", num_layers=2))
  tokens = jnp.asarray(np.random.default_rng(0).integers(1, 20, (3, 12)), jnp.int32)
  tokens = tokens.at[1, 5:].set(0).at[2, 2:].set(0)
  variables = jit_init(model, {"params": jax.random.PRNGKey(0)}, tokens)
  grads = jax.jit(jax.grad(
      lambda p: jnp.sum(jit_apply(model, {**variables, "params": p}, tokens) ** 2)))(
          variables["params"])
  assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))
