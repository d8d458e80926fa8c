"""What the benchmarks share: sizes, a warm decode step, and the implementations compared with
mtp_jax's `propose`.

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
- Torch: the same math in eager PyTorch on the CPU, same weights, caches updated in place.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import platform
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

try:
  import mtp_jax
except ImportError:  # run as `python benchmarks/x.py` from a checkout that is not pip-installed
  sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
  import mtp_jax
from mtp_jax.blocks import KVCache
from mtp_jax.proposer import ProposerState

K = 3
MAX_LEN = 512
PROMPT_T = 64
SIZES = {
    # demo-like: the byte vocabulary of mtp_jax.data
    "D=256": dict(vocab_size=258, hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=64,
                  intermediate_size=704),
    # weights dominate: 160.5 MB of module weights + a 16.8 MB LM head (float32)
    "D=1024": dict(vocab_size=4096, hidden_size=1024, num_heads=8, num_kv_heads=2, head_dim=128,
                   intermediate_size=2816),
    # for the --quick smoke run
    "D=64": dict(vocab_size=258, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
                 intermediate_size=128),
}


def config(size: str, dtype: str = "float32") -> mtp_jax.MtpConfig:
  # The historical variants chain the pre-norm hidden; the library is compared on the same wiring.
  return mtp_jax.MtpConfig(num_modules=K, dtype=dtype, pass_normed_hidden=False, **SIZES[size])


@dataclasses.dataclass
class Step:
  """One decode step: propose(params, state, hiddens, tokens, num_new, num_drafts=k)."""

  params: mtp_jax.MtpModel
  state: ProposerState
  hiddens: jax.Array  # float32[B, k + 1, D]
  tokens: jax.Array   # int32[B, k + 1]
  num_new: jax.Array  # int32[B], a + 1
  k: int


def warm_step(params: mtp_jax.MtpModel, batch_size: int, k: int, *, seed: int = 0,
              max_len: int = MAX_LEN) -> Step:
  """A prompt call of 32..64 positions per sequence, a verification accepting 0..k drafts, and
  the inputs of the decode step that follows. The prompt call drafts K tokens whatever k is, so
  one compile of it serves every k."""
  cfg = params.cfg
  b, d, v = batch_size, cfg.hidden_size, cfg.vocab_size
  rng = np.random.default_rng(seed)
  state = mtp_jax.init_state(cfg, b, max_len)
  lens = rng.integers(PROMPT_T // 2, PROMPT_T + 1, size=b).astype(np.int32)
  hid = rng.normal(size=(b, PROMPT_T, d)).astype(np.float32)
  toks = rng.integers(0, v, size=(b, PROMPT_T)).astype(np.int32)
  _, state = mtp_jax.propose(params, state, hid, toks, lens, num_drafts=K)
  accepted = rng.integers(0, k + 1, size=b).astype(np.int32)
  state = mtp_jax.after_verify(state, accepted)
  return Step(params, state, jnp.asarray(rng.normal(size=(b, k + 1, d)).astype(np.float32)),
              jnp.asarray(rng.integers(0, v, size=(b, k + 1)).astype(np.int32)),
              jnp.asarray(accepted + 1), k)


def copy_tree(tree):
  return jax.block_until_ready(jax.tree.map(jnp.copy, tree))


@functools.cache
def donated_propose(num_drafts: int):
  """`mtp_jax.propose` under jit with the state donated; one function per k, so runs share compiles."""
  return jax.jit(lambda p, s, h, t, n: mtp_jax.propose(p, s, h, t, n, num_drafts=num_drafts), donate_argnums=1)


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


def _check_plain(cfg):
  if cfg.pass_normed_hidden:
    raise ValueError("the benchmark variants implement pass_normed_hidden=False only")


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
    _check_plain(step.params.cfg)
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
def _scan_propose(graphdef, layers, embed, lm_head, st: StackedState, hiddens, tokens, num_new, *, k):
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
    _check_plain(step.params.cfg)
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
    return _scan_propose(self.graphdef, self.layers, p.embed_tokens, p.lm_head, st, s.hiddens, s.tokens,
                         s.num_new, k=s.k)

  def to_proposer(self, st):
    kv = tuple(KVCache(st.k[i], st.v[i]) for i in range(K))
    return self.step.state.set(kv=kv, tail=tuple(st.ring[1:]), lengths=st.lengths, num_pos=st.num_pos,
                               num_drafted=st.num_drafted, draft_probs=None)


class Torch:
  """Eager PyTorch on the CPU: the same math, same weights, caches and rings updated in place.

  Attention reads only the cache rows below the batch's largest valid row (eager code need not
  keep static shapes); the other rows are masked anyway.
  """

  name = "PyTorch eager (CPU)"

  def __init__(self, step: Step):
    import torch
    self.torch = torch
    cfg = step.params.cfg
    _check_plain(cfg)
    self.cfg, self.step = cfg, step
    self.w = {name: torch.from_numpy(np.array(x, np.float32)).to(self._dtype())
              for name, x in mtp_jax.state_dict(step.params).items()}
    self.inputs = [torch.from_numpy(np.array(x)) for x in (step.hiddens, step.tokens, step.num_new)]

  def _dtype(self):
    return {"float32": self.torch.float32, "bfloat16": self.torch.bfloat16}[self.cfg.dtype]

  def prepare(self, step):
    t = lambda x: self.torch.from_numpy(np.array(x.astype(jnp.float32))).to(self._dtype())
    st = step.state
    return dict(k=[t(c.k) for c in st.kv], v=[t(c.v) for c in st.kv], tail=[t(x) for x in st.tail],
                lengths=self.torch.from_numpy(np.array(st.lengths)).long(),
                num_pos=self.torch.from_numpy(np.array(st.num_pos)).long(),
                num_drafted=self.torch.from_numpy(np.array(st.num_drafted)).long())

  def copy(self, st):
    return {name: ([x.clone() for x in val] if isinstance(val, list) else val.clone()) for name, val in st.items()}

  def to_proposer(self, st):
    j = lambda x: jnp.asarray(x.float().numpy(), self.cfg.jnp_dtype)
    kv = tuple(KVCache(j(k), j(v)) for k, v in zip(st["k"], st["v"]))
    return self.step.state.set(kv=kv, tail=tuple(j(x) for x in st["tail"]),
                               lengths=jnp.asarray(st["lengths"].numpy(), jnp.int32),
                               num_pos=jnp.asarray(st["num_pos"].numpy(), jnp.int32),
                               num_drafted=jnp.asarray(st["num_drafted"].numpy(), jnp.int32), draft_probs=None)

  def _rms(self, x, name):
    x32 = x.float()
    x32 = x32 * self.torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.cfg.rms_norm_eps)
    return (x32 * self.w[name].float()).to(x.dtype)

  def _rope(self, x_BxWxHxDh, pos_BxW):
    torch = self.torch
    half = x_BxWxHxDh.shape[-1] // 2
    inv_freq = self.cfg.rope_theta ** (-torch.arange(half, dtype=torch.float32) / half)
    angle = pos_BxW.float()[..., None] * inv_freq
    cos, sin = torch.cos(angle)[:, :, None], torch.sin(angle)[:, :, None]
    x = x_BxWxHxDh.float()
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).to(x_BxWxHxDh.dtype)

  def _lin(self, x, name):
    return x @ self.w[name + ".weight"].T

  def _block(self, i, x_BxWxD, rows_BxW, valid_BxW, st, s_len):
    torch, cfg, p = self.torch, self.cfg, f"mtp.{i}."
    b, w, _ = x_BxWxD.shape
    hkv, dh = cfg.num_kv_heads, cfg.head_dim
    g = cfg.num_heads // hkv
    a = self._rms(x_BxWxD, p + "input_layernorm.weight")
    pos = rows_BxW + i + 1
    q = self._rope(self._lin(a, p + "self_attn.q_proj").view(b, w, hkv * g, dh), pos)
    k = self._rope(self._lin(a, p + "self_attn.k_proj").view(b, w, hkv, dh), pos)
    v = self._lin(a, p + "self_attn.v_proj").view(b, w, hkv, dh)
    bi, wi = valid_BxW.nonzero(as_tuple=True)
    st["k"][i][bi, rows_BxW[bi, wi]] = k[bi, wi]
    st["v"][i][bi, rows_BxW[bi, wi]] = v[bi, wi]
    kc, vc = st["k"][i][:, :s_len], st["v"][i][:, :s_len]
    scores = torch.einsum("btkgd,bskd->bkgts", q.view(b, w, hkv, g, dh).float(), kc.float()) * dh**-0.5
    mask = torch.arange(s_len)[None, None, :] <= rows_BxW[:, :, None]
    scores = scores.masked_fill(~mask[:, None, None], torch.finfo(torch.float32).min)
    probs = torch.softmax(scores, -1).to(vc.dtype)
    out = torch.einsum("bkgts,bskd->btkgd", probs, vc).reshape(b, w, hkv * g * dh)
    h = x_BxWxD + self._lin(out.to(x_BxWxD.dtype), p + "self_attn.o_proj")
    m = self._rms(h, p + "post_attention_layernorm.weight")
    mlp = self._lin(torch.nn.functional.silu(self._lin(m, p + "mlp.gate_proj")) * self._lin(m, p + "mlp.up_proj"),
                    p + "mlp.down_proj")
    return h + mlp

  def call(self, st):
    with self.torch.inference_mode():
      return self._call(st)

  def _call(self, st):
    torch, kd = self.torch, self.step.k
    hiddens, tokens, num_new = self.inputs
    b, t, _ = hiddens.shape
    num_pos = st["num_pos"]
    new_num_pos = num_pos + num_new
    i_Kx1 = torch.arange(K)[:, None]
    trimmed = (num_pos[None] - i_Kx1).clamp(min=0).minimum(st["lengths"])
    starts = torch.where(st["num_drafted"][None] > 0, trimmed, st["lengths"])
    drafts = torch.zeros((b, K), dtype=torch.long)
    prev_h, prev_start = hiddens.to(self._dtype()), num_pos
    old_tail = [x.clone() for x in st["tail"]]  # module i reads the ring module i - 1 had before this call
    gather = lambda x, idx: torch.gather(x, 1, idx.view(idx.shape + (1,) * (x.ndim - 2)).expand(
        idx.shape + x.shape[2:]))
    lengths = []
    for i in range(K):
      w, start = t + i, starts[i]
      limit = new_num_pos if i < kd else new_num_pos - i
      rows = start[:, None] + torch.arange(w)[None]
      valid = rows < limit[:, None]
      u = rows + i - num_pos[:, None]
      tok = torch.where(u < num_new[:, None], gather(tokens.long(), u.clamp(0, t - 1)),
                        gather(drafts, (u - num_new[:, None]).clamp(0, K - 1)))
      idx = rows - prev_start[:, None]
      h = gather(prev_h, idx.clamp(0, prev_h.shape[1] - 1))
      if i:
        h = torch.where((idx < 0)[..., None], gather(old_tail[i - 1], rows % K), h)
      p = f"mtp.{i}."
      emb = self.w["embed_tokens.weight"][tok]
      x = self._lin(torch.cat([self._rms(emb, p + "enorm.weight"), self._rms(h, p + "hnorm.weight")], -1),
                    p + "eh_proj")
      out = self._block(i, x, rows, valid, st, int(limit.max()))
      if i < K - 1:
        keep = valid & (rows >= limit[:, None] - K)
        bi, wi = keep.nonzero(as_tuple=True)
        st["tail"][i][bi, rows[bi, wi] % K] = out[bi, wi]
      lengths.append(torch.maximum(start, limit))
      if i < kd:
        last = (new_num_pos - 1 - start).clamp(0, w - 1)
        hl = out[torch.arange(b), last]
        logits = self._lin(self._rms(hl, p + "shared_head.norm.weight"), "lm_head").float()
        drafts[:, i] = logits.argmax(-1)
      prev_h, prev_start = out, start
    st["lengths"], st["num_pos"] = torch.stack(lengths), new_num_pos
    st["num_drafted"] = torch.full((b,), kd, dtype=torch.long)
    return drafts[:, :kd].numpy().astype(np.int32), st


VARIANTS = (MtpJax, MtpJaxDirect, ModuleLoop, Scan, Torch)


def torch_available() -> bool:
  try:
    import torch  # noqa: F401
  except ImportError:
    return False
  return True


def machine(with_torch: bool = True) -> str:
  """One line naming the processor, the jax device, torch (optionally) and the load average."""
  cpu = platform.processor() or platform.machine()
  try:
    with open("/proc/cpuinfo") as f:
      cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
  except (OSError, StopIteration):
    pass
  torch_info = ""
  if with_torch and torch_available():
    import torch
    torch_info = f"torch {torch.__version__} ({torch.get_num_threads()} threads); "
  dev = jax.devices()[0]
  return (f"{cpu}, {os.cpu_count()} cores; jax {jax.__version__} on {dev.platform} ({dev.device_kind}); "
          f"{torch_info}load average {os.getloadavg()[0]:.1f}")
