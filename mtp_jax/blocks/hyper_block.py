"""DeepSeek-V4's decoder layer over hyper-connection streams, and its MTP module around it.

`HyperBlock` is the layer: each of its two sublayers (`SinkMqaAttention`, then the MoE) reads the
streams collapsed by its own `HyperMixer`, pre-normed, and its output is written back into every
stream (transformers 5.25 DeepseekV4DecoderLayer; SGLang 0.5.23 DeepseekV4DecoderLayer hc_pre / hc_post).

`HyperMtpModule` is the MTP layer as SGLang 0.5.23 wires it (srt/models/deepseek_v4_nextn.py): the
hidden it reads is N streams, flattened to dtype[B, T, N * D] (the target's last layer output before
its hc_head; the previous depth's streams); each stream becomes h_proj(hnorm(stream)) + e_proj(enorm(e)),
the layer runs, and the module hands on its streams, flattened. `collapse` gives the head's input:
hc_head (a `HyperHead`) then the caller's shared_head norm.
"""

from __future__ import annotations

import jax
from flax import nnx

from mtp_jax.blocks.cache import LayerCache
from mtp_jax.blocks.hyper import HyperHead, HyperMixer
from mtp_jax.blocks.linear import Linear
from mtp_jax.blocks.masks import TreeRows
from mtp_jax.blocks.moe import Moe
from mtp_jax.blocks.norms import RMSNorm
from mtp_jax.blocks.sink_mqa import SinkMqaAttention
from mtp_jax.config import BlockConfig


class HyperBlock(nnx.Module):
  """attn_hc, input_layernorm, self_attn, ffn_hc, post_attention_layernorm, mlp (a `Moe`)."""

  def __init__(self, cfg: BlockConfig, *, rngs: nnx.Rngs):
    d, dt, eps = cfg.hidden_size, cfg.jnp_dtype, cfg.rms_norm_eps
    self.attn_hc = HyperMixer(cfg.hyper, d, eps, rngs=rngs)
    self.input_layernorm = RMSNorm(d, eps=eps, dtype=dt, axis="embed")
    self.self_attn = SinkMqaAttention(cfg, rngs=rngs)
    self.ffn_hc = HyperMixer(cfg.hyper, d, eps, rngs=rngs)
    self.post_attention_layernorm = RMSNorm(d, eps=eps, dtype=dt, axis="embed")
    self.mlp = Moe(cfg, rngs=rngs)

  def __call__(self, streams_BxTxNxD, rows_BxT, valid_BxT, cache: LayerCache | None, rope_offset: int = 0,
               tree: TreeRows | None = None):
    """streams dtype[B, T, N, D], the rest as `SinkMqaAttention`; returns (dtype[B, T, N, D], new cache)."""
    post, comb, x = self.attn_hc(streams_BxTxNxD)
    attn, cache = self.self_attn(self.input_layernorm(x), rows_BxT, valid_BxT, cache, rope_offset, tree)
    streams = HyperMixer.expand(attn, streams_BxTxNxD, post, comb)
    post, comb, x = self.ffn_hc(streams)
    return HyperMixer.expand(self.mlp(self.post_attention_layernorm(x)), streams, post, comb), cache


class HyperMtpModule(nnx.Module):
  """One DeepSeek-V4 MTP module: enorm, hnorm, e_proj [D, D], h_proj [D, D], block (a `HyperBlock`),
  hc_head (a `HyperHead`), shared_head_norm; its hidden is dtype[B, T, N * D], N = cfg.hyper.hc_mult.
  Each depth that runs it has a KV cache of its own."""

  def __init__(self, cfg: BlockConfig, *, rngs: nnx.Rngs):
    d, dt, eps = cfg.hidden_size, cfg.jnp_dtype, cfg.rms_norm_eps
    self.enorm = RMSNorm(d, eps=eps, dtype=dt, axis="embed")
    self.hnorm = RMSNorm(d, eps=eps, dtype=dt, axis="embed")
    self.e_proj = Linear(d, d, axes=("embed", "embed"), dtype=dt, rngs=rngs)
    self.h_proj = Linear(d, d, axes=("embed", "embed"), dtype=dt, rngs=rngs)
    self.block = HyperBlock(cfg, rngs=rngs)
    self.hc_head = HyperHead(cfg.hyper, d, eps, rngs=rngs)
    self.shared_head_norm = RMSNorm(d, eps=eps, dtype=dt, axis="embed")
    self.hc_mult, self.hidden_size = cfg.hyper.hc_mult, d

  def __call__(self, emb_BxTxD, h_BxTxND, rows_BxT, valid_BxT, cache: LayerCache | None, rope_offset: int,
               tree: TreeRows | None = None):
    """emb dtype[B, T, D], h dtype[B, T, N * D] (flattened streams); the rest as `HyperBlock`.
    Returns (the new streams flattened, dtype[B, T, N * D], new cache)."""
    b, t, _ = h_BxTxND.shape
    streams = self.h_proj(self.hnorm(h_BxTxND.reshape(b, t, self.hc_mult, self.hidden_size)))
    streams = streams + self.e_proj(self.enorm(emb_BxTxD))[:, :, None, :]
    out, cache = self.block(streams, rows_BxT, valid_BxT, cache, rope_offset, tree)
    return out.reshape(b, t, -1), cache

  def collapse(self, h_xND: jax.Array) -> jax.Array:
    """dtype[..., N * D] flattened streams -> dtype[..., D] by hc_head (before shared_head_norm)."""
    return self.hc_head(h_xND.reshape(h_xND.shape[:-1] + (self.hc_mult, self.hidden_size)))
