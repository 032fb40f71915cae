"""Position encodings: absolute embeddings, RoPE, ALiBi, T5 and Transformer-XL
relative scores.

Absolute schemes (sinusoidal, learned) are added to the token embeddings at the
model's input; complex-valued word embeddings (Wang et al. 2020) replace them,
each word a wave over the positions. Relative schemes act inside attention: RoPE rotates queries and
keys; ALiBi, T5 and Transformer-XL's relative scores add a `[B|1, H, Tq, Tk]`
bias to the attention logits; Shaw et al.'s embeddings of the clipped
distance join the keys and the values (`variants.dense.shaw_relative_attention`).

Positions are token indices, `[T]` (shared by the batch) or `[B, T]` (e.g.
restarting at each packed segment); every function here is jit-compatible.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from attention_jax import registry

Array = jnp.ndarray
Dtype = Any
Initializer = Callable[..., Array]

POSITION_ENCODINGS = ("none", "sinusoidal", "learned", "complex", "rope", "xpos", "alibi", "t5",
                      "xl_relative", "shaw")
# Schemes that act inside attention (on queries and keys, or as a logits bias);
# the others are added to the token embeddings by the model's input layer.
RELATIVE_POSITIONS = ("rope", "xpos", "alibi", "t5", "xl_relative", "shaw")
ROTARY_POSITIONS = ("rope", "xpos")


def check_position_encoding(name: str) -> str:
  """Returns `name` if it is one of `POSITION_ENCODINGS`, else raises ValueError."""
  if name not in POSITION_ENCODINGS:
    raise registry.unknown_name_error("position encoding", name, POSITION_ENCODINGS)
  return name


# ---------------------------------------------------------------------------
# Absolute position embeddings.
# ---------------------------------------------------------------------------


def sinusoidal_embedding(positions: Array, features: int,
                         max_timescale: float = 10_000.0) -> Array:
  """Sinusoids of Vaswani et al. 2017, interleaved as in the paper.

  `PE[pos, 2i] = sin(pos / max_timescale^(2i / features))` and
  `PE[pos, 2i + 1] = cos(pos / max_timescale^(2i / features))`.

  Args:
    positions: `[..., T]` integer or float positions.
    features: embedding size E, even.
    max_timescale: the longest wavelength is `2 pi max_timescale`.

  Returns:
    `[..., T, E]` float32.
  """
  if not isinstance(features, int) or features <= 0 or features % 2:
    raise ValueError(f"features must be a positive even int, got {features!r}.")
  inv_timescales = max_timescale ** (-np.arange(0, features, 2, dtype=np.float32) / features)
  angles = jnp.asarray(positions, jnp.float32)[..., None] * inv_timescales  # [..., T, E/2]
  # Stacking on a new last axis and flattening interleaves sin and cos.
  pe = jnp.stack([jnp.sin(angles), jnp.cos(angles)], axis=-1)
  return pe.reshape(*angles.shape[:-1], features)


def _check_sequence(x: Array, name: str = "x") -> None:
  if x.ndim != 3:
    raise ValueError(f"{name} must be [B, T, E], got shape {x.shape}.")


def _check_positions(positions: Array, batch: int, length: int,
                     name: str = "positions") -> None:
  """`positions` must be `[T]` or `[B, T]` (or `[1, T]`) for a `[B, T, ...]` input."""
  shape = jnp.shape(positions)
  ok = (len(shape) == 1 and shape[0] == length) or (
      len(shape) == 2 and shape[0] in (1, batch) and shape[1] == length)
  if not ok:
    raise ValueError(f"{name} must be [T] or [B, T] with B={batch}, T={length}, "
                     f"got shape {shape}.")


class SinusoidalPositionEmbedding(nn.Module):
  """Adds fixed sinusoids (`sinusoidal_embedding`) to the inputs; no parameters.

  Attributes:
    max_timescale: see `sinusoidal_embedding`.
  """

  max_timescale: float = 10_000.0

  @nn.compact
  def __call__(self, x: Array, positions: Optional[Array] = None) -> Array:
    """x: `[B, T, E]`; positions: `[B, T]`, `[T]` or None (`arange(T)`). Returns `[B, T, E]`."""
    _check_sequence(x)
    batch, length, features = x.shape
    if positions is None:
      positions = jnp.arange(length)
    _check_positions(positions, batch, length)
    pe = sinusoidal_embedding(positions, features, self.max_timescale)
    return x + pe.astype(x.dtype)


class LearnedPositionEmbedding(nn.Module):
  """Adds a learned embedding per position, `embedding: [max_length, E]`.

  Attributes:
    max_length: number of positions with an embedding; positions must be below it.
    embedding_init: initialiser of the table.
    param_dtype: dtype of the table.
  """

  max_length: int
  embedding_init: Initializer = nn.initializers.normal(stddev=0.02)
  param_dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, x: Array, positions: Optional[Array] = None) -> Array:
    """x: `[B, T, E]`; positions: `[B, T]`, `[T]` or None (`arange(T)`). Returns `[B, T, E]`."""
    _check_sequence(x)
    batch, length, features = x.shape
    embedding = self.param(
        "embedding", nn.with_logical_partitioning(self.embedding_init, ("length", "embed")),
        (self.max_length, features), self.param_dtype)
    if positions is None:
      if length > self.max_length:
        raise ValueError(f"sequence length {length} exceeds max_length {self.max_length}.")
      pe = embedding[None, :length]
    else:
      positions = jnp.asarray(positions)
      _check_positions(positions, batch, length)
      if not jnp.issubdtype(positions.dtype, jnp.integer):
        raise ValueError(f"positions must be integers to index the embedding, got dtype "
                         f"{positions.dtype}.")
      if not isinstance(positions, jax.core.Tracer):
        low, high = int(np.min(positions)), int(np.max(positions))
        if low < 0 or high >= self.max_length:
          raise ValueError(f"positions must lie in [0, max_length={self.max_length}), got "
                           f"values in [{low}, {high}] (sequence length {length}).")
      # Traced positions cannot be checked; "fill" turns out-of-range ones into
      # NaN rather than silently clamping them to the last embedding.
      pe = jnp.take(embedding, positions, axis=0, mode="fill")
    return x + pe.astype(x.dtype)


# ---------------------------------------------------------------------------
# Rotary position embedding.
# ---------------------------------------------------------------------------


def apply_rope(x: Array, positions: Array, max_wavelength: float = 10_000.0) -> Array:
  """Rotary position embedding (Su et al. 2021).

  Uses the "rotate half" layout: feature `i` is paired with feature `i + D/2`
  and the pair is rotated by `pos * max_wavelength^(-2i / D)`, `i < D/2`. This
  is the interleaved rotation of the paper up to a fixed permutation of the
  features, which Q/K projections absorb; dot products of rotated queries and
  keys then depend on positions only through `q_pos - k_pos`.

  Args:
    x: `[B, T, H, D]` queries or keys, D even.
    positions: `[B, T]` or `[T]` positions.
    max_wavelength: base of the geometric frequencies.

  Returns:
    `[B, T, H, D]` in `x.dtype` (computed in float32).
  """
  return Rotary(max_wavelength=max_wavelength)(x, positions)


ROPE_SCALINGS = (None, "linear", "ntk", "yarn")


def yarn_temperature(scaling_factor: float) -> float:
  """YaRN's sqrt(1/t) = 0.1 ln(s) + 1 (Peng et al. 2023, eq. 22), by which it
  multiplies both queries and keys: the logits grow by its square."""
  return 0.1 * math.log(scaling_factor) + 1.0


@dataclasses.dataclass(frozen=True)
class Rotary:
  """RoPE and its extensions, from `position_options` (`Rotary.from_options`).

  Attributes:
    max_wavelength: the frequencies' base b: theta_i = b^(-2i / d).
    scaling: None, or how a model trained at `original_length` reaches
      `scaling_factor` times it: "linear" (position interpolation, Chen et
      al. 2023: positions / s), "ntk" (NTK-aware, the base grown to
      b s^(d / (d - 2)), so the lowest frequency is interpolated and the
      highest kept), "yarn" (Peng et al. 2023: NTK-by-parts, each frequency
      interpolated by how many of its wavelengths fit in `original_length`,
      fully below `beta_slow` turns, not at all above `beta_fast`; and the
      attention temperature `yarn_temperature` on queries and keys).
    scaling_factor: s >= 1.
    original_length: the training length L that "yarn" measures wavelengths in.
    beta_fast, beta_slow: YaRN's alpha and beta (1 and 32 in the paper, for
      LLaMA) as turns of a frequency within L.
    rotary_fraction: rotate the first round(f D / 2) pairs of features
      ("partial RoPE", GPT-NeoX's rotary_pct); the rest pass unchanged.
    xpos_scale_base: xPos (Sun et al. 2022) when set: the rotated query at
      position n is multiplied by zeta^(n / B) and the key by zeta^(-n / B),
      zeta_i = (2i / d + gamma) / (1 + gamma), gamma = 0.4, B this base, so
      that q . k decays with the distance.
  """

  max_wavelength: float = 10_000.0
  scaling: Optional[str] = None
  scaling_factor: float = 1.0
  original_length: Optional[int] = None
  beta_fast: float = 32.0
  beta_slow: float = 1.0
  rotary_fraction: float = 1.0
  xpos_scale_base: Optional[float] = None

  XPOS_GAMMA = 0.4

  @classmethod
  def from_options(cls, options, *, xpos: bool = False) -> "Rotary":
    """The settings in a model's `position_options` (for "rope" or "xpos"),
    checked: an unknown key or a value out of range is a ValueError naming it."""
    options = dict(options or {})
    fields = {f.name for f in dataclasses.fields(cls)} - {"xpos_scale_base"}
    if xpos:
      options["xpos_scale_base"] = options.pop("scale_base", 512.0)
      fields.add("xpos_scale_base")
    unknown = sorted(set(options) - fields)
    if unknown:
      valid = sorted(fields - {"xpos_scale_base"}) + (["scale_base"] if xpos else [])
      raise ValueError(f"position_options {unknown} are not options of "
                       f"{'xpos' if xpos else 'rope'}; its options are: {', '.join(valid)}.")
    return cls(**options).checked()

  def checked(self) -> "Rotary":
    if self.scaling not in ROPE_SCALINGS:
      raise ValueError(f"position_options.scaling must be one of {ROPE_SCALINGS}, got "
                       f"{self.scaling!r}.")
    if not self.scaling_factor >= 1.0:
      raise ValueError(f"position_options.scaling_factor must be >= 1 (it stretches the "
                       f"trained length), got {self.scaling_factor!r}.")
    if self.scaling is None and self.scaling_factor != 1.0:
      # Without a scaling the factor would be read by nothing: plain RoPE.
      raise ValueError(f"position_options.scaling_factor={self.scaling_factor!r} needs a "
                       f"scaling ('linear', 'ntk' or 'yarn') to apply it; got scaling=None.")
    if self.scaling == "yarn" and not self.beta_fast > self.beta_slow:
      raise ValueError(f"position_options.beta_fast must exceed beta_slow (YaRN's ramp runs "
                       f"from beta_slow to beta_fast turns), got beta_fast={self.beta_fast!r}, "
                       f"beta_slow={self.beta_slow!r}.")
    if self.scaling == "yarn" and not self.original_length:
      raise ValueError("position_options.scaling='yarn' needs original_length, the length the "
                       "model was trained at.")
    if not 0.0 < self.rotary_fraction <= 1.0:
      raise ValueError(f"position_options.rotary_fraction must be in (0, 1], got "
                       f"{self.rotary_fraction!r}.")
    if self.xpos_scale_base is not None and not self.xpos_scale_base > 0:
      raise ValueError(f"position_options.scale_base must be > 0, got {self.xpos_scale_base!r}.")
    return self

  def inverse_frequencies(self, rotary_dim: int) -> np.ndarray:
    """theta_i for the rotary_dim / 2 pairs, after the scaling (float64)."""
    half = rotary_dim // 2
    exponents = np.arange(half, dtype=np.float64) * 2 / rotary_dim
    s = float(self.scaling_factor)
    if self.scaling == "ntk":
      return (self.max_wavelength * s ** (rotary_dim / (rotary_dim - 2))) ** -exponents
    theta = self.max_wavelength ** -exponents
    if self.scaling == "linear":
      return theta / s
    if self.scaling == "yarn":
      turns = self.original_length * theta / (2 * math.pi)  # r(d) = L / lambda_d
      ramp = np.clip((turns - self.beta_slow) / (self.beta_fast - self.beta_slow), 0.0, 1.0)
      return (1.0 - ramp) * theta / s + ramp * theta
    return theta

  def rotary_width(self, head_dim: int) -> int:
    """How many of `head_dim` features are rotated: feature i pairs with i + width / 2."""
    return 2 * max(1, round(self.rotary_fraction * head_dim / 2))

  @property
  def temperature(self) -> float:
    """The factor on queries and keys: YaRN's, else 1."""
    return yarn_temperature(self.scaling_factor) if self.scaling == "yarn" else 1.0

  def xpos_center(self, q_positions: Array, k_positions: Array) -> Optional[Array]:
    """Where xPos's exponent is measured from for one call: `[B|1, 1]`, the
    middle of the queries' and keys' positions; None without xPos.

    zeta^(n / B) leaves float32 past n ~ 36K at B = 512 (zeta_0 = 0.29). The
    scores depend on n - m only, so any center the queries and keys of a call
    share gives the same ones, and the middle keeps both exponents within
    half the call's span."""
    if self.xpos_scale_base is None:
      return None
    first = jnp.min(_batched_positions(k_positions, "k_positions"), axis=-1, keepdims=True)
    last = jnp.max(_batched_positions(q_positions, "q_positions"), axis=-1, keepdims=True)
    return 0.5 * (first + last).astype(jnp.float32)

  def __call__(self, x: Array, positions: Array, *, is_key: bool = False,
               xpos_center: Optional[Array] = None) -> Array:
    """`x` `[B, T, H, D]` rotated at `positions` (`[B, T]` or `[T]`), in x's dtype;
    `is_key` picks xPos's decaying side, whose exponent counts from
    `xpos_center` (`[B|1, 1]`, 0 when None; see `xpos_center`)."""
    if x.ndim != 4:
      raise ValueError(f"x must be [B, T, H, D], got shape {x.shape}.")
    batch, length, _, head_dim = x.shape
    if head_dim % 2:
      raise ValueError(f"RoPE needs an even head dim D, got x of shape {x.shape}.")
    _check_positions(positions, batch, length)
    rotary_dim = self.rotary_width(head_dim)
    half = rotary_dim // 2
    inv_freq = self.inverse_frequencies(rotary_dim).astype(np.float32)
    position = jnp.broadcast_to(jnp.asarray(positions, jnp.float32), (batch, length))
    angles = (position[..., None] * inv_freq)[:, :, None, :]  # [B, T, 1, half]
    sin, cos = jnp.sin(angles), jnp.cos(angles)
    x32 = x.astype(jnp.float32)
    x1, x2, rest = x32[..., :half], x32[..., half:rotary_dim], x32[..., rotary_dim:]
    rotated = [x1 * cos - x2 * sin, x2 * cos + x1 * sin]
    if self.xpos_scale_base is not None:
      gamma = self.XPOS_GAMMA
      zeta = (np.arange(half, dtype=np.float32) * 2 / rotary_dim + gamma) / (1 + gamma)
      from_center = position if xpos_center is None else position - xpos_center
      power = (-1.0 if is_key else 1.0) * from_center[..., None, None] / self.xpos_scale_base
      factor = jnp.asarray(zeta) ** power  # [B, T, 1, half]
      rotated = [part * factor for part in rotated]
    out = jnp.concatenate(rotated + [rest], axis=-1) * self.temperature
    return out.astype(x.dtype)


# ---------------------------------------------------------------------------
# Relative biases on the attention logits.
# ---------------------------------------------------------------------------


def _batched_positions(positions: Array, name: str) -> Array:
  """`[T]` -> `[1, T]`; `[B, T]` unchanged."""
  positions = jnp.asarray(positions)
  if positions.ndim not in (1, 2):
    raise ValueError(f"{name} must be [T] or [B, T], got shape {positions.shape}.")
  return positions if positions.ndim == 2 else positions[None]


def _relative_positions(q_positions: Array, k_positions: Array) -> Array:
  """`k_pos - q_pos`: `[B|1, Tq, Tk]`."""
  q = _batched_positions(q_positions, "q_positions")
  k = _batched_positions(k_positions, "k_positions")
  if q.shape[0] != k.shape[0] and 1 not in (q.shape[0], k.shape[0]):
    raise ValueError(f"q_positions and k_positions have incompatible batch sizes: "
                     f"shapes {q.shape} and {k.shape}.")
  return k[:, None, :] - q[:, :, None]


def _check_num_heads(num_heads: int) -> None:
  if not isinstance(num_heads, int) or isinstance(num_heads, bool) or num_heads <= 0:
    raise ValueError(f"num_heads must be a positive int, got {num_heads!r}.")


def alibi_slopes(num_heads: int) -> Array:
  """ALiBi head slopes (Press et al. 2022): `[H]` float32.

  For H a power of two, the geometric sequence `2^(-8 h / H)`, h = 1..H. Otherwise
  the slopes of the largest power of two n < H, followed by every other slope of
  2n (those falling between the first ones) until there are H.
  """
  _check_num_heads(num_heads)

  def power_of_two(n):
    return [2.0 ** (-8.0 * h / n) for h in range(1, n + 1)]

  n = 2 ** int(math.floor(math.log2(num_heads)))
  slopes = power_of_two(n) + power_of_two(2 * n)[0::2][: num_heads - n]
  return jnp.asarray(slopes, jnp.float32)


def alibi_bias(num_heads: int, q_positions: Array, k_positions: Array) -> Array:
  """ALiBi logits bias `-slope_h * |q_pos - k_pos|`.

  The paper defines the bias for causal attention, `-slope * (i - j)` for keys
  `j <= i`; the keys `j > i` are masked, so the symmetric distance gives the
  same result there and also serves bidirectional attention.

  Args:
    num_heads: H.
    q_positions: `[B|1, Tq]` or `[Tq]`.
    k_positions: `[B|1, Tk]` or `[Tk]`.

  Returns:
    `[B|1, H, Tq, Tk]` float32.
  """
  distance = jnp.abs(_relative_positions(q_positions, k_positions)).astype(jnp.float32)
  return -alibi_slopes(num_heads)[None, :, None, None] * distance[:, None]


def t5_relative_position_bucket(relative_position: Array, *, bidirectional: bool = True,
                                num_buckets: int = 32, max_distance: int = 128) -> Array:
  """T5 relative position buckets (Raffel et al. 2020).

  Distances below half of a direction's buckets get a bucket each; larger ones
  share log-spaced buckets up to `max_distance`, beyond which all land in the
  last bucket. When bidirectional, keys at or before the query
  (`relative_position <= 0`) use buckets `[0, num_buckets / 2)` and keys after
  it use `[num_buckets / 2, num_buckets)`. Otherwise all keys after the query
  share bucket 0 with the query itself (causal attention masks them anyway).

  Args:
    relative_position: integer array of `k_pos - q_pos`, any shape.
    bidirectional: whether keys after the query get their own buckets.
    num_buckets: total number of buckets.
    max_distance: distance from which all offsets share the last bucket.

  Returns:
    int32 array of bucket ids, shaped like `relative_position`.
  """
  relative_position = jnp.asarray(relative_position)
  if not isinstance(num_buckets, int):
    raise ValueError(f"num_buckets must be an int, got {num_buckets!r}.")
  if not jnp.issubdtype(relative_position.dtype, jnp.integer):
    raise ValueError(f"relative_position must be an integer array, got dtype "
                     f"{relative_position.dtype}.")
  per_direction = num_buckets // 2 if bidirectional else num_buckets
  if per_direction < 2 or (bidirectional and num_buckets % 2):
    raise ValueError(f"num_buckets must be an int >= 2 (an even int >= 4 when bidirectional), "
                     f"got {num_buckets!r} with bidirectional={bidirectional}.")
  max_exact = per_direction // 2
  if max_distance <= max_exact:
    raise ValueError(f"max_distance must exceed the {max_exact} exact buckets of "
                     f"num_buckets={num_buckets}, got {max_distance!r}.")

  distance = -relative_position.astype(jnp.int32)  # > 0 for keys before the query
  bucket = jnp.zeros_like(distance)
  if bidirectional:
    bucket += jnp.where(distance < 0, per_direction, 0)
    distance = jnp.abs(distance)
  else:
    distance = jnp.maximum(distance, 0)
  # Clamping before the log keeps the unused (small-distance) branch finite.
  scaled = jnp.log(jnp.maximum(distance, max_exact).astype(jnp.float32) / max_exact)
  scaled = scaled / math.log(max_distance / max_exact) * (per_direction - max_exact)
  large = jnp.minimum(max_exact + scaled.astype(jnp.int32), per_direction - 1)
  return bucket + jnp.where(distance < max_exact, distance, large)


class T5RelativePositionBias(nn.Module):
  """Learned per-head bias of each relative position bucket (T5).

  Differences from T5 as `MultiHeadAttention` uses it: T5 shares one table
  across the layers of a stack (computed in the first layer), while each
  layer here has its own `[num_buckets, H]` table; and T5's decoder
  self-attention buckets causally (`bidirectional=False`: all buckets for the
  keys before the query), while the default here is bidirectional in every
  layer, so a causal layer leaves half its buckets unused (the keys after
  the query are masked) and has num_buckets / 4 exact distances, not / 2.
  Set `bidirectional` False in `position_options` for T5's decoder.

  Attributes:
    num_heads: H.
    num_buckets, max_distance, bidirectional: see `t5_relative_position_bucket`.
    embedding_init: initialiser of the `[num_buckets, H]` table; small, so that
      attention starts close to content-only.
    param_dtype: dtype of the table.
  """

  num_heads: int
  num_buckets: int = 32
  max_distance: int = 128
  bidirectional: bool = True
  embedding_init: Initializer = nn.initializers.normal(stddev=0.02)
  param_dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, q_positions: Array, k_positions: Array, *, as_score_mod: bool = False):
    """q_positions: `[B|1, Tq]` or `[Tq]`; k_positions: `[B|1, Tk]` or `[Tk]`.

    Returns:
      `[B|1, H, Tq, Tk]` float32; with `as_score_mod`, the same bias as a
      flex score_mod `(score, b, h, q_idx, kv_idx) -> score + bias`, which a
      kernel applies per tile (no `[Tq, Tk]` array; the table's gradient
      comes from the kernel).
    """
    _check_num_heads(self.num_heads)
    table = self.param(
        "rel_embedding",
        nn.with_logical_partitioning(self.embedding_init, ("relpos_buckets", "heads")),
        (self.num_buckets, self.num_heads), self.param_dtype)
    bucket = functools.partial(t5_relative_position_bucket, bidirectional=self.bidirectional,
                               num_buckets=self.num_buckets, max_distance=self.max_distance)
    if as_score_mod:
      q_positions, k_positions = _as_rows(q_positions), _as_rows(k_positions)
      return lambda score, b, h, q_idx, kv_idx: score + table[
          bucket(_at(k_positions, b, kv_idx) - _at(q_positions, b, q_idx)), h].astype(
              jnp.float32)
    buckets = bucket(_relative_positions(q_positions, k_positions))  # [B|1, Tq, Tk]
    bias = jnp.take(table, buckets, axis=0)  # [B|1, Tq, Tk, H]
    return jnp.transpose(bias, (0, 3, 1, 2)).astype(jnp.float32)


def alibi_score_mod(num_heads: int, q_positions: Array, k_positions: Array):
  """`alibi_bias` as a flex score_mod: `score - slope_h |q_pos - k_pos|` per tile.

  q_positions: `[B|1, Tq]` or `[Tq]`; k_positions: `[B|1, Tk]` or `[Tk]`.
  """
  slopes = alibi_slopes(num_heads)
  q_positions, k_positions = _as_rows(q_positions), _as_rows(k_positions)
  return lambda score, b, h, q_idx, kv_idx: score - slopes[h] * jnp.abs(
      _at(q_positions, b, q_idx) - _at(k_positions, b, kv_idx)).astype(jnp.float32)


def _as_rows(positions: Array) -> Array:
  """Positions as `[B|1, T]` int32."""
  positions = jnp.asarray(positions, jnp.int32)
  return positions[None] if positions.ndim == 1 else positions


def _at(positions: Array, batch: Array, index: Array) -> Array:
  """`positions[batch, index]` of `[B|1, T]` positions (row 0 when they are the
  same for every row), for broadcasting index arrays."""
  return positions[0, index] if positions.shape[0] == 1 else positions[batch, index]


# ---------------------------------------------------------------------------
# Transformer-XL relative scores.
# ---------------------------------------------------------------------------


def relative_shift(logits: Array, kv_len: int) -> Array:
  """Re-indexes logits against relative distances into logits against keys.

  Column r of row i of `logits` scores the distance `d_0 + Tq - 1 - r` (the
  largest first), for `r < Tq + Tk - 1`; the result's `[i, j]` is
  `logits[i, j + Tq - 1 - i]`, the score of distance `d_0 + i - j`: query i at
  position `p + i` against key j at `p - d_0 + j`. Row i is shifted left by
  `Tq - 1 - i`, done as in Dai et al. 2019 (appendix B) by a pad, a reshape
  and a slice rather than a gather: flattened with one padding column, row
  i's wanted entries start `Tq - 1` elements later than row i of a `[Tq, L]`
  view would, so dropping `Tq - 1` leading elements aligns every row at once.

  Args:
    logits: `[..., Tq, Tq + Tk - 1]`.
    kv_len: Tk.

  Returns:
    `[..., Tq, Tk]`.
  """
  *batch, q_len, width = logits.shape
  if width != q_len + kv_len - 1:
    raise ValueError(f"logits must have Tq + Tk - 1 = {q_len + kv_len - 1} relative distances "
                     f"for Tq={q_len}, kv_len={kv_len}, got shape {logits.shape}.")
  padded = jnp.pad(logits, [(0, 0)] * (logits.ndim - 1) + [(0, 1)])
  flat = padded.reshape(*batch, q_len * (width + 1))
  aligned = jax.lax.slice_in_dim(flat, q_len - 1, q_len - 1 + q_len * width, axis=-1)
  return aligned.reshape(*batch, q_len, width)[..., :kv_len]


def xl_relative_distances(q_positions: Array, k_positions: Array, q_len: int,
                          kv_len: int) -> Array:
  """The distances `relative_shift` expects, largest first: `[B|1, Tq + Tk - 1]`.

  Positions are taken to be consecutive, `q_positions[..., 0] + arange(Tq)`
  (and likewise the keys'), as in a segment, a segment after its memory or
  the tokens after a KV cache; only the first of each is read.
  """
  q_start = _batched_positions(q_positions, "q_positions")[:, :1]
  k_start = _batched_positions(k_positions, "k_positions")[:, :1]
  return (q_start + q_len - 1 - k_start) - jnp.arange(q_len + kv_len - 1)


def xl_relative_logits(query: Array, key: Array, relative_key: Array, content_bias: Array,
                       position_bias: Array) -> Array:
  """Terms (b), (c) and (d) of Transformer-XL's score (Dai et al. 2019, eq. 3/4):

      u . k_j  +  (q_i + v) . W_{k,R} R_{i-j}

  (term (a), q_i . k_j, is the attention's own). Unscaled.

  Args:
    query: `[B, Tq, H, D]`.
    key: `[B, Tk, H, D]` (key heads repeated to H).
    relative_key: `W_{k,R} R` at the distances of `xl_relative_distances`,
      `[B|1, Tq + Tk - 1, H, D]`.
    content_bias: u `[H, D]`.
    position_bias: v `[H, D]`.

  Returns:
    `[B, H, Tq, Tk]` float32.
  """
  query, key, relative_key = (a.astype(jnp.float32) for a in (query, key, relative_key))
  content = jnp.einsum("hd,bkhd->bhk", content_bias.astype(jnp.float32), key)[:, :, None, :]
  by_distance = jnp.einsum("bqhd,brhd->bhqr", query + position_bias.astype(jnp.float32),
                           relative_key)  # [B, H, Tq, Tq + Tk - 1]
  return content + relative_shift(by_distance, key.shape[1])


class XLRelativePosition(nn.Module):
  """Transformer-XL's relative position scores (Dai et al. 2019) as a logits
  bias: the sinusoids R of the distances, projected per head by W_{k,R}, and
  the learned global content and position biases u and v.

  Attributes:
    num_heads: H.
    head_dim: D.
    max_wavelength: of the sinusoids R (the `max_timescale` of
      `sinusoidal_embedding`).
    kernel_init: initialiser of W_{k,R} `[E, H, D]`; u and v start at zero.
    param_dtype: dtype of the parameters.
  """

  num_heads: int
  head_dim: int
  max_wavelength: float = 10_000.0
  kernel_init: Initializer = nn.initializers.lecun_normal()
  param_dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, query: Array, key: Array, q_positions: Array, k_positions: Array,
               features: int) -> Array:
    """query: `[B, Tq, H, D]`; key: `[B, Tk, H, D]`; positions: `[Tq]`/`[B, Tq]`
    and `[Tk]`/`[B, Tk]`, consecutive (`xl_relative_distances`); features: the
    width E of the sinusoids R (the model's, as in the paper). Returns the
    unscaled `[B, H, Tq, Tk]` float32 terms of `xl_relative_logits`."""
    _check_num_heads(self.num_heads)
    q_len, kv_len = query.shape[1], key.shape[1]
    distances = xl_relative_distances(q_positions, k_positions, q_len, kv_len)
    sinusoids = sinusoidal_embedding(distances, features, self.max_wavelength)  # [B|1, L, E]
    shape = (self.num_heads, self.head_dim)
    kernel = self.param(
        "relative_kernel", nn.with_logical_partitioning(self._init_kernel, ("embed", "heads",
                                                                             "kv")),
        (features,) + shape, self.param_dtype)
    zeros = nn.with_logical_partitioning(nn.initializers.zeros_init(), ("heads", "kv"))
    content_bias = self.param("content_bias", zeros, shape, self.param_dtype)
    position_bias = self.param("position_bias", zeros, shape, self.param_dtype)
    relative_key = jnp.einsum("ble,ehd->blhd", sinusoids, kernel.astype(jnp.float32))
    return xl_relative_logits(query, key, relative_key, content_bias, position_bias)

  def _init_kernel(self, rng, shape, dtype):
    # As a dense [E, H * D] projection, then split into heads.
    return self.kernel_init(rng, (shape[0], shape[1] * shape[2]), dtype).reshape(shape)


# ---------------------------------------------------------------------------
# Shaw et al. 2018: learned embeddings of the clipped relative distance.
# ---------------------------------------------------------------------------


def shaw_relative_index(q_positions: Array, k_positions: Array, max_distance: int) -> Array:
  """clip(k_pos - q_pos, -k, k) + k, the row of each pair's embedding:
  `[B|1, Tq, Tk]` int32 in `[0, 2k]`."""
  if not isinstance(max_distance, int) or isinstance(max_distance, bool) or max_distance < 1:
    raise ValueError(f"max_distance must be a positive int (the clipping distance k), got "
                     f"{max_distance!r}.")
  relative = _relative_positions(q_positions, k_positions)
  return (jnp.clip(relative, -max_distance, max_distance) + max_distance).astype(jnp.int32)


class ShawRelativeEmbeddings(nn.Module):
  """The tables a^K and a^V of Shaw et al. 2018: one `[2k + 1, D]` row per
  clipped distance, shared by the heads (as in the paper).

  Attributes:
    max_distance: k, the clipping distance.
    embedding_init: initialiser of both tables.
    param_dtype: their dtype.
  """

  max_distance: int = 16
  embedding_init: Initializer = nn.initializers.normal(stddev=0.02)
  param_dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, head_dim: int, value_dim: int):
    """Returns `(key_embeddings [2k + 1, D], value_embeddings [2k + 1, Dv])`."""
    rows = 2 * self.max_distance + 1
    table = lambda name, width: self.param(
        name, nn.with_logical_partitioning(self.embedding_init, ("relpos_buckets", "kv")),
        (rows, width), self.param_dtype)
    return table("key_embeddings", head_dim), table("value_embeddings", value_dim)


# ---------------------------------------------------------------------------
# Complex-valued word embeddings (Wang et al. 2020).
# ---------------------------------------------------------------------------


def complex_word_embedding(amplitude: Array, frequency: Array, phase: Array,
                           positions: Array) -> Array:
  """f(j, pos)_d = r_{j,d} exp(i (w_{j,d} pos + theta_{j,d})), as real numbers.

  Each dimension is a wave in the position whose amplitude, frequency and
  phase belong to the word, so f(j, pos + k) = f(j, pos) * exp(i w_j k): the
  embedding at a shifted position is a fixed linear map (a rotation per
  dimension) of the one at the original position, whatever that position.

  Args:
    amplitude, frequency, phase: r, w, theta of each token `[B, T, E/2]`.
    positions: `[T]` or `[B, T]`.

  Returns:
    `[B, T, E]` float32: the real parts, then the imaginary parts.
  """
  positions = jnp.asarray(positions, jnp.float32)
  positions = positions[None, :, None] if positions.ndim == 1 else positions[..., None]
  angle = frequency * positions + phase
  return jnp.concatenate([amplitude * jnp.cos(angle), amplitude * jnp.sin(angle)], axis=-1)


class ComplexWordEmbedding(nn.Module):
  """Token embedding by `complex_word_embedding`: tables of amplitudes,
  frequencies and phases `[V, E/2]` (Wang et al. 2020, "Encoding word order in
  complex embeddings"). Replaces the token embedding and the position
  embedding both.

  Attributes:
    vocab_size: V.
    features: E, even (E/2 complex dimensions).
    param_dtype: dtype of the tables.
  """

  vocab_size: int
  features: int
  param_dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, tokens: Array, positions: Optional[Array] = None) -> Array:
    """tokens: `[B, T]` ids; positions: `[T]`, `[B, T]` or None (`arange(T)`). Returns `[B, T, E]`."""
    if not isinstance(self.features, int) or self.features <= 0 or self.features % 2:
      raise ValueError(f"features must be a positive even int (real and imaginary halves), "
                       f"got {self.features!r}.")
    batch, length = tokens.shape
    if positions is None:
      positions = jnp.arange(length)
    _check_positions(positions, batch, length)
    shape = (self.vocab_size, self.features // 2)
    table = lambda name, init: jnp.take(self.param(
        name, nn.with_logical_partitioning(init, ("vocab", "embed")), shape, self.param_dtype),
        tokens, axis=0)
    amplitude = table("amplitude", nn.initializers.normal(stddev=1.0))
    # Frequencies on the scale of the sinusoids' (wavelengths of a few to
    # thousands of positions); phases uniform on a turn.
    frequency = table("frequency", nn.initializers.uniform(scale=1.0))
    phase = table("phase", nn.initializers.uniform(scale=2 * math.pi))
    return complex_word_embedding(amplitude, frequency, phase, positions)
