"""The shipped demo models: they load, and speculative decoding reproduces plain greedy decoding."""

import os

import jax
import numpy as np
import pytest

import mtp_jax
from mtp_jax import checkpoint, checkpoint_dir, data, demo, demo_models


def test_load_demo_returns_the_shipped_models_and_tokenizer():
  target, proposer, tok = demo.load_demo()
  assert isinstance(target, mtp_jax.TargetModel) and isinstance(proposer, mtp_jax.MtpModel)
  assert proposer.cfg.num_modules == 3
  assert target.cfg.vocab_size == proposer.cfg.vocab_size == tok.vocab_size == data.VOCAB_SIZE
  assert tok.decode(tok.encode("def f(x):\n  return x\n")) == "def f(x):\n  return x\n"
  assert (tok.bos_id, tok.eos_id) == (data.BOS_ID, data.EOS_ID)


def test_demo_speculative_output_equals_plain_greedy():
  # The settings of the CLI test: in one pytest process the two share their compiled programs.
  report = demo.run_demo(num_prompts=2, max_new_tokens=16, repeats=1, ks=[1, 3], trees=[mtp_jax.TreeSpec((2, 2, 1))])
  assert [(r.label, r.rows_per_step) for r in report.rows] == [("k=1", 2), ("k=3", 4), ("tree 2,2,1", 11)]
  for row in report.rows:
    assert row.same_as_plain
    assert len(row.acceptance) == row.k and all(0 <= a <= 1 for a in row.acceptance)
    # Trained modules: more than one token per verify step, hence fewer target calls than plain decoding.
    assert row.mean_accepted_length > 1.5
    assert row.target_calls < report.plain_target_calls == report.generated_tokens
  assert report.model == "small" and all(r.speedup > 0 for r in report.rows)
  text = demo.format_report(report)
  assert "\nk=3        |    4 | " in text and "\ntree 2,2,1 |   11 | " in text
  assert "yes" in text and "NO" not in text
  assert f"best: {demo.best_row(report).label}," in text


def test_max_depth_drafts_past_the_modules_and_keeps_the_output():
  """max_depth=5: a chain of 5 and a 6-node tree 5 deep, depths 4 and 5 running modules 1 and 2 again."""
  report = demo.run_demo(num_prompts=1, max_new_tokens=12, repeats=1, ks=[5], trees=[mtp_jax.TreeSpec((2, 1, 1, 1, 1))],
                         max_depth=5)
  assert [(r.label, r.rows_per_step) for r in report.rows] == [("k=5", 6), ("tree 2,1,1,1,1", 11)]
  assert all(r.same_as_plain and r.mean_accepted_length > 1.5 for r in report.rows)
  with pytest.raises(ValueError, match=r"max_depth must be"):
    demo.load_demo(max_depth=0)


def test_run_demo_rejects_k_beyond_the_modules():
  with pytest.raises(ValueError, match=r"ks\[0\] must be an int in 1..3, got 4"):
    demo.run_demo(num_prompts=1, max_new_tokens=4, ks=[4], repeats=1, name="small")
  with pytest.raises(ValueError, match=r"widths=\(1, 1, 1, 1\) is 4 deep; the proposer drafts at most 3"):
    demo.run_demo(num_prompts=1, max_new_tokens=4, trees=[mtp_jax.TreeSpec((1, 1, 1, 1))], repeats=1, name="small")


def test_export_stores_bf16_and_loads_as_float32(tmp_path):
  out = tmp_path / "asset"
  written = demo.export_demo(demo_models.demo_path("small"), out)
  small = sum(os.path.getsize(os.path.join(demo_models.demo_path("small"), f))
              for f in (checkpoint_dir.TARGET_FILE, checkpoint_dir.MTP_FILE))
  assert written < 0.55 * small
  assert {str(v.dtype) for v in checkpoint.load_tensors(out / checkpoint_dir.TARGET_FILE).values()} == {"bfloat16"}
  target, proposer, _ = demo.load_demo(out)
  ref_target, _, _ = demo.load_demo()
  got, want = jax.tree.leaves(target), jax.tree.leaves(ref_target)
  assert len(got) == len(want) > 10 and all(g.dtype == np.float32 for g in got)
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, rtol=1e-2, atol=1e-6)


def test_unknown_or_missing_demo_model(monkeypatch, tmp_path):
  with pytest.raises(ValueError, match=r"name must be one of \('small', 'large'\)"):
    demo.load_demo(name="medium")
  monkeypatch.setattr(demo_models, "ASSETS", str(tmp_path))
  assert demo_models.default_demo() == "small"
  with pytest.raises(FileNotFoundError, match="the demo model 'large' is not in this package"):
    demo.load_demo(name="large")
  demo.export_demo(os.path.join(os.path.dirname(demo.__file__), "assets", "small"), tmp_path / "large")
  assert demo_models.default_demo() == "large"
