"""The device script's reporting and time-boxing: rows printed as markdown tables and appended as
JSON lines, the run's deadline shared out among its sections, and the median timing of one call."""

from __future__ import annotations

import json
import time
from pathlib import Path

import jax
import numpy as np


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


def error_what(e: Exception) -> str:
  """The `what` of a cell that raised: the exception's type and the first line of its message."""
  return f"error: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
