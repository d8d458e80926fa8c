"""The page allocator of paged caches and the per-call metadata that says which pages a call reads.

Row j of sequence b lives in page `table[b, j // page_size]` at offset `j % page_size` of every
layer's pools (paged.py); all the layers of a model share one table int32[B, max_pages], held
once, in `Pages`, the allocator: the table, the pages each slot holds and a stack of free page
ids, all device arrays, so `ensure` / `release` / `reset` are pure jittable functions (no host
round trip). A slot that cannot get the pages it asks for gets none of them and is flagged in
`Pages.oom`; its writes beyond its pages are dropped (sent to the out-of-range page id
`num_pages`), never wrapped into another slot's pages. `Pages.external` is the table of a
serving loop that allocates pages itself: `ensure` only checks that the table covers the rows
and flags the slots it does not, `release` / `reset` leave the table to its owner.

How a call reads its pages is per-call data, as tpu-inference passes its `AttentionMetadata`:
the caller picks a static `PageRead` (a page budget, or a span) for the call, and the model's
`LayerCaches.open` builds the call's `AttentionMetadata` (the table, the pages in use, and the
read) that every layer's cache reads with. The state never holds a read, so a new read is a new
compile of the call, never a new state. The host picks a budget with `budget_bucket` from the
pages the next call can hold (`Pages.pages_after`), or a span from `Pages.span_after`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from mtp_jax import validate
from mtp_jax.blocks.axes import axes


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


@dataclasses.dataclass(frozen=True)
class PageRead:
  """How a paged call reads its pages: static (one compile per value), chosen by the caller per call.

  budget: the pages the call's GQA attention reads as one list (`PagedKVCache.attend`), which
    must hold every page held during the call (`Pages.ensure` refuses a slot that would not
    fit); None: the whole pool (always enough). span: when set, every layer reads the first
    span columns of each slot's table as one dense block, and no slot may hold more pages
    (`Pages.span_after`); None reads the page list.
  """

  budget: int | None = None
  span: int | None = None

  def __post_init__(self):
    if self.budget is not None:
      validate.positive_int("budget", self.budget)
    if self.span is not None:
      validate.positive_int("span", self.span)


WHOLE_POOL = PageRead()


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
  """What one paged call reads with, built once per call by `LayerCaches.open` and shared by its layers.

  table: int32[B, max_pages], the slots' pages (num_pages: none); used: int32[B], the pages each
  slot holds (always table[b, :used]); budget: static int, the page list's length; span: static
  int or None, the table columns read as one dense block (see `PageRead`).
  """

  table: jax.Array = axes("table_slots", None)
  used: jax.Array = axes("table_slots")
  budget: int = dataclasses.field(metadata=dict(static=True))
  span: int | None = dataclasses.field(default=None, metadata=dict(static=True))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Pages:
  """The page allocator of one model's caches.

  table: int32[B, max_pages], the page holding rows p * page_size.. of slot b, or num_pages
    where the slot holds no page; used: int32[B], pages slot b holds (always table[b, :used]);
  free: int32[num_pages], a stack of free page ids, free[:num_free]; num_free: int32[];
  oom: bool[B], a request of the slot could not be met (sticky until the slot is reset);
  is_external: static bool, the table belongs to the caller (`Pages.external`): nothing is allocated
    or freed here, `used` is the pages the last `ensure` found covering the slot's rows.
  """

  table: jax.Array = axes("table_slots", None)
  used: jax.Array = axes("table_slots")
  free: jax.Array = axes(None)
  num_free: jax.Array = axes()
  oom: jax.Array = axes("table_slots")
  page_size: int = dataclasses.field(metadata=dict(static=True))
  is_external: bool = dataclasses.field(default=False, metadata=dict(static=True))

  @classmethod
  def create(cls, batch_size: int, max_len: int, page_size: int, num_pages: int) -> "Pages":
    max_pages = check_paging(max_len, page_size, num_pages)
    return cls(table=jnp.full((batch_size, max_pages), num_pages, jnp.int32),
               used=jnp.zeros((batch_size,), jnp.int32),
               # Popped from the end: pages 0, 1, .. go out first.
               free=jnp.arange(num_pages - 1, -1, -1, dtype=jnp.int32),
               num_free=jnp.asarray(num_pages, jnp.int32), oom=jnp.zeros((batch_size,), bool),
               page_size=page_size)

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
               oom=jnp.zeros((b,), bool), page_size=page_size, is_external=True)

  @property
  def num_pages(self) -> int:
    return self.free.shape[0]

  @property
  def max_len(self) -> int:
    return self.table.shape[1] * self.page_size

  def metadata(self, read: PageRead = WHOLE_POOL) -> AttentionMetadata:
    """The attention metadata of a call reading as `read` says (its budget at most num_pages, its
    span at most max_pages; errors name the field and the limit)."""
    validate.instance("read", read, PageRead, "a PageRead")
    budget = self.num_pages if read.budget is None else validate.integer("budget", read.budget, 1, self.num_pages)
    span = None if read.span is None else validate.integer("span", read.span, 1, self.table.shape[1])
    return AttentionMetadata(self.table, self.used, budget, span)

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

  def ensure(self, num_rows_B, read: PageRead = WHOLE_POOL) -> "Pages":
    """Gives each slot the pages for rows 0..num_rows_B[b]-1 (int32[B]) for a call reading as `read`.

    Slots are served in order while pages last and the pages held stay within read's budget
    (the call reads only that many) and, with a span, each slot's within it; a slot that does
    not fit gets nothing and is flagged in oom (the ones after it may still fit). External: a
    slot is served when the caller's table covers its rows (and the budget holds them); it then
    reads exactly those pages.
    """
    max_pages = self.table.shape[1]
    meta = self.metadata(read)
    want_B = self._pages_for(num_rows_B)
    # Greedy in slot order: slot b is served if everything asked before it that was served,
    # plus its own need, fits. A scan keeps "served before" exact (a cumsum would count refused slots).
    def serve(left, x):
      need, in_span = x
      ok = (need <= left) & in_span
      return left - jnp.where(ok, need, 0), ok
    p_BxP = jnp.arange(max_pages, dtype=jnp.int32)[None]
    # With a span, a slot's pages past it would not be read: such a slot is refused instead.
    in_span_B = jnp.ones_like(self.oom) if meta.span is None else jnp.maximum(want_B, self.used) <= meta.span
    if self.is_external:
      held_BxP = (self.table >= 0) & (self.table < self.num_pages)
      covered_B = jnp.all(held_BxP | (p_BxP >= want_B[:, None]), axis=1)
      _, fits_B = jax.lax.scan(serve, jnp.asarray(meta.budget, jnp.int32), (jnp.where(covered_B, want_B, 0), in_span_B))
      ok_B = covered_B & fits_B
      return dataclasses.replace(self, used=jnp.where(ok_B, want_B, 0), oom=self.oom | ~ok_B)
    need_B = jnp.maximum(want_B - self.used, 0)
    room = jnp.minimum(self.num_free, meta.budget - jnp.sum(self.used))
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
