import itertools
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtp_jax import grammar
from mtp_jax.data import BOS_ID, EOS_ID

# Every function runs jitted, as a decoding loop would call it.
_mask = jax.jit(grammar.allowed_mask)
_advance = jax.jit(grammar.advance)
_along = jax.jit(grammar.states_along)
_init = jax.jit(grammar.init_grammar_state, static_argnums=0)
_apply = jax.jit(grammar.apply_mask)
_no_token = jax.jit(grammar.no_allowed_token)

# Same meaning in Rust `regex` (outlines-core) and Python `re`; multi-byte characters included.
BYTE_PATTERN = r"(?:ab|é)+[0-9]{0,2}|x(?:yz)*|[α-γ]"

# A vocabulary with multi-byte tokens, a never-allowed special and EOS last.
JSON_VOCAB = [b"{", b"}", b'"', b"a", b'"a"', b":", b" ", b"-",
              *(bytes([c]) for c in b"0123456789"), b"12", b"-1", b'{"a":', b'"a": ', b"ab",
              "é".encode(), b"}}", None, b"<eos>"]
JSON_EOS = len(JSON_VOCAB) - 1
JSON_SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.fixture(scope="module")
def byte_grammar():
  return grammar.from_regex(BYTE_PATTERN, grammar.byte_vocab(), eos_token_id=EOS_ID)


@pytest.fixture(scope="module")
def json_grammar():
  return grammar.from_json_schema(JSON_SCHEMA, JSON_VOCAB, eos_token_id=JSON_EOS)


def random_walks(g, *, num_walks, max_steps, seed):
  """Token lists of walks that sampled EOS (EOS dropped); unfinished walks are left out."""
  rng = np.random.default_rng(seed)
  eos = g.eos_token_id
  state = _init(num_walks)
  tokens = [[] for _ in range(num_walks)]
  finished = np.zeros(num_walks, bool)
  for _ in range(max_steps):
    mask = np.asarray(_mask(g, state))
    step = np.empty(num_walks, np.int32)
    for b in range(num_walks):
      allowed = np.flatnonzero(mask[b])
      if finished[b]:
        np.testing.assert_array_equal(allowed, [eos])  # DONE allows only EOS
      # Lean towards EOS so that walks end, but keep exploring.
      stop = mask[b, eos] and rng.random() < 0.25
      step[b] = eos if stop else rng.choice(allowed)
      if not finished[b] and step[b] != eos:
        tokens[b].append(int(step[b]))
      finished[b] |= step[b] == eos
    state = _advance(g, state, jnp.asarray(step))
  return [t for t, done in zip(tokens, finished) if done]


def accepts(g, token_lists):
  """bool per token list: every token (then EOS) is allowed where it is fed, ending in DONE."""
  eos = g.eos_token_id
  length = max(map(len, token_lists)) + 1
  tokens_BxK = np.array([t + [eos] * (length - len(t)) for t in token_lists], np.int32)
  states_BxK1 = _along(g, _init(len(token_lists)), jnp.asarray(tokens_BxK))
  for k in range(length):  # states_along is advance applied token by token
    np.testing.assert_array_equal(states_BxK1[:, k + 1],
                                  _advance(g, states_BxK1[:, k], tokens_BxK[:, k]))
  mask_BxKxV = np.asarray(_mask(g, states_BxK1[:, :-1]))
  fed_allowed_BxK = np.take_along_axis(mask_BxKxV, tokens_BxK[..., None], -1)[..., 0]
  ok_B = fed_allowed_BxK.all(-1)
  # A disallowed token ends in DONE too (dead state), so DONE alone proves nothing.
  np.testing.assert_array_equal(np.asarray(states_BxK1[:, -1]), grammar.DONE)
  return ok_B.tolist()


def test_byte_walks_match_regex(byte_grammar):
  walks = random_walks(byte_grammar, num_walks=64, max_steps=40, seed=0)
  assert len(walks) >= 48
  texts = [bytes(t).decode("utf-8") for t in walks]
  for text in texts:
    assert re.fullmatch(BYTE_PATTERN, text), text
  assert len(set(texts)) >= 16
  assert any(t.startswith("x") for t in texts) and any("é" in t for t in texts)


def test_byte_grammar_accepts_exactly_the_regex(byte_grammar):
  texts = ["ab", "abab", "éabé7", "ab42", "é", "x", "xyzyz", "β", "",
           "a", "aba", "ab123", "xy", "abx", "γγ", "xyzé", "\x00", "ab\n"]
  expected = [bool(re.fullmatch(BYTE_PATTERN, t)) for t in texts]
  assert any(expected) and not all(expected)
  assert accepts(byte_grammar, [list(t.encode()) for t in texts]) == expected


@pytest.mark.parametrize("pattern", ["a|ab", "(?:ab)+c?", "a*b?a"])
def test_small_regex_language_is_exact(pattern):
  # Unanchored, outlines-core's index loses "ab" under a|ab and "abab" under (ab)+.
  g = grammar.from_regex(pattern, grammar.byte_vocab(), eos_token_id=EOS_ID)
  texts = ["".join(p) for n in range(5) for p in itertools.product("abc", repeat=n)]
  expected = [bool(re.fullmatch(pattern, t)) for t in texts]
  assert accepts(g, [list(t.encode()) for t in texts]) == expected


def test_raw_byte_tokens_and_split_characters():
  # Raw bytes, not GPT-2 byte-level strings: "é" arrives whole or as its two UTF-8 bytes.
  vocab = ["é".encode(), b"\xc3", b"\xa9", b"a", "éa".encode(), None, b"<eos>"]
  g = grammar.from_regex("(?:é|a)+", vocab, eos_token_id=6)
  start_allowed = np.flatnonzero(np.asarray(_mask(g, _init(1)))[0])
  np.testing.assert_array_equal(start_allowed, [0, 1, 3, 4])
  assert accepts(g, [[0], [1, 2], [1, 2, 0], [4], [3, 0, 4], [2, 1], [1], [], [5]]) == [
      True, True, True, True, True, False, False, False, False]


def test_json_schema_walks_validate(json_grammar):
  walks = random_walks(json_grammar, num_walks=64, max_steps=60, seed=1)
  assert len(walks) >= 48
  for walk in walks:
    text = b"".join(JSON_VOCAB[t] for t in walk).decode()
    obj = json.loads(text)
    assert isinstance(obj, dict) and set(obj) == {"a"}, text
    assert type(obj["a"]) is int, text
  used = {JSON_VOCAB[t] for walk in walks for t in walk}
  assert {b'{"a":', b"12"} & used  # multi-byte tokens are taken, not just single bytes
  assert not {b"ab", b"}}", "é".encode()} & used


def test_json_schema_accepts_tokenizations(json_grammar):
  ids = {tok: i for i, tok in enumerate(JSON_VOCAB)}
  tok = lambda *parts: [ids[p] for p in parts]  # noqa: E731
  cases = {
      (b'{"a":', b"12", b"}"): True,
      (b"{", b'"a"', b":", b" ", b"-1", b"0", b"}"): True,
      (b"{", b'"', b"a", b'"', b":", b"0", b"}"): True,
      (b'{"a":', b"0", b"1", b"}"): False,  # leading zero
      (b'{"a":', b"1", b"}}"): False,
      (b"{", b"}"): False,
  }
  assert accepts(json_grammar, [tok(*c) for c in cases]) == list(cases.values())


def _all_transitions(g):
  s, v = g.num_states, g.vocab_size
  state_N = jnp.repeat(jnp.arange(s, dtype=jnp.int32), v)
  token_N = jnp.tile(jnp.arange(v, dtype=jnp.int32), s)
  return (np.asarray(_mask(g, jnp.arange(s, dtype=jnp.int32))),
          np.asarray(_advance(g, state_N, token_N)).reshape(s, v))


@pytest.mark.parametrize("build", [
    lambda compact: grammar.from_regex(BYTE_PATTERN, grammar.byte_vocab(), eos_token_id=EOS_ID,
                                       compact=compact),
    lambda compact: grammar.from_json_schema(json.dumps(JSON_SCHEMA), JSON_VOCAB,
                                             eos_token_id=JSON_EOS, compact=compact),
], ids=["bytes", "json"])
def test_dense_and_compact_agree(build):
  dense, compact = build(False), build(True)
  assert not dense.compact and compact.compact
  dense_mask_SxV, dense_next_SxV = _all_transitions(dense)
  compact_mask_SxV, compact_next_SxV = _all_transitions(compact)
  np.testing.assert_array_equal(dense_mask_SxV, compact_mask_SxV)
  np.testing.assert_array_equal(dense_next_SxV, compact_next_SxV)
  np.testing.assert_array_equal(dense.final, compact.final)
  # Allowed non-EOS tokens move to a live state; EOS is allowed exactly in final states.
  eos = dense.eos_token_id
  others = np.arange(dense.vocab_size) != eos
  np.testing.assert_array_equal(dense_mask_SxV[:, others],
                                dense_next_SxV[:, others] != grammar.DONE)
  np.testing.assert_array_equal(dense_mask_SxV[:, eos], dense.final)
  np.testing.assert_array_equal(dense_next_SxV[:, eos], grammar.DONE)
  assert (dense_mask_SxV.sum(-1) >= 1).all()


def test_compact_is_picked_for_large_vocabularies():
  big_vocab = [bytes([b]) for b in range(128)] + [None] * (2**20 - 128)
  g = grammar.from_regex("[a-z]{16}", big_vocab, eos_token_id=2**20 - 1)
  assert g.compact and g.num_states * g.vocab_size >= 2**24
  small = grammar.from_regex("[a-z]{16}", grammar.byte_vocab(), eos_token_id=EOS_ID)
  assert not small.compact
  texts = ["abcdefghijklmnop", "abcdefghijklmno", "abcdefghijklmnoP", "zzzzzzzzzzzzzzzz"]
  assert accepts(g, [list(t.encode()) for t in texts]) == [True, False, False, True]


def test_free_and_constrained_sequences_share_a_batch(byte_grammar):
  state_B = _init(4, jnp.array([True, False, True, False]))
  np.testing.assert_array_equal(state_B, [grammar.START, grammar.FREE] * 2)
  mask_BxV = np.asarray(_mask(byte_grammar, state_B))
  assert mask_BxV[[1, 3]].all()
  assert not mask_BxV[0].all() and mask_BxV[0, ord("a")]
  np.testing.assert_array_equal(mask_BxV[0], mask_BxV[2])
  next_B = _advance(byte_grammar, state_B, jnp.array([ord("a"), BOS_ID, ord("x"), ord("q")]))
  assert next_B[1] == next_B[3] == grammar.FREE
  assert grammar.DONE != next_B[0] != next_B[2] != grammar.DONE
  np.testing.assert_array_equal(_init(3), [grammar.START] * 3)
  with pytest.raises(ValueError, match="shape"):
    grammar.init_grammar_state(3, jnp.array([True, False]))


def test_done_and_dead_states(byte_grammar):
  g = byte_grammar
  done_B = jnp.full((3,), grammar.DONE, jnp.int32)
  np.testing.assert_array_equal(np.flatnonzero(np.asarray(_mask(g, done_B))[0]), [EOS_ID])
  np.testing.assert_array_equal(_advance(g, done_B, jnp.array([EOS_ID, ord("a"), 0])), grammar.DONE)
  # BOS is never allowed, and a disallowed token kills the sequence.
  all_masks = np.asarray(_mask(g, jnp.arange(g.num_states, dtype=jnp.int32)))
  assert not all_masks[:, BOS_ID].any()
  start_B = _init(3)
  assert not np.asarray(_mask(g, start_B))[0, ord("q")]
  np.testing.assert_array_equal(_advance(g, start_B, jnp.array([ord("q"), BOS_ID, EOS_ID])),
                                grammar.DONE)
  final_B = _along(g, _init(1), jnp.array([list(b"ab")]))[:, -1]
  assert g.final[final_B[0]]
  np.testing.assert_array_equal(_advance(g, final_B, jnp.array([EOS_ID])), [grammar.DONE])


def test_apply_mask_and_empty_rows():
  logits_BxV = jax.random.normal(jax.random.key(0), (3, 5))
  mask_BxV = jnp.array([[True, False, True, False, False], [False] * 5, [True] * 5])
  out_BxV = _apply(logits_BxV, mask_BxV)
  np.testing.assert_array_equal(out_BxV[mask_BxV], logits_BxV[mask_BxV])
  np.testing.assert_array_equal(out_BxV[~mask_BxV], jnp.finfo(jnp.float32).min)
  probs_BxV = jax.nn.softmax(out_BxV, axis=-1)
  assert jnp.isfinite(probs_BxV).all()
  np.testing.assert_array_equal(probs_BxV[0, ~mask_BxV[0]], 0.0)
  np.testing.assert_array_equal(_no_token(mask_BxV), [False, True, False])
  assert _apply(logits_BxV.astype(jnp.bfloat16), mask_BxV).dtype == jnp.bfloat16


@pytest.mark.parametrize("pattern, vocab", [
    ("(ab", grammar.byte_vocab()),                   # invalid syntax
    ("a{3,1}", grammar.byte_vocab()),                # invalid repetition
    ("c", [b"a", b"b", None, None]),                 # no token holds "c"
    ("é", [bytes([b]) for b in range(128)] + [None, None]),  # needs bytes >= 0x80
    ("a+b|a+c", [b"a", b"aa", None, None]),          # only a-loops that never finish
])
def test_bad_patterns_raise_naming_the_pattern(pattern, vocab):
  with pytest.raises(ValueError, match=re.escape(repr(pattern))):
    grammar.from_regex(pattern, vocab, eos_token_id=len(vocab) - 1)


def test_bad_builder_arguments_raise():
  with pytest.raises(ValueError, match="nope"):
    grammar.from_json_schema({"type": "nope"}, JSON_VOCAB, eos_token_id=JSON_EOS)
  with pytest.raises(ValueError, match="eos_token_id"):
    grammar.from_regex("a", grammar.byte_vocab(), eos_token_id=258)
