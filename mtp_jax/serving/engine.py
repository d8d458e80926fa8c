"""The continuous-batching Engine: requests come and go, a driver over `DecodeStep`.

The engine owns one `LoopState` of `max_batch` slots with paged caches. Each request brings its
own settings (temperature, top_k, top_p, seed, num_drafts, end tokens, grammar): they live in the
state as per-slot arrays (`SlotSettings`), so any mix runs one compiled step. `step()`:

1. admits waiting requests into free slots (FIFO, while the page pool can hold each one's
   worst case): one jitted `prefill_slots` over the admitted slots only writes their prompt rows,
   emits their first token and drafts; running slots are neither computed nor touched;
2. runs the decode step `generate` itself runs, over the running slots only (`run_for_slots`,
   padded to a power of two; every slot when that is more than half of them); before each
   jitted call the host sets the page span (each slot's first pages, read as one dense block,
   see blocks/paged.py) from the pages the longest slot may hold, so reads follow the tokens in
   flight; a prefill reads its own slots' span;
3. reads the tokens each request gained and frees the slots (and pages) of finished ones at once.

Every jitted call donates the loop state, so the caches are updated in place. Host work per
step is one read (tokens, counters and the next step's page need). Greedy output per request
equals `generate` run on that request alone: a slot's rows, pages and counters are its own, and
the step masks the rest. A sampled request's token at output position n is its draw keyed by
(its key, n): with Gumbel acceptance (the default) its tokens equal `generate` sampling it alone
with proposer None and the same seed, whatever num_drafts ("auto" included), tree, neighbours or
admission step; with acceptance="rejection" they follow its draft counts (their distribution
does not).

Speculation adapts (`num_drafts="auto"`, `DraftPolicy`): before each call the engine picks how
many drafts the target verifies from the running requests' count, the measured acceptance per
draft position and the measured time of a step at each width; the proposer always drafts K, so
any width may follow any other.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import time
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from mtp_jax import grammar as grammar_lib
from mtp_jax import validate
from mtp_jax.blocks.paged import budget_bucket
from mtp_jax.mtp import MtpModel
from mtp_jax.serving import options
from mtp_jax.serving.metrics import Samples
from mtp_jax.serving.generate import MIN_CAPACITY, padded_prompts
from mtp_jax.serving.options import Paging, StepSettings
from mtp_jax.sampling import RowSampling, row_key
from mtp_jax.serving.state import EOS_PER_SLOT, SlotSettings
from mtp_jax.serving.step import (DecodeStep, jit_free, jit_prefill_part, jit_prefill_slots, jit_run_for,
                                  jit_run_for_slots, jit_span_needed, jit_span_needed_on)
from mtp_jax.target import TargetModel
from mtp_jax.tree import TreeSpec


# JAX traces a jitted function each time it builds a program for it (then compiles it, or reads it
# from the compilation cache): a call during which this fired spent time building, so its time is
# not a sample of the step's. Counted for the whole process, so a program another engine built is
# not mistaken for a build.
_TRACE_EVENT = "/jax/core/compile/jaxpr_trace_duration"
_events: collections.Counter = collections.Counter()
jax.monitoring.register_event_duration_secs_listener(
    lambda event, seconds, **kwargs: _events.update((event,)) if event == _TRACE_EVENT else None)


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
  grammar: grammar_lib.Grammar | None = None
  temperature: float = 0.0
  top_k: int | None = None
  top_p: float | None = None
  seed: int | None = None
  num_drafts: int | str = 0
  eos_token_ids: tuple[int, ...] = ()
  tokens: list[int] = dataclasses.field(default_factory=list)
  status: str = "waiting"
  slot: int | None = None
  pages: int = 0  # pages reserved in each pool while running
  prefilled: int = 0  # prompt tokens written by earlier parts (Engine(prefill_chunk=))
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



@dataclasses.dataclass
class DraftPolicy:
  """How many drafts a step verifies under num_drafts="auto" (host side; an Engine's, or shared).

  It keeps the measured seconds per decode step for each width k = 0..K and batch bucket (running
  requests rounded up to a power of two) and the drafts accepted and verified per position, and
  picks the k with the most tokens per second: running x (1 + sum_{i<k} r_i) / seconds(k, bucket),
  r_i the measured rate at which draft i is accepted when verified (a prior of 0.5^(i + 1) until
  16 verifications). At a bucket not yet timed the widest width runs first; a width not timed
  there takes the widest one's time there scaled by their ratio at the nearest bucket that timed
  both, or is tried when no bucket did (widest first). A width chosen on an estimate is timed as
  it runs, so an estimate that flattered it is replaced after one call, and a stream's smaller
  buckets (its tail) do not spend their few calls timing every width. Every 4th call at a bucket
  runs the runner-up instead when it is within a tenth of the best (call times here move by that
  much, so such widths are ranked by noise until timed again). A call during which JAX
  built a program (traced, then compiled or read it from a cache) is not a sample. So a step
  drafts like k = K where drafts pay (few requests, high acceptance) and less, down to 0, where
  the wider target forward costs more than the tokens it wins (many requests, low acceptance).
  Both measurements belong to the models, batch size and machine, not to one engine: an engine
  built again can start from them (`Engine(draft_policy=)`).
  """

  max_drafts: int
  seconds: dict = dataclasses.field(default_factory=dict)  # (k, bucket) -> recent calls' (seconds, steps)
  accepted_at: np.ndarray | None = None  # int64[K]: steps whose draft i was accepted
  proposed_at: np.ndarray | None = None  # int64[K]: steps whose draft i was verified
  choices: dict = dataclasses.field(default_factory=dict)  # bucket -> calls chosen by their measured gain

  def __post_init__(self):
    self.accepted_at = np.zeros((self.max_drafts,), np.int64) if self.accepted_at is None else self.accepted_at
    self.proposed_at = np.zeros((self.max_drafts,), np.int64) if self.proposed_at is None else self.proposed_at

  @staticmethod
  def bucket(num_running: int) -> int:
    return 1 << max(0, num_running - 1).bit_length()

  def choose(self, num_running: int) -> int:
    b, widest = self.bucket(num_running), self.max_drafts
    if not self.seconds.get((widest, b)):
      return widest  # it sets the scale of the bucket's other widths
    seconds = {}
    for k in range(widest, -1, -1):
      seconds[k] = self.step_seconds(k, b) if self.seconds.get((k, b)) else self._estimate(k, b)
      if seconds[k] is None:
        return k  # nothing to estimate it from: try it
    rate = [a / p if p >= 16 else 0.5 ** (i + 1) for i, (a, p) in enumerate(zip(self.accepted_at, self.proposed_at))]
    gain = {k: (1 + sum(rate[:k])) / seconds[k] for k in range(widest + 1)}
    best = max(gain, key=gain.get)  # a tie: the narrowest
    self.choices[b] = self.choices.get(b, 0) + 1
    if self.choices[b] % 4 == 0:
      # A call's time moves by a tenth here, so widths within a tenth of the best are ranked by
      # noise: every 4th call times the nearest of them again rather than trusting old samples.
      close = [k for k in gain if k != best and gain[k] >= 0.9 * gain[best]]
      if close:
        return max(close, key=gain.get)
    return best

  def _estimate(self, k: int, bucket: int) -> float | None:
    """Seconds of a step at width k and bucket, not timed there: the widest width's time there
    times k's ratio to it at the nearest bucket that timed both (None if none did)."""
    widest = self.max_drafts
    known = [c for (w, c) in self.seconds if w == k and self.seconds.get((widest, c))]
    if not known:
      return None
    c = min(known, key=lambda c: (abs(c.bit_length() - bucket.bit_length()), -c))
    return self.step_seconds(widest, bucket) * self.step_seconds(k, c) / self.step_seconds(widest, c)

  def step_seconds(self, k: int, bucket: int) -> float:
    """Seconds per decode step at width k and batch bucket: the recent calls' time over their steps
    (a ratio of sums, so a call cut short after one step weighs one step, not a whole call)."""
    samples = self.seconds[(k, bucket)]
    return sum(s for s, _ in samples) / sum(n for _, n in samples)

  def record(self, k: int, num_running: int, seconds: float, steps: int = 1) -> None:
    """One timing sample: a call of `steps` decode steps at width k with num_running requests took seconds."""
    samples = self.seconds.setdefault((k, self.bucket(num_running)), collections.deque(maxlen=16))
    samples.append((seconds, steps))

  def observe(self, accepted_at, proposed_at) -> None:
    """Counts more verifications: accepted_at, proposed_at (K ints each) steps whose draft i was
    accepted / verified since the last call."""
    self.accepted_at = self.accepted_at + np.asarray(accepted_at, np.int64)
    self.proposed_at = self.proposed_at + np.asarray(proposed_at, np.int64)


class Engine:
  """Continuous batching: requests come and go; each slot is refilled as soon as it frees.

  Args:
    target, proposer: as for `generate` (proposer None decodes without drafts).
    max_batch: slots decoded together.
    max_len: rows per sequence: a request needs len(prompt) + max_new_tokens + R <= max_len, R
      the rows of a step (K + 1, or a tree's nodes + 1).
    page_size, num_pages: the paged caches (page_size must divide max_len; num_pages per layer,
      default max_batch * max_len / page_size, at least max_len / page_size).
    num_drafts: "auto" (the default with a proposer; see `DraftPolicy`): the proposer drafts its
      K and each step verifies as many as pay. An int k in 1..K: it drafts k and verifies k
      (requests may ask for 0..k). 0: requests decode without drafts unless they ask for some.
      A tree engine drafts its tree; a request's num_drafts caps the depth it accepts.
    temperature, top_k, top_p, eos_token_id, seed: the requests' defaults (`add_request`
      overrides each). A request with a seed draws with `sampling.row_key(seed)` (as `generate`
      draws a lone prompt); one without, with the key of its id under the engine's seed.
    acceptance: how sampled requests' drafts are verified, "gumbel" or "rejection" (see `generate`).
    relaxed, tree: as for `generate` (a relaxed engine's requests are greedy).
    grammar: the default `mtp_jax.grammar.Grammar` of requests (constrained by default; needs
      eos_token_id equal to its own); `add_request(grammar=)` takes any other.
    mesh: a `mtp_jax.sharding.make_mesh` mesh for the slots' states (shard the params with
      `shard_params`).
    max_waiting: requests the queue may hold (default unbounded); `add_request` on a full queue
      raises `QueueFull`, so an overloaded engine refuses work instead of growing without bound.
    steps_per_call: decode steps one `step()` runs on device before the host reads the tokens
      (fewer when a request finishes, or one when a waiting request could take a free slot).
    prefill_chunk: prompt tokens one call writes for a request (default: whole prompts). A longer
      prompt is written in parts of prefill_chunk tokens, one part per `step()` (only its slot
      computed), between the running requests' decode steps, so it does not stall them for its
      whole prefill; it starts decoding with its last part.
    draft_policy: the `DraftPolicy` of num_drafts="auto" (default a new one). Its step times
      belong to the models, batch size and machine, not to one engine: an engine built again on
      the same ones (a server restarting its engine, a benchmark's second pass) can take the
      first one's (step times and acceptance) and skip measuring every width anew.
  """

  def __init__(self, target: TargetModel, proposer: MtpModel | None, *, max_batch: int = 8,
               max_len: int = 512, page_size: int = 16, num_pages: int | None = None,
               num_drafts: int | str | None = None, temperature: float = 0.0, top_k: int | None = None,
               top_p: float | None = None, eos_token_id: int | None = None, seed: int = 0,
               grammar: grammar_lib.Grammar | None = None, relaxed: tuple[int, float] | None = None,
               tree: TreeSpec | None = None, mesh: jax.sharding.Mesh | None = None,
               max_waiting: int | None = None, steps_per_call: int = 4, prefill_chunk: int | None = None,
               draft_policy: DraftPolicy | None = None, acceptance: str = "gumbel"):
    chain = tree is None and relaxed is None
    auto = proposer is not None and chain and (num_drafts is None or num_drafts == "auto")
    if num_drafts == "auto" and not auto:
      raise validate.InvalidValue("num_drafts", 'num_drafts="auto" needs a proposer and a chain without relaxed '
                                                "acceptance")
    d = options.decoding(target, proposer, num_drafts=None if auto or num_drafts == 0 else num_drafts,
                         temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, eos_token_id=eos_token_id,
                         relaxed=relaxed, tree=tree, grammar=grammar, acceptance=acceptance)
    max_batch = validate.positive_int("max_batch", max_batch)
    self.max_waiting = validate.optional_int("max_waiting", max_waiting, 0)
    self.steps_per_call = validate.positive_int("steps_per_call", steps_per_call)
    self.prefill_chunk = None if prefill_chunk is None else validate.positive_int("prefill_chunk", prefill_chunk)
    max_len = validate.integer("max_len", max_len, d.rows_per_step + 1)
    page_size, num_pages = options.paging(max_len, page_size, num_pages, max_batch)
    self.target, self.proposer = target, proposer
    self.max_drafts = d.num_drafts  # K: what the proposer drafts every step
    self.num_drafts = "auto" if auto else (0 if num_drafts == 0 else d.num_drafts)  # the requests' default
    self.defaults = d
    self.max_len, self.page_size, self.num_pages = max_len, page_size, num_pages
    if draft_policy is not None:
      validate.instance("draft_policy", draft_policy, DraftPolicy, "a mtp_jax.serving.DraftPolicy")
      if not auto or draft_policy.max_drafts != self.max_drafts:
        raise validate.InvalidValue("draft_policy", f'draft_policy serves num_drafts="auto" with a proposer of '
                                                    f"K={self.max_drafts} drafts, got max_drafts="
                                                    f"{draft_policy.max_drafts} (num_drafts={num_drafts!r})")
    self.policy = (draft_policy or DraftPolicy(self.max_drafts)) if auto else None
    # The state keeps this step's paging (every page allowed, the page list); each call reads the
    # budget or span of its own step, applied inside the jitted call, so the state's static fields
    # never change and each function compiles once per step, not once per state layout too.
    self._base = DecodeStep(StepSettings(
        num_drafts=d.num_drafts, max_new_tokens=max_len, max_len=max_len, sampled=d.relaxed is None,
        acceptance=d.acceptance, relaxed=d.relaxed, tree=tree, mesh=mesh,
        paging=Paging(page_size, num_pages, num_pages)))
    self._step = self._base  # the decode step: its verify width and page span follow the load
    self.grammar = grammar
    self._grammar_eos = None if grammar is None else grammar.eos_token_id  # every grammar of the engine ends so
    self._grammars: list[grammar_lib.Grammar] = []  # the grammars in the union, in its order
    self._union, self._offsets = None, []
    self._s = self._base.init(target, proposer, None, max_batch)  # donated: its own buffer
    self._slots: list[int | None] = [None] * max_batch
    self._waiting: collections.deque[int] = collections.deque()
    self._parts: collections.deque[int] = collections.deque()  # running requests whose prompt is written in parts
    self._reserved = 0
    self._next_span = None  # the page span the next call needs, read with the last call's outputs
    self._ids = itertools.count()
    self.requests: dict[int, Request] = {}  # every request's record until `forget` drops an ended one
    self._ttft, self._itl = Samples(), Samples()
    self._steps, self._step_seconds, self._verify_steps = 0, 0.0, 0
    self._accepted_at = np.zeros((self.max_drafts,), np.int64)
    self._proposed_at = np.zeros((self.max_drafts,), np.int64)
    self._ended: collections.Counter = collections.Counter()  # ended requests by status, forgotten ones too
    self._tokens_total = 0

  @property
  def page_span(self) -> int:
    """Pages per slot the last decode call read (the most a slot held: follows the rows in flight)."""
    span = self._step.settings.paging.span
    return self.max_len // self.page_size if span is None else span

  # -- requests --

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
    grammar = self._check_grammar(grammar, constrained)
    eos = self._check_eos(eos_token_ids, grammar)
    need = len(prompt) + max_new_tokens + self.defaults.rows_per_step
    if need > self.max_len:
      what = "K + 1" if self.defaults.tree is None else "the tree nodes + 1"
      raise validate.InvalidValue("prompt", f"request too long for the engine: len(prompt)={len(prompt)} + "
                                  f"max_new_tokens={max_new_tokens} + {what} = {need} > max_len={self.max_len}")
    if self.max_waiting is not None and len(self._waiting) >= self.max_waiting:
      raise QueueFull(f"the engine's waiting queue is full (max_waiting={self.max_waiting}); retry later")
    if grammar is not None:
      self._grammar_eos = grammar.eos_token_id
    rid = next(self._ids)
    self.requests[rid] = Request(rid, prompt, max_new_tokens, grammar, temperature, top_k, top_p, seed, num_drafts,
                                 eos, pages=-(-need // self.page_size), deadline_s=deadline_s,
                                 arrived_at=time.perf_counter())
    self._waiting.append(rid)
    return rid

  def _check_num_drafts(self, num_drafts) -> int | str:
    if num_drafts == "auto":
      if self.policy is None:
        raise validate.InvalidValue("num_drafts", 'num_drafts="auto" needs an engine with a proposer and a chain '
                                                  "without relaxed acceptance")
      return num_drafts
    return validate.integer("num_drafts", num_drafts, 0, self.max_drafts)

  def _check_grammar(self, grammar, constrained) -> grammar_lib.Grammar | None:
    constrained = None if constrained is None else validate.flag("constrained", constrained)
    if grammar is not None:
      validate.instance("grammar", grammar, grammar_lib.Grammar, "a mtp_jax.grammar.Grammar")
    grammar = grammar if grammar is not None else self.grammar
    if constrained is False:
      return None
    if constrained and grammar is None:
      raise validate.InvalidValue("constrained", "constrained=True needs a grammar: pass grammar= here or to Engine")
    if grammar is None:
      return None
    v = self.target.cfg.vocab_size
    if grammar.vocab_size > v:
      raise validate.InvalidValue("grammar", f"grammar has {grammar.vocab_size} tokens, more than the target's "
                                             f"vocab_size={v}")
    eos = grammar.eos_token_id if self._grammar_eos is None else self._grammar_eos
    if grammar.eos_token_id != eos:
      raise validate.InvalidValue("grammar", f"grammar's eos_token_id={grammar.eos_token_id} differs from this "
                                             f"engine's (eos_token_id={eos}): one engine's grammars share one")
    return grammar

  def _check_eos(self, eos_token_ids, grammar) -> tuple[int, ...]:
    if eos_token_ids is None:
      eos = () if self.defaults.eos_token_id is None else (self.defaults.eos_token_id,)
    else:
      if isinstance(eos_token_ids, (str, bytes)) or not isinstance(eos_token_ids, (Sequence, np.ndarray)):
        raise validate.InvalidType("eos_token_ids", "eos_token_ids must be a list of token ids, got "
                                                    f"{type(eos_token_ids).__name__}")
      v = self.target.cfg.vocab_size
      eos = tuple(validate.integer(f"eos_token_ids[{i}]", t, 0, v - 1) for i, t in enumerate(eos_token_ids))
    if grammar is not None and grammar.eos_token_id not in eos:
      eos += (grammar.eos_token_id,)  # a grammar's sequences end with its eos
    if len(set(eos)) > EOS_PER_SLOT:
      raise validate.InvalidValue("eos_token_ids", f"at most {EOS_PER_SLOT} end tokens per request (the "
                                                   f"grammar's included), got {len(set(eos))}")
    return tuple(dict.fromkeys(eos))

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
    self._end_request(req, status, time.perf_counter())

  def _end_request(self, req: Request, status: str, now: float) -> None:
    req.status, req.finished_at = status, now
    self._ended[status] += 1

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
    status = self._ended
    accepted = int(self._accepted_at.sum())
    caches = (self._s.target.kv, None if self._s.proposer is None else self._s.proposer.kv)
    return dict(
        requests_running=self.num_running, requests_waiting=self.num_waiting, requests_recorded=len(self.requests),
        requests_finished_total=status["finished"], requests_cancelled_total=status["cancelled"] + status["timed_out"],
        requests_out_of_pages_total=status["out_of_pages"], tokens_generated_total=self._tokens_total,
        verify_steps_total=self._verify_steps, drafts_proposed_total=int(self._proposed_at.sum()),
        drafts_proposed_at=self._proposed_at.tolist(), drafts_accepted_total=accepted,
        drafts_accepted_at=self._accepted_at.tolist(), verify_width=self._step.settings.verify_width,
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
    self._set_width()
    self._respan(self._step.rows_next(self._s) * self.steps_per_call, self._next_span)
    step, running, traces, t1 = self._step, self.num_running, _events[_TRACE_EVENT], time.perf_counter()
    decoding = [slot for slot, rid in enumerate(self._slots) if rid is not None and rid not in self._parts]
    idx_A = self._slot_group(decoding)
    if len(idx_A) == len(self._slots):
      self._s = jit_run_for(step, self.target, self.proposer, self._union, self._s, np.int32(n))
    else:
      self._s = jit_run_for_slots(step, self.target, self.proposer, self._union, self._s, idx_A, np.int32(n))
    gained, steps = self._collect()
    now = time.perf_counter()
    if self.policy is not None and steps and _events[_TRACE_EVENT] == traces:  # else it built a program
      self.policy.record(step.settings.verify_width, running, now - t1, steps)
    self._steps += 1
    self._step_seconds += now - t0
    return gained

  def _set_width(self) -> None:
    """Sets the drafts the next call verifies: the most any running request asks for, "auto" ones
    as the `DraftPolicy` says (a tree engine verifies its whole tree, capped per request)."""
    if self.defaults.tree is not None:
      return
    running = [self.requests[rid] for rid in self._slots if rid is not None]
    k = max((r.num_drafts for r in running if r.num_drafts != "auto"), default=0)
    if any(r.num_drafts == "auto" for r in running):
      k = max(k, self.policy.choose(len(running)))
    if k != self._step.settings.verify_width:
      self._step = self._step.replace(verify_drafts=None if k == self.max_drafts else k)
      self._next_span = None  # read for the old width's rows

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
    in_parts = lambda r: self.prefill_chunk is not None and len(r.prompt) > self.prefill_chunk
    whole = [r for r in admitted if not in_parts(r)]
    self._parts.extend(r.id for r in admitted if in_parts(r))
    if self._parts:  # the oldest prompt written in parts: its next part, or its last with the others
      head = self.requests[self._parts[0]]
      if len(head.prompt) - head.prefilled <= self.prefill_chunk:
        whole.append(self.requests[self._parts.popleft()])
      else:
        self._prefill_part(head)
    if whole:
      self._prefill(whole)

  def _prefill_part(self, req: Request) -> None:
    """Writes the next prefill_chunk tokens of req's prompt into its slot (not its last part)."""
    self._next_span = None  # the part takes pages
    c, done = self.prefill_chunk, req.prefilled
    prompt_1xT, len_1 = padded_prompts([req.prompt[done:done + c]], 1, [0])
    next_1xT, _ = padded_prompts([req.prompt[done + 1:done + c + 1]], 1, [0])
    slot_1 = np.asarray([req.slot], np.int32)
    self._s = jit_prefill_part(self._paging_for(slot_1, len_1), self.target, self.proposer, self._union, self._s,
                               slot_1, prompt_1xT, len_1, next_1xT)
    req.prefilled += c

  def _prefill(self, admitted: list[Request]) -> None:
    """Prefills the (rest of the) prompts of admitted requests and starts their decoding."""
    self._next_span = None  # the prefill takes pages
    self._use_grammars([r.grammar for r in admitted if r.grammar is not None])
    n = len(admitted)
    prompts = [r.prompt[r.prefilled:] for r in admitted]
    idx_A = self._slot_group([r.slot for r in admitted])
    a = len(idx_A)
    prompts_AxT, lens_A = padded_prompts(prompts, a, range(n))
    admit_A, max_new_A = np.arange(a) < n, np.zeros((a,), np.int32)
    gstart_A = np.full((a,), grammar_lib.FREE, np.int32)
    for i, r in enumerate(admitted):
      max_new_A[i] = r.max_new_tokens
      if r.grammar is not None:
        gstart_A[i] = self._offsets[self._grammar_index(r.grammar)] + grammar_lib.START
    self._s = jit_prefill_slots(self._paging_for(idx_A, lens_A), self.target, self.proposer, self._union, self._s,
                                idx_A, prompts_AxT, lens_A, admit_A, gstart_A, max_new_A,
                                self._slot_settings(admitted, a))

  def _slot_group(self, slots: list[int]) -> np.ndarray:
    """int32[A]: slots, then others (free ones first, untouched by the call) up to a power of two
    A: a call over a group compiles once per A. Every slot when A would be more than half of them
    (a group saves less than half the work there, and costs a program of its own to compile) or on
    a mesh (A must divide the data axis)."""
    b = len(self._slots)
    a = 1 << (len(slots) - 1).bit_length()
    if self._step.settings.mesh is not None or 2 * a > b:
      a = b
    rest = sorted(set(range(b)) - set(slots), key=lambda i: self._slots[i] is not None)
    return np.asarray(list(slots) + rest[:a - len(slots)], np.int32)

  def _paging_for(self, idx_A, num_new_A) -> DecodeStep:
    """The width-free step for a call adding num_new_A rows to the slots idx_A: it reads their pages
    only, the span of the longest (a prefill reads its prompts' pages, not a running request's)."""
    need = int(jit_span_needed_on(self._base, self.target, self.proposer, self._union, self._s, idx_A,
                                  np.asarray(num_new_A, np.int32)))
    span = budget_bucket(need, self.max_len // self.page_size, minimum=2)
    return DecodeStep(self._base.settings.with_budget(self.num_pages, span))

  def _slot_settings(self, admitted: list[Request], a: int) -> SlotSettings:
    """The admitted requests' settings, in rows 0..len(admitted)-1 of a (the other rows are not
    used). A request's key: row_key(seed), else row_key(the engine's seed, its id)."""
    v = self.target.cfg.vocab_size
    temperature, top_k = np.zeros((a,), np.float32), np.zeros((a,), np.int32)
    top_p, caps = np.ones((a,), np.float32), np.zeros((a,), np.int32)
    eos = np.full((a, EOS_PER_SLOT), -1, np.int32)
    keys = [row_key(self.defaults.seed)] * a
    for i, r in enumerate(admitted):
      temperature[i], top_k[i], top_p[i] = r.temperature, min(r.top_k or 0, v), 1.0 if r.top_p is None else r.top_p
      caps[i] = self.max_drafts if r.num_drafts == "auto" else r.num_drafts
      eos[i, :len(r.eos_token_ids)] = r.eos_token_ids
      keys[i] = row_key(r.seed) if r.seed is not None else row_key(self.defaults.seed, r.id)
    return SlotSettings(RowSampling(jnp.asarray(temperature), jnp.asarray(top_k), jnp.asarray(top_p)),
                        jnp.stack(keys), jnp.asarray(caps), jnp.asarray(eos))

  def _grammar_index(self, grammar: grammar_lib.Grammar) -> int:
    return next(i for i, g in enumerate(self._grammars) if g is grammar)

  def _use_grammars(self, needed: list[grammar_lib.Grammar]) -> None:
    """Makes the device grammar (one union of every grammar in use, `grammar.union`) hold `needed`.
    A new grammar rebuilds the union from the running requests' grammars and the new ones (the
    finished ones' are dropped), and the running slots' grammar states move to their new numbers."""
    known = lambda g, gs: any(g is h for h in gs)
    if all(known(g, self._grammars) for g in needed):
      return
    running = [self.requests[rid].grammar for rid in self._slots if rid is not None]
    keep: list[grammar_lib.Grammar] = []
    for g in [*(g for g in self._grammars if known(g, running)), *needed]:
      if not known(g, keep):
        keep.append(g)
    union, offsets = grammar_lib.union(keep)
    gstate_B = self._s.grammar_state
    if gstate_B is None:
      gstate_B = jnp.full(self._s.last.shape, grammar_lib.FREE, jnp.int32)
    else:
      table = np.full((self._union.num_states,), grammar_lib.DONE, np.int32)  # dropped grammars' states: unused
      for g, off in zip(keep, offsets):
        if known(g, self._grammars):
          old = self._offsets[self._grammar_index(g)]
          table[old + 1:old + g.num_states] = np.arange(off + 1, off + g.num_states)
      gstate_B = jnp.where(gstate_B < 0, gstate_B, jnp.asarray(table)[jnp.maximum(gstate_B, 0)])
    self._s = self._s.set(grammar_state=gstate_B)
    self._union, self._offsets, self._grammars = union, offsets, keep

  def _respan(self, num_new_B, span_needed: int | None = None) -> None:
    """Sets the page span of the next decode call, which adds at most num_new_B rows (int32[B]) per
    slot: it follows the longest slot's pages up and down (one compile per span, reused when it
    comes back). span_needed: that call's need when the host already has it (else read here)."""
    if span_needed is None:
      span_needed = int(jit_span_needed(self._base, self._s, num_new_B))
    # At least MIN_CAPACITY rows, as generate's caches start: short requests share one compile,
    # and a request does not meet a new span (a compile, seconds) every few pages it grows.
    first = 1 << max(1, (-(-MIN_CAPACITY // self.page_size) - 1).bit_length())
    span = budget_bucket(span_needed, self.max_len // self.page_size, minimum=first)
    if span != self._step.settings.paging.span:
      self._step = DecodeStep(self._step.settings.with_budget(self.num_pages, span))

  def _collect(self) -> tuple[dict[int, list[int]], int]:
    """(the tokens each running request gained, decode steps the last call ran)."""
    s = self._s
    # The next step's page need comes in the same read: freeing slots only lowers it.
    num_out, out, done, oom, verify_calls, accepted_at, proposed_at, self._next_span = jax.device_get(
        (s.num_out, s.out, s.done, s.out_of_pages, s.verify_calls, s.accepted_at, s.proposed_at,
         jit_span_needed(self._base, s, self._step.rows_next(s) * self.steps_per_call)))
    self._next_span = int(self._next_span)
    accepted_at, proposed_at = accepted_at.astype(np.int64), proposed_at.astype(np.int64)
    if self.policy is not None:
      self.policy.observe(accepted_at - self._accepted_at, proposed_at - self._proposed_at)
    self._accepted_at, self._proposed_at = accepted_at, proposed_at
    now = time.perf_counter()
    gained, finished, steps = {}, [], 0
    for slot, rid in enumerate(self._slots):
      if rid is None or rid in self._parts:  # a prompt still written in parts: not decoding yet
        continue
      req = self.requests[rid]
      new = out[slot, len(req.tokens):min(num_out[slot], req.max_new_tokens)].tolist()
      req.tokens += new
      self._tokens_total += len(new)
      steps = max(steps, int(verify_calls[slot]) - req.verify_calls)
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
      if self._slots[slot] in self._parts:
        self._parts.remove(self._slots[slot])
      self._reserved -= self.requests[self._slots[slot]].pages
      self.requests[self._slots[slot]].slot = None
      self._slots[slot] = None
