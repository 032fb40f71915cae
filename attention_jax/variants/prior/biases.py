"""Priors added to the dot-product logits: dot-product attention (masks,
padding and dropout all `dot_product_attention`'s) with a learned bias.

Gaussian Transformer (Guo et al. 2019), `gaussian_transformer`: the learned
distance prior -|w (i - j)^2 + b| (w, b per head) added to the logits, O(T^2).

Localness modelling (Yang et al. 2018), `gaussian_local`: the Gaussian bias
-(j - P_i)^2 / (2 sigma_i^2) whose centre P_i and width sigma_i each query
predicts from its own projection, O(T^2).

Conditionally adaptive attention (Pilault et al. 2021), `conditional_adapter`:
a learned block-diagonal bias whose blocks a FiLM of each example's task
embedding modulates; the task ids come per call
(`attention_arguments={"task_ids": ids}`), O(T^2).
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from attention_jax import registry
from attention_jax.variants import common
from attention_jax.flex import flex_attention
from attention_jax.variants.dense import dot_product_attention
from attention_jax.variants.prior.synthesizer import PER_HEAD_KERNEL

Array = jnp.ndarray
Dtype = Any
_FLEX_OPTION = ("None: the dense form (the reference); 'blockwise' or 'xla': flex_attention "
                "with the prior as its score_mod, never a [B, H, Tq, Tk] prior")


# --------------------------------------------------------------------------------------
# Priors added to the dot-product logits.


def _prior_attention(query: Array, key: Array, value: Array, prior: Array,
                     bias: Optional[Array], mask: Optional[Array], *, scale: Optional[float],
                     **kwargs) -> Array:
  """`dot_product_attention` with `prior` `[B|1, H, Tq, Tk]` added to its logits
  (and to `bias`): the masks, padding and dropout in `kwargs` are its."""
  if bias is not None:
    prior = prior + jnp.asarray(bias, jnp.float32)
  return dot_product_attention(query, key, value, prior, mask, scale=scale, **kwargs)


def _prior_on_flex(variant: str, query: Array, key: Array, value: Array, prior_mod,
                   bias: Optional[Array], mask: Optional[Array], *, scale: Optional[float],
                   implementation: str, dropout_rate: float = 0.0, dropout_rng=None,
                   **kwargs) -> Array:
  """The prior as a score_mod of `flex_attention` (`implementation` one of its
  kernels): the `[B, H, Tq, Tk]` prior is never built; the arrays `prior_mod`
  closes over get their gradients from the kernel."""
  del dropout_rng
  if dropout_rate:
    raise ValueError(f"{variant}: dropout on the attention weights runs on implementation=None "
                     f"(the dense form), got dropout_rate={dropout_rate} with "
                     f"implementation={implementation!r}.")
  return flex_attention(query, key, value, score_mod=prior_mod, bias=bias, mask=mask,
                        scale=scale, implementation=implementation, **kwargs)


# --------------------------------------------------------------------------------------
# Gaussian Transformer: a learned prior on the distance i - j.


def gaussian_transformer_attention(query: Array, key: Array, value: Array,
                                   bias: Optional[Array] = None, mask: Optional[Array] = None, *,
                                   distance_weight: Array, distance_bias: Array,
                                   query_positions: Optional[Array] = None,
                                   scale: Optional[float] = None,
                                   implementation: Optional[str] = None, **kwargs) -> Array:
  """The Gaussian Transformer's attention (Guo et al. 2019):

      out = softmax(q k^T * scale - |w_h (i - j)^2 + b_h| + bias, masked) v,

  a Gaussian-shaped prior on the distance between query position i and key
  position j (w > 0, b = 0: exp(-w (i - j)^2) times the dot-product weights;
  b < 0 moves the peak to |i - j| = sqrt(-b / w)). w = b = 0 is dot-product
  attention. The prior is a bias for `dot_product_attention`, so masks,
  padding and dropout are its.

  Args:
    query, key, value, bias, mask: as in `dot_product_attention`.
    distance_weight: w `[H]`, one per query head.
    distance_bias: b `[H]`.
    query_positions: `[Tq]` or `[B, Tq]`, the positions i of the queries
      (`arange(Tq)` when None; `MultiHeadAttention` passes its positions,
      offset while decoding); key j is at position j.
    scale: logit scale, 1/sqrt(D) when None.
    implementation: None, the dense form above (the reference); or a kernel
      of `flex_attention` ("blockwise", ...), the prior its score_mod.
    **kwargs: the masks of `dot_product_attention` (is_causal,
      query_seq_lengths, key_value_seq_lengths, segment_ids) and dropout.

  Returns:
    `[B, Tq, H, Dv]`.
  """
  batch, q_len, num_heads = query.shape[:3]
  common.check_per_head("distance_weight", distance_weight, (num_heads,))
  common.check_per_head("distance_bias", distance_bias, (num_heads,))
  positions = common.query_positions(query_positions, batch, q_len)
  if implementation is not None:
    weight = jnp.asarray(distance_weight, jnp.float32)
    offset = jnp.asarray(distance_bias, jnp.float32)

    def distance_prior(score, b, h, q_idx, kv_idx):
      squared = jnp.square(positions[b, q_idx] - kv_idx.astype(jnp.float32))
      return score - jnp.abs(weight[h] * squared + offset[h])

    return _prior_on_flex("gaussian_transformer", query, key, value, distance_prior, bias, mask,
                          scale=scale, implementation=implementation, **kwargs)
  squared = jnp.square(positions[:, :, None] - jnp.arange(key.shape[1], dtype=jnp.float32))
  weight = jnp.asarray(distance_weight, jnp.float32)[None, :, None, None]
  offset = jnp.asarray(distance_bias, jnp.float32)[None, :, None, None]
  prior = -jnp.abs(weight * squared[:, None] + offset)  # [B, H, Tq, Tk]
  return _prior_attention(query, key, value, prior, bias, mask, scale=scale, **kwargs)


class GaussianDistancePrior(nn.Module):
  """`gaussian_transformer`'s w and b, `[H]` each, learned.

  They start at `initial_weight` and `initial_bias` rather than zero: the
  gradient of |w d^2 + b| vanishes at w = b = 0 (d|x|/dx is taken as 0 there),
  so a prior started at zero would never move.

  Attributes:
    initial_weight: w at initialisation (0.1: the weight of a key 3 positions
      away is multiplied by exp(-0.9)).
    initial_bias: b at initialisation.
  """

  initial_weight: float = 0.1
  initial_bias: float = 0.0

  @nn.compact
  def __call__(self, query, key, value, deterministic: bool = True) -> dict:
    del key, value, deterministic
    heads = query.shape[2]
    constant = lambda v: (lambda rng, shape: jnp.full(shape, v, jnp.float32))
    return dict(distance_weight=self.param("distance_weight", constant(self.initial_weight),
                                           (heads,)),
                distance_bias=self.param("distance_bias", constant(self.initial_bias), (heads,)))


registry.register(registry.VariantSpec(
    name="gaussian_transformer", fn=gaussian_transformer_attention, family="prior",
    takes=("dropout", "query_positions"),
    complexity="O(T^2)", subquadratic=False, exact=False, causal=True, cross=True,
    paper="Guo et al. 2019", extras=GaussianDistancePrior,
    options=dict(initial_weight="w at initialisation, per head (the prior -|w (i-j)^2 + b|)",
                 initial_bias="b at initialisation, per head",
                 scale="multiplies the q . k logits; 1/sqrt(D) when None",
                 implementation=_FLEX_OPTION)))


# --------------------------------------------------------------------------------------
# Localness modelling: a Gaussian bias with a predicted centre and window.


def gaussian_local_attention(query: Array, key: Array, value: Array,
                             bias: Optional[Array] = None, mask: Optional[Array] = None, *,
                             position_kernel: Array, center_vector: Array, window_vector: Array,
                             key_value_seq_lengths: Optional[Array] = None,
                             scale: Optional[float] = None,
                             implementation: Optional[str] = None, **kwargs) -> Array:
  """Localness modelling (Yang et al. 2018, eqs. 5-9), per head h and query i:

      P_i = T sigmoid(U_p^T tanh(W_p q_i)),   D_i = T sigmoid(U_d^T tanh(W_p q_i)),
      sigma_i = D_i / 2,   G_ij = -(j - P_i)^2 / (2 sigma_i^2),
      out = softmax(q k^T * scale + G + bias, masked) v.

  P_i is the predicted centre and D_i the predicted window of query i's local
  region, both in (0, T); the one W_p is shared by the two predictions, as in
  the paper. T is the paper's I, the input length: here the row's valid key
  count `key_value_seq_lengths[b]`, or Tk without it, so a padded row's centres
  are those of the unpadded sequence (a key-padding `mask` masks keys but does
  not change T: pass lengths for that). Causal or not, T is the key count:
  the bias then depends on the length, never on a later token's content.
  The bias is an additive `bias` for `dot_product_attention`, so masks,
  padding (weight 0) and dropout are its. O(T^2).

  Args:
    query, key, value, bias, mask: as in `dot_product_attention`.
    position_kernel: W_p `[H, D, D]`, `[h, d_in, d_out]`.
    center_vector: U_p `[H, D]`.
    window_vector: U_d `[H, D]`.
    key_value_seq_lengths: `[B]` valid keys, T of each row (Tk when None).
    scale: the q . k logits' scale, 1/sqrt(D) when None.
    implementation: None, the dense form above (the reference); or a kernel
      of `flex_attention` ("blockwise", ...), G its score_mod (closing over
      the centres and variances `[B, H, Tq]`, which the kernel differentiates).
    **kwargs: the other masks of `dot_product_attention` (is_causal,
      query_seq_lengths, segment_ids) and dropout.

  Returns:
    `[B, Tq, H, Dv]`.
  """
  batch, _, num_heads, head_dim = query.shape
  kv_len = key.shape[1]
  common.check_per_head("position_kernel", position_kernel, (num_heads, head_dim, head_dim))
  common.check_per_head("center_vector", center_vector, (num_heads, head_dim))
  common.check_per_head("window_vector", window_vector, (num_heads, head_dim))
  length = jnp.full((batch,), kv_len, jnp.float32) if key_value_seq_lengths is None else \
      jnp.asarray(key_value_seq_lengths, jnp.float32)
  if length.shape != (batch,):
    raise ValueError(f"key_value_seq_lengths must be [B] = [{batch}], got shape "
                     f"{list(length.shape)}.")
  hidden = jnp.tanh(jnp.einsum("bqhd,hde->bhqe", query.astype(jnp.float32),
                               jnp.asarray(position_kernel, jnp.float32)))
  length = length[:, None, None]
  center = length * jax.nn.sigmoid(jnp.einsum("bhqe,he->bhq", hidden, center_vector))
  window = length * jax.nn.sigmoid(jnp.einsum("bhqe,he->bhq", hidden, window_vector))
  # sigmoid underflows to 0 below about -88 in float32; a floor keeps 1 / sigma^2
  # finite there (such a window is far narrower than one position anyway).
  variance = 2.0 * jnp.square(jnp.maximum(window, 1e-3) / 2.0)
  if implementation is not None:
    def localness(score, b, h, q_idx, kv_idx):
      return score - jnp.square(kv_idx.astype(jnp.float32) - center[b, h, q_idx]) / (
          variance[b, h, q_idx])

    return _prior_on_flex("gaussian_local", query, key, value, localness, bias, mask,
                          scale=scale, implementation=implementation,
                          key_value_seq_lengths=key_value_seq_lengths, **kwargs)
  distance = jnp.arange(kv_len, dtype=jnp.float32) - center[..., None]
  local_bias = -jnp.square(distance) / variance[..., None]  # [B, H, Tq, Tk]
  return _prior_attention(query, key, value, local_bias, bias, mask, scale=scale,
                          key_value_seq_lengths=key_value_seq_lengths, **kwargs)


class LocalnessPredictor(nn.Module):
  """`gaussian_local`'s W_p `[H, D, D]`, U_p and U_d `[H, D]`, learned per head.

  Attributes:
    param_dtype: dtype of the parameters.
  """

  param_dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, query, key, value, deterministic: bool = True) -> dict:
    del key, value, deterministic
    _, _, num_heads, head_dim = query.shape
    vector_init = nn.initializers.normal(head_dim ** -0.5)
    return dict(
        position_kernel=self.param("position_kernel", PER_HEAD_KERNEL,
                                   (num_heads, head_dim, head_dim), self.param_dtype),
        center_vector=self.param("center_vector", vector_init, (num_heads, head_dim),
                                 self.param_dtype),
        window_vector=self.param("window_vector", vector_init, (num_heads, head_dim),
                                 self.param_dtype))


registry.register(registry.VariantSpec(
    name="gaussian_local", fn=gaussian_local_attention, family="prior", complexity="O(T^2)",
    takes=("dropout",),
    subquadratic=False, exact=False, causal=True, cross=True, paper="Yang et al. 2018",
    extras=LocalnessPredictor,
    options=dict(scale="multiplies the q . k logits; 1/sqrt(D) when None",
                 implementation=_FLEX_OPTION)))


# --------------------------------------------------------------------------------------
# Conditionally adaptive attention: a task-conditioned block-diagonal bias.


def task_film(task_ids: Optional[Array], task_embeddings: Array, film_kernel: Array,
              film_bias: Array, batch: int) -> Tuple[Array, Array]:
  """FiLM parameters of each example's task: (gamma, beta) = split(z W + b).

  Args:
    task_ids: `[B]` ints in [0, K), or None: every example is task 0 (a model
      that names no task runs as a single-task one).
    task_embeddings: z, `[K, Z]`, one row per task.
    film_kernel: W `[Z, 2 b]`; film_bias: b `[2 b]`. The first b outputs are
      gamma, the last b beta.
    batch: B.

  Returns:
    (gamma `[B, b]`, beta `[B, b]`) float32.
  """
  num_tasks, task_dim = jnp.shape(task_embeddings)
  common.check_per_head("film_kernel", film_kernel, (task_dim, None))
  common.check_per_head("film_bias", film_bias, (jnp.shape(film_kernel)[1],))
  if jnp.shape(film_kernel)[1] % 2:
    raise ValueError(f"film_kernel must be [Z, 2 b] (gamma's b outputs, then beta's), got "
                     f"{list(jnp.shape(film_kernel))}.")
  if task_ids is None:
    task_ids = jnp.zeros((batch,), jnp.int32)
  task_ids = jnp.asarray(task_ids)
  if task_ids.shape != (batch,) or not jnp.issubdtype(task_ids.dtype, jnp.integer):
    raise ValueError(f"task_ids must be ints of shape [B] = [{batch}], got {task_ids.dtype} "
                     f"of shape {list(task_ids.shape)}.")
  if not isinstance(task_ids, jax.core.Tracer):
    ids = np.asarray(task_ids)
    if ids.min() < 0 or ids.max() >= num_tasks:
      raise ValueError(f"task_ids must be in [0, num_tasks) = [0, {num_tasks}), got "
                       f"{ids.tolist()}.")
  # Under jit the ids cannot be checked; an unknown task gets NaN, never another
  # task's embedding.
  embedding = jnp.take(jnp.asarray(task_embeddings, jnp.float32), task_ids, axis=0,
                       mode="fill", fill_value=jnp.nan)
  film = embedding @ jnp.asarray(film_kernel, jnp.float32) + jnp.asarray(film_bias, jnp.float32)
  gamma, beta = jnp.split(film, 2, axis=-1)
  return gamma, beta


def conditional_block_bias(block_logits: Array, gamma: Array, beta: Array,
                           length: int) -> Array:
  """M(z) = diag(A'_1, ..., A'_N), A'_n = A_n gamma(z) + beta(z), cut to T x T.

  Block n covers positions [n b, (n + 1) b); entries outside the diagonal
  blocks are 0. gamma and beta scale and shift each column of a block (the
  FiLM of a block row's b features): A'_n[r, c] = A_n[r, c] gamma[c] + beta[c].

  Args:
    block_logits: A `[H, N, b, b]`, N b >= `length`.
    gamma, beta: `[B, b]`, each example's task's.
    length: T.

  Returns:
    `[B, H, T, T]` float32.
  """
  num_heads, num_blocks, block, _ = jnp.shape(block_logits)
  positions = jnp.arange(length)
  block_of, within = positions // block, positions % block
  same_block = block_of[:, None] == block_of[None, :]
  # A[h, n(i), i mod b, j mod b], one gather; entries off the diagonal blocks unused.
  logits = jnp.asarray(block_logits, jnp.float32)[:, block_of[:, None], within[:, None],
                                                  within[None, :]]  # [H, T, T]
  gamma_columns = jnp.asarray(gamma, jnp.float32)[:, None, None, within]  # [B, 1, 1, T]
  beta_columns = jnp.asarray(beta, jnp.float32)[:, None, None, within]
  return jnp.where(same_block, logits[None] * gamma_columns + beta_columns, 0.0)


def conditional_adapter_attention(query: Array, key: Array, value: Array,
                                  bias: Optional[Array] = None, mask: Optional[Array] = None, *,
                                  block_logits: Array, task_embeddings: Array, film_kernel: Array,
                                  film_bias: Array, task_ids: Optional[Array] = None,
                                  scale: Optional[float] = None, **kwargs) -> Array:
  """Conditional attention of CA-MTL (Pilault et al. 2021, sec. 2.1):

      out = softmax(q k^T * scale + M(z) + bias, masked) v,
      M(z) = diag(A'_1, ..., A'_N),   A'_n = A_n gamma(z) + beta(z),

  a learned block-diagonal bias on the logits (blocks of b positions, one
  matrix A_n per block and head), modulated by a FiLM of the task embedding
  z of each example (`task_film`, `conditional_block_bias`). With A = 0, or
  gamma = beta = 0, it is dot-product attention; gamma = 1, beta = 0 leaves
  the bias A unmodulated. Masks, padding and dropout are
  `dot_product_attention`'s. Self-attention (the blocks are on the diagonal
  of a square matrix), O(T^2).

  Args:
    query, key, value, bias, mask: as in `dot_product_attention`.
    block_logits: A `[H, N, b, b]`; N b must cover the sequence.
    task_embeddings: z `[K, Z]` for K tasks.
    film_kernel, film_bias: `[Z, 2 b]`, `[2 b]`, (gamma, beta) = split(z W + b).
    task_ids: `[B]` ints, each example's task (per batch, so passed per call:
      `MultiHeadAttention(...)(x, attention_arguments={"task_ids": ids})`);
      None: task 0 for every example.
    scale: the q . k logits' scale, 1/sqrt(D) when None.
    **kwargs: the masks of `dot_product_attention` (is_causal,
      query_seq_lengths, key_value_seq_lengths, segment_ids) and dropout.

  Returns:
    `[B, T, H, Dv]`.
  """
  batch, length, num_heads = query.shape[:3]
  if key.shape[1] != length:
    raise ValueError(f"conditional_adapter is self-attention: the key length ({key.shape[1]}) "
                     f"must equal the query length ({length}).")
  shape = tuple(jnp.shape(block_logits))
  common.check_per_head("block_logits", block_logits, (num_heads, None, None, None))
  if shape[2] != shape[3] or shape[1] * shape[2] < length:
    raise ValueError(f"block_logits must be [H, N, b, b] with N b >= T = {length}, got "
                     f"{list(shape)}; raise max_length.")
  gamma, beta = task_film(task_ids, task_embeddings, film_kernel, film_bias, batch)
  if gamma.shape[-1] != shape[2]:
    raise ValueError(f"film_kernel must be [Z, 2 b] with b = {shape[2]} (block_logits' block "
                     f"size), got {list(jnp.shape(film_kernel))}.")
  task_bias = conditional_block_bias(block_logits, gamma, beta, length)
  return _prior_attention(query, key, value, task_bias, bias, mask, scale=scale, **kwargs)


class TaskConditioning(nn.Module):
  """`conditional_adapter`'s arrays: A `[H, N, b, b]` (N = ceil(max_length / b)),
  the task embeddings `[K, Z]` and the FiLM layer `[Z, 2 b]`, `[2 b]`.

  A starts at zero and the FiLM at gamma = 1, beta = 0 (zero kernel), so a new
  layer is dot-product attention for every task; the task embeddings start
  random so that the tasks' FiLMs part as soon as the kernel learns.

  Attributes:
    num_tasks: K.
    task_dim: Z.
    block_size: b, the positions per diagonal block.
    max_length: the longest sequence the blocks cover.
    param_dtype: dtype of the parameters.
  """

  num_tasks: int = 8
  task_dim: int = 32
  block_size: int = 16
  max_length: int = 512
  param_dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, query, key, value, deterministic: bool = True) -> dict:
    del key, value, deterministic
    num_heads = query.shape[2]
    block = common.check_size("block_size", self.block_size)
    num_blocks = -(-common.check_size("max_length", self.max_length) // block)
    task_dim = common.check_size("task_dim", self.task_dim)
    film_bias = lambda rng, shape, dtype: jnp.concatenate(
        [jnp.ones(shape[0] // 2, dtype), jnp.zeros(shape[0] // 2, dtype)])
    return dict(
        block_logits=self.param("block_logits", nn.initializers.zeros_init(),
                                (num_heads, num_blocks, block, block), self.param_dtype),
        task_embeddings=self.param("task_embeddings", nn.initializers.normal(1.0),
                                   (common.check_size("num_tasks", self.num_tasks), task_dim),
                                   self.param_dtype),
        film_kernel=self.param("film_kernel", nn.initializers.zeros_init(),
                               (task_dim, 2 * block), self.param_dtype),
        film_bias=self.param("film_bias", film_bias, (2 * block,), self.param_dtype))


registry.register(registry.VariantSpec(
    name="conditional_adapter", fn=conditional_adapter_attention, family="prior",
    takes=("dropout",),
    complexity="O(T^2)", subquadratic=False, exact=False, causal=True, cross=False,
    paper="Pilault et al. 2021", extras=TaskConditioning,
    options=dict(num_tasks="K, the number of tasks (task_ids in [0, K))",
                 task_dim="Z, the size of a task embedding",
                 block_size="b, positions per block of the block-diagonal bias",
                 max_length="longest sequence the blocks cover",
                 scale="multiplies the q . k logits; 1/sqrt(D) when None")))
