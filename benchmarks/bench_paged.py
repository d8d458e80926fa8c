"""Paged vs contiguous KV caches: the generate decode step's time and the caches' memory.

Both layouts run the same `generate` step (target verify + accept + propose) from the same
prompts with mixed lengths; the paged pool holds only the pages those sequences can reach
(prompt + the timed steps), the contiguous caches B x max_len rows each. Before timing, the two
layouts' emitted tokens must agree. Run: python benchmarks/bench_paged.py [--quick].
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from pathlib import Path

import jax
import numpy as np

try:
  import mtp_jax
except ImportError:  # run as `python benchmarks/x.py` from a checkout that is not pip-installed
  sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
  import mtp_jax

gen = importlib.import_module("mtp_jax.generate")

K = 3
FULL = dict(sizes=dict(vocab_size=258, hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=64,
                       intermediate_size=704), num_layers=4, batches=(8, 32), lengths=(64, 2048),
            max_len=2304, page_size=64, steps=16, reps=3)
QUICK = dict(sizes=dict(vocab_size=64, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
                        intermediate_size=128), num_layers=2, batches=(2,), lengths=(8, 96),
             max_len=128, page_size=16, steps=4, reps=1)


def _bytes(tree) -> int:
  return sum(x.nbytes for x in jax.tree_util.tree_leaves(tree))


def _cache_bytes(s) -> int:
  return _bytes((s.target.kv, s.proposer.kv))


def _run(target, proposer, prompts, cfg, steps):
  """(seconds per step, list of per-step times, emitted tokens, cache bytes) over `steps` steps."""
  b = len(prompts)
  t = -(-max(len(p) for p in prompts) // gen.PROMPT_BUCKET) * gen.PROMPT_BUCKET
  prompts_BxT = np.zeros((b, t), np.int32)
  for i, p in enumerate(prompts):
    prompts_BxT[i, :len(p)] = p
  lens = np.array([len(p) for p in prompts], np.int32)
  s = gen._start_jit(target, proposer, None, prompts_BxT, lens, None, jax.random.key(0), cfg)
  s = jax.block_until_ready(gen._step_jit(target, proposer, None, s, cfg))  # compile
  times = []
  for _ in range(steps):
    t0 = time.perf_counter()
    s = jax.block_until_ready(gen._step_jit(target, proposer, None, s, cfg))
    times.append(time.perf_counter() - t0)
  return times, np.asarray(s.out), np.asarray(s.num_out), _cache_bytes(s)


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--quick", action="store_true", help="tiny sizes, one rep (a smoke run)")
  opts = QUICK if ap.parse_args(argv).quick else FULL
  common = opts["sizes"]
  target = mtp_jax.init_target(mtp_jax.TargetConfig(num_layers=opts["num_layers"], **common), 0)
  proposer = mtp_jax.init_mtp(mtp_jax.MtpConfig(num_modules=K, **common), 1)
  max_len, ps, steps = opts["max_len"], opts["page_size"], opts["steps"]
  print(f"# paged vs contiguous decode step ({jax.devices()[0].platform}, D={common['hidden_size']}, "
        f"{opts['num_layers']} target layers, K=k={K}, max_len={max_len}, page_size={ps})\n")
  print("| B | prompt lengths | layout | cache MB | step ms (median) | p10-p90 ms |")
  print("|---|---|---|---|---|---|")
  rng = np.random.default_rng(0)
  for b in opts["batches"]:
    lo, hi = opts["lengths"]
    lens = np.sort(rng.integers(lo, hi + 1, size=b))
    prompts = [rng.integers(0, common["vocab_size"], size=n).tolist() for n in lens]
    # Pages each sequence can reach: its prompt + every step's k + 1 rows (+ the step after).
    reach = sum(-(-(int(n) + (steps + 2) * (K + 1)) // ps) for n in lens)
    settings = dict(num_drafts=K, max_new_tokens=max_len, temperature=0.0, top_k=None, top_p=None,
                    eos_token_id=None, relaxed=None, max_len=max_len, draft_masks="per_position")
    rows, outs = [], []
    for layout, extra in (("contiguous", {}), ("paged", dict(page_size=ps, num_pages=reach))):
      cfg = gen._Settings(**settings, **extra)
      per_rep = [_run(target, proposer, prompts, cfg, steps) for _ in range(opts["reps"])]
      times = np.concatenate([r[0] for r in per_rep]) * 1e3
      outs.append((per_rep[0][1], per_rep[0][2]))
      rows.append(f"| {b} | {lo}..{hi} | {layout} | {per_rep[0][3] / 2**20:.1f} | {np.median(times):.2f} | "
                  f"{np.percentile(times, 10):.2f}-{np.percentile(times, 90):.2f} |")
    (out_a, n_a), (out_b, n_b) = outs
    assert (n_a == n_b).all() and all((out_a[i, :n] == out_b[i, :n]).all() for i, n in enumerate(n_a)), \
        "paged and contiguous emitted different tokens"
    print("\n".join(rows))


if __name__ == "__main__":
  main()
