"""The dense SwiGLU feed-forward layer."""

from __future__ import annotations

import jax
from flax import nnx

from mtp_jax.blocks.linear import Linear
from mtp_jax.config import BlockConfig


class Mlp(nnx.Module):
  """down(silu(gate(x)) * up(x)); width F = intermediate_size (default cfg.intermediate_size)."""

  def __init__(self, cfg: BlockConfig, *, rngs: nnx.Rngs, intermediate_size: int | None = None):
    d, f, dt = cfg.hidden_size, intermediate_size or cfg.intermediate_size, cfg.jnp_dtype
    self.gate_proj = Linear(d, f, axes=("mlp", "embed"), dtype=dt, rngs=rngs)
    self.up_proj = Linear(d, f, axes=("mlp", "embed"), dtype=dt, rngs=rngs)
    self.down_proj = Linear(f, d, axes=("embed", "mlp"), dtype=dt, rngs=rngs)

  def __call__(self, x_BxTxD):
    return self.down_proj(jax.nn.silu(self.gate_proj(x_BxTxD)) * self.up_proj(x_BxTxD))
