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
Depths past the released module count reuse module 0 (vLLM: spec_step_idx % num_mtp_layers).
"""

import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import Ernie4_5Config, Ernie4_5ForCausalLM, Qwen2Config, Qwen2ForCausalLM
from transformers.models.ernie4_5.modeling_ernie4_5 import Ernie4_5DecoderLayer, Ernie4_5RMSNorm
from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer, Qwen2RMSNorm

import mtp_jax
from mtp_jax import layouts
from mtp_jax.checkpoint import save_tensors

V, D, N_LAYERS, DEPTHS = 48, 32, 2, 2
COMMON = dict(vocab_size=V, hidden_size=D, intermediate_size=48, num_hidden_layers=N_LAYERS,
              num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, max_position_embeddings=256,
              rope_parameters={"rope_type": "default", "rope_theta": 500.0})


def _init_all(module, seed):
  gen = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in module.named_parameters():
      noise = torch.randn(p.shape, generator=gen)
      if name.endswith("norm.weight"):
        p.copy_(1 + 0.2 * noise)
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
