"""The serving loop: target verify + accept + `after_verify` + `propose` as one jitted step.

Per sequence b the loop keeps `last[b]`, the newest emitted token (not yet run by the target),
and `drafts[b]`, the k drafts that follow it. A step runs the target on [last, d_1..d_k]
(rows L..L+k of its cache), accepts a drafts, emits d_1..d_a and the target's next token, keeps
the target cache rows of [last, d_1..d_a], and hands the chain exactly those a + 1 positions.

With a grammar, `grammar_state[b]` is the state after every emitted token (`last` included).
Verify position i is masked with the state after [emitted, d_1..d_i] (`states_along`), the
state then advances over the accepted drafts and the next token, and the chain drafts from it,
each draft masked with the state after the drafts before it. All of it runs on device.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from mtp_jax import grammar as grammar_lib
from mtp_jax import proposer as prop
from mtp_jax import sharding, validate
from mtp_jax.blocks.paged import budget_bucket, check_paging
from mtp_jax.mtp import MtpModel
from mtp_jax.sampling import sample
from mtp_jax.target import TargetModel, TargetState, compact_target, init_target_state, target_step, trim_target
from mtp_jax import tree as tree_lib
from mtp_jax.tree import DraftTree, TreeSpec, check_tree
from mtp_jax.verify import verify_greedy, verify_relaxed, verify_sampling, verify_tree_greedy, verify_tree_sampling

PROMPT_BUCKET = 32  # prompts are padded to a multiple of this: one compile per bucket
MIN_CAPACITY = 256  # cache rows per sequence to start with (unless fewer will do); doubled as needed
DRAFT_MASKS = ("per_position", "first", "none")


@dataclasses.dataclass
class GenerateOutput:
  """tokens: generated tokens only, per prompt (eos included when hit). stats: see `generate`."""

  tokens: list[list[int]]
  stats: dict


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LoopState:
  """Everything one step carries; all arrays per sequence (B) unless noted."""

  target: TargetState
  proposer: prop.ProposerState | None
  last: jax.Array            # int32[B]
  drafts: jax.Array          # int32[B, k], or the tree's int32[B, N]
  grammar_state: jax.Array | None  # int32[B], after the emitted tokens; None without a grammar
  out: jax.Array             # int32[B, max_new + k + 1], emitted tokens
  num_out: jax.Array         # int32[B]
  done: jax.Array            # bool[B]
  key: jax.Array
  target_calls: jax.Array    # int32[B], prefill included
  verify_calls: jax.Array    # int32[B], decode steps
  accepted: jax.Array        # int32[B], emitted tokens that were drafts
  target_tokens: jax.Array   # int32[B], emitted tokens chosen by the target
  accepted_at: jax.Array     # int32[k], steps whose draft i was accepted (all sequences)
  tree_probs: jax.Array | None = None  # float32[B, M, V]: a sampled tree's draft distributions

  def set(self, **changes) -> "LoopState":
    return dataclasses.replace(self, **changes)


@dataclasses.dataclass(frozen=True)
class _Settings:
  num_drafts: int
  max_new_tokens: int
  temperature: float
  top_k: int | None
  top_p: float | None
  eos_token_id: int | None
  relaxed: tuple[int, float] | None
  max_len: int  # cache rows per sequence now (the capacity); grown between jitted chunks
  draft_masks: str
  mesh: jax.sharding.Mesh | None = None
  page_size: int | None = None
  num_pages: int | None = None
  tree: TreeSpec | None = None
  # Paged: the pages attention reads per call (blocks/paged.py), carried by the states' `Pages`
  # too (`_with_budget` sets both); raised by the host between jitted chunks, as max_len is.
  page_budget: int | None = None


def _rows_per_step(cfg: _Settings) -> int:
  """Target rows a decode step writes: [last, d_1..d_k], or the root and the tree's N nodes."""
  return (cfg.num_drafts if cfg.tree is None else cfg.tree.num_nodes) + 1


def _emit(s: LoopState, new_BxJ, n_emit_B, cfg: _Settings, active_B) -> tuple[LoopState, jax.Array]:
  """Appends new_BxJ[:, :n] to the output, cut at eos and at max_new_tokens; returns (state, n int32[B])."""
  j = new_BxJ.shape[1]
  n = jnp.minimum(n_emit_B, cfg.max_new_tokens - s.num_out)
  hit_eos_B = jnp.zeros_like(active_B)
  if cfg.eos_token_id is not None:
    is_eos = (new_BxJ == cfg.eos_token_id) & (jnp.arange(j)[None] < n[:, None])
    hit_eos_B = active_B & jnp.any(is_eos, axis=1)
    n = jnp.where(hit_eos_B, jnp.argmax(is_eos, axis=1) + 1, n)
  n = jnp.where(active_B, n, 0)
  cols = jnp.where(jnp.arange(j)[None] < n[:, None], s.num_out[:, None] + jnp.arange(j)[None], s.out.shape[1])
  out = s.out.at[jnp.arange(new_BxJ.shape[0])[:, None], cols].set(new_BxJ, mode="drop")
  num_out = s.num_out + n
  done = s.done | (num_out >= cfg.max_new_tokens) | hit_eos_B
  return s.set(out=out, num_out=num_out, done=done), n


def _masked(grammar, logits_BxXxV, state_BxX):
  """Logits float32[B, ..., V] with the tokens the grammar forbids at states int32[B, ...] masked."""
  if grammar is None:
    return logits_BxXxV
  mask = grammar_lib.token_mask(grammar, state_BxX, logits_BxXxV.shape[-1])
  return grammar_lib.apply_mask(logits_BxXxV, mask)


def _draft(proposer, grammar, pstate, hid, tokens, num_new_B, gstate_B, key, cfg: _Settings):
  """propose() with the loop's fixed k, so only the k drafting modules run (catch_up=False); with a
  grammar, drafts are masked as cfg.draft_masks says (an ablation switch)."""
  draft_grammar = None if cfg.draft_masks == "none" else grammar
  drafts, pstate = prop._propose(proposer, pstate, hid, tokens, num_new_B, cfg.num_drafts, key, cfg.temperature,
                                 cfg.top_k, cfg.top_p, draft_grammar, None if draft_grammar is None else gstate_B,
                                 False, cfg.draft_masks == "per_position", catch_up=False, tree=cfg.tree)
  return drafts, pstate


def _with_drafts(s: LoopState, pstate, drafts) -> LoopState:
  """s with the new proposer state and drafts (a chain's int32[B, k], or a DraftTree)."""
  if isinstance(drafts, DraftTree):
    return s.set(proposer=pstate, drafts=drafts.tokens, tree_probs=drafts.probs)
  return s.set(proposer=pstate, drafts=drafts)


def _split(key, cfg: _Settings):
  """(carried key, key for the target's token, key for the drafts); greedy decoding draws nothing,
  so it splits nothing (a split is a threefry loop per step on CPU)."""
  if cfg.temperature == 0:
    return key, None, None
  return tuple(jax.random.split(key, 3))


def _first_token(grammar, logits_BxTxV, lens_B, gstate_B, key, cfg: _Settings):
  """The token after each prompt, int32[B], sampled from the logits of its last row (lens_B - 1)
  under the grammar, and the grammar states int32[B] after it (None without a grammar)."""
  last_B = jnp.maximum(lens_B - 1, 0)
  last_logits = jnp.take_along_axis(logits_BxTxV, last_B[:, None, None], axis=1)[:, 0]
  first_B, _ = sample(_masked(grammar, last_logits, gstate_B), key, temperature=cfg.temperature,
                      top_k=cfg.top_k, top_p=cfg.top_p)
  if grammar is not None:
    gstate_B = grammar_lib.advance(grammar, gstate_B, first_B)
  return first_B, gstate_B


def _start(target, proposer, grammar, prompts_BxT, lens_B, gstate_B, key, cfg: _Settings) -> LoopState:
  b, t = prompts_BxT.shape
  k = cfg.num_drafts
  tstate = _budgeted(init_target_state(target.cfg, b, cfg.max_len, page_size=cfg.page_size,
                                       num_pages=cfg.num_pages), cfg.page_budget)
  if cfg.mesh is not None:
    tstate = sharding.shard_state(tstate, cfg.mesh)
  logits, hid, tstate = target_step(target, tstate, prompts_BxT, lens_B)
  key, k_first, k_draft = _split(key, cfg)
  first_B, gstate_B = _first_token(grammar, logits, lens_B, gstate_B, k_first, cfg)
  one = jnp.ones((b,), jnp.int32)
  s = LoopState(target=tstate, proposer=None, last=first_B, drafts=jnp.zeros((b, _rows_per_step(cfg) - 1), jnp.int32),
                grammar_state=gstate_B,
                out=jnp.zeros((b, _out_width(cfg)), jnp.int32), num_out=jnp.zeros((b,), jnp.int32),
                done=jnp.zeros((b,), bool), key=key, target_calls=one, verify_calls=0 * one,
                accepted=0 * one, target_tokens=one, accepted_at=jnp.zeros((k,), jnp.int32))
  s, _ = _emit(s, first_B[:, None], one, cfg, ~_out_of_pages(tstate, None))
  if proposer is None:
    return _stop_out_of_pages(s)
  # A sampled tree's draft distributions travel in the step's DraftTree, not in the proposer state.
  keep_probs = cfg.temperature > 0 and cfg.tree is None
  pstate = _budgeted(prop.init_state(proposer.cfg, b, cfg.max_len, keep_draft_probs=keep_probs,
                                     page_size=cfg.page_size, num_pages=cfg.num_pages), cfg.page_budget)
  if cfg.mesh is not None:
    pstate = sharding.shard_state(pstate, cfg.mesh)
  # Position j's token is t_{j+1}: the prompt shifted left, with the first generated token at the end.
  tokens = jnp.concatenate([prompts_BxT[:, 1:], prompts_BxT[:, :1]], axis=1)
  tokens = tokens.at[jnp.arange(b), lens_B - 1].set(first_B)
  drafts, pstate = _draft(proposer, grammar, pstate, hid, tokens, lens_B, gstate_B, k_draft, cfg)
  return _stop_out_of_pages(_with_drafts(s, pstate, drafts))


def _budgeted(state, budget: int | None):
  """A target or proposer state whose calls read `budget` pages (unchanged when contiguous)."""
  return state if state.pages is None else state.set(pages=state.pages.with_budget(budget))


def _with_budget(s: LoopState, cfg: _Settings, budget: int) -> tuple[LoopState, _Settings]:
  """s and cfg with the page budget `budget` (a new value compiles the step anew)."""
  s = s.set(target=_budgeted(s.target, budget),
            proposer=None if s.proposer is None else _budgeted(s.proposer, budget))
  return s, dataclasses.replace(cfg, page_budget=budget)


@jax.jit
def _pages_needed(s: LoopState, num_new_B) -> jax.Array:
  """int32[]: pages a call adding num_new_B rows (int32[B]) per slot holds at most, in the target's
  or the proposer's pool (their rows differ by a few), i.e. the page budget it needs."""
  need = s.target.pages.pages_after(s.target.length + num_new_B)
  if s.proposer is not None:
    need = jnp.maximum(need, s.proposer.pages.pages_after(s.proposer.num_pos + num_new_B))
  return need


def _step_rows(s: LoopState, cfg: _Settings) -> jax.Array:
  """int32[B]: rows the next step adds at most per slot (its rows for unfinished ones)."""
  return jnp.where(s.done, 0, _rows_per_step(cfg))


def _out_of_pages(tstate: TargetState, pstate: prop.ProposerState | None) -> jax.Array:
  """bool[B]: sequences refused a page by the target's or the proposer's allocator (never when contiguous)."""
  oom_B = jnp.zeros(tstate.length.shape, bool)
  for st in (tstate, pstate):
    if st is not None and st.pages is not None:
      oom_B = oom_B | st.pages.oom
  return oom_B


def _stop_out_of_pages(s: LoopState) -> LoopState:
  # A sequence refused a page stops; the others go on (its pages and rows are its own).
  return s.set(done=s.done | _out_of_pages(s.target, s.proposer))


def _step(target, proposer, grammar, s: LoopState, cfg: _Settings) -> LoopState:
  k = cfg.num_drafts
  b = s.last.shape[0]
  active_B = ~s.done
  key, k_verify, k_draft = _split(s.key, cfg)
  inp_BxK1 = jnp.concatenate([s.last[:, None], s.drafts], axis=1)  # with a tree: [last, its N nodes]
  old_len = s.target.length
  logits, hid, tstate = target_step(target, s.target, inp_BxK1, jnp.where(active_B, inp_BxK1.shape[1], 0),
                                    cfg.tree)
  active_B = active_B & ~_out_of_pages(tstate, None)  # its logits are meaningless: emit nothing
  if grammar is not None:
    # Position i gives the token after [emitted, d_1..d_i]; a tree node, after [emitted, its path].
    gstates_BxK1 = (grammar_lib.states_along(grammar, s.grammar_state, s.drafts) if cfg.tree is None else
                    tree_lib.node_states(grammar, s.grammar_state, inp_BxK1, cfg.tree))
    mask_BxK1xV = grammar_lib.token_mask(grammar, gstates_BxK1, logits.shape[-1])
    logits = grammar_lib.apply_mask(logits, mask_BxK1xV)
  drafts_BxK = s.drafts
  if proposer is None:
    a_B = jnp.zeros((b,), jnp.int32)
    next_B, _ = sample(logits[:, 0], k_verify, temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p)
  elif cfg.tree is not None:
    if cfg.temperature == 0:
      a_B, next_B, path_BxK1 = verify_tree_greedy(logits, s.drafts, cfg.tree)
    else:
      a_B, next_B, path_BxK1 = verify_tree_sampling(logits, s.drafts, s.tree_probs, k_verify, cfg.tree,
                                                    temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p)
    if grammar is not None:
      gstates_BxK1 = jnp.take_along_axis(gstates_BxK1, path_BxK1, axis=1)
    drafts_BxK = jnp.take_along_axis(inp_BxK1, path_BxK1[:, 1:], axis=1)  # the path's tokens act as drafts
    hid = jnp.take_along_axis(hid, path_BxK1[..., None], axis=1)
    # The target keeps the root and the accepted path: its nodes' rows move into place.
    tstate = compact_target(tstate, old_len, path_BxK1, jnp.where(active_B, a_B, 0))
  elif cfg.relaxed is not None:
    a_B, next_B = verify_relaxed(logits, s.drafts, top_n=cfg.relaxed[0], delta=cfg.relaxed[1])
    if grammar is not None:
      # A draft of probability 0 passes the relaxed test when the top-1 probability is <= delta.
      allowed_BxK = jnp.take_along_axis(mask_BxK1xV[:, :k], s.drafts[..., None], axis=-1)[..., 0]
      a_B = jnp.minimum(a_B, jnp.sum(jnp.cumprod(allowed_BxK, axis=1), axis=1).astype(jnp.int32))
      next_B = jnp.argmax(jnp.take_along_axis(logits, a_B[:, None, None], axis=1)[:, 0], axis=-1).astype(jnp.int32)
  elif cfg.temperature == 0:
    a_B, next_B = verify_greedy(logits, s.drafts)
  else:
    a_B, next_B = verify_sampling(logits, s.drafts, s.proposer.draft_probs[:, :k], k_verify,
                                  temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p)
  a_B = jnp.where(active_B, a_B, 0)
  new_BxK1 = jnp.concatenate([drafts_BxK, jnp.zeros((b, 1), jnp.int32)], axis=1)
  new_BxK1 = new_BxK1.at[jnp.arange(b), a_B].set(next_B)
  s2, n_B = _emit(s, new_BxK1, a_B + 1, cfg, active_B)
  # The target keeps its rows for [last, d_1..d_a]; the rest were rejected.
  tstate = trim_target(tstate, old_len + jnp.where(active_B, a_B + 1, 0))
  s2 = s2.set(target=tstate, last=jnp.where(active_B, next_B, s.last), key=key,
              target_calls=s.target_calls + active_B, verify_calls=s.verify_calls + active_B,
              accepted=s.accepted + jnp.minimum(a_B, n_B), target_tokens=s.target_tokens + (n_B == a_B + 1),
              accepted_at=s.accepted_at + jnp.sum(active_B[:, None] & (jnp.arange(k)[None] < a_B[:, None]), axis=0))
  if grammar is not None:
    after_drafts_B = jnp.take_along_axis(gstates_BxK1, a_B[:, None], axis=1)[:, 0]
    s2 = s2.set(grammar_state=jnp.where(active_B, grammar_lib.advance(grammar, after_drafts_B, next_B),
                                        s.grammar_state))
  if proposer is None:
    return _stop_out_of_pages(s2)
  pstate = prop._after_verify(s.proposer, a_B)
  num_new = jnp.where(s2.done, 0, a_B + 1)
  drafts, pstate = _draft(proposer, grammar, pstate, hid, new_BxK1, num_new, s2.grammar_state, k_draft, cfg)
  return _stop_out_of_pages(_with_drafts(s2, pstate, drafts))


def _out_width(cfg: _Settings) -> int:
  # A sequence emits at most one token per cache row past its prompt, plus a step's k + 1.
  return min(cfg.max_new_tokens, cfg.max_len) + cfg.num_drafts + 1


def _fits(s: LoopState, cfg: _Settings) -> jax.Array:
  """bool[]: every unfinished sequence has room for one more step (its rows) in the caches,
  and paged, the pages the step may hold are within the page budget."""
  fits = jnp.all(s.done | (s.target.length + _rows_per_step(cfg) <= cfg.max_len))
  if cfg.page_size is not None:
    fits &= _pages_needed(s, _step_rows(s, cfg)) <= cfg.page_budget
  return fits


def _run(target, proposer, grammar, s: LoopState, cfg: _Settings) -> LoopState:
  """Steps until every sequence is done or one would outgrow the caches or the page budget (then
  the host grows them)."""
  return jax.lax.while_loop(lambda s: ~jnp.all(s.done) & _fits(s, cfg),
                            lambda s: _step(target, proposer, grammar, s, cfg), s)


@functools.partial(jax.jit, static_argnames=("cfg",))
def _generate_on_device(target, proposer, grammar, prompts_BxT, lens_B, gstate_B, key,
                        cfg: _Settings) -> LoopState:
  return _run(target, proposer, grammar, _start(target, proposer, grammar, prompts_BxT, lens_B, gstate_B, key, cfg),
              cfg)


_run_jit = jax.jit(_run, static_argnames=("cfg",), donate_argnames=("s",))


def _grow(s: LoopState, cfg: _Settings, full_len: int) -> tuple[LoopState, _Settings]:
  """s with room for the next step. Contiguous: caches of twice the rows (at most full_len) and a
  wider output buffer; cached rows and tokens are kept. Every cache array holds rows on axis 1
  (see blocks/cache.py). Paged: the page budget of the pages the next step may hold."""
  if cfg.page_size is not None:  # paged caches always hold full_len rows: only the budget grows
    budget = budget_bucket(int(_pages_needed(s, _step_rows(s, cfg))), cfg.num_pages)
    if budget <= cfg.page_budget:
      raise RuntimeError(f"generate: a page budget of {cfg.page_budget} pages is full; this is a bug")
    return _with_budget(s, cfg, budget)
  if cfg.max_len >= full_len:  # full_len rows hold every step (generate checks max_len against it)
    raise RuntimeError(f"generate: caches of {cfg.max_len} rows are full; this is a bug")
  new = dataclasses.replace(cfg, max_len=min(2 * cfg.max_len, full_len))

  def pad(x, width):
    return jnp.pad(x, [(0, 0), (0, width - x.shape[1])] + [(0, 0)] * (x.ndim - 2))

  def grow_kv(kv):
    return jax.tree.map(lambda x: pad(x, new.max_len), kv)

  tstate = s.target.set(kv=grow_kv(s.target.kv))
  pstate = None if s.proposer is None else s.proposer.set(kv=grow_kv(s.proposer.kv))
  if cfg.mesh is not None:
    tstate = sharding.shard_state(tstate, cfg.mesh)
    pstate = None if pstate is None else sharding.shard_state(pstate, cfg.mesh)
  return s.set(target=tstate, proposer=pstate, out=pad(s.out, _out_width(new))), new


_start_jit = jax.jit(_start, static_argnames=("cfg",))
_step_jit = jax.jit(_step, static_argnames=("cfg",), donate_argnames=("s",))


def _check_prompts(prompts, v: int) -> list[np.ndarray]:
  """Each prompt as int64[len], checked: a non-empty sequence of non-empty int token lists in 0..V-1."""
  if isinstance(prompts, (str, bytes)) or not isinstance(prompts, (Sequence, np.ndarray)):
    raise validate.InvalidType("prompts", f"prompts must be a list of token-id lists, got {type(prompts).__name__}")
  if len(prompts) == 0:
    raise validate.InvalidValue("prompts", "prompts must be a non-empty list of token lists")
  validate.integer("len(prompts)", len(prompts), 1)
  checked = []
  for i, p in enumerate(prompts):
    name = f"prompts[{i}]"
    if isinstance(p, (str, bytes)) or not isinstance(p, (Sequence, np.ndarray)):
      raise validate.InvalidType(name, f"{name} must be a list of token ids, got {type(p).__name__}")
    if len(p) == 0:
      raise validate.InvalidValue(name, f"{name} is empty; every prompt needs at least one token")
    arr = np.asarray(p)
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer) or arr.dtype == np.bool_:
      raise validate.InvalidType(name, f"{name} must be a flat list of int token ids, got {arr.dtype} "
                                       f"values of shape {list(arr.shape)}")
    bad = arr[(arr < 0) | (arr >= v)]
    if bad.size:
      raise validate.InvalidValue(
          name, f"{name} has token id(s) {bad[:5].tolist()} outside 0..vocab_size-1={v - 1}")
    checked.append(arr.astype(np.int64))
  return checked


def _validate(target, proposer, prompts, max_new_tokens, num_drafts, temperature, top_k, top_p, seed,
              eos_token_id, max_len, relaxed, stream, grammar, constrained, draft_masks, tree=None, page_size=None,
              mesh=None) -> dict:
  """Every argument of `generate` checked and normalised; errors name the argument and its limits."""
  validate.instance("target", target, TargetModel, "a TargetModel")
  v = target.cfg.vocab_size
  if proposer is None:
    if num_drafts is not None:
      raise validate.InvalidValue("num_drafts", f"num_drafts needs a proposer (plain decoding drafts nothing), "
                                                f"got {num_drafts!r}")
    k = 0
  else:
    validate.instance("proposer", proposer, MtpModel, "an MtpModel or None")
    if proposer.cfg.vocab_size != v:
      raise validate.InvalidValue(
          "proposer", f"vocab mismatch: target vocab_size={v}, proposer vocab_size={proposer.cfg.vocab_size}")
    if proposer.cfg.hidden_size != target.cfg.hidden_size:
      raise validate.InvalidValue("proposer", f"hidden size mismatch: target hidden_size={target.cfg.hidden_size}, "
                                              f"proposer hidden_size={proposer.cfg.hidden_size}")
    k_max = proposer.cfg.num_depths
    if tree is not None and num_drafts is None:
      num_drafts = check_tree(tree, max_depth=k_max).depth
    k = k_max if num_drafts is None else validate.integer("num_drafts", num_drafts, 1, k_max)
  prompts = _check_prompts(prompts, v)
  temperature, top_k, top_p = validate.sampling(temperature, top_k, top_p)
  if tree is not None:
    if proposer is None:
      raise validate.InvalidValue("tree", "tree drafts need a proposer")
    check_tree(tree, num_drafts=k)
    if relaxed is not None:
      raise validate.InvalidValue("tree", "tree verification is exact greedy: pass relaxed=None with a tree")
    if page_size is not None or mesh is not None:
      raise validate.InvalidValue("tree", "tree drafts move the accepted path's rows in contiguous, unsharded "
                                          "caches: pass page_size=None and mesh=None with a tree")
  longest = max(len(p) for p in prompts)
  max_new_tokens = validate.integer("max_new_tokens", max_new_tokens, 1, validate.INT32_MAX - longest - k - 1)
  seed = validate.integer("seed", seed, 0, 2**32 - 1)  # jax.random.key keeps the low 32 bits
  eos_token_id = validate.optional_int("eos_token_id", eos_token_id, 0, v - 1)
  max_len = None if max_len is None else validate.positive_int("max_len", max_len)
  if relaxed is not None:
    if not isinstance(relaxed, (tuple, list)) or len(relaxed) != 2:
      raise validate.InvalidType("relaxed", f"relaxed must be a (top_n, delta) pair, got {relaxed!r}")
    if temperature != 0:
      raise validate.InvalidValue("relaxed", "relaxed acceptance is a greedy option; use temperature=0")
    relaxed = (validate.positive_int("relaxed[0]", relaxed[0], v), validate.real("relaxed[1]", relaxed[1], 0.0, 1.0))
  if stream is not None and not callable(stream):
    raise validate.InvalidType("stream", f"stream must be callable or None, got {type(stream).__name__}")
  validate.one_of("draft_masks", draft_masks, DRAFT_MASKS)
  checked = dict(prompts=prompts, k=k, temperature=temperature, top_k=top_k, top_p=top_p,
                 max_new_tokens=max_new_tokens, seed=seed, eos_token_id=eos_token_id, max_len=max_len,
                 relaxed=relaxed, constrained=None)
  if grammar is None:
    if constrained is not None:
      raise validate.InvalidValue("constrained", "constrained needs a grammar")
    return checked
  validate.instance("grammar", grammar, grammar_lib.Grammar, "a mtp_jax.grammar.Grammar")
  if eos_token_id is None:
    raise validate.InvalidValue("eos_token_id", "a grammar ends sequences with eos: pass eos_token_id "
                                                f"(the grammar's is {grammar.eos_token_id})")
  if eos_token_id != grammar.eos_token_id:
    raise validate.InvalidValue("eos_token_id", f"eos_token_id={eos_token_id} differs from the grammar's "
                                                f"eos_token_id={grammar.eos_token_id}")
  if grammar.vocab_size > v:
    raise validate.InvalidValue(
        "grammar", f"grammar has {grammar.vocab_size} tokens, more than the target's vocab_size={v}")
  if constrained is not None:
    if isinstance(constrained, (str, bytes)) or not isinstance(constrained, (Sequence, np.ndarray)):
      raise validate.InvalidType("constrained", f"constrained must be a list of bools, got {constrained!r}")
    if len(constrained) != len(prompts):
      raise validate.InvalidValue(
          "constrained", f"constrained must have one bool per prompt ({len(prompts)}), got {len(constrained)}")
    checked["constrained"] = [validate.flag(f"constrained[{i}]", c) for i, c in enumerate(constrained)]
  return checked


def _paging(max_len, default_max_len, page_size, num_pages, batch_size, mesh):
  """(max_len, num_pages) for generate: a default max_len rounded up to whole pages, and by
  default as many pages as the contiguous caches hold."""
  if page_size is None:
    if num_pages is not None:
      raise validate.InvalidValue("num_pages", f"num_pages={num_pages!r} needs page_size")
    return max_len or default_max_len, None
  if mesh is not None:
    raise validate.InvalidValue("page_size", "page_size and mesh: paged caches are not sharded yet; "
                                "pass one of them")
  page_size = validate.positive_int("page_size", page_size)
  max_len = max_len or -(-default_max_len // page_size) * page_size
  num_pages = batch_size * (max_len // page_size) if num_pages is None else num_pages
  check_paging(max_len, page_size, num_pages)
  return max_len, num_pages


def generate(target: TargetModel, proposer: MtpModel | None, prompts: Sequence[Sequence[int]],
             max_new_tokens: int, num_drafts: int | None = None, temperature: float = 0.0,
             top_k: int | None = None, top_p: float | None = None, seed: int = 0,
             eos_token_id: int | None = None, *, max_len: int | None = None,
             relaxed: tuple[int, float] | None = None,
             stream: Callable[[list[list[int]]], None] | None = None,
             grammar: grammar_lib.Grammar | None = None, constrained: Sequence[bool] | None = None,
             draft_masks: str = "per_position", mesh: jax.sharding.Mesh | None = None,
             page_size: int | None = None, num_pages: int | None = None,
             tree: TreeSpec | None = None) -> GenerateOutput:
  """Speculative decoding with the MTP chain (or plain autoregressive decoding if proposer is None).

  Args:
    prompts: B token lists of any lengths (padded to a multiple of 32 internally).
    max_new_tokens: tokens to generate per prompt (fewer if eos_token_id is produced).
    num_drafts: k, 1..K (default K).
    temperature / top_k / top_p / seed: sampling; temperature 0 is greedy. With temperature > 0,
      verification is lossless speculative sampling.
    max_len: fixed cache rows per sequence, at least the longest prompt + max_new_tokens + k + 1.
      By default the caches start at the padded prompt length + max_new_tokens + k + 1 or the
      next power of two >= MIN_CAPACITY that holds the prompt and a step, whichever is smaller,
      and double (recompiling once per size) when a sequence is about to outgrow them: a step
      attends over at most twice the rows the sequences have reached, whatever max_new_tokens is.
    relaxed: (top_n, delta) for LOSSY relaxed acceptance (greedy only).
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
    tree: a `mtp_jax.tree.TreeSpec` (contiguous, unsharded caches; not with relaxed): the chain
      drafts a tree of depth k = num_drafts (default the tree's depth), the target verifies all
      its nodes in one call with the tree mask. Greedy: the longest path that matches the
      target's argmax is accepted, so the output equals plain greedy decoding; sampling:
      multi-candidate rejection sampling (`verify_tree_sampling`), lossless. Grammar masks
      apply per node, with the state after the node's path.
  Returns:
    GenerateOutput. stats: target_calls (forward passes per sequence, prefill included, summed),
    verify_calls, accepted_tokens (emitted drafts), target_tokens (emitted target tokens;
    accepted_tokens + target_tokens == generated_tokens), generated_tokens,
    mean_accepted_length (tokens per verify step: (generated - prefill tokens) / verify_calls),
    acceptance_per_position (k rates: P(draft i accepted | step)), out_of_pages (indices of
    the prompts stopped for lack of a page; always empty when contiguous).
  """
  a = _validate(target, proposer, prompts, max_new_tokens, num_drafts, temperature, top_k, top_p, seed,
                eos_token_id, max_len, relaxed, stream, grammar, constrained, draft_masks, tree, page_size, mesh)
  prompts, k, max_new_tokens, max_len, constrained = (a["prompts"], a["k"], a["max_new_tokens"], a["max_len"],
                                                      a["constrained"])
  lens = np.array([len(p) for p in prompts], np.int32)
  t = -(-int(lens.max()) // PROMPT_BUCKET) * PROMPT_BUCKET
  # Padding rows of the prompt are never written to the caches, so only real rows count.
  step_rows = (k if tree is None else tree.num_nodes) + 1
  needed = int(lens.max()) + max_new_tokens + step_rows
  if max_len is not None and max_len < needed:
    raise validate.InvalidValue(
        "max_len", f"prompt too long for the cache: the longest prompt ({lens.max()} tokens) + max_new_tokens "
                   f"({max_new_tokens}) + {'k + 1' if tree is None else 'the tree nodes + 1'} needs "
                   f"max_len >= {needed}, got {max_len}")
  prompts_BxT = np.zeros((len(prompts), t), np.int32)
  for i, p in enumerate(prompts):
    prompts_BxT[i, :len(p)] = p
  full_len = max_len or t + max_new_tokens + step_rows  # rows that always suffice
  if page_size is None and num_pages is None:
    capacity = max_len or min(full_len, max(MIN_CAPACITY, 1 << (t + step_rows).bit_length()))
  else:  # paged caches are sized by their pool and never grown: the capacity is the whole max_len
    full_len, num_pages = _paging(max_len, full_len, page_size, num_pages, len(prompts), mesh)
    capacity = full_len
  budget = None
  if page_size is not None:  # the prefill and the first step; raised as sequences grow
    first = np.minimum(-(-(lens + step_rows) // page_size), full_len // page_size)
    budget = budget_bucket(int(first.sum()), num_pages)
  cfg = _Settings(k, max_new_tokens, a["temperature"], a["top_k"], a["top_p"], a["eos_token_id"], a["relaxed"],
                  capacity, draft_masks, mesh, page_size, num_pages, tree, budget)
  gstate_B = None
  if grammar is not None:
    gstate_B = grammar_lib.init_grammar_state(
        len(prompts), None if constrained is None else jnp.asarray(constrained, bool))
  key = jax.random.key(a["seed"])
  if stream is None:
    s = _generate_on_device(target, proposer, grammar, prompts_BxT, lens, gstate_B, key, cfg)
    while not np.asarray(s.done).all():
      s, cfg = _grow(s, cfg, full_len)
      s = _run_jit(target, proposer, grammar, s, cfg)
  else:
    s = _start_jit(target, proposer, grammar, prompts_BxT, lens, gstate_B, key, cfg)
    seen = np.zeros(len(prompts), np.int64)
    while True:
      num_out, out, done = np.asarray(s.num_out), np.asarray(s.out), np.asarray(s.done)
      stream([out[i, seen[i]:num_out[i]].tolist() for i in range(len(prompts))])
      seen = num_out
      if done.all():
        break
      if not bool(_fits(s, cfg)):
        s, cfg = _grow(s, cfg, full_len)
      s = _step_jit(target, proposer, grammar, s, cfg)
  return _output(s, k)


def _output(s: LoopState, k: int) -> GenerateOutput:
  num_out, out = np.asarray(s.num_out), np.asarray(s.out)
  tokens = [out[i, :num_out[i]].tolist() for i in range(len(num_out))]
  generated = int(num_out.sum())
  verify_calls = int(np.asarray(s.verify_calls).sum())
  prefill_tokens = len(tokens)
  stats = dict(
      generated_tokens=generated,
      target_calls=int(np.asarray(s.target_calls).sum()),
      verify_calls=verify_calls,
      accepted_tokens=int(np.asarray(s.accepted).sum()),
      target_tokens=int(np.asarray(s.target_tokens).sum()),
      mean_accepted_length=(generated - prefill_tokens) / verify_calls if verify_calls else float("nan"),
      acceptance_per_position=[int(c) / verify_calls if verify_calls else float("nan")
                               for c in np.asarray(s.accepted_at)[:k]],
      out_of_pages=np.flatnonzero(np.asarray(_out_of_pages(s.target, s.proposer))).tolist(),
  )
  return GenerateOutput(tokens=tokens, stats=stats)
