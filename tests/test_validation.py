"""Bad input at every public boundary: the error's type, the argument it names and the limit."""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mtp_jax
from mtp_jax import train, validate

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
    (dict(temperature=1.0, top_k=2.5, key=jax.random.key(0)), TypeError, "top_k", f"1..{V}"),
    (dict(temperature=1.0, top_k=V + 1, key=jax.random.key(0)), ValueError, "top_k", f"1..{V}"),
    (dict(temperature=1.0, top_p=0.0, key=jax.random.key(0)), ValueError, "top_p", "(0.0, 1.0]"),
    (dict(grammar_state=np.zeros(B, np.int32)), ValueError, "grammar_state", "together"),
    (dict(checked=1), TypeError, "checked", "bool"),
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
