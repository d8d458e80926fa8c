"""Rotary position embedding: rotate-half or interleaved pairs, partial rotary, YaRN scaling.

Frequencies follow transformers' `ROPE_INIT_FUNCTIONS` ("default" and "yarn"), so a config.json
means the same here as there.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from mtp_jax.config import RopeScaling


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
  """YaRN's magnitude correction 0.1 * mscale * ln(scale) + 1 (1 when not extending)."""
  return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def inv_frequencies(rotary_dim: int, theta: float,
                    scaling: RopeScaling | None = None) -> tuple[np.ndarray, float]:
  """(float32[rotary_dim / 2] inverse frequencies, factor on cos and sin) for plain or YaRN RoPE."""
  exponents = np.arange(0, rotary_dim, 2, dtype=np.float32) / rotary_dim
  inv_freq = (1.0 / theta**exponents).astype(np.float32)
  if scaling is None:
    return inv_freq, 1.0
  factor = scaling.scale
  attention_factor = scaling.attention_factor
  if attention_factor is None:
    if scaling.mscale and scaling.mscale_all_dim:
      attention_factor = yarn_mscale(factor, scaling.mscale) / yarn_mscale(factor, scaling.mscale_all_dim)
    else:
      attention_factor = yarn_mscale(factor)

  def correction_dim(rotations):  # the dim whose wavelength fits `rotations` times in the original context
    return (rotary_dim * math.log(scaling.original_max_position_embeddings / (rotations * 2 * math.pi))
            / (2 * math.log(theta)))

  low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
  if scaling.truncate:
    low, high = math.floor(low), math.ceil(high)
  low, high = max(low, 0), min(high, rotary_dim - 1)
  if low == high:
    high += 0.001  # as transformers: no division by zero
  ramp = np.clip((np.arange(rotary_dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
  extrapolate = 1 - ramp  # 1 for fast (high-frequency) dims, kept as they are
  inv_freq = (inv_freq / factor) * (1 - extrapolate) + inv_freq * extrapolate
  return inv_freq.astype(np.float32), float(attention_factor)


def apply_rope(x_BxTxHxDh: jax.Array, pos_BxT: jax.Array, inv_freq, *,
               interleave: bool = False, attention_factor: float = 1.0) -> jax.Array:
  """Rotates the first 2 * len(inv_freq) dims of each head at integer positions pos_BxT.

  Rotate-half pairs dim i with i + R/2; interleave pairs (2i, 2i + 1) and, as transformers
  does, returns the rotated pairs de-interleaved (evens then odds). Queries and keys get the
  same permutation, so their dot products equal the interleaved rotation's.
  attention_factor scales cos and sin (YaRN).
  """
  inv_freq = np.asarray(inv_freq, np.float32)  # float32[R / 2]
  rot = 2 * inv_freq.shape[0]
  angle_BxTxR2 = pos_BxT.astype(jnp.float32)[..., None] * inv_freq
  cos = (jnp.cos(angle_BxTxR2) * attention_factor)[:, :, None, :]
  sin = (jnp.sin(angle_BxTxR2) * attention_factor)[:, :, None, :]
  x = x_BxTxHxDh.astype(jnp.float32)
  x_rot, x_pass = x[..., :rot], x[..., rot:]
  if interleave:
    x1, x2 = x_rot[..., 0::2], x_rot[..., 1::2]
  else:
    x1, x2 = x_rot[..., :rot // 2], x_rot[..., rot // 2:]
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, x_pass], axis=-1)
  return out.astype(x_BxTxHxDh.dtype)


def rope(x_BxTxHxDh: jax.Array, pos_BxT: jax.Array, theta: float) -> jax.Array:
  """Plain rotate-half rotary embedding over the whole head."""
  return apply_rope(x_BxTxHxDh, pos_BxT, inv_frequencies(x_BxTxHxDh.shape[-1], theta)[0])
