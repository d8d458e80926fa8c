"""Causal GQA self-attention with RoPE over a cache (see cache.py) or over its own rows."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from mtp_jax.blocks import cache as cache_lib
from mtp_jax.blocks.linear import Linear
from mtp_jax.blocks.rope import rope
from mtp_jax.config import BlockConfig


class Attention(nnx.Module):
  """Causal GQA self-attention with RoPE; caches k, v dtype[B, L, Hkv, Dh] (`KVCache`)."""

  def __init__(self, cfg: BlockConfig, *, rngs: nnx.Rngs):
    d, h, hkv, dh, dt = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.jnp_dtype
    self.q_proj = Linear(d, h * dh, bias=cfg.attention_bias, dtype=dt, rngs=rngs)
    self.k_proj = Linear(d, hkv * dh, bias=cfg.attention_bias, dtype=dt, rngs=rngs)
    self.v_proj = Linear(d, hkv * dh, bias=cfg.attention_bias, dtype=dt, rngs=rngs)
    self.o_proj = Linear(h * dh, d, dtype=dt, rngs=rngs)
    self.num_heads, self.num_kv_heads, self.head_dim = h, hkv, dh
    self.rope_theta = cfg.rope_theta

  def __call__(self, x_BxTxD, rows_BxT, valid_BxT, cache: cache_lib.KVCache | None, rope_offset: int = 0):
    """Attends row j to rows 0..j of the same sequence.

    Args:
      x_BxTxD: dtype[B, T, D] normed inputs.
      rows_BxT: int32[B, T] row index of each input (RoPE position is row + rope_offset).
      valid_BxT: bool[B, T]; invalid rows are neither written to the cache nor attended to.
      cache: KVCache with L rows, or None to attend within this call's rows only (training).
    Returns:
      (dtype[B, T, D], new KVCache or None).
    """
    b, t, _ = x_BxTxD.shape
    hkv, dh = self.num_kv_heads, self.head_dim
    g = self.num_heads // hkv
    pos_BxT = rows_BxT + rope_offset
    q = rope(self.q_proj(x_BxTxD).reshape(b, t, hkv * g, dh), pos_BxT, self.rope_theta)
    k = rope(self.k_proj(x_BxTxD).reshape(b, t, hkv, dh), pos_BxT, self.rope_theta)
    v = self.v_proj(x_BxTxD).reshape(b, t, hkv, dh)
    new_cache, (k_BxSxKxDh, v_BxSxKxDh), key_rows_BxS = cache_lib.update(cache, rows_BxT, valid_BxT, k, v)
    q = q.reshape(b, t, hkv, g, dh)
    scores = jnp.einsum("btkgd,bskd->bkgts", q, k_BxSxKxDh.astype(q.dtype),
                        preferred_element_type=jnp.float32) * dh**-0.5
    mask_BxTxS = key_rows_BxS[:, None, :] <= rows_BxT[:, :, None]
    scores = jnp.where(mask_BxTxS[:, None, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v_BxSxKxDh.dtype)
    # Rows no query may read get probability 0, but 0 * NaN = NaN: select them away so NaN / inf
    # left in stale rows (a reset slot's earlier request) cannot leak into any output.
    newest_B = jnp.max(jnp.where(valid_BxT, rows_BxT, -1), axis=1)
    readable_BxS = key_rows_BxS <= newest_B[:, None]
    v_BxSxKxDh = jnp.where(readable_BxS[:, :, None, None], v_BxSxKxDh, jnp.zeros((), v_BxSxKxDh.dtype))
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v_BxSxKxDh).reshape(b, t, hkv * g * dh)
    return self.o_proj(out.astype(x_BxTxD.dtype)), new_cache
