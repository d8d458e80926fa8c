"""Verification of k drafts against the target's k + 1 distributions; pure, batched, jittable.

Sampled rows have two rules: Gumbel acceptance (`verify_gumbel`, `verify_tree_gumbel`: the drafts
were drawn with the noise the target's tokens are drawn with, and a draft is kept when it equals
the target's draw, so the output is plain sampling's with that key, whatever was drafted) and
lossless rejection sampling (`verify_sampling` / `verify_rows`, `verify_tree_sampling` /
`verify_tree_rows`: the maximal coupling, with more accepted drafts per step, but tokens that
depend on the number of drafts verified).

Each rule returns (num_accepted int32[B] in 0..k, next_token int32[B]): the sequence grows by
drafts[:, :a] followed by next_token (the target's correction or its bonus token). The tree rule
also returns the accepted path, whose nodes' tokens play the drafts' part.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from mtp_jax import validate
from mtp_jax.sampling import Draws, RowSampling, row_probs
from mtp_jax.tree import TreeSpec, check_tree


def _first_rejection(accept_BxK: jax.Array) -> jax.Array:
  """Length of the all-True prefix of each row: int32[B]."""
  return jnp.sum(jnp.cumprod(accept_BxK.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)


def _at(x_BxKx, a_B):
  return jnp.take_along_axis(x_BxKx, a_B[:, None, None], axis=1)[:, 0]


def _check(logits_BxK1xV, drafts_BxK, draft_probs_BxKxV=None):
  """(logits, drafts, draft_probs or None) as jax arrays, their dtypes and shapes checked, and their
  values when concrete."""
  logits_BxK1xV = validate.array("logits", logits_BxK1xV, (None, None, None), kind="float", dims="[B, k + 1, V]")
  b, k1, v = logits_BxK1xV.shape
  drafts_BxK = validate.array("drafts", drafts_BxK, (b, k1 - 1), kind="int", dims=f"[B={b}, k={k1 - 1}]")
  if draft_probs_BxKxV is not None:
    draft_probs_BxKxV = validate.array("draft_probs", draft_probs_BxKxV, (b, k1 - 1, v), kind="float",
                                       dims=f"[B={b}, k={k1 - 1}, V={v}]")
  _check_values(v, logits=logits_BxK1xV, drafts=drafts_BxK, draft_probs=draft_probs_BxKxV)
  return (jnp.asarray(logits_BxK1xV), jnp.asarray(drafts_BxK),
          None if draft_probs_BxKxV is None else jnp.asarray(draft_probs_BxKxV))


def _check_values(vocab_size, *, logits, drafts, draft_probs=None, drafts_name="drafts"):
  """Eager calls only (traced values are the caller's to check): a NaN logit would be argmax's token 0,
  a draft id outside the vocabulary a gather past its end, a draft_probs row that is no distribution
  a biased acceptance test."""
  if not validate.is_concrete(logits, drafts, draft_probs):
    return
  validate.finite_logits("logits", logits)
  validate.token_ids(drafts_name, drafts, vocab_size)
  if draft_probs is not None:
    validate.distributions("draft_probs", draft_probs)


def _residual(r_BxV, q_BxV):
  """norm(max(0, r - q)): what is left of distribution r once a draw from q was rejected. Where
  nothing is left (r == q, so rejection had probability 0) r itself: a guard against rounding."""
  res_BxV = jnp.maximum(r_BxV - q_BxV, 0.0)
  mass = jnp.sum(res_BxV, axis=-1, keepdims=True)
  return jnp.where(mass > 0, res_BxV / jnp.where(mass > 0, mass, 1.0), r_BxV)


def verify_greedy(logits_BxK1xV: jax.Array, drafts_BxK: jax.Array):
  """Accepts the longest prefix of drafts equal to the target's argmax; next token is the argmax after it.

  logits_BxK1xV: float32[B, k + 1, V] target logits at [last token, d_1..d_k]; drafts_BxK: int32[B, k].
  Called eagerly, NaN or +inf logits and drafts outside 0..V-1 are refused (as in every rule here).
  """
  logits_BxK1xV, drafts_BxK, _ = _check(logits_BxK1xV, drafts_BxK)
  greedy_BxK1 = jnp.argmax(logits_BxK1xV, axis=-1).astype(jnp.int32)
  a_B = _first_rejection(drafts_BxK == greedy_BxK1[:, :-1])
  return a_B, jnp.take_along_axis(greedy_BxK1, a_B[:, None], axis=1)[:, 0]


def verify_sampling(logits_BxK1xV, drafts_BxK, draft_probs_BxKxV, key, *, temperature: float,
                    top_k: int | None = None, top_p: float | None = None):
  """Lossless speculative sampling (Leviathan et al. 2023; Chen et al. 2023).

  Draft x_i is accepted with probability min(1, p_i(x_i) / q_i(x_i)); at the first rejection the
  next token is drawn from norm(max(0, p_i - q_i)); if all k are accepted, from p_k. p is the target's
  filtered distribution, q the one the drafts were drawn from (draft_probs_BxKxV: float32[B, k, V]).
  The output is distributed exactly as sampling from p alone. temperature > 0 (verify_greedy is
  the temperature-0 rule). Called eagerly, every draft_probs row must be a distribution: finite,
  >= 0, summing to 1 within validate.PROB_ATOL.
  """
  _positive_temperature(temperature, "verify_sampling")
  logits_BxK1xV, drafts_BxK, draft_probs_BxKxV = _check(logits_BxK1xV, drafts_BxK, draft_probs_BxKxV)
  if key is None:
    raise validate.InvalidValue("key", "verify_sampling needs a PRNG key")
  b = drafts_BxK.shape[0]
  return verify_rows(logits_BxK1xV, drafts_BxK, draft_probs_BxKxV, jax.random.split(key, b),
                     RowSampling.uniform(b, *validate.sampling(temperature, top_k, top_p)))


def verify_rows(logits_BxK1xV, drafts_BxK, draft_probs_BxKxV, keys_B, rows: RowSampling, num_drafts_B=None):
  """`verify_sampling` with each row's own settings, key and draft count (one program for any mix).

  Args:
    logits_BxK1xV: float32[B, k + 1, V]; drafts_BxK: int32[B, k]; draft_probs_BxKxV: float32[B, k, V],
      the distributions the drafts were drawn from (one-hot for greedy rows).
    keys_B: a PRNG key per row; rows: `RowSampling` (temperature 0: greedy).
    num_drafts_B: int32[B] in 0..k (default k): row b verifies only its first num_drafts_B[b]
      drafts and draws its next token from the target's distribution after them.
  Returns (num_accepted int32[B], next_token int32[B]).

  A greedy row's distributions are one-hot, so acceptance is "draft == argmax" and the next token the
  argmax: exactly `verify_greedy`. A row's draws come from its own key, one per draft position
  (fold_in), so its tokens do not depend on its neighbours or on k beyond its num_drafts_B.
  """
  logits_BxK1xV, drafts_BxK, draft_probs_BxKxV = _check(logits_BxK1xV, drafts_BxK, draft_probs_BxKxV)
  b, k = drafts_BxK.shape
  cap_B = jnp.full((b,), k, jnp.int32) if num_drafts_B is None else jnp.asarray(num_drafts_B, jnp.int32)
  p_BxK1xV = row_probs(logits_BxK1xV, rows)
  p_d = jnp.take_along_axis(p_BxK1xV[:, :k], drafts_BxK[..., None], axis=-1)[..., 0]
  q_d = jnp.take_along_axis(draft_probs_BxKxV, drafts_BxK[..., None], axis=-1)[..., 0]
  u_BxK = jax.vmap(lambda key: jax.vmap(lambda i: jax.random.uniform(jax.random.fold_in(key, i)))(jnp.arange(k)))(
      jax.vmap(lambda key: jax.random.fold_in(key, 0))(keys_B)) if k else jnp.zeros((b, 0))
  in_cap_BxK = jnp.arange(k)[None] < cap_B[:, None]
  a_B = _first_rejection((u_BxK * q_d < p_d) & in_cap_BxK)
  # Past a row's cap nothing was drafted: the next token comes from p itself (q = 0 there).
  q_pad = jnp.concatenate([draft_probs_BxKxV * in_cap_BxK[..., None], jnp.zeros_like(p_BxK1xV[:, :1])], axis=1)
  residual_BxV = _residual(_at(p_BxK1xV, a_B), _at(q_pad, a_B))
  next_B = jax.vmap(lambda key, r: jax.random.categorical(jax.random.fold_in(key, 1), jnp.log(r)))(keys_B, residual_BxV)
  return a_B, next_B.astype(jnp.int32)


def verify_gumbel(logits_BxK1xV, drafts_BxK, draws: Draws | None, num_drafts_B=None):
  """Gumbel acceptance: the target's token at each position is the argmax of its perturbed scores
  (`Draws.scores`: log p + the row's noise at that output position), and a draft is accepted while
  it equals that token. The next token is the target's at the first mismatch (or after the last
  draft), so every emitted token is the one plain sampling with the same key draws at its
  position: the output does not depend on the drafts, their number or the neighbours. Drafts
  drawn with the same noise (`Draws.sample` on the NOISE_TARGET stream) match whenever both
  distributions pick the same token under it. A greedy row is `verify_greedy`.

  Args:
    logits_BxK1xV: float32[B, k + 1, V] target logits at [last token, d_1..d_k]; drafts_BxK: int32[B, k].
    draws: `Draws` of the target stream whose positions are the output positions of d_1 (the
      token after `last`); None: every row greedy.
    num_drafts_B: int32[B] in 0..k (default k): drafts row b verifies.
  Returns (num_accepted int32[B], next_token int32[B]).
  """
  logits_BxK1xV, drafts_BxK, _ = _check(logits_BxK1xV, drafts_BxK)
  b, k = drafts_BxK.shape
  scores = logits_BxK1xV if draws is None else draws.scores(logits_BxK1xV)
  target_BxK1 = jnp.argmax(scores, axis=-1).astype(jnp.int32)
  ok_BxK = drafts_BxK == target_BxK1[:, :k]
  if num_drafts_B is not None:
    ok_BxK &= jnp.arange(k)[None] < jnp.asarray(num_drafts_B, jnp.int32)[:, None]
  a_B = _first_rejection(ok_BxK)
  return a_B, jnp.take_along_axis(target_BxK1, a_B[:, None], axis=1)[:, 0]


def _positive_temperature(temperature, rule):
  if validate.real("temperature", temperature, 0.0) == 0:
    raise validate.InvalidValue("temperature", f"{rule} needs temperature > 0, got {temperature!r}; the "
                                               "temperature-0 rule is its greedy counterpart")


def _relaxed_ok(probs_BxXxV, tokens_BxX, top_n: int, delta: float):
  """bool[B, X]: token x is among the top_n of its distribution and within delta of its top-1."""
  top_vals, top_ids = jax.lax.top_k(probs_BxXxV, top_n)
  in_top = jnp.any(top_ids == tokens_BxX[..., None], axis=-1)
  p_x = jnp.take_along_axis(probs_BxXxV, tokens_BxX[..., None], axis=-1)[..., 0]
  return in_top & (p_x >= top_vals[..., 0] - delta)


def verify_relaxed(logits_BxK1xV, drafts_BxK, *, top_n: int, delta: float, allowed_BxK=None):
  """LOSSY relaxed acceptance (greedy): accepts a draft that is among the target's top_n tokens and
  whose probability is within delta of the top-1's. Output may differ from the target's greedy output.

  allowed_BxK: bool[B, k], the drafts a grammar allows (default all): with masked logits a draft
  of probability 0 would pass when the top-1's probability is <= delta.
  """
  logits_BxK1xV, drafts_BxK, _ = _check(logits_BxK1xV, drafts_BxK)
  k, v = drafts_BxK.shape[1], logits_BxK1xV.shape[2]
  top_n = validate.positive_int("top_n", top_n, v)
  delta = validate.real("delta", delta, 0.0, 1.0)
  probs = jax.nn.softmax(logits_BxK1xV.astype(jnp.float32), axis=-1)
  ok_BxK = _relaxed_ok(probs[:, :k], drafts_BxK, top_n, delta)
  if allowed_BxK is not None:
    ok_BxK &= allowed_BxK
  a_B = _first_rejection(ok_BxK)
  greedy_BxK1 = jnp.argmax(logits_BxK1xV, axis=-1).astype(jnp.int32)
  return a_B, jnp.take_along_axis(greedy_BxK1, a_B[:, None], axis=1)[:, 0]


def verify_tree_greedy(logits_BxN1xV: jax.Array, tree_tokens_BxN: jax.Array, tree: TreeSpec):
  """Greedy verification of a draft tree: the longest root path whose every token equals the
  target's argmax after its parent.

  Args:
    logits_BxN1xV: float32[B, N + 1, V] target logits at the tree's nodes, root first (tree order).
    tree_tokens_BxN: int32[B, N], the draft nodes' tokens (DraftTree.tokens).
    tree: the static TreeSpec.
  Returns:
    (num_accepted int32[B] in 0..k, next_token int32[B], path int32[B, k + 1]: the accepted
    node's ancestors by depth in tree order, path[:, 0] = 0 the root; entries past
    num_accepted repeat the accepted node). Siblings are distinct tokens (top-w), so at most
    one child of a node can match: the accepted path is unique, as a chain's prefix is.
  """
  logits_BxN1xV, tree_tokens_BxN, tree = _check_tree_args(logits_BxN1xV, tree_tokens_BxN, tree)
  greedy_BxN1 = jnp.argmax(logits_BxN1xV, axis=-1).astype(jnp.int32)
  return _deepest_accepted(tree_tokens_BxN == greedy_BxN1[:, tree.parents[1:]], greedy_BxN1, tree)


def _check_tree_args(logits_BxN1xV, tree_tokens_BxN, tree):
  """(logits, tree_tokens, tree) checked as every tree rule takes them, values too when concrete."""
  tree = check_tree(tree)
  logits_BxN1xV = validate.array("logits", logits_BxN1xV, (None, tree.num_nodes + 1, None), kind="float",
                                 dims=f"[B, N + 1 = {tree.num_nodes + 1}, V]")
  b, _, v = logits_BxN1xV.shape
  tree_tokens_BxN = validate.array("tree_tokens", tree_tokens_BxN, (b, tree.num_nodes), kind="int",
                                   dims=f"[B={b}, N={tree.num_nodes}]")
  check_tree(tree, vocab_size=v)
  _check_values(v, logits=logits_BxN1xV, drafts=tree_tokens_BxN, drafts_name="tree_tokens")
  return jnp.asarray(logits_BxN1xV), jnp.asarray(tree_tokens_BxN), tree


def _deepest_accepted(ok_BxN, greedy_BxN1, tree: TreeSpec):
  """(num_accepted, next_token, path) for the deepest node whose path is all ok (ok_BxN: bool[B, N],
  node n + 1 passes its own test); the first in tree order among equally deep ones."""
  b = ok_BxN.shape[0]
  accepted = [jnp.ones((b, 1), bool)]
  for d in range(1, tree.depth + 1):  # a node is accepted when it passes and its parent was accepted
    nodes = np.arange(tree.starts[d], tree.starts[d + 1])
    parent_ok = jnp.concatenate(accepted, axis=1)[:, tree.parents[nodes]]
    accepted.append(parent_ok & ok_BxN[:, nodes - 1])
  depth_BxN1 = jnp.where(jnp.concatenate(accepted, axis=1), jnp.asarray(tree.depths)[None], -1)
  best_B = jnp.argmax(depth_BxN1, axis=1)
  return (jnp.asarray(tree.depths)[best_B], jnp.take_along_axis(greedy_BxN1, best_B[:, None], axis=1)[:, 0],
          jnp.asarray(tree.paths)[best_B])


def verify_tree_relaxed(logits_BxN1xV, tree_tokens_BxN, tree: TreeSpec, *, top_n: int, delta: float,
                        allowed_BxN=None):
  """LOSSY relaxed acceptance along a draft tree's paths (greedy): a node passes when its token
  passes `verify_relaxed`'s test under its parent's distribution; the deepest node whose whole
  path passes is accepted (the first in tree order among equally deep ones, since siblings may
  pass together), and the next token is the target's argmax after it.

  Args and returns as `verify_tree_greedy`; allowed_BxN: bool[B, N], the nodes a grammar allows.
  """
  logits_BxN1xV, tree_tokens_BxN, tree = _check_tree_args(logits_BxN1xV, tree_tokens_BxN, tree)
  v = logits_BxN1xV.shape[-1]
  top_n = validate.positive_int("top_n", top_n, v)
  delta = validate.real("delta", delta, 0.0, 1.0)
  probs_BxN1xV = jax.nn.softmax(logits_BxN1xV.astype(jnp.float32), axis=-1)
  ok_BxN = _relaxed_ok(probs_BxN1xV[:, tree.parents[1:]], tree_tokens_BxN, top_n, delta)
  if allowed_BxN is not None:
    ok_BxN &= allowed_BxN
  greedy_BxN1 = jnp.argmax(logits_BxN1xV, axis=-1).astype(jnp.int32)
  return _deepest_accepted(ok_BxN, greedy_BxN1, tree)


def verify_tree_sampling(logits_BxN1xV, tree_tokens_BxN, draft_probs_BxMxV, key, tree: TreeSpec, *,
                         temperature: float, top_k: int | None = None, top_p: float | None = None):
  """Lossless speculative sampling over a draft tree whose node m's children were drawn independently
  from draft_probs_BxMxV[:, m] (multi-candidate rejection sampling: SpecInfer, Miao et al. 2024).

  From the root, the children of the current node are tried in order: child x is accepted with
  probability min(1, r(x) / q(x)), where r starts as the target's distribution p at the node and
  becomes norm(max(0, r - q)) after each rejected child. An accepted child becomes the current
  node (r = p there); when every child is rejected, or at a leaf, the next token is drawn from r.
  Each draw is then distributed exactly as sampling from p. temperature > 0; the values are checked
  as in verify_sampling.

  Args:
    logits_BxN1xV: float32[B, N + 1, V] target logits at the nodes, root first (tree order).
    tree_tokens_BxN: int32[B, N]; draft_probs_BxMxV: float32[B, M, V] (DraftTree.probs).
  Returns:
    (num_accepted int32[B], next_token int32[B], path int32[B, k + 1]) as verify_tree_greedy.
  """
  _positive_temperature(temperature, "verify_tree_sampling")
  if key is None:
    raise validate.InvalidValue("key", "verify_tree_sampling needs a PRNG key")
  b = validate.array("logits", logits_BxN1xV, (None, None, None), kind="float", dims="[B, N + 1, V]").shape[0]
  return verify_tree_rows(logits_BxN1xV, tree_tokens_BxN, draft_probs_BxMxV, jax.random.split(key, b),
                          RowSampling.uniform(b, *validate.sampling(temperature, top_k, top_p)), tree)


def verify_tree_rows(logits_BxN1xV, tree_tokens_BxN, draft_probs_BxMxV, keys_B, rows: RowSampling,
                     tree: TreeSpec, num_drafts_B=None):
  """`verify_tree_sampling` with each row's own settings (rows: `RowSampling`, temperature 0:
  greedy, where it is `verify_tree_greedy`), key (keys_B: a key per row) and depth cap
  (num_drafts_B: int32[B] in 0..depth, default the tree's depth: the walk stops there)."""
  tree = check_tree(tree)
  n1, m = tree.num_nodes + 1, tree.starts[tree.depth]
  logits_BxN1xV = validate.array("logits", logits_BxN1xV, (None, n1, None), kind="float", dims=f"[B, N + 1 = {n1}, V]")
  b, _, v = logits_BxN1xV.shape
  tree_tokens_BxN = validate.array("tree_tokens", tree_tokens_BxN, (b, n1 - 1), kind="int", dims=f"[B={b}, N={n1 - 1}]")
  draft_probs_BxMxV = validate.array("draft_probs", draft_probs_BxMxV, (b, m, v), kind="float",
                                     dims=f"[B={b}, M={m}, V={v}]")
  check_tree(tree, vocab_size=v)
  _check_values(v, logits=logits_BxN1xV, drafts=tree_tokens_BxN, draft_probs=draft_probs_BxMxV,
                drafts_name="tree_tokens")
  cap_B = jnp.full((b,), tree.depth, jnp.int32) if num_drafts_B is None else jnp.asarray(num_drafts_B, jnp.int32)
  p_BxN1xV = row_probs(jnp.asarray(logits_BxN1xV), rows)
  tokens_BxN1 = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), jnp.asarray(tree_tokens_BxN, jnp.int32)], axis=1)
  at = lambda x_BxNx, n_B: jnp.take_along_axis(x_BxNx, n_B.reshape((b,) + (1,) * (x_BxNx.ndim - 1)), axis=1)[:, 0]
  # One uniform per child tried, then the last draw: each from the row's own key.
  u_BxC = jax.vmap(lambda key: jax.random.uniform(jax.random.fold_in(key, 0), (sum(tree.widths),)))(keys_B)
  cur_B = jnp.zeros((b,), jnp.int32)
  walking_B = jnp.ones((b,), bool)  # still descending: every node so far accepted
  r_BxV = p_BxN1xV[:, 0]
  c = 0
  for d in range(1, tree.depth + 1):
    w = tree.widths[d - 1]
    walking_B = walking_B & (d <= cap_B)
    q_BxV = at(jnp.asarray(draft_probs_BxMxV), cur_B)
    first_B = tree.starts[d] + (cur_B - tree.starts[d - 1]) * w
    moved_B = jnp.zeros((b,), bool)
    for j in range(w):
      child_B = first_B + j
      x_B = at(tokens_BxN1, child_B)
      trying_B = walking_B & ~moved_B
      # u < r/q without the division: q(x) > 0 for any token the draft could have drawn.
      ok_B = trying_B & (u_BxC[:, c] * at(q_BxV, x_B) < at(r_BxV, x_B))
      c += 1
      r_BxV = jnp.where((trying_B & ~ok_B)[:, None], _residual(r_BxV, q_BxV), r_BxV)
      cur_B = jnp.where(ok_B, child_B, cur_B)
      moved_B = moved_B | ok_B
    r_BxV = jnp.where(moved_B[:, None], at(p_BxN1xV, cur_B), r_BxV)
    walking_B = walking_B & moved_B
  next_B = jax.vmap(lambda key, r: jax.random.categorical(jax.random.fold_in(key, 1), jnp.log(r)))(keys_B, r_BxV)
  return jnp.asarray(tree.depths)[cur_B], next_B.astype(jnp.int32), jnp.asarray(tree.paths)[cur_B]


def verify_tree_gumbel(logits_BxN1xV, tree_tokens_BxN, draws: Draws | None, tree: TreeSpec, num_drafts_B=None):
  """Gumbel acceptance over a draft tree: `verify_tree_greedy` on the target's perturbed scores
  (a node of depth d gives the token at output position draws.positions + d), so the accepted
  path is the target's own draws and the output is plain sampling's with the same key, whatever
  the tree. Children drawn as the top-w of the drafter's perturbed scores under the same noise
  (Gumbel-top-k: draws without replacement) hold the target's token whenever it is among them.

  Args and returns as `verify_tree_greedy`; draws: `Draws` of the target stream at the output
  position after the root (None: every row greedy); num_drafts_B: int32[B] in 0..depth (default the depth): nodes deeper
  than a row's cap are not accepted.
  """
  logits_BxN1xV, tree_tokens_BxN, tree = _check_tree_args(logits_BxN1xV, tree_tokens_BxN, tree)
  scores = logits_BxN1xV if draws is None else draws.scores(logits_BxN1xV, tree.depths)
  target_BxN1 = jnp.argmax(scores, axis=-1).astype(jnp.int32)
  ok_BxN = tree_tokens_BxN == target_BxN1[:, tree.parents[1:]]
  if num_drafts_B is not None:
    ok_BxN &= jnp.asarray(tree.depths[1:])[None] <= jnp.asarray(num_drafts_B, jnp.int32)[:, None]
  return _deepest_accepted(ok_BxN, target_BxN1, tree)
