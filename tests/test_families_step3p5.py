"""Step-3.5 / Step-3.7 (issue 37): the MTP modules load from a tiny directory in the released layout,
written here, and their chain equals a reference wired as vLLM 0.34 wires it
(model_executor/models/step3p5_mtp.py: Step3p5AMultiTokenPredictorLayer.forward and
Step3p5AMultiTokenPredictor.compute_logits; SGLang 0.5.23 srt/models/step3p5_mtp.py agrees), whose decoder
layer, norms and RoPE are transformers 5.25's models/step3p7 modules (Step3p7DecoderLayer with its
per-head g_proj gate and clipped SwiGLU, Step3p7RMSNorm, Step3p7RotaryEmbedding). The target is refused
by name; the caller hands in its hidden.
"""

import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers.models.step3p7 import modeling_step3p7 as step
from transformers.models.step3p7.configuration_step3p7 import Step3p7TextConfig

import mtp_jax
from mtp_jax import layouts
from mtp_jax.checkpoint import save_tensors
from mtp_jax.pretrained import load_mtp

V, D, F, N_TARGET, K, DEPTHS, WINDOW, LIMIT = 48, 32, 40, 2, 2, 3, 3, 0.5  # depth 3 reruns module 0
EMBED = np.random.default_rng(21).standard_normal((V, D)).astype(np.float32)  # the target's, shared

# As the released config.json writes it (remote-code keys): per-layer lists padded with the K MTP
# layers (indices 2, 3), sliding MTP layers with a head count of their own, RoPE on half of each head,
# the shared SwiGLU clipped in the MTP layers, MoE only in target layer 1, LLaMA-3 scaling on full layers.
RELEASED = {
    "model_type": "step3p5", "vocab_size": V, "hidden_size": D, "intermediate_size": F,
    "num_hidden_layers": N_TARGET, "num_nextn_predict_layers": K, "num_attention_heads": 2,
    "num_attention_groups": 2, "head_dim": 8, "rms_norm_eps": 1e-5, "max_position_embeddings": 256,
    "sliding_window": WINDOW, "layer_types": ["full_attention"] + ["sliding_attention"] * 3,
    "attention_other_setting": {"attention_type": "sliding_attention", "num_attention_heads": 4,
                                "num_attention_groups": 2},
    "rope_theta": [10000.0, 500.0, 500.0, 500.0], "partial_rotary_factors": [1.0, 0.5, 0.5, 0.5],
    "yarn_only_types": ["full_attention"], "rope_scaling": {"rope_type": "llama3", "factor": 2.0},
    "use_head_wise_attn_gate": True, "swiglu_limits": [0.0] * 4, "swiglu_limits_shared": [0.0, 0.0, LIMIT, LIMIT],
    "moe_layers_enum": "1", "moe_num_experts": 4, "moe_top_k": 2, "moe_intermediate_size": 16,
    "share_expert_dim": 16, "hidden_act": "swigluoai", "tie_word_embeddings": False}


def layer_config() -> Step3p7TextConfig:
  """transformers' config of one MTP layer (as get_mtp_config builds it): sliding, 4 query heads, dense."""
  config = Step3p7TextConfig(vocab_size=V, hidden_size=D, intermediate_size=F, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=2, head_dim=8,
                             layer_types=["sliding_attention"], mlp_layer_types=["dense"], sliding_window=WINDOW,
                             num_sliding_attention_heads=4, rope_theta=500.0, partial_rotary_factors=[0.5],
                             swiglu_limits_shared=[LIMIT], rms_norm_eps=1e-5, max_position_embeddings=256)
  config._attn_implementation = "eager"
  return config


class StepRefMtp(torch.nn.Module):
  """One Step-3.5 MTP module as vLLM wires it: eh_proj(concat(enorm(e), hnorm(h))) (embedding first, no
  position-0 mask), the decoder layer over a window of WINDOW rows; forward returns the residual, which
  the next depth reads; logits() scores it with this module's shared_head: its norm, then its own head."""

  def __init__(self, config):
    super().__init__()
    norm = lambda: step.Step3p7RMSNorm(D, eps=config.rms_norm_eps)  # 1 + weight, as GemmaRMSNorm
    self.enorm, self.hnorm, self.shared_head_norm = norm(), norm(), norm()
    self.eh_proj = torch.nn.Linear(2 * D, D, bias=False)
    self.mtp_block = step.Step3p7DecoderLayer(config, 0)
    self.head = torch.nn.Linear(D, V, bias=False)
    self.rotary = step.Step3p7RotaryEmbedding(config)

  def released(self, layer: int, nested: bool, head: str) -> dict[str, np.ndarray]:
    """name -> tensor as released at model.layers.{layer}: the layer's own tensors under .transformer.
    when nested (both engines drop that segment), the head as shared_head.{head}."""
    out = {}
    for name, p in self.named_parameters():
      name = {"shared_head_norm.weight": "shared_head.norm.weight", "head.weight": f"shared_head.{head}.weight"}.get(
          name, name.replace("mtp_block.", "transformer." if nested else ""))
      out[f"model.layers.{layer}.{name}"] = p.detach().numpy()
    return out

  def forward(self, emb, h, positions):
    """emb, h: float32[1, T, D]; positions: int[1, T]; returns the residual float32[1, T, D]."""
    x = self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(h)], -1))
    t = x.shape[1]
    q, k = torch.arange(t)[:, None], torch.arange(t)[None, :]
    mask = torch.where((k <= q) & (k > q - WINDOW), 0.0, float("-inf"))[None, None]
    return self.mtp_block(x, attention_mask=mask, position_embeddings=self.rotary(x, positions, "sliding_attention"))

  def logits(self, h):
    return self.head(self.shared_head_norm(h))


def ref_modules(seed: int) -> list[StepRefMtp]:
  """K reference modules, every parameter set: norms near 0 (scales near 1), matrices by fan-in."""
  modules = [StepRefMtp(layer_config()).eval() for _ in range(K)]
  gen = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for module in modules:
      for name, p in module.named_parameters():
        noise = torch.randn(p.shape, generator=gen)
        p.copy_(0.2 * noise if p.ndim == 1 else noise / p.shape[-1] ** 0.5 * 1.5)
  return modules


def ref_logits(modules, hidden, toks, n: int) -> np.ndarray:
  """float32[DEPTHS, n, V]: the cache-free chain, depth m running modules[(m - 1) % K] on t_{j+m}."""
  with torch.no_grad():
    h, out = torch.from_numpy(hidden), []
    for m in range(1, DEPTHS + 1):
      module = modules[(m - 1) % K]
      h = module(torch.from_numpy(EMBED[toks[:, m:m + n]]), h, torch.arange(n)[None] + m - 1)
      out.append(module.logits(h)[0].numpy())
  return np.stack(out)


def write_release(path, modules) -> None:
  """The released directory: config.json, the target's embedding / head / norm / a layer (read by no MTP
  module), module 0 flat with shared_head.output, module 1 under .transformer. with shared_head.head."""
  tensors = {"model.embed_tokens.weight": EMBED, "lm_head.weight": np.zeros((V, D), np.float32),
             "model.norm.weight": np.zeros(D, np.float32),
             "model.layers.0.self_attn.q_proj.weight": np.zeros((16, D), np.float32)}
  tensors |= modules[0].released(N_TARGET, nested=False, head="output")
  tensors |= modules[1].released(N_TARGET + 1, nested=True, head="head")
  save_tensors(path / "model.safetensors", tensors)
  (path / "config.json").write_text(json.dumps(RELEASED))


def test_step3p5_mtp_equals_engine_reference(tmp_path):
  """MTP only: two released modules, each scoring with its own head and handing on its residual,
  chained by mtp_jax (depth 3 reuses module 0); 10 rows over a window of 3, so the window counts. The
  per-head gate and the clip both change the reference's logits, so both are checked."""
  modules = ref_modules(22)
  write_release(tmp_path, modules)
  with pytest.raises(NotImplementedError, match="'step3p5' has no target.*head-wise attention gates"):
    mtp_jax.load_target(tmp_path)
  proposer = load_mtp(tmp_path, dtype="float32", max_depth=DEPTHS)
  cfg = proposer.cfg
  assert (cfg.num_modules, cfg.num_heads, cfg.num_kv_heads, cfg.moe, cfg.rope_scaling) == (K, 4, 2, None, None)
  assert (cfg.sliding_window, cfg.rope_theta, cfg.partial_rotary_factor) == (WINDOW, 500.0, 0.5)
  assert cfg.swiglu_limit == LIMIT
  assert (cfg.attention_head_gate, cfg.own_lm_head, cfg.qk_norm, cfg.norm_unit_offset) == (True, True, True, True)
  assert (cfg.pass_normed_hidden, cfg.head_norm, cfg.mask_first_embedding) == (False, True, False)
  assert proposer.lm_head is None

  rng = np.random.default_rng(23)
  n = 10
  toks = rng.integers(0, V, (1, n + DEPTHS))
  hidden = rng.standard_normal((1, n, D)).astype(np.float32)
  want = ref_logits(modules, hidden, toks, n)
  got = mtp_jax.forward_chain(proposer, jnp.asarray(hidden), jnp.asarray(toks[:, 1:], jnp.int32))
  np.testing.assert_allclose(np.asarray(got[:, 0]), want, rtol=1e-4, atol=1e-4)

  for module in modules:  # without the clip the reference moves: the test exercises it
    module.mtp_block.mlp.limit = None
  assert np.abs(ref_logits(modules, hidden, toks, n) - want).max() > 1e-2
  for module in modules:
    module.mtp_block.mlp.limit = LIMIT

  ref_drafts, ext = [], toks.copy()
  for m in range(DEPTHS):
    ref_drafts.append(int(np.argmax(ref_logits(modules, hidden, ext, n)[m, -1])))
    if n + m + 1 < ext.shape[1]:
      ext[0, n + m + 1] = ref_drafts[-1]
  drafts, _ = mtp_jax.propose(proposer, mtp_jax.init_state(cfg, 1, 32), hidden, toks[:, 1:n + 1],
                              np.array([n], np.int32), num_drafts=DEPTHS)
  assert np.asarray(drafts)[0].tolist() == ref_drafts

  # mtp_jax's own layout keeps each module's head (mtp.{i}.shared_head.head) and no shared one.
  layouts.save_canonical(tmp_path / "canonical", cfg, mtp_jax.mtp.state_dict(proposer))
  cfg2, tensors = layouts.read_mtp_checkpoint(tmp_path / "canonical")
  assert cfg2 == cfg and "lm_head.weight" not in tensors
  np.testing.assert_array_equal(tensors["mtp.1.shared_head.head.weight"], modules[1].head.weight.detach().numpy())


def test_step3p7_config_reads_as_step3p5(tmp_path):
  """Step-3.7's config.json nests the same fields under text_config, in transformers' form (kv heads as
  num_key_value_heads, the MTP layers' types split off into mtp_layer_types, RoPE per layer type); its
  target is refused by name too."""
  text = {k: v for k, v in RELEASED.items() if k not in ("model_type", "num_attention_groups", "layer_types",
                                                         "rope_theta", "partial_rotary_factors", "rope_scaling",
                                                         "yarn_only_types", "attention_other_setting")}
  text |= {"model_type": "step3p5", "num_key_value_heads": 2, "num_sliding_attention_heads": 4,
           "layer_types": ["full_attention", "sliding_attention"], "mtp_layer_types": ["sliding_attention"] * 2,
           "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0},
                               "sliding_attention": {"rope_type": "default", "rope_theta": 500.0,
                                                     "partial_rotary_factor": 0.5}}}
  hf = {"model_type": "step3p7", "text_config": text}
  assert layouts.config_from_hf(hf) == layouts.config_from_hf(RELEASED)
  (tmp_path / "config.json").write_text(json.dumps(hf))
  save_tensors(tmp_path / "model.safetensors", {"model.embed_tokens.weight": EMBED})
  with pytest.raises(NotImplementedError, match="'step3p7' has no target.*head-wise attention gates"):
    mtp_jax.load_target(tmp_path)


@pytest.mark.parametrize("extra, match", [
    ({"moe_layers_enum": "1,2,3"}, "moe_layers_enum makes MTP layer 2 a MoE layer"),
    ({"mlp_layer_types": ["dense", "sparse"], "mtp_mlp_layer_types": ["dense", "sparse"]},
     "mlp_layer_types makes MTP layer 3 a MoE layer"),
    ({"swiglu_limits_shared": [0.0, 0.0, LIMIT, 7.0]}, r"swiglu_limits_shared differs between the MTP layers"),
    ({"rope_theta": [1e4, 500.0, 500.0, 1e4]}, "rope_theta differs between the MTP layers"),
    ({"layer_types": ["full_attention"] * 3 + ["sliding_attention"]}, "num_attention_heads differs"),
    ({"query_pre_attn_scalar": 16}, "query_pre_attn_scalar 16"),
    ({"attention_other_setting": {"num_attention_heads": 4, "num_attention_groups": 1}},
     "attention_other_setting.num_attention_groups 1"),
    ({"attention_bias": True}, "attention_bias is not built"),
    ({"att_impl_type": "MLA"}, "att_impl_type 'MLA'")])
def test_step3p5_refusals_name_the_key(extra, match):
  with pytest.raises(NotImplementedError, match=match):
    layouts.config_from_hf(RELEASED | extra)
