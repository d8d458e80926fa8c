"""What the decode step carries between calls: the per-slot settings and the loop state (pytrees)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from mtp_jax import proposer as prop
from mtp_jax.blocks.axes import axes
from mtp_jax.sampling import RowSampling, row_keys
from mtp_jax.target import TargetState

EOS_PER_SLOT = 8  # end tokens a slot may have (SlotSettings.eos)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SlotSettings:
  """Each slot's request settings, as arrays.

  sampling: `RowSampling`; keys: key[B], each slot's request key (`sampling.row_key`), fixed for
  the request's life: its draws are keyed by (this key, output position), so they depend on
  neither its neighbours, nor when it was admitted, nor (with Gumbel acceptance) its drafts;
  num_drafts int32[B]: drafts the slot's verification reads (0 decodes it without drafts);
  eos int32[B, EOS_PER_SLOT]: its end tokens, -1 padding.
  """

  sampling: RowSampling
  keys: jax.Array = axes("batch")
  num_drafts: jax.Array = axes("batch")
  eos: jax.Array = axes("batch", None)

  @classmethod
  def free(cls, batch_size: int) -> "SlotSettings":
    """Greedy slots without end tokens or drafts (their keys are never read)."""
    b = batch_size
    return cls(RowSampling.uniform(b), jax.random.split(jax.random.key(0), b), jnp.zeros((b,), jnp.int32),
               jnp.full((b, EOS_PER_SLOT), -1, jnp.int32))

  @classmethod
  def uniform(cls, batch_size: int, *, num_drafts: int, temperature: float = 0.0, top_k: int | None = None,
              top_p: float | None = None, seed: int = 0, eos_token_id: int | None = None) -> "SlotSettings":
    """batch_size slots with the same settings (values checked by the caller), slot b's key
    `row_key(seed, b)`: a `generate` batch's."""
    b = batch_size
    eos = np.full((b, EOS_PER_SLOT), -1, np.int32)
    if eos_token_id is not None:
      eos[:, 0] = eos_token_id
    return cls(RowSampling.uniform(b, temperature, top_k, top_p), row_keys(seed, b),
               jnp.full((b,), num_drafts, jnp.int32), jnp.asarray(eos))

  def set(self, **changes) -> "SlotSettings":
    return dataclasses.replace(self, **changes)

  def where(self, mask_B, other: "SlotSettings") -> "SlotSettings":
    """Slots of self where mask_B (bool[B]), else other's."""
    return jax.tree.map(lambda a, b: jnp.where(mask_B.reshape(mask_B.shape + (1,) * (a.ndim - 1)), a, b), self, other)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepCounts:
  """What the steps counted, on device: per slot target_calls, verify_calls, accepted (emitted
  drafts), target_tokens (emitted target tokens) and drafts_verified (the step's width
  capped by the slot's num_drafts), int32[B]; per draft position, over all slots, accepted_at
  (steps whose draft i was accepted) and proposed_at (steps whose draft i was verified),
  int32[k]. Read by the hosts' metrics and the Engine's draft policy, never by the step itself."""

  target_calls: jax.Array = axes("batch")
  verify_calls: jax.Array = axes("batch")
  accepted: jax.Array = axes("batch")
  target_tokens: jax.Array = axes("batch")
  drafts_verified: jax.Array = axes("batch")
  accepted_at: jax.Array = axes(None)
  proposed_at: jax.Array = axes(None)

  @classmethod
  def zeros(cls, batch_size: int, num_drafts: int) -> "StepCounts":
    b, k = batch_size, num_drafts
    return cls(*(jnp.zeros((b,), jnp.int32) for _ in range(5)), jnp.zeros((k,), jnp.int32),
               jnp.zeros((k,), jnp.int32))

  def admitted(self, admit_B) -> "StepCounts":
    """The admitted slots' counts (bool[B]) restarted, their prefill counted as one target call
    that emitted one target token."""
    one = admit_B.astype(jnp.int32)
    zero = lambda x: jnp.where(admit_B, 0, x)
    return dataclasses.replace(self, target_calls=zero(self.target_calls) + one, verify_calls=zero(self.verify_calls),
                               accepted=zero(self.accepted), target_tokens=zero(self.target_tokens) + one,
                               drafts_verified=zero(self.drafts_verified))

  def verified(self, active_B, accepted_B, emitted_B, verified_B) -> "StepCounts":
    """After a verify step over the active slots (bool[B]) that accepted accepted_B drafts,
    emitted emitted_B tokens (the emission may stop short at an end token or the token limit) and
    verified verified_B drafts (int32[B] each)."""
    k = self.accepted_at.shape[0]
    per_position = lambda n_B: jnp.sum(active_B[:, None] & (jnp.arange(k)[None] < jnp.reshape(n_B, (-1, 1))), axis=0)
    return StepCounts(target_calls=self.target_calls + active_B, verify_calls=self.verify_calls + active_B,
                      accepted=self.accepted + jnp.minimum(accepted_B, emitted_B),
                      target_tokens=self.target_tokens + (emitted_B == accepted_B + 1),
                      drafts_verified=self.drafts_verified + jnp.where(active_B, verified_B, 0),
                      accepted_at=self.accepted_at + per_position(accepted_B),
                      proposed_at=self.proposed_at + per_position(verified_B))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Deferred:
  """Verified positions some modules have not consumed yet (StepSettings.deferred_rows = W).

  A step at width k with 2k < K (`serving.step.defers`) runs modules 0..k-1 only (none at
  k = 0): it keeps its newly verified rows here, and modules k..K-1 catch up on every kept row
  in one call, when a step needs them (a wider one) or the rows would not fit. Module k's input
  at a kept row is module k-1's output there, which its ring no longer holds, so that call puts
  the slot's proposer back as it was when its rows began to wait (`began`) and runs the chain
  over them all. A slot capped at most at k (`SlotSettings.num_drafts`) never verifies the deeper
  modules' drafts: its rows are not kept. A run of W rows at width 0 thus costs one K-module call
  instead of W, and a run at width k one call of the K - k deeper modules instead of one per
  step, plus modules 0..k-1 run again over those rows (so a wider step does not defer).

  hid dtype[B, W, D]: the target hiddens of those positions, in order; tok int32[B, W]: the
  token after each; n int32[B]: rows kept per slot; width int32[B]: the narrowest width a step
  ran since the slot's rows began to wait (modules width..K-1 lag; meaningless where n = 0);
  lengths int32[K, B], num_pos int32[B], tail (K - 1) x dtype[B, K, D]: the proposer's as the
  wait began (`ProposerState`'s fields of those names); catch_ups int32[]: catch-ups run so far
  (the host reads whether a call ran one, and charges its time to the width that waited).
  """

  hid: jax.Array = axes("batch", None, "embed")
  tok: jax.Array = axes("batch", None)
  n: jax.Array = axes("batch")
  width: jax.Array = axes("batch")
  lengths: jax.Array = axes(None, "batch")
  num_pos: jax.Array = axes("batch")
  tail: tuple[jax.Array, ...] = axes("batch", None, "embed")
  catch_ups: jax.Array = axes()

  @classmethod
  def zeros(cls, rows: int, hidden_size: int, dtype, proposer: prop.ProposerState) -> "Deferred":
    """Nothing kept, for `proposer`'s slots (its batch size, depths and rings)."""
    b = proposer.batch_size
    return cls(jnp.zeros((b, rows, hidden_size), dtype), jnp.zeros((b, rows), jnp.int32), jnp.zeros((b,), jnp.int32),
               jnp.zeros((b,), jnp.int32), jnp.zeros_like(proposer.lengths), jnp.zeros_like(proposer.num_pos),
               tuple(jnp.zeros_like(t) for t in proposer.tail), jnp.zeros((), jnp.int32))

  def lags(self, width: int, num_new_B) -> jax.Array:
    """bool[]: a step at this width must first catch up: a waiting slot's modules below it lag,
    or a slot's num_new_B (int32[B]) rows would not fit."""
    return jnp.any((self.n > 0) & (self.width < width)) | jnp.any(self.n + num_new_B > self.hid.shape[1])

  def began(self, proposer: prop.ProposerState) -> "Deferred":
    """The slots with no rows kept remember `proposer` (settled, before this step's propose) as
    the state their next kept rows continue."""
    empty_B = self.n == 0
    at = lambda new, old: jnp.where(empty_B.reshape((-1,) + (1,) * (new.ndim - 1)), new, old)
    return dataclasses.replace(self, lengths=jnp.where(empty_B[None], proposer.lengths, self.lengths),
                               num_pos=at(proposer.num_pos, self.num_pos),
                               tail=tuple(at(t, old) for t, old in zip(proposer.tail, self.tail)))

  def restored(self, proposer: prop.ProposerState) -> prop.ProposerState:
    """`proposer` with each waiting slot's positions, lengths and rings as its wait began. Its
    cache rows past them are left: rows are position-addressed and rewritten before they are
    read."""
    wait_B = self.n > 0
    at = lambda old, new: jnp.where(wait_B.reshape((-1,) + (1,) * (new.ndim - 1)), old, new)
    return proposer.set(lengths=jnp.where(wait_B[None], self.lengths, proposer.lengths),
                        num_pos=at(self.num_pos, proposer.num_pos),
                        tail=tuple(at(old, t) for old, t in zip(self.tail, proposer.tail)))

  def kept(self, hid_BxTxD, tok_BxT, num_new_B, width: int) -> "Deferred":
    """These rows and each slot's num_new_B (int32[B], at most W - n: `lags`) new ones after
    them, kept by a step at this width."""
    b, w, t = self.n.shape[0], self.hid.shape[1], tok_BxT.shape[1]
    u_BxT = jnp.arange(t, dtype=jnp.int32)[None]
    at_BxT = jnp.where(u_BxT < num_new_B[:, None], self.n[:, None] + u_BxT, w)  # index W is dropped
    rows = jnp.arange(b)[:, None]
    return dataclasses.replace(
        self, hid=self.hid.at[rows, at_BxT].set(hid_BxTxD.astype(self.hid.dtype), mode="drop"),
        tok=self.tok.at[rows, at_BxT].set(tok_BxT, mode="drop"), n=self.n + num_new_B,
        width=jnp.where(self.n > 0, jnp.minimum(self.width, width), width))

  def joined(self, hid_BxTxD, tok_BxT, num_new_B):
    """(hiddens dtype[B, W + T, D], tokens int32[B, W + T], count int32[B]): each slot's kept rows,
    then its num_new_B new ones, left-aligned, as `propose` takes them."""
    w, t = self.hid.shape[1], hid_BxTxD.shape[1]
    u_BxU = jnp.broadcast_to(jnp.arange(w + t, dtype=jnp.int32), (self.n.shape[0], w + t))
    new_BxU = u_BxU >= self.n[:, None]
    at_new, at_kept = jnp.clip(u_BxU - self.n[:, None], 0, t - 1), jnp.minimum(u_BxU, w - 1)
    pick = lambda new, kept, idx_new, idx_kept: jnp.where(
        new_BxU.reshape(new_BxU.shape + (1,) * (new.ndim - 2)),
        jnp.take_along_axis(new, idx_new.reshape(idx_new.shape + (1,) * (new.ndim - 2)), axis=1),
        jnp.take_along_axis(kept, idx_kept.reshape(idx_kept.shape + (1,) * (kept.ndim - 2)), axis=1))
    return (pick(hid_BxTxD.astype(self.hid.dtype), self.hid, at_new, at_kept), pick(tok_BxT, self.tok, at_new, at_kept),
            self.n + num_new_B)

  def caught_up(self) -> "Deferred":
    """No rows kept in any slot, after a catch-up consumed them all (one more counted)."""
    return dataclasses.replace(self.emptied(), catch_ups=self.catch_ups + 1)

  def emptied(self, mask_B=None) -> "Deferred":
    """No rows kept in the slots where mask_B (bool[B]; every slot when None)."""
    return dataclasses.replace(self, n=jnp.zeros_like(self.n) if mask_B is None else jnp.where(mask_B, 0, self.n))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LoopState:
  """Everything a step carries: the models' state and outputs, each slot's settings, the counts.

  target, proposer: the models' states (proposer None without drafts); last int32[B];
  drafts int32[B, k] or a tree's int32[B, N]; grammar_state int32[B] after the emitted tokens
  (None without a grammar); out int32[B, W] emitted tokens, num_out int32[B] (also the output
  position of the next token, which keys its draw); done bool[B] (free slots are done);
  max_new int32[B]: the slot's token limit; slots: `SlotSettings`; counts: `StepCounts`;
  tree_probs float32[B, M, V]: a tree's draft distributions under rejection sampling, else None;
  deferred: `Deferred`, the verified rows the modules have yet to consume (None unless the step
  defers: StepSettings.deferred_rows).
  """

  target: TargetState
  proposer: prop.ProposerState | None
  last: jax.Array = axes("batch")
  drafts: jax.Array = axes("batch", None)
  grammar_state: jax.Array | None = axes("batch")
  out: jax.Array = axes("batch", None)
  num_out: jax.Array = axes("batch")
  done: jax.Array = axes("batch")
  max_new: jax.Array = axes("batch")
  slots: SlotSettings
  counts: StepCounts
  tree_probs: jax.Array | None = axes("batch", None, "vocab", default=None)
  deferred: Deferred | None = None

  def set(self, **changes) -> "LoopState":
    return dataclasses.replace(self, **changes)

  @property
  def out_of_pages(self) -> jax.Array:
    """bool[B]: slots refused a page by the target's or the proposer's allocator."""
    oom_B = self.target.out_of_pages
    return oom_B if self.proposer is None else oom_B | self.proposer.out_of_pages
