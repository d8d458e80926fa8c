"""One cell of serve_bench's part 2, for many rounds: two or more Engine configurations interleaved.

serve_bench's part 2 runs 7 configurations a cell for 7 rounds, which resolves a paired ratio to
about a tenth here. This runs the same stream (4 x max_batch requests of 112 tokens, held-out
prompts) for the configurations named, in turns, for many rounds of one pass each, after warm-up
rounds that compile every program (a pass that still compiles is reported, not timed). It prints
each one's median pass, its paired ratio to the first configuration (the median over rounds of
their ratio within a round) with the quartiles of those ratios, and the decode calls at each verify
width per pass (`Engine.metrics()["steps_at_width"]`, over every pass of the rounds), so two
configurations that ran the same calls are seen to.

Configurations: k0 (no proposer), k1..kK (fixed num_drafts), auto (a new DraftPolicy each pass),
calibrated (a policy `Engine.calibrate` measured before the stream, in a child process, then kept).
Naming one twice times it against itself (the machine's noise).
Run: python benchmarks/serve_ab.py [--quick] [--model trained|random] [--max-batch N] [--rounds N] CONFIG CONFIG ...
"""

from __future__ import annotations

import argparse
import collections
import time

import numpy as np

import serve_bench  # (run from a checkout that is not pip-installed, it puts the checkout on sys.path)
from serve_bench import calibrated_policy, calls_at_width, clean_pass, engine_pass, load_models, requests_for

from mtp_jax import demo_models


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("configs", nargs="+", help="k0, k1..kK, auto or calibrated; the first is the base")
  ap.add_argument("--quick", action="store_true", help="the small demo model, a few short requests (a smoke run)")
  ap.add_argument("--model", choices=("trained", "random"), default="trained")
  ap.add_argument("--max-batch", type=int, default=2)
  ap.add_argument("--rounds", type=int, default=21)
  ap.add_argument("--warmup", type=int, default=2, help="untimed rounds first (default 2)")
  args = ap.parse_args(argv)
  opts = serve_bench.QUICK if args.quick else serve_bench.FULL
  name = "small" if args.quick else demo_models.default_demo()
  target, proposer = load_models(name, args.model)
  k = proposer.cfg.num_modules
  widths = {"k0": None, "auto": "auto", "calibrated": "auto", **{f"k{w}": w for w in range(1, k + 1)}}
  for c in args.configs:
    if c not in widths:
      ap.error(f"configuration {c!r}: one of {', '.join(widths)}")
  b = args.max_batch
  requests = [(p, opts["table_output"]) for p, _ in requests_for(opts["table_requests"] * b, opts, seed=2)]
  policy = calibrated_policy(name, args.model, b, opts) if "calibrated" in args.configs else None
  runs = [lambda c=c: engine_pass(target, None if c == "k0" else proposer, requests, opts, widths[c], b,
                                  policy if c == "calibrated" else None) for c in args.configs]
  for _ in range(args.warmup):
    for run in runs:
      run()
  walls, at_width, compiled = collections.defaultdict(list), collections.defaultdict(collections.Counter), 0
  t0 = time.perf_counter()
  for _ in range(args.rounds):
    for i, run in enumerate(runs):
      result, clean = clean_pass(run)
      compiled += not clean
      walls[i].append(result["wall"] if clean else float("nan"))
      at_width[i][tuple(calls_at_width(result, k))] += 1
  print(f"# serve_ab: {args.model} {name} demo, {b} slots, {len(requests)} requests of {opts['table_output']} tokens, "
        f"{args.rounds} rounds ({time.perf_counter() - t0:.0f} s); passes that compiled (not timed): {compiled}\n")
  print(f"| configuration | median pass s | paired vs {args.configs[0]} | quartiles | calls at width "
        f"{' / '.join(map(str, range(k + 1)))} (passes) |\n|---|---|---|---|---|")
  for i, c in enumerate(args.configs):
    ratios = np.asarray(walls[0]) / np.asarray(walls[i])
    calls = ", ".join(f"{' / '.join(map(str, w))} ({n})" for w, n in at_width[i].most_common())
    if np.isnan(ratios).all():  # every pass of c or of the base compiled (more warm-up rounds needed)
      print(f"| {c} | no round timed both | | | {calls} |")
      continue
    q1, q2, q3 = np.nanquantile(ratios, [0.25, 0.5, 0.75])
    print(f"| {c} | {np.nanmedian(walls[i]):.3f} | {q2:.3f}x | {q1:.3f}x-{q3:.3f}x | {calls} |")


if __name__ == "__main__":
  main()
