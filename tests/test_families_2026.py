"""Families of issue 37 (the MTP releases of 2026): each loads from a tiny directory in its released
layout, written here, and its MTP chain equals a reference wired as the serving engines wire it.

- ExaONE-MoE: vLLM 0.34 model_executor/models/exaone_moe_mtp.py (ExaoneMoeMultiTokenPredictor.forward)
  and exaone_moe.py (ExaoneMoeDecoderLayer / ExaoneMoeAttention with is_mtp), SGLang 0.5.23
  srt/models/exaone_moe_mtp.py; the layer from transformers 5.25's ExaoneMoe modules (see ExaoneRefMtp).
- Nemotron-H: vLLM 0.34 model_executor/models/nemotron_h_mtp.py and SGLang 0.5.23
  srt/models/nemotron_h_mtp.py; the mixers from transformers 5.25's NemotronH modules (see NemotronRefMtp).
- Families refused by name (Gemma 4 assistants): each loader names the model_type and the reason.
  Bailing's MTP modules load: tests/test_families_bailing.py. Step-3.5 / 3.7's MTP modules load:
  tests/test_families_step3p5.py. DeepSeek-V4's MTP modules load: tests/test_families_deepseek_v4.py.
"""

import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from transformers import ExaoneMoeConfig, NemotronHConfig
from transformers.models.exaone_moe import modeling_exaone_moe as exaone
from transformers.models.nemotron_h import modeling_nemotron_h as nemotron

import mtp_jax
from mtp_jax import layouts
from mtp_jax.blocks.moe import PATHS, Moe
from mtp_jax.checkpoint import save_tensors
from mtp_jax.pretrained import load_mtp

V, D = 48, 32


def init_all(module: torch.nn.Module, seed: int, norm_centre: float = 1.0) -> None:
  """Every parameter set here (norms around norm_centre, matrices scaled by fan-in), none left as built."""
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


def head_and_embed(seed: int) -> tuple[np.ndarray, np.ndarray]:
  """float32[V, D] embedding and LM head of the target the MTP modules share."""
  rng = np.random.default_rng(seed)
  return (rng.standard_normal((V, D)).astype(np.float32),
          (rng.standard_normal((V, D)) / D ** 0.5).astype(np.float32))


def check_chain_and_drafts(proposer, modules, hidden, toks, embed, lm_head, depths):
  """forward_chain's logits over every row equal the cache-free torch chain (depth m runs
  modules[(m - 1) % len(modules)], module(emb, h, positions) -> the hidden handed on and scored);
  propose's greedy drafts through the caches equal the reference's greedy chain."""
  n = hidden.shape[1]

  def chain(toks):  # float32[depths, n, V]
    with torch.no_grad():
      h, out = torch.from_numpy(hidden), []
      for m in range(1, depths + 1):
        h = modules[(m - 1) % len(modules)](torch.from_numpy(embed[toks[:, m:m + n]]), h, torch.arange(n)[None] + m - 1)
        out.append(h[0].numpy() @ lm_head.T)
    return np.stack(out)

  want = chain(toks)
  assert np.isfinite(want).all()
  got = mtp_jax.forward_chain(proposer, jnp.asarray(hidden), jnp.asarray(toks[:, 1:], jnp.int32))
  np.testing.assert_allclose(np.asarray(got[:, 0]), want, rtol=1e-4, atol=1e-4)
  ref_drafts, ext = [], toks.copy()
  for m in range(depths):
    ref_drafts.append(int(np.argmax(chain(ext)[m, -1])))
    if n + m + 1 < ext.shape[1]:
      ext[0, n + m + 1] = ref_drafts[-1]
  drafts, _ = mtp_jax.propose(proposer, mtp_jax.init_state(proposer.cfg, 1, 32), hidden, toks[:, 1:n + 1],
                              np.array([n], np.int32), num_drafts=depths)
  assert np.asarray(drafts)[0].tolist() == ref_drafts


# ExaONE-MoE ----------------------------------------------------------------------------------------

EX_WINDOW, EX_MODULES, EX_DEPTHS = 3, 2, 3  # depth 3 runs module 0 again (vLLM spec_step_idx % 2)


class ExaoneRefShared(torch.nn.Module):
  """The fc and norms every ExaONE-MoE MTP layer shares, released once as mtp.{fc, pre_fc_norm_*, norm}."""

  def __init__(self, config):
    super().__init__()
    norm = lambda: exaone.ExaoneMoeRMSNorm(D, eps=config.rms_norm_eps)
    self.pre_fc_norm_embedding, self.pre_fc_norm_hidden, self.norm = norm(), norm(), norm()
    self.fc = torch.nn.Linear(2 * D, D, bias=False)


class ExaoneRefMtp(torch.nn.Module):
  """ExaONE-MoE's MTP layer i as vLLM's exaone_moe_mtp.py wires it: fc(concat(pre_fc_norm_embedding(e),
  pre_fc_norm_hidden(h))) (embedding first, no position-0 mask), a pre-norm layer, then the shared
  mtp.norm, handed on and scored by the main lm_head. The layer is transformers' ExaoneMoeAttention
  as a sliding layer (q / k RMSNorms, RoPE: vLLM applies it in every MTP layer) over a window of
  sliding_window rows, and ExaoneMoeMLP of intermediate_size (vLLM's is_mtp layers are dense)."""

  def __init__(self, config, shared: ExaoneRefShared):
    super().__init__()
    self.shared = (shared,)  # a tuple: torch does not register it, each layer's params stay its own
    norm = lambda: exaone.ExaoneMoeRMSNorm(D, eps=config.rms_norm_eps)
    self.input_layernorm, self.post_attention_layernorm = norm(), norm()
    self.self_attn = exaone.ExaoneMoeAttention(config, 0)
    assert self.self_attn.is_sliding
    self.mlp = exaone.ExaoneMoeMLP(config)
    self.rotary = exaone.ExaoneMoeRotaryEmbedding(config)

  def released(self, i):
    """name -> tensor as released: the shared set at mtp.*, this layer at mtp.layers.{i}.*."""
    return ({f"mtp.{n}": p.detach().numpy() for n, p in self.shared[0].named_parameters()} |
            {f"mtp.layers.{i}.{n}": p.detach().numpy() for n, p in self.named_parameters()})

  def forward(self, emb, h, positions):
    """emb, h: float32[1, T, D]; positions: int[1, T]; returns the normed hidden float32[1, T, D]."""
    s = self.shared[0]
    x = s.fc(torch.cat([s.pre_fc_norm_embedding(emb), s.pre_fc_norm_hidden(h)], -1))
    t = x.shape[1]
    q, k = torch.arange(t)[:, None], torch.arange(t)[None, :]
    mask = torch.where((k <= q) & (k > q - EX_WINDOW), 0.0, float("-inf"))[None, None]
    x = x + self.self_attn(self.input_layernorm(x), self.rotary(x, positions), mask)[0]
    x = x + self.mlp(self.post_attention_layernorm(x))
    return s.norm(x)


def exaone_modules(config, count: int, seed: int) -> list[ExaoneRefMtp]:
  """count reference layers over one shared set, every parameter set."""
  shared = ExaoneRefShared(config).eval()
  init_all(shared, seed)
  modules = [ExaoneRefMtp(config, shared).eval() for _ in range(count)]
  for i, module in enumerate(modules):
    init_all(module, seed + 1 + i)
  return modules


def exaone_config(**extra) -> ExaoneMoeConfig:
  """A tiny ExaONE-MoE config (MoE target layers, layer 0 dense, windows on layers 0..2)."""
  config = ExaoneMoeConfig(vocab_size=V, hidden_size=D, intermediate_size=48, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=EX_WINDOW,
                           sliding_window_pattern=4, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                           rms_norm_eps=1e-5, max_position_embeddings=256, tie_word_embeddings=False, eos_token_id=2,
                           rope_parameters={"rope_type": "default", "rope_theta": 500.0}, **extra)
  config._attn_implementation = "eager"
  return config


def test_exaone_moe_mtp_equals_engine_reference(tmp_path):
  """MTP only (the target is refused by name): two released modules sharing fc / norms, chained by
  mtp_jax module after module (depth 3 reuses module 0); 10 rows over a window of 3, so the window counts."""
  config = exaone_config()
  modules = exaone_modules(config, EX_MODULES, 10)
  embed, lm_head = head_and_embed(11)
  tensors = modules[0].released(0) | modules[1].released(1) | {
      "model.embed_tokens.weight": embed, "lm_head.weight": lm_head, "model.norm.weight": np.ones(D, np.float32)}
  save_tensors(tmp_path / "model.safetensors", tensors)
  hf = json.loads(config.to_json_string()) | {"num_nextn_predict_layers": EX_MODULES}
  (tmp_path / "config.json").write_text(json.dumps(hf))

  with pytest.raises(NotImplementedError, match="'exaone_moe' has no target.*NoPE global layers"):
    mtp_jax.load_target(tmp_path)
  proposer = load_mtp(tmp_path, dtype="float32", max_depth=EX_DEPTHS)
  cfg = proposer.cfg
  assert (cfg.num_modules, cfg.moe, cfg.qk_norm, cfg.norm_unit_offset) == (EX_MODULES, None, True, False)
  assert (cfg.sliding_window, cfg.rope_theta, cfg.intermediate_size) == (EX_WINDOW, 500.0, 48)
  assert {k: getattr(cfg, k) for k in layouts.conventions("exaone_moe")} == layouts.conventions("exaone_moe")
  rng = np.random.default_rng(12)
  n = 10
  toks = rng.integers(0, V, (1, n + EX_DEPTHS))
  hidden = rng.standard_normal((1, n, D)).astype(np.float32)
  check_chain_and_drafts(proposer, modules, hidden, toks, embed, lm_head, EX_DEPTHS)


def test_exaone_moe_norms_are_read_as_stored(tmp_path):
  """The names are Qwen3-Next's, whose layout shifts zero-centred norms by 1 for configs without
  (1 + w) norms; ExaONE-MoE stores plain weights, read as they are."""
  config = exaone_config(num_nextn_predict_layers=1)
  module, = exaone_modules(config, 1, 13)
  embed, lm_head = head_and_embed(14)
  raw = module.released(0) | {"model.embed_tokens.weight": embed, "lm_head.weight": lm_head}
  assert layouts.detect_layout(raw) == "qwen3_next"
  cfg = layouts.config_from_hf(json.loads(config.to_json_string()))
  ours = layouts.to_canonical(raw, "qwen3_next", cfg, family="exaone_moe")
  qwen = layouts.to_canonical(raw, "qwen3_next", cfg)
  for name, stored in (("mtp.0.enorm.weight", "mtp.pre_fc_norm_embedding.weight"),
                       ("mtp.0.self_attn.q_norm.weight", "mtp.layers.0.self_attn.q_norm.weight")):
    np.testing.assert_array_equal(ours[name], raw[stored])
    np.testing.assert_array_equal(qwen[name], raw[stored] + 1)


@pytest.mark.parametrize("extra, window", [({}, EX_WINDOW), ({"sliding_windows": [5, 5, 5, 5]}, 5),
                                           ({"mtp_layer_types": ["full_attention"]}, None),
                                           ({"sliding_window": None}, None)])
def test_exaone_moe_mtp_window_from_config(extra, window):
  hf = json.loads(exaone_config().to_json_string()) | extra
  assert layouts.config_from_hf(hf).sliding_window == window


def test_exaone_moe_refusals():
  hf = json.loads(exaone_config().to_json_string())
  with pytest.raises(ValueError, match=r"swiglu_limits\[0\] = 7.0 clamps"):
    layouts.config_from_hf(hf | {"swiglu_limits": [7.0, 0.0, 0.0, 0.0]})
  assert layouts.config_from_hf(hf | {"swiglu_limits": [0.0, 7.0, 0.0, 0.0]}).sliding_window == EX_WINDOW
  with pytest.raises(ValueError, match="different windows"):
    layouts.config_from_hf(hf | {"num_nextn_predict_layers": 2, "mtp_layer_types": ["sliding_attention",
                                                                                    "full_attention"]})


# Families refused by name ----------------------------------------------------------------------------

REFUSED = [("gemma4_assistant", True, "KV cache", "holds no target"),
           ("gemma4_unified_assistant", True, "KV cache", "holds no target")]


@pytest.mark.parametrize("model_type, nested, mtp_why, target_why", REFUSED)
def test_refused_families_name_the_model_type_and_reason(tmp_path, model_type, nested, mtp_why, target_why):
  """load_mtp / read_mtp_checkpoint / config_from_hf and load_target refuse these directories by
  model_type with the reason, before reading a tensor (the fields under text_config where the
  release nests them)."""
  fields = dict(vocab_size=V, hidden_size=D, num_attention_heads=4, num_hidden_layers=2, num_nextn_predict_layers=1)
  hf = {"model_type": model_type, "text_config": fields} if nested else {"model_type": model_type, **fields}
  (tmp_path / "config.json").write_text(json.dumps(hf))
  save_tensors(tmp_path / "model.safetensors", {"model.embed_tokens.weight": np.zeros((V, D), np.float32)})
  mtp_error = f"'{model_type}' has no MTP modules mtp_jax can load: .*{mtp_why}"
  with pytest.raises(NotImplementedError, match=mtp_error):
    load_mtp(tmp_path)
  with pytest.raises(NotImplementedError, match=mtp_error):
    layouts.read_mtp_checkpoint(tmp_path)
  with pytest.raises(NotImplementedError, match=mtp_error):
    layouts.config_from_hf(hf)
  with pytest.raises(NotImplementedError, match=f"'{model_type}' has no target.*{target_why}"):
    mtp_jax.load_target(tmp_path)


# Nemotron-H ------------------------------------------------------------------------------------------

NH_DEPTHS = 2  # depth 2 reuses the one released step


class NemotronRefMtp(torch.nn.Module):
  """Nemotron-H's MTP step as vLLM's nemotron_h_mtp.py wires it (NemotronHMTPAttentionDecoderLayer, then
  NemotronHMTPMoEDecoderLayer): eh_proj(concat(enorm(e), hnorm(h))) (embedding first, no position-0
  mask), norm -> attention -> residual, norm -> MoE -> residual, final_layernorm, handed on and scored
  by the target's lm_head. The mixers are transformers' NemotronHAttention (no rotary embedding) and
  NemotronHMoE (sigmoid routing with the correction bias and groups, squared-ReLU experts between the
  latent projections, a squared-ReLU shared expert); every norm NemotronHRMSNorm."""

  def __init__(self, config):
    super().__init__()
    norm = lambda: nemotron.NemotronHRMSNorm(D, eps=config.layer_norm_epsilon)
    self.enorm, self.hnorm, self.attn_norm, self.moe_norm, self.final_layernorm = (norm() for _ in range(5))
    self.eh_proj = torch.nn.Linear(2 * D, D, bias=False)
    self.attn = nemotron.NemotronHAttention(config, 1)
    self.moe = nemotron.NemotronHMoE(config)

  def released(self):
    """name -> tensor as released: the attention layer at mtp.layers.0, the MoE layer at mtp.layers.1
    (experts one tensor each, torch [out, in])."""
    names = {"enorm": "mtp.layers.0.enorm", "hnorm": "mtp.layers.0.hnorm", "eh_proj": "mtp.layers.0.eh_proj",
             "attn_norm": "mtp.layers.0.norm", "attn": "mtp.layers.0.mixer", "moe_norm": "mtp.layers.1.norm",
             "moe": "mtp.layers.1.mixer", "final_layernorm": "mtp.layers.1.final_layernorm"}
    out = {}
    for n, p in list(self.named_parameters()) + list(self.named_buffers()):
      head, rest = n.split(".", 1)
      p = p.detach().numpy()
      if rest in ("experts.up_proj", "experts.down_proj"):
        for e, w in enumerate(p):
          out[f"{names[head]}.experts.{e}.{rest.split('.')[1]}.weight"] = w
      else:
        out[f"{names[head]}.{rest}"] = p
    return out

  def forward(self, emb, h, positions):
    """emb, h: float32[1, T, D]; positions: int[1, T] (unused: NoPE); returns the normed hidden."""
    x = self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(h)], -1))
    t = x.shape[1]
    mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
    x = x + self.attn(self.attn_norm(x), attention_mask=mask)[0]
    x = x + self.moe(self.moe_norm(x))
    return self.final_layernorm(x)


def nemotron_dir(path, latent: int | None = 16):
  """A tiny Nemotron-H directory as released (MTP at mtp.layers.{0,1}, the embedding at
  backbone.embeddings); returns (reference step, embed, lm_head)."""
  config = NemotronHConfig(vocab_size=V, hidden_size=D, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                           n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                           moe_shared_expert_intermediate_size=24, n_shared_experts=1, moe_latent_size=latent,
                           n_group=2, topk_group=1, routed_scaling_factor=2.0, num_nextn_predict_layers=1,
                           layers_block_type=["mamba", "attention", "moe"], mamba_num_heads=4, mamba_head_dim=8,
                           ssm_state_size=8, n_groups=1, eos_token_id=2, pad_token_id=0, bos_token_id=1)
  config._attn_implementation = "eager"
  ref = NemotronRefMtp(config).eval()
  init_all(ref, 20)
  with torch.no_grad():  # a buffer transformers leaves at zero: set, so the choice differs from the weights
    ref.moe.gate.e_score_correction_bias.copy_(0.3 * torch.randn(8, generator=torch.Generator().manual_seed(21)))
  embed, lm_head = head_and_embed(22)
  save_tensors(path / "model.safetensors", ref.released() | {
      "backbone.embeddings.weight": embed, "lm_head.weight": lm_head, "backbone.norm_f.weight": np.ones(D, np.float32)})
  hf = json.loads(config.to_json_string()) | {"mtp_hybrid_override_pattern": "*E"}  # as vLLM reads released configs
  (path / "config.json").write_text(json.dumps(hf))
  return ref, embed, lm_head


@pytest.mark.parametrize("latent", [16, None])
def test_nemotron_h_mtp_equals_engine_reference(tmp_path, latent):
  """MTP only (the hybrid Mamba target is refused by name): the caller hands in the target's hidden."""
  ref, embed, lm_head = nemotron_dir(tmp_path, latent)
  with pytest.raises(NotImplementedError, match="'nemotron_h' has no target.*Mamba-2"):
    mtp_jax.load_target(tmp_path)
  proposer = load_mtp(tmp_path, dtype="float32", max_depth=NH_DEPTHS)
  cfg = proposer.cfg
  assert (cfg.use_rope, cfg.num_modules, cfg.rms_norm_eps) == (False, 1, 1e-5)
  assert (cfg.moe.expert_activation, cfg.moe.latent_size, cfg.moe.shared_width, cfg.moe.n_group) == ("relu2", latent,
                                                                                                       24, 2)
  assert {k: getattr(cfg, k) for k in layouts.conventions("nemotron_h")} == layouts.conventions("nemotron_h")
  rng = np.random.default_rng(23)
  n = 9
  toks = rng.integers(0, V, (1, n + NH_DEPTHS))
  hidden = rng.standard_normal((1, n, D)).astype(np.float32)
  check_chain_and_drafts(proposer, [ref], hidden, toks, embed, lm_head, NH_DEPTHS)


def test_nemotron_h_refusals():
  hf = {"model_type": "nemotron_h", "vocab_size": V, "hidden_size": D, "num_attention_heads": 4, "head_dim": 8,
        "intermediate_size": 48,
        "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8,
        "moe_shared_expert_intermediate_size": 8, "num_nextn_predict_layers": 1}
  assert layouts.config_from_hf(hf).moe.expert_activation == "relu2"
  for extra, match in [({"mtp_hybrid_override_pattern": "*E*E"}, "pattern '\\*E\\*E'"),
                       ({"mlp_hidden_act": "silu"}, "mlp_hidden_act 'silu'"), ({"mlp_bias": True}, "mlp_bias")]:
    with pytest.raises(ValueError, match=match):
      layouts.config_from_hf(hf | extra)


@pytest.mark.parametrize("latent", [12, None])
def test_relu2_experts_agree_on_every_path(latent):
  """Nemotron-H's non-gated squared-ReLU experts (and latent projections) give the same output on the
  gather, grouped and dense paths, and hold no gate_proj."""
  moe = mtp_jax.config.MoeConfig(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, scoring="sigmoid",
                                 e_score_correction_bias=True, n_shared_experts=1, expert_activation="relu2",
                                 latent_size=latent)
  cfg = mtp_jax.config.BlockConfig(hidden_size=D, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=48,
                                   moe=moe)
  block = Moe(cfg, rngs=nnx.Rngs(0))
  assert block.experts.gate_proj is None and block.shared_experts.gate_proj is None
  x = jnp.asarray(np.random.default_rng(24).standard_normal((2, 5, D)), jnp.float32)
  outs = [np.asarray(block(x, path)) for path in PATHS]
  for out in outs[1:]:
    np.testing.assert_allclose(out, outs[0], rtol=1e-5, atol=1e-5)
