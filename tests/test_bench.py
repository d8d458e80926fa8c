"""Smoke test of the benchmark scripts: each runs with --quick and prints its tables (no timing is
asserted). They run in this process, so they share compiles; one subprocess checks that the scripts
start as `python benchmarks/<script>.py` from a checkout that is not pip-installed."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))

import bandwidth  # noqa: E402
import bench_mla  # noqa: E402
import bench_propose  # noqa: E402
import hot_path_ab  # noqa: E402
import scaling  # noqa: E402
import vs_transformers  # noqa: E402


def test_scripts_start_from_a_checkout():
  for script in ("bench_propose.py", "bandwidth.py", "hot_path_ab.py", "scaling.py", "vs_transformers.py",
                 "bench_mla.py", "bench_paged.py", "serve_bench.py"):
    proc = subprocess.run([sys.executable, str(BENCH / script), "--help"], capture_output=True, text=True,
                          timeout=300, cwd="/")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "--quick" in proc.stdout


@pytest.mark.slow
def test_bench_propose_quick(capsys):
  bench_propose.main(["--quick"])
  out = capsys.readouterr().out
  # each variant's drafts and state were asserted equal to mtp_jax's before its row was printed
  assert "| D=64 | 2 | 2 | " in out
  for name in ("per-module jit, Python loop", "lax.scan over stacked params", "mtp_jax.propose, direct call"):
    assert name in out
  assert "bf16 vs float32 greedy drafts" in out and "| D=64 | 12 |" in out
  assert "| D=64 | 2 | 2 | " in out.split("Why the scan is slower")[1]


@pytest.mark.slow
def test_bandwidth_quick(capsys):
  bandwidth.main(["--quick"])
  out = capsys.readouterr().out
  assert "memory bandwidth (16 MB float32 arrays" in out
  assert "| 1 | propose, max_len 512 (jit, state donated) |" in out


@pytest.mark.slow
def test_hot_path_ab_quick(capsys):
  hot_path_ab.main(["--quick"])
  out = capsys.readouterr().out
  assert "| 4 | " in out.split("Weight streaming of a few-row dot")[1]
  assert "| D=64 | 2 | 1 | " in out  # the patched variants gave the library's drafts


@pytest.mark.slow
def test_scaling_quick(capsys):
  scaling.main(["--quick", "--layers", "4", "6", "--ks", "2"])
  out = capsys.readouterr().out
  # Zero-output layers keep the tokens (asserted against plain decoding inside) and add weight bytes.
  assert "| 4 | 3.4 | " in out and "| 6 | 5.0 | " in out


def test_deepened_target_gives_the_same_logits():
  import jax.numpy as jnp
  from mtp_jax import demo
  small, _, _ = demo.load_demo(name="small")
  deep = scaling.deepened(small, 6)
  tokens = jnp.array([[5, 6, 7, 8]])
  run = lambda m: m(tokens, jnp.arange(4)[None], jnp.ones((1, 4), bool), None)[0]
  np.testing.assert_allclose(run(deep), run(small), rtol=1e-5, atol=1e-5)
  assert scaling.weight_bytes(deep) > scaling.weight_bytes(small)
  with pytest.raises(ValueError, match="num_layers must be >= the target's 4"):
    scaling.deepened(small, 3)


@pytest.mark.slow
def test_vs_transformers_quick(capsys):
  vs_transformers.main(["--quick", "--ks", "1"])
  out = capsys.readouterr().out
  assert "| speculative, k=1 (use_mtp=True) | " in out
  assert "mtp_jax plain == transformers plain" in out  # the same model on both sides


@pytest.mark.slow
def test_bench_mla_quick(capsys):
  bench_mla.main(["--quick"])
  out = capsys.readouterr().out
  # bytes per cached row: GQA 2 * Hkv * Dh * 4, MLA (R + Dr) * 4
  assert "| GQA, Hkv = H (MHA) | 512 |" in out and "| MLA, absorbed (decode path) | 160 |" in out
