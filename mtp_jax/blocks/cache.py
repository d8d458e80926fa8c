"""Per-layer caches. A cache class owns its layout and how attention reads it.

Every cache (this dense `KVCache`, the MLA latent `MlaCache`, the paged ones in paged.py, and
`NoCache`, a call's own rows in training) is a `LayerCache`: a frozen pytree dataclass with

  cache.max_len -> int: L, the rows one sequence can hold.
  cache.update(rows_BxT, valid_BxT, *entries) -> (new cache, views, key_rows_BxS):
    writes entry row t of sequence b (each entry dtype[B, T, ...]) as row rows_BxT[b, t] where
    valid_BxT[b, t], and returns `views`, one dtype[B, S, ...] array per entry holding every
    key the layer may attend to, with key_rows_BxS: int32[B, S], the row each key holds.
    A query at row r attends to key s iff key_rows_BxS[b, s] <= r, so rows a cache holds
    beyond a sequence's length (stale or never written) must carry rows > any query's row.
  cache.move_rows(src_BxA, dst_BxA, valid_BxA) -> new cache (tree compaction).
and, built on `update`, the reads attention makes: `keys` (what an MLA layer reads) and
`attend` (GQA attention; a paged cache overrides it to read only the pages in use).

The caches here are *position-addressed*: row j of a sequence lives at index j, so a write is
a scatter at known rows and a stale row is excluded by the causal mask alone. Rows to skip are
sent to index L, which `mode="drop"` discards: nothing can wrap around into another row or slot.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from mtp_jax.blocks.axes import axes
from mtp_jax.blocks.masks import TreeRows, causal_mask, gqa_attention, readable_rows
from mtp_jax.config import BlockConfig

NO_ROW = jnp.iinfo(jnp.int32).max  # key_rows of a key that no query may attend to


def write_rows(buf_BxLx: jax.Array, rows_BxT: jax.Array, valid_BxT: jax.Array, new_BxTx: jax.Array):
  """buf with new_BxTx[b, t] written at index rows_BxT[b, t] where valid; others dropped."""
  write_BxT = jnp.where(valid_BxT, rows_BxT, buf_BxLx.shape[1])  # index L is dropped: no wrap-around
  b_idx = jnp.arange(buf_BxLx.shape[0])[:, None]
  return buf_BxLx.at[b_idx, write_BxT].set(new_BxTx.astype(buf_BxLx.dtype), mode="drop")


def all_rows(batch_size: int, max_len: int) -> jax.Array:
  """key_rows_BxS of a position-addressed cache: int32[B, L], key s holds row s."""
  return jnp.broadcast_to(jnp.arange(max_len, dtype=jnp.int32), (batch_size, max_len))


class LayerCache:
  """The reads every per-layer cache shares, built on its `update` (a mixin of the cache dataclasses)."""

  def keys(self, rows_BxT, valid_BxT, entries, *, value: int, window: int | None = None,
           tree: TreeRows | None = None):
    """Writes this call's entries (each dtype[B, T, ...]) to the cache; returns what its queries read.

    Returns (new cache, views: one dtype[B, S, ...] per entry, mask bool[B, T, S]). In
    views[value], the entry read as values, every row no valid query may read is zeroed (see
    readable_rows); keys need no such care, their scores are masked by a select. Sequence calls
    see their cache causally; tree calls (`tree`) the committed prefix plus their ancestors, and
    then S is the cache's rows followed by the call's own T rows.
    """
    if tree is None:
      new_cache, views, key_rows_BxS = self.update(rows_BxT, valid_BxT, *entries)
      views = tuple(readable_rows(v, rows_BxT, valid_BxT, key_rows_BxS) if i == value else v
                    for i, v in enumerate(views))
      return new_cache, views, causal_mask(rows_BxT, key_rows_BxS, window=window)
    writes_BxT = valid_BxT if tree.write_BxT is not None else jnp.zeros_like(valid_BxT)
    new_cache, views, key_rows_BxS = self.update(
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

  def attend(self, q_BxTxKxGxDh, k_BxTxKxDh, v_BxTxKxDh, rows_BxT, valid_BxT, *, window: int | None = None,
             sinks_KxG: jax.Array | None = None, tree: TreeRows | None = None):
    """GQA attention: writes this call's k dtype[B, T, Hkv, Dh], v dtype[B, T, Hkv, Dv] and attends
    queries dtype[B, T, Hkv, G, Dh] over what `keys` returns; returns (new cache, dtype[B, T, Hkv, G, Dv])."""
    new_cache, (k_BxSxKxDh, v_BxSxKxDh), mask_BxTxS = self.keys(
        rows_BxT, valid_BxT, (k_BxTxKxDh, v_BxTxKxDh), value=1, window=window, tree=tree)
    return new_cache, gqa_attention(q_BxTxKxGxDh, k_BxSxKxDh, v_BxSxKxDh, mask_BxTxS, sinks_KxG=sinks_KxG)


@dataclasses.dataclass(frozen=True)
class NoCache(LayerCache):
  """No cache (training, references): a call's queries see its own valid rows only; keeps nothing."""

  def update(self, rows_BxT, valid_BxT, *entries):
    """Returns (None, the entries themselves, their rows: int32[B, T], NO_ROW where invalid)."""
    return None, entries, jnp.where(valid_BxT, rows_BxT, NO_ROW)

  def keys(self, rows_BxT, valid_BxT, entries, *, value, window=None, tree=None):
    if tree is not None:
      raise ValueError("tree rows attend to a cached prefix: pass the layer's cache")
    return super().keys(rows_BxT, valid_BxT, entries, value=value, window=window)


NO_CACHE = NoCache()


def or_none(cache) -> LayerCache:
  """cache, or NO_CACHE for None (a call that attends within its own rows)."""
  return NO_CACHE if cache is None else cache


class ContiguousRows:
  """Row moves and growth of a cache whose every array holds dtype[B, L, ...] (a mixin)."""

  def move_rows(self, src_BxA: jax.Array, dst_BxA: jax.Array, valid_BxA: jax.Array):
    """This cache with row src_BxA[b, a] copied to row dst_BxA[b, a] (int32[B, A]) where valid_BxA;
    every source is read before anything is written, so sources and destinations may overlap."""
    def move(buf_BxLx):
      src = jnp.take_along_axis(buf_BxLx, src_BxA.reshape(src_BxA.shape + (1,) * (buf_BxLx.ndim - 2)), axis=1)
      return write_rows(buf_BxLx, dst_BxA, valid_BxA, src)
    return jax.tree.map(move, self)

  def grown(self, max_len: int):
    """This cache padded to max_len rows (>= max_len now), rows kept."""
    if max_len < self.max_len:
      raise ValueError(f"max_len={max_len} is below the caches' {self.max_len} rows")
    return jax.tree.map(lambda x: jnp.pad(x, [(0, 0), (0, max_len - x.shape[1])] + [(0, 0)] * (x.ndim - 2)), self)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache(ContiguousRows, LayerCache):
  """One GQA layer's cache: k dtype[B, L, Hkv, Dh], v dtype[B, L, Hkv, Dv], row j at index j."""

  k: jax.Array = axes("batch", "cache_rows", "kv_heads", "head_dim")
  v: jax.Array = axes("batch", "cache_rows", "kv_heads", "head_dim")

  @classmethod
  def zeros(cls, cfg: BlockConfig, batch_size: int, max_len: int, dtype=None) -> "KVCache":
    dtype = dtype or cfg.jnp_dtype
    return cls(jnp.zeros((batch_size, max_len, cfg.num_kv_heads, cfg.head_dim), dtype),
               jnp.zeros((batch_size, max_len, cfg.num_kv_heads, cfg.value_dim), dtype))

  @property
  def max_len(self) -> int:
    return self.k.shape[1]

  def update(self, rows_BxT, valid_BxT, k_BxTxKxDh, v_BxTxKxDh):
    """Writes k dtype[B, T, Hkv, Dh], v dtype[B, T, Hkv, Dv]; returns (new KVCache, (k, v of all L rows),
    int32[B, L])."""
    new = KVCache(write_rows(self.k, rows_BxT, valid_BxT, k_BxTxKxDh),
                  write_rows(self.v, rows_BxT, valid_BxT, v_BxTxKxDh))
    return new, (new.k, new.v), all_rows(self.k.shape[0], self.max_len)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MlaCache(ContiguousRows, LayerCache):
  """One MLA layer's cache, row j at index j: the compressed latent dtype[B, L, R] (after
  kv_a_layernorm) and the rope key dtype[B, L, Dr] that all heads share (see mla.py)."""

  latent: jax.Array = axes("batch", "cache_rows", "kv_lora")
  k_rope: jax.Array = axes("batch", "cache_rows", "head_dim")

  @classmethod
  def zeros(cls, cfg: BlockConfig, batch_size: int, max_len: int, dtype=None) -> "MlaCache":
    dtype = dtype or cfg.jnp_dtype
    return cls(jnp.zeros((batch_size, max_len, cfg.mla.kv_lora_rank), dtype),
               jnp.zeros((batch_size, max_len, cfg.mla.qk_rope_head_dim), dtype))

  @property
  def max_len(self) -> int:
    return self.latent.shape[1]

  def update(self, rows_BxT, valid_BxT, latent_BxTxR, k_rope_BxTxDr):
    """Writes dtype[B, T, R], dtype[B, T, Dr]; returns (new MlaCache, (latent, k_rope) of all L rows, int32[B, L])."""
    new = MlaCache(write_rows(self.latent, rows_BxT, valid_BxT, latent_BxTxR),
                   write_rows(self.k_rope, rows_BxT, valid_BxT, k_rope_BxTxDr))
    return new, (new.latent, new.k_rope), all_rows(self.latent.shape[0], self.max_len)
