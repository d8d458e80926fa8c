"""The proposer's contract: exact drafts over any history, purity, errors, reset, static program."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.experimental import checkify

import mtp_jax

K, V, D, MAX_LEN, PROMPT_T = 3, 48, 32, 48, 12
CFG = mtp_jax.MtpConfig(vocab_size=V, hidden_size=D, num_heads=4, num_kv_heads=2, head_dim=8,
                        intermediate_size=64, num_modules=K)
MODEL = mtp_jax.init_mtp(CFG, seed=3)
# Two modules run as five depths (module reuse, vLLM's cycle), position 0's embedding masked.
REUSE_CFG = mtp_jax.MtpConfig(**{**CFG.__dict__, "num_modules": 2, "max_depth": 5, "mask_first_embedding": True})
REUSE_MODEL = mtp_jax.init_mtp(REUSE_CFG, seed=4)
NEAR_TIE = 1e-4


_ref_logits = jax.jit(mtp_jax.forward_chain, static_argnums=3)


def reference_drafts(hid_PxD, toks, k, model=MODEL):
  """Full recompute of the chain (no cache) over one verified sequence.

  hid_PxD: the target hiddens at positions 0..P; toks: verified t_1..t_{P+1}. Returns the k drafts
  and, per draft, the gap between the top two reference logits (to recognise float near-ties).
  """
  p = len(toks) - 1
  h = np.zeros((1, MAX_LEN, D), np.float32)
  h[0, :p + 1] = hid_PxD
  drafts, gaps = [], []
  depths = model.cfg.num_depths
  for m in range(1, k + 1):
    ext = np.zeros((1, MAX_LEN + depths - 1), np.int32)
    seq = list(toks) + drafts
    ext[0, :len(seq)] = seq
    logits = np.asarray(_ref_logits(model, jnp.asarray(h), jnp.asarray(ext), depths))[m - 1, 0, p]
    top2 = np.sort(logits)[-2:]
    drafts.append(int(np.argmax(logits)))
    gaps.append(float(top2[1] - top2[0]))
  return drafts, gaps


def assert_drafts_match(got, want, gaps):
  for g, w, gap in zip(got, want, gaps):
    if g != w:
      assert gap < NEAR_TIE, f"draft {got} != recompute {want} (logit gap {gap})"
      return  # later drafts follow the tied one, so they may differ too


class Sim:
  """Drives propose / after_verify over a ragged batch and keeps each sequence's verified history."""

  def __init__(self, prompt_lens, seed, batch_size=None, model=MODEL):
    self.model, self.depths = model, model.cfg.num_depths
    self.rng = np.random.default_rng(seed)
    self.b = batch_size or len(prompt_lens)
    self.hid = [self.rng.normal(size=(n, D)).astype(np.float32) for n in prompt_lens]
    self.toks = [list(self.rng.integers(0, V, size=n)) for n in prompt_lens]
    self.state = mtp_jax.init_state(model.cfg, self.b, MAX_LEN)

  def first_call(self, k, catch_up=True):
    h = np.zeros((self.b, PROMPT_T, D), np.float32)
    t = np.zeros((self.b, PROMPT_T), np.int32)
    for i, (hid, toks) in enumerate(zip(self.hid, self.toks)):
      h[i, :len(toks)], t[i, :len(toks)] = hid, toks
    n = np.array([len(x) for x in self.toks], np.int32)
    return self.call(h, t, n, k, catch_up)

  def call(self, h, t, n, k, catch_up=True):
    drafts, self.state = mtp_jax.propose(self.model, self.state, h, t, n, num_drafts=k, catch_up=catch_up)
    return np.asarray(drafts)

  def verify(self, drafts, accepted):
    """Accepts `accepted[b]` drafts, appends a random bonus; returns the next propose inputs."""
    self.state = mtp_jax.after_verify(self.state, np.asarray(accepted, np.int32))
    t_pad = self.depths + 1
    h = np.zeros((self.b, t_pad, D), np.float32)
    t = np.zeros((self.b, t_pad), np.int32)
    n = np.zeros((self.b,), np.int32)
    for i, a in enumerate(accepted):
      new = list(drafts[i, :a]) + [int(self.rng.integers(0, V))]
      new_h = self.rng.normal(size=(a + 1, D)).astype(np.float32)
      self.toks[i] += new
      self.hid[i] = np.concatenate([self.hid[i], new_h])
      h[i, :a + 1], t[i, :a + 1], n[i] = new_h, new, a + 1
    return h, t, n

  def check(self, drafts, k):
    for i in range(self.b):
      want, gaps = reference_drafts(self.hid[i], self.toks[i], k, self.model)
      assert_drafts_match(list(drafts[i]), want, gaps)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_drafts_equal_full_recompute_over_random_histories(data):
  prompt_lens = data.draw(st.lists(st.integers(1, PROMPT_T), min_size=3, max_size=3), label="prompts")
  sim = Sim(prompt_lens, seed=data.draw(st.integers(0, 2**16), label="seed"))
  # catch_up=False: only the drafting modules run, so k may only stay or shrink (num_live).
  catch_up = data.draw(st.booleans(), label="catch_up")
  k = data.draw(st.integers(1, K), label="k0")
  drafts = sim.first_call(k, catch_up)
  sim.check(drafts, k)
  for _ in range(data.draw(st.integers(1, 5), label="steps")):
    accepted = [data.draw(st.integers(0, k), label="a") for _ in range(sim.b)]
    if max(len(t) for t in sim.toks) + k + 1 >= MAX_LEN:
      break
    h, t, n = sim.verify(drafts, accepted)
    k = data.draw(st.integers(1, K if catch_up else sim.state.num_live), label="k")
    drafts = sim.call(h, t, n, k, catch_up)
    sim.check(drafts, k)
  assert sim.state.num_live == (K if catch_up else k)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_width_zero_runs_catch_up_only_and_drafts_stay_exact(data):
  """The serving step's narrow widths: propose_step with num_drafts 0..K and catch_up=True (width 0
  drafts nothing; every module only catches up on the verified rows), over histories with long
  runs at width 0: every later draft equals a full recompute of the chain."""
  from mtp_jax import proposer as prop
  sim = Sim(data.draw(st.lists(st.integers(1, PROMPT_T), min_size=2, max_size=2), label="prompts"),
            seed=data.draw(st.integers(0, 2**16), label="seed"))
  k = data.draw(st.integers(0, K), label="k0")
  widths = data.draw(st.lists(st.sampled_from([0, 0, 0, 1, 2, K]), min_size=4, max_size=10), label="widths")

  def call(h, t, n, k):
    drafts, sim.state = prop.propose_step(sim.model, sim.state, jnp.asarray(h), jnp.asarray(t), jnp.asarray(n),
                                          prop.ProposeSettings(k, catch_up=True))
    assert drafts.shape == (sim.b, k)
    return np.asarray(drafts)

  h = np.zeros((sim.b, PROMPT_T, D), np.float32)
  t = np.zeros((sim.b, PROMPT_T), np.int32)
  for i, (hid, toks) in enumerate(zip(sim.hid, sim.toks)):
    h[i, :len(toks)], t[i, :len(toks)] = hid, toks
  drafts = call(h, t, np.array([len(x) for x in sim.toks], np.int32), k)
  for width in widths:
    if k:
      sim.check(drafts, k)
    if max(len(x) for x in sim.toks) + K + 1 >= MAX_LEN:
      break
    h, t, n = sim.verify(drafts, [data.draw(st.integers(0, k), label="a") for _ in range(sim.b)])
    k = width
    drafts = call(h, t, n, k)
  assert sim.state.num_live == K


def test_long_history_with_every_accept_pattern(model=MODEL, repeats=2):
  """Deterministic companion to the property test: all-reject and all-accept runs, k cycling."""
  sim = Sim([5, 1, 12], seed=7, model=model)
  k, drafts = K, sim.first_call(K)
  sim.check(drafts, k)
  patterns = [[0, 0, 0], [3, 3, 3], [0, 3, 1], [2, 0, 3], [1, 1, 1], [0, 2, 0]]
  for step, acc in enumerate(patterns * repeats):
    acc = [min(a, k) for a in acc]
    h, t, n = sim.verify(drafts, acc)
    k = step % K + 1
    drafts = sim.call(h, t, n, k)
    sim.check(drafts, k)


def test_depths_past_the_module_count_stay_exact():
  """Five depths over two modules (each depth its own cache), position 0 masked: drafts equal the
  full recompute of the same rule for every k up to max_depth, over rejections and acceptances."""
  sim = Sim([5, 1, 9], seed=8, model=REUSE_MODEL)
  k, drafts = 5, sim.first_call(5)
  sim.check(drafts, k)
  for step, acc in enumerate([[0, 5, 2], [5, 0, 4], [1, 3, 0], [2, 2, 5]]):
    acc = [min(a, k) for a in acc]
    h, t, n = sim.verify(drafts, acc)
    k = [3, 5, 1, 4][step]
    drafts = sim.call(h, t, n, k)
    sim.check(drafts, k)
  with pytest.raises(ValueError, match=r"num_drafts must be an int in 1\.\.5, got 6"):
    sim.call(h, t, n, 6)


def _snapshot(tree):
  return [np.array(x) for x in jax.tree_util.tree_leaves(tree)]


def test_propose_and_after_verify_are_pure():
  sim = Sim([4, 7], seed=1)
  state0 = sim.state
  h = np.random.default_rng(0).normal(size=(2, PROMPT_T, D)).astype(np.float32)
  t = np.ones((2, PROMPT_T), np.int32)
  n = np.array([4, 7], np.int32)
  before = _snapshot(state0)
  d1, s1 = mtp_jax.propose(MODEL, state0, h, t, n, num_drafts=2)
  d2, s2 = mtp_jax.propose(MODEL, state0, h, t, n, num_drafts=2)
  np.testing.assert_array_equal(d1, d2)
  for x, y in zip(_snapshot(s1), _snapshot(s2)):
    np.testing.assert_array_equal(x, y)
  for x, y in zip(before, _snapshot(state0)):
    np.testing.assert_array_equal(x, y)
  mid = _snapshot(s1)
  a1 = mtp_jax.after_verify(s1, np.array([1, 2], np.int32))
  a2 = mtp_jax.after_verify(s1, np.array([1, 2], np.int32))
  for x, y in zip(_snapshot(a1), _snapshot(a2)):
    np.testing.assert_array_equal(x, y)
  for x, y in zip(mid, _snapshot(s1)):
    np.testing.assert_array_equal(x, y)


def test_trimming_rule_keeps_verified_rows():
  sim = Sim([6, 6], seed=2)
  sim.first_call(K)
  np.testing.assert_array_equal(sim.state.lengths, [[6, 6]] * K)
  state = mtp_jax.after_verify(sim.state, np.array([0, 3], np.int32))
  # P = 5: module m keeps rows j <= P + 1 + a - m.
  np.testing.assert_array_equal(state.lengths, [[6, 6], [5, 6], [4, 6]])
  np.testing.assert_array_equal(state.num_drafted, [0, 0])


def test_unsettled_drafts_count_as_rejected():
  """A second propose without after_verify equals after_verify(0) then propose."""
  sim = Sim([5, 3], seed=4)
  sim.first_call(K)
  h = np.random.default_rng(1).normal(size=(2, K + 1, D)).astype(np.float32)
  t = np.full((2, K + 1), 5, np.int32)
  n = np.array([1, 1], np.int32)
  d_implicit, _ = mtp_jax.propose(MODEL, sim.state, h, t, n, num_drafts=K)
  settled = mtp_jax.after_verify(sim.state, np.zeros(2, np.int32))
  d_explicit, _ = mtp_jax.propose(MODEL, settled, h, t, n, num_drafts=K)
  np.testing.assert_array_equal(d_implicit, d_explicit)


@pytest.mark.parametrize("k", [1, 2])
def test_without_catch_up_only_the_drafting_modules_run(k):
  state = mtp_jax.init_state(CFG, 2, 16)
  h, t, n = jnp.zeros((2, 4, D)), jnp.zeros((2, 4), jnp.int32), jnp.array([3, 4])
  dots = {c: str(jax.make_jaxpr(lambda s: mtp_jax.propose(MODEL, s, h, t, n, num_drafts=k, catch_up=c))(state))
          .count("dot_general") for c in (True, False)}
  assert dots[False] < dots[True]
  _, s = mtp_jax.propose(MODEL, state, h, t, n, num_drafts=k, catch_up=False)
  assert s.num_live == k
  np.testing.assert_array_equal(s.lengths[k:], 0)  # the deeper modules were left where they were


class TestErrors:

  def setup_method(self):
    self.state = mtp_jax.init_state(CFG, 2, 16)
    self.h = np.zeros((2, 4, D), np.float32)
    self.t = np.zeros((2, 4), np.int32)

  def test_more_drafts_than_live_modules(self):
    _, s = mtp_jax.propose(MODEL, self.state, self.h, self.t, np.array([2, 2]), num_drafts=2, catch_up=False)
    s = mtp_jax.after_verify(s, np.array([1, 0], np.int32))
    with pytest.raises(ValueError, match=r"left only modules 0..1 live \(num_live=2\)"):
      mtp_jax.propose(MODEL, s, self.h, self.t, np.array([1, 1]), num_drafts=3, catch_up=False)
    with pytest.raises(ValueError, match=r"num_live=2"):
      mtp_jax.propose(MODEL, s, self.h, self.t, np.array([1, 1]), num_drafts=1)  # catch_up needs all
    d, _ = mtp_jax.propose(MODEL, s, self.h, self.t, np.array([1, 1]), num_drafts=1, catch_up=False)
    assert d.shape == (2, 1)

  def test_more_drafts_than_modules(self):
    with pytest.raises(ValueError, match=r"num_drafts must be an int in 1\.\.3, got 4"):
      mtp_jax.propose(MODEL, self.state, self.h, self.t, np.array([1, 1]), num_drafts=4)

  def test_num_new_out_of_range(self):
    with pytest.raises(ValueError, match=r"num_new must be in 0..T=4"):
      mtp_jax.propose(MODEL, self.state, self.h, self.t, np.array([5, 1]), num_drafts=1)
    with pytest.raises(ValueError, match=r"num_new must be in 0..T=4"):
      mtp_jax.propose(MODEL, self.state, self.h, self.t, np.array([-1, 1]), num_drafts=1)

  def test_token_out_of_range(self):
    with pytest.raises(ValueError, match=r"tokens must be in 0..vocab_size-1=47"):
      mtp_jax.propose(MODEL, self.state, self.h, self.t + V, np.array([1, 1]), num_drafts=1)

  def test_num_accepted_out_of_range(self):
    _, s = mtp_jax.propose(MODEL, self.state, self.h, self.t, np.array([2, 2]), num_drafts=2)
    with pytest.raises(ValueError, match=r"num_accepted must be in 0..k"):
      mtp_jax.after_verify(s, np.array([3, 0], np.int32))
    with pytest.raises(ValueError, match=r"num_accepted must be in 0..k"):
      mtp_jax.after_verify(s, np.array([0, -1], np.int32))

  def test_state_from_another_config(self):
    other = mtp_jax.init_state(mtp_jax.MtpConfig(**{**CFG.__dict__, "num_modules": 2}), 2, 16)
    with pytest.raises(ValueError, match="state was made for another config"):
      mtp_jax.propose(MODEL, other, self.h, self.t, np.array([1, 1]), num_drafts=1)

  def test_shapes(self):
    with pytest.raises(ValueError, match=r"hiddens must be float\[B=2, T, D=32\]"):
      mtp_jax.propose(MODEL, self.state, self.h[:1], self.t, np.array([1, 1]), num_drafts=1)
    with pytest.raises(ValueError, match=r"tokens must be int32\[B=2, T=4\]"):
      mtp_jax.propose(MODEL, self.state, self.h, self.t[:, :3], np.array([1, 1]), num_drafts=1)

  def test_outgrowing_max_len(self):
    s = self.state
    for _ in range(4):
      _, s = mtp_jax.propose(MODEL, s, self.h, self.t, np.array([4, 1]), num_drafts=1)
      s = mtp_jax.after_verify(s, np.zeros(2, np.int32))
    with pytest.raises(ValueError, match=r"outgrow max_len=16"):
      mtp_jax.propose(MODEL, s, self.h, self.t, np.array([1, 1]), num_drafts=1)

  def test_checked_mode_under_jit(self):
    @jax.jit
    def step(state, n):
      return mtp_jax.checked(mtp_jax.propose)(MODEL, state, self.h, self.t, n, num_drafts=1)
    err, (drafts, _) = step(self.state, jnp.array([1, 1]))
    err.throw()
    assert drafts.shape == (2, 1)
    err, _ = step(self.state, jnp.array([1, 9]))
    with pytest.raises(checkify.JaxRuntimeError, match=r"num_new must be in 0..T=4"):
      err.throw()

  def test_checked_after_verify_under_jit(self):
    _, s = mtp_jax.propose(MODEL, self.state, self.h, self.t, np.array([2, 2]), num_drafts=2)
    verify = jax.jit(lambda s, a: mtp_jax.checked(mtp_jax.after_verify)(s, a))
    verify(s, jnp.array([2, 0]))[0].throw()
    err, _ = verify(s, jnp.array([3, 0]))
    with pytest.raises(checkify.JaxRuntimeError, match=r"num_accepted must be in 0..k"):
      err.throw()


def test_unchecked_overflow_never_wraps_or_touches_other_slots():
  """Under a caller's jit without checks, rows past max_len are dropped, not wrapped."""
  state = mtp_jax.init_state(CFG, 2, 6)
  h = np.ones((2, 8, D), np.float32)
  t = np.ones((2, 8), np.int32)
  step = jax.jit(lambda s, n: mtp_jax.propose(MODEL, s, h, t, n, num_drafts=K))
  _, s1 = step(state, jnp.array([4, 0]))
  before = [np.array(c.k) for c in s1.kv]
  s1 = mtp_jax.after_verify(s1, np.zeros(2, np.int32))
  _, s2 = step(s1, jnp.array([8, 0]))  # 4 + 8 > max_len 6 for slot 0
  kept = np.asarray(s1.lengths)[:, 0]
  for c_old, c_new, n_kept in zip(before, s2.kv, kept):
    assert n_kept > 0
    np.testing.assert_array_equal(c_old[0, :n_kept], np.asarray(c_new.k)[0, :n_kept])  # no wrap-around
    np.testing.assert_array_equal(c_old[1], np.asarray(c_new.k)[1])  # other slot untouched


def test_reset_slot_behaves_like_fresh_state():
  sim = Sim([5, 9, 3], seed=11)
  drafts = sim.first_call(K)
  h, t, n = sim.verify(drafts, [2, 1, 3])
  drafts = sim.call(h, t, n, K)
  h, t, n = sim.verify(drafts, [0, 3, 1])
  # Slot 1 gets a new prompt; slots 0 and 2 go on.
  state = mtp_jax.reset_slots(sim.state, np.array([False, True, False]))
  rng = np.random.default_rng(5)
  new_h = rng.normal(size=(6, D)).astype(np.float32)
  new_t = rng.integers(0, V, size=6).astype(np.int32)
  hp = np.zeros((3, PROMPT_T, D), np.float32)
  tp = np.zeros((3, PROMPT_T), np.int32)
  hp[:, :K + 1], tp[:, :K + 1] = h, t
  hp[1], tp[1] = 0, 0
  hp[1, :6], tp[1, :6] = new_h, new_t
  n2 = n.copy()
  n2[1] = 6
  d_reset, _ = mtp_jax.propose(MODEL, state, hp, tp, n2, num_drafts=K)
  fresh = mtp_jax.init_state(CFG, 3, MAX_LEN)
  d_fresh, _ = mtp_jax.propose(MODEL, fresh, hp, tp, np.array([0, 6, 0], np.int32), num_drafts=K)
  np.testing.assert_array_equal(np.asarray(d_reset)[1], np.asarray(d_fresh)[1])
  d_cont, _ = mtp_jax.propose(MODEL, sim.state, hp, tp, n2, num_drafts=K)
  np.testing.assert_array_equal(np.asarray(d_reset)[[0, 2]], np.asarray(d_cont)[[0, 2]])


def test_program_is_unrolled_and_compiles_once_per_shape(model=MODEL):
  state = mtp_jax.init_state(model.cfg, 2, 16)
  h = jnp.zeros((2, 4, D))
  t = jnp.zeros((2, 4), jnp.int32)
  fn = lambda s, h, t, n: mtp_jax.propose(model, s, h, t, n, num_drafts=K)
  jaxpr = str(jax.make_jaxpr(fn)(state, h, t, jnp.array([1, 2])))
  assert "scan" not in jaxpr and "while" not in jaxpr
  traces = []
  step = jax.jit(lambda s, h, t, n: (traces.append(1), fn(s, h, t, n))[1])
  _, s = step(state, h, t, jnp.array([1, 2]))
  _, s = step(s, h + 1, t + 1, jnp.array([3, 0]))
  _, s = step(s, h - 1, t, jnp.array([2, 4]))
  assert len(traces) == 1


@pytest.mark.slow
def test_mla_modules_draft_exactly_without_scans():
  """The exactness and static-program checks above, over MTP modules with MLA attention (YaRN,
  interleaved RoPE, latent caches, absorbed decode)."""
  mla = mtp_jax.MlaConfig(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                          q_lora_rank=12)
  cfg = mtp_jax.MtpConfig(**{**CFG.__dict__, "mla": mla, "rope_interleave": True,
                             "rope_scaling": mtp_jax.RopeScaling(factor=4.0, original_max_position_embeddings=16,
                                                                 mscale=1.0, mscale_all_dim=1.0)})
  model = mtp_jax.init_mtp(cfg, seed=3)
  assert isinstance(mtp_jax.init_state(cfg, 1, 8).kv[0], mtp_jax.blocks.MlaCache)
  test_long_history_with_every_accept_pattern(model, repeats=1)
  test_program_is_unrolled_and_compiles_once_per_shape(model)
