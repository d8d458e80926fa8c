"""The implementations compared with mtp_jax's `propose`, and (from `decode_setup.py`) what the
benchmarks share: sizes, a warm decode step, the machine line.

A decode step is the call a serving loop makes after each verification: the chain catches up on
the a + 1 newly verified positions (a accepted drafts, ragged over the batch) and drafts k tokens,
with hiddens/tokens padded to T = k + 1. Every variant runs that step from the same warm state
(a prompt of 32..64 positions, then a random verification) and must give mtp_jax's drafts.

Variants (each with a native state: `prepare(step)`, `copy(native)`, `call(native) ->
(int32[B, k] drafts, native state)`, `to_proposer(native)`):
- MtpJax: `mtp_jax.propose` under the caller's `jax.jit`, state donated (the serving form).
- MtpJaxDirect: `mtp_jax.propose` called directly (eager value checks + the library's jit).
- ModuleLoop: one jitted call per module from a Python loop (the naive port of a per-module loop).
- Scan: `lax.scan` over the K modules' params stacked with `jax.tree.map(jnp.stack)` (the rejected
  design): one uniform window of T + K - 1 rows per module and caches stacked [K, B, L, Hkv, Dh].
- Torch (`variants_torch.py`): the same math in eager PyTorch on the CPU, same weights, caches
  updated in place.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from decode_setup import K, Step, check_plain, copy_tree, donated_propose, mtp_jax
# The scripts read the shared setup through this module too (`import variants as V`; `V.config(...)`).
from decode_setup import MAX_LEN, PROMPT_T, SIZES, config, machine, torch_available, warm_step  # noqa: F401
from mtp_jax.blocks import KVCache
from variants_torch import Torch


class MtpJax:
  name = "mtp_jax propose (jit, state donated)"

  def __init__(self, step: Step):
    self.step = step
    self.fn = donated_propose(step.k)

  def prepare(self, step):
    return step.state

  copy = staticmethod(copy_tree)

  def call(self, state):
    s = self.step
    return self.fn(s.params, state, s.hiddens, s.tokens, s.num_new)

  def to_proposer(self, state):
    return state


class MtpJaxDirect(MtpJax):
  name = "mtp_jax.propose, direct call"

  def call(self, state):
    s = self.step
    return mtp_jax.propose(s.params, state, s.hiddens, s.tokens, s.num_new, num_drafts=s.k)


# ---- the chain's module body, written out once for the loop and the scan variants ----

def _gather_rows(x_BxTx, idx_BxW):
  return jnp.take_along_axis(x_BxTx, idx_BxW.reshape(idx_BxW.shape + (1,) * (x_BxTx.ndim - 2)), axis=1)


def _module_rows(layer, embed, cache, ring_prev_BxRxD, prev_h_BxPxD, prev_start_B, drafts_BxK, tokens_BxT,
                 num_pos_B, num_new_B, start_B, limit_B, i, w):
  """Module i over rows start..start+w-1: reads t_{j+i+1} (verified token or earlier draft) and
  h^i_j (previous depth in this call, or its ring from an earlier call); writes its KV rows.

  Returns (h dtype[B, w, D], valid bool[B, w], rows int32[B, w], new KVCache).
  """
  t = tokens_BxT.shape[1]
  rows_BxW = start_B[:, None] + jnp.arange(w, dtype=jnp.int32)[None]
  valid_BxW = rows_BxW < limit_B[:, None]
  u_BxW = rows_BxW + i - num_pos_B[:, None]
  tok_BxW = jnp.where(u_BxW < num_new_B[:, None], _gather_rows(tokens_BxT, jnp.clip(u_BxW, 0, t - 1)),
                      _gather_rows(drafts_BxK, jnp.clip(u_BxW - num_new_B[:, None], 0, K - 1)))
  idx_BxW = rows_BxW - prev_start_B[:, None]
  h_BxWxD = jnp.where((idx_BxW < 0)[..., None], _gather_rows(ring_prev_BxRxD, rows_BxW % K),
                      _gather_rows(prev_h_BxPxD, jnp.clip(idx_BxW, 0, prev_h_BxPxD.shape[1] - 1)))
  out_BxWxD, cache = layer(embed(tok_BxW), h_BxWxD, rows_BxW, valid_BxW, cache, rope_offset=i + 1)
  return out_BxWxD, valid_BxW, rows_BxW, cache


def _write_ring(tail_BxRxD, h_BxWxD, rows_BxW, valid_BxW, limit_B):
  keep_BxW = valid_BxW & (rows_BxW >= limit_B[:, None] - K)
  slot_BxW = jnp.where(keep_BxW, rows_BxW % K, K)
  b_idx = jnp.arange(h_BxWxD.shape[0])[:, None]
  return tail_BxRxD.at[b_idx, slot_BxW].set(h_BxWxD.astype(tail_BxRxD.dtype), mode="drop")


def _draft(layer, lm_head, h_BxWxD, new_num_pos_B, start_B):
  last_B = jnp.clip(new_num_pos_B - 1 - start_B, 0, h_BxWxD.shape[1] - 1)
  logits_BxV = lm_head(layer.shared_head_norm(_gather_rows(h_BxWxD, last_B[:, None])[:, 0]))
  return jnp.argmax(logits_BxV.astype(jnp.float32), axis=-1).astype(jnp.int32)


@jax.jit
def _start_lengths(state):
  """Lengths a decode step starts from: unsettled drafts count as all rejected."""
  i_Kx1 = jnp.arange(K, dtype=jnp.int32)[:, None]
  trimmed = jnp.maximum(0, jnp.minimum(state.lengths, state.num_pos[None] - i_Kx1))
  return tuple(jnp.where(state.num_drafted[None] > 0, trimmed, state.lengths))


@functools.partial(jax.jit, static_argnames=("i", "drafting"), donate_argnames=("cache",))
def _module_call(layer, embed, lm_head, cache, ring_prev, tail, prev_h, prev_start, drafts, tokens, num_pos,
                 num_new, start, *, i, drafting):
  new_num_pos = num_pos + num_new
  limit = new_num_pos if drafting else new_num_pos - i
  out, valid, rows, cache = _module_rows(layer, embed, cache, ring_prev, prev_h, prev_start, drafts, tokens,
                                         num_pos, num_new, start, limit, i, tokens.shape[1] + i)
  if tail is not None:
    tail = _write_ring(tail, out, rows, valid, limit)
  if drafting:
    drafts = drafts.at[:, i].set(_draft(layer, lm_head, out, new_num_pos, start))
  return out, cache, tail, jnp.maximum(start, limit), drafts


@functools.partial(jax.jit, static_argnames=("k",), donate_argnames=("state",))
def _finish(state, lengths, num_new, drafts, *, k):
  b = state.batch_size
  return drafts[:, :k], state.set(lengths=jnp.stack(lengths), num_pos=state.num_pos + num_new,
                                  num_drafted=jnp.full((b,), k, jnp.int32))


class ModuleLoop(MtpJax):
  name = "per-module jit, Python loop"

  def __init__(self, step: Step):
    check_plain(step.params.cfg)
    self.step = step
    b, d = step.hiddens.shape[0], step.hiddens.shape[2]
    self.no_ring = jnp.zeros((b, K, d), step.params.cfg.jnp_dtype)

  def call(self, state):
    s, p = self.step, self.step.params
    starts = _start_lengths(state)
    drafts = jnp.zeros((state.batch_size, K), jnp.int32)
    prev_h, prev_start = s.hiddens.astype(p.cfg.jnp_dtype), state.num_pos
    kv, tail, lengths = [], [], []
    for i in range(K):
      ring_prev = state.tail[i - 1] if i else self.no_ring
      prev_h, cache, new_tail, length, drafts = _module_call(
          p.layers[i], p.embed_tokens, p.lm_head, state.kv[i], ring_prev, state.tail[i] if i < K - 1 else None,
          prev_h, prev_start, drafts, s.tokens, state.num_pos, s.num_new, starts[i], i=i, drafting=i < s.k)
      prev_start = starts[i]
      kv.append(cache)
      tail.append(new_tail)
      lengths.append(length)
    return _finish(state.set(kv=tuple(kv), tail=tuple(tail[:-1])), tuple(lengths), s.num_new, drafts, k=s.k)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StackedState:
  """The scan's state: k, v dtype[K, B, L, Hkv, Dh]; ring dtype[K, B, K, D] (module i reads ring[i],
  the hiddens of module i - 1; ring[0] is unused); lengths int32[K, B]; num_pos, num_drafted int32[B]."""

  k: jax.Array
  v: jax.Array
  ring: jax.Array
  lengths: jax.Array
  num_pos: jax.Array
  num_drafted: jax.Array


@functools.partial(jax.jit, static_argnames=("graphdef", "k"), donate_argnames=("st",))
def scan_propose(graphdef, layers, embed, lm_head, st: StackedState, hiddens, tokens, num_new, *, k):
  b, t, _ = hiddens.shape
  w = t + K - 1
  pending = st.num_drafted[None] > 0
  i_Kx1 = jnp.arange(K, dtype=jnp.int32)[:, None]
  starts_KxB = jnp.where(pending, jnp.maximum(0, jnp.minimum(st.lengths, st.num_pos[None] - i_Kx1)), st.lengths)
  new_num_pos = st.num_pos + num_new

  def body(carry, xs):
    prev_h, prev_start, drafts = carry
    layer_state, ck, cv, ring_prev, own_ring, start, i = xs
    layer = nnx.merge(graphdef, layer_state)
    drafting = i < k
    limit = jnp.where(drafting, new_num_pos, new_num_pos - i)
    out, valid, rows, cache = _module_rows(layer, embed, KVCache(ck, cv), ring_prev, prev_h, prev_start, drafts,
                                           tokens, st.num_pos, num_new, start, limit, i, w)
    ring = _write_ring(own_ring, out, rows, valid, limit)
    d = jax.lax.cond(drafting, lambda: _draft(layer, lm_head, out, new_num_pos, start),
                     lambda: jnp.zeros((b,), jnp.int32))
    drafts = drafts.at[:, i].set(d)
    return (out, start, drafts), (cache.k, cache.v, ring, jnp.maximum(start, limit))

  h0 = jnp.pad(hiddens.astype(embed.weight[...].dtype), ((0, 0), (0, w - t), (0, 0)))
  carry = (h0, st.num_pos, jnp.zeros((b, K), jnp.int32))
  # Module i reads ring[i] (old hiddens of module i - 1) and rewrites ring[i + 1], its own; the
  # new rings go to the outputs so that module i + 1 still reads the old one.
  own_ring = jnp.concatenate([st.ring[1:], st.ring[:1]], axis=0)
  (_, _, drafts), (nk, nv, new_ring, lengths) = jax.lax.scan(
      body, carry, (layers, st.k, st.v, st.ring, own_ring, starts_KxB, jnp.arange(K, dtype=jnp.int32)))
  ring = jnp.concatenate([st.ring[:1], new_ring[:-1]], axis=0)
  return drafts[:, :k], StackedState(nk, nv, ring, lengths, new_num_pos, jnp.full((b,), k, jnp.int32))


class Scan(MtpJax):
  name = "lax.scan over stacked params"

  def __init__(self, step: Step):
    check_plain(step.params.cfg)
    self.step = step
    p = step.params
    splits = [nnx.split(layer) for layer in p.layers]
    self.graphdef = splits[0][0]
    self.layers = jax.tree.map(lambda *x: jnp.stack(x), *[s for _, s in splits])

  def prepare(self, step):
    st = step.state
    ring = jnp.stack([jnp.zeros_like(st.tail[0])] + list(st.tail))
    return StackedState(jnp.stack([c.k for c in st.kv]), jnp.stack([c.v for c in st.kv]), ring, st.lengths,
                        st.num_pos, st.num_drafted)

  def call(self, st):
    s, p = self.step, self.step.params
    return scan_propose(self.graphdef, self.layers, p.embed_tokens, p.lm_head, st, s.hiddens, s.tokens,
                         s.num_new, k=s.k)

  def to_proposer(self, st):
    kv = tuple(KVCache(st.k[i], st.v[i]) for i in range(K))
    return self.step.state.set(kv=kv, tail=tuple(st.ring[1:]), lengths=st.lengths, num_pos=st.num_pos,
                               num_drafted=st.num_drafted, draft_probs=None)


VARIANTS = (MtpJax, MtpJaxDirect, ModuleLoop, Scan, Torch)
