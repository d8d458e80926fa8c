"""DraftPolicy and calibrate: the width num_drafts="auto" picks from measured step times and
acceptance, and the requests whose drafts do not pay."""

import collections
import pytest

import mtp_jax
from mtp_jax import Engine
from mtp_jax.serving.calibrate import measured_policy
from mtp_jax.serving.policy import DraftPolicy

from test_engine import LONGEST, SETTINGS, _alone
from test_generate import K, PROPOSER5, TARGET5


@pytest.mark.slow
def test_calibrate_times_every_width_and_bucket_before_traffic():
  """calibrate() fills the cost model at every (width, bucket) with 2 timed calls and leaves the
  engine as it found it: no request, page or metric of its synthetic requests is left, the
  acceptance counts are untouched, and a request then runs exactly."""
  engine = Engine(TARGET5, PROPOSER5, max_batch=2, max_len=64, page_size=2, num_pages=64)
  policy = engine.calibrate(calls=2)
  assert all(len(policy.seconds[k, b]) >= 2 for k in range(K + 1) for b in (1, 2))
  # Widths under K are also timed with their requests capped there (the deeper modules idle).
  assert all(len(policy.capped_seconds[k, b]) >= 2 for k in range(1, K) for b in (1, 2))
  assert len(policy.capped_seconds) == 2 * (K - 1)
  # K = 3: width 1 leaves modules 1 and 2 behind, and ran until one of their catch-ups (past 32
  # rows waiting: the requests' 44 new tokens fill them) was charged to it.
  assert all((1, b) in policy.catch_up_seconds for b in (1, 2))
  assert policy.proposed_at.sum() == 0
  m = engine.metrics()
  assert (m["requests_recorded"], m["requests_cancelled_total"], m["steps_total"], m["drafts_proposed_total"]) == (
      0, 0, 0, 0)
  assert engine.free_pages() == 64
  # num_drafts=K: whether an "auto" request drafts follows the measured times (`admits_drafting`).
  rid = engine.add_request([1, 2, 3], 20, num_drafts=K)
  assert engine.run()[rid] == _alone((1, 2, 3))[:20]
  # The request's own drafts, and only them, reach both the metrics and the policy's acceptance.
  m = engine.metrics()
  assert m["drafts_proposed_total"] == policy.proposed_at.sum() > 0
  assert m["drafts_accepted_total"] == policy.accepted_at.sum()
  with pytest.raises(ValueError, match="calibrate measures num_drafts=\"auto\"") as e:
    Engine(TARGET5, PROPOSER5, **SETTINGS).calibrate()
  assert e.value.argument == "num_drafts"


def test_draft_policy_tries_each_width_then_picks_the_most_tokens_per_second():
  policy = DraftPolicy(3)
  picks = []
  for _ in range(4):
    picks.append(policy.choose(1))
    policy.record(picks[-1], 1, 0.01)
  assert picks == [3, 2, 1, 0]  # untried widths first, widest first
  assert policy.choose(1) == 3  # equal step times: drafts are free (prior acceptance)
  policy.observe([0, 0, 0], [100] * 3)
  assert policy.rates()[0] < 0.04  # measured: drafts are all but never accepted (the prior weighs 4 verifications)
  assert policy.choose(1) == 3  # yet at equal step times even those few pay
  # The median per step, each call weighing its steps: a slow call (0.1 s) does not move it.
  policy.record(3, 1, 0.02, steps=4)
  policy.record(3, 1, 0.1)
  assert policy.step_seconds(3, 1) == pytest.approx(0.005)  # 0.005 for 4 steps, 0.01 and 0.1 for one each
  policy.record(3, 1, 0.024, steps=3)
  assert policy.step_seconds(3, 1) == pytest.approx(0.008)  # 0.005 x 4, then 0.008 x 3 reaches half of 9 steps
  policy.seconds[3, 1] = collections.deque([(0.01, 1)])
  for k, seconds in enumerate([0.010, 0.016, 0.024, 0.032]):
    policy.record(k, 8, seconds)
  policy.observe([80, 60, 40], [0] * 3)  # counts add up: 0.8, 0.6, 0.4 accepted
  assert policy.choose(7) == 1  # 1.8 / 0.016 beats 1 / 0.010 and 2.4 / 0.024
  policy.observe([0, 0, 0], [300] * 3)  # 80 / 400, 60 / 400, 40 / 400
  assert policy.choose(8) == 0  # low acceptance at full batch: no drafts
  # A new bucket: the widest width first, then the others estimated by their ratio at bucket 8;
  # a chosen estimate is timed and replaced.
  assert policy.choose(4) == 3
  policy.record(3, 4, 0.02)
  assert policy.choose(4) == 0  # est. 0.02 x 0.010 / 0.032: 1 / 0.00625 beats 1.45 / 0.02
  policy.record(0, 4, 0.015)
  assert policy.choose(3) == 1  # k=0 measured at 1 / 0.015; k=1 est. 0.02 x 0.016 / 0.032: 1.2 / 0.01
  assert (2, 4) not in policy.seconds and (1, 4) not in policy.seconds
  # Every TURN_EVERY-th call at a bucket times again a runner-up within TURN_WITHIN of the best.
  one = DraftPolicy(1)
  one.record(1, 1, 0.02)
  one.record(0, 1, 0.0105)
  one.observe([4], [12])  # rate (4 + 4) / 16 = 0.5: k=1 1.5 / 0.02 = 75, k=0 1 / 0.0105 = 95: far
  assert [one.choose(1) for _ in range(4)] == [0, 0, 0, 0]
  one.record(1, 1, 0.014)  # k=1 1.5 / 0.014 = 107 now beats k=0: 95
  # k = 0 defers (its rows would wait, and the next call at 1 catch up on them): it takes no turns.
  assert [one.choose(1) for _ in range(8)] == [1] * 8
  three = DraftPolicy(3)
  for k, seconds in ((3, 0.0215), (2, 0.02), (1, 1.0), (0, 1.0)):
    three.record(k, 1, seconds)
  three.observe([4, 4, 0], [12, 12, 12])  # rates 0.5, 0.3125, 0.049: k=2 1.81 / 0.02 = 91, k=3 1.86 / 0.0215 = 87
  assert DraftPolicy.TURN_EVERY == 8 and DraftPolicy.TURN_WITHIN < 87 / 91
  assert [three.choose(1) for _ in range(8)] == [2] * 7 + [3]  # the 8th call times the runner-up, k=3, again
  # Every RETIME_EVERY-th call at a bucket (offset by half) times again the width timed longest
  # ago among those within RETIME_WITHIN of the best: k = 2 here, timed once on a slow call.
  policy = DraftPolicy(2)
  for k, seconds in ((2, 0.02), (0, 0.010), (1, 0.012)):
    policy.record(k, 1, seconds)
  policy.observe([4, 3], [12, 12])  # rates 0.5, 0.25: k=1 1.5 / 0.012 = 125, k=2 1.75 / 0.02 = 87.5
  policy.choices[1] = 2
  picks = [policy.choose(1) for _ in range(DraftPolicy.RETIME_EVERY)]  # calls 3..18
  assert picks[:5] == [1] * 5 and picks[5] == 2 and picks.count(2) == 1


def test_deeper_drafts_never_verified_take_their_prior_from_the_measured_ones():
  """A width that never ran never verified its deepest draft: its rate extends the measured ones
  (r_2 ~ r_1^2 / r_0), so a model whose drafts pass is not held at the narrower width by a fixed
  prior of 0.125 (the trained demo's calibrated engine stayed at k = 2 at one request for that)."""
  policy = DraftPolicy(3)
  assert policy.rates() == pytest.approx([1.0, 1.0, 1.0])  # nothing measured: drafts pass until measured
  for k, seconds in enumerate([0.010, 0.012, 0.014, 0.0165]):
    policy.record(k, 1, seconds)
  policy.observe([80, 64, 0], [100, 100, 0])  # k = 3 never ran: draft 2 never verified
  r = policy.rates()
  assert r[0] == pytest.approx(84 / 104) and r[1] == pytest.approx((64 + 4 * r[0] ** 2) / 104)
  assert r[2] == pytest.approx(r[1] ** 2 / r[0])
  assert policy.choose(1) == 3  # 2.94 / 0.0165 beats 2.43 / 0.014 (with 0.125 it would not: 2.55 / 0.0165)
  policy.observe([0, 0, 0], [0, 0, 400])  # once verified, the counts rule: all rejected
  assert policy.rates()[2] < 0.01 and policy.choose(1) == 2


def test_policy_turns_speculation_off_when_drafts_are_rejected_and_probes_back():
  """With measured step times where drafting costs 30% a width, a few all-rejected verifications
  pull the acceptance prior down and k = 0 wins; while it does, every PROBE_EVERY-th call runs
  k = 1, and acceptance that comes back turns speculation on again."""
  policy = DraftPolicy(K)
  for k in range(K + 1):
    policy.record(k, 4, 1.0 + 0.3 * k)
  policy.choices[4] = 1  # so neither probes nor runner-up reruns fall in the first calls below
  assert policy.choose(4) == K  # the prior, every draft accepted: 4 / 1.9 beats 1 / 1.0
  policy.observe([0] * K, [24] * K)  # 24 verifications, none accepted: 1.14 / 1.3 at k = 1 under 1 / 1.0
  picks = [policy.choose(4) for _ in range(2 * DraftPolicy.PROBE_EVERY)]
  assert picks.count(1) == 2 and set(picks) == {0, 1}
  policy.observe([200, 0, 0], [200, 0, 0])  # the probes find position 0 always accepted
  assert policy.choose(4) > 0


def test_requests_weigh_by_their_own_acceptance():
  """The pooled counts say drafts pay; requests whose own drafts were all rejected count one token
  a step each, so a batch of them turns speculation off while a batch like the pool keeps it."""
  policy = DraftPolicy(K)
  for k in range(K + 1):
    policy.record(k, 4, 1.0 + 0.3 * k)
  policy.choices[4] = 1  # no probe or runner-up rerun in the calls below
  policy.observe([60, 40, 20], [100] * K)
  assert policy.request_scale(0, 0) == pytest.approx(1.0)  # no drafts of its own yet: like the pool
  rejected = policy.request_scale(0, 40)
  assert rejected < 0.1 and policy.request_scale(40, 40) > 1.5
  assert policy.choose(4, [1.0] * 4) == policy.choose(4) > 0
  assert policy.choose(4, [rejected] * 4) == 0
  assert policy.choose(4, [rejected] * 3 + [1.0]) < policy.choose(4)


def test_a_catch_up_is_charged_to_the_width_whose_rows_waited():
  """A call that caught up (`record(..., catch_up_of=j)`) is no sample of its own width: its time
  past its steps at that width's median goes to width j at that bucket, spread over every step j
  ran there, so a deferring width that looked cheapest stops winning once its catch-ups count."""
  policy = DraftPolicy(3)
  for k, seconds in [(3, 0.040), (2, 0.040), (1, 0.020), (0, 0.020)]:
    policy.record(k, 4, seconds, steps=4)  # 10 ms a step at k >= 2, 5 ms at k <= 1
  policy.observe([90, 80, 70], [100] * 3)
  assert policy.choose(4) == 1
  policy.record(1, 4, 0.020, steps=4)  # 8 steps at k = 1, all told
  policy.record(1, 4, 0.040, steps=4, catch_up_of=1)  # its rows filled: 20 ms past 4 steps at 5
  policy.record(3, 4, 0.060, steps=4, catch_up_of=1)  # widened: 20 ms past 4 steps at 10, for k = 1's rows
  assert list(policy.seconds[1, 4]) == [(0.020, 4)] * 2 and list(policy.seconds[3, 4]) == [(0.040, 4)]
  assert policy.step_seconds(1, 4) == pytest.approx(0.005 + 0.040 / 12)  # 40 ms over 12 steps at k = 1
  assert policy.step_seconds(3, 4) == pytest.approx(0.010)
  assert policy.choose(4) == 3
  again = DraftPolicy.from_json(policy.to_json())
  assert again.step_seconds(1, 4) == policy.step_seconds(1, 4) and again.choose(4) == 3
  fresh = DraftPolicy(3)
  fresh.record(2, 4, 0.05, steps=4, catch_up_of=0)  # k = 2 not timed here yet: nothing to charge from
  assert not fresh.seconds and not fresh.catch_up_seconds


def test_requests_are_capped_where_a_narrower_width_wins_without_the_deeper_modules():
  """`cap`: a request admitted where a deferring width (2k < K), timed without catch-up charges,
  or a width timed with its requests capped there (`capped_seconds`), beats every width at its
  charged time is capped there (the deeper modules get none of its rows, so it pays for none);
  elsewhere, or before the bucket is timed, it may verify all K."""
  policy = DraftPolicy(3)
  assert policy.cap(4) == 3  # nothing timed at the bucket
  for k, seconds in [(3, 0.040), (2, 0.040), (1, 0.020), (0, 0.020)]:
    policy.record(k, 4, seconds, steps=4)  # 10 ms a step at k >= 2, 5 ms at k <= 1
  policy.observe([90, 80, 70], [100] * 3)
  policy.record(1, 4, 0.060, steps=4, catch_up_of=1)  # 40 ms of catch-up over k = 1's 8 steps
  assert policy.step_seconds(1, 4) == pytest.approx(0.010)
  assert policy.choose(4) == 3  # uncapped, k = 1 pays its catch-ups
  assert policy.cap(4) == 1 and policy.cap(1) == 3  # capped it pays none; bucket 1 is not timed
  policy.held = 1  # calibrate's uncapped requests at k = 1: the width is held, nothing capped
  assert policy.choose(4) == 1 and policy.cap(4) == 3 and policy.admits_drafting()
  policy.held = None
  for _ in range(3):
    policy.record(1, 4, 0.036, steps=4)  # k = 1 now takes 9 ms a step even without a catch-up
  assert policy.cap(4) == 3
  # A width that does not defer caps where its calls with the deeper modules idle win (k = 2 at
  # 7 ms a step capped, against 10 ms for k = 2 and 3 as uncapped requests run them).
  policy.record(2, 4, 0.028, steps=4, capped=True)
  assert policy.capped_seconds[2, 4] and policy.choose(4) == 3 and policy.cap(4) == 2
  policy.record(2, 4, 0.044, steps=4, capped=True)
  policy.record(2, 4, 0.044, steps=4, capped=True)  # now 11 ms a step capped: it no longer wins
  assert policy.cap(4) == 3


def test_a_measured_policy_round_trips_through_json_and_starts_a_served_engine(tmp_path):
  policy = DraftPolicy(K)
  policy.record(2, 3, 0.02, steps=4)
  policy.record(0, 1, 0.01)
  policy.record(1, 3, 0.01, steps=2, capped=True)
  policy.observe([5, 3, 1], [9, 9, 9])
  again = DraftPolicy.from_json(policy.to_json())
  assert again.seconds == policy.seconds and again.rates() == policy.rates()
  assert again.capped_seconds == policy.capped_seconds and list(again.capped_seconds) == [(1, 4)]
  assert again.choose(3) == policy.choose(3)
  with pytest.raises(ValueError, match="not a DraftPolicy's JSON"):
    DraftPolicy.from_json('{"max_drafts": 3}')
  path = tmp_path / "policy.json"
  path.write_text(policy.to_json())
  engine = Engine(TARGET5, PROPOSER5, **dict(SETTINGS, num_drafts="auto"))
  measured_policy(engine, str(path))  # `mtp-jax serve --draft-policy FILE`: read when FILE exists
  assert engine.policy.seconds == policy.seconds
  path.write_text(DraftPolicy(K + 1).to_json())
  with pytest.raises(ValueError, match="measured for K=4 drafts, the proposer has K=3"):
    measured_policy(engine, str(path))


def test_requests_admitted_where_drafts_do_not_pay_run_no_module():
  """Once drafts do not pay even for a request alone (all rejected), an "auto" request is admitted
  without drafting: its modules get no rows (no prefill, no catch-up) and its output is exact,
  greedy or seeded; every PROBE_REQUEST_EVERY-th such admission drafts, so acceptance is still
  measured, and is verified at width 1 until it has measured its drafts."""
  policy = DraftPolicy(K)
  assert policy.drafts_pay()  # nothing timed yet
  for b in (1, 2):
    for k in range(K + 1):
      policy.record(k, b, 1.0 + 0.3 * k)
  assert policy.drafts_pay()  # the prior: drafts pass until measured
  policy.observe([0] * K, [40] * K)
  assert not policy.drafts_pay()
  engine = Engine(TARGET5, PROPOSER5, max_batch=2, max_len=64, page_size=2, num_pages=40, num_drafts="auto",
                  draft_policy=policy, steps_per_call=1)
  greedy = [engine.add_request(p, 16) for p in ([1, 2, 3], [4, 0, 1, 1])]
  sampled = engine.add_request([2, 2, 4, 1], 16, temperature=1.0, seed=5)
  rows = []
  while engine.num_running or engine.num_waiting:
    engine.step()
    rows.append(int(engine._s.proposer.num_pos.max()))
  assert rows == [0] * len(rows) and policy.declined == 3
  assert not any(engine.requests[rid].stats["drafting"] for rid in [*greedy, sampled])
  for rid in greedy:
    assert engine.requests[rid].tokens == _alone(tuple(engine.requests[rid].prompt))[:16]
  assert engine.requests[sampled].tokens == mtp_jax.generate(TARGET5, None, [[2, 2, 4, 1]], 16, temperature=1.0,
                                                             seed=5).tokens[0]
  policy.declined = DraftPolicy.PROBE_REQUEST_EVERY - 1
  probe = engine.add_request([3, 1, 2], 16)
  engine.step()
  assert engine.requests[probe].probe and engine.requests[probe].drafting and int(engine._s.proposer.num_pos.max()) > 0
  # While the probe measures its drafts, every call verifies one, though k = 0 wins here.
  widths = [engine._step.settings.verify_width]
  while engine.num_running and policy.measuring(engine.requests[probe].drafts_verified):
    engine.step()
    widths.append(engine._step.settings.verify_width)
  assert len(widths) > 2 and set(widths) == {1}
  assert engine.run()[probe] == _alone((3, 1, 2))[:16]
  assert engine.requests[probe].drafts_verified > 0


def test_drafting_requests_stop_together_once_none_of_their_drafts_pays():
  """The pool says drafts pay (all accepted) and with 2-3 requests a step costs the same at every
  width, so all draft; alone, a step costs 1.9x with drafts, so a request whose own acceptance
  (blended with the pool over PRIOR_WEIGHT drafts) is below 0.9 does not pay even alone. While a
  request of a fixed num_drafts runs, the modules run anyway, so the "auto" ones keep drafting;
  after it, once each has verified K x PRIOR_WEIGHT drafts and none pays, they all stop for good
  (no module row or verified draft again, no module run), and every output stays exact."""
  policy = DraftPolicy(K)
  for k in range(K + 1):
    policy.record(k, 1, 1.0 + 0.9 * k)
    policy.record(k, 2, 1.0)
  policy.observe([1000] * K, [1000] * K)
  enough = K * DraftPolicy.PRIOR_WEIGHT
  assert policy.keeps_drafting(0, enough - 1) and policy.keeps_drafting(enough, enough)
  assert not policy.keeps_drafting(0, enough)
  engine = Engine(TARGET5, PROPOSER5, max_batch=3, max_len=64, page_size=2, num_pages=64, num_drafts="auto",
                  draft_policy=policy, steps_per_call=1)
  ids = [engine.add_request(p, LONGEST) for p in ([1, 2, 3], [4, 0, 1, 1])]
  fixed = engine.add_request([2, 2, 4, 1], 16, num_drafts=K)
  engine.step()
  failed = False  # whether the "auto" ones' drafts stopped paying while the fixed one ran
  while engine.requests[fixed].status == "running":
    assert all(engine.requests[rid].drafting for rid in ids)
    reqs = [engine.requests[rid] for rid in ids]
    failed |= not any(policy.keeps_drafting(r.drafts_accepted, r.drafts_verified) for r in reqs)
    engine.step()
  assert failed, "a request of acceptance 0.9 or more on a random 5-token model"
  engine.step()
  assert not any(engine.requests[rid].drafting for rid in ids)
  before = {rid: (engine.requests[rid].drafts_verified, int(engine._s.proposer.num_pos[engine.requests[rid].slot]))
            for rid in ids}
  engine.step()
  assert engine._step.settings.modules_idle  # no running request drafts: no module runs
  for rid in ids:
    req = engine.requests[rid]
    if req.status == "running":
      assert (req.drafts_verified, int(engine._s.proposer.num_pos[req.slot])) == before[rid]
  engine.run()
  for rid in [*ids, fixed]:
    req = engine.requests[rid]
    assert req.tokens == _alone(tuple(req.prompt))[:req.max_new_tokens]


def test_probe_requests_come_less_often_while_they_keep_failing():
  """Where drafts do not pay, every PROBE_REQUEST_EVERY-th declined admission is a probe; after
  each probe that stopped drafting the next waits twice as long (at most PROBE_BACKOFF_MAX
  doublings), and once drafts pay again the spacing is back to PROBE_REQUEST_EVERY."""
  policy = DraftPolicy(K)
  for k in range(K + 1):
    policy.record(k, 1, 1.0 + 0.3 * k)
  policy.observe([0] * K, [40] * K)
  every = DraftPolicy.PROBE_REQUEST_EVERY

  def probes(admissions):
    return [i for i in range(1, admissions + 1) if policy.admits_drafting() and policy.probe_admitted]

  assert probes(2 * every) == [every, 2 * every]
  policy.probes_failed = 1
  assert probes(4 * every) == [2 * every, 4 * every]  # 2 * every apart
  policy.probes_failed = 10
  assert len(probes(64 * every)) == 64 // (1 << DraftPolicy.PROBE_BACKOFF_MAX)
  policy.observe([400] * K, [400] * K)  # drafts pay again
  assert policy.admits_drafting() and policy.probes_failed == 0
