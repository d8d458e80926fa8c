"""Serving a request stream: the Engine against fixed `generate` batches, and against itself at k = 0, 1, K, auto.

Part 1, for the trained large demo model (drafts are accepted) and a random model of the same
shape (drafts are rejected): N requests (held-out prompts cut to mixed lengths, mixed output
lengths) arrive at once, in order. Fixed `generate` batches of max_batch run them in arrival
order, each batch until its longest request ends (its tokens come back together, at the end of
the batch); the Engine keeps max_batch slots busy, refilling each as its request ends. Rows:
generate at k = K; the Engine with num_drafts="auto" (its DraftPolicy new in each pass, so it
measures every width again; kept from the previous pass, as a long-running server keeps its
step times and acceptance; or calibrated before the stream by `Engine.calibrate`, then kept:
calibrated in a child process and read back from its JSON, as a server loads a calibration made
before it started),
with k = K, and without a proposer. Columns: tokens/s and its ratio to generate's (by medians,
paired, and in the worst round),
time to first token, inter-token latency and request latency (to the last token) p50 / p99 from
the moment all requests arrived.

Part 2, the trained and the random model: the Engine's tokens/s against max_batch for k = 0 (no
proposer), 1..K and "auto" (a new policy each pass, which measures as it goes, and a policy
calibrated before the stream, as in part 1, and kept), each over a stream of 4 x max_batch
requests of 112 tokens, at least 30 decode calls at k = K, with the cell's ITL p50 / p99, TTFT
p50 / p99 and decode calls (in all and at each verify width: which programs a cell ran); a
second k = 0 engine, run last in each round, against the first gives the ratio two passes of one
configuration show, the floor under every other paired ratio
(`--json PATH` writes every cell; `plots.py` draws tokens/s against max_batch from it).

All greedy. Each configuration runs until a pass compiles nothing (a long-running server compiles
each program once); then the configurations of a table run in turns, 7 rounds of one pass each
(`--rounds`), and the median of each one's passes is shown. The "paired" columns give a ratio as
the median over rounds of the two configurations' ratio within a round (`paired`): a drift of the
machine's speed between rounds falls on both alike, where two medians may come from different
rounds; part 1's "worst round" columns give the smallest of those ratios instead, and part 2's
"interval" columns the range that holds the median ratio with a stated probability
(`paired_interval`: a pass here moves by a tenth or more, more than the 3% the goals are about).
The best fixed width of a row is the one with the best median. Before the "auto" rows, the stream
also runs once at each fixed k = 0..K, which compiles most steps "auto" may pick. The counts of
outputs equal to generate's are printed.
Run: python benchmarks/serve_bench.py [--quick] [--json PATH] [--models both|trained|random] [--parts both|1|2]
[--batches N ...] [--rounds N].
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import math
import multiprocessing
import os
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
from mtp_jax import data, demo_models

FULL = dict(num_requests=16, max_batch=8, prompt_lens=(16, 128), output_lens=(16, 64), max_len=256, page_size=32,
            batches=(1, 2, 4, 8), table_output=112, table_requests=4, passes=6, repeats=7)
QUICK = dict(num_requests=6, max_batch=2, prompt_lens=(4, 40), output_lens=(4, 24), max_len=96, page_size=16,
             batches=(1, 2), table_output=8, table_requests=2, passes=2, repeats=1)


def requests_for(n, opts, seed):
  """n (prompt ids, max_new_tokens): held-out prompts cut to mixed lengths."""
  rng = np.random.default_rng(seed)
  prompts = data.heldout_prompts(n, prompt_len=opts["prompt_lens"][1], seed=seed)
  return [(list(p[:int(rng.integers(*opts["prompt_lens"]))]), int(rng.integers(*opts["output_lens"])))
          for p in prompts]


def load_models(name: str, kind: str):
  """(target, proposer): the demo `name` trained, or random ones of its shapes."""
  target, proposer, _ = demo_models.load_demo(name=name)
  if kind == "random":
    return mtp_jax.init_target(target.cfg, 0), mtp_jax.init_mtp(proposer.cfg, 1)
  return target, proposer


def _calibrate_json(name: str, kind: str, max_batch: int, opts) -> str:
  target, proposer = load_models(name, kind)
  return mtp_jax.Engine(target, proposer, max_batch=max_batch, max_len=opts["max_len"],
                        page_size=opts["page_size"]).calibrate().to_json()


def calibrated_policy(name: str, kind: str, max_batch: int, opts) -> mtp_jax.serving.DraftPolicy:
  """`Engine.calibrate`'s policy, measured in a child process and read back from its JSON, as a
  server reads a calibration made before it started: calibrating compiles a program per width
  and batch bucket (73 on the large demo at 8 slots) that traffic does not run again, and keeping
  them here ran XLA:CPU out of memory maps within a row (it maps each kernel's code apart)."""
  with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
    return mtp_jax.serving.DraftPolicy.from_json(pool.submit(_calibrate_json, name, kind, max_batch, opts).result())


def _q(values, q):
  return float(np.quantile(np.asarray(values), q)) if len(values) else float("nan")


def engine_pass(target, proposer, requests, opts, num_drafts, max_batch, policy=None):
  engine = mtp_jax.Engine(target, proposer, max_batch=max_batch, max_len=opts["max_len"],
                          page_size=opts["page_size"], num_drafts=num_drafts, draft_policy=policy)
  t0 = time.perf_counter()
  ids = [engine.add_request(p, m) for p, m in requests]
  out = engine.run()
  wall = time.perf_counter() - t0
  reqs = [engine.requests[i] for i in ids]
  m = engine.metrics()
  return dict(wall=wall, out=[out[i] for i in ids], ttft=[r.first_token_at - t0 for r in reqs],
              itl=(m["itl_seconds_p50"], m["itl_seconds_p99"]), last=[r.finished_at - t0 for r in reqs],
              accepted=m["mean_accepted_length"], calls=m["steps_total"], at_width=m["steps_at_width"])


def calls_at_width(result, k: int) -> list[int]:
  """An engine_pass result's decode calls at each verify width 0..k (an engine without a proposer
  counts width 0 alone)."""
  return result["at_width"] + [0] * (k + 1 - len(result["at_width"]))


def _generate_pass(target, proposer, requests, max_batch):
  t0 = time.perf_counter()
  outs, done_at = [], []
  for start in range(0, len(requests), max_batch):
    chunk = requests[start:start + max_batch]
    res = mtp_jax.generate(target, proposer, [p for p, _ in chunk], max(m for _, m in chunk))
    outs += [toks[:m] for toks, (_, m) in zip(res.tokens, chunk)]
    done_at += [time.perf_counter() - t0] * len(chunk)
  return dict(wall=time.perf_counter() - t0, out=outs, ttft=done_at, last=done_at, itl=None, accepted=None)


COMPILES = []
jax.monitoring.register_event_duration_secs_listener(
    lambda event, seconds, **_: COMPILES.append(seconds) if event == "/jax/core/compile/backend_compile_duration"
    else None)


def clean_pass(fn):
  """(fn's result, whether the pass compiled nothing)."""
  before = len(COMPILES)
  result = fn()
  return result, len(COMPILES) == before


def _side_by_side(fns, max_passes: int, repeats: int) -> list[dict]:
  """Each fn's result of median wall time over `repeats` passes that compiled nothing, taken in
  turns: round r runs every fn once, so a drift of this machine's speed (a pass's time moves by a
  tenth from one pass to the next) falls on every configuration of a table alike. Before the
  rounds each fn runs until a pass compiles nothing (a compile takes seconds here, which a warm
  server pays once per program, not per request), up to max_passes; which programs a stream needs
  depends on its timing (admissions grouped differently, another width under "auto"), so a timed
  pass may still compile: it is run again, up to max_passes more times (with fewer clean passes,
  a note: the median of those, or of the last pass when none)."""
  for fn in fns:
    for _ in range(max_passes):
      if clean_pass(fn)[1]:
        break
  clean, last, spare = [[] for _ in fns], [None] * len(fns), [max_passes] * len(fns)
  while any(len(c) < repeats and s > 0 for c, s in zip(clean, spare)):
    for i, fn in enumerate(fns):
      if len(clean[i]) < repeats and spare[i] > 0:
        last[i], ok = clean_pass(fn)
        if ok:
          clean[i].append(last[i])
        else:
          spare[i] -= 1
  out = []
  for c, result in zip(clean, last):
    if len(c) < repeats:
      print(f"note: only {len(c)} of {repeats} timed passes of a configuration compiled nothing")
    timed = sorted(c or [result], key=lambda r: r["wall"])
    out.append(dict(timed[len(timed) // 2], walls=[r["wall"] for r in c or [result]]))
  return out


def paired(r, base, over=np.median) -> float:
  """r's speed over base's: the median (or `over`, such as np.min: the worst round) over rounds
  of base's wall time over r's in the same round (their i-th timed passes). A round's drift
  (whole rounds here ran a tenth faster than others) moves both alike, so this ratio moves less
  than one of medians taken from different rounds."""
  return float(over([b / a for a, b in zip(r["walls"], base["walls"])]))


def paired_interval(r, base, cover: float = 0.85) -> tuple[float, float, float]:
  """(low, high, coverage): an interval around `paired`'s median from its rounds' ratios alone,
  the j-th smallest and j-th largest, j the largest whose coverage of the true median is at
  least `cover` (1 - 2 P(Binomial(n, 1/2) < j), whatever the ratios' distribution; with fewer
  rounds than that needs, the smallest and largest). A pass here moves by a tenth or more from
  one to the next, so one round's ratio says little; this says how far the median may be from the
  truth."""
  ratios = sorted(b / a for a, b in zip(r["walls"], base["walls"]))
  n = len(ratios)
  coverage = lambda j: 1 - 2 * sum(math.comb(n, i) for i in range(j)) / 2 ** n
  j = max([j for j in range(1, (n + 1) // 2 + 1) if coverage(j) >= cover], default=1)
  return ratios[j - 1], ratios[n - j], coverage(j)


def _stream_table(name, target, proposer, opts, k, models):
  requests = requests_for(opts["num_requests"], opts, seed=1)
  tokens = sum(m for _, m in requests)
  b = opts["max_batch"]
  for w in range(k):  # compiles the narrower steps "auto" may pick (k=K is compiled by its own row)
    engine_pass(target, proposer, requests, opts, w, b)
  policy = mtp_jax.serving.DraftPolicy(k)  # kept from one pass to the next, as a long-running server keeps it
  calibrated = calibrated_policy(*models, b, opts)  # measured before the stream, then kept
  engine = lambda prop, nd, pol=None: lambda: engine_pass(target, prop, requests, opts, nd, b, pol)
  runs = [("fixed generate batches, k=K", lambda: _generate_pass(target, proposer, requests, b)),
          ('Engine, "auto", measuring from scratch', engine(proposer, "auto")),
          ('Engine, "auto", policy kept', engine(proposer, "auto", policy)),
          ('Engine, "auto", calibrated', engine(proposer, "auto", calibrated)),
          ("Engine, k=K", engine(proposer, k)),
          ("Engine, no proposer (k=0)", engine(None, None))]
  runs = list(zip([label for label, _ in runs], _side_by_side([fn for _, fn in runs], opts["passes"], opts["repeats"])))
  base = runs[0][1]
  print(f"\n## {name}: {len(requests)} requests at once, {b} slots, K={k}; prompts {opts['prompt_lens'][0]}.."
        f"{opts['prompt_lens'][1]} bytes, outputs {opts['output_lens'][0]}..{opts['output_lens'][1]} tokens\n")
  print("| loop | tokens/s | vs generate | paired | worst round | TTFT p50 / p99 s | ITL p50 / p99 ms | "
        "latency p50 / p99 s | accepted length | outputs equal to generate |")
  print("|---|---|---|---|---|---|---|---|---|---|")
  for label, r in runs:
    assert sum(len(o) for o in r["out"]) == tokens  # no eos: every request gets all its tokens
    itl = "all at once" if r["itl"] is None else f"{1e3 * r['itl'][0]:.1f} / {1e3 * r['itl'][1]:.1f}"
    acc = "" if r["accepted"] is None else f"{r['accepted']:.2f}"
    equal = sum(a == g for a, g in zip(r["out"], base["out"]))
    print(f"| {label} | {tokens / r['wall']:.1f} | {base['wall'] / r['wall']:.2f}x | {paired(r, base):.2f}x | "
          f"{paired(r, base, np.min):.2f}x | {_q(r['ttft'], .5):.2f} / "
          f"{_q(r['ttft'], .99):.2f} | {itl} | {_q(r['last'], .5):.2f} / {_q(r['last'], .99):.2f} | {acc} | "
          f"{equal}/{len(requests)} |")


def _batch_table(name, target, proposer, opts, k, cells, models):
  """Tokens/s against max_batch for every fixed width and "auto"; each cell also goes to `cells`."""
  widths = [("0", None, None)] + [(str(w), proposer, w) for w in range(1, k + 1)] + [
      ("auto", proposer, "auto"), ("auto, calibrated", proposer, "calibrated")]
  n_fixed = k + 1
  control = ("0", None, None)  # k=0 again, last in each round: how far two passes of one configuration differ
  print(f"\n## {name}: Engine tokens/s against max_batch ({opts['table_requests']} x max_batch requests of "
        f"{opts['table_output']} tokens, prompts as above)\n")
  print("| max_batch | " + " | ".join(w if w.startswith("auto") else f"k={w}" for w, _, _ in widths) +
        " | auto / calibrated vs best fixed k | paired | calibrated vs best fixed, paired interval"
        " | calibrated vs k=0, paired (interval) | k=0 vs itself, paired (interval) |")
  print("|---" * (len(widths) + 6) + "|")
  lat = []
  for b in opts["batches"]:
    # Each row compiles its own programs (another batch size); XLA:CPU maps each one's code, and
    # keeping them all ran this process out of memory maps.
    jax.clear_caches()
    requests = [(p, opts["table_output"]) for p, _ in requests_for(opts["table_requests"] * b, opts, seed=2)]
    tokens = len(requests) * opts["table_output"]
    calibrated = calibrated_policy(*models, b, opts)
    run = lambda prop, nd: lambda: engine_pass(target, prop, requests, opts, "auto" if nd == "calibrated" else nd,
                                                b, calibrated if nd == "calibrated" else None)
    rates, row = [], []
    *results, again = _side_by_side([run(prop, nd) for _, prop, nd in widths + [control]], opts["passes"],
                                    opts["repeats"])
    for (label, _, _), r in zip(widths, results):
      rates.append(tokens / r["wall"])
      cell = dict(model=name, max_batch=b, width=label, tokens_per_s=rates[-1], decode_calls=r["calls"],
                  ttft_p50=_q(r["ttft"], .5), ttft_p99=_q(r["ttft"], .99), itl_p50=r["itl"][0], itl_p99=r["itl"][1],
                  decode_calls_at_width=calls_at_width(r, k), pass_tokens_per_s=[tokens / w for w in r["walls"]])
      cells.append(cell)
      row.append(cell)
    best = int(np.argmax(rates[:n_fixed]))
    (lo, hi, cover), (lo0, hi0, _) = (paired_interval(results[-1], results[i]) for i in (best, 0))
    cell = next(c for c in row if c["width"] == "0")
    cell["control_pass_tokens_per_s"] = [tokens / w for w in again["walls"]]
    lo_aa, hi_aa, _ = paired_interval(again, results[0])
    print(f"| {b} | " + " | ".join(f"{r:.1f}" for r in rates) + f" | {rates[-2] / rates[best]:.2f}x / "
          f"{rates[-1] / rates[best]:.2f}x | {paired(results[-2], results[best]):.2f}x / "
          f"{paired(results[-1], results[best]):.2f}x | {lo:.2f}x-{hi:.2f}x ({cover:.0%}) | "
          f"{paired(results[-1], results[0]):.2f}x ({lo0:.2f}x-{hi0:.2f}x) | "
          f"{paired(again, results[0]):.2f}x ({lo_aa:.2f}x-{hi_aa:.2f}x) |", flush=True)
    lat.append(row)
  print("\nintervals (`paired_interval`): order statistics of the rounds' ratios, which hold the median ratio with "
        "the probability given (the same for every interval column); k=0 vs itself: a second k=0 engine, run "
        "last in each round, against the first (a ratio of 1 up to the machine's noise)")
  print(f"\n| max_batch | width | ITL p50 / p99 ms | TTFT p50 / p99 s | decode calls | at width "
        f"{' / '.join(map(str, range(k + 1)))} |\n|---|---|---|---|---|---|")
  for row in lat:
    for c in row:
      print(f"| {c['max_batch']} | {c['width']} | {1e3 * c['itl_p50']:.1f} / {1e3 * c['itl_p99']:.1f} | "
            f"{c['ttft_p50']:.2f} / {c['ttft_p99']:.2f} | {c['decode_calls']} | "
            f"{' / '.join(map(str, c['decode_calls_at_width']))} |")


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--quick", action="store_true", help="the small demo model, a few short requests (a smoke run)")
  ap.add_argument("--json", type=Path, default=None, help="write part 2's cells here (for plots.py)")
  ap.add_argument("--models", choices=("both", "trained", "random"), default="both",
                  help="the models whose tables run (default both)")
  ap.add_argument("--parts", choices=("both", "1", "2"), default="both",
                  help="part 1 (the Engine against generate), part 2 (tokens/s against max_batch) or both")
  ap.add_argument("--batches", type=int, nargs="+", default=None, help="part 2's max_batch values (default 1 2 4 8)")
  ap.add_argument("--rounds", type=int, default=None, help="timed rounds per table (default 7; --quick 1)")
  args = ap.parse_args(argv)
  quick = args.quick
  opts = dict(QUICK if quick else FULL, **({} if args.batches is None else dict(batches=tuple(args.batches))),
              **({} if args.rounds is None else dict(repeats=args.rounds)))
  name = "small" if quick else demo_models.default_demo()
  target, proposer = load_models(name, "trained")
  k = proposer.cfg.num_modules
  random_target, random_proposer = load_models(name, "random")
  print(f"# serve_bench ({jax.devices()[0].platform}, {os.cpu_count()} CPUs, load average at start "
        f"{os.getloadavg()[0]:.2f})")
  models = [(f"trained {name} demo", target, proposer, "trained"),
            (f"random {name}-shaped", random_target, random_proposer, "random")]
  models = [m for m in models if args.models in ("both", m[3])]
  for label, t, p, kind in models if args.parts != "2" else ():
    jax.clear_caches()
    _stream_table(f"{label} model", t, p, opts, k, (name, kind))
  cells = []
  for label, t, p, kind in models if args.parts != "1" else ():
    _batch_table(label, t, p, opts, k, cells, (name, kind))
  if args.json:
    args.json.write_text(json.dumps(dict(benchmark="serve_bench", backend=jax.default_backend(),
                                         device_kind=jax.devices()[0].device_kind, jax_version=jax.__version__,
                                         settings=opts, rows=cells), indent=1))
  print(f"\nload average at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
  main()
