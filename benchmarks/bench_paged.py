"""Paged vs contiguous KV caches: K/V bytes attention reads per decode step, step time, cache memory.

Both layouts run the same `generate` step (target verify + accept + propose) from the same
prompts with mixed lengths. Contiguous caches hold B x max_len rows and every attention call
reads all of them. The paged pool holds half of that (as a server sizes a pool for mixed
lengths; more if the sequences need it) and attention reads the page budget: the pages the
timed steps hold, rounded up to a bucket (`blocks.pages.budget_bucket`), as `generate` picks
it. Bytes read are counted from the shapes attention gathers: per call, rows x Hkv x Dh x 2
(k and v) x itemsize, over the target's layers and the k modules that draft. Before timing,
the two layouts' emitted tokens must agree. Run: python benchmarks/bench_paged.py [--quick].
"""

from __future__ import annotations

import argparse
import dataclasses
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

from mtp_jax import serving  # noqa: E402

K = 3
FULL = dict(sizes=dict(vocab_size=258, hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=64,
                       intermediate_size=704), num_layers=4, batches=(8, 32), lengths=(64, 2048),
            max_len=2304, page_size=64, steps=16)
QUICK = dict(sizes=dict(vocab_size=64, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
                        intermediate_size=128), num_layers=2, batches=(2,), lengths=(8, 96),
             max_len=128, page_size=16, steps=4)


def _bytes(tree) -> int:
  return sum(x.nbytes for x in jax.tree_util.tree_leaves(tree))


def _cache_bytes(s) -> int:
  return _bytes((s.target.kv, s.proposer.kv))


def _run(target, proposer, prompts, settings, read, steps):
  """(per-step seconds, emitted tokens, their counts, cache bytes, target rows in use) over `steps` steps."""
  b = len(prompts)
  step = serving.DecodeStep(settings)
  prompts_BxT, lens = serving.generate_lib.padded_prompts(prompts, b, range(b))
  s = step.init(target, proposer, None, b)
  s = serving.jit_prefill(step, target, proposer, None, s, prompts_BxT, lens, np.ones(b, bool), np.zeros(b, bool),
                          np.full(b, settings.max_new_tokens, np.int32),
                          serving.SlotSettings.uniform(b, num_drafts=settings.num_drafts), read=read)
  s = jax.block_until_ready(serving.jit_step(step, target, proposer, None, s, read))  # compile
  times = []
  for _ in range(steps):
    t0 = time.perf_counter()
    s = jax.block_until_ready(serving.jit_step(step, target, proposer, None, s, read))
    times.append(time.perf_counter() - t0)
  return np.array(times), np.asarray(s.out), np.asarray(s.num_out), _cache_bytes(s), int(np.sum(s.target.length))


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--quick", action="store_true", help="tiny sizes, few steps (a smoke run)")
  opts = QUICK if ap.parse_args(argv).quick else FULL
  common = opts["sizes"]
  target = mtp_jax.init_target(mtp_jax.TargetConfig(num_layers=opts["num_layers"], **common), 0)
  proposer = mtp_jax.init_mtp(mtp_jax.MtpConfig(num_modules=K, **common), 1)
  max_len, ps, steps = opts["max_len"], opts["page_size"], opts["steps"]
  # K/V bytes of one cache row, over every attention call of a step (target layers + k drafting modules).
  row_bytes = 2 * common["num_kv_heads"] * common["head_dim"] * 4 * (opts["num_layers"] + K)
  print(f"# paged vs contiguous decode step ({jax.devices()[0].platform}, D={common['hidden_size']}, "
        f"{opts['num_layers']} target layers, K=k={K}, float32, max_len={max_len}, page_size={ps}, "
        f"{steps} timed steps)\n")
  print("| B | prompt lengths | layout | rows in use | rows read per call | K/V MB read per step | "
        "read vs contiguous | step ms (median) | p10-p90 ms | cache MB |")
  print("|---|---|---|---|---|---|---|---|---|---|")
  rng = np.random.default_rng(0)
  for b in opts["batches"]:
    lo, hi = opts["lengths"]
    lens = np.sort(rng.integers(lo, hi + 1, size=b))
    prompts = [rng.integers(0, common["vocab_size"], size=n).tolist() for n in lens]
    # Pages each sequence holds by the last timed step: its prompt + every step's k + 1 rows.
    need = int(sum(-(-(int(n) + (steps + 2) * (K + 1)) // ps) for n in lens))
    num_pages = max(b * (max_len // ps) // 2, need)
    budget = mtp_jax.blocks.pages.budget_bucket(need, num_pages)
    settings = serving.StepSettings(num_drafts=K, max_new_tokens=max_len, max_len=max_len)
    outs, base = [], None
    for layout, paging, read, rows in (("contiguous", None, mtp_jax.blocks.PageRead(), b * max_len),
                                       ("paged", serving.Paging(ps, num_pages), mtp_jax.blocks.PageRead(budget),
                                        budget * ps)):
      times, out, num_out, cache_bytes, in_use = _run(target, proposer, prompts,
                                                      dataclasses.replace(settings, paging=paging), read, steps)
      outs.append((out, num_out))
      base = base or rows
      times = times * 1e3
      print(f"| {b} | {lo}..{hi} | {layout} | {in_use} | {rows} | {rows * row_bytes / 2**20:.1f} | "
            f"{rows / base:.2f}x | {np.median(times):.2f} | {np.percentile(times, 10):.2f}-"
            f"{np.percentile(times, 90):.2f} | {cache_bytes / 2**20:.1f} |", flush=True)
    (out_a, n_a), (out_b, n_b) = outs
    assert (n_a == n_b).all() and all((out_a[i, :n] == out_b[i, :n]).all() for i, n in enumerate(n_a)), \
        "paged and contiguous emitted different tokens"


if __name__ == "__main__":
  main()
