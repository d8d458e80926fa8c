"""Seeded sampling that speculation cannot change: under Gumbel acceptance a seeded request's tokens
are exactly those of plain sampling (`generate(target, None, ...)`) with the same seed, whatever
the drafts, their number, the tree, the paging, the batch, the neighbours or the admission step."""

import functools

import pytest

import mtp_jax
from mtp_jax import Engine
from mtp_jax.tree import TreeSpec

from test_generate import K, PROPOSER5, TARGET5

NEW = 20
PROMPT = [1, 2, 3, 4]
SEED = 11
SETTINGS = [dict(temperature=1.0), dict(temperature=0.7, top_p=0.9), dict(temperature=1.3, top_k=3)]


@functools.cache
def _plain(prompt: tuple[int, ...], seed: int, settings: tuple) -> list[int]:
  return mtp_jax.generate(TARGET5, None, [list(prompt)], NEW, seed=seed, **dict(settings)).tokens[0]


def plain(prompt=PROMPT, seed=SEED, **settings) -> list[int]:
  return _plain(tuple(prompt), seed, tuple(sorted(settings.items())))


@pytest.mark.parametrize("settings", SETTINGS, ids=["t1", "top_p", "top_k"])
def test_generate_equals_plain_sampling_for_every_k_tree_and_paging(settings):
  """Row 0 of a batch draws with row_key(seed, 0), as a lone prompt does: its tokens are plain
  sampling's for k = 1..K, a tree, dense or paged caches, next to another prompt."""
  want = plain(**settings)
  runs = {f"k={k}": dict(num_drafts=k) for k in range(1, K + 1)}
  runs.update(tree=dict(tree=TreeSpec((2, 2))), paged=dict(page_size=8), tree_paged=dict(tree=TreeSpec((3, 1)),
                                                                                          page_size=8))
  accepted = 0
  for name, kwargs in runs.items():
    out = mtp_jax.generate(TARGET5, PROPOSER5, [PROMPT, [0, 4]], NEW, seed=SEED, **settings, **kwargs)
    assert out.tokens[0] == want, name
    accepted += out.stats["accepted_tokens"]
  assert accepted > 0  # drafts were kept, so the equality is not that of undrafted decoding


def test_rows_of_a_batch_are_their_own():
  """Prompt i of a batch draws with row_key(seed, i): the same prompt in rows 0 and 1 samples two
  different continuations, each independent of the other rows."""
  out = mtp_jax.generate(TARGET5, PROPOSER5, [PROMPT, PROMPT, [3]], NEW, temperature=1.0, seed=SEED).tokens
  again = mtp_jax.generate(TARGET5, PROPOSER5, [PROMPT, PROMPT], NEW, temperature=1.0, seed=SEED).tokens
  assert out[0] == plain(temperature=1.0) and out[:2] == again and out[0] != out[1]


def _engine_run(max_batch, settings, *, before=0, **engine_kwargs) -> tuple[list[int], Engine]:
  """The seeded request's tokens, admitted after `before` steps of mixed neighbours (greedy,
  sampled with other seeds, unseeded, undrafted)."""
  engine = Engine(TARGET5, PROPOSER5, max_batch=max_batch, max_len=64, page_size=4, **engine_kwargs)
  engine.add_request([4, 0, 1], 12)
  engine.add_request([2, 2], 16, temperature=1.0, seed=3)
  engine.add_request([0], 9, temperature=0.9, num_drafts=0)
  for _ in range(before):
    engine.step()
  rid = engine.add_request(PROMPT, NEW, seed=SEED, **settings)
  engine.add_request([3, 1, 4], 14, temperature=1.1, top_p=0.8)
  return engine.run()[rid], engine


@pytest.mark.parametrize("max_batch, engine_kwargs, before", [
    (1, dict(num_drafts=K), 0),
    (2, dict(num_drafts=1), 2),
    (2, dict(tree=TreeSpec((2, 2))), 1),
    (4, dict(), 3),  # num_drafts="auto"
    (4, dict(num_drafts=0), 1),
])
def test_engine_request_equals_plain_sampling(max_batch, engine_kwargs, before):
  settings = SETTINGS[1]
  got, engine = _engine_run(max_batch, settings, before=before, **engine_kwargs)
  assert got == plain(**settings)
  assert engine.free_pages() == engine.num_pages


def test_engine_per_request_draft_counts_and_tree_settings_leave_tokens_alone():
  """On one "auto" engine the same seeded request with num_drafts 0..K gives one output; a tree
  engine takes per-request sampling settings and depth caps."""
  engine = Engine(TARGET5, PROPOSER5, max_batch=4, max_len=64, page_size=4)
  ids = [engine.add_request(PROMPT, NEW, temperature=1.0, seed=SEED, num_drafts=k) for k in (0, 1, 2, K, "auto")]
  out = engine.run()
  assert all(out[i] == plain(temperature=1.0) for i in ids)
  tree = Engine(TARGET5, PROPOSER5, max_batch=2, max_len=64, page_size=4, tree=TreeSpec((2, 2)))
  ids = [tree.add_request(PROMPT, NEW, temperature=1.3, top_k=3, seed=SEED, num_drafts=k) for k in (1, 2)]
  greedy = tree.add_request(PROMPT, NEW)
  out = tree.run()
  assert all(out[i] == plain(temperature=1.3, top_k=3) for i in ids)
  assert out[greedy] == mtp_jax.generate(TARGET5, None, [PROMPT], NEW).tokens[0]
  assert tree.requests[ids[0]].stats["accepted_length"] <= 2.0  # capped at depth 1: a draft and a token a step


def test_rejection_acceptance_is_a_named_option():
  """acceptance="rejection" keeps lossless rejection sampling (its tokens follow k); bad names are refused."""
  out = mtp_jax.generate(TARGET5, PROPOSER5, [PROMPT], NEW, temperature=1.0, seed=SEED, acceptance="rejection")
  assert len(out.tokens[0]) == NEW and out.stats["verify_calls"] > 0
  with pytest.raises(ValueError, match=r"acceptance must be one of \('gumbel', 'rejection'\), got 'exact'") as e:
    mtp_jax.generate(TARGET5, PROPOSER5, [PROMPT], NEW, acceptance="exact")
  assert e.value.argument == "acceptance"
  with pytest.raises(ValueError, match="acceptance must be one of"):
    Engine(TARGET5, PROPOSER5, max_batch=1, max_len=64, page_size=4, acceptance="exact")
