"""`mtp-jax serve` in a subprocess on a free local port, driven by the official openai client.

One server (the small demo model, 4 slots of 256 rows, 16 pages: one page budget, so the warm-up
compiles everything the tests run) is shared by the module; the last test stops it with SIGTERM.
The text pieces, chat templates and error mapping are checked in this process.
"""

import asyncio
import concurrent.futures
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest

try:  # the openai client's HTTP library: httpx2 in recent releases
  import httpx2 as httpx
except ImportError:
  import httpx

import mtp_jax
from mtp_jax import data, validate
from mtp_jax.serving import server as server_lib
from mtp_jax.serving import QueueFull
from mtp_jax.serving.engine_thread import EngineFailed, Update
from mtp_jax.serving.model import ServedModel, chat_prompt
from mtp_jax.serving.text import TextStream

ROOT = Path(__file__).resolve().parents[1]
MODEL = "mtp-jax-demo-small"
MAX_LEN = 256
# The request in flight at SIGTERM may meet a step the server has not compiled yet (under
# num_drafts="auto" it tries each width; a compile takes seconds on 2 cores): room for one.
SHUTDOWN_S = 30
PROMPTS = ["def main(", "import os\n", "class Foo:\n    ", "for i in range(", "return self."]
MAX_TOKENS = 24


class Served:
  def __init__(self, proc: subprocess.Popen, url: str):
    self.proc, self.url = proc, url
    self.client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)

  def post(self, path: str, body: bytes) -> tuple[int, dict]:
    request = urllib.request.Request(self.url + path, data=body, headers={"Content-Type": "application/json"})
    try:
      with urllib.request.urlopen(request, timeout=60) as r:
        return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
      return e.code, json.loads(e.read())

  def get(self, path: str) -> str:
    with urllib.request.urlopen(self.url + path, timeout=60) as r:
      return r.read().decode()

  def metric(self, name: str) -> float:
    return float(re.search(rf"^mtp_jax_{name} (\S+)$", self.get("/metrics"), re.M).group(1))


@pytest.fixture(scope="module")
def started(tmp_path_factory):
  """The server process, starting (it compiles while the test process computes its references); its
  log goes to a file (a pipe nobody reads could fill and stall it)."""
  env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
  log = tmp_path_factory.mktemp("server") / "stderr.txt"
  with open(log, "w") as err:
    proc = subprocess.Popen([sys.executable, "-m", "mtp_jax.cli", "serve", "--port", "0", "--max-batch", "4",
                             "--max-len", str(MAX_LEN), "--page-size", "64", "--max-waiting", "64",
                             "--log-level", "warning", "--shutdown-timeout", str(SHUTDOWN_S)],
                            stdout=subprocess.PIPE, stderr=err, text=True, env=env, cwd=ROOT)
  proc.log = log
  yield proc
  if proc.poll() is None:
    proc.kill()
    proc.wait()


@pytest.fixture(scope="module")
def served(started):
  proc, lines = started, []
  reader = threading.Thread(target=lambda: lines.append(proc.stdout.readline()), daemon=True)
  reader.start()
  reader.join(240)
  match = re.search(r"listening on (http://\S+)", lines[0] if lines else "")
  if match is None:
    proc.kill()
    pytest.fail(f"the server did not start: {lines} {proc.log.read_text()[-3000:]}")
  return Served(proc, match.group(1))


@pytest.fixture(scope="module")
def greedy_refs(started):
  """generate on each prompt alone (greedy, the demo's eos), as text."""
  target, proposer, tok = mtp_jax.load_demo()
  out = mtp_jax.generate(target, proposer, [tok.encode(p, bos=False) for p in PROMPTS], MAX_TOKENS, num_drafts=3,
                         eos_token_id=tok.eos_id)
  return {p: data.decode(t) for p, t in zip(PROMPTS, out.tokens)}


@pytest.fixture(scope="module")
def seeded_refs(started):
  """Plain sampling (proposer None, batch 1) of the concurrent test's seeded requests, as text:
  {(prompt, seed): the text of MAX_TOKENS tokens}."""
  target, _, tok = mtp_jax.load_demo()
  refs = {}
  for i in range(2, 32, 4):
    prompt = PROMPTS[i % len(PROMPTS)]
    out = mtp_jax.generate(target, None, [tok.encode(prompt, bos=False)], MAX_TOKENS, temperature=0.8, seed=i,
                           eos_token_id=tok.eos_id)
    refs[prompt, i] = out.tokens[0]
  return refs


def test_greedy_completion_equals_generate_and_streams_the_same_text(greedy_refs, served):
  assert json.loads(served.get("/health")) == {"status": "ok"}
  assert [m.id for m in served.client.models.list().data] == [MODEL]
  for prompt in PROMPTS[:2]:
    want = greedy_refs[prompt]
    c = served.client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS)
    assert c.choices[0].text == want and c.choices[0].finish_reason == "length"
    assert c.usage.prompt_tokens == len(prompt) and c.usage.completion_tokens == MAX_TOKENS
    chunks = list(served.client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, stream=True,
                                                   stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == MAX_TOKENS
  # A stop string ends the text before it (not returned), streamed or not; its request is cancelled.
  want = greedy_refs[PROMPTS[0]]
  stop = want[8:11]
  c = served.client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, stop=[stop, "zzz"])
  assert c.choices[0].text == want[:want.index(stop)] and c.choices[0].finish_reason == "stop"
  chunks = list(served.client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, stop=stop,
                                                 stream=True))
  assert "".join(c.choices[0].text for c in chunks) == want[:want.index(stop)]
  assert chunks[-1].choices[0].finish_reason == "stop"


def test_concurrent_requests_with_mixed_settings_all_complete(greedy_refs, seeded_refs, served):
  """32 concurrent requests of mixed settings: greedy ones give generate's text, seeded sampled
  ones plain sampling's with their seed (under whatever load, width and admission they met)."""
  alone = {p: served.client.completions.create(model=MODEL, prompt=p, max_tokens=MAX_TOKENS).choices[0].text
           for p in PROMPTS}
  assert alone == greedy_refs

  def one(i):
    prompt, stream = PROMPTS[i % len(PROMPTS)], i % 3 == 0
    # greedy with the server's drafts, greedy with 0..3 drafts of its own, and two kinds of sampling
    settings = [{}, {"temperature": 0.0, "extra_body": {"num_drafts": i // 4 % 4}}, {"temperature": 0.8, "seed": i},
                {"temperature": 1.0, "top_p": 0.9, "extra_body": {"top_k": 20}}][i % 4]
    kwargs = dict(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS - i % 5, stream=stream, **settings)
    if stream:
      chunks = list(served.client.completions.create(**kwargs))
      return prompt, kwargs, "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
    c = served.client.completions.create(**kwargs)
    return prompt, kwargs, c.choices[0].text, c.choices[0].finish_reason

  with concurrent.futures.ThreadPoolExecutor(32) as pool:
    results = list(pool.map(one, range(32)))
  greedy = seeded = 0
  for prompt, kwargs, text, finish in results:
    assert finish in ("length", "stop")
    if kwargs.get("temperature", 0.0) == 0.0:
      greedy += 1
      assert text == data.decode(data.encode(alone[prompt], bos=False)[:kwargs["max_tokens"]]), kwargs
    elif "seed" in kwargs:
      seeded += 1
      assert text == data.decode(seeded_refs[prompt, kwargs["seed"]][:kwargs["max_tokens"]]), kwargs
  assert greedy == 16 and seeded == 8
  assert served.metric("requests_running") == served.metric("requests_waiting") == 0
  assert served.metric("pages_in_use") == 0


def test_bad_requests_get_400_naming_the_field(served):
  def check(body, param, status=400, path="/v1/completions"):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    code, answer = served.post(path, raw)
    assert (code, answer["error"]["param"]) == (status, param), (body, answer)
    assert set(answer["error"]) == {"message", "type", "param", "code"} and answer["error"]["message"]
    return answer["error"]

  ok = {"model": MODEL, "prompt": "def f(", "max_tokens": 4}
  check(b'{"prompt": "def f(", "max_tokens": 4', None)  # malformed JSON
  check(b'[1, 2]', None)
  assert "unknown field 'frobnicate'" in check({**ok, "frobnicate": 1}, "frobnicate")["message"]
  check({**ok, "max_tokens": 10**6}, "prompt")  # fits int32, not the engine: named with the prompt's length
  check({**ok, "max_tokens": 10**12}, "max_tokens")
  check({**ok, "max_tokens": "4"}, "max_tokens")
  check({**ok, "temperature": -1.0}, "temperature")
  check({**ok, "top_p": 1.5}, "top_p")
  check({**ok, "num_drafts": 9}, "num_drafts")
  check({**ok, "prompt": [999]}, "prompt")
  check({**ok, "prompt": ["a", "b"]}, "prompt")
  check({**ok, "n": 2}, "n")
  check({**ok, "stop": [""]}, "stop")
  check({**ok, "stream": "yes"}, "stream")
  check({**ok, "response_format": {"type": "xml"}}, "response_format")
  check({**ok, "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}}},
        "response_format")
  assert check({**ok, "model": "gpt-4"}, "model", 404)["code"] == "model_not_found"
  assert check({"messages": [{"role": "user", "content": "hi"}]}, None, 404,
               "/v1/chat/completions")["code"] == "chat_template_missing"
  with pytest.raises(openai.BadRequestError) as e:
    served.client.completions.create(model=MODEL, prompt="x", max_tokens=4, temperature=-0.5)
  assert e.value.status_code == 400 and e.value.param == "temperature"
  # A valid schema constrains the continuation to JSON under it.
  schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
            "additionalProperties": False}
  c = served.client.completions.create(model=MODEL, prompt="x = ", max_tokens=40, extra_body={
      "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}})
  assert isinstance(json.loads(c.choices[0].text)["n"], int) and c.choices[0].finish_reason == "stop"


def _raw_request(served, body: dict) -> socket.socket:
  """Sends a completion request over a raw socket; for a stream, returns once its first event arrived."""
  host, port = served.url.removeprefix("http://").split(":")
  sock = socket.create_connection((host, int(port)))
  raw = json.dumps(body).encode()
  sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               b"Content-Length: %d\r\n\r\n%s" % (len(raw), raw))
  got = b""
  while body.get("stream") and b"data: " not in got:
    got += sock.recv(65536)
  return sock


def _wait_for(served, name: str, value: float) -> float:
  deadline = time.monotonic() + 30
  while (now := served.metric(name)) != value and time.monotonic() < deadline:
    time.sleep(0.02)
  return now


def test_a_client_that_disconnects_frees_its_slot_and_pages(served):
  cancelled = served.metric("requests_cancelled_total")
  longest = MAX_LEN - len(PROMPTS[0]) - 4  # k + 1 rows of the last step
  for stream in (True, False):  # mid-stream; and while a whole answer is being made
    sock = _raw_request(served, {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": longest, "stream": stream})
    if not stream:
      assert _wait_for(served, "requests_running", 1) == 1
    sock.close()
    cancelled += 1
    assert _wait_for(served, "requests_cancelled_total", cancelled) == cancelled
    assert served.metric("pages_in_use") == 0 and served.metric("requests_running") == 0
    assert served.metric("requests_recorded") == 0  # the server forgets each ended request


def test_sigterm_finishes_the_open_stream_and_exits_cleanly(served):
  longest = MAX_LEN - len(PROMPTS[1]) - 4
  sock = _raw_request(served, {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": longest, "stream": True})
  t0 = time.monotonic()
  served.proc.send_signal(signal.SIGTERM)
  rest = b""
  while chunk := sock.recv(65536):
    rest += chunk
  sock.close()
  # Graceful: the request in flight ran to its end.
  assert b'"finish_reason":"length"' in rest and rest.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")
  assert served.proc.wait(timeout=SHUTDOWN_S + 20) == 0 and time.monotonic() - t0 < SHUTDOWN_S
  log = served.proc.log.read_text()
  assert "mtp-jax serve: stopped" in log and "Traceback" not in log


# -- in this process --


def test_text_stream_holds_back_what_may_be_a_stop_string_or_a_cut_character():
  text = TextStream(data.decode, stop=("END", "\n\n"))
  ids = lambda s: list(s.encode())
  assert text.push(ids("ab E")) == "ab "  # "E" may begin "END"
  assert text.push(ids("x")) == "Ex"
  assert text.push(ids("caf") + [0xC3]) == "caf"  # a cut two-byte character waits
  assert text.push([0xA9, ord("\n")]) == "\xe9"
  assert text.push(ids("\nEND")) == "" and text.stopped
  plain = TextStream(data.decode)
  assert plain.push([0xC3]) == "" and plain.push([], final=True) == "\ufffd"
  ended = TextStream(data.decode, stop=("xyz",))
  assert ended.push(ids("abxy"), final=True) == "abxy" and not ended.stopped


def test_chat_prompt_renders_a_template_and_names_the_messages_on_error():
  template = ("{{ bos_token }}{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
              "{% if add_generation_prompt %}<assistant>{% endif %}")
  messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
  assert chat_prompt(template, messages, bos_token="<s>") == "<s><system>be brief\n<user>hi\n<assistant>"
  with pytest.raises(validate.InvalidValue, match="refused the messages: no system") as e:
    chat_prompt("{{ raise_exception('no system') }}", messages)
  assert e.value.argument == "messages"
  with pytest.raises(validate.InvalidValue):  # the sandbox refuses attribute access to internals
    chat_prompt("{{ messages.__class__.__mro__ }}", messages)


def test_errors_map_to_openai_status_codes_without_tracebacks():
  def answer(error):
    response = server_lib.error_response(error)
    return response.status_code, json.loads(response.body)["error"]

  status, body = answer(validate.InvalidValue("max_new_tokens", "max_new_tokens must be <= 9"))
  assert (status, body["param"], body["type"]) == (400, "max_tokens", "invalid_request_error")
  assert body["message"] == "max_tokens: max_new_tokens must be <= 9"
  status, body = answer(QueueFull("the engine's waiting queue is full"))
  assert (status, body["type"], body["code"]) == (429, "rate_limit_error", "queue_full")
  status, body = answer(EngineFailed("the engine failed: boom"))
  assert (status, body["code"]) == (503, "engine_failed")
  status, body = answer(RuntimeError("secret detail"))
  assert status == 500 and "secret" not in body["message"] and "Traceback" not in body["message"]


def test_serve_without_the_extra_is_one_error_line(monkeypatch, capsys):
  import mtp_jax.serving
  from mtp_jax import cli
  monkeypatch.delitem(sys.modules, "mtp_jax.serving.server")
  monkeypatch.delattr(mtp_jax.serving, "server")
  monkeypatch.setitem(sys.modules, "uvicorn", None)  # as if not installed
  assert cli.main(["serve"]) == 2
  err = capsys.readouterr().err
  assert err == "mtp-jax: error: mtp-jax serve needs the serve extra (pip install 'mtp_jax[serve]'): uvicorn is " \
                "not installed\n"
  # The base package and the CLI import none of it.
  code = "import sys, mtp_jax, mtp_jax.cli; print(sorted({'starlette', 'uvicorn', 'jinja2'} & set(sys.modules)))"
  proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
  assert proc.stdout.strip() == "[]", proc.stderr[-2000:]


class _ScriptedWorker:
  """An EngineThread stand-in for the HTTP layer alone: every request gets `tokens`, three per update."""

  error = None

  def __init__(self, tokens):
    self.tokens, self.added, self.cancelled = tokens, [], []

  def add(self, sink, prompt, max_new_tokens, **settings):
    self.added.append((prompt, max_new_tokens, settings))
    for i in range(0, len(self.tokens), 3):
      sink(Update(tuple(self.tokens[i:i + 3])))
    sink(Update(status="finished"))
    future = asyncio.get_running_loop().create_future()
    future.set_result(len(self.added))
    return future

  def cancel(self, request_id):
    self.cancelled.append(request_id)


def test_chat_completions_render_the_template_and_answer_in_openai_shapes():
  template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}[assistant] "
  model = ServedModel(name="chatty", target=None, proposer=None, decode=data.decode,
                      encode=lambda text, special: data.encode(text, bos=False), eos_token_id=data.EOS_ID,
                      chat_template=template)
  worker = _ScriptedWorker(data.encode("Hello there. Bye", bos=False) + [data.EOS_ID])
  app = server_lib.Server(worker, model).app()

  async def talk():
    http = openai.DefaultAsyncHttpxClient(transport=httpx.ASGITransport(app=app), base_url="http://chat")
    client = openai.AsyncOpenAI(base_url="http://chat/v1", api_key="unused", http_client=http, max_retries=0)
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    whole = await client.chat.completions.create(model="chatty", messages=messages, max_completion_tokens=30)
    stream = await client.chat.completions.create(model="chatty", messages=messages, stream=True, stop=". B",
                                                  temperature=0.5, stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    with pytest.raises(openai.BadRequestError) as e:
      await client.chat.completions.create(model="chatty", messages=[{"role": "user"}])
    await http.aclose()
    return whole, chunks, e.value

  whole, chunks, error = asyncio.run(talk())
  prompt = "[system] be brief\n[user] hi\n[assistant] "
  assert worker.added[0] == (data.encode(prompt, bos=False), 30, {})
  assert worker.added[1][1:] == (server_lib.DEFAULT_MAX_TOKENS, {"temperature": 0.5})
  assert whole.object == "chat.completion" and whole.choices[0].message.role == "assistant"
  assert whole.choices[0].message.content == "Hello there. Bye" and whole.choices[0].finish_reason == "stop"
  assert whole.usage.prompt_tokens == len(prompt) and whole.usage.completion_tokens == 17
  assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].object == "chat.completion.chunk"
  assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hello there"
  assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop" and chunks[-1].usage.total_tokens
  assert worker.cancelled == [2]  # the stop string cancelled the second request
  assert error.status_code == 400 and error.param == "messages"
