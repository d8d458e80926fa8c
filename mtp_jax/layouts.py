"""Released MTP checkpoints onto mtp_jax's names, and HF config.json files onto its configs, as
each family's record says (`mtp_jax.families`: one module per family).

Dense and MoE FFNs are supported; docs/checkpoints.md lists the names and every layout's mapping.
Routed experts are stored one tensor per expert (mlp.experts.{e}.{gate,up,down}_proj.weight,
torch [out, in]) in every layout, canonical files included, and stacked into mtp_jax's
mlp.experts.{gate,up,down}_proj ([E, in, out], see blocks/moe.py) on load.
Each family's chain conventions are in its record (sources in docs/checkpoints.md).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Iterable, Mapping

import numpy as np
from flax import nnx

from mtp_jax import families, mtp, validate
from mtp_jax.families import base
from mtp_jax.checkpoint import CheckpointReader, Fp8Blocks, TensorSource, read_json, save_tensors
from mtp_jax.config import MlaConfig, MoeConfig, MtpConfig, RopeScaling

LAYOUTS = tuple(families.LAYOUTS)
CONVENTION_FIELDS = tuple(f.name for f in dataclasses.fields(families.Conventions))
# HF config keys for the number of MTP modules: DeepSeek / GLM / MiMo, Qwen3-Next, others.
_NUM_MTP_KEYS = ("num_nextn_predict_layers", "mtp_num_hidden_layers", "num_mtp_layers")


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
  """Which of LAYOUTS a checkpoint's tensor names follow (each family's `Layout.signature`)."""
  names = list(names)
  found = [name for name, layout in families.LAYOUTS.items()
           if any(re.fullmatch(layout.signature, n) for n in names)]
  if len(found) != 1:
    wanted = ", ".join(f"{name}: {layout.signature}" for name, layout in families.LAYOUTS.items())
    raise ValueError(f"cannot tell the MTP layout (matches {found or 'none'}); looked for {wanted}")
  return found[0]


# config.json fields mtp_jax reads, by kind; each is checked (named with its file) before use.
# num_hidden_layers is the target's (pretrained.target_config_from_hf requires it); LongCat-Flash's
# configs name it num_layers and load MTP modules alone.
_REQUIRED_INTS = ("vocab_size", "hidden_size", "num_attention_heads")
_POSITIVE_INTS = ("num_hidden_layers", "num_layers", "num_key_value_heads", "head_dim", "intermediate_size",
                  "ffn_hidden_size", "n_routed_experts", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
                  "shared_expert_intermediate_size",
                  "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_group",
                  "topk_group", "max_position_embeddings",
                  "swa_num_attention_heads", "swa_num_key_value_heads", "swa_head_dim",
                  "swa_v_head_dim", "index_n_heads", "index_head_dim", "index_topk") + _NUM_MTP_KEYS
_COUNTS = ("n_shared_experts", "first_k_dense_replace")
_POSITIVE_REALS = ("rms_norm_eps", "rope_theta", "partial_rotary_factor", "routed_scaling_factor",
                   "layernorm_epsilon", "swa_rope_theta", "attention_value_scale")
_FLAGS = ("tie_word_embeddings", "attention_bias", "use_qk_norm", "norm_topk_prob", "rope_interleave", "use_bias",
          "add_swa_attention_sink_bias", "indexer_rope_interleave")
_OBJECTS = ("rope_scaling", "rope_parameters", "quantization_config")


def text_fields(config: Mapping, file: str = "config.json") -> Mapping:
  """The language model's config: a multimodal config.json's text_config (Qwen3.5; vLLM reads it as
  hf_text_config) lifted over its top level, model_type kept from the top level (the family's);
  configs without one unchanged. Then, for a family with `Family.hf_view` (Step-3.5's per-layer
  lists), the config as that view reads it."""
  text = config.get("text_config")
  if text is not None:
    if not isinstance(text, Mapping):
      raise validate.InvalidType(f"{file}: text_config",
                                 f"{file}: text_config must be a JSON object, got {text!r:.60}")
    config = {**config, **text, "model_type": config.get("model_type")}
  family = families.family_of(config)
  return family.hf_view(config) if family is not None and family.hf_view is not None else config


def check_hf_config(config: Mapping, file: str = "config.json") -> Mapping:
  """config as mtp_jax reads it (`text_fields`), once every field it reads has the right type and
  range: raises validate.InvalidValue / InvalidType whose `.argument` is "<file>: <key>" (e.g. a
  missing vocab_size, a string head_dim, a negative rms_norm_eps). Fields set to null count as
  absent, except the required ones. Configs written by save_canonical ({"mtp_jax": ...}) pass as
  they are."""
  if "mtp_jax" in config:
    return config
  config = text_fields(config, file)
  for key in _REQUIRED_INTS:
    if config.get(key) is None:
      raise validate.InvalidValue(f"{file}: {key}", f"{file} has no {key!r} (a positive int every model needs)")
  for key in _REQUIRED_INTS + _POSITIVE_INTS:
    if config.get(key) is not None:
      validate.positive_int(f"{file}: {key}", config[key])
  for key in _COUNTS:
    if config.get(key) is not None:
      validate.integer(f"{file}: {key}", config[key], 0)
  for key in _POSITIVE_REALS:
    if config.get(key) is not None:
      validate.real(f"{file}: {key}", config[key], 0, lo_open=True)
  for key in _FLAGS:
    if config.get(key) is not None:
      validate.flag(f"{file}: {key}", config[key])
  if config.get("sliding_window_size") is not None:  # MiMo-V2-Flash; -1 means no window, as its engines read it
    validate.integer(f"{file}: sliding_window_size", config["sliding_window_size"], -1)
  for key in _OBJECTS:
    if config.get(key) is not None and not isinstance(config[key], Mapping):
      raise validate.InvalidType(f"{file}: {key}", f"{file}: {key} must be a JSON object or null, "
                                 f"got {config[key]!r:.60}")
  for key in ("model_type", "hidden_act", "dtype", "torch_dtype"):
    if config.get(key) is not None and not isinstance(config[key], str):
      raise validate.InvalidType(f"{file}: {key}", f"{file}: {key} must be a string, got {config[key]!r:.60}")
  return config


def _load_json(config):
  if isinstance(config, Mapping):
    return text_fields(config)
  return check_hf_config(read_json(config), os.fspath(config))


def family_of(config: Mapping, layout: str | None = None) -> str | None:
  """The name of the family of an HF config (by model_type), else of a layout; None for neither."""
  family = families.family_of(config, layout)
  return family.name if family else None


def conventions(family: str | None) -> dict:
  """MtpConfig chain fields of a family (empty for None or a family without MTP: MtpConfig's defaults)."""
  if family is None:
    return {}
  conv = families.get(family).conventions
  return dataclasses.asdict(conv) if conv else {}


def moe_from_hf(config: Mapping) -> MoeConfig | None:
  """The MoE FFN of an HF config.json as its family reads it (`Family.moe`; DeepSeek-V3's sigmoid
  routing for configs of no family), else None."""
  family = families.family_of(config)
  return (family.moe if family else families.base.sigmoid_moe)(config)


def mla_from_hf(config: Mapping) -> MlaConfig | None:
  """The MLA attention of a config.json (kv_lora_rank set) of a family with MLA (`Family.mla`,
  which adds the family's scales), else None."""
  if not config.get("kv_lora_rank"):
    return None
  family = families.family_of(config)
  if family is None or family.mla is None:
    with_mla = ", ".join(f.name for f in families.FAMILIES.values() if f.mla is not None)
    raise ValueError(f"config.json: MLA (kv_lora_rank) of model_type {config.get('model_type')!r} is not "
                     f"supported, only {with_mla}'s")
  return MlaConfig(kv_lora_rank=config["kv_lora_rank"], q_lora_rank=config.get("q_lora_rank"),
                   qk_nope_head_dim=config["qk_nope_head_dim"], qk_rope_head_dim=config["qk_rope_head_dim"],
                   v_head_dim=config["v_head_dim"], **family.mla(config))


def fp8_from_hf(config: Mapping, dtype: str = "float32", file: str = "config.json") -> Fp8Blocks | None:
  """How a config.json's quantization_config says weights are stored: block-scaled FP8
  (quant_method "fp8", fmt e4m3, weight_block_size [rows, cols], as DeepSeek-V3's FP8 release),
  dequantized to `dtype` as they are read; None without a quantization_config. Other methods raise
  NotImplementedError naming them, a bad block size validate.InvalidValue naming the key."""
  quant = config.get("quantization_config")
  if not quant:
    return None
  method = quant.get("quant_method")
  if method != "fp8":
    raise NotImplementedError(f"{file}: quantization_config.quant_method {method!r} is not supported, only "
                              "'fp8' (block-scaled float8_e4m3fn weights)")
  if quant.get("fmt", "e4m3") != "e4m3":
    raise NotImplementedError(f"{file}: quantization_config.fmt {quant['fmt']!r} is not supported, only 'e4m3'")
  block = quant.get("weight_block_size")
  key = f"{file}: quantization_config.weight_block_size"
  if not isinstance(block, list) or len(block) != 2:
    raise validate.InvalidValue(key, f"{key} must be [rows, cols] (per-block scales; per-tensor FP8 is not "
                                f"supported), got {block!r}")
  return Fp8Blocks(block=(validate.positive_int(key, block[0]), validate.positive_int(key, block[1])), dtype=dtype)


def block_kwargs_from_hf(config: Mapping) -> dict:
  """BlockConfig fields from an HF config.json; settings mtp_jax cannot honour raise ValueError."""
  family = families.family_of(config)
  blocks = family.blocks if family else families.Blocks()
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
          "partial_rotary_factor", blocks.partial_rotary_factor))),
      # DeepSeek-V3 says so in rope_interleave, whose transformers default (True) its MLA reads.
      rope_interleave=bool(config.get("rope_interleave", blocks.rope_interleave or mla is not None)),
      rope_scaling=scaling,
      mla=mla,
      dsa=family.dsa(config) if family is not None and family.dsa is not None else None,
      # GLM-4.5's per-head q / k RMSNorms (use_qk_norm); Qwen3-Next always has them.
      qk_norm=bool(config.get("use_qk_norm", blocks.qk_norm)),
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
      attention_bias=config.get("attention_bias", blocks.attention_bias),
      attention_gate=blocks.attention_gate,
      norm_unit_offset=blocks.norm_unit_offset,
  )


def refuse_mtp(config: Mapping) -> None:
  """Raises NotImplementedError naming config.json's model_type and why, for a family whose MTP
  modules mtp_jax does not load (`Family.mtp_refusal`: Gemma 4 assistants, DeepSeek-V4, ...)."""
  family = families.family_of(config)
  if family is not None and family.mtp_refusal:
    raise NotImplementedError(f"config.json: model_type {config.get('model_type')!r} has no MTP modules mtp_jax can "
                              f"load: {family.title}'s {family.mtp_refusal}")


def config_from_hf(config: Mapping | str | os.PathLike, *, layout: str | None = None,
                   names: Iterable[str] | None = None) -> MtpConfig:
  """An MtpConfig from an HF config.json (dict or path), or from one written by save_canonical.

  The chain conventions are the family's (`Family.conventions`, by model_type, else by `layout`);
  a config of neither keeps MtpConfig's defaults. A family's `mtp_blocks` overrides block fields,
  and with `names` (the checkpoint's tensor names) its `mtp_tensors` those the tensors settle
  (Bailing's MLA output gate); without names config.json's reading stands.
  Settings mtp_jax cannot honour (RoPE scaling other than YaRN, non-SiLU MLPs) raise ValueError.
  """
  config = _load_json(config)
  if "mtp_jax" in config:
    return MtpConfig(**config["mtp_jax"])
  refuse_mtp(config)
  family = families.family_of(config, layout)
  num_modules = next((config[k] for k in _NUM_MTP_KEYS if config.get(k)), family.num_mtp if family else None)
  if num_modules is None:
    raise ValueError(f"config has no MTP modules (none of {_NUM_MTP_KEYS} is set and positive)")
  blocks = block_kwargs_from_hf(config)
  if family is not None and family.mtp_blocks is not None:
    blocks |= family.mtp_blocks(config)
  if names is not None and family is not None and family.mtp_tensors is not None:
    blocks |= family.mtp_tensors(config, set(names))
  return MtpConfig(**blocks, vocab_size=config["vocab_size"], num_modules=num_modules,
                   **conventions(family_of(config, layout)))


def _plan(layout, cfg, names, first_layer, tied, family=None):
  """(canonical name -> (source names, transform, stacked), scope prefixes).

  The source names hold one equal tensor, or with stacked one expert each, in order.

  Every tensor under a scope prefix must be used, so unsupported parts cannot slip by unread.
  """
  suffixes = [n.split(".", 2)[2] for n in canonical_shapes(cfg) if n.startswith("mtp.0.")]
  ks = range(cfg.num_modules)
  if layout not in families.LAYOUTS:
    raise ValueError(f"unknown layout {layout!r}; expected one of {LAYOUTS}")
  record = families.get(family) if family is not None else None
  own = record.layout_sources if record is not None and record.layout == layout else None
  where = (own or families.LAYOUTS[layout].sources)(cfg, names, first_layer)
  source, embed, head = where.source, list(where.embed), list(where.head)
  if tied:  # tie_word_embeddings: the LM head is the embedding; heads a layout stores must equal it
    head = embed + [n for n in head if n in names and n not in base.DEFAULT_HEAD]
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
  if not cfg.own_lm_head:  # else each module's head is its mtp.{i}.shared_head.head.weight, planned above
    plan["lm_head.weight"] = (head, None, False)
  return plan, where.prefixes


def _shape(source, name: str) -> tuple[int, ...]:
  if isinstance(source, CheckpointReader):
    return source.shape(name)  # from the header, without loading
  return tuple(np.shape(source[name]))


def to_canonical(source: Mapping | CheckpointReader, layout: str, cfg: MtpConfig, *,
                 first_layer: int | None = None, tied: bool = False, lazy: bool = False,
                 family: str | None = None) -> dict[str, np.ndarray]:
  """Canonical name -> tensor, with the shapes of `canonical_shapes(cfg)` (e.g. float32[V, D]).

  source: name -> array in `layout`, or a CheckpointReader (then only the needed tensors load).
  first_layer: deepseek only, the layer index of MTP module 0 (HF num_hidden_layers); by default
  the lowest layer holding an eh_proj. tied: the checkpoint ties the LM head to the embedding
  (config tie_word_embeddings), so lm_head.weight is read from the embedding. Dtypes stay as
  stored, except that Qwen3-Next norm weights read into a config without norm_unit_offset come
  back as 1 + weight in float32. Arrays read once (a shared Qwen3-Next fc) are shared between names.
  lazy: with a CheckpointReader, TensorSources, read later (block by block, FP8 blocks dequantized
  with their scales) while the reader is open; a Mapping's arrays are in memory already.
  family: the config's family (`family_of`); one whose record has layout_sources reads its
  layout's names its own way (ExaONE-MoE's plain norms under Qwen3-Next's names).
  """
  lazy = lazy and isinstance(source, CheckpointReader)
  names = set(source.keys())
  plan, prefixes = _plan(layout, cfg, names, first_layer, tied, family)
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
        "are supported, or MoE FFNs with a moe config, or MLA with an mla config (quantization scales "
        "need config.json's quantization_config, quant_method fp8)")
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
        if tied and canonical == "lm_head.weight":
          raise ValueError(f"{layout} checkpoint: config.json sets tie_word_embeddings, so the LM head is the "
                           f"embedding {sources[0]!r}, but the stored head {name!r} differs from it (set "
                           "tie_word_embeddings to false to score with the stored head)")
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
    hf = check_hf_config(read_json(config_path), config_path)
  refuse_mtp(hf)
  with CheckpointReader(path, fp8=fp8_from_hf(hf, file=config_path)) as reader:
    layout = layout or detect_layout(reader.keys())
    cfg = config_from_hf(hf, layout=layout, names=reader.keys())
    key = families.LAYOUTS[layout].first_layer_key
    first_layer = hf.get(key) if key else None
    return cfg, to_canonical(reader, layout, cfg, first_layer=first_layer,
                             tied=bool(hf.get("tie_word_embeddings", False)), family=family_of(hf, layout))


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
