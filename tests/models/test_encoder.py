"""Encoder, SequenceClassifier and build_model: shapes, masking, causality, configs, training."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from attention_jax import positional
from attention_jax.models import (Encoder, ModelConfig, SequenceClassifier, build_model,
                                  default_model_config)
from attention_jax.models.classifier import masked_max, masked_mean
from attention_testing import assert_close, jit_apply, jit_call, jit_init

B, T, V, E = 2, 8, 20, 16
# dropout_rate=0.0: the old Encoder's default (ModelConfig's is 0.1).
SMALL = dict(vocab_size=V, num_layers=2, embed_dim=E, num_heads=4, mlp_dim=32, max_length=12,
             dropout_rate=0.0)


def _small(**overrides):
  """The checked ModelConfig of SMALL with `overrides`."""
  return ModelConfig.from_config({**SMALL, **overrides})


def _encoder(**overrides):
  return Encoder(_small(**overrides))


def _encoder_with(position):
  """An encoder with `position`; NoPE only in a causal model (a language model's stack)."""
  return _encoder(position=position, **({"kind": "language_model"} if position == "none" else {}))


def _tokens(seed=0, length=T):
  return jax.random.randint(jax.random.PRNGKey(seed), (B, length), 2, V)


def _init(module, *args, **kwargs):
  return nn.meta.unbox(jit_init(module, jax.random.PRNGKey(1), *args, **kwargs))


def _init_perturbed(module, *args, seed=7):
  """Random parameters: the zero-initialised head would make every logit 0."""
  variables = _init(module, *args)
  leaves, tree = jax.tree.flatten(variables)
  rng = np.random.default_rng(seed)  # NumPy: no compilation per parameter shape.
  return jax.tree.unflatten(
      tree, [leaf + 0.3 * rng.standard_normal(leaf.shape, np.float32) for leaf in leaves])


def _init_shapes(module, *args):
  return nn.meta.unbox(jax.eval_shape(module.init, jax.random.PRNGKey(1), *args))


def _suffix_padding(lengths, length=T):
  return jnp.arange(length)[None] < jnp.asarray(lengths)[:, None]


# ---------------------------------------------------------------------------
# Encoder.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("position", positional.POSITION_ENCODINGS)
def test_encoder_traces_under_jit_for_every_position_encoding(position):
  # Tracing is where jit fails (Python control flow on traced values); skipping
  # XLA's compilation keeps the sweep fast. Values are checked by the tests below.
  tokens = _tokens()
  encoder = _encoder_with(position)
  variables = _init_shapes(encoder, tokens)
  apply = jax.jit(lambda v, t, m: encoder.apply(v, t, padding_mask=m, is_causal=True))
  out = jax.eval_shape(apply, variables, tokens, _suffix_padding([T, 5]))
  assert (out.shape, out.dtype) == ((B, T, E), jnp.float32)


def test_jitted_encoder_equals_eager_encoder():
  tokens, padding_mask = _tokens(), _suffix_padding([T, 5])
  encoder = _encoder(position="t5")
  variables = _init(encoder, tokens)
  apply = lambda v, t, m: jit_apply(encoder, v, t, padding_mask=m)
  assert_close(jax.jit(apply)(variables, tokens, padding_mask),
               apply(variables, tokens, padding_mask), atol=1e-5)


@pytest.mark.parametrize("position", ["sinusoidal", "learned", "rope", "alibi"])
def test_padded_outputs_equal_outputs_of_the_truncated_sequence(position):
  tokens = _tokens()
  encoder = _encoder(position=position)
  variables = _init(encoder, tokens)
  padded = jit_apply(encoder, variables, tokens, padding_mask=_suffix_padding([T, 5]))
  truncated = jit_apply(encoder, variables, tokens[1:, :5])
  full = jit_apply(encoder, variables, tokens[:1])
  assert_close(padded[1, :5], truncated[0], atol=1e-5)
  assert_close(padded[0], full[0], atol=1e-5)


def test_padding_anywhere_hides_the_padded_tokens():
  tokens = _tokens()
  padding_mask = jnp.ones((B, T), bool).at[:, 2].set(False).at[1, 6].set(False)
  other_ids = jnp.where(padding_mask, tokens, _tokens(seed=5))
  assert not np.array_equal(other_ids, tokens)
  encoder = _encoder(position="rope")
  variables = _init(encoder, tokens)
  out = jit_apply(encoder, variables, tokens, padding_mask=padding_mask)
  out_other = jit_apply(encoder, variables, other_ids, padding_mask=padding_mask)
  valid = np.asarray(padding_mask)
  assert_close(np.asarray(out)[valid], np.asarray(out_other)[valid], atol=1e-5)
  # Without the mask the padded ids matter: the test can fail.
  assert not np.allclose(jit_apply(encoder, variables, tokens),
                         jit_apply(encoder, variables, other_ids), atol=1e-3)


@pytest.mark.parametrize("position", ["learned", "alibi"])
def test_causal_encoder_output_at_t_ignores_later_tokens(position):
  tokens = _tokens()
  changed = tokens.at[:, 4:].set(_tokens(seed=3)[:, 4:])
  encoder = _encoder(position=position)
  variables = _init(encoder, tokens)
  out = jit_apply(encoder, variables, tokens, is_causal=True)
  out_changed = jit_apply(encoder, variables, changed, is_causal=True)
  assert_close(out[:, :4], out_changed[:, :4], atol=1e-5)
  assert not np.allclose(out[:, 4:], out_changed[:, 4:], atol=1e-3)


@pytest.mark.parametrize("position", positional.POSITION_ENCODINGS)
def test_sequence_longer_than_max_length_raises_naming_both(position):
  encoder = _encoder_with(position)
  with pytest.raises(ValueError, match=r"13.*max_length=12"):
    jit_init(encoder, jax.random.PRNGKey(0), _tokens(length=13))


def test_bad_inputs_raise():
  encoder = _encoder()
  init = lambda *a, **k: jit_init(encoder, jax.random.PRNGKey(0), *a, **k)
  with pytest.raises(ValueError, match="padding_mask must be bool"):
    init(_tokens(), padding_mask=jnp.ones((B, T - 1), bool))
  with pytest.raises(ValueError, match="padding_mask must be bool"):
    init(_tokens(), padding_mask=jnp.ones((B, T), jnp.int32))
  with pytest.raises(ValueError, match="tokens must be"):
    init(jnp.ones((B, T), jnp.float32))
  # An unknown position is caught when the config is made, however it is
  # made, not when the Encoder is traced.
  expected = r"unknown position encoding 'absolute'. Valid names are: none, sinusoidal"
  with pytest.raises(ValueError, match=expected):
    _small(position="absolute")
  with pytest.raises(ValueError, match=expected):
    ModelConfig(**SMALL, position="absolute")


def test_post_norm_encoder_has_no_final_norm_and_rmsnorm_has_no_bias():
  tokens = _tokens()
  post = _init(_encoder(residual="post_norm"), tokens)["params"]
  pre = _init(_encoder(norm="rmsnorm", activation="swiglu"), tokens)["params"]
  assert "final_norm" not in post and "final_norm" in pre
  assert set(pre["final_norm"]) == {"scale"}
  assert set(pre["block_0"]["mlp"]) == {"wi_0", "wi_1", "wo"}


def test_encoder_dropout_needs_rng_and_acts_only_when_not_deterministic():
  tokens = _tokens()
  encoder = _encoder(dropout_rate=0.2)
  variables = _init(encoder, tokens)
  reference = jit_apply(_encoder(), variables, tokens)
  assert_close(jit_apply(encoder, variables, tokens), reference)
  dropped = jit_apply(encoder, variables, tokens, deterministic=False,
                      rngs={"dropout": jax.random.PRNGKey(0)})
  assert not np.allclose(dropped, reference, atol=1e-3)


# ---------------------------------------------------------------------------
# Pooling and the classifier.
# ---------------------------------------------------------------------------


def test_masked_pooling_formulas_and_all_padding_rows():
  # NumPy inputs: the expected values are NumPy arithmetic, the poolings one program each.
  x = np.asarray(jax.random.normal(jax.random.PRNGKey(0), (3, 4, 5)))
  mask = np.array([[1, 1, 0, 0], [0, 1, 0, 1], [0, 0, 0, 0]], bool)
  assert_close(jit_call(masked_mean, x, mask)[0], x[0, :2].sum(0) / 2)
  assert_close(jit_call(masked_mean, x, mask)[1], (x[1, 1] + x[1, 3]) / 2)
  assert_close(jit_call(masked_max, x, mask)[1], np.maximum(x[1, 1], x[1, 3]))
  for pooled in (jit_call(masked_mean, x, mask), jit_call(masked_max, x, mask)):
    assert_close(pooled[2], np.zeros(5))  # No NaN or -inf from a fully padded row.


def test_masked_max_gradient_reaches_only_the_valid_maximum():
  x = jax.random.normal(jax.random.PRNGKey(1), (2, 6, 3))
  mask = jnp.array([[1, 1, 1, 0, 0, 0], [0, 1, 1, 1, 1, 1]], bool)
  grad = jax.jit(jax.grad(lambda x: masked_max(x, mask).sum()))(x)
  valid = np.where(np.asarray(mask)[..., None], np.asarray(x), -np.inf)
  expected = (valid == valid.max(axis=1, keepdims=True)).astype(np.float32)
  assert_close(grad, expected)


def _classifier(pooling, **overrides):
  return SequenceClassifier(_small(num_classes=3, pooling=pooling, head_mlp_dim=8, **overrides))


@pytest.mark.parametrize("pooling", ["cls", "mean", "max"])
def test_pooling_ignores_padded_tokens(pooling):
  tokens = _tokens()
  padding_mask = _suffix_padding([T, 3]).at[0, 1].set(False)
  other_ids = jnp.where(padding_mask, tokens, _tokens(seed=11))
  model = _classifier(pooling)
  variables = _init_perturbed(model, tokens)
  logits = jit_apply(model, variables, tokens, padding_mask=padding_mask)
  assert logits.shape == (B, 3) and logits.dtype == jnp.float32
  assert_close(logits, jit_apply(model, variables, other_ids, padding_mask=padding_mask), atol=1e-5)
  assert not np.allclose(logits, jit_apply(model, variables, other_ids), atol=1e-4)


def test_cls_pooling_reads_the_prepended_embedding_at_position_zero():
  tokens = _tokens()
  model = _classifier("cls")
  variables = _init_perturbed(model, tokens)
  params = variables["params"]
  assert params["cls"].shape == (1, 1, E)
  # The encoder run by hand on [cls, tokens], its first output through the head.
  encoded = jit_apply(_encoder(), {"params": params["encoder"]}, tokens, prefix=params["cls"])
  assert encoded.shape == (B, T + 1, E)
  hidden = jax.nn.relu(encoded[:, 0] @ params["head_hidden"]["kernel"]
                       + params["head_hidden"]["bias"])
  expected = hidden @ params["head"]["kernel"] + params["head"]["bias"]
  assert_close(jit_apply(model, variables, tokens), expected, atol=1e-5)


def test_mean_pooling_equals_the_masked_mean_of_encoder_outputs():
  tokens = _tokens()
  padding_mask = _suffix_padding([T, 5])
  model = SequenceClassifier(_small(num_classes=3, pooling="mean"))
  params = _init_perturbed(model, tokens)["params"]
  encoded = jit_apply(_encoder(), {"params": params["encoder"]}, tokens,
                      padding_mask=padding_mask)
  pooled = jnp.stack([encoded[0].mean(0), encoded[1, :5].mean(0)])
  expected = pooled @ params["head"]["kernel"] + params["head"]["bias"]
  assert_close(jit_apply(model, {"params": params}, tokens, padding_mask=padding_mask), expected,
               atol=1e-5)


def test_unknown_pooling_raises():
  # Raised when the config is checked, before any module is built or traced.
  message = r"unknown pooling 'first'\..* Valid names are: cls, mean, max, attention\.$"
  with pytest.raises(ValueError, match=message):
    _classifier("first")
  with pytest.raises(ValueError, match=message):
    build_model(ModelConfig(**SMALL, pooling="first"))


def test_params_carry_logical_axis_names():
  boxed = jax.eval_shape(_classifier("cls").init, jax.random.PRNGKey(0), _tokens())["params"]
  leaves = jax.tree.leaves(boxed, is_leaf=lambda x: isinstance(x, nn.Partitioned))
  assert all(isinstance(leaf, nn.Partitioned) for leaf in leaves)
  specs = nn.get_partition_spec(boxed)
  assert tuple(specs["encoder"]["token_embedding"]["embedding"]) == ("vocab", "embed")
  assert tuple(specs["encoder"]["block_1"]["mlp"]["wi"]["kernel"]) == ("embed", "mlp")
  assert tuple(specs["encoder"]["block_1"]["mlp"]["wo"]["kernel"]) == ("mlp", "embed")
  assert tuple(specs["encoder"]["final_norm"]["scale"]) == ("embed",)


# ---------------------------------------------------------------------------
# build_model.
# ---------------------------------------------------------------------------


def _config(**overrides):
  config = default_model_config()
  config.update(dict(vocab_size=V, num_classes=3, num_layers=1, embed_dim=E, num_heads=4,
                     mlp_dim=32, max_length=T, dropout_rate=0.0))
  config.update(overrides)
  return config


@pytest.mark.parametrize("attention", ["dot_product", "multi_query"])
@pytest.mark.parametrize("pooling", ["cls", "mean", "max"])
def test_build_model_from_config(attention, pooling):
  model = build_model(_config(attention=attention, pooling=pooling))
  assert isinstance(model, SequenceClassifier)
  # Shapes suffice here, and tracing without compiling keeps the sweep fast.
  variables = _init_shapes(model, _tokens())
  key_heads = variables["params"]["encoder"]["block_0"]["attention"]["key"]["kernel"].shape[1]
  assert key_heads == (1 if attention == "multi_query" else 4)
  assert ("cls" in variables["params"]) == (pooling == "cls")
  assert jax.eval_shape(model.apply, variables, _tokens()).shape == (B, 3)


def test_build_model_passes_every_option_through():
  config = _config(num_kv_heads=2, position="t5", norm="rmsnorm", residual="post_norm",
                   activation="geglu", head_mlp_dim=8, dtype="bfloat16", num_layers=3)
  config.attention_options = ml_collections.ConfigDict({"implementation": "xla"})
  model = build_model(config)
  # The encoder is built inside the model from the same config (there is no
  # `model.encoder` before tracing): the fields are checked on the config, and
  # what reaches the encoder and every block's mixer on the modules as they run.
  model_config = model.config
  assert (model_config.num_kv_heads, model_config.position, model_config.norm,
          model_config.residual, model_config.activation, model_config.num_layers,
          model_config.head_mlp_dim) == (2, "t5", "rmsnorm", "post_norm", "geglu", 3, 8)
  assert model_config.jnp_dtype == jnp.bfloat16
  assert dict(model_config.attention_options) == {"implementation": "xla"}
  variables = _init_shapes(model, _tokens())
  assert len([k for k in variables["params"]["encoder"] if k.startswith("block_")]) == 3
  assert variables["params"]["encoder"]["block_0"]["attention"]["key"]["kernel"].shape[1] == 2

  called = {}

  def record(next_fun, args, kwargs, context):
    if context.method_name == "__call__":
      called[context.module.scope.path] = context.module
    return next_fun(*args, **kwargs)

  with nn.intercept_methods(record):
    logits = jax.eval_shape(model.apply, variables, _tokens())
  assert logits.dtype == jnp.float32
  assert called[("encoder",)].config is model_config
  for i in range(3):
    mixer = called[("encoder", f"block_{i}", "attention")]
    assert (mixer.num_kv_heads, mixer.position, mixer.dtype) == (2, "t5", jnp.bfloat16)
    assert dict(mixer.attention_options) == {"implementation": "xla"}


def test_build_model_rejects_unknown_keys_and_names():
  with pytest.raises(ValueError, match=r"unknown model config key 'num_layer'\. Did you mean "
                     r"'num_layers'\?.*Valid names are:.*num_layers"):
    build_model({"num_layer": 2})
  with pytest.raises(ValueError, match="unknown attention variant 'no_such_variant'"):
    build_model(_config(attention="no_such_variant"))
  with pytest.raises(ValueError, match=r"unknown activation 'mish'\..*Valid names are: .*gelu"):
    build_model(_config(activation="mish"))
  with pytest.raises(ValueError, match=r"unknown pooling 'sum'\. Valid names are: cls, mean, max"):
    build_model(_config(pooling="sum"))
  with pytest.raises(ValueError, match="dtype must name a JAX dtype.*'float99'"):
    build_model(_config(dtype="float99"))
  # The renamed key is unknown too, pointing at nothing silently ignored.
  with pytest.raises(ValueError, match="unknown model config key 'pre_norm'"):
    build_model(_config(pre_norm=False))


def test_build_model_trains_on_a_toy_task():
  """Is token 1 in the sequence? 30 Adam steps should nearly solve a fixed batch."""
  rng = np.random.default_rng(0)
  tokens = rng.integers(2, V, size=(64, T))
  labels = np.arange(64) % 2
  tokens[labels == 1, rng.integers(0, T, size=32)] = 1
  tokens, labels = jnp.asarray(tokens), jnp.asarray(labels)

  model = build_model(_config(num_classes=2, pooling="max"))
  params = _init(model, tokens[:B])["params"]  # The batch size does not shape the params.
  optimizer = optax.adam(1e-2)

  def loss_fn(params):
    logits = jit_apply(model, {"params": params}, tokens)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

  @jax.jit
  def step(params, opt_state):
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = optimizer.update(grads, opt_state)
    return optax.apply_updates(params, updates), opt_state, loss

  opt_state = optimizer.init(params)
  losses = []
  for _ in range(30):
    params, opt_state, loss = step(params, opt_state)
    losses.append(float(loss))
  assert abs(losses[0] - np.log(2)) < 1e-3  # The zero-initialised head starts uniform.
  assert losses[-1] < 0.05, losses
