"""Token-level grammar automata as JAX pytrees, for grammar-constrained (speculative) decoding.

A `Grammar` is a DFA over token ids: per state, a packed bitmask of allowed tokens and the
next state for each allowed token. Every sequence in a batch carries an int32 state:

  FREE (-1, any negative)  unconstrained: every token allowed, stays FREE.
  DONE (0)                 after EOS, or after a disallowed token (dead): only EOS allowed.
  START (1)                the grammar's start state; `init_grammar_state` hands it out.

Final states (the text so far is a full match) allow EOS, which leads to DONE. Every state
the builders keep can still reach a final state, so a masked sampler can never get stuck.

Transitions come in two forms with identical results: a dense int32[S, V] table (small
vocabularies such as the byte vocabulary, V = 258) or CSR rows of (token, next state) pairs
sorted by token and looked up by a fixed-step binary search (100k+ token vocabularies).

The builders use outlines-core: its Rust `Index` builds the token-level automaton over an
arbitrary vocabulary of byte strings, and it turns JSON schemas into regexes, so this module
carries no regex engine or JSON-schema compiler of its own.

Shapes: B batch (any leading shape works, e.g. [B, K] for draft positions), V vocabulary,
S states, W = ceil(V / 32) bitmask words, E stored transitions, K tokens along a path.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import outlines_core
from outlines_core.json_schema import build_regex_from_schema

from mtp_jax import validate
from mtp_jax.data import VOCAB_SIZE

FREE = -1
DONE = 0
START = 1

_DENSE_MAX_ENTRIES = 2**24


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Grammar:
  """A token-level DFA; build it with `from_regex` or `from_json_schema`.

  allowed_bits: int32[S, W], bit t % 32 of word t // 32 set iff token t is allowed.
  final: bool[S], EOS allowed (the text so far is a full match; DONE counts as final).
  next_state: int32[S, V] dense table, DONE where disallowed; None in the compact form.
  csr_offsets: int32[S + 1]; state s owns entries csr_offsets[s]:csr_offsets[s + 1] of
    csr_tokens: int32[E] (sorted within each state) and csr_next: int32[E]. None when dense.
  """

  allowed_bits: jax.Array
  final: jax.Array
  next_state: jax.Array | None
  csr_offsets: jax.Array | None
  csr_tokens: jax.Array | None
  csr_next: jax.Array | None
  vocab_size: int = dataclasses.field(metadata=dict(static=True))
  eos_token_id: int = dataclasses.field(metadata=dict(static=True))
  search_steps: int = dataclasses.field(metadata=dict(static=True))  # ceil(log2(max row + 1))

  @property
  def num_states(self) -> int:
    return self.allowed_bits.shape[0]

  @property
  def compact(self) -> bool:
    return self.next_state is None


def init_grammar_state(batch_size: int, constrained: jax.Array | None = None) -> jax.Array:
  """Initial states int32[B]: START where constrained (bool[B]; None means all), else FREE."""
  if constrained is None:
    return jnp.full((batch_size,), START, jnp.int32)
  if jnp.shape(constrained) != (batch_size,):
    raise validate.InvalidValue("constrained", f"constrained must have shape ({batch_size},), got "
                                               f"{jnp.shape(constrained)}")
  return jnp.where(constrained, START, FREE).astype(jnp.int32)


def allowed_mask(grammar: Grammar, state_B: jax.Array) -> jax.Array:
  """Allowed tokens bool[B, V] for states int32[B]; all True for FREE rows."""
  bits_BxW = grammar.allowed_bits[jnp.maximum(state_B, 0)]
  bit_BxWx32 = (bits_BxW[..., None] >> jnp.arange(32, dtype=jnp.int32)) & 1
  mask_BxV = bit_BxWx32.reshape(*state_B.shape, -1)[..., :grammar.vocab_size].astype(bool)
  return mask_BxV | (state_B < 0)[..., None]


def advance(grammar: Grammar, state_B: jax.Array, token_B: jax.Array) -> jax.Array:
  """Next states int32[B] after tokens int32[B] (ids in [0, V)).

  FREE stays FREE. EOS from a final state, and any token from DONE, lead to DONE. A token
  the mask disallows also leads to DONE: the sequence is dead and can only emit EOS.
  """
  safe_B = jnp.maximum(state_B, 0)
  if grammar.compact:
    next_B = _csr_lookup(grammar, safe_B, token_B)
  else:
    next_B = grammar.next_state[safe_B, token_B]
  return jnp.where(state_B < 0, FREE, next_B)


def _csr_lookup(grammar: Grammar, state_B: jax.Array, token_B: jax.Array) -> jax.Array:
  last = grammar.csr_tokens.shape[0] - 1
  end_B = grammar.csr_offsets[state_B + 1]

  def lower_bound_step(_, lo_hi):
    lo_B, hi_B = lo_hi
    mid_B = (lo_B + hi_B) // 2
    right_B = grammar.csr_tokens[jnp.minimum(mid_B, last)] < token_B
    open_B = lo_B < hi_B  # a finished search must not move past its row
    return (jnp.where(open_B & right_B, mid_B + 1, lo_B),
            jnp.where(open_B & ~right_B, mid_B, hi_B))

  lo_B, _ = jax.lax.fori_loop(0, grammar.search_steps, lower_bound_step,
                              (grammar.csr_offsets[state_B], end_B))
  at_B = jnp.minimum(lo_B, last)
  found_B = (lo_B < end_B) & (grammar.csr_tokens[at_B] == token_B)
  return jnp.where(found_B, grammar.csr_next[at_B], DONE)


def states_along(grammar: Grammar, state_B: jax.Array, tokens_BxK: jax.Array) -> jax.Array:
  """States int32[B, K + 1] before each of the tokens int32[B, K] and after the last one.

  Column k is the state whose `allowed_mask` constrains position k: for K drafted tokens,
  the masks of the K + 1 positions the target model verifies.
  """
  def step(state, token):
    nxt = advance(grammar, state, token)
    return nxt, nxt

  _, after_KxB = jax.lax.scan(step, state_B, jnp.moveaxis(tokens_BxK, -1, 0))
  return jnp.concatenate([state_B[..., None], jnp.moveaxis(after_KxB, 0, -1)], axis=-1)


def apply_mask(logits_BxV: jax.Array, mask_BxV: jax.Array) -> jax.Array:
  """Logits float[B, V] with disallowed entries (mask bool[B, V] False) at the dtype's minimum.

  The finite minimum still gives disallowed tokens exactly zero probability next to any
  allowed finite logit, and an all-disallowed row stays NaN-free (see `no_allowed_token`).
  """
  return jnp.where(mask_BxV, logits_BxV, jnp.finfo(logits_BxV.dtype).min)


def no_allowed_token(mask_BxV: jax.Array) -> jax.Array:
  """bool[B]: rows of mask bool[B, V] that allow nothing; the caller should emit EOS there.

  A grammar mask alone always allows something (DONE allows EOS); this catches the mask
  after it is combined with other constraints (top-k, a draft's support, padded vocab).
  """
  return ~jnp.any(mask_BxV, axis=-1)


def token_mask(grammar: Grammar, state_B: jax.Array, vocab_size: int) -> jax.Array:
  """The mask bool[B, vocab_size] to apply to a model's logits at states int32[B].

  vocab_size: the model's vocabulary, >= grammar.vocab_size (models often pad theirs); tokens
    past the grammar's vocabulary are allowed for FREE rows only. A constrained row whose mask
    allows nothing (possible only for a hand-built Grammar) allows EOS alone, so the sequence
    ends there; `advance` over that EOS leads to DONE.
  """
  if vocab_size < grammar.vocab_size:
    raise validate.InvalidValue("vocab_size", f"vocab_size {vocab_size} is smaller than the grammar's vocabulary "
                                              f"({grammar.vocab_size} tokens)")
  mask_BxG = allowed_mask(grammar, state_B)
  pad_BxP = jnp.broadcast_to((state_B < 0)[..., None],
                             (*state_B.shape, vocab_size - grammar.vocab_size))
  mask_BxV = jnp.concatenate([mask_BxG, pad_BxP], axis=-1)
  eos_V = jnp.arange(vocab_size) == grammar.eos_token_id
  return jnp.where(no_allowed_token(mask_BxV)[..., None], eos_V, mask_BxV)


def union(grammars: Sequence[Grammar]) -> tuple[Grammar, list[int]]:
  """(one Grammar holding all of `grammars`, offsets): a batch whose rows follow different grammars
  runs one program. DONE is shared; grammar g's state s >= START is offsets[g] + s in the union,
  so a row under g starts at offsets[g] + START. States (and CSR entries) are padded to a power of
  two with unreachable rows, so the union's shapes, and a step compiled for them, change rarely.

  The grammars must share vocab_size and eos_token_id (refused by name otherwise). The union is
  dense when every grammar is and the table stays small, else CSR.
  """
  if isinstance(grammars, Grammar) or not isinstance(grammars, Sequence) or not grammars:
    raise validate.InvalidType("grammars", "grammars must be a non-empty list of Grammar")
  for i, g in enumerate(grammars):
    validate.instance(f"grammars[{i}]", g, Grammar, "a mtp_jax.grammar.Grammar")
    if (g.vocab_size, g.eos_token_id) != (grammars[0].vocab_size, grammars[0].eos_token_id):
      raise validate.InvalidValue(f"grammars[{i}]", f"grammars[{i}] has vocab_size={g.vocab_size}, eos_token_id="
                                                    f"{g.eos_token_id}; grammars[0] has {grammars[0].vocab_size}, "
                                                    f"{grammars[0].eos_token_id}")
  v = grammars[0].vocab_size
  offsets = [int(x) for x in np.cumsum([0] + [g.num_states - 1 for g in grammars[:-1]])]
  used = 1 + sum(g.num_states - 1 for g in grammars)
  num_states = max(16, 1 << (used - 1).bit_length())
  pad = num_states - used
  shift = lambda d, off: np.where(d > DONE, d + off, d).astype(np.int32)
  bits = np.concatenate([np.asarray(grammars[0].allowed_bits[:1])] + [np.asarray(g.allowed_bits[1:]) for g in grammars]
                        + [np.zeros((pad, grammars[0].allowed_bits.shape[1]), np.int32)])
  final = np.concatenate([[True]] + [np.asarray(g.final[1:]) for g in grammars] + [np.zeros(pad, bool)])
  common = dict(allowed_bits=jnp.asarray(bits), final=jnp.asarray(final), vocab_size=v,
                eos_token_id=grammars[0].eos_token_id)
  if all(not g.compact for g in grammars) and num_states * v < _DENSE_MAX_ENTRIES:
    table = np.concatenate([np.asarray(grammars[0].next_state[:1])] +
                           [shift(np.asarray(g.next_state[1:]), off) for g, off in zip(grammars, offsets)] +
                           [np.full((pad, v), DONE, np.int32)])
    return Grammar(**common, next_state=jnp.asarray(table), csr_offsets=None, csr_tokens=None, csr_next=None,
                   search_steps=0), offsets
  rows_tok, rows_next = [], []  # per union state: its sorted tokens and next states
  for gi, (g, off) in enumerate(zip(grammars, offsets)):
    for st in range(0 if gi == 0 else 1, g.num_states):
      if g.compact:
        lo, hi = int(g.csr_offsets[st]), int(g.csr_offsets[st + 1])
        tok, nxt = np.asarray(g.csr_tokens[lo:hi]), np.asarray(g.csr_next[lo:hi])
      else:
        word = np.asarray(g.allowed_bits[st]).view(np.uint32)
        tok = np.flatnonzero((word[np.arange(v) // 32] >> (np.arange(v) % 32).astype(np.uint32)) & 1)
        nxt = np.asarray(g.next_state[st])[tok]
      rows_tok.append(tok.astype(np.int32))
      rows_next.append(shift(nxt, off))
  lengths = [len(t) for t in rows_tok] + [0] * pad
  entries = sum(lengths)
  size = max(16, 1 << (entries - 1).bit_length())
  fill = lambda rows: jnp.asarray(np.concatenate(rows + [np.zeros(size - entries, np.int32)]).astype(np.int32))
  return Grammar(**common, next_state=None, csr_offsets=jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]),
                                                                    jnp.int32),
                 csr_tokens=fill(rows_tok), csr_next=fill(rows_next),
                 search_steps=int(max(lengths)).bit_length()), offsets


def byte_vocab() -> list[bytes | None]:
  """The byte tokenizer's vocabulary (mtp_jax.data), V = 258: ids 0..255 are single bytes.

  BOS_ID and EOS_ID are None (never text); build with eos_token_id=mtp_jax.data.EOS_ID.
  """
  return [bytes([b]) for b in range(256)] + [None] * (VOCAB_SIZE - 256)


def from_regex(pattern: str, vocab: Sequence[bytes | None], *, eos_token_id: int,
               compact: bool | None = None) -> Grammar:
  """Grammar accepting token sequences whose concatenated bytes fully match `pattern`.

  pattern: Rust `regex` syntax (as outlines-core), matched against the whole text.
  vocab: token byte strings indexed by token id; None (special tokens such as BOS) and the
    entry at eos_token_id are never allowed as text. `byte_vocab()` for the byte tokenizer.
  eos_token_id: an int in 0..len(vocab)-1.
  compact: CSR transitions; None picks dense when S * V < 2**24.
  Raises validate.InvalidType / InvalidValue naming the argument: a pattern that is not a str, is
  invalid or cannot be matched by any token sequence; a vocab entry that is not bytes or None;
  an eos_token_id outside the vocabulary.
  """
  validate.instance("pattern", pattern, str, "a str (a regex)")
  ids_by_token, eos_token_id = _ids_by_token(vocab, eos_token_id)
  compact = None if compact is None else validate.flag("compact", compact)
  try:
    # outlines-core takes raw bytes keys as they are (only from_pretrained decodes
    # GPT-2 byte-level strings). Anchoring at the end of text makes a match reportable
    # only there; unanchored, its index drops tokens that continue past a possible match
    # ("abab" under (ab)+, "ab" under a|ab).
    index = outlines_core.Index(f"(?:{pattern})\\z",
                                outlines_core.Vocabulary(eos_token_id, ids_by_token))
  except Exception as e:  # pyo3 maps Rust errors to several exception types
    # outlines-core cannot anchor a pattern that matches the empty string ("a*", "(abc)?", "").
    # Prefixed with a NUL byte it can; an extra token id V holding just that byte leads from
    # the index's initial state to the state after the prefix, which becomes START (final, so
    # EOS is allowed at once).
    sentinel = dict(ids_by_token)
    sentinel[b"\x00"] = sentinel.get(b"\x00", []) + [len(vocab)]
    try:
      index = outlines_core.Index(f"\\x00(?:{pattern})\\z", outlines_core.Vocabulary(eos_token_id, sentinel))
    except Exception:
      raise validate.InvalidValue("pattern", f"cannot build a grammar for pattern {pattern!r}: {e}") from e
    return _from_index(index, pattern, len(vocab), eos_token_id, compact, start_token=len(vocab))
  return _from_index(index, pattern, len(vocab), eos_token_id, compact)


def from_json_schema(schema: str | dict, vocab: Sequence[bytes | None], *, eos_token_id: int,
                     whitespace_pattern: str | None = None,
                     compact: bool | None = None) -> Grammar:
  """Grammar accepting JSON texts valid under `schema`; other arguments as `from_regex`.

  schema: a JSON text or a dict (a JSON object); an invalid one raises validate.InvalidValue
    naming "schema".
  whitespace_pattern: regex for the whitespace allowed between JSON tokens (outlines-core's
    default when None).
  """
  if isinstance(schema, dict):
    try:
      schema_json = json.dumps(schema)
    except (TypeError, ValueError) as e:
      raise validate.InvalidValue("schema", f"schema must be JSON-serialisable: {e}") from e
  else:
    schema_json = validate.instance("schema", schema, str, "a JSON text (str) or a dict")
  if whitespace_pattern is not None:
    validate.instance("whitespace_pattern", whitespace_pattern, str, "a str (a regex) or None")
  try:
    pattern = build_regex_from_schema(schema_json, whitespace_pattern)
  except Exception as e:
    raise validate.InvalidValue("schema", f"cannot turn JSON schema {schema_json!r} into a regex: {e}") from e
  return from_regex(pattern, vocab, eos_token_id=eos_token_id, compact=compact)


def _ids_by_token(vocab, eos_token_id) -> tuple[dict[bytes, list[int]], int]:
  """(token byte strings -> their ids, leaving out None entries, empty ones and eos; eos_token_id),
  vocab and eos_token_id checked."""
  if isinstance(vocab, (str, bytes)) or not isinstance(vocab, Sequence):
    raise validate.InvalidType("vocab", f"vocab must be a list of bytes (or None) indexed by token id, "
                                        f"got {type(vocab).__name__}")
  if not vocab:
    raise validate.InvalidValue("vocab", "vocab must not be empty")
  eos_token_id = validate.integer("eos_token_id", eos_token_id, 0, len(vocab) - 1)
  ids_by_token: dict[bytes, list[int]] = {}
  for token_id, token in enumerate(vocab):
    if token is not None and not isinstance(token, (bytes, bytearray)):
      raise validate.InvalidType(f"vocab[{token_id}]", f"vocab[{token_id}] must be bytes or None, got {token!r} "
                                                       f"({type(token).__name__}); encode str tokens to bytes")
    if token and token_id != eos_token_id:
      ids_by_token.setdefault(bytes(token), []).append(token_id)
  return ids_by_token, eos_token_id


def _from_index(index, pattern: str, vocab_size: int, eos_token_id: int,
                compact: bool | None, start_token: int | None = None) -> Grammar:
  """start_token: a token past the vocabulary whose transition from the index's initial state
  leads to the grammar's START (see from_regex); its edges and that initial state are dropped."""
  raw = index.get_transitions()
  initial = index.get_initial_state()
  if start_token is not None:
    initial = raw.pop(initial)[start_token]
  transitions = {s: {t: d for t, d in row.items() if t != eos_token_id and t < vocab_size}
                 for s, row in raw.items()}
  finals = set(index.get_final_states())
  live = _states_that_can_finish(transitions, finals)
  if initial not in live:
    raise validate.InvalidValue("pattern", f"pattern {pattern!r} cannot be matched by any token sequence "
                                           "over this vocabulary")

  order = [initial] + sorted(live - {initial})
  ids = {s: i + START for i, s in enumerate(order)}
  num_states = len(order) + 1
  final = np.zeros(num_states, bool)
  final[DONE] = True
  final[[ids[s] for s in finals & live]] = True
  edges = [(ids[s], t, ids[d]) for s in order for t, d in transitions.get(s, {}).items()
           if d in live]
  edges += [(s, eos_token_id, DONE) for s in np.flatnonzero(final)]
  src, tok, dst = (np.asarray(column, np.int64) for column in zip(*edges))

  bits = np.zeros((num_states, -(-vocab_size // 32)), np.uint32)
  np.bitwise_or.at(bits, (src, tok // 32), (np.uint32(1) << (tok % 32).astype(np.uint32)))
  if compact is None:
    compact = num_states * vocab_size >= _DENSE_MAX_ENTRIES
  if compact:
    by_state_token = np.lexsort((tok, src))
    row_lengths = np.bincount(src, minlength=num_states)
    transition_arrays = dict(
        next_state=None,
        csr_offsets=jnp.asarray(np.concatenate([[0], np.cumsum(row_lengths)]), jnp.int32),
        csr_tokens=jnp.asarray(tok[by_state_token], jnp.int32),
        csr_next=jnp.asarray(dst[by_state_token], jnp.int32))
    search_steps = int(row_lengths.max()).bit_length()
  else:
    table = np.full((num_states, vocab_size), DONE, np.int32)
    table[src, tok] = dst
    transition_arrays = dict(next_state=jnp.asarray(table), csr_offsets=None, csr_tokens=None,
                             csr_next=None)
    search_steps = 0
  return Grammar(allowed_bits=jnp.asarray(bits.view(np.int32)), final=jnp.asarray(final),
                 **transition_arrays, vocab_size=vocab_size, eos_token_id=eos_token_id,
                 search_steps=search_steps)


def _states_that_can_finish(transitions: dict[int, dict[int, int]], finals: set[int]) -> set[int]:
  # outlines-core keeps states that can never reach a final one (e.g. the a-loop of a+b
  # when no token holds "b"); a sampler following the mask would be trapped there.
  sources: dict[int, set[int]] = {}
  for s, row in transitions.items():
    for d in row.values():
      sources.setdefault(d, set()).add(s)
  live, frontier = set(finals), list(finals)
  while frontier:
    for s in sources.get(frontier.pop(), ()):
      if s not in live:
        live.add(s)
        frontier.append(s)
  return live
