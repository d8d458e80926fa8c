"""StepFun Step-3.5 / Step-3.7 (step3p5, step3p7): MTP modules load and run; the target is refused by name.

Where each fact was read (vLLM 0.34 model_executor/models/step3p5_mtp.py and step3p5.py, SGLang 0.5.23
srt/models/step3p5_mtp.py and step3p5.py, transformers 5.25 models/step3p7/ and modeling_layers.py):

- Layout: module k at model.layers.{num_hidden_layers + k} (the `deepseek` names): enorm, hnorm,
  eh_proj, shared_head.norm and shared_head.output (its LM head; vLLM and SGLang rename it
  shared_head.head, which is read too), the decoder layer's tensors beside them (or under
  .transformer.; both engines drop that segment). The embedding is model.embed_tokens.
- Chain (vLLM Step3p5AMultiTokenPredictorLayer / compute_logits; SGLang Step3p5AMultiTokenPredictor):
  eh_proj(concat(enorm(e), hnorm(h))), embedding first, no position-0 mask; the layer; logits =
  shared_head.output(shared_head.norm(h)) with the module's own head; the residual h, not the normed
  one, handed on (SGLang: hidden_states_before_norm; vLLM returns the layer's output). Depth i runs
  module i % K. The hidden a caller hands module 1 is the target's last-layer output before its final
  norm (vLLM's Step3p5Model.forward returns it so and compute_logits norms it; SGLang's logits processor
  gets it as hidden_states_before_norm). transformers'
  generic MtpModel instead scores with the target's lm_head and hands on the normed hidden; mtp_jax
  follows the engines, whose reading uses the released per-module heads.
- Norms: every RMSNorm (enorm, hnorm, the layer's, q / k, shared_head.norm) scales by 1 + weight
  (GemmaRMSNorm in both engines, Step3p7RMSNorm in transformers); eps rms_norm_eps.
- Attention of MTP layer L = num_hidden_layers + k: its type is [*layer_types, *mtp_layer_types][L]
  (released configs pad layer_types with the MTP layers; transformers splits the pad off into
  mtp_layer_types), "full_attention" past the lists (transformers' default). Sliding layers attend
  over sliding_window rows, the query included (vLLM's per_layer_sliding_window, transformers' mask;
  SGLang's RadixAttention window keeps one row more), with num_sliding_attention_heads (else
  attention_other_setting.num_attention_heads) query heads; kv heads num_attention_groups (transformers:
  num_key_value_heads). GQA with q / k norms per head, then RoPE in halves over the first
  head_dim * partial_rotary_factor dims (partial_rotary_factors[L], or rope_parameters[type] in
  transformers' configs), theta rope_theta[L] (a list, or one value); rope_scaling applies where
  yarn_only_types lists the layer's type (all types without the list, as vLLM reads it);
  use_rope_layers[L] false: no RoPE. With use_head_wise_attn_gate, g_proj [H, D] gives one logit per
  head and head h's output is multiplied by sigmoid(g_h) before o_proj (`BlockConfig.attention_head_gate`).
- FFN: dense SwiGLU of intermediate_size unless the layer is MoE ([*mlp_layer_types,
  *mtp_mlp_layer_types][L] == "sparse", else L in moe_layers_enum; transformers and vLLM leave MTP
  layers dense otherwise). swiglu_limits_shared[L] > 0 clips it: min(silu(gate), limit) *
  clip(up, -limit, limit) (vLLM SwigluStepAndMul, transformers Step3p7MLP; `BlockConfig.swiglu_limit`).

Refused, naming the key (NotImplementedError): a MoE MTP layer (vLLM 0.34's MTP loader has no place
for the layer's share_expert tensors and SGLang builds every MTP layer from layer 45's settings, so
the two do not agree on how one runs); MTP layers that differ in any setting above (mtp_jax's modules
share one block config); query_pre_attn_scalar other than head_dim (transformers' scale; the engines
use head_dim^-0.5); a sliding kv head count in attention_other_setting other than the full layers'
(SGLang reads it, vLLM does not); attention_bias and mlp_bias (the engines and transformers put the
biases on different projections); att_impl_type other than GQA. The target (sliding-window / full
layers, MoE) is not built.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from mtp_jax import validate
from mtp_jax.families.base import DEFAULT_EMBED, Blocks, Conventions, Family, Sources, layer_list

_EH_PROJ = re.compile(r"model\.layers\.(\d+)\.eh_proj\.weight")
_MODULE_OWN = ("enorm.", "hnorm.", "eh_proj.", "shared_head.norm.")  # beside the layer, never under .transformer.
_HEADS = ("shared_head.output.weight", "shared_head.head.weight")


def _sources(cfg, names, first_layer):
  if first_layer is None:
    layers = [int(m.group(1)) for n in names if (m := _EH_PROJ.fullmatch(n))]
    if not layers:
      raise ValueError("step3p5 checkpoint has no model.layers.<n>.eh_proj.weight")
    first_layer = min(layers)
  prefixes = tuple(f"model.layers.{first_layer + i}." for i in range(cfg.num_modules))

  def source(i, s):
    p = prefixes[i]
    if s == "shared_head.head.weight":
      return next((p + n for n in _HEADS if p + n in names), p + _HEADS[0]), None
    if s.startswith(_MODULE_OWN) or p + s in names:
      return p + s, None
    return (p + "transformer." + s if p + "transformer." + s in names else p + s), None

  return Sources(prefixes, source, embed=DEFAULT_EMBED)


def _at(config: Mapping, key: str, i: int, default=None):
  """config[key][i] of a per-layer list (default past its end or without one)."""
  value = layer_list(config, key)
  return default if value is None or i >= len(value) else value[i]


def _mtp_indices(config: Mapping) -> range:
  """The layer indices L of the MTP layers: num_hidden_layers + k."""
  first = validate.positive_int("config.json: num_hidden_layers", config.get("num_hidden_layers"))
  return range(first, first + (config.get("num_nextn_predict_layers") or 1))


def _layer_type(config: Mapping, layer: int) -> str:
  types = [*(config.get("layer_types") or []), *(config.get("mtp_layer_types") or [])]
  kind = types[layer] if layer < len(types) else "full_attention"
  return validate.one_of(f"config.json: layer_types[{layer}]", kind, ("sliding_attention", "full_attention"))


def _attention(config: Mapping, layer: int) -> dict:
  """The flat config.json keys of MTP layer `layer`'s attention (the module docstring says where read)."""
  kind = _layer_type(config, layer)
  other = config.get("attention_other_setting") or {}
  heads = config.get("num_attention_heads")
  if kind == "sliding_attention":
    heads = config.get("num_sliding_attention_heads") or other.get("num_attention_heads") or heads
  nested = (config.get("rope_parameters") or {}).get(kind)
  if isinstance(nested, Mapping):  # transformers' configs: RoPE per layer type
    theta, factor = nested.get("rope_theta", 10000.0), nested.get("partial_rotary_factor", 1.0)
    scaling = dict(nested) if nested.get("rope_type", "default") != "default" else None
  else:
    theta = config.get("rope_theta", 10000.0)
    theta = _at(config, "rope_theta", layer) if isinstance(theta, list) else theta
    factor = _at(config, "partial_rotary_factors", layer, config.get("partial_rotary_factor", 1.0))
    only = config.get("yarn_only_types")
    scaling = config.get("rope_scaling") if only is None or kind in only else None
  return dict(num_attention_heads=heads,
              num_key_value_heads=config.get("num_attention_groups") or config.get("num_key_value_heads") or heads,
              rope_theta=theta, partial_rotary_factor=factor, rope_scaling=scaling)


def hf_view(config: Mapping) -> Mapping:
  """config.json with the MTP layers' attention keys resolved to the flat values the shared readers
  read (num_attention_heads, num_key_value_heads, rope_theta, partial_rotary_factor, rope_scaling);
  MTP layers whose values differ are refused naming the key (NotImplementedError). Per-layer lists
  of other keys are left for `mtp_block`. The MLP is SiLU-gated whatever hidden_act says (both
  engines build SiLU; transformers resets the released "swigluoai" to silu). Applied twice, the same."""
  if config.get("num_hidden_layers") is None:
    return config
  layers = [_attention(config, layer) for layer in _mtp_indices(config)]
  _same(layers)
  rest = {k: v for k, v in config.items() if k not in ("partial_rotary_factors", "rope_parameters", "yarn_only_types")}
  return {**rest, **layers[0], "hidden_act": "silu"}


def _same(layers: list[dict]) -> None:
  """Refuses MTP layers whose settings (by config.json key) differ: mtp_jax's modules share one block config."""
  for key, value in layers[0].items():
    if any(other[key] != value for other in layers[1:]):
      raise NotImplementedError(f"config.json: {key} differs between the MTP layers ({[s[key] for s in layers]}); "
                                "mtp_jax's MTP modules share one block config")


def _is_moe(config: Mapping, layer: int) -> str | None:
  """The config.json key that makes MTP layer `layer` a MoE layer, else None."""
  if config.get("mlp_layer_types") is not None:
    types = [*config["mlp_layer_types"], *(config.get("mtp_mlp_layer_types") or [])]
    return "mlp_layer_types" if layer < len(types) and types[layer] == "sparse" else None
  enum = config.get("moe_layers_enum")
  if enum is None:
    return None
  items = enum.split(",") if isinstance(enum, str) else enum
  return "moe_layers_enum" if layer in {int(i) for i in items if str(i).strip()} else None


def step_moe(config: Mapping) -> None:
  """The MTP layers' FFN is dense: a MoE MTP layer is refused naming the key that makes it one."""
  for layer in _mtp_indices(config):
    if key := _is_moe(config, layer):
      raise NotImplementedError(f"config.json: {key} makes MTP layer {layer} a MoE layer, which mtp_jax does not "
                                "build for Step-3.5 (vLLM 0.34's MTP loader and SGLang's disagree on its "
                                "share_expert and settings); only dense MTP layers load")
  return None


def _layer(config: Mapping, layer: int) -> dict:
  """MTP layer `layer`'s block settings, by the config.json key each comes from."""
  kind = _layer_type(config, layer)
  window = config.get("sliding_window") if kind == "sliding_attention" else None
  if kind == "sliding_attention" and window is None:
    raise validate.InvalidValue("config.json: sliding_window", f"config.json: MTP layer {layer} is a sliding "
                                "layer (layer_types) but sliding_window is not set")
  limit = _at(config, "swiglu_limits_shared", layer)
  use_rope = _at(config, "use_rope_layers", layer, True)
  return {"layer_types": window, "swiglu_limits_shared": float(limit) if limit else None,
          "use_rope_layers": bool(use_rope)}


def _refuse(config: Mapping) -> None:
  """Raises NotImplementedError naming the config.json key of what the MTP layers hold unbuilt."""
  head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
  scalar = config.get("query_pre_attn_scalar")
  if scalar is not None and scalar != head_dim:
    raise NotImplementedError(f"config.json: query_pre_attn_scalar {scalar} (transformers' softmax scale) differs "
                              f"from head_dim {head_dim}, the scale vLLM and SGLang use; not built")
  groups = (config.get("attention_other_setting") or {}).get("num_attention_groups")
  if groups is not None and groups != config["num_key_value_heads"] and any(
      _layer_type(config, layer) == "sliding_attention" for layer in _mtp_indices(config)):
    raise NotImplementedError(f"config.json: attention_other_setting.num_attention_groups {groups} differs from "
                              f"num_attention_groups {config['num_key_value_heads']}: SGLang gives sliding layers "
                              "that kv head count, vLLM does not; not built")
  for key in ("attention_bias", "mlp_bias"):
    if config.get(key):
      raise NotImplementedError(f"config.json: {key} is not built for Step-3.5 (transformers and the engines put "
                                "the biases on different projections)")
  if config.get("att_impl_type", "GQA") != "GQA":
    raise NotImplementedError(f"config.json: att_impl_type {config['att_impl_type']!r} is not built, only 'GQA'")


def mtp_block(config: Mapping) -> dict:
  """BlockConfig fields of the MTP layers, and own_lm_head (the module docstring says where each is
  read); config is `hf_view`'s. Layers that differ are refused naming the key: mtp_jax's modules
  share one block config."""
  _refuse(config)
  layers = [_layer(config, layer) for layer in _mtp_indices(config)]
  _same(layers)
  first = layers[0]
  gate = config.get("use_head_wise_attn_gate", False)
  return dict(sliding_window=first["layer_types"], swiglu_limit=first["swiglu_limits_shared"],
              use_rope=first["use_rope_layers"], attention_head_gate=validate.flag(
                  "config.json: use_head_wise_attn_gate", gate), own_lm_head=True)


FAMILY = Family(
    name="step3p5", title="Step-3.5 / 3.7", model_types=("step3p5", "step3p7"), layout="deepseek",
    conventions=Conventions(pass_normed_hidden=False, head_norm=True, mask_first_embedding=False),
    blocks=Blocks(qk_norm=True, norm_unit_offset=True), moe=step_moe, mtp_blocks=mtp_block, num_mtp=1,
    layout_sources=_sources, hf_view=hf_view,
    target_refusal="target (sliding-window / full layers with head-wise attention gates, MoE) not built",
    sources="vLLM step3p5_mtp.py, SGLang step3p5_mtp.py; the layer as transformers step3p7")
