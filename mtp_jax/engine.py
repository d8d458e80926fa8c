"""A continuous-batching engine around generate's jitted decode step.

The engine owns one `generate.LoopState` of `max_batch` slots with paged caches. `step()`:

1. admits waiting requests into free slots (FIFO, while the page pool can hold each one's
   worst case): one jitted prefill over the admitted slots writes their prompt rows, emits
   their first token and drafts; running slots pass through untouched;
2. runs `generate._step`, the decode step `generate` itself runs, once over all slots;
   before each jitted call the host sets the page budget (the pages attention reads, see
   blocks/paged.py) from the pages the call may hold, so reads follow the tokens in flight;
3. reads the tokens each request gained and frees the slots (and pages) of finished ones at once.

Every jitted call donates the loop state, so the caches are updated in place. Host work per
step is small reads (the pages the call may hold; tokens, counters). Greedy output per request
equals `generate` run on that request alone: a slot's rows, pages and counters are its own, and
the step masks the rest.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import time
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from mtp_jax import grammar as grammar_lib
from mtp_jax import proposer as prop
from mtp_jax import validate
from mtp_jax.generate import (PROMPT_BUCKET, LoopState, _budgeted, _draft, _emit, _first_token, _out_of_pages,
                              _pages_needed, _Settings, _split, _step_jit, _step_rows, _stop_out_of_pages,
                              _validate, _with_budget)
from mtp_jax.blocks.paged import budget_bucket, check_paging
from mtp_jax.mtp import MtpModel
from mtp_jax.target import TargetModel, init_target_state, reset_target_slots, target_step


@dataclasses.dataclass
class Request:
  """One request's host-side record.

  status: "waiting", "running", "finished", "cancelled" or "out_of_pages" (stopped by the
  device allocator; admission reserves pages, so only an engine built too small sees it).
  """

  id: int
  prompt: list[int]
  max_new_tokens: int
  constrained: bool = False
  tokens: list[int] = dataclasses.field(default_factory=list)
  status: str = "waiting"
  slot: int | None = None
  pages: int = 0  # pages reserved in each pool while running
  verify_calls: int = 0
  arrived_at: float = 0.0
  first_token_at: float | None = None
  finished_at: float | None = None

  @property
  def stats(self) -> dict:
    """accepted_length: tokens per verify step (after the first token); ttft_s: time to first
    token from add_request; tokens_per_s: generated tokens over the request's whole time."""
    n = len(self.tokens)
    end = self.finished_at or time.perf_counter()
    return dict(prompt_tokens=len(self.prompt), generated_tokens=n, verify_calls=self.verify_calls,
                accepted_length=(n - 1) / self.verify_calls if self.verify_calls else float("nan"),
                ttft_s=None if self.first_token_at is None else self.first_token_at - self.arrived_at,
                tokens_per_s=n / (end - self.arrived_at) if n else 0.0)


def _empty_state(target, proposer, grammar, batch_size: int, cfg: _Settings, seed: int) -> LoopState:
  """A loop state whose slots are all free (done, no rows, no pages; grammar states FREE)."""
  k = cfg.num_drafts
  zeros = lambda: jnp.zeros((batch_size,), jnp.int32)  # a buffer each: the state is donated
  pstate = None if proposer is None else _budgeted(prop.init_state(
      proposer.cfg, batch_size, cfg.max_len, keep_draft_probs=cfg.temperature > 0,
      page_size=cfg.page_size, num_pages=cfg.num_pages), cfg.page_budget)
  return LoopState(
      target=_budgeted(init_target_state(target.cfg, batch_size, cfg.max_len, page_size=cfg.page_size,
                                         num_pages=cfg.num_pages), cfg.page_budget),
      proposer=pstate, last=zeros(), drafts=jnp.zeros((batch_size, k), jnp.int32),
      grammar_state=None if grammar is None else jnp.full((batch_size,), grammar_lib.FREE, jnp.int32),
      out=jnp.zeros((batch_size, cfg.max_new_tokens + k + 1), jnp.int32), num_out=zeros(),
      done=jnp.ones((batch_size,), bool), key=jax.random.key(seed), target_calls=zeros(), verify_calls=zeros(),
      accepted=zeros(), target_tokens=zeros(), accepted_at=jnp.zeros((k,), jnp.int32))


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("s",))
def _admit(target, proposer, grammar, s: LoopState, prompts_BxT, lens_B, admit_B, constrained_B, cfg: _Settings):
  """Prefills the slots where admit_B (bool[B]) with prompts_BxT (int32[B, T], lens_B long) as
  `generate`'s start does, under the grammar where constrained_B (bool[B]); the other slots'
  rows, drafts, grammar states and counters are unchanged."""
  b = admit_B.shape[0]
  zero = lambda x: jnp.where(admit_B, 0, x)
  one = admit_B.astype(jnp.int32)
  s = s.set(num_out=zero(s.num_out), done=s.done & ~admit_B, target_calls=zero(s.target_calls) + one,
            verify_calls=zero(s.verify_calls), accepted=zero(s.accepted), target_tokens=zero(s.target_tokens) + one)
  logits, hid, tstate = target_step(target, s.target, prompts_BxT, jnp.where(admit_B, lens_B, 0))
  key, k_first, k_draft = _split(s.key, cfg)
  gstate_B = s.grammar_state
  if grammar is not None:
    gstate_B = jnp.where(admit_B, grammar_lib.init_grammar_state(b, constrained_B), gstate_B)
  first_B, after_B = _first_token(grammar, logits, lens_B, gstate_B, k_first, cfg)
  if grammar is not None:
    gstate_B = jnp.where(admit_B, after_B, gstate_B)
  ok_B = admit_B & ~_out_of_pages(tstate, None)
  s, _ = _emit(s.set(target=tstate, key=key), first_B[:, None], one, cfg, ok_B)
  s = s.set(last=jnp.where(admit_B, first_B, s.last), grammar_state=gstate_B)
  if proposer is None:
    return _stop_out_of_pages(s)
  old = s.proposer
  # Running slots get no new positions and no drafts to settle, so propose writes none of their rows.
  pstate = old.set(num_drafted=jnp.where(admit_B, old.num_drafted, 0))
  tokens = jnp.concatenate([prompts_BxT[:, 1:], prompts_BxT[:, :1]], axis=1)
  tokens = tokens.at[jnp.arange(b), jnp.maximum(lens_B - 1, 0)].set(first_B)
  drafts, pstate = _draft(proposer, grammar, pstate, hid, tokens, jnp.where(ok_B, lens_B, 0), gstate_B, k_draft,
                          cfg)
  keep = lambda new, prev: jnp.where(admit_B.reshape((b,) + (1,) * (new.ndim - 1)), new, prev)
  pstate = pstate.set(num_drafted=keep(pstate.num_drafted, old.num_drafted),
                      draft_probs=None if old.draft_probs is None else keep(pstate.draft_probs, old.draft_probs))
  return _stop_out_of_pages(s.set(proposer=pstate, drafts=keep(drafts, s.drafts)))


@functools.partial(jax.jit, donate_argnames=("s",))
def _free(s: LoopState, mask_B) -> LoopState:
  """Empties the slots where mask_B (bool[B]): their pages go back to the pools."""
  s = s.set(target=reset_target_slots(s.target, mask_B), done=s.done | mask_B)
  return s if s.proposer is None else s.set(proposer=prop.reset_slots(s.proposer, mask_B))


class Engine:
  """Continuous batching: requests come and go; each slot is refilled as soon as it frees.

  Args:
    target, proposer: as for `generate` (proposer None decodes without drafts).
    max_batch: slots decoded together.
    max_len: rows per sequence: a request needs len(prompt) + max_new_tokens + k + 1 <= max_len.
    page_size, num_pages: the paged caches (page_size must divide max_len; num_pages per layer,
      default max_batch * max_len / page_size, at least max_len / page_size).
    num_drafts, temperature, top_k, top_p, eos_token_id, seed: as for `generate`, shared by all
      requests (they are static settings of the jitted step). Greedy output per request equals
      `generate` on that request alone; sampling draws from the engine's one key stream.
    grammar: a `mtp_jax.grammar.Grammar` for the requests added with constrained=True (by
      default all of them, as `generate`'s constrained); needs eos_token_id equal to its own.
  """

  def __init__(self, target: TargetModel, proposer: MtpModel | None, *, max_batch: int = 8,
               max_len: int = 512, page_size: int = 16, num_pages: int | None = None,
               num_drafts: int | None = None, temperature: float = 0.0, top_k: int | None = None,
               top_p: float | None = None, eos_token_id: int | None = None, seed: int = 0,
               grammar: grammar_lib.Grammar | None = None):
    a = _validate(target, proposer, [[0]], 1, num_drafts, temperature, top_k, top_p, seed, eos_token_id,
                  None, None, None, grammar, None, "per_position")
    k, temperature, top_k, top_p, seed = a["k"], a["temperature"], a["top_k"], a["top_p"], a["seed"]
    max_batch = validate.positive_int("max_batch", max_batch)
    max_len = validate.integer("max_len", max_len, k + 2)
    page_size = validate.positive_int("page_size", page_size)
    num_pages = max_batch * (max_len // page_size) if num_pages is None else num_pages
    check_paging(max_len, page_size, num_pages)
    self.target, self.proposer, self.grammar = target, proposer, grammar
    self.num_drafts, self.max_len, self.page_size, self.num_pages = k, max_len, page_size, num_pages
    # The device never stops a slot by count: the host cuts each request at its own max_new_tokens.
    self._cfg = _Settings(k, max_len, float(temperature), top_k, top_p, eos_token_id, None, max_len,
                          "per_position", None, page_size, num_pages, page_budget=budget_bucket(0, num_pages))
    self._s = _empty_state(target, proposer, grammar, max_batch, self._cfg, seed)
    self._slots: list[int | None] = [None] * max_batch
    self._waiting: collections.deque[int] = collections.deque()
    self._reserved = 0
    self._next_pages = None  # pages the next step needs, read with the last step's outputs
    self._ids = itertools.count()
    self.requests: dict[int, Request] = {}

  # -- requests --

  def add_request(self, prompt: Sequence[int], max_new_tokens: int, *, constrained: bool | None = None) -> int:
    """Queues a request; returns its id. Raises ValueError naming the argument and the limit.

    constrained: decode under the engine's grammar (default: whenever the engine has one);
      False decodes free of it, as `generate`'s constrained[i] = False.
    """
    v = self.target.cfg.vocab_size
    prompt = [validate.integer("prompt", x) for x in prompt]
    if not prompt:
      raise validate.InvalidValue("prompt", "prompt is empty; a request needs at least one token")
    bad = [x for x in prompt if not 0 <= x < v]
    if bad:
      raise validate.InvalidValue("prompt", f"prompt has token id(s) {bad[:5]} outside 0..vocab_size-1={v - 1}")
    max_new_tokens = validate.positive_int("max_new_tokens", max_new_tokens)
    constrained = self.grammar is not None if constrained is None else validate.flag("constrained", constrained)
    if constrained and self.grammar is None:
      raise validate.InvalidValue("constrained", "constrained=True needs a grammar: pass Engine(..., grammar=...)")
    need = len(prompt) + max_new_tokens + self.num_drafts + 1
    if need > self.max_len:
      raise validate.InvalidValue("prompt", f"request too long for the engine: len(prompt)={len(prompt)} + "
                                  f"max_new_tokens={max_new_tokens} + k + 1 = {need} > max_len={self.max_len}")
    rid = next(self._ids)
    self.requests[rid] = Request(rid, prompt, max_new_tokens, constrained, pages=-(-need // self.page_size),
                                 arrived_at=time.perf_counter())
    self._waiting.append(rid)
    return rid

  def cancel(self, request_id: int) -> None:
    """Drops a waiting request or stops a running one (its slot and pages are freed at once)."""
    req = self.requests.get(request_id)
    if req is None:
      raise KeyError(f"request_id={request_id!r} is not a request of this engine")
    if req.status == "waiting":
      self._waiting.remove(request_id)
    elif req.status == "running":
      self._release([req.slot])
    else:
      return
    req.status, req.finished_at = "cancelled", time.perf_counter()

  @property
  def num_running(self) -> int:
    return sum(r is not None for r in self._slots)

  @property
  def num_waiting(self) -> int:
    return len(self._waiting)

  def free_pages(self) -> int:
    """Free pages in the target's pool, read from the device (the proposer's pool moves alike)."""
    return int(self._s.target.pages.num_free)

  # -- the loop --

  def step(self) -> dict[int, list[int]]:
    """Admits, runs one speculative step, frees finished slots; returns the tokens each request gained."""
    self._admit_waiting()
    if not self.num_running:
      return {}
    self._rebudget(_step_rows(self._s, self._cfg), self._next_pages)
    self._s = _step_jit(self.target, self.proposer, self.grammar, self._s, self._cfg)
    return self._collect()

  def stream(self) -> Iterator[tuple[int, list[int]]]:
    """Steps until every request is done, yielding (request id, new tokens) as they come."""
    while self.num_running or self.num_waiting:
      for rid, new in self.step().items():
        if new:
          yield rid, new

  def run(self) -> dict[int, list[int]]:
    """Steps until every request is done; returns each request's tokens."""
    for _ in self.stream():
      pass
    return {rid: r.tokens for rid, r in self.requests.items()}

  def _admit_waiting(self) -> None:
    free = [i for i, r in enumerate(self._slots) if r is None]
    admitted = []
    while free and self._waiting:
      req = self.requests[self._waiting[0]]
      if self._reserved + req.pages > self.num_pages:
        break  # FIFO: the head waits for pages rather than being overtaken
      self._waiting.popleft()
      req.slot, req.status = free.pop(0), "running"
      self._slots[req.slot] = req.id
      self._reserved += req.pages
      admitted.append(req)
    if not admitted:
      return
    self._next_pages = None  # the prefill takes pages
    b = len(self._slots)
    t = -(-max(len(r.prompt) for r in admitted) // PROMPT_BUCKET) * PROMPT_BUCKET
    prompts_BxT = np.zeros((b, t), np.int32)
    lens_B = np.zeros((b,), np.int32)
    admit_B, constrained_B = np.zeros((b,), bool), np.zeros((b,), bool)
    for r in admitted:
      prompts_BxT[r.slot, :len(r.prompt)], lens_B[r.slot], admit_B[r.slot] = r.prompt, len(r.prompt), True
      constrained_B[r.slot] = r.constrained
    self._rebudget(lens_B)
    self._s = _admit(self.target, self.proposer, self.grammar, self._s, prompts_BxT, lens_B, admit_B, constrained_B,
                     self._cfg)

  def _rebudget(self, num_new_B, pages_needed: int | None = None) -> None:
    """Sets the page budget of the next call, which adds num_new_B rows (int32[B]) per slot: it
    follows the pages in flight up and down (one compile per budget, reused when it comes back).
    pages_needed: the pages that call needs when the host already has them (else read here)."""
    if pages_needed is None:
      pages_needed = int(_pages_needed(self._s, num_new_B))
    budget = budget_bucket(pages_needed, self.num_pages)
    if budget != self._cfg.page_budget:
      self._s, self._cfg = _with_budget(self._s, self._cfg, budget)

  def _collect(self) -> dict[int, list[int]]:
    s = self._s
    # The next step's page need comes in the same read: freeing slots only lowers it.
    num_out, out, done, oom, verify_calls, self._next_pages = jax.device_get(
        (s.num_out, s.out, s.done, _out_of_pages(s.target, s.proposer), s.verify_calls,
         _pages_needed(s, _step_rows(s, self._cfg))))
    self._next_pages = int(self._next_pages)
    now = time.perf_counter()
    gained, finished = {}, []
    for slot, rid in enumerate(self._slots):
      if rid is None:
        continue
      req = self.requests[rid]
      new = out[slot, len(req.tokens):min(num_out[slot], req.max_new_tokens)].tolist()
      req.tokens += new
      req.verify_calls = int(verify_calls[slot])
      gained[rid] = new
      if new and req.first_token_at is None:
        req.first_token_at = now
      if done[slot] or len(req.tokens) >= req.max_new_tokens:
        req.status, req.finished_at = ("out_of_pages" if oom[slot] else "finished"), now
        finished.append(slot)
    if finished:
      self._release(finished)
    return gained

  def _release(self, slots: list[int]) -> None:
    mask_B = np.zeros((len(self._slots),), bool)
    mask_B[slots] = True
    self._s = _free(self._s, mask_B)
    for slot in slots:
      self._reserved -= self.requests[self._slots[slot]].pages
      self.requests[self._slots[slot]].slot = None
      self._slots[slot] = None
