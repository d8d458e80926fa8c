"""Bad input at every public boundary: the error's type, the argument it names and the limit."""

import dataclasses
import json
import os

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
