"""Configs: frozen dataclasses, hashable so they can be static jit arguments."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from mtp_jax import validate


def _check_positive(cls_name: str, **fields: int) -> None:
  for name, value in fields.items():
    validate.positive_int(f"{cls_name}.{name}", value)


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
  q_lora_scale / kv_lora_scale: LongCat-Flash multiplies every query (nope and rope parts) and the
  normed latent by these (sqrt(hidden_size / rank) there); 1.0, DeepSeek-V3's, leaves them as is.
  """

  kv_lora_rank: int
  qk_nope_head_dim: int
  qk_rope_head_dim: int
  v_head_dim: int
  q_lora_rank: int | None = None
  q_lora_scale: float = 1.0
  kv_lora_scale: float = 1.0

  def __post_init__(self):
    _check_positive("MlaConfig", kv_lora_rank=self.kv_lora_rank, qk_nope_head_dim=self.qk_nope_head_dim,
                    qk_rope_head_dim=self.qk_rope_head_dim, v_head_dim=self.v_head_dim)
    if self.q_lora_rank is not None:
      _check_positive("MlaConfig", q_lora_rank=self.q_lora_rank)
    if self.qk_rope_head_dim % 2:
      raise ValueError(f"MlaConfig.qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")
    for name in ("q_lora_scale", "kv_lora_scale"):
      value = getattr(self, name)
      if not (isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < float("inf")):
        raise ValueError(f"MlaConfig.{name} must be a positive finite number, got {value!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DsaConfig:
  """DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5): a lightning indexer beside MLA picks, per
  query, the index_topk cached keys it attends to (blocks/dsa.py).

  index_n_heads / index_head_dim: the indexer's query heads and its one shared key's width; RoPE
  turns the first qk_rope_head_dim dims of each (rope_interleave: pairs (0, 1), ... as GLM-5;
  else halves, as DeepSeek-V3.2). index_topk: keys kept per query (all when fewer are visible).
  """

  index_n_heads: int
  index_head_dim: int
  index_topk: int
  rope_interleave: bool = False

  def __post_init__(self):
    validate.dataclass_fields(self, positive=("index_n_heads", "index_head_dim", "index_topk"),
                              flags=("rope_interleave",))


def _as(cls, value):
  # Nested configs arrive as dicts from a config.json (dataclasses.asdict round trip).
  return cls(**value) if isinstance(value, dict) else value


EXPERT_ACTIVATIONS = ("swiglu", "relu2", "swiglu_clamp")  # MoeConfig.expert_activation, blocks/mlp.py, blocks/moe.py
ROUTER_SCORES = ("softmax", "sigmoid", "sqrtsoftplus")  # MoeConfig.scoring, blocks/moe.py


@dataclasses.dataclass(frozen=True, kw_only=True)
class HyperConfig:
  """DeepSeek-V4's hyper-connections (blocks/hyper.py): hc_mult streams, sinkhorn_iters steps, floor hc_eps."""
  hc_mult: int
  sinkhorn_iters: int
  hc_eps: float

  def __post_init__(self):
    validate.dataclass_fields(self, positive=("hc_mult", "sinkhorn_iters"), reals=dict(hc_eps=(0.0, None, True)))


@dataclasses.dataclass(frozen=True, kw_only=True)
class SinkMqaConfig:
  """DeepSeek-V4's attention (blocks/sink_mqa.py): a q LoRA of q_lora_rank, one key = value head,
  the output projected per group: o_groups groups of heads to o_lora_rank each."""
  q_lora_rank: int
  o_groups: int
  o_lora_rank: int

  def __post_init__(self):
    validate.dataclass_fields(self, positive=("q_lora_rank", "o_groups", "o_lora_rank"))


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
  expert_activation: "swiglu", down(silu(gate(x)) * up(x)) (DeepSeek, Qwen, GLM), or "relu2", the
    non-gated down(relu(up(x))^2) with no gate_proj, for the routed and the shared experts (Nemotron-H).
  latent_size: None, or the routed experts run in this width between fc1_latent_proj (D -> latent)
    and fc2_latent_proj (latent -> D); the router and the shared experts read x itself (Nemotron-H).
  swiglu_limit: None, or the routed experts' SwiGLU is clipped: silu(gate) <= limit, |up| <= limit
    (Bailing / Ling; the shared experts' clip is BlockConfig.swiglu_limit); with expert_activation
    "swiglu_clamp" (needs the limit) gate <= limit before the SiLU instead; scoring "sqrtsoftplus" (DeepSeek-V4).
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
  expert_activation: str = "swiglu"
  latent_size: int | None = None
  swiglu_limit: float | None = None
  first_k_dense_replace: int = 0

  def __post_init__(self):
    name = type(self).__name__
    bad = lambda field, message: validate.InvalidValue(f"{name}.{field}", f"{name}.{field} {message}")
    validate.dataclass_fields(
        self, positive=("num_experts", "num_experts_per_tok", "moe_intermediate_size", "n_group", "topk_group"),
        ints=("n_shared_experts", "first_k_dense_replace"),
        reals=dict(routed_scaling_factor=(0.0, None, True)),
        flags=("e_score_correction_bias", "norm_topk_prob", "shared_expert_gate"))
    validate.one_of(f"{name}.scoring", self.scoring, ROUTER_SCORES)
    validate.one_of(f"{name}.expert_activation", self.expert_activation, EXPERT_ACTIVATIONS)
    if self.latent_size is not None:
      validate.positive_int(f"{name}.latent_size", self.latent_size)
    if self.swiglu_limit is not None:
      validate.real(f"{name}.swiglu_limit", self.swiglu_limit, 0.0, lo_open=True)
      if self.expert_activation == "relu2":
        raise bad("swiglu_limit", f"clips a SwiGLU; expert_activation is {self.expert_activation!r}")
    elif self.expert_activation == "swiglu_clamp":
      raise bad("swiglu_limit", "is needed by expert_activation 'swiglu_clamp'")
    if self.num_experts % self.n_group:
      raise bad("n_group", f"({self.n_group}) must divide num_experts ({self.num_experts})")
    if self.n_group > 1 and self.num_experts // self.n_group < 2:
      raise bad("n_group", f"({self.n_group}) must leave >= 2 experts per group: a group scores "
                "the sum of its two best experts")
    if self.topk_group > self.n_group:
      raise bad("topk_group", f"({self.topk_group}) must be <= n_group ({self.n_group})")
    allowed = self.topk_group * (self.num_experts // self.n_group)
    if self.num_experts_per_tok > allowed:
      raise bad("num_experts_per_tok", f"({self.num_experts_per_tok}) must be <= the {allowed} experts "
                f"in topk_group ({self.topk_group}) groups")
    if self.shared_expert_intermediate_size is not None:
      validate.positive_int(f"{name}.shared_expert_intermediate_size", self.shared_expert_intermediate_size)
      if not self.n_shared_experts:
        raise bad("shared_expert_intermediate_size", "is set but n_shared_experts is 0")
    if self.shared_expert_gate and not self.n_shared_experts:
      raise bad("shared_expert_gate", "needs a shared expert (n_shared_experts >= 1)")

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
  attention_out_bias: bool = False  # o_proj bias (Qwen3-Next with attention_bias)
  qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE (GLM-4.5, Qwen3-Next)
  norm_unit_offset: bool = False  # RMSNorms scale by (1 + weight), weight starting at 0 (Qwen3-Next)
  attention_gate: bool = False  # q_proj gives per head [q | gate]; out * sigmoid(gate) (Qwen3-Next)
  rope_interleave: bool = False  # rotate pairs (0, 1), (2, 3), ... (DeepSeek) instead of halves
  use_rope: bool = True  # False: GQA attention with no rotary embedding (Nemotron-H's NoPE attention layers)
  partial_rotary_factor: float = 1.0  # rotate only the first int(head_dim * factor) dims
  rope_scaling: RopeScaling | None = None
  mla: MlaConfig | None = None  # MLA attention instead of GQA (num_kv_heads, head_dim unused)
  dsa: DsaConfig | None = None  # DeepSeek Sparse Attention's indexer over the MLA latent cache (needs mla)
  sliding_window: int | None = None  # a query attends to itself and the window - 1 rows before it
  attention_sinks: bool = False  # a learned per-head logit in the softmax denominator (MiMo-V2-Flash)
  v_head_dim: int | None = None  # per-head value / attention-output width; None: head_dim (MiMo-V2-Flash 128 vs 192)
  attention_value_scale: float | None = None  # values (cached ones too) multiplied by it; None: 1 (MiMo-V2-Flash)
  attention_head_gate: bool = False  # g_proj gives one logit per head; head h's output * sigmoid(g_h) (Step-3.5)
  swiglu_limit: float | None = None  # dense / shared SwiGLU: silu(gate) <= limit, |up| <= limit (Step-3.5)
  dtype: str = "float32"  # weights, activations and KV caches
  moe: MoeConfig | None = None  # the FFN is a mixture of experts (see MoeConfig) instead of the dense MLP
  sink_mqa: SinkMqaConfig | None = None  # DeepSeek-V4's attention (needs one kv head and attention_sinks)
  hyper: HyperConfig | None = None  # DeepSeek-V4's hyper-connection streams around the block (needs sink_mqa)

  def __post_init__(self):
    cls = type(self).__name__
    validate.dataclass_fields(
        self, positive=("hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size"),
        reals=dict(rms_norm_eps=(0.0, None, True), rope_theta=(0.0, None, True)),
        flags=("attention_bias", "attention_head_gate"), strings=("dtype",))
    if self.num_heads % self.num_kv_heads:
      raise validate.InvalidValue(
          f"{cls}.num_heads",
          f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
    object.__setattr__(self, "rope_scaling", _as(RopeScaling, self.rope_scaling))
    object.__setattr__(self, "mla", _as(MlaConfig, self.mla))
    object.__setattr__(self, "dsa", _as(DsaConfig, self.dsa))
    if self.dsa is not None:
      if self.mla is None or self.mla.q_lora_rank is None:
        raise validate.InvalidValue(f"{cls}.dsa", f"{cls}.dsa needs mla with a q_lora_rank: the indexer's "
                                    "queries read MLA's normed q LoRA")
      if self.dsa.index_head_dim < self.mla.qk_rope_head_dim:
        raise validate.InvalidValue(f"{cls}.dsa", f"{cls}.dsa.index_head_dim ({self.dsa.index_head_dim}) must "
                                    f"be >= mla.qk_rope_head_dim ({self.mla.qk_rope_head_dim}), the dims RoPE turns")
      if self.attention_head_gate:  # DsaAttention attends without MLA's output gate
        raise validate.InvalidValue(f"{cls}.dsa", f"{cls}: attention_head_gate cannot be combined with dsa")
    if not 0.0 < self.partial_rotary_factor <= 1.0:
      raise validate.InvalidValue(f"{cls}.partial_rotary_factor",
                                  f"{cls}.partial_rotary_factor must be in (0, 1], got {self.partial_rotary_factor}")
    if self.rotary_dim % 2 or self.rotary_dim == 0:
      raise validate.InvalidValue(f"{cls}.head_dim", f"{cls}: the rotary dims (head_dim * partial_rotary_factor "
                                  f"= {self.rotary_dim}) must be even and positive")
    if self.sliding_window is not None:
      _check_positive(type(self).__name__, sliding_window=self.sliding_window)
    if self.v_head_dim is not None:
      _check_positive(type(self).__name__, v_head_dim=self.v_head_dim)
      if self.attention_gate and self.v_head_dim != self.head_dim:  # the gate is head_dim wide per head
        raise validate.InvalidValue(f"{cls}.v_head_dim", f"{cls}.v_head_dim ({self.v_head_dim}) must equal head_dim "
                                    f"({self.head_dim}) with attention_gate")
    if self.attention_value_scale is not None:
      validate.real(f"{cls}.attention_value_scale", self.attention_value_scale, 0.0, lo_open=True)
    if self.swiglu_limit is not None:
      validate.real(f"{cls}.swiglu_limit", self.swiglu_limit, 0.0, lo_open=True)
    if self.mla is not None:
      unsupported = [n for n in ("qk_norm", "attention_gate", "attention_out_bias", "attention_sinks", "v_head_dim",
                                 "attention_value_scale") if getattr(self, n)]
      if self.partial_rotary_factor != 1.0:
        unsupported.append("partial_rotary_factor")
      if not self.use_rope:
        unsupported.append("use_rope=False")
      if unsupported:
        raise validate.InvalidValue(f"{cls}.mla", f"{cls}: {', '.join(unsupported)} cannot be combined with mla")
    validate.float_dtype(f"{cls}.dtype", self.dtype)
    object.__setattr__(self, "sink_mqa", _as(SinkMqaConfig, self.sink_mqa))
    object.__setattr__(self, "hyper", _as(HyperConfig, self.hyper))
    if self.sink_mqa is not None and (self.num_kv_heads != 1 or not self.attention_sinks or self.mla is not None
                                      or (self.num_heads * self.head_dim) % self.sink_mqa.o_groups):
      raise validate.InvalidValue(f"{cls}.sink_mqa", f"{cls}.sink_mqa needs num_kv_heads 1, attention_sinks, "
                                  "no mla and o_groups dividing num_heads * head_dim")
    if self.hyper is not None and self.sink_mqa is None:  # the only block built over streams is DeepSeek-V4's
      raise validate.InvalidValue(f"{cls}.hyper", f"{cls}.hyper needs sink_mqa (DeepSeek-V4's block)")
    if isinstance(self.moe, dict):  # as dataclasses.asdict wrote it into a config.json
      object.__setattr__(self, "moe", MoeConfig(**self.moe))
    if self.moe is not None:
      validate.instance(f"{cls}.moe", self.moe, MoeConfig, "a MoeConfig or None")

  @property
  def rotary_dim(self) -> int:
    """The dims of each query / key head that RoPE rotates."""
    if self.mla is not None:
      return self.mla.qk_rope_head_dim
    return int(self.head_dim * self.partial_rotary_factor)

  @property
  def value_dim(self) -> int:
    """Dv, the width of each GQA value head (v_head_dim, default head_dim)."""
    return self.v_head_dim or self.head_dim

  @property
  def jnp_dtype(self):
    return jnp.dtype(self.dtype)

  def block_config(self) -> "BlockConfig":
    return BlockConfig(**{f.name: getattr(self, f.name) for f in dataclasses.fields(BlockConfig)})


DEPTH_REUSE = ("cycle", "last")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MtpConfig(BlockConfig):
  """K chained MTP modules (DeepSeek-V3 layout, dense blocks) and how the chain is wired.

  vocab_size: V; hidden_size: D; num_modules: K (modules with weights of their own).
  The chain conventions below default to transformers' `MtpModel`; `mtp_jax.families`
  holds each family's values (docs/checkpoints.md says where each comes from):
  pass_normed_hidden: hand the next depth shared_head_norm(h) instead of the residual h.
  head_norm: apply shared_head_norm before the LM head (ERNIE-4.5 applies none: the module
    has no shared_head_norm and hands on, and scores, its residual h).
  mask_first_embedding: zero the token embedding of position 0 (module 1, row 0), as vLLM does
    for DeepSeek, GLM, MiMo and ERNIE.
  max_depth: drafts a propose may make (default K); depths past K reuse a module's weights,
    each depth with a KV cache of its own.
  depth_reuse: which module depth i >= K runs: "cycle" (i mod K, vLLM's rule) or "last" (K - 1).
  own_lm_head: each module scores with an LM head of its own (mtp.{i}.shared_head.head.weight,
    Step-3.5) instead of the one lm_head the modules share with the target.
  """

  vocab_size: int
  num_modules: int
  pass_normed_hidden: bool = True
  head_norm: bool = True
  mask_first_embedding: bool = False
  max_depth: int | None = None
  depth_reuse: str = "cycle"
  own_lm_head: bool = False

  def __post_init__(self):
    super().__post_init__()
    validate.dataclass_fields(self, positive=("vocab_size", "num_modules"),
                              flags=("pass_normed_hidden", "head_norm", "mask_first_embedding", "own_lm_head"))
    if self.max_depth is not None:
      validate.positive_int("MtpConfig.max_depth", self.max_depth)
    if self.depth_reuse not in DEPTH_REUSE:
      raise validate.InvalidValue("MtpConfig.depth_reuse",
                                  f"MtpConfig.depth_reuse must be one of {DEPTH_REUSE}, got {self.depth_reuse!r}")
    if self.pass_normed_hidden and not self.head_norm:
      raise validate.InvalidValue("MtpConfig.pass_normed_hidden",
                                  "MtpConfig.pass_normed_hidden needs head_norm: without a head norm "
                                  "there is no normed hidden to hand on")

  @property
  def hidden_width(self) -> int:
    """The hidden a depth reads and hands on: hidden_size, or with hyper hc_mult streams flattened (DeepSeek-V4)."""
    return self.hidden_size * (self.hyper.hc_mult if self.hyper is not None else 1)

  @property
  def num_depths(self) -> int:
    """Depths the chain runs (max_depth, default K); each has its own KV cache."""
    return self.max_depth or self.num_modules

  def module_of(self, i: int) -> int:
    """The module (0-based) whose weights depth i (0-based) runs."""
    if not 0 <= i < self.num_depths:
      raise ValueError(f"depth {i} is outside 0..num_depths-1={self.num_depths - 1}")
    if i < self.num_modules:
      return i
    return i % self.num_modules if self.depth_reuse == "cycle" else self.num_modules - 1


@dataclasses.dataclass(frozen=True, kw_only=True)
class TargetConfig(BlockConfig):
  """A Llama / Qwen-style decoder: embedding, N pre-norm blocks, final RMSNorm, LM head.

  output_normed_hidden: hand the MTP chain the post-final-norm hidden norm(h) (what every
    engine and transformers feed module 1) instead of the residual stream h.
  """

  vocab_size: int
  num_layers: int
  output_normed_hidden: bool = True

  def __post_init__(self):
    super().__post_init__()
    validate.dataclass_fields(self, positive=("vocab_size", "num_layers"), flags=("output_normed_hidden",))


RECIPES = ("joint", "mimo")  # the training recipes of mtp_jax.train (docs/training.md)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
  """Optimisation settings of `mtp_jax.train` (kept here so a checkpoint's config.json reads without
  the training code). The schedule warms up linearly for warmup_steps, then decays on a
  cosine to learning_rate * final_lr_fraction at `steps`. mtp_weight is DeepSeek-V3's lambda."""

  recipe: str = "joint"
  steps: int = 1500
  batch_size: int = 8
  seq_len: int = 256
  learning_rate: float = 3e-3
  warmup_steps: int = 100
  final_lr_fraction: float = 0.1
  weight_decay: float = 0.05
  grad_clip: float = 1.0
  mtp_weight: float = 0.3
  stop_gradient: bool = False
  eval_every: int = 250
  eval_batches: int = 8
  save_every: int = 250
  seed: int = 0

  def __post_init__(self):
    validate.one_of("TrainConfig.recipe", self.recipe, RECIPES)
    validate.dataclass_fields(
        self, positive=("steps", "batch_size", "seq_len", "eval_every", "eval_batches", "save_every"),
        ints=("seed",), flags=("stop_gradient",),
        reals=dict(learning_rate=(0.0, None, True), final_lr_fraction=(0.0, 1.0, False),
                   weight_decay=(0.0, None, False), grad_clip=(0.0, None, True), mtp_weight=(0.0, None, False)))
    validate.integer("TrainConfig.warmup_steps", self.warmup_steps, 0, self.steps - 1)
