"""Qwen3-Next / Qwen3.5: gated full-attention MTP blocks, softmax-routed MoE with a gated shared
expert, one fc / norm set (mtp.fc, mtp.pre_fc_norm_*, mtp.norm) shared by all modules.

Qwen3.5 (vLLM qwen3_5_mtp.py) is the same MTP with its fields under config.json's text_config and its
embedding at model.language_model.embed_tokens. Its rope_parameters carry an mrope_section for image
grids: text positions are equal in all three sections, so the rotation is plain (partial) RoPE.

The full-attention layer (transformers' Qwen3NextAttention, vLLM's qwen3_next.py): per-head q / k
RMSNorms, q_proj giving per head [q | gate], zero-centred (1 + w) RMSNorms. The target mixes in
linear-attention layers, which mtp_jax does not build. Chain: vLLM qwen3_next_mtp.py.
"""

from collections.abc import Mapping

import numpy as np

from mtp_jax.config import MoeConfig
from mtp_jax.families.base import DEFAULT_EMBED, Blocks, Conventions, Family, Layout, Sources

_SHARED = {"enorm.weight": "mtp.pre_fc_norm_embedding.weight", "hnorm.weight": "mtp.pre_fc_norm_hidden.weight",
           "eh_proj.weight": "mtp.fc.weight", "shared_head.norm.weight": "mtp.norm.weight"}


def plus_one(w: np.ndarray) -> np.ndarray:
  """A zero-centred RMSNorm weight as a plain scale, 1 + w, in float32 so bf16 weights near 0
  keep their precision."""
  return w.astype(np.float32) + 1.0


def _sources(cfg, names, first_layer):
  prefixes = tuple(f"mtp.layers.{i}." for i in range(cfg.num_modules)) + tuple(
      n.removesuffix("weight") for n in _SHARED.values())
  # Qwen3.5 keeps its language model (embedding included) under model.language_model.
  embed = tuple(n for n in ("model.language_model.embed_tokens.weight",) if n in names) or DEFAULT_EMBED
  # A config with norm_unit_offset reads the norms as stored; one without gets 1 + weight.
  return Sources(prefixes, lambda i, s: (_SHARED.get(s, f"mtp.layers.{i}.{s}"),
                                         plus_one if s.endswith("norm.weight") and not cfg.norm_unit_offset
                                         else None), embed=embed)


def softmax_moe(config: Mapping) -> MoeConfig | None:
  """Softmax scores plus one shared expert scaled by sigmoid(shared_expert_gate(x))
  (transformers' Qwen3NextSparseMoeBlock); None without num_experts."""
  if not config.get("num_experts"):
    return None
  shared = config.get("shared_expert_intermediate_size") or 0
  return MoeConfig(num_experts=config["num_experts"], num_experts_per_tok=config["num_experts_per_tok"],
                   moe_intermediate_size=config["moe_intermediate_size"], scoring="softmax",
                   norm_topk_prob=config.get("norm_topk_prob", True), n_shared_experts=1 if shared else 0,
                   shared_expert_intermediate_size=shared or None, shared_expert_gate=bool(shared))


LAYOUT = Layout("qwen3_next", r"mtp\.fc\.weight", _sources)

FAMILY = Family(
    name="qwen3_next", title="Qwen3-Next / Qwen3.5", model_types=("qwen3_next", "qwen3_5", "qwen3_5_moe"),
    layout="qwen3_next",
    conventions=Conventions(pass_normed_hidden=True, head_norm=True, mask_first_embedding=False),
    blocks=Blocks(partial_rotary_factor=0.25, qk_norm=True, attention_gate=True, norm_unit_offset=True),
    moe=softmax_moe, target_refusal="hybrid linear-attention target (Gated DeltaNet layers)",
    sources="vLLM qwen3_next_mtp.py, qwen3_5_mtp.py")
