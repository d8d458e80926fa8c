"""Causal GQA self-attention with RoPE over a cache (see cache.py) or over its own rows.

Options (BlockConfig): q, k, v biases and an o_proj bias; per-head q / k RMSNorm before RoPE;
Qwen3-Next's output gate; a sliding window; learned attention sinks.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from mtp_jax.blocks import cache as cache_lib
from mtp_jax.blocks.linear import Linear, param
from mtp_jax.blocks.masks import causal_mask, readable_rows
from mtp_jax.blocks.norms import RMSNorm
from mtp_jax.blocks.paged import PagedKVCache
from mtp_jax.blocks.rope import apply_rope, inv_frequencies
from mtp_jax.config import BlockConfig


def attention_probs(scores_BxKxGxTxS, mask_BxTxS, *, sinks_KxG: jax.Array | None = None) -> jax.Array:
  """Softmax of float32 scores over the S keys the mask allows.

  sinks_KxG: a learned logit per query head that joins the softmax denominator only, so a
  head may attend to nothing.
  """
  scores = jnp.where(mask_BxTxS[:, None, None], scores_BxKxGxTxS, jnp.finfo(jnp.float32).min)
  if sinks_KxG is None:
    return jax.nn.softmax(scores, axis=-1)
  sink = sinks_KxG.astype(jnp.float32)[None, :, :, None, None]
  top = jnp.maximum(jnp.max(scores, axis=-1, keepdims=True), sink)
  e = jnp.exp(scores - top)
  return e / (jnp.sum(e, axis=-1, keepdims=True) + jnp.exp(sink - top))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TreeRows:
  """A call whose rows are nodes of a draft tree (mtp_jax/tree.py) rather than a run of a sequence.

  base_B: int32[B]: every row sees the cached rows < base_B[b] (the sequence's committed
    prefix) and no other cached row;
  visible_TxT: bool[T, T]: row t also sees this call's row u where visible_TxT[t, u] (itself
    and its ancestors), from the keys computed in this call;
  write_BxT: int32[B, T], the cache row each call row is written to, or None: nothing is written.
  The rows_BxT of the call give RoPE positions only (a node at depth d sits at position P + d).
  """

  base_B: jax.Array
  visible_TxT: jax.Array
  write_BxT: jax.Array | None = None


def attended_keys(cache, rows_BxT, valid_BxT, entries, *, value: int, window: int | None = None,
                  tree: TreeRows | None = None):
  """Writes this call's entries (each dtype[B, T, ...]) to the cache; returns what its queries read.

  Returns (new cache or None, views: one dtype[B, S, ...] per entry, mask bool[B, T, S]). In
  views[value], the entry read as values, every row no valid query may read is zeroed (see
  readable_rows); keys need no such care, their scores are masked by a select. Sequence calls see their
  cache causally; tree calls (`tree`) the committed prefix plus their ancestors, and then S is
  the cache's rows followed by the call's own T rows.
  """
  if tree is None:
    new_cache, views, key_rows_BxS = cache_lib.update(cache, rows_BxT, valid_BxT, *entries)
    views = tuple(readable_rows(v, rows_BxT, valid_BxT, key_rows_BxS) if i == value else v
                  for i, v in enumerate(views))
    return new_cache, views, causal_mask(rows_BxT, key_rows_BxS, window=window)
  if cache is None:
    raise ValueError("tree rows attend to a cached prefix: pass the layer's cache")
  writes_BxT = valid_BxT if tree.write_BxT is not None else jnp.zeros_like(valid_BxT)
  new_cache, views, key_rows_BxS = cache.update(
      rows_BxT if tree.write_BxT is None else tree.write_BxT, writes_BxT, *entries)
  committed_BxS = key_rows_BxS < tree.base_B[:, None]
  committed = lambda v: jnp.where(committed_BxS.reshape(committed_BxS.shape + (1,) * (v.ndim - 2)), v,
                                  jnp.zeros((), v.dtype))
  views = tuple(jnp.concatenate([committed(v) if i == value else v, e.astype(v.dtype)], axis=1)
                for i, (v, e) in enumerate(zip(views, entries)))
  b, t = rows_BxT.shape
  mask_BxTxS = jnp.concatenate([jnp.broadcast_to(committed_BxS[:, None], (b, t, committed_BxS.shape[1])),
                                jnp.asarray(tree.visible_TxT)[None] & valid_BxT[:, None]], axis=-1)
  if window is not None:
    key_pos_BxS = jnp.concatenate([key_rows_BxS, rows_BxT], axis=1)
    mask_BxTxS &= key_pos_BxS[:, None] > rows_BxT[:, :, None] - window
  return new_cache, views, mask_BxTxS


class Attention(nnx.Module):
  """Causal GQA self-attention with RoPE; caches k, v dtype[B, L, Hkv, Dh] (`KVCache`) or pages of
  them (`PagedKVCache`, which attends over the pages in use itself)."""

  def __init__(self, cfg: BlockConfig, *, rngs: nnx.Rngs):
    d, h, hkv, dh, dt = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.jnp_dtype
    q_width = 2 * h * dh if cfg.attention_gate else h * dh
    self.q_proj = Linear(d, q_width, axes=("heads", "embed"), bias=cfg.attention_bias, dtype=dt, rngs=rngs)
    self.k_proj = Linear(d, hkv * dh, axes=("kv_heads", "embed"), bias=cfg.attention_bias, dtype=dt, rngs=rngs)
    self.v_proj = Linear(d, hkv * dh, axes=("kv_heads", "embed"), bias=cfg.attention_bias, dtype=dt, rngs=rngs)
    self.o_proj = Linear(h * dh, d, axes=("embed", "heads"), bias=cfg.attention_out_bias, dtype=dt, rngs=rngs)
    norm = lambda: RMSNorm(dh, eps=cfg.rms_norm_eps, dtype=dt, unit_offset=cfg.norm_unit_offset, axis="head_dim")
    self.q_norm = norm() if cfg.qk_norm else None
    self.k_norm = norm() if cfg.qk_norm else None
    self.sinks = param(jnp.zeros((h,), dt), ("heads",)) if cfg.attention_sinks else None
    self.num_heads, self.num_kv_heads, self.head_dim = h, hkv, dh
    self.gated, self.window, self.interleave = cfg.attention_gate, cfg.sliding_window, cfg.rope_interleave
    inv_freq, self.rope_factor = inv_frequencies(cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling)
    self.inv_freq = tuple(inv_freq.tolist())  # static module data, not a param

  def __call__(self, x_BxTxD, rows_BxT, valid_BxT, cache: cache_lib.KVCache | None, rope_offset: int = 0,
               tree: TreeRows | None = None):
    """Attends row j to rows 0..j of the same sequence (the last `sliding_window` of them).

    Args:
      x_BxTxD: dtype[B, T, D] normed inputs.
      rows_BxT: int32[B, T] row index of each input (RoPE position is row + rope_offset).
      valid_BxT: bool[B, T]; invalid rows are neither written to the cache nor attended to.
      cache: KVCache with L rows, or None to attend within this call's rows only (training).
      tree: the rows are draft-tree nodes (TreeRows), attending to a prefix and their ancestors.
    Returns:
      (dtype[B, T, D], new KVCache or None).
    """
    b, t, _ = x_BxTxD.shape
    hkv, dh = self.num_kv_heads, self.head_dim
    g = self.num_heads // hkv
    pos_BxT = rows_BxT + rope_offset
    q = self.q_proj(x_BxTxD).reshape(b, t, hkv * g, -1)
    if self.gated:  # per head [q | gate] (Qwen3-Next's q_proj layout)
      q, gate_BxTxHxDh = q[..., :dh], q[..., dh:]
    k = self.k_proj(x_BxTxD).reshape(b, t, hkv, dh)
    if self.q_norm is not None:
      q, k = self.q_norm(q), self.k_norm(k)
    q, k = (apply_rope(a, pos_BxT, self.inv_freq, interleave=self.interleave,
                       attention_factor=self.rope_factor) for a in (q, k))
    v = self.v_proj(x_BxTxD).reshape(b, t, hkv, dh)
    q = q.reshape(b, t, hkv, g, dh)
    sinks = None if self.sinks is None else self.sinks[...].reshape(hkv, g)
    if isinstance(cache, PagedKVCache) and tree is None:  # reads only the pages in use, not a [B, max_len] view
      new_cache = cache.write(rows_BxT, valid_BxT, k, v)
      out = new_cache.attend(q, rows_BxT, valid_BxT, window=self.window, sinks_KxG=sinks)
    else:
      new_cache, (k_BxSxKxDh, v_BxSxKxDh), mask_BxTxS = attended_keys(cache, rows_BxT, valid_BxT, (k, v), value=1,
                                                                      window=self.window, tree=tree)
      scores = jnp.einsum("btkgd,bskd->bkgts", q, k_BxSxKxDh.astype(q.dtype),
                          preferred_element_type=jnp.float32) * dh**-0.5
      probs = attention_probs(scores, mask_BxTxS, sinks_KxG=sinks)
      out = jnp.einsum("bkgts,bskd->btkgd", probs.astype(v_BxSxKxDh.dtype), v_BxSxKxDh)
    out = out.reshape(b, t, hkv * g, dh).astype(x_BxTxD.dtype)
    if self.gated:
      out = out * jax.nn.sigmoid(gate_BxTxHxDh)
    return self.o_proj(out.reshape(b, t, hkv * g * dh)), new_cache
