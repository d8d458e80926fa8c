"""The decode step: target verify + accept + `after_verify` + `propose` as one jitted program.

`DecodeStep(settings)` picks its parts once, on the host, from the static `StepSettings`
(serving/parts.py):

    drafter   `Drafter`: a chain of k drafts or a `TreeSpec` tree (propose, catch_up=False)
    verifier  `VerifyPlain` (no proposer), `VerifyChain`, `VerifyTree` (Gumbel acceptance or
              rejection sampling; greedy slots exactly greedy), `VerifyRelaxed`, `VerifyTreeRelaxed`
    caches    the target's and the proposer's states own theirs: dense or paged, GQA or MLA,
              on a mesh or not; the step only asks them for out-of-pages flags, page needs
              and growth

Per sequence b the loop state (serving/state.py) keeps `last[b]`, the newest emitted token (not
yet run by the target), and `drafts[b]`, the k drafts (or N tree nodes) that follow it. A step
runs the target on [last, drafts], accepts a drafts, emits them and the target's next token,
keeps the target cache rows of [last, d_1..d_a] (a tree's accepted path is moved into place
first), and hands the chain exactly those a + 1 positions.

Each slot carries its request's settings (`SlotSettings`: sampling, key, draft cap, end tokens),
`generate`'s rows and the Engine's requests alike. A sampled slot's token at output position n
is its draw keyed by (its key, n) (`sampling.Draws`), so under Gumbel acceptance its tokens are
those of plain sampling with its key, whatever was drafted, verified or batched with it.

With a grammar, `grammar_state[b]` is the state after every emitted token (`last` included).
Verify position i is masked with the state after [emitted, d_1..d_i] (a tree node: after its
path), the state then advances over the accepted drafts and the next token, and the chain
drafts from it. All of it runs on device.

`prefill` admits prompts into chosen slots of a state (all of them for `generate`); the other
slots pass through untouched; with `idx_A` only the admitted slots are computed (the Engine's
admissions), and `run_for` likewise decodes a group of slots. `prefill_part` writes a long
prompt in parts. `generate` and the Engine are drivers over these functions, through their
jitted entry points in serving/jit.py, one per job (`jit_prefill`, `jit_prefill_part`,
`jit_step`, `jit_run`, `jit_run_for`, `jit_free`; the slot group is an argument, not a variant).
Paged, how a call reads its pages is per-call data: each entry point takes a static `read`
(`PageRead`: a page budget, or a span), which the model calls turn into the attention metadata
their layers read with; the state never holds one. A call over some slots reads a page span
sized for theirs (`span_needed(..., idx_A)`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from mtp_jax import grammar as grammar_lib
from mtp_jax import proposer as prop
from mtp_jax import sharding
from mtp_jax.blocks import PageRead
from mtp_jax.blocks.axes import put_slots, take_slots
from mtp_jax.blocks.pages import WHOLE_POOL
from mtp_jax.serving.options import StepSettings
from mtp_jax.serving.parts import Drafter, Verifier, draw_tokens, pick_verifier
from mtp_jax.serving.state import Deferred, LoopState, SlotSettings, StepCounts
from mtp_jax.target import compact_target, init_target_state, reset_target_slots, target_step, trim_target
from mtp_jax.tree import node_states


@dataclasses.dataclass(frozen=True)
class DecodeStep:
  """The decode step for `settings` (static: one compile per value); see the module docstring.

  A hashable value: pass it to the jitted functions below as a static argument.
  """

  settings: StepSettings

  @functools.cached_property
  def verifier(self) -> Verifier:
    return pick_verifier(self.settings)

  @functools.cached_property
  def drafter(self) -> Drafter | None:
    st = self.settings
    if st.num_drafts == 0:
      return None
    return Drafter(st.num_drafts, st.tree, st.draft_masks, st.sampled, st.acceptance, st.verify_drafts)

  def replace(self, **changes) -> "DecodeStep":
    """The step for these settings with `changes` (StepSettings fields)."""
    return DecodeStep(dataclasses.replace(self.settings, **changes))

  def out_width(self) -> int:
    """Output columns per slot: at most one token per cache row past its prompt, plus a step's k + 1."""
    st = self.settings
    return min(st.max_new_tokens, st.max_len) + st.num_drafts + 1

  # -- state --

  def init(self, target, proposer, grammar, batch_size: int) -> LoopState:
    """A loop state whose slots are all free (done, no rows, no pages; grammar states FREE)."""
    st, b, k = self.settings, batch_size, self.settings.num_drafts
    paged = st.paging is not None
    pages = dict(page_size=st.paging.page_size, num_pages=st.paging.num_pages) if paged else {}
    tstate = init_target_state(target.cfg, b, st.max_len, **pages)
    pstate = None
    if proposer is not None:
      # Rejection sampling reads the drafts' distributions; a tree's travel in the loop state.
      keep_probs = self._keeps_probs and st.tree is None
      pstate = prop.init_state(proposer.cfg, b, st.max_len, keep_draft_probs=keep_probs, **pages)
    zeros = lambda: jnp.zeros((b,), jnp.int32)  # a buffer each: the state is donated
    tree_probs = None
    if st.tree is not None and self._keeps_probs:
      tree_probs = jnp.zeros((b, st.tree.starts[st.tree.depth], target.cfg.vocab_size), jnp.float32)
    n_drafts = k if st.tree is None else st.tree.num_nodes  # every draft, whatever a step verifies
    deferred = None
    if st.deferred_rows and proposer is not None:
      deferred = Deferred.zeros(st.deferred_rows, target.cfg.hidden_size, target.cfg.jnp_dtype, pstate)
    s = LoopState(target=tstate, proposer=pstate, last=zeros(), drafts=jnp.zeros((b, n_drafts), jnp.int32),
                  grammar_state=None if grammar is None else jnp.full((b,), grammar_lib.FREE, jnp.int32),
                  out=jnp.zeros((b, self.out_width()), jnp.int32), num_out=zeros(), done=jnp.ones((b,), bool),
                  max_new=zeros(), slots=SlotSettings.free(b), counts=StepCounts.zeros(b, k), tree_probs=tree_probs,
                  deferred=deferred)
    return self.placed(s)

  @property
  def _keeps_probs(self) -> bool:
    st = self.settings
    return st.sampled and st.acceptance == "rejection"

  def placed(self, s: LoopState) -> LoopState:
    """s with, on a mesh, its states' shardings as the settings say."""
    st = self.settings
    tstate, pstate = s.target, s.proposer
    if st.mesh is not None:
      tstate = sharding.shard_state(tstate, st.mesh)
      pstate = None if pstate is None else sharding.shard_state(pstate, st.mesh)
    return s.set(target=tstate, proposer=pstate)

  def resized(self, s: LoopState) -> LoopState:
    """s fitted to these settings (host side, between jitted calls): contiguous caches grown to
    max_len rows and the output widened. Rows and tokens are kept."""
    st = self.settings
    if st.paging is None and s.target.max_len < st.max_len:
      pstate = None if s.proposer is None else s.proposer.grown(st.max_len)
      s = s.set(target=s.target.grown(st.max_len), proposer=pstate)
    width = self.out_width()
    if s.out.shape[1] < width:
      s = s.set(out=jnp.pad(s.out, [(0, 0), (0, width - s.out.shape[1])]))
    return self.placed(s)

  def rows_next(self, s: LoopState) -> jax.Array:
    """int32[B]: rows the next step adds at most per slot (its rows for unfinished ones)."""
    return jnp.where(s.done, 0, self.settings.rows_per_step)

  def pages_needed(self, s: LoopState, num_new_B) -> jax.Array:
    """int32[]: pages a call adding num_new_B (int32[B]) rows per slot holds at most, in the target's
    or the proposer's pool (their rows differ by a few): the page budget it needs."""
    need = s.target.pages_needed(num_new_B)
    return need if s.proposer is None else jnp.maximum(need, s.proposer.pages_needed(num_new_B))

  def span_needed(self, s: LoopState, num_new_B, idx_A=None) -> jax.Array:
    """int32[]: the most pages one slot holds, in either pool, after a call adding num_new_B
    (int32[B]) rows per slot: the page span it needs. idx_A: None (every slot), or int32[A]
    distinct slots alone (num_new_B read as A): the span of a call over those slots, which reads
    their pages only."""
    if idx_A is not None:
      s = take_slots(s, idx_A)
    need = s.target.span_needed(num_new_B)
    return need if s.proposer is None else jnp.maximum(need, s.proposer.span_needed(num_new_B))

  def fits(self, s: LoopState, read: PageRead = WHOLE_POOL) -> jax.Array:
    """bool[]: every unfinished slot has room for one more step in the caches and, paged, the
    pages the step may hold are within read's budget and span."""
    st = self.settings
    fits = jnp.all(s.done | (s.target.length + st.rows_per_step <= st.max_len))
    if st.paging is not None and read.budget is not None:
      fits &= self.pages_needed(s, self.rows_next(s)) <= read.budget
    if st.paging is not None and read.span is not None:
      fits &= self.span_needed(s, self.rows_next(s)) <= read.span
    return fits

  # -- on device --

  def _emit(self, s: LoopState, new_BxJ, n_emit_B, active_B) -> tuple[LoopState, jax.Array]:
    """Appends new_BxJ[:, :n] to the output, cut at eos and at the slot's max_new; returns (state, n int32[B])."""
    j = new_BxJ.shape[1]
    n = jnp.minimum(n_emit_B, s.max_new - s.num_out)
    is_eos = jnp.any(new_BxJ[..., None] == s.slots.eos[:, None, :], axis=-1)
    is_eos &= jnp.arange(j)[None] < n[:, None]
    hit_eos_B = active_B & jnp.any(is_eos, axis=1)
    n = jnp.where(hit_eos_B, jnp.argmax(is_eos, axis=1) + 1, n)
    n = jnp.where(active_B, n, 0)
    cols = jnp.where(jnp.arange(j)[None] < n[:, None], s.num_out[:, None] + jnp.arange(j)[None], s.out.shape[1])
    out = s.out.at[jnp.arange(new_BxJ.shape[0])[:, None], cols].set(new_BxJ, mode="drop")
    num_out = s.num_out + n
    done = s.done | (num_out >= s.max_new) | hit_eos_B
    return s.set(out=out, num_out=num_out, done=done), n

  def prefill(self, target, proposer, grammar, s: LoopState, prompts_BxT, lens_B, admit_B, gstart_B,
              max_new_B, slots: SlotSettings, idx_A=None, read: PageRead = WHOLE_POOL) -> LoopState:
    """Admits prompts_BxT (int32[B, T], lens_B int32[B] long) into the slots where admit_B (bool[B]):
    writes their prompt rows, emits their first token (from grammar state gstart_B, int32[B]:
    grammar.FREE decodes free of it) and drafts, and stops each after max_new_B (int32[B],
    <= settings.max_new_tokens) tokens, with the admitted slots' settings `slots` (SlotSettings:
    rows where admit_B are read). The other slots' rows, drafts, grammar states, settings and
    counters are unchanged.

    idx_A: None (every slot), or int32[A] distinct slots: then the per-slot arguments are the A
    slots' (B read as A), in idx_A's order, and only they are computed (a prefill over all B slots
    costs B x T rows of the target for the few admitted). A slot whose earlier prompt parts
    `prefill_part` wrote gets its last part here: its rows continue after them. Not on a mesh
    (A need not divide the data axis). read: how the call reads its pages (static `PageRead`).
    A step at verify width c < K runs modules 0..c-1 only, for slots capped at c (num_drafts <= c).
    proposer None with a proposer state: no admitted slot drafts; their module rows stay as `free`
    left them (none; num_drafted 0, so a stale draft is never verified)."""
    if idx_A is not None:
      return self._on_slots(s, idx_A, lambda sub: self.prefill(
          target, proposer, grammar, sub, prompts_BxT, lens_B, admit_B, gstart_B, max_new_B, slots, read=read))
    b = admit_B.shape[0]
    zero = lambda x: jnp.where(admit_B, 0, x)
    one = admit_B.astype(jnp.int32)
    s = s.set(num_out=zero(s.num_out), done=s.done & ~admit_B, max_new=jnp.where(admit_B, max_new_B, s.max_new),
              counts=s.counts.admitted(admit_B), slots=slots.where(admit_B, s.slots),
              deferred=None if s.deferred is None else s.deferred.emptied(admit_B))
    logits, hid, tstate = target_step(target, s.target, prompts_BxT, jnp.where(admit_B, lens_B, 0), read=read)
    gstate_B = s.grammar_state
    if grammar is not None:
      gstate_B = jnp.where(admit_B, gstart_B, gstate_B)
    last_logits = jnp.take_along_axis(logits, jnp.maximum(lens_B - 1, 0)[:, None, None], axis=1)[:, 0]
    if grammar is not None:
      last_logits = grammar_lib.apply_mask(last_logits, grammar_lib.token_mask(grammar, gstate_B, logits.shape[-1]))
    first_B = draw_tokens(last_logits, s.slots, s.num_out, self.settings.sampled)  # output position 0
    if grammar is not None:
      gstate_B = jnp.where(admit_B, grammar_lib.advance(grammar, gstate_B, first_B), gstate_B)
    ok_B = admit_B & ~tstate.out_of_pages
    s, _ = self._emit(s.set(target=tstate), first_B[:, None], one, ok_B)
    s = s.set(last=jnp.where(admit_B, first_B, s.last), grammar_state=gstate_B)
    if proposer is None:
      return self._stop_out_of_pages(s)
    old = s.proposer
    # Running slots get no new positions and no drafts to settle, so propose writes none of their rows.
    pstate = old.set(num_drafted=jnp.where(admit_B, old.num_drafted, 0))
    # Position j's token is t_{j+1}: the prompt shifted left, with the first generated token at the end.
    tokens = jnp.concatenate([prompts_BxT[:, 1:], prompts_BxT[:, :1]], axis=1)
    tokens = tokens.at[jnp.arange(b), jnp.maximum(lens_B - 1, 0)].set(first_B)
    # A slot that verifies no drafts (num_drafts 0) gets no module rows, now or later.
    drafts, tree_probs, pstate = _draft_unless_idle(
        lambda pstate, hid, tokens, num_new: self.drafter.draft(proposer, grammar, pstate, hid, tokens, num_new,
                                                                gstate_B, s.slots, s.num_out, read, lagging=True),
        pstate, hid, tokens, jnp.where(ok_B & (s.slots.num_drafts > 0), lens_B, 0))
    keep = lambda new, prev: jnp.where(admit_B.reshape((b,) + (1,) * (new.ndim - 1)), new, prev)
    # A running slot whose deeper modules lag (`Deferred`) may see them run here over rows whose
    # inputs its rings no longer hold: harmless, its catch-up restores them as its wait began.
    pstate = pstate.set(num_drafted=keep(pstate.num_drafted, old.num_drafted),
                        draft_probs=None if old.draft_probs is None else keep(pstate.draft_probs, old.draft_probs))
    s = s.set(proposer=pstate, drafts=keep(drafts, s.drafts),
              tree_probs=None if s.tree_probs is None else keep(tree_probs, s.tree_probs))
    return self._stop_out_of_pages(s)

  def prefill_part(self, target, proposer, grammar, s: LoopState, slot_1, prompt_1xT, len_1, next_1xT,
                   read: PageRead = WHOLE_POOL, drafting_1=None) -> LoopState:
    """Writes one part of a prompt, not its last, into slot slot_1 (int32[1]): prompt_1xT (int32[1, T],
    len_1 (int32[1]) tokens of it) continue the slot's target and proposer rows; next_1xT holds
    the token after each (the prompt shifted by one). Nothing is emitted or drawn: the slot stays
    done (not decoding) until `prefill` admits the prompt's last part. Only that slot is
    computed, so a long prompt costs the running requests one part per call, not the whole.
    drafting_1: bool[1], False for a request that will verify no drafts (its modules get no
    rows); None: True."""
    def part(sub: LoopState) -> LoopState:
      _, hid, tstate = target_step(target, sub.target, prompt_1xT, len_1, read=read)
      sub = sub.set(target=tstate)
      if proposer is None:
        return sub
      # Its drafts are never read (the last part's propose treats them as rejected).
      num_new_1 = len_1 if drafting_1 is None else jnp.where(drafting_1, len_1, 0)
      _, _, pstate = _draft_unless_idle(
          lambda pstate, hid, tokens, num_new: self.drafter.draft(proposer, None, pstate, hid, tokens, num_new, None,
                                                                  sub.slots, sub.num_out, read, lagging=True),
          sub.proposer, hid, next_1xT, num_new_1)
      return sub.set(proposer=pstate)
    return self._on_slots(s, slot_1, part)

  def _on_slots(self, s: LoopState, idx_A, fn) -> LoopState:
    """fn applied to the A-slot state of slots idx_A (int32[A], distinct), its slots put back."""
    return put_slots(s, fn(take_slots(s, idx_A)), idx_A)

  def _stop_out_of_pages(self, s: LoopState) -> LoopState:  # a slot refused a page stops; the others go on
    return s.set(done=s.done | s.out_of_pages)

  def __call__(self, target, proposer, grammar, s: LoopState, read: PageRead = WHOLE_POOL) -> LoopState:
    """One decode step over every slot (done slots pass through); read: how it reads its pages."""
    st = self.settings
    k, tree = st.verify_width, st.tree
    b = s.last.shape[0]
    active_B = ~s.done
    drafts_BxK = s.drafts if tree is not None else s.drafts[:, :k]  # the drafts this step verifies
    inp_BxR = jnp.concatenate([s.last[:, None], drafts_BxK], axis=1)  # with a tree: [last, its N nodes]
    old_len = s.target.length
    logits, hid, tstate = target_step(target, s.target, inp_BxR, jnp.where(active_B, inp_BxR.shape[1], 0), tree,
                                      read=read)
    active_B = active_B & ~tstate.out_of_pages  # its logits are meaningless: emit nothing
    allowed_BxN = None
    if grammar is not None:
      # Position i gives the token after [emitted, d_1..d_i]; a tree node, after [emitted, its path].
      gstates_BxR = (grammar_lib.states_along(grammar, s.grammar_state, drafts_BxK) if tree is None else
                     node_states(grammar, s.grammar_state, inp_BxR, tree))
      mask_BxRxV = grammar_lib.token_mask(grammar, gstates_BxR, logits.shape[-1])
      logits = grammar_lib.apply_mask(logits, mask_BxRxV)
      parent_of = jnp.arange(k) if tree is None else jnp.asarray(tree.parents[1:])  # whose mask rules draft n
      allowed_BxN = jnp.take_along_axis(mask_BxRxV[:, parent_of], drafts_BxK[..., None], axis=-1)[..., 0]
    draft_probs = s.tree_probs if tree is not None else (
        None if s.proposer is None or s.proposer.draft_probs is None else s.proposer.draft_probs[:, :k])
    slots = s.slots
    if s.proposer is not None:  # after a narrower step, the drafts past its width were not drafted
      slots = slots.set(num_drafts=jnp.minimum(slots.num_drafts, s.proposer.num_drafted))
    verdict = self.verifier.verify(logits, drafts_BxK, draft_probs, allowed_BxN, slots, s.num_out)
    a_B, next_B = jnp.where(active_B, verdict.accepted, 0), verdict.next_token
    if verdict.path is not None:  # a tree: its accepted path plays the drafts' part
      path_BxK1 = verdict.path
      if grammar is not None:
        gstates_BxR = jnp.take_along_axis(gstates_BxR, path_BxK1, axis=1)
      drafts_BxK = jnp.take_along_axis(inp_BxR, path_BxK1[:, 1:], axis=1)
      hid = jnp.take_along_axis(hid, path_BxK1[..., None], axis=1)
      # The target keeps the root and the accepted path: its nodes' rows move into place.
      tstate = compact_target(tstate, old_len, path_BxK1, a_B)
    new_BxK1 = jnp.concatenate([drafts_BxK, jnp.zeros((b, 1), jnp.int32)], axis=1)
    new_BxK1 = new_BxK1.at[jnp.arange(b), a_B].set(next_B)
    s2, n_B = self._emit(s, new_BxK1, a_B + 1, active_B)
    # The target keeps its rows for [last, d_1..d_a]; the rest were rejected.
    tstate = trim_target(tstate, old_len + jnp.where(active_B, a_B + 1, 0))
    s2 = s2.set(target=tstate, last=jnp.where(active_B, next_B, s.last),
                counts=s.counts.verified(active_B, a_B, n_B, jnp.minimum(slots.num_drafts, k)))
    if grammar is not None:
      after_drafts_B = jnp.take_along_axis(gstates_BxR, a_B[:, None], axis=1)[:, 0]
      s2 = s2.set(grammar_state=jnp.where(active_B, grammar_lib.advance(grammar, after_drafts_B, next_B),
                                          s.grammar_state))
    if proposer is None or st.modules_idle:
      # Idle modules: no running slot drafts, so none has a proposer row to settle or to add.
      return self._stop_out_of_pages(s2)
    pstate = prop.after_verify(s.proposer, a_B)
    # A slot that verifies no drafts (num_drafts 0: a fixed 0, or "auto" admitted where drafts do
    # not pay) never needs its modules' rows, so they get none.
    num_new = jnp.where(s2.done | (s.slots.num_drafts == 0), 0, a_B + 1)
    def draft(pstate, hid, tokens, num_new, lagging=st.deeper_idle):
      return self.drafter.draft(proposer, grammar, pstate, hid, tokens, num_new, s2.grammar_state, s2.slots,
                                s2.num_out, read, lagging)
    deferred = s.deferred  # with deeper_idle no slot waits or will read the deeper modules: they lag
    if st.deeper_idle or deferred is None or not (st.may_catch_up or defers(k, self.drafter.num_drafts)):
      drafts, tree_probs, pstate = _draft_unless_idle(draft, pstate, hid, new_BxK1, num_new)
    else:
      # A slot capped at most at k (num_drafts <= k) never verifies a deeper module's draft: its
      # rows wait for none (those modules' rows and drafts for it are left stale, never read).
      waits_B = s2.slots.num_drafts > k
      drafts, tree_probs, pstate, deferred = _draft_deferring(draft, k, self.drafter.num_drafts, pstate, deferred,
                                                              hid, new_BxK1, num_new, waits_B, st.may_catch_up)
    tree_probs = None if s.tree_probs is None else tree_probs  # kept for rejection sampling only
    return self._stop_out_of_pages(s2.set(proposer=pstate, drafts=drafts, tree_probs=tree_probs, deferred=deferred))

  def run(self, target, proposer, grammar, s: LoopState, read: PageRead = WHOLE_POOL) -> LoopState:
    """Steps until every slot is done or one would outgrow the caches or read's page budget
    (then the host resizes: `resized`, or a larger read)."""
    return jax.lax.while_loop(lambda s: ~jnp.all(s.done) & self.fits(s, read),
                              lambda s: self(target, proposer, grammar, s, read), s)

  def run_for(self, target, proposer, grammar, s: LoopState, max_steps, idx_A=None,
              read: PageRead = WHOLE_POOL) -> LoopState:
    """Up to max_steps (int32[], a value: one compile for every count) steps on device, ending
    after the step in which a slot finishes (its slot can then be refilled) or before one that
    would not fit read's page budget and span: a serving loop's host round trip per call
    instead of per step.

    idx_A: None (every slot), or int32[A] distinct slots: only they are computed. The Engine
    passes its running slots (padded to a power of two with idle ones), so a step over a few
    running requests costs a few slots' rows, not all B (the page pools are shared, so only the
    per-slot arrays are gathered and put back)."""
    if idx_A is not None:
      return self._on_slots(s, idx_A, lambda sub: self.run_for(target, proposer, grammar, sub, max_steps, read=read))
    running_B = ~s.done

    def go_on(c):
      i, s = c
      return (i < max_steps) & ~jnp.any(running_B & s.done) & ~jnp.all(s.done) & self.fits(s, read)

    return jax.lax.while_loop(go_on, lambda c: (c[0] + 1, self(target, proposer, grammar, c[1], read)), (0, s))[1]

  def free(self, s: LoopState, mask_B) -> LoopState:
    """Empties the slots where mask_B (bool[B]): done, and their pages back to the pools."""
    s = s.set(target=reset_target_slots(s.target, mask_B), done=s.done | mask_B,
              deferred=None if s.deferred is None else s.deferred.emptied(mask_B))
    return s if s.proposer is None else s.set(proposer=prop.reset_slots(s.proposer, mask_B))

  def stop_drafting(self, s: LoopState, mask_B) -> LoopState:
    """The slots where mask_B (bool[B]) verify no drafts from now on (num_drafts 0): their modules
    get no rows again, and the rows they kept waiting are dropped (none will read them)."""
    s = s.set(slots=s.slots.set(num_drafts=jnp.where(mask_B, 0, s.slots.num_drafts)))
    return s if s.deferred is None else s.set(deferred=s.deferred.emptied(mask_B))


def defers(k: int, full: int) -> bool:
  """Whether a step at width k of at most `full` drafts leaves the deeper modules' rows waiting
  (`Deferred`) rather than running them over its own rows: when fewer modules draft than lag
  (2k < full). Waiting saves the full - k deeper modules' calls of every step, and its catch-up
  runs modules 0..k-1 again over every waiting row: measured on the large demo model (K = 3,
  8 slots, an engine held at one width, interleaved medians of 3 passes), deferring ran at 0.945x
  the fixed k = 1 engine against 0.91x not deferring, and at k = 2 at 0.963x the fixed k = 2
  engine against 0.985x."""
  return 2 * k < full


def _draft_deferring(draft, k: int, full: int, pstate, deferred: Deferred, hid, tokens, num_new_B, waits_B,
                     may_catch_up: bool = True):
  """(drafts, draft distributions or None, new proposer state, new `Deferred`) of a step at width
  k of at most `full` drafts that may defer the modules past k (`defers`; draft(..., lagging=True)
  runs k). waits_B (bool[B]): the slots whose rows the deeper modules need (a slot capped at most
  at k needs none of them: its rows are not kept).

  A step that does not defer, or one whose width a waiting slot's modules lag behind, or whose
  rows would not fit, first puts each waiting slot's proposer back as its wait began and runs the
  chain over the kept rows and its own (every module current after it); any other step runs
  modules 0..k-1 over its rows (none at k = 0) and keeps them for the deeper ones. may_catch_up
  False (a deferring step the host knows needs no catch-up: `StepSettings.may_catch_up`): the
  step keeps its rows without checking."""
  def catch_up():
    drafts, probs, p = draft(deferred.restored(pstate), *deferred.joined(hid, tokens, num_new_B))
    return drafts, probs, p, deferred.caught_up()

  if not defers(k, full):
    return jax.lax.cond(jnp.any(deferred.n > 0), catch_up,
                        lambda: (*draft(pstate, hid, tokens, num_new_B), deferred))

  kept_B = jnp.where(waits_B, num_new_B, 0)

  def wait():
    kept = deferred.began(pstate).kept(hid, tokens, kept_B, k)
    if k == 0:
      return *_no_drafts(draft, pstate, hid, tokens, num_new_B)[:2], pstate, kept
    return *draft(pstate, hid, tokens, num_new_B, lagging=True), kept

  return jax.lax.cond(deferred.lags(k, kept_B), catch_up, wait) if may_catch_up else wait()


def _draft_unless_idle(draft, pstate, hid, tokens, num_new_B):
  """draft(pstate, hid, tokens, num_new_B), or nothing when no slot has a new row (every running
  slot verifies no drafts): zero drafts and pstate as it was, at the cost of a predicate."""
  def idle():
    drafts, probs, out = _no_drafts(draft, pstate, hid, tokens, num_new_B)
    return drafts, probs, pstate.set(num_live=out.num_live)  # the static num_live as drafting sets it
  return jax.lax.cond(jnp.any(num_new_B > 0), lambda: draft(pstate, hid, tokens, num_new_B), idle)


def _no_drafts(draft, *args):
  """(zero drafts, zero draft distributions or None, the abstract state) shaped as draft(*args)'s
  answer, traced without running it."""
  drafts, probs, out = jax.eval_shape(draft, *args)
  zeros = lambda x: None if x is None else jnp.zeros(x.shape, x.dtype)
  return zeros(drafts), zeros(probs), out
