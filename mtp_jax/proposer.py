"""`propose`: the chain caught up on the newly verified positions and its drafts, one unrolled program.

`propose` checks its arguments (one validation layer for every entry point: mtp_jax/validate.py)
and calls `propose_step`, the jitted loop over the K depths that a serving step, which checked
its inputs once, calls directly. The state and the functions that only move it (`init_state`,
`after_verify`, `reset_slots`) are in proposer_state.py, with the layout and the validity rule.

With `num_drafts = k < K` and `catch_up=True`, depths k..K-1 still run, but only over rows whose
inputs are all verified (catch-up), so a later call with a larger k finds them within their
window. A caller that keeps k fixed passes `catch_up=False`: only the k drafting depths run, and
the static `num_live` of the state records that depths k..K-1 fell behind, so a later call that
would need them (more drafts, or a catch-up) is refused instead of drafting from stale rows.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

from mtp_jax import grammar as grammar_lib
from mtp_jax import validate
from mtp_jax import tree as tree_lib
from mtp_jax.blocks import PageRead, TreeRows
from mtp_jax.blocks.pages import WHOLE_POOL
from mtp_jax.mtp import MtpModel
# The state and its pure functions, re-exported: `mtp_jax.proposer` is where callers find them all.
from mtp_jax.proposer_state import (ProposerState, after_verify, check_state, init_state, reset_slots,  # noqa: F401
                                    trim_lengths)
from mtp_jax.sampling import Draws, RowSampling, row_probs
from mtp_jax.tree import DraftTree, TreeSpec, check_tree


def _check_propose_args(params, state, hiddens, tokens, num_new, num_drafts, catch_up):
  """(hiddens, tokens, num_new, num_drafts) with their types and shapes checked."""
  validate.instance("params", params, MtpModel, "an MtpModel")
  cfg = params.cfg
  check_state(state, cfg)
  num_drafts = validate.integer("num_drafts", num_drafts, 1, cfg.num_depths)
  run = cfg.num_depths if catch_up else num_drafts
  if run > state.num_live:
    raise validate.InvalidValue(
        "num_drafts", f"this call needs modules 0..{run - 1} current, but a propose with catch_up=False left "
        f"only modules 0..{state.num_live - 1} live (num_live={state.num_live}); use "
        f"num_drafts <= {state.num_live} with catch_up=False, or start from init_state")
  b, d = state.batch_size, cfg.hidden_width
  hiddens = validate.array("hiddens", hiddens, (b, None, d), kind="float", dims=f"[B={b}, T, D={d}]")
  t = hiddens.shape[1]
  tokens = validate.array("tokens", tokens, (b, t), kind="int", dims=f"[B={b}, T={t}]")
  num_new = validate.array("num_new", num_new, (b,), kind="int", dims=f"[B={b}]")
  return hiddens, tokens, num_new, num_drafts


def _propose_value_errors(state, hiddens, tokens, num_new, vocab_size, grammar, grammar_state):
  """(condition that must hold, argument, message) over values; shared by eager and checkify checks."""
  t = tokens.shape[1]
  end = state.num_pos + num_new
  real_BxT = jnp.arange(t)[None] < num_new[:, None]
  errors = [
      (jnp.all((num_new >= 0) & (num_new <= t)), "num_new", f"num_new must be in 0..T={t}"),
      (jnp.all(end <= state.max_len), "num_new",
       f"num_new: a sequence would outgrow max_len={state.max_len} (num_pos + num_new > max_len)"),
      (jnp.all((tokens >= 0) & (tokens < vocab_size) | ~real_BxT), "tokens",
       f"tokens must be in 0..vocab_size-1={vocab_size - 1}"),
      # A NaN / inf hidden would sit in the chain's caches and tails for the rest of the sequence.
      (jnp.all(jnp.isfinite(hiddens) | ~real_BxT[..., None]), "hiddens",
       "hiddens must be finite at the num_new real rows (NaN or inf found)"),
  ]
  if grammar is not None:
    errors.append((jnp.all(grammar_state < grammar.num_states), "grammar_state",
                   f"grammar_state must be < num_states={grammar.num_states} (negative: FREE)"))
  return errors


def propose(params: MtpModel, state: ProposerState, hiddens, tokens, num_new, num_drafts: int, *,
            key=None, temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
            grammar=None, grammar_state=None, checked: bool = False, catch_up: bool = True,
            tree: TreeSpec | None = None, grammar_per_position: bool = True, read: PageRead = WHOLE_POOL):
  """Catches the chain up on the newly verified positions and drafts `num_drafts` tokens.

  Args:
    params: MtpModel; its cfg.num_depths = K depths run.
    state: ProposerState from `init_state` (or a previous call).
    hiddens: float[B, T, D] target hiddens h0_j (D = cfg.hidden_width) at the new verified positions j = num_pos..,
      left-aligned, padded to a static T.
    tokens: int32[B, T]; tokens[b, u] = t_{j+1} for the same positions (the verified token that
      follows each position; the last real one is the newest verified "bonus" token).
    num_new: int32[B], 0..T, real entries per sequence (the prompt length on the first call,
      a + 1 after a verification that accepted a drafts).
    num_drafts: static k, 1..K.
    key: PRNG key, needed when temperature > 0.
    temperature / top_k / top_p: static sampling settings; temperature 0 drafts greedily.
    grammar, grammar_state: optional `mtp_jax.grammar.Grammar` and int32[B] states after the
      verified tokens (FREE rows are unconstrained); draft i is masked with the state reached
      after drafts 0..i-1, so the drafts are a valid continuation and, when sampling, the kept
      draft_probs are the masked distributions the drafts were drawn from.
    checked: add `checkify` checks on values (wrap the caller in `checkify.checkify`).
    catch_up: static. True runs every module (modules k..K-1 over their verified rows only), so
      the next call may use any k. False runs only the k drafting modules, for callers that keep
      k fixed (`generate`): the state's num_live becomes k, and later calls must keep
      num_drafts <= k with catch_up=False.
    tree: static `mtp_jax.tree.TreeSpec` with depth num_drafts: draft a tree instead of a chain.
      Each node of depth d - 1 gets w_d children from depth d's distribution after the node's
      path: its top-w_d tokens when greedy, w_d independent draws when sampling (the tree keeps
      the distributions, DraftTree.probs); with a grammar each node is masked with the state
      after its path. Depth d runs over the nodes of depths 1..d as extra rows that see the
      verified rows and their own ancestors and are never cached, so the state holds verified
      rows only and `after_verify` works as after a chain.
    grammar_per_position: static; False masks every draft with grammar_state itself (the state
      after the verified tokens) instead of the state after the drafts before it, as the seed
      proposer did (an ablation: `generate(draft_masks="first")`).
    read: static `mtp_jax.blocks.PageRead`, how a paged state's call reads its pages (a page
      budget or span; default the whole pool); contiguous states ignore it.
  Returns:
    drafts int32[B, k] (a `DraftTree` with tokens int32[B, N] when tree is given), new
    ProposerState. Drafts of a sequence with no positions are unspecified.

  Pure: inputs are not modified. Under a caller's `jax.jit` with `donate_argnames="state"` the
  caches are updated in place (see docs/proposer.md).
  """
  hiddens, tokens, num_new, num_drafts = _check_propose_args(params, state, hiddens, tokens, num_new, num_drafts,
                                                             catch_up)
  temperature, top_k, top_p = validate.sampling(temperature, top_k, top_p)
  if temperature > 0 and key is None:
    raise validate.InvalidValue("key", "key is required when temperature > 0")
  if (grammar is None) != (grammar_state is None):
    raise validate.InvalidValue("grammar_state", "grammar and grammar_state must be given together")
  if grammar is not None:
    grammar_state = _check_grammar(grammar, grammar_state, state.batch_size, params.cfg.vocab_size)
  checked = validate.flag("checked", checked)
  catch_up = validate.flag("catch_up", catch_up)
  grammar_per_position = validate.flag("grammar_per_position", grammar_per_position)
  if tree is not None:
    check_tree(tree, num_drafts=num_drafts, vocab_size=params.cfg.vocab_size)
  hiddens, tokens, num_new = jnp.asarray(hiddens), jnp.asarray(tokens), jnp.asarray(num_new)
  if validate.is_concrete(state.num_pos, hiddens, tokens, num_new, grammar_state):
    validate.raise_failed(_propose_value_errors(state, hiddens, tokens, num_new, params.cfg.vocab_size, grammar,
                                                grammar_state),
                          num_pos=state.num_pos, num_new=num_new)
  validate.instance("read", read, PageRead, "a mtp_jax.blocks.PageRead")
  settings = ProposeSettings(num_drafts, checked, grammar_per_position, catch_up, tree, tree_draws="independent",
                             read=read)
  draws = None
  if temperature > 0:  # every row with these settings, each its own key split from key
    b = state.batch_size
    draws = Draws(RowSampling.uniform(b, temperature, top_k, top_p), jax.random.split(key, b),
                  jnp.zeros((b,), jnp.int32))
  return propose_step(params, state, hiddens, tokens.astype(jnp.int32), num_new.astype(jnp.int32), settings,
                      draws, grammar, grammar_state)


@dataclasses.dataclass(frozen=True)
class ProposeSettings:
  """The static settings of one propose call (see `propose` for each): hashable, so a jit takes
  it as one static argument and compiles once per value.

  num_drafts: k, 1..K; checked: add checkify checks on values; grammar_per_position: mask draft
  i with the grammar state after drafts 0..i-1 (False: with the state after the verified tokens,
  the seed's way); catch_up: run every depth (False: only the k drafting ones); tree: draft this
  TreeSpec; tree_draws: how a sampled tree's children are drawn, "top" (the top-w under the
  noise of their position: Gumbel-top-k, for Gumbel acceptance) or "independent" (w draws with
  replacement, for rejection sampling); read: how a paged state's call reads its pages (`PageRead`).
  """

  num_drafts: int
  checked: bool = False
  grammar_per_position: bool = True
  catch_up: bool = True
  tree: TreeSpec | None = None
  tree_draws: str = "top"
  read: PageRead = WHOLE_POOL


def _check_grammar(grammar, grammar_state, batch_size, vocab_size):
  """grammar_state as int32[B], its type and shape checked (its values with the other values)."""
  validate.instance("grammar", grammar, grammar_lib.Grammar, "a mtp_jax.grammar.Grammar")
  if grammar.vocab_size > vocab_size:
    raise validate.InvalidValue(
        "grammar", f"grammar has {grammar.vocab_size} tokens, more than the model's vocab_size={vocab_size}")
  grammar_state = validate.array("grammar_state", grammar_state, (batch_size,), kind="int", dims=f"[B={batch_size}]")
  return jnp.asarray(grammar_state).astype(jnp.int32)


def _gather_rows(x_BxTx, idx_BxW):
  return jnp.take_along_axis(x_BxTx, idx_BxW.reshape(idx_BxW.shape + (1,) * (x_BxTx.ndim - 2)), axis=1)


@validate.jit_when_concrete(static_argnums=5)
def propose_step(params: MtpModel, state: ProposerState, hiddens_BxTxD, tokens_BxT, num_new_B,
                 settings: ProposeSettings, draws: Draws | None = None, grammar=None, grammar_state_B=None):
  """`propose` without its argument checks, for a serving step that checked its inputs once:
  hiddens float[B, T, D], tokens int32[B, T], num_new int32[B], the static settings, grammar and
  grammar_state int32[B] as `propose` takes them. Returns what `propose` returns.
  draws: how each row draws (`sampling.Draws`; None: every row greedy): draft i of row b is its
  draw at output position draws.positions[b] + i, a tree's depth-i children its top-w under that
  position's noise, or w independent draws (settings.tree_draws).
  Jitted when called with concrete arrays; inside a caller's jit, traced into it."""
  num_drafts = settings.num_drafts
  grammar_per_position, catch_up, tree = settings.grammar_per_position, settings.catch_up, settings.tree
  # grammar_per_position=False masks every draft with grammar_state_B, as the seed proposer
  # did; the serving loop's ablation (generate's draft_masks="first") uses it.
  # catch_up=False runs modules 0..k-1 only; the deeper modules' rows, lengths and rings are
  # left as they were (stale), which num_live records.
  cfg = params.cfg
  if settings.checked:
    validate.checkify_checks(_propose_value_errors(state, hiddens_BxTxD, tokens_BxT, num_new_B, cfg.vocab_size,
                                                   grammar, grammar_state_B))
  b, t, _ = hiddens_BxTxD.shape
  ring = cfg.num_depths
  b_idx = jnp.arange(b)[:, None]
  num_pos_B = state.num_pos
  # A propose over unsettled drafts treats them as all rejected (after_verify with a = 0).
  pending_B = state.num_drafted > 0
  lengths_KxB = jnp.where(pending_B[None], trim_lengths(state.lengths, num_pos_B, jnp.zeros_like(num_pos_B)),
                          state.lengths)
  new_num_pos_B = num_pos_B + num_new_B
  # Every row this call writes is below new_num_pos_B (paged, a slot refused pages writes nothing).
  caches, kv = state.caches.open(new_num_pos_B, settings.read)
  kv, tail = list(kv), list(state.tail)
  new_lengths, drafts, probs = [], [], []
  prev_h_BxWxD, prev_start_B = hiddens_BxTxD.astype(cfg.jnp_dtype), num_pos_B
  g_state_B = grammar_state_B
  num_run = cfg.num_depths if catch_up else num_drafts
  if tree is not None:
    nodes_tok_BxN1 = jnp.zeros((b, tree.num_nodes + 1), jnp.int32)
    nodes_h = None  # depth i - 1's handed-on hiddens at the tree's nodes
    tree_probs = []
  for i in range(num_run):
    # A tree runs every depth over verified rows only; its nodes are extra rows (_tree_depth).
    drafting = i < num_drafts and tree is None
    w = t + i
    start_B = lengths_KxB[i]
    rows_BxW = start_B[:, None] + jnp.arange(w, dtype=jnp.int32)[None]
    limit_B = new_num_pos_B if drafting else new_num_pos_B - i
    valid_BxW = rows_BxW < limit_B[:, None]

    # Row j reads t_{j+i+1}: a verified token of this call, or a draft of an earlier module.
    u_BxW = rows_BxW + i - num_pos_B[:, None]
    tok_BxW = _gather_rows(tokens_BxT, jnp.clip(u_BxW, 0, t - 1))
    if i > 0 and drafts:
      d_BxW = _gather_rows(jnp.stack(drafts, axis=1), jnp.clip(u_BxW - num_new_B[:, None], 0, i - 1))
      tok_BxW = jnp.where(u_BxW < num_new_B[:, None], tok_BxW, d_BxW)

    # Row j reads h^i_j: from the previous depth in this call, or from its ring if that depth
    # computed row j in an earlier call (the old ring: this call's writes may alias its slots).
    idx_BxW = rows_BxW - prev_start_B[:, None]
    h_BxWxD = _gather_rows(prev_h_BxWxD, jnp.clip(idx_BxW, 0, prev_h_BxWxD.shape[1] - 1))
    if i > 0:
      ring_h = _gather_rows(state.tail[i - 1], rows_BxW % ring)
      h_BxWxD = jnp.where((idx_BxW < 0)[..., None], ring_h, h_BxWxD)

    emb_BxWxD = params.embed(i, tok_BxW, rows_BxW)
    out_BxWxD, kv[i] = params.module(i)(emb_BxWxD, h_BxWxD, rows_BxW, valid_BxW, kv[i], rope_offset=i + 1)
    next_h_BxWxD = params.next_hidden(i, out_BxWxD)
    if i < num_run - 1:  # the ring is read only by the next module
      keep_BxW = valid_BxW & (rows_BxW >= limit_B[:, None] - ring)
      slot_BxW = jnp.where(keep_BxW, rows_BxW % ring, ring)
      tail[i] = tail[i].at[b_idx, slot_BxW].set(next_h_BxWxD.astype(tail[i].dtype), mode="drop")
    new_lengths.append(jnp.maximum(start_B, limit_B))

    if drafting:
      last_B = jnp.clip(new_num_pos_B - 1 - start_B, 0, w - 1)
      logits_BxV = params.logits(i, _gather_rows(out_BxWxD, last_B[:, None])[:, 0])
      if grammar is not None:
        logits_BxV = grammar_lib.apply_mask(
            logits_BxV, grammar_lib.token_mask(grammar, g_state_B, logits_BxV.shape[-1]))
      if draws is None:
        d_B = jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32)
        q_BxV = jax.nn.one_hot(d_B, logits_BxV.shape[-1], dtype=jnp.float32)
      else:
        d_B, q_BxV = draws.at(i).sample(logits_BxV), row_probs(logits_BxV, draws.rows)
      drafts.append(d_B)
      probs.append(q_BxV)
      if grammar is not None and grammar_per_position:
        g_state_B = grammar_lib.advance(grammar, g_state_B, d_B)
    if tree is not None and i < num_drafts:
      nodes_h, out_BxNxD = _tree_depth(params, i, tree, kv[i], out_BxWxD, next_h_BxWxD, start_B, new_num_pos_B,
                                       nodes_h, nodes_tok_BxN1)
      logits_BxNxV = params.logits(i, out_BxNxD)
      if grammar is not None:
        # Each node is masked with the state after its path (the "first" ablation: the root's state).
        if grammar_per_position:
          g_BxN = tree_lib.node_states(grammar, grammar_state_B, nodes_tok_BxN1, tree,
                                       upto=i)[:, tree.starts[i]:tree.starts[i + 1]]
        else:
          g_BxN = jnp.broadcast_to(grammar_state_B[:, None], logits_BxNxV.shape[:2])
        logits_BxNxV = grammar_lib.apply_mask(logits_BxNxV, grammar_lib.token_mask(grammar, g_BxN, cfg.vocab_size))
      kids_BxC, q_BxNxV = _tree_children(logits_BxNxV, tree.widths[i], None if draws is None else draws.at(i),
                                         settings.tree_draws)
      nodes_tok_BxN1 = nodes_tok_BxN1.at[:, tree.starts[i + 1]:tree.starts[i + 2]].set(kids_BxC)
      tree_probs.append(q_BxNxV)
    prev_h_BxWxD, prev_start_B = next_h_BxWxD, start_B

  draft_probs = state.draft_probs
  if draft_probs is not None and tree is None and num_drafts:  # a tree's distributions travel in its DraftTree
    draft_probs = draft_probs.at[:, :num_drafts].set(jnp.stack(probs, axis=1))
  new_state = state.set(caches=caches.close(kv), tail=tuple(tail),
                        lengths=jnp.concatenate([jnp.stack(new_lengths), lengths_KxB[num_run:]]),
                        num_pos=new_num_pos_B, num_drafted=jnp.full((b,), num_drafts, jnp.int32),
                        draft_probs=draft_probs, num_live=num_run)
  if tree is not None:
    probs = None if draws is None else jnp.concatenate(tree_probs, axis=1)
    return DraftTree.of(tree, nodes_tok_BxN1[:, 1:], probs), new_state
  # num_drafts 0 (a serving step that verifies none, catch_up=True): every module only catches up.
  return jnp.stack(drafts, axis=1) if drafts else jnp.zeros((b, 0), jnp.int32), new_state


def _tree_depth(params, i, tree, cache, out_BxWxD, next_h_BxWxD, start_B, new_num_pos_B, prev_nodes_h, nodes_tok_BxN1):
  """Depth i of a tree propose, after it ran its verified rows (out / next_h of its window).

  Depth i's node of tree depth d sits at row P - i + d (P = new_num_pos - 1, the newest
  position; the root is depth i's last verified row P - i) and reads the token of that node
  and the hidden depth i - 1 handed on at the node's parent. Those rows see the cache below
  the root's row plus their ancestors, and are not written: they used drafts.
  prev_nodes_h: dtype[B, M, D], depth i - 1's handed-on hiddens at tree nodes 0..M-1.
  Returns (depth i's handed-on hiddens at nodes 0..M'-1, its outputs dtype[B, N_i, D] at the
  tree's depth-i nodes, whose logits give their children).
  """
  b, w, _ = out_BxWxD.shape
  root_row_B = new_num_pos_B - 1 - i
  at_root = lambda x: _gather_rows(x, jnp.clip(root_row_B - start_B, 0, w - 1)[:, None])
  node_out, node_h = at_root(out_BxWxD), at_root(next_h_BxWxD)
  if i > 0:
    nodes = np.arange(1, tree.starts[i + 1])  # tree depths 1..i
    rows_BxM = root_row_B[:, None] + jnp.asarray(tree.depths[nodes])[None]
    emb = params.embed(i, nodes_tok_BxN1[:, nodes], rows_BxM)
    h_in = prev_nodes_h[:, tree.parents[nodes]]
    rows = TreeRows(base_B=root_row_B + 1, visible_TxT=tree.visible[1:, 1:][nodes - 1][:, nodes - 1])
    # Rows before position 0 do not exist (a sequence shorter than the chain is deep).
    out_BxMxD, _ = params.module(i)(emb, h_in, rows_BxM, rows_BxM >= 0, cache, rope_offset=i + 1, tree=rows)
    node_out = jnp.concatenate([node_out, out_BxMxD], axis=1)
    node_h = jnp.concatenate([node_h, params.next_hidden(i, out_BxMxD)], axis=1)
  return node_h, node_out[:, tree.starts[i]:tree.starts[i + 1]]


def _tree_children(logits_BxNxV, width, draws: Draws | None, tree_draws: str):
  """(children int32[B, N * width], parent-major, and the draft distributions float32[B, N, V] or
  None when greedy): the top-width tokens of each node, greedy or under the draws' noise at their
  position ("top"), or width independent draws from it ("independent")."""
  b, n, v = logits_BxNxV.shape
  if draws is None:
    return jax.lax.top_k(logits_BxNxV, width)[1].reshape(b, -1).astype(jnp.int32), None
  q_BxNxV = row_probs(logits_BxNxV, draws.rows)
  if tree_draws == "independent":
    kids = draws.sample_many(logits_BxNxV, width)
  else:
    kids = jax.lax.top_k(draws.scores(logits_BxNxV, np.zeros(n, np.int32)), width)[1]
  return kids.reshape(b, -1).astype(jnp.int32), q_BxNxV


def checked(fn):
  """`fn` (`propose`, `after_verify` or `target_step`) with value checks, functionalised by `checkify`.

  The wrapped function returns (error, outputs) and works under `jax.jit`; call
  `error.throw()` outside jit to raise `checkify.JaxRuntimeError` naming the argument and
  the limit that failed. Static arguments (num_drafts, temperature, ...) go as keywords.
  """
  def wrapper(*args, **static_kwargs):
    return checkify.checkify(lambda *a: fn(*a, checked=True, **static_kwargs))(*args)
  return functools.wraps(fn)(wrapper)
