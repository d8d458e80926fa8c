"""Paged caches: a pool of fixed-size pages per layer, read through a call's page table.

Every layer of a model (every MTP module, every target layer) has its own pools: GQA k
dtype[num_pages, page_size, Hkv, Dh] and v of Dv (`PagedKVCache`) or MLA's latent
dtype[num_pages, page_size, R] and rope key dtype[num_pages, page_size, Dr] (`PagedMlaCache`); all
of them share one table int32[B, max_pages] (pages.py): page id p is taken in every pool at once,
and row j of sequence b lives in page `table[b, j // page_size]` at offset `j % page_size`, so rows
stay position-addressed (as in cache.py) and the causal mask still excludes stale rows. A stored
cache is its pools and nothing else; a call reads through the view `for_call(meta)` with the
call's `AttentionMetadata` (pages.py), which `LayerCaches.open` builds once for all the layers.

GQA attention reads only the pages in use (`PagedKVCache.attend`): the held pages of all slots,
flattened into one list of `budget` pages with their owner slot, each scored against its
owner's queries, with the softmax taken across one owner's pages by segment max / sum, so the
rows read per step follow the rows in use, not B x max_len. MLA and draft-tree calls read the
table's dense view (`update`). With a `span`, every call reads the dense view of the first span
columns instead: B x span pages, each slot's rows as one block, which for a few query rows per
slot (a decode step) runs faster on XLA:CPU than the page list's per-page products, and so does
a prefill; the Engine's calls read so.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from mtp_jax.blocks.axes import axes
from mtp_jax.blocks.cache import NO_ROW, LayerCache
from mtp_jax.blocks.masks import TreeRows, causal_mask, readable_rows
from mtp_jax.blocks.pages import AttentionMetadata, Pages
from mtp_jax.config import BlockConfig


class PagedRows(LayerCache):
  """What the paged caches share (a mixin): their pools, named in POOLS, each
  dtype[num_pages, page_size, ...], and `meta`: None in a stored state, the call's
  `AttentionMetadata` in the view a call reads through (`for_call`)."""

  POOLS = ()

  def pools(self) -> tuple:
    return tuple(getattr(self, n) for n in self.POOLS)

  def with_pools(self, pools):
    return dataclasses.replace(self, **dict(zip(self.POOLS, pools)))

  @property
  def num_pages(self) -> int:
    return self.pools()[0].shape[0]

  @property
  def page_size(self) -> int:
    return self.pools()[0].shape[1]

  @property
  def max_len(self) -> int:
    return self.max_pages * self.page_size

  def for_call(self, meta: AttentionMetadata | None):
    """The view of this cache a call reads through with meta (None: the stored pools alone)."""
    return dataclasses.replace(self, meta=meta)

  @property
  def _meta(self) -> AttentionMetadata:
    if self.meta is None:
      raise ValueError(f"a {type(self).__name__} is read through a call's metadata: open the caches first "
                       "(LayerCaches.open)")
    return self.meta

  def _addresses(self, rows_BxT, valid_BxT):
    """(page int32[B, T], offset int32[B, T]) of each row; page num_pages (dropped) where invalid
    or where the table holds no page."""
    table = self._meta.table
    num_pages, ps = self.num_pages, self.page_size
    p_BxT = rows_BxT // ps
    in_table_BxT = valid_BxT & (rows_BxT >= 0) & (p_BxT < table.shape[1])
    page_BxT = jnp.take_along_axis(table, jnp.clip(p_BxT, 0, table.shape[1] - 1), axis=1)
    page_BxT = jnp.where(in_table_BxT & (page_BxT >= 0) & (page_BxT < num_pages), page_BxT, num_pages)
    return page_BxT, rows_BxT % ps

  def write(self, rows_BxT, valid_BxT, *entries):
    """Writes each entry dtype[B, T, ...] at its rows' pages (dropped where the slot holds no page)."""
    page_BxT, off_BxT = self._addresses(rows_BxT, valid_BxT)
    return self.with_pools(pool.at[page_BxT, off_BxT].set(x.astype(pool.dtype), mode="drop")
                           for pool, x in zip(self.pools(), entries))

  def update(self, rows_BxT, valid_BxT, *entries):
    """The cache contract of cache.py: `write`, then the table's first `span` columns (all of them
    without a span) as a dense view.

    Returns (new cache, one dtype[B, L, ...] view per pool, gathered through the table,
    int32[B, L]), L = span x page_size: keys of pages the slot does not hold carry NO_ROW. Reads
    B x L rows (GQA sequence calls without a span use `PagedKVCache.attend`'s page list).
    """
    new = self.write(rows_BxT, valid_BxT, *entries)
    meta = self._meta
    table = meta.table if meta.span is None else meta.table[:, :meta.span]
    b, cols = table.shape
    held_BxP = (table >= 0) & (table < self.num_pages)
    gather = lambda pool: jnp.take(pool, jnp.where(held_BxP, table, 0), axis=0).reshape(
        b, cols * self.page_size, *pool.shape[2:])
    rows_BxL = jnp.broadcast_to(jnp.arange(cols * self.page_size, dtype=jnp.int32), (b, cols * self.page_size))
    held_BxL = jnp.repeat(held_BxP, self.page_size, axis=1)
    return new, tuple(gather(pool) for pool in new.pools()), jnp.where(held_BxL, rows_BxL, NO_ROW)

  def move_rows(self, src_BxA, dst_BxA, valid_BxA):
    """This cache with row src_BxA[b, a] copied to row dst_BxA[b, a] (int32[B, A]) where valid_BxA,
    both through the call's table; every source is read before anything is written."""
    src_page, src_off = self._addresses(src_BxA, valid_BxA)
    dst_page, dst_off = self._addresses(dst_BxA, valid_BxA)
    src_page = jnp.minimum(src_page, self.num_pages - 1)  # invalid moves read a page, write nothing
    return self.with_pools(pool.at[dst_page, dst_off].set(pool[src_page, src_off], mode="drop")
                           for pool in self.pools())

  def grown(self, max_len: int):
    raise ValueError(f"only contiguous caches grow (paged ones are sized by their pool), got {type(self).__name__}")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedKVCache(PagedRows):
  """One GQA layer's paged cache: pools k dtype[num_pages, page_size, Hkv, Dh] and v
  dtype[num_pages, page_size, Hkv, Dv] (see PagedRows)."""

  POOLS = ("k", "v")

  k: jax.Array = axes("pages", "page_rows", "kv_heads", "head_dim")
  v: jax.Array = axes("pages", "page_rows", "kv_heads", "head_dim")
  max_pages: int = dataclasses.field(metadata=dict(static=True))
  meta: AttentionMetadata | None = None

  @classmethod
  def zeros(cls, cfg: BlockConfig, pages: Pages, dtype=None) -> "PagedKVCache":
    dtype = dtype or cfg.jnp_dtype
    pool = lambda width: jnp.zeros((pages.num_pages, pages.page_size, cfg.num_kv_heads, width), dtype)
    return cls(pool(cfg.head_dim), pool(cfg.value_dim), pages.table.shape[1])

  def page_list(self):
    """The held pages of all slots, flattened: (owner int32[U], first row int32[U], page int32[U])
    with U = the call's budget. Entry u is page table[owner, col] holding rows col * page_size..;
    entries past the pages in use have owner B (dropped by the segment sums) and page num_pages."""
    meta = self._meta
    b, max_pages = meta.table.shape
    end_B = jnp.cumsum(meta.used)
    u_U = jnp.arange(meta.budget, dtype=jnp.int32)
    owner_U = jnp.searchsorted(end_B, u_U, side="right").astype(jnp.int32)  # B past the last page
    col_U = u_U - (end_B - meta.used)[jnp.minimum(owner_U, b - 1)]
    page_U = meta.table[jnp.minimum(owner_U, b - 1), jnp.clip(col_U, 0, max_pages - 1)]
    live_U = owner_U < b
    return owner_U, jnp.where(live_U, col_U * self.page_size, 0), jnp.where(live_U, page_U, self.num_pages)

  def attend(self, q_BxTxKxGxDh, k_BxTxKxDh, v_BxTxKxDh, rows_BxT, valid_BxT, *, window: int | None = None,
             sinks_KxG: jax.Array | None = None, tree: TreeRows | None = None):
    """`LayerCache.attend` that, for sequence calls, reads only the pages in use: writes k, v
    dtype[B, T, Hkv, Dh | Dv]; returns (new cache, float32[B, T, Hkv, G, Dv]). Tree calls and
    calls with a span read the dense view (`update`).

    The same softmax as the dense one over a slot's rows (a query at row r sees keys at rows
    r - window < row <= r), taken across the slot's pages: max and sum per page, then per owner
    by segment max / sum. Rows no valid query may read (stale rows of held pages, padding
    entries) are selected away from v, so NaN left in them cannot leak.
    Reads `budget` pages, however long the table.
    """
    if tree is not None or self._meta.span is not None:
      return super().attend(q_BxTxKxGxDh, k_BxTxKxDh, v_BxTxKxDh, rows_BxT, valid_BxT, window=window,
                            sinks_KxG=sinks_KxG, tree=tree)
    new = self.write(rows_BxT, valid_BxT, k_BxTxKxDh, v_BxTxKxDh)
    return new, new.attend_pages(q_BxTxKxGxDh, rows_BxT, valid_BxT, window=window, sinks_KxG=sinks_KxG)

  def attend_pages(self, q_BxTxKxGxDh, rows_BxT, valid_BxT, *, window: int | None = None,
                   sinks_KxG: jax.Array | None = None) -> jax.Array:
    """Causal GQA attention of queries dtype[B, T, Hkv, G, Dh] over the pages in use (see `attend`);
    returns float32[B, T, Hkv, G, Dv]."""
    b, t, hkv, g, dh = q_BxTxKxGxDh.shape
    owner_U, first_U, page_U = self.page_list()
    own_U = jnp.minimum(owner_U, b - 1)
    k_UxPxKxDh = jnp.take(self.k, page_U, axis=0, mode="clip")
    v_UxPxKxDh = jnp.take(self.v, page_U, axis=0, mode="clip")
    key_rows_UxP = first_U[:, None] + jnp.arange(self.page_size, dtype=jnp.int32)[None]
    key_rows_UxP = jnp.where((owner_U < b)[:, None], key_rows_UxP, NO_ROW)
    q_rows_UxT = rows_BxT[own_U]
    mask_UxTxP = causal_mask(q_rows_UxT, key_rows_UxP, window=window)
    q_UxTxKxGxDh = q_BxTxKxGxDh[own_U]
    scores_UxKxGxTxP = jnp.einsum("utkgd,upkd->ukgtp", q_UxTxKxGxDh, k_UxPxKxDh.astype(q_BxTxKxGxDh.dtype),
                                  preferred_element_type=jnp.float32) * dh**-0.5
    scores_UxKxGxTxP = jnp.where(mask_UxTxP[:, None, None], scores_UxKxGxTxP, jnp.finfo(jnp.float32).min)
    # owner_U is sorted (slot by slot, then padding). Empty segments (slots holding no page)
    # give -inf: floored so that every exponent is finite.
    page_max_UxKxGxT = jnp.max(scores_UxKxGxTxP, axis=-1)
    top_BxKxGxT = jnp.maximum(jax.ops.segment_max(page_max_UxKxGxT, owner_U, num_segments=b, indices_are_sorted=True),
                              jnp.finfo(jnp.float32).min)
    if sinks_KxG is not None:
      sink_1xKxGx1 = sinks_KxG.astype(jnp.float32)[None, :, :, None]
      top_BxKxGxT = jnp.maximum(top_BxKxGxT, sink_1xKxGx1)
    e_UxKxGxTxP = jnp.exp(scores_UxKxGxTxP - top_BxKxGxT[own_U][..., None])
    denom_BxKxGxT = jax.ops.segment_sum(jnp.sum(e_UxKxGxTxP, axis=-1), owner_U, num_segments=b, indices_are_sorted=True)
    if sinks_KxG is not None:
      denom_BxKxGxT = denom_BxKxGxT + jnp.exp(sink_1xKxGx1 - top_BxKxGxT)
    probs_UxKxGxTxP = e_UxKxGxTxP / jnp.where(denom_BxKxGxT > 0, denom_BxKxGxT, 1.0)[own_U][..., None]
    v_UxPxKxDh = readable_rows(v_UxPxKxDh, q_rows_UxT, valid_BxT[own_U], key_rows_UxP)
    # Partial outputs per page are summed in float32, as the dense einsum accumulates.
    out_UxTxKxGxDh = jnp.einsum("ukgtp,upkd->utkgd", probs_UxKxGxTxP.astype(v_UxPxKxDh.dtype), v_UxPxKxDh,
                                preferred_element_type=jnp.float32)
    return jax.ops.segment_sum(out_UxTxKxGxDh, owner_U, num_segments=b, indices_are_sorted=True)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedMlaCache(PagedRows):
  """One MLA layer's paged cache: pools latent dtype[num_pages, page_size, R] and k_rope
  dtype[num_pages, page_size, Dr] (the rows of `MlaCache`, in pages; see PagedRows)."""

  POOLS = ("latent", "k_rope")

  latent: jax.Array = axes("pages", "page_rows", "kv_lora")
  k_rope: jax.Array = axes("pages", "page_rows", "head_dim")
  max_pages: int = dataclasses.field(metadata=dict(static=True))
  meta: AttentionMetadata | None = None

  @classmethod
  def zeros(cls, cfg: BlockConfig, pages: Pages, dtype=None) -> "PagedMlaCache":
    dtype = dtype or cfg.jnp_dtype
    pool = lambda width: jnp.zeros((pages.num_pages, pages.page_size, width), dtype)
    return cls(pool(cfg.mla.kv_lora_rank), pool(cfg.mla.qk_rope_head_dim), pages.table.shape[1])
