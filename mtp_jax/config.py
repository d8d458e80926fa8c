"""Configs: frozen dataclasses, hashable so they can be static jit arguments."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp


def _check_positive(cls_name: str, **fields: int) -> None:
  for name, value in fields.items():
    if not isinstance(value, int) or value < 1:
      raise ValueError(f"{cls_name}.{name} must be a positive int, got {value!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeScaling:
  """YaRN RoPE scaling; absent fields take transformers' defaults.

  factor None means max_position_embeddings / original_max_position_embeddings (DeepSeek-V3),
  which needs max_position_embeddings. attention_factor None derives it from factor, mscale and
  mscale_all_dim. MLA layers also scale softmax by yarn_mscale(factor, mscale_all_dim)^2.
  """

  rope_type: str = "yarn"
  factor: float | None = None
  original_max_position_embeddings: int | None = None
  max_position_embeddings: int | None = None
  beta_fast: float = 32.0
  beta_slow: float = 1.0
  mscale: float | None = None
  mscale_all_dim: float | None = None
  attention_factor: float | None = None
  truncate: bool = True

  def __post_init__(self):
    if self.rope_type != "yarn":
      raise ValueError(f"rope_scaling.rope_type {self.rope_type!r} is not supported, only 'yarn'")
    if self.original_max_position_embeddings is None:
      raise ValueError("rope_scaling.original_max_position_embeddings is required for 'yarn'")
    if self.factor is None and self.max_position_embeddings is None:
      raise ValueError("rope_scaling.factor is None: set it or max_position_embeddings")

  @property
  def scale(self) -> float:
    if self.factor is not None:
      return float(self.factor)
    return self.max_position_embeddings / self.original_max_position_embeddings


@dataclasses.dataclass(frozen=True, kw_only=True)
class MlaConfig:
  """Multi-head latent attention (DeepSeek-V2/V3): low-rank q and a shared compressed KV latent.

  q_lora_rank None: a plain q_proj. Per head, queries and keys have qk_nope_head_dim + qk_rope_head_dim
  dims (only the last qk_rope_head_dim rotate), values v_head_dim.
  """

  kv_lora_rank: int
  qk_nope_head_dim: int
  qk_rope_head_dim: int
  v_head_dim: int
  q_lora_rank: int | None = None

  def __post_init__(self):
    _check_positive("MlaConfig", kv_lora_rank=self.kv_lora_rank, qk_nope_head_dim=self.qk_nope_head_dim,
                    qk_rope_head_dim=self.qk_rope_head_dim, v_head_dim=self.v_head_dim)
    if self.q_lora_rank is not None:
      _check_positive("MlaConfig", q_lora_rank=self.q_lora_rank)
    if self.qk_rope_head_dim % 2:
      raise ValueError(f"MlaConfig.qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")


def _as(cls, value):
  # Nested configs arrive as dicts from a config.json (dataclasses.asdict round trip).
  return cls(**value) if isinstance(value, dict) else value


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
  attention_out_bias: bool = False  # o_proj bias (Qwen3-Next with attention_bias)
  qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE (GLM-4.5, Qwen3-Next)
  norm_unit_offset: bool = False  # RMSNorms scale by (1 + weight), weight starting at 0 (Qwen3-Next)
  attention_gate: bool = False  # q_proj gives per head [q | gate]; out * sigmoid(gate) (Qwen3-Next)
  rope_interleave: bool = False  # rotate pairs (0, 1), (2, 3), ... (DeepSeek) instead of halves
  partial_rotary_factor: float = 1.0  # rotate only the first int(head_dim * factor) dims
  rope_scaling: RopeScaling | None = None
  mla: MlaConfig | None = None  # MLA attention instead of GQA (num_kv_heads, head_dim unused)
  sliding_window: int | None = None  # a query attends to itself and the window - 1 rows before it
  attention_sinks: bool = False  # a learned per-head logit in the softmax denominator (MiMo-V2-Flash)
  dtype: str = "float32"  # weights, activations and KV caches

  def __post_init__(self):
    _check_positive(type(self).__name__, hidden_size=self.hidden_size,
                    num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                    head_dim=self.head_dim, intermediate_size=self.intermediate_size)
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
          f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
    object.__setattr__(self, "rope_scaling", _as(RopeScaling, self.rope_scaling))
    object.__setattr__(self, "mla", _as(MlaConfig, self.mla))
    if not 0.0 < self.partial_rotary_factor <= 1.0:
      raise ValueError(f"partial_rotary_factor must be in (0, 1], got {self.partial_rotary_factor}")
    if self.rotary_dim % 2 or self.rotary_dim == 0:
      raise ValueError(f"the rotary dims (head_dim * partial_rotary_factor = {self.rotary_dim}) "
                       "must be even and positive")
    if self.sliding_window is not None:
      _check_positive(type(self).__name__, sliding_window=self.sliding_window)
    if self.mla is not None:
      unsupported = [n for n in ("qk_norm", "attention_gate", "attention_out_bias", "attention_sinks")
                     if getattr(self, n)]
      if self.partial_rotary_factor != 1.0:
        unsupported.append("partial_rotary_factor")
      if unsupported:
        raise ValueError(f"{', '.join(unsupported)} cannot be combined with mla")
    jnp.dtype(self.dtype)  # fails early on an unknown dtype name

  @property
  def rotary_dim(self) -> int:
    """The dims of each query / key head that RoPE rotates."""
    if self.mla is not None:
      return self.mla.qk_rope_head_dim
    return int(self.head_dim * self.partial_rotary_factor)

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
