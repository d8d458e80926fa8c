"""A released model directory (config.json, safetensors shards + index, tokenizer.json) -> the
target, its MTP proposer and a tokenizer.

    target, proposer, config = from_pretrained("path/to/model", dtype="bfloat16", max_depth=3)

Targets: GQA decoders of the Llama / Qwen2 / MiMo, GLM-4.5 (dense and MoE layers) and ERNIE-4.5
(dense) families, and DeepSeek-V3 (MLA in every layer, dense then MoE FFNs). MTP modules: every
layout of `layouts` whose blocks mtp_jax runs. The chain follows the
family's conventions (its record in `mtp_jax.families`); keyword arguments override them.
Tensors are read lazily (only the ones used, never whole shards) and placed straight into the
model, with no random initialisation first. With mesh= each tensor goes straight into its
sharding (sharding.param_specs), each device's block read from the file on its own (routed
experts: only the experts that device holds), so the host holds about one tensor at a time.
Block-scaled FP8 weights are dequantized as they are read, or with quantized="fp8" placed as
stored, float8 values with their scales, and dequantized inside the matmuls (`from_pretrained`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

import jax.numpy as jnp
import numpy as np
import tokenizers
from flax import nnx
from jax.sharding import Mesh

from mtp_jax import families, layouts, sharding, validate
from mtp_jax.blocks.linear import Linear, keep_fp8
from mtp_jax.blocks.moe import Experts
from mtp_jax.checkpoint import SCALE_SUFFIX, CheckpointReader, Fp8Blocks, TensorSource, read_json
from mtp_jax.config import MtpConfig, TargetConfig
from mtp_jax.mtp import MtpModel, canonical_name, param_names
from mtp_jax.target import TargetModel, hf_name

def read_model_config(path) -> dict:
  """config.json of a model directory, as a dict, every field mtp_jax reads checked
  (`layouts.check_hf_config`): errors are validate.InvalidValue / InvalidType naming the file and
  the key; a missing directory or config.json is a FileNotFoundError."""
  file = os.path.join(os.fspath(path), "config.json")
  if not os.path.isfile(file):
    raise FileNotFoundError(f"{path} is not a model directory: no config.json")
  return dict(layouts.check_hf_config(read_json(file), file))


def config_dtype(config: Mapping, dtype) -> str:
  """The compute dtype: `dtype`, else the checkpoint's ("dtype", or "torch_dtype" in transformers v4
  configs), else float32; bf16 checkpoints stay bf16. FP8 or integer dtypes cannot compute and are
  refused by name (FP8 checkpoints' configs say bfloat16 and carry a quantization_config)."""
  name, source = next(((v, k) for k, v in (("dtype", dtype), ("config.json: dtype", config.get("dtype")),
                                           ("config.json: torch_dtype", config.get("torch_dtype"))) if v),
                      ("float32", "dtype"))
  resolved = validate.float_dtype(source, name)
  if resolved.itemsize < 2:
    hint = (" (an FP8 checkpoint's config.json names bfloat16 and a quantization_config; pass dtype='bfloat16')"
            if source != "dtype" else "")
    raise validate.InvalidValue(source, f"{source} {resolved.name} cannot be the compute dtype: weights and "
                                f"activations need float16, bfloat16 or float32{hint}")
  return resolved.name


def target_config_from_hf(config: Mapping, *, dtype=None) -> TargetConfig:
  """A TargetConfig from an HF config.json dict; families or settings mtp_jax cannot run raise."""
  model_type = config.get("model_type")
  family = families.family_of(config)
  if family is None or model_type not in family.target:
    why = f": {family.title}'s {family.target_refusal}" if family else ""
    supported = [t for f in families.FAMILIES.values() for t in f.target]
    raise NotImplementedError(f"config.json: model_type {model_type!r} has no target mtp_jax can build{why} "
                              f"(supported: {', '.join(supported)}); its MTP modules load alone with load_mtp")
  if family.target_check is not None:
    family.target_check(config)
  if config.get("num_hidden_layers") is None:
    raise validate.InvalidValue("config.json: num_hidden_layers",
                                "config.json has no 'num_hidden_layers' (the target's layer count)")
  return TargetConfig(**layouts.block_kwargs_from_hf(config), vocab_size=config["vocab_size"],
                      num_layers=config["num_hidden_layers"], dtype=config_dtype(config, dtype))


def _mesh(mesh):
  if mesh is not None:
    validate.instance("mesh", mesh, Mesh, "a jax.sharding.Mesh (see sharding.make_mesh)")
  return mesh


QUANTIZED = ("fp8",)
# MLA reads kv_b_proj's weight whole (folded into its query and output, blocks/mla.py), not through
# Linear's matmul, so it is dequantized at load even with quantized="fp8"; vLLM's MLA backend
# (v1/attention/backends/mla/common.py) likewise keeps 16-bit copies of it dequantized.
_DEQUANTIZED_AT_LOAD = ("kv_b_proj",)


def _quantized(quantized, config: Mapping, path) -> bool:
  """Whether to keep the stored FP8 weights: quantized None or "fp8", the latter only for a
  directory whose config.json declares block-scaled FP8 weights (else refused, naming `quantized`)."""
  if quantized is None:
    return False
  if not isinstance(quantized, str) or quantized not in QUANTIZED:
    raise validate.InvalidValue("quantized", f"quantized must be None (weights dequantized at load) or one of "
                                f"{QUANTIZED} (block-scaled FP8 weights kept on device), got {quantized!r}")
  if layouts.fp8_from_hf(config) is None:
    raise validate.InvalidValue("quantized", f"quantized={quantized!r} keeps a checkpoint's block-scaled FP8 "
                                f"weights, but {path}/config.json has no quantization_config (quant_method "
                                "fp8): its weights are not FP8; load it with quantized=None")
  return True


def _keep_stored_fp8(model, canonical, tensors: Mapping, dtype: str):
  """model with each Linear weight and routed-expert projection that `tensors` hold block-scaled
  FP8 kept so (blocks.linear.keep_fp8, dequantized to dtype in the matmul), but for
  _DEQUANTIZED_AT_LOAD."""
  for path, module in list(nnx.iter_modules(model)):
    if not isinstance(module, (Linear, Experts)) or (path and path[-1] in _DEQUANTIZED_AT_LOAD):
      continue
    for name in ("weight",) if isinstance(module, Linear) else ("gate_proj", "up_proj", "down_proj"):
      source = tensors.get(canonical(".".join(str(p) for p in path + (name,))))
      if isinstance(source, TensorSource) and source.fp8 is not None:
        keep_fp8(module, name, Fp8Blocks(block=source.fp8.block, dtype=dtype))
  return model


def _stored(tensors: Mapping, name: str, dtype):
  """What fills the param `name` of `dtype`: tensors[name], or the stored FP8 parts of a weight
  `_keep_stored_fp8` kept (its float8 values, or the scales for its <name>_scale_inv)."""
  if name.endswith(SCALE_SUFFIX):
    return tensors[name.removesuffix(SCALE_SUFFIX)].fp8.scale_inv
  if dtype == jnp.float8_e4m3fn:
    return tensors[name].fp8.values
  return tensors[name]


def _checked(read, name: str, what: str, allow_nonfinite: bool, kept_fp8: bool = False):
  """read(index) -> x[index] as a numpy array, refused when float8 without scales (unless kept_fp8:
  the stored values of a weight kept FP8) or (unless allow_nonfinite) holding NaN or inf: so each
  block placed is checked as it is read."""

  def checked(index):
    value = np.asarray(read(index))
    if value.dtype.itemsize < 2 and not kept_fp8:
      raise ValueError(f"{what}: tensor {name!r} is stored as {value.dtype} without scales; only float16 / bfloat16 "
                       "/ float32 tensors load, or block-scaled FP8 ones with config.json's quantization_config")
    finite = allow_nonfinite or np.isfinite(value)
    if not np.all(finite):
      bad = int(value.size - np.count_nonzero(finite))
      where = "" if index is None else f" in its block {tuple((s.start, s.stop) for s in index)}"
      raise validate.InvalidValue(name, f"{what}: tensor {name!r} holds {bad} NaN / inf value(s) of {value.size}"
                                  f"{where}; pass allow_nonfinite=True to load it anyway")
    return value

  return checked


def build_from_tensors(ctor, canonical, tensors: Mapping, what: str, allow_nonfinite: bool = False,
                       mesh: Mesh | None = None, fp8_dtype: str | None = None):
  """ctor() as an abstract model, its params filled from tensors (canonical name -> array or
  TensorSource), each cast to the dtype the model gives that param (routers stay float32 in a bf16
  model); with mesh, each placed block by block into its sharding.param_specs sharding. A tensor
  (with mesh: a block) holding NaN or inf is refused (validate.InvalidValue naming it) unless
  allow_nonfinite. fp8_dtype (quantized="fp8"): the weights stored block-scaled FP8 are placed as
  stored, float8 values and float32 scales (`_keep_stored_fp8`), dequantized to fp8_dtype in the matmul."""
  make = ctor if fp8_dtype is None else lambda: _keep_stored_fp8(ctor(), canonical, tensors, fp8_dtype)
  abstract = nnx.eval_shape(make)
  specs = None if mesh is None else dict(nnx.to_flat_state(nnx.state(sharding.param_specs(abstract, mesh))))
  graphdef, state = nnx.split(abstract)
  flat = []
  for path, var in nnx.to_flat_state(state):
    name = canonical(".".join(str(p) for p in path))
    if name not in tensors and not name.endswith(SCALE_SUFFIX):
      raise KeyError(f"{what}: missing tensor {name!r} (shape {tuple(var.shape)})")
    value = _stored(tensors, name, var.dtype)
    if tuple(value.shape) != tuple(var.shape):
      raise ValueError(f"{what}: tensor {name!r} has shape {tuple(value.shape)}, expected {tuple(var.shape)}")
    read = value.read if isinstance(value, TensorSource) else (
        lambda index, v=value: np.asarray(v) if index is None else np.asarray(v)[index])
    read = _checked(read, name, what, allow_nonfinite, kept_fp8=var.dtype == jnp.float8_e4m3fn)
    if mesh is None:
      placed = jnp.asarray(read(None), var.dtype)
    else:
      placed = sharding.place_blocks(read, var.shape, var.dtype, specs[path].get_value(), mesh)
    flat.append((path, var.replace(placed)))
  return nnx.merge(graphdef, nnx.from_flat_state(flat))


def _target_tensors(reader: CheckpointReader, config: Mapping, cfg: TargetConfig) -> dict[str, np.ndarray]:
  """HF name -> array for every target param; lm_head from the embedding when tied."""
  names = set(reader.keys())
  want = set(param_names(nnx.eval_shape(lambda: TargetModel(cfg, rngs=nnx.Rngs(0))), hf_name))
  tied = bool(config.get("tie_word_embeddings", False))
  scope = tuple(f"model.layers.{i}." for i in range(cfg.num_layers)) + ("model.norm.", "model.embed_tokens.")
  per_expert = {f"{m[1]}.{e}.{m[2]}.weight" for n in want if (m := re.fullmatch(r"(.*\.mlp\.experts)\.(\w+_proj)", n))
                for e in range(cfg.moe.num_experts)}
  unused = sorted(n for n in names if n.startswith(scope) and n not in want | per_expert)
  if unused:
    raise NotImplementedError(f"{reader.path}: target tensor {unused[0]!r}"
                              f"{f' ({len(unused) - 1} more)' if len(unused) > 1 else ''} has no place in this "
                              "config's blocks (quantization scales need config.json's quantization_config, "
                              "quant_method fp8)")
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


def load_target(path, *, dtype=None, allow_nonfinite: bool = False, mesh: Mesh | None = None,
                quantized: str | None = None) -> TargetModel:
  """The target model of a released directory (see `from_pretrained`)."""
  allow_nonfinite = validate.flag("allow_nonfinite", allow_nonfinite)
  mesh = _mesh(mesh)
  config = read_model_config(path)
  keep = _quantized(quantized, config, path)
  cfg = target_config_from_hf(config, dtype=dtype)
  with CheckpointReader(path, fp8=layouts.fp8_from_hf(config, cfg.dtype)) as reader:
    tensors = _target_tensors(reader, config, cfg)
    return build_from_tensors(lambda: TargetModel(cfg, rngs=nnx.Rngs(0)), hf_name, tensors, f"{path}",
                              allow_nonfinite, mesh, cfg.dtype if keep else None)


def load_mtp(path, *, dtype=None, max_depth: int | None = None, allow_nonfinite: bool = False,
             mesh: Mesh | None = None, quantized: str | None = None, **conventions) -> MtpModel:
  """The MTP modules of a released directory; conventions override the family's (MtpConfig fields).
  With mesh, each read block by block into its sharding.param_specs sharding; quantized as in
  `from_pretrained`."""
  allow_nonfinite = validate.flag("allow_nonfinite", allow_nonfinite)
  mesh = _mesh(mesh)
  config = read_model_config(path)
  keep = _quantized(quantized, config, path)
  bad = sorted(set(conventions) - set(layouts.CONVENTION_FIELDS))
  if bad:
    raise TypeError(f"unknown convention(s) {bad}; expected some of {layouts.CONVENTION_FIELDS}")
  layouts.refuse_mtp(config)
  with CheckpointReader(path, fp8=layouts.fp8_from_hf(config, config_dtype(config, dtype))) as reader:
    layout = layouts.detect_layout(reader.keys())
    base = layouts.config_from_hf(config, layout=layout, names=reader.keys())
    cfg = MtpConfig(**{**base.__dict__, **conventions, "max_depth": max_depth,
                       "dtype": config_dtype(config, dtype)})
    key = families.LAYOUTS[layout].first_layer_key
    first_layer = config.get(key) if key else None
    tensors = layouts.to_canonical(reader, layout, cfg, first_layer=first_layer,
                                   tied=bool(config.get("tie_word_embeddings", False)), lazy=True,
                                   family=layouts.family_of(config, layout))
    return build_from_tensors(lambda: MtpModel(cfg, rngs=nnx.Rngs(0)), canonical_name, tensors, f"{path}",
                              allow_nonfinite, mesh, cfg.dtype if keep else None)


def from_pretrained(path, *, dtype=None, max_depth: int | None = None, allow_nonfinite: bool = False,
                    mesh: Mesh | None = None, quantized: str | None = None,
                    **conventions) -> tuple[TargetModel, MtpModel, dict]:
  """(target, proposer, config.json dict) from a released model directory.

  dtype: weights / activations dtype (default the checkpoint's: bf16 stays bf16).
  max_depth: drafts a propose may make (default the module count; depths past it reuse modules).
  mesh: a sharding.make_mesh mesh; every param is read straight into its sharding.param_specs
    sharding (one block per device), not first whole onto the host.
  conventions: MtpConfig chain fields (pass_normed_hidden, head_norm, mask_first_embedding,
    depth_reuse) overriding the family's.
  allow_nonfinite: load tensors holding NaN or inf (refused by default, naming the tensor).
  quantized: None (default): block-scaled FP8 weights are dequantized to dtype at load. "fp8": they
    stay as stored, float8_e4m3fn[out, in] with their weight_scale_inv float32[ceil(out / b0),
    ceil(in / b1)] (b = quantization_config.weight_block_size), named as in the checkpoint, and
    are dequantized to dtype inside each matmul (blocks.linear.keep_fp8 / weight_of): Linear weights
    and routed experts (gathered before dequantizing), but MLA's kv_b_proj, which MLA reads whole,
    dequantized at load. Weights the checkpoint stores unquantized (embeddings, norms, LM heads,
    routers) load as usual. Refused (validate.InvalidValue naming `quantized`) for a directory whose
    config.json declares no FP8 quantization_config.
  Bad directories raise validate.InvalidValue / InvalidType naming the file and the key or tensor.
  """
  config = read_model_config(path)
  return (load_target(path, dtype=dtype, allow_nonfinite=allow_nonfinite, mesh=mesh, quantized=quantized),
          load_mtp(path, dtype=dtype, max_depth=max_depth, allow_nonfinite=allow_nonfinite, mesh=mesh,
                   quantized=quantized, **conventions),
          config)


def load_tokenizer(path):
  """The `tokenizers.Tokenizer` of path/tokenizer.json."""
  file = os.path.join(os.fspath(path), "tokenizer.json")
  if not os.path.isfile(file):
    raise FileNotFoundError(f"{path} has no tokenizer.json")
  try:
    return tokenizers.Tokenizer.from_file(file)
  except Exception as e:  # the tokenizers package raises a bare Exception for an unreadable file
    raise validate.InvalidValue(file, f"{file} is not a tokenizers tokenizer.json: {e}") from e
