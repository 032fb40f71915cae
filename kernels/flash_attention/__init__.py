"""Blockwise-softmax (flash) attention: the pure-JAX `blockwise` and the Pallas kernels.

One algorithm (Rabe & Staats 2021; Dao et al. 2022): queries in blocks, a loop
over the key blocks each can see keeping a running maximum and sum, the
log-sum-exp saved for a backward pass that recomputes the probabilities.

  blockwise.py   pure JAX (lax loops), every backend; the portable fallback
  pallas_gpu.py  Pallas on Triton (NVIDIA/AMD GPUs)
  pallas_mgpu.py Pallas on Mosaic GPU (NVIDIA Hopper)
  pallas_tpu.py  Pallas on Mosaic (TPUs)
  ring.py        ring attention: the sequence sharded over a mesh axis, the
                 blockwise loops on each device, key/value chunks passed round

Importing this package registers `implementation="blockwise"`,
`implementation="pallas"`, `implementation="ring"` and (on Hopper GPUs) `implementation="pallas_mgpu"`
with `attention_jax.dot_product_attention`, and the variants `blockwise` and
`flash` with the registry.
"""

from typing import Optional, Tuple, Union

import jax

from attention_jax import registry
from attention_jax.core.implementations import register_implementation
from attention_jax.core.inputs import AttentionInputs, prepare_inputs, returned_outputs

from . import pallas_gpu, pallas_mgpu, pallas_tpu, ring
from .blockwise import blockwise_attention, blockwise_dot_product_attention, default_block_sizes
from .common import BlockSizes
from .pallas_gpu import default_block_sizes_gpu, flash_attention_gpu, gpu_dot_product_attention
from .pallas_mgpu import default_block_sizes_mgpu, flash_attention_mgpu, mgpu_dot_product_attention
from .pallas_tpu import default_block_sizes_tpu, flash_attention_tpu, tpu_dot_product_attention
from .ring import SEQUENCE_AXIS, ring_attention

# Tq * Tk from which `implementation=None` prefers blockwise to dense on CPU
# (measured: benchmarks/attention_cpu.json).
BLOCKWISE_MIN_SCORES_ON_CPU = 1024 * 1024


def _blockwise_priority(inputs: AttentionInputs) -> int:
  """Above dense XLA on CPU for long sequences; elsewhere the portable fallback."""
  on_cpu = jax.default_backend() == "cpu"
  large = inputs.query.shape[1] * inputs.key.shape[1] >= BLOCKWISE_MIN_SCORES_ON_CPU
  return 1 if on_cpu and large else -1


def pallas_attention(inputs: AttentionInputs, block_sizes: Optional[BlockSizes] = None, *,
                     interpret: Optional[bool] = None, return_residual: bool = False
                     ) -> Union[jax.Array, Tuple[jax.Array, jax.Array]]:
  """The Pallas kernel of the default backend: Mosaic on TPU, Triton elsewhere.

  Off an accelerator the Triton kernel runs in the Pallas interpreter
  (`interpret=None`): exact, and slow; it exists for testing.
  """
  kernel = flash_attention_tpu if jax.default_backend() == "tpu" else flash_attention_gpu
  return kernel(inputs, block_sizes, interpret=interpret, return_residual=return_residual)


def _pallas_rejects(inputs: AttentionInputs) -> Optional[str]:
  if jax.default_backend() == "tpu":
    return pallas_tpu.tpu_rejects(inputs)
  return pallas_gpu.gpu_rejects(inputs)


def flash_dot_product_attention(query, key, value, bias=None, mask=None, *,
                                block_sizes: Optional[BlockSizes] = None,
                                interpret: Optional[bool] = None,
                                return_residual: bool = False, **kwargs):
  """`attention_jax.dot_product_attention` computed by the Pallas flash kernel.

  Takes every argument of `dot_product_attention` except `implementation`,
  plus the kernel's `block_sizes`. On CPU the kernel is interpreted (slow).
  """
  inputs, unbatched = prepare_inputs(query, key, value, bias, mask, **kwargs)
  return returned_outputs(pallas_attention(inputs, block_sizes, interpret=interpret,
                                           return_residual=return_residual), unbatched)


def mosaic_gpu_attention(inputs: AttentionInputs, block_sizes: Optional[BlockSizes] = None, *,
                         interpret: Optional[bool] = None, return_residual: bool = False
                         ) -> Union[jax.Array, Tuple[jax.Array, jax.Array]]:
  """The Mosaic GPU kernels (Hopper GPUs)."""
  return flash_attention_mgpu(inputs, block_sizes, interpret=interpret,
                              return_residual=return_residual)


register_implementation("blockwise", blockwise_attention, priority=_blockwise_priority)
# The best on GPU and TPU whenever it takes the inputs (every mask, bias and
# head layout; head dims up to 256; float32 and bfloat16).
register_implementation("pallas", pallas_attention, priority=2, rejects=_pallas_rejects,
                        is_available=lambda: jax.default_backend() in ("gpu", "tpu"))
# Below the Triton kernels, so `implementation=None` never picks it: it has only
# run in the GPU interpreter and been lowered for CUDA, not timed on a Hopper
# GPU yet. Ask for it by name (or benchmark it: experiments/benchmark_attention).
register_implementation("pallas_mgpu", mosaic_gpu_attention, priority=1,
                        rejects=pallas_mgpu.mgpu_rejects,
                        is_available=pallas_mgpu.is_hopper_or_newer)

# Never picked by `implementation=None`: it needs a mesh with a "sequence" axis
# (`jax.set_mesh`), and pays communication that only long sequences repay.
register_implementation("ring", ring.attention_over_ring, priority=-10,
                        rejects=ring.ring_rejects)

_EXACT_KERNEL = dict(family="kernels", complexity="O(T^2)", subquadratic=False, exact=True,
                     causal=True, cross=True)
# What a config can set; `block_sizes` (a BlockSizes) is for Python callers.
_KERNEL_OPTIONS = dict(
    local_window_size=registry.VariantOption(
        "local_window_size", tuple, None,
        "(left, right): each query sees keys q - left .. q + right; None for all"),
    scale=registry.VariantOption("scale", float, None,
                                 "multiplies the logits; 1/sqrt(D) when None"))
registry.register(registry.VariantSpec(
    name="blockwise", fn=blockwise_dot_product_attention,
    paper="Rabe & Staats 2021; Dao et al. 2022", options=_KERNEL_OPTIONS, **_EXACT_KERNEL))
registry.register(registry.VariantSpec(
    name="flash", fn=flash_dot_product_attention, paper="Dao et al. 2022",
    options=dict(_KERNEL_OPTIONS,
                 interpret="run the Pallas interpreter; None: only off an accelerator"),
    **_EXACT_KERNEL))
