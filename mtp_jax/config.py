"""Configs: frozen dataclasses, hashable so they can be static jit arguments."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from mtp_jax import validate


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

  def __post_init__(self):
    cls = type(self).__name__
    validate.dataclass_fields(
        self, positive=("hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size"),
        reals=dict(rms_norm_eps=(0.0, None, True), rope_theta=(0.0, None, True)),
        flags=("attention_bias",), strings=("dtype",))
    if self.num_heads % self.num_kv_heads:
      raise validate.InvalidValue(
          f"{cls}.num_heads",
          f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
    if self.head_dim % 2:
      raise validate.InvalidValue(f"{cls}.head_dim",
                                  f"{cls}.head_dim must be even for rotate-half RoPE, got {self.head_dim}")
    validate.float_dtype(f"{cls}.dtype", self.dtype)

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
    validate.dataclass_fields(self, positive=("vocab_size", "num_modules"), flags=("pass_normed_hidden",))


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
    validate.dataclass_fields(self, positive=("vocab_size", "num_layers"), flags=("output_normed_hidden",))
