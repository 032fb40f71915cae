"""Greedy and beam-search decoding of a sequence-to-sequence model, jitted with
a fixed number of steps (`lax.scan`).

  tokens = decode(model, variables, inputs, max_length=31)               # greedy
  tokens = decode(model, variables, inputs, max_length=31, beam_size=4)  # beam search

The model answers two methods: `encode(inputs) -> (*memory, carry)` and
`decode_step(tokens [N], carry, *memory) -> (logits [N, V], carry)`, as
`RNNEncoderDecoder` does. Decoding starts from BOS; once a sequence has
emitted EOS (or padding) it emits padding (0) and its score stops changing.
"""

from __future__ import annotations

import functools
from typing import Any, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from attention_jax.data.seq2seq import BOS_ID, EOS_ID, PAD_ID

Array = jnp.ndarray


def _stepper(model: nn.Module, variables: Any, memory: Tuple[Array, ...]):
  def step(tokens, carry):
    return model.apply(variables, tokens, carry, *memory, method=model.decode_step)
  return step


def greedy_decode(model: nn.Module, variables: Any, inputs: Array, max_length: int) -> Array:
  """The argmax token at every step: inputs `[B, Ts]` -> tokens `[B, max_length]`."""
  *memory, carry = model.apply(variables, inputs, method=model.encode)
  step = _stepper(model, variables, tuple(memory))

  def body(state, _):
    tokens, carry, done = state
    logits, carry = step(tokens, carry)
    tokens = jnp.where(done, PAD_ID, jnp.argmax(logits, axis=-1).astype(jnp.int32))
    return (tokens, carry, done | (tokens == EOS_ID) | (tokens == PAD_ID)), tokens

  batch = inputs.shape[0]
  start = (jnp.full((batch,), BOS_ID, jnp.int32), carry, jnp.zeros((batch,), bool))
  _, tokens = jax.lax.scan(body, start, None, length=max_length)
  return tokens.T


def beam_search(model: nn.Module, variables: Any, inputs: Array, max_length: int,
                beam_size: int) -> Array:
  """The highest-scoring of `beam_size` hypotheses (sum of token
  log-probabilities, no length penalty): inputs `[B, Ts]` -> `[B, max_length]`.

  Beams are rows `b * beam_size + k` of the model's batch; a finished beam
  extends only by padding, at no cost, so it competes with the live ones
  on its final score.
  """
  batch = inputs.shape[0]
  *memory, carry = model.apply(variables, inputs, method=model.encode)
  tile = lambda x: jnp.repeat(x, beam_size, axis=0) if jnp.ndim(x) and x.shape[0] == batch else x
  memory = tuple(jax.tree.map(tile, m) for m in memory)
  carry = jax.tree.map(tile, carry)
  step = _stepper(model, variables, memory)
  # Only beam 0 is live at the start, so the first step's k best differ.
  scores = jnp.tile(jnp.array([0.0] + [-jnp.inf] * (beam_size - 1)), (batch, 1))

  def body(state, t):
    tokens, carry, scores, done, history = state
    logits, carry = step(tokens.reshape(-1), carry)
    vocab = logits.shape[-1]
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32)).reshape(batch, beam_size, vocab)
    # A finished beam's one continuation: padding, at log-probability 0.
    finished = jnp.full((vocab,), -jnp.inf).at[PAD_ID].set(0.0)
    log_probs = jnp.where(done[..., None], finished, log_probs)
    candidates = (scores[..., None] + log_probs).reshape(batch, beam_size * vocab)
    scores, chosen = jax.lax.top_k(candidates, beam_size)  # [B, K]
    parent, tokens = chosen // vocab, (chosen % vocab).astype(jnp.int32)
    rows = (jnp.arange(batch)[:, None] * beam_size + parent).reshape(-1)
    carry = jax.tree.map(lambda x: x[rows] if jnp.ndim(x) and x.shape[0] == batch * beam_size
                         else x, carry)
    history = jnp.take_along_axis(history, parent[..., None], axis=1).at[:, :, t].set(tokens)
    done = jnp.take_along_axis(done, parent, axis=1) | (tokens == EOS_ID) | (tokens == PAD_ID)
    return (tokens, carry, scores, done, history), None

  start = (jnp.full((batch, beam_size), BOS_ID, jnp.int32), carry, scores,
           jnp.zeros((batch, beam_size), bool),
           jnp.zeros((batch, beam_size, max_length), jnp.int32))
  (_, _, scores, _, history), _ = jax.lax.scan(body, start, jnp.arange(max_length))
  best = jnp.argmax(scores, axis=1)
  return jnp.take_along_axis(history, best[:, None, None], axis=1)[:, 0]


def decode(model: nn.Module, variables: Any, inputs: Array, max_length: int,
           beam_size: int = 1) -> Array:
  """Greedy decoding for `beam_size` 1, beam search above: `[B, max_length]` tokens."""
  if not isinstance(beam_size, int) or beam_size < 1:
    raise ValueError(f"beam_size must be a positive integer, got {beam_size!r}.")
  if not isinstance(max_length, int) or max_length < 1:
    raise ValueError(f"max_length must be a positive integer, got {max_length!r}.")
  # A model that decodes into a fixed buffer says how long it is.
  limit = getattr(model, "max_decode_length", None)
  if limit is not None and max_length > limit:
    raise ValueError(f"max_length={max_length} decoding steps do not fit the model's buffer of "
                     f"{limit} tokens (model.max_length).")
  return _decode(model, variables, inputs, max_length, beam_size)


# One program for the encoder, the scan and the choice of the best beam: run op
# by op, each of the ops around the scan is compiled on its own (a seq2seq test
# decoding a small model spent seconds compiling them).
@functools.partial(jax.jit, static_argnums=(0, 3, 4))
def _decode(model: nn.Module, variables: Any, inputs: Array, max_length: int,
            beam_size: int) -> Array:
  if beam_size == 1:
    return greedy_decode(model, variables, inputs, max_length)
  return beam_search(model, variables, inputs, max_length, beam_size)
