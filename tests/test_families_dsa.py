"""DeepSeek Sparse Attention families, DeepSeek-V3.2 (`deepseek_v32`) and GLM-5 (`glm_moe_dsa`), from tiny
directories in the released layout, against transformers 5.25.0:

- target: transformers/models/deepseek_v32/modeling_deepseek_v32.py (DeepseekV32ForCausalLM: MLA with
  the DeepseekV32Indexer's top-k mask) and transformers/models/glm_moe_dsa/modeling_glm_moe_dsa.py
  (GlmMoeDsaForCausalLM: the indexer's RoPE on pairs), logits and hidden; greedy speculative decoding
  (a draft tree on contiguous caches, a chain on paged ones) equals their greedy `generate`.
- the attention layer alone against DeepseekV32Attention: prefill, and ragged chunks then decode
  steps through the dense and the paged cache.
- MTP: transformers builds no MtpModel for these two, so the reference wires each module as vLLM 0.34
  (models/deepseek_v32/nvidia/mtp.py) and SGLang 0.5.23 (srt/models/deepseek_nextn.py) do:
  eh_proj(concat(enorm(e), hnorm(h))), the transformers decoder layer of the family (its own indexer,
  a MoE FFN), shared_head.norm(h) handed on and scored by the head; no position-0 mask (SGLang's, and
  mtp_jax's DeepSeek-V3 record); depths past the module count reuse module i mod K (vLLM).

Each model is two layers (dense, then MoE) with index_topk 4 below the sequence lengths, so the
indexer's choice changes the output (checked: the references differ with the indexer off).
"""

import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from block_refs import B, T, copy_into, full_rows, randomize, run_cached, torch_mask
from flax import nnx
from transformers import DeepseekV32Config, DeepseekV32ForCausalLM, GlmMoeDsaConfig, GlmMoeDsaForCausalLM
from transformers.models.deepseek_v32 import modeling_deepseek_v32 as v32
from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as glm5

import mtp_jax
from mtp_jax import layouts, validate
from mtp_jax.blocks import DsaAttention, LayerCaches, init_cache
from mtp_jax.checkpoint import save_tensors
from mtp_jax.config import DsaConfig, MlaConfig
from mtp_jax.pretrained import load_mtp
from mtp_jax.tree import TreeSpec

N_LAYERS, K, V, TOPK = 2, 2, 64, 4
COMMON = dict(vocab_size=V, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
              num_hidden_layers=N_LAYERS, num_attention_heads=4, num_key_value_heads=4, first_k_dense_replace=1,
              n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, n_group=2, topk_group=1,
              routed_scaling_factor=1.5, rms_norm_eps=1e-5, tie_word_embeddings=False, max_position_embeddings=256,
              eos_token_id=None, pad_token_id=None, bos_token_id=None, kv_lora_rank=16, q_lora_rank=24,
              qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, index_n_heads=8, index_head_dim=8,
              index_topk=TOPK)
YARN = {"rope_type": "yarn", "rope_theta": 500.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.8}
FAMILIES = {"deepseek_v32": (DeepseekV32Config, DeepseekV32ForCausalLM, v32.DeepseekV32DecoderLayer, YARN),
            "glm_moe_dsa": (GlmMoeDsaConfig, GlmMoeDsaForCausalLM, glm5.GlmMoeDsaDecoderLayer,
                            {"rope_type": "default", "rope_theta": 500.0})}


def _init_all(module, seed):
  """Every tensor drawn here (transformers leaves MoE experts uninitialised): norms near 1."""
  gen = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    biases = [(n, b) for n, b in module.named_buffers() if n.endswith("e_score_correction_bias")]
    for name, p in list(module.named_parameters()) + biases:
      noise = torch.randn(p.shape, generator=gen)
      if name.endswith("norm.weight"):
        p.copy_(1 + 0.2 * noise)
      elif p.ndim == 1:
        p.copy_(0.2 * noise)
      else:
        p.copy_(noise / p.shape[-1] ** 0.5 * (1.0 if "embed" in name else 1.5))


def as_released(named):
  """(name, tensor) pairs with transformers' fused experts split into one torch [out, in] tensor per
  expert, as released checkpoints hold them: name -> numpy array."""
  out = {}
  for name, t in named:
    v = t.detach().numpy()
    if name.endswith("experts.gate_up_proj"):
      f, prefix = v.shape[1] // 2, name.removesuffix("gate_up_proj")
      for e in range(v.shape[0]):
        out[f"{prefix}{e}.gate_proj.weight"], out[f"{prefix}{e}.up_proj.weight"] = v[e, :f], v[e, f:]
    elif name.endswith("experts.down_proj"):
      out |= {f"{name.removesuffix('down_proj')}{e}.down_proj.weight": v[e] for e in range(v.shape[0])}
    else:
      out[name] = v
  return out


class RefModule(torch.nn.Module):
  """One MTP module wired as vLLM's DeepseekV32MTP / SGLang's deepseek_nextn (module docstring)."""

  def __init__(self, config, layer_cls):
    super().__init__()
    d, eps = config.hidden_size, config.rms_norm_eps
    self.enorm, self.hnorm = v32.DeepseekV32RMSNorm(d, eps), v32.DeepseekV32RMSNorm(d, eps)
    self.eh_proj = torch.nn.Linear(2 * d, d, bias=False)
    self.block = layer_cls(config, N_LAYERS - 1)  # the last target layer's index: a MoE FFN, its own indexer
    self.head_norm = v32.DeepseekV32RMSNorm(d, eps)

  def released(self, layer):
    """Its tensors under model.layers.{layer}. as released (block weights directly under the prefix)."""
    named = [(n.removeprefix("block.").replace("head_norm.", "shared_head.norm."), p)
             for n, p in self.named_parameters()]
    named += [(n.removeprefix("block."), b) for n, b in self.named_buffers() if n.endswith("correction_bias")]
    return {f"model.layers.{layer}.{n}": v for n, v in as_released(named).items()}

  def forward(self, emb, h, positions, rotary):
    x = self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(h)], -1))
    t = x.shape[1]
    mask = torch.full((t, t), torch.finfo(torch.float32).min).triu(1)[None, None]
    out = self.block(x, attention_mask=mask, position_ids=positions, position_embeddings=rotary(x, positions))
    return self.head_norm(out[0] if isinstance(out, tuple) else out)


def reference_chain(main, modules, toks, n, depths):
  """Cache-free chain over t_0..t_{n+depths-1}: float32[depths, n, V], every row."""
  with torch.no_grad():
    h = main(toks[:, :n], output_hidden_states=True).hidden_states[-1]
    positions = torch.arange(n)[None]
    out = []
    for m in range(1, depths + 1):
      h = modules[(m - 1) % len(modules)](main.model.embed_tokens(toks[:, m:m + n]), h, positions + m - 1,
                                          main.model.rotary_emb)
      out.append(main.lm_head(h)[0])
  return torch.stack(out).numpy()


def write_released(family, path):
  """(transformers main model, [RefModule] * K, config.json dict) written to path as released: MTP
  layers at model.layers.{N + k} carrying copies of the embedding and head, two shards and an index."""
  config_cls, main_cls, layer_cls, rope = FAMILIES[family]
  config = config_cls(**COMMON, num_nextn_predict_layers=K, rope_parameters=rope)
  config._attn_implementation = "eager"
  main = main_cls(config).eval()
  _init_all(main, 0)
  modules = []
  for i in range(K):
    modules.append(RefModule(config, layer_cls).eval())
    _init_all(modules[-1], 1 + i)
  tensors = as_released(list(main.state_dict().items()))
  for i, module in enumerate(modules):
    tensors |= module.released(N_LAYERS + i)
    tensors[f"model.layers.{N_LAYERS + i}.embed_tokens.weight"] = tensors["model.embed_tokens.weight"]
    tensors[f"model.layers.{N_LAYERS + i}.shared_head.head.weight"] = tensors["lm_head.weight"]
  names = sorted(tensors)
  weight_map = {}
  for s in range(2):
    file = f"model-{s + 1:05d}-of-00002.safetensors"
    save_tensors(path / file, {n: tensors[n] for n in names[s::2]})
    weight_map |= dict.fromkeys(names[s::2], file)
  (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
  hf = json.loads(config.to_json_string())
  (path / "config.json").write_text(json.dumps(hf))
  return main, modules, hf


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def released(request, tmp_path_factory):
  path = tmp_path_factory.mktemp(request.param)
  main, modules, hf = write_released(request.param, path)
  target, proposer, _ = mtp_jax.from_pretrained(path, dtype="float32", max_depth=3)
  return request.param, main, modules, target, proposer, path


def test_config_reads_the_indexer_and_the_chain(released):
  family, _, _, target, proposer, _ = released
  want = DsaConfig(index_n_heads=8, index_head_dim=8, index_topk=TOPK,
                                  rope_interleave=family == "glm_moe_dsa")
  assert target.cfg.dsa == proposer.cfg.dsa == want
  assert target.cfg.rope_interleave and target.cfg.mla.q_lora_rank == 24
  c = proposer.cfg
  assert (c.num_modules, c.num_depths, c.pass_normed_hidden, c.head_norm, c.mask_first_embedding) == (
      K, 3, True, True, False)
  assert {k: getattr(c, k) for k in layouts.conventions(family)} == layouts.conventions(family)


def test_target_equals_transformers_and_the_indexer_matters(released):
  _, main, _, target, _, _ = released
  toks = np.random.default_rng(0).integers(0, V, (2, 11))
  with torch.no_grad():
    out = main(torch.tensor(toks), output_hidden_states=True)
  rows = jnp.broadcast_to(jnp.arange(11), (2, 11))
  logits, hidden, _ = target(jnp.asarray(toks, jnp.int32), rows, jnp.ones((2, 11), bool), None)
  np.testing.assert_allclose(np.asarray(logits), out.logits.numpy(), rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(np.asarray(hidden), out.hidden_states[-1].numpy(), rtol=1e-4, atol=1e-4)
  indexers = [layer.self_attn.indexer for layer in main.model.layers]
  for indexer in indexers:  # every key kept: dense MLA
    indexer.index_topk = 1000
  with torch.no_grad():
    dense = main(torch.tensor(toks)).logits.numpy()
  for indexer in indexers:
    indexer.index_topk = TOPK
  assert np.abs(dense - out.logits.numpy()).max() > 1e-2


def test_mtp_chain_and_drafts_equal_engine_reference(released):
  _, main, modules, _, proposer, _ = released
  n, depths = 10, 3
  toks = torch.tensor(np.random.default_rng(1).integers(0, V, (1, n + depths)))
  want = reference_chain(main, modules, toks, n, depths)
  with torch.no_grad():
    hidden = main(toks[:, :n], output_hidden_states=True).hidden_states[-1].numpy()
  got = mtp_jax.forward_chain(proposer, jnp.asarray(hidden), jnp.asarray(toks[:, 1:].numpy(), jnp.int32), depths)
  np.testing.assert_allclose(np.asarray(got[:, 0]), want, rtol=1e-4, atol=1e-4)
  # The first propose's drafts are the reference chain's greedy continuation.
  ext, ref_drafts = toks.clone(), []
  for m in range(depths):
    ref_drafts.append(int(np.argmax(reference_chain(main, modules, ext, n, depths)[m, -1])))
    if m + 1 < depths:
      ext[0, n + 1 + m] = ref_drafts[-1]
  drafts, _ = mtp_jax.propose(proposer, mtp_jax.init_state(proposer.cfg, 1, 32), hidden,
                              toks[:, 1:n + 1].numpy(), np.array([n], np.int32), num_drafts=depths)
  assert np.asarray(drafts)[0].tolist() == ref_drafts


def test_greedy_speculative_equals_transformers_generate(released):
  """One compile each: DeepSeek-V3.2 verifying a draft tree (widths 2, 2, 1: tree rows attend to the
  prefix and their ancestors, the indexer choosing among those), GLM-5 a chain of k = 3 (module 0 again
  at depth 3) on paged caches (`PagedDsaCache`)."""
  family, main, _, target, proposer, _ = released
  rng = np.random.default_rng(3)
  prompts = [list(rng.integers(0, V, 5)), list(rng.integers(0, V, 12))]
  new = 12
  want = []
  for p in prompts:
    with torch.no_grad():
      out = main.generate(torch.tensor([p]), max_new_tokens=new, do_sample=False, min_new_tokens=new)
    want.append(out[0, len(p):].tolist())
  how = dict(max_len=64, page_size=8, num_drafts=3) if family == "glm_moe_dsa" else dict(tree=TreeSpec((2, 2, 1)))
  assert mtp_jax.generate(target, proposer, prompts, new, **how).tokens == want


@pytest.mark.parametrize("released", ["glm_moe_dsa"], indirect=True)  # cross-layer top-k sharing is GLM-5's
def test_glm5_shared_top_k_target_is_refused_by_name_and_its_mtp_loads(released, tmp_path):
  family, _, _, _, proposer, path = released
  assert family == "glm_moe_dsa"
  for f in path.iterdir():
    (tmp_path / f.name).symlink_to(f)
  (tmp_path / "config.json").unlink()
  hf = json.loads((path / "config.json").read_text()) | {"indexer_types": ["full", "shared"]}
  (tmp_path / "config.json").write_text(json.dumps(hf))
  with pytest.raises(NotImplementedError, match=r"layer\(s\) \[1\].*cross-layer top-k sharing"):
    mtp_jax.load_target(tmp_path)
  assert load_mtp(tmp_path, dtype="float32").cfg.dsa == proposer.cfg.dsa


def test_missing_indexer_key_is_named(released, tmp_path):
  family, _, _, _, _, path = released
  hf = json.loads((path / "config.json").read_text())
  del hf["index_topk"]
  with pytest.raises(validate.InvalidValue, match="index_topk"):
    layouts.config_from_hf(hf)
  bad = dict(hf, index_topk=4, index_head_dim=2)  # narrower than the 4 rotary dims
  with pytest.raises(validate.InvalidValue, match="index_head_dim"):
    layouts.config_from_hf(bad)


def test_dsa_attention_prefill_cached_and_paged_equal_transformers():
  """The attention layer alone (DeepseekV32Attention, eager, YaRN, its indexer keeping 3 of up to 7
  keys): one prefill, then ragged prefill chunks and decode steps (block_refs.SCHEDULE) through a
  DsaCache and through a PagedDsaCache of 4-row pages. GLM-5's layer differs only in the indexer's
  RoPE, which the target test covers."""
  config = DeepseekV32Config(**(COMMON | dict(index_topk=3)), rope_parameters=YARN)
  config._attn_implementation = "eager"
  ref, rotary = v32.DeepseekV32Attention(config, 0), v32.DeepseekV32RotaryEmbedding(config)
  randomize(ref)
  cfg = layouts.config_from_hf(json.loads(config.to_json_string()) | {"num_nextn_predict_layers": 1}).block_config()
  assert cfg.dsa == DsaConfig(index_n_heads=8, index_head_dim=8, index_topk=3, rope_interleave=False)
  assert cfg.mla == MlaConfig(kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6)
  attn = DsaAttention(cfg, rngs=nnx.Rngs(0))
  copy_into(attn, ref)
  x = np.random.default_rng(1).standard_normal((B, T, config.hidden_size)).astype(np.float32)
  with torch.no_grad():
    xt, pos = torch.from_numpy(x), torch.arange(T)[None].expand(B, T)
    want = ref(xt, position_embeddings=rotary(xt, pos), attention_mask=torch_mask(T))[0].numpy()
    ref.indexer.index_topk = T  # every key: the rows past the third differ
    dense = ref(xt, position_embeddings=rotary(xt, pos), attention_mask=torch_mask(T))[0].numpy()
  assert np.abs(dense - want)[:, 3:].min(axis=-1).max() > 0 and np.abs(dense - want).max() > 1e-2
  got, _ = attn(jnp.asarray(x), *full_rows(B, T), None)
  np.testing.assert_allclose(np.asarray(got), want, atol=2e-5, rtol=1e-4)
  cached = run_cached(lambda x, r, v, c: attn(x, r, v, c), init_cache(cfg, B, T + 1), x)
  np.testing.assert_allclose(cached, want, atol=2e-5, rtol=1e-4)

  def paged_step(x, rows, valid, caches):
    caches, (layer,) = caches.open(jnp.max(jnp.where(valid, rows + 1, 0), axis=1))
    y, layer = attn(x, rows, valid, layer)
    return y, caches.close([layer])

  paged = run_cached(paged_step, LayerCaches.create(cfg, 1, B, 8, page_size=4, num_pages=4), x)
  np.testing.assert_allclose(paged, want, atol=2e-5, rtol=1e-4)
