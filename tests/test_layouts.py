import dataclasses
import json

import numpy as np
import pytest

from mtp_jax import families, layouts
from mtp_jax.checkpoint import CheckpointReader, save_tensors
from mtp_jax.config import MlaConfig, MtpConfig
from mtp_jax.validate import InvalidType, InvalidValue

D, H, HKV, DH, F, V, K = 16, 2, 1, 8, 32, 50, 2
NUM_LAYERS = 3  # target layers before the MTP ones in the deepseek layout
SHARED = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight")
MIMO_NAMES = {"enorm.weight": "token_layernorm.weight", "hnorm.weight": "hidden_layernorm.weight",
              "eh_proj.weight": "input_proj.weight",
              "shared_head.norm.weight": "final_layernorm.weight"}
QWEN_NAMES = {"enorm.weight": "mtp.pre_fc_norm_embedding.weight",
              "hnorm.weight": "mtp.pre_fc_norm_hidden.weight", "eh_proj.weight": "mtp.fc.weight",
              "shared_head.norm.weight": "mtp.norm.weight"}


def _blocks(layout):
  """The family's block options that have no config.json key (Qwen3-Next's gated attention)."""
  family = families.family_of({}, layout)
  return {k: getattr(family.blocks, k) for k in ("qk_norm", "attention_gate", "norm_unit_offset")} if family else {}


def tiny_cfg(bias=False, layout="deepseek"):
  return MtpConfig(hidden_size=D, num_heads=H, num_kv_heads=HKV, head_dim=DH, intermediate_size=F,
                   rms_norm_eps=1e-5, rope_theta=5000.0, attention_bias=bias, vocab_size=V,
                   num_modules=K, **layouts.conventions(layouts.family_of({}, layout)),
                   **_blocks(layout))


def canonical_tensors(cfg, seed=0, shared_across_modules=False):
  """Random canonical tensors; norm weights are 1 + k/64 so Qwen3-Next's w - 1 is exact."""
  rng = np.random.default_rng(seed)
  out = {}
  for name, shape in layouts.canonical_shapes(cfg).items():
    if name.endswith("norm.weight"):
      out[name] = (1 + rng.integers(-16, 16, shape) / 64).astype(np.float32)
    else:
      out[name] = rng.standard_normal(shape).astype(np.float32)
  if shared_across_modules:  # Qwen3-Next has one fc / norm set for all modules
    for i in range(1, cfg.num_modules):
      out.update({f"mtp.{i}.{s}": out[f"mtp.0.{s}"] for s in SHARED})
  return out


def _target_extras():
  """Tensors of the main model that a reader must leave alone."""
  return {"model.norm.weight": np.ones(D, np.float32),
          "model.layers.0.self_attn.q_proj.weight": np.zeros((H * DH, D), np.float32),
          "model.layers.0.mlp.experts.0.up_proj.weight": np.zeros((F, D), np.float32)}


def _module(canon, i):
  prefix = f"mtp.{i}."
  return {n[len(prefix):]: v for n, v in canon.items() if n.startswith(prefix)}


def to_deepseek(canon, cfg, per_layer_embed=True):
  out = {**_target_extras(), "model.embed_tokens.weight": canon["embed_tokens.weight"]}
  for i in range(cfg.num_modules):
    p = f"model.layers.{NUM_LAYERS + i}."
    out.update({p + s: v for s, v in _module(canon, i).items()})
    out[p + "shared_head.head.weight"] = canon["lm_head.weight"]
    if per_layer_embed:
      out[p + "embed_tokens.weight"] = canon["embed_tokens.weight"]
  return out


def to_mimo(canon, cfg):
  out = {**_target_extras(), "model.embed_tokens.weight": canon["embed_tokens.weight"],
         "lm_head.weight": canon["lm_head.weight"]}
  for i in range(cfg.num_modules):
    p = f"model.mtp_layers.{i}."
    for s, v in _module(canon, i).items():
      if s == "eh_proj.weight":  # MiMo's input_proj reads concat(hidden, embedding)
        v = np.concatenate([v[:, D:], v[:, :D]], axis=1)
      out[p + MIMO_NAMES.get(s, s)] = v
  return out


def to_qwen3_next(canon, cfg):
  out = {**_target_extras(), "model.embed_tokens.weight": canon["embed_tokens.weight"],
         "lm_head.weight": canon["lm_head.weight"]}
  for i in range(cfg.num_modules):
    for s, v in _module(canon, i).items():  # norms zero-centred as stored: cfg.norm_unit_offset
      out[QWEN_NAMES.get(s, f"mtp.layers.{i}.{s}")] = v
  return out


CONVERTERS = {"deepseek": to_deepseek, "mimo": to_mimo, "qwen3_next": to_qwen3_next}


def hf_config(layout, cfg):
  config = {"hidden_size": D, "num_attention_heads": H, "num_key_value_heads": HKV,
            "head_dim": DH, "intermediate_size": F, "vocab_size": V, "rms_norm_eps": 1e-5,
            "rope_theta": 5000.0, "hidden_act": "silu", "num_hidden_layers": NUM_LAYERS}
  if layout == "deepseek":
    config |= {"model_type": "deepseek_v3", "num_nextn_predict_layers": K,
               "attention_bias": cfg.attention_bias}
  elif layout == "mimo":
    config |= {"model_type": "mimo", "num_nextn_predict_layers": K}
    if not cfg.attention_bias:  # Qwen2-family configs only say so when biases are absent
      config["attention_bias"] = False
  else:
    config |= {"model_type": "qwen3_next", "mtp_num_hidden_layers": K,
               "attention_bias": cfg.attention_bias, "partial_rotary_factor": 1.0}  # default 0.25
  return config


def write_checkpoint(folder, tensors, config, shards=1):
  """Writes tensors (in `shards` files, with an index when more than one) and config.json."""
  folder.mkdir(parents=True, exist_ok=True)
  names = sorted(tensors)
  if shards == 1:
    save_tensors(folder / "model.safetensors", tensors)
  else:
    weight_map = {}
    for s in range(shards):
      file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
      part = names[s::shards]
      save_tensors(folder / file, {n: tensors[n] for n in part})
      weight_map |= dict.fromkeys(part, file)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
  (folder / "config.json").write_text(json.dumps(config))
  return folder


def assert_same(got, want):
  assert sorted(got) == sorted(want)
  for name in want:
    np.testing.assert_array_equal(got[name], want[name], err_msg=name)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("layout", ["deepseek", "mimo", "qwen3_next"])
def test_read_real_layout_round_trip(tmp_path, layout, bias):
  cfg = tiny_cfg(bias, layout)
  canon = canonical_tensors(cfg, shared_across_modules=layout == "qwen3_next")
  raw = CONVERTERS[layout](canon, cfg)
  folder = write_checkpoint(tmp_path / layout, raw, hf_config(layout, cfg),
                            shards=2 if layout == "deepseek" else 1)
  got_cfg, got = layouts.read_mtp_checkpoint(folder)
  assert got_cfg == cfg
  assert_same(got, canon)
  # The same through a file path and an explicit layout.
  file = "model.safetensors.index.json" if layout == "deepseek" else "model.safetensors"
  assert_same(layouts.read_mtp_checkpoint(folder / file, layout=layout)[1], canon)


def test_mimo_input_proj_halves_are_swapped():
  cfg = tiny_cfg(True, "mimo")
  canon = canonical_tensors(cfg)
  raw = to_mimo(canon, cfg)
  got = layouts.to_canonical(raw, "mimo", cfg)
  for i in range(K):
    input_proj = raw[f"model.mtp_layers.{i}.input_proj.weight"]
    eh_proj = got[f"mtp.{i}.eh_proj.weight"]
    np.testing.assert_array_equal(eh_proj[:, :D], input_proj[:, D:])  # embedding columns
    np.testing.assert_array_equal(eh_proj[:, D:], input_proj[:, :D])  # hidden columns
    assert not np.array_equal(eh_proj, input_proj)
    np.testing.assert_array_equal(got[f"mtp.{i}.self_attn.q_proj.bias"],
                                  raw[f"model.mtp_layers.{i}.self_attn.q_proj.bias"])


def test_qwen3_next_shared_set_replicated_and_norms_shifted():
  cfg = tiny_cfg(False, "qwen3_next")
  assert cfg.norm_unit_offset and cfg.qk_norm and cfg.attention_gate
  canon = canonical_tensors(cfg, shared_across_modules=True)
  raw = to_qwen3_next(canon, cfg)
  got = layouts.to_canonical(raw, "qwen3_next", cfg)
  # A config without the (1 + w) norms gets the stored zero-centred weights shifted by 1.
  plain = dataclasses.replace(cfg, norm_unit_offset=False)
  shifted = layouts.to_canonical(raw, "qwen3_next", plain)
  for i in range(K):
    np.testing.assert_array_equal(got[f"mtp.{i}.eh_proj.weight"], raw["mtp.fc.weight"])
    for name, stored in ((f"mtp.{i}.enorm.weight", "mtp.pre_fc_norm_embedding.weight"),
                         (f"mtp.{i}.input_layernorm.weight", f"mtp.layers.{i}.input_layernorm.weight"),
                         (f"mtp.{i}.self_attn.q_norm.weight", f"mtp.layers.{i}.self_attn.q_norm.weight")):
      np.testing.assert_array_equal(got[name], raw[stored])
      np.testing.assert_array_equal(shifted[name], raw[stored] + 1)
    assert shifted[f"mtp.{i}.shared_head.norm.weight"].dtype == np.float32


def test_only_needed_tensors_are_read(tmp_path, monkeypatch):
  cfg = tiny_cfg()
  raw = to_deepseek(canonical_tensors(cfg), cfg)
  folder = write_checkpoint(tmp_path, raw, hf_config("deepseek", cfg), shards=2)
  read = []
  real_get = CheckpointReader.get
  monkeypatch.setattr(CheckpointReader, "get", lambda self, n: read.append(n) or real_get(self, n))
  layouts.read_mtp_checkpoint(folder)
  assert read and not [n for n in read if not n.startswith(("model.layers.3.", "model.layers.4."))]
  assert len(read) == len(set(read))


def test_deepseek_falls_back_to_main_embedding_and_head():
  cfg = tiny_cfg()
  canon = canonical_tensors(cfg)
  raw = to_deepseek(canon, cfg, per_layer_embed=False)
  raw = {n: v for n, v in raw.items() if not n.endswith("shared_head.head.weight")}
  raw["lm_head.weight"] = canon["lm_head.weight"]
  assert_same(layouts.to_canonical(raw, "deepseek", cfg), canon)
  # Without first_layer the MTP layers are found from their eh_proj; an explicit one wins.
  with pytest.raises(ValueError, match=r"lacks tensor 'model\.layers\.2\."):
    layouts.to_canonical(raw, "deepseek", cfg, first_layer=2)


def test_deepseek_modules_with_different_heads_are_refused():
  cfg = tiny_cfg()
  raw = to_deepseek(canonical_tensors(cfg), cfg)
  raw["model.layers.4.shared_head.head.weight"] = raw["model.layers.4.shared_head.head.weight"] + 1
  with pytest.raises(ValueError, match=r"shared_head\.head\.weight.*differ.*lm_head"):
    layouts.to_canonical(raw, "deepseek", cfg)


@pytest.mark.parametrize("layout", ["deepseek", "mimo", "qwen3_next"])
def test_missing_tensor_is_named(layout):
  cfg = tiny_cfg(False, layout)
  raw = CONVERTERS[layout](canonical_tensors(cfg, shared_across_modules=True), cfg)
  victim = {"deepseek": "model.layers.4.mlp.down_proj.weight",
            "mimo": "model.mtp_layers.1.input_proj.weight",
            "qwen3_next": "mtp.layers.1.self_attn.k_proj.weight"}[layout]
  del raw[victim]
  with pytest.raises(ValueError, match=rf"{layout}.*'{victim}'.*expected shape"):
    layouts.to_canonical(raw, layout, cfg)


@pytest.mark.parametrize("layout", ["deepseek", "mimo", "qwen3_next"])
def test_wrong_shape_is_named(tmp_path, layout):
  cfg = tiny_cfg(False, layout)
  raw = CONVERTERS[layout](canonical_tensors(cfg, shared_across_modules=True), cfg)
  victim = {"deepseek": "model.layers.3.self_attn.q_proj.weight",
            "mimo": "model.mtp_layers.0.mlp.up_proj.weight",
            "qwen3_next": "mtp.fc.weight"}[layout]
  raw[victim] = raw[victim][:-1]
  folder = write_checkpoint(tmp_path, raw, hf_config(layout, cfg))
  with pytest.raises(ValueError, match=rf"{layout}.*'{victim}'.*shape.*expected"):
    layouts.read_mtp_checkpoint(folder)


@pytest.mark.parametrize("layout,extra", [
    ("deepseek", "model.layers.3.mlp.experts.0.gate_proj.weight"),
    ("deepseek", "model.layers.4.mlp.gate.weight"),
    ("deepseek", "model.layers.3.self_attn.kv_a_proj_with_mqa.weight"),
    ("mimo", "model.mtp_layers.1.self_attn.q_proj.bias"),
    ("qwen3_next", "mtp.layers.0.linear_attn.A_log"),
    ("qwen3_next", "mtp.layers.1.mlp.shared_expert_gate.weight"),
    ("qwen3_next", "mtp.fc.weight_scale_inv"),
])
def test_unsupported_tensor_is_named(layout, extra):
  cfg = tiny_cfg(False, layout)
  raw = CONVERTERS[layout](canonical_tensors(cfg, shared_across_modules=True), cfg)
  raw[extra] = np.zeros(4, np.float32)
  with pytest.raises(NotImplementedError, match=rf"{layout}.*'{extra}'.*only dense blocks"):
    layouts.to_canonical(raw, layout, cfg)


def test_detect_layout():
  cfg = tiny_cfg()
  canon = canonical_tensors(cfg, shared_across_modules=True)
  assert layouts.detect_layout(canon) == "canonical"
  for layout, convert in CONVERTERS.items():
    assert layouts.detect_layout(convert(canon, cfg)) == layout
  with pytest.raises(ValueError, match="none"):
    layouts.detect_layout(["model.layers.0.mlp.up_proj.weight"])
  with pytest.raises(ValueError, match="deepseek.*mimo"):
    layouts.detect_layout(["model.layers.3.eh_proj.weight", "model.mtp_layers.0.input_proj.weight"])


def test_config_from_hf(tmp_path):
  config = hf_config("deepseek", tiny_cfg())
  assert layouts.config_from_hf(config) == tiny_cfg()
  path = tmp_path / "config.json"
  path.write_text(json.dumps({k: v for k, v in config.items() if k != "model_type"}))
  assert layouts.config_from_hf(path) == dataclasses.replace(tiny_cfg(), mask_first_embedding=False)
  assert layouts.config_from_hf(path, layout="mimo").mask_first_embedding
  ernie = layouts.config_from_hf({**config, "model_type": "ernie4_5"})
  assert (ernie.pass_normed_hidden, ernie.head_norm, ernie.mask_first_embedding) == (False, False, True)
  assert ernie.rope_interleave
  # transformers' family defaults when config.json leaves them out.
  assert layouts.config_from_hf({**config, "model_type": "glm4_moe"}).partial_rotary_factor == 0.5
  assert layouts.config_from_hf({**config, "model_type": "qwen3_next"}).partial_rotary_factor == 0.25
  # Defaults: head_dim from hidden / heads, kv heads from heads; transformers v5 rope_parameters.
  slim = {k: v for k, v in config.items()
          if k not in ("head_dim", "num_key_value_heads", "rope_theta", "attention_bias")}
  slim["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e6}
  got = layouts.config_from_hf(slim)
  assert (got.head_dim, got.num_kv_heads, got.rope_theta) == (D // H, H, 1e6)
  assert not got.attention_bias
  assert layouts.config_from_hf({**slim, "model_type": "mimo"}).attention_bias
  # MLA (DeepSeek-V3): kv heads are the query heads whatever the count says; interleaved RoPE by default.
  mla = {"kv_lora_rank": 16, "q_lora_rank": None, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 6,
         "num_key_value_heads": 128}
  got = layouts.config_from_hf({**config, **mla})
  assert got.mla == MlaConfig(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6)
  assert got.num_kv_heads == H and got.rope_interleave
  assert not layouts.config_from_hf({**config, **mla, "rope_interleave": False}).rope_interleave
  with pytest.raises(ValueError, match="MLA.*'kimi_k2' is not supported"):
    layouts.config_from_hf({**config, **mla, "model_type": "kimi_k2"})
  # LongCat-Flash: q and latent scaled by sqrt(hidden / rank) unless its config turns them off.
  longcat = {**config, **mla, "q_lora_rank": 8, "model_type": "longcat_flash"}
  got = layouts.config_from_hf(longcat).mla
  assert (got.q_lora_scale, got.kv_lora_scale) == ((D / 8) ** 0.5, (D / 16) ** 0.5)
  got = layouts.config_from_hf({**longcat, "mla_scale_q_lora": False, "mla_scale_kv_lora": False}).mla
  assert (got.q_lora_scale, got.kv_lora_scale) == (1.0, 1.0)
  for bad in (0.0, -1.0, float("nan"), True):
    with pytest.raises(ValueError, match="MlaConfig.kv_lora_scale"):
      MlaConfig(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, kv_lora_scale=bad)
  for bad, match in [({"rope_scaling": {"type": "yarn", "factor": 40}}, "yarn"),
                     ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "dynamic"),
                     ({"hidden_act": "gelu"}, "gelu"),
                     ({"num_nextn_predict_layers": 0}, "MTP")]:
    with pytest.raises(ValueError, match=match):
      layouts.config_from_hf({**config, **bad})


def test_mimo_v2_flash_mtp_attention_from_config():
  """MiMo-V2-Flash's MTP block reads the swa_* keys (families/mimo_v2_flash.py says where from):
  window sliding_window_size + 1 rows (-1: none), v heads swa_head_dim wide without swa_v_head_dim,
  eps layernorm_epsilon; missing or bad keys are named."""
  config = {**hf_config("deepseek", tiny_cfg()), "model_type": "mimo_v2_flash", "swa_num_attention_heads": 4,
            "swa_num_key_value_heads": 2, "swa_head_dim": 12, "swa_v_head_dim": 8, "sliding_window_size": 5,
            "attention_value_scale": 0.5, "add_swa_attention_sink_bias": True, "layernorm_epsilon": 1e-5,
            "swa_rope_theta": 100.0, "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8}
  got = layouts.config_from_hf(config)
  assert (got.num_heads, got.num_kv_heads, got.head_dim, got.value_dim, got.sliding_window) == (4, 2, 12, 8, 6)
  assert (got.attention_value_scale, got.attention_sinks, got.rms_norm_eps, got.rope_theta) == (0.5, True, 1e-5, 100.0)
  assert got.moe is None
  slim = {k: v for k, v in config.items() if k not in ("swa_v_head_dim", "attention_value_scale", "swa_rope_theta",
                                                       "add_swa_attention_sink_bias")}
  got = layouts.config_from_hf({**slim, "sliding_window_size": -1})
  assert (got.value_dim, got.sliding_window, got.attention_value_scale, got.attention_sinks) == (12, None, None, False)
  assert got.rope_theta == config["rope_theta"]
  with pytest.raises(InvalidValue, match="swa_head_dim") as e:
    layouts.config_from_hf({k: v for k, v in config.items() if k != "swa_head_dim"})
  assert e.value.argument == "config.json: swa_head_dim"
  for key, bad in [("attention_value_scale", -1.0), ("swa_v_head_dim", 0), ("sliding_window_size", -2),
                   ("add_swa_attention_sink_bias", 1)]:
    with pytest.raises((InvalidValue, InvalidType)) as e:
      layouts.check_hf_config({**config, key: bad})
    assert e.value.argument == f"config.json: {key}"


def test_save_canonical_round_trip(tmp_path):
  cfg = dataclasses.replace(tiny_cfg(True), pass_normed_hidden=True, dtype="bfloat16")
  canon = canonical_tensors(cfg)
  layouts.save_canonical(tmp_path / "out", cfg, {**canon, "unrelated.weight": np.zeros(3)})
  got_cfg, got = layouts.read_mtp_checkpoint(tmp_path / "out")
  assert got_cfg == cfg
  assert_same(got, canon)
  bad = {**canon, "lm_head.weight": canon["lm_head.weight"][:, :-1]}
  with pytest.raises(ValueError, match=r"'lm_head\.weight'.*expected \(50, 16\)"):
    layouts.save_canonical(tmp_path / "bad", cfg, bad)


@pytest.mark.parametrize("layout", ["mimo", "qwen3_next"])
def test_drafts_match_after_loading_real_layout(tmp_path, layout):
  try:
    from mtp_jax import init_state, load_state_dict, propose
  except ImportError:
    pytest.skip("mtp_jax.load_state_dict / propose are not available")
  cfg = tiny_cfg(True, layout)
  canon = canonical_tensors(cfg, shared_across_modules=True)
  folder = write_checkpoint(tmp_path, CONVERTERS[layout](canon, cfg), hf_config(layout, cfg))
  read_cfg, read = layouts.read_mtp_checkpoint(folder)
  rng = np.random.default_rng(1)
  b, t = 2, 6
  hiddens = rng.standard_normal((b, t, D)).astype(np.float32)
  tokens = rng.integers(0, V, (b, t)).astype(np.int32)
  num_new = np.array([t, t - 2], np.int32)
  drafts = []
  for c, tensors in ((read_cfg, read), (cfg, canon)):
    model = load_state_dict(c, tensors)
    d, _ = propose(model, init_state(c, b, 32), hiddens, tokens, num_new, num_drafts=K)
    drafts.append(np.asarray(d))
  np.testing.assert_array_equal(drafts[0], drafts[1])
