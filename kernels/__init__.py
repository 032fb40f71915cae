"""Pallas kernels (installed as attention_jax.kernels)."""
