"""The implementations of exact attention, and how one is chosen for a call.

`register_implementation(name, fn, ...)` makes `fn(inputs: AttentionInputs)`
selectable as `dot_product_attention(..., implementation=name)`;
`select_implementation` picks the available one of highest priority that
accepts the inputs. "xla" and "cudnn" register themselves in
`variants/dense.py`, the kernels ("blockwise", "pallas", "pallas_mgpu",
"ring") in `kernels/flash_attention/__init__.py`. The registry is in core so
that the kernels, which sit below the variants, register without importing
them.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict, Optional, Tuple, Union

import jax
import jax.numpy as jnp

from attention_jax.core.inputs import AttentionInputs

Array = jnp.ndarray


Priority = Union[int, Callable[[AttentionInputs], int]]


@dataclasses.dataclass(frozen=True)
class Implementation:
  """One way to compute exact attention.

  Attributes:
    fn: `fn(inputs: AttentionInputs, **options) -> [B, Tq, H, Dv]`. With the
      option `return_residual=True` (passed only when asked for) it returns
      `(out, lse)` instead: lse `[B, Tq, H]` float32, the log-sum-exp of each
      query's allowed logits, `MASKED_LOGSUMEXP` where it may attend nothing
      (past `query_seq_lengths` too), differentiable where the fn can.
    is_available: whether it runs on the default backend.
    priority: `implementation=None` takes the highest; a function of the
      inputs where the best choice depends on the shapes.
    rejects: `rejects(inputs)` is None when `fn` takes these inputs, else the
      reason it does not (an unsupported head dim or dtype, say).
    takes_dropout: computes dropout on the attention weights itself.
  """

  fn: Callable[..., Array]
  is_available: Callable[[], bool]
  priority: Priority
  rejects: Callable[[AttentionInputs], Optional[str]]
  takes_dropout: bool = False

  def priority_for(self, inputs: AttentionInputs) -> int:
    return self.priority(inputs) if callable(self.priority) else self.priority


_IMPLEMENTATIONS: Dict[str, Implementation] = {}


def register_implementation(name: str, fn: Callable[..., Array], *,
                            is_available: Callable[[], bool] = lambda: True,
                            priority: Priority = 0,
                            rejects: Callable[[AttentionInputs], Optional[str]] = lambda _: None,
                            takes_dropout: bool = False) -> None:
  """Makes `fn(inputs: AttentionInputs) -> out` selectable as `implementation=name`.

  `fn` also takes `return_residual=True` (see `Implementation.fn`).
  """
  _IMPLEMENTATIONS[name] = Implementation(fn, is_available, priority, rejects, takes_dropout)


def available_implementations() -> Tuple[str, ...]:
  """Implementation names usable on the default backend, by their fixed priority
  (shape-dependent priorities count as 0 here)."""
  fixed = lambda impl: impl.priority if isinstance(impl.priority, int) else 0
  usable = [(fixed(impl), name) for name, impl in _IMPLEMENTATIONS.items() if impl.is_available()]
  return tuple(name for _, name in sorted(usable, reverse=True))


def select_implementation(inputs: AttentionInputs, implementation: Optional[str] = None,
                          dropout: bool = False) -> Tuple[str, Optional[str]]:
  """The implementation that computes `inputs`, and why a better one was passed over.

  Args:
    inputs: validated arguments.
    implementation: a name asked for explicitly, or None to choose.
    dropout: whether dropout on the attention weights is requested.

  Returns:
    `(name, note)`: `note` is None, or the reason the highest-priority
    implementation declined these inputs when `implementation` is None.

  Raises:
    ValueError: an unknown or unavailable name, or one that cannot take these
      inputs (the message gives the reason).
  """
  if implementation is not None:
    if implementation not in _IMPLEMENTATIONS:
      raise ValueError(f"implementation must be one of {sorted(_IMPLEMENTATIONS)} or None, "
                       f"got {implementation!r}.")
    impl = _IMPLEMENTATIONS[implementation]
    if not impl.is_available():
      raise ValueError(f"implementation {implementation!r} is not available on backend "
                       f"{jax.default_backend()!r}; available: {list(available_implementations())}.")
    if dropout and not impl.takes_dropout:
      raise ValueError(f"dropout on attention weights needs implementation='xla', got "
                       f"{implementation!r}.")
    reason = impl.rejects(inputs)
    if reason is not None:
      raise ValueError(f"implementation {implementation!r} cannot take these inputs: {reason}")
    return implementation, None

  candidates = sorted(((impl.priority_for(inputs), name) for name, impl in _IMPLEMENTATIONS.items()
                       if impl.is_available()), reverse=True)
  declined = []
  for _, name in candidates:
    impl = _IMPLEMENTATIONS[name]
    reason = "it takes no dropout" if dropout and not impl.takes_dropout else impl.rejects(inputs)
    if reason is None:
      note = "; ".join(declined) if declined and not dropout else None
      return name, note
    declined.append(f"{name!r} declined: {reason}")
  raise ValueError(f"no implementation takes these inputs: {'; '.join(declined)}")


def registered_implementation(name: str) -> Implementation:
  """The implementation registered as `name` (a name `select_implementation` returned)."""
  return _IMPLEMENTATIONS[name]
