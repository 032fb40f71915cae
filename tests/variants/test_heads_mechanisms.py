"""Mechanisms across heads (section B): talking heads against dot-product
attention and numpy, fixed head size's projections, multi-scale heads against
local attention per head."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attention_jax
from attention_jax.variants import heads
from attention_testing import (assert_close, assert_same_outputs_and_grads, jit_apply, jit_call,
                                jit_init,
                               perturbed, random_qkv)


def _np(x):
  return np.asarray(x, np.float64)


# ----------------------------------------------------------------------------
# talking_heads


def _np_talking_heads(query, key, value, logits_mixing, weights_mixing, allowed):
  """Shazeer et al.'s equations in numpy: mix logits over heads, softmax over
  the allowed keys, mix weights over heads, weights @ values."""
  query, key, value = _np(query), _np(key), _np(value)
  logits = np.einsum("bqhd,bkhd->bhqk", query, key) / np.sqrt(query.shape[-1])
  logits = np.einsum("hg,bgqk->bhqk", _np(logits_mixing), logits)
  logits = np.where(allowed, logits, -np.inf)
  weights = np.exp(logits - logits.max(-1, keepdims=True))
  weights = weights / weights.sum(-1, keepdims=True)
  weights = np.einsum("hg,bgqk->bhqk", _np(weights_mixing), weights)
  return np.einsum("bhqk,bkhv->bqhv", weights, value)


def _mixing(seed, num_heads):
  keys = jax.random.split(jax.random.PRNGKey(seed))
  return tuple(jnp.eye(num_heads) + 0.5 * jax.random.normal(k, (num_heads, num_heads))
               for k in keys)


@pytest.mark.parity("talking_heads")
@pytest.mark.parametrize("masks", [{}, dict(is_causal=True),
                                   dict(key_value_seq_lengths=jnp.array([3, 7]))])
def test_talking_heads_with_identity_mixing_is_dot_product_attention(masks):
  query, key, value = random_qkv(seed=3, q_len=7, num_heads=4, num_kv_heads=2)
  identity = jnp.eye(4)
  ours = lambda q, k, v: heads.talking_heads_attention(
      q, k, v, logits_mixing=identity, weights_mixing=identity, **masks)
  theirs = lambda q, k, v: attention_jax.dot_product_attention(q, k, v, **masks)
  assert_same_outputs_and_grads(ours, theirs, query, key, value)


@pytest.mark.property("talking_heads")
def test_talking_heads_mixes_logits_and_weights_as_the_paper_writes_them():
  batch, length, num_heads = 2, 6, 3
  query, key, value = random_qkv(seed=4, batch=batch, q_len=length, num_heads=num_heads)
  logits_mixing, weights_mixing = _mixing(5, num_heads)
  lengths = np.array([6, 4])
  out = jit_call(heads.talking_heads_attention, query, key, value, logits_mixing=logits_mixing,
                 weights_mixing=weights_mixing, is_causal=True,
                 key_value_seq_lengths=jnp.array(lengths))
  causal = np.tril(np.ones((length, length), bool))
  allowed = causal[None, None] & (np.arange(length) < lengths[:, None])[:, None, None, :]
  want = _np_talking_heads(query, key, value, logits_mixing, weights_mixing, allowed)
  assert_close(out, want, rtol=1e-4, atol=1e-5)


@pytest.mark.property("talking_heads")
def test_talking_heads_padded_keys_contribute_nothing():
  """Changing the values (and keys) of padded keys changes no output: a key
  masked in every head has weight 0 in every head, before and after the mix."""
  query, key, value = random_qkv(seed=6, batch=2, q_len=5, kv_len=8, num_heads=4)
  logits_mixing, weights_mixing = _mixing(7, 4)
  lengths = jnp.array([5, 3])
  padded = (jnp.arange(8)[None, :] >= lengths[:, None])[:, :, None, None]
  attend = jax.jit(lambda k, v: heads.talking_heads_attention(
      query, k, v, logits_mixing=logits_mixing, weights_mixing=weights_mixing,
      key_value_seq_lengths=lengths))
  changed = attend(jnp.where(padded, 100.0, key), jnp.where(padded, -50.0, value))
  assert_close(changed, attend(key, value))
  # The same padding as a key mask [B, 1, 1, Tk].
  mask = ~padded[:, :, 0, 0][:, None, None, :]
  by_mask = jit_call(heads.talking_heads_attention, query, key, value, mask=mask,
                     logits_mixing=logits_mixing, weights_mixing=weights_mixing)
  assert_close(by_mask, attend(key, value))


@pytest.mark.property("talking_heads")
def test_talking_heads_masks_the_mixed_weights_of_a_per_head_mask():
  """A key masked in one head only gets no weight there after the mix either."""
  num_heads, length = 2, 4
  query, key, value = random_qkv(seed=8, batch=1, q_len=length, num_heads=num_heads)
  mask = jnp.ones((1, num_heads, length, length), bool).at[0, 0, :, 0].set(False)
  one_hot = jnp.broadcast_to(jnp.eye(length)[None, :, None, :], (1, length, num_heads, length))
  weights = heads.talking_heads_attention(query, key, one_hot, mask=mask,
                                          logits_mixing=jnp.ones((2, 2)),
                                          weights_mixing=jnp.ones((2, 2)))
  # weights[b, q, h, j]: the weight head h gives key j.
  assert np.all(np.asarray(weights)[0, :, 0, 0] == 0.0)
  assert np.all(np.asarray(weights)[0, :, 1, 0] > 0.0)


def _np_paper_talking_heads(Q, K, V, P_l, P_w, allowed):
  """Shazeer et al. 2020's TalkingHeadsAttention (section 4's pseudocode,
  batched as in their appendix), in their layout and orientation:

    Q [B, n, d_k, h_k], K [B, m, d_k, h_k], V [B, m, d_v, h_v],
    P_l [h_k, h], P_w [h, h_v], allowed [B, n, m] (key padding);
    returns O [B, n, d_v, h_v]. No 1/sqrt(d_k): the paper folds it into P_q.
  """
  J = np.einsum("BNdk,BMdk->BNMk", Q, K)
  L = np.einsum("BNMk,kh->BNMh", J, P_l)
  L = np.where(allowed[..., None], L, -np.inf)
  W = np.exp(L - L.max(2, keepdims=True))
  W = W / W.sum(2, keepdims=True)  # softmax over the keys M
  U = np.einsum("BNMh,hv->BNMv", W, P_w)
  return np.einsum("BNMv,BMdv->BNdv", U, V)


def _numeric_gradients(loss, arrays, eps=1e-6):
  """Central differences of the float64 scalar `loss(*arrays)`, every entry."""
  grads = []
  for index, array in enumerate(arrays):
    grad = np.zeros_like(array)
    for position in np.ndindex(array.shape):
      shifted = [a.copy() for a in arrays]
      shifted[index][position] += eps
      up = loss(*shifted)
      shifted[index][position] -= 2 * eps
      grad[position] = (up - loss(*shifted)) / (2 * eps)
    grads.append(grad)
  return grads


@pytest.mark.property("talking_heads")
@pytest.mark.parametrize("key_heads, softmax_heads, value_heads", [(2, 3, 4), (4, 2, 3)])
def test_talking_heads_with_different_head_counts_is_the_papers_attention(
    key_heads, softmax_heads, value_heads):
  """h_k query/key heads, h softmax heads, h_v value heads. Ours mixes with
  P_l `[h, h_k]` and P_w `[h_v, h]`: the transposes of the paper's
  P_l `[h_k, h]` and P_w `[h, h_v]`. Output and gradients."""
  batch, q_len, kv_len, key_dim, value_dim = 2, 4, 5, 3, 2
  rng = np.random.default_rng(key_heads)
  Q = rng.normal(size=(batch, q_len, key_dim, key_heads))
  K = rng.normal(size=(batch, kv_len, key_dim, key_heads))
  V = rng.normal(size=(batch, kv_len, value_dim, value_heads))
  P_l = rng.normal(size=(key_heads, softmax_heads))
  P_w = rng.normal(size=(softmax_heads, value_heads))
  lengths = np.array([5, 3])
  allowed = np.broadcast_to((np.arange(kv_len) < lengths[:, None])[:, None, :],
                            (batch, q_len, kv_len))
  cotangent = rng.normal(size=(batch, q_len, value_dim, value_heads))

  def paper_loss(Q, K, V, P_l, P_w):
    return np.sum(_np_paper_talking_heads(Q, K, V, P_l, P_w, allowed) * cotangent)

  @jax.jit
  def ours(query, key, value, logits_mixing, weights_mixing):
    return heads.talking_heads_attention(
        query, key, value, logits_mixing=logits_mixing, weights_mixing=weights_mixing,
        scale=1.0, key_value_seq_lengths=jnp.asarray(lengths))

  heads_first = lambda x: jnp.asarray(np.swapaxes(x, 2, 3), jnp.float32)  # [B, T, H, D]
  arguments = (heads_first(Q), heads_first(K), heads_first(V), jnp.asarray(P_l.T, jnp.float32),
               jnp.asarray(P_w.T, jnp.float32))
  out = ours(*arguments)
  assert out.shape == (batch, q_len, value_heads, value_dim)
  want = _np_paper_talking_heads(Q, K, V, P_l, P_w, allowed)
  assert_close(out, np.swapaxes(want, 2, 3), rtol=1e-4, atol=1e-5)

  ours_loss = lambda *a: jnp.sum(ours(*a) * np.swapaxes(cotangent, 2, 3))
  got = jax.grad(ours_loss, argnums=tuple(range(5)))(*arguments)
  wanted = _numeric_gradients(paper_loss, [Q, K, V, P_l, P_w])
  layouts = [lambda g: np.swapaxes(g, 2, 3)] * 3 + [lambda g: g.T] * 2
  for name, grad, expected, layout in zip(
      ["query", "key", "value", "logits_mixing", "weights_mixing"], got, wanted, layouts):
    assert_close(grad, layout(expected), rtol=1e-4, atol=1e-5, err_msg=f"gradient of {name}")


def _square_talking_heads_before(query, key, value, logits_mixing, weights_mixing, **masks):
  """The square-only implementation this library had: `scored_attention`
  with the mixing in its weighting."""
  from attention_jax.core.softmax import masked_softmax  # pylint: disable=import-outside-toplevel
  from attention_jax.variants import scoring  # pylint: disable=import-outside-toplevel
  scale = query.shape[-1] ** -0.5
  mix = lambda p, x: jnp.einsum("hg,bgqk->bhqk", p.astype(jnp.float32), x)

  def weighting(scores, allowed):
    weights = mix(weights_mixing, masked_softmax(mix(logits_mixing, scores), allowed))
    return weights if allowed is None else jnp.where(allowed, weights, 0.0)

  return scoring.scored_attention(query, key, value,
                                  lambda q, k: scoring.dot_score(q, k) * jnp.float32(scale),
                                  weighting=weighting, **masks)


@pytest.mark.property("talking_heads")
@pytest.mark.parametrize("masks", [dict(is_causal=True),
                                   dict(key_value_seq_lengths=jnp.array([3, 7]),
                                        bias=jnp.ones((1, 4, 7, 7)) * jnp.arange(7.0))])
def test_talking_heads_square_mixing_is_unchanged(masks):
  """h_k = h = h_v: the same outputs and gradients as the square-only
  implementation, grouped K/V heads included."""
  query, key, value = random_qkv(seed=9, q_len=7, num_heads=4, num_kv_heads=2)
  logits_mixing, weights_mixing = _mixing(10, 4)
  ours = lambda q, k, v: heads.talking_heads_attention(
      q, k, v, logits_mixing=logits_mixing, weights_mixing=weights_mixing, **masks)
  before = lambda q, k, v: _square_talking_heads_before(q, k, v, logits_mixing, weights_mixing,
                                                        **masks)
  assert_same_outputs_and_grads(ours, before, query, key, value, rtol=1e-6, atol=1e-6)


@pytest.mark.property("talking_heads")
@pytest.mark.parametrize("arguments, message", [
    (dict(logits_mixing=jnp.eye(3)),
     r"logits_mixing must be P_l \[h, h_k\] = \[\*, 4\] .*got \[3, 3\]"),
    (dict(logits_mixing=jnp.ones((4,))),
     r"logits_mixing must be P_l \[h, h_k\] = \[\*, 4\] .*got \[4\]"),
    (dict(logits_mixing=jnp.ones((5, 4)), weights_mixing=jnp.eye(4)),
     r"weights_mixing must be P_w \[h_v, h\] = \[\*, 5\] .*got \[4, 4\]"),
    (dict(weights_mixing=jnp.ones((6, 4)), value_heads=4),
     r"value must have a number of heads dividing h_v = 6 .*got 4 heads"),
    (dict(weights_mixing=jnp.ones((6, 4)), value_heads=2, mask=jnp.ones((1, 4, 7, 7), bool)),
     r"mask has a head axis of 4, .*needs h_k = h = h_v, got h_k = 4, h = 4, h_v = 6"),
])
def test_talking_heads_refuses_bad_head_counts(arguments, message):
  arguments = dict(arguments)
  query, key, value = random_qkv(num_heads=4, num_kv_heads=arguments.pop("value_heads", 4))
  arguments = {"logits_mixing": jnp.eye(4), "weights_mixing": jnp.eye(4), **arguments}
  with pytest.raises(ValueError, match=message):
    heads.talking_heads_attention(query, key, value, **arguments)


@pytest.mark.property("talking_heads")
def test_talking_heads_layer_takes_the_head_counts_as_options():
  """softmax_heads (h) and value_heads (h_v) size P_l, P_w and the output
  projection; the layer's 2 value heads are repeated to h_v = 6."""
  x = jax.random.normal(jax.random.PRNGKey(0), (2, 6, 16))
  layer = attention_jax.MultiHeadAttention(
      num_heads=4, num_kv_heads=2, attention="talking_heads",
      attention_options=dict(softmax_heads=5, value_heads=6))
  params = nn.meta.unbox(jit_init(layer, jax.random.PRNGKey(1), x)["params"])
  assert params["variant"]["logits_mixing"].shape == (5, 4)
  assert params["variant"]["weights_mixing"].shape == (6, 5)
  assert params["out"]["kernel"].shape == (6, 4, 16)
  params = perturbed(params)
  out = jax.jit(layer.apply)({"params": params}, x)
  assert out.shape == x.shape
  # The layer is its projections around the pure function.

  @jax.jit
  def written_out(params):
    """talking_heads_attention of the layer's projections, then its output projection."""
    project = lambda name, y: jnp.einsum("bte,ehd->bthd", y, params[name]["kernel"]) + \
        params[name]["bias"]
    attended = heads.talking_heads_attention(
        project("query", x), project("key", x), project("value", x),
        logits_mixing=params["variant"]["logits_mixing"],
        weights_mixing=params["variant"]["weights_mixing"])
    return jnp.einsum("bthd,hde->bte", attended, params["out"]["kernel"]) + params["out"]["bias"]

  want = written_out(params)
  assert_close(out, want, rtol=1e-5, atol=1e-5)
  options = {o.name: o for o in attention_jax.variant_options("talking_heads")}
  assert options["softmax_heads"].default is None and options["value_heads"].default is None


@pytest.mark.property("talking_heads")
@pytest.mark.parametrize("options, message", [
    (dict(softmax_heads=0), r"softmax_heads must be an int >= 1, got 0"),
    (dict(value_heads=5),
     r"value_heads must be a multiple of the layer's 2 value heads \(num_kv_heads\).* got 5"),
])
def test_talking_heads_layer_refuses_bad_head_counts(options, message):
  x = jnp.zeros((1, 3, 16))
  layer = attention_jax.MultiHeadAttention(num_heads=4, num_kv_heads=2,
                                           attention="talking_heads", attention_options=options)
  with pytest.raises(ValueError, match=message):
    jit_init(layer, jax.random.PRNGKey(0), x)


@pytest.mark.property("talking_heads")
def test_talking_heads_layer_starts_as_multi_head_attention():
  x = jax.random.normal(jax.random.PRNGKey(0), (2, 6, 16))
  talking = attention_jax.MultiHeadAttention(num_heads=4, attention="talking_heads")
  variables = jit_init(talking, jax.random.PRNGKey(1), x)
  mixing = variables["params"]["variant"]
  assert_close(mixing["logits_mixing"], np.eye(4))
  assert_close(mixing["weights_mixing"], np.eye(4))
  plain = attention_jax.MultiHeadAttention(num_heads=4)
  params = {k: v for k, v in variables["params"].items() if k != "variant"}
  assert_close(jit_apply(talking, variables, x, is_causal=True),
               jit_apply(plain, {"params": params}, x, is_causal=True))


# ----------------------------------------------------------------------------
# fixed_head_size


def _block_params(attention, **options):
  from attention_jax.models import Block, ModelConfig  # pylint: disable=import-outside-toplevel
  config = ModelConfig(attention=attention, attention_options=options, num_layers=1,
                       embed_dim=32, num_heads=8, mlp_dim=64, max_length=16, dropout_rate=0.0)
  block = Block(config)
  x = jax.random.normal(jax.random.PRNGKey(2), (2, 16, 32))
  variables = nn.unbox(jit_init(block, jax.random.PRNGKey(0), x, {}))
  return block, variables, x


def _count(tree):
  return sum(np.size(leaf) for leaf in jax.tree.leaves(tree))


@pytest.mark.parity("fixed_head_size")
def test_fixed_head_size_shapes_and_parameter_count_follow_head_dim_not_width_over_heads():
  _, variables, _ = _block_params("fixed_head_size", head_dim=16)
  attention = variables["params"]["attention"]
  for name in ("query", "key", "value"):
    assert attention[name]["kernel"].shape == (32, 8, 16)
    assert attention[name]["bias"].shape == (8, 16)
  assert attention["out"]["kernel"].shape == (8, 16, 32)
  # Three [E, H, D] kernels and [H, D] biases, the [H, D, E] output and its bias.
  assert _count(attention) == 3 * (32 * 8 * 16 + 8 * 16) + 8 * 16 * 32 + 32
  # Multi-head attention of the same width and heads has heads of 32 / 8 = 4.
  _, plain, _ = _block_params("multi_head")
  assert plain["params"]["attention"]["query"]["kernel"].shape == (32, 8, 4)
  # The default head size (64) holds whatever the width and heads.
  _, default, _ = _block_params("fixed_head_size")
  assert default["params"]["attention"]["query"]["kernel"].shape == (32, 8, 64)


@pytest.mark.parity("fixed_head_size")
def test_fixed_head_size_is_dot_product_attention_through_its_own_projections():
  block, variables, x = _block_params("fixed_head_size", head_dim=16)
  mixer = attention_jax.registry.get_variant("fixed_head_size").module(num_heads=8, head_dim=16)
  params = perturbed(variables["params"]["attention"])  # biases not zero
  out = jit_apply(mixer, {"params": params}, x, is_causal=True)
  project = lambda name: (np.einsum("bte,ehd->bthd", _np(x), _np(params[name]["kernel"]))
                          + _np(params[name]["bias"]))
  query, key, value = project("query"), project("key"), project("value")
  logits = np.einsum("bqhd,bkhd->bhqk", query, key) / np.sqrt(16)
  logits = np.where(np.tril(np.ones((16, 16), bool)), logits, -np.inf)
  weights = np.exp(logits - logits.max(-1, keepdims=True))
  weights /= weights.sum(-1, keepdims=True)
  heads_out = np.einsum("bhqk,bkhd->bqhd", weights, value)
  want = np.einsum("bqhd,hde->bqe", heads_out, _np(params["out"]["kernel"]))
  assert_close(out, want + _np(params["out"]["bias"]), rtol=1e-4, atol=1e-5)
  # And it runs as a block's mixer by name.
  y, _ = jit_apply(block, variables, x, {})
  assert y.shape == x.shape


@pytest.mark.parity("fixed_head_size")
def test_fixed_head_size_refuses_a_bad_head_dim():
  with pytest.raises(ValueError, match="head_dim must be an int >= 1, got 0"):
    _block_params("fixed_head_size", head_dim=0)


def test_a_module_option_must_be_declared():
  from attention_jax import registry  # pylint: disable=import-outside-toplevel
  spec = registry.get_variant("fixed_head_size")
  with pytest.raises(ValueError, match="routes option 'head_size' to its module"):
    registry.register(registry.VariantSpec(
        name="fixed_head_size_typo", fn=spec.fn, family="heads", complexity="O(T^2)",
        subquadratic=False, exact=True, causal=True, cross=True, paper="-", qkv=False,
        mixer=registry.ATTENTION_MIXER, module_options=("head_size",), options={}))


# ----------------------------------------------------------------------------
# multi_scale


def _local_per_head(windows_per_head, query, key, value, **masks):
  """Each head through `local` with its own window, one head at a time."""
  group = query.shape[2] // key.shape[2]
  return jnp.concatenate([
      attention_jax.registry.get_variant("local").fn(
          query[:, :, h:h + 1], key[:, :, h // group:h // group + 1],
          value[:, :, h // group:h // group + 1], window_size=window, **masks)
      for h, window in enumerate(windows_per_head)], axis=2)


MULTI_SCALE_MASKS = {
    "plain": {},
    "causal": dict(is_causal=True),
    "padded": dict(key_value_seq_lengths=jnp.array([11, 6]),
                   query_seq_lengths=jnp.array([11, 6])),
    "causal_padded": dict(is_causal=True, mask=(jnp.arange(11) < jnp.array([[9], [4]]))[
        :, None, None, :]),
}


@pytest.mark.parity("multi_scale")
@pytest.mark.parametrize("case", sorted(MULTI_SCALE_MASKS))
@pytest.mark.parametrize("windows, per_head", [((1, 4, 2, 4), (1, 4, 2, 4)),
                                               ((2, 5), (2, 2, 5, 5))])
def test_multi_scale_heads_are_local_attention_with_their_own_windows(case, windows, per_head):
  masks = MULTI_SCALE_MASKS[case]
  query, key, value = random_qkv(seed=9, batch=2, q_len=11, num_heads=4, num_kv_heads=2)
  ours = lambda q, k, v: heads.multi_scale_attention(q, k, v, windows=windows, **masks)
  theirs = lambda q, k, v: _local_per_head(per_head, q, k, v, **masks)
  assert_same_outputs_and_grads(ours, theirs, query, key, value)


@pytest.mark.parity("multi_scale")
def test_multi_scale_window_of_the_whole_sequence_is_full_attention():
  """A head whose window spans the sequence is (causal) dot-product attention,
  whatever the other heads' windows; fewer windows than heads are spread over
  contiguous groups."""
  query, key, value = random_qkv(seed=10, batch=1, q_len=6, num_heads=2)
  out = jit_call(heads.multi_scale_attention, query, key, value, windows=(6, 1), is_causal=True)
  full = jit_call(attention_jax.dot_product_attention, query[:, :, :1], key[:, :, :1],
                  value[:, :, :1], is_causal=True)
  assert_close(out[:, :, :1], full)
  assert heads.head_windows((1, 2, 3), 4, 16) == (1, 1, 2, 3)


@pytest.mark.parity("multi_scale")
@pytest.mark.parametrize("windows, message", [
    ((0, 2), r"windows\[0\] must be an int >= 1, got 0"),
    ((2, 7), r"windows\[1\]=7 must be at most the sequence length 6"),
    ((1, 2, 3), r"windows must be a tuple of 1 to num_heads \(2\) window sizes, got \(1, 2, 3\)"),
    ((), r"windows must be a tuple of 1 to num_heads \(2\) window sizes, got \(\)"),
])
def test_multi_scale_refuses_bad_windows(windows, message):
  query, key, value = random_qkv(batch=1, q_len=6, num_heads=2)
  with pytest.raises(ValueError, match=message):
    heads.multi_scale_attention(query, key, value, windows=windows)
