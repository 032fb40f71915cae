"""The input contract of the chunkwise recurrent mixers' recurrence,

    S_t = (diag(exp(g_t)) + w_t r_t^T) S_{t-1} + k_t v_t^T,      o_t = S_t^T q_t,

shared by its pure-JAX forms (`attention_jax.variants.chunkwise.engine`) and
its Pallas kernels (`attention_jax.kernels.chunkwise`), which sit below the
variants and so cannot import the engine.

Shapes: query and key `[B, T, H, Dk]`, value `[B, T, H, Dv]`, log_decay
`[B, T, H]` (one decay per head) or `[B, T, H, Dk]` (one per key dimension),
read_key and write_key `[B, T, H, Dk]`, state `[B, H, Dk, Dv]`.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

Array = jax.Array


def check_inputs(query: Array, key: Array, value: Array, log_decay: Array,
                 read_key: Optional[Array] = None, write_key: Optional[Array] = None,
                 initial_state: Optional[Array] = None) -> None:
  """Raises a ValueError naming the first array whose shape does not fit the
  recurrence (the shapes in the module docstring)."""
  if jnp.ndim(query) != 4:
    raise ValueError(f"query must be [B, T, H, Dk], got shape {list(jnp.shape(query))}.")
  batch, length, heads, key_dim = query.shape
  value_dim = jnp.shape(value)[-1]
  expected = {"key": (batch, length, heads, key_dim), "value": (batch, length, heads, value_dim)}
  if read_key is not None or write_key is not None:
    if read_key is None or write_key is None:
      raise ValueError("read_key and write_key come together (the rank-one transition "
                       "w r^T); got only one of them.")
    expected.update(read_key=(batch, length, heads, key_dim),
                    write_key=(batch, length, heads, key_dim))
  arrays = dict(key=key, value=value, read_key=read_key, write_key=write_key)
  for name, shape in expected.items():
    if tuple(jnp.shape(arrays[name])) != shape:
      raise ValueError(f"{name} must be {list(shape)} (query's [B, T, H, Dk] = "
                       f"{list(query.shape)}), got shape {list(jnp.shape(arrays[name]))}.")
  if tuple(jnp.shape(log_decay)) not in ((batch, length, heads), (batch, length, heads, key_dim)):
    raise ValueError(f"log_decay must be [B, T, H] = {[batch, length, heads]} (one decay per "
                     f"head) or [B, T, H, Dk] = {[batch, length, heads, key_dim]} (one per key "
                     f"dimension), got shape {list(jnp.shape(log_decay))}.")
  if initial_state is not None and tuple(jnp.shape(initial_state)) != (batch, heads, key_dim,
                                                                        value_dim):
    raise ValueError(f"initial_state must be [B, H, Dk, Dv] = "
                     f"{[batch, heads, key_dim, value_dim]}, got shape "
                     f"{list(jnp.shape(initial_state))}.")
