"""Layers: the multi-head attention mixer, feed-forward, norms and Transformer blocks."""

from attention_jax.layers.attention import MultiHeadAttention
from attention_jax.layers.blocks import EncoderBlock
from attention_jax.layers.feedforward import ACTIVATIONS, FeedForward
from attention_jax.layers.norms import NORMS, make_norm
