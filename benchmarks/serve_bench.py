"""Serving a request stream: `mtp_jax.Engine` (continuous batching, paged) vs fixed `generate` batches.

N requests with mixed prompt and output lengths arrive at once, in order. The engine keeps
`max_batch` slots busy, refilling each as its request ends, with a page pool smaller than
max_batch full-length sequences (a request waits while the pool cannot hold its worst case); the baseline runs them as
consecutive `generate` batches of max_batch in arrival order, each running until its longest
request ends. Both are greedy; each pass runs twice and the second (warm, compiled) is timed.
Prints throughput, cache memory and how many outputs agree. Run: python benchmarks/serve_bench.py [--quick].
"""

from __future__ import annotations

import argparse
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

K = 3
FULL = dict(sizes=dict(vocab_size=258, hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=64,
                       intermediate_size=704), num_layers=4, num_requests=32, max_batch=8,
            prompt_lens=(16, 200), output_lens=(8, 120), max_len=384, page_size=32, num_pages=56)
QUICK = dict(sizes=dict(vocab_size=64, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
                        intermediate_size=128), num_layers=2, num_requests=6, max_batch=2,
             prompt_lens=(4, 40), output_lens=(4, 24), max_len=96, page_size=16, num_pages=8)


def _engine_pass(target, proposer, requests, opts):
  engine = mtp_jax.Engine(target, proposer, max_batch=opts["max_batch"], max_len=opts["max_len"],
                          page_size=opts["page_size"], num_pages=opts["num_pages"], num_drafts=K)
  t0 = time.perf_counter()
  ids = [engine.add_request(p, m) for p, m in requests]
  out = engine.run()
  wall = time.perf_counter() - t0
  return wall, [out[i] for i in ids], engine.metrics()["cache_bytes"], engine


def _generate_pass(target, proposer, requests, opts):
  t0 = time.perf_counter()
  outs, peak = [], 0
  b = opts["max_batch"]
  for start in range(0, len(requests), b):
    chunk = requests[start:start + b]
    longest = max(m for _, m in chunk)
    res = mtp_jax.generate(target, proposer, [p for p, _ in chunk], longest, num_drafts=K)
    outs += [toks[:m] for toks, (_, m) in zip(res.tokens, chunk)]
    # generate's caches: B x max_len rows per layer (max_len = padded prompt + longest + k + 1)
    t = -(-max(len(p) for p, _ in chunk) // 32) * 32
    rows = len(chunk) * (t + longest + K + 1)
    peak = max(peak, rows)
  return time.perf_counter() - t0, outs, peak


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run)")
  opts = QUICK if ap.parse_args(argv).quick else FULL
  common = opts["sizes"]
  target = mtp_jax.init_target(mtp_jax.TargetConfig(num_layers=opts["num_layers"], **common), 0)
  proposer = mtp_jax.init_mtp(mtp_jax.MtpConfig(num_modules=K, **common), 1)
  rng = np.random.default_rng(0)
  n = opts["num_requests"]
  requests = [(rng.integers(0, common["vocab_size"], size=int(rng.integers(*opts["prompt_lens"]))).tolist(),
               int(rng.integers(*opts["output_lens"]))) for _ in range(n)]
  for _ in range(2):  # the first pass compiles
    e_wall, e_out, e_bytes, engine = _engine_pass(target, proposer, requests, opts)
    g_wall, g_out, g_rows = _generate_pass(target, proposer, requests, opts)
  tokens = sum(len(o) for o in e_out)
  assert tokens == sum(m for _, m in requests)  # no eos: every request gets all its tokens
  # bytes per cache row, all layers of target and proposer: from the engine's pools
  row_bytes = e_bytes / (engine.num_pages * engine.page_size)
  agree = sum(a == b for a, b in zip(e_out, g_out))
  print(f"# serving {n} requests ({jax.devices()[0].platform}, D={common['hidden_size']}, "
        f"{opts['num_layers']} target layers, K=k={K}; prompts {opts['prompt_lens'][0]}.."
        f"{opts['prompt_lens'][1]}, outputs {opts['output_lens'][0]}..{opts['output_lens'][1]} tokens)\n")
  print("| loop | batch | wall s | tokens/s | cache MB | outputs equal |")
  print("|---|---|---|---|---|---|")
  print(f"| Engine (paged, page_size={opts['page_size']}, {engine.num_pages} pages) | {opts['max_batch']} slots | "
        f"{e_wall:.2f} | {tokens / e_wall:.1f} | {e_bytes / 2**20:.1f} | {agree}/{n} |")
  print(f"| fixed generate batches | {opts['max_batch']} | {g_wall:.2f} | {tokens / g_wall:.1f} | "
        f"{g_rows * row_bytes / 2**20:.1f} (largest batch) | reference |")
  ttft = [r.stats["ttft_s"] for r in engine.requests.values()]
  acc = [r.stats["accepted_length"] for r in engine.requests.values()]
  print(f"\nEngine per request: time to first token median {np.median(ttft):.2f} s (max {max(ttft):.2f} s), "
        f"accepted length median {np.median(acc):.2f}.")


if __name__ == "__main__":
  main()
