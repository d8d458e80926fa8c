"""Tree drafts: the static tree, exact node drafts over random histories, tree verification of the
target with compaction, greedy tree decoding == plain greedy decoding, errors."""

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mtp_jax
from mtp_jax import serving
from mtp_jax import TreeSpec, grammar, validate

from test_generate import PROMPTS5, PROPOSER5, TARGET5, _exact_joint, _models
from test_grammar_generate import AB_VOCAB, EOS, G, MAX_NEW, _assert_matches
from test_grammar_generate import PROMPTS as GPROMPTS
from test_grammar_generate import PROPOSER as GP
from test_grammar_generate import TARGET as GT
from test_proposer import CFG, D, K, MAX_LEN, MODEL, NEAR_TIE, V, Sim, _ref_logits
from test_verify import _chi2_pvalue

verify_lib = importlib.import_module("mtp_jax.verify")
target_lib = importlib.import_module("mtp_jax.target")


def test_tree_spec_layout():
  tree = TreeSpec((2, 3))
  assert (tree.depth, tree.num_nodes, tree.level_sizes, tree.starts) == (2, 8, (1, 2, 6), (0, 1, 3, 9))
  assert tree.parents.tolist() == [-1, 0, 0, 1, 1, 1, 2, 2, 2]
  assert tree.depths.tolist() == [0, 1, 1, 2, 2, 2, 2, 2, 2]
  assert tree.paths[7].tolist() == [0, 2, 7] and tree.paths[1].tolist() == [0, 1, 1]
  assert np.flatnonzero(tree.visible[7]).tolist() == [0, 2, 7]
  assert TreeSpec((1, 1, 1)).parents.tolist() == [-1, 0, 1, 2]  # the chain
  drafts = mtp_jax.DraftTree.of(tree, jnp.zeros((1, 8), jnp.int32))
  assert drafts.parents.tolist() == [-1, -1, 0, 0, 0, 1, 1, 1] and drafts.depths.tolist() == [1, 1, 2, 2, 2, 2, 2, 2]


@pytest.mark.parametrize("widths, error", [((), validate.InvalidType), ((2, 0), validate.InvalidValue),
                                           ((2.5,), validate.InvalidType), ("22", validate.InvalidType),
                                           ((8, 8, 8), validate.InvalidValue)])
def test_tree_spec_refuses_bad_widths(widths, error):
  with pytest.raises(error) as e:
    TreeSpec(widths)
  assert e.value.argument.startswith("widths")


def _children_match(got, logits, width):
  """got (the node's children) are the top-width tokens of the reference logits, up to float near-ties."""
  order = np.argsort(-logits, kind="stable")
  if set(got) == set(order[:width].tolist()):
    return True
  assert logits[order[width - 1]] - logits[order[width]] < NEAR_TIE, (got, order[:width])
  return False


def check_tree_drafts(sim, tree, drafts):
  """Every node's children equal the top-w of a full, cache-free recompute of the chain over the
  verified sequence followed by the node's path."""
  tokens, k = np.asarray(drafts.tokens), tree.depth
  for b in range(sim.b):
    p = len(sim.toks[b]) - 1
    h = np.zeros((1, MAX_LEN, D), np.float32)
    h[0, :p + 1] = sim.hid[b]
    for leaf_parent in range(tree.starts[k - 1], tree.starts[k]):  # deepest parents: their paths cover all
      path = tree.paths[leaf_parent, 1:tree.depths[leaf_parent] + 1]
      seq = list(sim.toks[b]) + [int(tokens[b, n - 1]) for n in path]
      ext = np.zeros((1, MAX_LEN + sim.depths - 1), np.int32)
      ext[0, :len(seq)] = seq
      logits = np.asarray(_ref_logits(sim.model, jnp.asarray(h), jnp.asarray(ext), sim.depths))[:, 0, p]
      for d in range(k):  # depth d + 1 row p reads the path up to depth d
        node = tree.paths[leaf_parent, d]
        kids = np.flatnonzero(tree.parents == node)
        if not _children_match(tokens[b, kids - 1].tolist(), logits[d], tree.widths[d]):
          break  # a near-tie: the subtree below follows the tied choice


def accept_random_path(sim, tree, drafts, rng):
  """Accepts a random node's path per sequence: returns the next propose inputs (as Sim.verify)."""
  tokens = np.asarray(drafts.tokens)
  ends = rng.integers(0, tree.num_nodes + 1, size=sim.b)
  accepted = [int(tree.depths[e]) for e in ends]
  chain = np.zeros((sim.b, tree.depth), np.int32)
  for b, e in enumerate(ends):
    path = tree.paths[e, 1:tree.depths[e] + 1]
    chain[b, :len(path)] = tokens[b, path - 1]
  return sim.verify(chain, accepted)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_tree_drafts_equal_full_recompute_over_random_histories(data):
  """Tree steps with random accepted paths, chain steps in between: node drafts and, through the
  chain steps, the caches stay equal to a full recompute."""
  prompt_lens = data.draw(st.lists(st.integers(1, 12), min_size=3, max_size=3), label="prompts")
  seed = data.draw(st.integers(0, 2**16), label="seed")
  sim, rng = Sim(prompt_lens, seed=seed), np.random.default_rng(seed)
  trees = [TreeSpec((2, 2, 2)), TreeSpec((3, 2))]
  h, t, n = _first_inputs(sim)
  for _ in range(data.draw(st.integers(2, 5), label="steps")):
    if max(len(x) for x in sim.toks) + 2 * K + 1 >= MAX_LEN:
      break
    if data.draw(st.booleans(), label="tree step"):
      tree = trees[data.draw(st.integers(0, 1), label="tree")]
      drafts, sim.state = mtp_jax.propose(sim.model, sim.state, h, t, n, num_drafts=tree.depth, tree=tree)
      check_tree_drafts(sim, tree, drafts)
      h, t, n = accept_random_path(sim, tree, drafts, rng)
    else:
      drafts = sim.call(h, t, n, K)
      sim.check(drafts, K)
      h, t, n = sim.verify(drafts, [int(a) for a in rng.integers(0, K + 1, size=sim.b)])


def _first_inputs(sim):
  h = np.zeros((sim.b, 12, D), np.float32)
  t = np.zeros((sim.b, 12), np.int32)
  for i, (hid, toks) in enumerate(zip(sim.hid, sim.toks)):
    h[i, :len(toks)], t[i, :len(toks)] = hid, toks
  return h, t, np.array([len(x) for x in sim.toks], np.int32)


def test_tree_propose_is_unrolled_and_compiles_once():
  tree = TreeSpec((2, 2, 1))
  state = mtp_jax.init_state(CFG, 2, 16)
  h, t = jnp.zeros((2, 4, D)), jnp.zeros((2, 4), jnp.int32)
  fn = lambda s, h, t, n: mtp_jax.propose(MODEL, s, h, t, n, num_drafts=3, tree=tree)
  jaxpr = str(jax.make_jaxpr(fn)(state, h, t, jnp.array([1, 2])))
  assert "scan" not in jaxpr and "while" not in jaxpr
  traces = []
  step = jax.jit(lambda s, h, t, n: (traces.append(1), fn(s, h, t, n))[1])
  drafts, s = step(state, h, t, jnp.array([1, 2]))
  assert drafts.tokens.shape == (2, tree.num_nodes)
  _, s = step(s, h + 1, t + 1, jnp.array([3, 0]))
  assert len(traces) == 1


TCFG = mtp_jax.TargetConfig(vocab_size=V, hidden_size=D, num_heads=4, num_kv_heads=2, head_dim=8,
                            intermediate_size=64, num_layers=2)
MLA_TCFG = mtp_jax.TargetConfig(**{**TCFG.__dict__, "mla": mtp_jax.MlaConfig(
    kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, q_lora_rank=12)})


@pytest.mark.parametrize("cfg", [TCFG, MLA_TCFG], ids=["gqa", "mla"])
def test_target_tree_verification_and_compaction(cfg):
  """Each node's logits equal the target run on the prefix + the node's path; after compaction of a
  path the caches hold what a chain verification of that path writes."""
  target, tree = mtp_jax.init_target(cfg, seed=1), TreeSpec((3, 2))
  rng = np.random.default_rng(0)
  lens = np.array([5, 9], np.int32)
  prompts = rng.integers(0, V, size=(2, 12)).astype(np.int32)
  state = mtp_jax.init_target_state(cfg, 2, 32)
  _, _, state = mtp_jax.target_step(target, state, prompts, lens)
  nodes = rng.integers(0, V, size=(2, tree.num_nodes + 1)).astype(np.int32)
  logits, hid, tree_state = mtp_jax.target_step(target, state, nodes, np.full(2, tree.num_nodes + 1, np.int32), tree)
  # Reference: every (sequence, node) as its own cache-free sequence, padded to 16 rows, one batch.
  seqs, last = np.zeros((2, tree.num_nodes + 1, 16), np.int32), np.zeros((2, tree.num_nodes + 1), np.int32)
  for b in range(2):
    for node in range(tree.num_nodes + 1):
      seq = np.concatenate([prompts[b, :lens[b]], nodes[b, tree.paths[node, :tree.depths[node] + 1]]])
      seqs[b, node, :len(seq)], last[b, node] = seq, len(seq) - 1
  rows = jnp.broadcast_to(jnp.arange(16), (seqs[..., 0].size, 16))
  ref, ref_h, _ = jax.jit(lambda m, x: m(x, rows, jnp.ones_like(rows, bool), None))(target, seqs.reshape(-1, 16))
  at_last = lambda x: np.take_along_axis(np.asarray(x).reshape(2, tree.num_nodes + 1, 16, -1),
                                         last[..., None, None], axis=2)[:, :, 0]
  np.testing.assert_allclose(logits, at_last(ref), atol=2e-4, rtol=2e-4)
  np.testing.assert_allclose(hid, at_last(ref_h), atol=2e-4, rtol=2e-4)
  ends = np.array([7, 2])  # a depth-2 path and a depth-1 path
  path_BxK1, a_B = jnp.asarray(tree.paths[ends]), jnp.asarray(tree.depths[ends])
  compacted = jax.jit(lambda st, start, path, a: target_lib.trim_target(
      target_lib.compact_target(st, start, path, a), start + a + 1))(tree_state, state.length, path_BxK1, a_B)
  chain_in = np.zeros((2, 3), np.int32)
  for b in range(2):
    chain_in[b, :a_B[b] + 1] = nodes[b, tree.paths[ends[b], :a_B[b] + 1]]
  _, _, chain_state = mtp_jax.target_step(target, state, chain_in, a_B + 1)
  np.testing.assert_array_equal(compacted.length, chain_state.length)
  for got, want in zip(compacted.kv, chain_state.kv):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      for b in range(2):
        n = int(chain_state.length[b])
        np.testing.assert_allclose(g[b, :n], w[b, :n], atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("cfg", [TCFG, MLA_TCFG], ids=["gqa", "mla"])
def test_paged_target_tree_verification_and_compaction_equal_contiguous(cfg):
  """Tree verification over paged caches (nodes written through the page table), compaction
  moving rows through the table, a trim giving pages back, then a chain step: every logit equals
  the contiguous run's."""
  target, tree = mtp_jax.init_target(cfg, seed=1), TreeSpec((3, 2))
  rng = np.random.default_rng(4)
  states = [mtp_jax.init_target_state(cfg, 2, 32), mtp_jax.init_target_state(cfg, 2, 32, page_size=4, num_pages=16)]
  prompts = rng.integers(0, V, size=(2, 12)).astype(np.int32)
  lens = np.array([5, 10], np.int32)
  nodes = rng.integers(0, V, size=(2, tree.num_nodes + 1)).astype(np.int32)
  ends = np.array([8, 1])  # a depth-2 path, a depth-1 path
  path_BxK1, a_B = jnp.asarray(tree.paths[ends]), jnp.asarray(tree.depths[ends])
  nxt = rng.integers(0, V, size=(2, 3)).astype(np.int32)
  outs = []
  for state in states:
    _, _, state = mtp_jax.target_step(target, state, prompts, lens)
    start = state.length
    logits, _, state = mtp_jax.target_step(target, state, nodes, np.full(2, tree.num_nodes + 1, np.int32), tree)
    state = target_lib.trim_target(target_lib.compact_target(state, start, path_BxK1, a_B), start + a_B + 1)
    after, _, state = mtp_jax.target_step(target, state, nxt, np.array([3, 2], np.int32))
    outs.append((np.asarray(logits), np.asarray(after)[0, :3], np.asarray(after)[1, :2], np.asarray(state.length)))
  assert not np.asarray(state.out_of_pages).any()
  for got, want in zip(*outs):
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("widths", [(2, 2, 2), (3, 1, 1), (1, 1, 1), (4, 2)])
def test_greedy_tree_decoding_equals_plain(widths):
  base = mtp_jax.generate(TARGET5, None, PROMPTS5, 24)
  out = mtp_jax.generate(TARGET5, PROPOSER5, PROMPTS5, 24, tree=TreeSpec(widths))
  assert out.tokens == base.tokens
  assert out.stats["accepted_tokens"] > 0
  assert out.stats["accepted_tokens"] + out.stats["target_tokens"] == out.stats["generated_tokens"]


def test_tree_decoding_with_eos_streaming_and_a_larger_vocab():
  target, proposer = _models(64, seed=4)
  prompts = [[5, 6, 7, 8], [9] * 20, [1, 2]]
  base = mtp_jax.generate(target, None, prompts, 30, eos_token_id=3)
  streamed = [[] for _ in prompts]
  out = mtp_jax.generate(target, proposer, prompts, 30, eos_token_id=3, tree=TreeSpec((3, 2, 1)),
                         stream=lambda new: [s.extend(x) for s, x in zip(streamed, new)])
  assert out.tokens == base.tokens == streamed


def test_tree_accepts_at_least_what_the_chain_does_per_step():
  """The chain's drafts are the tree's first-child path, so from the same state a tree step accepts
  at least as many: checked on one verification of the same drafted state."""
  prompts = [[1, 2, 3, 4], [0, 1]]
  tree = TreeSpec((2, 2, 2))
  chain = serving.DecodeStep(serving.StepSettings(num_drafts=3, max_new_tokens=8, max_len=48))
  trees = chain.replace(tree=tree)
  prompts_BxT = np.zeros((2, 32), np.int32)
  lens = np.array([4, 2], np.int32)
  for i, p in enumerate(prompts):
    prompts_BxT[i, :len(p)] = p

  def start(step):  # the prefill generate runs, from the same key
    s = step.init(TARGET5, PROPOSER5, None, 2)
    return serving.jit_prefill(step, TARGET5, PROPOSER5, None, s, prompts_BxT, lens, np.ones(2, bool),
                               np.zeros(2, bool), np.full(2, 8, np.int32),
                               serving.SlotSettings.uniform(2, num_drafts=3))

  s_c, s_t = start(chain), start(trees)
  assert (np.asarray(s_t.drafts)[:, [0, 2, 6]] == np.asarray(s_c.drafts)).all()  # the first-child path
  s_c = serving.jit_step(chain, TARGET5, PROPOSER5, None, s_c)
  s_t = serving.jit_step(trees, TARGET5, PROPOSER5, None, s_t)
  assert (np.asarray(s_t.num_out) >= np.asarray(s_c.num_out)).all()


@pytest.mark.parametrize("kwargs, argument", [
    (dict(num_drafts=2), "tree"), (dict(tree="222"), "tree"), (dict(tree=TreeSpec((1, 1, 1, 1))), "tree")])
def test_generate_tree_errors(kwargs, argument):
  kwargs = {"tree": TreeSpec((2, 2, 2)), **kwargs}
  with pytest.raises((validate.InvalidValue, validate.InvalidType)) as e:
    mtp_jax.generate(TARGET5, PROPOSER5, PROMPTS5, 8, **kwargs)
  assert e.value.argument == argument


def test_tree_errors_name_the_argument():
  with pytest.raises(validate.InvalidValue, match="tree drafts need a proposer") as e:
    mtp_jax.generate(TARGET5, None, PROMPTS5, 8, tree=TreeSpec((2,)))
  state = mtp_jax.init_state(CFG, 1, 16)
  h, t, n = jnp.zeros((1, 2, D)), jnp.zeros((1, 2), jnp.int32), jnp.array([1])
  with pytest.raises(validate.InvalidValue, match="depth 2") as e:
    mtp_jax.propose(MODEL, state, h, t, n, num_drafts=3, tree=TreeSpec((2, 2)))
  assert e.value.argument == "tree"
  with pytest.raises(validate.InvalidValue) as e:
    mtp_jax.verify_tree_greedy(jnp.zeros((1, 4, V)), jnp.zeros((1, 2), jnp.int32), TreeSpec((2, 2)))
  assert e.value.argument == "logits"


def _tree_sampling_first_tokens(rule, copies=20000, seed=0):
  """Counts of the first token a verification emits, and the target's distribution at the root:
  random target distributions at every node, children drawn independently from random drafts."""
  tree, v = TreeSpec((3, 2)), 4
  rng = np.random.default_rng(seed)
  p_N1xV = rng.dirichlet(np.ones(v), size=tree.num_nodes + 1)
  q_MxV = rng.dirichlet(np.ones(v) * 0.5, size=tree.starts[tree.depth])
  key_kids, key_verify = jax.random.split(jax.random.key(seed))
  kids = jax.random.categorical(key_kids, jnp.log(q_MxV[tree.parents[1:]]), axis=-1, shape=(copies, tree.num_nodes))
  logits = jnp.broadcast_to(jnp.log(p_N1xV), (copies,) + p_N1xV.shape)
  q = jnp.broadcast_to(q_MxV, (copies,) + q_MxV.shape)
  a, nxt, path = rule(logits, kids.astype(jnp.int32), q, key_verify, tree, temperature=1.0)
  first_node = np.asarray(path)[:, 1]
  first = np.where(np.asarray(a) > 0, np.asarray(kids)[np.arange(copies), np.maximum(first_node - 1, 0)],
                   np.asarray(nxt))
  return np.bincount(first, minlength=v), p_N1xV[0], np.asarray(a)


def test_tree_sampling_rule_emits_the_target_distribution(monkeypatch):
  """The first token out of a tree verification is distributed as the target's root distribution,
  with every accepted depth exercised; dropping the residual update after a rejected sibling is caught."""
  counts, p, a = _tree_sampling_first_tokens(mtp_jax.verify_tree_sampling)
  assert _chi2_pvalue(counts, p) > 1e-3
  assert set(np.unique(a)) == {0, 1, 2}

  # The residual left unchanged after a rejected sibling (and at the end): a biased rule.
  monkeypatch.setattr(verify_lib, "_residual", lambda r_BxV, q_BxV: r_BxV)
  counts, p, _ = _tree_sampling_first_tokens(verify_lib.verify_tree_sampling)
  assert _chi2_pvalue(counts, p) < 1e-6


def test_tree_grammar_masks_per_node():
  """Greedy constrained tree decoding equals greedy constrained plain decoding. Under (ab){3,6}
  every draft is forced: masking each node with the state after its path gets them accepted,
  masking all with the root's state ("first") or none does not; the output is the same."""
  base = mtp_jax.generate(GT, None, GPROMPTS, MAX_NEW, eos_token_id=EOS, grammar=G)
  out = mtp_jax.generate(GT, GP, GPROMPTS, MAX_NEW, eos_token_id=EOS, grammar=G, tree=TreeSpec((2, 2, 1)))
  assert out.tokens == base.tokens
  _assert_matches(out.tokens)
  g = grammar.from_regex("(ab){3,6}", AB_VOCAB, eos_token_id=EOS)
  outs = {mode: mtp_jax.generate(GT, GP, GPROMPTS, MAX_NEW, eos_token_id=EOS, grammar=g, tree=TreeSpec((2, 1, 1)),
                                 draft_masks=mode) for mode in ("per_position", "first")}
  assert outs["first"].tokens == outs["per_position"].tokens
  assert outs["first"].stats["mean_accepted_length"] < outs["per_position"].stats["mean_accepted_length"]


@pytest.mark.slow
def test_tree_speculative_sampling_matches_target_distribution():
  """3 tokens over a 3-token vocabulary (27 outcomes): tree speculative sampling draws the target's
  joint distribution (with a grammar-free, unfiltered target)."""
  v, n, copies = 3, 3, 3000
  target, proposer = _models(v, seed=2)
  prompt = [0, 1, 2, 1]
  exact = _exact_joint(target, prompt, v, n)
  keys = sorted(exact)
  out = mtp_jax.generate(target, proposer, [prompt] * copies, n, temperature=1.0, seed=0, tree=TreeSpec((2, 2)))
  counts = {}
  for toks in out.tokens:
    counts[tuple(toks)] = counts.get(tuple(toks), 0) + 1
  assert _chi2_pvalue(np.array([counts.get(c, 0) for c in keys]), np.array([exact[c] for c in keys])) > 1e-3
  assert out.stats["accepted_tokens"] > copies  # drafts were accepted, so the tree rule was exercised


def test_tree_propose_over_paged_caches_equals_contiguous():
  """The node rows are never written, so a paged proposer state drafts the same trees."""
  tree, rng = TreeSpec((2, 2, 1)), np.random.default_rng(5)
  states = [mtp_jax.init_state(CFG, 2, 32), mtp_jax.init_state(CFG, 2, 32, page_size=8, num_pages=8)]
  h, t = rng.normal(size=(2, 6, D)).astype(np.float32), rng.integers(0, V, size=(2, 6)).astype(np.int32)
  n = np.array([6, 3], np.int32)
  for _ in range(3):
    outs = [mtp_jax.propose(MODEL, s, h, t, n, num_drafts=3, tree=tree) for s in states]
    np.testing.assert_array_equal(outs[0][0].tokens, outs[1][0].tokens)
    states = [mtp_jax.after_verify(s, np.array([2, 0], np.int32)) for _, s in outs]
    h = rng.normal(size=(2, 6, D)).astype(np.float32)
    t, n = rng.integers(0, V, size=(2, 6)).astype(np.int32), np.array([3, 1], np.int32)
