"""Families outside transformers' MtpModel: from_pretrained's MTP forward equals a torch reference
written from the engines' forward, on tiny random released directories.

- ERNIE-4.5: vLLM model_executor/models/ernie_mtp.py (ErnieMultiTokenPredictorLayer.forward) and
  SGLang srt/models/ernie4_eagle.py: the embedding of position 0 zeroed, concat(mtp_emb_norm(e),
  mtp_hidden_norm(h)) -> mtp_linear_proj -> block, the residual handed on and scored by the LM head
  with no norm; the head is tied to the embedding. The block rotates interleaved pairs, as SGLang's
  Ernie4DecoderLayer (rope_is_neox_style False) and the ERNIE target do.
- MiMo: vLLM model_executor/models/mimo_mtp.py (MiMoMultiTokenPredictorLayer.forward) and SGLang
  srt/models/mimo_mtp.py: position 0 zeroed, input_proj(concat(hidden_layernorm(h),
  token_layernorm(e))) (hidden first), a Qwen2 block, final_layernorm handed on and scored.
- Qwen3-Next: vLLM model_executor/models/qwen3_next_mtp.py (see Qwen3NextRefMtp below).
- LongCat-Flash: vLLM model_executor/models/longcat_flash_mtp.py (see LongcatRefMtp below).
- MiMo-V2-Flash: SGLang srt/models/mimo_v2_nextn.py and vLLM model_executor/models/mimo_v2_mtp.py
  (see MiMoV2RefMtp below).
Depths past the released module count reuse module 0 (vLLM: spec_step_idx % num_mtp_layers).
"""

import json
import pathlib
import re

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import (Ernie4_5Config, Ernie4_5ForCausalLM, Ernie4_5_MoeConfig, Ernie4_5_MoeForCausalLM,
                          LongcatFlashConfig, Qwen2Config, Qwen2ForCausalLM, Qwen3_5Config, Qwen3NextConfig)
from transformers.models.longcat_flash import modeling_longcat_flash as longcat
from transformers.models.mimo_v2_flash import modeling_mimo_v2_flash as mimo_v2
from transformers.models.qwen3_next import modeling_qwen3_next as qwen3_next
from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen3_5
from transformers.models.ernie4_5.modeling_ernie4_5 import Ernie4_5DecoderLayer, Ernie4_5RMSNorm
from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer, Qwen2RMSNorm

import mtp_jax
from mtp_jax import layouts
from mtp_jax.checkpoint import save_tensors
from mtp_jax.pretrained import load_mtp

V, D, N_LAYERS, DEPTHS = 48, 32, 2, 2
COMMON = dict(vocab_size=V, hidden_size=D, intermediate_size=48, num_hidden_layers=N_LAYERS,
              num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, max_position_embeddings=256,
              rope_parameters={"rope_type": "default", "rope_theta": 500.0})


def _init_all(module, seed, norm_centre=1.0):
  gen = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in module.named_parameters():
      noise = torch.randn(p.shape, generator=gen)
      if name.endswith("norm.weight"):
        p.copy_(norm_centre + 0.2 * noise)
      elif p.ndim == 1:
        p.copy_(0.2 * noise)
      else:
        p.copy_(noise / p.shape[-1] ** 0.5 * 1.5)


class RefModule(torch.nn.Module):
  """One released MTP module as the engines run it; `family` picks the names and the wiring."""

  def __init__(self, config, family):
    super().__init__()
    self.family = family
    norm, block = ((Ernie4_5RMSNorm, Ernie4_5DecoderLayer) if family == "ernie" else
                   (Qwen2RMSNorm, Qwen2DecoderLayer))
    self.emb_norm = norm(D, eps=config.rms_norm_eps)
    self.hidden_norm = norm(D, eps=config.rms_norm_eps)
    self.proj = torch.nn.Linear(2 * D, D, bias=False)
    self.block = block(config, 0)
    self.final_norm = norm(D, eps=config.rms_norm_eps) if family == "mimo" else None

  def released(self, i):
    """name -> tensor in the family's released layout."""
    names = {"ernie": {"emb_norm": f"model.mtp_emb_norm.{i}", "hidden_norm": f"model.mtp_hidden_norm.{i}",
                       "proj": f"model.mtp_linear_proj.{i}", "block": f"model.mtp_block.{i}"},
             "mimo": {"emb_norm": f"model.mtp_layers.{i}.token_layernorm",
                      "hidden_norm": f"model.mtp_layers.{i}.hidden_layernorm",
                      "proj": f"model.mtp_layers.{i}.input_proj", "block": f"model.mtp_layers.{i}",
                      "final_norm": f"model.mtp_layers.{i}.final_layernorm"}}[self.family]
    out = {}
    for n, p in self.named_parameters():
      head, rest = n.split(".", 1)
      out[f"{names[head]}.{rest}"] = p.detach().numpy()
    return out

  def forward(self, emb, h, positions, rotary):
    """emb, h: [1, T, D]; positions: [1, T] of the hidden; returns (hidden handed on, head input)."""
    if self.family == "ernie":
      x = self.proj(torch.cat([self.emb_norm(emb), self.hidden_norm(h)], -1))
    else:
      x = self.proj(torch.cat([self.hidden_norm(h), self.emb_norm(emb)], -1))
    t = x.shape[1]
    mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
    out = self.block(x, attention_mask=mask, position_ids=positions, position_embeddings=rotary(x, positions))
    out = out[0] if isinstance(out, tuple) else out
    if self.final_norm is not None:
      out = self.final_norm(out)
    return out, out


def reference_chain(main, modules, toks, n, depths):
  """Cache-free chain over t_0..t_{n+depths-1}: float[depths, n, V] logits, every row."""
  with torch.no_grad():
    h = main(toks[:, :n], output_hidden_states=True).hidden_states[-1]
    positions = torch.arange(n)[None]
    out = []
    for m in range(1, depths + 1):
      emb = main.model.embed_tokens(toks[:, m:m + n]).clone()
      if m == 1:
        emb[:, 0] = 0  # vLLM / SGLang: positions == 0 masked
      h, head_in = modules[(m - 1) % len(modules)](emb, h, positions + m - 1, main.model.rotary_emb)
      out.append(main.lm_head(head_in)[0])
  return torch.stack(out).numpy()


def write_family(tmp_path, family):
  if family == "ernie":
    config = Ernie4_5Config(**COMMON, head_dim=8, tie_word_embeddings=True, use_bias=False,
                            num_nextn_predict_layers=1)
    main = Ernie4_5ForCausalLM(config)
  else:
    config = Qwen2Config(**COMMON, tie_word_embeddings=False)
    main = Qwen2ForCausalLM(config)
  config._attn_implementation = "eager"
  main.eval()
  _init_all(main, 0)
  module = RefModule(config, family).eval()
  _init_all(module, 1)
  tensors = {n: p.detach().numpy() for n, p in main.named_parameters()} | module.released(0)
  if family == "ernie":  # tied: released without lm_head.weight
    tensors.pop("lm_head.weight", None)
  save_tensors(tmp_path / "model.safetensors", tensors)
  hf = json.loads(config.to_json_string())
  if family == "mimo":  # MiMo-7B: a Qwen2 target whose config names its MTP modules
    hf |= {"model_type": "mimo", "num_nextn_predict_layers": 1}
  (tmp_path / "config.json").write_text(json.dumps(hf))
  return main, [module]


@pytest.mark.parametrize("family", ["ernie", "mimo"])
def test_mtp_forward_equals_engine_reference(tmp_path, family):
  main, modules = write_family(tmp_path, family)
  target, proposer, _ = mtp_jax.from_pretrained(tmp_path, dtype="float32", max_depth=DEPTHS)
  want_conv = layouts.conventions({"ernie": "ernie4_5", "mimo": "mimo"}[family])
  assert {k: getattr(proposer.cfg, k) for k in want_conv} == want_conv
  n = 10
  toks = torch.tensor(np.random.default_rng(0).integers(0, V, (1, n + DEPTHS)))
  with torch.no_grad():
    ref_out = main(toks[:, :n], output_hidden_states=True)
  rows = jnp.arange(n)[None]
  logits, hidden, _ = target(jnp.asarray(toks[:, :n].numpy(), jnp.int32), rows, jnp.ones((1, n), bool), None)
  np.testing.assert_allclose(np.asarray(logits), ref_out.logits.numpy(), rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(np.asarray(hidden), ref_out.hidden_states[-1].numpy(), rtol=1e-4, atol=1e-4)

  want = reference_chain(main, modules, toks, n, DEPTHS)
  got = mtp_jax.forward_chain(proposer, hidden, jnp.asarray(toks[:, 1:].numpy(), jnp.int32))
  np.testing.assert_allclose(np.asarray(got[:, 0]), want, rtol=1e-4, atol=1e-4)
  # The proposer's drafts from the prompt are the reference chain's greedy continuation.
  ref_drafts = [int(np.argmax(want[0, -1]))]
  ext = toks.clone()
  ext[0, n + 1] = ref_drafts[0]
  ref_drafts.append(int(np.argmax(reference_chain(main, modules, ext, n, DEPTHS)[1, -1])))
  drafts, _ = mtp_jax.propose(proposer, mtp_jax.init_state(proposer.cfg, 1, 32), np.asarray(hidden),
                              toks[:, 1:n + 1].numpy(), np.array([n], np.int32), num_drafts=DEPTHS)
  assert np.asarray(drafts)[0].tolist() == ref_drafts



def test_ernie4_5_moe_mtp_is_a_dense_block_equal_to_engine_reference(tmp_path):
  """ERNIE-4.5 MoE (model_type ernie4_5_moe): its MTP block is dense whatever the target's experts.
  SGLang srt/models/ernie4.py builds Ernie4DecoderLayer(is_mtp=True) with a dense Ernie4MLP of
  intermediate_size, wired by srt/models/ernie4_eagle.py (Ernie4ModelMTP.forward); vLLM
  model_executor/models/ernie_mtp.py builds a dense LlamaDecoderLayer. The hidden comes from
  transformers' Ernie4_5_MoeForCausalLM (mtp_jax builds no ERNIE MoE target: refused by name)."""
  config = Ernie4_5_MoeConfig(**COMMON, head_dim=8, tie_word_embeddings=True, use_bias=False,
                              num_nextn_predict_layers=1, moe_num_experts=4, moe_k=2, moe_intermediate_size=16,
                              moe_layer_start_index=1, moe_num_shared_experts=1)
  config._attn_implementation = "eager"
  main = Ernie4_5_MoeForCausalLM(config).eval()
  _init_all(main, 0)
  with torch.no_grad():  # the router's correction bias is a buffer transformers leaves as allocated
    for name, b in main.named_buffers():
      if name.endswith("e_score_correction_bias"):
        b.zero_()
  module = RefModule(config, "ernie").eval()
  _init_all(module, 1)
  save_tensors(tmp_path / "model.safetensors", module.released(0) | {
      "model.embed_tokens.weight": main.model.embed_tokens.weight.detach().numpy()})
  (tmp_path / "config.json").write_text(config.to_json_string())
  with pytest.raises(NotImplementedError, match="'ernie4_5_moe' has no target.*MoE target"):
    mtp_jax.load_target(tmp_path)
  proposer = load_mtp(tmp_path, dtype="float32", max_depth=DEPTHS)
  assert proposer.cfg.moe is None and proposer.cfg.intermediate_size == 48
  assert {k: getattr(proposer.cfg, k) for k in layouts.conventions("ernie4_5")} == layouts.conventions("ernie4_5")
  n = 10
  toks = torch.tensor(np.random.default_rng(1).integers(0, V, (1, n + DEPTHS)))
  with torch.no_grad():
    hidden = main(toks[:, :n], output_hidden_states=True).hidden_states[-1].numpy()
  want = reference_chain(main, [module], toks, n, DEPTHS)
  got = mtp_jax.forward_chain(proposer, jnp.asarray(hidden), jnp.asarray(toks[:, 1:].numpy(), jnp.int32))
  np.testing.assert_allclose(np.asarray(got[:, 0]), want, rtol=1e-4, atol=1e-4)


def _canonical(cfg, seed=0):
  rng = np.random.default_rng(seed)
  return {n: rng.standard_normal(s).astype(np.float32) for n, s in layouts.canonical_shapes(cfg).items()}


@pytest.mark.parametrize("layout", ["longcat", "mimo_v2"])
def test_longcat_and_mimo_v2_names(layout):
  """Name mapping only (their blocks are MLA / sliding-window attention): released names from vLLM's
  longcat_flash_mtp.py (load_weights' mapping) and mimo_v2_mtp.py (module docstring)."""
  family = {"longcat": "longcat_flash", "mimo_v2": "mimo_v2_flash"}[layout]
  cfg = mtp_jax.MtpConfig(hidden_size=16, num_heads=2, num_kv_heads=1, head_dim=8, intermediate_size=24,
                          vocab_size=20, num_modules=1, **layouts.conventions(family))
  canon = _canonical(cfg)
  p = "model.mtp.layers.0."
  raw = {"model.embed_tokens.weight": canon["embed_tokens.weight"], "lm_head.weight": canon["lm_head.weight"]}
  for name, value in canon.items():
    if not name.startswith("mtp.0."):
      continue
    s = name.removeprefix("mtp.0.")
    if layout == "longcat":
      s = {"enorm.weight": "enorm.m.weight", "hnorm.weight": "hnorm.m.weight"}.get(s, s)
      s = "transformer_layer." + s if s.startswith("mlp.") else s
      raw["model.mtp.norm.weight" if s == "shared_head.norm.weight" else p + s] = value
    else:
      s = {"post_attention_layernorm.weight": "pre_mlp_layernorm.weight",
           "shared_head.norm.weight": "final_layernorm.weight"}.get(s, s)
      raw[p + s] = value
  assert layouts.detect_layout(raw) == layout
  got = layouts.to_canonical(raw, layout, cfg)
  for name in canon:
    np.testing.assert_array_equal(got[name], canon[name], err_msg=name)
  raw[p + "self_attn.q_a_proj.weight"] = np.zeros((4, 16), np.float32)
  with pytest.raises(NotImplementedError, match=r"q_a_proj"):
    layouts.to_canonical(raw, layout, cfg)


QN_DEPTHS = 2


class Qwen3NextRefMtp(torch.nn.Module):
  """Qwen3-Next's MTP as vLLM model_executor/models/qwen3_next_mtp.py (Qwen3NextMultiTokenPredictor
  .forward) runs it: fc(concat(pre_fc_norm_embedding(e), pre_fc_norm_hidden(h))) (embedding first,
  no position-0 mask), one full-attention decoder layer (layers[spec_step_idx % num_mtp_layers]),
  then the shared mtp.norm, handed on and scored by the target's lm_head. The layer is built from
  transformers' Qwen3NextAttention (per-head [q | gate] q_proj, q / k norms, partial RoPE) and
  Qwen3NextSparseMoeBlock; every RMSNorm is Qwen3NextRMSNorm's (1 + w), w stored zero-centred."""

  def __init__(self, config):
    super().__init__()
    norm = lambda: qwen3_next.Qwen3NextRMSNorm(D, eps=config.rms_norm_eps)
    self.pre_fc_norm_embedding, self.pre_fc_norm_hidden, self.norm = norm(), norm(), norm()
    self.fc = torch.nn.Linear(2 * D, D, bias=False)
    self.input_layernorm, self.post_attention_layernorm = norm(), norm()
    self.self_attn = qwen3_next.Qwen3NextAttention(config, 1)
    self.mlp = qwen3_next.Qwen3NextSparseMoeBlock(config)
    self.rotary = qwen3_next.Qwen3NextRotaryEmbedding(config)

  def released(self):
    """name -> tensor as released (mtp.*; experts one tensor per expert, torch [out, in])."""
    out = {}
    for n, p in self.named_parameters():
      p = p.detach().numpy()
      if n.startswith(("pre_fc", "fc.", "norm.")):
        out[f"mtp.{n}"] = p
      elif n == "mlp.experts.gate_up_proj":  # [E, 2 Fe, D]: gate rows, then up rows
        for e, w in enumerate(p):
          gate, up = np.split(w, 2)
          out[f"mtp.layers.0.mlp.experts.{e}.gate_proj.weight"] = gate
          out[f"mtp.layers.0.mlp.experts.{e}.up_proj.weight"] = up
      elif n == "mlp.experts.down_proj":
        for e, w in enumerate(p):
          out[f"mtp.layers.0.mlp.experts.{e}.down_proj.weight"] = w
      else:
        out[f"mtp.layers.0.{n}"] = p
    return out

  def forward(self, emb, h, positions):
    """emb, h: float32[1, T, D]; positions: int[1, T]; returns the normed hidden float32[1, T, D]."""
    x = self.fc(torch.cat([self.pre_fc_norm_embedding(emb), self.pre_fc_norm_hidden(h)], -1))
    t = x.shape[1]
    mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
    attn = self.self_attn(self.input_layernorm(x), self.rotary(x, positions), mask)[0]
    x = x + attn
    x = x + self.mlp(self.post_attention_layernorm(x))
    return self.norm(x)


def test_qwen3_next_mtp_equals_engine_reference(tmp_path):
  """MTP only (mtp_jax builds no Qwen3-Next target): the caller hands in the target's hidden."""
  config = Qwen3NextConfig(vocab_size=V, hidden_size=D, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=16, intermediate_size=48, moe_intermediate_size=24,
                           shared_expert_intermediate_size=40, num_experts=8, num_experts_per_tok=2,
                           num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
                           rms_norm_eps=1e-6, max_position_embeddings=256, tie_word_embeddings=False,
                           rope_parameters={"rope_type": "default", "rope_theta": 500.0,
                                            "partial_rotary_factor": 0.25})
  config._attn_implementation = "eager"
  ref = Qwen3NextRefMtp(config).eval()
  _init_all(ref, 2, norm_centre=0.0)  # zero-centred, as Qwen3-Next stores its norms
  rng = np.random.default_rng(3)
  embed = rng.standard_normal((V, D)).astype(np.float32)
  lm_head = (rng.standard_normal((V, D)) / D ** 0.5).astype(np.float32)
  save_tensors(tmp_path / "model.safetensors", ref.released() | {"model.embed_tokens.weight": embed,
                                                                  "lm_head.weight": lm_head})
  hf = json.loads(config.to_json_string()) | {"mtp_num_hidden_layers": 1}
  (tmp_path / "config.json").write_text(json.dumps(hf))

  proposer = load_mtp(tmp_path, dtype="float32", max_depth=QN_DEPTHS)
  cfg = proposer.cfg
  assert (cfg.qk_norm, cfg.attention_gate, cfg.norm_unit_offset, cfg.partial_rotary_factor) == (True, True, True, 0.25)
  assert (cfg.moe.scoring, cfg.moe.shared_expert_gate, cfg.moe.shared_width) == ("softmax", True, 40)
  assert {k: getattr(cfg, k) for k in layouts.conventions("qwen3_next")} == layouts.conventions("qwen3_next")

  n = 10
  toks = rng.integers(0, V, (1, n + QN_DEPTHS))
  hidden = rng.standard_normal((1, n, D)).astype(np.float32)

  _check_chain_and_drafts(proposer, cfg, ref, hidden, toks, embed, lm_head, QN_DEPTHS)



class Qwen3_5RefMtp(Qwen3NextRefMtp):
  """Qwen3.5's MTP as vLLM model_executor/models/qwen3_5_mtp.py (Qwen3_5MultiTokenPredictor.forward)
  runs it: the wiring of Qwen3NextRefMtp (fc over concat(pre_fc_norm_embedding(e), pre_fc_norm_hidden(h)),
  one full-attention Qwen3_5DecoderLayer, layers[spec_step_idx % num_mtp_layers], the shared norm
  handed on), here with transformers' Qwen3_5Attention, Qwen3_5MLP (the dense model), Qwen3_5RMSNorm
  (1 + w) and Qwen3_5TextRotaryEmbedding (mrope sections over equal text positions)."""

  def __init__(self, config):
    torch.nn.Module.__init__(self)
    norm = lambda: qwen3_5.Qwen3_5RMSNorm(D, eps=config.rms_norm_eps)
    self.pre_fc_norm_embedding, self.pre_fc_norm_hidden, self.norm = norm(), norm(), norm()
    self.fc = torch.nn.Linear(2 * D, D, bias=False)
    self.input_layernorm, self.post_attention_layernorm = norm(), norm()
    self.self_attn = qwen3_5.Qwen3_5Attention(config, 1)
    self.mlp = qwen3_5.Qwen3_5MLP(config, config.intermediate_size)
    self.rotary = qwen3_5.Qwen3_5TextRotaryEmbedding(config)


def test_qwen3_5_text_config_mtp_equals_engine_reference(tmp_path):
  """A Qwen3.5 directory as released: fields under text_config, the embedding at
  model.language_model.embed_tokens, MTP at mtp.*; the caller hands in the target's hidden (the
  hybrid linear-attention target is refused by name)."""
  text = dict(vocab_size=V, hidden_size=D, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              intermediate_size=48, num_hidden_layers=2, mtp_num_hidden_layers=1, rms_norm_eps=1e-6,
              max_position_embeddings=256, rope_parameters={
                  "rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.25,
                  "mrope_section": [1, 1, 0], "mrope_interleaved": True})
  config = Qwen3_5Config(text_config=text, tie_word_embeddings=False)
  text_config = config.text_config
  text_config._attn_implementation = "eager"
  ref = Qwen3_5RefMtp(text_config).eval()
  _init_all(ref, 4, norm_centre=0.0)
  rng = np.random.default_rng(5)
  embed = rng.standard_normal((V, D)).astype(np.float32)
  lm_head = (rng.standard_normal((V, D)) / D ** 0.5).astype(np.float32)
  save_tensors(tmp_path / "model.safetensors", ref.released() | {
      "model.language_model.embed_tokens.weight": embed, "lm_head.weight": lm_head})
  hf = json.loads(config.to_json_string())
  assert "vocab_size" not in hf and hf["text_config"]["mtp_num_hidden_layers"] == 1
  (tmp_path / "config.json").write_text(json.dumps(hf))

  proposer = load_mtp(tmp_path, dtype="float32", max_depth=QN_DEPTHS)
  cfg = proposer.cfg
  assert (cfg.qk_norm, cfg.attention_gate, cfg.norm_unit_offset, cfg.partial_rotary_factor) == (True, True, True, 0.25)
  assert cfg.moe is None and cfg.num_modules == 1
  with pytest.raises(NotImplementedError, match="'qwen3_5' has no target.*hybrid linear-attention"):
    mtp_jax.load_target(tmp_path)
  n = 9
  toks = rng.integers(0, V, (1, n + QN_DEPTHS))
  hidden = rng.standard_normal((1, n, D)).astype(np.float32)
  _check_chain_and_drafts(proposer, cfg, ref, hidden, toks, embed, lm_head, QN_DEPTHS)


LC_DEPTHS = 2


class LongcatRefMtp(torch.nn.Module):
  """LongCat-Flash's MTP as vLLM model_executor/models/longcat_flash_mtp.py
  (LongCatMultiTokenPredictorLayer.forward) runs it: eh_proj(concat(enorm(e), hnorm(h))) (embedding
  first, no position-0 mask), one pre-norm decoder layer (its DeepseekV2DecoderLayer with the MoE
  cleared: MLA, then a dense SiLU MLP), then the shared final norm (released model.mtp.norm), handed
  on and scored by the main lm_head; layers[spec_step_idx % num_mtp_layers]. The attention is
  transformers' LongcatFlashMLA (q and the normed latent scaled by sqrt(hidden / rank); vLLM and
  SGLang's longcat_flash_nextn.py fold the same factors into q_a_layernorm / kv_a_layernorm)."""

  def __init__(self, config):
    super().__init__()
    norm = lambda: longcat.LongcatFlashRMSNorm(D, eps=config.rms_norm_eps)
    self.enorm, self.hnorm, self.norm = norm(), norm(), norm()
    self.eh_proj = torch.nn.Linear(2 * D, D, bias=False)
    self.input_layernorm, self.post_attention_layernorm = norm(), norm()
    self.self_attn = longcat.LongcatFlashMLA(config, 0)
    self.mlp = longcat.LongcatFlashMLP(config, config.ffn_hidden_size)
    self.rotary = longcat.LongcatFlashRotaryEmbedding(config)

  def released(self):
    """name -> tensor under the released model.mtp.* names (vLLM load_weights' mapping)."""
    out = {}
    for n, p in self.named_parameters():
      p = p.detach().numpy()
      if n.startswith(("enorm.", "hnorm.")):
        out[f"model.mtp.layers.0.{n.split('.')[0]}.m.weight"] = p
      elif n == "norm.weight":
        out["model.mtp.norm.weight"] = p
      elif n.startswith("mlp."):
        out[f"model.mtp.layers.0.transformer_layer.{n}"] = p
      else:
        out[f"model.mtp.layers.0.{n}"] = p
    return out

  def forward(self, emb, h, positions):
    """emb, h: float32[1, T, D]; positions: int[1, T]; returns the normed hidden float32[1, T, D]."""
    x = self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(h)], -1))
    t = x.shape[1]
    mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
    x = x + self.self_attn(self.input_layernorm(x), self.rotary(x, positions), mask)[0]
    x = x + self.mlp(self.post_attention_layernorm(x))
    return self.norm(x)


def test_longcat_mtp_equals_engine_reference(tmp_path):
  """MTP only (mtp_jax builds no LongCat-Flash target): the caller hands in the target's hidden.
  The config keeps its routed experts: the MTP module is dense whatever they say."""
  config = LongcatFlashConfig(vocab_size=V, hidden_size=D, num_layers=1, num_attention_heads=4,
                              ffn_hidden_size=48, q_lora_rank=8, kv_lora_rank=16, qk_nope_head_dim=8,
                              qk_rope_head_dim=8, head_dim=8, v_head_dim=12, n_routed_experts=4,
                              expert_ffn_hidden_size=16, zero_expert_num=2, moe_topk=2, rms_norm_eps=1e-5,
                              max_position_embeddings=256, tie_word_embeddings=False,
                              rope_parameters={"rope_type": "default", "rope_theta": 500.0})
  config._attn_implementation = "eager"
  ref = LongcatRefMtp(config).eval()
  _init_all(ref, 4)
  rng = np.random.default_rng(5)
  embed = rng.standard_normal((V, D)).astype(np.float32)
  lm_head = (rng.standard_normal((V, D)) / D ** 0.5).astype(np.float32)
  save_tensors(tmp_path / "model.safetensors", ref.released() | {"model.embed_tokens.weight": embed,
                                                                  "lm_head.weight": lm_head})
  (tmp_path / "config.json").write_text(config.to_json_string())

  proposer = load_mtp(tmp_path, dtype="float32", max_depth=LC_DEPTHS)
  cfg = proposer.cfg
  assert cfg.moe is None and cfg.num_modules == 1 and cfg.rope_interleave
  assert (cfg.mla.q_lora_scale, cfg.mla.kv_lora_scale) == ((D / 8) ** 0.5, (D / 16) ** 0.5)
  assert {k: getattr(cfg, k) for k in layouts.conventions("longcat_flash")} == layouts.conventions("longcat_flash")

  n = 10
  toks = rng.integers(0, V, (1, n + LC_DEPTHS))
  hidden = rng.standard_normal((1, n, D)).astype(np.float32)

  # Drafts go through the latent cache (absorbed form, scaled latent stored): the reference's greedy chain.
  _check_chain_and_drafts(proposer, cfg, ref, hidden, toks, embed, lm_head, LC_DEPTHS)


MV2_DEPTHS, MV2_WINDOW = 2, 3  # sliding_window_size: each query sees itself and 3 rows before


class MiMoV2RefMtp(torch.nn.Module):
  """MiMo-V2-Flash's MTP module as SGLang srt/models/mimo_v2_nextn.py (MiMoV2ModelNextN.forward,
  MiMoV2MTPLayer) and vLLM model_executor/models/mimo_v2_mtp.py (MiMoV2MTPLayer.forward) wire it:
  eh_proj(concat(enorm(e), hnorm(h))) (embedding first, no position-0 mask), input_layernorm, the
  sliding-window attention built from the swa_* keys, pre_mlp_layernorm, a dense SiLU MLP, then
  final_layernorm(h), handed on and scored by the main lm_head. The attention is transformers'
  MiMoV2FlashAttention as a sliding layer (kv heads doubled there, as swa_num_key_value_heads is;
  v_head_dim values scaled by attention_value_scale; sinks), its window sliding_window_size + 1
  rows (SGLang's flash-attention window (W, 0)); transformers' masking rule, key > query - window."""

  def __init__(self, config):
    super().__init__()
    norm = lambda: mimo_v2.MiMoV2FlashRMSNorm(D, eps=config.rms_norm_eps)
    self.enorm, self.hnorm, self.final_layernorm = norm(), norm(), norm()
    self.eh_proj = torch.nn.Linear(2 * D, D, bias=False)
    self.input_layernorm, self.pre_mlp_layernorm = norm(), norm()
    self.self_attn = mimo_v2.MiMoV2FlashAttention(config, 1)
    self.mlp = mimo_v2.MiMoV2FlashMLP(config)
    rotary = mimo_v2.MiMoV2FlashRotaryEmbedding(config)
    self.rotary = lambda x, p: rotary(x, p, "sliding_attention")

  def released(self):
    """name -> tensor under the released model.mtp.layers.0.* names (sinks as attention_sink_bias)."""
    return {f"model.mtp.layers.0.{n.replace('self_attn.sinks', 'self_attn.attention_sink_bias')}":
            p.detach().numpy() for n, p in self.named_parameters()}

  def forward(self, emb, h, positions):
    """emb, h: float32[1, T, D]; positions: int[1, T]; returns the normed hidden float32[1, T, D]."""
    x = self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(h)], -1))
    t, window = x.shape[1], self.self_attn.sliding_window
    q, k = torch.arange(t)[:, None], torch.arange(t)[None, :]
    mask = torch.where((k <= q) & (k > q - window), 0.0, float("-inf"))[None, None]
    x = x + self.self_attn(self.input_layernorm(x), self.rotary(x, positions), mask)[0]
    x = x + self.mlp(self.pre_mlp_layernorm(x))
    return self.final_layernorm(x)


def _mimo_v2_flash_dir(path, value_scale=0.707):
  """A tiny MiMo-V2-Flash directory as released (config.json keys as the engines read them, MTP
  tensors at model.mtp.layers.0.*); returns (reference module, embed, lm_head)."""
  hf = dict(model_type="mimo_v2_flash", architectures=["MiMoV2FlashForCausalLM"], vocab_size=V, hidden_size=D,
            intermediate_size=48, num_hidden_layers=2, hybrid_layer_pattern=[0, 1], num_attention_heads=4,
            num_key_value_heads=1, head_dim=16, v_head_dim=8, swa_num_attention_heads=4, swa_num_key_value_heads=2,
            swa_head_dim=12, swa_v_head_dim=8, rope_theta=5e6, swa_rope_theta=500.0, partial_rotary_factor=0.334,
            sliding_window_size=MV2_WINDOW, add_swa_attention_sink_bias=True, add_full_attention_sink_bias=False,
            attention_value_scale=value_scale, layernorm_epsilon=1e-5, hidden_act="silu", attention_bias=False,
            n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, num_nextn_predict_layers=1,
            max_position_embeddings=256, tie_word_embeddings=False)
  # transformers' config for the sliding layer: num_key_value_heads doubled there, rope per layer type.
  config = mimo_v2.MiMoV2FlashConfig(
      vocab_size=V, hidden_size=D, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
      num_key_value_heads=1, head_dim=12, v_head_dim=8, layer_types=["full_attention", "sliding_attention"],
      sliding_window_size=MV2_WINDOW, attention_value_scale=value_scale, rms_norm_eps=1e-5,
      rope_parameters={t: {"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.334}
                       for t in ("full_attention", "sliding_attention")})
  config._attn_implementation = "eager"
  assert config.sliding_window == MV2_WINDOW + 1
  ref = MiMoV2RefMtp(config).eval()
  _init_all(ref, 6)
  rng = np.random.default_rng(7)
  embed = rng.standard_normal((V, D)).astype(np.float32)
  lm_head = (rng.standard_normal((V, D)) / D ** 0.5).astype(np.float32)
  save_tensors(path / "model.safetensors", ref.released() | {"model.embed_tokens.weight": embed,
                                                             "lm_head.weight": lm_head})
  (path / "config.json").write_text(json.dumps(hf))
  return ref, embed, lm_head


def test_mimo_v2_flash_mtp_equals_engine_reference(tmp_path):
  """MTP only (mtp_jax builds no MiMo-V2-Flash target): q / k heads of 12, v heads of 8, values
  scaled by 0.707, a window of sliding_window_size + 1 rows with sinks; the config's routed experts
  leave the MTP block dense. The chain runs past the window (10 rows > 4), so the window counts."""
  ref, embed, lm_head = _mimo_v2_flash_dir(tmp_path)
  proposer = load_mtp(tmp_path, dtype="float32", max_depth=MV2_DEPTHS)
  cfg = proposer.cfg
  assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.value_dim) == (4, 2, 12, 8)
  assert (cfg.attention_value_scale, cfg.sliding_window, cfg.attention_sinks) == (0.707, MV2_WINDOW + 1, True)
  assert (cfg.rope_theta, cfg.rotary_dim, cfg.rms_norm_eps, cfg.moe) == (500.0, 4, 1e-5, None)
  assert {k: getattr(cfg, k) for k in layouts.conventions("mimo_v2_flash")} == layouts.conventions("mimo_v2_flash")
  with pytest.raises(NotImplementedError, match="'mimo_v2_flash' has no target.*sliding-window"):
    mtp_jax.load_target(tmp_path)
  rng = np.random.default_rng(8)
  n = 10
  toks = rng.integers(0, V, (1, n + MV2_DEPTHS))
  hidden = rng.standard_normal((1, n, D)).astype(np.float32)
  _check_chain_and_drafts(proposer, cfg, ref, hidden, toks, embed, lm_head, MV2_DEPTHS)


def test_mimo_v2_flash_value_scale_is_applied(tmp_path):
  """The same directory read without attention_value_scale gives other logits (by far more than the
  reference test's tolerance), so a dropped scale cannot pass test_mimo_v2_flash_mtp_equals_engine_reference."""
  _mimo_v2_flash_dir(tmp_path)
  hidden = np.random.default_rng(9).standard_normal((1, 6, D)).astype(np.float32)
  toks = jnp.asarray(np.random.default_rng(9).integers(0, V, (1, 6)), jnp.int32)
  scaled = load_mtp(tmp_path, dtype="float32")
  hf = json.loads((tmp_path / "config.json").read_text())
  (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in hf.items() if k != "attention_value_scale"}))
  plain = load_mtp(tmp_path, dtype="float32")
  assert plain.cfg.attention_value_scale is None
  got = [np.asarray(mtp_jax.forward_chain(m, jnp.asarray(hidden), toks)) for m in (scaled, plain)]
  assert np.max(np.abs(got[0] - got[1])) > 1e-2


def _check_chain_and_drafts(proposer, cfg, ref, hidden, toks, embed, lm_head, depths):
  """The chain's logits over every row equal a cache-free torch reference (ref(emb, h, positions)
  -> h); propose's greedy drafts from the cache equal the reference's greedy chain."""
  n = hidden.shape[1]

  def chain(toks):  # float32[depths, n, V]
    with torch.no_grad():
      h, out = torch.from_numpy(hidden), []
      for m in range(1, depths + 1):
        h = ref(torch.from_numpy(embed[toks[:, m:m + n]]), h, torch.arange(n)[None] + m - 1)
        out.append(h[0].numpy() @ lm_head.T)
    return np.stack(out)

  want = chain(toks)
  assert np.isfinite(want).all()
  got = mtp_jax.forward_chain(proposer, jnp.asarray(hidden), jnp.asarray(toks[:, 1:], jnp.int32))
  np.testing.assert_allclose(np.asarray(got[:, 0]), want, rtol=1e-4, atol=1e-4)
  ref_drafts = [int(np.argmax(want[0, -1]))]
  ext = toks.copy()
  ext[0, n + 1] = ref_drafts[0]
  ref_drafts.append(int(np.argmax(chain(ext)[1, -1])))
  drafts, _ = mtp_jax.propose(proposer, mtp_jax.init_state(cfg, 1, 32), hidden, toks[:, 1:n + 1],
                              np.array([n], np.int32), num_drafts=depths)
  assert np.asarray(drafts)[0].tolist() == ref_drafts


def test_registry_records_are_consistent_and_documented():
  """Every family's layout is registered, each layout's signature tensor picks that layout alone,
  model types belong to one family, and docs/checkpoints.md holds the current table."""
  from mtp_jax import families
  assert list(layouts.LAYOUTS) == list(families.LAYOUTS) and layouts.LAYOUTS[0] == "canonical"
  seen = {}
  for family in families.FAMILIES.values():
    assert family.layout is None or family.layout in families.LAYOUTS, family.name
    assert set(family.target) <= set(family.model_types), family.name
    assert family.target == family.model_types or family.target_refusal, family.name
    for t in family.model_types:
      assert seen.setdefault(t, family.name) == family.name, t
      assert layouts.family_of({"model_type": t}) == family.name
  examples = {name: re.sub(r"[\\()]", "", layout.signature.replace(r"\d+", "3"))
              for name, layout in families.LAYOUTS.items()}
  for name, tensor in examples.items():
    assert layouts.detect_layout([tensor, "model.norm.weight"]) == name
  with pytest.raises(ValueError, match=r"matches \['deepseek', 'mimo'\]"):
    layouts.detect_layout([examples["deepseek"], examples["mimo"]])
  with pytest.raises(ValueError, match="unknown family 'gpt2'"):
    families.get("gpt2")
  doc = (pathlib.Path(__file__).parent.parent / "docs" / "checkpoints.md").read_text()
  assert families.table() in doc


def test_target_refusals_name_the_family_and_reason():
  from mtp_jax import pretrained
  for model_type, why in [("qwen3_5", "hybrid linear-attention"), ("qwen3_next", "hybrid linear-attention"),
                          ("longcat_flash", "LongCat-Flash's target"), ("ernie4_5_moe", "MoE target"),
                          ("gpt2", "")]:
    with pytest.raises(NotImplementedError, match=f"model_type '{model_type}' has no target.*{why}"):
      pretrained.target_config_from_hf({"model_type": model_type})
