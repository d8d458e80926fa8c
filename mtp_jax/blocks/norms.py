"""RMSNorm."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


class RMSNorm(nnx.Module):
  """x * rsqrt(mean(x^2) + eps) * weight, computed in float32."""

  def __init__(self, dim: int, *, eps: float, dtype=jnp.float32):
    self.weight = nnx.Param(jnp.ones((dim,), dtype))
    self.eps = eps

  def __call__(self, x_BxTxD: jax.Array) -> jax.Array:
    x = x_BxTxD.astype(jnp.float32)
    x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps)
    return (x * self.weight[...].astype(jnp.float32)).astype(x_BxTxD.dtype)
