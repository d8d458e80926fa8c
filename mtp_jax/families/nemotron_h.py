"""NVIDIA Nemotron-H: a hybrid Mamba-2 / attention / MoE target (not built) and an MTP step of two
layers, an attention layer and a MoE layer, which together are one pre-norm block. Where each fact was
read (vLLM 0.34 model_executor/models/nemotron_h_mtp.py and nemotron_h.py, SGLang 0.5.23
srt/models/nemotron_h_mtp.py, transformers 5.25 models/nemotron_h/):

- Layers: mtp.layers.{j}, step s at j = s * len(pattern) + r (vLLM's flat numbering; vLLM 0.34
  asserts one step). The pattern (config.json mtp_hybrid_override_pattern "*E", or transformers'
  mtp_layers_block_type ["full_attention", "moe"]) must be attention then MoE: each layer is
  norm -> mixer -> residual, so the two are input_layernorm / attention and post_attention_layernorm /
  FFN of one block. Other patterns are refused.
- Chain: layer 2s holds enorm / hnorm / eh_proj over concat(enorm(e), hnorm(h)), embedding first, no
  position-0 mask; layer 2s + 1 ends in final_layernorm, whose output is handed on and scored by the
  target's lm_head (vLLM NemotronHMTP*DecoderLayer.forward, SGLang the same).
- Attention: GQA of head_dim with no rotary embedding (NemotronHAttention in all three: NoPE), no biases.
- MoE: sigmoid router with e_score_correction_bias, n_group / topk_group, norm_topk_prob,
  routed_scaling_factor; non-gated squared-ReLU experts (mlp_hidden_act relu2; up_proj / down_proj
  only) inside fc1_latent_proj / fc2_latent_proj when moe_latent_size; a shared expert of width
  moe_shared_expert_intermediate_size * n_shared_experts (vLLM), also relu2.
- Norms: RMSNorm, eps layer_norm_epsilon. Embedding backbone.embeddings (released) or
  model.embeddings (transformers' names); LM head lm_head.
"""

from collections.abc import Mapping

from mtp_jax import validate
from mtp_jax.config import MoeConfig
from mtp_jax.families.base import Conventions, Family, Layout, Sources

_PATTERNS = ("*E", ["full_attention", "moe"])
_EMBEDS = ("backbone.embeddings.weight", "model.embeddings.weight")


def _sources(cfg, names, first_layer):
  prefixes = tuple(f"mtp.layers.{j}." for j in range(2 * cfg.num_modules))

  def source(i, s):
    attn, ffn = f"mtp.layers.{2 * i}.", f"mtp.layers.{2 * i + 1}."
    if s == "input_layernorm.weight":
      return attn + "norm.weight", None
    if s.startswith("self_attn."):
      return attn + "mixer." + s.removeprefix("self_attn."), None
    if s == "post_attention_layernorm.weight":
      return ffn + "norm.weight", None
    if s.startswith("mlp."):
      return ffn + "mixer." + s.removeprefix("mlp."), None
    if s == "shared_head.norm.weight":
      return ffn + "final_layernorm.weight", None
    return attn + s, None  # enorm, hnorm, eh_proj

  embed = tuple(n for n in _EMBEDS if n in names)[:1] or _EMBEDS[:1]
  return Sources(prefixes, source, embed=embed)


def _check(config: Mapping) -> None:
  """Refuses what the MTP step holds that mtp_jax does not build, naming the config.json key."""
  pattern = config.get("mtp_hybrid_override_pattern") or config.get("mtp_layers_block_type") or "*E"
  if pattern not in _PATTERNS:
    raise ValueError(f"config.json: MTP layer pattern {pattern!r} is not supported, only an attention layer then "
                     f"a MoE layer ({_PATTERNS[0]!r} / {_PATTERNS[1]!r})")
  if config.get("mlp_hidden_act", "relu2") != "relu2":
    raise ValueError(f"config.json: mlp_hidden_act {config['mlp_hidden_act']!r} is not supported, only 'relu2'")
  if config.get("mlp_bias"):
    raise ValueError("config.json: mlp_bias (biases on the MoE and latent projections) is not supported")


def nemotron_moe(config: Mapping) -> MoeConfig:
  """The MTP step's MoE layer (the module docstring says where each field is read)."""
  _check(config)
  for key in ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size"):
    validate.positive_int(f"config.json: {key}", config.get(key))
  shared = config.get("n_shared_experts", 1) or 0
  return MoeConfig(num_experts=config["n_routed_experts"], num_experts_per_tok=config["num_experts_per_tok"],
                   moe_intermediate_size=config["moe_intermediate_size"], scoring="sigmoid",
                   e_score_correction_bias=True, n_group=config.get("n_group") or 1,
                   topk_group=config.get("topk_group") or 1, norm_topk_prob=config.get("norm_topk_prob", True),
                   routed_scaling_factor=float(config.get("routed_scaling_factor", 1.0)), n_shared_experts=shared,
                   shared_expert_intermediate_size=(config["moe_shared_expert_intermediate_size"] * shared
                                                    if shared else None),
                   expert_activation="relu2", latent_size=config.get("moe_latent_size"))


def mtp_attention(config: Mapping) -> dict:
  """BlockConfig fields of the MTP step: NoPE attention, eps layer_norm_epsilon."""
  _check(config)
  return dict(use_rope=False, rms_norm_eps=validate.real("config.json: layer_norm_epsilon",
                                                         config.get("layer_norm_epsilon", 1e-5), 0, lo_open=True))


LAYOUT = Layout("nemotron_h", r"mtp\.layers\.\d+\.mixer\.q_proj\.weight", _sources)

FAMILY = Family(
    name="nemotron_h", title="Nemotron-H", model_types=("nemotron_h",), layout="nemotron_h",
    conventions=Conventions(pass_normed_hidden=True, head_norm=True, mask_first_embedding=False),
    moe=nemotron_moe, mtp_blocks=mtp_attention, num_mtp=1,
    target_refusal="hybrid Mamba-2 / attention / MoE target not built",
    sources="vLLM nemotron_h_mtp.py, SGLang nemotron_h_mtp.py")
