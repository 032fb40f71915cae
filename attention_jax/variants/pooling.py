"""Attention that is not a token mixer (section A of VARIANTS.md): pooling and alignment.

* `attention_pooling` (Yang et al. 2016, HAN; Lin et al. 2017; Conneau et al.
  2017): a learned query (context vector u_w) pools a sequence into one
  vector. u_t = tanh(W x_t + b), a_t = softmax_t(u_t . u_w) over the allowed
  tokens, out = sum_t a_t x_t. Several learned queries (Lin et al.'s r hops,
  sharing W and b) give one pooled vector each, concatenated. The
  hierarchical form of HAN pools the words of each sentence, then the
  sentences: `hierarchical_attention_pooling`, with an optional encoder
  (HAN's bidirectional GRU) before each level.
* `cross_alignment` (Chen et al. 2017, ESIM): soft alignment of two sequences
  both ways, e_ij = a_i . b_j, a~_i = sum_j softmax_j(e_ij) b_j, b~_j = sum_i
  softmax_i(e_ij) a_i, and the enhancement m = [x; x~; x - x~; x * x~].

Neither maps `[B, T, E]` to `[B, T, E]`, so they are registered with a role
other than "mixer" (`registry.ROLES`) and are refused as a block's mixer:

    pool(x [B, T, E], *, mask=None [B, T]) -> [B, F]                    role "pooling"
    align(a [B, Ta, E], b [B, Tb, E], *, a_mask=None, b_mask=None)
      -> (m_a [B, Ta, 4E], m_b [B, Tb, 4E])                               role "alignment"

`AttentionPooling` is what `config.model.pooling = "attention"` runs in a
classifier (with `sentence_length` set, the hierarchical form over
consecutive chunks of the sequence); `HierarchicalAttentionPooling` is HAN's
document model on `[B, S, W, E]` input with its GRU encoders.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from attention_jax import registry
from attention_jax.core import masks as mask_lib
from attention_jax.core.inputs import check_lengths
from attention_jax.core.softmax import masked_softmax
from attention_jax.variants import common

Array = jnp.ndarray
Dtype = Any
# encoder(x [N, L, E], mask [N, L] bool or None) -> [N, L, E']: what runs over the
# words of each sentence (or the sentences of each document) before pooling.
Encoder = Callable[[Array, Optional[Array]], Array]


def _shape_error(name: str, value, expected: str) -> ValueError:
  return ValueError(f"{name} must have shape {expected}, got shape {list(jnp.shape(value))}.")


def valid_tokens(mask: Optional[Array], lengths: Optional[Array], batch: int, length: int, *,
                 mask_name: str = "mask", lengths_name: str = "lengths") -> Optional[Array]:
  """The tokens that may be attended to, `[B, T]` bool, or None when all may.

  Args:
    mask: `[B, T]` bool, True for real tokens (padding anywhere), or None.
    lengths: `[B]` valid lengths (padding at the end), or None.
    batch, length: B and T of the sequence.
    mask_name, lengths_name: the arguments' names, for the messages.

  Raises:
    ValueError: on a mask that is not boolean `[B, T]` or lengths that are not `[B]`
      (never broadcast: a `[1, T]` mask for a batch is a bug more often than not),
      lengths that are not integers, or (where concrete) not in [0, T].
  """
  valid = None
  if lengths is not None:
    if tuple(jnp.shape(lengths)) != (batch,):
      raise _shape_error(lengths_name, lengths, f"[B] = [{batch}]")
    # `arange(T) < lengths` would take anything: 2.5 keeps 3 tokens, True 1, a
    # count past T or below 0 all or none.
    check_lengths(lengths_name, lengths, batch, length)
    valid = mask_lib.length_predicate(jnp.arange(length)[None, :],
                                      jnp.asarray(lengths)[:, None])
  if mask is not None:
    if tuple(jnp.shape(mask)) != (batch, length):
      raise _shape_error(mask_name, mask, f"[B, T] = [{batch}, {length}]")
    if jnp.result_type(mask) != jnp.bool_:
      raise ValueError(f"{mask_name} must be boolean (True for real tokens), got dtype "
                       f"{jnp.result_type(mask)}.")
    valid = mask_lib.and_masks(valid, jnp.asarray(mask))
  return valid


# --------------------------------------------------------------------------------------
# Attention pooling.


def attention_pooling(x: Array, context_vector: Array, kernel: Array, bias: Optional[Array] = None,
                      mask: Optional[Array] = None, *, lengths: Optional[Array] = None,
                      return_weights: bool = False):
  """Pools a sequence with learned queries: sum_t softmax_t(tanh(W x_t + b) . u) x_t.

  Only `[B, T, A]` and `[B, H, T]` arrays are built (O(T), never T x T).

  Args:
    x: `[B, T, E]` the sequence (e.g. a sentence's word encodings).
    context_vector: u `[A]` (one query, HAN's u_w) or `[H, A]` (H queries,
      Lin et al.'s r hops).
    kernel: W `[E, A]`, shared by the queries.
    bias: b `[A]`, or None for none.
    mask: `[B, T]` bool, True for the tokens that may be pooled; padded tokens
      get weight 0.
    lengths: `[B]` valid lengths (padding at the end), combined with `mask`.
    return_weights: also return the weights.

  Returns:
    `[B, E]` for a `[A]` context vector, `[B, H * E]` for `[H, A]` (query h's
    pooled vector at `[h * E, (h + 1) * E)`), in x's dtype; with
    `return_weights`, also the float32 weights `[B, T]` or `[B, H, T]`, which
    sum to 1 over the allowed tokens. A sequence with no allowed token pools to
    zeros (weights 0), never NaN.
  """
  if jnp.ndim(x) != 3:
    raise _shape_error("x", x, "[B, T, E]")
  batch, length, features = x.shape
  if jnp.ndim(kernel) != 2 or jnp.shape(kernel)[0] != features:
    raise _shape_error("kernel", kernel, f"[E, A] with E = {features} (x's last size)")
  attention_dim = kernel.shape[1]
  if bias is not None and tuple(jnp.shape(bias)) != (attention_dim,):
    raise _shape_error("bias", bias, f"[A] = [{attention_dim}]")
  single = jnp.ndim(context_vector) == 1
  if jnp.ndim(context_vector) not in (1, 2) or jnp.shape(context_vector)[-1] != attention_dim:
    raise _shape_error("context_vector", context_vector,
                       f"[A] or [H, A] with A = {attention_dim} (kernel's last size)")
  valid = valid_tokens(mask, lengths, batch, length)

  hidden = jnp.einsum("bte,ea->bta", x, kernel.astype(x.dtype))  # u_t before the tanh
  if bias is not None:
    hidden = hidden + bias.astype(x.dtype)
  queries = jnp.atleast_2d(context_vector).astype(x.dtype)  # [H, A]
  logits = jnp.einsum("bta,ha->bht", jnp.tanh(hidden), queries,
                      preferred_element_type=jnp.float32)
  weights = masked_softmax(logits, None if valid is None else valid[:, None, :])  # [B, H, T]
  pooled = jnp.einsum("bht,bte->bhe", weights.astype(x.dtype), x,
                      preferred_element_type=jnp.float32).astype(x.dtype)
  if single:
    pooled, weights = pooled[:, 0], weights[:, 0]
  else:
    pooled = pooled.reshape(batch, -1)
  return (pooled, weights) if return_weights else pooled


def hierarchical_attention_pooling(x: Array, word_parameters: Dict[str, Array],
                                   sentence_parameters: Dict[str, Array],
                                   word_mask: Optional[Array] = None, *,
                                   word_encoder: Optional[Encoder] = None,
                                   sentence_encoder: Optional[Encoder] = None) -> Array:
  """HAN's document vector: attention-pool the words of each sentence, then the sentences.

  sentence_s = attention_pooling(word_encoder(words of s)); document =
  attention_pooling(sentence_encoder(sentences)). A sentence with no real
  word pools to zeros and is masked out of the sentence level, so it gets
  weight 0; a document with no real word pools to zeros (never NaN).

  Args:
    x: `[B, S, W, E]`, S sentences of W words.
    word_parameters, sentence_parameters: the keyword arrays of
      `attention_pooling` at each level: `{"context_vector", "kernel", "bias"}`
      (bias optional). The sentence kernel's input size is the word level's
      output size.
    word_mask: `[B, S, W]` bool, True for real words; None: all real.
    word_encoder: `encoder(words [B * S, W, E], mask [B * S, W]) -> [B * S, W, E']`
      run before the word pooling (HAN's bidirectional GRU), or None.
    sentence_encoder: the same over the sentences, `[B, S, E'']`, or None.

  Returns:
    `[B, F]`, the pooled width of the sentence level, in x's dtype.
  """
  if jnp.ndim(x) != 4:
    raise _shape_error("x", x, "[B, S, W, E] (S sentences of W words)")
  batch, sentences, words, features = x.shape
  if word_mask is not None and tuple(jnp.shape(word_mask)) != (batch, sentences, words):
    raise _shape_error("word_mask", word_mask, f"[B, S, W] = [{batch}, {sentences}, {words}]")
  if word_mask is not None and jnp.result_type(word_mask) != jnp.bool_:
    raise ValueError(f"word_mask must be boolean (True for real words), got dtype "
                     f"{jnp.result_type(word_mask)}.")
  word_valid = None if word_mask is None else jnp.reshape(word_mask, (batch * sentences, words))
  encoded = jnp.reshape(x, (batch * sentences, words, features))
  if word_encoder is not None:
    encoded = word_encoder(encoded, word_valid)
  pooled = _pool_level("word", encoded, word_parameters, word_valid)
  pooled = jnp.reshape(pooled, (batch, sentences, pooled.shape[-1]))  # [B, S, E']
  sentence_valid = None if word_mask is None else jnp.any(jnp.asarray(word_mask), axis=-1)
  if sentence_encoder is not None:
    pooled = sentence_encoder(pooled, sentence_valid)
  return _pool_level("sentence", pooled, sentence_parameters, sentence_valid)


def _pool_level(level: str, x: Array, parameters: Dict[str, Array],
                valid: Optional[Array]) -> Array:
  """`attention_pooling` of one level, its parameters checked by name first."""
  unknown = set(parameters) - {"context_vector", "kernel", "bias"}
  if unknown or not {"context_vector", "kernel"} <= set(parameters):
    raise ValueError(f"{level}_parameters must hold 'context_vector', 'kernel' and optionally "
                     f"'bias', got keys {sorted(parameters)}.")
  try:
    return attention_pooling(x, mask=valid, **parameters)
  except ValueError as e:  # say which level's arrays do not fit
    raise ValueError(f"{level} level: {e}") from e


_KERNEL_INIT = nn.initializers.lecun_normal()
# Each query [A] is a unit-variance projection of u_t's A entries.
_QUERY_INIT = nn.initializers.lecun_normal(in_axis=-1, out_axis=-1, batch_axis=(0,))


def _pooling_parameters(module: nn.Module, prefix: str, features: int,
                        attention_dim: Optional[int], num_queries: int,
                        dtype: Dtype) -> Dict[str, Array]:
  """One level's W `[E, A]`, b `[A]` and queries `[H, A]` as parameters of `module`."""
  width = common.check_size(f"{prefix}attention_dim", attention_dim or features)
  num_queries = common.check_size("num_queries", num_queries)
  return {"kernel": module.param(f"{prefix}kernel", _KERNEL_INIT, (features, width), dtype),
          "bias": module.param(f"{prefix}bias", nn.initializers.zeros_init(), (width,), dtype),
          "context_vector": module.param(f"{prefix}context_vector", _QUERY_INIT,
                                         (num_queries, width), dtype)}


class AttentionPooling(nn.Module):
  """Pooling with learned queries: `[B, T, E]` -> `[B, num_queries * E]`.

  The registered module of `attention_pooling` (role "pooling"), and what a
  classifier with `model.pooling = "attention"` pools with. Several queries
  share W and b and their pooled vectors are concatenated (Lin et al. 2017's
  r hops, whose matrix M = A H is flattened): averaging them instead would
  be one pooling with averaged weights, which a single query can learn.

  With `sentence_length` L, the hierarchical form (HAN without its GRUs):
  the sequence is cut into ceil(T / L) consecutive chunks ("sentences") of L
  tokens (the last one padded), each chunk is pooled with one query (the
  "word_" parameters), and the chunks are pooled with `num_queries` queries
  (the "sentence_" parameters). Chunks with no real token get weight 0.

  Attributes:
    num_queries: H learned queries; their pooled vectors are concatenated.
    attention_dim: A, the width of u_t = tanh(W x_t + b); E when None.
    sentence_length: None for one level; L for two (words, then chunks of L).
    dtype: the computation dtype; x's when None.
    param_dtype: the parameters' dtype.
  """

  num_queries: int = 1
  attention_dim: Optional[int] = None
  sentence_length: Optional[int] = None
  dtype: Optional[Dtype] = None
  param_dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, x: Array, *, mask: Optional[Array] = None,
               lengths: Optional[Array] = None) -> Array:
    """x: `[B, T, E]`; mask: `[B, T]` bool, True for real tokens; lengths: `[B]`.

    Returns:
      `[B, num_queries * E]`.
    """
    if jnp.ndim(x) != 3:
      raise _shape_error("x", x, "[B, T, E]")
    x = x.astype(self.dtype or x.dtype)
    batch, length, features = x.shape
    valid = valid_tokens(mask, lengths, batch, length)
    if self.sentence_length is None:
      return attention_pooling(x, mask=valid, **_pooling_parameters(
          self, "", features, self.attention_dim, self.num_queries, self.param_dtype))
    chunk = common.check_size("sentence_length", self.sentence_length)
    chunks = -(-length // chunk)
    padding = chunks * chunk - length
    valid = jnp.ones((batch, length), bool) if valid is None else valid
    x = jnp.pad(x, ((0, 0), (0, padding), (0, 0))).reshape(batch, chunks, chunk, features)
    valid = jnp.pad(valid, ((0, 0), (0, padding))).reshape(batch, chunks, chunk)
    word = _pooling_parameters(self, "word_", features, self.attention_dim, 1, self.param_dtype)
    sentence = _pooling_parameters(self, "sentence_", features, self.attention_dim,
                                   self.num_queries, self.param_dtype)
    return hierarchical_attention_pooling(x, word, sentence, valid)


ENCODERS = ("gru", "none")


def check_suffix_padding(name: str, mask: Optional[Array]) -> None:
  """A recurrent encoder reads the first `sum(mask)` entries of each row, so its
  padding must be at the end: checked when `mask` is concrete (under `jax.jit`
  it is a traced value and cannot be)."""
  if mask is None or isinstance(mask, jax.core.Tracer):
    return
  mask = np.asarray(mask)
  prefix = np.arange(mask.shape[-1]) < mask.sum(-1, keepdims=True)
  if not np.array_equal(mask, prefix):
    raise ValueError(f"{name} must pad at the end of each row when encoder='gru' (the GRU "
                     f"reads the first sum({name}) entries), got padding before a real entry; "
                     f"use encoder='none' for padding anywhere.")


class BidirectionalGRU(nn.Module):
  """HAN's encoder, an `Encoder`: a GRU each way, outputs concatenated.
  `[N, L, E]` -> `[N, L, 2 * hidden_dim]`; each row reads its first sum(mask)
  entries (the backward GRU starts at the last of them).

  Attributes:
    hidden_dim: units per direction.
    dtype, param_dtype: of the GRU cells.
  """

  hidden_dim: int
  dtype: Optional[Dtype] = None
  param_dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, x: Array, mask: Optional[Array] = None) -> Array:
    cell = lambda: nn.GRUCell(self.hidden_dim, dtype=self.dtype, param_dtype=self.param_dtype)
    lengths = None if mask is None else jnp.sum(mask, axis=-1, dtype=jnp.int32)
    return nn.Bidirectional(nn.RNN(cell()), nn.RNN(cell()))(x, seq_lengths=lengths)


class HierarchicalAttentionPooling(nn.Module):
  """HAN's document model (Yang et al. 2016): `[B, S, W, E]` -> `[B, num_queries * F]`.

  Word encoder (a bidirectional GRU, `hidden_dim` units each way) over each
  sentence, word attention pooling, sentence encoder (another bidirectional
  GRU) over the sentence vectors, sentence attention pooling. With
  `encoder="none"` the two pools run on the inputs directly. The word level
  has one query (HAN's u_w); the sentence level `num_queries`, concatenated.

  Padded words and sentences with no real word get weight 0. With the GRUs,
  padding must be at the end (of each sentence's words, of each document's
  sentences), as the GRU reads the first sum(mask) entries; that is checked
  when the mask is concrete.

  Attributes:
    encoder: one of `ENCODERS`, "gru" (HAN) or "none".
    hidden_dim: GRU units per direction; the levels' outputs are 2 * hidden_dim
      wide. None: E // 2 (at least 1).
    num_queries: learned queries of the sentence level.
    attention_dim: A of both levels; the width pooled when None.
    dtype, param_dtype: as `AttentionPooling`.
  """

  encoder: str = "gru"
  hidden_dim: Optional[int] = None
  num_queries: int = 1
  attention_dim: Optional[int] = None
  dtype: Optional[Dtype] = None
  param_dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, x: Array, *, word_mask: Optional[Array] = None) -> Array:
    """x: `[B, S, W, E]`; word_mask: `[B, S, W]` bool, True for real words.

    Returns:
      `[B, num_queries * F]`: F = 2 * hidden_dim with the GRUs, E without.
    """
    if self.encoder not in ENCODERS:
      raise registry.unknown_name_error("encoder", self.encoder, ENCODERS)
    if jnp.ndim(x) != 4:
      raise _shape_error("x", x, "[B, S, W, E] (S sentences of W words)")
    x = x.astype(self.dtype or x.dtype)
    width = x.shape[-1]
    word_encoder = sentence_encoder = None
    if self.encoder == "gru":
      hidden = common.check_size("hidden_dim", self.hidden_dim or max(width // 2, 1))
      if word_mask is not None and not isinstance(word_mask, jax.core.Tracer):
        check_suffix_padding("word_mask", word_mask)
        check_suffix_padding("any(word_mask, -1)", np.any(word_mask, -1))
      word_encoder = BidirectionalGRU(hidden, self.dtype, self.param_dtype, name="word_encoder")
      sentence_encoder = BidirectionalGRU(hidden, self.dtype, self.param_dtype,
                                          name="sentence_encoder")
      width = 2 * hidden
    word = _pooling_parameters(self, "word_", width, self.attention_dim, 1, self.param_dtype)
    sentence = _pooling_parameters(self, "sentence_", width, self.attention_dim,
                                   self.num_queries, self.param_dtype)
    return hierarchical_attention_pooling(x, word, sentence, word_mask,
                                          word_encoder=word_encoder,
                                          sentence_encoder=sentence_encoder)


# --------------------------------------------------------------------------------------
# Cross alignment (ESIM).


def enhance(x: Array, aligned: Array) -> Array:
  """ESIM's local inference enhancement [x; x~; x - x~; x * x~]: `[..., E]` x 2 -> `[..., 4E]`."""
  return jnp.concatenate([x, aligned, x - aligned, x * aligned], axis=-1)


def cross_alignment(a: Array, b: Array, a_mask: Optional[Array] = None,
                    b_mask: Optional[Array] = None, *, a_lengths: Optional[Array] = None,
                    b_lengths: Optional[Array] = None,
                    enhanced: bool = True) -> Tuple[Array, Array]:
  """ESIM's soft alignment of two sequences, both ways.

  e_ij = a_i . b_j; a~_i = sum_j softmax_j(e_ij) b_j over the real j;
  b~_j = sum_i softmax_i(e_ij) a_i over the real i. The scores are
  `[B, Ta, Tb]`, O(Ta Tb) like dense attention.

  Args:
    a: `[B, Ta, E]` (e.g. the premise's encodings); b: `[B, Tb, E]` (the hypothesis').
    a_mask, b_mask: `[B, Ta]`, `[B, Tb]` bool, True for real tokens, or None.
    a_lengths, b_lengths: `[B]` valid lengths (padding at the end), or None.
    enhanced: return ESIM's enhancement `[x; x~; x - x~; x * x~]` of each
      side; False: the aligned vectors `(a~, b~)` alone.

  Returns:
    `(m_a [B, Ta, 4E], m_b [B, Tb, 4E])`, or `(a~ [B, Ta, E], b~ [B, Tb, E])`
    when not `enhanced`; in a's dtype. Padded tokens of either side get
    weight 0; a padded token's own aligned vector, and every aligned vector
    when the other side has no real token, is zero (never NaN), so its
    enhancement is [x; 0; x; 0].
  """
  if jnp.ndim(a) != 3 or jnp.ndim(b) != 3:
    raise ValueError(f"a and b must be [B, T, E], got shapes {list(jnp.shape(a))} and "
                     f"{list(jnp.shape(b))}.")
  if a.shape[0] != b.shape[0] or a.shape[2] != b.shape[2]:
    raise ValueError(f"b must have a's batch and feature sizes, [B, Tb, E] = "
                     f"[{a.shape[0]}, *, {a.shape[2]}], got shape {list(b.shape)}.")
  batch = a.shape[0]
  a_valid = valid_tokens(a_mask, a_lengths, batch, a.shape[1], mask_name="a_mask",
                         lengths_name="a_lengths")
  b_valid = valid_tokens(b_mask, b_lengths, batch, b.shape[1], mask_name="b_mask",
                         lengths_name="b_lengths")
  b = b.astype(a.dtype)
  scores = jnp.einsum("bie,bje->bij", a, b, preferred_element_type=jnp.float32)
  # One pairwise mask for both directions: (i, j) counts when both are real.
  allowed = mask_lib.and_masks(None if a_valid is None else a_valid[:, :, None],
                               None if b_valid is None else b_valid[:, None, :])
  a_weights = masked_softmax(scores, allowed, axis=2)  # over j, for each i
  b_weights = masked_softmax(scores, allowed, axis=1)  # over i, for each j
  a_aligned = jnp.einsum("bij,bje->bie", a_weights.astype(a.dtype), b,
                         preferred_element_type=jnp.float32).astype(a.dtype)
  b_aligned = jnp.einsum("bij,bie->bje", b_weights.astype(a.dtype), a,
                         preferred_element_type=jnp.float32).astype(a.dtype)
  if not enhanced:
    return a_aligned, b_aligned
  return enhance(a, a_aligned), enhance(b, b_aligned)


class CrossAlignment(nn.Module):
  """ESIM's soft alignment (role "alignment"); it has no parameters.

  Attributes:
    enhanced: return `[x; x~; x - x~; x * x~]` (`[B, T, 4E]`); False: `(a~, b~)`.
  """

  enhanced: bool = True

  def __call__(self, a: Array, b: Array, *, a_mask: Optional[Array] = None,
               b_mask: Optional[Array] = None, a_lengths: Optional[Array] = None,
               b_lengths: Optional[Array] = None) -> Tuple[Array, Array]:
    """a: `[B, Ta, E]`, b: `[B, Tb, E]`; masks `[B, Ta]`, `[B, Tb]`; lengths `[B]`.

    Returns:
      `(m_a [B, Ta, 4E], m_b [B, Tb, 4E])` (`(a~, b~)` when not `enhanced`).
    """
    return cross_alignment(a, b, a_mask, b_mask, a_lengths=a_lengths, b_lengths=b_lengths,
                           enhanced=self.enhanced)


registry.register(registry.VariantSpec(
    name="attention_pooling", fn=attention_pooling, family="scoring", role="pooling",
    complexity="O(T)", subquadratic=True, exact=False, causal=False, cross=False,
    paper="Yang et al. 2016; Lin et al. 2017; Conneau et al. 2017", qkv=False,
    mixer=AttentionPooling,
    options=dict(num_queries="H learned queries sharing W and b; their pooled vectors are "
                             "concatenated ([B, H * E])",
                 attention_dim="A, the width of tanh(W x + b); the input width E when None",
                 sentence_length="None: one level; L: HAN's two levels, pooling chunks of L "
                                 "tokens, then the chunks")))
registry.register(registry.VariantSpec(
    name="cross_alignment", fn=cross_alignment, family="scoring", role="alignment",
    complexity="O(T^2)", subquadratic=False, exact=False, causal=False, cross=True,
    paper="Chen et al. 2017", qkv=False, mixer=CrossAlignment,
    options=dict(enhanced="return [x; x~; x - x~; x * x~] (4E wide); False: the aligned "
                          "vectors (a~, b~) alone")))
