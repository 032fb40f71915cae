"""Attention kernels, installed as `attention_jax.kernels` (never a top-level `kernels`)."""

from . import flash_attention
