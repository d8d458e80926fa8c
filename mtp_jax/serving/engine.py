"""The continuous-batching Engine: requests come and go, a driver over `DecodeStep`.

The engine owns one `LoopState` of `max_batch` slots with paged caches. `step()`:

1. admits waiting requests into free slots (FIFO, while the page pool can hold each one's
   worst case): one jitted `prefill` over the admitted slots writes their prompt rows, emits
   their first token and drafts; running slots pass through untouched;
2. runs the decode step `generate` itself runs, once over all slots; before each jitted call
   the host sets the page budget (the pages attention reads, see blocks/paged.py) from the
   pages the call may hold, so reads follow the tokens in flight;
3. reads the tokens each request gained and frees the slots (and pages) of finished ones at once.

Every jitted call donates the loop state, so the caches are updated in place. Host work per
step is one read (tokens, counters and the next step's page need). Greedy output per request
equals `generate` run on that request alone: a slot's rows, pages and counters are its own, and
the step masks the rest.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import time
from collections.abc import Iterator, Sequence

import jax
import numpy as np

from mtp_jax import grammar as grammar_lib
from mtp_jax import validate
from mtp_jax.blocks.paged import budget_bucket
from mtp_jax.mtp import MtpModel
from mtp_jax.serving import options
from mtp_jax.serving.metrics import Samples
from mtp_jax.serving.generate import padded_prompts
from mtp_jax.serving.options import Paging, StepSettings
from mtp_jax.serving.step import DecodeStep, jit_free, jit_pages_needed, jit_prefill, jit_run_for
from mtp_jax.target import TargetModel
from mtp_jax.tree import TreeSpec


class QueueFull(RuntimeError):
  """add_request on an engine whose waiting queue holds max_waiting requests (a server answers 429 / 503)."""


@dataclasses.dataclass
class Request:
  """One request's host-side record.

  status: "waiting", "running", "finished", "cancelled", "timed_out" (past its deadline_s) or
  "out_of_pages" (stopped by the device allocator; admission reserves pages, so only an engine
  built too small sees it).
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
  deadline_s: float | None = None
  arrived_at: float = 0.0
  last_token_at: float | None = None
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



class Engine:
  """Continuous batching: requests come and go; each slot is refilled as soon as it frees.

  Args:
    target, proposer: as for `generate` (proposer None decodes without drafts).
    max_batch: slots decoded together.
    max_len: rows per sequence: a request needs len(prompt) + max_new_tokens + R <= max_len, R
      the rows of a step (k + 1, or a tree's nodes + 1).
    page_size, num_pages: the paged caches (page_size must divide max_len; num_pages per layer,
      default max_batch * max_len / page_size, at least max_len / page_size).
    num_drafts, temperature, top_k, top_p, eos_token_id, seed, relaxed, tree: as for
      `generate`, shared by all requests (they are static settings of the jitted step). Greedy
      output per request equals `generate` on that request alone; sampling draws from the
      engine's one key stream.
    grammar: a `mtp_jax.grammar.Grammar` for the requests added with constrained=True (by
      default all of them, as `generate`'s constrained); needs eos_token_id equal to its own.
    mesh: a `mtp_jax.sharding.make_mesh` mesh for the slots' states (shard the params with
      `shard_params`).
    max_waiting: requests the queue may hold (default unbounded); `add_request` on a full queue
      raises `QueueFull`, so an overloaded engine refuses work instead of growing without bound.
    steps_per_call: decode steps one `step()` runs on device before the host reads the tokens
      (fewer when a request finishes, or one when a waiting request could take a free slot).
  """

  def __init__(self, target: TargetModel, proposer: MtpModel | None, *, max_batch: int = 8,
               max_len: int = 512, page_size: int = 16, num_pages: int | None = None,
               num_drafts: int | None = None, temperature: float = 0.0, top_k: int | None = None,
               top_p: float | None = None, eos_token_id: int | None = None, seed: int = 0,
               grammar: grammar_lib.Grammar | None = None, relaxed: tuple[int, float] | None = None,
               tree: TreeSpec | None = None, mesh: jax.sharding.Mesh | None = None,
               max_waiting: int | None = None, steps_per_call: int = 4):
    d = options.decoding(target, proposer, num_drafts=num_drafts, temperature=temperature, top_k=top_k,
                         top_p=top_p, seed=seed, eos_token_id=eos_token_id, relaxed=relaxed, tree=tree,
                         grammar=grammar)
    max_batch = validate.positive_int("max_batch", max_batch)
    self.max_waiting = validate.optional_int("max_waiting", max_waiting, 0)
    self.steps_per_call = validate.positive_int("steps_per_call", steps_per_call)
    max_len = validate.integer("max_len", max_len, d.rows_per_step + 1)
    page_size, num_pages = options.paging(max_len, page_size, num_pages, max_batch)
    self.target, self.proposer, self.grammar = target, proposer, grammar
    self.num_drafts, self.max_len, self.page_size, self.num_pages = d.num_drafts, max_len, page_size, num_pages
    self._step = DecodeStep(StepSettings(
        num_drafts=d.num_drafts, max_new_tokens=max_len, max_len=max_len, sampling=d.sampling,
        eos_token_id=d.eos_token_id, relaxed=d.relaxed, tree=tree, mesh=mesh,
        paging=Paging(page_size, num_pages, budget_bucket(0, num_pages))))
    self._s = self._step.init(target, proposer, grammar, max_batch, jax.random.key(d.seed))
    self._slots: list[int | None] = [None] * max_batch
    self._waiting: collections.deque[int] = collections.deque()
    self._reserved = 0
    self._next_pages = None  # pages the next step needs, read with the last step's outputs
    self._ids = itertools.count()
    self.requests: dict[int, Request] = {}
    self._ttft, self._itl = Samples(), Samples()
    self._steps, self._step_seconds, self._verify_steps = 0, 0.0, 0
    self._accepted_at = np.zeros((self.num_drafts,), np.int64)

  @property
  def page_budget(self) -> int:
    """The pages attention reads in the next call (follows the pages in flight)."""
    return self._step.settings.paging.budget

  # -- requests --

  def add_request(self, prompt: Sequence[int], max_new_tokens: int, *, constrained: bool | None = None,
                  deadline_s: float | None = None) -> int:
    """Queues a request; returns its id. Raises ValueError naming the argument and the limit, and
    `QueueFull` when max_waiting requests are already waiting.

    constrained: decode under the engine's grammar (default: whenever the engine has one);
      False decodes free of it, as `generate`'s constrained[i] = False.
    deadline_s: seconds from now after which the request is stopped, waiting or running
      (status "timed_out", its slot and pages freed; the tokens so far are kept).
    """
    prompt = options.check_prompt("prompt", prompt, self.target.cfg.vocab_size).tolist()
    max_new_tokens = validate.positive_int("max_new_tokens", max_new_tokens)
    constrained = self.grammar is not None if constrained is None else validate.flag("constrained", constrained)
    deadline_s = None if deadline_s is None else validate.real("deadline_s", deadline_s, 0.0, lo_open=True)
    if constrained and self.grammar is None:
      raise validate.InvalidValue("constrained", "constrained=True needs a grammar: pass Engine(..., grammar=...)")
    need = len(prompt) + max_new_tokens + self._step.settings.rows_per_step
    if need > self.max_len:
      what = "k + 1" if self._step.settings.tree is None else "the tree nodes + 1"
      raise validate.InvalidValue("prompt", f"request too long for the engine: len(prompt)={len(prompt)} + "
                                  f"max_new_tokens={max_new_tokens} + {what} = {need} > max_len={self.max_len}")
    if self.max_waiting is not None and len(self._waiting) >= self.max_waiting:
      raise QueueFull(f"the engine's waiting queue is full (max_waiting={self.max_waiting}); retry later")
    rid = next(self._ids)
    self.requests[rid] = Request(rid, prompt, max_new_tokens, constrained, pages=-(-need // self.page_size),
                                 deadline_s=deadline_s, arrived_at=time.perf_counter())
    self._waiting.append(rid)
    return rid

  def cancel(self, request_id: int) -> None:
    """Drops a waiting request or stops a running one (its slot and pages are freed at once)."""
    self._stop(request_id, "cancelled")

  def _stop(self, request_id: int, status: str) -> None:
    req = self.requests.get(request_id)
    if req is None:
      raise KeyError(f"request_id={request_id!r} is not a request of this engine")
    if req.status == "waiting":
      self._waiting.remove(request_id)
    elif req.status == "running":
      self._release([req.slot])
    else:
      return
    req.status, req.finished_at = status, time.perf_counter()

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

  def metrics(self) -> dict:
    """Counters, gauges and latency quantiles (names and meanings: serving.metrics.DESCRIPTIONS);
    `serving.prometheus_text` renders them. Reads the free page count from the device."""
    status = collections.Counter(r.status for r in self.requests.values())
    tokens = sum(len(r.tokens) for r in self.requests.values())
    accepted = int(self._accepted_at.sum())
    caches = (self._s.target.kv, None if self._s.proposer is None else self._s.proposer.kv)
    return dict(
        requests_running=self.num_running, requests_waiting=self.num_waiting,
        requests_finished_total=status["finished"], requests_cancelled_total=status["cancelled"] + status["timed_out"],
        requests_out_of_pages_total=status["out_of_pages"], tokens_generated_total=tokens,
        verify_steps_total=self._verify_steps, drafts_proposed_total=self._verify_steps * self.num_drafts,
        drafts_accepted_total=accepted, drafts_accepted_at=self._accepted_at.tolist(),
        mean_accepted_length=(accepted / self._verify_steps + 1) if self._verify_steps else float("nan"),
        pages_in_use=self.num_pages - self.free_pages(), pages_total=self.num_pages,
        cache_bytes=sum(x.nbytes for x in jax.tree_util.tree_leaves(caches)),
        steps_total=self._steps,
        step_seconds_mean=self._step_seconds / self._steps if self._steps else float("nan"),
        **self._ttft.quantiles("ttft_seconds"), **self._itl.quantiles("itl_seconds"))

  def step(self) -> dict[int, list[int]]:
    """Admits, runs up to steps_per_call speculative steps on device (one when a waiting request
    could take a free slot; they end early when a request finishes), frees finished slots;
    returns the tokens each request gained."""
    t0 = time.perf_counter()
    self._expire(t0)
    self._admit_waiting()
    if not self.num_running:
      return {}
    n = 1 if self._waiting and None in self._slots else self.steps_per_call
    self._rebudget(self._step.rows_next(self._s) * self.steps_per_call, self._next_pages)
    self._s = jit_run_for(self._step, self.target, self.proposer, self.grammar, self._s, np.int32(n))
    gained = self._collect()
    self._steps += 1
    self._step_seconds += time.perf_counter() - t0
    return gained

  def _expire(self, now: float) -> None:
    # Only live requests: the finished ones stay in `requests` and would make every step O(all ever).
    live = [*self._waiting, *(rid for rid in self._slots if rid is not None)]
    late = [rid for rid in live if (r := self.requests[rid]).deadline_s is not None and
            now - r.arrived_at > r.deadline_s]
    for rid in late:
      self._stop(rid, "timed_out")

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
    prompts_BxT, lens_B = padded_prompts([r.prompt for r in admitted], b, [r.slot for r in admitted])
    admit_B, constrained_B, max_new_B = np.zeros((b,), bool), np.zeros((b,), bool), np.zeros((b,), np.int32)
    for r in admitted:
      admit_B[r.slot], constrained_B[r.slot], max_new_B[r.slot] = True, r.constrained, r.max_new_tokens
    self._rebudget(lens_B)
    self._s = jit_prefill(self._step, self.target, self.proposer, self.grammar, self._s, prompts_BxT, lens_B, admit_B,
                          constrained_B, max_new_B)

  def _rebudget(self, num_new_B, pages_needed: int | None = None) -> None:
    """Sets the page budget of the next call, which adds at most num_new_B rows (int32[B]) per slot: it
    follows the pages in flight up and down (one compile per budget, reused when it comes back).
    pages_needed: the pages that call needs when the host already has them (else read here)."""
    if pages_needed is None:
      pages_needed = int(jit_pages_needed(self._step, self._s, num_new_B))
    budget = budget_bucket(pages_needed, self.num_pages)
    if budget != self.page_budget:
      self._step = DecodeStep(self._step.settings.with_budget(budget))
      self._s = self._step.placed(self._s)

  def _collect(self) -> dict[int, list[int]]:
    s = self._s
    # The next step's page need comes in the same read: freeing slots only lowers it.
    num_out, out, done, oom, verify_calls, accepted_at, self._next_pages = jax.device_get(
        (s.num_out, s.out, s.done, s.out_of_pages, s.verify_calls, s.accepted_at,
         jit_pages_needed(self._step, s, self._step.rows_next(s) * self.steps_per_call)))
    self._next_pages = int(self._next_pages)
    self._accepted_at = accepted_at.astype(np.int64)
    now = time.perf_counter()
    gained, finished = {}, []
    for slot, rid in enumerate(self._slots):
      if rid is None:
        continue
      req = self.requests[rid]
      new = out[slot, len(req.tokens):min(num_out[slot], req.max_new_tokens)].tolist()
      req.tokens += new
      self._verify_steps += int(verify_calls[slot]) - req.verify_calls
      req.verify_calls = int(verify_calls[slot])
      gained[rid] = new
      if new:
        if req.first_token_at is None:  # the tokens arriving with the first one come without a gap
          req.first_token_at = now
          self._ttft.add(now - req.arrived_at)
          self._itl.add(0.0, len(new) - 1)
        else:
          self._itl.add((now - req.last_token_at) / len(new), len(new))
        req.last_token_at = now
      if done[slot] or len(req.tokens) >= req.max_new_tokens:
        req.status, req.finished_at = ("out_of_pages" if oom[slot] else "finished"), now
        finished.append(slot)
    if finished:
      self._release(finished)
    return gained

  def _release(self, slots: list[int]) -> None:
    mask_B = np.zeros((len(self._slots),), bool)
    mask_B[slots] = True
    self._s = jit_free(self._step, self._s, mask_B)
    for slot in slots:
      self._reserved -= self.requests[self._slots[slot]].pages
      self.requests[self._slots[slot]].slot = None
      self._slots[slot] = None
