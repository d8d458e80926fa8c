"""The continuous-batching engine: each request's greedy output equals generate on it alone."""

import functools
import time

import pytest

import mtp_jax
from mtp_jax import Engine

from test_generate import K, PROPOSER5, TARGET5
from test_grammar_generate import EOS, G, MAX_NEW, PROMPTS, PROPOSER, TARGET, _assert_matches

# 3 slots but 40 pages of 2 rows: two requests of 14 and 12 pages hold 26, so a third of 15 waits
# for pages with a slot free, and a slot that finishes is refilled from the queue. The pages
# attention reads (the budget) follow the pages in flight up from 16 and down again.
SETTINGS = dict(max_batch=3, max_len=64, page_size=2, num_pages=40)
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
  streamed, budgets = {}, []
  for rid, new in engine.stream():
    streamed.setdefault(rid, []).extend(new)
    budgets.append(engine.page_budget)
  for rid in (a, b, c, d):
    req = engine.requests[rid]
    want = _alone(tuple(req.prompt))[:req.max_new_tokens]
    assert req.status == "finished" and req.tokens == want
    assert req.stats["generated_tokens"] == len(want) and req.stats["verify_calls"] > 0
    assert req.stats["ttft_s"] > 0 and req.stats["tokens_per_s"] > 0
  assert streamed[c] == engine.requests[c].tokens  # c ran entirely inside the stream
  assert engine.free_pages() == full and engine.num_running == engine.num_waiting == 0
  assert max(budgets) > 16 and budgets[-1] < max(budgets)  # up with the pages in flight, and down again


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
  engine = Engine(TARGET, PROPOSER, max_batch=2, max_len=64, page_size=8, eos_token_id=EOS, grammar=G)
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
  assert m["drafts_proposed_total"] == K * m["verify_steps_total"]
  assert m["drafts_accepted_total"] == sum(m["drafts_accepted_at"]) > 0
  assert m["pages_in_use"] == 0 and engine.free_pages() == SETTINGS["num_pages"] and engine.num_running == 0
  assert m["ttft_seconds_p50"] > 0 and m["itl_seconds_p99"] >= m["itl_seconds_p50"] >= 0
  text = mtp_jax.serving.prometheus_text(m)
  assert "# TYPE mtp_jax_requests_finished_total counter\nmtp_jax_requests_finished_total 1\n" in text
  assert 'mtp_jax_drafts_accepted_at{position="1"} ' in text and 'mtp_jax_ttft_seconds{quantile="0.99"}' in text


class TestErrors:

  def test_request_longer_than_the_engine_limit(self):
    engine = Engine(TARGET5, PROPOSER5, **SETTINGS)
    with pytest.raises(ValueError, match=r"len\(prompt\)=40 \+ max_new_tokens=30 \+ k \+ 1 = 74 > max_len=64"):
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

  def test_grammar_needs_its_eos(self):
    with pytest.raises(ValueError, match="a grammar ends sequences with eos: pass eos_token_id") as e:
      Engine(TARGET, PROPOSER, max_len=64, page_size=8, grammar=G)
    assert e.value.argument == "eos_token_id"

  def test_paging_arguments(self):
    with pytest.raises(ValueError, match="page_size=6 must divide max_len=64"):
      Engine(TARGET5, PROPOSER5, max_len=64, page_size=6)
    with pytest.raises(ValueError, match="num_pages=7 is too small for one sequence"):
      Engine(TARGET5, PROPOSER5, max_len=64, page_size=8, num_pages=7)
