"""DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5): MLA (mla.py) whose queries each attend only to
the index_topk keys a lightning indexer scores highest among those they may see.

The indexer (transformers' DeepseekV32Indexer, vLLM's / SGLang's Indexer) has projections of its own:
  q = wq_b(q_resid)                      per index head, dtype[B, T, Hi, Di] (q_resid: MLA's normed q LoRA)
  k = LayerNorm(wk(x))                   one key per row, dtype[B, T, Di], cached beside MLA's latent
  both rotated on their first Dr dims (halves for DeepSeek-V3.2, pairs for GLM-5: DsaConfig.rope_interleave)
  score[t, s] = sum_h w[t, h] * relu(q[t, h] . k[s]) * Di^-0.5,   w = weights_proj(x) * Hi^-0.5 (float32)
then the visible keys with the top index_topk scores are kept. The released kernels add a Hadamard
rotation of q and k (orthogonal: dot products unchanged) and FP8 scoring, a precision choice; this
computes the scores in float32, as transformers does.

Caches: `DsaCache` (dense, row j at index j) and `PagedDsaCache` (pages) hold MLA's latent and rope
key and the indexer's key per row; `init_cache` / `init_paged_cache` pick them for a config with dsa.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from mtp_jax.blocks import cache as cache_lib
from mtp_jax.blocks.axes import axes
from mtp_jax.blocks.linear import Linear, param
from mtp_jax.blocks.masks import TreeRows
from mtp_jax.blocks.mla import MlaAttention
from mtp_jax.blocks.paged import PagedRows
from mtp_jax.blocks.pages import AttentionMetadata, Pages
from mtp_jax.blocks.rope import apply_rope
from mtp_jax.config import BlockConfig

_INDEX_NORM_EPS = 1e-6  # the indexer's k_norm: every reference builds it with eps 1e-6, whatever the config says


class LayerNorm(nnx.Module):
  """(x - mean) * rsqrt(var + eps) * weight + bias over the last axis, computed in float32."""

  def __init__(self, dim: int, *, eps: float, dtype):
    self.weight = param(jnp.ones((dim,), dtype), (None,))
    self.bias = param(jnp.zeros((dim,), dtype), (None,))
    self.eps = eps

  def __call__(self, x_BxTxD: jax.Array) -> jax.Array:
    x = x_BxTxD.astype(jnp.float32)
    x = x - jnp.mean(x, axis=-1, keepdims=True)
    x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps)
    return (x * self.weight[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)).astype(x_BxTxD.dtype)


class Indexer(nnx.Module):
  """The lightning indexer: scores every key a query may see (module docstring). Its heads are few
  and narrow, so its params are never split (vLLM replicates them too)."""

  def __init__(self, cfg: BlockConfig, inv_freq: tuple, rope_factor: float, *, rngs: nnx.Rngs):
    d, dsa, dt = cfg.hidden_size, cfg.dsa, cfg.jnp_dtype
    hi, di = dsa.index_n_heads, dsa.index_head_dim
    self.wq_b = Linear(cfg.mla.q_lora_rank, hi * di, axes=(None, "q_lora"), dtype=dt, rngs=rngs)
    self.wk = Linear(d, di, axes=(None, "embed"), dtype=dt, rngs=rngs)
    self.k_norm = LayerNorm(di, eps=_INDEX_NORM_EPS, dtype=dt)
    # Kept float32 in bf16 models, as transformers (_keep_in_fp32_modules) and vLLM keep it.
    self.weights_proj = Linear(d, hi, axes=(None, "embed"), dtype=jnp.float32, rngs=rngs)
    self.num_heads, self.head_dim = hi, di
    self.inv_freq, self.rope_factor, self.interleave = inv_freq, rope_factor, dsa.rope_interleave

  def _rope(self, x_BxTxHxDi, pos_BxT):
    return apply_rope(x_BxTxHxDi, pos_BxT, self.inv_freq, interleave=self.interleave,
                      attention_factor=self.rope_factor)

  def key(self, x_BxTxD, pos_BxT) -> jax.Array:
    """The indexer key of each row at positions int32[B, T]: dtype[B, T, Di] (what the cache holds)."""
    return self._rope(self.k_norm(self.wk(x_BxTxD))[:, :, None], pos_BxT)[:, :, 0]

  def scores(self, x_BxTxD, q_resid_BxTxRq, pos_BxT, keys_BxSxDi) -> jax.Array:
    """float32[B, T, S]: each query row's index score of each of S keys (unmasked)."""
    b, t, _ = x_BxTxD.shape
    q = self._rope(self.wq_b(q_resid_BxTxRq).reshape(b, t, self.num_heads, self.head_dim), pos_BxT)
    qk_BxTxHxS = jnp.einsum("bthd,bsd->bths", q.astype(jnp.float32), keys_BxSxDi.astype(jnp.float32))
    w_BxTxH = self.weights_proj(x_BxTxD.astype(jnp.float32)) * self.num_heads**-0.5
    return jnp.einsum("bth,bths->bts", w_BxTxH, jax.nn.relu(qk_BxTxHxS * self.head_dim**-0.5))


def top_k_mask(scores_BxTxS: jax.Array, mask_BxTxS: jax.Array, k: int) -> jax.Array:
  """bool[B, T, S]: mask_BxTxS narrowed to the k keys of highest score per query (all of a query's
  visible keys when it sees k or fewer). Ties go to the lower key index."""
  b, t, s = scores_BxTxS.shape
  if k >= s:
    return mask_BxTxS
  _, top_BxTxK = jax.lax.top_k(jnp.where(mask_BxTxS, scores_BxTxS, -jnp.inf), k)
  chosen = jnp.zeros((b, t, s), bool).at[jnp.arange(b)[:, None, None], jnp.arange(t)[None, :, None],
                                         top_BxTxK].set(True)
  return mask_BxTxS & chosen


class DsaAttention(MlaAttention):
  """MLA (its projections, cache rows and attention, mla.py) with the lightning indexer choosing the
  keys; caches `DsaCache` / `PagedDsaCache` rows. Needs cfg.dsa and an MLA q LoRA (BlockConfig checks)."""

  def __init__(self, cfg: BlockConfig, *, rngs: nnx.Rngs):
    super().__init__(cfg, rngs=rngs)
    self.indexer = Indexer(cfg, self.inv_freq, self.rope_factor, rngs=rngs)
    self.index_topk = cfg.dsa.index_topk

  def __call__(self, x_BxTxD, rows_BxT, valid_BxT, cache: DsaCache | PagedDsaCache | None, rope_offset: int = 0,
               tree: TreeRows | None = None, *, absorb: bool | None = None):
    """As `Attention.__call__` (x dtype[B, T, D], rows int32[B, T], valid bool[B, T]); each query reads
    only its top index_topk visible keys. Returns (dtype[B, T, D], new cache or None)."""
    pos_BxT = rows_BxT + rope_offset
    q_nope, q_rope, latent_BxTxR, k_rope_BxTxDr, q_resid = self.project(x_BxTxD, pos_BxT)
    index_k_BxTxDi = self.indexer.key(x_BxTxD, pos_BxT)
    new_cache, (latent_BxSxR, k_rope_BxSxDr, index_k_BxSxDi), mask_BxTxS = cache_lib.or_none(cache).keys(
        rows_BxT, valid_BxT, (latent_BxTxR, k_rope_BxTxDr, index_k_BxTxDi), value=0, window=self.window, tree=tree)
    if self.index_topk < mask_BxTxS.shape[-1]:  # else every visible key is kept: no scores needed
      scores_BxTxS = self.indexer.scores(x_BxTxD, q_resid, pos_BxT, index_k_BxSxDi)
      mask_BxTxS = top_k_mask(scores_BxTxS, mask_BxTxS, self.index_topk)
    out = self.attend(q_nope, q_rope, latent_BxSxR, k_rope_BxSxDr, mask_BxTxS, x_BxTxD.dtype, absorb=absorb)
    return out, new_cache


def _widths(cfg: BlockConfig) -> tuple[int, int, int]:
  return cfg.mla.kv_lora_rank, cfg.mla.qk_rope_head_dim, cfg.dsa.index_head_dim


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DsaCache(cache_lib.ContiguousRows, cache_lib.LayerCache):
  """One DSA layer's cache, row j at index j: MLA's latent dtype[B, L, R] and rope key dtype[B, L, Dr]
  (as `MlaCache`) and the indexer's key dtype[B, L, Di]."""

  latent: jax.Array = axes("batch", "cache_rows", "kv_lora")
  k_rope: jax.Array = axes("batch", "cache_rows", "head_dim")
  index_k: jax.Array = axes("batch", "cache_rows", None)

  @classmethod
  def zeros(cls, cfg: BlockConfig, batch_size: int, max_len: int, dtype=None) -> "DsaCache":
    dtype = dtype or cfg.jnp_dtype
    return cls(*(jnp.zeros((batch_size, max_len, w), dtype) for w in _widths(cfg)))

  @property
  def max_len(self) -> int:
    return self.latent.shape[1]

  def update(self, rows_BxT, valid_BxT, latent_BxTxR, k_rope_BxTxDr, index_k_BxTxDi):
    """Writes dtype[B, T, R], dtype[B, T, Dr], dtype[B, T, Di]; returns (new DsaCache, the three of
    all L rows, int32[B, L])."""
    new = DsaCache(*(cache_lib.write_rows(buf, rows_BxT, valid_BxT, x) for buf, x in
                     ((self.latent, latent_BxTxR), (self.k_rope, k_rope_BxTxDr), (self.index_k, index_k_BxTxDi))))
    return new, (new.latent, new.k_rope, new.index_k), cache_lib.all_rows(self.latent.shape[0], self.max_len)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedDsaCache(PagedRows):
  """One DSA layer's paged cache: pools latent dtype[num_pages, page_size, R], k_rope
  dtype[num_pages, page_size, Dr] and index_k dtype[num_pages, page_size, Di] (the rows of
  `DsaCache`, in pages; see paged.PagedRows)."""

  POOLS = ("latent", "k_rope", "index_k")

  latent: jax.Array = axes("pages", "page_rows", "kv_lora")
  k_rope: jax.Array = axes("pages", "page_rows", "head_dim")
  index_k: jax.Array = axes("pages", "page_rows", None)
  max_pages: int = dataclasses.field(metadata=dict(static=True))
  meta: AttentionMetadata | None = None

  @classmethod
  def zeros(cls, cfg: BlockConfig, pages: Pages, dtype=None) -> "PagedDsaCache":
    dtype = dtype or cfg.jnp_dtype
    pools = (jnp.zeros((pages.num_pages, pages.page_size, w), dtype) for w in _widths(cfg))
    return cls(*pools, pages.table.shape[1])
