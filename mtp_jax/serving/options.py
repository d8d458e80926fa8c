"""The decode step's settings, as typed frozen dataclasses, and the checks that build them.

Everything here runs on the host, once per `generate` call or `Engine`: the settings are static
(hashable) data of the jitted step, so each distinct value compiles once. `generate` and the
Engine build them through the same checks (`decoding`, `check_prompts`), which name the
argument and the limit on bad input (mtp_jax/validate.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

import jax
import numpy as np

from mtp_jax import grammar as grammar_lib
from mtp_jax import validate
from mtp_jax.blocks.pages import check_paging
from mtp_jax.mtp import MtpModel
from mtp_jax.target import TargetModel
from mtp_jax.tree import TreeSpec, check_tree

if TYPE_CHECKING:
  from mtp_jax.serving.policy import DraftPolicy

DRAFT_MASKS = ("per_position", "first", "none")
# How a sampled row accepts drafts: "gumbel" (the drafts share the target's noise and its own
# draws are kept: seeded output equals plain sampling's, whatever k) or "rejection" (lossless
# rejection sampling: the maximal coupling, but tokens that follow the number of drafts verified).
ACCEPTANCES = ("gumbel", "rejection")


@dataclasses.dataclass(frozen=True)
class Sampling:
  """How tokens are drawn: temperature 0 is greedy; top_k / top_p filter the distribution."""

  temperature: float = 0.0
  top_k: int | None = None
  top_p: float | None = None

  @property
  def greedy(self) -> bool:
    return self.temperature == 0

  def kwargs(self) -> dict:
    """The keywords `sample`, `propose` and the verify functions take."""
    return dict(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p)


@dataclasses.dataclass(frozen=True)
class Relaxed:
  """LOSSY relaxed acceptance (greedy only): a draft among the target's top_n tokens whose
  probability is within delta of the top-1's is accepted (`verify_relaxed`)."""

  top_n: int
  delta: float


@dataclasses.dataclass(frozen=True)
class Paging:
  """Paged caches: num_pages pages of page_size rows per layer (blocks/paged.py). How each call
  reads them (a `PageRead`: a page budget or span) is an argument of that call, not a setting."""

  page_size: int
  num_pages: int


@dataclasses.dataclass(frozen=True)
class StepSettings:
  """The static settings of `DecodeStep`.

  num_drafts: k drafts per step (a tree's depth), 0 without a proposer. max_new_tokens: the
  device stops a sequence after this many tokens. max_len: cache rows per sequence now
  (contiguous caches grow between jitted calls; paged ones hold it from the start).
  Sampling settings, keys, draft caps and end tokens are per slot, in the loop state's `slots`;
  sampled: some slot may sample (False: every slot is greedy and the step draws no noise).
  acceptance: how sampled slots accept drafts, "gumbel" or "rejection" (ACCEPTANCES).
  relaxed: LOSSY relaxed acceptance (greedy only). tree: draft a `TreeSpec` instead of a chain.
  draft_masks: "per_position", "first" or "none" (see `generate`). mesh: place the states on a
  ("data", "model") mesh. verify_drafts: drafts the target verifies per step, 0..num_drafts
  (default all); the proposer drafts that many and its deeper modules catch up, so the next
  call may verify any number. deferred_rows: W > 0 (a chain): a step at width k with
  2k < num_drafts (`step.defers`) runs modules 0..k-1 only (none at 0) and keeps its verified
  rows (`LoopState.deferred`); the deeper modules catch up on the kept rows in one call when a
  wider step needs them or the next rows would not fit in W. 0: every step hands every module
  its rows. may_catch_up (with deferred_rows): some slot may have to catch up during the call (a
  step that does not defer: rows wait; one that defers: rows that began to wait at a narrower
  width, or more than W rows), so each step checks (a `lax.cond` whose catch-up branch the
  program carries); False: the Engine ruled it out from the counts it reads after each call
  (`Deferred.n`, `Deferred.width`), so the step does not check: one that does not defer runs the
  chain as one without deferred rows does (3% of the fixed k = K engine's time on the large demo
  at 8 slots went to that check), one that defers keeps its rows. modules_idle: no slot the step
  runs drafts (the Engine's calls where every running request verifies no drafts): it verifies
  none and runs no module (the proposer's state and any waiting rows pass through as they came);
  needs verify_drafts=0. deeper_idle: no slot the step runs ever verifies more than verify_drafts
  = k < num_drafts drafts (each one's draft cap is at most k: a fixed num_drafts, or "auto"
  capped at admission) and none has rows waiting, so the modules past k do not run (their rows
  of these slots are never read); without it a step at a width that does not defer runs them
  over its verified rows (catch_up), as an uncapped slot may verify their drafts later.
  """

  num_drafts: int
  max_new_tokens: int
  max_len: int
  sampled: bool = False
  acceptance: str = "gumbel"
  relaxed: Relaxed | None = None
  tree: TreeSpec | None = None
  draft_masks: str = "per_position"
  mesh: jax.sharding.Mesh | None = None
  paging: Paging | None = None
  verify_drafts: int | None = None
  deferred_rows: int = 0
  may_catch_up: bool = True
  modules_idle: bool = False
  deeper_idle: bool = False

  def __post_init__(self):
    validate.one_of("acceptance", self.acceptance, ACCEPTANCES)
    if self.relaxed is not None and self.sampled:
      raise validate.InvalidValue("relaxed", "relaxed acceptance is a greedy option: its steps have sampled=False")
    if self.verify_drafts is not None and not 0 <= self.verify_drafts <= self.num_drafts:
      raise validate.InvalidValue("verify_drafts", f"verify_drafts must be in 0..num_drafts={self.num_drafts}, "
                                                   f"got {self.verify_drafts}")
    if self.verify_drafts is not None and self.tree is not None:
      raise validate.InvalidValue("verify_drafts", "a tree step verifies its whole tree")
    if self.modules_idle and self.verify_drafts != 0:
      raise validate.InvalidValue("modules_idle", f"modules_idle=True (no module runs) verifies no drafts: it "
                                                  f"needs verify_drafts=0, got {self.verify_drafts}")
    if self.deeper_idle and (self.tree is not None or self.verify_width >= self.num_drafts):
      raise validate.InvalidValue("deeper_idle", f"deeper_idle=True idles the modules past the verify width: it "
                                                 f"needs a chain and verify_drafts < num_drafts={self.num_drafts}, "
                                                 f"got {self.verify_drafts}")
    validate.integer("deferred_rows", self.deferred_rows, 0)
    if self.deferred_rows and (self.tree is not None or self.relaxed is not None or not self.num_drafts):
      raise validate.InvalidValue("deferred_rows", "deferred_rows defers a chain's modules: it needs num_drafts > 0, "
                                                   "no tree and no relaxed acceptance")

  @property
  def verify_width(self) -> int:
    """Drafts the target verifies per step (a tree: its depth)."""
    return self.num_drafts if self.verify_drafts is None else self.verify_drafts

  @property
  def rows_per_step(self) -> int:
    """Target rows a decode step writes per sequence: [last, d_1..d_k], or the root and the tree's N nodes."""
    return (self.verify_width if self.tree is None else self.tree.num_nodes) + 1


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  """The settings of an `Engine`, checked when it is built (errors name the field and the limit).

  max_batch: slots decoded together. max_len: rows per sequence: a request needs len(prompt) +
    max_new_tokens + R <= max_len, R the rows of a step (K + 1, or a tree's nodes + 1).
  page_size, num_pages: the paged caches (page_size must divide max_len; num_pages per layer,
    default max_batch * max_len / page_size, at least max_len / page_size).
  num_drafts: "auto" (the default with a proposer; see `DraftPolicy`): each step verifies as many
    of the K drafts as pay, and the modules draft that many. An int k in 1..K: it drafts and
    verifies k (requests may ask for 0..k). 0: requests decode without drafts unless they ask for
    some. A tree engine drafts its tree; a request's num_drafts caps the depth it accepts.
  temperature, top_k, top_p, eos_token_id, seed: the requests' defaults (`add_request` overrides
    each). A request with a seed draws with `sampling.row_key(seed)` (as `generate` draws a lone
    prompt); one without, with the key of its id under the engine's seed.
  acceptance: how sampled requests' drafts are verified, "gumbel" or "rejection" (see `generate`).
  grammar: the default `mtp_jax.grammar.Grammar` of requests (constrained by default; needs
    eos_token_id equal to its own); `add_request(grammar=)` takes any other.
  relaxed, tree: as for `generate` (a relaxed engine's requests are greedy).
  mesh: a `mtp_jax.sharding.make_mesh` mesh for the slots' states (shard the params with
    `shard_params`).
  max_waiting: requests the queue may hold (None: unbounded); `add_request` on a full queue
    raises `QueueFull`, so an overloaded engine refuses work instead of growing without bound.
  steps_per_call: decode steps one `step()` runs on device before the host reads the tokens
    (fewer when a request finishes, or one when a waiting request could take a free slot).
  prefill_chunk: prompt tokens one call writes for a request (None: whole prompts). A longer
    prompt is written in parts, one per `step()` (only its slot computed), between the running
    requests' decode steps, so it does not stall them for its whole prefill.
  draft_policy: the `DraftPolicy` of num_drafts="auto" (None: a new one). Its step times belong
    to the models, batch size and machine, not to one engine: an engine built again on the same
    ones can take the first one's and skip measuring every width anew.
  deferred_rows: under num_drafts="auto", a step at width k with 2k < K runs modules 0..k-1
    only (none at 0): the deeper ones catch up on up to this many verified rows per slot in one
    call, when a wider step needs them or the rows fill (0: every module runs every step, over
    its rows).
    Only "auto" engines defer.
  """

  max_batch: int = 8
  max_len: int = 512
  page_size: int = 16
  num_pages: int | None = None
  num_drafts: int | str | None = None
  temperature: float = 0.0
  top_k: int | None = None
  top_p: float | None = None
  eos_token_id: int | None = None
  seed: int = 0
  acceptance: str = "gumbel"
  grammar: grammar_lib.Grammar | None = None
  relaxed: tuple[int, float] | None = None
  tree: TreeSpec | None = None
  mesh: jax.sharding.Mesh | None = None
  max_waiting: int | None = None
  steps_per_call: int = 4
  prefill_chunk: int | None = None
  draft_policy: DraftPolicy | None = None
  deferred_rows: int = 32

  def replace(self, **changes) -> "EngineConfig":
    """This config with `changes` (its field names; another name is a TypeError naming it)."""
    return dataclasses.replace(self, **changes)


@dataclasses.dataclass(frozen=True)
class Decoding:
  """Checked decoding arguments shared by `generate` and the Engine (before sizes are known)."""

  num_drafts: int
  sampling: Sampling
  seed: int
  eos_token_id: int | None
  relaxed: Relaxed | None
  tree: TreeSpec | None
  draft_masks: str
  acceptance: str = "gumbel"

  @property
  def rows_per_step(self) -> int:
    """Target rows a decode step writes per sequence (as StepSettings.rows_per_step)."""
    return (self.num_drafts if self.tree is None else self.tree.num_nodes) + 1


def decoding(target, proposer, *, num_drafts, temperature, top_k, top_p, seed, eos_token_id, relaxed=None,
             tree=None, grammar=None, draft_masks: str = "per_position", acceptance: str = "gumbel") -> Decoding:
  """The models and the decoding arguments checked; errors name the argument and its limits.

  num_drafts defaults to the proposer's depths (or the tree's depth); it must be None without a
  proposer. Relaxed acceptance is greedy only; a grammar needs eos_token_id equal to its own;
  acceptance is one of ACCEPTANCES.
  """
  validate.instance("target", target, TargetModel, "a TargetModel")
  v = target.cfg.vocab_size
  if proposer is None:
    if num_drafts is not None:
      raise validate.InvalidValue("num_drafts", f"num_drafts needs a proposer (plain decoding drafts nothing), "
                                                f"got {num_drafts!r}")
    if tree is not None:
      raise validate.InvalidValue("tree", "tree drafts need a proposer")
    k = 0
  else:
    validate.instance("proposer", proposer, MtpModel, "an MtpModel or None")
    if proposer.cfg.vocab_size != v:
      raise validate.InvalidValue(
          "proposer", f"vocab mismatch: target vocab_size={v}, proposer vocab_size={proposer.cfg.vocab_size}")
    if proposer.cfg.hidden_size != target.cfg.hidden_size:
      raise validate.InvalidValue("proposer", f"hidden size mismatch: target hidden_size={target.cfg.hidden_size}, "
                                              f"proposer hidden_size={proposer.cfg.hidden_size}")
    k_max = proposer.cfg.num_depths
    if tree is not None and num_drafts is None:
      num_drafts = check_tree(tree, max_depth=k_max).depth
    k = k_max if num_drafts is None else validate.integer("num_drafts", num_drafts, 1, k_max)
    if tree is not None:
      check_tree(tree, num_drafts=k, vocab_size=v)
  temperature, top_k, top_p = validate.sampling(temperature, top_k, top_p)
  seed = validate.integer("seed", seed, 0, 2**32 - 1)  # jax.random.key keeps the low 32 bits
  eos_token_id = validate.optional_int("eos_token_id", eos_token_id, 0, v - 1)
  if relaxed is not None:
    if not isinstance(relaxed, (tuple, list)) or len(relaxed) != 2:
      raise validate.InvalidType("relaxed", f"relaxed must be a (top_n, delta) pair, got {relaxed!r}")
    if temperature != 0:
      raise validate.InvalidValue("relaxed", "relaxed acceptance is a greedy option; use temperature=0")
    if proposer is None:
      raise validate.InvalidValue("relaxed", "relaxed acceptance verifies drafts: it needs a proposer")
    relaxed = Relaxed(validate.positive_int("relaxed[0]", relaxed[0], v),
                      validate.real("relaxed[1]", relaxed[1], 0.0, 1.0))
  validate.one_of("draft_masks", draft_masks, DRAFT_MASKS)
  validate.one_of("acceptance", acceptance, ACCEPTANCES)
  if grammar is not None:
    validate.instance("grammar", grammar, grammar_lib.Grammar, "a mtp_jax.grammar.Grammar")
    if eos_token_id is None:
      raise validate.InvalidValue("eos_token_id", "a grammar ends sequences with eos: pass eos_token_id "
                                                  f"(the grammar's is {grammar.eos_token_id})")
    if eos_token_id != grammar.eos_token_id:
      raise validate.InvalidValue("eos_token_id", f"eos_token_id={eos_token_id} differs from the grammar's "
                                                  f"eos_token_id={grammar.eos_token_id}")
    if grammar.vocab_size > v:
      raise validate.InvalidValue(
          "grammar", f"grammar has {grammar.vocab_size} tokens, more than the target's vocab_size={v}")
  return Decoding(num_drafts=k, sampling=Sampling(temperature, top_k, top_p), seed=seed,
                  eos_token_id=eos_token_id, relaxed=relaxed, tree=tree, draft_masks=draft_masks,
                  acceptance=acceptance)


def check_prompt(name: str, prompt, vocab_size: int) -> np.ndarray:
  """One prompt as int64[len], refused by `name` unless a non-empty flat list of ids in 0..V-1."""
  if isinstance(prompt, (str, bytes)) or not isinstance(prompt, (Sequence, np.ndarray)):
    raise validate.InvalidType(name, f"{name} must be a list of token ids, got {type(prompt).__name__}")
  if len(prompt) == 0:
    raise validate.InvalidValue(name, f"{name} is empty; every prompt needs at least one token")
  arr = np.asarray(prompt)
  if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer) or arr.dtype == np.bool_:
    raise validate.InvalidType(name, f"{name} must be a flat list of int token ids, got {arr.dtype} "
                                     f"values of shape {list(arr.shape)}")
  bad = arr[(arr < 0) | (arr >= vocab_size)]
  if bad.size:
    raise validate.InvalidValue(name, f"{name} has token id(s) {bad[:5].tolist()} outside 0..vocab_size-1="
                                      f"{vocab_size - 1}")
  return arr.astype(np.int64)


def check_prompts(prompts, vocab_size: int) -> list[np.ndarray]:
  """Each prompt as int64[len], checked: a non-empty sequence of non-empty int token lists in 0..V-1."""
  if isinstance(prompts, (str, bytes)) or not isinstance(prompts, (Sequence, np.ndarray)):
    raise validate.InvalidType("prompts", f"prompts must be a list of token-id lists, got {type(prompts).__name__}")
  if len(prompts) == 0:
    raise validate.InvalidValue("prompts", "prompts must be a non-empty list of token lists")
  validate.integer("len(prompts)", len(prompts), 1)
  return [check_prompt(f"prompts[{i}]", p, vocab_size) for i, p in enumerate(prompts)]


def paging(max_len: int, page_size, num_pages, batch_size: int) -> tuple[int, int]:
  """(page_size, num_pages) checked for caches of max_len rows; num_pages defaults to as many
  pages as contiguous caches of batch_size x max_len rows hold."""
  page_size = validate.positive_int("page_size", page_size)
  num_pages = batch_size * (max_len // page_size) if num_pages is None else num_pages
  check_paging(max_len, page_size, num_pages)
  return page_size, num_pages
