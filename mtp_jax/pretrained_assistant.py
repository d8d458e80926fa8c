"""A released Gemma 4 assistant directory (model_type gemma4_assistant or gemma4_unified_assistant:
config.json with its text_config, model.safetensors named as transformers 5.25's
Gemma4AssistantForCausalLM state dict) -> `assistant.Gemma4Assistant`.

    assistant = load_assistant("path/to/gemma-4-e2b-it-assistant", dtype="bfloat16")
    drafts, logits = assistant_propose(assistant, tokens_B=..., hidden_BxH=..., shared_kv=..., ...)

Every tensor of the directory is read or refused by name: lm_head.weight, where stored, must equal
model.embed_tokens.weight (the head is tied); k / v projections and norms of the layers (which
transformers drops on load: its assistant layers all reuse the target's K/V) are refused.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import numpy as np
from flax import nnx

from mtp_jax import families, validate
from mtp_jax.assistant import Gemma4Assistant, Gemma4AssistantConfig, LayerKind
from mtp_jax.checkpoint import CheckpointReader, read_json
from mtp_jax.mtp import param_names
from mtp_jax.pretrained import build_from_tensors, config_dtype

ASSISTANT_FAMILY = "gemma4_assistant"


def _text_config(config: Mapping, file: str) -> Mapping:
  text = config.get("text_config")
  if not isinstance(text, Mapping):
    raise validate.InvalidValue(f"{file}: text_config", f"{file} needs a text_config object (the assistant's "
                                f"decoder), got {text!r:.60}")
  return text


def _refuse_unbuilt(text: Mapping, file: str) -> None:
  """Raises NotImplementedError naming a text_config setting whose layer mtp_jax does not build."""
  n = text.get("num_hidden_layers")
  unbuilt = [("hidden_size_per_layer_input", text.get("hidden_size_per_layer_input") or 0, 0),
             ("vocab_size_per_layer_input", text.get("vocab_size_per_layer_input") or 0, 0),
             ("enable_moe_block", bool(text.get("enable_moe_block")), False),
             ("use_double_wide_mlp", bool(text.get("use_double_wide_mlp")), False),
             ("attention_bias", bool(text.get("attention_bias")), False),
             ("hidden_activation", text.get("hidden_activation", "gelu_pytorch_tanh"), "gelu_pytorch_tanh"),
             ("num_kv_shared_layers", text.get("num_kv_shared_layers") or n, n)]
  for key, value, built in unbuilt:
    if value != built:
      raise NotImplementedError(f"{file}: text_config.{key} = {value!r}: the Gemma 4 assistant mtp_jax builds has "
                                f"{key} = {built!r}")
  if text.get("use_bidirectional_attention") == "all":
    raise NotImplementedError(f"{file}: text_config.use_bidirectional_attention 'all' (which halves the sliding "
                              "window) is not built")


def _kind(text: Mapping, layer_type: str, indices: list[int], file: str) -> LayerKind | None:
  """The LayerKind of the layers `indices` (all of `layer_type`), from per_layer_config and rope_parameters."""
  if not indices:
    return None
  per_layer = text.get("per_layer_config")
  if per_layer is not None and not isinstance(per_layer, Mapping):
    raise validate.InvalidType(f"{file}: text_config.per_layer_config", f"{file}: text_config.per_layer_config must "
                               f"be a JSON object (layer index -> overrides), got {per_layer!r:.60}")
  full = layer_type == "full_attention"

  def field(i, key, default):
    if per_layer is None:  # transformers' defaults before per_layer_config: global_head_dim for full layers
      return text.get("global_head_dim", 512) if full and key == "head_dim" else default
    return (per_layer.get(str(i)) or per_layer.get(i) or {}).get(key, default)

  dims = {(field(i, "head_dim", text.get("head_dim", 256)),
           field(i, "num_key_value_heads", text.get("num_key_value_heads", 4))) for i in indices}
  if len(dims) != 1:
    raise NotImplementedError(f"{file}: text_config's {layer_type} layers differ in (head_dim, num_key_value_heads) "
                              f"{sorted(dims)}; they all read the K/V of one target layer")
  (head_dim, kv_heads), = dims
  rope = (text.get("rope_parameters") or {}).get(layer_type)
  if not isinstance(rope, Mapping) or rope.get("rope_theta") is None:
    raise validate.InvalidValue(f"{file}: text_config.rope_parameters", f"{file}: text_config.rope_parameters "
                                f"needs a {layer_type!r} entry with a rope_theta, got {rope!r:.80}")
  return LayerKind(head_dim=head_dim, num_kv_heads=kv_heads, rope_type=rope.get("rope_type", "default"),
                   theta=float(rope["rope_theta"]),
                   partial_rotary_factor=float(rope.get("partial_rotary_factor", 1.0)),
                   factor=float(rope.get("factor", 1.0)))


def assistant_config_from_hf(config: Mapping, *, dtype=None, file: str = "config.json") -> Gemma4AssistantConfig:
  """A Gemma4AssistantConfig from an assistant's config.json (dict); refuses other model_types and
  settings it does not build by name."""
  family = families.family_of(config)
  if family is None or family.name != ASSISTANT_FAMILY:
    raise validate.InvalidValue(f"{file}: model_type", f"{file}: model_type {config.get('model_type')!r} is not a "
                                f"Gemma 4 assistant ({families.get(ASSISTANT_FAMILY).model_types})")
  text = _text_config(config, file)
  _refuse_unbuilt(text, file)
  if not config.get("tie_word_embeddings", True) or not text.get("tie_word_embeddings", True):
    raise NotImplementedError(f"{file}: tie_word_embeddings false: the assistant's LM head is its embedding")
  types = text.get("layer_types")
  if not isinstance(types, list) or len(types) != text.get("num_hidden_layers"):
    raise validate.InvalidValue(f"{file}: text_config.layer_types", f"{file}: text_config.layer_types must list "
                                f"one type per layer (num_hidden_layers), got {types!r:.80}")
  kinds = {t: _kind(text, t, [i for i, u in enumerate(types) if u == t], file)
           for t in ("sliding_attention", "full_attention")}
  try:
    return Gemma4AssistantConfig(
        vocab_size=text.get("vocab_size"), hidden_size=text.get("hidden_size"),
        intermediate_size=text.get("intermediate_size"), num_heads=text.get("num_attention_heads"),
        layer_types=tuple(types), sliding_window=text.get("sliding_window"),
        backbone_hidden_size=config.get("backbone_hidden_size"), sliding=kinds["sliding_attention"],
        full=kinds["full_attention"], rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
        use_ordered_embeddings=bool(config.get("use_ordered_embeddings", False)),
        num_centroids=config.get("num_centroids", 2048), centroid_top_k=config.get("centroid_intermediate_top_k", 32),
        dtype=config_dtype(config, dtype))
  except (validate.InvalidValue, validate.InvalidType) as e:
    raise validate.renamed(e, file) from e


def _tensors(reader: CheckpointReader, cfg: Gemma4AssistantConfig, want: set[str]) -> dict:
  names = set(reader.keys())
  missing = sorted(want - names)
  if missing:
    raise KeyError(f"{reader.path}: missing assistant tensor {missing[0]!r}"
                   f"{f' ({len(missing) - 1} more)' if len(missing) > 1 else ''}")
  unused = sorted(names - want - {"lm_head.weight"})
  if unused:
    raise NotImplementedError(f"{reader.path}: tensor {unused[0]!r}"
                              f"{f' ({len(unused) - 1} more)' if len(unused) > 1 else ''} has no place in the "
                              "Gemma 4 assistant (its layers read the target's K/V: no k / v projections)")
  if "lm_head.weight" in names and not np.array_equal(reader["lm_head.weight"], reader["model.embed_tokens.weight"]):
    raise NotImplementedError(f"{reader.path}: lm_head.weight differs from model.embed_tokens.weight; the "
                              "assistant's LM head is tied to its embedding")
  if cfg.use_ordered_embeddings:
    order = np.asarray(reader["masked_embedding.token_ordering"])
    if not np.array_equal(np.sort(order), np.arange(cfg.vocab_size)):
      raise validate.InvalidValue("masked_embedding.token_ordering", f"{reader.path}: masked_embedding."
                                  f"token_ordering must be a permutation of 0..{cfg.vocab_size - 1}")
  return {n: reader.source(n) for n in want}


def load_assistant(path, *, dtype=None, allow_nonfinite: bool = False) -> Gemma4Assistant:
  """The Gemma 4 assistant of a released directory, for `assistant.assistant_propose`.

  dtype: weights / activations dtype (default the checkpoint's). allow_nonfinite: load tensors holding
  NaN or inf (refused by default, naming the tensor). Bad directories raise validate.InvalidValue /
  InvalidType naming the file and key or tensor; settings and tensors mtp_jax does not build raise
  NotImplementedError naming them.
  """
  allow_nonfinite = validate.flag("allow_nonfinite", allow_nonfinite)
  file = os.path.join(os.fspath(path), "config.json")
  if not os.path.isfile(file):
    raise FileNotFoundError(f"{path} is not a model directory: no config.json")
  cfg = assistant_config_from_hf(read_json(file), dtype=dtype, file=file)
  ctor = lambda: Gemma4Assistant(cfg, rngs=nnx.Rngs(0))
  want = set(param_names(nnx.eval_shape(ctor), lambda n: n))
  with CheckpointReader(path) as reader:
    return build_from_tensors(ctor, lambda n: n, _tensors(reader, cfg, want), f"{path}", allow_nonfinite)
