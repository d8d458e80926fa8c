"""`Engine.calibrate`: the step-time cost model of num_drafts="auto", measured before traffic, and
`measured_policy`, which keeps it in a file for later engines (`mtp-jax serve --draft-policy`)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from mtp_jax import validate
from mtp_jax.serving.policy import DraftPolicy
from mtp_jax.serving.step import defers

if TYPE_CHECKING:
  from mtp_jax.serving.engine import Engine


def calibrate(engine: Engine, *, calls: int = 3, prompt_len: int = 16) -> DraftPolicy:
  """At every batch bucket (1, 2, 4, .. max_batch running requests) and every width k = K..0,
  runs synthetic requests (prompt_len tokens) on `engine` until `calls` decode calls that built
  no program were timed into its policy. At 0 < k < K twice: as "auto" requests run it, uncapped
  under the policy held at k (`DraftPolicy.held`; the deeper modules catch up on their rows, or,
  where k defers them (2k < K), their rows wait until one catch-up was charged to k:
  `DraftPolicy.record`), then as requests of num_drafts=k (the deeper modules idle:
  `DraftPolicy.capped_seconds`, which `DraftPolicy.cap` weighs). The acceptance counts and the
  engine's metrics are left as they were (synthetic prompts say nothing about real ones). Needs
  an "auto" engine with nothing running or waiting; returns its `DraftPolicy`."""
  calls = validate.positive_int("calls", calls)
  policy = engine.policy
  if policy is None:
    raise validate.InvalidValue("num_drafts", 'calibrate measures num_drafts="auto": this engine has no DraftPolicy')
  if engine.num_running or engine.num_waiting:
    raise validate.InvalidValue("calibrate", "calibrate runs on an idle engine (requests are running or waiting)")
  cfg = engine.config
  rows = engine.defaults.rows_per_step
  prompt_len = validate.integer("prompt_len", prompt_len, 1, engine.max_len - rows - 1)
  prompt = [i % engine.target.cfg.vocab_size for i in range(prompt_len)]
  new = (calls + 2) * cfg.steps_per_call * rows + cfg.deferred_rows  # rows enough to fill the waiting ones
  acceptance = policy.accepted_at.copy(), policy.proposed_at.copy()
  tally = engine.tally.copy()
  buckets = [1 << i for i in range(engine.max_batch.bit_length()) if 1 << i <= engine.max_batch]
  for bucket in buckets:
    # All `bucket` requests must hold their pages at once, or some would wait and run fewer calls.
    fits = min(engine.max_len, engine.num_pages // bucket * engine.page_size) - prompt_len - rows
    if fits < 1:
      raise validate.InvalidValue("prompt_len", f"{bucket} calibration requests of prompt_len={prompt_len} do not "
                                                f"fit in num_pages={engine.num_pages} pages together")
    full = engine.max_drafts
    for k, held in [(full, False)] + [(k, h) for k in range(full - 1, 0, -1) for h in (True, False)] + [(0, False)]:
      key, table = (k, DraftPolicy.bucket(bucket)), policy.seconds if held or k in (0, full) else policy.capped_seconds
      waits = held and defers(k, full) and cfg.deferred_rows > 0
      policy.held = k if held else None
      ids = [engine.add_request(prompt, min(new, fits), num_drafts="auto" if held else k) for _ in range(bucket)]
      before, charged = len(table.get(key, ())), policy.catch_up_seconds.get(key)
      try:
        while (engine.num_running or engine.num_waiting) and (len(table.get(key, ())) < before + calls or
                                                              waits and policy.catch_up_seconds.get(key) == charged):
          engine.step()
      finally:
        policy.held = None
      for rid in ids:
        engine.cancel(rid)
        engine.forget(rid)
  policy.accepted_at, policy.proposed_at = acceptance
  engine.tally = tally  # the synthetic requests are no traffic: metrics() reads as before them
  return policy


def measured_policy(engine: Engine, path: str | None = None) -> DraftPolicy:
  """Starts an idle num_drafts="auto" engine from a measured cost model: the `DraftPolicy` in the
  JSON file `path` when it exists (measured for the same K), else one measured now with
  `calibrate`, then written to `path` (when given). Returns the engine's policy."""
  if engine.policy is None:
    raise validate.InvalidValue("num_drafts", 'a measured policy serves num_drafts="auto": this engine has none')
  if path is not None and os.path.exists(path):
    with open(path, encoding="utf-8") as f:
      policy = DraftPolicy.from_json(f.read())
    if policy.max_drafts != engine.max_drafts:
      raise validate.InvalidValue("draft_policy", f"{path} was measured for K={policy.max_drafts} drafts, "
                                                  f"the proposer has K={engine.max_drafts}")
    engine.policy = policy
    return policy
  policy = calibrate(engine)
  if path is not None:
    with open(path, "w", encoding="utf-8") as f:
      f.write(policy.to_json())
  return policy
