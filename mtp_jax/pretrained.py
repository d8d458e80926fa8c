"""A released model directory (config.json, safetensors shards + index, tokenizer.json) -> the
target, its MTP proposer and a tokenizer.

    target, proposer, config = from_pretrained("path/to/model", dtype="bfloat16", max_depth=3)

Targets: GQA decoders of the Llama / Qwen2 / MiMo, GLM-4.5 (dense and MoE layers) and ERNIE-4.5
(dense) families, and DeepSeek-V3 (MLA in every layer, dense then MoE FFNs). MTP modules: every layout of `layouts` whose blocks mtp_jax runs. The chain follows the
family's conventions (`layouts.CONVENTIONS`); keyword arguments override them.
Tensors are read lazily (only the ones used, never whole shards) and placed straight into the
model, with no random initialisation first. With mesh= each tensor goes straight into its
sharding (sharding.param_specs), each device's block read from the file on its own (routed
experts: only the experts that device holds), so the host holds about one tensor at a time.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping

import jax.numpy as jnp
import numpy as np
import tokenizers
from flax import nnx
from jax.sharding import Mesh

from mtp_jax import layouts, sharding, validate
from mtp_jax.checkpoint import CheckpointReader, TensorSource
from mtp_jax.config import MtpConfig, TargetConfig
from mtp_jax.mtp import MtpModel, canonical_name, param_names
from mtp_jax.target import TargetModel, _hf_name

# HF model_types whose target mtp_jax builds (their MTP modules and other families' load alone).
_TARGET_TYPES = ("llama", "qwen2", "mimo", "glm4_moe", "ernie4_5", "deepseek_v3")


def read_config(path) -> dict:
  """config.json of a model directory, as a dict."""
  file = os.path.join(os.fspath(path), "config.json")
  if not os.path.isfile(file):
    raise FileNotFoundError(f"{path} is not a model directory: no config.json")
  with open(file) as f:
    return json.load(f)


def _dtype(config: Mapping, dtype) -> str:
  # bf16 checkpoints stay bf16 unless asked otherwise; configs name the dtype "torch_dtype" (v4) or "dtype".
  name = dtype or config.get("dtype") or config.get("torch_dtype") or "float32"
  return jnp.dtype(name).name


def target_config_from_hf(config: Mapping, *, dtype=None) -> TargetConfig:
  """A TargetConfig from an HF config.json dict; families or settings mtp_jax cannot run raise."""
  model_type = config.get("model_type")
  if model_type not in _TARGET_TYPES:
    raise NotImplementedError(f"config.json: model_type {model_type!r} has no target mtp_jax can build "
                              f"(supported: {', '.join(_TARGET_TYPES)})")
  return TargetConfig(**layouts.block_kwargs_from_hf(config), vocab_size=config["vocab_size"],
                      num_layers=config["num_hidden_layers"], dtype=_dtype(config, dtype))


def _mesh(mesh):
  if mesh is not None:
    validate.instance("mesh", mesh, Mesh, "a jax.sharding.Mesh (see sharding.make_mesh)")
  return mesh


def _build(ctor, canonical, tensors: Mapping, what: str, mesh: Mesh | None = None):
  """ctor() as an abstract model, its params filled from tensors (canonical name -> array or
  TensorSource), each cast to the dtype the model gives that param (routers stay float32 in a bf16
  model); with mesh, each placed block by block into its sharding.param_specs sharding."""
  abstract = nnx.eval_shape(ctor)
  specs = None if mesh is None else dict(nnx.to_flat_state(nnx.state(sharding.param_specs(abstract, mesh))))
  graphdef, state = nnx.split(abstract)
  flat = []
  for path, var in nnx.to_flat_state(state):
    name = canonical(".".join(str(p) for p in path))
    if name not in tensors:
      raise KeyError(f"{what}: missing tensor {name!r} (shape {tuple(var.shape)})")
    value = tensors[name]
    if tuple(value.shape) != tuple(var.shape):
      raise ValueError(f"{what}: tensor {name!r} has shape {tuple(value.shape)}, expected {tuple(var.shape)}")
    if mesh is None:
      placed = jnp.asarray(np.asarray(value), var.dtype)
    else:
      read = value.read if isinstance(value, TensorSource) else (lambda index, v=value: np.asarray(v)[index])
      placed = sharding.place_blocks(read, var.shape, var.dtype, specs[path].get_value(), mesh)
    flat.append((path, var.replace(placed)))
  return nnx.merge(graphdef, nnx.from_flat_state(flat))


def _target_tensors(reader: CheckpointReader, config: Mapping, cfg: TargetConfig) -> dict[str, np.ndarray]:
  """HF name -> array for every target param; lm_head from the embedding when tied."""
  names = set(reader.keys())
  want = set(param_names(nnx.eval_shape(lambda: TargetModel(cfg, rngs=nnx.Rngs(0))), _hf_name))
  tied = bool(config.get("tie_word_embeddings", False))
  scope = tuple(f"model.layers.{i}." for i in range(cfg.num_layers)) + ("model.norm.", "model.embed_tokens.")
  per_expert = {f"{m[1]}.{e}.{m[2]}.weight" for n in want if (m := re.fullmatch(r"(.*\.mlp\.experts)\.(\w+_proj)", n))
                for e in range(cfg.moe.num_experts)}
  unused = sorted(n for n in names if n.startswith(scope) and n not in want | per_expert)
  if unused:
    raise NotImplementedError(f"{reader.path}: target tensor {unused[0]!r}"
                              f"{f' ({len(unused) - 1} more)' if len(unused) > 1 else ''} has no place in this "
                              "config's blocks (quantisation scales are not supported)")
  out = {}
  for name in sorted(want):
    if stacked := re.fullmatch(r"(.*\.mlp\.experts)\.(\w+_proj)", name):
      out[name] = _stack_experts(reader, names, stacked[1], stacked[2], cfg.moe.num_experts)
      continue
    source = "model.embed_tokens.weight" if (name == "lm_head.weight" and tied) else name
    if source not in names:
      hint = " (config.json: tie_word_embeddings is false)" if name == "lm_head.weight" else ""
      raise KeyError(f"{reader.path}: missing target tensor {source!r}{hint}")
    out[name] = reader.source(source)
  return out


def _stack_experts(reader, names, prefix: str, proj: str, num_experts: int) -> TensorSource:
  """Released experts (one torch [out, in] tensor each) -> mtp_jax's stacked [E, in, out]; a block
  of it reads only its experts, and of each only its [out, in] block."""
  parts = [f"{prefix}.{e}.{proj}.weight" for e in range(num_experts)]
  missing = [p for p in parts if p not in names]
  if missing:
    raise KeyError(f"{reader.path}: missing expert tensor {missing[0]!r} (config.json has "
                   f"n_routed_experts={num_experts})")
  return reader.stacked(parts)


def load_target(path, *, dtype=None, mesh: Mesh | None = None) -> TargetModel:
  """The target model of a released directory (see `from_pretrained`)."""
  mesh = _mesh(mesh)
  config = read_config(path)
  cfg = target_config_from_hf(config, dtype=dtype)
  with CheckpointReader(path) as reader:
    tensors = _target_tensors(reader, config, cfg)
    return _build(lambda: TargetModel(cfg, rngs=nnx.Rngs(0)), _hf_name, tensors, f"{path}", mesh)


def load_mtp(path, *, dtype=None, max_depth: int | None = None, mesh: Mesh | None = None,
             **conventions) -> MtpModel:
  """The MTP modules of a released directory; conventions override the family's (MtpConfig fields).
  With mesh, each read block by block into its sharding.param_specs sharding."""
  mesh = _mesh(mesh)
  config = read_config(path)
  bad = sorted(set(conventions) - set(layouts.CONVENTION_FIELDS))
  if bad:
    raise TypeError(f"unknown convention(s) {bad}; expected some of {layouts.CONVENTION_FIELDS}")
  with CheckpointReader(path) as reader:
    layout = layouts.detect_layout(reader.keys())
    base = layouts.config_from_hf(config, layout=layout)
    cfg = MtpConfig(**{**base.__dict__, **conventions, "max_depth": max_depth,
                       "dtype": _dtype(config, dtype)})
    first_layer = config.get("num_hidden_layers") if layout == "deepseek" else None
    tensors = layouts.to_canonical(reader, layout, cfg, first_layer=first_layer,
                                   tied=bool(config.get("tie_word_embeddings", False)), lazy=True)
    return _build(lambda: MtpModel(cfg, rngs=nnx.Rngs(0)), canonical_name, tensors, f"{path}", mesh)


def from_pretrained(path, *, dtype=None, max_depth: int | None = None, mesh: Mesh | None = None,
                    **conventions) -> tuple[TargetModel, MtpModel, dict]:
  """(target, proposer, config.json dict) from a released model directory.

  dtype: weights / activations dtype (default the checkpoint's: bf16 stays bf16).
  max_depth: drafts a propose may make (default the module count; depths past it reuse modules).
  mesh: a sharding.make_mesh mesh; every param is read straight into its sharding.param_specs
    sharding (one block per device), not first whole onto the host.
  conventions: MtpConfig chain fields (pass_normed_hidden, head_norm, mask_first_embedding,
    depth_reuse) overriding the family's.
  """
  config = read_config(path)
  return (load_target(path, dtype=dtype, mesh=mesh),
          load_mtp(path, dtype=dtype, max_depth=max_depth, mesh=mesh, **conventions), config)


def load_tokenizer(path):
  """The `tokenizers.Tokenizer` of path/tokenizer.json."""
  file = os.path.join(os.fspath(path), "tokenizer.json")
  if not os.path.isfile(file):
    raise FileNotFoundError(f"{path} has no tokenizer.json")
  return tokenizers.Tokenizer.from_file(file)
