"""LG ExaONE-MoE (K-EXAONE): one dense MTP layer under Qwen3-Next's names (mtp.fc, mtp.pre_fc_norm_*,
mtp.norm, mtp.layers.{i}) with plain RMSNorm weights. Where each fact was read (vLLM 0.34
model_executor/models/exaone_moe_mtp.py and exaone_moe.py, SGLang 0.5.23 srt/models/exaone_moe_mtp.py,
transformers 5 models/exaone_moe/):

- Chain: fc(concat(pre_fc_norm_embedding(e), pre_fc_norm_hidden(h))), embedding first, no position-0
  mask; the layer (layers[spec_step_idx % num_nextn_predict_layers]); mtp.norm(h) handed on and
  scored by the main lm_head (tied to the embedding when tie_word_embeddings) (vLLM
  ExaoneMoeMultiTokenPredictor.forward; SGLang ExaoneMoEForCausalLMMTP.forward agrees).
- The layer: pre-norm ExaoneMoeDecoderLayer built with is_mtp: GQA with per-head q / k RMSNorms,
  RoPE always (the target's full-attention layers are NoPE, the MTP layer is trained with RoPE),
  neox-style halves; a dense SiLU MLP of intermediate_size whatever the experts (vLLM's is_mtp;
  SGLang builds layer 0, dense below first_k_dense_replace).
- Window: MTP layer i is index i of mtp_layer_types (absent: layer_types); sliding there means
  mtp_sliding_windows[i] (absent: sliding_windows[i], else sliding_window) rows, the query
  included (vLLM's per_layer_sliding_window; transformers' key > query - window). RoPE theta
  1e6 where config.json names none (vLLM's set_default_rope_theta).
- swiglu_limits[i] > 0 clamps the SwiGLU (vLLM SiluAndMulWithClamp): refused, not built.
The target (sliding-window layers with RoPE, NoPE global layers, sigmoid-routed MoE) is not built.
"""

from collections.abc import Mapping

from mtp_jax import validate
from mtp_jax.families.base import DEFAULT_EMBED, Blocks, Conventions, Family, Sources, no_moe

_SHARED = {"enorm.weight": "mtp.pre_fc_norm_embedding.weight", "hnorm.weight": "mtp.pre_fc_norm_hidden.weight",
           "eh_proj.weight": "mtp.fc.weight", "shared_head.norm.weight": "mtp.norm.weight"}


def _sources(cfg, names, first_layer):
  prefixes = tuple(f"mtp.layers.{i}." for i in range(cfg.num_modules)) + tuple(
      n.removesuffix("weight") for n in _SHARED.values())
  return Sources(prefixes, lambda i, s: (_SHARED.get(s, f"mtp.layers.{i}.{s}"), None), embed=DEFAULT_EMBED)


def _at(config: Mapping, key: str, i: int):
  """config[key][i] of a per-layer list key (None when absent), checked to be long enough."""
  value = config.get(key)
  if value is None:
    return None
  if not isinstance(value, list) or len(value) <= i:
    raise validate.InvalidType(f"config.json: {key}", f"config.json: {key} must be a list of at least {i + 1} "
                               f"entries (one per MTP layer), got {value!r:.60}")
  return value[i]


def _window(config: Mapping, i: int) -> int | None:
  """Rows MTP layer i attends to (None: all): sliding when (mtp_)layer_types[i] says so, else
  transformers' default from sliding_window_pattern (an int p: layer i slides unless (i + 1) % p
  == 0; a string of L / G per layer)."""
  if config.get("sliding_window") is None:
    return None
  kind = _at(config, "mtp_layer_types", i) or _at(config, "layer_types", i)
  if kind is not None:
    validate.one_of(f"config.json: layer_types[{i}]", kind, ("sliding_attention", "full_attention"))
    sliding = kind == "sliding_attention"
  else:
    pattern = config.get("sliding_window_pattern", 4)
    sliding = pattern[i % len(pattern)] == "L" if isinstance(pattern, str) and pattern else (
        isinstance(pattern, int) and pattern > 0 and (i + 1) % pattern != 0)
  if not sliding:
    return None
  window = _at(config, "mtp_sliding_windows", i) or _at(config, "sliding_windows", i) or config["sliding_window"]
  return validate.positive_int("config.json: sliding_window", window)


def mtp_block(config: Mapping) -> dict:
  """BlockConfig fields of the MTP layers from config.json (the module docstring says where each is
  read); mtp_jax's modules share one block config, so layers with different windows are refused."""
  count = config.get("num_nextn_predict_layers") or 1
  for i in range(count):
    limit = _at(config, "swiglu_limits", i)
    if limit is not None and limit > 0:
      raise ValueError(f"config.json: swiglu_limits[{i}] = {limit} clamps MTP layer {i}'s SwiGLU, which mtp_jax "
                       "does not build (only unclamped SiLU-gated MLPs; a limit <= 0 means none)")
  windows = {_window(config, i) for i in range(count)}
  if len(windows) > 1:
    raise ValueError(f"config.json: the {count} MTP layers attend over different windows {sorted(windows, key=str)}; "
                     "mtp_jax's MTP modules share one block config")
  # vLLM's set_default_rope_theta(config, 1e6) where config.json names no theta.
  theta = config.get("rope_theta", (config.get("rope_parameters") or {}).get("rope_theta", 1e6))
  return dict(sliding_window=windows.pop(), rope_theta=float(theta))


FAMILY = Family(
    name="exaone_moe", title="ExaONE-MoE", model_types=("exaone_moe",), layout="qwen3_next",
    conventions=Conventions(pass_normed_hidden=True, head_norm=True, mask_first_embedding=False),
    blocks=Blocks(qk_norm=True), moe=no_moe, mtp_blocks=mtp_block, num_mtp=1, layout_sources=_sources,
    target_refusal="target (sliding-window layers with RoPE, NoPE global layers, MoE) not built",
    sources="vLLM exaone_moe_mtp.py, SGLang exaone_moe_mtp.py")
