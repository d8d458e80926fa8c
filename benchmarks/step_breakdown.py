"""Where a decode step's time goes on the large demo model (B=1, greedy): each part jitted alone,
all parts taking turns rep by rep, medians.

  python benchmarks/step_breakdown.py            # the large demo model, k = 0 (plain) and k = 3
  python benchmarks/step_breakdown.py --quick    # the small one, few reps (a smoke run)

Rows: the generate loop's whole step (`DecodeStep`, as `jit_run` runs it: N steps in one
on-device loop, per step; and one `jit_step` call from Python, dispatch included), the target
forward over its cache at 1 and k + 1 rows (with and without the LM head), the LM head alone,
each MTP depth's module over its decode window, the drafting head, greedy verification, the
target's cache writes (donated, and not), and the reference read of the bytes involved. Under
the table: the compiled step's scratch and the copies of cache-sized buffers in its HLO (what
donation should leave: none).
"""

from __future__ import annotations

import argparse
import collections
import functools
import glob
import gzip
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

try:
  import mtp_jax
except ImportError:  # run as `python benchmarks/step_breakdown.py` from a checkout that is not pip-installed
  sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
  import mtp_jax
from mtp_jax import data  # noqa: E402
from mtp_jax.blocks.cache import write_rows  # noqa: E402
from mtp_jax.proposer import ProposeSettings, propose_step  # noqa: E402
from mtp_jax.serving.options import StepSettings  # noqa: E402
from mtp_jax.serving.state import SlotSettings  # noqa: E402
from mtp_jax.serving.step import DecodeStep  # noqa: E402
from mtp_jax.serving.jit import jit_prefill, jit_step  # noqa: E402
from mtp_jax.target import target_step  # noqa: E402
from mtp_jax.verify import verify_greedy  # noqa: E402

LOOP_STEPS = 8  # steps per timed on-device loop


def copy_tree(tree):
  return jax.tree.map(lambda x: x.copy() if isinstance(x, jax.Array) else x, tree)


def nbytes(tree) -> int:
  return sum(x.nbytes for x in jax.tree.leaves(tree) if isinstance(x, jax.Array))


def interleaved(cases: dict, reps: int) -> dict:
  """{name: median s} of {name: (fn, make_args)}; the cases take turns rep by rep, inputs made
  outside the timer."""
  for fn, make in cases.values():
    jax.block_until_ready(fn(*make()))
  times = {name: [] for name in cases}
  for _ in range(reps):
    for name, (fn, make) in cases.items():
      args = make()
      start = time.perf_counter()
      jax.block_until_ready(fn(*args))
      times[name].append(time.perf_counter() - start)
  return {name: float(np.median(ts)) for name, ts in times.items()}


def prefilled(step: DecodeStep, target, proposer, prompt):
  """A loop state after the prompt's prefill (batch 1)."""
  s = step.init(target, proposer, None, 1)
  t = -(-len(prompt) // 32) * 32
  prompts = np.zeros((1, t), np.int32)
  prompts[0, :len(prompt)] = prompt
  return jit_prefill(step, target, proposer, None, s, prompts, np.array([len(prompt)], np.int32),
                     np.ones((1,), bool), np.zeros((1,), bool), np.array([step.settings.max_new_tokens], np.int32),
                     SlotSettings.uniform(1, num_drafts=step.settings.num_drafts))


@functools.partial(jax.jit, static_argnames=("step", "n"), donate_argnames=("s",))
def loop_steps(step: DecodeStep, target, proposer, s, n: int):
  """n decode steps in one on-device loop, as `jit_run` runs them (no `fits` test: the caches hold them)."""
  return jax.lax.fori_loop(0, n, lambda _, s: step(target, proposer, None, s), s)


def cache_copies(hlo: str, min_bytes: int) -> list[str]:
  """The HLO's copy instructions whose result is at least min_bytes (float32 / int32 elements)."""
  found = []
  for m in re.finditer(r"= (f32|bf16|s32)\[([\d,]*)\]\{[^}]*\} copy\(", hlo):
    dims = [int(d) for d in m.group(2).split(",") if d]
    size = int(np.prod(dims)) * (2 if m.group(1) == "bf16" else 4)
    if size >= min_bytes:
      found.append(f"{m.group(1)}[{m.group(2)}]")
  return found


def op_profile(compiled, run, reps: int, top: int) -> list[str]:
  """XLA:CPU's own per-op times (jax.profiler) of `run` (a call of `compiled`), summed by the op's
  result shape and opcode, per loop step: the top `top` rows."""
  kinds = {}
  for line in compiled.as_text().splitlines():
    m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = (\S+) ([\w\-]+)\(", line)
    if m:
      kinds[m.group(1)] = f"{m.group(2).split('{')[0]} {m.group(3)}"
  with tempfile.TemporaryDirectory() as d:
    jax.profiler.start_trace(d, create_perfetto_trace=True)
    for _ in range(reps):
      jax.block_until_ready(run())
    jax.profiler.stop_trace()
    trace = json.load(gzip.open(glob.glob(os.path.join(d, "**", "perfetto_trace.json.gz"), recursive=True)[0]))
  events = trace["traceEvents"] if isinstance(trace, dict) else trace
  by_kind = collections.Counter()
  for e in events:
    op = e.get("args", {}).get("hlo_op")
    if e.get("ph") == "X" and op and not op.startswith("while") and op in kinds:
      by_kind[kinds[op]] += e["dur"] / 1e3 / reps / LOOP_STEPS
  total = sum(by_kind.values())
  rows = [f"| {kind} | {ms:.3f} | {ms / total:.2f} |" for kind, ms in by_kind.most_common(top)]
  return [f"op time per step (profiled, all ops): {total:.2f} ms", "| result, opcode | ms per step | share |",
          "|---|---|---|"] + rows


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--quick", action="store_true", help="the small demo model, 3 reps")
  ap.add_argument("--reps", type=int, default=30)
  ap.add_argument("--k", type=int, default=3)
  ap.add_argument("--profile", type=int, default=0, metavar="N", help="also print the top N ops of each loop")
  args = ap.parse_args(argv)
  name, reps = ("small", 3) if args.quick else ("large", args.reps)
  k = args.k
  target, proposer, _ = mtp_jax.load_demo(name=name)
  tcfg = target.cfg
  prompt = np.asarray(data.heldout_prompts(1, prompt_len=64, seed=0)[0], np.int32)
  max_new = 128
  # generate's cache rows for one 64-token prompt and 128 new tokens (docs/demo.md's run)
  plain = DecodeStep(StepSettings(num_drafts=0, max_new_tokens=max_new, max_len=64 + max_new + 1))
  spec = DecodeStep(StepSettings(num_drafts=k, max_new_tokens=max_new, max_len=64 + max_new + k + 1))
  s_plain = prefilled(plain, target, None, prompt)
  s_spec = prefilled(spec, target, proposer, prompt)

  cases = {}
  n = LOOP_STEPS
  cases["plain step (on-device loop, per step)"] = (
      lambda s: loop_steps(plain, target, None, s, n), lambda: (copy_tree(s_plain),))
  cases[f"k={k} step (on-device loop, per step)"] = (
      lambda s: loop_steps(spec, target, proposer, s, n), lambda: (copy_tree(s_spec),))
  cases["plain step, one jit_step call"] = (
      lambda s: jit_step(plain, target, None, None, s), lambda: (copy_tree(s_plain),))
  cases[f"k={k} step, one jit_step call"] = (
      lambda s: jit_step(spec, target, proposer, None, s), lambda: (copy_tree(s_spec),))

  # The target over its cache (the prefilled state), donated as the step donates it.
  tstep = jax.jit(lambda m, st, tok, num: target_step(m, st, tok, num), donate_argnums=1)
  for rows in (1, k + 1):
    tok = jnp.zeros((1, rows), jnp.int32)
    num = jnp.full((1,), rows, jnp.int32)
    cases[f"target forward, {rows} row(s) (LM head included)"] = (
        functools.partial(tstep, target), lambda tok=tok, num=num: (copy_tree(s_spec.target), tok, num))

  def layers_only(m, st, tok, num):
    t = tok.shape[1]
    rows_BxT = st.length[:, None] + jnp.arange(t, dtype=jnp.int32)[None]
    valid_BxT = jnp.arange(t)[None] < num[:, None]
    caches, layers = st.caches.open(st.length + num)
    h = m.embed_tokens(tok)
    new = []
    for i, layer in enumerate(m.layers):
      h, c = layer(h, rows_BxT, valid_BxT, layers[i])
      new.append(c)
    return m.norm(h), st.set(caches=caches.close(tuple(new)))

  body = jax.jit(layers_only, donate_argnums=1)
  for rows in (1, k + 1):
    tok = jnp.zeros((1, rows), jnp.int32)
    num = jnp.full((1,), rows, jnp.int32)
    cases[f"target layers only, {rows} row(s)"] = (
        functools.partial(body, target), lambda tok=tok, num=num: (copy_tree(s_spec.target), tok, num))

  head = jax.jit(lambda m, x: m.lm_head(x).astype(jnp.float32))
  for rows in (1, k + 1):
    x = jnp.ones((1, rows, tcfg.hidden_size), jnp.float32)
    cases[f"target LM head, {rows} row(s)"] = (head, lambda x=x: (target, x))

  # The proposer: the whole drafting call as the step makes it, and each depth's module alone.
  pst = s_spec.proposer
  hid = jnp.ones((1, k + 1, tcfg.hidden_size), jnp.float32)
  toks = jnp.zeros((1, k + 1), jnp.int32)
  num_new = jnp.full((1,), 2, jnp.int32)
  settings = ProposeSettings(k, catch_up=False)  # as the step drafts
  prop = jax.jit(lambda p, st, h, t, n: propose_step(p, st, h, t, n, settings), donate_argnums=1)
  cases[f"propose, k={k} (the step's drafting call)"] = (
      functools.partial(prop, proposer), lambda: (copy_tree(pst), hid, toks, num_new))

  def module(p, cache, x, i):
    w = x.shape[1]
    rows = pst.num_pos[:, None] - 2 + jnp.arange(w, dtype=jnp.int32)[None]
    return p.module(i)(x, x, rows, jnp.ones((1, w), bool), cache, rope_offset=i + 1)

  mod = jax.jit(module, static_argnums=3, donate_argnums=1)
  for i in range(k):  # the step's windows: k + 1 + i rows at depth i
    x = jnp.ones((1, k + 1 + i, tcfg.hidden_size), jnp.float32)
    cases[f"MTP depth {i + 1} module, {x.shape[1]} rows"] = (
        functools.partial(mod, proposer), lambda x=x, i=i: (copy_tree(pst.kv[i]), x, i))
  phead = jax.jit(lambda p, x: p.logits(0, x))
  cases["MTP head (norm + LM head), 1 row"] = (phead, lambda: (proposer, jnp.ones((1, tcfg.hidden_size))))

  logits = jnp.asarray(np.random.default_rng(0).normal(size=(1, k + 1, tcfg.vocab_size)), jnp.float32)
  drafts = jnp.zeros((1, k), jnp.int32)
  cases[f"verify_greedy over {k + 1} rows"] = (jax.jit(verify_greedy), lambda: (logits, drafts))

  kv_rows = jnp.full((1, k + 1), 70, jnp.int32)
  valid = jnp.ones((1, k + 1), bool)
  kv_new = jnp.ones((1, k + 1) + s_spec.target.kv[0].k.shape[2:], jnp.float32)

  def writes(kv):
    return tuple(type(c)(write_rows(c.k, kv_rows, valid, kv_new), write_rows(c.v, kv_rows, valid, kv_new)) for c in kv)

  cases[f"target cache writes, {k + 1} rows x {tcfg.num_layers} layers (donated)"] = (
      jax.jit(writes, donate_argnums=0), lambda: (copy_tree(s_spec.target.kv),))
  cases[f"target cache writes, {k + 1} rows x {tcfg.num_layers} layers (not donated)"] = (
      jax.jit(writes), lambda: (s_spec.target.kv,))

  weights = jax.tree.leaves(nnx.state(target, nnx.Param))
  mweights = jax.tree.leaves(nnx.state(proposer.layers, nnx.Param))
  read = jax.jit(lambda ws: sum(w.sum() for w in ws))
  cases[f"read every target weight once ({nbytes(weights) / 1e6:.1f} MB)"] = (read, lambda: (weights,))
  cases[f"read every MTP module weight once ({nbytes(mweights) / 1e6:.1f} MB)"] = (read, lambda: (mweights,))

  load = os.getloadavg()
  medians = interleaved(cases, reps)
  load_after = os.getloadavg()
  base = medians["plain step (on-device loop, per step)"]
  for case in ("plain step (on-device loop, per step)", f"k={k} step (on-device loop, per step)"):
    medians[case] /= n
  print(f"demo model {name}, B=1, greedy, {reps} reps interleaved, medians; load average "
        f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f} before, {load_after[0]:.2f} after; jax {jax.__version__}\n")
  base = medians["plain step (on-device loop, per step)"]
  print("| part | median ms | / plain step |\n|---|---|---|")
  for case, t in medians.items():
    print(f"| {case} | {t * 1e3:.2f} | {t / base:.2f} |")

  print()
  for label, step, s, pr in (("plain", plain, s_plain, None), (f"k={k}", spec, s_spec, proposer)):
    compiled = loop_steps.lower(step, target, pr, copy_tree(s), n).compile()
    mem = compiled.memory_analysis()
    one_cache = s.target.kv[0].k.nbytes
    copies = cache_copies(compiled.as_text(), one_cache)
    if args.profile:
      run = functools.partial(lambda c, s: c(target, pr, copy_tree(s)), compiled, s)
      print("\n".join(op_profile(compiled, run, 10, args.profile)) + "\n")
    print(f"{label} loop: scratch {mem.temp_size_in_bytes / 1e6:.2f} MB, un-aliased outputs "
          f"{(mem.output_size_in_bytes - mem.alias_size_in_bytes) / 1e6:.3f} MB; copies of >= one cache "
          f"array ({one_cache / 1e3:.0f} KB) in the HLO: {len(copies)} {copies[:6]}")


if __name__ == "__main__":
  main()
