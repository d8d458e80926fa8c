"""The serving loop: greedy speculative == greedy autoregressive, lossless sampling end to end, stats, errors."""

import dataclasses
import importlib
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mtp_jax
from mtp_jax import serving
from mtp_jax import verify

from test_verify import _chi2_pvalue

# The submodule, not the function of the same name that mtp_jax exports.
parts_lib = importlib.import_module("mtp_jax.serving.parts")

K = 3


def _models(v, seed=0):
  common = dict(vocab_size=v, hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=64)
  target = mtp_jax.init_target(mtp_jax.TargetConfig(num_layers=2, **common), seed)
  proposer = mtp_jax.init_mtp(mtp_jax.MtpConfig(num_modules=K, **common), seed + 1)
  return target, proposer


# A 5-token vocabulary makes random drafts right often enough to exercise every accept count.
TARGET5, PROPOSER5 = _models(5)
PROMPTS5 = [[1, 2, 3], [4, 0, 1, 2, 3, 4, 0, 1], [3]]


@pytest.mark.parametrize("k", range(1, K + 1))
def test_greedy_speculative_equals_autoregressive(k):
  base = mtp_jax.generate(TARGET5, None, PROMPTS5, 24)
  out = mtp_jax.generate(TARGET5, PROPOSER5, PROMPTS5, 24, num_drafts=k)
  assert out.tokens == base.tokens
  assert out.stats["accepted_tokens"] > 0  # the comparison covered accepted drafts
  assert out.stats["verify_calls"] < base.stats["verify_calls"]


def test_greedy_equality_with_eos_and_larger_vocab():
  target, proposer = _models(64, seed=4)
  prompts = [[5, 6, 7, 8], [9] * 20, [1, 2]]
  base = mtp_jax.generate(target, None, prompts, 30, eos_token_id=3)
  out = mtp_jax.generate(target, proposer, prompts, 30, num_drafts=K, eos_token_id=3)
  assert out.tokens == base.tokens
  streamed = [[] for _ in prompts]
  out_s = mtp_jax.generate(target, proposer, prompts, 30, num_drafts=K, eos_token_id=3,
                           stream=lambda new: [s.extend(n) for s, n in zip(streamed, new)])
  assert out_s.tokens == base.tokens == streamed


def test_eos_ends_a_sequence():
  base = mtp_jax.generate(TARGET5, None, PROMPTS5, 24)
  eos = base.tokens[0][4]
  out = mtp_jax.generate(TARGET5, PROPOSER5, PROMPTS5, 24, num_drafts=2, eos_token_id=eos)
  for got, full in zip(out.tokens, base.tokens):
    cut = full.index(eos) + 1 if eos in full else len(full)
    assert got == full[:cut]


def test_stats_are_exact_counts():
  out = mtp_jax.generate(TARGET5, PROPOSER5, PROMPTS5, 17, num_drafts=K, eos_token_id=2)
  s = out.stats
  generated = sum(len(t) for t in out.tokens)
  assert s["generated_tokens"] == generated == s["accepted_tokens"] + s["target_tokens"]
  assert s["target_calls"] == s["verify_calls"] + len(PROMPTS5)
  assert s["target_tokens"] <= s["target_calls"]
  assert len(s["acceptance_per_position"]) == K
  rates = s["acceptance_per_position"]
  assert all(r1 >= r2 for r1, r2 in zip(rates, rates[1:]))  # draft i+1 is accepted only after draft i
  plain = mtp_jax.generate(TARGET5, None, PROMPTS5, 17, eos_token_id=2).stats
  assert plain["target_calls"] == plain["generated_tokens"] and plain["accepted_tokens"] == 0


def _exact_joint(target, prompt, v, n):
  """P(x_1..x_n | prompt) for every continuation, from the target's own distributions."""
  conts = list(itertools.product(range(v), repeat=n))
  p = np.asarray(jax.nn.softmax(_forward(target, jnp.asarray([prompt + list(c) for c in conts], jnp.int32)), axis=-1))
  return {c: float(np.prod([p[j, len(prompt) - 1 + i, tok] for i, tok in enumerate(c)])) for j, c in enumerate(conts)}


@jax.jit
def _forward(target, seqs_BxT):
  """The target's logits over whole sequences, cache-free; one compile, not one per op."""
  b, t = seqs_BxT.shape
  return target(seqs_BxT, jnp.broadcast_to(jnp.arange(t), (b, t)), jnp.ones((b, t), bool), None)[0]


def _sampled_joint(target, proposer, prompt, n, copies, seed, acceptance):
  out = mtp_jax.generate(target, proposer, [prompt] * copies, n, num_drafts=2, temperature=1.0, seed=seed,
                         acceptance=acceptance)
  counts = {}
  for toks in out.tokens:
    counts[tuple(toks)] = counts.get(tuple(toks), 0) + 1
  return counts


def _wrong_residual(logits, drafts, q, keys, rows, caps):
  """Rejection sampling whose correction ignores the residual: biased."""
  a, _ = verify.verify_rows(logits, drafts, q, keys, rows, caps)
  at = jnp.take_along_axis(logits, a[:, None, None], axis=1)[:, 0]
  return a, jax.vmap(lambda key, x: jax.random.categorical(jax.random.fold_in(key, 7), x))(keys, at).astype(jnp.int32)


def _wrong_positions(logits, drafts, draws, caps):
  """Gumbel acceptance whose noise is that of the step's first position at every position: biased."""
  return verify.verify_gumbel(logits, drafts, dataclasses.replace(draws, positions=draws.positions * 0), caps)


@pytest.mark.slow
@pytest.mark.parametrize("acceptance, rule, wrong", [("gumbel", "verify_gumbel", _wrong_positions),
                                                     ("rejection", "verify_rows", _wrong_residual)])
def test_speculative_sampling_matches_target_distribution(monkeypatch, acceptance, rule, wrong):
  """3 tokens over a 3-token vocabulary (27 outcomes): the speculative loop samples the target's
  joint distribution under either acceptance rule; the same loop with a wrong rule is caught by
  the same test."""
  v, n, copies = 3, 3, 3000
  target, proposer = _models(v, seed=2)
  prompt = [0, 1, 2, 1]
  exact = _exact_joint(target, prompt, v, n)
  keys = sorted(exact)
  p = np.array([exact[c] for c in keys])
  counts = _sampled_joint(target, proposer, prompt, n, copies, 0, acceptance)
  assert _chi2_pvalue(np.array([counts.get(c, 0) for c in keys]), p) > 1e-3

  monkeypatch.setattr(parts_lib, rule, wrong)
  # One copy fewer: a new shape, so the loop is traced again with the wrong rule (clearing
  # every cache instead would make the tests after this one compile again).
  counts = _sampled_joint(target, proposer, prompt, n, copies - 1, 0, acceptance)
  assert _chi2_pvalue(np.array([counts.get(c, 0) for c in keys]), p) < 1e-6


class TestErrors:

  def test_empty_prompt(self):
    with pytest.raises(ValueError, match=r"prompts\[1\] is empty"):
      mtp_jax.generate(TARGET5, PROPOSER5, [[1], []], 4)

  def test_token_out_of_range(self):
    with pytest.raises(ValueError, match=r"prompts\[0\] has token id\(s\) \[7\] outside 0..vocab_size-1=4"):
      mtp_jax.generate(TARGET5, PROPOSER5, [[1, 7]], 4)

  def test_prompt_longer_than_cache(self):
    with pytest.raises(ValueError, match=r"prompt too long for the cache.*needs max_len >= 46, got 40"):
      mtp_jax.generate(TARGET5, PROPOSER5, [[1] * 33], 10, num_drafts=2, max_len=40)

  def test_max_new_tokens(self):
    with pytest.raises(ValueError, match=r"max_new_tokens must be an int in 1\.\.\d+, got 0"):
      mtp_jax.generate(TARGET5, PROPOSER5, [[1]], 0)

  def test_vocab_mismatch(self):
    _, other = _models(6)
    with pytest.raises(ValueError, match=r"vocab mismatch: target vocab_size=5, proposer vocab_size=6"):
      mtp_jax.generate(TARGET5, other, [[1]], 4)

  def test_num_drafts(self):
    with pytest.raises(ValueError, match=r"num_drafts must be an int in 1\.\.3, got 4"):
      mtp_jax.generate(TARGET5, PROPOSER5, [[1]], 4, num_drafts=4)


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_greedy_step_does_no_prng_work(temperature):
  """A step whose slots are all greedy (sampled=False) draws nothing, so it must not derive keys
  (threefry on CPU)."""
  k = 2
  step = serving.DecodeStep(serving.StepSettings(num_drafts=k, max_new_tokens=8, max_len=64,
                                                 sampled=temperature > 0))
  prompts = np.array([[1, 2, 3, 0]], np.int32)
  s = step.init(TARGET5, PROPOSER5, None, 1)
  s = serving.jit_prefill(step, TARGET5, PROPOSER5, None, s, prompts, np.array([3], np.int32), np.ones(1, bool),
                          np.zeros(1, bool), np.array([8], np.int32),
                          serving.SlotSettings.uniform(1, num_drafts=k, temperature=temperature))
  jaxpr = str(jax.make_jaxpr(lambda s: step(TARGET5, PROPOSER5, None, s))(s))
  prng = [p for p in ("random_bits", "threefry", "random_split", "random_fold_in") if p in jaxpr]
  # Sampling does draw: the check is live, not vacuous.
  assert (prng == []) == (temperature == 0), prng
