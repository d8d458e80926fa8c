"""The PyTorch variant of `variants.py`: the decode step's math in eager PyTorch on the CPU, from the
same weights and warm state as the jax variants. PyTorch is imported when a `Torch` is built, so the
other variants run without it."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from decode_setup import K, Step, check_plain, mtp_jax
from mtp_jax.blocks import KVCache


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
    check_plain(cfg)
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
