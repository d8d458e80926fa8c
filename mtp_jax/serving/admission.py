"""The Engine's admission: the waiting queue, page reservations and chunked prefill, on the host.

Requests wait in FIFO order; the head is admitted into a free slot once the page pool can hold
its worst case (prompt + max_new_tokens + a step's rows) beside every running request's, so a
running request is never refused a page. A prompt longer than `prefill_chunk` is written in
parts, one per engine call, and decodes from its last part.
"""

from __future__ import annotations

import collections

import numpy as np

from mtp_jax.serving.requests import QueueFull, Request


class Admission:
  """Who waits, who is written in parts, and the pages reserved by running requests.

  num_pages: pages per pool; max_waiting: the queue's bound (None: unbounded); prefill_chunk:
  prompt tokens one call writes (None: whole prompts).
  """

  def __init__(self, num_pages: int, max_waiting: int | None, prefill_chunk: int | None):
    self.num_pages, self.max_waiting, self.prefill_chunk = num_pages, max_waiting, prefill_chunk
    self.waiting: collections.deque[int] = collections.deque()
    self.parts: collections.deque[int] = collections.deque()  # running requests whose prompt is written in parts
    self.reserved = 0

  def queue(self, request_id: int) -> None:
    """Appends a request to the queue; raises `QueueFull` when max_waiting already wait."""
    if self.max_waiting is not None and len(self.waiting) >= self.max_waiting:
      raise QueueFull(f"the engine's waiting queue is full (max_waiting={self.max_waiting}); retry later")
    self.waiting.append(request_id)

  def in_parts(self, request_id: int) -> bool:
    """True while the request's prompt is still being written in parts (it does not decode yet)."""
    return request_id in self.parts

  def admit(self, free_slots: list[int], requests: dict[int, Request]
            ) -> tuple[list[Request], list[Request], Request | None]:
    """Moves waiting requests into free_slots (FIFO: the head waits for pages rather than being
    overtaken), marking them running with their slot. Returns (the requests admitted now; those
    whose whole prompt, or last part, the next prefill writes; the request whose next part is
    written alone, or None)."""
    admitted = []
    while free_slots and self.waiting:
      req = requests[self.waiting[0]]
      if self.reserved + req.pages > self.num_pages:
        break
      self.waiting.popleft()
      req.slot, req.status = free_slots.pop(0), "running"
      self.reserved += req.pages
      admitted.append(req)
    chunked = lambda r: self.prefill_chunk is not None and len(r.prompt) > self.prefill_chunk
    whole = [r for r in admitted if not chunked(r)]
    self.parts.extend(r.id for r in admitted if chunked(r))
    part = None
    if self.parts:  # the oldest prompt written in parts: its next part, or its last with the others
      head = requests[self.parts[0]]
      if len(head.prompt) - head.prefilled <= self.prefill_chunk:
        whole.append(requests[self.parts.popleft()])
      else:
        part = head
    return admitted, whole, part

  def release(self, req: Request) -> None:
    """A running request left its slot: its pages are free for the queue."""
    if req.id in self.parts:
      self.parts.remove(req.id)
    self.reserved -= req.pages

  def drop(self, request_id: int) -> None:
    """A waiting request leaves the queue (cancelled or past its deadline)."""
    self.waiting.remove(request_id)


def slot_group(slots: list[int], occupied: list[bool], may_group: bool = True) -> np.ndarray:
  """int32[A]: the slots a call computes: `slots`, then others (free ones first: occupied[i] says
  whether slot i holds a request; the call leaves them untouched) up to a power of two A, so a
  call over a group compiles once per A. Every slot when A would be more than half of them (a
  group saves less than half the work there, and costs a program of its own to compile) or when
  not may_group (on a mesh: A must divide the data axis)."""
  b = len(occupied)
  a = 1 << (len(slots) - 1).bit_length()
  if not may_group or 2 * a > b:
    a = b
  rest = sorted(set(range(b)) - set(slots), key=lambda i: occupied[i])
  return np.asarray(list(slots) + rest[:a - len(slots)], np.int32)


def prefill_groups(slots: list[int], occupied: list[bool], may_group: bool = True) -> list[np.ndarray]:
  """The slot groups (int32[A] each, as `slot_group`) whose prefills write `slots` (occupied[i]:
  slot i holds a request, `slots` included): one group when it takes no slot that holds another
  request; else `slots` in chunks of powers of two, largest first, each a group of exactly its
  slots. A prefill's page span must cover every slot of its group, and a running request's pages
  would widen it past its prompts' (a slower call, and a program per such span). Not may_group
  (on a mesh): every slot, in one group."""
  others = [held and i not in slots for i, held in enumerate(occupied)]
  group = slot_group(slots, others, may_group)
  if not may_group or not any(others[i] for i in group):
    return [group]
  groups, rest = [], list(slots)
  while rest:
    a = 1 << (len(rest).bit_length() - 1)
    groups.append(np.asarray(rest[:a], np.int32))
    rest = rest[a:]
  return groups
