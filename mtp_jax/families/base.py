"""The record every family module fills in (`Family`, `Layout`), and the readers families share.

A family module (one file in this package) defines `FAMILY` (a `Family`), `LAYOUT` (a `Layout`,
the tensor names of its MTP checkpoints), or both; `mtp_jax.families` collects them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import numpy as np

from mtp_jax import validate
from mtp_jax.config import DsaConfig, MoeConfig, MtpConfig

DEFAULT_EMBED, DEFAULT_HEAD = ("model.embed_tokens.weight",), ("lm_head.weight",)


@dataclasses.dataclass(frozen=True)
class Conventions:
  """How a family's chain is wired: the MtpConfig fields of the same names."""
  pass_normed_hidden: bool
  head_norm: bool
  mask_first_embedding: bool
  depth_reuse: str = "cycle"


@dataclasses.dataclass(frozen=True)
class Blocks:
  """Block settings a family's config.json leaves out. partial_rotary_factor, rope_interleave,
  attention_bias and qk_norm (config key use_qk_norm) are defaults the config may override;
  attention_gate and norm_unit_offset have no config key and always apply."""
  partial_rotary_factor: float = 1.0
  rope_interleave: bool = False
  attention_bias: bool = False
  qk_norm: bool = False
  attention_gate: bool = False
  norm_unit_offset: bool = False


# A checkpoint tensor's source: (name in the checkpoint, transform applied on load or None).
Source = tuple[str, Callable[[np.ndarray], np.ndarray] | None]


@dataclasses.dataclass(frozen=True)
class Sources:
  """Where a layout keeps each canonical tensor of a config's MTP modules.

  source(i, suffix): module i's tensor `mtp.{i}.{suffix}`; experts are asked for one each
  (suffix mlp.experts.{e}.{proj}.weight). prefixes: every checkpoint tensor under them must be
  used, so unsupported parts cannot slip by unread. embed / head: the tensors holding the
  embedding / LM head (several when modules carry copies, which must then be equal)."""
  prefixes: tuple[str, ...]
  source: Callable[[int, str], Source]
  embed: tuple[str, ...] = DEFAULT_EMBED
  head: tuple[str, ...] = DEFAULT_HEAD


@dataclasses.dataclass(frozen=True)
class Layout:
  """The tensor names of one kind of MTP checkpoint.

  signature: a regex matching a tensor only this layout has (for detect_layout).
  sources(cfg, names, first_layer): the `Sources` of cfg's modules in a checkpoint with `names`.
  first_layer_key: the config.json key whose value is module 0's layer index (else None)."""
  name: str
  signature: str
  sources: Callable[[MtpConfig, set, int | None], Sources]
  first_layer_key: str | None = None


def no_moe(config: Mapping) -> None:
  """A family whose MTP FFN is dense whatever the config says."""
  return None


def sigmoid_moe(config: Mapping) -> MoeConfig | None:
  """DeepSeek-V3 / GLM-4.5 MoE (n_routed_experts): sigmoid scores with an e_score_correction_bias
  (transformers' DeepseekV3 / Glm4Moe TopkRouter; DeepSeek-V3 says so in scoring_func /
  topk_method), group-limited routing and shared experts; None without n_routed_experts."""
  if not config.get("n_routed_experts"):
    return None
  if config.get("topk_method", "noaux_tc") != "noaux_tc":
    raise ValueError(f"config.json: topk_method {config['topk_method']!r} is not supported, only 'noaux_tc'")
  return MoeConfig(num_experts=config["n_routed_experts"], num_experts_per_tok=config["num_experts_per_tok"],
                   moe_intermediate_size=config["moe_intermediate_size"],
                   scoring=config.get("scoring_func", "sigmoid"), e_score_correction_bias=True,
                   n_group=config.get("n_group") or 1, topk_group=config.get("topk_group") or 1,
                   norm_topk_prob=config.get("norm_topk_prob", True),
                   routed_scaling_factor=float(config.get("routed_scaling_factor", 1.0)),
                   n_shared_experts=config.get("n_shared_experts") or 0,
                   first_k_dense_replace=config.get("first_k_dense_replace", 0))


@dataclasses.dataclass(frozen=True)
class Family:
  """One model family: what mtp_jax reads from its config.json and checkpoints.

  name / title: registry key / display name. model_types: the config.json model_types it
  covers. layout: the name of its MTP checkpoints' `Layout` (None: no MTP modules released).
  conventions: its chain (None: MtpConfig's defaults). blocks: its block defaults. moe:
  config.json -> its MoE FFN (or None). mla: config.json -> MlaConfig scale fields, None where
  the family has no MLA. mtp_blocks: config.json -> BlockConfig fields of its MTP blocks that
  differ from the target's reading (MiMo-V2-Flash's MTP attention is its sliding-window layers'),
  None where they do not. num_mtp: module count when config.json names none. target: the
  model_types whose target mtp_jax builds; target_refusal: why the others' is not, for the error.
  sources: where its conventions were read, for the docs. layout_sources: where its MTP tensors
  are when it stores them otherwise than `layout` reads them under the same names (ExaONE-MoE:
  Qwen3-Next's names, plain RMSNorm weights where Qwen3-Next's are zero-centred); None: the layout's.
  mtp_refusal: why its MTP modules do not load, for the error (empty: they load where a layout reads them).
  dsa: config.json -> the DeepSeek Sparse Attention indexer of its MLA layers (DeepSeek-V3.2,
  GLM-5), None where it has none. target_check: raises NotImplementedError naming what of a
  config.json of a built target type mtp_jax does not build (GLM-5's cross-layer top-k sharing).
  hf_view: config.json -> the config.json the shared readers see (`layouts.text_fields` applies it
  before any key is checked), for a family whose keys those readers do not know (Step-3.5's per-layer
  lists resolved to its MTP layers' values); it must give the same result applied twice. None: as stored.
  mtp_blocks may also set MtpConfig's own_lm_head (Step-3.5's per-module LM heads).
  mtp_tensors: (config.json, the checkpoint's tensor names) -> BlockConfig fields of its MTP blocks that
  the checkpoint settles over mtp_blocks' reading (Bailing's MLA output gate: built where the MTP
  layers hold one), None where config.json settles them all.
  assistant: what its draft model is when it is no MTP chain but an assistant mtp_jax builds on its own
  (`mtp_jax.load_assistant`: Gemma 4); the chain loaders then refuse it with mtp_refusal."""
  name: str
  title: str
  model_types: tuple[str, ...]
  layout: str | None = None
  conventions: Conventions | None = None
  blocks: Blocks = Blocks()
  moe: Callable[[Mapping], MoeConfig | None] = sigmoid_moe
  mla: Callable[[Mapping], dict] | None = None
  mtp_blocks: Callable[[Mapping], dict] | None = None
  num_mtp: int | None = None
  target: tuple[str, ...] = ()
  target_refusal: str = ""
  sources: str = ""
  layout_sources: Callable[[MtpConfig, set, int | None], Sources] | None = None
  mtp_refusal: str = ""
  dsa: Callable[[Mapping], DsaConfig] | None = None
  target_check: Callable[[Mapping], None] | None = None
  hf_view: Callable[[Mapping], Mapping] | None = None
  mtp_tensors: Callable[[Mapping, set], dict] | None = None
  assistant: str = ""


def layer_list(config: Mapping, key: str) -> list | None:
  """config.json's per-layer list `key` (one entry per layer), or None without one; anything else
  raises naming the key."""
  value = config.get(key)
  if value is not None and not isinstance(value, list):
    raise validate.InvalidType(f"config.json: {key}", f"config.json: {key} must be a list (one entry per layer), "
                               f"got {value!r:.60}")
  return value
