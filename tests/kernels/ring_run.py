"""Ring attention against dense attention on 8 simulated CPU devices.

Run as a script (tests/kernels/test_ring.py does, in a subprocess, with a JSON
list of "mesh-layout-full|causal-masks[-dtype]" case names; float32 unless a
dtype is named): the device count must be set before jax initialises. Prints one
JSON object on the last line: per case, the largest differences from
`implementation="xla"` (in float32, of the same input values) of the output,
the log-sum-exp and the gradients of q, k and v.
"""

import functools
import json
import sys

import jax

# Simulated CPU devices, also on a host with an accelerator (before jax's first
# computation creates the backends).
jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 8)
# pylint: disable=wrong-import-position
import jax.numpy as jnp

import attention_jax as aj
from attention_jax.kernels.flash_attention import BlockSizes, ring

jax.config.update("jax_default_matmul_precision", "highest")
B, T, H, HKV, D = 2, 64, 4, 2, 16


def inputs(seed=0):
  keys = jax.random.split(jax.random.key(seed), 3)
  return (jax.random.normal(keys[0], (B, T, H, D)), jax.random.normal(keys[1], (B, T, HKV, D)),
          jax.random.normal(keys[2], (B, T, HKV, D)))


SEGMENTS = jnp.concatenate([jnp.zeros((B, 40), jnp.int32), jnp.ones((B, T - 40), jnp.int32)], 1)
MASKS = {
    "plain": {},
    "padded": dict(query_seq_lengths=jnp.array([T, 45]), key_value_seq_lengths=jnp.array([T, 50])),
    "segments": dict(segment_ids=SEGMENTS),
    "window": dict(local_window_size=(9, 3)),
    # A key mask as the encoders pass their padding, holes anywhere.
    "key_mask": dict(mask=(jnp.arange(T) % 7 != 3)[None, None, None, :] &
                     (jnp.arange(B) == 0)[:, None, None, None] | (jnp.arange(T) < 50)),
}


def _outputs_and_grads(attention, qkv):
  """One program: `(out, lse)` of `attention` and the gradients of q, k and v
  of a loss using both, all in float32."""

  def loss(*qkv):
    out, lse = (x.astype(jnp.float32) for x in attention(*qkv))
    return (jnp.sum(out * jnp.cos(jnp.arange(D))) + jnp.sum(jnp.sin(lse) * (lse > -1e30)),
            (out, lse))

  (_, outputs), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(*qkv)
  return outputs + tuple(g.astype(jnp.float32) for g in grads)


def rounded_inputs(dtype):
  return tuple(x.astype(dtype) for x in inputs())


@functools.lru_cache(maxsize=None)
def dense_results(is_causal, mask_name, dtype):
  """Dense attention's `(out, lse, dq, dk, dv)` in float32 of the inputs
  rounded to `dtype`: one per causality, masks and dtype, whatever the ring's
  mesh and layout."""
  kwargs = dict(is_causal=is_causal, return_residual=True, **MASKS[mask_name])
  dense = lambda *qkv: aj.dot_product_attention(*qkv, implementation="xla", **kwargs)
  return _outputs_and_grads(dense, [x.astype(jnp.float32) for x in rounded_inputs(dtype)])


def differences(mesh, layout, is_causal, mask_name, dtype=jnp.float32):
  """Largest |ring - dense| of out, lse and d(q, k, v) of a loss using both: the
  ring takes the inputs in `dtype`, dense attention the same values in float32."""
  kwargs = dict(is_causal=is_causal, return_residual=True, **MASKS[mask_name])
  ring_attention = lambda *qkv: ring.ring_attention(
      *qkv, mesh=mesh, layout=layout, block_sizes=BlockSizes(8, 8), **kwargs)
  ours = _outputs_and_grads(ring_attention, rounded_inputs(dtype))
  expected = dense_results(is_causal, mask_name, jnp.dtype(dtype).name)
  return {name: float(jnp.max(jnp.abs(a - b)))
          for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), ours, expected)}


def collectives(mesh, layout):
  """The collective ops in the compiled forward+backward of a causal ring."""
  q, k, v = inputs()
  loss = lambda *qkv: jnp.sum(ring.ring_attention(*qkv, mesh=mesh, layout=layout,
                                                  is_causal=True) ** 2)
  text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v).compile().as_text()
  return {op: text.count(f" {op}(") + text.count(f" {op}-start(")
          for op in ("collective-permute", "all-gather", "all-reduce", "all-to-all")}


def main():
  meshes = {"sequence8": jax.make_mesh((8,), ("sequence",)),
            "data2_sequence4": jax.make_mesh((2, 4), ("data", "sequence"))}
  cases = {}
  for name in json.loads(sys.argv[1]):
    mesh_name, layout, attend, mask_name, *dtype = name.split("-")
    cases[name] = differences(meshes[mesh_name], layout, attend == "causal", mask_name,
                              jnp.dtype(dtype[0]) if dtype else jnp.float32)
  result = dict(cases=cases,
                collectives={layout: collectives(meshes["sequence8"], layout)
                             for layout in ring.LAYOUTS})
  print(json.dumps(result))


if __name__ == "__main__":
  main()
