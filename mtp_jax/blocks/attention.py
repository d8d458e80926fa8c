"""Causal GQA self-attention with RoPE over a cache (see cache.py) or over its own rows.

Options (BlockConfig): q, k, v biases and an o_proj bias; per-head q / k RMSNorm before RoPE;
Qwen3-Next's output gate; Step-3.5's head-wise gate; a sliding window; learned attention sinks;
value heads of their own width (v_head_dim) and a constant value scale (MiMo-V2-Flash).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from mtp_jax.blocks import cache as cache_lib
from mtp_jax.blocks.linear import Linear, param
from mtp_jax.blocks.masks import TreeRows
from mtp_jax.blocks.norms import RMSNorm
from mtp_jax.blocks.rope import apply_rope, inv_frequencies
from mtp_jax.config import BlockConfig


class Attention(nnx.Module):
  """Causal GQA self-attention with RoPE; its cache (`KVCache` k dtype[B, L, Hkv, Dh], v
  dtype[B, L, Hkv, Dv], or pages of them) attends (`LayerCache.attend`)."""

  def __init__(self, cfg: BlockConfig, *, rngs: nnx.Rngs):
    d, h, hkv, dh, dt = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.jnp_dtype
    dv = cfg.value_dim
    q_width = 2 * h * dh if cfg.attention_gate else h * dh
    self.q_proj = Linear(d, q_width, axes=("heads", "embed"), bias=cfg.attention_bias, dtype=dt, rngs=rngs)
    self.k_proj = Linear(d, hkv * dh, axes=("kv_heads", "embed"), bias=cfg.attention_bias, dtype=dt, rngs=rngs)
    self.v_proj = Linear(d, hkv * dv, axes=("kv_heads", "embed"), bias=cfg.attention_bias, dtype=dt, rngs=rngs)
    self.o_proj = Linear(h * dv, d, axes=("embed", "heads"), bias=cfg.attention_out_bias, dtype=dt, rngs=rngs)
    norm = lambda: RMSNorm(dh, eps=cfg.rms_norm_eps, dtype=dt, unit_offset=cfg.norm_unit_offset, axis="head_dim")
    self.q_norm = norm() if cfg.qk_norm else None
    self.k_norm = norm() if cfg.qk_norm else None
    self.sinks = param(jnp.zeros((h,), dt), ("heads",)) if cfg.attention_sinks else None
    # Step-3.5's g_proj: one gate logit per query head, read from the same normed input as q / k / v.
    self.g_proj = (Linear(d, h, axes=("heads", "embed"), dtype=dt, rngs=rngs) if cfg.attention_head_gate
                   else None)
    self.num_heads, self.num_kv_heads, self.head_dim, self.value_dim = h, hkv, dh, dv
    self.value_scale = cfg.attention_value_scale
    self.gated, self.window, self.interleave = cfg.attention_gate, cfg.sliding_window, cfg.rope_interleave
    self.use_rope = cfg.use_rope
    inv_freq, self.rope_factor = inv_frequencies(cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling)
    self.inv_freq = tuple(inv_freq.tolist())  # static module data, not a param

  def __call__(self, x_BxTxD, rows_BxT, valid_BxT, cache: cache_lib.KVCache | None, rope_offset: int = 0,
               tree: TreeRows | None = None):
    """Attends row j to rows 0..j of the same sequence (the last `sliding_window` of them).

    Args:
      x_BxTxD: dtype[B, T, D] normed inputs.
      rows_BxT: int32[B, T] row index of each input (RoPE position is row + rope_offset).
      valid_BxT: bool[B, T]; invalid rows are neither written to the cache nor attended to.
      cache: a GQA LayerCache (KVCache with L rows, a PagedKVCache view for the call), or None to
        attend within this call's rows only (training).
      tree: the rows are draft-tree nodes (TreeRows), attending to a prefix and their ancestors.
    Returns:
      (dtype[B, T, D], new cache or None).
    """
    b, t, _ = x_BxTxD.shape
    hkv, dh, dv = self.num_kv_heads, self.head_dim, self.value_dim
    g = self.num_heads // hkv
    pos_BxT = rows_BxT + rope_offset
    q = self.q_proj(x_BxTxD).reshape(b, t, hkv * g, -1)
    if self.gated:  # per head [q | gate] (Qwen3-Next's q_proj layout)
      q, gate_BxTxHxDh = q[..., :dh], q[..., dh:]
    k = self.k_proj(x_BxTxD).reshape(b, t, hkv, dh)
    if self.q_norm is not None:
      q, k = self.q_norm(q), self.k_norm(k)
    if self.use_rope:  # Nemotron-H's attention layers carry no position encoding (NoPE)
      q, k = (apply_rope(a, pos_BxT, self.inv_freq, interleave=self.interleave,
                         attention_factor=self.rope_factor) for a in (q, k))
    v = self.v_proj(x_BxTxD).reshape(b, t, hkv, dv)
    if self.value_scale is not None:  # before the cache write, as vLLM / SGLang scale v (cached values scaled)
      v = v * jnp.asarray(self.value_scale, v.dtype)
    q = q.reshape(b, t, hkv, g, dh)
    sinks = None if self.sinks is None else self.sinks[...].reshape(hkv, g)
    new_cache, out = cache_lib.or_none(cache).attend(q, k, v, rows_BxT, valid_BxT, window=self.window,
                                                     sinks_KxG=sinks, tree=tree)
    out = out.reshape(b, t, hkv * g, dv).astype(x_BxTxD.dtype)
    if self.gated:
      out = out * jax.nn.sigmoid(gate_BxTxHxDh)
    if self.g_proj is not None:  # one sigmoid per head scales all of that head's output
      out = out * jax.nn.sigmoid(self.g_proj(x_BxTxD))[..., None]
    return self.o_proj(out.reshape(b, t, hkv * g * dv)), new_cache
