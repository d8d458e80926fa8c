"""Where speculative decoding starts to pay: spec/plain tokens/s at k = 1..3 against the target's
weight bytes, on this machine.

The target is the small shipped demo model made deeper by zero-output layers: each added block
has random weights except o_proj and down_proj, which are zero, so its residual contributions
vanish and every depth produces the same tokens and the same acceptance as the 4-layer model,
while a decode step pays the real cost of every layer (the weights are arrays handed to jit,
never folded constants). Only the weight bytes change from row to row; the MTP modules are the
shipped ones. Batch 1, greedy, held-out prompts; plain and every k take turns (medians of the
passes, compile apart), and each speculative output is checked against plain greedy decoding.

  python benchmarks/scaling.py                      # 4 / 16 / 32 / 64 layers
  python benchmarks/scaling.py --layers 4 8 --quick
  python benchmarks/scaling.py --json scaling.json  # also writes the rows as JSON (benchmarks/plots.py reads it)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import mtp_jax  # noqa: E402
from mtp_jax import data, demo  # noqa: E402
from mtp_jax.serving import generate  # noqa: E402

ZEROED = ("self_attn.o_proj.weight", "mlp.down_proj.weight")


def deepened(target: mtp_jax.TargetModel, num_layers: int, seed: int = 0) -> mtp_jax.TargetModel:
  """`target` with zero-output blocks appended up to `num_layers` (same outputs, real cost)."""
  base = target.cfg.num_layers
  if num_layers < base:
    raise ValueError(f"num_layers must be >= the target's {base}, got {num_layers}")
  cfg = mtp_jax.TargetConfig(**{**target.cfg.__dict__, "num_layers": num_layers})
  tensors = mtp_jax.target_state_dict(mtp_jax.init_target(cfg, seed))
  tensors.update(mtp_jax.target_state_dict(target))
  for i in range(base, num_layers):
    for name in ZEROED:
      key = f"model.layers.{i}.{name}"
      tensors[key] = np.zeros_like(tensors[key])
  return mtp_jax.load_target_state_dict(cfg, tensors)


def weight_bytes(model) -> int:
  return sum(x.nbytes for x in jax.tree.leaves(model))


def measure(num_layers: int, ks, *, num_prompts: int, prompt_len: int, max_new_tokens: int, repeats: int):
  """One table row: dict(layers, mb, plain tok/s, {k: (spec tok/s, spec/plain, accepted length)})."""
  small, proposer, _ = demo.load_demo(name="small")
  target = deepened(small, num_layers)
  prompts = data.heldout_prompts(num_prompts, prompt_len=prompt_len, seed=0)
  decoders = [lambda p: generate(target, None, [p], max_new_tokens)]
  decoders += [lambda p, k=k: generate(target, proposer, [p], max_new_tokens, num_drafts=k) for k in ks]
  outs, secs, _ = demo._interleaved(decoders, prompts, repeats)
  tokens = sum(o.stats["generated_tokens"] for o in outs[0])
  row = dict(layers=num_layers, mb=weight_bytes(target) / 1e6, plain=tokens / float(np.median(secs[0])), spec={})
  for k, spec, spec_secs in zip(ks, outs[1:], secs[1:]):
    if [o.tokens for o in spec] != [o.tokens for o in outs[0]]:
      raise AssertionError(f"{num_layers} layers, k={k}: speculative output differs from plain greedy output")
    steps = sum(o.stats["verify_calls"] for o in spec)
    acc_len = sum(o.stats["mean_accepted_length"] * o.stats["verify_calls"] for o in spec) / steps
    row["spec"][k] = (tokens / float(np.median(spec_secs)), float(np.median(secs[0] / spec_secs)), acc_len)
  return row


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--layers", type=int, nargs="+", default=[4, 16, 32, 64])
  parser.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3])
  parser.add_argument("--num-prompts", type=int, default=4)
  parser.add_argument("--prompt-len", type=int, default=64)
  parser.add_argument("--max-new-tokens", type=int, default=96)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--quick", action="store_true", help="a tiny smoke run (2 prompts, 16 tokens, 1 pass)")
  parser.add_argument("--json", metavar="PATH", help="also write the settings and rows to PATH as JSON")
  args = parser.parse_args(argv)
  if args.quick:
    args.num_prompts, args.max_new_tokens, args.repeats = 2, 16, 1
  print(f"# spec/plain vs target weight bytes ({jax.default_backend()}, {jax.devices()[0].device_kind}); "
        f"{args.num_prompts} prompts x {args.max_new_tokens} tokens, batch 1, greedy, medians of "
        f"{args.repeats} interleaved passes; zero-output layers on the small demo target\n")
  head = "| layers | target MB (f32) | plain tok/s | " + " | ".join(
      f"k={k} tok/s | k={k} spec/plain" for k in args.ks) + " | accepted len (k=" + str(max(args.ks)) + ") |"
  print(head)
  print("|" + "---|" * (head.count("|") - 1))
  rows = []
  for n in args.layers:
    t0 = time.perf_counter()
    r = measure(n, args.ks, num_prompts=args.num_prompts, prompt_len=args.prompt_len,
                max_new_tokens=args.max_new_tokens, repeats=args.repeats)
    cells = " | ".join(f"{r['spec'][k][0]:.0f} | {r['spec'][k][1]:.2f}x" for k in args.ks)
    print(f"| {n} | {r['mb']:.1f} | {r['plain']:.0f} | {cells} | {r['spec'][max(args.ks)][2]:.2f} |", flush=True)
    print(f"<!-- {n} layers: {time.perf_counter() - t0:.0f} s with compiles -->", flush=True)
    rows.append(dict(layers=r["layers"], mb=r["mb"], plain_tokens_per_s=r["plain"],
                     spec={str(k): dict(tokens_per_s=t, spec_over_plain=x, accepted_length=a)
                           for k, (t, x, a) in r["spec"].items()}))
    if args.json:  # rewritten after every row, so a long run stopped early keeps the rows it measured
      settings = {k: getattr(args, k) for k in ("layers", "ks", "num_prompts", "prompt_len", "max_new_tokens",
                                                 "repeats")}
      with open(args.json, "w") as f:
        json.dump(dict(benchmark="scaling", backend=jax.default_backend(), device_kind=jax.devices()[0].device_kind,
                       jax_version=jax.__version__, settings=settings, rows=rows), f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
