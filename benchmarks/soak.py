"""`mtp-jax serve` held under a bounded mixed load with injected client faults: nothing lost, nothing leaked.

A server subprocess on a free local port (small demo model, num_drafts "auto"); `clients` threads send
requests for `duration` s, each the next kind of a fixed cycle: greedy, seeded sampled and stop-string
requests (whole and streamed), JSON schema, max_tokens at the engine's limit, and faults: a hang-up mid-stream
or before the answer, a slow consumer (small receive buffer, stalls before reading), malformed bodies, an
oversized body (declared, or chunked), a prompt past max_len, max_tokens one past the limit; every few seconds
a burst overfills the waiting queue (429s; other text requests turned away by it come back, up to RETRIES_429
times). Checked: greedy answers equal `mtp_jax.generate` on the prompt alone (cut at the stop string), seeded
ones plain sampling with the seed, schema ones JSON under the schema; each fault its status and OpenAI error
body; no 5xx, no traceback in the server's log; after the load: pages in use 0, requests recorded 0
(/metrics), RSS and threads (/proc) against a baseline taken after a warm round of every kind, and exit 0 on
SIGTERM. TTFT / ITL as serve_http.py measures them (streams read at once). Local only.
Run: python benchmarks/soak.py [--duration S] [--clients N] [--quick]."""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import dataclasses
import contextlib
import http.client
import itertools
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # `python benchmarks/soak.py` from a checkout that is not pip-installed
import mtp_jax  # noqa: E402
from mtp_jax import data  # noqa: E402

PROMPTS = ("def main(", "import os\n", "class Foo:\n    ", "for i in range(", "return self.", "# utils\n")
SEEDED, TEMPERATURE = PROMPTS[:2], 0.8
SCHEMAS = ({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
            "additionalProperties": False},
           {"type": "string", "enum": ["red", "green", "blue"]})
RETRIES_429 = 3
KINDS = ("greedy", "greedy_stream", "disconnect", "seeded", "malformed", "stop", "slow", "schema", "oversized",
         "seeded_stream", "too_long", "stop_stream", "at_limit", "over_limit")


@dataclasses.dataclass(frozen=True)
class SoakConfig:
  """The load: its length, clients, the engine's flags and the request sizes."""

  duration_s: float = 600.0
  clients: int = 64
  max_batch: int = 8
  max_len: int = 256
  page_size: int = 64
  max_waiting: int = 32
  max_tokens: int = 32
  num_drafts: str = "auto"
  burst_every_s: float = 15.0
  stall_s: float = 2.0
  seeds: tuple[int, ...] = (1, 2, 3)


FULL = SoakConfig()
# One verify width and two pages a slot: few programs to compile (each takes seconds on 2 cores).
QUICK = SoakConfig(duration_s=8.0, clients=6, max_batch=4, max_len=128, max_waiting=4, max_tokens=16,
                   num_drafts="3", burst_every_s=4.0, stall_s=1.0, seeds=(1,))


@dataclasses.dataclass(frozen=True)
class Outcome:
  """One request checked: its status (as Answer's), what was wrong (None: nothing), TTFT / ITL (s)."""

  kind: str
  status: int
  problem: str | None = None
  ttft: float | None = None
  itl: float | None = None


class Soak:
  """The load's clients, their expectations, and the references the answers are checked against."""

  def __init__(self, cfg: SoakConfig, server: Server, rows_per_step: int):
    self.cfg, self.server, self.rows = cfg, server, rows_per_step
    self.greedy: dict[str, list[int]] = {}
    self.sampled: dict[tuple[str, int], list[int]] = {}

  def references(self) -> None:
    """generate on each prompt alone: greedy to the engine's limit, and plain sampling (proposer
    None) with each seed, as `Engine` promises its seeded requests."""
    target, proposer, tok = mtp_jax.load_demo()
    longest = self.cfg.max_len - min(len(p) for p in PROMPTS) - self.rows
    self.greedy = dict(zip(PROMPTS, mtp_jax.generate(target, proposer, [tok.encode(p, bos=False) for p in PROMPTS],
                                                     longest, num_drafts=3, eos_token_id=tok.eos_id).tokens))
    for p, seed in itertools.product(SEEDED, self.cfg.seeds):
      self.sampled[p, seed] = mtp_jax.generate(target, None, [tok.encode(p, bos=False)], self.cfg.max_tokens,
                                               temperature=TEMPERATURE, seed=seed, eos_token_id=tok.eos_id).tokens[0]

  def limit(self, prompt: str) -> int:
    return self.cfg.max_len - len(prompt.encode()) - self.rows

  def one(self, i: int) -> list[Outcome]:
    """The i-th request of the cycle (every malformed body, for "malformed"), checked."""
    if KINDS[i % len(KINDS)] == "malformed":
      return [self.expect_error("malformed", post(self.server, raw), 400, param) for raw, param in MALFORMED]
    return [self.request(i)]

  def request(self, i: int) -> Outcome:
    kind = KINDS[i % len(KINDS)]
    prompt = PROMPTS[i // len(KINDS) % len(PROMPTS)]
    n = self.cfg.max_tokens - i % 5
    body = {"prompt": prompt, "max_tokens": n}
    if kind in ("greedy", "greedy_stream"):
      return self.expect_text(kind, body, data.decode(self.greedy[prompt][:n]), stream=kind == "greedy_stream")
    if kind in ("seeded", "seeded_stream"):
      prompt, seed = SEEDED[i % len(SEEDED)], self.cfg.seeds[i % len(self.cfg.seeds)]
      body = {"prompt": prompt, "max_tokens": n, "temperature": TEMPERATURE, "seed": seed}
      return self.expect_text(kind, body, data.decode(self.sampled[prompt, seed][:n]),
                              stream=kind == "seeded_stream")
    if kind in ("stop", "stop_stream"):
      full = data.decode(self.greedy[prompt][:n])
      stop = full[n // 2:n // 2 + 2] or "\n"
      want = full[:full.index(stop)] if stop in full else full
      return self.expect_text(kind, {**body, "stop": [stop, "@@"]}, want, stream=kind == "stop_stream")
    if kind == "at_limit":
      m = self.limit(prompt)
      return self.expect_text(kind, {"prompt": prompt, "max_tokens": m}, data.decode(self.greedy[prompt][:m]),
                              stream=i % 2 == 0)
    if kind == "slow":  # stalls before reading, with a small receive buffer: the server's writes wait
      return self.expect_text(kind, {**body, "max_tokens": self.cfg.max_tokens * 4},
                              data.decode(self.greedy[prompt][:self.cfg.max_tokens * 4]), stream=True,
                              stall_s=self.cfg.stall_s)
    if kind == "schema":
      schema = SCHEMAS[i % len(SCHEMAS)]
      answer = post(self.server, {"prompt": "x = ", "max_tokens": 24, "response_format": {
          "type": "json_schema", "json_schema": {"name": "s", "schema": schema}}})
      return self.check(kind, answer, _schema_problem(answer, schema))
    if kind == "disconnect":  # hangs up after the first event, or before the answer when the limit is odd
      answer = post(self.server, {**body, "stream": True, "max_tokens": (m := self.limit(prompt))}, hang_up=True)
      return self.check(kind if m % 2 == 0 else "disconnect_early", answer, None)
    if kind == "oversized":  # declared (refused unread) or sent (refused past the limit), in turn
      raw = b'{"prompt": "' + b"x" * (self.server.max_body + 1) + b'"}'
      return self.expect_error(kind, post(self.server, raw, chunked=i % 2 == 1), 413, None)
    assert kind in ("too_long", "over_limit")  # past max_len by the prompt, or by max_tokens
    body = {"prompt": "x" * (self.cfg.max_len + 1), "max_tokens": 1} if kind == "too_long" else {
        "prompt": prompt, "max_tokens": self.limit(prompt) + 1}
    return self.expect_error(kind, post(self.server, body), 400, "prompt")

  def check(self, kind: str, answer: Answer, problem: str | None) -> Outcome:
    if answer.status == 429 and not kind.startswith("disconnect"):  # the queue was full: its body is checked
      problem = _error_problem(answer, 429, None, "queue_full")
    elif answer.status >= 500 or answer.error is not None:
      problem = f"HTTP {answer.status}: {answer.error or answer.body[:300]!r}"
    return Outcome(kind, answer.status, problem and f"{kind}: {problem}", answer.ttft, answer.itl)

  def expect_text(self, kind: str, body: dict, want: str, *, stream: bool, stall_s: float = 0.0) -> Outcome:
    for attempt in range(RETRIES_429 + 1):  # turned away by a full queue, a client comes back (a burst's do not)
      answer = post(self.server, {**body, "stream": stream}, stall_s=stall_s, rcvbuf=4096 if stall_s else None)
      if answer.status != 429 or kind == "burst" or attempt == RETRIES_429:
        break
      time.sleep(0.5 * (attempt + 1))
    wrong = answer.status == 200 and answer.text != want
    return self.check(kind, answer, f"{body} gave {answer.text!r}, generate alone {want!r}" if wrong else None)

  def expect_error(self, kind: str, answer: Answer, status: int, param: str | None) -> Outcome:
    return self.check(kind, answer, _error_problem(answer, status, param))

  def burst(self, pool: concurrent.futures.Executor) -> list[Outcome]:
    """More greedy requests at once than the slots and the waiting queue hold: 200s or 429s."""
    body, want = {"prompt": PROMPTS[0], "max_tokens": self.cfg.max_tokens}, data.decode(
        self.greedy[PROMPTS[0]][:self.cfg.max_tokens])
    return list(pool.map(lambda _: self.expect_text("burst", body, want, stream=False),
                         range(2 * (self.cfg.max_batch + self.cfg.max_waiting))))


# Malformed bodies and the field each names (None: the whole body).
MALFORMED = (
    (b'{"prompt": "def f(", "max_tokens": 4', None),  # cut short
    (b"[" * 50_000 + b"]" * 50_000, None),  # deeper than json's recursion
    (b"\xff\xfe\x00 not text", None),
    (b"[1, 2]", None),
    (b'{"prompt": "x", "max_tokens": 4, "frobnicate": 1}', "frobnicate"),
    (b'{"prompt": "x", "max_tokens": "4"}', "max_tokens"),
    (b'{"prompt": "x", "max_tokens": 4, "temperature": NaN}', "temperature"),
    (b'{"prompt": [], "max_tokens": 4}', "prompt"),
    (json.dumps({"prompt": "x", "max_tokens": 4, "response_format": {"type": "json_schema", "json_schema": {
        "schema": {"type": "string", "minLength": 100_000}}}}).encode(), "response_format"),
)


def _error_problem(answer: Answer, status: int, param: str | None, code: str | None = None) -> str | None:
  """What is wrong with an error answer: not `status`, or not {"error": {message, type, param, code}}."""
  if answer.status != status:
    return f"HTTP {answer.status} where {status} was due: {answer.body[:200]!r}"
  try:
    error = json.loads(answer.body)["error"]
  except (ValueError, KeyError, TypeError):
    return f"HTTP {status} without an OpenAI error body: {answer.body[:200]!r}"
  if not {"message", "type", "param", "code"} <= set(error) or not error["message"] or error["param"] != param:
    return f"HTTP {status} error body {error} (param {param!r} due)"
  if code is not None and error["code"] != code:
    return f"HTTP {status} code {error['code']!r} where {code!r} was due"
  return None


def _schema_problem(answer: Answer, schema: dict) -> str | None:
  try:
    value = json.loads(answer.text)
  except ValueError:
    return None if answer.status != 200 else f"schema answer {answer.text!r} is not JSON"
  ok = isinstance(value, dict) and set(value) == {"ok"} and isinstance(value["ok"], bool) if "properties" in schema \
      else value in schema["enum"]
  off = answer.status == 200 and not (ok and answer.finish == "stop")
  return f"schema answer {answer.text!r} ({answer.finish}) is off" if off else None


class Server:
  """A `mtp-jax serve` subprocess on a free port (its log in a file: a pipe nobody reads could
  fill and stall it), read over HTTP and /proc."""

  def __init__(self, proc: subprocess.Popen, log):
    self.proc, self._log = proc, log
    self.address, self.max_body = "", 0

  def wait_listening(self, timeout_s: float = 600.0) -> None:
    line = []
    reader = threading.Thread(target=lambda: line.append(self.proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout_s)
    match = re.search(r"http://([\d.]+:\d+)", line[0] if line else "")
    if match is None:
      raise RuntimeError(f"the server did not start: {self.log()[-2000:]}")
    self.address = match.group(1)
    from mtp_jax.serving.server import max_body_bytes  # the limit serve sets for this engine
    self.max_body = max_body_bytes(int(self.proc.args[self.proc.args.index("--max-len") + 1]))

  def metrics(self) -> dict[str, float]:
    text = post(self, None, path="/metrics").body.decode()
    return {m[1]: float(m[2]) for m in re.finditer(r"^mtp_jax_(\w+) (\S+)$", text, re.M)}

  def wait_idle(self, timeout_s: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while (busy := (m := self.metrics())["requests_running"] + m["requests_waiting"]) and time.monotonic() < deadline:
      time.sleep(0.1)
    return not busy

  def proc_status(self) -> dict[str, int]:
    """The server process's resident memory (kB) and thread count, from /proc."""
    with open(f"/proc/{self.proc.pid}/status") as f:
      fields = dict(line.split(":", 1) for line in f)
    return {"rss_kb": int(fields["VmRSS"].split()[0]), "threads": int(fields["Threads"])}

  def stop(self, timeout_s: float = 60.0) -> int | None:
    self.proc.send_signal(signal.SIGTERM)
    try:
      return self.proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
      return None

  def log(self) -> str:
    self._log.seek(0)
    return self._log.read()


@contextlib.contextmanager
def start_server(max_batch: int, max_len: int, page_size: int, max_waiting: int, num_drafts: str):
  """A started `Server` (call wait_listening before use; it compiles meanwhile), killed on exit."""
  env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
  with tempfile.TemporaryFile("w+") as log:
    proc = subprocess.Popen([sys.executable, "-m", "mtp_jax.cli", "serve", "--port", "0", "--host", "127.0.0.1",
                             "--max-batch", str(max_batch), "--max-len", str(max_len), "--page-size", str(page_size),
                             "--max-waiting", str(max_waiting), "--num-drafts", num_drafts, "--log-level", "warning",
                             "--shutdown-timeout", "30"],
                            stdout=subprocess.PIPE, stderr=log, text=True, env=env, cwd=ROOT)
    try:
      yield Server(proc, log)
    finally:
      if proc.poll() is None:
        proc.kill()
        proc.wait()


@dataclasses.dataclass(frozen=True)
class Answer:
  """A response as the client read it: status (0: it hung up first), body (the error body, or the
  raw events), the text and finish_reason (of a 200), TTFT / ITL of a stream in seconds (the
  first text event; (last - first) / (tokens - 1)), and what broke on the client side."""

  status: int
  body: bytes = b""
  text: str = ""
  finish: str | None = None
  ttft: float | None = None
  itl: float | None = None
  error: str | None = None


def post(server: Server, body, *, path: str = "/v1/completions", hang_up: bool = False, stall_s: float = 0.0,
         rcvbuf: int | None = None, chunked: bool = False, timeout_s: float = 300.0) -> Answer:
  """One request (body: a dict, raw bytes, or None for a GET) over a fresh connection."""
  host, port = server.address.split(":")
  sock = socket.socket()
  if rcvbuf is not None:  # before connecting: the window is set then
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
  sock.settimeout(timeout_s)
  conn = http.client.HTTPConnection(host, int(port), timeout=timeout_s)
  stream = isinstance(body, dict) and body.get("stream", False)
  raw = json.dumps(body).encode() if isinstance(body, dict) else body
  t0 = time.perf_counter()
  try:
    sock.connect((host, int(port)))
    conn.sock = sock
    if raw is None:
      conn.request("GET", path)
    elif chunked:  # no Content-Length: the server learns the size by reading
      conn.request("POST", path, iter([raw[j:j + 65536] for j in range(0, len(raw), 65536)]),
                   {"Content-Type": "application/json"}, encode_chunked=True)
    else:
      conn.request("POST", path, raw, {"Content-Type": "application/json"})
    if hang_up and body.get("max_tokens", 0) % 2:  # before the answer: the request may still wait
      return Answer(0)
    response = conn.getresponse()
    if response.status != 200 or not stream:
      data_ = response.read()
      if response.status != 200 or raw is None:
        return Answer(response.status, data_)
      choice = json.loads(data_)["choices"][0]
      return Answer(200, data_, choice["text"], choice["finish_reason"])
    time.sleep(stall_s)
    parts, times, finish = [], [], None
    for line in response:
      line = line.strip()
      if not line.startswith(b"data: ") or line == b"data: [DONE]":
        continue
      event = json.loads(line[6:])
      if hang_up:
        return Answer(0)
      if event.get("error"):
        return Answer(200, line, error=f"error event {event['error']}")
      choice = event["choices"][0]
      if choice["text"]:
        times.append(time.perf_counter())
      parts.append(choice["text"])
      finish = choice["finish_reason"] or finish
    tokens = len(data.encode("".join(parts), bos=False))  # bytes: the byte tokenizer's tokens
    itl = (times[-1] - times[0]) / (tokens - 1) if len(times) > 1 and tokens > 1 and not stall_s else None
    ttft = times[0] - t0 if times and not stall_s else None
    return Answer(200, b"", "".join(parts), finish, ttft, itl)
  except (OSError, http.client.HTTPException, ValueError, KeyError) as e:
    return Answer(-1, error=f"{type(e).__name__}: {e}")
  finally:
    conn.close()


def run(cfg: SoakConfig, log=print) -> dict:
  """The soak: its figures (the load's requests; the warm round's are checked too) and `problems`, every
  expectation broken."""
  with start_server(cfg.max_batch, cfg.max_len, cfg.page_size, cfg.max_waiting, cfg.num_drafts) as server:
    soak = Soak(cfg, server, rows_per_step=mtp_jax.load_demo()[1].cfg.num_depths + 1)
    t = time.perf_counter()
    soak.references()  # while the server compiles
    server.wait_listening()
    log(f"references and server ready after {time.perf_counter() - t:.1f} s; a warm round of every kind")
    pool = concurrent.futures.ThreadPoolExecutor(cfg.clients + 2 * (cfg.max_batch + cfg.max_waiting))
    warm = [o for done in pool.map(soak.one, range(len(KINDS))) for o in done]
    before = server.proc_status()
    log(f"warm round done after {time.perf_counter() - t:.1f} s; load for {cfg.duration_s:g} s")
    outcomes: list[Outcome] = []
    counter, lock = itertools.count(len(KINDS)), threading.Lock()
    t0 = time.perf_counter()
    deadline = t0 + cfg.duration_s

    def client() -> None:
      while time.perf_counter() < deadline:
        done = soak.one(next(counter))  # itertools.count's next is atomic under the GIL
        with lock:
          outcomes.extend(done)

    with pool:
      clients = [pool.submit(client) for _ in range(cfg.clients)]
      while (now := time.perf_counter()) < deadline:
        time.sleep(min(cfg.burst_every_s, deadline - now))
        if time.perf_counter() < deadline:
          burst = soak.burst(pool)
          with lock:
            outcomes.extend(burst)
      for c in clients:
        c.result()
    wall = time.perf_counter() - t0
    drained, metrics, after = server.wait_idle(), server.metrics(), server.proc_status()
    exit_code, log_text = server.stop(), server.log()
  problems = [o.problem for o in warm + outcomes if o.problem]
  problems += [f"{name} = {metrics[name]:g} after the load" for name in ("pages_in_use", "requests_recorded",
                                                                         "requests_running", "requests_waiting")
               if metrics[name] != 0] + ["requests still running or waiting a minute after the load"] * (not drained)
  if "Traceback" in log_text:
    problems.append("a traceback in the server's log: " + log_text[log_text.index("Traceback"):][:1500])
  if exit_code != 0:
    problems.append(f"the server exited with {exit_code} on SIGTERM")
  ttft, itl = (np.array([x for o in outcomes if (x := getattr(o, f)) is not None]) for f in ("ttft", "itl"))
  q = lambda x, p: float(np.quantile(x, p)) * 1e3 if len(x) else float("nan")
  ok = sum(o.status == 200 for o in outcomes)
  return dict(requests=len(outcomes), wall_s=wall, rps=len(outcomes) / wall, ok_rps=ok / wall,  # the load's
              statuses=dict(sorted(collections.Counter(o.status for o in warm + outcomes).items())),  # all
              kinds=collections.Counter((o.kind, o.status) for o in warm + outcomes),
              ttft_p50=q(ttft, 0.5), ttft_p99=q(ttft, 0.99), itl_p50=q(itl, 0.5), itl_p99=q(itl, 0.99),
              rss_mb=(before["rss_kb"] / 1024, after["rss_kb"] / 1024), threads=(before["threads"], after["threads"]),
              pages_in_use=metrics["pages_in_use"], requests_recorded=metrics["requests_recorded"],
              cancelled=metrics["requests_cancelled_total"], exit_code=exit_code, problems=problems)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--duration", type=float, default=None, help="seconds of load (default 600; --quick 10)")
  ap.add_argument("--clients", type=int, default=None, help="concurrent client threads (default 64; --quick 6)")
  ap.add_argument("--quick", action="store_true", help="the test's short form (the test server's engine flags)")
  args = ap.parse_args(argv)
  cfg = QUICK if args.quick else FULL
  cfg = dataclasses.replace(cfg, **{k: v for k, v in (("duration_s", args.duration), ("clients", args.clients))
                                    if v is not None})
  load = os.getloadavg()[0]
  r = run(cfg, log=lambda s: print(s, file=sys.stderr, flush=True))
  print(f"# mtp-jax serve soak: small demo model, --num-drafts {cfg.num_drafts} --max-batch {cfg.max_batch} --max-len "
        f"{cfg.max_len} --page-size {cfg.page_size} --max-waiting {cfg.max_waiting}; {cfg.clients} clients for "
        f"{cfg.duration_s:g} s, a burst of {2 * (cfg.max_batch + cfg.max_waiting)} every {cfg.burst_every_s:g} s; "
        f"{os.cpu_count()} CPUs, load average {load:.2f} before, {os.getloadavg()[0]:.2f} after\n")
  print("| requests | wall s | requests/s | 200s/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | "
        "RSS MB start -> end | threads start -> end | pages in use | requests recorded | SIGTERM exit |")
  print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
  print(f"| {r['requests']} | {r['wall_s']:.1f} | {r['rps']:.2f} | {r['ok_rps']:.2f} | {r['ttft_p50']:.0f} | "
        f"{r['ttft_p99']:.0f} | {r['itl_p50']:.1f} | {r['itl_p99']:.1f} | {r['rss_mb'][0]:.0f} -> "
        f"{r['rss_mb'][1]:.0f} | {r['threads'][0]} -> {r['threads'][1]} | {r['pages_in_use']:g} | "
        f"{r['requests_recorded']:g} | {r['exit_code']} |")
  print("\nBy status, the warm round's too (0: the client hung up on purpose): "
        + ", ".join(f"{s}: {n}" for s, n in r["statuses"].items())
        + "\nBy kind: " + ", ".join(f"{k} {s}: {n}" for (k, s), n in sorted(r["kinds"].items()))
        + f"\n\nProblems: {len(r['problems'])}\n" + "".join(f"- {p}\n" for p in r["problems"][:20]))
  return 1 if r["problems"] else 0


if __name__ == "__main__":
  sys.exit(main())
