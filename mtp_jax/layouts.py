"""Real MTP checkpoint layouts (DeepSeek-V3 / GLM-4.5, MiMo, ERNIE-4.5, Qwen3-Next, LongCat-Flash,
MiMo-V2) onto mtp_jax's names, and each family's chain conventions.

Dense and MoE FFNs are supported; docs/checkpoints.md lists the names and every layout's mapping.
Routed experts are stored one tensor per expert (mlp.experts.{e}.{gate,up,down}_proj.weight,
torch [out, in]) in every layout, canonical files included, and stacked into mtp_jax's
mlp.experts.{gate,up,down}_proj ([E, in, out], see blocks/moe.py) on load.
Each family's chain conventions are in CONVENTIONS (sources in docs/checkpoints.md).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Iterable, Mapping

import numpy as np
from flax import nnx

from mtp_jax import mtp
from mtp_jax.checkpoint import CheckpointReader, TensorSource, save_tensors
from mtp_jax.config import MlaConfig, MoeConfig, MtpConfig, RopeScaling

LAYOUTS = ("canonical", "deepseek", "mimo", "ernie", "qwen3_next", "longcat", "mimo_v2")

# Each family's chain: its HF model_types, tensor layout and MtpConfig conventions.
# Where transformers' MtpModel covers a family (DeepSeek-V3, GLM-4.5) its behaviour is the default
# (post-norm hidden chained, no position-0 mask); elsewhere vLLM's MTP model file (SGLang where
# vLLM has no rule). Every target hands module 1 its post-final-norm hidden (TargetConfig
# default); concat order is fixed at load time (MiMo's input_proj halves are swapped).
# depth_reuse "cycle" is vLLM's spec_step_idx % num_mtp_layers. Sources: docs/checkpoints.md.
CONVENTIONS = {
    "deepseek_v3": dict(model_types=("deepseek_v3",), layout="deepseek", pass_normed_hidden=True,
                        head_norm=True, mask_first_embedding=False, depth_reuse="cycle"),
    "glm4_moe": dict(model_types=("glm4_moe",), layout="deepseek", pass_normed_hidden=True,
                     head_norm=True, mask_first_embedding=False, depth_reuse="cycle"),
    "mimo": dict(model_types=("mimo",), layout="mimo", pass_normed_hidden=True, head_norm=True,
                 mask_first_embedding=True, depth_reuse="cycle"),
    "ernie4_5": dict(model_types=("ernie4_5", "ernie4_5_moe"), layout="ernie", pass_normed_hidden=False,
                     head_norm=False, mask_first_embedding=True, depth_reuse="cycle"),
    "qwen3_next": dict(model_types=("qwen3_next", "qwen3_5", "qwen3_5_moe"), layout="qwen3_next",
                       pass_normed_hidden=True, head_norm=True, mask_first_embedding=False,
                       depth_reuse="cycle"),
    "longcat_flash": dict(model_types=("longcat_flash",), layout="longcat", pass_normed_hidden=True,
                          head_norm=True, mask_first_embedding=False, depth_reuse="cycle"),
    "mimo_v2_flash": dict(model_types=("mimo_v2_flash", "mimo_v2"), layout="mimo_v2",
                          pass_normed_hidden=True, head_norm=True, mask_first_embedding=False,
                          depth_reuse="cycle"),
}
CONVENTION_FIELDS = ("pass_normed_hidden", "head_norm", "mask_first_embedding", "depth_reuse")

# The tensor that only that layout has, for detect_layout.
_SIGNATURES = {
    "canonical": r"mtp\.\d+\.eh_proj\.weight",
    "deepseek": r"model\.layers\.\d+\.eh_proj\.weight",
    "mimo": r"model\.mtp_layers\.\d+\.input_proj\.weight",
    "ernie": r"model\.mtp_linear_proj\.\d+\.weight",
    "qwen3_next": r"mtp\.fc\.weight",
    "longcat": r"model\.mtp\.layers\.\d+\.enorm\.m\.weight",
    "mimo_v2": r"model\.mtp\.layers\.\d+\.final_layernorm\.weight",
}

# HF config keys for the number of MTP modules: DeepSeek / GLM / MiMo, Qwen3-Next, others.
_NUM_MTP_KEYS = ("num_nextn_predict_layers", "mtp_num_hidden_layers", "num_mtp_layers")

_MIMO_NAMES = {"enorm.weight": "token_layernorm.weight",
               "hnorm.weight": "hidden_layernorm.weight",
               "eh_proj.weight": "input_proj.weight",
               "shared_head.norm.weight": "final_layernorm.weight"}
_ERNIE_NAMES = {"enorm.weight": "model.mtp_emb_norm.{i}.weight",
                "hnorm.weight": "model.mtp_hidden_norm.{i}.weight",
                "eh_proj.weight": "model.mtp_linear_proj.{i}.weight"}
# LongCat-Flash: one final norm for all modules; the MLP sits under transformer_layer.
_LONGCAT_NAMES = {"enorm.weight": "enorm.m.weight", "hnorm.weight": "hnorm.m.weight",
                  "mlp.gate_proj.weight": "transformer_layer.mlp.gate_proj.weight",
                  "mlp.up_proj.weight": "transformer_layer.mlp.up_proj.weight",
                  "mlp.down_proj.weight": "transformer_layer.mlp.down_proj.weight"}
_MIMO_V2_NAMES = {"post_attention_layernorm.weight": "pre_mlp_layernorm.weight",
                  "shared_head.norm.weight": "final_layernorm.weight"}
# One set shared by every Qwen3-Next MTP layer.
_QWEN3_NEXT_SHARED = {"enorm.weight": "mtp.pre_fc_norm_embedding.weight",
                      "hnorm.weight": "mtp.pre_fc_norm_hidden.weight",
                      "eh_proj.weight": "mtp.fc.weight",
                      "shared_head.norm.weight": "mtp.norm.weight"}


# The stacked expert weights; each is read from and written as one tensor per expert.
_STACKED = ("mlp.experts.gate_proj", "mlp.experts.up_proj", "mlp.experts.down_proj")


def canonical_shapes(cfg: MtpConfig) -> dict[str, tuple[int, ...]]:
  """Every canonical name -> shape, e.g. mtp.0.eh_proj.weight -> (D, 2D), lm_head -> (V, D).

  With cfg.moe: mtp.{i}.mlp.gate.weight (E, D), .gate.e_score_correction_bias (E,), stacked
  mtp.{i}.mlp.experts.{gate,up}_proj (E, D, Fe) and .down_proj (E, Fe, D), and the shared
  expert(s) mlp.shared_experts.* or (Qwen) mlp.shared_expert.* + mlp.shared_expert_gate.weight.
  Read off the module cfg builds (no arrays allocated), so every attention / FFN option's
  params are listed as the model holds them.
  """
  model = nnx.eval_shape(lambda: mtp.MtpModel(cfg, rngs=nnx.Rngs(0)))
  return {name: shape for name, (_, shape) in mtp.param_names(model, mtp.canonical_name).items()}


def detect_layout(names: Iterable[str]) -> str:
  """Which of LAYOUTS a checkpoint's tensor names follow."""
  names = list(names)
  found = [layout for layout, pattern in _SIGNATURES.items()
           if any(re.fullmatch(pattern, n) for n in names)]
  if len(found) != 1:
    wanted = ", ".join(f"{layout}: {p}" for layout, p in _SIGNATURES.items())
    raise ValueError(f"cannot tell the MTP layout (matches {found or 'none'}); looked for {wanted}")
  return found[0]


# Defaults transformers' config classes apply when config.json leaves a field out.
_FAMILY_PARTIAL_ROTARY = {"glm4_moe": 0.5, "qwen3_next": 0.25}
_INTERLEAVED_ROPE = ("ernie4_5", "ernie4_5_moe")
# Block options a family always has, which its config.json does not spell out. Qwen3-Next's
# full-attention layer (transformers' Qwen3NextAttention, vLLM's qwen3_next.py): per-head q / k
# RMSNorms, q_proj giving per head [q | gate], and zero-centred (1 + w) RMSNorms throughout.
FAMILY_BLOCKS = {"qwen3_next": dict(qk_norm=True, attention_gate=True, norm_unit_offset=True)}
# Families whose MLA is mtp_jax's (blocks/mla.py); LongCat-Flash's also scales q and the latent.
_MLA_TYPES = ("deepseek_v3", "longcat_flash")
# LongCat-Flash: the MTP module's FFN is dense (vLLM longcat_flash_mtp.py clears n_routed_experts),
# its width ffn_hidden_size (transformers' LongcatFlashConfig); one module when the config says
# nothing (SGLang's LongcatFlashConfig default num_nextn_predict_layers=1).
_DENSE_MTP_TYPES = ("longcat_flash",)
_FAMILY_NUM_MTP = {"longcat_flash": 1}


def _load_json(config):
  if isinstance(config, Mapping):
    return config
  with open(config) as f:
    return json.load(f)


def family_of(config: Mapping, layout: str | None = None) -> str | None:
  """The CONVENTIONS family of an HF config (by model_type), else of a layout; None for neither."""
  model_type = config.get("model_type")
  for family, conv in CONVENTIONS.items():
    if model_type in conv["model_types"]:
      return family
  for family, conv in CONVENTIONS.items():
    if layout is not None and conv["layout"] == layout:
      return family
  return None


def conventions(family: str | None) -> dict:
  """MtpConfig chain fields of a family (empty for None: MtpConfig's defaults)."""
  if family is None:
    return {}
  if family not in CONVENTIONS:
    raise ValueError(f"unknown family {family!r}; expected one of {sorted(CONVENTIONS)}")
  return {k: CONVENTIONS[family][k] for k in CONVENTION_FIELDS}


def moe_from_hf(config: Mapping) -> MoeConfig | None:
  """The MoE FFN of a DeepSeek-V3 / GLM-4.5 (n_routed_experts) or Qwen3-Next (num_experts)
  config.json, else None.

  DeepSeek-V3 and GLM-4.5 route with sigmoid scores and an e_score_correction_bias (transformers'
  DeepseekV3 / Glm4Moe TopkRouter; DeepSeek-V3's config says so in scoring_func / topk_method).
  Qwen3-Next routes with softmax scores and adds one shared expert scaled by
  sigmoid(shared_expert_gate(x)) (transformers' Qwen3NextSparseMoeBlock)."""
  if family_of(config) == "qwen3_next" and config.get("num_experts"):
    shared = config.get("shared_expert_intermediate_size") or 0
    return MoeConfig(num_experts=config["num_experts"], num_experts_per_tok=config["num_experts_per_tok"],
                     moe_intermediate_size=config["moe_intermediate_size"], scoring="softmax",
                     norm_topk_prob=config.get("norm_topk_prob", True), n_shared_experts=1 if shared else 0,
                     shared_expert_intermediate_size=shared or None, shared_expert_gate=bool(shared))
  if not config.get("n_routed_experts") or config.get("model_type") in _DENSE_MTP_TYPES:
    return None
  scoring = config.get("scoring_func", "sigmoid")
  if config.get("topk_method", "noaux_tc") != "noaux_tc":
    raise ValueError(f"config.json: topk_method {config['topk_method']!r} is not supported, only 'noaux_tc'")
  return MoeConfig(num_experts=config["n_routed_experts"], num_experts_per_tok=config["num_experts_per_tok"],
                   moe_intermediate_size=config["moe_intermediate_size"], scoring=scoring,
                   e_score_correction_bias=True, n_group=config.get("n_group") or 1,
                   topk_group=config.get("topk_group") or 1, norm_topk_prob=config.get("norm_topk_prob", True),
                   routed_scaling_factor=float(config.get("routed_scaling_factor", 1.0)),
                   n_shared_experts=config.get("n_shared_experts") or 0,
                   first_k_dense_replace=config.get("first_k_dense_replace", 0))


def mla_from_hf(config: Mapping) -> MlaConfig | None:
  """The MLA attention of a DeepSeek-V3 or LongCat-Flash config.json (kv_lora_rank set), else None.

  LongCat-Flash scales the query by sqrt(hidden_size / q_lora_rank) and the normed latent by
  sqrt(hidden_size / kv_lora_rank) (transformers' LongcatFlashMLA always; SGLang / vLLM fold them
  into q_a_layernorm / kv_a_layernorm when mla_scale_q_lora / mla_scale_kv_lora, default true)."""
  if not config.get("kv_lora_rank"):
    return None
  model_type = config.get("model_type")
  if model_type not in _MLA_TYPES:
    raise ValueError(f"config.json: MLA (kv_lora_rank) of model_type {model_type!r} is not "
                     f"supported, only {', '.join(_MLA_TYPES)}'s")
  scales = {}
  if model_type == "longcat_flash":
    d, q_rank, kv_rank = config["hidden_size"], config.get("q_lora_rank"), config["kv_lora_rank"]
    if config.get("mla_scale_q_lora", True):
      if not q_rank:
        raise ValueError("config.json: mla_scale_q_lora needs q_lora_rank (LongCat-Flash always has a q LoRA)")
      scales["q_lora_scale"] = (d / q_rank) ** 0.5
    if config.get("mla_scale_kv_lora", True):
      scales["kv_lora_scale"] = (d / kv_rank) ** 0.5
  return MlaConfig(kv_lora_rank=config["kv_lora_rank"], q_lora_rank=config.get("q_lora_rank"),
                   qk_nope_head_dim=config["qk_nope_head_dim"], qk_rope_head_dim=config["qk_rope_head_dim"],
                   v_head_dim=config["v_head_dim"], **scales)


def block_kwargs_from_hf(config: Mapping) -> dict:
  """BlockConfig fields from an HF config.json; settings mtp_jax cannot honour raise ValueError."""
  model_type = config.get("model_type")
  rope = config.get("rope_scaling") or config.get("rope_parameters") or {}
  rope_type = rope.get("rope_type", rope.get("type", "default"))
  scaling = None
  if rope_type == "yarn":
    fields = {f.name for f in dataclasses.fields(RopeScaling)} - {"rope_type", "max_position_embeddings"}
    scaling = RopeScaling(**{k: v for k, v in rope.items() if k in fields},
                          max_position_embeddings=config.get("max_position_embeddings"))
  elif rope_type != "default":
    raise ValueError(f"config.json: RoPE type {rope_type!r} is not supported, only plain RoPE and YaRN")
  act = config.get("hidden_act", "silu")
  if act not in ("silu", "swish"):
    raise ValueError(f"config.json: hidden_act {act!r} is not supported, only SiLU-gated MLPs")
  if config.get("use_bias"):
    raise ValueError("config.json: use_bias (biases on every linear, ERNIE-4.5) is not supported")
  heads = config["num_attention_heads"]
  mla = mla_from_hf(config)
  return dict(
      # transformers' family defaults where config.json leaves them out (GLM-4.5 0.5, Qwen3-Next 0.25).
      partial_rotary_factor=float(config.get("partial_rotary_factor", rope.get(
          "partial_rotary_factor", _FAMILY_PARTIAL_ROTARY.get(model_type, 1.0)))),
      # ERNIE-4.5 rotates interleaved pairs (transformers' ernie4_5 rotate_half, SGLang's
      # rope_is_neox_style False); DeepSeek-V3 says so in rope_interleave, whose transformers
      # default (True) its MLA reads.
      rope_interleave=bool(config.get("rope_interleave", model_type in _INTERLEAVED_ROPE or mla is not None)),
      rope_scaling=scaling,
      mla=mla,
      # GLM-4.5's per-head q / k RMSNorms (use_qk_norm); Qwen3-Next's from FAMILY_BLOCKS below.
      qk_norm=bool(config.get("use_qk_norm", False)),
      moe=moe_from_hf(config),
      hidden_size=config["hidden_size"],
      num_heads=heads,
      # MLA has no kv heads (every head reads the latent); DeepSeek-V3 configs still carry a count.
      num_kv_heads=heads if mla is not None else config.get("num_key_value_heads") or heads,
      head_dim=config.get("head_dim") or config["hidden_size"] // heads,
      # LongCat-Flash names it ffn_hidden_size (transformers maps intermediate_size onto it).
      intermediate_size=config.get("intermediate_size") or config["ffn_hidden_size"],
      rms_norm_eps=config.get("rms_norm_eps", 1e-6),
      rope_theta=float(config.get("rope_theta", rope.get("rope_theta", 10000.0))),
      # Qwen2-family configs (MiMo) have no attention_bias key: their q, k, v always carry biases.
      attention_bias=config.get("attention_bias", model_type in ("qwen2", "mimo")),
  ) | FAMILY_BLOCKS.get(family_of(config), {})


def config_from_hf(config: Mapping | str | os.PathLike, *, layout: str | None = None) -> MtpConfig:
  """An MtpConfig from an HF config.json (dict or path), or from one written by save_canonical.

  The chain conventions are the family's (CONVENTIONS, by model_type, else by `layout`);
  a config of neither keeps MtpConfig's defaults. Settings mtp_jax cannot honour (RoPE
  scaling, partial rotary, non-SiLU MLPs) raise ValueError.
  """
  config = _load_json(config)
  if "mtp_jax" in config:
    return MtpConfig(**config["mtp_jax"])
  num_modules = next((config[k] for k in _NUM_MTP_KEYS if config.get(k)),
                     _FAMILY_NUM_MTP.get(config.get("model_type")))
  if num_modules is None:
    raise ValueError(f"config has no MTP modules (none of {_NUM_MTP_KEYS} is set and positive)")
  return MtpConfig(**block_kwargs_from_hf(config), vocab_size=config["vocab_size"], num_modules=num_modules,
                   **conventions(family_of(config, layout)))


def _swap_halves(w: np.ndarray) -> np.ndarray:
  # MiMo's input_proj reads concat(hidden, embedding); eh_proj reads concat(embedding, hidden).
  half = w.shape[1] // 2
  return np.concatenate([w[:, half:], w[:, :half]], axis=1)


def _plus_one(w: np.ndarray) -> np.ndarray:
  # Qwen3-Next stores its RMSNorm weights zero-centred (scale 1 + weight). A config with
  # norm_unit_offset reads them as stored; one without gets 1 + weight, in float32 so bf16
  # weights near 0 keep their precision.
  return w.astype(np.float32) + 1.0


def _first_deepseek_layer(names: Iterable[str]) -> int:
  layers = [int(m.group(1)) for n in names
            if (m := re.fullmatch(r"model\.layers\.(\d+)\.eh_proj\.weight", n))]
  if not layers:
    raise ValueError("deepseek checkpoint has no model.layers.<n>.eh_proj.weight")
  return min(layers)


def _plan(layout, cfg, names, first_layer, tied):
  """(canonical name -> (source names, transform, stacked), scope prefixes).

  The source names hold one equal tensor, or with stacked one expert each, in order.

  Every tensor under a scope prefix must be used, so unsupported parts cannot slip by unread.
  """
  suffixes = [n.split(".", 2)[2] for n in canonical_shapes(cfg) if n.startswith("mtp.0.")]
  ks = range(cfg.num_modules)
  embed, head = ["model.embed_tokens.weight"], ["lm_head.weight"]
  if layout == "canonical":
    prefixes = [f"mtp.{i}." for i in ks]
    source = lambda i, s: (f"mtp.{i}.{s}", None)
    embed = ["embed_tokens.weight"]
  elif layout == "deepseek":
    first = _first_deepseek_layer(names) if first_layer is None else first_layer
    prefixes = [f"model.layers.{first + i}." for i in ks]
    source = lambda i, s: (prefixes[i] + s, None)
    embed = [p + "embed_tokens.weight" for p in prefixes
             if p + "embed_tokens.weight" in names] or embed
    head = [p + "shared_head.head.weight" for p in prefixes
            if p + "shared_head.head.weight" in names] or head
  elif layout == "mimo":
    prefixes = [f"model.mtp_layers.{i}." for i in ks]
    source = lambda i, s: (prefixes[i] + _MIMO_NAMES.get(s, s),
                           _swap_halves if s == "eh_proj.weight" else None)
    # MiMo's q, k, v biases sit where the canonical ones do: no renaming needed.
  elif layout == "ernie":
    prefixes = [f"model.{part}.{i}." for i in ks
                for part in ("mtp_block", "mtp_emb_norm", "mtp_hidden_norm", "mtp_linear_proj")]
    source = lambda i, s: (_ERNIE_NAMES[s].format(i=i) if s in _ERNIE_NAMES else f"model.mtp_block.{i}.{s}",
                           None)
  elif layout == "longcat":
    prefixes = [f"model.mtp.layers.{i}." for i in ks] + ["model.mtp.norm.", "model.mtp.embed_tokens."]
    source = lambda i, s: ("model.mtp.norm.weight" if s == "shared_head.norm.weight" else
                           f"model.mtp.layers.{i}.{_LONGCAT_NAMES.get(s, s)}", None)
    embed = [n for n in ["model.mtp.embed_tokens.weight"] if n in names] or embed
  elif layout == "mimo_v2":
    prefixes = [f"model.mtp.layers.{i}." for i in ks]
    source = lambda i, s: (f"model.mtp.layers.{i}.{_MIMO_V2_NAMES.get(s, s)}", None)
  elif layout == "qwen3_next":
    prefixes = [f"mtp.layers.{i}." for i in ks] + [
        n.removesuffix("weight") for n in _QWEN3_NEXT_SHARED.values()]
    source = lambda i, s: (_QWEN3_NEXT_SHARED.get(s, f"mtp.layers.{i}.{s}"),
                           _plus_one if s.endswith("norm.weight") and not cfg.norm_unit_offset else None)
  else:
    raise ValueError(f"unknown layout {layout!r}; expected one of {LAYOUTS}")
  if tied:  # tie_word_embeddings: the LM head is the (main) embedding matrix
    head = embed
  plan = {}
  for i in ks:
    for s in suffixes:
      if s in _STACKED:
        proj = s.rsplit(".", 1)[1]
        experts = [source(i, f"mlp.experts.{e}.{proj}.weight")[0] for e in range(cfg.moe.num_experts)]
        plan[f"mtp.{i}.{s}"] = (experts, None, True)
      else:
        name, transform = source(i, s)
        plan[f"mtp.{i}.{s}"] = ([name], transform, False)
  plan["embed_tokens.weight"] = (embed, None, False)
  plan["lm_head.weight"] = (head, None, False)
  return plan, tuple(prefixes)


def _shape(source, name: str) -> tuple[int, ...]:
  if isinstance(source, CheckpointReader):
    return source.shape(name)  # from the header, without loading
  return tuple(np.shape(source[name]))


def to_canonical(source: Mapping | CheckpointReader, layout: str, cfg: MtpConfig, *,
                 first_layer: int | None = None, tied: bool = False, lazy: bool = False) -> dict[str, np.ndarray]:
  """Canonical name -> tensor, with the shapes of `canonical_shapes(cfg)` (e.g. float32[V, D]).

  source: name -> array in `layout`, or a CheckpointReader (then only the needed tensors load).
  first_layer: deepseek only, the layer index of MTP module 0 (HF num_hidden_layers); by default
  the lowest layer holding an eh_proj. tied: the checkpoint ties the LM head to the embedding
  (config tie_word_embeddings), so lm_head.weight is read from the embedding. Dtypes stay as
  stored, except that Qwen3-Next norm weights read into a config without norm_unit_offset come
  back as 1 + weight in float32. Arrays read once (a shared Qwen3-Next fc) are shared between names.
  lazy (with a CheckpointReader): TensorSources, read later (block by block) while the reader is open.
  """
  names = set(source.keys())
  plan, prefixes = _plan(layout, cfg, names, first_layer, tied)
  used = {n for sources, _, _ in plan.values() for n in sources}
  unused = sorted(n for n in names if n.startswith(prefixes) and n not in used)
  if unused:
    off = unused[0].endswith("_proj.bias") and not cfg.attention_bias
    no_moe = ".mlp.experts." in unused[0] or ".mlp.gate." in unused[0]
    hint = (" (the config has attention_bias off)" if off
            else " (the config has no moe)" if no_moe and cfg.moe is None else "")
    raise NotImplementedError(
        f"{layout} checkpoint tensor {unused[0]!r}{hint} has no place in this config's MTP module"
        f"{f' ({len(unused) - 1} more like it)' if len(unused) > 1 else ''}: only dense blocks "
        "are supported, or MoE FFNs with a moe config, or MLA with an mla config (no "
        "quantization scales)")
  shapes = canonical_shapes(cfg)
  out, loaded = {}, {}
  for canonical, (sources, transform, stacked) in plan.items():
    # A stacked [E, in, out] tensor is read as E torch [out, in] tensors.
    want = shapes[canonical][:0:-1] if stacked else shapes[canonical]
    for name in sources:
      if name not in names:
        raise ValueError(f"{layout} checkpoint lacks tensor {name!r} "
                         f"(mtp_jax {canonical}, expected shape {want})")
      if _shape(source, name) != want:
        raise ValueError(f"{layout} checkpoint tensor {name!r} has shape {_shape(source, name)}, "
                         f"expected {want} (mtp_jax {canonical})")
      if name not in loaded:
        loaded[name] = source.source(name) if lazy else np.asarray(source[name])
    if stacked:
      out[canonical] = source.stacked(sources) if lazy else np.stack([loaded.pop(name).T for name in sources])
      continue
    for name in sources[1:]:
      if not np.array_equal(loaded[name], loaded[sources[0]]):
        raise ValueError(f"{layout} checkpoint tensors {sources[0]!r} and {name!r} differ, but "
                         f"mtp_jax shares one {canonical} across all MTP modules")
    first = loaded[sources[0]]
    if transform and lazy:  # the whole tensor transformed, then the block asked for
      out[canonical] = TensorSource(shapes[canonical], lambda index, t=transform, f=first: (
          t(np.asarray(f)) if index is None else t(np.asarray(f))[index]))
    else:
      out[canonical] = transform(first) if transform else first
  return out


def read_mtp_checkpoint(path, *,
                        layout: str | None = None) -> tuple[MtpConfig, dict[str, np.ndarray]]:
  """(config, canonical tensors as in `to_canonical`) from a checkpoint and its config.json.

  path: a .safetensors file, a shard index, or their directory. Reads only the MTP tensors, the
  embedding and the LM head, never whole shards.
  """
  with CheckpointReader(path) as reader:
    config_path = os.path.join(os.path.dirname(reader.path), "config.json")
    if not os.path.isfile(config_path):
      raise FileNotFoundError(f"no config.json beside {reader.path}")
    with open(config_path) as f:
      hf = json.load(f)
    layout = layout or detect_layout(reader.keys())
    cfg = config_from_hf(hf, layout=layout)
    first_layer = hf.get("num_hidden_layers") if layout == "deepseek" else None
    return cfg, to_canonical(reader, layout, cfg, first_layer=first_layer,
                             tied=bool(hf.get("tie_word_embeddings", False)))


def _unstack_experts(tensors: Mapping) -> dict:
  """Stacked mtp.{i}.mlp.experts.{proj} [E, in, out] -> mtp.{i}.mlp.experts.{e}.{proj}.weight [out, in]."""
  out = {}
  for name, value in tensors.items():
    if name.startswith("mtp.") and name.split(".", 2)[-1] in _STACKED and np.ndim(value) == 3:
      prefix, proj = name.rsplit(".", 1)
      value = np.asarray(value)
      out |= {f"{prefix}.{e}.{proj}.weight": np.ascontiguousarray(value[e].T) for e in range(value.shape[0])}
    else:
      out[name] = value
  return out


def save_canonical(path, cfg: MtpConfig, tensors: Mapping) -> None:
  """Writes `path`/model.safetensors (canonical names, checked against `canonical_shapes(cfg)`;
  stacked experts written one tensor per expert, as released checkpoints hold them) and
  `path`/config.json, which `read_mtp_checkpoint` reads back."""
  tensors = _unstack_experts(to_canonical(_unstack_experts(tensors), "canonical", cfg))
  os.makedirs(path, exist_ok=True)
  save_tensors(os.path.join(path, "model.safetensors"), tensors, metadata={"format": "mtp_jax"})
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump({"mtp_jax": dataclasses.asdict(cfg)}, f, indent=2)
