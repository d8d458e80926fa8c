"""In-place state: with the state donated, `propose` and the generate loop's step write the KV
caches in place: no unusable-donation warning, no copy of the caches in the compiled program
(outputs aliased to the donated inputs, scratch below one module's caches), and the same device
buffers step after step. `test_the_checks_catch_a_copy` shows the checks fail on a copying call."""

import importlib
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mtp_jax

gen = importlib.import_module("mtp_jax.serving.generate")  # the package's `generate` attribute is the function

K, DRAFTS, B, MAX_LEN = 3, 2, 2, 512
# Long, narrow caches: one module's k cache (128 KiB) outweighs any activation of a decode step,
# so a copy of even one cache array shows in the compiled memory figures.
CFG = mtp_jax.MtpConfig(vocab_size=32, hidden_size=32, num_heads=2, num_kv_heads=1, head_dim=32,
                        intermediate_size=64, num_modules=K)
MODEL = mtp_jax.init_mtp(CFG, seed=0)
RNG = np.random.default_rng(0)
HIDDENS = jnp.asarray(RNG.normal(size=(B, DRAFTS + 1, CFG.hidden_size)).astype(np.float32))
TOKENS = jnp.asarray(RNG.integers(0, CFG.vocab_size, size=(B, DRAFTS + 1)).astype(np.int32))
NUM_NEW = jnp.asarray([DRAFTS + 1, 1], jnp.int32)

donated_propose = jax.jit(lambda p, s, h, t, n: mtp_jax.propose(p, s, h, t, n, num_drafts=DRAFTS), donate_argnums=1)
plain_propose = jax.jit(lambda p, s, h, t, n: mtp_jax.propose(p, s, h, t, n, num_drafts=DRAFTS))
donated_after_verify = jax.jit(mtp_jax.after_verify, donate_argnums=0)


def caches(state):
  return [a for c in state.kv for a in (c.k, c.v)]


def pointers(arrays):
  return [a.unsafe_buffer_pointer() for a in arrays]


def donation_warnings(fn, *args):
  """Runs fn(*args) and returns the messages of donation warnings it raised, and its result."""
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    out = jax.block_until_ready(fn(*args))
  return [str(w.message) for w in caught if "donat" in str(w.message).lower()], out


def module_cache_bytes(state):
  return state.kv[0].k.nbytes + state.kv[0].v.nbytes


def copied_bytes(compiled) -> tuple[int, int]:
  """(scratch bytes, output bytes not aliased to a donated input) of a compiled program."""
  mem = compiled.memory_analysis()
  if mem is None:
    pytest.skip("this backend gives no compiled memory analysis")
  return mem.temp_size_in_bytes, mem.output_size_in_bytes - mem.alias_size_in_bytes


def test_the_checks_catch_a_copy():
  state = mtp_jax.init_state(CFG, B, MAX_LEN)
  _, fresh_out = copied_bytes(plain_propose.lower(MODEL, state, HIDDENS, TOKENS, NUM_NEW).compile())
  assert fresh_out >= sum(a.nbytes for a in caches(state))
  before = pointers(caches(state))
  _, new_state = plain_propose(MODEL, state, HIDDENS, TOKENS, NUM_NEW)
  assert all(a != b for a, b in zip(pointers(caches(new_state)), before))
  unusable = jax.jit(lambda x: x.sum(), donate_argnums=0)
  msgs, _ = donation_warnings(unusable, jnp.zeros((4, 4)))
  assert msgs, "an unusable donation must be reported"


def test_propose_donated_compiles_without_a_cache_copy():
  """Outputs alias the donated caches; scratch stays below one module's k + v caches.

  The scratch bound leaves room for what XLA:CPU does today: for the attention dots it lays a
  module's cache out again in a reused scratch buffer (here the V cache as [B, Hkv, Dh, L]; see
  docs/performance.md, fix 2). A copy of the caches, or of more than one module's, fails.
  """
  state = mtp_jax.init_state(CFG, B, MAX_LEN)
  temp, fresh_out = copied_bytes(donated_propose.lower(MODEL, state, HIDDENS, TOKENS, NUM_NEW).compile())
  assert fresh_out < state.kv[0].k.nbytes, f"{fresh_out} B of outputs are not aliased to the donated state"
  assert temp < module_cache_bytes(state), f"scratch {temp} B holds more than one module's caches"


def test_propose_donated_keeps_the_cache_buffers():
  state = mtp_jax.init_state(CFG, B, MAX_LEN)
  before = pointers(caches(state))
  for step in range(3):
    inputs = caches(state)
    msgs, (drafts, state) = donation_warnings(donated_propose, MODEL, state, HIDDENS, TOKENS, NUM_NEW)
    assert not msgs, msgs
    assert all(a.is_deleted() for a in inputs)
    assert pointers(caches(state)) == before, f"a cache moved in propose step {step}"
    msgs, state = donation_warnings(donated_after_verify, state, jnp.asarray([min(step, DRAFTS), 1], jnp.int32))
    assert not msgs, msgs
    assert pointers(caches(state)) == before, f"a cache moved in after_verify after step {step}"
  assert drafts.shape == (B, DRAFTS)


@pytest.mark.parametrize("settle", [lambda s: mtp_jax.after_verify(s, jnp.zeros((B,), jnp.int32)),
                                    lambda s: mtp_jax.reset_slots(s, jnp.asarray([True, False]))],
                         ids=["after_verify", "reset_slots"])
def test_direct_settle_calls_keep_the_cache_buffers(settle):
  state = mtp_jax.init_state(CFG, B, MAX_LEN)
  before = pointers(caches(state))
  assert pointers(caches(settle(state))) == before


def loop_caches(s):
  return caches(s.proposer) + caches(s.target)


def test_generate_step_donated_in_place(monkeypatch):
  """The streaming loop's jitted step (it donates the loop state) keeps every cache buffer."""
  step_jit, records = gen.jit_step, []

  def recording_step(*args, **kwargs):
    s = next(a for a in (*args, *kwargs.values()) if isinstance(a, mtp_jax.serving.LoopState))
    if not records:
      records.append(copied_bytes(step_jit.lower(*args, **kwargs).compile()))
      records.append(module_cache_bytes(s.proposer))
    before = pointers(loop_caches(s))
    out = step_jit(*args, **kwargs)
    records.append((before, pointers(loop_caches(out))))
    return out

  monkeypatch.setattr(gen, "jit_step", recording_step)
  tcfg = mtp_jax.TargetConfig(vocab_size=CFG.vocab_size, hidden_size=CFG.hidden_size, num_heads=2, num_kv_heads=1,
                              head_dim=32, intermediate_size=64, num_layers=2)
  prompts = [RNG.integers(0, CFG.vocab_size, size=n).tolist() for n in (20, 9)]
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    mtp_jax.generate(mtp_jax.init_target(tcfg, seed=1), MODEL, prompts, max_new_tokens=120, num_drafts=DRAFTS,
                     stream=lambda new_tokens: None)
  assert not [str(w.message) for w in caught if "donat" in str(w.message).lower()]
  (temp, fresh_out), one_module, *steps = records
  assert fresh_out < one_module / 2, f"{fresh_out} B of outputs are not aliased to the donated state"
  assert temp < one_module, f"scratch {temp} B holds more than one module's caches"
  assert len(steps) >= 2
  first = steps[0][0]
  assert all(before == first and after == first for before, after in steps), "a cache moved in a generate step"
