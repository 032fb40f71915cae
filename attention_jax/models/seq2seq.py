"""The RNN encoder-decoder with attention (Bahdanau et al. 2015; Luong et al.
2015), any registered Q/K/V variant as its attention.

  model = build_model(dict(kind="rnn_seq2seq", attention="additive", rnn_cell="gru",
                           vocab_size=13, num_classes=13, embed_dim=64, num_heads=1))
  logits = model.apply(variables, inputs, targets)            # teacher forcing
  tokens = decoding.decode(model, variables, inputs, max_length=31, beam_size=4)

The encoder is a bidirectional GRU or LSTM over the source; its outputs,
projected to the model width, are the annotations that the decoder attends
to, and its final states (both directions) start the decoder. Each decoder
step is Luong's arrangement with input feeding:

  h_t = cell(h_{t-1}, [embed(y_{t-1}); h~_{t-1}])
  c_t = attention(query h_t, keys and values = annotations)
  h~_t = tanh(W_c [c_t; h_t]),   logits_t = W_o h~_t

so every scoring function attends from the state it scores (Bahdanau's
additive score included: the score, not the wiring, is what the variants
compare). With `decoder_attention=False` it is the encoder-decoder of
Sutskever et al. / Cho et al. 2014: the final states are the only context,
h~_t = h_t. The same `DecoderStep` runs in training (scanned over the target,
teacher-forced) and in decoding (one token at a time, `decode_step`), so the
two agree by construction; tests/models/test_seq2seq.py checks it.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from attention_jax.data.seq2seq import BOS_ID, PAD_ID
from attention_jax.layers.attention import MultiHeadAttention
from attention_jax.models.config import ModelConfig

Array = jnp.ndarray
Carry = Dict[str, Any]
CELLS = {"gru": nn.GRUCell, "lstm": nn.OptimizedLSTMCell}  # config.RNN_CELLS


def shift_right(targets: Array) -> Array:
  """The decoder's inputs under teacher forcing: BOS, then the targets but
  the last. targets: `[B, T]` -> `[B, T]`."""
  return jnp.pad(targets, ((0, 0), (1, 0)), constant_values=BOS_ID)[:, :-1]


class DecoderStep(nn.Module):
  """One decoder step: `(carry, embedded y_{t-1} [B, E]) -> (carry, logits [B, V])`.

  `carry` holds the cell's state, h~_{t-1} `[B, E]` (input feeding) and the
  step t (Luong's local-m centres on it).
  """

  config: ModelConfig

  @nn.compact
  def __call__(self, carry: Carry, embedded: Array, annotations: Array, source_lengths: Array,
               deterministic: bool = True) -> Tuple[Carry, Array]:
    config = self.config
    inputs = embedded
    if config.decoder_attention:
      inputs = jnp.concatenate([embedded, carry["feed"]], axis=-1)
    state, hidden = CELLS[config.rnn_cell](config.embed_dim, name="cell")(carry["state"],
                                                                            inputs)
    output = hidden
    if config.decoder_attention:
      context = MultiHeadAttention(
          num_heads=config.num_heads, attention=config.attention,
          attention_options=config.options_for(config.attention),
          dropout_rate=config.attention_dropout_rate, name="attention")(
              hidden[:, None], annotations, key_value_seq_lengths=source_lengths,
              positions=carry["step"][None], deterministic=deterministic)[:, 0]
      output = jnp.tanh(nn.Dense(config.embed_dim, use_bias=False, name="combine")(
          jnp.concatenate([context, hidden], axis=-1)))
    output = nn.Dropout(config.dropout_rate)(output, deterministic=deterministic)
    logits = nn.Dense(config.vocab_size, name="logits")(output)
    return dict(state=state, feed=output, step=carry["step"] + 1), logits


class RNNEncoderDecoder(nn.Module):
  """Source tokens `[B, Ts]` and target tokens `[B, Tt]` -> logits `[B, Tt, V]`.

  Token 0 is padding in both, the source's valid length is its count of
  non-padding tokens (left-aligned), and the decoder starts from BOS (1).
  Uses `embed_dim`, `num_heads`, `attention` and its options,
  `attention_dropout_rate`, `dropout_rate`, `vocab_size` (source and target
  share it), `rnn_cell` and `decoder_attention` of the config.
  """

  config: ModelConfig

  def setup(self):
    config = self.config
    cell = CELLS[config.rnn_cell]
    self.embed = nn.Embed(config.vocab_size, config.embed_dim)
    self.encoder = nn.Bidirectional(nn.RNN(cell(config.embed_dim)),
                                    nn.RNN(cell(config.embed_dim)), return_carry=True)
    self.annotate = nn.Dense(config.embed_dim)
    self.bridge = nn.Dense(config.embed_dim)
    self.dropout = nn.Dropout(config.dropout_rate)
    self.step = DecoderStep(config)

  def encode(self, inputs: Array, deterministic: bool = True) -> Tuple[Array, Array, Carry]:
    """inputs: `[B, Ts]` -> (annotations `[B, Ts, E]`, source lengths `[B]`,
    the decoder's first carry)."""
    source_lengths = jnp.sum(inputs != PAD_ID, axis=1).astype(jnp.int32)
    embedded = self.dropout(self.embed(inputs), deterministic=deterministic)
    (forward, backward), outputs = self.encoder(embedded, seq_lengths=source_lengths)
    annotations = self.annotate(outputs)
    # The decoder's first state from both directions' last states (an LSTM's
    # cell and hidden state each): s_0 = tanh(W [h_fwd; h_bwd]).
    state = jax.tree.map(lambda f, b: jnp.tanh(self.bridge(jnp.concatenate([f, b], -1))),
                         forward, backward)
    batch = inputs.shape[0]
    carry = dict(state=state, feed=jnp.zeros((batch, self.config.embed_dim), annotations.dtype),
                 step=jnp.zeros((), jnp.int32))
    return annotations, source_lengths, carry

  def decode_step(self, tokens: Array, carry: Carry, annotations: Array,
                  source_lengths: Array) -> Tuple[Array, Carry]:
    """The previous tokens `[B]` -> (logits `[B, V]` of the next, carry)."""
    carry, logits = self.step(carry, self.embed(tokens), annotations, source_lengths)
    return logits, carry

  def __call__(self, inputs: Array, targets: Array, deterministic: bool = True) -> Array:
    """Teacher forcing: the logits of `targets` `[B, Tt]` given their prefixes."""
    annotations, source_lengths, carry = self.encode(inputs, deterministic)
    embedded = self.dropout(self.embed(shift_right(targets)), deterministic=deterministic)

    def step(module, carry, embedded_t):
      return module(carry, embedded_t, annotations, source_lengths, deterministic)

    # One set of step parameters for every position; the attention weights a
    # caller collects ("intermediates") get a time axis.
    scan = nn.scan(step, variable_broadcast="params", variable_axes={"intermediates": 1},
                   split_rngs={"params": False, "dropout": True}, in_axes=1, out_axes=1)
    _, logits = scan(self.step, carry, embedded)
    return logits
