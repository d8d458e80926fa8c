"""Xiaomi MiMo-V2-Flash: MTP modules at model.mtp.layers.{i}, each a dense block whose attention is
the target's sliding-window kind. Where each fact was read (vLLM 0.34 model_executor/models/,
SGLang 0.5.23 srt/models/, transformers 5 models/mimo_v2_flash/):

- Attention from config.json's swa_* keys: swa_num_attention_heads, swa_num_key_value_heads,
  swa_head_dim (q / k), swa_v_head_dim (v and the attention output; absent: swa_head_dim),
  swa_rope_theta (absent: rope_theta), partial_rotary_factor, attention_bias on q / k / v only,
  sinks when add_swa_attention_sink_bias (vLLM mimo_v2_mtp.py MiMoV2MTPLayer, SGLang
  mimo_v2_nextn.py MiMoV2MTPLayer). Plain RoPE over the first int(head_dim * factor) dims in
  halves, softmax scale swa_head_dim^-0.5 (MiMoV2Attention in both engines' mimo_v2.py).
- v is multiplied by attention_value_scale (when set) before attention, so cached values are
  scaled (MiMoV2Attention.forward in both mimo_v2.py; SGLang's fused rope-store path passes it as
  value_scale; transformers' MiMoV2FlashAttention multiplies v the same way).
- Sinks: one learned logit per query head joining the softmax denominator, released as
  self_attn.attention_sink_bias (the engines' parameter name; transformers renames it sinks).
- Window: SGLang hands sliding_window_size W to RadixAttention, whose flash-attention backend
  uses window (W, 0): the query and the W rows before it; transformers' MiMoV2FlashConfig sets
  sliding_window = sliding_window_size + 1 citing SGLang as the reference. mtp_jax follows them
  (sliding_window = W + 1). vLLM 0.34 passes W as per_layer_sliding_window and its flash-attention
  backend uses (W - 1, 0), one row fewer. -1 or absent: no window (vLLM's default).
- FFN: a dense SiLU MLP of intermediate_size whatever the target's experts (MiMoV2MLP in both
  MTP layers); RMSNorm eps layernorm_epsilon for every norm.
- Chain: eh_proj(concat(enorm(e), hnorm(h))), embedding first, no position-0 mask; the block;
  final_layernorm(h) handed on and scored by the main lm_head (vLLM MiMoV2MTPLayer.forward,
  SGLang MiMoV2ModelNextN.forward). The hidden a target hands module 1 is its final norm's output
  (vLLM MiMoV2Model.forward). vLLM 0.34 runs module 0 at every depth (n_predict 1).
The target (hybrid full / sliding-window layers, MoE) is not built.
"""

from collections.abc import Mapping

from mtp_jax import validate
from mtp_jax.families.base import Conventions, Family, Layout, Sources, no_moe

_NAMES = {"post_attention_layernorm.weight": "pre_mlp_layernorm.weight",
          "shared_head.norm.weight": "final_layernorm.weight",
          "self_attn.sinks": "self_attn.attention_sink_bias"}


def _sources(cfg, names, first_layer):
  prefixes = tuple(f"model.mtp.layers.{i}." for i in range(cfg.num_modules))
  return Sources(prefixes, lambda i, s: (prefixes[i] + _NAMES.get(s, s), None))


def mtp_attention(config: Mapping) -> dict:
  """BlockConfig fields of the MTP block from config.json (the module docstring says where each is read)."""
  for key in ("swa_num_attention_heads", "swa_num_key_value_heads", "swa_head_dim", "layernorm_epsilon"):
    if config.get(key) is None:
      raise validate.InvalidValue(f"config.json: {key}", f"config.json has no {key!r}, which MiMo-V2-Flash's MTP "
                                  "attention reads")
  window = config.get("sliding_window_size")
  return dict(num_heads=config["swa_num_attention_heads"], num_kv_heads=config["swa_num_key_value_heads"],
              head_dim=config["swa_head_dim"], v_head_dim=config.get("swa_v_head_dim"),
              attention_value_scale=config.get("attention_value_scale"),
              sliding_window=None if window is None or window == -1 else window + 1,
              attention_sinks=bool(config.get("add_swa_attention_sink_bias", False)),
              rope_theta=float(config.get("swa_rope_theta", config.get("rope_theta", 1e6))),
              rms_norm_eps=config["layernorm_epsilon"], qk_norm=False, attention_out_bias=False)


LAYOUT = Layout("mimo_v2", r"model\.mtp\.layers\.\d+\.final_layernorm\.weight", _sources)

FAMILY = Family(
    name="mimo_v2_flash", title="MiMo-V2-Flash", model_types=("mimo_v2_flash", "mimo_v2"), layout="mimo_v2",
    conventions=Conventions(pass_normed_hidden=True, head_norm=True, mask_first_embedding=False),
    moe=no_moe, mtp_blocks=mtp_attention,
    target_refusal="target (hybrid full / sliding-window attention, MoE) not built",
    sources="vLLM mimo_v2_mtp.py, SGLang mimo_v2_nextn.py")
