"""Transformer encoder block: a token mixer chosen by name, then a feed-forward layer."""

from __future__ import annotations

from typing import Any, Mapping, Optional

import flax.linen as nn
import jax.numpy as jnp
from flax.core import FrozenDict

from attention_jax import registry
from attention_jax.layers.feedforward import FeedForward
from attention_jax.layers.norms import make_norm

Array = jnp.ndarray
Dtype = Any


class EncoderBlock(nn.Module):
  """Mixer and feed-forward sub-layers, each in a residual branch.

  Pre-LN (Xiong et al. 2020): `x + f(norm(x))`, which trains without warm-up
  and needs a final norm after the last block. Post-LN (Vaswani et al. 2017):
  `norm(x + f(x))`. Sub-modules are named `attention_norm`, `attention`,
  `mlp_norm` and `mlp`.

  Attributes:
    num_heads: heads of the mixer.
    mlp_dim: hidden size of the feed-forward layer.
    attention: registered variant name of the mixer.
    attention_options: options of the variant's function (see `MultiHeadAttention`).
    num_kv_heads: key/value heads (grouped-query attention); the variant's default if None.
    position: relative position scheme of the mixer: None, "rope", "alibi" or "t5".
    position_options: options of that scheme.
    activation: feed-forward activation (see `feedforward.ACTIVATIONS`).
    norm: "layernorm" or "rmsnorm".
    pre_norm: pre-LN if True, post-LN otherwise.
    dropout_rate: dropout on each branch's output before the residual sum, and on
      the feed-forward hidden activations.
    attention_dropout_rate: dropout on the attention weights.
    dtype, param_dtype: computation and parameter dtypes.
  """

  num_heads: int
  mlp_dim: int
  attention: str = "dot_product"
  attention_options: Mapping[str, Any] = FrozenDict()
  num_kv_heads: Optional[int] = None
  position: Optional[str] = None
  position_options: Mapping[str, Any] = FrozenDict()
  activation: str = "gelu"
  norm: str = "layernorm"
  pre_norm: bool = True
  dropout_rate: float = 0.0
  attention_dropout_rate: float = 0.0
  dtype: Optional[Dtype] = None
  param_dtype: Dtype = jnp.float32

  def _mixer_kwargs(self) -> dict:
    kwargs = dict(num_heads=self.num_heads, dropout_rate=self.attention_dropout_rate,
                  dtype=self.dtype, param_dtype=self.param_dtype)
    # Only what is set: a None here must not override a variant's preset
    # (multi_query presets num_kv_heads=1), and mixers that are not Q/K/V
    # attention need not accept options they have no use for.
    optional = dict(num_kv_heads=self.num_kv_heads, position=self.position,
                    attention_options=self.attention_options,
                    position_options=self.position_options)
    kwargs.update({k: v for k, v in optional.items() if v})
    return kwargs

  @nn.compact
  def __call__(
      self,
      x: Array,
      *,
      mask: Optional[Array] = None,
      is_causal: bool = False,
      segment_ids: Optional[Array] = None,
      query_seq_lengths: Optional[Array] = None,
      key_value_seq_lengths: Optional[Array] = None,
      positions: Optional[Array] = None,
      deterministic: bool = True,
  ) -> Array:
    """x: `[B, T, E]` -> `[B, T, E]`; the other arguments go to the mixer
    (see `MultiHeadAttention.__call__`)."""
    if x.ndim != 3:
      raise ValueError(f"x must be [B, T, E], got shape {x.shape}.")
    mixer_args = dict(mask=mask, segment_ids=segment_ids, query_seq_lengths=query_seq_lengths,
                      key_value_seq_lengths=key_value_seq_lengths, positions=positions)
    mixer_args = {k: v for k, v in mixer_args.items() if v is not None}
    if is_causal:
      mixer_args["is_causal"] = True
    mixer = registry.get_variant(self.attention).module(**self._mixer_kwargs(), name="attention")
    mlp = FeedForward(self.mlp_dim, activation=self.activation, dropout_rate=self.dropout_rate,
                      dtype=self.dtype, param_dtype=self.param_dtype, name="mlp")
    attention_norm = make_norm(self.norm, self.dtype, param_dtype=self.param_dtype,
                               name="attention_norm")
    mlp_norm = make_norm(self.norm, self.dtype, param_dtype=self.param_dtype, name="mlp_norm")
    dropout = nn.Dropout(self.dropout_rate)

    def attend(y):
      return mixer(y, deterministic=deterministic, **mixer_args)

    def feed_forward(y):
      return mlp(y, deterministic=deterministic)

    for branch, norm in ((attend, attention_norm), (feed_forward, mlp_norm)):
      if self.pre_norm:
        x = x + dropout(branch(norm(x)), deterministic=deterministic)
      else:
        x = norm(x + dropout(branch(x), deterministic=deterministic))
      x = nn.with_logical_constraint(x, ("batch", "length", "embed"))
    return x
