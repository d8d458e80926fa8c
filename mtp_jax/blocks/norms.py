"""RMSNorm, scaling by weight or by (1 + weight)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


class RMSNorm(nnx.Module):
  """x * rsqrt(mean(x^2) + eps) * scale over the last axis, computed in float32.

  scale is weight, or with unit_offset (Qwen3-Next's zero-centred norms) 1 + weight, weight
  starting at 0. Either way a fresh norm is the identity scale.
  """

  def __init__(self, dim: int, *, eps: float, dtype=jnp.float32, unit_offset: bool = False):
    self.weight = nnx.Param((jnp.zeros if unit_offset else jnp.ones)((dim,), dtype))
    self.eps = eps
    self.unit_offset = unit_offset

  def __call__(self, x_BxTxD: jax.Array) -> jax.Array:
    x = x_BxTxD.astype(jnp.float32)
    x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps)
    scale = self.weight[...].astype(jnp.float32) + (1.0 if self.unit_offset else 0.0)
    return (x * scale).astype(x_BxTxD.dtype)
