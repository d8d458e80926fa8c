"""The proposer's state and the pure functions that only move it: `init_state`, `after_verify`,
`reset_slots` (`propose`, which runs the modules, is in proposer.py).

State layout (all per sequence b of the batch; K = cfg.num_depths depths, 0-based i = m - 1;
depth i runs module cfg.module_of(i), so depths past the module count reuse weights):

- `kv[i]`: depth i's KV cache, rows 0..L-1 (position-addressed, row j at index j).
- `lengths[i, b]`: rows of depth i written so far; `lengths[i, b] <= num_pos[b]`.
- `num_pos[b]`: P + 1, the positions whose target hidden the chain has consumed.
- `tail[i]`: a ring of the last R = K hiddens depth i handed on (row j at slot j % R). A deeper
  depth lags its predecessor by up to K - 1 rows after a rejection, and catching those rows up
  needs the predecessor's hiddens from an earlier call.
- `num_drafted[b]`: drafts of the last `propose` not yet settled by `after_verify` (0 = none).
- `draft_probs`: float32[B, K, V], the distributions the drafts were drawn from (only when asked
  for by `init_state(keep_draft_probs=True)`; lossless sampling verification needs them).

Row j of depth i depends on t_{j+i+1}; after a propose at newest position P, rows with
j + i + 1 > P + 1 used drafts. `after_verify(a)` keeps rows j <= P + 1 + a - (i + 1).
The next `propose` recomputes depth i from `lengths[i]` up to the new P': at most
T + i rows, so depth i's window is the static T + i.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental import checkify

from mtp_jax import validate
from mtp_jax.blocks import LayerCaches, Pages
from mtp_jax.blocks.axes import axes
from mtp_jax.blocks.caches import CachedState
from mtp_jax.config import MtpConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ProposerState(CachedState):
  """Pytree of the proposer's per-sequence state; see the module docstring for the layout.

  caches: the depths' LayerCaches: `kv`, K caches (KVCache k, v dtype[B, L, Hkv, Dh], or an MLA
  layer's MlaCache latent dtype[B, L, R], k_rope dtype[B, L, Dr], or their paged forms sharing
  the table of `pages`, the allocator, None when contiguous); tail: (K - 1) x dtype[B, K, D];
  lengths: int32[K, B]; num_pos: int32[B]; num_drafted: int32[B];
  draft_probs: float32[B, K, V] or None; cfg: static MtpConfig;
  num_live: static int, the modules 0..num_live-1 whose rows are current (K unless a
  `propose(..., catch_up=False)` left the deeper ones behind).
  """

  caches: LayerCaches
  tail: tuple[jax.Array, ...] = axes("batch", None, "embed")
  lengths: jax.Array = axes(None, "batch")
  num_pos: jax.Array = axes("batch")
  num_drafted: jax.Array = axes("batch")
  draft_probs: jax.Array | None = axes("batch", None, "vocab")
  cfg: MtpConfig = dataclasses.field(metadata=dict(static=True))
  num_live: int = dataclasses.field(metadata=dict(static=True))

  @property
  def batch_size(self) -> int:
    return self.num_pos.shape[0]

  @property
  def rows_held(self) -> jax.Array:
    return self.num_pos


def init_state(cfg: MtpConfig, batch_size: int, max_len: int, *, keep_draft_probs: bool = False,
               dtype=None, page_size: int | None = None, num_pages: int | None = None,
               pages: Pages | None = None) -> ProposerState:
  """An empty state for `batch_size` sequences of at most `max_len` positions.

  keep_draft_probs: also keep float32[B, K, V] draft distributions (for sampling verification).
  dtype: KV cache / tail dtype (default cfg.dtype).
  page_size, num_pages: paged caches (blocks/paged.py): each depth a pool of num_pages pages
    of page_size rows, pages taken as positions arrive and returned by `reset_slots`.
  pages: paged through a table the caller allocates and owns, `Pages.external(table, page_size,
    num_pages)` with table int32[B, max_len // page_size]: position j of slot b is row j of
    every depth, in page table[b, j // page_size]; calls read and write through it and allocate
    nothing; a slot whose positions the table does not cover is flagged in `out_of_pages`.
    `state.with_page_table` hands in a new table between calls.
  """
  validate.instance("cfg", cfg, MtpConfig)
  batch_size = validate.positive_int("batch_size", batch_size)
  max_len = validate.positive_int("max_len", max_len)
  keep_draft_probs = validate.flag("keep_draft_probs", keep_draft_probs)
  dtype = cfg.jnp_dtype if dtype is None else validate.float_dtype("dtype", dtype)
  k, d = cfg.num_depths, cfg.hidden_width
  caches = LayerCaches.create(cfg.block_config(), k, batch_size, max_len, dtype=dtype, page_size=page_size,
                              num_pages=num_pages, pages=pages)
  return ProposerState(
      caches=caches,
      tail=tuple(jnp.zeros((batch_size, k, d), dtype) for _ in range(k - 1)),
      lengths=jnp.zeros((k, batch_size), jnp.int32),
      num_pos=jnp.zeros((batch_size,), jnp.int32),
      num_drafted=jnp.zeros((batch_size,), jnp.int32),
      draft_probs=(jnp.zeros((batch_size, k, cfg.vocab_size), jnp.float32) if keep_draft_probs else None),
      cfg=cfg, num_live=k)


def trim_lengths(lengths_KxB, num_pos_B, num_accepted_B):
  """int32[K, B]: lengths_KxB after a verification that accepted num_accepted_B (int32[B]) of the drafts
  of a propose at num_pos_B (int32[B]). The validity rule: module i keeps rows j <= P + 1 + a - (i + 1),
  i.e. length <= num_pos + a - i."""
  i_Kx1 = jnp.arange(lengths_KxB.shape[0], dtype=jnp.int32)[:, None]
  return jnp.maximum(0, jnp.minimum(lengths_KxB, num_pos_B[None] + num_accepted_B[None] - i_Kx1))


def check_state(state, cfg=None) -> None:
  """Refuses, naming `state`, anything but a ProposerState (made for cfg, when given)."""
  validate.instance("state", state, ProposerState, "a ProposerState (from init_state)")
  if cfg is not None and state.cfg != cfg:
    raise validate.InvalidValue("state", f"state was made for another config ({state.cfg}); params have {cfg}")


def after_verify(state: ProposerState, num_accepted, *, checked: bool = False) -> ProposerState:
  """Settles the last `propose`: keeps the rows that used only verified (or accepted) inputs.

  Args:
    state: the state returned by `propose`.
    num_accepted: int32[B], 0..k accepted drafts per sequence (k = that propose's num_drafts).
      Sequences with no drafts pending are left unchanged.
    checked: add `checkify` checks on values.
  Returns:
    The new ProposerState; module i keeps max(0, min(length_i, num_pos + a - i)) rows.
  """
  check_state(state)
  b = state.batch_size
  num_accepted = jnp.asarray(validate.array("num_accepted", num_accepted, (b,), kind="int", dims=f"[B={b}]"))
  checked = validate.flag("checked", checked)
  ok_msg = ((num_accepted >= 0) & (num_accepted <= state.num_drafted),
            "num_accepted must be in 0..k, the num_drafts of the last propose (0 when none is pending)")
  if validate.is_concrete(state.num_drafted, num_accepted):
    validate.raise_failed([(jnp.all(ok_msg[0]), "num_accepted", ok_msg[1])], num_accepted=num_accepted,
                          k=state.num_drafted)
  elif checked:
    checkify.check(jnp.all(ok_msg[0]), ok_msg[1])
  return _after_verify(state, num_accepted.astype(jnp.int32))


def _after_verify(state, num_accepted_B):
  # Touches only lengths and num_drafted: called eagerly, the caches stay the same buffers.
  pending_B = state.num_drafted > 0
  lengths = jnp.where(pending_B[None], trim_lengths(state.lengths, state.num_pos, num_accepted_B), state.lengths)
  return state.set(lengths=lengths, num_drafted=jnp.zeros_like(state.num_drafted))


def reset_slots(state: ProposerState, mask) -> ProposerState:
  """Frees the slots where mask (bool[B]) is True: they behave exactly like a fresh state.

  Lengths, positions, pending drafts, tails and draft_probs are zeroed. Cache rows are not
  cleared: with length 0 no stale row is attended to, and attention selects (rather than
  multiplies away) the rows it may not read, so even NaN / inf left there cannot leak.
  Paged: the slots' pages go back to the pool.
  """
  check_state(state)
  b = state.batch_size
  mask_B = jnp.asarray(validate.array("mask", mask, (b,), kind="bool", dims=f"[B={b}]"))
  # Only the small arrays change; the caches pass through as the same buffers (no jit, which
  # would copy every cache it returns).
  zero = lambda x: jnp.where(mask_B.reshape((b,) + (1,) * (x.ndim - 1)), jnp.zeros((), x.dtype), x)
  return state.set(lengths=jnp.where(mask_B[None], 0, state.lengths), num_pos=zero(state.num_pos),
                   num_drafted=zero(state.num_drafted), tail=tuple(zero(x) for x in state.tail),
                   draft_probs=None if state.draft_probs is None else zero(state.draft_probs),
                   caches=state.caches.reset(mask_B))
