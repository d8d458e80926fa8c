"""The server's engine side: `warm_up` before serving, then `EngineThread`, the one thread that calls the Engine.

Only that thread touches the Engine: its jitted calls donate the state, so a read from another
thread could see a donated buffer. Other threads post commands (closures run between steps);
each tracked request's new tokens go back through its sink as `Update`s.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING

from mtp_jax.serving.engine import Engine

if TYPE_CHECKING:  # model.py needs jinja2, which nothing here uses
  from mtp_jax.serving.model import ServedModel

log = logging.getLogger("mtp_jax.serve")


def warm_up(engine: Engine, model: ServedModel) -> None:
  """Compiles the engine's programs with one short request, so the first client's time to first
  token is not a compile (the request is counted in the metrics)."""
  prompt = model.encode("Hello", False) or [0]
  rid = engine.add_request(prompt, 2)
  engine.run()
  engine.forget(rid)


@dataclasses.dataclass(frozen=True)
class Update:
  """What one engine step gave a request: its new tokens, and its final status once it ended
  ("finished", "out_of_pages", "cancelled", "timed_out"); error: the engine failed."""

  tokens: tuple[int, ...] = ()
  status: str | None = None
  error: str | None = None


class EngineFailed(RuntimeError):
  """The engine thread's step raised: the server answers 503 from then on."""


class EngineThread:
  """The one thread that owns an Engine: runs commands posted from other threads between steps,
  steps while requests are live, and sends each tracked request its `Update`s through its sink
  (a callable run on this thread; the server's puts into an asyncio queue thread-safely)."""

  def __init__(self, engine: Engine):
    self.engine = engine
    self.error: str | None = None
    self._commands: queue.SimpleQueue = queue.SimpleQueue()
    self._sinks: dict[int, Callable[[Update], None]] = {}
    self._thread = threading.Thread(target=self._loop, name="mtp-jax-engine", daemon=True)

  def start(self) -> None:
    self._thread.start()

  def stop(self, timeout: float | None = None) -> None:
    """Cancels the live requests (their sinks get status "cancelled") and ends the thread."""
    self._commands.put(None)
    self._thread.join(timeout)

  def post(self, command: Callable[[Engine], object]) -> None:
    """Runs command(engine) on the engine thread before its next step (errors are logged)."""
    self._commands.put(command)

  def call(self, command: Callable[[Engine], object]) -> asyncio.Future:
    """command(engine) on the engine thread; its result (or exception) in a future of the calling loop."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def run(engine):
      try:
        result, error = command(engine), None
      except Exception as e:  # handed to the caller, which answers with it
        result, error = None, e
      loop.call_soon_threadsafe(settle, future, result, error)
    self.post(run)
    return future

  def add(self, sink: Callable[[Update], None], prompt: list[int], max_new_tokens: int, **settings) -> asyncio.Future:
    """engine.add_request(prompt, max_new_tokens, **settings) with `sink` receiving its updates;
    a future of the request id."""
    def add(engine):
      if self.error is not None:
        raise EngineFailed(self.error)
      rid = engine.add_request(prompt, max_new_tokens, **settings)
      self._sinks[rid] = sink
      return rid
    return self.call(add)

  def cancel(self, request_id: int) -> None:
    """Stops a request that is still live (its slot and pages are freed); no more updates come."""
    def cancel(engine):
      if self._sinks.pop(request_id, None) is not None:
        engine.cancel(request_id)
        engine.forget(request_id)
    self.post(cancel)

  def _loop(self) -> None:
    while True:
      live = self.error is None and (self.engine.num_running or self.engine.num_waiting)
      commands = []
      try:
        commands.append(self._commands.get(block=not live))
        while True:
          commands.append(self._commands.get_nowait())
      except queue.Empty:
        pass
      for command in commands:
        if command is None:
          self._end("cancelled")
          return
        try:
          command(self.engine)
        except Exception:
          log.exception("engine command failed")
      if self.error is None and (self.engine.num_running or self.engine.num_waiting):
        try:
          gained = self.engine.step()
        except Exception as e:  # the state may be half-donated: no more steps
          log.error("engine step failed; the server stops decoding:\n%s", traceback.format_exc())
          self.error = f"the engine failed: {type(e).__name__}: {e}"
          self._end(None)
          continue
        self._dispatch(gained)

  def _dispatch(self, gained: dict[int, list[int]]) -> None:
    for rid, sink in list(self._sinks.items()):
      status = self.engine.requests[rid].status
      status = None if status in ("waiting", "running") else status
      new = gained.get(rid, ())
      if new or status is not None:
        sink(Update(tuple(new), status))
      if status is not None:  # delivered: the engine need not keep its record
        del self._sinks[rid]
        self.engine.forget(rid)

  def _end(self, status: str | None) -> None:
    for rid, sink in self._sinks.items():
      if status is not None:
        self.engine.cancel(rid)
        self.engine.forget(rid)
      sink(Update(status=status, error=self.error))
    self._sinks.clear()


def settle(future: asyncio.Future, result, error) -> None:
  """Sets a future's result or exception (on its loop's thread), unless its waiter gave it up."""
  if future.cancelled():
    return
  if error is not None:
    future.set_exception(error)
  else:
    future.set_result(result)
