"""Pallas kernels of the chunkwise recurrent mixers' recurrence (GPU and TPU).

`chunkwise_kernel` computes what `attention_jax.variants.chunkwise.engine`'s
chunkwise form does, forward and backward, in Pallas kernels; the mixers run
it with `form="pallas_gpu"` or `"pallas_tpu"`. The pure-JAX chunkwise form
stays the fallback and the reference the kernels are tested against.
"""

from .kernel import BACKENDS, DEFAULT_CHUNK, chunkwise_kernel

__all__ = ["BACKENDS", "DEFAULT_CHUNK", "chunkwise_kernel"]
