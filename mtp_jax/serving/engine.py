"""The continuous-batching Engine: requests come and go, a driver over `DecodeStep`.

The engine owns one `LoopState` of `max_batch` slots with paged caches. Each request brings its
own settings (temperature, top_k, top_p, seed, num_drafts, end tokens, grammar): they live in the
state as per-slot arrays (`SlotSettings`), so any mix runs one compiled step. `step()`:

1. admits waiting requests into free slots (FIFO, while the page pool can hold each one's
   worst case): one jitted `prefill` over the admitted slots only writes their prompt rows,
   emits their first token and drafts; running slots are neither computed nor touched;
2. runs the decode step `generate` itself runs, over the running slots only (`run_for` of a slot group,
   padded to a power of two; every slot when that is more than half of them); before each
   jitted call the host sets the page span (each slot's first pages, read as one dense block,
   see blocks/paged.py) from the pages the longest slot may hold, so reads follow the tokens in
   flight; a prefill reads its own slots' span;
3. reads the tokens each request gained and frees the slots (and pages) of finished ones at once.

Every jitted call donates the loop state, so the caches are updated in place. Host work per
step is one read (tokens, counters, the next page need, the waiting rows). Greedy output per request
equals `generate` run on that request alone: a slot's rows, pages and counters are its own, and
the step masks the rest. A sampled request's token at output position n is its draw keyed by
(its key, n): with Gumbel acceptance (the default) its tokens equal `generate` sampling it alone
with proposer None and the same seed, whatever num_drafts ("auto" included), tree, neighbours or
admission step; with acceptance="rejection" they follow its draft counts (their distribution
does not).

Speculation adapts (`num_drafts="auto"`, `DraftPolicy`): each call's width follows the running
count, the measured acceptance per position and the measured step time of each width; at a narrow
width (2k < K) only k modules run: the deeper ones' rows wait (`deferred_rows`) and catch up in one
call when a wider step needs them (its time charged to the width that waited). A slot capped at
c < K ("auto" admitted where c wins without the deeper modules: `DraftPolicy.cap`; a fixed
num_drafts=c) gets no rows of the deeper modules from its prefill on, and a call whose slots are
all capped at its width runs none of them (`deeper_idle`). A request that verifies no drafts
(num_drafts=0, "auto" admitted where drafts do not pay even alone: `DraftPolicy.admits_drafting`,
or stopped by `DraftPolicy.keeps_drafting`) gets no module rows; a call where no slot drafts runs
no module. Its parts: admission.py (queue, pages, chunked prefill), policy.py (width), grammars.py,
metrics.py, calibrate.py.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from mtp_jax import grammar as grammar_lib
from mtp_jax import validate
from mtp_jax.blocks.pages import PageRead, budget_bucket
from mtp_jax.mtp import MtpModel
from mtp_jax.serving import options
from mtp_jax.serving.grammars import GrammarUnion
from mtp_jax.serving.admission import Admission, prefill_groups, slot_group
from mtp_jax.serving.calibrate import calibrate
from mtp_jax.serving.metrics import Tally
from mtp_jax.serving.policy import DraftPolicy, programs_built
from mtp_jax.serving.requests import Request, check_eos, check_grammar, slot_settings
from mtp_jax.serving.generate import MIN_CAPACITY, padded_prompts
from mtp_jax.serving.options import EngineConfig, Paging, StepSettings
from mtp_jax.serving.step import DecodeStep, defers
from mtp_jax.serving.jit import (FlatModel, jit_free, jit_prefill, jit_prefill_part, jit_span_needed, run_for_lean,
                                 jit_stop_drafting)
from mtp_jax.target import TargetModel


class Engine:
  """Continuous batching: requests come and go; each slot is refilled as soon as it frees.

  `Engine(target, proposer, config)` or `Engine(target, proposer, **fields)`: target, proposer as
  for `generate` (proposer None decodes without drafts; their weights are read once, here); config
  an `EngineConfig` (see it for every field), fields overriding its values (`Engine(t, p, max_batch=4)`).
  """

  def __init__(self, target: TargetModel, proposer: MtpModel | None, config: EngineConfig | None = None,
               **fields):
    if config is not None:
      validate.instance("config", config, EngineConfig, "a mtp_jax.serving.EngineConfig")
    cfg = (config or EngineConfig()).replace(**fields)
    chain = cfg.tree is None and cfg.relaxed is None
    auto = proposer is not None and chain and (cfg.num_drafts is None or cfg.num_drafts == "auto")
    if cfg.num_drafts == "auto" and not auto:
      raise validate.InvalidValue("num_drafts", 'num_drafts="auto" needs a proposer and a chain, no relaxed acceptance')
    d = options.decoding(target, proposer, num_drafts=None if auto or cfg.num_drafts == 0 else cfg.num_drafts,
                         temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p, seed=cfg.seed,
                         eos_token_id=cfg.eos_token_id, relaxed=cfg.relaxed, tree=cfg.tree, grammar=cfg.grammar,
                         acceptance=cfg.acceptance)
    self.max_batch = validate.positive_int("max_batch", cfg.max_batch)
    max_waiting = validate.optional_int("max_waiting", cfg.max_waiting, 0)
    self.steps_per_call = validate.positive_int("steps_per_call", cfg.steps_per_call)
    prefill_chunk = None if cfg.prefill_chunk is None else validate.positive_int("prefill_chunk", cfg.prefill_chunk)
    max_len = validate.integer("max_len", cfg.max_len, d.rows_per_step + 1)
    page_size, num_pages = options.paging(max_len, cfg.page_size, cfg.num_pages, self.max_batch)
    self.config, self.target, self.proposer = cfg, target, proposer
    self._models = FlatModel.of(target), FlatModel.of(proposer)  # what the jitted calls take: flattened once
    self.max_drafts, self.defaults = d.num_drafts, d  # K: the most a step drafts
    self.num_drafts = "auto" if auto else (0 if cfg.num_drafts == 0 else d.num_drafts)  # the requests' default
    self.max_len, self.page_size, self.num_pages = max_len, page_size, num_pages
    if cfg.draft_policy is not None:
      validate.instance("draft_policy", cfg.draft_policy, DraftPolicy, "a mtp_jax.serving.DraftPolicy")
      if not auto or cfg.draft_policy.max_drafts != self.max_drafts:
        raise validate.InvalidValue("draft_policy", f'draft_policy serves num_drafts="auto" with a proposer of '
                                                    f"K={self.max_drafts} drafts, got max_drafts="
                                                    f"{cfg.draft_policy.max_drafts} (num_drafts={cfg.num_drafts!r})")
    self.policy = (cfg.draft_policy or DraftPolicy(self.max_drafts)) if auto else None
    self._base = DecodeStep(StepSettings(
        num_drafts=d.num_drafts, max_new_tokens=max_len, max_len=max_len, sampled=d.relaxed is None,
        acceptance=d.acceptance, relaxed=d.relaxed, tree=cfg.tree, mesh=cfg.mesh, paging=Paging(page_size, num_pages),
        deferred_rows=validate.integer("deferred_rows", cfg.deferred_rows, 0) if auto else 0))
    self._step = self._base  # the decode step: its verify width follows the load
    self._read = PageRead(span=max_len // page_size)  # how the next decode call reads its pages
    self.grammar = cfg.grammar
    self._grammar_eos = None if cfg.grammar is None else cfg.grammar.eos_token_id  # every grammar of the engine ends so
    self._grammars = GrammarUnion()
    self._s = self._base.init(target, proposer, None, self.max_batch)  # donated: its own buffer
    self._slots: list[int | None] = [None] * self.max_batch
    self._admission = Admission(num_pages, max_waiting, prefill_chunk)
    self._next_span = None  # the page span the next call needs, read with the last call's outputs
    # (most rows a slot keeps waiting, narrowest width they waited at), catch-ups run: read with them too
    self._waiting, self._catch_ups = (0, 0), 0
    self._ids = itertools.count()
    self.requests: dict[int, Request] = {}  # every request's record until `forget` drops an ended one
    self.tally = Tally(self.max_drafts)  # metrics() counters, kept as requests end
    # The device's cumulative per-position counters as last read: each read adds the difference.
    self._read_at = np.zeros((2, self.max_drafts), np.int64)

  @property
  def page_span(self) -> int:
    """Pages per slot the last decode call read (the most a slot held: follows the rows in flight)."""
    return self._read.span

  def add_request(self, prompt: Sequence[int], max_new_tokens: int, *, temperature: float | None = None,
                  top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
                  num_drafts: int | str | None = None, eos_token_ids: Sequence[int] | None = None,
                  grammar: grammar_lib.Grammar | None = None, constrained: bool | None = None,
                  deadline_s: float | None = None) -> int:
    """Queues a request; returns its id. Raises ValueError / TypeError naming the argument and the
    limit, and `QueueFull` when max_waiting requests are already waiting.

    temperature, top_k, top_p, seed, num_drafts (0..K or "auto"; a tree engine: the depth it
      accepts, 0..depth), eos_token_ids (at most EOS_PER_SLOT ids): this request's settings; None
      takes the engine's. A relaxed engine's requests are greedy.
    grammar: a `mtp_jax.grammar.Grammar` for this request (default: the engine's); the grammars of
      one engine share their eos_token_id, which ends the request. constrained: False decodes free
      of any grammar, True insists on one.
    deadline_s: seconds from now after which the request is stopped, waiting or running
      (status "timed_out", its slot and pages freed; the tokens so far are kept).
    """
    v = self.target.cfg.vocab_size
    prompt = options.check_prompt("prompt", prompt, v).tolist()
    max_new_tokens = validate.positive_int("max_new_tokens", max_new_tokens)
    deadline_s = None if deadline_s is None else validate.real("deadline_s", deadline_s, 0.0, lo_open=True)
    d = self.defaults.sampling
    temperature, top_k, top_p = validate.sampling(d.temperature if temperature is None else temperature,
                                                  d.top_k if top_k is None else top_k,
                                                  d.top_p if top_p is None else top_p)
    if temperature > 0 and self.defaults.relaxed is not None:
      raise validate.InvalidValue("temperature", f"a relaxed engine's requests are greedy (relaxed acceptance is "
                                                 f"lossy and greedy only), got temperature={temperature}")
    seed = None if seed is None else validate.integer("seed", seed, 0, 2**32 - 1)
    num_drafts = self._check_num_drafts(self.num_drafts if num_drafts is None else num_drafts)
    grammar = check_grammar(grammar, constrained, self.grammar, v, self._grammar_eos)
    default_eos = () if self.defaults.eos_token_id is None else (self.defaults.eos_token_id,)
    eos = check_eos(eos_token_ids, grammar, default_eos, v)
    need = len(prompt) + max_new_tokens + self.defaults.rows_per_step
    if need > self.max_len:
      what = "K + 1" if self.defaults.tree is None else "the tree nodes + 1"
      raise validate.InvalidValue("prompt", f"request too long for the engine: len(prompt)={len(prompt)} + "
                                  f"max_new_tokens={max_new_tokens} + {what} = {need} > max_len={self.max_len}")
    rid = next(self._ids)
    self._admission.queue(rid)  # QueueFull before anything is recorded
    if grammar is not None:
      self._grammar_eos = grammar.eos_token_id
    self.requests[rid] = Request(rid, prompt, max_new_tokens, grammar, temperature, top_k, top_p, seed, num_drafts,
                                 eos, pages=-(-need // self.page_size), deadline_s=deadline_s,
                                 arrived_at=time.perf_counter())
    return rid

  def _check_num_drafts(self, num_drafts) -> int | str:
    if num_drafts == "auto":
      if self.policy is None:
        raise validate.InvalidValue("num_drafts", 'num_drafts="auto" needs an engine with a proposer and a chain '
                                                  "without relaxed acceptance")
      return num_drafts
    return validate.integer("num_drafts", num_drafts, 0, self.max_drafts)

  def cancel(self, request_id: int) -> None:
    """Drops a waiting request or stops a running one (its slot and pages are freed at once)."""
    self._stop(request_id, "cancelled")

  def _stop(self, request_id: int, status: str) -> None:
    req = self.requests.get(request_id)
    if req is None:
      raise KeyError(f"request_id={request_id!r} is not a request of this engine")
    if req.status == "waiting":
      self._admission.drop(request_id)
    elif req.status == "running":
      self._release([req.slot])
    else:
      return
    self._end_request(req, status, time.perf_counter())

  def _end_request(self, req: Request, status: str, now: float) -> None:
    req.status, req.finished_at = status, now
    self.tally.request_ended(status, req.drafts_verified, req.drafts_accepted)

  def forget(self, request_id: int) -> Request:
    """Removes an ended request's record from `requests` and returns it, so a long-running engine
    (a server) keeps only live records; `metrics()` counts it still. Raises KeyError for an unknown
    id, ValueError for a request still waiting or running."""
    req = self.requests.get(request_id)
    if req is None:
      raise KeyError(f"request_id={request_id!r} is not a request of this engine")
    if req.status in ("waiting", "running"):
      raise validate.InvalidValue("request_id", f"request {request_id} is still {req.status}: cancel it first")
    return self.requests.pop(request_id)

  num_running = property(lambda self: sum(r is not None for r in self._slots))
  num_waiting = property(lambda self: len(self._admission.waiting))

  def free_pages(self) -> int:
    """Free pages in the target's pool, read from the device (the proposer's pool moves alike)."""
    return int(self._s.target.pages.num_free)

  def metrics(self) -> dict:
    """Counters, gauges and latency quantiles (names and meanings: serving.metrics.DESCRIPTIONS);
    `serving.prometheus_text` renders them. Reads the free page count from the device."""
    caches = (self._s.target.kv, None if self._s.proposer is None else self._s.proposer.kv)
    return dict(requests_running=self.num_running, requests_waiting=self.num_waiting,
                requests_recorded=len(self.requests), verify_width=self._step.settings.verify_width,
                pages_in_use=self.num_pages - self.free_pages(), pages_total=self.num_pages,
                cache_bytes=sum(x.nbytes for x in jax.tree_util.tree_leaves(caches)), **self.tally.as_metrics())

  def step(self) -> dict[int, list[int]]:
    """Admits, runs up to steps_per_call speculative steps on device (one when a waiting request
    could take a free slot; they end early when a request finishes), frees finished slots;
    returns the tokens each request gained."""
    t0 = time.perf_counter()
    self._expire(t0)
    self._admit_waiting()
    if not self.num_running:
      return {}
    n = 1 if self.num_waiting and None in self._slots else self.steps_per_call
    self._set_width()
    self._respan(self._step.rows_next(self._s) * self.steps_per_call, self._next_span)
    step, running, traces, t1 = self._step, self.num_running, programs_built(), time.perf_counter()
    decoding = [slot for slot, rid in enumerate(self._slots) if rid is not None and not self._admission.in_parts(rid)]
    idx_A = slot_group(decoding, [r is not None for r in self._slots], step.settings.mesh is None)
    self._s = run_for_lean(step, *self._models, self._grammars.union, self._s, np.int32(n),
                           None if len(idx_A) == len(self._slots) else idx_A, self._read)
    (rows, narrowest), catch_ups = self._waiting, self._catch_ups
    gained, steps = self._collect()
    now, k = time.perf_counter(), step.settings.verify_width
    if self.policy is not None and steps and programs_built() == traces:  # else it built a program
      of = None if self._catch_ups == catch_ups else min(k, narrowest) if rows else k  # whose rows caught up
      self.policy.record(k, running, now - t1, steps, of, capped=step.settings.deeper_idle)
    self.tally.called(k, now - t0)
    return gained

  def calibrate(self, *, calls: int = 3, prompt_len: int = 16) -> DraftPolicy:
    """Measures num_drafts="auto"'s step-time cost model before traffic (`serving.calibrate.calibrate`
    says how) on this idle "auto" engine; returns its `DraftPolicy` (pass it to another engine on
    the same models and machine with `draft_policy=`)."""
    return calibrate(self, calls=calls, prompt_len=prompt_len)

  def _set_width(self) -> None:
    """Sets the drafts the next call verifies: the most any running request asks for, "auto" ones
    as the `DraftPolicy` says (a tree engine verifies its whole tree, capped per request); first,
    when no drafting request's drafts pay any more (`DraftPolicy.keeps_drafting`), they stop."""
    if self.defaults.tree is not None:
      return
    running = [self.requests[rid] for rid in self._slots if rid is not None]
    # All or none: a step computes every slot's draft rows, so one stopping alone saves nothing
    # (`all` stops at the first that still pays: one policy look per step, not one per request).
    drafting = [r for r in running if r.drafting and r.num_drafts != 0]
    if drafting and all(r.num_drafts == "auto" and not self.policy.keeps_drafting(r.drafts_accepted, r.drafts_verified)
                        for r in drafting):
      self._s = jit_stop_drafting(self._base, self._s, np.isin(np.arange(self.max_batch), [r.slot for r in drafting]))
      for r in drafting:
        r.drafting = False
      self.policy.probes_failed += any(r.probe for r in drafting)
    caps = [r.draft_cap(self.max_drafts) for r in running]  # K for "auto" ones drafting uncapped
    # Fixed requests and "auto" ones capped at admission (`DraftPolicy.cap`) ask for their own width.
    k = max((c for c, r in zip(caps, running) if r.num_drafts != "auto" or r.cap < self.max_drafts), default=0)
    if any(r.num_drafts == "auto" and r.drafting and r.cap == self.max_drafts for r in running):
      # A request that does not draft adds its one token a step whatever the width.
      scales = [self.policy.request_scale(r.drafts_accepted, r.drafts_verified) if r.drafting else 0.0
                for r in running]
      probing = any(r.probe and r.drafting and self.policy.measuring(r.drafts_verified) for r in running)
      k = max(k, self.policy.choose(len(running), scales, probing))
    # No running request drafts: the proposer's state passes through (its upkeep cost 7% at 8 slots).
    idle = self.proposer is not None and not any(r.num_drafts != 0 and r.drafting for r in running)
    # Whether a slot may have to catch up in the call (`StepSettings.may_catch_up`), from the last read.
    (rows, narrowest), deferring = self._waiting, defers(k, self.max_drafts)
    check = rows > 0 and (not deferring or narrowest < k) or (
        deferring and rows + self.steps_per_call * (k + 1) > self._base.settings.deferred_rows)
    # Every running request capped at k or under, none with rows waiting: the deeper modules idle.
    deeper = 0 < k < self.max_drafts and not rows and max(caps) <= k
    st = self._step.settings
    if (k, idle, check, deeper) != (st.verify_width, st.modules_idle, st.may_catch_up, st.deeper_idle):
      self._step = self._step.replace(verify_drafts=None if k == self.max_drafts else k, modules_idle=idle,
                                      may_catch_up=check, deeper_idle=deeper)
      self._next_span = None  # read for the old width's rows

  def _expire(self, now: float) -> None:
    # Only live requests: the finished ones stay in `requests` and would make every step O(all ever).
    live = [*self._admission.waiting, *(rid for rid in self._slots if rid is not None)]
    for rid in [rid for rid in live if (r := self.requests[rid]).deadline_s is not None and
                now - r.arrived_at > r.deadline_s]:
      self._stop(rid, "timed_out")

  def stream(self) -> Iterator[tuple[int, list[int]]]:
    """Steps until every request is done, yielding (request id, new tokens) as they come."""
    while self.num_running or self.num_waiting:
      yield from ((rid, new) for rid, new in self.step().items() if new)

  def run(self) -> dict[int, list[int]]:
    """Steps until every request is done; returns each request's tokens."""
    for _ in self.stream():
      pass
    return {rid: r.tokens for rid, r in self.requests.items()}

  def _admit_waiting(self) -> None:
    admitted, whole, part = self._admission.admit([i for i, r in enumerate(self._slots) if r is None],
                                                  self.requests)
    for req in admitted:
      self._slots[req.slot] = req.id
    for req in admitted:
      if req.num_drafts == "auto":  # (the policy answers the admission, then says whether it was a probe)
        req.drafting, req.probe = self.policy.admits_drafting(), self.policy.probe_admitted
        req.cap = self.policy.cap(self.num_running) if req.drafting and not req.probe else self.max_drafts
    if part is not None:
      self._prefill_part(part)
    occupied = [r is not None for r in self._slots]
    for group in prefill_groups([r.slot for r in whole], occupied, self._step.settings.mesh is None) if whole else ():
      self._prefill([r for r in whole if r.slot in group], group)

  def _prefill_part(self, req: Request) -> None:
    """Writes the next prefill_chunk tokens of req's prompt into its slot (not its last part)."""
    self._next_span = None  # the part takes pages
    c, done = self._admission.prefill_chunk, req.prefilled
    prompt_1xT, len_1 = padded_prompts([req.prompt[done:done + c]], 1, [0])
    next_1xT, _ = padded_prompts([req.prompt[done + 1:done + c + 1]], 1, [0])
    slot_1 = np.asarray([req.slot], np.int32)
    drafting_1 = np.asarray([req.drafting and req.num_drafts != 0], bool)
    self._s = jit_prefill_part(self._base, *self._models, self._grammars.union, self._s, slot_1,
                               prompt_1xT, len_1, next_1xT, self._read_for(slot_1, len_1), drafting_1)
    req.prefilled += c

  def _prefill(self, admitted: list[Request], idx_A: np.ndarray) -> None:
    """Prefills the (rest of the) prompts of admitted requests and starts their decoding, in one
    call over the slots idx_A (int32[A]: theirs first, in order, then free ones)."""
    self._next_span = None  # the prefill takes pages
    self._use_grammars([r.grammar for r in admitted if r.grammar is not None])
    n, a = len(admitted), len(idx_A)
    prompts_AxT, lens_A = padded_prompts([r.prompt[r.prefilled:] for r in admitted], a, range(n))
    admit_A, max_new_A = np.arange(a) < n, np.zeros((a,), np.int32)
    gstart_A = np.full((a,), grammar_lib.FREE, np.int32)
    for i, r in enumerate(admitted):
      max_new_A[i] = r.max_new_tokens
      if r.grammar is not None:
        gstart_A[i] = self._grammars.start(r.grammar)
    slots = slot_settings(admitted, a, vocab_size=self.target.cfg.vocab_size, max_drafts=self.max_drafts,
                          seed=self.defaults.seed)
    # Requests capped below K need none of the deeper modules' prompt rows; with none drafting, the
    # modules get no rows, so the call needs no proposer (its state passes through).
    widest = max(r.draft_cap(self.max_drafts) for r in admitted)
    step = self._base if widest in (0, self.max_drafts) else self._base.replace(verify_drafts=widest)
    self._s = jit_prefill(step, self._models[0], self._models[1] if widest else None, self._grammars.union,
                          self._s, prompts_AxT, lens_A, admit_A, gstart_A, max_new_A, slots, idx_A,
                          self._read_for(idx_A, lens_A))

  def _read_for(self, idx_A, num_new_A) -> PageRead:
    """How a call adding num_new_A rows to the slots idx_A reads its pages: their pages only, the
    span of the longest (a prefill reads its prompts' pages, not a running request's)."""
    need = int(jit_span_needed(self._base, self._s, np.asarray(num_new_A, np.int32), idx_A))
    return PageRead(span=budget_bucket(need, self.max_len // self.page_size, minimum=2))

  def _use_grammars(self, needed: list[grammar_lib.Grammar]) -> None:
    """Makes the device grammar hold `needed` (the running requests' grammars are kept)."""
    if self._grammars.holds(needed):
      return
    running = [self.requests[rid].grammar for rid in self._slots if rid is not None]
    gstate_B = self._s.grammar_state
    if gstate_B is None:
      gstate_B = jnp.full(self._s.last.shape, grammar_lib.FREE, jnp.int32)
    self._s = self._s.set(grammar_state=self._grammars.use(needed, running, gstate_B))

  def _respan(self, num_new_B, span_needed: int | None = None) -> None:
    """Sets the page span of the next decode call, which adds at most num_new_B rows (int32[B]) per
    slot: it follows the longest slot's pages up and down (one compile per span, reused when it
    comes back). span_needed: that call's need when the host already has it (else read here)."""
    if span_needed is None:
      span_needed = int(jit_span_needed(self._base, self._s, num_new_B))
    # At least MIN_CAPACITY rows, as generate's caches start: short requests share one compile,
    # and a request does not meet a new span (a compile, seconds) every few pages it grows.
    first = 1 << max(1, (-(-MIN_CAPACITY // self.page_size) - 1).bit_length())
    self._read = PageRead(span=budget_bucket(span_needed, self.max_len // self.page_size, minimum=first))

  def _collect(self) -> tuple[dict[int, list[int]], int]:
    """(the tokens each running request gained, decode steps the last call ran)."""
    s = self._s
    # The next step's page need comes in the same read: freeing slots only lowers it.
    num_out, out, done, oom, verify_calls, verified, accepted, read_at, self._next_span, waiting = jax.device_get(
        (s.num_out, s.out, s.done, s.out_of_pages, s.counts.verify_calls, s.counts.drafts_verified, s.counts.accepted,
         jnp.stack([s.counts.accepted_at, s.counts.proposed_at]),
         jit_span_needed(self._base, s, self._step.rows_next(s) * self.steps_per_call),
         None if s.deferred is None else (s.deferred.n, s.deferred.width, s.deferred.catch_ups)))
    n, w, c = waiting or (np.zeros(1, np.int32),) * 3
    self._next_span, self._catch_ups = int(self._next_span), int(c.max())
    self._waiting = (int(n.max()), int(min(w[n > 0], default=0)))
    new_accepted_at, new_proposed_at = read_at.astype(np.int64) - self._read_at
    self._read_at = read_at.astype(np.int64)
    self.tally.accepted_at += new_accepted_at
    self.tally.proposed_at += new_proposed_at
    if self.policy is not None:
      self.policy.observe(new_accepted_at, new_proposed_at)
    now = time.perf_counter()
    gained, finished, steps = {}, [], 0
    for slot, rid in enumerate(self._slots):
      if rid is None or self._admission.in_parts(rid):  # a prompt still written in parts: not decoding yet
        continue
      req = self.requests[rid]
      new = out[slot, len(req.tokens):min(num_out[slot], req.max_new_tokens)].tolist()
      req.tokens += new
      steps = max(steps, int(verify_calls[slot]) - req.verify_calls)
      self.tally.verify_steps += int(verify_calls[slot]) - req.verify_calls
      req.verify_calls = int(verify_calls[slot])
      req.drafts_verified, req.drafts_accepted = int(verified[slot]), int(accepted[slot])
      gained[rid] = new
      if new:
        self.tally.tokens_arrived(len(new), now, req.arrived_at, req.last_token_at)
        req.first_token_at = req.first_token_at or now
        req.last_token_at = now
      if done[slot] or len(req.tokens) >= req.max_new_tokens:
        self._end_request(req, "out_of_pages" if oom[slot] else "finished", now)
        finished.append(slot)
    if finished:
      self._release(finished)
    return gained, steps

  def _release(self, slots: list[int]) -> None:
    mask_B = np.zeros((len(self._slots),), bool)
    mask_B[slots] = True
    self._s = jit_free(self._base, self._s, mask_B)
    for slot in slots:
      self._admission.release(req := self.requests[self._slots[slot]])
      req.slot, self._slots[slot] = None, None
