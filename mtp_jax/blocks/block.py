"""The pre-norm transformer block shared by the target and the MTP modules."""

from __future__ import annotations

from flax import nnx

from mtp_jax.blocks.attention import Attention
from mtp_jax.blocks.cache import LayerCache
from mtp_jax.blocks.dsa import DsaAttention
from mtp_jax.blocks.linear import constrain
from mtp_jax.blocks.masks import TreeRows
from mtp_jax.blocks.mla import MlaAttention
from mtp_jax.blocks.mlp import Mlp
from mtp_jax.blocks.moe import Moe
from mtp_jax.blocks.norms import RMSNorm
from mtp_jax.config import BlockConfig

_HIDDEN = ("batch", None, "embed")  # the residual stream's logical axes


class Block(nnx.Module):
  """Pre-norm transformer block: x + attn(norm(x)), then + mlp(norm(.)); attn is GQA, MLA or DSA per cfg.

  mlp is the dense `Mlp`, or a `Moe` when cfg.moe is set, except in target layers with
  layer_idx < cfg.moe.first_k_dense_replace. MTP modules pass no layer_idx: always MoE.
  """

  def __init__(self, cfg: BlockConfig, *, rngs: nnx.Rngs, layer_idx: int | None = None):
    dt = cfg.jnp_dtype
    norm = lambda: RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dt, unit_offset=cfg.norm_unit_offset,
                           axis="embed")
    self.input_layernorm = norm()
    attention = Attention if cfg.mla is None else MlaAttention if cfg.dsa is None else DsaAttention
    self.self_attn = attention(cfg, rngs=rngs)
    self.post_attention_layernorm = norm()
    dense = cfg.moe is None or (layer_idx is not None and layer_idx < cfg.moe.first_k_dense_replace)
    self.mlp = Mlp(cfg, rngs=rngs) if dense else Moe(cfg, rngs=rngs)

  def __call__(self, x_BxTxD, rows_BxT, valid_BxT, cache: LayerCache | None, rope_offset: int = 0,
               tree: TreeRows | None = None):
    """Same arguments as Attention; returns (dtype[B, T, D], new cache or None)."""
    attn, cache = self.self_attn(self.input_layernorm(x_BxTxD), rows_BxT, valid_BxT, cache, rope_offset, tree)
    # The residual stream stays split by batch between the sublayers (under sharding.use_mesh),
    # rather than left to GSPMD, which may gather it after a row-parallel o_proj / down_proj.
    h = constrain(x_BxTxD + attn, _HIDDEN)
    return constrain(h + self.mlp(self.post_attention_layernorm(h)), _HIDDEN), cache
