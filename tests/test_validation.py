"""Bad input at every public boundary: the error's type, the argument it names and the limit."""

import dataclasses
import importlib
import json
import os

import jax
import jax.numpy as jnp
import hypothesis
import hypothesis.strategies as st
import numpy as np
import pytest
from jax.experimental import checkify

import mtp_jax
from mtp_jax import checkpoint_dir, train, validate

BLOCK = dict(hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=64)
MTP_CFG = mtp_jax.MtpConfig(vocab_size=48, num_modules=3, **BLOCK)
TARGET_CFG = mtp_jax.TargetConfig(vocab_size=48, num_layers=1, **BLOCK)


def _raises(error, argument, *fragments):
  """pytest.raises for a validate error naming `argument`, whose message holds each fragment."""
  class Check:
    def __enter__(self):
      self.ctx = pytest.raises(error)
      self.info = self.ctx.__enter__()
      return self.info

    def __exit__(self, *exc):
      swallowed = self.ctx.__exit__(*exc)
      e = self.info.value
      assert getattr(e, "argument", None) == argument, (e, getattr(e, "argument", None))
      for fragment in fragments:
        assert fragment in str(e), (fragment, str(e))
      return swallowed
  return Check()


@pytest.mark.parametrize("cls, field, value, error, fragment", [
    (mtp_jax.MtpConfig, "num_modules", 0, ValueError, "1..2147483647"),
    (mtp_jax.MtpConfig, "num_modules", 2.0, TypeError, "got 2.0"),
    (mtp_jax.MtpConfig, "vocab_size", True, TypeError, "got True"),
    (mtp_jax.MtpConfig, "hidden_size", 2**32, ValueError, "1..2147483647"),
    (mtp_jax.MtpConfig, "rms_norm_eps", -1.0, ValueError, "(0.0, inf)"),
    (mtp_jax.MtpConfig, "rms_norm_eps", "1e-6", TypeError, "'1e-6'"),
    (mtp_jax.MtpConfig, "rms_norm_eps", float("nan"), ValueError, "nan"),
    (mtp_jax.TargetConfig, "rope_theta", None, TypeError, "None"),
    (mtp_jax.TargetConfig, "rope_theta", float("inf"), ValueError, "inf"),
    (mtp_jax.TargetConfig, "attention_bias", "false", TypeError, "'false'"),
    (mtp_jax.TargetConfig, "output_normed_hidden", 1, TypeError, "bool"),
    (mtp_jax.MtpConfig, "pass_normed_hidden", "yes", TypeError, "bool"),
    (mtp_jax.TargetConfig, "dtype", "int32", ValueError, "floating"),
    (mtp_jax.TargetConfig, "dtype", "float33", TypeError, "float33"),
    (mtp_jax.TargetConfig, "head_dim", 7, ValueError, "even"),
    (mtp_jax.TargetConfig, "num_heads", 3, ValueError, "multiple of num_kv_heads"),
])
def test_config_fields(cls, field, value, error, fragment):
  base = MTP_CFG if cls is mtp_jax.MtpConfig else TARGET_CFG
  with _raises(error, f"{cls.__name__}.{field}", fragment):
    dataclasses.replace(base, **{field: value})


@pytest.mark.parametrize("field, value, error, fragment", [
    ("steps", 0, ValueError, "1..2147483647"),
    ("steps", 1.5, TypeError, "1.5"),
    ("warmup_steps", 10, ValueError, "0..9"),
    ("learning_rate", 0.0, ValueError, "(0.0, inf)"),
    ("learning_rate", float("nan"), ValueError, "nan"),
    ("mtp_weight", -0.1, ValueError, "[0.0, inf)"),
    ("final_lr_fraction", 2.0, ValueError, "[0.0, 1.0]"),
    ("stop_gradient", "no", TypeError, "bool"),
    ("recipe", "mtp", ValueError, "('joint', 'mimo')"),
    ("seed", -1, ValueError, "0..2147483647"),
])
def test_train_config_fields(field, value, error, fragment):
  with _raises(error, f"TrainConfig.{field}", fragment):
    train.TrainConfig(**{"steps": 10, field: value})


def _write_config(path, mutate):
  meta = dict(target=dataclasses.asdict(TARGET_CFG), mtp=dataclasses.asdict(MTP_CFG), step=3, train=None)
  mutate(meta)
  os.makedirs(path, exist_ok=True)
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(meta, f)


@pytest.mark.parametrize("mutate, error, argument, fragment", [
    (lambda m: m["target"].update(rms_norm_eps=-1), ValueError, "TargetConfig.rms_norm_eps", "(0.0, inf)"),
    (lambda m: m["mtp"].update(rms_norm_eps="1e-6"), TypeError, "MtpConfig.rms_norm_eps", "'1e-6'"),
    (lambda m: m["target"].update(rope_theta=None), TypeError, "TargetConfig.rope_theta", "None"),
    (lambda m: m["target"].update(attention_bias="false"), TypeError, "TargetConfig.attention_bias", "bool"),
    (lambda m: m["target"].update(colour=1), ValueError, "target.colour", "unknown field"),
    (lambda m: m.update(step=-2), ValueError, "step", "0..2147483647"),
    (lambda m: m.update(step="3"), TypeError, "step", "'3'"),
    (lambda m: m.update(mtp=[1]), TypeError, "mtp", "JSON object"),
    (lambda m: m.pop("step"), ValueError, "config.json", "missing ['step']"),
])
def test_checkpoint_config_json(tmp_path, mutate, error, argument, fragment):
  _write_config(tmp_path, mutate)
  with _raises(error, argument, fragment, "config.json"):
    train.read_config(tmp_path)


def test_truncated_config_json(tmp_path):
  _write_config(tmp_path, lambda m: None)
  file = tmp_path / "config.json"
  file.write_text(file.read_text()[:40])
  with _raises(ValueError, "config.json", str(file), "truncated"):
    train.read_config(tmp_path)


@pytest.mark.parametrize("call, error, argument, fragment", [
    (lambda: validate.integer("n", 2**32 + 5), ValueError, "n", "-2147483648..2147483647"),
    (lambda: validate.integer("n", np.int64(2**40)), ValueError, "n", "got 1099511627776"),
    (lambda: validate.integer("n", 3.0), TypeError, "n", "got 3.0"),
    (lambda: validate.array("ids", np.array([[2**32 + 5]]), (1, 1), kind="int"), ValueError, "ids", "int32"),
    (lambda: validate.array("ids", np.array([[1.0]]), (1, 1), kind="int"), TypeError, "ids", "float64"),
    (lambda: validate.array("ids", np.zeros((2, 3), np.int32), (2, 4), kind="int"), ValueError, "ids", "[2, 4]"),
])
def test_helpers(call, error, argument, fragment):
  with _raises(error, argument, fragment):
    call()


# --- proposer ---------------------------------------------------------------------------------

MTP = mtp_jax.init_mtp(MTP_CFG, 0)
B, T, D, V = 2, 4, BLOCK["hidden_size"], MTP_CFG.vocab_size


def _propose_args(**changes):
  args = dict(params=MTP, state=mtp_jax.init_state(MTP_CFG, B, 16), hiddens=np.zeros((B, T, D), np.float32),
              tokens=np.zeros((B, T), np.int32), num_new=np.array([1, 1], np.int32), num_drafts=2)
  args.update(changes)
  return args


@pytest.mark.parametrize("changes, error, argument, fragment", [
    (dict(params="mtp"), TypeError, "params", "MtpModel"),
    (dict(state=None), TypeError, "state", "ProposerState"),
    (dict(num_drafts=0), ValueError, "num_drafts", "1..3"),
    (dict(num_drafts=4), ValueError, "num_drafts", "1..3"),
    (dict(num_drafts=2.0), TypeError, "num_drafts", "2.0"),
    (dict(hiddens=np.zeros((B, T, D), np.int32)), TypeError, "hiddens", "float[B=2, T, D=32]"),
    (dict(hiddens=np.zeros((B, 0, D), np.float32)), ValueError, "hiddens", "[B=2, T, D=32]"),
    (dict(tokens=np.zeros((B, T), np.float32)), TypeError, "tokens", "int32[B=2, T=4]"),
    (dict(tokens=np.full((B, T), 2**32 + 5)), ValueError, "tokens", "outside int32"),
    (dict(tokens=np.full((B, T), V)), ValueError, "tokens", f"0..vocab_size-1={V - 1}"),
    (dict(num_new=np.array([2**32 + 1, 1])), ValueError, "num_new", "outside int32"),
    (dict(num_new=np.array([1.0, 1.0])), TypeError, "num_new", "int32[B=2]"),
    (dict(num_new=np.array([5, 1])), ValueError, "num_new", "0..T=4"),
    (dict(num_new=np.array([-1, 1])), ValueError, "num_new", "0..T=4"),
    (dict(hiddens=np.full((B, T, D), np.nan, np.float32)), ValueError, "hiddens", "finite"),
    (dict(temperature=-1.0, key=jax.random.key(0)), ValueError, "temperature", "[0.0, inf)"),
    (dict(temperature=float("nan"), key=jax.random.key(0)), ValueError, "temperature", "nan"),
    (dict(temperature=1.0), ValueError, "key", "temperature > 0"),
    (dict(temperature=1.0, top_k=2.5, key=jax.random.key(0)), TypeError, "top_k", "2.5"),
    (dict(temperature=1.0, top_k=0, key=jax.random.key(0)), ValueError, "top_k", "1..2147483647"),
    (dict(temperature=1.0, top_p=0.0, key=jax.random.key(0)), ValueError, "top_p", "(0.0, 1.0]"),
    (dict(grammar_state=np.zeros(B, np.int32)), ValueError, "grammar_state", "together"),
    (dict(checked=1), TypeError, "checked", "bool"),
    (dict(tree=mtp_jax.TreeSpec((V + 1, 1))), ValueError, "tree", f"widths[0]={V + 1}"),
])
def test_propose_arguments(changes, error, argument, fragment):
  with _raises(error, argument, fragment):
    mtp_jax.propose(**_propose_args(**changes))


def test_propose_grammar_state_range():
  from mtp_jax import grammar
  g = grammar.from_regex("ab", [bytes([97 + i]) for i in range(26)] + [None] * (V - 26), eos_token_id=V - 1)
  with _raises(ValueError, "grammar_state", f"num_states={g.num_states}"):
    mtp_jax.propose(**_propose_args(grammar=g, grammar_state=np.array([1, g.num_states])))
  with _raises(TypeError, "grammar_state", "int32[B=2]"):
    mtp_jax.propose(**_propose_args(grammar=g, grammar_state=np.array([1.0, 1.0])))


@pytest.mark.parametrize("call, error, argument, fragment", [
    (lambda: mtp_jax.init_state(MTP_CFG, 0, 16), ValueError, "batch_size", "1..2147483647"),
    (lambda: mtp_jax.init_state(MTP_CFG, 2, 2**31), ValueError, "max_len", "1..2147483647"),
    (lambda: mtp_jax.init_state(MTP_CFG, 2, 16.0), TypeError, "max_len", "16.0"),
    (lambda: mtp_jax.init_state(MTP_CFG, 2, 16, dtype=np.int32), ValueError, "dtype", "floating"),
    (lambda: mtp_jax.init_state(TARGET_CFG, 2, 16), TypeError, "cfg", "MtpConfig"),
    (lambda: mtp_jax.after_verify(None, np.zeros(B, np.int32)), TypeError, "state", "ProposerState"),
    (lambda: mtp_jax.after_verify(mtp_jax.init_state(MTP_CFG, B, 16), np.zeros(B, np.float32)),
     TypeError, "num_accepted", "int32[B=2]"),
    (lambda: mtp_jax.after_verify(mtp_jax.init_state(MTP_CFG, B, 16), np.ones(B, np.int32)),
     ValueError, "num_accepted", "0..k"),
    (lambda: mtp_jax.reset_slots(mtp_jax.init_state(MTP_CFG, B, 16), np.array([1, 0])),
     TypeError, "mask", "bool[B=2]"),
    (lambda: mtp_jax.reset_slots(mtp_jax.init_state(MTP_CFG, B, 16), np.array([True])),
     ValueError, "mask", "bool[B=2]"),
])
def test_state_functions(call, error, argument, fragment):
  with _raises(error, argument, fragment):
    call()


def test_reset_slots_clears_nan_poisoned_slots():
  """A slot whose caches, tails and draft_probs hold NaN / inf behaves exactly as a fresh one after
  reset_slots (masked rows are selected away, not multiplied by 0)."""
  rng = np.random.default_rng(0)
  hiddens = rng.normal(size=(B, T, D)).astype(np.float32)
  tokens = rng.integers(0, V, size=(B, T)).astype(np.int32)
  num_new = np.array([3, 4], np.int32)
  fresh = mtp_jax.init_state(MTP_CFG, B, 16, keep_draft_probs=True)
  poison = lambda x: jnp.full_like(x, jnp.nan).at[..., :1].set(jnp.inf)
  bad = fresh.set(kv=jax.tree.map(poison, fresh.kv), tail=jax.tree.map(poison, fresh.tail),
                  draft_probs=poison(fresh.draft_probs), lengths=fresh.lengths + 5, num_pos=fresh.num_pos + 7)
  reset = mtp_jax.reset_slots(bad, np.array([True, True]))
  key = jax.random.key(3)
  for temperature in (0.0, 1.0):
    d_fresh, s_fresh = mtp_jax.propose(MTP, fresh, hiddens, tokens, num_new, 3, key=key, temperature=temperature)
    d_reset, s_reset = mtp_jax.propose(MTP, reset, hiddens, tokens, num_new, 3, key=key, temperature=temperature)
    np.testing.assert_array_equal(np.asarray(d_reset), np.asarray(d_fresh))
    np.testing.assert_array_equal(np.asarray(s_reset.draft_probs), np.asarray(s_fresh.draft_probs))
    for c_fresh, c_reset, n in zip(s_fresh.kv, s_reset.kv, np.asarray(s_fresh.lengths)):
      for b in range(B):
        np.testing.assert_array_equal(np.asarray(c_reset.v)[b, :n[b]], np.asarray(c_fresh.v)[b, :n[b]])


# --- generate and verify ------------------------------------------------------------------------

TARGET = mtp_jax.init_target(TARGET_CFG, 0)
PROMPTS = [[1, 2, 3], [4, 5]]


@pytest.mark.parametrize("changes, error, argument, fragment", [
    (dict(target=MTP), TypeError, "target", "TargetModel"),
    (dict(proposer=TARGET), TypeError, "proposer", "MtpModel"),
    (dict(prompts="abc"), TypeError, "prompts", "list of token-id lists"),
    (dict(prompts=[]), ValueError, "prompts", "non-empty"),
    (dict(prompts=[[1], []]), ValueError, "prompts[1]", "empty"),
    (dict(prompts=[[1.0, 2.0]]), TypeError, "prompts[0]", "int token ids"),
    (dict(prompts=[[True]]), TypeError, "prompts[0]", "int token ids"),
    (dict(prompts=[[1, V]]), ValueError, "prompts[0]", f"0..vocab_size-1={V - 1}"),
    (dict(prompts=[[2**32 + 5]]), ValueError, "prompts[0]", f"0..vocab_size-1={V - 1}"),
    (dict(prompts=[[-1]]), ValueError, "prompts[0]", f"0..vocab_size-1={V - 1}"),
    (dict(max_new_tokens=0), ValueError, "max_new_tokens", "1.."),
    (dict(max_new_tokens=2**32 + 5), ValueError, "max_new_tokens", "1.."),
    (dict(max_new_tokens=4.0), TypeError, "max_new_tokens", "4.0"),
    (dict(num_drafts=0), ValueError, "num_drafts", "1..3"),
    (dict(num_drafts=-1), ValueError, "num_drafts", "1..3"),
    (dict(num_drafts=4), ValueError, "num_drafts", "1..3"),
    (dict(proposer=None, num_drafts=2), ValueError, "num_drafts", "needs a proposer"),
    (dict(temperature=-1.0), ValueError, "temperature", "[0.0, inf)"),
    (dict(temperature=float("nan")), ValueError, "temperature", "nan"),
    (dict(proposer=None, temperature=-1.0), ValueError, "temperature", "[0.0, inf)"),
    (dict(temperature="0"), TypeError, "temperature", "'0'"),
    (dict(temperature=1.0, top_k=2.5), TypeError, "top_k", "2.5"),
    (dict(temperature=1.0, top_p=1.5), ValueError, "top_p", "(0.0, 1.0]"),
    (dict(seed=2**32), ValueError, "seed", "0..4294967295"),
    (dict(seed=-1), ValueError, "seed", "0..4294967295"),
    (dict(seed=0.5), TypeError, "seed", "0.5"),
    (dict(eos_token_id=V), ValueError, "eos_token_id", f"0..{V - 1}"),
    (dict(max_len=0), ValueError, "max_len", "1.."),
    (dict(max_len=8), ValueError, "max_len", "needs max_len >= 11"),
    (dict(relaxed=(0, 0.1)), ValueError, "relaxed[0]", f"1..{V}"),
    (dict(relaxed=(V + 1, 0.1)), ValueError, "relaxed[0]", f"1..{V}"),
    (dict(relaxed=(2.5, 0.1)), TypeError, "relaxed[0]", "2.5"),
    (dict(relaxed=(2, float("nan"))), ValueError, "relaxed[1]", "[0.0, 1.0]"),
    (dict(relaxed=2), TypeError, "relaxed", "(top_n, delta)"),
    (dict(relaxed=(2, 0.1), temperature=1.0), ValueError, "relaxed", "greedy"),
    (dict(stream=1), TypeError, "stream", "callable"),
    (dict(draft_masks="all"), ValueError, "draft_masks", "per_position"),
    (dict(constrained=[True, True]), ValueError, "constrained", "needs a grammar"),
])
def test_generate_arguments(changes, error, argument, fragment):
  args = dict(target=TARGET, proposer=MTP, prompts=PROMPTS, max_new_tokens=4)
  args.update(changes)
  with _raises(error, argument, fragment):
    mtp_jax.generate(**args)


LOGITS = jnp.asarray(np.random.default_rng(0).normal(size=(2, 3, 5)), jnp.float32)  # B=2, k=2, V=5
DRAFTS = jnp.array([[1, 2], [3, 4]], jnp.int32)
PROBS = jax.nn.softmax(LOGITS[:, :2] * 0.5, axis=-1)


@pytest.mark.parametrize("call, error, argument, fragment", [
    (lambda: mtp_jax.verify_greedy(np.zeros((2, 3, 5), np.float32), np.zeros((2, 3), np.int32)),
     ValueError, "drafts", "[B=2, k=2]"),
    (lambda: mtp_jax.verify_greedy(np.zeros((2, 3, 5), np.int32), np.zeros((2, 2), np.int32)),
     TypeError, "logits", "[B, k + 1, V]"),
    (lambda: mtp_jax.verify_relaxed(np.zeros((2, 3, 5), np.float32), np.zeros((2, 2), np.int32), top_n=6,
                                    delta=0.1), ValueError, "top_n", "1..5"),
    (lambda: mtp_jax.verify_relaxed(np.zeros((2, 3, 5), np.float32), np.zeros((2, 2), np.int32), top_n=2,
                                    delta=-0.1), ValueError, "delta", "[0.0, 1.0]"),
    (lambda: mtp_jax.verify_sampling(np.zeros((2, 3, 5), np.float32), np.zeros((2, 2), np.int32),
                                     np.zeros((2, 2, 4), np.float32), jax.random.key(0), temperature=1.0),
     ValueError, "draft_probs", "[B=2, k=2, V=5]"),
    (lambda: mtp_jax.verify_sampling(np.zeros((2, 3, 5), np.float32), np.zeros((2, 2), np.int32),
                                     np.zeros((2, 2, 5), np.float32), jax.random.key(0), temperature=-2.0),
     ValueError, "temperature", "[0.0, inf)"),
    (lambda: mtp_jax.verify_greedy(LOGITS.at[1, 2, 3].set(jnp.nan), DRAFTS), ValueError, "logits", "NaN"),
    (lambda: mtp_jax.verify_greedy(LOGITS.at[0, 0, 0].set(jnp.inf), DRAFTS), ValueError, "logits", "+inf"),
    (lambda: mtp_jax.verify_greedy(LOGITS, DRAFTS.at[0, 1].set(5)), ValueError, "drafts", "vocab_size-1=4"),
    (lambda: mtp_jax.verify_relaxed(LOGITS, DRAFTS.at[0, 1].set(-1), top_n=2, delta=0.1),
     ValueError, "drafts", "vocab_size-1=4"),
    (lambda: mtp_jax.verify_sampling(LOGITS, DRAFTS, PROBS, jax.random.key(0), temperature=0.0),
     ValueError, "temperature", "temperature > 0"),
    (lambda: mtp_jax.verify_sampling(LOGITS.at[0, 0, 0].set(jnp.nan), DRAFTS, PROBS, jax.random.key(0),
                                     temperature=1.0), ValueError, "logits", "NaN"),
    (lambda: mtp_jax.verify_sampling(LOGITS, DRAFTS, PROBS.at[0, 0, :2].set([-0.2, 0.4]), jax.random.key(0),
                                     temperature=1.0), ValueError, "draft_probs", ">= 0"),
    (lambda: mtp_jax.verify_sampling(LOGITS, DRAFTS, PROBS * 1.01, jax.random.key(0), temperature=1.0),
     ValueError, "draft_probs", f"within {validate.PROB_ATOL}"),
    (lambda: mtp_jax.verify_sampling(LOGITS, DRAFTS, PROBS.at[1, 1, 4].set(jnp.nan), jax.random.key(0),
                                     temperature=1.0), ValueError, "draft_probs", "finite"),
    (lambda: mtp_jax.verify_tree_greedy(np.zeros((2, 7, 5), np.float32), np.zeros((2, 6), np.int32),
                                        mtp_jax.TreeSpec((6,))), ValueError, "tree", "vocab_size=5"),
    (lambda: mtp_jax.verify_tree_greedy(LOGITS.at[0, 1, 1].set(jnp.nan), DRAFTS, mtp_jax.TreeSpec((2,))),
     ValueError, "logits", "NaN"),
    (lambda: mtp_jax.verify_tree_greedy(LOGITS, DRAFTS.at[1, 0].set(7), mtp_jax.TreeSpec((2,))),
     ValueError, "tree_tokens", "vocab_size-1=4"),
    (lambda: mtp_jax.verify_tree_sampling(LOGITS, DRAFTS, PROBS[:, :1], jax.random.key(0), mtp_jax.TreeSpec((2,)),
                                          temperature=0.0), ValueError, "temperature", "temperature > 0"),
    (lambda: mtp_jax.verify_tree_sampling(LOGITS, DRAFTS, PROBS[:, :1] * 0.5, jax.random.key(0),
                                          mtp_jax.TreeSpec((2,)), temperature=1.0),
     ValueError, "draft_probs", "rows must sum to 1"),
])
def test_verify_arguments(call, error, argument, fragment):
  with _raises(error, argument, fragment):
    call()


def test_verify_accepts_masked_logits_and_rounded_probs():
  """-inf logits (masked tokens) and draft_probs rows off 1 by less than PROB_ATOL are valid input."""
  a, nxt = mtp_jax.verify_greedy(LOGITS.at[:, :, 0].set(-jnp.inf), DRAFTS)
  assert np.asarray(nxt).tolist() == np.asarray(jnp.argmax(LOGITS[jnp.arange(2), a], -1)).tolist()
  rounded = PROBS.at[:, :, 0].add(validate.PROB_ATOL / 2)
  a, nxt = mtp_jax.verify_sampling(LOGITS, DRAFTS, rounded, jax.random.key(0), temperature=1.0)
  assert all(0 <= x <= 2 for x in np.asarray(a).tolist()) and all(0 <= x < 5 for x in np.asarray(nxt).tolist())
  a, nxt = mtp_jax.verify_sampling(np.asarray(LOGITS).tolist(), [[1, 2], [3, 4]], np.asarray(PROBS).tolist(),
                                   jax.random.key(0), temperature=1.0)  # nested lists are arrays too
  assert np.asarray(a).shape == np.asarray(nxt).shape == (2,)


@pytest.mark.parametrize("temperature", [1e-30, 1e-40])
def test_tiny_temperature_is_greedy(temperature):
  from mtp_jax.sampling import filtered_probs
  logits = jnp.array([[1.0, 3.0, 2.0, -5.0]])
  np.testing.assert_array_equal(np.asarray(filtered_probs(logits, temperature=temperature)), [[0, 1, 0, 0]])


GOOD_AND_BAD = dict(  # the first value of each is valid; valid ones are few, so compiles repeat
    prompts=[PROMPTS, [[1]], [], [[]], [[1.5]], [[V]], [[2**32]], "ab", [[True]]],
    max_new_tokens=[3, 0, -1, 2**31, 2.0, None, "3"],
    num_drafts=[None, 2, 0, 4, -1, 1.0, True],
    temperature=[0.0, 0.7, -1.0, float("nan"), float("inf"), None, 1e-40],
    top_k=[None, 0, 2.5, -3, "5"],
    top_p=[None, 0.0, 1.5, float("nan")],
    seed=[0, -1, 2**32, 0.5, None],
    eos_token_id=[None, V, -1, 1.0],
    relaxed=[None, (0, 0.1), (2, -1.0), "x"],
    draft_masks=["per_position", "bogus", None],
)


@pytest.mark.slow
@hypothesis.settings(max_examples=40, deadline=None, suppress_health_check=list(hypothesis.HealthCheck))
@hypothesis.given(st.fixed_dictionaries({name: st.sampled_from(values) for name, values in GOOD_AND_BAD.items()}))
@hypothesis.example({name: values[0] for name, values in GOOD_AND_BAD.items()})
@hypothesis.example({**{name: values[0] for name, values in GOOD_AND_BAD.items()}, "temperature": 0.7, "top_k": None})
def test_generate_fuzz(args):
  """Any mix of arguments: a ValueError / TypeError naming one of them, or a valid result."""
  try:
    out = mtp_jax.generate(TARGET, MTP, **args)
  except (ValueError, TypeError) as e:
    assert getattr(e, "argument", "").split("[")[0] in GOOD_AND_BAD, repr(e)
    assert e.argument in str(e)
    return
  assert len(out.tokens) == len(args["prompts"])
  for tokens in out.tokens:
    assert 1 <= len(tokens) <= args["max_new_tokens"]
    assert all(0 <= t < V for t in tokens)


# --- target -------------------------------------------------------------------------------------

@pytest.mark.parametrize("args, kwargs, error, argument, fragment", [
    ((TARGET_CFG, 0, 16), {}, ValueError, "batch_size", "1..2147483647"),
    ((TARGET_CFG, -2, 16), {}, ValueError, "batch_size", "got -2"),
    ((TARGET_CFG, 2, 0), {}, ValueError, "max_len", "1..2147483647"),
    ((TARGET_CFG, 2, 16.0), {}, TypeError, "max_len", "16.0"),
    ((TARGET_CFG, 2.0, 16), {}, TypeError, "batch_size", "2.0"),
    ((TARGET_CFG, 2, 16), dict(dtype="int32"), ValueError, "dtype", "floating"),
    ((MTP_CFG, 2, 16), {}, TypeError, "cfg", "TargetConfig"),
])
def test_init_target_state_arguments(args, kwargs, error, argument, fragment):
  with _raises(error, argument, fragment):
    mtp_jax.init_target_state(*args, **kwargs)


def _step_args(**changes):
  args = dict(model=TARGET, state=mtp_jax.init_target_state(TARGET_CFG, B, 6), tokens_BxT=np.ones((B, T), np.int32),
              num_new_B=np.array([4, 2], np.int32))
  args.update(changes)
  return args


TREE2 = mtp_jax.TreeSpec((2,))


@pytest.mark.parametrize("changes, error, argument, fragment", [
    (dict(model=MTP), TypeError, "model", "TargetModel"),
    (dict(state=mtp_jax.init_state(MTP_CFG, B, 6)), TypeError, "state", "TargetState"),
    (dict(tokens_BxT=np.full((B, T), V)), ValueError, "tokens", f"0..vocab_size-1={V - 1}"),
    (dict(tokens_BxT=np.full((B, T), -1)), ValueError, "tokens", f"0..vocab_size-1={V - 1}"),
    (dict(tokens_BxT=np.ones((B, T), np.float32)), TypeError, "tokens", "int32[B=2, T]"),
    (dict(tokens_BxT=np.ones((B + 1, T), np.int32)), ValueError, "tokens", "int32[B=2, T]"),
    (dict(tokens_BxT=np.ones((T,), np.int32)), ValueError, "tokens", "int32[B=2, T]"),
    (dict(num_new_B=np.array([5, 1])), ValueError, "num_new", "0..T=4"),
    (dict(num_new_B=np.array([-1, 1])), ValueError, "num_new", "0..T=4"),
    (dict(num_new_B=np.array([1.0, 1.0])), TypeError, "num_new", "int32[B=2]"),
    (dict(num_new_B=np.array([1])), ValueError, "num_new", "int32[B=2]"),
    (dict(state=mtp_jax.init_target_state(TARGET_CFG, B, 3)), ValueError, "num_new", "max_len=3"),
    (dict(checked=1), TypeError, "checked", "bool"),
    (dict(tree=mtp_jax.TreeSpec((V + 1,)), tokens_BxT=np.ones((B, V + 2), np.int32)), ValueError, "tree",
     f"vocab_size={V}"),
    (dict(tree=TREE2), ValueError, "tokens", "N + 1=3"),
    (dict(tree=TREE2, tokens_BxT=np.ones((B, 3), np.int32), num_new_B=np.array([3, 2])), ValueError, "num_new",
     "0 or N + 1=3"),
])
def test_target_step_arguments(changes, error, argument, fragment):
  args = _step_args(**changes)
  with _raises(error, argument, fragment):
    mtp_jax.target_step(args.pop("model"), args.pop("state"), args.pop("tokens_BxT"), args.pop("num_new_B"), **args)


def test_target_step_checks_real_rows_only_and_under_jit():
  """Padding past num_new may hold any id; under jit, checked=True reports the limit through checkify."""
  tokens = np.full((B, T), V + 7, np.int32)
  tokens[:, :2] = 3
  _, _, state = mtp_jax.target_step(TARGET, mtp_jax.init_target_state(TARGET_CFG, B, 6), tokens, np.array([2, 1]))
  assert np.asarray(state.length).tolist() == [2, 1]
  step = jax.jit(lambda s, t, n: mtp_jax.target_step(TARGET, s, t, n, checked=True)[2].length)
  err, length = checkify.checkify(step)(state, tokens, np.array([2, 2], np.int32))
  assert err.get() is None and np.asarray(length).tolist() == [4, 3]
  for bad, fragment in ((np.array([3, 1], np.int32), f"tokens must be in 0..vocab_size-1={V - 1}"),
                        (np.array([5, 1], np.int32), "num_new must be in 0..T=4")):
    err, _ = checkify.checkify(step)(state, tokens, bad)
    assert fragment in err.get(), err.get()


# --- grammar builders -----------------------------------------------------------------------------

SCHEMA = {"type": "integer"}


@pytest.mark.parametrize("call, error, argument, fragment", [
    (lambda g: g.from_regex(None, g.byte_vocab(), eos_token_id=257), TypeError, "pattern", "NoneType"),
    (lambda g: g.from_regex(123, g.byte_vocab(), eos_token_id=257), TypeError, "pattern", "int"),
    (lambda g: g.from_regex("(", g.byte_vocab(), eos_token_id=257), ValueError, "pattern", "cannot build"),
    (lambda g: g.from_regex("z", [b"a", b"b", None], eos_token_id=2), ValueError, "pattern", "incompatible"),
    (lambda g: g.from_regex("a", g.byte_vocab(), eos_token_id=True), TypeError, "eos_token_id", "got True"),
    (lambda g: g.from_regex("a", g.byte_vocab(), eos_token_id=258), ValueError, "eos_token_id", "0..257"),
    (lambda g: g.from_regex("a", g.byte_vocab(), eos_token_id=None), TypeError, "eos_token_id", "None"),
    (lambda g: g.from_regex("a", ["a", "b", None], eos_token_id=2), TypeError, "vocab[0]", "bytes or None"),
    (lambda g: g.from_regex("a", [b"a", 5, None], eos_token_id=2), TypeError, "vocab[1]", "bytes or None"),
    (lambda g: g.from_regex("a", "ab", eos_token_id=1), TypeError, "vocab", "list of bytes"),
    (lambda g: g.from_regex("a", [], eos_token_id=0), ValueError, "vocab", "empty"),
    (lambda g: g.from_regex("a", g.byte_vocab(), eos_token_id=257, compact="yes"), TypeError, "compact", "bool"),
    (lambda g: g.from_json_schema(None, g.byte_vocab(), eos_token_id=257), TypeError, "schema", "NoneType"),
    (lambda g: g.from_json_schema("{bad", g.byte_vocab(), eos_token_id=257), ValueError, "schema", "'{bad'"),
    (lambda g: g.from_json_schema({"a": {1, 2}}, g.byte_vocab(), eos_token_id=257), ValueError, "schema",
     "JSON-serialisable"),
    (lambda g: g.from_json_schema(SCHEMA, ["1", "2"], eos_token_id=1), TypeError, "vocab[0]", "bytes or None"),
    (lambda g: g.from_json_schema(SCHEMA, g.byte_vocab(), eos_token_id=True), TypeError, "eos_token_id", "True"),
    (lambda g: g.from_json_schema(SCHEMA, g.byte_vocab(), eos_token_id=257, whitespace_pattern=3), TypeError,
     "whitespace_pattern", "int"),
])
def test_grammar_builder_arguments(call, error, argument, fragment):
  from mtp_jax import grammar
  with _raises(error, argument, fragment):
    call(grammar)


def test_tree_wider_than_the_vocabulary():
  assert mtp_jax.tree.check_tree(mtp_jax.TreeSpec((4, 2)), vocab_size=4).widths == (4, 2)
  with _raises(ValueError, "tree", "widths[1]=5", "vocab_size=4"):
    mtp_jax.tree.check_tree(mtp_jax.TreeSpec((1, 5)), vocab_size=4)


# --- checkpoints --------------------------------------------------------------------------------

def _save(path, step, seed):
  train.save_checkpoint(path, mtp_jax.init_target(TARGET_CFG, seed), mtp_jax.init_mtp(MTP_CFG, seed), step=step,
                        opt_state={"mu": np.full(3, step, np.float32)})


def _state(path):
  target, mtp = train.load_checkpoint(path)
  opt = os.path.join(path, checkpoint_dir.OPTIMIZER_FILE)
  train.check_step(opt, train.read_config(path)["step"])
  return {**mtp_jax.target_state_dict(target), **mtp_jax.state_dict(mtp)}


def test_interrupted_save_leaves_one_consistent_step(tmp_path, monkeypatch):
  """A save interrupted after any number of file writes or renames leaves the previous step
  (or, once the new directory is in place, the new one), never a mix; the next save cleans up."""
  path = str(tmp_path / "ckpt")
  _save(path, 2, seed=2)
  old = _state(path)
  _save(str(tmp_path / "new"), 4, seed=4)
  new = _state(str(tmp_path / "new"))
  real_save, real_rename = checkpoint_dir.checkpoint.save_tensors, os.rename
  for fail_at in range(5):  # after 0..2 of the 3 tensor files, before either rename
    calls = []

    def counting(real):
      def call(*args, **kwargs):
        calls.append(1)
        if len(calls) > fail_at:
          raise KeyboardInterrupt
        return real(*args, **kwargs)
      return call
    monkeypatch.setattr(checkpoint_dir.checkpoint, "save_tensors", counting(real_save))
    monkeypatch.setattr(checkpoint_dir.os, "rename", counting(real_rename))
    with pytest.raises(KeyboardInterrupt):
      _save(path, 4, seed=4)
    monkeypatch.undo()
    got = _state(path)
    step = train.read_config(path)["step"]
    assert step in (2, 4)
    expected = old if step == 2 else new
    assert got.keys() == expected.keys()
    for name in got:
      np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(expected[name]), err_msg=name)
    _save(path, 2, seed=2)  # a clean save over whatever is left
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "new"]


def test_mixed_checkpoint_files_are_refused(tmp_path):
  a, b = str(tmp_path / "a"), str(tmp_path / "b")
  _save(a, 2, seed=0)
  _save(b, 4, seed=0)
  os.replace(os.path.join(b, checkpoint_dir.MTP_FILE), os.path.join(a, checkpoint_dir.MTP_FILE))
  with _raises(ValueError, checkpoint_dir.MTP_FILE, "step 4", "step 2"):
    train.load_checkpoint(a)


def test_old_checkpoint_without_step_metadata_loads(tmp_path):
  path = str(tmp_path / "old")
  _save(path, 2, seed=1)
  for name in (checkpoint_dir.TARGET_FILE, checkpoint_dir.MTP_FILE):
    file = os.path.join(path, name)
    checkpoint_dir.checkpoint.save_tensors(file, checkpoint_dir.checkpoint.load_tensors(file))  # no metadata
  assert _state(path).keys()


def test_save_never_replaces_a_foreign_directory(tmp_path):
  (tmp_path / "notes.txt").write_text("mine")
  with _raises(ValueError, "path", "other than a checkpoint's"):
    _save(str(tmp_path), 1, seed=0)
  assert (tmp_path / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("setup, kwargs, fragment", [
    (lambda p: p.write_text("x"), {}, "is a file"),
    (lambda p: _save(str(p), 1, seed=0), {}, "overwrite=True (--overwrite)"),
    (lambda p: (p.mkdir(), (p / "notes.txt").write_text("x")), dict(overwrite=True), "other than a checkpoint's"),
])
def test_out_dir_checks(tmp_path, setup, kwargs, fragment):
  out = tmp_path / "out"
  setup(out)
  with _raises(ValueError, "out_dir", fragment):
    train.check_out_dir(out, **kwargs)


def test_out_dir_accepts_overwrite_resume_and_new(tmp_path):
  out = tmp_path / "out"
  _save(str(out), 1, seed=0)
  assert train.check_out_dir(out, overwrite=True) == str(out)
  assert train.check_out_dir(out, resume_from=out) == str(out)
  assert train.check_out_dir(tmp_path / "a" / "b") == str(tmp_path / "a" / "b")


# --- CLI ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, fragment", [
    (["demo", "--small", "--num-prompts", "0"], "num_prompts must be an int in 1.."),
    (["demo", "--small", "--num-prompts", "-2"], "num_prompts must be an int in 1.."),
    (["demo", "--small", "--ks", "0"], "ks[0] must be an int in 1..3"),
    (["generate", "--small", "--prompt", "x", "--temperature", "nan"], "temperature must be a finite number"),
    (["generate", "--small", "--prompt", "x", "--num-drafts", "-1"], "--num-drafts must be an int in 0..3, got -1"),
    (["generate", "--small", "--prompt", "", "--num-drafts", "1"], "--prompt must not be empty"),
    (["generate", "--small", "--prompt", "x", "--max-new-tokens", "0"], "max_new_tokens must be an int in 1.."),
    (["train", "--steps", "0", "--out", "{tmp}/run"], "TrainConfig.steps must be an int in 1.."),
    (["train", "--out", "{tmp}/file/sub"], "is not writable"),
    (["train", "--out", "{tmp}/ckpt"], "--overwrite"),
    (["train", "--resume", "{tmp}/nowhere"], "no config.json"),
    (["train", "--num-heads", "0", "--warmup-steps", "0", "--steps", "1", "--out", "{tmp}/run"],
     "num_heads must be an int in 1..2147483647, got 0"),
    (["train", "--num-kv-heads", "0", "--out", "{tmp}/run"], "num_kv_heads must be an int in 1.."),
    (["train", "--hidden-size", "30", "--num-heads", "4", "--out", "{tmp}/run"],
     "hidden_size (30) must be a multiple of num_heads (4)"),
    (["train", "--num-modules", "-1", "--out", "{tmp}/run"], "num_modules must be an int in 1.."),
    (["generate", "--small", "--prompt", "x", "--temperature", "1", "--top-k", "0"], "top_k must be an int in 1.."),
    (["generate", "--small", "--prompt", "x", "--temperature", "1", "--top-p", "0"], "top_p must be a finite number"),
    (["generate", "--small", "--prompt", "x", "--eos", "258"], "eos_token_id must be an int in 0..257, got 258"),
    (["generate", "--small", "--prompt", "x", "--regex", "("], "cannot build a grammar for pattern '('"),
    (["generate", "--small", "--prompt", "x", "--regex", "[0-9]", "--eos", "none"], "drop --eos none"),
    (["generate", "--small", "--prompt", "x", "--json-schema", "{bad"], "cannot turn JSON schema '{bad'"),
    (["generate", "--small", "--prompt", "x", "--json-schema", "@{tmp}/nowhere.json"], "cannot read"),
    (["generate", "--small", "--prompt", "x", "--tree", "2,2,2,2"], "is 4 deep; the proposer drafts at most 3"),
    (["generate", "--small", "--prompt", "x", "--tree", "2,2", "--num-drafts", "3"], "num_drafts=3"),
    (["generate", "--small", "--prompt", "x", "--max-depth", "0"], "max_depth must be an int in 1.."),
    (["generate", "--small", "--prompt", "x", "--dtype", "bfloat16"], "--dtype applies to --model"),
    (["demo", "--small", "--max-depth", "-1"], "max_depth must be an int in 1.."),
])
def test_cli_errors_are_one_line_exit_2(tmp_path, capsys, argv, fragment):
  from mtp_jax import cli
  (tmp_path / "file").write_text("x")
  _save(str(tmp_path / "ckpt"), 1, seed=0)
  assert cli.main([a.replace("{tmp}", str(tmp_path)) for a in argv]) == 2
  err = capsys.readouterr().err
  assert err.startswith("mtp-jax: error: ") and err.count("\n") == 1, err
  assert fragment in err, err


# --- generate's caches grow with the sequences, not with max_new_tokens ------------------------

@pytest.mark.slow
@pytest.mark.parametrize("streamed", [False, True])
def test_generate_grows_its_caches(monkeypatch, streamed):
  gen_lib = importlib.import_module("mtp_jax.serving.generate")
  fixed = mtp_jax.generate(TARGET, MTP, PROMPTS, 80, num_drafts=2, max_len=120)
  monkeypatch.setattr(gen_lib, "MIN_CAPACITY", 8)  # the caches start at 64 rows and grow to 115
  sizes = []
  real_resize = gen_lib._resize
  monkeypatch.setattr(gen_lib, "_resize", lambda step, *a: (sizes.append(step.settings.max_len),
                                                            real_resize(step, *a))[1])
  grown = mtp_jax.generate(TARGET, MTP, PROMPTS, 80, num_drafts=2, stream=(lambda _: None) if streamed else None)
  assert sizes == [64]
  assert grown.tokens == fixed.tokens
  assert grown.stats == fixed.stats


@pytest.mark.slow
def test_generate_cost_does_not_follow_max_new_tokens():
  first = mtp_jax.generate(TARGET, MTP, PROMPTS, 1).tokens
  eos = first[0][0]
  out = mtp_jax.generate(TARGET, MTP, PROMPTS[:1], 10**8, eos_token_id=eos)  # caches of 64 rows, not 10**8
  assert out.tokens == [[eos]]


# --- grammars that accept the empty string -------------------------------------------------------

@pytest.mark.parametrize("pattern, text", [("a*", b"aaa"), ("[0-9]*", b"42"), (r"\s*", b" \n"), ("(abc)?", b"abc"),
                                           ("", b"")])
def test_grammar_accepting_the_empty_string(pattern, text):
  from mtp_jax import grammar
  g = grammar.from_regex(pattern, grammar.byte_vocab(), eos_token_id=257)
  start = grammar.init_grammar_state(1)
  assert bool(np.asarray(g.final)[grammar.START])  # EOS allowed at once
  assert np.asarray(grammar.token_mask(g, start, 258))[0, 257]
  state = start
  for byte in text:
    assert np.asarray(grammar.token_mask(g, state, 258))[0, byte], (pattern, text, byte)
    state = grammar.advance(g, state, jnp.array([byte], jnp.int32))
  assert bool(np.asarray(g.final)[int(state[0])])
  assert not np.asarray(grammar.token_mask(g, start, 258))[0, ord("z")]


@pytest.mark.parametrize("dtype", [np.int32, np.bool_])
def test_integer_weights_are_refused(dtype):
  tensors = {name: np.asarray(value) for name, value in mtp_jax.state_dict(MTP).items()}
  tensors["lm_head.weight"] = tensors["lm_head.weight"].astype(dtype)
  with _raises(TypeError, "lm_head.weight", "floating"):
    mtp_jax.load_state_dict(MTP_CFG, tensors)
