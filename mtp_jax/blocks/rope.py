"""Rotary position embedding."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rope(x_BxTxHxDh: jax.Array, pos_BxT: jax.Array, theta: float) -> jax.Array:
  """Rotate-half rotary embedding at integer positions pos_BxT."""
  half = x_BxTxHxDh.shape[-1] // 2
  inv_freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
  angle_BxTxHalf = pos_BxT.astype(jnp.float32)[..., None] * inv_freq
  cos = jnp.cos(angle_BxTxHalf)[:, :, None, :]
  sin = jnp.sin(angle_BxTxHalf)[:, :, None, :]
  x = x_BxTxHxDh.astype(jnp.float32)
  x1, x2 = x[..., :half], x[..., half:]
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_BxTxHxDh.dtype)
