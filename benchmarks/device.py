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
import sys
import time
from pathlib import Path

import jax

try:
  import mtp_jax
except ImportError:  # run as `python benchmarks/x.py` from a checkout that is not pip-installed
  sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
  import mtp_jax

from device_kernels import section_attention, section_propose  # noqa: E402
from device_models import K, Models, compare, gen_max_len, prompts_for, round_up, run_generate  # noqa: E402
from device_report import Box, Budget, Report, error_what, median_call  # noqa: E402

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
      report.row(error_what(e), **fields, passed=False)
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
          report.row(error_what(e), **fields)
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
  max_len = round_up(opts["prompt_len"] + new + K + 1, 16)
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
          report.row(error_what(e), **fields)
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


def section_paged(report: Report, box: Box, models: Models, opts: dict) -> None:
  name, pair = models.tables()[0]
  new, ps, reps = opts["paged_new"], opts["page_size"], opts["reps"]
  report.table("paged", f"generate on one long prompt (B = 1, {new} new tokens, {name}), page_size={ps} vs "
               f"contiguous caches of the same max_len; tokens/s = {new} / median wall of {reps} calls "
               "(the prompt's prefill included); step_ms = wall / verify_calls",
               ("context", "k", "layout", "tokens_per_s", "step_ms", "paged_over_contiguous", "same_tokens"))
  for ctx in opts["contexts"]:
    prompt = prompts_for(pair[0], 1, ctx, seed=1)
    max_len = round_up(ctx + new + K + 1, max(ps, 32))
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
          report.row(error_what(e), **fields)
          continue
        report.row("generate, long prompt", **fields, tokens_per_s=out.stats["generated_tokens"] / median,
                   step_ms=1e3 * median / out.stats["verify_calls"],
                   paged_over_contiguous=base[1] / median if base and page_size else None,
                   same_tokens=base[0].tokens == out.tokens if base and page_size else None)
        base = (out, median) if page_size is None else base


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
