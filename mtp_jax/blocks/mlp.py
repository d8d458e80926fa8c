"""The dense feed-forward layer: SwiGLU (optionally clipped, Step-3.5), gated tanh-GELU (Gemma 4), or
Nemotron-H's non-gated squared ReLU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from mtp_jax.blocks.linear import Linear
from mtp_jax.config import BlockConfig


def activate(up, gate, activation: str, limit: float | None = None):
  """The experts' and MLPs' hidden from the up (and gate) projections: silu(gate) * up for "swiglu",
  relu(up)^2 for "relu2" (gate None); same shape and dtype as up. limit ("swiglu" only) clips
  silu(gate) above at limit and up to [-limit, limit] before the product (Step-3.5's clipped SwiGLU);
  "swiglu_clamp" clips gate above at limit before the SiLU instead (DeepSeek-V4's experts); "gelu_tanh"
  is gelu(gate) * up with GELU's tanh approximation (Gemma 4's gelu_pytorch_tanh)."""
  if activation == "relu2":
    return jnp.square(jax.nn.relu(up))
  if activation == "gelu_tanh":
    return jax.nn.gelu(gate, approximate=True) * up
  if activation == "swiglu_clamp":
    return jax.nn.silu(jnp.minimum(gate, limit)) * jnp.clip(up, -limit, limit)
  act = jax.nn.silu(gate)
  if limit is not None:
    act, up = jnp.minimum(act, limit), jnp.clip(up, -limit, limit)
  return act * up


class Mlp(nnx.Module):
  """down(silu(gate(x)) * up(x)), clipped by cfg.swiglu_limit, down(gelu(gate(x)) * up(x)) with activation
  "gelu_tanh", or with activation "relu2"
  down(relu(up(x))^2) and no gate_proj; width F = intermediate_size (default cfg.intermediate_size)."""

  def __init__(self, cfg: BlockConfig, *, rngs: nnx.Rngs, intermediate_size: int | None = None,
               activation: str = "swiglu"):
    d, f, dt = cfg.hidden_size, intermediate_size or cfg.intermediate_size, cfg.jnp_dtype
    self.activation, self.limit = activation, cfg.swiglu_limit
    self.gate_proj = Linear(d, f, axes=("mlp", "embed"), dtype=dt, rngs=rngs) if activation != "relu2" else None
    self.up_proj = Linear(d, f, axes=("mlp", "embed"), dtype=dt, rngs=rngs)
    self.down_proj = Linear(f, d, axes=("embed", "mlp"), dtype=dt, rngs=rngs)

  def __call__(self, x_BxTxD):
    """dtype[B, T, D] -> dtype[B, T, D]."""
    gate = None if self.gate_proj is None else self.gate_proj(x_BxTxD)
    return self.down_proj(activate(self.up_proj(x_BxTxD), gate, self.activation, self.limit))
