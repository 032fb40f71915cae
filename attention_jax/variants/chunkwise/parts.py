"""What the chunkwise mixers share: the mixer shell (forms, padding, the
bidirectional pass, decoding from the recurrent state) and the block parts
their papers' layers are built of (short causal convolutions, token shift,
per-head norms, L2-normalised keys).

A mixer subclasses `RecurrentMixer` and defines two methods:

  recurrence(x [B, T, E], positions [B, T], history) -> (Recurrence, extras, history)
  output(out [B, T, H, Dv], extras, x) -> [B, T, E]

`history` is what the mixer's short convolutions or token shift need of the
tokens before these (`{name: [B, K - 1, C]}`; None at the start of a sequence),
and `extras` whatever `output` needs besides the recurrence's outputs (an output
gate's input, a skip term). The shell runs the engine between the two and keeps
the recurrent state and the history in the "cache" collection while decoding.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, NamedTuple, Optional, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from attention_jax.variants import common
from attention_jax.variants.chunkwise import engine

Array = jax.Array
NORM_EPSILON = 1e-6


class Recurrence(NamedTuple):
  """The engine's inputs for one sequence (shapes in `engine`'s docstring):
  S_t = (diag(exp(log_decay_t)) + write_key_t read_key_t^T) S_{t-1} + key_t value_t^T,
  out_t = S_t^T query_t."""

  query: Array
  key: Array
  value: Array
  log_decay: Array
  read_key: Optional[Array] = None
  write_key: Optional[Array] = None


def without_padding(recurrence: Recurrence, valid: Optional[Array]) -> Recurrence:
  """Padded tokens (`valid` `[B, T]` False) leave the state as it is: no key,
  no write, decay 1."""
  if valid is None:
    return recurrence
  keep = lambda x: None if x is None else jnp.where(
      valid.reshape(valid.shape + (1,) * (x.ndim - 2)), x, jnp.zeros((), x.dtype))
  return recurrence._replace(key=keep(recurrence.key), log_decay=keep(recurrence.log_decay),
                             write_key=keep(recurrence.write_key))


# The registry's documentation of the options every mixer's recurrence takes.
FORM_OPTIONS = dict(
    form="'chunkwise', 'recurrent' (a scan over tokens), 'parallel' (O(T^2)), or the "
         "chunkwise form in Pallas kernels, 'pallas_gpu' (Triton) or 'pallas_tpu' (Mosaic); "
         "equal",
    chunk_size="C, tokens per chunk of the chunkwise and kernel forms (a power of two >= 16 "
               "for 'pallas_gpu')")


def check_form(form: str) -> str:
  if form not in engine.FORMS:
    raise ValueError(f"form must be one of {sorted(engine.FORMS)} (how the recurrence is "
                     f"computed; equal results), got {form!r}.")
  return form


def check_divides(name: str, size: int, width: int, what: str) -> int:
  """`size` divides `width` (a head count into a width): the number of parts."""
  common.check_size(name, size)
  if width % size:
    raise ValueError(f"{name}={size} must divide {what} ({width}).")
  return width // size


def check_fraction(name: str, value: float, *, low: float = 0.0, high: float = 1.0) -> float:
  """A fixed rate or decay given as an option lies in the open interval (low, high)."""
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not low < value < high:
    raise ValueError(f"{name} must be a number in ({low}, {high}), got {value!r}.")
  return float(value)


class RecurrentMixer(nn.Module):
  """The shell of every chunkwise mixer (the mixer contract).

  Causal, the recurrence runs left to right. Not causal (an encoder), the
  layer runs over the sequence and over it reversed, with the same weights
  (one pass over a batch of both), and sums the two, as weight-tied
  bidirectional Mamba layers do (Caduceus' BiMamba): each token then sees
  every other, the earlier ones from one side and the later from the other.

  Attributes (shared):
    num_heads: H.
    form: "chunkwise" (default), "recurrent" (a scan over tokens, the
      reference), "parallel" (one chunk of T: O(T^2)), or the chunkwise form
      in Pallas kernels, "pallas_gpu" (Triton) or "pallas_tpu" (Mosaic),
      interpreted off their device; equal results.
    chunk_size: C, tokens per chunk of the chunkwise and kernel forms.
    dropout_rate: dropout on the recurrence's outputs o_t in training (the
      model's attention dropout; these layers have no weights to drop).
    dtype, param_dtype: computation and parameter dtypes.
    decode: keep the recurrent state `[B, H, Dk, Dv]` and the short
      convolutions' history in the "cache" collection: the prompt goes in
      chunkwise, then tokens one at a time, O(1) each.
  """

  num_heads: int
  form: str = "chunkwise"
  chunk_size: int = engine.DEFAULT_CHUNK_SIZE
  dropout_rate: float = 0.0
  dtype: Optional[Any] = None
  param_dtype: Any = jnp.float32
  decode: bool = False

  def recurrence(self, x: Array, positions: Array, history: Optional[Mapping[str, Array]]
                 ) -> Tuple[Recurrence, Any, Mapping[str, Array]]:
    raise NotImplementedError

  def output(self, out: Array, extras: Any, x: Array) -> Array:
    raise NotImplementedError

  def compute_dtype(self, x: Array):
    return self.dtype or jnp.promote_types(x.dtype, self.param_dtype)

  def _pass(self, x, positions, valid, history, state, deterministic):
    """Left to right: `(y [B, T, E], final state, history after these tokens)`."""
    recurrence, extras, history = self.recurrence(x, positions, history)
    recurrence = without_padding(recurrence, valid)
    out, state = engine.run(check_form(self.form), *recurrence, chunk_size=self.chunk_size,
                            initial_state=state)
    out = nn.Dropout(self.dropout_rate)(out, deterministic=deterministic)
    return self.output(out, extras, x), state, history

  @nn.compact
  def __call__(self, x: Array, context: Optional[Array] = None, *, mask=None,
               is_causal: bool = False, query_seq_lengths=None, key_value_seq_lengths=None,
               segment_ids=None, positions=None, deterministic: bool = True, carry=None):
    """The mixer contract. x: `[B, T, E]`; mask: key padding `[B|1, 1, 1, T]`
    (padded tokens leave the state unchanged; padded queries give zeros);
    positions: `[B, T]` or `[T]` (offset by the tokens decoded so far).
    Returns `[B, T, E]` (with the carry when given one)."""
    name = type(self).__name__
    common.reject_unsupported(name, context=context, segment_ids=segment_ids)
    batch, length, _ = x.shape
    valid = common.key_padding(name, mask, key_value_seq_lengths, batch, length)
    x = x.astype(self.compute_dtype(x))
    if valid is not None:  # a padded token's input is a zero, as before the first token
      x = jnp.where(valid[..., None], x, jnp.zeros((), x.dtype))
    positions = jnp.broadcast_to(jnp.arange(length) if positions is None else positions,
                                 (batch, length))
    decoding = self.decode and self.has_variable("cache", "state")
    if decoding and not is_causal:
      raise ValueError(f"{name} decodes causally: call it with is_causal=True while decoding.")
    if decoding:
      index = self.get_variable("cache", "cache_index")
      y, state, history = self._pass(x, positions + index, valid,
                                     self.get_variable("cache", "history"),
                                     self.get_variable("cache", "state"), deterministic)
      self.put_variable("cache", "state", state)
      self.put_variable("cache", "history", history)
      self.put_variable("cache", "cache_index", index + length)
    elif is_causal or self.decode:
      y, state, history = self._pass(x, positions, valid, None, None, deterministic)
      if self.decode:  # initialisation: the state starts empty, whatever the input's length
        self.put_variable("cache", "state", jnp.zeros_like(state))
        self.put_variable("cache", "history", jax.tree.map(jnp.zeros_like, history))
        self.put_variable("cache", "cache_index", jnp.array(0, jnp.int32))
    else:
      # Both directions in one pass of twice the batch: the sequences, then
      # the same reversed (positions reversed too, so each token keeps its own).
      both = lambda a: None if a is None else jnp.concatenate([a, jnp.flip(a, axis=1)])
      y = self._pass(both(x), both(positions), both(valid), None, None, deterministic)[0]
      y = y[:batch] + jnp.flip(y[batch:], axis=1)
    if query_seq_lengths is not None:
      y = common.zero_padded_queries(y[:, :, None], query_seq_lengths)[:, :, 0]
    return common.mixer_output(y, carry)


# ----------------------------------------------------------------------------
# Block parts.
# ----------------------------------------------------------------------------


def causal_convolution(x: Array, kernel: Array, history: Optional[Array] = None,
                       bias: Optional[Array] = None) -> Tuple[Array, Array]:
  """A depthwise causal convolution over tokens: y_t = sum_j kernel_j x_{t - K + 1 + j}.

  Args:
    x: `[B, T, C]`.
    kernel: `[K, C]`, one filter of width K per channel.
    history: `[B, K - 1, C]`, the inputs before these (zeros when None: the
      start of the sequence).
    bias: `[C]` or None.

  Returns:
    `(y [B, T, C], the last K - 1 inputs: the next call's history)`.
  """
  width = kernel.shape[0]
  if history is None:
    history = jnp.zeros((x.shape[0], width - 1, x.shape[2]), x.dtype)
  extended = jnp.concatenate([history.astype(x.dtype), x], axis=1)
  length = x.shape[1]
  y = sum(extended[:, j:j + length] * kernel[j] for j in range(width))
  if bias is not None:
    y = y + bias
  return y, extended[:, extended.shape[1] - (width - 1):]


class ShortConvolution(nn.Module):
  """A causal depthwise convolution of width `width` (the short convolution
  in front of DeltaNet's, Gated DeltaNet's and Mamba-2's projections), then
  SiLU. Called with the previous inputs `history` `[B, K - 1, C]` or None."""

  width: int = 4
  use_bias: bool = False
  param_dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: Array, history: Optional[Array]) -> Tuple[Array, Array]:
    channels = x.shape[-1]
    common.check_size("conv_size", self.width)
    bound = 1.0 / math.sqrt(self.width)  # PyTorch's Conv1d default, fan_in = K per channel
    init = lambda rng, shape, dtype: jax.random.uniform(rng, shape, dtype, -bound, bound)
    kernel = self.param("kernel", init, (self.width, channels), self.param_dtype)
    bias = (self.param("bias", init, (channels,), self.param_dtype) if self.use_bias
            else None)
    y, history = causal_convolution(x, kernel.astype(x.dtype), history,
                                    None if bias is None else bias.astype(x.dtype))
    return jax.nn.silu(y), history


def token_shift(x: Array, history: Optional[Array]) -> Tuple[Array, Array]:
  """x_{t-1} for every token (RWKV's token shift): `(x shifted [B, T, E], x's
  last token [B, 1, E])`; the token before the first is `history` (zeros
  when None)."""
  previous = jnp.zeros_like(x[:, :1]) if history is None else history.astype(x.dtype)
  return jnp.concatenate([previous, x[:, :-1]], axis=1), x[:, -1:]


def l2_normalize(x: Array, epsilon: float = NORM_EPSILON) -> Array:
  """x / |x| along the last axis (0 stays 0)."""
  x32 = x.astype(jnp.float32)
  return (x32 * jax.lax.rsqrt(jnp.sum(x32 * x32, axis=-1, keepdims=True) + epsilon)
          ).astype(x.dtype)


class HeadNorm(nn.Module):
  """Normalises each head's output `[B, T, H, D]` on its own, with a learned
  scale `[H, D]`: RMS (`center=False`, GLA's and DeltaNet's RMSNorm) or mean
  and variance (`center=True`, with a bias: RetNet's and RWKV-7's GroupNorm
  with H groups)."""

  center: bool = False
  epsilon: float = NORM_EPSILON
  param_dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: Array) -> Array:
    x32 = x.astype(jnp.float32)
    if self.center:
      x32 = x32 - jnp.mean(x32, axis=-1, keepdims=True)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.epsilon)
    scale = self.param("scale", nn.initializers.ones, x.shape[-2:], self.param_dtype)
    normed = normed * scale
    if self.center:
      normed = normed + self.param("bias", nn.initializers.zeros, x.shape[-2:], self.param_dtype)
    return normed.astype(x.dtype)


def mamba_decay_parameters(module: nn.Module, num_heads: int, *, decay_range=(1.0, 16.0),
                           step_range=(1e-3, 1e-1)):
  """Mamba-2's per-head decay rate A = exp(A_log), A uniform in `decay_range`,
  and its step bias, softplus(dt_bias) log-uniform in `step_range`:
  `(A_log [H], dt_bias [H])`. g = -A softplus(x W + dt_bias)."""
  def log_rate(rng, shape, dtype):
    return jnp.log(jax.random.uniform(rng, shape, dtype, *decay_range))

  def step_bias(rng, shape, dtype):
    low, high = map(math.log, step_range)
    step = jnp.exp(jax.random.uniform(rng, shape, dtype, low, high))
    return step + jnp.log(-jnp.expm1(-step))  # softplus^-1(step)

  return (module.param("A_log", log_rate, (num_heads,), jnp.float32),
          module.param("dt_bias", step_bias, (num_heads,), jnp.float32))


def dense(features: int, name: str, *, use_bias: bool = False, param_dtype=jnp.float32,
          **kwargs) -> nn.Dense:
  """The projections of these layers (no bias unless asked)."""
  return nn.Dense(features, use_bias=use_bias, param_dtype=param_dtype, name=name, **kwargs)


def heads(x: Array, num_heads: int) -> Array:
  """`[B, T, H * D]` -> `[B, T, H, D]`."""
  return x.reshape(x.shape[:2] + (num_heads, x.shape[-1] // num_heads))


def merge_heads(x: Array) -> Array:
  """`[B, T, H, D]` -> `[B, T, H * D]`."""
  return x.reshape(x.shape[:2] + (-1,))
