"""One model's caches: `LayerCaches`, the per-layer caches of a model (the target's layers, the
proposer's depths) and, when paged, their page allocator.

It owns everything about the memory that is not attention: allocation (dense or paged, GQA or
MLA, from a config), growth (dense), paging (`open` gives the slots the pages a call needs and
hands the layers the call's `AttentionMetadata`, `close` takes back their pools; `release`,
`reset`, `pages_after`, `span_after`, `out_of_pages`), an external page table (`with_page_table`)
and row moves (`move_rows`, for draft-tree compaction). A model call reads as

    caches, layers = state.caches.open(num_rows_B, read)  # pages for rows 0..num_rows_B[b]-1
    ... layers[i] = layer(..., layers[i]) ...             # each a LayerCache (cache.py): attend / keys
    caches = caches.close(layers)

where `read` (a static `PageRead`: a page budget or span, chosen by the caller per call) says
how the call reads its pages; contiguous caches ignore it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from mtp_jax import validate
from mtp_jax.blocks.cache import KVCache, MlaCache
from mtp_jax.blocks.dsa import DsaCache, PagedDsaCache
from mtp_jax.blocks.paged import PagedKVCache, PagedMlaCache
from mtp_jax.blocks.pages import WHOLE_POOL, PageRead, Pages, check_paging
from mtp_jax.config import BlockConfig


def init_cache(cfg: BlockConfig, batch_size: int, max_len: int, dtype=None) -> KVCache | MlaCache | DsaCache:
  """An empty contiguous cache of the kind cfg's attention uses, for batch_size sequences of max_len rows.

  dtype: cache dtype (default cfg.dtype).
  """
  kind = KVCache if cfg.mla is None else MlaCache if cfg.dsa is None else DsaCache
  return kind.zeros(cfg, batch_size, max_len, dtype)


def init_paged_cache(cfg: BlockConfig, pages: Pages, dtype=None) -> PagedKVCache | PagedMlaCache | PagedDsaCache:
  """An empty paged cache of the kind cfg's attention uses, with pools of pages.num_pages pages."""
  kind = PagedKVCache if cfg.mla is None else PagedMlaCache if cfg.dsa is None else PagedDsaCache
  return kind.zeros(cfg, pages, dtype)


def _allocator(batch_size, max_len, page_size, num_pages, pages):
  """The `Pages` of a new LayerCaches: pages itself (external), one made for page_size /
  num_pages, or None (contiguous)."""
  if pages is not None:
    validate.instance("pages", pages, Pages, "a Pages (e.g. Pages.external(table, page_size, num_pages))")
    if page_size is not None or num_pages is not None:
      raise validate.InvalidValue("pages", "pages carries its page_size and num_pages: pass those only without it")
    max_pages = check_paging(max_len, pages.page_size, pages.num_pages)
    if pages.table.shape != (batch_size, max_pages):
      raise validate.InvalidValue("pages", f"pages' table is int32{list(pages.table.shape)}, expected "
                                  f"[B={batch_size}, max_len // page_size={max_pages}]")
    return pages
  if (page_size is None) != (num_pages is None):
    raise validate.InvalidValue("page_size", "page_size and num_pages must be given together, got "
                                f"page_size={page_size!r}, num_pages={num_pages!r}")
  return None if page_size is None else Pages.create(batch_size, max_len, page_size, num_pages)


def fold_views(caches: "LayerCaches", changes: dict) -> dict:
  """A state's `set(**changes)` with kv= / pages= (its views of its LayerCaches `caches`: the
  layers and the allocator) folded into caches=."""
  if "kv" in changes or "pages" in changes:
    moved = {"layers" if k == "kv" else k: changes.pop(k) for k in ("kv", "pages") if k in changes}
    changes["caches"] = changes.get("caches", caches).set(**moved)
  return changes


class CachedState:
  """What a model state holding `caches: LayerCaches` offers (TargetState, ProposerState): its
  views `kv` and `pages`, and the paging and growth the serving loops ask of it. A subclass gives
  `rows_held`, int32[B]: the rows (positions) each slot holds now."""

  def set(self, **changes):
    """A copy with fields replaced; kv= and pages= replace the caches' layers and allocator."""
    return dataclasses.replace(self, **fold_views(self.caches, changes))

  @property
  def kv(self) -> tuple:
    """One cache per layer (KVCache k, v dtype[B, L, Hkv, Dh], MlaCache, or their paged forms)."""
    return self.caches.layers

  @property
  def pages(self):
    """The allocator (`Pages`), or None when contiguous."""
    return self.caches.pages

  @property
  def max_len(self) -> int:
    return self.caches.max_len

  @property
  def out_of_pages(self) -> jax.Array:
    """bool[B]: slots the page allocator refused a page (never when contiguous)."""
    return self.caches.out_of_pages(self.rows_held.shape[0])

  def pages_needed(self, num_new_B) -> jax.Array:
    """int32[]: pages held in all after a call adding num_new_B (int32[B]) rows per slot (0 when contiguous)."""
    return self.caches.pages_after(self.rows_held + num_new_B)

  def span_needed(self, num_new_B) -> jax.Array:
    """int32[]: the most pages one slot holds after a call adding num_new_B (int32[B]) rows per slot
    (0 when contiguous): the page span it needs."""
    return self.caches.span_after(self.rows_held + num_new_B)

  def with_page_table(self, table):
    """External paging (`pages=Pages.external(..)` at init): this state reading and writing
    through the caller's new table int32[B, max_pages]."""
    return self.set(caches=self.caches.with_page_table(table))

  def grown(self, max_len: int):
    """This state with contiguous caches of max_len rows (>= max_len now), rows kept."""
    return self.set(caches=self.caches.grown(max_len))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerCaches:
  """layers: one cache per layer, all of one kind: KVCache k, v dtype[B, L, Hkv, Dh], MlaCache
  latent dtype[B, L, R], k_rope dtype[B, L, Dr], or their paged forms (PagedKVCache,
  PagedMlaCache: pools of pages alone); pages: the allocator whose table they share, or None
  when contiguous."""

  layers: tuple
  pages: Pages | None = None

  @classmethod
  def create(cls, cfg: BlockConfig, num_layers: int, batch_size: int, max_len: int, *, dtype=None,
             page_size: int | None = None, num_pages: int | None = None, pages: Pages | None = None) -> "LayerCaches":
    """Empty caches for num_layers layers of cfg, batch_size sequences of max_len rows.

    dtype: cache dtype (default cfg.dtype). page_size, num_pages: paged, each layer a pool of
    num_pages pages of page_size rows, pages taken as rows are written. pages: paged through a
    table the caller allocates (`Pages.external`), with its page_size and num_pages.
    """
    pages = _allocator(batch_size, max_len, page_size, num_pages, pages)
    if pages is None:
      return cls(tuple(init_cache(cfg, batch_size, max_len, dtype) for _ in range(num_layers)))
    return cls(tuple(init_paged_cache(cfg, pages, dtype) for _ in range(num_layers)), pages)

  @property
  def max_len(self) -> int:
    return self.layers[0].max_len

  def set(self, **changes) -> "LayerCaches":
    return dataclasses.replace(self, **changes)

  def _for_call(self, read: PageRead) -> tuple:
    if self.pages is None:
      return self.layers
    meta = self.pages.metadata(read)
    return tuple(c.for_call(meta) for c in self.layers)

  def open(self, num_rows_B, read: PageRead = WHOLE_POOL) -> tuple["LayerCaches", tuple]:
    """(these caches with pages for rows 0..num_rows_B[b]-1 (int32[B]), the layers ready for one call).

    Paged, each slot first gets the pages its rows need within read's budget and span (one
    refused them is flagged in `out_of_pages` and its writes past its pages are dropped), and
    the layers come as views reading through the call's `AttentionMetadata`; contiguous, the
    layers as they are. read: a static `PageRead` (default: the page list of the whole pool)."""
    caches = self if self.pages is None else self.set(pages=self.pages.ensure(num_rows_B, read))
    return caches, caches._for_call(read)

  def close(self, layers) -> "LayerCaches":
    """These caches holding the layers a call returned (their pools alone: a state holds the table once)."""
    return self.set(layers=tuple(layers) if self.pages is None else tuple(c.for_call(None) for c in layers))

  def out_of_pages(self, batch_size: int) -> jax.Array:
    """bool[B]: slots the page allocator refused a page (never when contiguous)."""
    return jnp.zeros((batch_size,), bool) if self.pages is None else self.pages.oom

  def pages_after(self, num_rows_B) -> jax.Array:
    """int32[]: pages held in all once each slot holds rows 0..num_rows_B[b]-1 (0 when contiguous)."""
    return jnp.zeros((), jnp.int32) if self.pages is None else self.pages.pages_after(num_rows_B)

  def span_after(self, num_rows_B) -> jax.Array:
    """int32[]: the most pages one slot holds once each holds rows 0..num_rows_B[b]-1 (0 when contiguous)."""
    return jnp.zeros((), jnp.int32) if self.pages is None else self.pages.span_after(num_rows_B)

  def with_page_table(self, table) -> "LayerCaches":
    """External paging: these caches reading and writing through the caller's table int32[B, max_pages]."""
    if self.pages is None:
      raise validate.InvalidValue("table", "these caches are contiguous: only caches made with "
                                  "pages=Pages.external(...) take a page table")
    return self.set(pages=self.pages.with_table(table))

  def release(self, num_rows_B) -> "LayerCaches":
    """Keeps rows 0..num_rows_B[b]-1 (int32[B]); paged, whole pages past them go back to the pool."""
    return self if self.pages is None else self.set(pages=self.pages.release(num_rows_B))

  def reset(self, mask_B) -> "LayerCaches":
    """Paged: the pages of the slots where mask_B (bool[B]) is True go back to the pool, their
    oom flag is cleared. Rows are not cleared: callers reset their lengths."""
    return self if self.pages is None else self.set(pages=self.pages.reset(mask_B))

  def grown(self, max_len: int) -> "LayerCaches":
    """Contiguous caches padded to max_len rows (>= max_len now), rows kept; paged ones are
    sized by their pool and refuse."""
    return self.set(layers=tuple(c.grown(max_len) for c in self.layers))

  def move_rows(self, src_BxA, dst_BxA, valid_BxA) -> "LayerCaches":
    """Every layer with row src_BxA[b, a] copied to row dst_BxA[b, a] (int32[B, A]) where valid_BxA
    (paged: through the table; the rows must lie in pages the slots hold)."""
    return self.close(c.move_rows(src_BxA, dst_BxA, valid_BxA) for c in self._for_call(WHOLE_POOL))
