"""Configs: frozen dataclasses, hashable so they can be static jit arguments."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp


def _check_positive(cls_name: str, **fields: int) -> None:
  for name, value in fields.items():
    if not isinstance(value, int) or value < 1:
      raise ValueError(f"{cls_name}.{name} must be a positive int, got {value!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoeConfig:
  """A mixture-of-experts FFN (DeepSeek-V3 / GLM-4.5 / Qwen3-Next); see blocks/moe.py.

  num_experts: E routed experts, each a SwiGLU of width moe_intermediate_size (Fe).
  num_experts_per_tok: top-k experts per token.
  scoring: "softmax" (Qwen) or "sigmoid" (DeepSeek-V3, GLM-4.5) of the router logits.
  e_score_correction_bias: a per-expert bias added to the scores for choosing experts only;
    the combine weights use the unbiased scores (DeepSeek-V3's aux-loss-free balancing).
  n_group, topk_group: group-limited top-k: experts split into n_group groups, a group scores
    the sum of its two best (biased) scores, and only the best topk_group groups compete.
  norm_topk_prob: divide the chosen weights by their sum; routed_scaling_factor then scales them.
  n_shared_experts: 0, or shared experts run on every token as one SwiGLU of width
    shared_expert_intermediate_size (default moe_intermediate_size * n_shared_experts).
  shared_expert_gate: multiply the shared output by sigmoid(x @ w) (Qwen).
  first_k_dense_replace: target layers below this index keep the dense MLP; MTP modules are
    always MoE (transformers' get_mtp_config sets it to 0).
  """

  num_experts: int
  num_experts_per_tok: int
  moe_intermediate_size: int
  scoring: str = "softmax"
  e_score_correction_bias: bool = False
  n_group: int = 1
  topk_group: int = 1
  norm_topk_prob: bool = True
  routed_scaling_factor: float = 1.0
  n_shared_experts: int = 0
  shared_expert_intermediate_size: int | None = None
  shared_expert_gate: bool = False
  first_k_dense_replace: int = 0

  def __post_init__(self):
    name = type(self).__name__
    _check_positive(name, num_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok,
                    moe_intermediate_size=self.moe_intermediate_size, n_group=self.n_group,
                    topk_group=self.topk_group)
    if self.scoring not in ("softmax", "sigmoid"):
      raise ValueError(f"{name}.scoring must be 'softmax' or 'sigmoid', got {self.scoring!r}")
    if self.num_experts % self.n_group:
      raise ValueError(f"{name}.n_group ({self.n_group}) must divide num_experts ({self.num_experts})")
    if self.n_group > 1 and self.num_experts // self.n_group < 2:
      raise ValueError(f"{name}.n_group ({self.n_group}) must leave >= 2 experts per group: "
                       f"a group scores the sum of its two best experts")
    if self.topk_group > self.n_group:
      raise ValueError(f"{name}.topk_group ({self.topk_group}) must be <= n_group ({self.n_group})")
    allowed = self.topk_group * (self.num_experts // self.n_group)
    if self.num_experts_per_tok > allowed:
      raise ValueError(f"{name}.num_experts_per_tok ({self.num_experts_per_tok}) must be <= the "
                       f"{allowed} experts in topk_group ({self.topk_group}) groups")
    if not self.routed_scaling_factor > 0:
      raise ValueError(f"{name}.routed_scaling_factor must be > 0, got {self.routed_scaling_factor!r}")
    for field in ("n_shared_experts", "first_k_dense_replace"):
      value = getattr(self, field)
      if not isinstance(value, int) or value < 0:
        raise ValueError(f"{name}.{field} must be an int >= 0, got {value!r}")
    if self.shared_expert_intermediate_size is not None:
      _check_positive(name, shared_expert_intermediate_size=self.shared_expert_intermediate_size)
      if not self.n_shared_experts:
        raise ValueError(f"{name}.shared_expert_intermediate_size is set but n_shared_experts is 0")
    if self.shared_expert_gate and not self.n_shared_experts:
      raise ValueError(f"{name}.shared_expert_gate needs a shared expert (n_shared_experts >= 1)")

  @property
  def shared_width(self) -> int:
    """Width of the shared SwiGLU (0 without shared experts)."""
    return self.shared_expert_intermediate_size or self.moe_intermediate_size * self.n_shared_experts


@dataclasses.dataclass(frozen=True, kw_only=True)
class BlockConfig:
  """What one pre-norm transformer block needs; shared by the target and MTP modules."""

  hidden_size: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  intermediate_size: int
  rms_norm_eps: float = 1e-6
  rope_theta: float = 10000.0
  attention_bias: bool = False  # Qwen2 / MiMo style q, k, v biases.
  dtype: str = "float32"  # weights, activations and KV caches
  moe: MoeConfig | None = None  # the FFN is a mixture of experts (see MoeConfig) instead of the dense MLP

  def __post_init__(self):
    _check_positive(type(self).__name__, hidden_size=self.hidden_size,
                    num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                    head_dim=self.head_dim, intermediate_size=self.intermediate_size)
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
          f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
    if self.head_dim % 2:
      raise ValueError(f"head_dim must be even for rotate-half RoPE, got {self.head_dim}")
    jnp.dtype(self.dtype)  # fails early on an unknown dtype name
    if isinstance(self.moe, dict):  # as dataclasses.asdict wrote it into a config.json
      object.__setattr__(self, "moe", MoeConfig(**self.moe))
    if self.moe is not None and not isinstance(self.moe, MoeConfig):
      raise TypeError(f"moe must be a MoeConfig or None, got {type(self.moe).__name__}")

  @property
  def jnp_dtype(self):
    return jnp.dtype(self.dtype)

  def block_config(self) -> "BlockConfig":
    return BlockConfig(**{f.name: getattr(self, f.name) for f in dataclasses.fields(BlockConfig)})


@dataclasses.dataclass(frozen=True, kw_only=True)
class MtpConfig(BlockConfig):
  """K chained MTP modules (DeepSeek-V3 layout, dense blocks).

  vocab_size: V; hidden_size: D; num_modules: K.
  pass_normed_hidden: feed the next module shared_head_norm(h) instead of the residual h.
  """

  vocab_size: int
  num_modules: int
  pass_normed_hidden: bool = False

  def __post_init__(self):
    super().__post_init__()
    _check_positive("MtpConfig", vocab_size=self.vocab_size, num_modules=self.num_modules)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TargetConfig(BlockConfig):
  """A Llama / Qwen-style decoder: embedding, N pre-norm blocks, final RMSNorm, LM head.

  output_normed_hidden: hand the MTP chain norm(h) instead of the residual stream h.
  """

  vocab_size: int
  num_layers: int
  output_normed_hidden: bool = False

  def __post_init__(self):
    super().__post_init__()
    _check_positive("TargetConfig", vocab_size=self.vocab_size, num_layers=self.num_layers)
