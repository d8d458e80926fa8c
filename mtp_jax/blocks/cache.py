"""Per-layer caches. A cache class owns its layout; attention sees only `update`.

Every cache (this dense `KVCache`, an MLA latent cache, a paged cache) is a frozen pytree
dataclass with:

  cache.max_len -> int: L, the rows one sequence can hold.
  cache.update(rows_BxT, valid_BxT, *entries) -> (new cache, views, key_rows_BxS):
    writes entry row t of sequence b (each entry dtype[B, T, ...]) as row rows_BxT[b, t] where
    valid_BxT[b, t], and returns `views`, one dtype[B, S, ...] array per entry holding every
    key the layer may attend to, with key_rows_BxS: int32[B, S], the row each key holds.
    A query at row r attends to key s iff key_rows_BxS[b, s] <= r, so rows a cache holds
    beyond a sequence's length (stale or never written) must carry rows > any query's row.

The caches here are *position-addressed*: row j of a sequence lives at index j, so a write is
a scatter at known rows and a stale row is excluded by the causal mask alone. Rows to skip are
sent to index L, which `mode="drop"` discards: nothing can wrap around into another row or slot.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from mtp_jax.config import BlockConfig

NO_ROW = jnp.iinfo(jnp.int32).max  # key_rows of a key that no query may attend to


def write_rows(buf_BxLx: jax.Array, rows_BxT: jax.Array, valid_BxT: jax.Array, new_BxTx: jax.Array):
  """buf with new_BxTx[b, t] written at index rows_BxT[b, t] where valid; others dropped."""
  write_BxT = jnp.where(valid_BxT, rows_BxT, buf_BxLx.shape[1])  # index L is dropped: no wrap-around
  b_idx = jnp.arange(buf_BxLx.shape[0])[:, None]
  return buf_BxLx.at[b_idx, write_BxT].set(new_BxTx.astype(buf_BxLx.dtype), mode="drop")


def move_rows(cache, src_BxA: jax.Array, dst_BxA: jax.Array, valid_BxA: jax.Array):
  """A contiguous cache (KVCache, MlaCache) with row src_BxA[b, a] copied to row dst_BxA[b, a] where
  valid; every source is read before anything is written, so sources and destinations may overlap."""
  if not isinstance(cache, (KVCache, MlaCache)):
    raise ValueError(f"move_rows needs a contiguous cache (KVCache, MlaCache), got {type(cache).__name__}")
  def move(buf_BxLx):
    src = jnp.take_along_axis(buf_BxLx, src_BxA.reshape(src_BxA.shape + (1,) * (buf_BxLx.ndim - 2)), axis=1)
    return write_rows(buf_BxLx, dst_BxA, valid_BxA, src)
  return jax.tree.map(move, cache)


def grow_caches(caches: tuple, max_len: int) -> tuple:
  """Contiguous caches (KVCache, MlaCache) padded to max_len rows; every array holds rows on axis 1."""
  for c in caches:
    if not isinstance(c, (KVCache, MlaCache)):
      raise ValueError(f"only contiguous caches grow (paged ones are sized by their pool), got {type(c).__name__}")
    if max_len < c.max_len:
      raise ValueError(f"max_len={max_len} is below the caches' {c.max_len} rows")
  pad = lambda x: jnp.pad(x, [(0, 0), (0, max_len - x.shape[1])] + [(0, 0)] * (x.ndim - 2))
  return jax.tree.map(pad, caches)


def all_rows(batch_size: int, max_len: int) -> jax.Array:
  """key_rows_BxS of a position-addressed cache: int32[B, L], key s holds row s."""
  return jnp.broadcast_to(jnp.arange(max_len, dtype=jnp.int32), (batch_size, max_len))


def update(cache, rows_BxT: jax.Array, valid_BxT: jax.Array, *entries: jax.Array):
  """`cache.update(...)`, or with cache None the keys of this call's own valid rows (training).

  Returns (new cache or None, views, key_rows_BxS) as `update` in the module docstring.
  """
  if cache is None:
    return None, entries, jnp.where(valid_BxT, rows_BxT, NO_ROW)
  return cache.update(rows_BxT, valid_BxT, *entries)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
  """One GQA layer's cache: k, v dtype[B, L, Hkv, Dh], row j at index j."""

  k: jax.Array
  v: jax.Array

  @classmethod
  def zeros(cls, cfg: BlockConfig, batch_size: int, max_len: int, dtype=None) -> "KVCache":
    shape = (batch_size, max_len, cfg.num_kv_heads, cfg.head_dim)
    dtype = dtype or cfg.jnp_dtype
    return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))

  @property
  def max_len(self) -> int:
    return self.k.shape[1]

  def update(self, rows_BxT, valid_BxT, k_BxTxKxDh, v_BxTxKxDh):
    """Writes k, v dtype[B, T, Hkv, Dh]; returns (new KVCache, (k, v dtype[B, L, Hkv, Dh]), int32[B, L])."""
    new = KVCache(write_rows(self.k, rows_BxT, valid_BxT, k_BxTxKxDh),
                  write_rows(self.v, rows_BxT, valid_BxT, v_BxTxKxDh))
    return new, (new.k, new.v), all_rows(self.k.shape[0], self.max_len)

  def partition_specs(self, batch_axis, model_axis, model_size: int) -> "KVCache":
    """PartitionSpecs: B on batch_axis, Hkv on model_axis when it divides by model_size."""
    spec = P(batch_axis, None, model_axis if self.k.shape[2] % model_size == 0 else None, None)
    return KVCache(spec, spec)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MlaCache:
  """One MLA layer's cache, row j at index j: the compressed latent dtype[B, L, R] (after
  kv_a_layernorm) and the rope key dtype[B, L, Dr] that all heads share (see mla.py)."""

  latent: jax.Array
  k_rope: jax.Array

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

  def partition_specs(self, batch_axis, model_axis, model_size: int) -> "MlaCache":
    """PartitionSpecs: B on batch_axis; every head reads the whole latent, so no model split."""
    del model_axis, model_size
    return MlaCache(P(batch_axis, None, None), P(batch_axis, None, None))
