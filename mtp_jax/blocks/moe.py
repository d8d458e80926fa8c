"""The mixture-of-experts FFN: a router, E routed SwiGLU experts in stacked weights, shared experts.

N = B * T token rows, E experts, K = num_experts_per_tok, Fe = moe_intermediate_size.

The routed experts have three ways to run, equal up to float rounding:
  gather:  each row gathers its K experts' weights, dtype[N, K, D, Fe]; the bytes read grow with
           N * K, not E, which is what decode wants (B = 1: K experts, not E).
  grouped: the N * K (row, expert) pairs sorted by expert and multiplied with
           jax.lax.ragged_dot, every expert's weights read once; for many rows.
  dense:   every expert on every row, weighted by a mostly-zero [N, E] combine matrix; the
           reference form and the "read everything" baseline of benchmarks/bench_moe.py.
`Moe` picks gather when N * K <= E (the gathered bytes are at most one read of all experts)
and grouped otherwise; the choice is static, from the shapes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from mtp_jax.blocks.linear import Linear, normal, param, weight_of
from mtp_jax.blocks.mlp import Mlp, activate
from mtp_jax.config import BlockConfig, MoeConfig

PATHS = ("gather", "grouped", "dense")


def route(cfg: MoeConfig, logits_NxE: jax.Array, bias_E: jax.Array | None):
  """Chooses each row's K experts and their combine weights.

  Args:
    logits_NxE: float32[N, E] router logits.
    bias_E: float32[E] e_score_correction_bias, added for the choice only, or None.
  Returns:
    (weights float32[N, K], experts int32[N, K]); weights come from the unbiased scores,
    renormalised if cfg.norm_topk_prob, then times cfg.routed_scaling_factor.
  """
  if cfg.scoring == "softmax":
    scores_NxE = jax.nn.softmax(logits_NxE, axis=-1)
  elif cfg.scoring == "sqrtsoftplus":
    scores_NxE = jnp.sqrt(jax.nn.softplus(logits_NxE))
  else:
    scores_NxE = jax.nn.sigmoid(logits_NxE)
  choice_NxE = scores_NxE if bias_E is None else scores_NxE + bias_E
  if cfg.n_group > 1:
    n, e = choice_NxE.shape
    grouped_NxGxEg = choice_NxE.reshape(n, cfg.n_group, e // cfg.n_group)
    group_score_NxG = jax.lax.top_k(grouped_NxGxEg, 2)[0].sum(-1)  # DeepSeek-V3: its two best
    _, keep_NxTg = jax.lax.top_k(group_score_NxG, cfg.topk_group)
    keep_NxG = jnp.zeros(group_score_NxG.shape, bool).at[jnp.arange(n)[:, None], keep_NxTg].set(True)
    choice_NxE = jnp.where(keep_NxG[:, :, None], grouped_NxGxEg, -jnp.inf).reshape(n, e)
  _, experts_NxK = jax.lax.top_k(choice_NxE, cfg.num_experts_per_tok)
  weights_NxK = jnp.take_along_axis(scores_NxE, experts_NxK, axis=-1)
  if cfg.norm_topk_prob:
    weights_NxK = weights_NxK / (weights_NxK.sum(-1, keepdims=True) + 1e-20)
  return weights_NxK * cfg.routed_scaling_factor, experts_NxK.astype(jnp.int32)


class Router(nnx.Module):
  """weight float32[E, D] (kept float32, as the released checkpoints and transformers keep it);
  e_score_correction_bias float32[E] when the config has one."""

  def __init__(self, cfg: MoeConfig, hidden_size: int, *, rngs: nnx.Rngs):
    self.cfg = cfg
    # Every device routes its own rows over all experts: the router is never split.
    self.weight = param(normal(rngs, (cfg.num_experts, hidden_size), hidden_size**-0.5, jnp.float32), (None, "embed"))
    # Set by balancing statistics, not by gradients: route() uses it only under top_k, so its
    # gradient is zero and AdamW (which decays matrices only) leaves it unchanged.
    self.e_score_correction_bias = (param(jnp.zeros((cfg.num_experts,), jnp.float32), (None,))
                                    if cfg.e_score_correction_bias else None)

  def __call__(self, x_NxD: jax.Array):
    """Returns (weights float32[N, K], experts int32[N, K]) as `route`."""
    logits_NxE = jnp.einsum("nd,ed->ne", x_NxD.astype(jnp.float32), self.weight[...])
    bias = None if self.e_score_correction_bias is None else self.e_score_correction_bias[...]
    return route(self.cfg, logits_NxE, bias)


class Experts(nnx.Module):
  """E SwiGLU experts in stacked (input, output) layout for ragged_dot:
  gate_proj, up_proj dtype[E, D, Fe]; down_proj dtype[E, Fe, D]. With cfg.expert_activation "relu2"
  no gate_proj (down(relu(up(x))^2)); with cfg.latent_size the experts' D is that width; with
  cfg.swiglu_limit the SwiGLU is clipped (blocks.mlp.activate).

  Released checkpoints store expert e as mlp.experts.{e}.{gate,up,down}_proj.weight in the
  torch [out, in] layout; layouts.py stacks (and transposes) them into these on load.
  fp8 and the *_scale_inv: None, or the projections `blocks.linear.keep_fp8` made float8 (each
  expert's scales transposed with it), dequantized in each call (gather: only the chosen experts).
  """

  def __init__(self, cfg: MoeConfig, hidden_size: int, dtype, *, rngs: nnx.Rngs):
    e, d, f = cfg.num_experts, cfg.latent_size or hidden_size, cfg.moe_intermediate_size
    self.activation, self.limit = cfg.expert_activation, cfg.swiglu_limit
    self.gate_proj = (param(normal(rngs, (e, d, f), d**-0.5, dtype), ("experts", "embed", "expert_mlp"))
                      if self.activation != "relu2" else None)
    self.up_proj = param(normal(rngs, (e, d, f), d**-0.5, dtype), ("experts", "embed", "expert_mlp"))
    self.down_proj = param(normal(rngs, (e, f, d), f**-0.5, dtype), ("experts", "expert_mlp", "embed"))
    self.fp8 = None
    # data: keep_fp8 may put params there
    self.gate_proj_scale_inv, self.up_proj_scale_inv, self.down_proj_scale_inv = (nnx.data(None),) * 3

  def __call__(self, x_NxD, weights_NxK, experts_NxK, path: str):
    """sum_k weights[n, k] * expert_{experts[n, k]}(x[n]): dtype[N, D], via `path` (see PATHS)."""
    n, k = experts_NxK.shape
    gated = self.gate_proj is not None
    if path == "gather":
      g = jnp.einsum("nd,nkdf->nkf", x_NxD, weight_of(self, "gate_proj", experts_NxK)) if gated else None
      u = jnp.einsum("nd,nkdf->nkf", x_NxD, weight_of(self, "up_proj", experts_NxK))
      h_NxKxF = activate(u, g, self.activation, self.limit)
      y_NxKxD = jnp.einsum("nkf,nkfd->nkd", h_NxKxF, weight_of(self, "down_proj", experts_NxK))
      out = jnp.einsum("nk,nkd->nd", weights_NxK, y_NxKxD.astype(jnp.float32))
      return out.astype(x_NxD.dtype)
    wg = weight_of(self, "gate_proj") if gated else None
    wu, wd = weight_of(self, "up_proj"), weight_of(self, "down_proj")
    if path == "grouped":
      order_M = jnp.argsort(experts_NxK.reshape(-1), stable=True)  # M = N * K pairs, by expert
      rows_M = order_M // k
      sizes_E = jnp.bincount(experts_NxK.reshape(-1), length=wu.shape[0]).astype(jnp.int32)
      x_MxD = x_NxD[rows_M]
      h_MxF = activate(jax.lax.ragged_dot(x_MxD, wu, sizes_E),
                       jax.lax.ragged_dot(x_MxD, wg, sizes_E) if gated else None, self.activation, self.limit)
      y_MxD = jax.lax.ragged_dot(h_MxF, wd, sizes_E).astype(jnp.float32)
      y_MxD = y_MxD * weights_NxK.reshape(-1)[order_M][:, None]
      out = jnp.zeros((n, x_NxD.shape[1]), jnp.float32).at[rows_M].add(y_MxD)
    elif path == "dense":
      combine_NxE = jnp.zeros((n, wu.shape[0]), jnp.float32).at[jnp.arange(n)[:, None], experts_NxK].add(
          weights_NxK)
      h = activate(jnp.einsum("nd,edf->nef", x_NxD, wu),
                   jnp.einsum("nd,edf->nef", x_NxD, wg) if gated else None, self.activation, self.limit)
      out = jnp.einsum("ne,ned->nd", combine_NxE, jnp.einsum("nef,efd->ned", h, wd).astype(jnp.float32))
    else:
      raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    return out.astype(x_NxD.dtype)


class Moe(nnx.Module):
  """Routed experts plus shared experts: mlp.gate, mlp.experts, and mlp.shared_experts
  (DeepSeek-V3 / GLM-4.5) or mlp.shared_expert with mlp.shared_expert_gate (Qwen), as the
  released checkpoints name them; with moe.latent_size the routed experts sit between
  mlp.fc1_latent_proj and mlp.fc2_latent_proj (Nemotron-H)."""

  def __init__(self, cfg: BlockConfig, *, rngs: nnx.Rngs):
    moe, d = cfg.moe, cfg.hidden_size
    self.cfg = moe
    self.gate = Router(moe, d, rngs=rngs)
    self.experts = Experts(moe, d, cfg.jnp_dtype, rngs=rngs)
    if moe.latent_size is not None:
      self.fc1_latent_proj = Linear(d, moe.latent_size, axes=(None, "embed"), dtype=cfg.jnp_dtype, rngs=rngs)
      self.fc2_latent_proj = Linear(moe.latent_size, d, axes=("embed", None), dtype=cfg.jnp_dtype, rngs=rngs)
    shared = lambda: Mlp(cfg, rngs=rngs, intermediate_size=moe.shared_width, activation=moe.expert_activation)
    if moe.shared_expert_gate:
      self.shared_expert = shared()
      self.shared_expert_gate = Linear(d, 1, axes=(None, "embed"), dtype=cfg.jnp_dtype, rngs=rngs)
    elif moe.n_shared_experts:
      self.shared_experts = shared()

  def __call__(self, x_BxTxD: jax.Array, path: str | None = None) -> jax.Array:
    """dtype[B, T, D] -> dtype[B, T, D]; path: one of PATHS, or None to pick by row count."""
    b, t, d = x_BxTxD.shape
    x_NxD = x_BxTxD.reshape(b * t, d)
    if path is None:
      path = "gather" if b * t * self.cfg.num_experts_per_tok <= self.cfg.num_experts else "grouped"
    weights_NxK, experts_NxK = self.gate(x_NxD)
    if self.cfg.latent_size is None:
      out = self.experts(x_NxD, weights_NxK, experts_NxK, path).reshape(b, t, d)
    else:
      latent_NxL = self.fc1_latent_proj(x_NxD)
      out = self.fc2_latent_proj(self.experts(latent_NxL, weights_NxK, experts_NxK, path)).reshape(b, t, d)
    if self.cfg.shared_expert_gate:
      out = out + jax.nn.sigmoid(self.shared_expert_gate(x_BxTxD)) * self.shared_expert(x_BxTxD)
    elif self.cfg.n_shared_experts:
      out = out + self.shared_experts(x_BxTxD)
    return out
