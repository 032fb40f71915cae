"""Composed attention (VARIANTS.md J): exact attention with options that compose.

`composed_attention` is `flex_attention` driven by names a config can hold:

  model.attention = "flex"
  model.attention_options = {"mods": ("alibi",), "local_window_size": (128, 0),
                             "softcap": 30.0, "sinks": True, "qk_norm": "rms"}

is ALiBi, a causal sliding window of 129 keys, soft-capped logits, learned
sinks and RMS-normalised queries and keys with learned scales, one line and
no new variant. Named mods (`NAMED_MODS`): "alibi" (the paper's fixed
slopes), "learned_alibi" (slopes learned from the paper's), "relative_bias"
(T5's bucketed bias, learned) and "prefix_lm" (bidirectional over the first
`prefix_lengths[b]` keys, causal after; the lengths come with each batch
through `attention_arguments`). Documents are `segment_ids` and a window is
`local_window_size`, as for `dot_product`; both also skip blocks.

`ComposedParameters` owns the learned arrays (sink logits, QK-norm scales,
ALiBi slopes, the bias table); the kernel returns their gradients.
"""

from __future__ import annotations

from typing import Optional, Tuple

import flax.linen as nn
import jax

from attention_jax import positional, registry
from attention_jax.core import mods as mod_lib
from attention_jax.flex import QK_NORMS, flex_attention

Array = jax.Array
NAMED_MODS = ("alibi", "learned_alibi", "relative_bias", "prefix_lm")


def composed_attention(query: Array, key: Array, value: Array, bias: Optional[Array] = None,
                       mask: Optional[Array] = None, *, mods: Tuple[str, ...] = (),
                       score_mod: Optional[mod_lib.ScoreMod] = None,
                       softcap: Optional[float] = None, sink_logits: Optional[Array] = None,
                       qk_norm: Optional[str] = None,
                       qk_norm_scales: Optional[Tuple[Array, Array]] = None,
                       normaliser: str = "softmax", sigmoid_bias: Optional[float] = None,
                       local_window_size=None, scale: Optional[float] = None,
                       alibi_slopes: Optional[Array] = None,
                       relative_bias_table: Optional[Array] = None,
                       relative_bias_max_distance: int = 128,
                       prefix_lengths: Optional[Array] = None,
                       implementation: Optional[str] = None, dropout_rate: float = 0.0,
                       dropout_rng: Optional[Array] = None, is_causal: bool = False,
                       query_seq_lengths=None, key_value_seq_lengths=None,
                       segment_ids=None, decoding: bool = False) -> Array:
  """`flex_attention` with named mods: `[B, Tq, H, Dv]`.

  Args:
    query, key, value, bias, mask: as `dot_product_attention`.
    mods: names from `NAMED_MODS`, applied in order.
    score_mod: a score_mod applied before them (`MultiHeadAttention` passes
      its ALiBi or T5 position bias as one).
    softcap, normaliser, sigmoid_bias, qk_norm, qk_norm_scales, scale,
      local_window_size, implementation: as `flex_attention`.
    sink_logits: `[H]` learned sinks (`flex_attention`'s `sinks`), or None.
    alibi_slopes: `[H]` for "learned_alibi" ("alibi" uses the paper's).
    relative_bias_table: `[H, num_buckets]` for "relative_bias", bucketed as
      T5 does up to `relative_bias_max_distance`.
    prefix_lengths: `[B]` for "prefix_lm".
    dropout_rate, dropout_rng: dropout on the weights (blockwise draws it per tile).
    decoding: the layer decodes from a KV cache, where the engine's indices
      are the cache's slots and a step's queries: named mods and windows,
      which read them, are refused (sinks, softcap, QK-norm and the
      normalisers decode).
  """
  mods = tuple(mods)
  if decoding and (mods or local_window_size is not None):
    raise ValueError(f"the flex variant's mods {mods} and local_window_size "
                     f"{local_window_size} read token indices, which a decoding step does not "
                     f"have (a step's queries against the cache's slots); decode without them, "
                     f"or use dot_product with position='alibi' or 't5'.")
  unknown = [m for m in mods if m not in NAMED_MODS]
  if unknown:
    raise ValueError(f"mods must be names from {NAMED_MODS}, got {unknown}.")
  num_heads = query.shape[-2]
  score_mods, mask_mod = [] if score_mod is None else [score_mod], None
  for name in mods:
    if name == "alibi":
      score_mods.append(mod_lib.alibi(positional.alibi_slopes(num_heads)))
    elif name == "learned_alibi":
      score_mods.append(mod_lib.alibi(_required(alibi_slopes, "alibi_slopes", name)))
    elif name == "relative_bias":
      table = _required(relative_bias_table, "relative_bias_table", name)
      bucket = lambda distance: positional.t5_relative_position_bucket(
          distance, bidirectional=not is_causal, num_buckets=table.shape[-1],
          max_distance=relative_bias_max_distance)
      score_mods.append(mod_lib.relative_bias(table, bucket))
    else:  # prefix_lm
      mask_mod = mod_lib.prefix_lm_mask(_required(prefix_lengths, "prefix_lengths", name))

  def chained(score, b, h, q_idx, kv_idx):
    for mod in score_mods:
      score = mod(score, b, h, q_idx, kv_idx)
    return score

  return flex_attention(
      query, key, value, score_mod=chained if score_mods else None, mask_mod=mask_mod,
      scale=scale, softcap=softcap, sinks=sink_logits, qk_norm=qk_norm,
      qk_norm_scales=qk_norm_scales, normaliser=normaliser, sigmoid_bias=sigmoid_bias,
      bias=bias, mask=mask, is_causal=is_causal, query_seq_lengths=query_seq_lengths,
      key_value_seq_lengths=key_value_seq_lengths, local_window_size=local_window_size,
      segment_ids=segment_ids, implementation=implementation, dropout_rate=dropout_rate,
      dropout_rng=dropout_rng)


def _required(array, argument: str, mod: str):
  if array is None:
    raise ValueError(f"mod {mod!r} needs {argument}, got None"
                     + (" (pass it per batch through attention_arguments)."
                        if argument == "prefix_lengths" else "."))
  return array


class ComposedParameters(nn.Module):
  """The learned arrays the options ask for, by name of `composed_attention`'s arguments.

  Attributes:
    mods: the named mods (their tables and slopes are made here).
    sinks: learn one sink logit per head (initialised at 0).
    qk_norm: "rms": a scale per feature for queries and for keys (at 1);
      "l2": one scalar each, the query's at sqrt(D), so that cosine logits
      (with `scale=1.0`) start at the magnitude of q . k / sqrt(D) for
      unit-variance inputs, the key's at 1.
    relative_bias_buckets: the bias table's buckets for "relative_bias".
  """

  mods: Tuple[str, ...] = ()
  sinks: bool = False
  qk_norm: Optional[str] = None
  relative_bias_buckets: int = 32

  @nn.compact
  def __call__(self, query, key, value, deterministic: bool = True) -> dict:
    del key, value, deterministic
    num_heads, head_dim = query.shape[-2], query.shape[-1]
    arrays = {}
    if self.sinks:
      arrays["sink_logits"] = self.param("sink_logits", nn.initializers.zeros, (num_heads,))
    if self.qk_norm is not None:
      if self.qk_norm not in QK_NORMS:
        raise ValueError(f"qk_norm must be one of {QK_NORMS} or None, got {self.qk_norm!r}.")
      shape = (head_dim,) if self.qk_norm == "rms" else ()
      query_init = 1.0 if self.qk_norm == "rms" else float(head_dim) ** 0.5
      arrays["qk_norm_scales"] = (
          self.param("query_norm_scale", nn.initializers.constant(query_init), shape),
          self.param("key_norm_scale", nn.initializers.ones, shape))
    if "learned_alibi" in self.mods:
      arrays["alibi_slopes"] = self.param(
          "alibi_slopes", lambda rng, shape: positional.alibi_slopes(shape[0]), (num_heads,))
    if "relative_bias" in self.mods:
      arrays["relative_bias_table"] = self.param(
          "relative_bias_table", nn.initializers.normal(0.02),
          (num_heads, self.relative_bias_buckets))
    return arrays


registry.register(registry.VariantSpec(
    name="flex", fn=composed_attention, family="composed",
    paper="Dehghani et al. 2023; Gemma Team 2024; Xiao et al. 2024; Ramapuram et al. 2024",
    complexity="O(T^2); O(T w) with a window", subquadratic=False, exact=True, causal=True,
    cross=True, extras=ComposedParameters, takes=("dropout", "score_mod", "decoding"),
    options=dict(
        mods=registry.VariantOption("mods", tuple, (),
                                    f"named mods applied in order, from {NAMED_MODS}"),
        softcap="logits become softcap * tanh(logits / softcap); None: no cap",
        sinks="learn one sink logit per head, a key with no value in every softmax",
        qk_norm="'rms' or 'l2': normalise queries and keys over D, with learned scales",
        normaliser="'softmax', or 'sigmoid' (weights sigmoid(s + b), no normalisation)",
        sigmoid_bias="b of the sigmoid normaliser; -log(Tk) when None",
        local_window_size=registry.VariantOption(
            "local_window_size", tuple, None,
            "(left, right): each query sees keys q - left .. q + right; None for all"),
        scale="multiplies the logits; 1/sqrt(D) when None (set 1.0 with qk_norm='l2')",
        relative_bias_buckets="the learned bias table's buckets ('relative_bias')",
        relative_bias_max_distance="distances beyond it share the last bucket ('relative_bias')",
        implementation="'blockwise' (default) or 'xla' (the dense reference)")))
