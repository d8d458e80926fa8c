"""`mtp-jax serve`: an OpenAI-compatible HTTP server over the `Engine`; this module speaks HTTP only.

    HTTP handlers (Starlette on uvicorn, one asyncio loop)
        |  commands (closures run on the engine thread): add, cancel, metrics
        v
    EngineThread (engine_thread.py): owns the Engine; drains commands, runs engine.step(), and hands
        |  each request's new tokens back to its handler (loop.call_soon_threadsafe into an asyncio.Queue)
        v
    handler: tokens -> text (TextStream, text.py: incremental detokenizing, stop strings cut on the host)
             -> a JSON response, or server-sent events when stream=true

The model served and its chat template: model.py. Endpoints: POST /v1/completions, POST
/v1/chat/completions (models with a chat template), GET /v1/models, /health, /metrics (Prometheus
text). Bad input gets HTTP 400 with an OpenAI-style error body naming the field, a body past the limit 413, a
full waiting queue 429; a client that disconnects has its request cancelled (slot and pages freed).
Needs the `serve` extra (starlette, uvicorn; jinja2 for model.py's chat templates); the base package imports none.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import signal
import socket
import sys
import time
import traceback
import uuid
from collections.abc import AsyncIterator

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from mtp_jax import grammar as grammar_lib, validate
from mtp_jax.serving.engine import Engine
from mtp_jax.serving.engine_thread import EngineFailed, EngineThread, Update, warm_up
from mtp_jax.serving.metrics import prometheus_text
from mtp_jax.serving.model import SchemaGrammars, ServedModel, chat_prompt, schema_text
from mtp_jax.serving.requests import QueueFull
from mtp_jax.serving.text import TextStream

log = logging.getLogger("mtp_jax.serve")

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions
# Request fields the server takes, per endpoint; any other top-level field is refused (400).
SHARED_FIELDS = ("model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream", "stream_options",
                 "response_format", "num_drafts", "n", "frequency_penalty", "presence_penalty", "logprobs", "user")
COMPLETION_FIELDS = SHARED_FIELDS + ("prompt", "best_of", "echo", "suffix", "logit_bias")
CHAT_FIELDS = SHARED_FIELDS + ("messages", "max_completion_tokens", "logit_bias", "top_logprobs")
# Fields the server knows but does not implement: accepted at these values (OpenAI's defaults) only.
INERT = {"n": (1,), "best_of": (1,), "echo": (False,), "suffix": ("",), "logprobs": (False, 0),
         "frequency_penalty": (0,), "presence_penalty": (0,), "logit_bias": ({},), "top_logprobs": (0,)}
# The engine's argument names -> the request fields they come from, for errors.
FIELD_OF_ARGUMENT = {"max_new_tokens": "max_tokens", "grammar": "response_format", "schema": "response_format"}
SETTING_FIELDS = ("temperature", "top_p", "top_k", "seed", "num_drafts")


# -- requests --


class ApiError(Exception):
  """An error answered as OpenAI does: {"error": {"message", "type", "param", "code"}}."""

  def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
               code: str | None = None):
    super().__init__(message)
    self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code


def error_response(error: Exception) -> JSONResponse:
  """The HTTP answer to an error raised while serving a request: 400 naming the field for bad input
  (validate.InvalidValue / InvalidType, ApiError), 429 for a full queue, 503 once the engine failed,
  500 (logged, no traceback in the body) for anything else."""
  if isinstance(error, (validate.InvalidValue, validate.InvalidType)):
    field = FIELD_OF_ARGUMENT.get(error.argument, error.argument)
    error = ApiError(400, str(error) if field == error.argument else f"{field}: {error}", field)
  elif isinstance(error, QueueFull):
    error = ApiError(429, str(error), kind="rate_limit_error", code="queue_full")
  elif isinstance(error, EngineFailed):
    error = ApiError(503, str(error), kind="server_error", code="engine_failed")
  elif not isinstance(error, ApiError):
    log.error("request failed:\n%s", "".join(traceback.format_exception(error)))
    error = ApiError(500, f"internal server error ({type(error).__name__})", kind="server_error")
  return JSONResponse(_error_body(error), status_code=error.status)


def _error_body(error: ApiError) -> dict:
  return {"error": {"message": error.message, "type": error.kind, "param": error.param, "code": error.code}}


@dataclasses.dataclass(frozen=True)
class RequestSettings:
  """A request's per-request engine settings; None keeps the engine's default (not passed)."""

  temperature: float | None = None
  top_p: float | None = None
  top_k: int | None = None
  seed: int | None = None
  num_drafts: int | str | None = None
  grammar: grammar_lib.Grammar | None = None

  def kwargs(self) -> dict:
    """The keywords for engine.add_request: only the settings the client set."""
    return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) is not None}


@dataclasses.dataclass(frozen=True)
class Completion:
  """One parsed request: the prompt's ids, the token limit, stop strings, streaming and its engine settings."""

  prompt: tuple[int, ...]
  max_tokens: int
  stop: tuple[str, ...]
  stream: bool
  include_usage: bool
  settings: RequestSettings
  chat: bool


class Server:
  """The HTTP side: parses requests, hands them to the EngineThread, answers as the OpenAI API does."""

  def __init__(self, worker: EngineThread, model: ServedModel, *, max_body_bytes: int = 1 << 20,
               grammar_timeout_s: float = 60.0):
    self.worker, self.model = worker, model
    self.max_body_bytes = validate.positive_int("max_body_bytes", max_body_bytes)
    self.grammars = SchemaGrammars(model, timeout_s=grammar_timeout_s)
    self.created = int(time.time())

  def app(self) -> Starlette:
    routes = [Route("/v1/completions", self.completions, methods=["POST"]),
              Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
              Route("/v1/models", self.models, methods=["GET"]),
              Route("/health", self.health, methods=["GET"]),
              Route("/metrics", self.metrics, methods=["GET"])]

    async def http_error(request, exc: HTTPException):
      return JSONResponse(_error_body(ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                                               code="not_found" if exc.status_code == 404 else None)),
                          status_code=exc.status_code)
    return Starlette(routes=routes, exception_handlers={HTTPException: http_error})

  # -- endpoints --

  async def health(self, request: HttpRequest) -> Response:
    if self.worker.error is not None:
      return JSONResponse(_error_body(ApiError(503, self.worker.error, kind="server_error", code="engine_failed")),
                          status_code=503)
    return JSONResponse({"status": "ok"})

  async def metrics(self, request: HttpRequest) -> Response:
    try:
      text = await self.worker.call(lambda engine: prometheus_text(engine.metrics()))
    except Exception as e:
      return error_response(e)
    return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")

  async def models(self, request: HttpRequest) -> Response:
    return JSONResponse({"object": "list", "data": [
        {"id": self.model.name, "object": "model", "created": self.created, "owned_by": "mtp-jax"}]})

  async def completions(self, request: HttpRequest) -> Response:
    return await self._serve(request, chat=False)

  async def chat_completions(self, request: HttpRequest) -> Response:
    if self.model.chat_template is None:
      return error_response(ApiError(
          404, f"the model {self.model.name!r} has no chat template, so there is no chat endpoint; use "
               "/v1/completions (or start the server with --chat-template FILE)", code="chat_template_missing"))
    return await self._serve(request, chat=True)

  async def _serve(self, request: HttpRequest, chat: bool) -> Response:
    try:
      params = await self._parse(request, chat)
      queue_: asyncio.Queue[Update] = asyncio.Queue()
      loop = asyncio.get_running_loop()

      def sink(update: Update) -> None:
        try:
          loop.call_soon_threadsafe(queue_.put_nowait, update)
        except RuntimeError:  # the loop closed at shutdown: nobody waits
          pass
      rid = await self.worker.add(sink, list(params.prompt), params.max_tokens, **params.settings.kwargs())
    except Exception as e:
      return error_response(e)
    run = _Run(self.worker, rid, queue_, TextStream(self.model.decode, params.stop), params, self.model.eos_token_id)
    if params.stream:
      return StreamingResponse(self._events(run), media_type="text/event-stream",
                               headers={"Cache-Control": "no-cache"})
    return await self._whole(request, run)

  # -- parsing --

  async def _parse(self, request: HttpRequest, chat: bool) -> Completion:
    try:
      body = json.loads(await self._body(request))
    except (ValueError, UnicodeDecodeError) as e:
      raise ApiError(400, f"the request body is not valid JSON: {e}") from e
    except RecursionError as e:  # json nests by recursion: "[[[[..." deeper than the interpreter's stack
      raise ApiError(400, "the request body is not valid JSON: nested too deeply") from e
    if not isinstance(body, dict):
      raise ApiError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    known = CHAT_FIELDS if chat else COMPLETION_FIELDS
    for field in body:
      if field not in known:
        raise ApiError(400, f"unknown field {field!r}; this endpoint takes {', '.join(sorted(known))}", field)
    for field, allowed in INERT.items():
      value = body.get(field)
      if value is not None and not any(isinstance(value, bool) == isinstance(a, bool) and value == a
                                       for a in allowed):
        raise ApiError(400, f"{field}={body[field]!r} is not supported by this server (only {allowed[0]!r})", field)
    model = body.get("model")
    if model is not None and model != self.model.name:
      raise ApiError(404, f"the model {model!r} does not exist; this server serves {self.model.name!r}", "model",
                     code="model_not_found")
    prompt = self._chat_prompt(body.get("messages")) if chat else self._prompt(body.get("prompt"))
    max_tokens = body.get("max_completion_tokens") if chat and body.get("max_tokens") is None else body.get(
        "max_tokens")
    max_tokens = DEFAULT_MAX_TOKENS if max_tokens is None else validate.positive_int("max_tokens", max_tokens)
    stream = body.get("stream")
    stream = False if stream is None else validate.flag("stream", stream)
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
      if not stream:
        raise ApiError(400, "stream_options is only allowed with stream=true", "stream_options")
      if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise ApiError(400, f"stream_options must be an object with include_usage only, got {options!r}",
                       "stream_options")
      include_usage = validate.flag("stream_options.include_usage", options.get("include_usage", False))
    settings = {f: body[f] for f in SETTING_FIELDS if body.get(f) is not None}
    schema = schema_text(self.model, body.get("response_format"))
    if schema is not None:
      settings["grammar"] = await self.grammars.get(schema)
    return Completion(prompt=tuple(prompt), max_tokens=max_tokens, stop=_stop(body.get("stop")), stream=stream,
                      include_usage=include_usage, settings=RequestSettings(**settings), chat=chat)

  async def _body(self, request: HttpRequest) -> bytes:
    """The body, read no further than max_body_bytes (413 past them, declared or sent)."""
    declared = request.headers.get("content-length", "")
    parts, size = [], int(declared) if declared.isdigit() else 0
    if size <= self.max_body_bytes:
      size = 0
      async for part in request.stream():
        size += len(part)
        if size > self.max_body_bytes:
          break
        parts.append(part)
    if size > self.max_body_bytes:
      raise ApiError(413, f"the request body is larger than this server takes ({self.max_body_bytes} bytes)",
                     code="request_too_large")
    return b"".join(parts)

  def _prompt(self, prompt) -> list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
      prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
      if not prompt:
        raise ApiError(400, "prompt is empty", "prompt")
      return self.model.encode(prompt, True)
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
      return prompt  # token ids, checked by the engine
    raise ApiError(400, "prompt must be a string or a list of token ids (one prompt per request)", "prompt")

  def _chat_prompt(self, messages) -> list[int]:
    if not isinstance(messages, list) or not messages:
      raise ApiError(400, "messages must be a non-empty list of {role, content} objects", "messages")
    plain = []
    for i, m in enumerate(messages):
      content = m.get("content") if isinstance(m, dict) else None
      if isinstance(content, list):  # content parts: text ones only
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
          raise ApiError(400, f"messages[{i}].content: only text parts are supported", "messages")
        content = "".join(p["text"] for p in content)
      if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(content, str):
        raise ApiError(400, f"messages[{i}] must be an object with a string role and content", "messages")
      plain.append({**m, "content": content})
    text = chat_prompt(self.model.chat_template, plain, bos_token=self.model.bos_token,
                       eos_token=self.model.eos_token)
    return self.model.encode(text, False)

  # -- answers --

  def _head(self, run: _Run) -> dict:
    chat = run.params.chat
    return dict(id=("chatcmpl-" if chat else "cmpl-") + run.uid, created=run.created, model=self.model.name,
                object="chat.completion.chunk" if chat and run.params.stream else
                "chat.completion" if chat else "text_completion")

  async def _whole(self, request: HttpRequest, run: _Run) -> Response:
    collect = asyncio.ensure_future(run.text())
    gone = asyncio.ensure_future(_disconnected(request))
    try:
      await asyncio.wait((collect, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
      gone.cancel()
      left = not collect.done()
      if left:  # the client left: the collector's cancellation cancels the request
        collect.cancel()
    if left:
      return Response(status_code=499)  # nobody reads it
    try:
      text, finish = collect.result()
    except Exception as e:
      return error_response(e)
    choice = {"index": 0, "finish_reason": finish, "logprobs": None}
    choice.update({"message": {"role": "assistant", "content": text}} if run.params.chat else {"text": text})
    return JSONResponse({**self._head(run), "choices": [choice], "usage": run.usage()})

  async def _events(self, run: _Run) -> AsyncIterator[str]:
    head, chat = self._head(run), run.params.chat

    def chunk(text: str | None, finish: str | None, role: bool = False) -> str:
      if chat:
        delta = ({"role": "assistant"} if role else {}) | ({} if text is None else {"content": text})
        choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
      else:
        choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
      return _sse({**head, "choices": [choice]})

    if chat:
      yield chunk("", None, role=True)
    try:
      # Closed here, not when collected: a client gone mid-stream closes this generator, and the
      # request is cancelled in `pieces`'s finally (a cycle could hold it, and its pages, until a GC).
      async with contextlib.aclosing(run.pieces()) as pieces:
        async for piece, finish in pieces:
          yield chunk(piece, finish)
    except EngineFailed as e:
      yield _sse(_error_body(ApiError(503, str(e), kind="server_error", code="engine_failed")))
      return
    if run.params.include_usage:
      yield _sse({**head, "choices": [], "usage": run.usage()})
    yield "data: [DONE]\n\n"


class _Run:
  """One request in flight: its updates as text pieces; cancels the request if left before its end."""

  def __init__(self, worker: EngineThread, rid: int, updates: asyncio.Queue, text: TextStream, params: Completion,
               eos_token_id: int | None):
    self.worker, self.rid, self.updates, self.stream, self.params = worker, rid, updates, text, params
    self.eos_token_id = eos_token_id
    self.uid, self.created = uuid.uuid4().hex, int(time.time())
    self.tokens = 0

  async def pieces(self) -> AsyncIterator[tuple[str, str | None]]:
    """(text, None) while decoding, then (text, finish_reason): "stop" at EOS or a stop string,
    "length" at max_tokens. Raises EngineFailed if the engine failed or dropped the request."""
    ended = False
    try:
      while True:
        update = await self.updates.get()
        self.tokens += len(update.tokens)
        final = update.status is not None or update.error is not None
        piece = self.stream.push(update.tokens, final=final)
        if self.stream.stopped:
          yield piece, "stop"  # the request is cancelled on the way out
          return
        if update.error is not None or update.status in ("cancelled", "timed_out"):
          ended = True
          raise EngineFailed(update.error or f"the request was {update.status} by the server")
        if update.status is not None:
          ended = True
          # The engine ends a request at max_tokens or at EOS (the model's, as served).
          at_eos = update.status == "finished" and (len(self.stream.ids) < self.params.max_tokens or
                                                    self.stream.ids[-1] == self.eos_token_id)
          yield piece, "stop" if at_eos else "length"
          return
        if piece:
          yield piece, None
    finally:
      if not ended:
        self.worker.cancel(self.rid)

  async def text(self) -> tuple[str, str]:
    parts, finish = [], "length"
    async with contextlib.aclosing(self.pieces()) as pieces:
      async for piece, finish in pieces:
        parts.append(piece)
    return "".join(parts), finish

  def usage(self) -> dict:
    n = len(self.params.prompt)
    return {"prompt_tokens": n, "completion_tokens": self.tokens, "total_tokens": n + self.tokens}


def _stop(stop) -> tuple[str, ...]:
  if stop is None:
    return ()
  stop = [stop] if isinstance(stop, str) else stop
  if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
    raise ApiError(400, f"stop must be a non-empty string or a list of them, got {stop!r}", "stop")
  return tuple(stop)


def _sse(payload: dict) -> str:
  return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


async def _disconnected(request: HttpRequest) -> None:
  """Returns when the client has gone (the body is read, so the next ASGI message is the disconnect)."""
  while (await request.receive())["type"] != "http.disconnect":
    pass


# -- running --


def max_body_bytes(max_len: int) -> int:
  """The largest request body `serve` reads: 1 MiB, or 64 bytes per row of max_len (a prompt of
  max_len tokens as ids or as escaped text) when that is more."""
  return max(1 << 20, 64 * max_len)


def serve(engine: Engine, model: ServedModel, *, host: str = "127.0.0.1", port: int = 8000, warmup: bool = True,
          shutdown_timeout: float = 5.0, log_level: str = "info") -> int:
  """Runs the server until SIGTERM or SIGINT; returns 0 after a graceful shutdown (in-flight requests
  get shutdown_timeout seconds to finish, then are cancelled). Prints one line when it listens:
  `mtp-jax serve: listening on http://HOST:PORT (model NAME)` (port 0 picks a free port)."""
  validate.integer("port", port, 0, 65535)
  # Bound before the warm-up: a port in use fails at once, and early clients wait in the backlog.
  sock = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
  if warmup:
    warm_up(engine, model)
  worker = EngineThread(engine)
  app = Server(worker, model, max_body_bytes=max_body_bytes(engine.max_len)).app()
  config = uvicorn.Config(app, log_level=log_level, access_log=False, lifespan="off",
                          timeout_graceful_shutdown=max(1, round(shutdown_timeout)))
  bound = sock.getsockname()[1]
  worker.start()
  # uvicorn re-raises the signal that stopped it once it has shut down; with the default handler that
  # would kill the process (exit -15) after a clean stop, so the handlers left in place do nothing.
  for sig in (signal.SIGTERM, signal.SIGINT):
    signal.signal(sig, lambda *_: None)
  print(f"mtp-jax serve: listening on http://{host}:{bound} (model {model.name})", flush=True)
  try:
    uvicorn.Server(config).run(sockets=[sock])
  finally:
    worker.stop(timeout=shutdown_timeout)
    sock.close()
  print("mtp-jax serve: stopped", file=sys.stderr, flush=True)
  return 0
