"""The soak's short form (benchmarks/soak.py --quick): `mtp-jax serve` in a subprocess under a mixed
load with injected client faults for 8 s, then its invariants; and the schema guard it relies on."""

import asyncio
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import soak  # noqa: E402
from mtp_jax import data, grammar, validate  # noqa: E402
from mtp_jax.serving.model import MAX_WIDE_REPEAT, SchemaGrammars, ServedModel, wide_repeats  # noqa: E402


@pytest.mark.slow
def test_a_short_soak_loses_nothing_and_leaks_nothing():
  r = soak.run(soak.QUICK, log=lambda _: None)
  # Each broken expectation is one line: a greedy / seeded answer unlike generate alone, a fault
  # answered with another status or without an OpenAI error body, any 5xx, a traceback in the
  # server's log, pages or records left after the load, an unclean exit on SIGTERM.
  assert r["problems"] == []
  assert r["pages_in_use"] == 0 and r["requests_recorded"] == 0 and r["exit_code"] == 0
  assert not [s for s in r["statuses"] if s >= 500 or s < 0]
  assert r["threads"][1] <= r["threads"][0] + 4, r["threads"]
  kinds = r["kinds"]
  # The faults were injected and met: each kind at least once, answered as due.
  for kind, status in [("malformed", 400), ("oversized", 413), ("too_long", 400), ("over_limit", 400),
                       ("greedy", 200), ("greedy_stream", 200), ("seeded", 200), ("stop", 200),
                       ("schema", 200), ("at_limit", 200), ("slow", 200)]:
    assert kinds[kind, status] >= 1, (kind, status, kinds)
  assert kinds["burst", 429] >= 1, kinds  # a burst overfilled the waiting queue
  assert kinds["disconnect", 0] + kinds["disconnect_early", 0] >= 1, kinds
  # Each hang-up after the first event cancelled its running request (one before the answer may
  # come before the request was queued: then there is nothing to cancel, and nothing leaks either).
  assert r["cancelled"] >= kinds["disconnect", 0], r


def test_a_schema_that_repeats_a_wide_class_past_the_bound_is_refused_before_building():
  assert wide_repeats('"([^"\\\\]|\\\\.){%d,}"' % (MAX_WIDE_REPEAT + 1))  # a string's minLength, as outlines writes it
  assert wide_repeats(".{50}") == [".{50}"] and wide_repeats("[^a]{3,40}") == ["[^a]{3,40}"]
  assert not wide_repeats("a{1000}") and not wide_repeats("[0-9]{0,15}") and not wide_repeats("\\.{40}")
  assert not wide_repeats("[^a]{%d}" % MAX_WIDE_REPEAT)
  model = ServedModel(name="m", target=None, proposer=None, encode=None, decode=None, eos_token_id=data.EOS_ID,
                      vocab=grammar.byte_vocab())
  grammars = SchemaGrammars(model, timeout_s=30)
  with pytest.raises(validate.InvalidValue, match="minLength / maxLength over") as e:
    asyncio.run(grammars.get('{"minLength": 100000, "type": "string"}'))  # else: minutes and gigabytes
  assert e.value.argument == "response_format"
  assert asyncio.run(grammars.get('{"enum": ["red", "blue"], "type": "string"}')).num_states > 1
