"""Paged KV caches: a pool of fixed-size pages per layer, one page table, an on-device allocator.

Row j of sequence b lives in page `table[b, j // page_size]` at offset `j % page_size`, so rows
stay position-addressed (as in cache.py) and the causal mask still excludes stale rows. Every
layer of a model (every MTP module, every target layer) has its own pool
k, v dtype[num_pages, page_size, Hkv, Dh], and all of them share one table int32[B, max_pages]:
page id p is taken in every pool at once. The table lives once, in `Pages`; a model binds it
to its caches for a call (`bind`) and drops it after (`unbind`), so a state holds one copy
and donating the state never donates a buffer twice.

`Pages` is the allocator: the table, the pages each slot holds and a stack of free page ids,
all device arrays, so `ensure` / `release` / `reset` are pure jittable functions (no host round
trip). A slot that cannot get the pages it asks for gets none of them and is flagged in
`Pages.oom`; its writes beyond its pages are dropped (sent to the out-of-range page id
`num_pages`), never wrapped into another slot's pages.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from mtp_jax import validate
from mtp_jax.blocks.cache import NO_ROW
from mtp_jax.config import BlockConfig


def check_paging(max_len: int, page_size: int, num_pages: int) -> int:
  """Validates a paged layout; returns max_pages = max_len // page_size (the pages of one sequence)."""
  page_size = validate.positive_int("page_size", page_size)
  if max_len % page_size:
    raise validate.InvalidValue("page_size", f"page_size={page_size} must divide max_len={max_len}")
  max_pages = max_len // page_size
  if validate.positive_int("num_pages", num_pages) < max_pages:
    raise validate.InvalidValue("num_pages", f"num_pages={num_pages} is too small for one sequence: "
                                f"max_len={max_len} needs max_len // page_size = {max_pages} pages")
  return max_pages


def allocator(batch_size: int, max_len: int, page_size: int | None, num_pages: int | None):
  """The `Pages` for page_size / num_pages (both or neither), or None for contiguous caches."""
  if (page_size is None) != (num_pages is None):
    raise validate.InvalidValue("page_size", "page_size and num_pages must be given together, got "
                                f"page_size={page_size!r}, num_pages={num_pages!r}")
  return None if page_size is None else Pages.create(batch_size, max_len, page_size, num_pages)


def _exclusive_cumsum(x_B):
  return jnp.cumsum(x_B) - x_B


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Pages:
  """The page allocator of one model's caches.

  table: int32[B, max_pages], the page holding rows p * page_size.. of slot b, or num_pages
    where the slot holds no page; used: int32[B], pages slot b holds (always table[b, :used]);
  free: int32[num_pages], a stack of free page ids, free[:num_free]; num_free: int32[];
  oom: bool[B], a request of the slot could not be met (sticky until the slot is reset).
  """

  table: jax.Array
  used: jax.Array
  free: jax.Array
  num_free: jax.Array
  oom: jax.Array
  page_size: int = dataclasses.field(metadata=dict(static=True))

  @classmethod
  def create(cls, batch_size: int, max_len: int, page_size: int, num_pages: int) -> "Pages":
    max_pages = check_paging(max_len, page_size, num_pages)
    return cls(table=jnp.full((batch_size, max_pages), num_pages, jnp.int32),
               used=jnp.zeros((batch_size,), jnp.int32),
               # Popped from the end: pages 0, 1, .. go out first.
               free=jnp.arange(num_pages - 1, -1, -1, dtype=jnp.int32),
               num_free=jnp.asarray(num_pages, jnp.int32), oom=jnp.zeros((batch_size,), bool),
               page_size=page_size)

  @property
  def num_pages(self) -> int:
    return self.free.shape[0]

  def ensure(self, num_rows_B) -> "Pages":
    """Gives each slot the pages for rows 0..num_rows_B[b]-1 (int32[B]).

    Slots are served in order while pages last; a slot that does not fit gets nothing and is
    flagged in oom (the ones after it may still fit).
    """
    ps, max_pages = self.page_size, self.table.shape[1]
    want_B = jnp.minimum(-(-num_rows_B // ps), max_pages)
    need_B = jnp.maximum(want_B - self.used, 0)
    # Greedy in slot order: slot b is served if everything asked before it that was served,
    # plus its own need, fits. A scan keeps "served before" exact (a cumsum would count refused slots).
    def serve(left, need):
      ok = need <= left
      return left - jnp.where(ok, need, 0), ok
    left, ok_B = jax.lax.scan(serve, self.num_free, need_B)
    got_B = jnp.where(ok_B, need_B, 0)
    p_BxP = jnp.arange(max_pages, dtype=jnp.int32)[None]
    new_BxP = (p_BxP >= self.used[:, None]) & (p_BxP < (self.used + got_B)[:, None])
    k_BxP = _exclusive_cumsum(got_B)[:, None] + p_BxP - self.used[:, None]  # k-th page popped
    popped_BxP = self.free[jnp.clip(self.num_free - 1 - k_BxP, 0, self.num_pages - 1)]
    return dataclasses.replace(self, table=jnp.where(new_BxP, popped_BxP, self.table), used=self.used + got_B,
                               num_free=left, oom=self.oom | ~ok_B)

  def release(self, num_rows_B) -> "Pages":
    """Keeps the pages for rows 0..num_rows_B[b]-1 (int32[B]) and returns the slot's others to the pool."""
    ps, max_pages = self.page_size, self.table.shape[1]
    keep_B = jnp.minimum(jnp.minimum(-(-num_rows_B // ps), max_pages), self.used)
    give_B = self.used - keep_B
    p_BxP = jnp.arange(max_pages, dtype=jnp.int32)[None]
    back_BxP = (p_BxP >= keep_B[:, None]) & (p_BxP < self.used[:, None])
    pos_BxP = self.num_free + _exclusive_cumsum(give_B)[:, None] + p_BxP - keep_B[:, None]
    free = self.free.at[jnp.where(back_BxP, pos_BxP, self.num_pages)].set(self.table, mode="drop")
    return dataclasses.replace(self, table=jnp.where(back_BxP, self.num_pages, self.table), used=keep_B,
                               free=free, num_free=self.num_free + jnp.sum(give_B))

  def reset(self, mask_B) -> "Pages":
    """Frees every page of the slots where mask_B (bool[B]) is True and clears their oom flag."""
    freed = self.release(jnp.where(mask_B, 0, self.used * self.page_size))
    return dataclasses.replace(freed, oom=self.oom & ~mask_B)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedKVCache:
  """One GQA layer's paged cache: pools k, v dtype[num_pages, page_size, Hkv, Dh], and while
  bound for a call, its model's page table int32[B, max_pages] (None in a stored state)."""

  k: jax.Array
  v: jax.Array
  table: jax.Array | None
  max_pages: int = dataclasses.field(metadata=dict(static=True))

  @classmethod
  def zeros(cls, cfg: BlockConfig, pages: Pages, dtype=None) -> "PagedKVCache":
    shape = (pages.num_pages, pages.page_size, cfg.num_kv_heads, cfg.head_dim)
    dtype = dtype or cfg.jnp_dtype
    return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), None, pages.table.shape[1])

  @property
  def page_size(self) -> int:
    return self.k.shape[1]

  @property
  def max_len(self) -> int:
    return self.max_pages * self.page_size

  def with_table(self, table) -> "PagedKVCache":
    return dataclasses.replace(self, table=table)

  def _addresses(self, rows_BxT, valid_BxT):
    """(page int32[B, T], offset int32[B, T]) of each row; page num_pages (dropped) where invalid."""
    num_pages, ps = self.k.shape[0], self.page_size
    p_BxT = rows_BxT // ps
    in_table_BxT = valid_BxT & (rows_BxT >= 0) & (p_BxT < self.table.shape[1])
    page_BxT = jnp.take_along_axis(self.table, jnp.clip(p_BxT, 0, self.table.shape[1] - 1), axis=1)
    return jnp.where(in_table_BxT, page_BxT, num_pages), rows_BxT % ps

  def update(self, rows_BxT, valid_BxT, k_BxTxKxDh, v_BxTxKxDh):
    """Writes k, v dtype[B, T, Hkv, Dh] at their rows' pages (dropped where the slot holds no page).

    Returns (new cache, (k, v dtype[B, L, Hkv, Dh]) gathered through the table, int32[B, L]):
    keys of pages the slot does not hold carry NO_ROW.
    """
    if self.table is None:
      raise ValueError("a PagedKVCache needs its page table: bind it first (blocks.paged.bind)")
    page_BxT, off_BxT = self._addresses(rows_BxT, valid_BxT)
    write = lambda pool, x: pool.at[page_BxT, off_BxT].set(x.astype(pool.dtype), mode="drop")
    new = dataclasses.replace(self, k=write(self.k, k_BxTxKxDh), v=write(self.v, v_BxTxKxDh))
    b, max_pages = self.table.shape
    gather = lambda pool: jnp.take(pool, self.table, axis=0, mode="clip").reshape(
        b, max_pages * self.page_size, *pool.shape[2:])
    rows_BxL = jnp.broadcast_to(jnp.arange(self.max_len, dtype=jnp.int32), (b, self.max_len))
    held_BxL = jnp.repeat(self.table < self.k.shape[0], self.page_size, axis=1)
    return new, (gather(new.k), gather(new.v)), jnp.where(held_BxL, rows_BxL, NO_ROW)

  def partition_specs(self, batch_axis, model_axis, model_size: int) -> "PagedKVCache":
    """PartitionSpecs: pools' Hkv on model_axis when it divides by model_size; pages are shared
    by the whole batch, so no axis is on batch_axis (the table, bound per call, lives in `Pages`)."""
    pool = P(None, None, model_axis if self.k.shape[2] % model_size == 0 else None, None)
    return PagedKVCache(pool, pool, None, self.max_pages)


def paged_cache(cfg: BlockConfig, pages: Pages, dtype=None) -> PagedKVCache:
  """An empty paged cache for a layer of cfg; GQA only (MLA's latent cache has no paged form yet)."""
  if cfg.mla is not None:
    raise validate.InvalidValue("page_size", "page_size: paged caches hold GQA k, v; MLA attention "
                                "(cfg.mla) has no paged cache yet")
  return PagedKVCache.zeros(cfg, pages, dtype)


def bind(caches: tuple[PagedKVCache, ...], pages: Pages) -> tuple[PagedKVCache, ...]:
  """Every cache with the allocator's current table, for one model call."""
  return tuple(c.with_table(pages.table) for c in caches)


def unbind(caches: tuple[PagedKVCache, ...]) -> tuple[PagedKVCache, ...]:
  """The caches without their table again, as a state stores them."""
  return tuple(c.with_table(None) for c in caches)
