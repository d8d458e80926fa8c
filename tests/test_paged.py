"""Paged KV caches: the same drafts and tokens as contiguous caches, the allocator, errors."""

import sys

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mtp_jax
from mtp_jax.blocks.masks import attention_probs, causal_mask, readable_rows
from mtp_jax.blocks.paged import PagedKVCache
from mtp_jax.blocks.pages import PageRead, Pages, budget_bucket

from test_generate import PROMPTS5, PROPOSER5, TARGET5
from test_proposer import CFG, K, MAX_LEN, MODEL, Sim

PAGE = 8


def _paged_sim(prompt_lens, seed, num_pages):
  sim = Sim(prompt_lens, seed)
  sim.state = mtp_jax.init_state(CFG, sim.b, MAX_LEN, page_size=PAGE, num_pages=num_pages)
  return sim


def _check_pages(state):
  """Each slot holds exactly the pages its positions need; held + free pages are all pages, once each."""
  pages = state.pages
  used, table = np.asarray(pages.used), np.asarray(pages.table)
  np.testing.assert_array_equal(used, -(-np.asarray(state.num_pos) // PAGE))
  held = np.concatenate([table[b, :used[b]] for b in range(len(used))])
  free = np.asarray(pages.free)[:int(pages.num_free)]
  assert sorted(np.concatenate([held, free]).tolist()) == list(range(pages.num_pages))


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_paged_drafts_equal_contiguous_over_random_histories(data):
  """The proposer property test, run on both layouts side by side (k changes between calls)."""
  prompt_lens = data.draw(st.lists(st.integers(1, 12), min_size=3, max_size=3), label="prompts")
  seed = data.draw(st.integers(0, 2**16), label="seed")
  flat, paged = Sim(prompt_lens, seed), _paged_sim(prompt_lens, seed, num_pages=3 * MAX_LEN // PAGE)
  k = data.draw(st.integers(1, K), label="k0")
  d_flat, d_paged = flat.first_call(k), paged.first_call(k)
  for step in range(data.draw(st.integers(1, 5), label="steps") + 1):
    np.testing.assert_array_equal(d_paged, d_flat)
    paged.check(d_paged, k)
    _check_pages(paged.state)
    accepted = [data.draw(st.integers(0, k), label="a") for _ in range(flat.b)]
    if max(len(t) for t in flat.toks) + k + 1 >= MAX_LEN:
      break
    h, t, n = flat.verify(d_flat, accepted)
    paged.verify(d_paged, accepted)  # same rng stream: the same bonus tokens and hiddens
    k = data.draw(st.integers(1, K), label="k")
    d_flat, d_paged = flat.call(h, t, n, k), paged.call(h, t, n, k)


def test_released_pages_are_reused_and_the_slot_behaves_like_fresh():
  sim = _paged_sim([5, 12, 3], seed=11, num_pages=6)
  drafts = sim.first_call(K)
  h, t, n = sim.verify(drafts, [2, 1, 3])
  sim.call(h, t, n, K)
  before = int(sim.state.pages.num_free)
  slot1_pages = set(np.asarray(sim.state.pages.table)[1, :int(sim.state.pages.used[1])].tolist())
  state = mtp_jax.reset_slots(sim.state, np.array([False, True, False]))
  assert int(state.pages.num_free) == before + len(slot1_pages) and int(state.pages.used[1]) == 0
  # A new 30-token prompt in slot 1 needs 4 pages: the 2 never used and the 2 slot 1 gave back.
  rng = np.random.default_rng(5)
  hp = np.zeros((3, 32, CFG.hidden_size), np.float32)
  tp = np.zeros((3, 32), np.int32)
  hp[1, :30], tp[1, :30] = rng.normal(size=(30, CFG.hidden_size)), rng.integers(0, CFG.vocab_size, 30)
  n = np.array([0, 30, 0], np.int32)
  d_reused, state = mtp_jax.propose(MODEL, state, hp, tp, n, num_drafts=K)
  assert not np.asarray(state.pages.oom).any()
  free_before = set(np.asarray(sim.state.pages.free)[:before].tolist())
  assert len(slot1_pages) == 2 and set(np.asarray(state.pages.table)[1, :4].tolist()) == slot1_pages | free_before
  d_fresh, _ = mtp_jax.propose(MODEL, mtp_jax.init_state(CFG, 3, MAX_LEN), hp, tp, n, num_drafts=K)
  np.testing.assert_array_equal(np.asarray(d_reused)[1], np.asarray(d_fresh)[1])


def test_allocator_refuses_writes_past_its_pages_and_touches_no_other_slot():
  pages = Pages.create(2, 32, 8, 5).ensure(jnp.array([16, 9]))  # slot 0 pages 0, 1; slot 1 pages 2, 3
  pages = pages.ensure(jnp.array([32, 10]))  # slot 0 needs 2 more, only 1 is free: refused
  np.testing.assert_array_equal(np.asarray(pages.oom), [True, False])
  np.testing.assert_array_equal(np.asarray(pages.used), [2, 2])
  assert int(pages.num_free) == 1
  cache = mtp_jax.blocks.paged.PagedKVCache.zeros(CFG, pages).for_call(pages.metadata())
  rows = jnp.arange(32)[None].repeat(2, 0)
  ones = jnp.ones((2, 32, CFG.num_kv_heads, CFG.head_dim))
  new, (k_view, _), key_rows = cache.update(rows, rows < jnp.array([[32], [0]]), ones, ones)
  pool = np.asarray(new.k)
  assert pool[[0, 1]].all() and not pool[[2, 3, 4]].any()  # rows 16.. of slot 0 were dropped
  assert (np.asarray(key_rows)[0, 16:] == np.iinfo(np.int32).max).all()
  # Trimming gives whole pages past the kept rows back; reset gives all and clears the flag.
  pages = pages.release(jnp.array([3, 10]))
  np.testing.assert_array_equal(np.asarray(pages.used), [1, 2])
  pages = pages.reset(jnp.array([True, True]))
  assert int(pages.num_free) == 5 and not np.asarray(pages.oom).any()
  assert sorted(np.asarray(pages.free).tolist()) == list(range(5))
  # Under a budget of 3 pages (what attention reads), a 4th page is refused like a missing one.
  pages = Pages.create(2, 32, 8, 5).ensure(jnp.array([16, 8]), PageRead(budget=3))
  pages = pages.ensure(jnp.array([16, 9]), PageRead(budget=3))
  np.testing.assert_array_equal(np.asarray(pages.oom), [False, True])
  np.testing.assert_array_equal(np.asarray(pages.used), [2, 1])
  assert int(pages.num_free) == 2
  # Under a span of 2 pages per slot (what a dense-view call reads), a slot's 3rd page is refused.
  pages = Pages.create(2, 32, 8, 5)
  assert int(pages.span_after(jnp.array([24, 8]))) == 3
  pages = pages.ensure(jnp.array([24, 8]), PageRead(span=2))
  np.testing.assert_array_equal(np.asarray(pages.oom), [True, False])
  np.testing.assert_array_equal(np.asarray(pages.used), [0, 1])


def test_generate_paged_equals_contiguous_and_stops_sequences_out_of_pages():
  flat = mtp_jax.generate(TARGET5, PROPOSER5, PROMPTS5, 24, num_drafts=K)
  paged = mtp_jax.generate(TARGET5, PROPOSER5, PROMPTS5, 24, num_drafts=K, page_size=PAGE)
  assert paged.tokens == flat.tokens and paged.stats == dict(flat.stats, out_of_pages=[])
  # 11 pages of 8 rows cannot hold all three (up to 31 + 36 + 29 rows): two stop early, one goes on.
  short = mtp_jax.generate(TARGET5, PROPOSER5, PROMPTS5, 24, num_drafts=K, page_size=PAGE, num_pages=11)
  stopped = short.stats["out_of_pages"]
  assert 0 < len(stopped) < len(PROMPTS5)
  for i, (got, want) in enumerate(zip(short.tokens, flat.tokens)):
    assert got == want if i not in stopped else (len(got) < len(want) and got == want[:len(got)])


@pytest.mark.parametrize("window, sinks, dv", [(None, False, 8), (5, True, 6)])
def test_attend_over_the_pages_in_use_equals_the_dense_view(window, sinks, dv):
  """Slots holding 2, 0 and 3 pages of a shuffled pool whose other rows hold NaN, read with a
  budget of exactly the 5 pages in use and with padding: attention.py's dense softmax over the
  [B, max_len] view, and no NaN. dv: the value heads' width (MiMo-V2-Flash's differs from k's)."""
  b, t, hkv, g, dh, ps = 3, 4, 2, 2, 8, 4
  rng = np.random.default_rng(0)
  pages = Pages.create(b, 16, ps, 9)
  pages = pages.ensure(jnp.array([8, 0, 12]))
  pool = rng.normal(size=(9, ps, hkv, dh)).astype(np.float32)
  v_pool = rng.normal(size=(9, ps, hkv, dv)).astype(np.float32)
  rows = np.array([[4, 5, 6, 7], [0, 1, 2, 3], [8, 9, 10, 11]], np.int32)
  valid = np.array([[1, 1, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]], bool)  # slot 0's row 7 is stale
  held = np.asarray(pages.table)[[0, 0, 2, 2, 2], [0, 1, 0, 1, 2]]
  pool[np.setdiff1d(np.arange(9), held)] = np.nan
  v_pool[np.setdiff1d(np.arange(9), held)] = np.nan
  q = jnp.asarray(rng.normal(size=(b, t, hkv, g, dh)), jnp.float32)
  kv = (jnp.asarray(rng.normal(size=(b, t, hkv, dh)), jnp.float32),
        jnp.asarray(rng.normal(size=(b, t, hkv, dv)), jnp.float32))
  sinks_KxG = jnp.asarray(rng.normal(size=(hkv, g)), jnp.float32) if sinks else None
  cache = PagedKVCache(jnp.asarray(pool), jnp.asarray(v_pool), 4)
  _, (k_view, v_view), key_rows = cache.for_call(pages.metadata()).update(rows, valid, kv[0], kv[1])
  scores = jnp.einsum("btkgd,bskd->bkgts", q, k_view) * dh**-0.5
  probs = attention_probs(scores, causal_mask(rows, key_rows, window=window), sinks_KxG=sinks_KxG)
  want = jnp.einsum("bkgts,bskd->btkgd", probs, readable_rows(v_view, rows, valid, key_rows))
  for budget in (5, 8):
    written = cache.for_call(pages.metadata(PageRead(budget))).write(rows, valid, kv[0], kv[1])
    got = np.asarray(written.attend_pages(q, rows, valid, window=window, sinks_KxG=sinks_KxG))
    ok = valid[:, :, None, None, None]  # invalid queries' outputs are never used
    np.testing.assert_allclose(np.where(ok, got, 0), np.where(ok, np.asarray(want), 0), rtol=1e-5, atol=1e-6)
    assert np.isfinite(got).all()
  for span in (3, 4):  # the dense view of the first span columns (slot 2 holds 3 pages)
    _, got = cache.for_call(pages.metadata(PageRead(span=span))).attend(q, kv[0], kv[1], rows, valid,
                                                                        window=window, sinks_KxG=sinks_KxG)
    got = np.asarray(got)
    np.testing.assert_allclose(np.where(ok, got, 0), np.where(ok, np.asarray(want), 0), rtol=1e-5, atol=1e-6)
    assert np.isfinite(np.where(ok, got, 0)).all()


def test_budget_buckets():
  assert [budget_bucket(n, 1000) for n in (0, 16, 17, 25, 33, 49, 65, 97)] == [16, 16, 24, 32, 48, 64, 96, 128]
  assert budget_bucket(200, 150) == 150 and budget_bucket(3, 10) == 10
  assert [budget_bucket(n, 100, minimum=2) for n in (0, 3, 5, 7, 9, 13)] == [2, 3, 6, 8, 12, 16]
  with pytest.raises(ValueError, match="minimum must be a power of two"):
    budget_bucket(3, 10, minimum=3)


def test_generate_paged_with_very_mixed_lengths_raises_its_budget_mid_run(monkeypatch):
  """Pages of 4 rows: the budget starts at 16 pages and is raised as the sequences grow."""
  prompts = [[1], [4, 0, 1, 2, 3, 4, 0, 1] * 5, [3, 2]]
  flat = mtp_jax.generate(TARGET5, PROPOSER5, prompts, 10, num_drafts=K)
  reads = []
  driver = sys.modules["mtp_jax.serving.generate"]
  jit_run = driver.jit_run
  monkeypatch.setattr(driver, "jit_run", lambda *args: reads.append(args[-1]) or jit_run(*args))
  paged = mtp_jax.generate(TARGET5, PROPOSER5, prompts, 10, num_drafts=K, page_size=4)
  assert paged.tokens == flat.tokens and paged.stats == dict(flat.stats, out_of_pages=[])
  assert reads == [PageRead(budget=24)]


class TestErrors:

  def test_page_size_must_divide_max_len(self):
    with pytest.raises(ValueError, match="page_size=7 must divide max_len=48"):
      mtp_jax.init_state(CFG, 2, 48, page_size=7, num_pages=100)
    with pytest.raises(ValueError, match="page_size=5 must divide max_len=64"):
      mtp_jax.generate(TARGET5, PROPOSER5, PROMPTS5, 4, max_len=64, page_size=5)

  def test_num_pages_too_small_for_one_sequence(self):
    with pytest.raises(ValueError, match="num_pages=5 is too small for one sequence.*6 pages"):
      mtp_jax.init_target_state(TARGET5.cfg, 2, 48, page_size=8, num_pages=5)
    with pytest.raises(ValueError, match="num_pages=1 is too small"):
      mtp_jax.generate(TARGET5, PROPOSER5, PROMPTS5, 4, page_size=8, num_pages=1)

  def test_page_size_and_num_pages_go_together(self):
    with pytest.raises(ValueError, match="page_size and num_pages must be given together"):
      mtp_jax.init_state(CFG, 2, 48, page_size=8)
    with pytest.raises(ValueError, match="num_pages=4 needs page_size"):
      mtp_jax.generate(TARGET5, PROPOSER5, PROMPTS5, 4, num_pages=4)


class HostPages:
  """The test's own allocator, as a serving loop that owns its memory keeps one: a host free list
  handed out in shuffled order, a table int32[B, max_pages] with -1 where a slot holds no page."""

  def __init__(self, batch_size, num_pages, seed):
    self.free = list(np.random.default_rng(seed).permutation(num_pages))
    self.table = np.full((batch_size, MAX_LEN // PAGE), -1, np.int32)

  def cover(self, slot, num_rows):
    for p in range(-(-num_rows // PAGE)):
      if self.table[slot, p] < 0:
        self.table[slot, p] = self.free.pop()

  def free_slot(self, slot):
    self.free += [int(p) for p in self.table[slot] if p >= 0]
    self.table[slot] = -1


class ExternalSim(Sim):
  """Sim whose proposer reads and writes through HostPages' table, covered before every call."""

  def __init__(self, prompt_lens, seed, num_pages):
    super().__init__(prompt_lens, seed)
    self.host = HostPages(self.b, num_pages, seed)
    self.state = mtp_jax.init_state(CFG, self.b, MAX_LEN, pages=Pages.external(self.host.table, PAGE, num_pages))

  def call(self, h, t, n, k, catch_up=True):
    for b in range(self.b):
      self.host.cover(b, int(self.state.num_pos[b]) + int(n[b]))
    self.state = self.state.with_page_table(self.host.table)
    return super().call(h, t, n, k, catch_up)


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_external_page_table_drafts_equal_the_internal_allocator(data):
  """A table the caller allocates (shuffled page ids, -1 for no page) gives the internal
  allocator's drafts over random accept histories, and after a slot is reset and refilled."""
  prompt_lens = data.draw(st.lists(st.integers(1, 12), min_size=3, max_size=3), label="prompts")
  seed = data.draw(st.integers(0, 2**16), label="seed")
  num_pages = 3 * MAX_LEN // PAGE
  inner, outer = _paged_sim(prompt_lens, seed, num_pages), ExternalSim(prompt_lens, seed, num_pages)
  k = data.draw(st.integers(1, K), label="k0")
  d_inner, d_outer = inner.first_call(k), outer.first_call(k)
  for _ in range(data.draw(st.integers(1, 4), label="steps")):
    np.testing.assert_array_equal(d_outer, d_inner)
    accepted = [data.draw(st.integers(0, k), label="a") for _ in range(inner.b)]
    if max(len(t) for t in inner.toks) + k + 1 >= MAX_LEN:
      break
    h, t, n = inner.verify(d_inner, accepted)
    outer.verify(d_outer, accepted)
    k = data.draw(st.integers(1, K), label="k")
    d_inner, d_outer = inner.call(h, t, n, k), outer.call(h, t, n, k)
  np.testing.assert_array_equal(d_outer, d_inner)
  assert not np.asarray(outer.state.out_of_pages).any()
  # Slot 1 restarts with a new prompt: the caller frees its pages and covers the new rows anew.
  slot = np.array([False, True, False])
  inner.state = mtp_jax.reset_slots(inner.state, slot)
  outer.host.free_slot(1)
  outer.state = mtp_jax.reset_slots(outer.state, slot)
  rng = np.random.default_rng(seed)
  hp, tp = np.zeros((3, 12, CFG.hidden_size), np.float32), np.zeros((3, 12), np.int32)
  hp[1], tp[1] = rng.normal(size=(12, CFG.hidden_size)), rng.integers(0, CFG.vocab_size, 12)
  n = np.array([0, 12, 0], np.int32)
  np.testing.assert_array_equal(outer.call(hp, tp, n, K)[1], inner.call(hp, tp, n, K)[1])


def test_external_table_that_misses_a_page_flags_only_that_slot():
  host = HostPages(2, 8, seed=0)
  host.cover(0, 12)
  host.cover(1, 8)  # slot 1 will write rows 0..11 but holds one page of 8 rows
  state = mtp_jax.init_state(CFG, 2, MAX_LEN, pages=Pages.external(host.table, PAGE, 8))
  rng = np.random.default_rng(1)
  h, t = rng.normal(size=(2, 12, CFG.hidden_size)).astype(np.float32), rng.integers(0, CFG.vocab_size, (2, 12))
  drafts, state = mtp_jax.propose(MODEL, state, h, t, np.array([12, 12], np.int32), num_drafts=K)
  np.testing.assert_array_equal(np.asarray(state.out_of_pages), [False, True])
  want, _ = mtp_jax.propose(MODEL, mtp_jax.init_state(CFG, 2, MAX_LEN), h, t, np.array([12, 12], np.int32),
                            num_drafts=K)
  np.testing.assert_array_equal(np.asarray(drafts)[0], np.asarray(want)[0])
  with pytest.raises(ValueError, match=r"table must be int32\[B=2, max_pages=6\]"):
    state.with_page_table(np.zeros((2, 5), np.int32))
  with pytest.raises(ValueError, match="only an external one"):
    mtp_jax.init_state(CFG, 2, MAX_LEN, page_size=PAGE, num_pages=8).with_page_table(host.table)


MLA_CFG = mtp_jax.MtpConfig(**{**CFG.__dict__, "num_kv_heads": 4, "rope_interleave": True, "mla": mtp_jax.MlaConfig(
    kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, q_lora_rank=12)})
MLA_MODEL = mtp_jax.init_mtp(MLA_CFG, seed=2)


def test_paged_mla_drafts_equal_contiguous():
  """MLA's latent cache in pages (PagedMlaCache): the same drafts over a history with every
  accept pattern, with pages few enough that slots reuse each other's."""
  flat, paged = Sim([5, 1, 12], seed=7, model=MLA_MODEL), Sim([5, 1, 12], seed=7, model=MLA_MODEL)
  paged.state = mtp_jax.init_state(MLA_CFG, 3, MAX_LEN, page_size=PAGE, num_pages=3 * MAX_LEN // PAGE)
  assert isinstance(paged.state.kv[0], mtp_jax.blocks.PagedMlaCache)
  d_flat, d_paged = flat.first_call(K), paged.first_call(K)
  for acc in [[0, 0, 0], [3, 3, 3], [0, 3, 1], [2, 0, 3]]:
    np.testing.assert_array_equal(d_paged, d_flat)
    h, t, n = flat.verify(d_flat, acc)
    paged.verify(d_paged, acc)
    d_flat, d_paged = flat.call(h, t, n, K), paged.call(h, t, n, K)
  np.testing.assert_array_equal(d_paged, d_flat)
  paged.check(d_paged, K)


def test_external_pages_errors():
  table = np.zeros((2, MAX_LEN // PAGE), np.int32)
  with pytest.raises(ValueError, match=r"pages' table is int32\[3, 6\], expected \[B=2") as e:
    mtp_jax.init_state(CFG, 2, MAX_LEN, pages=Pages.external(np.zeros((3, 6), np.int32), PAGE, 8))
  assert e.value.argument == "pages"
  with pytest.raises(ValueError, match="pass those only without it"):
    mtp_jax.init_target_state(TARGET5.cfg, 2, MAX_LEN, page_size=PAGE, pages=Pages.external(table, PAGE, 8))
  with pytest.raises(TypeError, match="table must be int32") as e:
    Pages.external(table.astype(np.float32), PAGE, 8)
  assert e.value.argument == "table"
  with pytest.raises(ValueError, match="only caches made with pages=Pages.external"):
    mtp_jax.init_state(CFG, 2, MAX_LEN).with_page_table(table)
