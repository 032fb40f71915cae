"""Properties every registered variant must have, walked from the registry.

* a token mixer (role "mixer") is reachable by name and runs as a model
  block's mixer (the mixer contract), forward and backward under `jax.jit`,
  with finite outputs and gradients (a variant with no test of its own here
  would still fail `tests/test_registry.py`); a pooling or alignment module
  is reachable by name and runs its own call (`registry.ROLES`) the same way;
* a variant registered as sub-quadratic never builds a T x T array, in the
  forward or the backward pass (checked on the traced program at T = 4096).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_jax import registry
from attention_jax.models import Block, ModelConfig
from attention_testing import jit_init, largest_intermediate, perturbed

EMBED, HEADS = 32, 2
MIXERS = registry.list_variants("mixer")
NOT_MIXERS = [n for n in registry.list_variants() if n not in MIXERS]
SUBQUADRATIC = [n for n in MIXERS if registry.get_variant(n).subquadratic]
SUBQUADRATIC_NOT_MIXERS = [n for n in NOT_MIXERS if registry.get_variant(n).subquadratic]


def _length_options(name, length):
  """`{"max_length": length}` for a variant that declares the option (its
  weights are sized by the sequence length: the Synthesizers, mlp_mixer,
  gmlp), `{}` for the others."""
  declared = {option.name for option in registry.variant_options(name)}
  return {"max_length": length} if "max_length" in declared else {}


def _module(name, length):
  spec = registry.get_variant(name)
  options = _length_options(name, length)
  if spec.mixer is None or spec.mixer == registry.ATTENTION_MIXER:
    return spec.module(num_heads=HEADS, attention_options=options)
  return spec.module(num_heads=HEADS, **options)


def _loss_of_params(module, x, **call):
  """The gradient of a loss in the parameters and inputs; the other variable
  collections (e.g. the "random" draws, int counters) pass through undifferentiated."""
  variables = jax.eval_shape(functools.partial(module.init, **call), jax.random.PRNGKey(0), x)
  zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), variables)
  others = {name: value for name, value in zeros.items() if name != "params"}

  def loss(params, x):
    return jnp.sum(module.apply({"params": params, **others}, x, **call) ** 2)

  # A mixer without parameters (fnet) has no "params" collection.
  return jax.grad(loss, argnums=(0, 1)), zeros.get("params", {})


@pytest.mark.parametrize("name", MIXERS)
def test_runs_by_name_in_a_block_under_jit_forward_and_backward(name):
  """Every registered mixer through the same model block (the mixer contract),
  built from the model config by name, with finite outputs and gradients."""
  length = 256  # fits every default block size and pattern
  # A causal-only mechanism (stick-breaking) runs causally, in a language model's block.
  causal = not registry.get_variant(name).bidirectional
  config = ModelConfig(attention=name, attention_options=_length_options(name, length),
                       num_layers=1, embed_dim=EMBED, num_heads=HEADS, mlp_dim=64,
                       max_length=length, dropout_rate=0.0,
                       kind="language_model" if causal else "classifier")
  x = jax.random.normal(jax.random.PRNGKey(2), (1, length, EMBED))
  block = Block(config)
  variables = jit_init(block, jax.random.PRNGKey(0), x, {}, None, causal)
  # State a variant keeps besides its parameters (routing's k-means centroids).
  state = {k: v for k, v in variables.items() if k != "params"}

  def loss(params, x):
    (y, _), _ = block.apply({"params": params, **state}, x, {}, None, causal,
                            mutable=list(state))
    assert y.shape == x.shape
    return jnp.sum(y ** 2)

  value, (grad_params, grad_x) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(
      variables["params"], x)
  assert np.isfinite(value)
  assert np.isfinite(np.asarray(grad_x)).all() and np.abs(np.asarray(grad_x)).max() > 0
  assert all(np.isfinite(np.asarray(leaf)).all() for leaf in jax.tree.leaves(grad_params))


@pytest.mark.parametrize("name", SUBQUADRATIC)
def test_subquadratic_variant_never_builds_a_length_squared_array(name):
  length = 4096
  x = jax.ShapeDtypeStruct((1, length, EMBED), jnp.float32)
  module = _module(name, length)
  # A causal-only mechanism runs causally.
  call = {} if registry.get_variant(name).bidirectional else {"is_causal": True}
  grad_fn, params = _loss_of_params(module, jnp.zeros(x.shape, x.dtype), **call)
  largest = largest_intermediate(grad_fn, params, jnp.zeros(x.shape, x.dtype))
  # A quarter of T^2 leaves room for bands and blocks (e.g. [H, T, 2w] windows)
  # while catching any T x T (or T x T/2) score matrix.
  assert largest < length * length // 4, (
      f"{name} builds an array of {largest} elements at T={length} (T^2 = {length ** 2})")



# The arguments a module of each role other than "mixer" is called with
# (`registry.ROLES`), from x [B, T, E] and its padding mask [B, T]: an
# alignment module aligns x with its every other token (Ta = T, Tb = T / 2).
CALLS_BY_ROLE = {
    "pooling": lambda x, mask: ((x,), dict(mask=mask)),
    "alignment": lambda x, mask: ((x, x[:, ::2]), dict(a_mask=mask, b_mask=mask[:, ::2])),
}


def test_every_role_is_walked_by_this_file():
  # A new role needs its call in CALLS_BY_ROLE before its variants can be tested.
  assert set(registry.ROLES) == {"mixer", *CALLS_BY_ROLE}


def _init_and_call(name, x, mask):
  """The module of `name` built by name with its defaults, its parameters
  (zeros; only their shapes are traced) and `call(params, x) -> outputs`."""
  spec = registry.get_variant(name)
  module = spec.module()

  def call(params, x, method=None):
    args, kwargs = CALLS_BY_ROLE[spec.role](x, mask)
    if method == "init":
      return module.init(jax.random.PRNGKey(0), *args, **kwargs)
    return module.apply({"params": params}, *args, **kwargs)

  shapes = jax.eval_shape(lambda x: call(None, x, "init"), x)
  params = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes.get("params", {}))
  return module, params, call


@pytest.mark.parametrize("name", NOT_MIXERS)
def test_a_pooling_or_alignment_module_runs_by_name_under_jit_forward_and_backward(name):
  """Built by name (`spec.module()`, its defaults) and called as its role says,
  padding in the batch, with finite outputs and gradients."""
  length = 64
  x = jax.random.normal(jax.random.PRNGKey(2), (2, length, EMBED))
  mask = jnp.arange(length)[None, :] < jnp.array([[length], [length // 3]])
  _, params, call = _init_and_call(name, x, mask)
  params = perturbed(params)  # random, not the initialisers' zero biases

  def loss(params, x):
    out = call(params, x)
    return sum(jnp.sum(leaf ** 2) for leaf in jax.tree.leaves(out)), out

  (value, out), (grad_params, grad_x) = jax.jit(
      jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, x)
  assert np.isfinite(value)
  assert all(np.isfinite(np.asarray(leaf)).all() for leaf in jax.tree.leaves(out))
  assert np.isfinite(np.asarray(grad_x)).all() and np.abs(np.asarray(grad_x)).max() > 0
  assert all(np.isfinite(np.asarray(leaf)).all() for leaf in jax.tree.leaves(grad_params))


@pytest.mark.parametrize("name", SUBQUADRATIC_NOT_MIXERS)
def test_subquadratic_pooling_never_builds_a_length_squared_array(name):
  """The test above for modules that are not mixers, through their own call."""
  length = 4096
  x = jnp.zeros((1, length, EMBED))
  _, params, call = _init_and_call(name, x, jnp.ones((1, length), bool))
  loss = lambda params, x: sum(jnp.sum(leaf ** 2) for leaf in jax.tree.leaves(call(params, x)))
  largest = largest_intermediate(jax.grad(loss, argnums=(0, 1)), params, x)
  assert largest < length * length // 4, (
      f"{name} builds an array of {largest} elements at T={length} (T^2 = {length ** 2})")
