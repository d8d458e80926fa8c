"""DeepSeek-V4 (`deepseek_v4`): the MTP modules load from a tiny directory in DeepSeek's release layout,
written here, and their chain equals a reference wired as SGLang wires the MTP layer, built from
transformers' own DeepSeek-V4 modules:

- wiring: SGLang 0.5.23 srt/models/deepseek_v4_nextn.py (DeepseekV4ModelNextN.forward): the hidden is the
  hc_mult streams flattened; every stream becomes h_proj(hnorm(stream)) + e_proj(enorm(e)); the decoder
  layer built with compress ratio 0 (sliding-window attention only); the streams, flattened, handed on;
  logits = head(norm(hc_head(streams))) with the target's head. Depth 3 of two modules runs module 0.
- the layer: transformers 5.25 models/deepseek_v4/modeling_deepseek_v4.py, DeepseekV4DecoderLayer with
  layer_types ["sliding_attention"] and mlp_layer_types ["moe"] (DeepseekV4HyperConnection,
  DeepseekV4Attention with sinks and the grouped output projection, DeepseekV4SparseMoeBlock with the
  sqrtsoftplus DeepseekV4TopKRouter and clamped experts), DeepseekV4HyperHead, DeepseekV4RMSNorm,
  DeepseekV4RotaryEmbedding ("main"); every tensor set here. The mask is transformers' sliding-window
  causal mask (a query sees itself and the window - 1 rows before it).
- names: transformers 5.25 conversion_mapping.py ("deepseek_v4") and SGLang's
  remap_weight_name_to_dpsk_hf_format.
"""

import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import DeepseekV4Config
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as dv4

import mtp_jax
from mtp_jax import layouts
from mtp_jax.checkpoint import save_tensors
from mtp_jax.pretrained import load_mtp

V, D, N, H, DH, E, HC, W = 48, 32, 3, 4, 16, 8, 3, 4  # N target layers; HC streams; W the sliding window
LIMIT = 0.4  # small enough to clamp these activations (checked below)


def hf_config() -> DeepseekV4Config:
  config = DeepseekV4Config(
      vocab_size=V, hidden_size=D, moe_intermediate_size=16, num_hidden_layers=1, num_attention_heads=H,
      num_key_value_heads=1, head_dim=DH, q_lora_rank=24, num_experts_per_tok=2, n_routed_experts=E,
      n_shared_experts=1, scoring_func="sqrtsoftplus", routed_scaling_factor=1.5, rope_theta=500.0,
      layer_types=["sliding_attention"], mlp_layer_types=["moe"], hc_mult=HC, hc_sinkhorn_iters=5, hc_eps=1e-6,
      swiglu_limit=LIMIT, sliding_window=W, o_groups=2, o_lora_rank=12, partial_rotary_factor=0.5,
      rms_norm_eps=1e-6, index_n_heads=2, index_head_dim=8, index_topk=4, pad_token_id=None, eos_token_id=None)
  config._attn_implementation = config._experts_implementation = "eager"
  return config


def config_json(modules: int, **extra) -> dict:
  """A released-style config.json (DeepseekV4ForCausalLM, the legacy keys transformers folds in)."""
  return {"model_type": "deepseek_v4", "architectures": ["DeepseekV4ForCausalLM"], "vocab_size": V,
          "hidden_size": D, "moe_intermediate_size": 16, "num_hidden_layers": N, "num_attention_heads": H,
          "num_key_value_heads": 1, "head_dim": DH, "q_lora_rank": 24, "qk_rope_head_dim": DH // 2, "o_groups": 2,
          "o_lora_rank": 12, "n_routed_experts": E, "n_shared_experts": 1, "num_experts_per_tok": 2,
          "scoring_func": "sqrtsoftplus", "norm_topk_prob": True, "routed_scaling_factor": 1.5,
          "topk_method": "noaux_tc", "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 500.0,
          "compress_rope_theta": 16000.0, "rope_scaling": {"type": "yarn", "factor": 4.0,
                                                           "original_max_position_embeddings": 64},
          "max_position_embeddings": 256, "compress_ratios": [0, 4, 128], "num_hash_layers": 1,
          "sliding_window": W, "hc_mult": HC, "hc_sinkhorn_iters": 5, "hc_eps": 1e-6, "swiglu_limit": LIMIT,
          "index_n_heads": 2, "index_head_dim": 8, "index_topk": 4, "num_nextn_predict_layers": modules,
          "tie_word_embeddings": False, **extra}


class RefMtp(torch.nn.Module):
  """One MTP module as SGLang wires it (module docstring), transformers' modules inside."""

  def __init__(self, config, seed: int):
    super().__init__()
    norm = lambda: dv4.DeepseekV4RMSNorm(D, eps=config.rms_norm_eps)
    self.enorm, self.hnorm, self.norm = norm(), norm(), norm()
    self.e_proj, self.h_proj = torch.nn.Linear(D, D, bias=False), torch.nn.Linear(D, D, bias=False)
    self.layer = dv4.DeepseekV4DecoderLayer(config, 0)
    self.hc_head = dv4.DeepseekV4HyperHead(config)
    self.rotary = dv4.DeepseekV4RotaryEmbedding(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # norms near 1, vectors small, matrices by fan-in
      bias = [("layer.mlp.gate.e_score_correction_bias", self.layer.mlp.gate.e_score_correction_bias)]
      for name, p in list(self.named_parameters()) + bias:
        noise = torch.randn(p.shape, generator=gen)
        p.copy_(1 + 0.2 * noise if name.endswith("norm.weight") else 0.3 * noise if p.ndim == 1
                else noise / p.shape[-1] ** 0.5 * 1.5)

  def released(self, k: int) -> dict:
    """name -> array as DeepSeek releases MTP module k (mtp.{k}.*, experts one torch [out, in] tensor each)."""
    layer, p = self.layer, f"mtp.{k}."
    a, moe = layer.self_attn, layer.mlp
    t = lambda x: x.detach().numpy()
    out = {p + "e_proj.weight": t(self.e_proj.weight), p + "h_proj.weight": t(self.h_proj.weight),
           p + "enorm.weight": t(self.enorm.weight), p + "hnorm.weight": t(self.hnorm.weight),
           p + "norm.weight": t(self.norm.weight), p + "hc_head_fn": t(self.hc_head.hc_fn),
           p + "hc_head_base": t(self.hc_head.hc_base), p + "hc_head_scale": t(self.hc_head.hc_scale),
           p + "attn_norm.weight": t(layer.input_layernorm.weight),
           p + "ffn_norm.weight": t(layer.post_attention_layernorm.weight),
           p + "attn.wq_a.weight": t(a.q_a_proj.weight), p + "attn.q_norm.weight": t(a.q_a_norm.weight),
           p + "attn.wq_b.weight": t(a.q_b_proj.weight), p + "attn.wkv.weight": t(a.kv_proj.weight),
           p + "attn.kv_norm.weight": t(a.kv_norm.weight), p + "attn.wo_a.weight": t(a.o_a_proj.weight),
           p + "attn.wo_b.weight": t(a.o_b_proj.weight), p + "attn.attn_sink": t(a.sinks),
           p + "ffn.gate.weight": t(moe.gate.weight), p + "ffn.gate.bias": t(moe.gate.e_score_correction_bias)}
    for ours, hc in (("hc_attn_", layer.attn_hc), ("hc_ffn_", layer.ffn_hc)):
      out |= {p + ours + n: t(getattr(hc, n)) for n in ("fn", "base", "scale")}
    for n, w in (("w1", "gate_proj"), ("w2", "down_proj"), ("w3", "up_proj")):
      out[f"{p}ffn.shared_experts.{n}.weight"] = t(getattr(moe.shared_experts, w).weight)
    gate_up, down = t(moe.experts.gate_up_proj), t(moe.experts.down_proj)
    f = gate_up.shape[1] // 2
    for e in range(E):
      out[f"{p}ffn.experts.{e}.w1.weight"], out[f"{p}ffn.experts.{e}.w3.weight"] = gate_up[e, :f], gate_up[e, f:]
      out[f"{p}ffn.experts.{e}.w2.weight"] = down[e]
    return out

  def forward(self, emb, h, positions):
    """emb float32[1, T, D], h float32[1, T, HC * D] (streams flattened), positions int[1, T];
    returns (the new streams flattened, the head's input norm(hc_head(streams)))."""
    t = emb.shape[1]
    streams = self.h_proj(self.hnorm(h.view(1, t, HC, D))) + self.e_proj(self.enorm(emb))[:, :, None]
    q, k = torch.arange(t)[:, None], torch.arange(t)[None]
    mask = torch.where((k <= q) & (k > q - W), 0.0, float("-inf"))[None, None]
    rope = {kind: self.rotary(emb, positions, layer_type=kind) for kind in ("main", "compress")}
    out = self.layer(streams, input_ids=None, position_embeddings=rope, position_ids=positions, attention_mask=mask)
    return out.flatten(2), self.norm(self.hc_head(out))


def write_dir(path, modules, seed: int, **extra):
  rng = np.random.default_rng(seed)
  embed = rng.standard_normal((V, D)).astype(np.float32)
  head = (rng.standard_normal((V, D)) / D ** 0.5).astype(np.float32)
  tensors = {"embed.weight": embed, "head.weight": head, "norm.weight": np.ones(D, np.float32)}
  for k, module in enumerate(modules):
    tensors |= module.released(k)
  save_tensors(path / "model.safetensors", {n: np.asarray(v, np.float32) for n, v in tensors.items()})
  (path / "config.json").write_text(json.dumps(config_json(len(modules), **extra)))
  return embed, head


def reference_chain(modules, hidden, toks, embed, head, depths):
  """float32[depths, n, V]: depth m runs modules[(m - 1) % K] over rows 0..n-1, cache-free."""
  n = hidden.shape[1]
  with torch.no_grad():
    h, out = torch.from_numpy(hidden), []
    for m in range(1, depths + 1):
      h, head_in = modules[(m - 1) % len(modules)](torch.from_numpy(embed[toks[:, m:m + n]]), h,
                                                   torch.arange(n)[None] + m - 1)
      out.append(head_in[0].numpy() @ head.T)
  return np.stack(out)


def greedy_reference(modules, hidden, toks, embed, head, depths):
  """The reference's greedy drafts after rows 0..n-1 (toks int[1, >= n + 1]: t_0..t_n)."""
  n = hidden.shape[1]
  ext = np.zeros((1, n + depths), toks.dtype)
  ext[:, :n + 1] = toks[:, :n + 1]
  drafts = []
  for m in range(depths):
    drafts.append(int(np.argmax(reference_chain(modules, hidden, ext, embed, head, depths)[m, -1])))
    if n + m + 1 < ext.shape[1]:
      ext[0, n + m + 1] = drafts[-1]
  return drafts


def test_mtp_two_modules_equal_engine_reference_through_caches(tmp_path):
  """forward_chain's logits equal the reference's at every row and depth; propose's greedy drafts through
  the caches (dense; paged at the prompt) equal a cache-free recompute, at the prompt and again after a
  verification (rows past the sliding window). The clamp changes the reference, so it is checked."""
  config = hf_config()
  modules = [RefMtp(config, 0), RefMtp(config, 1)]
  embed, head = write_dir(tmp_path, modules, 2)
  with pytest.raises(NotImplementedError, match="'deepseek_v4' has no target.*hyper-connection"):
    mtp_jax.load_target(tmp_path)
  proposer = load_mtp(tmp_path, dtype="float32", max_depth=3)
  cfg = proposer.cfg
  assert (cfg.hidden_width, cfg.sliding_window, cfg.rotary_dim, cfg.rope_scaling, cfg.moe.scoring) == (
      HC * D, W, DH // 2, None, "sqrtsoftplus")
  rng = np.random.default_rng(3)
  n, depths = 9, 3
  toks = rng.integers(0, V, (1, n + 4))
  hidden = rng.standard_normal((1, n + 2, HC * D)).astype(np.float32)
  want = reference_chain(modules, hidden[:, :n], toks, embed, head, depths)
  got = mtp_jax.forward_chain(proposer, jnp.asarray(hidden[:, :n]), jnp.asarray(toks[:, 1:], jnp.int32))
  np.testing.assert_allclose(np.asarray(got[:, 0]), want, rtol=1e-4, atol=1e-4)

  first = greedy_reference(modules, hidden[:, :n], toks, embed, head, depths)
  paged, _ = mtp_jax.propose(proposer, mtp_jax.init_state(cfg, 1, 32, page_size=4, num_pages=16), hidden[:, :n],
                             toks[:, 1:n + 1], np.array([n], np.int32), num_drafts=depths)
  assert np.asarray(paged)[0].tolist() == first
  state = mtp_jax.init_state(cfg, 1, 32)
  drafts, state = mtp_jax.propose(proposer, state, hidden[:, :n], toks[:, 1:n + 1], np.array([n], np.int32),
                                  num_drafts=depths)
  assert np.asarray(drafts)[0].tolist() == first
  # The verifier accepts draft 1 and adds a bonus token: positions n and n + 1 arrive.
  toks[0, n + 1] = int(np.asarray(drafts)[0, 0])
  state = mtp_jax.after_verify(state, np.array([1], np.int32))
  drafts, _ = mtp_jax.propose(proposer, state, hidden[:, n:n + 2], toks[:, n + 1:n + 3], np.array([2], np.int32),
                              num_drafts=depths)
  assert np.asarray(drafts)[0].tolist() == greedy_reference(modules, hidden, toks, embed, head, depths)

  saved = tmp_path / "canonical"  # mtp_jax's own names round-trip
  layouts.save_canonical(saved, cfg, mtp_jax.mtp.state_dict(proposer))
  again = mtp_jax.mtp.state_dict(load_mtp(saved, dtype="float32", max_depth=3))
  assert all(np.array_equal(again[k], v) for k, v in mtp_jax.mtp.state_dict(proposer).items())

  for module in modules:
    module.layer.mlp.experts.limit = module.layer.mlp.shared_experts.limit = 1e9
  assert np.abs(reference_chain(modules, hidden[:, :n], toks, embed, head, depths) - want).max() > 1e-2


@pytest.mark.parametrize("extra, key", [({"model_type": "deepseek_v41"}, "hc_pre_from_prev_sublayer"),
                                        ({"q_head_norm": False}, "q_head_norm"),
                                        ({"mlp_bias": True}, "mlp_bias")])
def test_unbuilt_settings_are_refused_by_key(tmp_path, extra, key):
  write_dir(tmp_path, [RefMtp(hf_config(), 0)], 0, **extra)
  with pytest.raises(NotImplementedError, match=f"config.json: {key}"):
    load_mtp(tmp_path, dtype="float32")
