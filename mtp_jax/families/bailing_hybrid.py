"""Bailing / Ling hybrid (bailing_hybrid): MTP layers of MLA and routed experts; the hybrid target (KDA or
lightning linear attention with MLA every layer_group_size layers) is not built, so the caller hands the
modules the target's hidden. Where each fact was read (transformers 5.25 models/bailing_hybrid/; vLLM 0.34
model_executor/models/bailing_moe_mtp.py (BailingMoeV25MTPModel, Ling-2.5 architectures),
bailing_moe_v3_mtp.py (BailingMoeV3MTPModel, BailingMoeV3ForCausalLM: Ling-3), bailing_moe_linear.py,
bailing_moe_v3.py and config/speculative.py; SGLang 0.5.23 srt/models/bailing_moe_nextn.py, bailing_moe_v3.py,
srt/configs/bailing_hybrid.py):

- Layout: module k at model.layers.{num_hidden_layers + k} (the `deepseek` layout's place, Ling's names):
  enorm, hnorm, eh_proj, input_layernorm, attention.{q_proj | q_a_proj, q_a_layernorm, q_b_proj;
  kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, dense (o_proj), g_proj}, post_attention_layernorm,
  mlp.{gate.weight, gate.expert_bias, experts.{e}.{gate,up,down}_proj, shared_experts.*}, final_layernorm;
  the embedding model.word_embeddings, the head lm_head (copies under a module, embed_tokens /
  shared_head.head, which SGLang skips, must equal them).
- Chain (both vLLM MTP models, SGLang's nextn): eh_proj(concat(enorm(e), hnorm(h))), embedding first; a
  pre-norm layer; final_layernorm(h) handed on and scored by lm_head. vLLM's Ling-2.5 MTP zeroes the
  embedding at position 0, its Ling-3 MTP and SGLang do not; mtp_jax does not (load_mtp(...,
  mask_first_embedding=True) gives the former).
- MLA: q LoRA where q_lora_rank is set; RoPE on pairs (vLLM's is_neox_style False, transformers'
  interleaved rotation) over qk_rope_head_dim only: config.json's partial_rotary_factor (0.5 in Ling-3)
  and use_qk_norm are the linear-attention heads', dropped for MLA as vLLM drops them. q_a / kv_a norms
  use eps 1e-6 (transformers; the engines read rms_norm_eps, 1e-6 in the releases).
- Output gate: transformers' BailingHybridAttention always has a head-wise g_proj; vLLM's Ling-3 MLA
  and SGLang's build one by gated_attention_proj_granularity_type ("head_wise" [H, D], "element_wise"
  [H * Dv, D]); vLLM's Ling-2.5 MTP attention has none. The checkpoint settles it (`mtp_gate`): built
  where the MTP layers hold attention.g_proj, refused where config.json's key says otherwise;
  element-wise gates are refused.
- MoE (every MTP layer): sigmoid scores, expert_bias for the choice, group-limited top-k (n_group /
  transformers' num_expert_group, topk_group), norm_topk_prob (moe_renormalize), routed_scaling_factor
  on the routed output; shared experts of width moe_shared_expert_intermediate_size (else
  moe_intermediate_size) * num_shared_experts. Softmax scoring or no expert_bias are refused.
- Clipped SwiGLU: silu(gate) <= limit, |up| <= limit (all three), the routed experts' limit from
  expert_swiglu_limit_list, the shared experts' from share_expert_swiglu_limit_list, each at the MTP
  layer's index num_hidden_layers + k as vLLM reads it (0 or absent: none; so the lists transformers
  requires, num_hidden_layers long, leave the MTP layer unclipped; SGLang reads entry 0).
"""

from collections.abc import Mapping

from mtp_jax import validate
from mtp_jax.config import MoeConfig
from mtp_jax.families.base import DEFAULT_HEAD, Conventions, Family, Sources, layer_list

_EMBED = "model.word_embeddings.weight"
_GATE_KEY = "gated_attention_proj_granularity_type"
# Canonical suffix -> Ling's, where they differ (attention.* for self_attn.* besides).
_RENAMED = {"self_attn.o_proj.weight": "self_attn.dense.weight", "mlp.gate.e_score_correction_bias":
            "mlp.gate.expert_bias", "shared_head.norm.weight": "final_layernorm.weight"}


def _sources(cfg, names, first_layer):
  """Where Ling keeps module i's tensors: model.layers.{first_layer + i} under its own names."""
  if first_layer is None:
    raise ValueError("config.json has no num_hidden_layers: Bailing MTP layer k is "
                     "model.layers.{num_hidden_layers + k}")
  prefixes = tuple(f"model.layers.{first_layer + i}." for i in range(cfg.num_modules))

  def source(i, s):
    s = _RENAMED.get(s, s)
    return prefixes[i] + ("attention." + s.removeprefix("self_attn.") if s.startswith("self_attn.") else s), None

  # The main embedding / head and any copies a module stores (all must be equal); the main alone if none is.
  present = lambda main, copy: tuple(n for n in (main,) + tuple(p + copy for p in prefixes) if n in names) or (main,)
  return Sources(prefixes, source, embed=present(_EMBED, "embed_tokens.weight"),
                 head=present(DEFAULT_HEAD[0], "shared_head.head.weight"))


def _mtp_layers(config: Mapping) -> range:
  """The layer indices of the MTP layers: num_hidden_layers + k."""
  n = validate.positive_int("config.json: num_hidden_layers", config.get("num_hidden_layers"))
  count = config.get("num_nextn_predict_layers") or config.get("num_mtp_layers") or 1
  return range(n, n + count)


def _get(config: Mapping, *keys, default=None):
  """The first of keys config.json sets (Ling's name, then transformers' spelling), else default."""
  return next((config[k] for k in keys if config.get(k) is not None), default)


def _limit(config: Mapping, key: str) -> float | None:
  """The SwiGLU clip of the MTP layers from the per-layer list `key` (None: not clipped); the modules
  share one block config, so their limits must agree."""
  values = layer_list(config, key)
  if values is None:
    return None
  limits = {values[i] if i < len(values) and values[i] else None for i in _mtp_layers(config)}
  if len(limits) > 1:
    raise ValueError(f"config.json: {key} gives the MTP layers different limits {sorted(limits, key=str)}; "
                     "mtp_jax's MTP modules share one block config")
  limit = limits.pop()
  return None if limit is None else validate.real(f"config.json: {key}", limit, 0, lo_open=True)


def bailing_moe(config: Mapping) -> MoeConfig:
  """The MTP layers' MoE (the module docstring says where each field is read)."""
  scoring = _get(config, "score_function", "scoring_func", default="sigmoid")
  if scoring != "sigmoid":
    raise ValueError(f"config.json: score_function {scoring!r} is not supported, only 'sigmoid'")
  if not config.get("moe_router_enable_expert_bias", True):
    raise ValueError("config.json: moe_router_enable_expert_bias false (routing without expert_bias) is not supported")
  count = lambda key, *others: validate.positive_int(f"config.json: {key}", _get(config, key, *others))
  shared = validate.integer("config.json: num_shared_experts", _get(config, "num_shared_experts", "n_shared_experts",
                                                                    default=0), 0)
  width = _get(config, "moe_shared_expert_intermediate_size", "moe_intermediate_size")
  return MoeConfig(num_experts=count("num_experts"), num_experts_per_tok=count("num_experts_per_tok",
                                                                               "num_experts_per_token"),
                   moe_intermediate_size=count("moe_intermediate_size"), scoring="sigmoid",
                   e_score_correction_bias=True, n_group=_get(config, "n_group", "num_expert_group", default=1),
                   topk_group=_get(config, "topk_group", default=1),
                   norm_topk_prob=bool(_get(config, "norm_topk_prob", "moe_renormalize", default=True)),
                   routed_scaling_factor=float(config.get("routed_scaling_factor", 1.0)), n_shared_experts=shared,
                   shared_expert_intermediate_size=width * shared if shared else None,
                   swiglu_limit=_limit(config, "expert_swiglu_limit_list"))


def _declared_gate(config: Mapping) -> bool | None:
  """Whether config.json declares the head-wise MLA output gate (None: it says nothing)."""
  kind = config.get(_GATE_KEY)
  if kind is None:
    return None
  validate.one_of(f"config.json: {_GATE_KEY}", kind, ("head_wise", "element_wise"))
  if kind == "element_wise":
    raise ValueError(f"config.json: {_GATE_KEY} 'element_wise' (an MLA output gate per channel) is not supported, "
                     "only 'head_wise'")
  return True


def mtp_block(config: Mapping) -> dict:
  """BlockConfig fields of the MTP layers from config.json alone: MLA's own RoPE width and no q / k norms,
  the shared experts' clip, the output gate as config.json declares it (`mtp_gate` settles it by tensors)."""
  return dict(partial_rotary_factor=1.0, qk_norm=False, swiglu_limit=_limit(config, "share_expert_swiglu_limit_list"),
              attention_head_gate=bool(_declared_gate(config)))


def mtp_gate(config: Mapping, names: set) -> dict:
  """attention_head_gate as the checkpoint says: on where the MTP layers hold attention.g_proj.weight.
  Layers that differ, or a config.json key that says otherwise, raise ValueError naming them."""
  held = {n: f"model.layers.{n}.attention.g_proj.weight" in names for n in _mtp_layers(config)}
  if len(set(held.values())) > 1:
    raise ValueError(f"checkpoint: only some MTP layers hold attention.g_proj.weight ({held}); mtp_jax's MTP modules "
                     "share one block config")
  gate = next(iter(held.values()))
  if _declared_gate(config) and not gate:
    raise ValueError(f"config.json: {_GATE_KEY} {config[_GATE_KEY]!r} declares an MLA output gate, but the "
                     "checkpoint's MTP layers hold no attention.g_proj.weight")
  return dict(attention_head_gate=gate)


FAMILY = Family(
    name="bailing_hybrid", title="Bailing / Ling hybrid", model_types=("bailing_hybrid",), layout="deepseek",
    conventions=Conventions(pass_normed_hidden=True, head_norm=True, mask_first_embedding=False),
    mla=lambda config: {}, moe=bailing_moe, mtp_blocks=mtp_block, mtp_tensors=mtp_gate, layout_sources=_sources,
    target_refusal="hybrid KDA / lightning linear-attention and MLA target not built",
    sources="vLLM bailing_moe_v3_mtp.py, bailing_moe_mtp.py; SGLang bailing_moe_nextn.py; transformers bailing_hybrid")
