"""The continuous-batching engine: each request's greedy output equals generate on it alone."""

import functools
import time

import jax
import numpy as np
import pytest

import mtp_jax
from mtp_jax import Engine, grammar
from mtp_jax.serving.policy import DraftPolicy

from test_generate import K, PROPOSER5, TARGET5
from test_grammar_generate import (BOS, EOS, G, MAX_NEW, PATTERN, PROMPTS, PROPOSER, TARGET, VOCAB,
                                   _assert_matches)

# 3 slots but 40 pages of 2 rows: two requests of 14 and 12 pages hold 26, so a third of 15 waits
# for pages with a slot free, and a slot that finishes is refilled from the queue.
SETTINGS = dict(max_batch=3, max_len=64, page_size=2, num_pages=40, num_drafts=K)  # auto: its own test
LONGEST = 24


@functools.cache
def _alone(prompt: tuple[int, ...]) -> list[int]:
  """generate on one prompt by itself; shorter requests are its prefixes (greedy, no eos)."""
  return mtp_jax.generate(TARGET5, PROPOSER5, [list(prompt)], LONGEST, num_drafts=K).tokens[0]


def test_staggered_requests_equal_generate_alone_and_pages_come_back():
  engine = Engine(TARGET5, PROPOSER5, **SETTINGS)
  full = engine.free_pages()
  a = engine.add_request([1, 2, 3], 20)            # 14 pages
  b = engine.add_request([4, 0, 1, 2, 3, 4, 0, 1], 12)  # 12 pages
  gained = engine.step()
  assert set(gained) == {a, b} and engine.num_running == 2
  c = engine.add_request([3], LONGEST)             # 15 pages: 26 + 15 > 40, waits with a slot free
  engine.step()
  assert engine.requests[c].status == "waiting" and engine.num_running == 2
  d = engine.add_request([2, 2, 4, 1], 5)
  streamed = {}
  for rid, new in engine.stream():
    streamed.setdefault(rid, []).extend(new)
  for rid in (a, b, c, d):
    req = engine.requests[rid]
    want = _alone(tuple(req.prompt))[:req.max_new_tokens]
    assert req.status == "finished" and req.tokens == want
    assert req.stats["generated_tokens"] == len(want) and req.stats["verify_calls"] > 0
    assert req.stats["ttft_s"] > 0 and req.stats["tokens_per_s"] > 0
  assert streamed[c] == engine.requests[c].tokens  # c ran entirely inside the stream
  assert engine.free_pages() == full and engine.num_running == engine.num_waiting == 0


def test_the_page_span_follows_the_longest_request_and_outputs_stay_exact():
  """Decode steps read the first `span` pages of each slot: 256 rows' worth at least (4 pages of
  64), raised as a request grows past them and lowered once it has finished."""
  engine = Engine(TARGET5, PROPOSER5, max_batch=2, max_len=512, page_size=64, num_drafts=K)
  prompts = {engine.add_request([1, 2, 3] * 80, 40): [1, 2, 3] * 80, engine.add_request([4, 0, 1], 10): [4, 0, 1]}
  spans = []
  while engine.num_running or engine.num_waiting:
    engine.step()
    spans.append(engine.page_span)
  prompts[engine.add_request([2, 2], 8)] = [2, 2]
  engine.run()
  spans.append(engine.page_span)
  assert spans[0] == 4 and 6 in spans and spans[-1] == 4  # 240 + 40 + K + 1 rows need 5 pages: bucket 6
  for rid, prompt in prompts.items():
    req = engine.requests[rid]
    assert req.tokens == mtp_jax.generate(TARGET5, PROPOSER5, [prompt], req.max_new_tokens, num_drafts=K).tokens[0]


def test_cancel_frees_a_slot_and_leaves_the_others_exact():
  engine = Engine(TARGET5, PROPOSER5, **SETTINGS)
  keep = engine.add_request([1, 2, 3], 20)
  dropped = engine.add_request([4, 0, 1, 2, 3, 4, 0, 1], 12)
  queued = engine.add_request([3], LONGEST)
  engine.step()
  engine.cancel(queued)
  engine.cancel(dropped)
  assert engine.num_running == 1 and engine.num_waiting == 0
  out = engine.run()
  assert out[keep] == _alone((1, 2, 3))[:20]
  assert engine.requests[dropped].status == engine.requests[queued].status == "cancelled"
  assert out[queued] == [] and engine.free_pages() == SETTINGS["num_pages"]
  with pytest.raises(KeyError, match="request_id=99 is not a request"):
    engine.cancel(99)


def test_constrained_and_free_requests_equal_generate_alone_under_the_grammar():
  """A constrained request arriving while a free one runs: each equals generate on it alone with
  grammar=G and constrained=[True] / [False] (greedy)."""
  engine = Engine(TARGET, PROPOSER, max_batch=2, max_len=64, page_size=8, eos_token_id=EOS, grammar=G, num_drafts=K)
  free = engine.add_request(PROMPTS[1], MAX_NEW, constrained=False)
  engine.step()
  constrained = engine.add_request(PROMPTS[0], MAX_NEW)  # constrained by default
  out = engine.run()
  for rid, flag in ((constrained, True), (free, False)):
    want = mtp_jax.generate(TARGET, PROPOSER, [engine.requests[rid].prompt], MAX_NEW, num_drafts=K, eos_token_id=EOS,
                            grammar=G, constrained=[flag]).tokens[0]
    assert out[rid] == want
  _assert_matches([out[constrained]])


def test_one_token_request_ends_at_its_prefill():
  """max_new_tokens=1: the prefill's token is the whole output; no verify step is counted for it."""
  engine = Engine(TARGET5, PROPOSER5, **SETTINGS)
  one = engine.add_request([1, 2, 3], 1)
  out = engine.run()
  assert out[one] == _alone((1, 2, 3))[:1]
  stats = engine.requests[one].stats
  assert stats["verify_calls"] == 0 and stats["accepted_length"] != stats["accepted_length"]  # nan, as generate's
  assert engine.free_pages() == SETTINGS["num_pages"]


def test_metrics_deadlines_and_a_bounded_queue_return_every_page():
  """Mixed finish / cancel / timeout / refused-by-a-full-queue: counters add up, the Prometheus text
  carries them, and every slot and page comes back."""
  engine = Engine(TARGET5, PROPOSER5, **SETTINGS, max_waiting=2)
  done = engine.add_request([1, 2, 3], 12)
  late = engine.add_request([4, 0, 1], 20, deadline_s=1e-3)  # past its deadline at the first step
  with pytest.raises(mtp_jax.serving.QueueFull, match="max_waiting=2"):
    engine.add_request([3], 4)
  time.sleep(0.01)
  engine.step()
  assert engine.requests[late].status == "timed_out"
  dropped = engine.add_request([2, 2], LONGEST)
  engine.step()
  engine.cancel(dropped)
  engine.run()
  m = engine.metrics()
  assert engine.requests[done].tokens == _alone((1, 2, 3))[:12]
  assert (m["requests_finished_total"], m["requests_cancelled_total"], m["requests_running"]) == (1, 2, 0)
  assert m["tokens_generated_total"] == sum(len(r.tokens) for r in engine.requests.values())
  assert m["verify_steps_total"] == sum(r.verify_calls for r in engine.requests.values()) > 0
  assert m["drafts_proposed_total"] == sum(m["drafts_proposed_at"]) <= K * m["verify_steps_total"]
  assert all(a <= p for a, p in zip(m["drafts_accepted_at"], m["drafts_proposed_at"]))
  assert m["drafts_accepted_total"] == sum(m["drafts_accepted_at"]) > 0
  assert m["pages_in_use"] == 0 and engine.free_pages() == SETTINGS["num_pages"] and engine.num_running == 0
  assert m["ttft_seconds_p50"] > 0 and m["itl_seconds_p99"] >= m["itl_seconds_p50"] >= 0
  text = mtp_jax.serving.prometheus_text(m)
  assert "# TYPE mtp_jax_requests_finished_total counter\nmtp_jax_requests_finished_total 1\n" in text
  assert 'mtp_jax_drafts_accepted_at{position="1"} ' in text and 'mtp_jax_ttft_seconds{quantile="0.99"}' in text
  assert m["steps_at_width"] == [0] * K + [m["steps_total"]]  # a fixed k=K engine verifies K drafts a call
  assert 'mtp_jax_steps_at_width{width="0"} 0\n' in text
  assert f'mtp_jax_steps_at_width{{width="{K}"}} {m["steps_total"]}\n' in text
  # An ended request's record can go (a server keeps only live ones); the counters keep it.
  assert m["requests_recorded"] == 3  # the one the full queue refused was never recorded
  assert engine.forget(done).tokens == _alone((1, 2, 3))[:12] and done not in engine.requests
  assert engine.metrics()["requests_recorded"] == 2
  with pytest.raises(KeyError, match=f"request_id={done}"):
    engine.forget(done)
  assert engine.metrics()["tokens_generated_total"] == m["tokens_generated_total"]
  assert engine.metrics()["requests_finished_total"] == 1
  live = engine.add_request([1], 4)
  with pytest.raises(ValueError, match="still waiting"):
    engine.forget(live)


def _alone_in_engine(prompt, max_new_tokens, **settings) -> list[int]:
  engine = Engine(TARGET5, PROPOSER5, **SETTINGS)
  rid = engine.add_request(prompt, max_new_tokens, **settings)
  return engine.run()[rid]


def test_mixed_settings_each_request_as_if_alone():
  """Greedy, seeded sampled and undrafted requests side by side, admitted at different times: a
  greedy one equals generate alone (with or without drafts); a sampled one with a seed gives the
  tokens it gives in an engine of its own (per-request key streams, one compiled step)."""
  sampled = dict(temperature=1.5, top_k=4, seed=7)
  nucleus = dict(temperature=0.9, top_p=0.9, seed=3, num_drafts=1)
  engine = Engine(TARGET5, PROPOSER5, **SETTINGS)
  a = engine.add_request([1, 2, 3], 20)
  b = engine.add_request([4, 0, 1], 16, **sampled)
  engine.step()
  c = engine.add_request([2, 2, 4, 1], 12, num_drafts=0)
  d = engine.add_request([3], 10, **nucleus)
  out = engine.run()
  assert out[a] == _alone((1, 2, 3))[:20]
  assert out[c] == _alone((2, 2, 4, 1))[:12]
  assert engine.requests[c].stats["accepted_length"] == 1.0  # drafted for, never verified
  assert out[b] == _alone_in_engine([4, 0, 1], 16, **sampled) != _alone((4, 0, 1))[:16]
  assert out[d] == _alone_in_engine([3], 10, **nucleus)
  assert engine.free_pages() == SETTINGS["num_pages"] and engine.num_running == 0


def test_a_long_prompt_is_written_in_parts_between_the_running_steps():
  """prefill_chunk=8: a 21-token prompt arriving while another request decodes is written in
  three parts, one per step(), and the running request gains tokens at each of them; both equal
  generate alone, and every page comes back."""
  engine = Engine(TARGET5, PROPOSER5, **SETTINGS, prefill_chunk=8)
  running = engine.add_request([1, 2, 3], 24)
  engine.step()
  long_prompt = [4, 0, 1, 2, 3, 4, 2] * 3
  late = engine.add_request(long_prompt, 12)
  gains = []
  while not engine.requests[late].tokens:
    gains.append(len(engine.step().get(running, [])))
  assert len(gains) == 3 and all(gains)  # parts of 8, 8, then the last 5 with the first token
  out = engine.run()
  assert out[running] == _alone((1, 2, 3))[:24]
  assert out[late] == mtp_jax.generate(TARGET5, PROPOSER5, [long_prompt], 12, num_drafts=K).tokens[0]
  assert engine.free_pages() == SETTINGS["num_pages"] and engine.num_running == 0


def test_end_tokens_per_request():
  """eos_token_ids cuts a request at the first of its end tokens (kept), its neighbour runs on."""
  want = _alone((1, 2, 3))[:20]
  stop = want[5]
  engine = Engine(TARGET5, PROPOSER5, **SETTINGS)
  cut = engine.add_request([1, 2, 3], 20, eos_token_ids=[stop])
  full = engine.add_request([1, 2, 3], 20)
  out = engine.run()
  assert out[cut] == want[:want.index(stop) + 1] and out[full] == want


def test_grammars_per_request_come_and_go():
  """Three grammars, two at a time: the union is rebuilt when a third arrives (the finished one's
  grammar dropped, the running one's states renumbered) and each request equals generate alone
  under its own grammar."""
  g2 = grammar.from_regex(r"[0-9]{1,2}(,[0-9]{1,3}){2,4}", VOCAB, eos_token_id=EOS)
  g3 = grammar.from_regex(r"(12|,3|007)+", VOCAB, eos_token_id=EOS)
  engine = Engine(TARGET, PROPOSER, max_batch=2, max_len=64, page_size=8, eos_token_id=EOS, grammar=G, num_drafts=K)
  short = engine.add_request(PROMPTS[0], 3)  # the engine's grammar, by default
  long = engine.add_request(PROMPTS[1], MAX_NEW, grammar=g2)
  while engine.requests[short].status == "running" or engine.requests[short].status == "waiting":
    engine.step()
  third = engine.add_request(PROMPTS[2], MAX_NEW, grammar=g3)
  engine.step()
  assert engine.requests[long].status == "running" and engine._grammars.grammars == [g2, g3]
  out = engine.run()
  for rid, g in ((short, G), (long, g2), (third, g3)):
    req = engine.requests[rid]
    want = mtp_jax.generate(TARGET, PROPOSER, [req.prompt], req.max_new_tokens, num_drafts=K, eos_token_id=EOS,
                            grammar=g).tokens[0]
    assert out[rid] == want, rid


class _ScriptedWidths(DraftPolicy):
  """A DraftPolicy that picks the widths of a script (long runs at 0 among them) and keeps every
  request drafting, whatever it measured."""

  def __init__(self, widths):
    super().__init__(K)
    self.widths = iter(widths)

  def choose(self, num_running, scales=None, probing=False):
    return next(self.widths, K)

  def drafts_pay(self, scale=1.0):  # every request drafts, admitted or running
    return True


def _width_history(seed: int) -> list[int]:
  """A random width history: width 1 while two requests are admitted (a prefill over lagging
  slots), a long run at 0, then runs of 1..4 calls at each width (each at least three times) in a
  random order, with another long run at 0 among them."""
  rng = np.random.default_rng(seed)
  widths = [0, 1, 2, K] * 3 + [int(w) for w in rng.integers(0, K + 1, 6)]
  rng.shuffle(widths)
  runs = [[w] * int(rng.integers(1, 5)) for w in widths]
  runs.insert(int(rng.integers(1, len(runs))), [0] * 8)
  return [1, 1, 1] + [0] * 6 + [w for run in runs for w in run]


@pytest.mark.slow
@pytest.mark.parametrize("deferred_rows, seed", [(32, 0), (3, 1)])
def test_module_work_follows_the_width_and_drafts_stay_exact(deferred_rows, seed):
  """Under "auto" a call at width k with 2k < K runs modules 0..k-1 only: the deeper modules'
  rows wait (`Deferred`, up to deferred_rows per slot) and they catch up on them all in one call
  when a wider step needs them or the rows would not fit (3: often); a wider call first catches
  up, then runs every module over its rows; a call that the counts read before it show needs no
  catch-up does not check for one.
  Over a random width history with long runs at 0 (`_width_history`), each step's drafts equal
  those of an engine whose every module consumes every row at once (deferred_rows=0, the
  property-tested catch-up), every greedy request equals generate alone and the seeded sampled
  one plain sampling with its seed."""
  script = _width_history(seed)
  engines = [Engine(TARGET5, PROPOSER5, max_batch=3, max_len=64, page_size=2, num_pages=64,
                    draft_policy=_ScriptedWidths(script), steps_per_call=1, deferred_rows=rows)
             for rows in (0, deferred_rows)]
  ref, engine = engines
  widths, waiting, checked = [], [], []
  while not widths or engine.num_running or engine.num_waiting:
    if len(widths) == 3:  # two admitted at once: a prefill over every slot, the first one's lagging
      for e in engines:
        ids = [e.add_request([1, 2, 3], 20), e.add_request([4, 0, 1], 20)]
    for e in engines:
      if not widths:
        sampled = e.add_request([2, 2, 4, 1], 20, temperature=1.0, seed=5)
      e.step()
    width = engine.metrics()["verify_width"]
    assert ref.metrics()["verify_width"] == width
    live = ~np.asarray(engine._s.done)
    np.testing.assert_array_equal(np.asarray(engine._s.drafts)[live], np.asarray(ref._s.drafts)[live])
    checked.append(engine._step.settings.may_catch_up)  # whether the call's steps check for a catch-up
    widths.append(width)
    waiting.append(int(max(engine._s.deferred.n)))  # rows the deepest module has not consumed
  assert set(widths) == {0, 1, 2, K}
  # The host rules out a catch-up from the counts it read, at a deferring width (1) or a wider one,
  # and the steps then do not check (the drafts above equal the reference's all the same).
  assert {(c, w >= 2) for c, w in zip(checked, widths) if w} >= {(True, True), (False, True), (False, False)}
  assert 0 < max(waiting) <= deferred_rows
  # Every catch-up is counted on device, and its call's time is charged to a width that waited.
  assert int(engine._s.deferred.catch_ups) > 0 and set(engine.policy.catch_up_seconds) <= {(0, 4), (1, 4)}
  # Rows wait while drafts are made: the deeper modules lag behind steps at width 1, never
  # after one at width 2 (2k >= K: it runs them).
  assert any(w == 1 and n > 0 for w, n in zip(widths, waiting))
  assert all(n == 0 for w, n in zip(widths, waiting) if w >= 2)
  for rid in ids:
    assert engine.requests[rid].tokens == _alone(tuple(engine.requests[rid].prompt))[:20]
  assert engine.requests[sampled].tokens == mtp_jax.generate(TARGET5, None, [[2, 2, 4, 1]], 20, temperature=1.0,
                                                             seed=5).tokens[0]
  m = engine.metrics()
  assert m["drafts_accepted_total"] > 0 and m["drafts_proposed_at"][0] < m["verify_steps_total"]


class _Capping(_ScriptedWidths):
  """A scripted policy that caps the first requests admitted at `caps`, the later ones at K."""

  def __init__(self, widths, caps):
    super().__init__(widths)
    self.caps = iter(caps)

  def cap(self, num_running):
    return next(self.caps, K)


@pytest.mark.parametrize("steps_per_call", [1, 3])
def test_requests_capped_at_a_narrow_width_keep_no_rows_and_stay_exact(steps_per_call):
  """Two requests capped at width 1 at their admission (`DraftPolicy.cap`), then an uncapped one
  under widths 1 and K in turns: the capped slots' prefill runs module 0 only, their rows never
  wait for the deeper modules (no catch-up for them) while the uncapped slot's do, each step's
  drafts up to each slot's cap equal those of an engine that defers nothing, and every request
  equals generate alone."""
  engines = [Engine(TARGET5, PROPOSER5, max_batch=3, max_len=64, page_size=2, num_pages=64,
                    draft_policy=_Capping([1, 1, K] * 30, caps=[1, 1]), steps_per_call=steps_per_call,
                    deferred_rows=rows) for rows in (0, 32)]
  ref, engine = engines
  for e in engines:
    ids = [e.add_request([1, 2, 3], 20), e.add_request([4, 0, 1], 20)]
    e.step()
    ids.append(e.add_request([2, 2, 4, 1], 20))
  caps = {engine.requests[rid].slot: engine.requests[rid].cap for rid in ids[:2]}
  assert list(caps.values()) == [1, 1] and engine.metrics()["verify_width"] == 1
  # Their prefill and steps ran module 0 alone: the deeper modules hold no row of theirs.
  lengths_KxB = np.asarray(engine._s.proposer.lengths)
  assert all(lengths_KxB[0, b] > 0 and not lengths_KxB[1:, b].any() for b in caps)
  waited = []
  while engine.num_running or engine.num_waiting:
    for e in engines:
      e.step()
    assert ref.metrics()["verify_width"] == engine.metrics()["verify_width"]
    live = ~np.asarray(engine._s.done)
    cap_B = np.asarray(engine._s.slots.num_drafts)
    for b in np.flatnonzero(live):
      np.testing.assert_array_equal(np.asarray(engine._s.drafts)[b, :cap_B[b]], np.asarray(ref._s.drafts)[b, :cap_B[b]])
    n_B = np.asarray(engine._s.deferred.n)
    assert all(n_B[b] == 0 for b in caps)
    waited.append(int(n_B.max()))
  assert max(waited) > 0  # the uncapped slot's rows waited at width 1
  for rid in ids:
    assert engine.requests[rid].tokens == _alone(tuple(engine.requests[rid].prompt))[:20]


def test_calls_whose_requests_are_all_capped_at_their_width_run_no_deeper_module():
  """Two requests capped at K - 1 (a width that does not defer: `DraftPolicy.cap`) and a fixed
  num_drafts=K - 1 one: their calls run modules 0..K-2 only (`deeper_idle`), so the last module
  holds no row of theirs, and their timings go to `capped_seconds`; an uncapped request admitted
  later turns it off (the deeper module catches up on its rows). Each step's drafts up to each
  slot's cap equal those of an engine that keeps every module current, and every request equals
  generate alone."""
  engines = [Engine(TARGET5, PROPOSER5, max_batch=4, max_len=64, page_size=2, num_pages=64,
                    draft_policy=_Capping([K - 1, K] * 30, caps=[K - 1, K - 1]), steps_per_call=2,
                    deferred_rows=rows) for rows in (0, 32)]
  ref, engine = engines
  for e in engines:
    ids = [e.add_request([1, 2, 3], 20), e.add_request([4, 0, 1], 20), e.add_request([3, 1], 16, num_drafts=K - 1)]
    e.step()
  assert engine._step.settings.deeper_idle and engine.metrics()["verify_width"] == K - 1
  for e in engines:
    e.step()
  assert engine.policy.capped_seconds and not engine.policy.seconds
  lengths_KxB = np.asarray(engine._s.proposer.lengths)
  slots = [engine.requests[rid].slot for rid in ids]
  assert all(lengths_KxB[K - 2, b] > 0 and not lengths_KxB[K - 1, b].any() for b in slots)
  for e in engines:
    e.step()
    ids.append(e.add_request([2, 2, 4, 1], 20))
  idle = []
  while engine.num_running or engine.num_waiting:
    for e in engines:
      e.step()
    idle.append(engine._step.settings.deeper_idle)
    live = ~np.asarray(engine._s.done)
    cap_B = np.asarray(engine._s.slots.num_drafts)
    for b in np.flatnonzero(live):
      np.testing.assert_array_equal(np.asarray(engine._s.drafts)[b, :cap_B[b]], np.asarray(ref._s.drafts)[b, :cap_B[b]])
  assert not all(idle)  # the uncapped request ran the deeper module
  for rid in ids:
    req = engine.requests[rid]
    assert req.tokens == _alone(tuple(req.prompt))[:req.max_new_tokens], rid


def test_steps_where_no_request_drafts_run_no_module():
  """While every running request verifies no drafts a step runs no module (`modules_idle`: the
  proposer's state passes through); a drafting request admitted later drafts from its own
  prefill on, and every request equals generate alone."""
  engine = Engine(TARGET5, PROPOSER5, max_batch=2, max_len=64, page_size=2, num_pages=64, steps_per_call=1)
  plain = engine.add_request([1, 2, 3], 16, num_drafts=0)
  engine.step()
  assert engine._step.settings.modules_idle and engine._step.settings.verify_width == 0
  with pytest.raises(ValueError, match="modules_idle.*verify_drafts=0, got 1"):
    engine._step.replace(verify_drafts=1)
  drafting = engine.add_request([4, 0, 1], 16)
  engine.step()
  assert not engine._step.settings.modules_idle
  engine.run()
  for rid in (plain, drafting):
    req = engine.requests[rid]
    assert req.tokens == _alone(tuple(req.prompt))[:16], rid
  assert engine.requests[drafting].drafts_verified > 0 and engine.requests[plain].drafts_verified == 0


def test_engine_config_is_typed_and_fields_override_it():
  """Engine(t, p, EngineConfig(...), **fields): the fields override the config's; an unknown field
  or a config of another type is refused by name."""
  config = mtp_jax.serving.EngineConfig(**SETTINGS)
  engine = Engine(TARGET5, PROPOSER5, config, max_batch=2)
  assert (engine.config.max_batch, engine.config.max_len, engine.max_batch) == (2, 64, 2)
  assert config.max_batch == 3  # frozen: the caller's config is not changed
  rid = engine.add_request([1, 2, 3], 12)
  assert engine.run()[rid] == _alone((1, 2, 3))[:12]
  with pytest.raises(TypeError, match="max_batchh"):
    Engine(TARGET5, PROPOSER5, config, max_batchh=2)
  with pytest.raises(TypeError, match="config") as e:
    Engine(TARGET5, PROPOSER5, dict(SETTINGS))
  assert e.value.argument == "config"


def test_auto_width_changes_and_greedy_output_stays_exact():
  """num_drafts="auto" (the default with a proposer) tries each width while it measures: the width
  changes from call to call, and every request still equals generate alone."""
  engine = Engine(TARGET5, PROPOSER5, max_batch=2, max_len=64, page_size=2, num_pages=40)
  assert engine.num_drafts == "auto"
  ids = [engine.add_request(p, 20) for p in ([1, 2, 3], [4, 0, 1], [2, 2, 4, 1])]
  jax.clear_caches()  # so the first decode call builds its program
  engine.step()
  assert not engine.policy.seconds  # a call that built a program is not a sample of the step's time
  widths = {engine.metrics()["verify_width"]}
  while engine.num_running or engine.num_waiting:
    engine.step()
    widths.add(engine.metrics()["verify_width"])
  assert len(widths) >= 2 and widths <= set(range(K + 1))
  at_width = engine.metrics()["steps_at_width"]  # every call counted once, at the width it verified
  assert sum(at_width) == engine.metrics()["steps_total"] and {k for k, n in enumerate(at_width) if n} == widths
  for rid in ids:
    assert engine.requests[rid].tokens == _alone(tuple(engine.requests[rid].prompt))[:20]
  m = engine.metrics()
  assert m["drafts_proposed_total"] < K * m["verify_steps_total"]  # some steps verified fewer than K
  # An engine built again takes the first one's step times and acceptance: with every width timed
  # at one running request (a width the first engine left untried is given a slow time here), its
  # first call picks the fastest at once, instead of trying each width.
  for k in range(K + 1):
    if (k, 1) not in engine.policy.seconds:
      engine.policy.record(k, 1, 1.0)
  again = Engine(TARGET5, PROPOSER5, max_batch=2, max_len=64, page_size=2, num_pages=40, draft_policy=engine.policy)
  rid = again.add_request([1, 2, 3], 20)
  rate = engine.policy.rates()  # kept too: the first engine's measured rates
  gain = lambda k: (1 + sum(rate[:k])) / engine.policy.step_seconds(k, 1)
  again.step()
  assert again.metrics()["verify_width"] == max(range(K + 1), key=gain)
  assert again.run()[rid] == _alone((1, 2, 3))[:20]


class TestErrors:

  def test_request_longer_than_the_engine_limit(self):
    engine = Engine(TARGET5, PROPOSER5, **SETTINGS)
    with pytest.raises(ValueError, match=r"len\(prompt\)=40 \+ max_new_tokens=30 \+ K \+ 1 = 74 > max_len=64"):
      engine.add_request([1] * 40, 30)
    with pytest.raises(ValueError, match="prompt is empty"):
      engine.add_request([], 3)
    with pytest.raises(ValueError, match="outside 0..vocab_size-1=4"):
      engine.add_request([7], 3)
    with pytest.raises(ValueError, match="constrained=True needs a grammar") as e:
      engine.add_request([1], 3, constrained=True)
    assert e.value.argument == "constrained"
    with pytest.raises(TypeError, match="constrained must be a bool"):
      engine.add_request([1], 3, constrained="yes")
    assert engine.num_waiting == 0

  def test_deadline_and_queue_bound(self):
    with pytest.raises(ValueError, match=r"max_waiting must be an int in 0\.\.\d+, got -1"):
      Engine(TARGET5, PROPOSER5, **SETTINGS, max_waiting=-1)
    engine = Engine(TARGET5, PROPOSER5, **SETTINGS)
    with pytest.raises(ValueError, match="deadline_s") as e:
      engine.add_request([1], 3, deadline_s=0)
    assert e.value.argument == "deadline_s" and engine.num_waiting == 0

  def test_prompt_of_the_wrong_type(self):
    engine = Engine(TARGET5, PROPOSER5, **SETTINGS)
    for bad in (None, "abc", [1.5, 2.0], [[1, 2]]):
      with pytest.raises(TypeError, match="prompt must be a") as e:
        engine.add_request(bad, 4)
      assert e.value.argument == "prompt"
    assert engine.num_waiting == 0

  def test_per_request_settings(self):
    engine = Engine(TARGET, PROPOSER, max_batch=2, max_len=64, page_size=8, eos_token_id=EOS, grammar=G, num_drafts=K)
    other_eos = grammar.from_regex(PATTERN, VOCAB, eos_token_id=BOS)
    for kwargs, name, match in (
        (dict(temperature=-1.0), "temperature", "temperature must be"), (dict(top_p=0.0), "top_p", "top_p must be"),
        (dict(top_k=0), "top_k", "top_k must be"), (dict(seed=-1), "seed", "seed must be"),
        (dict(num_drafts=K + 1), "num_drafts", f"num_drafts must be an int in 0..{K}"),
        (dict(num_drafts="most"), "num_drafts", "num_drafts must be an int"),
        (dict(eos_token_ids=[99]), "eos_token_ids[0]", "eos_token_ids\\[0\\] must be"),
        (dict(eos_token_ids=list(range(9))), "eos_token_ids", "at most 8 end tokens"),
        (dict(eos_token_ids=3), "eos_token_ids", "must be a list of token ids"),
        (dict(grammar="x"), "grammar", "grammar must be"),
        (dict(grammar=other_eos), "grammar", f"grammar's eos_token_id={BOS} differs")):
      with pytest.raises((ValueError, TypeError), match=match) as e:
        engine.add_request([1], 3, **kwargs)
      assert e.value.argument == name, kwargs
    relaxed = Engine(TARGET5, PROPOSER5, **SETTINGS, relaxed=(2, 0.1))
    with pytest.raises(ValueError, match="a relaxed engine's requests are greedy"):
      relaxed.add_request([1], 3, temperature=0.5)
    with pytest.raises(ValueError, match=r"draft_policy serves num_drafts=\"auto\" with a proposer of K=3 drafts"):
      Engine(TARGET5, PROPOSER5, **dict(SETTINGS, draft_policy=DraftPolicy(K)))  # SETTINGS: num_drafts=K
    with pytest.raises(ValueError, match="got max_drafts=2"):
      Engine(TARGET5, PROPOSER5, **dict(SETTINGS, num_drafts="auto", draft_policy=DraftPolicy(2)))
    with pytest.raises(TypeError, match="draft_policy must be a mtp_jax.serving.DraftPolicy, got dict"):
      Engine(TARGET5, PROPOSER5, **dict(SETTINGS, num_drafts="auto", draft_policy={}))
    with pytest.raises(ValueError, match='num_drafts="auto" needs an engine with a proposer'):
      Engine(TARGET5, None, max_len=64, page_size=2).add_request([1], 3, num_drafts="auto")
    assert engine.num_waiting == relaxed.num_waiting == 0

  def test_grammar_needs_its_eos(self):
    with pytest.raises(ValueError, match="a grammar ends sequences with eos: pass eos_token_id") as e:
      Engine(TARGET, PROPOSER, max_len=64, page_size=8, grammar=G)
    assert e.value.argument == "eos_token_id"

  def test_paging_arguments(self):
    with pytest.raises(ValueError, match="page_size=6 must divide max_len=64"):
      Engine(TARGET5, PROPOSER5, max_len=64, page_size=6)
    with pytest.raises(ValueError, match="num_pages=7 is too small for one sequence"):
      Engine(TARGET5, PROPOSER5, max_len=64, page_size=8, num_pages=7)


def test_each_request_reports_its_acceptance():
  engine = Engine(TARGET5, PROPOSER5, **SETTINGS)  # SETTINGS: num_drafts=K
  ids = [engine.add_request(p, 12) for p in ([1, 2, 3], [4, 0])]
  engine.run()
  for rid in ids:
    st = engine.requests[rid].stats
    assert st["drafts_verified"] == K * st["verify_calls"] and 0 <= st["drafts_accepted"] <= st["drafts_verified"]
    assert st["acceptance"] == st["drafts_accepted"] / st["drafts_verified"]
  m = engine.metrics()
  want = np.quantile([engine.requests[rid].stats["acceptance"] for rid in ids], 0.5)
  assert m["request_acceptance_p50"] == pytest.approx(want)
  assert 'mtp_jax_request_acceptance{quantile="0.5"}' in mtp_jax.serving.prometheus_text(m)
