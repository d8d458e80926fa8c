"""RMSNorm, scaling by weight or by (1 + weight)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from mtp_jax.blocks.linear import param


class RMSNorm(nnx.Module):
  """x * rsqrt(mean(x^2) + eps) * scale over the last axis, computed in float32.

  scale is weight, or with unit_offset (Qwen3-Next's zero-centred norms) 1 + weight, weight
  starting at 0. Either way a fresh norm is the identity scale. axis: the weight's logical axis
  (the normed dimension's: "embed", "head_dim", ...).
  """

  def __init__(self, dim: int, *, eps: float, dtype=jnp.float32, unit_offset: bool = False, axis: str | None = None):
    self.weight = param((jnp.zeros if unit_offset else jnp.ones)((dim,), dtype), None if axis is None else (axis,))
    self.eps = eps
    self.unit_offset = unit_offset

  def __call__(self, x_BxTxD: jax.Array) -> jax.Array:
    x = x_BxTxD.astype(jnp.float32)
    x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps)
    scale = self.weight[...].astype(jnp.float32) + (1.0 if self.unit_offset else 0.0)
    return (x * scale).astype(x_BxTxD.dtype)
