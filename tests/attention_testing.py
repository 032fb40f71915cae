"""Helpers shared by the tests: random inputs and an independent mask builder."""

from __future__ import annotations

import collections
import functools
import itertools
import os

import jax
import jax.numpy as jnp
import numpy as np

from attention_jax.core import reference_attention


# The flags of tests/conftest.py's TEST_XLA_FLAGS that make the compiled code slow.
RUNTIME_COSTLY_XLA_FLAGS = ("xla_backend_optimization_level", "xla_cpu_opt_preset")


def runtime_bound_environment(**extra: str) -> dict:
  """The environment for a subprocess that mostly runs its programs rather than
  compiles them (a training run, a benchmark): this session's environment
  without the backend optimisation level 0 and the fast-compile preset that
  tests/conftest.py asks for, which make compiles cheap and the compiled code
  slow."""
  environment = dict(os.environ, **extra)
  environment["XLA_FLAGS"] = " ".join(
      flag for flag in environment.get("XLA_FLAGS", "").split()
      if not flag.startswith(tuple(f"--{name}=" for name in RUNTIME_COSTLY_XLA_FLAGS)))
  return environment


def _is_traced(value) -> bool:
  """Arrays and pytrees holding arrays (variables, rng dicts, caches) are
  traced; Python values (flags, sizes, shapes, None, strings, methods) fixed."""
  return any(isinstance(leaf, (jax.Array, np.ndarray)) for leaf in jax.tree.leaves(value))


def _hashable(value):
  """`value` as a key: lists (e.g. `mutable=["cache"]`) as tuples; a TypeError
  for what has no hash."""
  if isinstance(value, (list, tuple)):
    return tuple(_hashable(v) for v in value)
  hash(value)
  return value


class _ByIdentity:
  """An object that cannot be hashed (a Flax module with a dict field) as part
  of a key, by identity: modules are frozen, and the key holds the object, so
  its id names no other object while the key lives. Without it such a
  module's every `jit_apply` made a new `jax.jit`, traced and lowered again."""

  __slots__ = ("value",)

  def __init__(self, value):
    self.value = value

  def __hash__(self):
    return id(self.value)

  def __eq__(self, other):
    return isinstance(other, _ByIdentity) and other.value is self.value


# The compiled callers by what they fix: a test that applies the same module
# again (decoding token by token, a loop over inputs of one shape) reuses the
# jitted function and so its traced and compiled program, where a new jax.jit
# would trace and lower it again. Bounded, so that a worker does not keep every
# program of its tests alive.
_CALLERS: "collections.OrderedDict" = collections.OrderedDict()
_MAX_CALLERS = 64


def jit_call(fn, *args, **kwargs):
  """`fn(*args, **kwargs)` compiled as one program; the arguments that are not
  arrays or containers (flags, sizes, methods, filters) are fixed, not traced,
  whether passed by keyword or by position.

  For a pure attention function called once in a test: eager, each of its
  ops is a program of its own (tens of compiles for a blockwise variant).
  """
  fixed_args = {i: a for i, a in enumerate(args) if not _is_traced(a)}
  fixed_kwargs = {k: v for k, v in kwargs.items() if not _is_traced(v)}
  traced_args = [a for i, a in enumerate(args) if i not in fixed_args]
  traced_kwargs = {k: v for k, v in kwargs.items() if k not in fixed_kwargs}

  def call(*traced, **traced_by_name):
    traced = iter(traced)
    every_arg = [fixed_args[i] if i in fixed_args else next(traced) for i in range(len(args))]
    return fn(*every_arg, **fixed_kwargs, **traced_by_name)

  owner = getattr(fn, "__self__", None)
  try:
    hash(owner)
  except TypeError:  # a module with a dict field (`attention_options={...}`)
    owner = _ByIdentity(owner)
  try:  # A bound method (`model.apply`) by its function and its module, which hash by value.
    key = _hashable((getattr(fn, "__func__", fn), owner, len(args),
                     sorted(fixed_args.items()), sorted(fixed_kwargs.items())))
  except TypeError:
    return jax.jit(call)(*traced_args, **traced_kwargs)
  if key not in _CALLERS:
    _CALLERS[key] = jax.jit(call)
    if len(_CALLERS) > _MAX_CALLERS:
      _CALLERS.popitem(last=False)
  _CALLERS.move_to_end(key)
  return _CALLERS[key](*traced_args, **traced_kwargs)


def jit_init(model, *args, method=None, **kwargs):
  """`model.init(*args, method=method, **kwargs)` compiled as one program.

  Eager `init` compiles every op of every initialiser on its own: seconds for
  a small model on CPU, where one program takes a fraction.
  """
  return jit_call(model.init, *args, method=method, **kwargs)


def jit_apply(model, variables, *args, method=None, **kwargs):
  """`model.apply(variables, *args, method=method, **kwargs)` compiled as one
  program, for the same reason as `jit_init`."""
  return jit_call(model.apply, variables, *args, method=method, **kwargs)


def random_qkv(seed=0, batch=2, q_len=7, kv_len=None, num_heads=4, num_kv_heads=None,
               head_dim=8, value_dim=None, dtype=jnp.float32):
  """query [B, Tq, H, D], key [B, Tk, Hkv, D], value [B, Tk, Hkv, Dv] ~ N(0, 1)."""
  kv_len = q_len if kv_len is None else kv_len
  num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
  value_dim = head_dim if value_dim is None else value_dim
  kq, kk, kv = jax.random.split(jax.random.PRNGKey(seed), 3)
  query = jax.random.normal(kq, (batch, q_len, num_heads, head_dim), dtype)
  key = jax.random.normal(kk, (batch, kv_len, num_kv_heads, head_dim), dtype)
  value = jax.random.normal(kv, (batch, kv_len, num_kv_heads, value_dim), dtype)
  return query, key, value


def loop_mask(batch, q_len, kv_len, *, is_causal=False, window=None, q_lengths=None,
              kv_lengths=None, q_segments=None, kv_segments=None):
  """The allowed (query, key) pairs written out one by one: [B, 1, Tq, Tk] bool.

  Deliberately a plain loop over the definitions, independent of attention_jax.core.
  """
  allowed = np.ones((batch, 1, q_len, kv_len), bool)
  for b, i, j in itertools.product(range(batch), range(q_len), range(kv_len)):
    ok = True
    if is_causal:
      ok &= j <= i
    if window is not None:
      left, right = (window, window) if isinstance(window, int) else window
      ok &= i - left <= j <= i + right
    if q_lengths is not None:
      ok &= i < q_lengths[b]
    if kv_lengths is not None:
      ok &= j < kv_lengths[b]
    if q_segments is not None:
      ok &= q_segments[b][i] == kv_segments[b][j]
    allowed[b, 0, i, j] = ok
  return allowed


def assert_close(actual, expected, rtol=1e-5, atol=1e-5, err_msg=""):
  np.testing.assert_allclose(np.asarray(actual, np.float32), np.asarray(expected, np.float32),
                             rtol=rtol, atol=atol, err_msg=err_msg)


# The argument grid every exact implementation is checked on (Tq != Tk, odd lengths).
B, TQ, TK, H = 2, 7, 9, 4
Q_LENGTHS = np.array([5, 7])
KV_LENGTHS = np.array([3, 9])
Q_SEGMENTS = np.array([[1, 1, 1, 2, 2, 2, 2], [1, 1, 1, 1, 1, 1, 3]])
KV_SEGMENTS = np.array([[1, 1, 2, 2, 2, 2, 2, 0, 0], [1, 1, 1, 1, 2, 2, 2, 2, 2]])

# name -> (keyword arguments of dot_product_attention, arguments of loop_mask, supported by jax.nn)
MASK_CASES = {
    "plain": ({}, {}, True),
    "causal": (dict(is_causal=True), dict(is_causal=True), True),
    "window": (dict(local_window_size=2), dict(window=2), True),
    "window_pair": (dict(local_window_size=(3, 0)), dict(window=(3, 0)), True),
    "causal_window": (dict(is_causal=True, local_window_size=(2, 2)),
                      dict(is_causal=True, window=(2, 2)), True),
    "q_lengths": (dict(query_seq_lengths=jnp.array(Q_LENGTHS)), dict(q_lengths=Q_LENGTHS), True),
    "kv_lengths": (dict(key_value_seq_lengths=jnp.array(KV_LENGTHS)),
                   dict(kv_lengths=KV_LENGTHS), True),
    "segments": (dict(segment_ids=(jnp.array(Q_SEGMENTS), jnp.array(KV_SEGMENTS))),
                 dict(q_segments=Q_SEGMENTS, kv_segments=KV_SEGMENTS), False),
    "everything": (dict(is_causal=True, local_window_size=(4, 1),
                        key_value_seq_lengths=jnp.array(KV_LENGTHS),
                        segment_ids=(jnp.array(Q_SEGMENTS), jnp.array(KV_SEGMENTS))),
                   dict(is_causal=True, window=(4, 1), kv_lengths=KV_LENGTHS,
                        q_segments=Q_SEGMENTS, kv_segments=KV_SEGMENTS), False),
}


# The masks of variants that take no window (Q/K/V arrays of the grid above):
# name -> (keyword arguments of the variant, arguments of loop_mask)
VARIANT_MASK_CASES = {
    "plain": ({}, {}),
    "causal": (dict(is_causal=True), dict(is_causal=True)),
    "lengths": (dict(query_seq_lengths=jnp.array(Q_LENGTHS),
                     key_value_seq_lengths=jnp.array(KV_LENGTHS)),
                dict(q_lengths=Q_LENGTHS, kv_lengths=KV_LENGTHS)),
    "everything": (dict(is_causal=True, query_seq_lengths=jnp.array(Q_LENGTHS),
                        key_value_seq_lengths=jnp.array(KV_LENGTHS),
                        segment_ids=(jnp.array(Q_SEGMENTS), jnp.array(KV_SEGMENTS))),
                   dict(is_causal=True, q_lengths=Q_LENGTHS, kv_lengths=KV_LENGTHS,
                        q_segments=Q_SEGMENTS, kv_segments=KV_SEGMENTS)),
}


def bias_and_mask(seed):
  """A random bias [1, H, Tq, Tk] and a random boolean mask [B, 1, Tq, Tk]."""
  rng = np.random.default_rng(seed)
  bias = jnp.array(rng.normal(size=(1, H, TQ, TK)), jnp.float32)
  mask = jnp.array(rng.random((B, 1, TQ, TK)) > 0.2)
  return bias, mask


def _output_and_grads(fn, query, key, value, bias):
  """fn's output and the gradients of a fixed random projection of it w.r.t. q, k, v, bias."""
  shape = query.shape[:3] + value.shape[-1:]
  cotangent = jax.random.normal(jax.random.PRNGKey(42), shape)

  def loss(*args):
    out = fn(*args)
    return jnp.sum(out.astype(jnp.float32) * cotangent), out

  (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(
      query, key, value, bias)
  return out, grads



def check_against_reference(attention_fn, case, num_kv_heads, with_bias_and_mask, *,
                            dtype=jnp.float32, rtol=1e-5, atol=1e-5):
  """Outputs and q/k/v/bias gradients of `attention_fn` (the signature of
  dot_product_attention) equal the reference under the loop-built mask."""
  kwargs, mask_args, _ = MASK_CASES[case]
  query, key, value = random_qkv(batch=B, q_len=TQ, kv_len=TK, num_heads=H,
                                 num_kv_heads=num_kv_heads, value_dim=5, dtype=dtype)
  allowed = loop_mask(B, TQ, TK, **mask_args)
  bias, extra_mask = bias_and_mask(seed=1)
  bias = bias.astype(dtype)
  if with_bias_and_mask:
    allowed = allowed & np.asarray(extra_mask)
  else:
    bias, extra_mask = jnp.zeros_like(bias), None

  ours = lambda q, k, v, b: attention_fn(q, k, v, b, extra_mask, scale=0.3, **kwargs)
  oracle = lambda q, k, v, b: reference_attention(q, k, v, b, jnp.array(allowed), scale=0.3)

  # One compilation of the implementation under test; the oracle runs eagerly.
  out, grads = jax.jit(lambda *args: _output_and_grads(ours, *args))(query, key, value, bias)
  expected_out, expected_grads = _output_and_grads(oracle, query, key, value, bias)
  assert out.dtype == dtype
  assert_close(out, expected_out, rtol=rtol, atol=atol)
  for name, got, want in zip("qkvb", grads, expected_grads):
    assert got.dtype == dtype
    assert_close(got, want, rtol=rtol, atol=atol, err_msg=f"gradient of {name}")


def intermediate_shapes(fn, *args):
  """The shapes of the arrays the equations of `fn`'s jaxpr produce (sub-jaxprs
  included), as a set.

  Tracing only, no compilation: cheap even at lengths where a T x T array
  would not fit in memory.
  """
  import jax.extend  # pylint: disable=import-outside-toplevel
  shapes = set()

  def visit(jaxpr):
    for eqn in jaxpr.eqns:
      shapes.update(tuple(getattr(var.aval, "shape", ())) for var in eqn.outvars)
      for sub in jax.extend.core.jaxprs_in_params(eqn.params):
        visit(sub)

  visit(jax.make_jaxpr(fn)(*args).jaxpr)
  return shapes


def largest_intermediate(fn, *args):
  """Size of the largest array any equation of `fn`'s jaxpr produces (`intermediate_shapes`)."""
  return max((int(np.prod(shape)) for shape in intermediate_shapes(fn, *args)), default=0)


def outputs_and_grads(fn, *arrays):
  """fn's output and the gradients of a fixed random projection of it w.r.t. `arrays`
  (one compilation: eager execution of many small ops is the slower path on CPU)."""
  out_shape = jax.eval_shape(fn, *arrays).shape
  cotangent = jax.random.normal(jax.random.PRNGKey(42), out_shape)

  def loss(*args):  # the output as the auxiliary: fn is traced and run once
    out = fn(*args)
    return jnp.sum(out.astype(jnp.float32) * cotangent), out

  grad_fn = jax.value_and_grad(loss, argnums=tuple(range(len(arrays))), has_aux=True)
  (_, out), grads = jax.jit(grad_fn)(*arrays)
  return out, grads


def assert_same_outputs_and_grads(ours, theirs, *arrays, rows=None, rtol=1e-5, atol=1e-5):
  """`ours(*arrays)` equals `theirs(*arrays)`, and so do their gradients w.r.t. every
  array. `rows`: boolean `[B, T]` of the query rows whose outputs are compared (all
  when None)."""
  out, grads = outputs_and_grads(ours, *arrays)
  want, want_grads = outputs_and_grads(theirs, *arrays)
  if rows is not None:
    out, want = np.asarray(out)[rows], np.asarray(want)[rows]
  assert_close(out, want, rtol=rtol, atol=atol)
  for index, (got, expected) in enumerate(zip(grads, want_grads)):
    assert_close(got, expected, rtol=rtol, atol=atol, err_msg=f"gradient of argument {index}")


def layer_norm_by_formula(x, p, eps=1e-6):
  """LayerNorm written out: (x - mean) / sqrt(var + eps) * scale + bias."""
  mean = x.mean(-1, keepdims=True)
  var = ((x - mean) ** 2).mean(-1, keepdims=True)
  return (x - mean) / jnp.sqrt(var + eps) * p["scale"] + p["bias"]


def rms_norm_by_formula(x, p, eps=1e-6):
  """RMSNorm written out: x / sqrt(mean(x^2) + eps) * scale."""
  return x / jnp.sqrt((x ** 2).mean(-1, keepdims=True) + eps) * p["scale"]


def small_stack_config(max_length, **overrides):
  """The small model of the layer-stack tests (3 layers of width 16, 2 heads,
  no dropout), with `overrides`: a `ModelConfig`."""
  from attention_jax.models import ModelConfig  # pylint: disable=import-outside-toplevel
  fields = dict(vocab_size=11, num_layers=3, embed_dim=16, num_heads=2, mlp_dim=32,
                max_length=max_length, dropout_rate=0.0)
  fields.update(overrides)
  return ModelConfig.from_config(fields)


def perturbed(params, seed=7):
  """Random parameters: default initialisers (zero biases, unit scales) would
  hide a missing bias or scale."""
  leaves, tree = jax.tree.flatten(params)
  rng = np.random.default_rng(seed)  # NumPy: no compilation per parameter shape.
  return jax.tree.unflatten(
      tree, [leaf + 0.3 * rng.standard_normal(leaf.shape, np.float32) for leaf in leaves])


def segment_training_step(model, vocab_size):
  """A jitted training step of language model `model` on one segment of a
  stream, with the "memory" of the segments before it (Transformer-XL,
  compressive): `step(params, memory, segment [B, T]) -> (loss, sown, grads,
  new memory)`, the loss being the next-token cross-entropy plus `sown`, the
  sum of the losses the layers sow into "losses" (0 if none)."""

  @jax.jit
  def step(params, memory, segment):
    def loss(params):
      logits, state = model.apply({"params": params, "memory": memory}, segment,
                                  mutable=["memory", "losses"])
      labels = jax.nn.one_hot(segment[:, 1:], vocab_size)
      cross_entropy = -jnp.mean(jnp.sum(jax.nn.log_softmax(logits[:, :-1]) * labels, -1))
      sown = sum((jnp.sum(leaf) for leaf in jax.tree.leaves(state.get("losses", {}))),
                 jnp.zeros((), jnp.float32))
      return cross_entropy + sown, (sown, state["memory"])

    (value, (sown, memory)), grads = jax.value_and_grad(loss, has_aux=True)(params)
    return value, sown, grads, memory

  return step


# numpy re-creations of the LRA release's layers (tests/variants/test_lra_release_*.py).


def as_float64(x):
  return np.asarray(x, np.float64)


def np_softmax(logits):
  logits = logits - logits.max(-1, keepdims=True)
  weights = np.exp(logits)
  return weights / weights.sum(-1, keepdims=True)


def np_project_heads(x, p):
  """DenseGeneral into heads: x [B, T, E], kernel [E, H, D], bias [H, D]."""
  return np.einsum("bte,ehd->bthd", x, as_float64(p["kernel"])) + as_float64(p["bias"])


def np_project_out(out, p):
  """DenseGeneral out of heads: out [B, T, H, D], kernel [H, D, E], bias [E]."""
  return np.einsum("bthd,hde->bte", out, as_float64(p["kernel"])) + as_float64(p["bias"])


def train_briefly(config, tmp_path, steps=4):
  """Runs the trainer on a task config (its data and model made small by the
  caller) for `steps` batches of 16, evaluating at the end; returns the
  results, after checking that the test split was scored."""
  from attention_jax.train.trainer import train_and_evaluate  # pylint: disable=import-outside-toplevel
  config.update(num_train_steps=steps, batch_size=16, eval_every=steps, checkpoint_every=steps,
                log_every=2, progress=False, data_dir=str(tmp_path / "data"))
  config.optimizer.warmup_steps = 1
  results = train_and_evaluate(config, tmp_path / "run", handle_signals=False)
  test = results["metrics"]["test"]
  assert test["count"] == config.task_options["test_size"]
  assert 0.0 <= test["accuracy"] <= 1.0 and np.isfinite(test["loss"])
  return results


def assert_causal_language_model(model, batch, length, cut, vocab_size, seed=0):
  """`model` (a language model) with random parameters: changing the tokens from
  position `cut` on leaves the logits before `cut` as they were, and changes
  those after (so the check can fail)."""
  import flax.linen as nn  # pylint: disable=import-outside-toplevel
  tokens = jax.random.randint(jax.random.PRNGKey(seed), (batch, length), 1, vocab_size)
  changed = tokens.at[:, cut:].set(jax.random.randint(jax.random.PRNGKey(seed + 5),
                                                      (batch, length - cut), 1, vocab_size))
  variables = {"params": perturbed(nn.meta.unbox(jit_init(model, jax.random.PRNGKey(seed + 1),
                                                          tokens)["params"]))}
  logits = jit_apply(model, variables, tokens)
  logits_changed = jit_apply(model, variables, changed)
  np.testing.assert_allclose(logits[:, :cut], logits_changed[:, :cut], atol=1e-5)
  assert not np.allclose(logits[:, cut:], logits_changed[:, cut:], atol=1e-3)


@functools.partial(jax.jit, static_argnames=("per_dimension", "low_rank", "batch", "length",
                                             "heads", "key_dim", "value_dim"))
def recurrence_inputs(per_dimension: bool, low_rank: bool, *, batch: int, length: int,
                      heads: int, key_dim: int, value_dim: int, seed=0, gate_bias=2.0):
  """Inputs of the chunkwise engine's recurrence (query, key, value, log_decay,
  read_key, write_key; the last two None without the rank-one term): decays
  sigmoid(N(gate_bias, 1)), one per head or per key dimension; the rank-one
  term as the delta rule's (unit keys, rates in (0, 1))."""
  rngs = jax.random.split(jax.random.PRNGKey(seed), 6)
  normal = lambda i, *shape: jax.random.normal(rngs[i], shape)
  query, key = normal(0, batch, length, heads, key_dim), normal(1, batch, length, heads, key_dim)
  value = normal(2, batch, length, heads, value_dim)
  decay_shape = (batch, length, heads) + ((key_dim,) if per_dimension else ())
  log_decay = jax.nn.log_sigmoid(normal(3, *decay_shape) + gate_bias)
  read = write = None
  if low_rank:
    read = key / jnp.linalg.norm(key, axis=-1, keepdims=True)
    rate = jax.nn.sigmoid(normal(4, batch, length, heads, 1))
    write, key = -rate * read, rate * read
  return query, key, value, log_decay, read, write


def forms_outputs_and_grads(arrays, forms):
  """Per named form of the recurrence (a function of `recurrence_inputs` and
  `initial_state`): its outputs, final state and the gradients of a loss of
  both in every input. `arrays`: `recurrence_inputs` plus an initial state."""
  results = {}
  differentiable = [i for i, a in enumerate(arrays) if a is not None]
  for name, form in forms.items():
    def loss(*diff):
      given = list(arrays)
      for i, a in zip(differentiable, diff):
        given[i] = a
      out, final = form(*given[:6], initial_state=given[6])
      return jnp.sum(out * jnp.cos(out)) + jnp.sum(final ** 2), (out, final)
    grads, (out, final) = jax.jit(jax.grad(loss, argnums=tuple(range(len(differentiable))),
                                           has_aux=True))(
        *[arrays[i] for i in differentiable])
    results[name] = (out, final, grads)
  return results


def assert_generated_splits_follow_the_seed(make_task, folder, sizes):
  """A generated task (`make_task(seed)`) prepares `sizes` (`{split: size}`)
  once, then nothing; the same seed in another folder writes the same test
  split, another seed a different one; the recall tasks' arrays are read
  back. Returns the task of seed 0."""
  task = make_task(0)
  assert task.prepare(folder / "a", progress=False) == sizes
  assert task.prepare(folder / "a", progress=False) == {split: 0 for split in sizes}
  make_task(0).prepare(folder / "b", progress=False)
  make_task(1).prepare(folder / "c", progress=False)
  read = lambda where: make_task(0).splits(where)["test"].gather(np.arange(sizes["test"]))
  np.testing.assert_array_equal(read(folder / "a")["inputs"], read(folder / "b")["inputs"])
  assert not np.array_equal(read(folder / "a")["inputs"], read(folder / "c")["inputs"])
  assert set(read(folder / "a")) == {"inputs", "target_mask", "group"}
  return task
