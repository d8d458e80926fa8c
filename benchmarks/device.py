"""The GPU path, measured rather than assumed: one prepared device script, correctness first.

  python benchmarks/device.py --json out.json   # an accelerator: realistic shapes, under 8 min (--deadline-s)
  python benchmarks/device.py --cpu             # tiny shapes on the CPU, under a minute (--quick is the same)

Sections, in this order (rows print as markdown tables as they are measured, and each row is
appended at once to --json PATH as one JSON object per line with its "section" and "what", so a
run cut short keeps every row it measured):

1. correctness: greedy speculative decoding (k = 3) against plain `generate(target, None, ...)`
   on the shipped demo model (large) and on random models (GQA and MLA, float32 and bfloat16).
   Where a sequence differs, the plain target's logits at its first differing token decide:
   a near-tie (the two tokens' logits within the dtype's rounding, TIE_TOL) passes as such;
   anything else fails the run (exit status 1; the timings still run and say what they did).
2. generate: tokens/s of plain and k = 1..3 at B = 1, 8, 32, 64 (same prompts), spec / plain.
3. step: the k = 3 step / plain step time at B = 1, from the generate rows: wall / verify_calls.
4. propose: `propose` (jit, state donated) at B = 1 against weight bytes / the read bandwidth
   measured in the same reps.
5. attention: one layer's attention over paged K/V: the library's page list
   (`PagedKVCache.attend_pages`), its dense span (the gathered pages + `masks.gqa_attention`) and
   `jax.nn.dot_product_attention` (xla; cudnn on a GPU) on the same gathered span; outputs agree first.
6. engine: `Engine` tokens/s (add_request for each prompt, then run()), plain and k = 3.
7. paged: `generate` with page_size vs contiguous caches on one long prompt (1k..32k tokens).

Every timed call is warmed up first (its compile), then timed as the median of --reps calls, each
ended by jax.block_until_ready. The correctness checks always run (they gate the timings); the
timing sections share what --deadline-s leaves, by weight as each starts. Each measures its first
cell while the deadline is ahead; a later cell whose expected time (the longest cell of its section
so far) would overrun the section's share prints a row "skipped: out of time" instead.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

try:
  import mtp_jax
except ImportError:  # run as `python benchmarks/x.py` from a checkout that is not pip-installed
  sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
  import mtp_jax

import bandwidth  # noqa: E402  (the reference copies and sums that bandwidth.py times)
from mtp_jax.blocks import masks  # noqa: E402
from mtp_jax.blocks.paged import PagedKVCache  # noqa: E402
from mtp_jax.blocks.pages import AttentionMetadata  # noqa: E402

K = 3  # MTP modules of the random models; the demo models have 3 too
# Relative logit margin (of max(1, |top logit|)) under which two tokens count as tied: float32 allows
# TF32-level matmul rounding (a GPU's default), bfloat16 its 8-bit mantissa over a few layers.
TIE_TOL = {"float32": 1e-3, "bfloat16": 3e-2}
# In run order: the cheap and telling sections before the long-context ones.
SECTIONS = ("correctness", "generate", "step", "propose", "attention", "engine", "paged")

GPU = dict(
    # about 0.5B target params (1 GB in bfloat16) + 3 MTP modules: weight-bound at small batches
    shape=dict(vocab_size=32000, hidden_size=2048, num_heads=16, num_kv_heads=4, head_dim=128,
               intermediate_size=5632),
    mla=mtp_jax.MlaConfig(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                          q_lora_rank=1536),
    layers=8, check_layers=2, dtype="bfloat16", demo_tables=True, check_batch=8,
    checks=(("GQA", "float32"), ("GQA", "bfloat16"), ("MLA", "float32"), ("MLA", "bfloat16")),
    batches=(1, 8, 32, 64), ks=(0, 1, 2, 3), engine_batches=(8, 32), engine_ks=(0, 3),
    prompt_len=64, new_tokens=128, contexts=(1024, 4096, 16384, 32768), paged_ks=(0, 3), paged_new=64,
    page_size=64, bw_mb=1024, attn=dict(batch=8, rows=4, kv_heads=4, groups=4, head_dim=128, page_size=64,
                                        lengths=(4096, 32768)),
    reps=5, deadline_s=420.0,
    # shares of what the deadline leaves after the correctness checks (never skipped: they gate the
    # timings), given out as each section starts; the step section reads the generate rows
    weights=dict(generate=0.4, propose=0.07, attention=0.1, engine=0.16, paged=0.27))
# The CPU run keeps every section but few cells: a k = 3 generate compiles in 5-7 s on 2 cores, even this small.
CPU = dict(
    shape=dict(vocab_size=128, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128),
    mla=mtp_jax.MlaConfig(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8),
    layers=2, check_layers=2, dtype="float32", demo_tables=False, check_batch=4,
    checks=(("GQA", "float32"), ("MLA", "bfloat16")),
    batches=(1, 4), ks=(0, 3), engine_batches=(4,), engine_ks=(0, 1),
    prompt_len=16, new_tokens=16, contexts=(256,), paged_ks=(0,), paged_new=8, page_size=16,
    bw_mb=16, attn=dict(batch=2, rows=4, kv_heads=2, groups=2, head_dim=16, page_size=16, lengths=(256,)),
    reps=3, deadline_s=70.0,
    weights=dict(generate=0.35, propose=0.1, attention=0.1, engine=0.25, paged=0.2))


# ---- reporting and time-boxing ----

def _cell(value) -> str:
  if value is None:
    return ""
  if isinstance(value, bool):
    return "yes" if value else "NO"
  if isinstance(value, float):
    return f"{value:.0f}" if abs(value) >= 100 else f"{value:.3g}"
  return str(value)


class Report:
  """Markdown tables on stdout, one per section, and the same rows as JSON lines in `path` (or none)."""

  def __init__(self, path: str | None):
    self.path, self.section, self.columns, self.failures = path, None, (), 0
    if path:
      Path(path).write_text("")

  def table(self, section: str, title: str, columns: tuple[str, ...]) -> None:
    self.section, self.columns = section, ("what",) + columns
    print(f"\n## {section}: {title}\n\n| " + " | ".join(self.columns) + " |\n|" + "---|" * len(self.columns),
          flush=True)

  def row(self, what: str, **fields) -> dict:
    record = dict(section=self.section, what=what, **fields)
    print("| " + " | ".join(_cell(record.get(c)) for c in self.columns) + " |", flush=True)
    if self.path:
      with open(self.path, "a") as f:
        f.write(json.dumps(record) + "\n")
    return record


class Budget:
  """The run's deadline, shared out among the sections by weight as each one starts."""

  def __init__(self, seconds: float, weights: dict):
    self.end = time.monotonic() + seconds
    self.weights = dict(weights)

  def box(self, section: str) -> "Box":
    w = self.weights.pop(section)
    total = w + sum(self.weights.values())
    left = max(0.0, self.end - time.monotonic())
    return Box(time.monotonic() + (left * w / total if total else 0.0), self.end)


class Box:
  """One section's end: its first cell runs while the run's deadline is ahead (so every section
  measures something), a later one if the longest cell so far would still end by the section's end."""

  def __init__(self, end: float, deadline: float):
    self.end, self.deadline, self.longest, self.cells = end, deadline, 0.0, 0

  def allows(self) -> bool:
    now = time.monotonic()
    return now < self.deadline if self.cells == 0 else now + self.longest <= self.end

  def run(self, fn):
    start = time.monotonic()
    self.cells += 1
    try:
      return fn()
    finally:
      self.longest = max(self.longest, time.monotonic() - start)


def median_call(fn, reps: int, make_args=lambda: ()):
  """(first call s, median s of `reps` calls after it, the last output) of fn(*make_args());
  the arguments are made outside the timer and every call is blocked on."""
  start = time.perf_counter()
  out = jax.block_until_ready(fn(*make_args()))
  first = time.perf_counter() - start
  times = []
  for _ in range(reps):
    args = make_args()
    start = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return first, float(np.median(times)), out


def _error(e: Exception) -> str:
  return f"error: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"


# ---- models and prompts ----

class Models:
  """The models the sections share, built once: the demo model and random ones by (attention, dtype, layers)."""

  def __init__(self, opts: dict):
    self.opts, self._built = opts, {}

  def demo(self):
    if "demo" not in self._built:
      target, proposer, _ = mtp_jax.load_demo(name="large")
      self._built["demo"] = (target, proposer)
    return self._built["demo"]

  def random(self, attention: str, dtype: str, layers: int):
    key = (attention, dtype, layers)
    if key not in self._built:
      common = dict(self.opts["shape"], dtype=dtype, mla=self.opts["mla"] if attention == "MLA" else None)
      self._built[key] = (mtp_jax.init_target(mtp_jax.TargetConfig(num_layers=layers, **common), 0),
                          mtp_jax.init_mtp(mtp_jax.MtpConfig(num_modules=K, **common), 1))
    return self._built[key]

  def timed_random(self):
    """The random GQA model the timing sections run (the run's dtype and layer count)."""
    return self.random("GQA", self.opts["dtype"], self.opts["layers"])

  def tables(self) -> list[tuple[str, tuple]]:
    """(name, (target, proposer)) of the models the generate / engine / paged tables run."""
    rand = (f"random GQA {self.opts['dtype']} x{self.opts['layers']}", self.timed_random())
    return [("demo large float32", self.demo()), rand] if self.opts["demo_tables"] else [rand]


def prompts_for(target, n: int, length: int, seed: int = 0) -> list[list[int]]:
  """n prompts of `length` tokens: held-out text for the byte-level demo models, random ids otherwise."""
  v = target.cfg.vocab_size
  if v == mtp_jax.data.VOCAB_SIZE:
    return mtp_jax.data.heldout_prompts(n, prompt_len=length, seed=seed)
  return np.random.default_rng(seed).integers(0, v, size=(n, length)).tolist()


def _round_up(n: int, m: int) -> int:
  return -(-n // m) * m


def gen_max_len(opts: dict) -> int:
  """One max_len for plain and every k (room for k = K), so no cell's caches grow mid-run."""
  return _round_up(opts["prompt_len"] + opts["new_tokens"] + K + 1, 64)


def run_generate(models, prompts, k: int, max_new: int, max_len: int, page_size: int | None = None):
  target, proposer = models
  return lambda: mtp_jax.generate(target, proposer if k else None, prompts, max_new, num_drafts=k or None,
                                  max_len=max_len, page_size=page_size)


@jax.jit
def _last_logits(target, tokens_1xL, valid_1xL):
  """float32[1, L, V] logits of a cache-free forward over the valid rows."""
  rows = jnp.arange(tokens_1xL.shape[1], dtype=jnp.int32)[None]
  return target(tokens_1xL, rows, valid_1xL, None)[0]


def compare(target, prompts, plain: list[list[int]], spec: list[list[int]], pad: int, dtype: str):
  """(verdict, tokens equal / all, worst relative margin or None): "equal", "near-tie" when every
  sequence's first differing token is within TIE_TOL of plain's under the plain target's logits
  (a cache-free forward over the prompt and plain's tokens before it), else "DIFFERS"."""
  equal = sum(int(a == b) for p, s in zip(plain, spec) for a, b in zip(p, s))
  total = sum(len(p) for p in plain)
  worst = None
  for prompt, p, s in zip(prompts, plain, spec):
    at = next((i for i, (a, b) in enumerate(zip(p, s)) if a != b), None)
    if at is None:
      continue
    prefix = list(prompt) + p[:at]
    tokens = np.zeros((1, pad), np.int32)
    tokens[0, :len(prefix)] = prefix
    logits = np.asarray(_last_logits(target, jnp.asarray(tokens), jnp.arange(pad)[None] < len(prefix)))
    row = logits[0, len(prefix) - 1]
    margin = float(row[p[at]] - row[s[at]]) / max(1.0, float(np.abs(row).max()))
    worst = margin if worst is None else max(worst, margin)
  if worst is None and len(plain) == len(spec) and all(len(a) == len(b) for a, b in zip(plain, spec)):
    return "equal", equal / total, None
  return ("near-tie" if worst is not None and worst <= TIE_TOL[dtype] else "DIFFERS"), equal / total, worst


# ---- sections ----

def section_correctness(report: Report, models: Models, opts: dict) -> None:
  report.table("correctness", f"greedy k = {K} vs plain generate, B = {opts['check_batch']}, "
               f"{opts['new_tokens']} new tokens; a differing token is judged by the plain target's logits",
               ("model", "dtype", "batch", "k", "verdict", "tokens_equal", "margin", "passed", "accepted_len"))
  cases = [("demo large", "float32", models.demo)]
  # The timing model first: its check compiles the generate cells of its batch.
  timing = ("GQA", opts["dtype"])
  for attention, dtype in sorted(opts["checks"], key=lambda c: c != timing):
    layers = opts["layers"] if (attention, dtype) == timing else opts["check_layers"]
    cases.append((f"random {attention} x{layers}", dtype,
                  lambda a=attention, d=dtype, n=layers: models.random(a, d, n)))
  b, new, max_len = opts["check_batch"], opts["new_tokens"], gen_max_len(opts)
  for name, dtype, build in cases:
    fields = dict(model=name, dtype=dtype, batch=b, k=K)

    def check(build=build, dtype=dtype):
      pair = build()
      prompts = prompts_for(pair[0], b, opts["prompt_len"])
      plain = run_generate(pair, prompts, 0, new, max_len)()
      spec = run_generate(pair, prompts, K, new, max_len)()
      verdict, frac, margin = compare(pair[0], prompts, plain.tokens, spec.tokens, opts["prompt_len"] + new, dtype)
      return verdict, frac, margin, spec.stats["mean_accepted_length"]

    try:
      verdict, frac, margin, accepted = check()
    except Exception as e:  # a check that cannot run has not passed
      report.failures += 1
      report.row(_error(e), **fields, passed=False)
      continue
    passed = verdict != "DIFFERS"
    report.failures += not passed
    report.row("spec == plain, token by token", **fields, verdict=verdict, tokens_equal=frac, margin=margin,
               passed=passed, accepted_len=accepted)


def section_generate(report: Report, box: Box, models: Models, opts: dict, results: dict) -> None:
  new, reps, max_len = opts["new_tokens"], opts["reps"], gen_max_len(opts)
  report.table("generate", f"mtp_jax.generate tokens/s (B x {new} new tokens / median wall of {reps} calls, "
               f"prefill included), greedy, prompts of {opts['prompt_len']} tokens, max_len {max_len}; compile_s: "
               "first call - median (about 0 where the correctness checks compiled the cell)",
               ("model", "batch", "k", "tokens_per_s", "spec_over_plain", "ms_per_call", "compile_s",
                "accepted_len", "same_as_plain"))
  tables = [(name, pair, prompts_for(pair[0], max(opts["batches"]), opts["prompt_len"]))
            for name, pair in models.tables()]
  for b in opts["batches"]:  # batch by batch, so a run out of time has every model's small batches
    for name, pair, prompts in tables:
      for k in opts["ks"]:
        fields = dict(model=name, batch=b, k=k)
        if not box.allows():
          report.row("skipped: out of time", **fields)
          continue
        try:
          first, median, out = box.run(lambda: median_call(run_generate(pair, prompts[:b], k, new, max_len), reps))
        except Exception as e:
          report.row(_error(e), **fields)
          continue
        results[("generate", name, b, k)] = (out, median)
        plain = results.get(("generate", name, b, 0))
        tps = out.stats["generated_tokens"] / median
        report.row("generate, greedy" if k else "generate, plain (proposer None)", **fields, tokens_per_s=tps,
                   spec_over_plain=plain[1] / median if plain else None, ms_per_call=1e3 * median,
                   compile_s=first - median, accepted_len=out.stats["mean_accepted_length"] if k else None,
                   same_as_plain=(sum(a == c for a, c in zip(out.tokens, plain[0].tokens)) / b) if plain else None)


def section_engine(report: Report, box: Box, models: Models, opts: dict, results: dict) -> None:
  new, reps = opts["new_tokens"], opts["reps"]
  max_len = _round_up(opts["prompt_len"] + new + K + 1, 16)
  report.table("engine", f"mtp_jax.Engine tokens/s: add_request for each of B prompts, then run(), max_batch = B, "
               f"{new} new tokens each; median of {reps} runs on fresh engines (built outside the timer)",
               ("model", "batch", "k", "tokens_per_s", "spec_over_plain", "ms_per_run", "compile_s",
                "same_as_generate_plain"))
  for name, (target, proposer) in models.tables():
    prompts = prompts_for(target, max(opts["engine_batches"]), opts["prompt_len"])
    for b in opts["engine_batches"]:
      plain_s = None
      for k in opts["engine_ks"]:
        fields = dict(model=name, batch=b, k=k)
        if not box.allows():
          report.row("skipped: out of time", **fields)
          continue
        engine = lambda: mtp_jax.Engine(target, proposer if k else None, max_batch=b, max_len=max_len,
                                        num_drafts=k or None)

        def serve(eng):
          for p in prompts[:b]:
            eng.add_request(p, new)
          return eng.run()

        try:
          first, median, out = box.run(lambda: median_call(serve, reps, lambda: (engine(),)))
        except Exception as e:
          report.row(_error(e), **fields)
          continue
        plain_s = median if k == 0 else plain_s
        gen_plain = results.get(("generate", name, b, 0))
        tokens = [out[rid] for rid in sorted(out)]
        report.row("Engine.run, greedy" if k else "Engine.run, plain (proposer None)", **fields,
                   tokens_per_s=sum(map(len, tokens)) / median,
                   spec_over_plain=plain_s / median if plain_s else None, ms_per_run=1e3 * median,
                   compile_s=first - median,
                   same_as_generate_plain=(sum(a == c for a, c in zip(tokens, gen_plain[0].tokens)) / b
                                           if gen_plain else None))


def section_step(report: Report, models: Models, opts: dict, results: dict) -> None:
  report.table("step", f"time per verify step at B = 1, k = {K} vs plain: median generate wall (prefill of "
               f"{opts['prompt_len']} tokens + the loop) / stats['verify_calls'] (one sequence: one call per step)",
               ("model", "plain_step_ms", "spec_step_ms", "step_ratio", "accepted_len", "spec_over_plain"))
  for name, _ in models.tables():
    plain, spec = results.get(("generate", name, 1, 0)), results.get(("generate", name, 1, K))
    if plain is None or spec is None:
      report.row("skipped: needs the generate rows at B = 1 (k = 0 and 3)", model=name)
      continue
    step = lambda r: r[1] / r[0].stats["verify_calls"]
    report.row(f"k = {K} step / plain step", model=name, plain_step_ms=1e3 * step(plain),
               spec_step_ms=1e3 * step(spec), step_ratio=step(spec) / step(plain),
               accepted_len=spec[0].stats["mean_accepted_length"], spec_over_plain=plain[1] / spec[1])


def warm_propose_state(proposer, k: int, prompt_len: int, max_len: int, seed: int = 0):
  """(state, hiddens dtype[1, k + 1, D], tokens int32[1, k + 1], num_new int32[1]): a prompt call of
  prompt_len positions, a verification that accepted a random 0..k drafts, the next step's inputs."""
  cfg = proposer.cfg
  d, v, dt = cfg.hidden_size, cfg.vocab_size, cfg.jnp_dtype
  rng = np.random.default_rng(seed)
  hid = lambda t: jnp.asarray(rng.normal(size=(1, t, d)), dt)
  tok = lambda t: jnp.asarray(rng.integers(0, v, size=(1, t)), jnp.int32)
  state = mtp_jax.init_state(cfg, 1, max_len)
  _, state = mtp_jax.propose(proposer, state, hid(prompt_len), tok(prompt_len), jnp.array([prompt_len]),
                             num_drafts=K)
  accepted = jnp.asarray(rng.integers(0, k + 1, size=1), jnp.int32)
  return mtp_jax.after_verify(state, accepted), hid(k + 1), tok(k + 1), accepted + 1


def section_propose(report: Report, box: Box, models: Models, opts: dict) -> None:
  _, proposer = models.timed_random()
  cfg, reps = proposer.cfg, opts["reps"]
  modules = sum(x.nbytes for x in jax.tree.leaves(nnx.state(proposer.layers, nnx.Param)))
  head = proposer.lm_head.weight.nbytes
  report.table("propose", f"mtp_jax.propose (jit, state donated) at B = 1, random {cfg.dtype} proposer, D = "
               f"{cfg.hidden_size}, V = {cfg.vocab_size}, K = {K} modules (all run: catch_up) after a "
               f"{opts['prompt_len']}-token prompt; bound = weight bytes (the modules + the LM head once per draft) "
               f"/ the read bandwidth of a {opts['bw_mb']} MB array sum timed in turn with it",
               ("k", "weight_mb", "ms", "bound_ms", "share_of_read_bw", "read_gbs", "stream_gbs"))
  if not box.allows():
    report.row("skipped: out of time")
    return
  cases, sizes = [], []
  for k in (1, K):
    state, hid, tok, num_new = warm_propose_state(proposer, k, opts["prompt_len"], 4 * opts["prompt_len"])
    fn = jax.jit(lambda p, s, h, t, n, k=k: mtp_jax.propose(p, s, h, t, n, num_drafts=k), donate_argnums=1)
    cases.append((fn, lambda state=state, hid=hid, tok=tok, num_new=num_new: (
        proposer, jax.block_until_ready(jax.tree.map(jnp.copy, state)), hid, tok, num_new)))
    sizes.append((k, modules + k * head))
  try:
    medians, gbs = box.run(lambda: bandwidth.timed_with_references(cases, bandwidth.reference_cases(opts["bw_mb"]),
                                                                   reps))
  except Exception as e:
    report.row(_error(e))
    return
  stream, read = bandwidth.best(gbs)
  for (k, nbytes), t in zip(sizes, medians):
    bound = nbytes / (read * 1e9)
    report.row("propose vs weight bytes / read bandwidth", k=k, weight_mb=nbytes / 1e6, ms=1e3 * t,
               bound_ms=1e3 * bound, share_of_read_bw=bound / t, read_gbs=read, stream_gbs=stream)


def section_paged(report: Report, box: Box, models: Models, opts: dict) -> None:
  name, pair = models.tables()[0]
  new, ps, reps = opts["paged_new"], opts["page_size"], opts["reps"]
  report.table("paged", f"generate on one long prompt (B = 1, {new} new tokens, {name}), page_size={ps} vs "
               f"contiguous caches of the same max_len; tokens/s = {new} / median wall of {reps} calls "
               "(the prompt's prefill included); step_ms = wall / verify_calls",
               ("context", "k", "layout", "tokens_per_s", "step_ms", "paged_over_contiguous", "same_tokens"))
  for ctx in opts["contexts"]:
    prompt = prompts_for(pair[0], 1, ctx, seed=1)
    max_len = _round_up(ctx + new + K + 1, max(ps, 32))
    for k in opts["paged_ks"]:
      base = None
      for layout, page_size in (("contiguous", None), ("paged", ps)):
        fields = dict(context=ctx, k=k, layout=layout)
        if not box.allows():
          report.row("skipped: out of time", **fields)
          continue
        try:
          _, median, out = box.run(lambda: median_call(run_generate(pair, prompt, k, new, max_len, page_size), reps))
        except Exception as e:
          report.row(_error(e), **fields)
          continue
        report.row("generate, long prompt", **fields, tokens_per_s=out.stats["generated_tokens"] / median,
                   step_ms=1e3 * median / out.stats["verify_calls"],
                   paged_over_contiguous=base[1] / median if base and page_size else None,
                   same_tokens=base[0].tokens == out.tokens if base and page_size else None)
        base = (out, median) if page_size is None else base


def attention_case(batch, rows, kv_heads, groups, head_dim, page_size, length, dtype, seed=0):
  """A PagedKVCache view (with its call's AttentionMetadata) of `batch` slots holding `length` rows
  each in scattered pages, every page held (pools dtype[B * length / page_size, page_size, Hkv, Dh]),
  queries dtype[B, rows, Hkv, G, Dh] at the last `rows` rows of every slot (a verify step's k + 1
  rows, already written), their rows int32[B, rows] and valid bool[B, rows]."""
  rng = np.random.default_rng(seed)
  max_pages = length // page_size
  num_pages = batch * max_pages
  pool = lambda: jnp.asarray(rng.normal(size=(num_pages, page_size, kv_heads, head_dim)), dtype)
  table = jnp.asarray(rng.permutation(num_pages).reshape(batch, max_pages), jnp.int32)
  meta = AttentionMetadata(table, jnp.full((batch,), max_pages, jnp.int32), budget=num_pages)
  cache = PagedKVCache(pool(), pool(), max_pages, meta)
  q = jnp.asarray(rng.normal(size=(batch, rows, kv_heads, groups, head_dim)), dtype)
  rows_BxT = jnp.broadcast_to(jnp.arange(length - rows, length, dtype=jnp.int32), (batch, rows))
  return cache, q, rows_BxT, jnp.ones((batch, rows), bool)


def gathered_span(cache: PagedKVCache):
  """(k, v dtype[B, L, Hkv, Dh], key rows int32[B, L]): every slot's pages as one dense block, as
  `PagedRows.update` gathers them for a span (every page held, so no row is NO_ROW)."""
  table = cache.meta.table
  b, cols = table.shape
  gather = lambda pool: jnp.take(pool, table, axis=0).reshape(b, cols * cache.page_size, *pool.shape[2:])
  key_rows = jnp.broadcast_to(jnp.arange(cols * cache.page_size, dtype=jnp.int32), (b, cols * cache.page_size))
  return gather(cache.k), gather(cache.v), key_rows


def attention_paths(on_gpu: bool) -> dict:
  """{name: fn(cache, q, rows, valid) -> float[B, T, Hkv, G, Dh]}, each the same attention of one layer."""
  def page_list(cache, q, rows, valid):
    return cache.attend_pages(q, rows, valid)

  def span(cache, q, rows, valid):
    k, v, key_rows = gathered_span(cache)
    v = masks.readable_rows(v, rows, valid, key_rows)
    return masks.gqa_attention(q, k, v, masks.causal_mask(rows, key_rows))

  def dpa(implementation):
    def fn(cache, q, rows, valid):
      k, v, key_rows = gathered_span(cache)
      b, t, hkv, g, dh = q.shape
      # Every gathered row holds finite values, so masked rows (probability 0) need no zeroing here.
      mask = masks.causal_mask(rows, key_rows)[:, None] & valid[:, None, :, None]
      out = jax.nn.dot_product_attention(q.reshape(b, t, hkv * g, dh), k, v, mask=mask,
                                         implementation=implementation)
      return out.reshape(b, t, hkv, g, dh)
    return fn

  paths = {"library page list (PagedKVCache.attend_pages: generate's path)": page_list,
           "library dense span (gathered pages + masks.gqa_attention: the Engine's path)": span,
           "jax.nn.dot_product_attention, xla, on the gathered span": dpa("xla")}
  if on_gpu:
    paths["jax.nn.dot_product_attention, cudnn, on the gathered span"] = dpa("cudnn")
  return paths


def section_attention(report: Report, box: Box, opts: dict) -> None:
  a, dtype, reps = opts["attn"], opts["dtype"], opts["reps"]
  on_gpu = jax.default_backend() == "gpu"
  report.table("attention", f"one layer's attention over paged K/V ({dtype}, B = {a['batch']}, {a['rows']} query "
               f"rows per slot at its end (a k = {a['rows'] - 1} verify step), Hkv = {a['kv_heads']}, "
               f"G = {a['groups']}, Dh = {a['head_dim']}, page_size = {a['page_size']}, pages scattered); every "
               "output checked against the page list's first (max abs error / max |output|); median of "
               f"{reps} jitted calls", ("context", "path", "ms", "vs_page_list", "rel_err", "agrees"))
  tol = TIE_TOL[dtype]  # of the output's scale: float32 allows TF32-level rounding, bfloat16 its own
  for length in a["lengths"]:
    if not box.allows():
      report.row("skipped: out of time", context=length)
      continue
    case = attention_case(a["batch"], a["rows"], a["kv_heads"], a["groups"], a["head_dim"], a["page_size"],
                          length, dtype)
    ref = None  # (output, ms) of the page list, the first path
    for path, fn in attention_paths(on_gpu).items():
      fields = dict(context=length, path=path)

      def measure(fn=fn):
        jitted = jax.jit(fn)
        out = np.asarray(jitted(*case), np.float32)
        err = 0.0 if ref is None else float(np.abs(out - ref[0]).max() / np.abs(ref[0]).max())
        if err > tol:  # a wrong output is not timed
          return out, err, None
        return out, err, median_call(jitted, reps, lambda: case)[1]

      try:
        out, err, median = box.run(measure)
      except Exception as e:
        report.row(_error(e), **fields)
        if ref is None:
          break  # nothing to compare the other paths with
        continue
      if median is None:
        report.row(f"outputs disagree (tolerance {tol})", **fields, rel_err=err, agrees=False)
        continue
      ref = (out, 1e3 * median) if ref is None else ref
      report.row("attention call", **fields, ms=1e3 * median, vs_page_list=1e3 * median / ref[1], rel_err=err,
                 agrees=True)
    if not on_gpu:
      report.row("skipped: the cudnn path needs a GPU", context=length,
                 path="jax.nn.dot_product_attention, cudnn, on the gathered span")


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--cpu", "--quick", action="store_true", dest="cpu",
                  help="tiny shapes on the CPU (a smoke run of every section, under a minute)")
  ap.add_argument("--json", metavar="PATH", help="append every row to PATH as a JSON line (the file is rewritten)")
  ap.add_argument("--deadline-s", type=float, help="seconds for the whole run (default 420 on a GPU, 70 on --cpu)")
  ap.add_argument("--reps", type=int, help="timed calls per cell after the warm-up (default 5, --cpu 3)")
  ap.add_argument("--dtype", choices=("float32", "bfloat16"),
                  help="the random timing model's dtype (default bfloat16, --cpu float32)")
  ap.add_argument("--sections", nargs="+", choices=SECTIONS, default=SECTIONS, help="run only these, in order")
  args = ap.parse_args(argv)
  opts = dict(CPU if args.cpu else GPU)
  opts.update({k: v for k, v in (("deadline_s", args.deadline_s), ("reps", args.reps), ("dtype", args.dtype))
               if v is not None})
  device = jax.devices("cpu")[0] if args.cpu else jax.devices()[0]
  with jax.default_device(device) if args.cpu else contextlib.nullcontext():
    return run(args, opts)


def run(args, opts: dict) -> int:
  report = Report(args.json)
  report.table("setup", f"jax {jax.__version__}, devices {jax.devices()}", ("value",))
  report.row("jax version", value=jax.__version__)
  report.row("devices", value=", ".join(f"{d.platform}:{d.device_kind}" for d in jax.devices()))
  report.row("run on", value="cpu (--cpu)" if args.cpu else jax.default_backend())
  report.row("settings", value=f"timing dtype {opts['dtype']}, reps {opts['reps']}, deadline {opts['deadline_s']} s")
  budget = Budget(opts["deadline_s"], {s: w for s, w in opts["weights"].items() if s in args.sections})
  models, results = Models(opts), {}
  start = time.monotonic()
  for section in SECTIONS:
    if section not in args.sections:
      continue
    box = budget.box(section) if section in budget.weights else None
    if section == "correctness":
      section_correctness(report, models, opts)
    elif section == "generate":
      section_generate(report, box, models, opts, results)
    elif section == "engine":
      section_engine(report, box, models, opts, results)
    elif section == "step":
      section_step(report, models, opts, results)
    elif section == "propose":
      section_propose(report, box, models, opts)
    elif section == "paged":
      section_paged(report, box, models, opts)
    else:
      section_attention(report, box, opts)
  report.table("end", "the run", ("value",))
  report.row("wall s", value=time.monotonic() - start)
  report.row("correctness", value="all passed" if report.failures == 0 else f"{report.failures} FAILED",
             failures=report.failures)
  return 1 if report.failures else 0


if __name__ == "__main__":
  sys.exit(main())
