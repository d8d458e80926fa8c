"""Bailing / Ling hybrid (`bailing_hybrid`): the MTP modules load from a tiny directory in the released
(Ling) layout, written here, and their chain equals a reference wired as the engines wire the MTP layer:

- wiring: vLLM 0.34 model_executor/models/bailing_moe_v3_mtp.py (BailingMoeV3MultiTokenPredictorLayer.forward;
  bailing_moe_mtp.py's BailingMoeV25MultiTokenPredictorLayer is the same but for its position-0 mask) and
  SGLang 0.5.23 srt/models/bailing_moe_nextn.py: eh_proj(concat(enorm(e), hnorm(h))), a pre-norm MLA + MoE
  layer, final_layernorm(h) handed on and scored by lm_head; depth 3 of two modules runs module 0 (vLLM's
  spec_step_idx % num_mtp_layers).
- the layer: transformers 5.25 models/bailing_hybrid/modeling_bailing_hybrid.py, BailingHybridAttention
  (MLA, interleaved RoPE, the head-wise g_proj; held open, sigmoid = 1 in float32, for a checkpoint
  without one, as vLLM's Ling-2.5 MTP attention has none), BailingHybridMoE (DeepseekV3TopkRouter:
  sigmoid, correction bias, groups; BailingHybridExperts and BailingHybridMLP with their clipped SwiGLU;
  the shared expert rebuilt at moe_shared_expert_intermediate_size, vLLM's width), BailingHybridRMSNorm,
  BailingHybridRotaryEmbedding; every tensor set here (transformers leaves the experts uninitialised).
"""

import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import BailingHybridConfig
from transformers.models.bailing_hybrid import modeling_bailing_hybrid as bh

import mtp_jax
from mtp_jax import layouts
from mtp_jax.checkpoint import save_tensors
from mtp_jax.pretrained import load_mtp

V, D, N, H, E = 48, 32, 3, 4, 8  # N target layers: MTP module k is model.layers.{N + k}
MLA = dict(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6)
MOE = dict(num_experts_per_tok=2, n_group=2, topk_group=1, moe_intermediate_size=16, routed_scaling_factor=2.0)
LIMITS = (0.6, 0.8)  # routed, shared: small enough to clip these activations (checked below)


def hf_config(q_lora_rank, limits=(0.0, 0.0)) -> BailingHybridConfig:
  """transformers' config of the reference layer; the clip limits sit at layer N - 1, where it is built."""
  config = BailingHybridConfig(
      vocab_size=V, hidden_size=D, intermediate_size=48, num_hidden_layers=N, num_attention_heads=H,
      num_key_value_heads=H, q_lora_rank=q_lora_rank, num_local_experts=E, n_shared_experts=1, norm_topk_prob=True,
      rms_norm_eps=1e-5, rope_theta=500.0, rope_parameters={"rope_type": "default", "rope_theta": 500.0},
      layer_group_size=N, first_k_dense_replace=1,
      expert_swiglu_limit_list=[0.0] * (N - 1) + [limits[0]], share_expert_swiglu_limit_list=[0.0] * (N - 1) + [
          limits[1]], pad_token_id=None, eos_token_id=None, **MLA, **MOE)
  config._attn_implementation = config._experts_implementation = "eager"
  return config


class _Open(torch.nn.Module):
  """An output gate held open: logits of 40, sigmoid exactly 1 in float32."""

  def forward(self, x):
    return torch.full(x.shape[:-1] + (H,), 40.0)


def init_all(module: torch.nn.Module, seed: int) -> None:
  """Every parameter and the router's correction bias drawn here: norms near 1, matrices by fan-in."""
  gen = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    biases = [(n, b) for n, b in module.named_buffers() if n.endswith("e_score_correction_bias")]
    for name, p in list(module.named_parameters()) + biases:
      noise = torch.randn(p.shape, generator=gen)
      p.copy_(1 + 0.2 * noise if name.endswith("norm.weight") else 0.3 * noise if p.ndim == 1
              else noise / p.shape[-1] ** 0.5 * 1.5)


class RefMtp(torch.nn.Module):
  """One MTP module as the engines wire it (module docstring), transformers' modules inside."""

  def __init__(self, config, gated: bool, shared_width: int):
    super().__init__()
    norm = lambda: bh.BailingHybridRMSNorm(D, eps=config.rms_norm_eps)
    self.enorm, self.hnorm, self.input_layernorm, self.post_attention_layernorm, self.final_layernorm = (
        norm() for _ in range(5))
    self.eh_proj = torch.nn.Linear(2 * D, D, bias=False)
    self.attn = bh.BailingHybridAttention(config, N - 1)
    self.moe = bh.BailingHybridMoE(config, N - 1)
    self.moe.shared_experts = bh.BailingHybridMLP(config, intermediate_size=shared_width, layer_idx=N - 1)
    init_all(self, 0)
    if not gated:
      self.attn.g_proj = _Open()
    self.rotary = bh.BailingHybridRotaryEmbedding(config)

  def released(self, layer: int) -> dict:
    """name -> array as Ling releases MTP layer `layer`: attention.* (o_proj as dense), mlp.gate.expert_bias,
    experts one torch [out, in] tensor each."""
    out = {}
    bias = self.moe.gate.e_score_correction_bias
    named = list(self.named_parameters()) + [("moe.gate.e_score_correction_bias", bias)]
    for name, p in named:
      v, prefix = p.detach().numpy(), f"model.layers.{layer}."
      name = (name.replace("attn.o_proj", "attn.dense").replace("attn.", "attention.").replace("moe.", "mlp.")
              .replace("gate.e_score_correction_bias", "gate.expert_bias"))
      if name == "mlp.experts.gate_up_proj":
        f = v.shape[1] // 2
        for e in range(E):
          out[f"{prefix}mlp.experts.{e}.gate_proj.weight"], out[f"{prefix}mlp.experts.{e}.up_proj.weight"] = (
              v[e, :f], v[e, f:])
      elif name == "mlp.experts.down_proj":
        out |= {f"{prefix}mlp.experts.{e}.down_proj.weight": v[e] for e in range(E)}
      else:
        out[prefix + name] = v
    return out

  def forward(self, emb, h, positions):
    """emb, h: float32[1, T, D]; positions: int[1, T]; returns final_layernorm(h) float32[1, T, D]."""
    x = self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(h)], -1))
    t = x.shape[1]
    mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
    x = x + self.attn(self.input_layernorm(x), self.rotary(x, positions), mask)[0]
    x = x + self.moe(self.post_attention_layernorm(x))
    return self.final_layernorm(x)


def write_dir(path, config_json: dict, modules: list[RefMtp], seed: int):
  """The released directory: the MTP layers at model.layers.{N + k}, the embedding and the head."""
  rng = np.random.default_rng(seed)
  embed = rng.standard_normal((V, D)).astype(np.float32)
  lm_head = (rng.standard_normal((V, D)) / D ** 0.5).astype(np.float32)
  tensors = {"model.word_embeddings.weight": embed, "lm_head.weight": lm_head, "model.norm.weight": np.ones(D)}
  for k, module in enumerate(modules):
    tensors |= module.released(N + k)
  save_tensors(path / "model.safetensors", {n: np.asarray(v, np.float32) for n, v in tensors.items()})
  (path / "config.json").write_text(json.dumps(config_json))
  return embed, lm_head


def reference_chain(modules, hidden, toks, embed, lm_head, depths):
  """float32[depths, n, V]: depth m runs modules[(m - 1) % K] over rows 0..n-1, cache-free."""
  n = hidden.shape[1]
  with torch.no_grad():
    h, out = torch.from_numpy(hidden), []
    for m in range(1, depths + 1):
      h = modules[(m - 1) % len(modules)](torch.from_numpy(embed[toks[:, m:m + n]]), h, torch.arange(n)[None] + m - 1)
      out.append(h[0].numpy() @ lm_head.T)
  return np.stack(out)


def check_chain(proposer, modules, embed, lm_head, depths, seed):
  """forward_chain's logits (every row, every depth) equal the reference's; propose's greedy drafts through
  the caches equal the reference's greedy chain."""
  rng = np.random.default_rng(seed)
  n = 9
  toks = rng.integers(0, V, (1, n + depths))
  hidden = rng.standard_normal((1, n, D)).astype(np.float32)
  want = reference_chain(modules, hidden, toks, embed, lm_head, depths)
  got = mtp_jax.forward_chain(proposer, jnp.asarray(hidden), jnp.asarray(toks[:, 1:], jnp.int32))
  np.testing.assert_allclose(np.asarray(got[:, 0]), want, rtol=1e-4, atol=1e-4)
  ref_drafts, ext = [], toks.copy()
  for m in range(depths):
    ref_drafts.append(int(np.argmax(reference_chain(modules, hidden, ext, embed, lm_head, depths)[m, -1])))
    if n + m + 1 < ext.shape[1]:
      ext[0, n + m + 1] = ref_drafts[-1]
  drafts, _ = mtp_jax.propose(proposer, mtp_jax.init_state(proposer.cfg, 1, 32), hidden, toks[:, 1:n + 1],
                              np.array([n], np.int32), num_drafts=depths)
  assert np.asarray(drafts)[0].tolist() == ref_drafts
  return hidden, toks, want


def ling3_config(modules: int, **extra) -> dict:
  """A Ling-3 style config.json (BailingMoeV3ForCausalLM keys): the MTP layers' clip limits at index N + k,
  the linear-attention heads' partial_rotary_factor and use_qk_norm, which MLA ignores."""
  return {"model_type": "bailing_hybrid", "architectures": ["BailingMoeV3ForCausalLM"], "vocab_size": V,
          "hidden_size": D, "intermediate_size": 48, "num_hidden_layers": N, "num_attention_heads": H,
          "num_key_value_heads": H, "head_dim": 8, "q_lora_rank": 24, **MLA, **MOE, "num_experts": E,
          "num_shared_experts": 1, "moe_shared_expert_intermediate_size": 24, "norm_topk_prob": True,
          "score_function": "sigmoid", "moe_router_enable_expert_bias": True, "topk_method": "noaux_tc",
          "rms_norm_eps": 1e-5, "rope_theta": 500.0, "partial_rotary_factor": 0.5, "rope_interleave": True,
          "rope_parameters": {"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.5},
          "use_qk_norm": True, "hidden_act": "silu", "tie_word_embeddings": False, "first_k_dense_replace": 1,
          "layer_group_size": N, "short_conv_kernel_size": 4, "num_nextn_predict_layers": modules,
          "gated_attention_proj_granularity_type": "head_wise",
          "expert_swiglu_limit_list": [0.0] * N + [LIMITS[0]] * modules,
          "share_expert_swiglu_limit_list": [0.0] * N + [LIMITS[1]] * modules, **extra}


def test_ling3_mtp_gated_clipped_equals_engine_reference(tmp_path):
  """Two gated modules with a q LoRA and clipped experts (limits at the MTP layers' own index N + k);
  depth 3 reuses module 0. The clip changes the reference's logits, so it is checked."""
  config = hf_config(q_lora_rank=24, limits=LIMITS)
  modules = [RefMtp(config, gated=True, shared_width=24) for _ in range(2)]
  init_all(modules[1], 1)
  embed, lm_head = write_dir(tmp_path, ling3_config(2), modules, 2)
  with pytest.raises(NotImplementedError, match="'bailing_hybrid' has no target.*KDA"):
    mtp_jax.load_target(tmp_path)
  proposer = load_mtp(tmp_path, dtype="float32", max_depth=3)
  cfg = proposer.cfg
  assert (cfg.attention_head_gate, cfg.mla.q_lora_rank, cfg.rope_interleave, cfg.partial_rotary_factor) == (
      True, 24, True, 1.0)
  assert (cfg.swiglu_limit, cfg.moe.swiglu_limit, cfg.moe.shared_width, cfg.qk_norm) == (0.8, 0.6, 24, False)
  assert {k: getattr(cfg, k) for k in layouts.conventions("bailing_hybrid")} == layouts.conventions("bailing_hybrid")
  hidden, toks, want = check_chain(proposer, modules, embed, lm_head, 3, 3)
  for module in modules:
    module.moe.experts.limit = module.moe.shared_experts.limit = None
  assert np.abs(reference_chain(modules, hidden, toks, embed, lm_head, 3) - want).max() > 1e-2


def test_mtp_without_gate_in_transformers_names_equals_engine_reference(tmp_path):
  """config.json as transformers writes it (num_expert_group, num_experts_per_token, moe_renormalize, no
  q LoRA, limits num_hidden_layers long: the MTP layer unclipped) and a checkpoint whose MTP layer holds
  no g_proj: the MLA runs ungated."""
  config = hf_config(q_lora_rank=None)
  module = RefMtp(config, gated=False, shared_width=MOE["moe_intermediate_size"])
  assert f"model.layers.{N}.attention.g_proj.weight" not in module.released(N)
  embed, lm_head = write_dir(tmp_path, json.loads(config.to_json_string()), [module], 4)
  proposer = load_mtp(tmp_path, dtype="float32", max_depth=2)
  cfg = proposer.cfg
  assert (cfg.attention_head_gate, cfg.mla.q_lora_rank, cfg.swiglu_limit, cfg.moe.swiglu_limit) == (
      False, None, None, None)
  check_chain(proposer, [module], embed, lm_head, 2, 5)


def test_gate_and_clip_settled_by_checkpoint_and_config():
  """Without tensor names config.json's gate key stands; with them the checkpoint settles it, and a key that
  declares a gate the checkpoint lacks is refused; limits past the list leave the layer unclipped."""
  hf = ling3_config(1)
  gate = f"model.layers.{N}.attention.g_proj.weight"
  assert layouts.config_from_hf(hf).attention_head_gate
  assert not layouts.config_from_hf({**hf, "gated_attention_proj_granularity_type": None}).attention_head_gate
  assert layouts.config_from_hf({**hf, "gated_attention_proj_granularity_type": None}, names={gate}).attention_head_gate
  with pytest.raises(ValueError, match="'head_wise' declares an MLA output gate, but"):
    layouts.config_from_hf(hf, names={"lm_head.weight"})
  short = layouts.config_from_hf({**hf, "expert_swiglu_limit_list": [5.0] * N, "share_expert_swiglu_limit_list": None})
  assert (short.moe.swiglu_limit, short.swiglu_limit) == (None, None)


@pytest.mark.parametrize("extra, match", [
    ({"gated_attention_proj_granularity_type": "element_wise"}, "'element_wise'.*not supported"),
    ({"score_function": "softmax"}, "score_function 'softmax'"),
    ({"moe_router_enable_expert_bias": False}, "moe_router_enable_expert_bias"),
    ({"num_nextn_predict_layers": 2, "expert_swiglu_limit_list": [0.0] * N + [1.0, 2.0]}, "different limits")])
def test_bailing_refusals_name_the_key(extra, match):
  with pytest.raises(ValueError, match=match):
    layouts.config_from_hf(ling3_config(1) | extra)
