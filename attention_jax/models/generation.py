"""Sampling from the causal language model, one token at a time with a cache.

  tokens = generate(model, params, prompt, max_new_tokens=32)                 # greedy
  tokens = generate(model, params, prompt, 32, temperature=0.8, top_p=0.9,
                    rng=jax.random.PRNGKey(0))

The model is rebuilt with `ModelConfig.decode=True`: every mixer keeps its
keys and values (or its recurrent state) in the "cache" collection, sized
for the prompt and the new tokens, and the encoder counts the positions
already decoded. The prompt fills the cache in one call; then `lax.scan`
feeds each sampled token back, so the whole loop is one compiled program of
fixed shapes.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

Array = jnp.ndarray


def decoding_model(model: nn.Module) -> nn.Module:
  """The same language model built for incremental decoding (same parameters).

  Raises:
    ValueError: when the model is not a language model, or one of its
      variants cannot decode (`VariantSpec.not_decodable` says why).
  """
  config = getattr(model, "config", None)
  if config is None or config.kind != "language_model":
    raise ValueError(f"model must be a causal language model (build_model of a config with "
                     f"kind='language_model'), got {type(model).__name__}"
                     f"{'' if config is None else f' of kind {config.kind!r}'}.")
  return model.clone(config=dataclasses.replace(config, decode=True))


def empty_cache(decoder: nn.Module, batch: int, length: int) -> Any:
  """The "cache" collection of `decoder` for `batch` sequences of up to
  `length` tokens, before any token: zeros (every counter starts at 0)."""
  shapes = jax.eval_shape(decoder.init, jax.random.PRNGKey(0),
                          jnp.zeros((batch, length), jnp.int32))
  return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes["cache"])


def check_sampling(temperature: float, top_k: Optional[int], top_p: Optional[float]) -> None:
  """Raises ValueError naming the argument that is out of range."""
  if temperature < 0:
    raise ValueError(f"temperature must be >= 0 (0: greedy), got {temperature}.")
  if top_k is not None and (not isinstance(top_k, int) or top_k <= 0):
    raise ValueError(f"top_k must be a positive int (or None for every token), got {top_k!r}.")
  if top_p is not None and not 0.0 < top_p <= 1.0:
    raise ValueError(f"top_p must be in (0, 1] (or None for every token), got {top_p!r}.")


def sample_logits(logits: Array, rng: Optional[jax.Array], *, temperature: float = 1.0,
                  top_k: Optional[int] = None, top_p: Optional[float] = None) -> Array:
  """One token per row of `logits` `[B, V]`: argmax at temperature 0, else a
  draw from softmax(logits / temperature) restricted to the `top_k` most
  likely tokens and then to the smallest set whose probability reaches
  `top_p` (nucleus sampling). Returns `[B]` int32."""
  check_sampling(temperature, top_k, top_p)
  logits = logits.astype(jnp.float32)
  if temperature == 0:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  if rng is None:
    raise ValueError(f"rng must be a PRNG key to sample at temperature {temperature} (only "
                     f"temperature=0, greedy, needs none).")
  logits = logits / temperature
  if top_k is not None and top_k < logits.shape[-1]:
    kth_largest = jax.lax.top_k(logits, top_k)[0][..., -1:]
    logits = jnp.where(logits < kth_largest, -jnp.inf, logits)
  if top_p is not None and top_p < 1.0:
    order = jnp.argsort(-logits, axis=-1)
    probs = jax.nn.softmax(jnp.take_along_axis(logits, order, axis=-1), axis=-1)
    # A token stays when the tokens more likely than it sum to less than p:
    # the most likely always stays, and the set stops once it reaches p.
    keep_sorted = jnp.cumsum(probs, axis=-1) - probs < top_p
    keep = jnp.zeros_like(keep_sorted).at[
        jnp.arange(logits.shape[0])[:, None], order].set(keep_sorted)
    logits = jnp.where(keep, logits, -jnp.inf)
  return jax.random.categorical(rng, logits, axis=-1).astype(jnp.int32)


def generate(model: nn.Module, params: Any, prompt: Array, max_new_tokens: int, *,
             temperature: float = 0.0, top_k: Optional[int] = None,
             top_p: Optional[float] = None, rng: Optional[jax.Array] = None) -> Array:
  """Continues each prompt by `max_new_tokens` tokens.

  Args:
    model: a language model (`build_model` of kind "language_model").
    params: its parameters.
    prompt: `[B, P]` int token ids, P >= 1 (a batch of prompts of one length).
    max_new_tokens: N >= 1 tokens to add; P + N must fit the model's
      `max_length` (the cache holds P + N tokens).
    temperature: 0 for greedy decoding, else the softmax temperature.
    top_k: sample among the k most likely tokens only (None: all).
    top_p: nucleus sampling, the smallest set of tokens of probability >= p.
    rng: a PRNG key; needed when temperature > 0.

  Returns:
    `[B, P + N]` int32: the prompt, then the new tokens.

  Raises:
    ValueError: on a bad argument (named), or a model variant that cannot decode.
  """
  check_sampling(temperature, top_k, top_p)
  if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
    raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}.")
  if jnp.ndim(prompt) != 2 or not jnp.issubdtype(jnp.asarray(prompt).dtype, jnp.integer) or (
      jnp.shape(prompt)[1] < 1):
    raise ValueError(f"prompt must be [B, P] integer token ids with P >= 1, got shape "
                     f"{list(jnp.shape(prompt))} and dtype {jnp.asarray(prompt).dtype}.")
  if temperature > 0 and rng is None:
    raise ValueError(f"rng must be a PRNG key to sample at temperature {temperature}.")
  decoder = decoding_model(model)
  batch, prompt_len = prompt.shape
  length = prompt_len + max_new_tokens
  if length > decoder.config.max_length:
    raise ValueError(f"prompt length {prompt_len} + max_new_tokens {max_new_tokens} = {length} "
                     f"tokens exceeds the model's max_length={decoder.config.max_length}, the "
                     f"longest sequence its cache and positions cover.")
  cache = empty_cache(decoder, batch, length)
  rng = jax.random.PRNGKey(0) if rng is None else rng  # unused when greedy
  return _generate(decoder, params, cache, jnp.asarray(prompt, jnp.int32), rng,
                   max_new_tokens, temperature, top_k, top_p)


@functools.partial(jax.jit, static_argnums=(0, 5, 6, 7, 8))
def _generate(decoder: nn.Module, params: Any, cache: Any, prompt: Array, rng: jax.Array,
              max_new_tokens: int, temperature: float, top_k: Optional[int],
              top_p: Optional[float]) -> Array:
  sample = functools.partial(sample_logits, temperature=temperature, top_k=top_k, top_p=top_p)

  def feed(cache, tokens):
    logits, state = decoder.apply({"params": params, "cache": cache}, tokens, mutable=["cache"])
    return state["cache"], logits[:, -1]

  cache, logits = feed(cache, prompt)  # the prompt fills the cache in one call
  rng, first_rng = jax.random.split(rng)
  first = sample(logits, first_rng)

  def step(state, step_rng):
    cache, token = state
    cache, logits = feed(cache, token[:, None])
    token = sample(logits, step_rng)
    return (cache, token), token

  _, rest = jax.lax.scan(step, (cache, first), jax.random.split(rng, max_new_tokens - 1))
  return jnp.concatenate([prompt, first[:, None], rest.T.reshape(prompt.shape[0], -1)], axis=1)
