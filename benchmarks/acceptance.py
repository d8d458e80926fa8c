"""Sampled drafts' acceptance under each rule: Gumbel acceptance vs lossless rejection sampling.

The trained large demo (K = 3) on held-out prompts, k = 1..3 drafts, temperature 0.7 and 1.0
with top_p 0.95 (and greedy as the reference): tokens per verify step (mean accepted length) of
`generate(acceptance="gumbel")` and `generate(acceptance="rejection")` side by side, over the same
prompts and seeds. Counts, not times, so the machine's load does not move them. Also checks that
every Gumbel run's tokens equal plain sampling's with the same seed (the rule's guarantee).

    python benchmarks/acceptance.py [--quick] [--seeds N] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

import mtp_jax
from mtp_jax import data


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--quick", action="store_true",
                  help="the small demo, 2 prompts, 1 seed, 16 tokens, temperature 1 only, k = 1 and K (a smoke run)")
  ap.add_argument("--seeds", type=int, default=3)
  ap.add_argument("--json", type=Path, default=None)
  args = ap.parse_args(argv)
  name, n_prompts, new, seeds = ("small", 2, 16, 1) if args.quick else ("large", 8, 128, args.seeds)
  target, proposer, _ = mtp_jax.load_demo(name=name)
  prompts = data.heldout_prompts(n_prompts, prompt_len=64, seed=0)
  k_max = proposer.cfg.num_depths
  print(f"# accepted length by acceptance rule ({name} demo, K={k_max}, {n_prompts} held-out prompts x {new} "
        f"tokens, batch {n_prompts}, {seeds} seed(s) pooled)\n")
  print("| temperature | top_p | k | gumbel | rejection | gumbel / rejection | gumbel == plain |")
  print("|---|---|---|---|---|---|---|")
  rows = []
  settings = [(1.0, 0.95)] if args.quick else [(0.0, None), (0.7, 0.95), (1.0, 0.95)]
  ks = [1, k_max] if args.quick else range(1, k_max + 1)
  for temperature, top_p in settings:
    plain = [mtp_jax.generate(target, None, prompts, new, temperature=temperature, top_p=top_p, seed=s).tokens
             for s in range(seeds)]
    for k in ks:
      length, same = {}, True
      for rule in ("gumbel", "rejection"):
        tokens, steps = 0, 0
        for s in range(seeds):
          out = mtp_jax.generate(target, proposer, prompts, new, num_drafts=k, temperature=temperature, top_p=top_p,
                                 seed=s, acceptance=rule)
          tokens += out.stats["generated_tokens"] - len(prompts)  # the prefill's token is no verify step's
          steps += out.stats["verify_calls"]
          if rule == "gumbel":
            same &= out.tokens == plain[s]
        length[rule] = tokens / steps
      g, r = length["gumbel"], length["rejection"]
      rows.append(dict(temperature=temperature, top_p=top_p, k=k, gumbel=g, rejection=r, gumbel_equals_plain=same))
      print(f"| {temperature} | {top_p or '-'} | {k} | {g:.3f} | {r:.3f} | {g / r:.3f} | {same} |", flush=True)
  sampled = [r for r in rows if r["temperature"] > 0]
  print(f"\nsampled rows: gumbel / rejection median {np.median([r['gumbel'] / r['rejection'] for r in sampled]):.3f}")
  if args.json:
    args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
  main()
