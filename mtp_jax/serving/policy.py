"""DraftPolicy: how many drafts a step verifies under num_drafts="auto", from measured step times
and acceptance (host side); and the process-wide count of programs JAX built, which tells a timed
call that built one (not a sample) from one that did not."""

from __future__ import annotations

import collections
import dataclasses
import json
import typing

import jax
import numpy as np

from mtp_jax.serving.step import defers

# JAX traces a jitted function each time it builds a program for it (then compiles it, or reads it
# from the compilation cache): a call during which this fired spent time building, so its time is
# not a sample of the step's. Counted for the whole process, so a program another engine built is
# not mistaken for a build.
_TRACE_EVENT = "/jax/core/compile/jaxpr_trace_duration"
_events: collections.Counter = collections.Counter()
jax.monitoring.register_event_duration_secs_listener(
    lambda event, seconds, **kwargs: _events.update((event,)) if event == _TRACE_EVENT else None)


def programs_built() -> int:
  """Programs JAX has traced in this process so far (a call that changed it built one)."""
  return _events[_TRACE_EVENT]


@dataclasses.dataclass
class DraftPolicy:
  """How many drafts a step verifies under num_drafts="auto" (host side; an Engine's, or shared).

  It keeps the measured seconds per decode step for each width k = 0..K and batch bucket (running
  requests rounded up to a power of two) and the drafts accepted and verified per position, and
  picks the k with the most tokens per second: running x (1 + sum_{i<k} r_i) / seconds(k, bucket),
  r_i the measured rate at which draft i is accepted when verified (`rates`: the counts blended with
  a prior worth PRIOR_WEIGHT verifications, extended from the positions before it). When speculation
  is off (k = 0 wins), every PROBE_EVERY-th call at a bucket runs k = 1 as a probe, so acceptance is
  still measured and speculation comes back when drafts start to pay. At a bucket not yet timed the
  widest width runs first; a width not timed there takes the widest one's time there scaled by their
  ratio at the nearest bucket that timed both, or is tried when no bucket did (widest first). A
  width chosen on an estimate is timed as it runs, so an estimate that flattered it is replaced
  after one call, and a stream's smaller buckets (its tail) do not spend their few calls timing
  every width. Requests weigh by their own acceptance (`request_scale`): a request whose drafts are
  rejected adds its one token per step and nothing for the drafts, so a batch of such requests turns
  speculation off (and a probe brings it back for them when their drafts start to pass), while the
  others keep drafting; with one request running this is a per-request switch. A request admitted
  where drafts do not pay even alone (`admits_drafting`) runs no module for its whole life, bar one
  probe request in PROBE_REQUEST_EVERY (twice as few after each probe in a row whose drafts did not
  pay, down to one in PROBE_REQUEST_EVERY << PROBE_BACKOFF_MAX, until drafts pay); drafting ones
  stop when none's own drafts pay alone any more (`keeps_drafting`). Every TURN_EVERY-th call at a
  bucket runs the runner-up instead when it is within TURN_WITHIN of the best (such widths are
  ranked by noise until timed again), and every RETIME_EVERY-th the width timed longest ago among
  those within RETIME_WITHIN of the best, so one slow sample cannot bar a width for good (both
  only where neither width defers the deeper modules: such a turn would cost a catch-up); a
  width's time is the median of its recent calls
  plus the catch-ups it caused, spread over its steps (`step_seconds`). A call during which JAX
  built a program (traced, then compiled or read it from a cache) is not a sample. So a step
  drafts like k = K where drafts pay (few requests, high acceptance) and less, down to 0, where
  the wider target forward costs more than the tokens it wins (many requests, low acceptance).
  Where a width c < K with the deeper modules idle (timed apart: `capped_seconds`) beats every
  width as it runs for uncapped requests (catch-ups counted), requests admitted there are capped
  at c for life (`cap`): the deeper modules get none of their rows, so they pay for none.
  Both measurements belong to the models, batch size and machine, not to one engine: an engine
  built again can start from them
  (`Engine(draft_policy=)`).
  """

  PRIOR_WEIGHT: typing.ClassVar[int] = 4  # verifications the prior of `rates` weighs
  PROBE_EVERY: typing.ClassVar[int] = 16  # calls at a bucket between probes while k = 0 wins
  # A probe request runs the modules over its whole admission group's prompts and its rows' catch-ups:
  # at 1 in 16 that cost a tenth of the tokens/s of 8 slots whose drafts all fail.
  PROBE_REQUEST_EVERY: typing.ClassVar[int] = 64  # admissions declined between probe requests
  # A probe request makes every call of its batch verify a draft while it measures: on the random
  # large demo at 8 slots its 3 calls cost 60 ms a pass more (1.2% of the pass), so probes that keep
  # failing come less often.
  PROBE_BACKOFF_MAX: typing.ClassVar[int] = 4
  RETIME_EVERY: typing.ClassVar[int] = 16  # calls at a bucket between runs of its stalest width
  TURN_EVERY: typing.ClassVar[int] = 8  # calls at a bucket between turns of a runner-up within TURN_WITHIN
  TURN_WITHIN: typing.ClassVar[float] = 0.95  # of the best width's gain
  RETIME_WITHIN: typing.ClassVar[float] = 0.6  # of the best width's gain: widths worth timing again

  max_drafts: int
  seconds: dict = dataclasses.field(default_factory=dict)  # (k, bucket) -> recent calls' (seconds, steps)
  accepted_at: np.ndarray | None = None  # int64[K]: steps whose draft i was accepted
  proposed_at: np.ndarray | None = None  # int64[K]: steps whose draft i was verified
  choices: dict = dataclasses.field(default_factory=dict)  # bucket -> calls chosen by their measured gain
  declined: int = 0  # admissions `admits_drafting` declined
  probe_admitted: bool = False  # the last admission `admits_drafting` answered was a probe request's
  probes_failed: int = 0  # probe requests in a row that stopped drafting (the Engine counts them)
  recorded: int = 0  # samples recorded so far (the clock of timed_at)
  timed_at: dict = dataclasses.field(default_factory=dict)  # (k, bucket) -> `recorded` at its latest sample
  steps_at: dict = dataclasses.field(default_factory=dict)  # (k, bucket) -> steps run there, all told
  catch_up_seconds: dict = dataclasses.field(default_factory=dict)  # (k, bucket) -> catch-up time charged to it
  # (k, bucket) -> recent calls' (seconds, steps) at k < K whose requests were all capped at k or
  # under: the deeper modules idle (`StepSettings.deeper_idle`); `cap` weighs these, `choose` not.
  capped_seconds: dict = dataclasses.field(default_factory=dict)
  # A width every call runs while set, its requests uncapped and drafting (`calibrate` times a
  # deferring width with rows waiting, so its catch-ups are charged), whatever was measured.
  held: int | None = None
  _medians: dict = dataclasses.field(default_factory=dict, init=False, repr=False, compare=False)

  def __post_init__(self):
    self.accepted_at = np.zeros((self.max_drafts,), np.int64) if self.accepted_at is None else self.accepted_at
    self.proposed_at = np.zeros((self.max_drafts,), np.int64) if self.proposed_at is None else self.proposed_at

  @staticmethod
  def bucket(num_running: int) -> int:
    return 1 << max(0, num_running - 1).bit_length()

  def choose(self, num_running: int, scales: list[float] | None = None, probing: bool = False) -> int:
    """The width of the next call with num_running requests; scales: the running requests' own
    acceptance relative to the pooled one (`request_scale`; None: every request at 1); probing: a
    probe request (`admits_drafting`) runs and is still `measuring`: where k = 0 wins, the call
    runs k = 1, so its drafts are verified within K x PRIOR_WEIGHT steps and it stops (or drafts
    pay again) a few calls after its admission, not after a life of waiting rows and catch-ups."""
    if self.held is not None:
      return self.held
    b = self.bucket(num_running)
    untried = self._untried(b)
    if untried is not None:
      return untried
    gain = self._gains(b, [1.0] * num_running if scales is None else scales)
    best = max(gain, key=gain.get)  # a tie: the narrowest
    self.choices[b] = self.choices.get(b, 0) + 1
    if best == 0 and self.max_drafts and (probing or self.choices[b] % self.PROBE_EVERY == 0):
      return 1
    # A call at another width and back costs a catch-up of the waiting rows where either width
    # defers (`defers`: one call at width 1 between calls at 3 cost 4 slots of the trained demo a
    # catch-up each time), so only widths that run every module take such turns.
    turns = [k for k in gain if k != best and not defers(k, self.max_drafts) and not defers(best, self.max_drafts)]
    if self.choices[b] % self.TURN_EVERY == 0:
      # Widths within TURN_WITHIN of the best are ranked by noise (a call's time moves by a tenth
      # here, the median of a few calls by less): every TURN_EVERY-th call times the nearest of
      # them again rather than trusting old samples, at a cost of at most 1 - TURN_WITHIN a turn.
      close = [k for k in turns if gain[k] >= self.TURN_WITHIN * gain[best]]
      if close:
        return max(close, key=gain.get)
    if best > 0 and self.choices[b] % self.RETIME_EVERY == self.RETIME_EVERY // 2:
      # A width timed once on a slow call (a cold cache) would never run again, so every
      # RETIME_EVERY-th call runs the one whose latest sample here is oldest, within RETIME_WITHIN
      # (while k = 0 wins, the probes above time k = 1 instead).
      stale = [k for k in turns if gain[k] >= self.RETIME_WITHIN * gain[best]]
      if stale:
        return min(stale, key=lambda k: self.timed_at.get((k, b), -1))
    return best

  def drafts_pay(self, scale: float = 1.0) -> bool:
    """Whether drafts pay for a request running alone at `scale` times the pooled acceptance
    (`request_scale`): some k > 0 beats k = 0 at the smallest bucket whose widths are all timed
    (or estimated); True before any is."""
    for b in sorted({b for _, b in self.seconds}):
      if self._untried(b) is None:
        gain = self._gains(b, [scale])
        return max(gain, key=gain.get) > 0
    return True

  def keeps_drafting(self, drafts_accepted: int, drafts_verified: int) -> bool:
    """Whether a drafting request's drafts still pay: until it has verified PRIOR_WEIGHT drafts per
    position (K x PRIOR_WEIGHT), and then while drafts at its own acceptance (`request_scale`) pay
    for it running alone (`drafts_pay`). The Engine stops the drafting requests when none pays
    (all or none: a batched step computes every slot's draft rows); one that stops runs no module
    for the rest of its life (its modules cannot catch up without the target hiddens they missed),
    and a probe request (`admits_drafting`) stops once its first drafts say they still do not pay."""
    if self.measuring(drafts_verified) or self.held is not None:
      return True
    return self.drafts_pay(self.request_scale(drafts_accepted, drafts_verified))

  def measuring(self, drafts_verified: int) -> bool:
    """Whether a request that verified drafts_verified drafts is still measuring its own acceptance
    (fewer than PRIOR_WEIGHT per position: K x PRIOR_WEIGHT)."""
    return drafts_verified < self.PRIOR_WEIGHT * self.max_drafts

  def admits_drafting(self) -> bool:
    """Whether a request admitted now drafts for its whole life: where drafts do not pay even for
    a request alone (`drafts_pay`: its acceptance has collapsed, not merely the batch grown),
    one runs no module at all (no prefill, no catch-up), except every PROBE_REQUEST_EVERY-th
    (doubled for each of `probes_failed`, at most PROBE_BACKOFF_MAX times), admitted drafting as a
    probe (`probe_admitted`; while it is `measuring`, calls where k = 0 wins run k = 1:
    `choose(probing=)`), so acceptance is still measured and speculation comes back for later
    requests once drafts pay again."""
    self.probe_admitted = False
    if self.held is not None or self.drafts_pay():
      self.probes_failed = 0
      return True
    self.declined += 1
    every = self.PROBE_REQUEST_EVERY << min(self.probes_failed, self.PROBE_BACKOFF_MAX)
    self.probe_admitted = self.declined % every == 0
    return self.probe_admitted

  def cap(self, num_running: int) -> int:
    """The most drafts a drafting request admitted now, with num_running requests running, may
    ever verify: a width c < K where c with the deeper modules idle (its `capped_seconds`; a width
    that defers, not timed so: its time per step without catch-up charges) gives more tokens per
    second than any width as uncapped requests run it (`step_seconds`), else K. A request capped
    at c keeps no rows for the deeper modules (they are never read for it), so its slot never
    pays their catch-up, nor their prefill; measured on the trained large demo with 4 slots, an
    engine held at width 1 ran at 0.91x a fixed k = 1 engine while it kept them. Only widths timed
    at the bucket (not estimated) are weighed."""
    b, k = self.bucket(num_running), self.max_drafts
    if self.held is not None or self._untried(b) is not None:
      return k
    gain = self._gains(b, [1.0] * num_running)
    rate = self.rates()
    capped = {}
    for c in range(1, k):
      samples = self.capped_seconds.get((c, b)) or (self.seconds.get((c, b)) if defers(c, k) else None)
      if samples:
        capped[c] = num_running * (1 + sum(rate[:c])) / _median(samples)
    best = max(capped, key=capped.get, default=None)
    return best if best is not None and capped[best] > max(gain.values()) else k

  def _untried(self, bucket: int) -> int | None:
    """A width the bucket has to try before widths can be compared there (None: none): the widest
    first (it sets the scale of the others), then one neither timed nor estimable."""
    widest = self.max_drafts
    if not self.seconds.get((widest, bucket)):
      return widest
    for k in range(widest, -1, -1):
      if not self.seconds.get((k, bucket)) and self._estimate(k, bucket) is None:
        return k
    return None

  def _gains(self, bucket: int, scales: list[float]) -> dict[int, float]:
    """Expected tokens per second of each width k = 0..K at bucket (none of them `_untried`), for
    requests of acceptance scales."""
    rate = self.rates()
    gain = {}
    for k in range(self.max_drafts + 1):
      seconds = self.step_seconds(k, bucket) if self.seconds.get((k, bucket)) else self._estimate(k, bucket)
      # Tokens a step gives each request: its one, plus the drafts it is expected to keep.
      gain[k] = sum(1 + sum(min(1.0, c * r) for r in rate[:k]) for c in scales) / seconds
    return gain

  def rates(self) -> list[float]:
    """The acceptance rate of each draft position: its measured counts plus PRIOR_WEIGHT
    verifications at a prior, so a few verifications already move it (a model whose drafts are
    rejected turns speculation off within one call of a few requests). The prior of position 0 is
    1 (drafts pass until measured); that of position i > 0 extends the rates before it
    geometrically (r_{i-1}^2 / r_{i-2}, r_0^2 for i = 1). A prior under what pays would start a
    calibrated engine at k = 0, where no draft is verified, so acceptance would never be measured
    (the trained demo's calibrated engine declined to draft for every request at 8 slots with a
    prior of 0.5); and a width that never runs never verifies its deepest drafts, so a fixed
    prior there would keep it from ever being chosen where it pays."""
    w, rates = self.PRIOR_WEIGHT, []
    for i, (a, p) in enumerate(zip(self.accepted_at, self.proposed_at)):
      prior = 1.0 if i == 0 else rates[-1] * (rates[-1] / rates[-2] if i > 1 and rates[-2] > 0 else rates[-1])
      rates.append((a + w * min(1.0, prior)) / (p + w))
    return rates

  def request_scale(self, drafts_accepted: int, drafts_verified: int) -> float:
    """A request's acceptance over the pooled one (1: like the rest): its drafts accepted over
    drafts verified, blended with the pooled rate worth PRIOR_WEIGHT drafts, so a request that has
    verified few drafts counts as the others do and one whose drafts fail falls towards 0."""
    w, k = self.PRIOR_WEIGHT, self.max_drafts
    pooled = (int(self.accepted_at.sum()) + w * k) / (int(self.proposed_at.sum()) + w * k)  # prior: all pass
    return (drafts_accepted + w * pooled) / (drafts_verified + w) / pooled

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
    """Seconds per decode step at width k and batch bucket: the median of the recent calls' seconds
    per step, each call weighing its steps (a call cut short after one step weighs one step, and
    one slow call does not move it), plus the catch-ups charged to k there (`record`) over all the
    steps k ran there: a width that leaves the deeper modules' rows waiting pays for their
    catch-up, whichever call runs it."""
    charged = self.catch_up_seconds.get((k, bucket), 0.0)
    return self._median(k, bucket) + charged / max(1, self.steps_at.get((k, bucket), 0))

  def _median(self, k: int, bucket: int) -> float:
    # Kept until k's next sample there: each call's width weighs every width at its bucket a few
    # times (under cProfile, at 8 slots, the width choice took 0.5 ms a call sorting anew, 0.4 kept).
    median = self._medians.get((k, bucket))
    if median is None:
      median = self._medians[(k, bucket)] = _median(self.seconds[(k, bucket)])
    return median

  def to_json(self) -> str:
    """The measurements as JSON (`from_json` reads them back): a policy measured once on a machine
    (`Engine.calibrate`) serves later engines on the same models and machine."""
    listed = lambda table: [[k, b, [list(x) for x in samples]] for (k, b), samples in sorted(table.items())]
    steps = [[k, b, n, self.catch_up_seconds.get((k, b), 0.0)] for (k, b), n in sorted(self.steps_at.items())]
    return json.dumps(dict(max_drafts=self.max_drafts, seconds=listed(self.seconds), steps_at=steps,
                           capped=listed(self.capped_seconds), accepted_at=self.accepted_at.tolist(),
                           proposed_at=self.proposed_at.tolist()))

  @classmethod
  def from_json(cls, text: str) -> "DraftPolicy":
    """The policy `to_json` wrote (a ValueError names what is malformed)."""
    try:
      d = json.loads(text)
      policy = cls(int(d["max_drafts"]), accepted_at=np.asarray(d["accepted_at"], np.int64),
                   proposed_at=np.asarray(d["proposed_at"], np.int64))
      for table, rows in ((policy.seconds, d["seconds"]), (policy.capped_seconds, d.get("capped", []))):
        for k, b, samples in rows:  # no "capped" in files written before capped calls were timed apart
          for seconds, steps in samples:
            table.setdefault((int(k), int(b)), collections.deque(maxlen=16)).append((float(seconds), int(steps)))
      for k, b, steps, charged in d.get("steps_at", []):  # absent from files written before catch-ups were charged
        policy.steps_at[(int(k), int(b))], policy.catch_up_seconds[(int(k), int(b))] = int(steps), float(charged)
    except (ValueError, KeyError, TypeError) as e:
      raise ValueError(f"not a DraftPolicy's JSON: {e!r}") from e
    if policy.accepted_at.shape != (policy.max_drafts,) or policy.proposed_at.shape != (policy.max_drafts,):
      raise ValueError(f"not a DraftPolicy's JSON: accepted_at / proposed_at must hold max_drafts={policy.max_drafts} "
                       "counts each")
    return policy

  def record(self, k: int, num_running: int, seconds: float, steps: int = 1, catch_up_of: int | None = None,
             capped: bool = False) -> None:
    """One timing sample: a call of `steps` decode steps at width k with num_running requests took
    seconds. capped: its requests were all capped at k or under, so the deeper modules idled
    (`StepSettings.deeper_idle`): a sample of `capped_seconds`, which only `cap` reads.
    catch_up_of: the narrowest width whose waiting rows the call's modules caught up on
    (None: it ran no catch-up). Such a call is no sample of k: its time past `steps` steps at k
    (`step_seconds`) is charged to width catch_up_of at this bucket, where it adds that charge
    over the steps it ran there to its time per step (a width that defers pays its catch-ups, the
    wider width a catch-up falls in does not; with k not timed here yet, the call is dropped)."""
    key = (k, self.bucket(num_running))
    if capped:
      self.capped_seconds.setdefault(key, collections.deque(maxlen=16)).append((seconds, steps))
      return
    self.steps_at[key] = self.steps_at.get(key, 0) + steps
    if catch_up_of is not None:
      if self.seconds.get(key):
        charged = (catch_up_of, key[1])
        extra = max(0.0, seconds - steps * self._median(*key))
        self.catch_up_seconds[charged] = self.catch_up_seconds.get(charged, 0.0) + extra
      return
    self.seconds.setdefault(key, collections.deque(maxlen=16)).append((seconds, steps))
    self._medians.pop(key, None)
    self.recorded += 1
    self.timed_at[key] = self.recorded

  def observe(self, accepted_at, proposed_at) -> None:
    """Counts more verifications: accepted_at, proposed_at (K ints each) steps whose draft i was
    accepted / verified since the last call."""
    self.accepted_at = self.accepted_at + np.asarray(accepted_at, np.int64)
    self.proposed_at = self.proposed_at + np.asarray(proposed_at, np.int64)


def _median(samples) -> float:
  """The median seconds per step of samples ((seconds, steps) each), each weighing its steps."""
  per_step = sorted((s / n, n) for s, n in samples)
  half, steps = sum(n for _, n in per_step) / 2, 0
  for seconds, n in per_step:
    steps += n
    if steps >= half:
      return seconds
