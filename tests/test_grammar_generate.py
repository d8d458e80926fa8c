"""Grammar-constrained speculative decoding: per-position draft masks, per-position verify masks.

Every generate output must match its grammar; greedy constrained speculative output must equal
greedy constrained autoregressive output; drafts must be valid continuations; free rows of a
mixed batch must not notice the grammar.
"""

import dataclasses
import importlib
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mtp_jax
from mtp_jax import grammar
from mtp_jax.data import EOS_ID, VOCAB_SIZE

from test_generate import _forward
from test_verify import _chi2_pvalue

prop = importlib.import_module("mtp_jax.proposer")


K = 3

# A small vocabulary with multi-character tokens, so one text has several tokenizations.
VOCAB = [str(i).encode() for i in range(10)] + [b",", b"12", b",3", b"007", None, None]
V, BOS, EOS = len(VOCAB), 14, 15
PATTERN = r"[0-9]{1,3}(,[0-9]{1,3}){0,3}"  # at most 15 characters, so 16 tokens end every output
MAX_NEW = 20
PROMPTS = [[BOS, 1, 2, 3], [BOS] + [6] * 10, [BOS, 12]]

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 4},
                                           "ok": {"type": "boolean"},
                                           "n": {"type": "integer", "maxDigits": 2}},
          "required": ["name", "ok", "n"]}
JSON_MAX_NEW = 64  # the longest text is {"name":"",...} with 4 four-byte characters: under 60


def _models(v, seed):
  common = dict(vocab_size=v, hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=64)
  target = mtp_jax.init_target(mtp_jax.TargetConfig(num_layers=2, **common), seed)
  proposer = mtp_jax.init_mtp(mtp_jax.MtpConfig(num_modules=K, **common), seed + 1)
  return target, proposer


TARGET, PROPOSER = _models(V, seed=0)
G = grammar.from_regex(PATTERN, VOCAB, eos_token_id=EOS)


def _text(tokens, vocab=VOCAB, eos=EOS):
  """The bytes of an output; it must end with eos, every output here has room to finish."""
  assert tokens and tokens[-1] == eos, f"output {tokens} does not end with eos"
  return b"".join(vocab[t] for t in tokens[:-1])


def _assert_matches(outputs):
  for tokens in outputs:
    assert re.fullmatch(PATTERN, _text(tokens).decode()), tokens


def _tables(g):
  """(allowed bool[S, V], next state int32[S, V]) as numpy, for walking the automaton in Python."""
  states = jnp.arange(g.num_states, dtype=jnp.int32)
  return np.asarray(grammar.allowed_mask(g, states)), np.asarray(g.next_state)


def _walk(g, state, tokens):
  """The state after tokens, asserting each one is allowed where it is fed."""
  allowed, nxt = _tables(g)
  for t in tokens:
    assert allowed[state, t], f"token {t} is not allowed in state {state} (walking {list(tokens)})"
    state = int(nxt[state, t])
  return state


@pytest.fixture(scope="module")
def autoregressive():
  return mtp_jax.generate(TARGET, None, PROMPTS, MAX_NEW, eos_token_id=EOS, grammar=G)


@pytest.fixture(scope="module")
def speculative():
  return mtp_jax.generate(TARGET, PROPOSER, PROMPTS, MAX_NEW, num_drafts=K, eos_token_id=EOS, grammar=G)


def test_greedy_constrained_speculative_equals_autoregressive(autoregressive, speculative):
  _assert_matches(autoregressive.tokens)
  assert speculative.tokens == autoregressive.tokens
  assert speculative.stats["accepted_tokens"] > 0  # the comparison covered accepted drafts
  free = mtp_jax.generate(TARGET, None, PROMPTS, MAX_NEW, eos_token_id=EOS)
  assert free.tokens != autoregressive.tokens  # the grammar changed something


@pytest.mark.slow
@pytest.mark.parametrize("k", range(1, K))
def test_greedy_constrained_equality_fewer_drafts(autoregressive, k):
  out = mtp_jax.generate(TARGET, PROPOSER, PROMPTS, MAX_NEW, num_drafts=k, eos_token_id=EOS, grammar=G)
  assert out.tokens == autoregressive.tokens
  assert out.stats["accepted_tokens"] > 0


def test_mixed_batch_rows_equal_their_own_decoding(autoregressive):
  """Row 1 decodes free in a constrained batch: it gets plain decoding's output, the others the
  constrained output (greedy outputs do not depend on the batch, so each run is 'alone')."""
  mixed = mtp_jax.generate(TARGET, PROPOSER, PROMPTS, MAX_NEW, num_drafts=K, eos_token_id=EOS, grammar=G,
                           constrained=[True, False, True])
  free = mtp_jax.generate(TARGET, None, PROMPTS, MAX_NEW, eos_token_id=EOS)
  assert mixed.tokens[1] == free.tokens[1]
  assert mixed.tokens[0] == autoregressive.tokens[0] and mixed.tokens[2] == autoregressive.tokens[2]
  assert mixed.tokens[1] != autoregressive.tokens[1]  # row 1 really decoded free


def test_sampled_outputs_match(speculative):
  for seed in range(3):
    out = mtp_jax.generate(TARGET, PROPOSER, PROMPTS, MAX_NEW, num_drafts=K, temperature=1.0, seed=seed,
                           eos_token_id=EOS, grammar=G)
    _assert_matches(out.tokens)
    assert out.stats["accepted_tokens"] > 0


AB_VOCAB = [b"a", b"b"] + [bytes([c]) for c in b"cdefghijklm"] + [None, None, None]  # EOS = 15


@pytest.mark.slow
def test_ablated_draft_masks_keep_output_and_lose_acceptance():
  """Under (ab){3,6} the first six tokens are forced. Per-position draft masks get every such draft
  accepted; masking all drafts with the first state ("first", the seed) or not at all ("none")
  loses that, and verification keeps the output the same in all three."""
  g = grammar.from_regex("(ab){3,6}", AB_VOCAB, eos_token_id=EOS)
  outs = {mode: mtp_jax.generate(TARGET, PROPOSER, PROMPTS, MAX_NEW, num_drafts=K, eos_token_id=EOS, grammar=g,
                                 draft_masks=mode) for mode in mtp_jax.serving.options.DRAFT_MASKS}
  for tokens in outs["per_position"].tokens:
    assert re.fullmatch("(ab){3,6}", _text(tokens, AB_VOCAB).decode())
  per_position = outs["per_position"].stats["mean_accepted_length"]
  for mode in ("first", "none"):
    assert outs[mode].tokens == outs["per_position"].tokens
    assert outs[mode].stats["mean_accepted_length"] < per_position


@pytest.mark.slow
def test_relaxed_acceptance_never_takes_a_forbidden_draft():
  """Unmasked drafts under (ab){3,6}: with delta = 1 the relaxed test alone would accept any draft
  among the top 3, including tokens of probability 0 where fewer than 3 are allowed."""
  g = grammar.from_regex("(ab){3,6}", AB_VOCAB, eos_token_id=EOS)
  out = mtp_jax.generate(TARGET, PROPOSER, PROMPTS, MAX_NEW, num_drafts=K, eos_token_id=EOS, grammar=g,
                         draft_masks="none", relaxed=(3, 1.0))
  for tokens in out.tokens:
    assert re.fullmatch("(ab){3,6}", _text(tokens, AB_VOCAB).decode())


@pytest.mark.slow
def test_streamed_with_the_smallest_cache(speculative):
  """The jitted step driven from Python, over caches of exactly the rows needed (the padded
  prompt would ask for 21 more), gives the on-device loop's output."""
  streamed = [[] for _ in PROMPTS]
  max_len = max(map(len, PROMPTS)) + MAX_NEW + K + 1
  out = mtp_jax.generate(TARGET, PROPOSER, PROMPTS, MAX_NEW, num_drafts=K, eos_token_id=EOS, grammar=G,
                         max_len=max_len, stream=lambda new: [s.extend(n) for s, n in zip(streamed, new)])
  assert out.tokens == streamed == speculative.tokens


# --- JSON over the byte vocabulary -----------------------------------------------------------

def _check_json(tokens):
  obj = json.loads(_text(tokens, grammar.byte_vocab(), EOS_ID).decode())
  assert set(obj) <= {"name", "ok", "n"} and {"name", "ok", "n"} <= set(obj), obj
  assert isinstance(obj["name"], str) and len(obj["name"]) <= 4, obj
  assert isinstance(obj["ok"], bool), obj
  assert isinstance(obj["n"], int) and not isinstance(obj["n"], bool) and abs(obj["n"]) < 100, obj


@pytest.fixture(scope="module")
def json_setup():
  target, proposer = _models(VOCAB_SIZE, seed=5)
  g = grammar.from_json_schema(SCHEMA, grammar.byte_vocab(), eos_token_id=EOS_ID, whitespace_pattern=" ?")
  prompts = [list(b"record = "), list(b"{'x': 1}\n" * 3), list(b"#")]
  return target, proposer, g, prompts


def test_json_greedy_outputs_validate(json_setup):
  target, proposer, g, prompts = json_setup
  out = mtp_jax.generate(target, proposer, prompts, JSON_MAX_NEW, num_drafts=K, eos_token_id=EOS_ID, grammar=g)
  for tokens in out.tokens:
    _check_json(tokens)
  assert out.stats["accepted_tokens"] > 0


@pytest.mark.slow
def test_json_greedy_equals_autoregressive_and_sampled_outputs_validate(json_setup):
  target, proposer, g, prompts = json_setup
  base = mtp_jax.generate(target, None, prompts, JSON_MAX_NEW, eos_token_id=EOS_ID, grammar=g)
  out = mtp_jax.generate(target, proposer, prompts, JSON_MAX_NEW, num_drafts=K, eos_token_id=EOS_ID, grammar=g)
  assert out.tokens == base.tokens
  for seed in range(3):
    out = mtp_jax.generate(target, proposer, prompts, JSON_MAX_NEW, num_drafts=K, temperature=1.0, seed=seed,
                           top_k=50, eos_token_id=EOS_ID, grammar=g)
    for tokens in out.tokens:
      _check_json(tokens)


# --- propose with a grammar -------------------------------------------------------------------

def _propose_inputs(batch, t, seed):
  rng = np.random.default_rng(seed)
  hiddens = rng.normal(size=(batch, t, 32)).astype(np.float32)
  tokens = rng.integers(0, V, size=(batch, t)).astype(np.int32)
  return hiddens, tokens


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_drafts_are_valid_continuations_over_steps(temperature):
  """Over propose / after_verify rounds with random accept counts, each round's drafts walk the
  automaton from the state after the verified tokens; sampled drafts' q is zero off the mask."""
  rng = np.random.default_rng(1)
  prefixes = [b"", b"7", b"12,", b"123", b"1,2,3,007"]
  b = len(prefixes)
  states = [_walk(G, grammar.START, [VOCAB.index(bytes([c])) for c in p]) for p in prefixes]
  pstate = mtp_jax.init_state(PROPOSER.cfg, b, 64, keep_draft_probs=temperature > 0)
  t = K + 1  # one compile: the first call's "prompt" has as many rows as a verify step
  hiddens, tokens = _propose_inputs(b, t, seed=2)
  num_new = np.full((b,), t, np.int32)
  for step in range(4):
    drafts, pstate = mtp_jax.propose(PROPOSER, pstate, hiddens, tokens, num_new, num_drafts=K,
                                     temperature=temperature, key=jax.random.key(step), grammar=G,
                                     grammar_state=np.asarray(states, np.int32))
    drafts = np.asarray(drafts)
    for i in range(b):
      _walk(G, states[i], drafts[i])
    if temperature > 0:
      along = grammar.states_along(G, jnp.asarray(states), jnp.asarray(drafts))[:, :K]
      off_mask = ~np.asarray(grammar.allowed_mask(G, along))
      assert np.all(np.asarray(pstate.draft_probs)[off_mask] == 0)
    # Accept a random prefix and a random allowed next token, as verification would.
    accepted = rng.integers(0, K + 1, size=b)
    pstate = mtp_jax.after_verify(pstate, accepted.astype(np.int32))
    hiddens, tokens = _propose_inputs(b, t, seed=10 + step)
    for i in range(b):
      state = _walk(G, states[i], drafts[i, :accepted[i]])
      allowed = np.flatnonzero(_tables(G)[0][state])
      allowed = allowed[allowed != EOS] if len(allowed) > 1 else allowed
      nxt = int(rng.choice(allowed))
      states[i] = _walk(G, state, [nxt])
      tokens[i, :accepted[i] + 1] = list(drafts[i, :accepted[i]]) + [nxt]
    num_new = (accepted + 1).astype(np.int32)


def test_per_position_masks_matter():
  """Under (ab){2,4} the first three tokens can only be "a b a". Masking every draft with the
  first position's state (the seed proposer) drafts "a a a": invalid from the second draft on."""
  g = grammar.from_regex("(ab){2,4}", AB_VOCAB, eos_token_id=EOS)
  hiddens, tokens = _propose_inputs(2, 4, seed=3)
  start = jnp.full((2,), grammar.START, jnp.int32)
  state = mtp_jax.init_state(PROPOSER.cfg, 2, 16)
  num_new = jnp.asarray([4, 2], jnp.int32)
  drafts, _ = mtp_jax.propose(PROPOSER, state, hiddens, tokens, num_new, num_drafts=K, grammar=g,
                              grammar_state=start)
  np.testing.assert_array_equal(drafts, [[0, 1, 0]] * 2)
  seed_drafts, _ = prop.propose_step(PROPOSER, state, jnp.asarray(hiddens), jnp.asarray(tokens), num_new,
                                     prop.ProposeSettings(K, grammar_per_position=False), None, g, start)
  np.testing.assert_array_equal(seed_drafts, [[0, 0, 0]] * 2)
  with pytest.raises(AssertionError):
    _walk(g, grammar.START, np.asarray(seed_drafts)[0])


def test_token_mask_pads_the_vocabulary_and_ends_dead_rows():
  states = jnp.asarray([grammar.FREE, grammar.START, grammar.DONE, 2], jnp.int32)
  # A hand-built grammar whose state 2 allows nothing: such a row may only emit EOS.
  g = grammar.from_regex("1,2", VOCAB, eos_token_id=EOS)
  hollow = dataclasses.replace(g, allowed_bits=g.allowed_bits.at[2].set(0))
  mask = np.asarray(grammar.token_mask(hollow, states, V + 4))
  assert mask[0].all()  # FREE: the padded tokens too
  np.testing.assert_array_equal(mask[1], np.asarray(grammar.allowed_mask(g, states[1:2]))[0].tolist() + [False] * 4)
  np.testing.assert_array_equal(np.flatnonzero(mask[2]), [EOS])
  np.testing.assert_array_equal(np.flatnonzero(mask[3]), [EOS])
  with pytest.raises(ValueError, match=r"vocab_size 10 is smaller than the grammar's vocabulary \(16 tokens\)"):
    grammar.token_mask(g, states, 10)


# --- lossless constrained sampling -------------------------------------------------------------

def _constrained_joint(target, g, prompt, vocab_size):
  """P(output | prompt) of every output, from the target masked along the grammar, walked exactly."""
  probs = {}

  def visit(prefix, state, p):
    logits = _forward(target, jnp.asarray([prompt + prefix], jnp.int32))
    mask = grammar.token_mask(g, jnp.asarray([state]), vocab_size)
    q = np.asarray(jax.nn.softmax(grammar.apply_mask(logits[0, -1:], mask)[0]))
    for tok in np.flatnonzero(np.asarray(mask)[0]):
      if tok == g.eos_token_id:
        probs[tuple(prefix + [int(tok)])] = p * float(q[tok])
      else:
        nxt = int(grammar.advance(g, jnp.asarray([state]), jnp.asarray([tok]))[0])
        visit(prefix + [int(tok)], nxt, p * float(q[tok]))

  visit([], grammar.START, 1.0)
  return probs


@pytest.mark.slow
def test_constrained_speculative_sampling_is_lossless(monkeypatch):
  """[ab]{1,2}c? over a 4-token vocabulary (12 outputs): speculative sampling draws the masked
  target's joint distribution; verifying every position with the first state is caught."""
  vocab = [b"a", b"b", b"c", None]
  target, proposer = _models(4, seed=2)
  g = grammar.from_regex("[ab]{1,2}c?", vocab, eos_token_id=3)
  prompt = [0, 1, 2, 1]
  exact = _constrained_joint(target, g, prompt, 4)
  assert len(exact) == 12
  outcomes = sorted(exact)
  p = np.array([exact[o] for o in outcomes])

  def sampled_counts(copies=3000):
    out = mtp_jax.generate(target, proposer, [prompt] * copies, 4, num_drafts=2, temperature=1.0, eos_token_id=3,
                           grammar=g)
    counts = {}
    for toks in out.tokens:
      counts[tuple(toks)] = counts.get(tuple(toks), 0) + 1
    return counts

  counts = sampled_counts()
  assert set(counts) <= set(exact)
  assert _chi2_pvalue(np.array([counts.get(o, 0) for o in outcomes]), p) > 1e-3

  def first_state_only(g, state_B, tokens_BxK):
    return jnp.repeat(state_B[:, None], tokens_BxK.shape[1] + 1, axis=1)

  monkeypatch.setattr(mtp_jax.grammar, "states_along", first_state_only)
  counts = sampled_counts(2999)  # a new shape: traced again with the ablation
  wrong = np.array([counts.get(o, 0) for o in outcomes])
  assert set(counts) - set(exact) or _chi2_pvalue(wrong, p) < 1e-6


# --- errors ----------------------------------------------------------------------------------

class TestErrors:

  def test_invalid_and_unsatisfiable_patterns(self):
    with pytest.raises(ValueError, match=r"cannot build a grammar for pattern '\[0-9'"):
      grammar.from_regex("[0-9", VOCAB, eos_token_id=EOS)
    with pytest.raises(ValueError, match=r"pattern '\(12\)\+3' cannot be matched by any token sequence"):
      grammar.from_regex("(12)+3", [None, b"1", b"2", b"12"], eos_token_id=0)  # no token holds "3"

  def test_grammar_needs_eos(self):
    with pytest.raises(ValueError, match=r"pass eos_token_id \(the grammar's is 15\)"):
      mtp_jax.generate(TARGET, PROPOSER, PROMPTS, 4, grammar=G)
    with pytest.raises(ValueError, match=r"eos_token_id=14 differs from the grammar's eos_token_id=15"):
      mtp_jax.generate(TARGET, PROPOSER, PROMPTS, 4, eos_token_id=14, grammar=G)

  def test_constrained(self):
    with pytest.raises(ValueError, match=r"constrained needs a grammar"):
      mtp_jax.generate(TARGET, PROPOSER, PROMPTS, 4, eos_token_id=EOS, constrained=[True] * 3)
    with pytest.raises(ValueError, match=r"constrained must have one bool per prompt \(3\), got 2"):
      mtp_jax.generate(TARGET, PROPOSER, PROMPTS, 4, eos_token_id=EOS, grammar=G, constrained=[True] * 2)

  def test_grammar_vocab_larger_than_model(self):
    g = grammar.from_regex(PATTERN, VOCAB + [b"x"], eos_token_id=EOS)
    with pytest.raises(ValueError, match=r"grammar has 17 tokens, more than the target's vocab_size=16"):
      mtp_jax.generate(TARGET, PROPOSER, PROMPTS, 4, eos_token_id=EOS, grammar=g)
    with pytest.raises(ValueError, match=r"grammar has 17 tokens, more than the model's vocab_size=16"):
      mtp_jax.propose(PROPOSER, mtp_jax.init_state(PROPOSER.cfg, 1, 8), np.zeros((1, 1, 32), np.float32),
                      np.zeros((1, 1), np.int32), np.ones((1,), np.int32), num_drafts=1, grammar=g,
                      grammar_state=np.ones((1,), np.int32))

  def test_draft_masks(self):
    with pytest.raises(ValueError, match=r"draft_masks must be one of .*got 'all'"):
      mtp_jax.generate(TARGET, PROPOSER, PROMPTS, 4, eos_token_id=EOS, grammar=G, draft_masks="all")

  def test_grammar_state_shape(self):
    with pytest.raises(ValueError, match=r"grammar_state must be int32\[B=1\], got int32\[2\]"):
      mtp_jax.propose(PROPOSER, mtp_jax.init_state(PROPOSER.cfg, 1, 8), np.zeros((1, 1, 32), np.float32),
                      np.zeros((1, 1), np.int32), np.ones((1,), np.int32), num_drafts=1, grammar=G,
                      grammar_state=np.ones((2,), np.int32))
