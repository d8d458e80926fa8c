"""`mtp-jax serve` under load over HTTP: requests/s, time to first token and inter-token latency.

Starts the server in a subprocess on a free local port (the small demo model, greedy), with k
drafts, with `--num-drafts auto` and without the MTP modules (`--num-drafts 0`), and drives each with streaming
completions from `concurrency` client threads (1, 8, 32): a fixed number of requests per cell,
no new one issued after the duration cap. Held-out prompts are sent as token ids. Each cell runs
twice and the second pass is timed: the first compiles the page budgets (blocks/paged.py) that
its load reaches (a --quick smoke run runs each cell once). Local only: nothing leaves 127.0.0.1.

TTFT: request sent -> first text event. ITL: a request's (last event - first event) / (its tokens
- 1), the mean gap per token (a speculative step sends several tokens in one event).
Run: python benchmarks/serve_http.py [--quick].
"""

from __future__ import annotations

import argparse
import concurrent.futures
import http.client
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
try:
  import mtp_jax  # noqa: F401
except ImportError:  # run as `python benchmarks/x.py` from a checkout that is not pip-installed
  sys.path.insert(0, str(ROOT))
from mtp_jax import data

# One page of 128 rows holds a request (48 + 64 + k + 1 rows), and 32 pages hold 32 requests: the
# pages attention reads per call (the budget) take three values (16, 24, 32), each compiled in the
# untimed pass. With 16-row pages (512 of them) it takes many more values, and a timed pass still
# met uncompiled ones (a TTFT p99 of 11 s at concurrency 32 with drafts, in one run here).
FULL = dict(concurrency=(1, 8, 32), requests=64, max_tokens=64, prompt_len=48, max_batch=32, max_len=256,
            page_size=128, num_pages=32, num_drafts=3, cap_s=60.0, passes=2)
QUICK = dict(concurrency=(1, 4), requests=4, max_tokens=8, prompt_len=16, max_batch=4, max_len=64,
             page_size=16, num_pages=16, num_drafts=2, cap_s=20.0, passes=1)


def start_server(opts: dict, num_drafts: int) -> tuple[subprocess.Popen, str]:
  env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
  log = tempfile.TemporaryFile("w+")  # a pipe nobody reads could fill and stall the server
  proc = subprocess.Popen([sys.executable, "-m", "mtp_jax.cli", "serve", "--port", "0", "--host", "127.0.0.1",
                           "--max-batch", str(opts["max_batch"]), "--max-len", str(opts["max_len"]),
                           "--page-size", str(opts["page_size"]), "--num-pages", str(opts["num_pages"]),
                           "--num-drafts", str(num_drafts),
                           "--max-waiting", str(max(opts["concurrency"])), "--log-level", "warning"],
                          stdout=subprocess.PIPE, stderr=log, text=True, env=env)
  line = []
  reader = threading.Thread(target=lambda: line.append(proc.stdout.readline()), daemon=True)
  reader.start()
  reader.join(600)
  match = re.search(r"http://([\d.]+):(\d+)", line[0] if line else "")
  if match is None:
    proc.kill()
    log.seek(0)
    raise RuntimeError(f"the server did not start: {log.read()[-2000:]}")
  return proc, f"{match.group(1)}:{match.group(2)}"


def stream_one(address: str, prompt: list[int], max_tokens: int) -> dict:
  """One streaming completion: {ttft, itl, tokens, end} (seconds, perf_counter clock)."""
  host, port = address.split(":")
  conn = http.client.HTTPConnection(host, int(port), timeout=300)
  body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "stream": True,
                     "stream_options": {"include_usage": True}})
  t0 = time.perf_counter()
  conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
  response = conn.getresponse()
  if response.status != 200:
    raise RuntimeError(f"HTTP {response.status}: {response.read()[:500]!r}")
  times, tokens = [], 0
  for raw in response:
    line = raw.strip()
    if not line.startswith(b"data: ") or line == b"data: [DONE]":
      continue
    event = json.loads(line[6:])
    if event.get("usage"):
      tokens = event["usage"]["completion_tokens"]
    if event["choices"] and event["choices"][0]["text"]:
      times.append(time.perf_counter())
  conn.close()
  itl = (times[-1] - times[0]) / (tokens - 1) if len(times) > 1 and tokens > 1 else float("nan")
  return dict(ttft=times[0] - t0 if times else float("nan"), itl=itl, tokens=tokens, end=time.perf_counter())


def run_cell(address: str, prompts: list[list[int]], concurrency: int, max_tokens: int, cap_s: float) -> dict:
  """len(prompts) requests from `concurrency` threads; none issued after cap_s."""
  t0 = time.perf_counter()
  pending = iter(prompts)
  lock = threading.Lock()

  def worker():
    done = []
    while time.perf_counter() - t0 < cap_s:
      with lock:
        prompt = next(pending, None)
      if prompt is None:
        break
      done.append(stream_one(address, prompt, max_tokens))
    return done

  with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
    results = [r for f in [pool.submit(worker) for _ in range(concurrency)] for r in f.result()]
  wall = max(r["end"] for r in results) - t0
  ttft, itl = np.array([r["ttft"] for r in results]), np.array([r["itl"] for r in results])
  itl = itl[~np.isnan(itl)]
  q = lambda x, p: float(np.quantile(x, p)) * 1e3 if len(x) else float("nan")
  return dict(requests=len(results), wall=wall, rps=len(results) / wall,
              tokens_per_s=sum(r["tokens"] for r in results) / wall, ttft_p50=q(ttft, 0.5), ttft_p99=q(ttft, 0.99),
              itl_p50=q(itl, 0.5), itl_p99=q(itl, 0.99))


def metric(address: str, name: str) -> float:
  host, port = address.split(":")
  conn = http.client.HTTPConnection(host, int(port), timeout=60)
  conn.request("GET", "/metrics")
  text = conn.getresponse().read().decode()
  conn.close()
  return float(re.search(rf"^mtp_jax_{name} (\S+)$", text, re.M).group(1))


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run)")
  opts = QUICK if ap.parse_args(argv).quick else FULL
  prompts = data.heldout_prompts(opts["requests"], prompt_len=opts["prompt_len"], seed=0)
  load_before = os.getloadavg()
  rows = {}
  for k in (opts["num_drafts"], "auto", 0):
    proc, address = start_server(opts, k)
    try:
      for c in opts["concurrency"]:
        for _ in range(opts["passes"]):  # the first of 2 compiles; a smoke run (--quick) times its one
          rows[k, c] = run_cell(address, prompts, c, opts["max_tokens"], opts["cap_s"])
      rows[k, "accepted"] = metric(address, "mean_accepted_length")
      rows[k, "pages"] = metric(address, "pages_in_use")
    finally:
      proc.terminate()
      proc.wait(60)
  load_after = os.getloadavg()
  print(f"# mtp-jax serve over HTTP: small demo model, greedy, {opts['requests']} streaming requests per cell, "
        f"timed on pass {opts['passes']} "
        f"(prompts {opts['prompt_len']} tokens, max_tokens {opts['max_tokens']}), --max-batch {opts['max_batch']} "
        f"--max-len {opts['max_len']} --page-size {opts['page_size']} --num-pages {opts['num_pages']}; "
        f"{os.cpu_count()} CPUs, load average "
        f"{load_before[0]:.2f} before, {load_after[0]:.2f} after\n")
  print("| drafts | concurrency | requests | wall s | requests/s | tokens/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms "
        "| ITL p99 ms |")
  print("|---|---|---|---|---|---|---|---|---|---|")
  for (k, c), r in [(key, r) for key, r in rows.items() if isinstance(key[1], int)]:
    print(f"| {k} | {c} | {r['requests']} | {r['wall']:.2f} | {r['rps']:.2f} | {r['tokens_per_s']:.1f} | "
          f"{r['ttft_p50']:.1f} | {r['ttft_p99']:.1f} | {r['itl_p50']:.2f} | {r['itl_p99']:.2f} |")
  k = opts["num_drafts"]
  for drafts in (k, "auto"):
    print(f"\nWith {drafts} drafts / without, requests/s at concurrency "
          + ", ".join(f"{c}: {rows[drafts, c]['rps'] / rows[0, c]['rps']:.2f}x" for c in opts["concurrency"])
          + f". Mean accepted length (server metric): {rows[drafts, 'accepted']:.2f}.")
  print(f"\nPages in use after the load: {rows[k, 'pages']:.0f}, {rows['auto', 'pages']:.0f} and "
        f"{rows[0, 'pages']:.0f}.")


if __name__ == "__main__":
  main()
