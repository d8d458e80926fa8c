"""Multi-head latent attention (DeepSeek-V2/V3, LongCat) over a latent cache (`MlaCache` or its
paged form `PagedMlaCache`, read through `LayerCache.keys`).

Per row the cache holds the compressed latent c = kv_a_layernorm(.) dtype[R] (times kv_lora_scale,
LongCat's, so prefill and decode read the same scaled latent) and one rope key
shared by all heads dtype[Dr]; kv_b_proj expands c into per-head keys (Dn) and values (Dv).

Two equal forms (tests/test_blocks.py checks they agree):
  expanded: k = [W_uk c | k_rope], v = W_uv c for every key, then ordinary attention;
  absorbed: W_uk folds into the query (q_lat = q_nope W_uk, scores q_lat . c + q_rope . k_rope)
    and W_uv into the output (out = (probs @ c) W_uv), so keys are never expanded and a step
    reads only the R + Dr numbers per cached row. DeepSeek's inference code decodes this way.
A call takes the form with fewer flops for its T rows (absorbed for decode and short chunks).

With cfg.attention_head_gate (Bailing / Ling), g_proj dtype[H, D] gives one logit per head from the
layer's normed input, and head h's attention output is scaled by sigmoid(logit_h) before o_proj.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from mtp_jax.blocks import cache as cache_lib
from mtp_jax.blocks.masks import TreeRows, attention_probs
from mtp_jax.blocks.linear import Linear
from mtp_jax.blocks.norms import RMSNorm
from mtp_jax.blocks.rope import apply_rope, inv_frequencies, yarn_mscale
from mtp_jax.config import BlockConfig

_LORA_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm: DeepSeek-V3 leaves them at the default eps


class MlaAttention(nnx.Module):
  """MLA with RoPE on the last qk_rope_head_dim dims of each head; caches `MlaCache` rows."""

  def __init__(self, cfg: BlockConfig, *, rngs: nnx.Rngs):
    m, d, h, dt = cfg.mla, cfg.hidden_size, cfg.num_heads, cfg.jnp_dtype
    dq = m.qk_nope_head_dim + m.qk_rope_head_dim
    lin = lambda i, o, axes, bias=False: Linear(i, o, axes=axes, bias=bias, dtype=dt, rngs=rngs)
    if m.q_lora_rank is None:
      self.q_proj = lin(d, h * dq, ("heads", "embed"))
      self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
    else:
      self.q_proj = None
      self.q_a_proj = lin(d, m.q_lora_rank, ("q_lora", "embed"), cfg.attention_bias)
      self.q_a_layernorm = RMSNorm(m.q_lora_rank, eps=_LORA_NORM_EPS, dtype=dt, axis="q_lora")
      self.q_b_proj = lin(m.q_lora_rank, h * dq, ("heads", "q_lora"))
    # The latent (and the shared rope key) feeds every head: never split.
    self.kv_a_proj_with_mqa = lin(d, m.kv_lora_rank + m.qk_rope_head_dim, ("kv_lora", "embed"), cfg.attention_bias)
    self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, eps=_LORA_NORM_EPS, dtype=dt, axis="kv_lora")
    self.kv_b_proj = lin(m.kv_lora_rank, h * (m.qk_nope_head_dim + m.v_head_dim), ("heads", "kv_lora"))
    self.o_proj = lin(h * m.v_head_dim, d, ("embed", "heads"), cfg.attention_bias)
    self.g_proj = lin(d, h, ("heads", "embed")) if cfg.attention_head_gate else None
    self.num_heads, self.mla, self.window = h, m, cfg.sliding_window
    inv_freq, self.rope_factor = inv_frequencies(cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling)
    self.inv_freq, self.interleave = tuple(inv_freq.tolist()), cfg.rope_interleave
    scale = dq**-0.5
    if cfg.rope_scaling is not None and cfg.rope_scaling.mscale_all_dim:
      # DeepSeek-V3: YaRN's magnitude correction enters the softmax scale squared.
      scale *= yarn_mscale(cfg.rope_scaling.scale, cfg.rope_scaling.mscale_all_dim) ** 2
    self.scale = scale

  def absorbs(self, t: int) -> bool:
    """Whether T query rows take the absorbed form: fewer flops when T < R (Dn + Dv) / (2R - Dn - Dv)."""
    m = self.mla
    r, dnv = m.kv_lora_rank, m.qk_nope_head_dim + m.v_head_dim
    return 2 * r <= dnv or t * (2 * r - dnv) < r * dnv

  def __call__(self, x_BxTxD, rows_BxT, valid_BxT, cache: cache_lib.MlaCache | None, rope_offset: int = 0,
               tree: TreeRows | None = None, *, absorb: bool | None = None):
    """As `Attention.__call__`; absorb picks the form (default by `absorbs(T)`)."""
    q_nope, q_rope, latent_BxTxR, k_rope_BxTxDr, _ = self.project(x_BxTxD, rows_BxT + rope_offset)
    # The latent is MLA's value too: rows no query may read come back zeroed (see readable_rows).
    new_cache, (latent_BxSxR, k_rope_BxSxDr), mask_BxTxS = cache_lib.or_none(cache).keys(
        rows_BxT, valid_BxT, (latent_BxTxR, k_rope_BxTxDr), value=0, window=self.window, tree=tree)
    gate_BxTxH = None if self.g_proj is None else jax.nn.sigmoid(self.g_proj(x_BxTxD))
    out = self.attend(q_nope, q_rope, latent_BxSxR, k_rope_BxSxDr, mask_BxTxS, x_BxTxD.dtype, absorb=absorb,
                      gate_BxTxH=gate_BxTxH)
    return out, new_cache

  def project(self, x_BxTxD, pos_BxT):
    """This call's rows, rotated at positions int32[B, T]: (q_nope dtype[B, T, H, Dn], q_rope
    dtype[B, T, H, Dr], latent dtype[B, T, R], k_rope dtype[B, T, Dr], the normed q LoRA
    dtype[B, T, Rq] or None without one; DSA's indexer reads it)."""
    b, t, _ = x_BxTxD.shape
    m, h = self.mla, self.num_heads
    rope = lambda a: apply_rope(a, pos_BxT, self.inv_freq, interleave=self.interleave,
                                attention_factor=self.rope_factor)
    q_resid = None
    if self.q_proj is not None:
      q = self.q_proj(x_BxTxD)
    else:
      q_resid = self.q_a_layernorm(self.q_a_proj(x_BxTxD))
      q = self.q_b_proj(q_resid)
    if m.q_lora_scale != 1.0:
      q = q * jnp.asarray(m.q_lora_scale, q.dtype)
    q = q.reshape(b, t, h, m.qk_nope_head_dim + m.qk_rope_head_dim)
    kv = self.kv_a_proj_with_mqa(x_BxTxD)
    latent_BxTxR = self.kv_a_layernorm(kv[..., :m.kv_lora_rank])
    if m.kv_lora_scale != 1.0:
      latent_BxTxR = latent_BxTxR * jnp.asarray(m.kv_lora_scale, latent_BxTxR.dtype)
    k_rope_BxTxDr = rope(kv[..., None, m.kv_lora_rank:])[:, :, 0]
    return q[..., :m.qk_nope_head_dim], rope(q[..., m.qk_nope_head_dim:]), latent_BxTxR, k_rope_BxTxDr, q_resid

  def attend(self, q_nope_BxTxHxDn, q_rope_BxTxHxDr, latent_BxSxR, k_rope_BxSxDr, mask_BxTxS, out_dtype, *,
             absorb: bool | None = None, gate_BxTxH=None):
    """Attention of this call's queries over S keys read from the cache (mask bool[B, T, S]), cast to
    out_dtype, each head scaled by gate_BxTxH (dtype[B, T, H], None: not gated), through o_proj:
    dtype[B, T, D]."""
    b, t, h, _ = q_nope_BxTxHxDn.shape
    m, dt = self.mla, q_nope_BxTxHxDn.dtype
    w_HxDnvxR = self.kv_b_proj.weight[...].reshape(h, -1, m.kv_lora_rank)
    w_uk_HxDnxR, w_uv_HxDvxR = w_HxDnvxR[:, :m.qk_nope_head_dim], w_HxDnvxR[:, m.qk_nope_head_dim:]
    f32 = dict(preferred_element_type=jnp.float32)
    latent_BxSxR = latent_BxSxR.astype(dt)
    rope_scores = jnp.einsum("bthp,bsp->bhts", q_rope_BxTxHxDr, k_rope_BxSxDr.astype(dt), **f32)
    if self.absorbs(t) if absorb is None else absorb:
      q_lat_BxTxHxR = jnp.einsum("bthn,hnr->bthr", q_nope_BxTxHxDn, w_uk_HxDnxR)
      scores = jnp.einsum("bthr,bsr->bhts", q_lat_BxTxHxR, latent_BxSxR, **f32) + rope_scores
      probs = self._probs(scores, mask_BxTxS).astype(dt)
      out_lat_BxTxHxR = jnp.einsum("bhts,bsr->bthr", probs, latent_BxSxR)
      out_BxTxHxDv = jnp.einsum("bthr,hvr->bthv", out_lat_BxTxHxR, w_uv_HxDvxR)
    else:
      k_nope_BxSxHxDn = jnp.einsum("bsr,hnr->bshn", latent_BxSxR, w_uk_HxDnxR)
      v_BxSxHxDv = jnp.einsum("bsr,hvr->bshv", latent_BxSxR, w_uv_HxDvxR)
      scores = jnp.einsum("bthn,bshn->bhts", q_nope_BxTxHxDn, k_nope_BxSxHxDn, **f32) + rope_scores
      probs = self._probs(scores, mask_BxTxS).astype(dt)
      out_BxTxHxDv = jnp.einsum("bhts,bshv->bthv", probs, v_BxSxHxDv)
    out_BxTxHxDv = out_BxTxHxDv.astype(out_dtype)
    if gate_BxTxH is not None:
      out_BxTxHxDv = out_BxTxHxDv * gate_BxTxH[..., None].astype(out_dtype)
    return self.o_proj(out_BxTxHxDv.reshape(b, t, h * m.v_head_dim))

  def _probs(self, scores_BxHxTxS, mask_BxTxS):
    probs = attention_probs(scores_BxHxTxS[:, None] * self.scale, mask_BxTxS)
    return probs[:, 0]
