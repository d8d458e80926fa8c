"""DeepSeek-V4's sliding-window attention (its MTP layer's; the target's pure sliding layers are the same).

One head serves as key and value for all H query heads (MQA), normed and turned by RoPE before it
is cached; so values carry RoPE too, and each head's output is turned back by the inverse rotation
at the query's own position, leaving what a value contributes a function of the query-key distance.
Queries come from a LoRA (q_a_proj, a weighted RMSNorm, q_b_proj) and are RMS-normed per head with no
weight. RoPE turns the LAST rotary_dim dims of a head, in interleaved pairs (2i, 2i + 1) kept in place
(transformers 5.25 deepseek_v4 `apply_rotary_pos_emb`). A learned sink per head joins the softmax; the
output projection is grouped: the H heads split into o_groups groups, each projected on its own to
o_lora_rank (o_a_proj), then o_b_proj mixes them to D.

The cache is the GQA one (one kv head, values = keys), so dense and paged caches both serve it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mtp_jax.blocks import cache as cache_lib
from mtp_jax.blocks.linear import Linear, param, weight_of
from mtp_jax.blocks.masks import TreeRows
from mtp_jax.blocks.norms import RMSNorm
from mtp_jax.blocks.rope import inv_frequencies
from mtp_jax.config import BlockConfig


def rope_tail(x_BxTxHxDh: jax.Array, pos_BxT: jax.Array, inv_freq, *, inverse: bool = False) -> jax.Array:
  """Turns the last 2 * len(inv_freq) dims of each head in interleaved pairs at positions pos_BxT, in
  float32, pairs left in place; inverse turns them back (angle -theta). Same shape and dtype as x."""
  inv_freq = np.asarray(inv_freq, np.float32)
  rot = 2 * inv_freq.shape[0]
  angle = pos_BxT.astype(jnp.float32)[..., None, None] * inv_freq  # [B, T, 1, R / 2]
  cos, sin = jnp.cos(angle), jnp.sin(angle) * (-1.0 if inverse else 1.0)
  x = x_BxTxHxDh.astype(jnp.float32)
  keep, pairs = x[..., :-rot], x[..., -rot:].reshape(x.shape[:-1] + (rot // 2, 2))
  even, odd = pairs[..., 0], pairs[..., 1]
  turned = jnp.stack([even * cos - odd * sin, odd * cos + even * sin], axis=-1).reshape(x.shape[:-1] + (rot,))
  return jnp.concatenate([keep, turned], axis=-1).astype(x_BxTxHxDh.dtype)


class SinkMqaAttention(nnx.Module):
  """The attention above: q_a_proj [R_q, D], q_a_norm [R_q], q_b_proj [H Dh, R_q], kv_proj [Dh, D],
  kv_norm [Dh], o_a_proj [G R_o, H Dh / G], o_b_proj [D, G R_o], sinks float32[H] (G = o_groups,
  R_q / R_o = q_lora_rank / o_lora_rank), the names transformers 5.25 gives them."""

  def __init__(self, cfg: BlockConfig, *, rngs: nnx.Rngs):
    d, h, dh, dt, mqa = cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.jnp_dtype, cfg.sink_mqa
    self.q_a_proj = Linear(d, mqa.q_lora_rank, axes=(None, "embed"), dtype=dt, rngs=rngs)
    self.q_a_norm = RMSNorm(mqa.q_lora_rank, eps=cfg.rms_norm_eps, dtype=dt)
    self.q_b_proj = Linear(mqa.q_lora_rank, h * dh, axes=("heads", None), dtype=dt, rngs=rngs)
    self.kv_proj = Linear(d, dh, axes=(None, "embed"), dtype=dt, rngs=rngs)
    self.kv_norm = RMSNorm(dh, eps=cfg.rms_norm_eps, dtype=dt, axis="head_dim")
    self.o_a_proj = Linear(h * dh // mqa.o_groups, mqa.o_groups * mqa.o_lora_rank, axes=(None, None), dtype=dt,
                           rngs=rngs)
    self.o_b_proj = Linear(mqa.o_groups * mqa.o_lora_rank, d, axes=("embed", None), dtype=dt, rngs=rngs)
    self.sinks = param(jnp.zeros((h,), jnp.float32), ("heads",))
    self.num_heads, self.head_dim, self.groups = h, dh, mqa.o_groups
    self.window, self.eps = cfg.sliding_window, cfg.rms_norm_eps
    self.inv_freq = tuple(inv_frequencies(cfg.rotary_dim, cfg.rope_theta)[0].tolist())  # static module data

  def __call__(self, x_BxTxD, rows_BxT, valid_BxT, cache: cache_lib.KVCache | None, rope_offset: int = 0,
               tree: TreeRows | None = None):
    """Same arguments and returns as `Attention`: x dtype[B, T, D] normed inputs, rows int32[B, T]
    (RoPE position row + rope_offset), valid bool[B, T]; returns (dtype[B, T, D], new cache or None)."""
    b, t, _ = x_BxTxD.shape
    h, dh = self.num_heads, self.head_dim
    pos_BxT = rows_BxT + rope_offset
    q = self.q_b_proj(self.q_a_norm(self.q_a_proj(x_BxTxD))).reshape(b, t, h, dh)
    q32 = q.astype(jnp.float32)  # per-head RMSNorm without a weight
    q = (q32 * jax.lax.rsqrt(jnp.mean(q32 * q32, axis=-1, keepdims=True) + self.eps)).astype(q.dtype)
    q = rope_tail(q, pos_BxT, self.inv_freq)
    kv = rope_tail(self.kv_norm(self.kv_proj(x_BxTxD)).reshape(b, t, 1, dh), pos_BxT, self.inv_freq)
    new_cache, out = cache_lib.or_none(cache).attend(q.reshape(b, t, 1, h, dh), kv, kv, rows_BxT, valid_BxT,
                                                     window=self.window, sinks_KxG=self.sinks[...].reshape(1, h),
                                                     tree=tree)
    out = rope_tail(out.reshape(b, t, h, dh).astype(x_BxTxD.dtype), pos_BxT, self.inv_freq, inverse=True)
    g = self.groups
    w_GxRxI = weight_of(self.o_a_proj, "weight").reshape(g, -1, h * dh // g)
    grouped = jnp.einsum("btgi,gri->btgr", out.reshape(b, t, g, h * dh // g), w_GxRxI)
    return self.o_b_proj(grouped.reshape(b, t, -1)), new_cache
