"""Paged caches: a pool of fixed-size pages per layer, one page table, an on-device allocator.

Row j of sequence b lives in page `table[b, j // page_size]` at offset `j % page_size`, so rows
stay position-addressed (as in cache.py) and the causal mask still excludes stale rows. Every
layer of a model (every MTP module, every target layer) has its own pools: GQA k
dtype[num_pages, page_size, Hkv, Dh] and v of Dv (`PagedKVCache`) or MLA's latent dtype[num_pages, page_size, R]
and rope key dtype[num_pages, page_size, Dr] (`PagedMlaCache`); all of them share one table
int32[B, max_pages]: page id p is taken in every pool at once. The table lives once, in
`Pages`; a model's `LayerCaches` (caches.py) binds it to its caches for a call and drops it
after, so a state holds one copy and donating the state never donates a buffer twice.

`Pages` is the allocator: the table, the pages each slot holds and a stack of free page ids,
all device arrays, so `ensure` / `release` / `reset` are pure jittable functions (no host round
trip). A slot that cannot get the pages it asks for gets none of them and is flagged in
`Pages.oom`; its writes beyond its pages are dropped (sent to the out-of-range page id
`num_pages`), never wrapped into another slot's pages. `Pages.external` is the table of a
serving loop that allocates pages itself: `ensure` only checks that the table covers the rows
and flags the slots it does not, `release` / `reset` leave the table to its owner.

GQA attention reads only the pages in use (`PagedKVCache.attend`): the held pages of all slots,
flattened into one list of `budget` pages with their owner slot, each scored against its
owner's queries, with the softmax taken across one owner's pages by segment max / sum. The
budget is static (one compile per value): the host picks it with `budget_bucket` from the
pages the next call can hold (`Pages.pages_after`), so the rows read per step follow the rows
in use, not B x max_len. MLA and draft-tree calls read the table's dense view (`update`).
With a `span` (`Pages.with_budget(budget, span)`), every call reads the dense view of the first
span columns instead: B x span pages, each slot's rows as one block, which for a few query rows
per slot (a decode step) runs faster on XLA:CPU than the page list's per-page products, and
so does a prefill; the Engine's calls read so.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from mtp_jax import validate
from mtp_jax.blocks.axes import axes
from mtp_jax.blocks.cache import NO_ROW, LayerCache
from mtp_jax.blocks.masks import TreeRows, causal_mask, readable_rows
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


def _exclusive_cumsum(x_B):
  return jnp.cumsum(x_B) - x_B


MIN_BUDGET = 16  # the smallest page budget: tiny calls share one compile


def budget_bucket(pages_needed: int, num_pages: int, minimum: int = MIN_BUDGET) -> int:
  """The page budget for calls that hold at most pages_needed pages: the next of minimum (a power
  of two >= 2; 16 by default), then 1.5 and 2 times each power of two (16, 24, 32, 48, 64, ..: at
  most 1.5x the pages in use, two compiles per doubling), never above num_pages (which always
  suffices). A call over a few slots (a prefill) takes a smaller minimum: it reads only its pages."""
  if minimum < 2 or minimum & (minimum - 1):
    raise validate.InvalidValue("minimum", f"minimum must be a power of two >= 2, got {minimum!r}")
  budget = minimum
  while budget < pages_needed:
    budget = budget * 3 // 2 if budget & (budget - 1) == 0 else budget * 4 // 3
  return min(budget, num_pages)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Pages:
  """The page allocator of one model's caches.

  table: int32[B, max_pages], the page holding rows p * page_size.. of slot b, or num_pages
    where the slot holds no page; used: int32[B], pages slot b holds (always table[b, :used]);
  free: int32[num_pages], a stack of free page ids, free[:num_free]; num_free: int32[];
  oom: bool[B], a request of the slot could not be met (sticky until the slot is reset);
  budget: static int, the pages attention reads per call (see `attend`); it must be at least
    the pages held during the call: num_pages (the default) always is; the serving loops pick
    a smaller one per call (`with_budget`, `pages_after`, `budget_bucket`).
  span: static int or None: when set, calls read the first `span` columns of the table of every
    slot instead (B x span pages, each slot's as one dense block, as contiguous caches are read),
    and no slot may hold more than span pages (`span_after`); None (the default) reads the
    page list of `budget` pages. Few query rows per slot (decode steps) run faster dense.
  is_external: static bool, the table belongs to the caller (`Pages.external`): nothing is allocated
    or freed here, `used` is the pages the last `ensure` found covering the slot's rows.
  """

  table: jax.Array = axes("table_slots", None)
  used: jax.Array = axes("table_slots")
  free: jax.Array = axes(None)
  num_free: jax.Array = axes()
  oom: jax.Array = axes("table_slots")
  page_size: int = dataclasses.field(metadata=dict(static=True))
  budget: int = dataclasses.field(metadata=dict(static=True))
  is_external: bool = dataclasses.field(default=False, metadata=dict(static=True))
  span: int | None = dataclasses.field(default=None, metadata=dict(static=True))

  @classmethod
  def create(cls, batch_size: int, max_len: int, page_size: int, num_pages: int) -> "Pages":
    max_pages = check_paging(max_len, page_size, num_pages)
    return cls(table=jnp.full((batch_size, max_pages), num_pages, jnp.int32),
               used=jnp.zeros((batch_size,), jnp.int32),
               # Popped from the end: pages 0, 1, .. go out first.
               free=jnp.arange(num_pages - 1, -1, -1, dtype=jnp.int32),
               num_free=jnp.asarray(num_pages, jnp.int32), oom=jnp.zeros((batch_size,), bool),
               page_size=page_size, budget=num_pages)

  @classmethod
  def external(cls, table, page_size: int, num_pages: int) -> "Pages":
    """The pages of a serving loop that allocates them itself.

    table: int32[B, max_pages], the caller's page ids (0..num_pages-1 in pools of num_pages pages
    of page_size rows; any other value: no page), slot b's rows p * page_size.. in page
    table[b, p]. Calls read and write through it; `ensure` flags in `oom` (and gives no page to)
    a slot whose rows the table does not cover; `release` and `reset` leave it as it is. Hand
    a new table in between calls with `with_table` (or the states' `with_page_table`).
    """
    page_size = validate.positive_int("page_size", page_size)
    num_pages = validate.positive_int("num_pages", num_pages)
    table = validate.array("table", table, (None, None), kind="int", dims="[B, max_pages]")
    b = table.shape[0]
    return cls(table=jnp.asarray(table).astype(jnp.int32), used=jnp.zeros((b,), jnp.int32),
               free=jnp.full((num_pages,), num_pages, jnp.int32), num_free=jnp.zeros((), jnp.int32),
               oom=jnp.zeros((b,), bool), page_size=page_size, budget=num_pages, is_external=True)

  @property
  def num_pages(self) -> int:
    return self.free.shape[0]

  @property
  def max_len(self) -> int:
    return self.table.shape[1] * self.page_size

  def with_budget(self, budget: int, span: int | None = None) -> "Pages":
    """The same allocator whose calls read `budget` pages (1..num_pages), or with span
    (1..max_pages) the first span columns of every slot (a new static value compiles anew)."""
    span = None if span is None else validate.integer("span", span, 1, self.table.shape[1])
    return dataclasses.replace(self, budget=validate.integer("budget", budget, 1, self.num_pages), span=span)

  def with_table(self, table) -> "Pages":
    """An external allocator with the caller's new table int32[B, max_pages] (same shape)."""
    if not self.is_external:
      raise validate.InvalidValue("table", "this allocator owns its page table (Pages.create); only an external "
                                  "one (Pages.external) takes a table from its caller")
    table = validate.array("table", table, self.table.shape, kind="int",
                           dims=f"[B={self.table.shape[0]}, max_pages={self.table.shape[1]}]")
    return dataclasses.replace(self, table=jnp.asarray(table).astype(jnp.int32))

  def _pages_for(self, num_rows_B):
    return jnp.minimum(-(-num_rows_B // self.page_size), self.table.shape[1])

  def pages_after(self, num_rows_B) -> jax.Array:
    """int32[]: pages held in all once each slot holds rows 0..num_rows_B[b]-1 (int32[B]), never
    fewer than it holds now nor more than the pool: an upper bound on the pages a call that
    writes those rows holds (slots refused pages hold fewer)."""
    return jnp.minimum(jnp.sum(jnp.maximum(self._pages_for(num_rows_B), self.used)), self.num_pages)

  def span_after(self, num_rows_B) -> jax.Array:
    """int32[]: the most pages one slot holds once each slot holds rows 0..num_rows_B[b]-1
    (int32[B]): the span a call that writes those rows needs."""
    return jnp.max(jnp.maximum(self._pages_for(num_rows_B), self.used))

  def ensure(self, num_rows_B) -> "Pages":
    """Gives each slot the pages for rows 0..num_rows_B[b]-1 (int32[B]).

    Slots are served in order while pages last and the pages held stay within the budget (the
    calls read only `budget` pages) and, with a span, each slot's within it; a slot that does
    not fit gets nothing and is flagged in oom (the ones after it may still fit). External: a
    slot is served when the caller's table covers its rows (and the budget holds them); it then
    reads exactly those pages.
    """
    max_pages = self.table.shape[1]
    want_B = self._pages_for(num_rows_B)
    # Greedy in slot order: slot b is served if everything asked before it that was served,
    # plus its own need, fits. A scan keeps "served before" exact (a cumsum would count refused slots).
    def serve(left, x):
      need, in_span = x
      ok = (need <= left) & in_span
      return left - jnp.where(ok, need, 0), ok
    p_BxP = jnp.arange(max_pages, dtype=jnp.int32)[None]
    # With a span, a slot's pages past it would not be read: such a slot is refused instead.
    in_span_B = jnp.ones_like(self.oom) if self.span is None else jnp.maximum(want_B, self.used) <= self.span
    if self.is_external:
      held_BxP = (self.table >= 0) & (self.table < self.num_pages)
      covered_B = jnp.all(held_BxP | (p_BxP >= want_B[:, None]), axis=1)
      _, fits_B = jax.lax.scan(serve, jnp.asarray(self.budget, jnp.int32), (jnp.where(covered_B, want_B, 0), in_span_B))
      ok_B = covered_B & fits_B
      return dataclasses.replace(self, used=jnp.where(ok_B, want_B, 0), oom=self.oom | ~ok_B)
    need_B = jnp.maximum(want_B - self.used, 0)
    room = jnp.minimum(self.num_free, self.budget - jnp.sum(self.used))
    _, ok_B = jax.lax.scan(serve, room, (need_B, in_span_B))
    got_B = jnp.where(ok_B, need_B, 0)
    new_BxP = (p_BxP >= self.used[:, None]) & (p_BxP < (self.used + got_B)[:, None])
    k_BxP = _exclusive_cumsum(got_B)[:, None] + p_BxP - self.used[:, None]  # k-th page popped
    popped_BxP = self.free[jnp.clip(self.num_free - 1 - k_BxP, 0, self.num_pages - 1)]
    return dataclasses.replace(self, table=jnp.where(new_BxP, popped_BxP, self.table), used=self.used + got_B,
                               num_free=self.num_free - jnp.sum(got_B), oom=self.oom | ~ok_B)

  def release(self, num_rows_B) -> "Pages":
    """Keeps the pages for rows 0..num_rows_B[b]-1 (int32[B]) and returns the slot's others to the
    pool (external: the table is the caller's; only the pages read shrink)."""
    keep_B = jnp.minimum(self._pages_for(num_rows_B), self.used)
    if self.is_external:
      return dataclasses.replace(self, used=keep_B)
    max_pages = self.table.shape[1]
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


class PagedRows(LayerCache):
  """What the paged caches share (a mixin): their pools, named in POOLS, each
  dtype[num_pages, page_size, ...], and while bound for a call (`bound`), the model's page table
  int32[B, max_pages] (`table`), pages held int32[B] (`used`), page budget and span (None in a
  stored state)."""

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

  def bound(self, pages: Pages | None):
    """This cache with pages' table, held pages, budget and span for a call (None: stored, unbound)."""
    if pages is None:
      return dataclasses.replace(self, table=None, used=None, budget=None, span=None)
    return dataclasses.replace(self, table=pages.table, used=pages.used, budget=pages.budget, span=pages.span)

  def _addresses(self, rows_BxT, valid_BxT):
    """(page int32[B, T], offset int32[B, T]) of each row; page num_pages (dropped) where invalid
    or where the table holds no page."""
    if self.table is None:
      raise ValueError(f"a {type(self).__name__} needs its page table: bind it first (LayerCaches.open)")
    num_pages, ps = self.num_pages, self.page_size
    p_BxT = rows_BxT // ps
    in_table_BxT = valid_BxT & (rows_BxT >= 0) & (p_BxT < self.table.shape[1])
    page_BxT = jnp.take_along_axis(self.table, jnp.clip(p_BxT, 0, self.table.shape[1] - 1), axis=1)
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
    table = self.table if self.span is None else self.table[:, :self.span]
    b, cols = table.shape
    held_BxP = (table >= 0) & (table < self.num_pages)
    gather = lambda pool: jnp.take(pool, jnp.where(held_BxP, table, 0), axis=0).reshape(
        b, cols * self.page_size, *pool.shape[2:])
    rows_BxL = jnp.broadcast_to(jnp.arange(cols * self.page_size, dtype=jnp.int32), (b, cols * self.page_size))
    held_BxL = jnp.repeat(held_BxP, self.page_size, axis=1)
    return new, tuple(gather(pool) for pool in new.pools()), jnp.where(held_BxL, rows_BxL, NO_ROW)

  def move_rows(self, src_BxA, dst_BxA, valid_BxA):
    """This cache with row src_BxA[b, a] copied to row dst_BxA[b, a] (int32[B, A]) where valid_BxA,
    both through the bound table; every source is read before anything is written."""
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
  table: jax.Array | None = axes("table_slots", None)
  max_pages: int = dataclasses.field(metadata=dict(static=True))
  used: jax.Array | None = axes("table_slots", default=None)
  budget: int | None = dataclasses.field(default=None, metadata=dict(static=True))
  span: int | None = dataclasses.field(default=None, metadata=dict(static=True))

  @classmethod
  def zeros(cls, cfg: BlockConfig, pages: Pages, dtype=None) -> "PagedKVCache":
    dtype = dtype or cfg.jnp_dtype
    pool = lambda width: jnp.zeros((pages.num_pages, pages.page_size, cfg.num_kv_heads, width), dtype)
    return cls(pool(cfg.head_dim), pool(cfg.value_dim), None, pages.table.shape[1])

  def page_list(self):
    """The held pages of all slots, flattened: (owner int32[U], first row int32[U], page int32[U])
    with U = budget. Entry u is page table[owner, col] holding rows col * page_size..; entries
    past the pages in use have owner B (dropped by the segment sums) and page num_pages."""
    b, max_pages = self.table.shape
    if self.budget is None:
      raise ValueError("a PagedKVCache needs its page table: bind it first (LayerCaches.open)")
    end_B = jnp.cumsum(self.used)
    u_U = jnp.arange(self.budget, dtype=jnp.int32)
    owner_U = jnp.searchsorted(end_B, u_U, side="right").astype(jnp.int32)  # B past the last page
    col_U = u_U - (end_B - self.used)[jnp.minimum(owner_U, b - 1)]
    page_U = self.table[jnp.minimum(owner_U, b - 1), jnp.clip(col_U, 0, max_pages - 1)]
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
    if tree is not None or self.span is not None:
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
  table: jax.Array | None = axes("table_slots", None)
  max_pages: int = dataclasses.field(metadata=dict(static=True))
  used: jax.Array | None = axes("table_slots", default=None)
  budget: int | None = dataclasses.field(default=None, metadata=dict(static=True))
  span: int | None = dataclasses.field(default=None, metadata=dict(static=True))

  @classmethod
  def zeros(cls, cfg: BlockConfig, pages: Pages, dtype=None) -> "PagedMlaCache":
    dtype = dtype or cfg.jnp_dtype
    pool = lambda width: jnp.zeros((pages.num_pages, pages.page_size, width), dtype)
    return cls(pool(cfg.mla.kv_lora_rank), pool(cfg.mla.qk_rope_head_dim), None, pages.table.shape[1])
