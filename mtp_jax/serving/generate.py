"""`generate`: one fixed batch of prompts decoded to its end, a driver over `DecodeStep`.

The host checks the arguments, sizes the caches, and runs the step: the whole generation as one
on-device `lax.while_loop` (`jit_generate`, then `jit_run` after each resize), or step by step
from Python when it streams. Contiguous caches start small and double between jitted chunks
(one compile per size); paged ones raise the page budget their calls read (`PageRead`) the same way.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
import numpy as np

from mtp_jax import grammar as grammar_lib
from mtp_jax import validate
from mtp_jax.blocks.pages import WHOLE_POOL, PageRead, budget_bucket
from mtp_jax.mtp import MtpModel
from mtp_jax.serving import options
from mtp_jax.serving.options import Paging, StepSettings
from mtp_jax.serving.state import LoopState, SlotSettings
from mtp_jax.serving.step import DecodeStep
from mtp_jax.serving.jit import FlatModel, jit_fits, jit_generate, jit_pages_needed, jit_prefill, jit_run, jit_step
from mtp_jax.target import TargetModel
from mtp_jax.tree import TreeSpec

PROMPT_BUCKET = 32  # prompts are padded to a multiple of this: one compile per bucket
MIN_CAPACITY = 256  # cache rows per sequence to start with (unless fewer will do); doubled as needed


@dataclasses.dataclass
class GenerateOutput:
  """tokens: generated tokens only, per prompt (eos included when hit). stats: see `generate`."""

  tokens: list[list[int]]
  stats: dict


def padded_prompts(prompts: Sequence[np.ndarray], batch_size: int,
                   slots: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
  """(int32[B, T], int32[B]): prompt i left-aligned in row slots[i], T the longest padded to a
  multiple of PROMPT_BUCKET (one compile per bucket); other rows empty."""
  t = -(-max(len(p) for p in prompts) // PROMPT_BUCKET) * PROMPT_BUCKET
  prompts_BxT, lens_B = np.zeros((batch_size, t), np.int32), np.zeros((batch_size,), np.int32)
  for slot, p in zip(slots, prompts):
    prompts_BxT[slot, :len(p)], lens_B[slot] = p, len(p)
  return prompts_BxT, lens_B


def generate(target: TargetModel, proposer: MtpModel | None, prompts: Sequence[Sequence[int]],
             max_new_tokens: int, num_drafts: int | None = None, temperature: float = 0.0,
             top_k: int | None = None, top_p: float | None = None, seed: int = 0,
             eos_token_id: int | None = None, *, max_len: int | None = None,
             relaxed: tuple[int, float] | None = None,
             stream: Callable[[list[list[int]]], None] | None = None,
             grammar: grammar_lib.Grammar | None = None, constrained: Sequence[bool] | None = None,
             draft_masks: str = "per_position", mesh: jax.sharding.Mesh | None = None,
             page_size: int | None = None, num_pages: int | None = None,
             tree: TreeSpec | None = None, acceptance: str = "gumbel") -> GenerateOutput:
  """Speculative decoding with the MTP chain (or plain autoregressive decoding if proposer is None).

  Args:
    prompts: B token lists of any lengths (padded to a multiple of 32 internally).
    max_new_tokens: tokens to generate per prompt (fewer if eos_token_id is produced).
    num_drafts: k, 1..K (default K).
    temperature / top_k / top_p / seed: sampling; temperature 0 is greedy. Prompt i draws with
      the key `sampling.row_key(seed, i)`, its token at output position n from the noise of
      (that key, n), so each prompt's tokens are its own whatever the batch.
    acceptance: how sampled drafts are verified. "gumbel" (default): the drafts share the
      target's noise and a draft is kept when it equals the target's own draw, so the output
      equals plain sampling's (proposer None) with the same seed, for every num_drafts and tree.
      "rejection": lossless speculative sampling, distributed as the target too but with tokens
      that depend on k (more drafts accepted per step when the drafter's distribution is close).
    max_len: fixed cache rows per sequence, at least the longest prompt + max_new_tokens + k + 1.
      By default the caches start at the padded prompt length + max_new_tokens + k + 1 or the
      next power of two >= MIN_CAPACITY that holds the prompt and a step, whichever is smaller,
      and double (recompiling once per size) when a sequence is about to outgrow them: a step
      attends over at most twice the rows the sequences have reached, whatever max_new_tokens is.
    relaxed: (top_n, delta) for LOSSY relaxed acceptance (greedy only; along the paths of a tree).
    stream: called after each step with the tokens each sequence gained (runs the jitted step
      from Python; without it the whole generation is one on-device `lax.while_loop`).
    grammar: a `mtp_jax.grammar.Grammar` every constrained sequence's output must match; needs
      eos_token_id equal to the grammar's. Each emitted token is drawn from the target masked
      with the grammar state before it (greedy output equals constrained greedy decoding without
      a proposer; sampling stays lossless w.r.t. the masked target). A sequence ends with eos
      once its state is DONE or allows nothing else; output cut by max_new_tokens before that
      is an unfinished match.
    constrained: bool per prompt (default all True): False rows decode free of the grammar.
    draft_masks: how drafts are masked, for ablations: "per_position" (each draft with the
      state after the drafts before it), "first" (all with the state after the emitted tokens,
      as the seed proposer did) or "none". Verification masks every position correctly in all
      three, so greedy output is the same; only acceptance changes.
    mesh: a `mtp_jax.sharding.make_mesh` mesh: the loop's target and proposer caches are placed
      with batch on "data" and KV heads on "model" (shard the params with `shard_params`).
    page_size, num_pages: paged KV caches (docs/serving.md): page_size must divide max_len (the
      default max_len is rounded up to a multiple of it); num_pages pages per layer, default
      B * max_len / page_size (as much as the contiguous caches), at least max_len / page_size.
      A sequence refused a page stops early (listed in stats["out_of_pages"]); the others go on.
    tree: a `mtp_jax.tree.TreeSpec`: the chain drafts a tree of depth k = num_drafts (default
      the tree's depth), the target verifies all its nodes in one call with the tree mask.
      Greedy: the longest path that matches the target's argmax is accepted, so the output
      equals plain greedy decoding; sampling: Gumbel acceptance along the tree (children are the
      top-w under the target's noise, the output plain sampling's), or with
      acceptance="rejection" multi-candidate rejection sampling (`verify_tree_sampling`),
      lossless. Grammar masks apply per node, with the state after
      the node's path.
  Returns:
    GenerateOutput. stats: target_calls (forward passes per sequence, prefill included, summed),
    verify_calls, accepted_tokens (emitted drafts), target_tokens (emitted target tokens;
    accepted_tokens + target_tokens == generated_tokens), generated_tokens,
    mean_accepted_length (tokens per verify step: (generated - prefill tokens) / verify_calls),
    acceptance_per_position (k rates: P(draft i accepted | step)), out_of_pages (indices of
    the prompts stopped for lack of a page; always empty when contiguous).
  """
  d = options.decoding(target, proposer, num_drafts=num_drafts, temperature=temperature, top_k=top_k, top_p=top_p,
                       seed=seed, eos_token_id=eos_token_id, relaxed=relaxed, tree=tree, grammar=grammar,
                       draft_masks=draft_masks, acceptance=acceptance)
  prompts = options.check_prompts(prompts, target.cfg.vocab_size)
  b = len(prompts)
  longest = max(len(p) for p in prompts)
  max_new_tokens = validate.integer("max_new_tokens", max_new_tokens, 1,
                                    validate.INT32_MAX - longest - d.num_drafts - 1)
  max_len = None if max_len is None else validate.positive_int("max_len", max_len)
  if stream is not None and not callable(stream):
    raise validate.InvalidType("stream", f"stream must be callable or None, got {type(stream).__name__}")
  gstart_B = np.where(_constrained(grammar, constrained, b), grammar_lib.START, grammar_lib.FREE).astype(np.int32)
  step_rows = d.rows_per_step
  needed = longest + max_new_tokens + step_rows
  if max_len is not None and max_len < needed:
    raise validate.InvalidValue(
        "max_len", f"prompt too long for the cache: the longest prompt ({longest} tokens) + max_new_tokens "
                   f"({max_new_tokens}) + {'k + 1' if tree is None else 'the tree nodes + 1'} needs "
                   f"max_len >= {needed}, got {max_len}")
  prompts_BxT, lens_B = padded_prompts(prompts, b, range(b))
  t = prompts_BxT.shape[1]
  full_len = max_len or t + max_new_tokens + step_rows  # rows that always suffice
  paging, read = None, WHOLE_POOL
  if page_size is None:
    if num_pages is not None:
      raise validate.InvalidValue("num_pages", f"num_pages={num_pages!r} needs page_size")
    capacity = max_len or min(full_len, max(MIN_CAPACITY, 1 << (t + step_rows).bit_length()))
  else:  # paged caches are sized by their pool and never grown: the capacity is the whole max_len
    page_size = validate.positive_int("page_size", page_size)
    full_len = max_len or -(-full_len // page_size) * page_size
    page_size, num_pages = options.paging(full_len, page_size, num_pages, b)
    capacity = full_len
    first = np.minimum(-(-(lens_B + step_rows) // page_size), full_len // page_size)  # the prefill and a step
    paging, read = Paging(page_size, num_pages), PageRead(budget_bucket(int(first.sum()), num_pages))
  step = DecodeStep(StepSettings(
      num_drafts=d.num_drafts, max_new_tokens=max_new_tokens, max_len=capacity, sampled=not d.sampling.greedy,
      acceptance=d.acceptance, relaxed=d.relaxed, tree=tree, draft_masks=draft_masks, mesh=mesh, paging=paging))
  slots = SlotSettings.uniform(b, num_drafts=d.num_drafts, temperature=d.sampling.temperature, top_k=d.sampling.top_k,
                               top_p=d.sampling.top_p, seed=d.seed, eos_token_id=d.eos_token_id)
  models = FlatModel.of(target), FlatModel.of(proposer)  # the jitted calls' arguments, flattened once
  if stream is None:
    s = jit_generate(step, *models, grammar, prompts_BxT, lens_B, gstart_B, slots, b, read)
    while not np.asarray(s.done).all():
      step, read, s = _resize(step, read, s, full_len)
      s = jit_run(step, *models, grammar, s, read)
  else:
    s = jit_prefill(step, *models, grammar, step.init(target, proposer, grammar, b), prompts_BxT,
                    lens_B, np.ones((b,), bool), gstart_B, np.full((b,), max_new_tokens, np.int32), slots)
    seen = np.zeros(b, np.int64)
    while True:
      num_out, out, done = np.asarray(s.num_out), np.asarray(s.out), np.asarray(s.done)
      stream([out[i, seen[i]:num_out[i]].tolist() for i in range(b)])
      seen = num_out
      if done.all():
        break
      if not bool(jit_fits(step, s, read)):
        step, read, s = _resize(step, read, s, full_len)
      s = jit_step(step, *models, grammar, s, read)
  return _output(s, d.num_drafts)


def _constrained(grammar, constrained, batch_size: int) -> np.ndarray:
  """bool[B]: the prompts decoded under the grammar (all by default); checked by name."""
  if grammar is None:
    if constrained is not None:
      raise validate.InvalidValue("constrained", "constrained needs a grammar")
    return np.zeros((batch_size,), bool)
  if constrained is None:
    return np.ones((batch_size,), bool)
  if isinstance(constrained, (str, bytes)) or not isinstance(constrained, (Sequence, np.ndarray)):
    raise validate.InvalidType("constrained", f"constrained must be a list of bools, got {constrained!r}")
  if len(constrained) != batch_size:
    raise validate.InvalidValue(
        "constrained", f"constrained must have one bool per prompt ({batch_size}), got {len(constrained)}")
  return np.array([validate.flag(f"constrained[{i}]", c) for i, c in enumerate(constrained)], bool)


def _resize(step: DecodeStep, read: PageRead, s: LoopState, full_len: int) -> tuple[DecodeStep, PageRead, LoopState]:
  """The step, page read and state with room for the next step: contiguous caches of twice the
  rows (at most full_len), or paged, a read whose budget holds the pages the next step may hold."""
  st = step.settings
  if st.paging is not None:  # paged caches always hold full_len rows: only the budget grows
    budget = budget_bucket(int(jit_pages_needed(step, s, step.rows_next(s))), st.paging.num_pages)
    if budget <= read.budget:
      raise RuntimeError(f"generate: a page budget of {read.budget} pages is full; this is a bug")
    return step, PageRead(budget), s
  if st.max_len >= full_len:  # full_len rows hold every step (generate checks max_len against it)
    raise RuntimeError(f"generate: caches of {st.max_len} rows are full; this is a bug")
  step = step.replace(max_len=min(2 * st.max_len, full_len))
  return step, read, step.resized(s)


def _output(s: LoopState, k: int) -> GenerateOutput:
  num_out, out = np.asarray(s.num_out), np.asarray(s.out)
  tokens = [out[i, :num_out[i]].tolist() for i in range(len(num_out))]
  generated = int(num_out.sum())
  counts = jax.device_get(s.counts)
  verify_calls = int(counts.verify_calls.sum())
  prefill_tokens = len(tokens)
  stats = dict(
      generated_tokens=generated,
      target_calls=int(counts.target_calls.sum()),
      verify_calls=verify_calls,
      accepted_tokens=int(counts.accepted.sum()),
      target_tokens=int(counts.target_tokens.sum()),
      mean_accepted_length=(generated - prefill_tokens) / verify_calls if verify_calls else float("nan"),
      acceptance_per_position=[int(c) / verify_calls if verify_calls else float("nan")
                               for c in counts.accepted_at[:k]],
      out_of_pages=np.flatnonzero(np.asarray(s.out_of_pages)).tolist(),
  )
  return GenerateOutput(tokens=tokens, stats=stats)
