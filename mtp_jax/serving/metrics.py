"""Serving metrics: latency samples kept on the host and the Prometheus text format.

`Engine.metrics()` returns a flat dict of numbers (counters, gauges and quantiles, named as
below); `prometheus_text` renders such a dict for a `/metrics` endpoint. Nothing here touches
the device.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import math

import numpy as np

QUANTILES = (0.5, 0.9, 0.99)
# A list metric's label and the label of its first entry (others: `position`, from 1).
LIST_LABELS = {"steps_at_width": ("width", 0)}

# name -> (Prometheus type, help); names ending in _seconds_p50 etc. are quantiles of a summary.
DESCRIPTIONS = {
    "requests_running": ("gauge", "Requests decoding in a slot."),
    "requests_waiting": ("gauge", "Requests queued for a slot."),
    "requests_recorded": ("gauge", "Request records the engine holds (live ones and ended ones not forgotten)."),
    "requests_finished_total": ("counter", "Requests that ended with all their tokens or eos."),
    "requests_cancelled_total": ("counter", "Requests cancelled or past their deadline."),
    "requests_out_of_pages_total": ("counter", "Requests stopped by the page allocator."),
    "tokens_generated_total": ("counter", "Tokens emitted to requests."),
    "verify_steps_total": ("counter", "Slot-steps of target verification (one per running request per step)."),
    "drafts_proposed_total": ("counter", "Drafts verified (a step's width, capped by the request's num_drafts)."),
    "drafts_proposed_at": ("counter", "Verify steps that verified a draft at this position."),
    "drafts_accepted_total": ("counter", "Drafts accepted."),
    "drafts_accepted_at": ("counter", "Verify steps whose draft at this position was accepted."),
    "verify_width": ("gauge", "Drafts the last step verified (num_drafts=\"auto\" follows the load)."),
    "mean_accepted_length": ("gauge", "Tokens per verify step (accepted drafts + 1)."),
    "pages_in_use": ("gauge", "Pages held in the target's pool."),
    "pages_total": ("gauge", "Pages in the target's pool."),
    "cache_bytes": ("gauge", "Bytes of the target's and the proposer's KV caches."),
    "steps_total": ("counter", "Engine.step() calls that ran the device (each up to steps_per_call decode steps)."),
    "steps_at_width": ("counter", "Such calls at each verify width (drafts a step verified, 0..K)."),
    "step_seconds_mean": ("gauge", "Mean wall time of such a call (host round trip included)."),
    "ttft_seconds": ("summary", "Time from add_request to the first token."),
    "itl_seconds": ("summary", "Time between a request's tokens (a step's tokens share its gap)."),
    "request_acceptance": ("summary", "Drafts accepted over drafts verified, per ended request that verified any."),
}


class Samples:
  """The most recent `limit` values of a latency, for quantiles."""

  def __init__(self, limit: int = 10_000):
    self.values: collections.deque[float] = collections.deque(maxlen=limit)

  def add(self, value: float, count: int = 1) -> None:
    self.values.extend([value] * count)

  def quantiles(self, name: str) -> dict[str, float]:
    """{name_p50: .., name_p90: .., name_p99: ..}; NaN while there are no samples."""
    if not self.values:
      return {f"{name}_p{round(q * 100)}": math.nan for q in QUANTILES}
    vals = np.quantile(np.asarray(self.values), QUANTILES)
    return {f"{name}_p{round(q * 100)}": float(v) for q, v in zip(QUANTILES, vals)}


@dataclasses.dataclass
class Tally:
  """An engine's host-side counters, kept as requests end so forgotten requests still count.

  ended: ended requests by status; accepted_at / proposed_at int64[K]: verify steps whose draft i
  was accepted / verified, as last read from the device (cumulative); at_width int64[K + 1]: the
  calls (`called`) that verified each width; acceptance: each ended request's drafts accepted over
  drafts verified (`request_ended`).
  """

  max_drafts: int
  ttft: Samples = dataclasses.field(default_factory=Samples)
  itl: Samples = dataclasses.field(default_factory=Samples)
  acceptance: Samples = dataclasses.field(default_factory=Samples)
  calls: int = 0
  call_seconds: float = 0.0
  verify_steps: int = 0
  tokens: int = 0
  ended: collections.Counter = dataclasses.field(default_factory=collections.Counter)
  accepted_at: np.ndarray | None = None
  proposed_at: np.ndarray | None = None
  at_width: np.ndarray | None = None

  def __post_init__(self):
    if self.accepted_at is None:
      self.accepted_at = np.zeros((self.max_drafts,), np.int64)
    if self.proposed_at is None:
      self.proposed_at = np.zeros((self.max_drafts,), np.int64)
    if self.at_width is None:
      self.at_width = np.zeros((self.max_drafts + 1,), np.int64)

  def copy(self) -> "Tally":
    """A deep copy (a snapshot to restore: `Engine.calibrate` leaves the metrics as they were)."""
    return copy.deepcopy(self)

  def called(self, width: int, seconds: float) -> None:
    """A call that ran the device took `seconds` (host round trip included), verifying `width` drafts a step."""
    self.calls += 1
    self.call_seconds += seconds
    self.at_width[width] += 1

  def request_ended(self, status: str, drafts_verified: int, drafts_accepted: int) -> None:
    """A request ended with `status` after drafts_verified drafts were verified, drafts_accepted accepted."""
    self.ended[status] += 1
    if drafts_verified:
      self.acceptance.add(drafts_accepted / drafts_verified)

  def tokens_arrived(self, count: int, now: float, arrived_at: float, last_token_at: float | None) -> None:
    """count tokens of one request came at `now`: its first ones (last_token_at None) add a TTFT
    sample and arrive together (ITL 0); later ones share the gap since its last token."""
    self.tokens += count
    if last_token_at is None:
      self.ttft.add(now - arrived_at)
      self.itl.add(0.0, count - 1)
    else:
      self.itl.add((now - last_token_at) / count, count)

  def as_metrics(self) -> dict:
    """The counters' part of `Engine.metrics()` (names as in DESCRIPTIONS)."""
    accepted = int(self.accepted_at.sum())
    return dict(
        requests_finished_total=self.ended["finished"],
        requests_cancelled_total=self.ended["cancelled"] + self.ended["timed_out"],
        requests_out_of_pages_total=self.ended["out_of_pages"], tokens_generated_total=self.tokens,
        verify_steps_total=self.verify_steps, drafts_proposed_total=int(self.proposed_at.sum()),
        drafts_proposed_at=self.proposed_at.tolist(), drafts_accepted_total=accepted,
        drafts_accepted_at=self.accepted_at.tolist(),
        mean_accepted_length=(accepted / self.verify_steps + 1) if self.verify_steps else math.nan,
        steps_total=self.calls, steps_at_width=self.at_width.tolist(),
        step_seconds_mean=self.call_seconds / self.calls if self.calls else math.nan,
        **self.ttft.quantiles("ttft_seconds"), **self.itl.quantiles("itl_seconds"),
        **self.acceptance.quantiles("request_acceptance"))


def prometheus_text(metrics: dict, *, prefix: str = "mtp_jax_") -> str:
  """The Prometheus text exposition format (version 0.0.4) of an `Engine.metrics()` dict.

  A list becomes one labelled sample per entry: `position` from 1 (`drafts_accepted_at`), `width`
  from 0 (`steps_at_width`); quantiles `X_p50` become a summary `X{quantile="0.5"}`. NaN is written as NaN.
  """
  lines = []
  done = set()
  for key, value in metrics.items():
    base = key.rsplit("_p", 1)[0] if key.rsplit("_p", 1)[-1].isdigit() else key
    if base in done:
      continue
    kind, help_text = DESCRIPTIONS.get(base, ("gauge", base.replace("_", " ") + "."))
    name = prefix + base
    lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
    if kind == "summary":
      for q in QUANTILES:
        lines.append(f'{name}{{quantile="{q}"}} {_number(metrics[f"{base}_p{round(q * 100)}"])}')
    elif isinstance(value, (list, tuple)):
      label, first = LIST_LABELS.get(base, ("position", 1))
      lines += [f'{name}{{{label}="{i + first}"}} {_number(v)}' for i, v in enumerate(value)]
    else:
      lines.append(f"{name} {_number(value)}")
    done.add(base)
  return "\n".join(lines) + "\n"


def _number(value) -> str:
  value = float(value)
  if math.isnan(value):
    return "NaN"
  return repr(int(value)) if value.is_integer() and abs(value) < 2**53 else repr(value)
