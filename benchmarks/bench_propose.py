"""Side-by-side timing of one decode-step `propose` (T = k + 1 new positions after a warm prompt),
and bf16 vs float32 (draft agreement and speed). Prints markdown tables.

  python benchmarks/bench_propose.py            # the full table (B in 1, 8, 32; k in 1, 3; D=256, D=1024)
  python benchmarks/bench_propose.py --quick    # a tiny smoke run

Ratios are median time / mtp_jax's median (> 1: slower than mtp_jax). Every variant's drafts and
new state are checked against mtp_jax's before it is timed. Each timed call starts from a fresh
copy of the warm state (copied outside the timer); variants take turns, rep by rep, so a change
in machine load hits them alike. Compile time is the first call minus the median call.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import variants as V
from variants import mtp_jax


def _ready(out):
  return jax.block_until_ready(out)


def check_same(name, drafts, state, ref_drafts, ref_state):
  """Drafts must be equal; lengths / positions equal; float32 caches and rings equal up to rounding."""
  drafts, ref_drafts = np.asarray(drafts), np.asarray(ref_drafts)
  assert np.array_equal(drafts, ref_drafts), f"{name}: drafts {drafts.tolist()} != mtp_jax {ref_drafts.tolist()}"
  for field in ("lengths", "num_pos", "num_drafted"):
    got, want = np.asarray(getattr(state, field)), np.asarray(getattr(ref_state, field))
    assert np.array_equal(got, want), f"{name}: {field} {got.tolist()} != mtp_jax {want.tolist()}"
  for got, want in zip(jax.tree.leaves((state.kv, state.tail)), jax.tree.leaves((ref_state.kv, ref_state.tail))):
    err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32))))
    assert err <= 1e-4, f"{name}: cache / ring differs from mtp_jax by {err}"


def time_variants(step: V.Step, classes, budget_s: float, max_reps: int) -> dict:
  """{variant name: dict(times=[s], compile=s)}; the first class is the reference."""
  runners = [cls(step) for cls in classes]
  natives, firsts = [], []
  ref = None
  for r in runners:
    native = r.prepare(step)
    natives.append(native)
    start = time.perf_counter()
    drafts, state = _ready(r.call(r.copy(native)))
    firsts.append(time.perf_counter() - start)
    state = r.to_proposer(state)
    if ref is None:
      ref = drafts, state
    else:
      check_same(r.name, drafts, state, *ref)
  # JAX variants take turns rep by rep; PyTorch runs on its own afterwards, since its OpenMP
  # threads and XLA's thread pool slow each other down when calls alternate on few cores.
  times = [[] for _ in runners]
  groups = [[i for i, r in enumerate(runners) if not isinstance(r, V.Torch)],
            [i for i, r in enumerate(runners) if isinstance(r, V.Torch)]]
  for group in groups:
    rep = 0
    while group and rep < max_reps and (rep < 5 or sum(sum(times[i]) for i in group) < budget_s * len(group)):
      for i in group:
        inp = runners[i].copy(natives[i])
        start = time.perf_counter()
        _ready(runners[i].call(inp))
        times[i].append(time.perf_counter() - start)
      rep += 1
  return {r.name: dict(times=ts, compile=first - float(np.median(ts)))
          for r, ts, first in zip(runners, times, firsts)}


def fmt_ms(ts) -> str:
  p10, p50, p90 = np.percentile(np.asarray(ts) * 1e3, [10, 50, 90])
  return f"{p50:.2f} [{p10:.2f}–{p90:.2f}]"


def variant_table(sizes, batches, drafts, budget_s, max_reps, torch: bool):
  """Prints the runtime table row by row (a run cut short keeps its rows), then compile times."""
  classes = list(V.VARIANTS)
  if not torch:
    classes.remove(V.Torch)
  elif not V.torch_available():
    print("> PyTorch is not installed: its column is skipped (`pip install torch` to include it).\n")
    classes.remove(V.Torch)
  names = [c.name for c in classes]
  print("Decode-step `propose`, median ms [p10–p90]; other columns: median / mtp_jax median "
        "(> 1 is slower), then their own ms.\n")
  print("| size | B | k | " + " | ".join(names) + " |\n" + "|---" * (3 + len(names)) + "|", flush=True)
  jitted = [n for n in names if n != V.Torch.name]
  compile_ = ["| size | B | k | " + " | ".join(jitted) + " |", "|---" * (3 + len(jitted)) + "|"]
  for size in sizes:
    params = mtp_jax.init_mtp(V.config(size), seed=0)
    for b in batches:
      for k in drafts:
        start = time.perf_counter()
        res = time_variants(V.warm_step(params, b, k), classes, budget_s, max_reps)
        print(f"  {size} B={b} k={k}: {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
        base = float(np.median(res[names[0]]["times"]))
        cells = [fmt_ms(res[names[0]]["times"]) + " ms"]
        for n in names[1:]:
          cells.append(f"{np.median(res[n]['times']) / base:.2f}× ({fmt_ms(res[n]['times'])})")
        print(f"| {size} | {b} | {k} | " + " | ".join(cells) + " |", flush=True)
        compile_.append(f"| {size} | {b} | {k} | " + " | ".join(f"{res[n]['compile']:.2f}" for n in jitted) + " |")
  print("\nCompile time, s (first call minus median call):\n")
  print("\n".join(compile_))


def memory_table(size, batches, k):
  """Compiled scratch and XLA's 'bytes accessed' of the unrolled program vs the scan."""
  params = mtp_jax.init_mtp(V.config(size), seed=0)
  rows = ["| size | B | k | weights MB | caches MB | scratch MB: mtp_jax / scan | bytes accessed MB: mtp_jax / scan |",
          "|---|---|---|---|---|---|---|"]
  for b in batches:
    step = V.warm_step(params, b, k)
    scan = V.Scan(step)
    stacked = scan.prepare(step)
    args = (step.hiddens, step.tokens, step.num_new)
    unrolled = V.donated_propose(k).lower(params, step.state, *args).compile()
    scanned = V.scan_propose.lower(scan.graphdef, scan.layers, params.embed_tokens, params.lm_head, stacked, *args,
                                   k=k).compile()
    temp = [c.memory_analysis().temp_size_in_bytes / 1e6 for c in (unrolled, scanned)]
    accessed = [c.cost_analysis().get("bytes accessed", float("nan")) / 1e6 for c in (unrolled, scanned)]
    weights = sum(x.nbytes for x in jax.tree.leaves(scan.layers)) / 1e6
    rows.append(f"| {size} | {b} | {k} | {weights:.1f} | {(stacked.k.nbytes + stacked.v.nbytes) / 1e6:.1f} | "
                f"{temp[0]:.1f} / {temp[1]:.1f} | {accessed[0]:.1f} / {accessed[1]:.1f} |")
  print("\nWhy the scan is slower: compiled scratch (memory_analysis) and XLA's bytes accessed (cost_analysis):\n")
  print("\n".join(rows))


def bf16_agreement(size: str, batch_size: int, steps: int, k: int, seed: int = 0):
  """Greedy drafts of bf16 (weights + caches) vs float32 over a random decode history.

  The float32 proposer's drafts are the verified tokens: each step accepts a random 0..k of them;
  the bf16 proposer is told how many of its own drafts that accepted (its leading agreement).
  Returns (equal drafts per position, drafts compared per position).
  """
  cfg32, cfg16 = V.config(size), V.config(size, "bfloat16")
  p32 = mtp_jax.init_mtp(cfg32, seed=0)
  p16 = mtp_jax.load_state_dict(cfg16, mtp_jax.state_dict(p32))
  rng = np.random.default_rng(seed)
  b, d, v = batch_size, cfg32.hidden_size, cfg32.vocab_size
  s32, s16 = mtp_jax.init_state(cfg32, b, V.MAX_LEN), mtp_jax.init_state(cfg16, b, V.MAX_LEN, dtype=jnp.bfloat16)
  lens = rng.integers(V.PROMPT_T // 2, V.PROMPT_T + 1, size=b).astype(np.int32)
  hid = rng.normal(size=(b, V.PROMPT_T, d)).astype(np.float32)
  toks = rng.integers(0, v, size=(b, V.PROMPT_T)).astype(np.int32)
  # K drafts after the prompt, as in decode_setup.warm_step, so the two share compiles
  d32, s32 = mtp_jax.propose(p32, s32, hid, toks, lens, num_drafts=V.K)
  d16, s16 = mtp_jax.propose(p16, s16, hid, toks, lens, num_drafts=V.K)
  equal, total = np.zeros(k, np.int64), np.zeros(k, np.int64)
  for _ in range(steps):
    d32, d16 = np.asarray(d32)[:, :k], np.asarray(d16)[:, :k]
    same = d32 == d16
    equal += same.sum(0)
    total += b
    a = rng.integers(0, k + 1, size=b).astype(np.int32)
    lead = np.argmin(np.concatenate([same, np.zeros((b, 1), bool)], axis=1), axis=1).astype(np.int32)
    s32 = mtp_jax.after_verify(s32, a)
    s16 = mtp_jax.after_verify(s16, np.minimum(a, lead))
    tokens = rng.integers(0, v, size=(b, k + 1)).astype(np.int32)
    for i in range(b):
      tokens[i, :a[i]] = d32[i, :a[i]]
    hid = rng.normal(size=(b, k + 1, d)).astype(np.float32)
    d32, s32 = mtp_jax.propose(p32, s32, hid, tokens, a + 1, num_drafts=k)
    d16, s16 = mtp_jax.propose(p16, s16, hid, tokens, a + 1, num_drafts=k)
  return equal, total


def bf16_table(sizes, batches, k, agree_batch, steps, budget_s, max_reps):
  rows = ["| size | drafts compared | equal (all) | equal per position 1..k |", "|---|---|---|---|"]
  for size in sizes:
    equal, total = bf16_agreement(size, agree_batch, steps, k)
    per = ", ".join(f"{e / t:.3f}" for e, t in zip(equal, total))
    rows.append(f"| {size} | {total.sum()} | {equal.sum() / total.sum():.3f} | {per} |")
  print(f"\nbf16 vs float32 greedy drafts (random weights, B={agree_batch}, {steps} decode steps, k={k}, "
        "random accepts):\n")
  print("\n".join(rows))
  speed = ["| size | B | float32 ms | bfloat16 ms | bf16 / f32 |", "|---|---|---|---|---|"]
  for size in sizes:
    p32 = mtp_jax.init_mtp(V.config(size), seed=0)
    p16 = mtp_jax.load_state_dict(V.config(size, "bfloat16"), mtp_jax.state_dict(p32))
    for b in batches:
      s32 = V.warm_step(p32, b, k)
      s16 = V.warm_step(p16, b, k)
      r32, r16 = V.MtpJax(s32), V.MtpJax(s16)
      n32, n16 = r32.prepare(s32), r16.prepare(s16)
      _ready(r32.call(r32.copy(n32)))
      _ready(r16.call(r16.copy(n16)))
      t32, t16 = [], []
      while len(t32) < max_reps and (len(t32) < 5 or sum(t32) + sum(t16) < budget_s):
        for r, n, ts in ((r32, n32, t32), (r16, n16, t16)):
          inp = r.copy(n)
          start = time.perf_counter()
          _ready(r.call(inp))
          ts.append(time.perf_counter() - start)
      speed.append(f"| {size} | {b} | {fmt_ms(t32)} | {fmt_ms(t16)} | {np.median(t16) / np.median(t32):.2f} |")
  print(f"\nbf16 vs float32 speed, mtp_jax propose (jit, state donated), k={k}, median ms [p10–p90]:\n")
  print("\n".join(speed))


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--quick", action="store_true", help="tiny sizes and few reps (a smoke test)")
  ap.add_argument("--no-bf16", action="store_true", help="skip the bf16 tables")
  ap.add_argument("--no-torch", action="store_true", help="skip the PyTorch column")
  ap.add_argument("--torch-threads", type=int, default=1,
                  help="PyTorch intra-op threads (default 1: on a busy machine its OpenMP threads spin on "
                       "each other and run 5-100x slower)")
  args = ap.parse_args(argv)
  if V.torch_available() and not args.no_torch:
    import torch
    torch.set_num_threads(args.torch_threads)
  if args.quick:
    sizes, batches, drafts, budget_s, max_reps, agree_batch, steps = ["D=64"], [2], [2], 0.0, 3, 2, 3
  else:
    sizes, batches, drafts, budget_s, max_reps, agree_batch, steps = (["D=256", "D=1024"], [1, 8, 32], [1, 3], 1.0,
                                                                      25, 8, 40)
  start = time.perf_counter()
  print(f"Machine: {V.machine(with_torch=not args.no_torch)}\n")
  print(f"K={V.K}, max_len={V.MAX_LEN}, float32; sizes: " + "; ".join(
      f"{s}: V={V.SIZES[s]['vocab_size']}, heads {V.SIZES[s]['num_heads']}/{V.SIZES[s]['num_kv_heads']}x"
      f"{V.SIZES[s]['head_dim']}, F={V.SIZES[s]['intermediate_size']}" for s in sizes) + "\n")
  variant_table(sizes, batches, drafts, budget_s, max_reps, torch=not args.no_torch)
  memory_table(sizes[-1], sorted({batches[0], batches[-1]}), drafts[0])
  if not args.no_bf16:
    bf16_table(sizes, sorted({batches[0], batches[-1]}), max(drafts), agree_batch, steps, budget_s, max_reps)
  print(f"\nTotal {time.perf_counter() - start:.0f} s; load average at the end {os.getloadavg()[0]:.1f}.")


if __name__ == "__main__":
  main()
