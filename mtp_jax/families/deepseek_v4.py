"""DeepSeek-V4 (deepseek_v4, deepseek_v41): MTP modules load and run; the target is refused by name.

Where each fact was read (transformers 5.25 models/deepseek_v4/ modeling and configuration, whose
decoder layer, hyper-connections, attention and MoE the MTP layer reuses; SGLang 0.5.23
srt/models/deepseek_v4_nextn.py, deepseek_v4.py and deepseek_v2.py; transformers' conversion_mapping.py
for the released tensor names):

- What the caller hands module 1: the target's last-layer hyper-connection streams before its hc_head,
  hc_mult of them, flattened to [hc_mult * D] per position (SGLang's DeepseekV4Model returns them as
  pre_hc_head and the logits processor keeps them as hidden_states_before_norm); `MtpConfig.hidden_width`.
- Chain (SGLang DeepseekV4ModelNextN.forward): every stream s becomes h_proj(hnorm(s)) + e_proj(enorm(e)),
  no position-0 mask; the decoder layer runs over the streams; the module hands on its streams, flattened
  (pre_hc_head again); logits = head(norm(hc_head(streams))), head and embedding the target's (module
  copies, mtp.{k}.emb.tok_emb / mtp.{k}.head, must equal them). SGLang loads one module
  (num_nextn_predict_layers 1); mtp_jax chains more the same way, depth i on module i % K.
- The layer (SGLang builds it with compress ratio 0): sliding-window attention only, no compressor and
  no indexer: `blocks/sink_mqa.py` (sliding_window, else window_size, rows with the query included as
  transformers' mask), RoPE theta rope_theta (rope_parameters.main) without YaRN on
  qk_rope_head_dim dims (else head_dim * partial_rotary_factor, transformers' default 64 / 512); the FFN
  is the top-k MoE, never hash-routed in the MTP layer (SGLang: is_hash false for the nextn layer):
  scoring_func (sqrtsoftplus) scores with e_score_correction_bias for the choice, no expert groups,
  norm_topk_prob, routed_scaling_factor; routed and shared experts clamp the gate above and up to
  +-swiglu_limit before the SiLU (`MoeConfig` expert_activation "swiglu_clamp").
- Layout `deepseek_v4`, DeepSeek's release names: mtp.{k}.{e_proj, h_proj, enorm, hnorm, norm,
  hc_head_fn/base/scale, attn_norm, ffn_norm, hc_attn_*, hc_ffn_*, attn.{wq_a, q_norm, wq_b, wkv, kv_norm,
  wo_a, wo_b, attn_sink}, ffn.gate.{weight, bias}, ffn.experts.{e}.w1/w2/w3, ffn.shared_experts.w1/w2/w3};
  embed.weight, head.weight.

Refused, naming the key (NotImplementedError): hc_pre_from_prev_sublayer (DeepSeek-V4.1's default:
SGLang mixes a sublayer's streams from the one before, which transformers 5.25 does not build),
q_head_norm false (V4.1's queries without the per-head norm; unchecked against a reference),
attention_bias / mlp_bias. The target (hyper-connection streams through compressed sparse and heavily
compressed attention layers, hash-routed MoE) is not built.
"""

from __future__ import annotations

from collections.abc import Mapping

from mtp_jax import validate
from mtp_jax.config import HyperConfig, MoeConfig, SinkMqaConfig
from mtp_jax.families.base import Conventions, Family, Layout, Sources

# Canonical suffix (mtp_jax's module) -> the released name under mtp.{k}.; experts below.
_NAMES = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "shared_head.norm.weight": "norm.weight",
    "self_attn.q_a_proj.weight": "attn.wq_a.weight", "self_attn.q_a_norm.weight": "attn.q_norm.weight",
    "self_attn.q_b_proj.weight": "attn.wq_b.weight", "self_attn.kv_proj.weight": "attn.wkv.weight",
    "self_attn.kv_norm.weight": "attn.kv_norm.weight", "self_attn.o_a_proj.weight": "attn.wo_a.weight",
    "self_attn.o_b_proj.weight": "attn.wo_b.weight", "self_attn.sinks": "attn.attn_sink",
    "mlp.gate.weight": "ffn.gate.weight", "mlp.gate.e_score_correction_bias": "ffn.gate.bias",
}
_HC = {"attn_hc.": "hc_attn_", "ffn_hc.": "hc_ffn_", "hc_head.": "hc_head_"}  # attn_hc.fn -> hc_attn_fn
_PROJ = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}


def _released(suffix: str) -> str:
  if suffix in _NAMES:
    return _NAMES[suffix]
  for ours, theirs in _HC.items():
    if suffix.startswith(ours):
      return theirs + suffix[len(ours):]
  if suffix.startswith("mlp."):  # mlp.experts.{e}.gate_proj.weight, mlp.shared_experts.up_proj.weight
    *path, proj, leaf = suffix.split(".")
    return ".".join(["ffn", *path[1:], _PROJ[proj], leaf])
  return suffix  # enorm, hnorm, e_proj, h_proj keep their names


def _sources(cfg, names, first_layer):
  prefixes = tuple(f"mtp.{i}." for i in range(cfg.num_modules))
  copies = lambda leaf: tuple(p + leaf for p in prefixes if p + leaf in names)
  return Sources(("mtp.",), lambda i, s: (prefixes[i] + _released(s), None),
                 embed=("embed.weight", *copies("emb.tok_emb.weight")), head=("head.weight", *copies("head.weight")))


def _refuse(config: Mapping) -> None:
  v41 = config.get("model_type") == "deepseek_v41"
  if config.get("hc_pre_from_prev_sublayer", v41):
    raise NotImplementedError("config.json: hc_pre_from_prev_sublayer (DeepSeek-V4.1's default) is not supported: "
                              "SGLang reads a sublayer's hyper-connection mix from the sublayer before, which "
                              "transformers 5.25 does not build and mtp_jax does not check")
  if not config.get("q_head_norm", not v41):
    raise NotImplementedError("config.json: q_head_norm false (queries without the per-head RMSNorm) is not "
                              "supported: no reference builds it")
  for key in ("attention_bias", "mlp_bias"):
    if config.get(key):
      raise NotImplementedError(f"config.json: {key} is not supported: DeepSeek-V4's projections have no biases")


def _limit(config: Mapping) -> float:
  # transformers' default where config.json leaves it out; its MLP and experts always clamp.
  return validate.real("config.json: swiglu_limit", config.get("swiglu_limit", 10.0), 0.0, lo_open=True)


def v4_moe(config: Mapping) -> MoeConfig:
  """The MTP layer's top-k MoE (the module docstring says where each field is read)."""
  _refuse(config)
  for key in ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size"):
    validate.positive_int(f"config.json: {key}", config.get(key))
  return MoeConfig(num_experts=config["n_routed_experts"], num_experts_per_tok=config["num_experts_per_tok"],
                   moe_intermediate_size=config["moe_intermediate_size"],
                   scoring=config.get("scoring_func", "sqrtsoftplus"), e_score_correction_bias=True,
                   norm_topk_prob=config.get("norm_topk_prob", True),
                   routed_scaling_factor=float(config.get("routed_scaling_factor", 1.5)),
                   n_shared_experts=config.get("n_shared_experts", 1) or 0, expert_activation="swiglu_clamp",
                   swiglu_limit=_limit(config))


def mtp_layer(config: Mapping) -> dict:
  """BlockConfig fields of the MTP layer: its attention, hyper-connections and main RoPE."""
  _refuse(config)
  head_dim = validate.positive_int("config.json: head_dim", config.get("head_dim"))
  rope_dim = config.get("qk_rope_head_dim") or int(head_dim * (config.get("partial_rotary_factor") or 64 / 512))
  window = config.get("sliding_window") or config.get("window_size")
  main = (config.get("rope_parameters") or {}).get("main") or {}
  theta = main.get("rope_theta", config.get("rope_theta", 10000.0))
  for key in ("q_lora_rank", "o_groups", "o_lora_rank"):
    validate.positive_int(f"config.json: {key}", config.get(key))
  return dict(
      num_kv_heads=1, head_dim=head_dim, partial_rotary_factor=rope_dim / head_dim, rope_theta=float(theta),
      rope_scaling=None, attention_sinks=True, mla=None, dsa=None, qk_norm=False, swiglu_limit=_limit(config),
      sliding_window=validate.positive_int("config.json: sliding_window", window),
      sink_mqa=SinkMqaConfig(q_lora_rank=config["q_lora_rank"], o_groups=config["o_groups"],
                             o_lora_rank=config["o_lora_rank"]),
      hyper=HyperConfig(hc_mult=config.get("hc_mult", 4), sinkhorn_iters=config.get("hc_sinkhorn_iters", 20),
                        hc_eps=float(config.get("hc_eps", 1e-6))))


def _view(config: Mapping) -> Mapping:
  # The shared readers want intermediate_size; V4's only FFN width is moe_intermediate_size
  # (transformers' attribute_map reads it so too).
  if config.get("intermediate_size") is not None or config.get("moe_intermediate_size") is None:
    return config
  return {**config, "intermediate_size": config["moe_intermediate_size"]}


LAYOUT = Layout("deepseek_v4", r"mtp\.\d+\.hc_head_fn", _sources)

FAMILY = Family(
    name="deepseek_v4", title="DeepSeek-V4", model_types=("deepseek_v4", "deepseek_v41"), layout="deepseek_v4",
    conventions=Conventions(pass_normed_hidden=False, head_norm=True, mask_first_embedding=False),
    moe=v4_moe, mtp_blocks=mtp_layer, hf_view=_view, num_mtp=1,
    target_refusal="target (hyper-connection streams, compressed sparse attention) not built",
    sources="transformers deepseek_v4 (layer); SGLang deepseek_v4_nextn.py (chain)")
