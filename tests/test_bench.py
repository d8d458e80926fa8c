"""Smoke test of the benchmark scripts: each runs with --quick and prints its tables (no timing is
asserted). They run in this process, so they share compiles; one subprocess checks that the scripts
start as `python benchmarks/<script>.py` from a checkout that is not pip-installed."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))

import bandwidth  # noqa: E402
import acceptance  # noqa: E402
import bench_fp8  # noqa: E402
import bench_mla  # noqa: E402
import bench_propose  # noqa: E402
import demo_report  # noqa: E402
import device  # noqa: E402
import few_row_dots  # noqa: E402
import hot_path_ab  # noqa: E402
import plots  # noqa: E402
import scaling  # noqa: E402
import serve_bench  # noqa: E402
import serve_http  # noqa: E402
import vs_transformers  # noqa: E402


SCRIPTS = ("bench_propose.py", "bandwidth.py", "hot_path_ab.py", "scaling.py", "vs_transformers.py", "bench_mla.py",
           "bench_paged.py", "serve_bench.py", "demo_report.py", "bench_fp8.py", "step_breakdown.py",
           "few_row_dots.py", "serve_http.py", "acceptance.py", "device.py", "serve_ab.py")
# Runs each script as __main__ with --help, from "/", in one interpreter (one jax import for all),
# as `python benchmarks/<script>.py` would.
_RUN_AS_MAIN = """
import os, runpy, sys
for path in sys.argv[1:]:
  print("=== " + path, flush=True)
  sys.argv = [path, "--help"]
  sys.path.insert(0, os.path.dirname(path))  # as `python path` puts the script's folder first
  try:
    runpy.run_path(path, run_name="__main__")
  except SystemExit as e:
    assert e.code in (0, None), (path, e.code)
"""


def test_paired_ratio_is_the_median_of_same_round_ratios():
  # Round 2 ran twice as fast for both: its ratio is 1, as is round 3's; medians across rounds would say 1.5.
  slow = dict(walls=[3.0, 1.5, 3.0])
  fast = dict(walls=[2.0, 1.5, 3.0])
  assert serve_bench.paired(fast, slow) == 1.0
  assert serve_bench.paired(dict(walls=[1.0, 1.0, 1.0]), dict(walls=[2.0, 2.0, 4.0])) == 2.0
  assert serve_bench.paired(dict(walls=[1.0, 1.0, 1.0]), dict(walls=[2.0, 2.0, 4.0]), np.min) == 2.0
  assert serve_bench.paired(fast, dict(walls=[3.0, 1.2, 3.3]), np.min) == pytest.approx(0.8)


def test_paired_interval_is_order_statistics_of_round_ratios():
  base = dict(walls=[1.0] * 7)
  r = dict(walls=[1 / x for x in (0.9, 1.3, 1.0, 0.8, 1.1, 1.2, 0.95)])  # ratios, sorted: .8 .9 .95 1 1.1 1.2 1.3
  lo, hi, cover = serve_bench.paired_interval(r, base)
  assert (lo, hi) == pytest.approx((0.9, 1.2)) and cover == pytest.approx(1 - 2 * 8 / 128)  # j = 2 of 7
  lo, hi, cover = serve_bench.paired_interval(dict(walls=[1.0, 0.5, 2.0]), dict(walls=[1.0] * 3))
  assert (lo, hi, cover) == pytest.approx((0.5, 2.0, 0.75))  # too few rounds for 85%: the extremes
  assert lo <= serve_bench.paired(dict(walls=[1.0, 0.5, 2.0]), dict(walls=[1.0] * 3)) <= hi


def test_scripts_start_from_a_checkout():
  proc = subprocess.run([sys.executable, "-c", _RUN_AS_MAIN, *(str(BENCH / s) for s in SCRIPTS)],
                        capture_output=True, text=True, timeout=300, cwd="/")
  assert proc.returncode == 0, proc.stderr[-3000:]
  helps = proc.stdout.split("=== ")[1:]
  assert [h.split("\n", 1)[0] for h in helps] == [str(BENCH / s) for s in SCRIPTS]
  for h in helps:
    assert "--quick" in h, h[:300]


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


def test_few_row_dots_quick(capsys):
  few_row_dots.main(["--quick"])
  out = capsys.readouterr().out
  assert "| bf16 [out, in], x split exactly (3 parts) | " in out and "1 layers" in out


@pytest.mark.slow
def test_hot_path_ab_quick(capsys):
  hot_path_ab.main(["--quick"])
  out = capsys.readouterr().out
  assert "| 4 | " in out.split("Weight streaming of a few-row dot")[1]
  assert "| D=64 | 2 | 1 | " in out  # the patched variants gave the library's drafts


@pytest.mark.slow
def test_scaling_quick(capsys, tmp_path):
  scaling.main(["--quick", "--layers", "4", "6", "--ks", "2", "--json", str(tmp_path / "scaling.json")])
  out = capsys.readouterr().out
  # Zero-output layers keep the tokens (asserted against plain decoding inside) and add weight bytes.
  assert "| 4 | 3.4 | " in out and "| 6 | 5.0 | " in out
  result = json.loads((tmp_path / "scaling.json").read_text())
  assert [r["layers"] for r in result["rows"]] == [4, 6] and result["settings"]["max_new_tokens"] == 16
  assert [round(r["mb"], 1) for r in result["rows"]] == [3.4, 5.0] and list(result["rows"][0]["spec"]) == ["2"]
  assert plots.main(["--scaling", str(tmp_path / "scaling.json"), "--out", str(tmp_path)]) == [
      str(tmp_path / "scaling.png")]
  assert (tmp_path / "scaling.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_demo_report_quick_feeds_plots(tmp_path, capsys):
  path = tmp_path / "demo.json"
  assert demo_report.main(["--quick", "--ks", "2", "--tree", "2,1", "--json", str(path)]) == 0
  assert "tree 2,1" in capsys.readouterr().out
  result = json.loads(path.read_text())
  rows = result["report"]["rows"]
  assert [(r["k"], r["tree"], r["rows_per_step"]) for r in rows] == [(2, None, 3), (2, [2, 1], 5)]
  assert all(r["same_as_plain"] for r in rows) and result["report"]["model"] == "small"
  assert result["settings"]["num_prompts"] == 2 and result["settings"]["max_new_tokens"] == 8
  assert plots.main(["--demo", str(path), "--out", str(tmp_path)]) == [str(tmp_path / "chains.png"),
                                                                      str(tmp_path / "trees.png")]


def _demo_row(k, acceptance, length, tree=None, rows=None):
  return dict(k=k, acceptance=acceptance, mean_accepted_length=length, target_calls=100, tokens_per_s=500.0,
              speedup=0.9, ms_per_call=1.0, compile_s=1.0, same_as_plain=True, tree=tree,
              rows_per_step=rows or k + 1)


def test_plots_from_a_demo_report(tmp_path):
  report = dict(model="small", plain_tokens_per_s=600.0, plain_ms_per_call=0.5, plain_target_calls=64,
                plain_compile_s=1.0, generated_tokens=64, repeats=1, sample=["a", "b"],
                rows=[_demo_row(1, [0.8], 1.8), _demo_row(2, [0.8, 0.7], 2.5),
                      _demo_row(2, [0.9, 0.8], 2.7, tree=[2, 2], rows=7)])
  result = dict(benchmark="demo", backend="cpu", device_kind="cpu", jax_version="0", report=report,
                settings=dict(num_prompts=2, prompt_len=64, max_new_tokens=32, seed=0, repeats=1, max_depth=None))
  (tmp_path / "demo.json").write_text(json.dumps(result))
  written = plots.main(["--demo", str(tmp_path / "demo.json"), "--out", str(tmp_path / "img")])
  assert written == [str(tmp_path / "img" / "chains.png"), str(tmp_path / "img" / "trees.png")]
  assert all(Path(p).read_bytes()[:4] == b"\x89PNG" for p in written)
  # A chain-only report draws no trees figure; a JSON of another benchmark is refused by name.
  report["rows"] = report["rows"][:2]
  (tmp_path / "chains.json").write_text(json.dumps(result))
  assert plots.main(["--demo", str(tmp_path / "chains.json"), "--out", str(tmp_path)]) == [
      str(tmp_path / "chains.png")]
  with pytest.raises(ValueError, match="expected the JSON of the 'scaling' benchmark, got 'demo'"):
    plots.main(["--scaling", str(tmp_path / "demo.json"), "--out", str(tmp_path)])


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


@pytest.mark.slow
def test_bench_fp8_quick(capsys):
  bench_fp8.main(["--quick"])  # asserts each variant's logits against its dequantized-at-load twin first
  out = capsys.readouterr().out
  rows = {line.split(" | ")[0].lstrip("| "): line for line in out.splitlines() if line.startswith("| ")}
  # float32 params: 0.5 MiB; the FP8 loads hold their projections in a byte per weight plus the scales
  assert rows["float32 (dequantized at load)"].startswith("| float32 (dequantized at load) | 0.5 | 0.0 | ")
  assert " | 0.1 | " in rows["FP8 kept, bfloat16 compute"] and " | 0.1 | " in rows["FP8 kept, float32 compute"]
  assert "FP8, per-block scaled dot (bf16)" in rows and "load average at the end" in out


@pytest.mark.slow
def test_acceptance_quick(capsys):
  """Both rules' accepted lengths, and every Gumbel run equal to plain sampling with its seed."""
  acceptance.main(["--quick"])
  out = capsys.readouterr().out
  rows = [line for line in out.splitlines() if line.startswith("| 1.0 |")]
  assert len(rows) == 2 and all(line.endswith("| True |") for line in rows), out


def test_serve_http_quick(capsys):
  serve_http.main(["--quick"])
  out = capsys.readouterr().out
  # each cell's requests all came back (4 of 4), with drafts (2, auto) and without (0); no page left held
  assert all(f"| {k} | {c} | 4 | " in out for k in (2, "auto", 0) for c in (1, 4))
  assert "Pages in use after the load: 0, 0 and 0." in out


@pytest.mark.slow
def test_device_cpu_quick(tmp_path, capsys):
  """The device script's --cpu run: every correctness check passed, and every row is in the JSON file."""
  path = tmp_path / "d.json"
  assert device.main(["--cpu", "--deadline-s", "30", "--json", str(path)]) == 0
  rows = [json.loads(line) for line in path.read_text().splitlines()]
  assert all({"section", "what"} <= set(r) for r in rows)
  checks = [r for r in rows if r["section"] == "correctness"]
  assert [(r["model"], r["dtype"]) for r in checks] == [("demo large", "float32"), ("random GQA x2", "float32"),
                                                        ("random MLA x2", "bfloat16")]
  assert all(r["passed"] and r["verdict"] in ("equal", "near-tie") for r in checks)
  # Timing cells may be skipped on a busy machine, but each section prints its table and the first
  # generate cell always runs while the deadline is ahead.
  assert set(device.SECTIONS) <= {r["section"] for r in rows}
  generated = [r for r in rows if r["section"] == "generate" and "tokens_per_s" in r]
  assert generated and all({"model", "batch", "k", "spec_over_plain", "ms_per_call"} <= set(r) for r in generated)
  assert rows[-1] == dict(section="end", what="correctness", value="all passed", failures=0)
  assert "| spec == plain, token by token | demo large | float32 | 4 | 3 | equal |" in capsys.readouterr().out
