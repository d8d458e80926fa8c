"""The Engine's host-side request records: their checks, their errors, and the per-slot settings
they become on admission."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np

from mtp_jax import grammar as grammar_lib
from mtp_jax import validate
from mtp_jax.sampling import RowSampling, row_key
from mtp_jax.serving.state import EOS_PER_SLOT, SlotSettings


class QueueFull(RuntimeError):
  """add_request on an engine whose waiting queue holds max_waiting requests (a server answers 429 / 503)."""


@dataclasses.dataclass
class Request:
  """One request's host-side record.

  status: "waiting", "running", "finished", "cancelled", "timed_out" (past its deadline_s) or
  "out_of_pages" (stopped by the device allocator; admission reserves pages, so only an engine
  built too small sees it).
  """

  id: int
  prompt: list[int]
  max_new_tokens: int
  grammar: grammar_lib.Grammar | None = None
  temperature: float = 0.0
  top_k: int | None = None
  top_p: float | None = None
  seed: int | None = None
  num_drafts: int | str = 0
  eos_token_ids: tuple[int, ...] = ()
  tokens: list[int] = dataclasses.field(default_factory=list)
  status: str = "waiting"
  slot: int | None = None
  pages: int = 0  # pages reserved in each pool while running
  prefilled: int = 0  # prompt tokens written by earlier parts (Engine(prefill_chunk=))
  # False: an "auto" request admitted where drafts do not pay (DraftPolicy.admits_drafting), or
  # stopped since, its own drafts not paying (DraftPolicy.keeps_drafting).
  drafting: bool = True
  probe: bool = False  # admitted drafting as a probe where drafts did not pay (DraftPolicy.admits_drafting)
  cap: int | None = None  # an "auto" request's draft cap, set at admission (DraftPolicy.cap; K: none)
  verify_calls: int = 0
  drafts_verified: int = 0
  drafts_accepted: int = 0
  deadline_s: float | None = None
  arrived_at: float = 0.0
  last_token_at: float | None = None
  first_token_at: float | None = None
  finished_at: float | None = None

  def draft_cap(self, max_drafts: int) -> int:
    """The most drafts a step verifies for it: its num_drafts; "auto": its cap (K before
    admission), 0 once it does not draft."""
    if self.num_drafts != "auto":
      return self.num_drafts
    return (max_drafts if self.cap is None else self.cap) if self.drafting else 0

  @property
  def stats(self) -> dict:
    """accepted_length: tokens per verify step (after the first token); acceptance: drafts
    accepted over drafts verified (NaN before any was verified); ttft_s: time to first token from
    add_request; tokens_per_s: generated tokens over the request's whole time; drafting: False for
    an "auto" request admitted where drafts did not pay (it ran no module) or whose own drafts
    stopped paying (it ran none since)."""
    n = len(self.tokens)
    end = self.finished_at or time.perf_counter()
    return dict(prompt_tokens=len(self.prompt), generated_tokens=n, verify_calls=self.verify_calls,
                accepted_length=(n - 1) / self.verify_calls if self.verify_calls else float("nan"),
                drafts_verified=self.drafts_verified, drafts_accepted=self.drafts_accepted,
                acceptance=self.drafts_accepted / self.drafts_verified if self.drafts_verified else float("nan"),
                ttft_s=None if self.first_token_at is None else self.first_token_at - self.arrived_at,
                tokens_per_s=n / (end - self.arrived_at) if n else 0.0, drafting=self.drafting)


def check_grammar(grammar, constrained, default: grammar_lib.Grammar | None, vocab_size: int,
                  engine_eos: int | None) -> grammar_lib.Grammar | None:
  """A request's grammar (its own, else the engine's `default`; None when constrained is False),
  checked by name: it fits the vocabulary and ends with the engine's grammars' eos (engine_eos,
  None before the first grammar)."""
  constrained = None if constrained is None else validate.flag("constrained", constrained)
  if grammar is not None:
    validate.instance("grammar", grammar, grammar_lib.Grammar, "a mtp_jax.grammar.Grammar")
  grammar = grammar if grammar is not None else default
  if constrained is False:
    return None
  if constrained and grammar is None:
    raise validate.InvalidValue("constrained", "constrained=True needs a grammar: pass grammar= here or to Engine")
  if grammar is None:
    return None
  if grammar.vocab_size > vocab_size:
    raise validate.InvalidValue("grammar", f"grammar has {grammar.vocab_size} tokens, more than the target's "
                                           f"vocab_size={vocab_size}")
  eos = grammar.eos_token_id if engine_eos is None else engine_eos
  if grammar.eos_token_id != eos:
    raise validate.InvalidValue("grammar", f"grammar's eos_token_id={grammar.eos_token_id} differs from this "
                                           f"engine's (eos_token_id={eos}): one engine's grammars share one")
  return grammar


def check_eos(eos_token_ids, grammar: grammar_lib.Grammar | None, default: tuple[int, ...],
              vocab_size: int) -> tuple[int, ...]:
  """A request's distinct end tokens (its own, else `default`, and its grammar's), at most EOS_PER_SLOT."""
  if eos_token_ids is None:
    eos = default
  else:
    if isinstance(eos_token_ids, (str, bytes)) or not isinstance(eos_token_ids, (Sequence, np.ndarray)):
      raise validate.InvalidType("eos_token_ids", "eos_token_ids must be a list of token ids, got "
                                                  f"{type(eos_token_ids).__name__}")
    eos = tuple(validate.integer(f"eos_token_ids[{i}]", t, 0, vocab_size - 1) for i, t in enumerate(eos_token_ids))
  if grammar is not None and grammar.eos_token_id not in eos:
    eos += (grammar.eos_token_id,)  # a grammar's sequences end with its eos
  if len(set(eos)) > EOS_PER_SLOT:
    raise validate.InvalidValue("eos_token_ids", f"at most {EOS_PER_SLOT} end tokens per request (the "
                                                 f"grammar's included), got {len(set(eos))}")
  return tuple(dict.fromkeys(eos))


def slot_settings(admitted: list[Request], a: int, *, vocab_size: int, max_drafts: int, seed: int) -> SlotSettings:
  """The admitted requests' settings, in rows 0..len(admitted)-1 of a (the other rows are not
  used). A request's key: row_key(its seed), else row_key(the engine's seed, its id)."""
  temperature, top_k = np.zeros((a,), np.float32), np.zeros((a,), np.int32)
  top_p, caps = np.ones((a,), np.float32), np.zeros((a,), np.int32)
  eos = np.full((a, EOS_PER_SLOT), -1, np.int32)
  keys = [row_key(seed)] * a
  for i, r in enumerate(admitted):
    temperature[i], top_k[i] = r.temperature, min(r.top_k or 0, vocab_size)
    top_p[i] = 1.0 if r.top_p is None else r.top_p
    caps[i] = r.draft_cap(max_drafts)
    eos[i, :len(r.eos_token_ids)] = r.eos_token_ids
    keys[i] = row_key(r.seed) if r.seed is not None else row_key(seed, r.id)
  return SlotSettings(RowSampling(jnp.asarray(temperature), jnp.asarray(top_k), jnp.asarray(top_p)),
                      jnp.stack(keys), jnp.asarray(caps), jnp.asarray(eos))
