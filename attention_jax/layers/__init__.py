"""Layers: the parts a block is built from (the multi-head attention mixer,
feed-forward, norms). Blocks and the layer stack live in `attention_jax.models`."""

from attention_jax.layers.attention import MultiHeadAttention
from attention_jax.layers.feedforward import ACTIVATIONS, FeedForward
from attention_jax.layers.norms import NORMS, make_norm
