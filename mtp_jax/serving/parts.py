"""The decode step's parts, chosen once on the host from its static settings: a verifier and a drafter.

Every part reads the slots' own settings (`SlotSettings`: sampling, key, draft cap), so one
compiled step serves any mix of requests; a step whose settings say no slot samples
(`StepSettings.sampled` False) draws no noise at all.
"""

from __future__ import annotations

import dataclasses
import typing

import jax
import jax.numpy as jnp

from mtp_jax import proposer as prop
from mtp_jax.sampling import NOISE_ACCEPT, NOISE_DRAFT, NOISE_TARGET, Draws, position_keys
from mtp_jax.blocks import PageRead
from mtp_jax.blocks.pages import WHOLE_POOL
from mtp_jax.serving.options import StepSettings
from mtp_jax.serving.state import SlotSettings
from mtp_jax.tree import TreeSpec
from mtp_jax.verify import (verify_gumbel, verify_relaxed, verify_rows, verify_tree_gumbel, verify_tree_relaxed,
                            verify_tree_rows)


class Verdict(typing.NamedTuple):
  """A verifier's answer: accepted int32[B] drafts, the next token int32[B], and for trees the
  accepted path int32[B, k + 1] (tree nodes by depth, the root first), else None."""

  accepted: jax.Array
  next_token: jax.Array
  path: jax.Array | None = None


def target_draws(slots: SlotSettings, positions_B, sampled: bool) -> Draws | None:
  """The slots' draws of target tokens from output positions_B (int32[B]) on; None when no slot samples."""
  return Draws.of(slots.sampling, slots.keys, NOISE_TARGET, positions_B) if sampled else None


def draw_tokens(logits_BxV, slots: SlotSettings, positions_B, sampled: bool) -> jax.Array:
  """int32[B]: each slot's token at output position positions_B (int32[B]): the plain sampling
  path every emitted token follows (greedy slots: the argmax)."""
  draws = target_draws(slots, positions_B, sampled)
  return jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32) if draws is None else draws.sample(logits_BxV)


# The verifiers. verify(logits float32[B, R, V] (masked by the grammar), drafts int32[B, R - 1],
# draft_probs (float32[B, k, V] for a chain, [B, M, V] for a tree, or None when not kept),
# allowed bool[B, R - 1] (drafts the grammar allows, or None), slots (SlotSettings), positions_B
# int32[B] (the output position of the token after `last`)) -> Verdict.


@dataclasses.dataclass(frozen=True)
class VerifyPlain:
  """No drafts: the next token is the slot's draw from the target's first row."""

  sampled: bool

  def verify(self, logits, drafts, draft_probs, allowed, slots, positions_B) -> Verdict:
    del drafts, draft_probs, allowed
    next_B = draw_tokens(logits[:, 0], slots, positions_B, self.sampled)
    return Verdict(jnp.zeros(next_B.shape, jnp.int32), next_B)


def _caps(slots: SlotSettings, k: int) -> jax.Array:
  return jnp.minimum(slots.num_drafts, k)


def _accept_keys(slots: SlotSettings, positions_B) -> jax.Array:
  """key[B]: rejection sampling's key of each slot's step starting at positions_B: one per step,
  since positions only grow."""
  keys_B = jax.vmap(lambda key: jax.random.fold_in(key, NOISE_ACCEPT))(slots.keys)
  return position_keys(keys_B, jnp.asarray(positions_B)[:, None])[:, 0]


@dataclasses.dataclass(frozen=True)
class VerifyChain:
  """A chain's drafts: Gumbel acceptance (`verify_gumbel`; greedy slots: the argmax prefix) or
  lossless rejection sampling (`verify_rows`), each slot with its own settings and draft cap."""

  sampled: bool
  acceptance: str

  def verify(self, logits, drafts, draft_probs, allowed, slots, positions_B) -> Verdict:
    del allowed  # the masked logits give forbidden drafts probability 0: they are rejected
    caps_B = _caps(slots, drafts.shape[1])
    if self.sampled and self.acceptance == "rejection":
      return Verdict(*verify_rows(logits, drafts, draft_probs, _accept_keys(slots, positions_B), slots.sampling,
                                  caps_B))
    return Verdict(*verify_gumbel(logits, drafts, target_draws(slots, positions_B, self.sampled), caps_B))


@dataclasses.dataclass(frozen=True)
class VerifyTree:
  """A tree's nodes: Gumbel acceptance (`verify_tree_gumbel`; greedy slots: `verify_tree_greedy`)
  or multi-candidate rejection sampling (`verify_tree_rows`), each slot with its own settings and
  depth cap."""

  tree: TreeSpec
  sampled: bool
  acceptance: str

  def verify(self, logits, drafts, draft_probs, allowed, slots, positions_B) -> Verdict:
    del allowed
    caps_B = _caps(slots, self.tree.depth)
    if self.sampled and self.acceptance == "rejection":
      return Verdict(*verify_tree_rows(logits, drafts, draft_probs, _accept_keys(slots, positions_B),
                                       slots.sampling, self.tree, caps_B))
    return Verdict(*verify_tree_gumbel(logits, drafts, target_draws(slots, positions_B, self.sampled), self.tree,
                                       caps_B))


@dataclasses.dataclass(frozen=True)
class VerifyRelaxed:
  """LOSSY relaxed acceptance (greedy), capped at the first draft the grammar forbids and at the
  slot's draft cap (`verify_relaxed`)."""

  top_n: int
  delta: float

  def verify(self, logits, drafts, draft_probs, allowed, slots, positions_B) -> Verdict:
    k = drafts.shape[1]
    in_cap = jnp.arange(k)[None] < _caps(slots, k)[:, None]
    allowed = in_cap if allowed is None else allowed & in_cap
    return Verdict(*verify_relaxed(logits, drafts, top_n=self.top_n, delta=self.delta, allowed_BxK=allowed))


@dataclasses.dataclass(frozen=True)
class VerifyTreeRelaxed:
  """LOSSY relaxed acceptance along the tree's paths, nodes deeper than the slot's cap refused
  (`verify_tree_relaxed`)."""

  tree: TreeSpec
  top_n: int
  delta: float

  def verify(self, logits, drafts, draft_probs, allowed, slots, positions_B) -> Verdict:
    in_cap = jnp.asarray(self.tree.depths[1:])[None] <= _caps(slots, self.tree.depth)[:, None]
    allowed = in_cap if allowed is None else allowed & in_cap
    return Verdict(*verify_tree_relaxed(logits, drafts, self.tree, top_n=self.top_n, delta=self.delta,
                                        allowed_BxN=allowed))


Verifier = VerifyPlain | VerifyChain | VerifyTree | VerifyRelaxed | VerifyTreeRelaxed


def pick_verifier(settings: StepSettings) -> Verifier:
  """The verification rule the settings ask for (chosen once, on the host)."""
  st, tree, relaxed = settings, settings.tree, settings.relaxed
  if st.num_drafts == 0:
    return VerifyPlain(st.sampled)
  if relaxed is not None:
    if tree is None:
      return VerifyRelaxed(relaxed.top_n, relaxed.delta)
    return VerifyTreeRelaxed(tree, relaxed.top_n, relaxed.delta)
  if tree is None:
    return VerifyChain(st.sampled, st.acceptance)
  return VerifyTree(tree, st.sampled, st.acceptance)


@dataclasses.dataclass(frozen=True)
class Drafter:
  """Drafts with `propose_step`: a chain of k drafts, or the `tree`'s N nodes; with a grammar,
  drafts are masked as draft_masks says ("per_position", "first" or "none", an ablation switch).
  Sampled slots draw with the target's noise under Gumbel acceptance (so a draft is the target's
  token whenever both distributions agree under it), from a noise stream of their own under
  rejection sampling.

  The work follows the width: a step that verifies `verify_width` < num_drafts drafts (the
  Engine's num_drafts="auto"), over a proposer of num_drafts = K modules, drafts only that many;
  the deeper modules run over the newly verified rows alone (catch_up: no drafted rows, no head,
  no draws), so they stay current and any width may follow; or, lagging, they do not run and the
  step keeps their rows for later (`Deferred`). A step that verifies all it drafts,
  or a proposer deeper than num_drafts (its deeper modules never run: catch_up=False), drafts
  num_drafts."""

  num_drafts: int
  tree: TreeSpec | None
  draft_masks: str
  sampled: bool
  acceptance: str
  verify_width: int | None = None

  def draft(self, proposer, grammar, pstate, hid_BxTxD, tokens_BxT, num_new_B, gstate_B, slots: SlotSettings,
            positions_B, read: PageRead = WHOLE_POOL, lagging: bool = False):
    """(drafts int32[B, num_drafts] (zeros past the drafted ones) or the tree's int32[B, N], a
    tree's draft distributions float32[B, M, V] or None, new state); positions_B int32[B]: the
    output position of the first draft; read: how a paged state's call reads its pages;
    lagging: at a narrower width, the deeper modules do not run (the caller keeps their rows:
    `Deferred`), and the state's static num_live stays as it came."""
    masked = self.draft_masks != "none" and grammar is not None
    gumbel = self.acceptance == "gumbel"
    narrow = (self.tree is None and self.verify_width is not None and self.verify_width < self.num_drafts
              and proposer.cfg.num_depths == self.num_drafts)
    settings = prop.ProposeSettings(self.verify_width if narrow else self.num_drafts, catch_up=narrow and not lagging,
                                    tree=self.tree, grammar_per_position=self.draft_masks == "per_position",
                                    tree_draws="top" if gumbel else "independent", read=read)
    draws = None
    if self.sampled:
      draws = Draws.of(slots.sampling, slots.keys, NOISE_TARGET if gumbel else NOISE_DRAFT, positions_B)
    drafts, new_pstate = prop.propose_step(proposer, pstate, hid_BxTxD, tokens_BxT, num_new_B, settings, draws,
                                           grammar if masked else None, gstate_B if masked else None)
    # The loop state's structure is one for every width; what lags is the caller's to track.
    pstate = new_pstate.set(num_live=pstate.num_live) if narrow and lagging else new_pstate
    if self.tree is not None:
      return drafts.tokens, drafts.probs, pstate
    pad = self.num_drafts - drafts.shape[1]
    return jnp.pad(drafts, [(0, 0), (0, pad)]), None, pstate
