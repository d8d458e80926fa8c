"""from_pretrained on a released GLM-4.5 or DeepSeek-V3 directory equals transformers: target logits,
the chain's drafts and logits against transformers' `MtpModel`, and greedy speculative decoding
(ragged batch, every k up to a max_depth past the module count) against transformers' greedy `generate`.

Each tiny model has a dense layer and a MoE layer (first_k_dense_replace = 1) and MoE MTP layers (as
transformers always builds them). GLM-4.5: the family's partial RoPE (0.5, transformers' default, left
out of config.json) and q / k norms. DeepSeek-V3: MLA with YaRN RoPE, rotated interleaved
(transformers' default, left out of config.json). Experts are written one tensor each, as released. Greedy
`generate(use_mtp=True)` is lossless, so it equals plain greedy `generate`; the latter is the
reference (MtpModel.from_pretrained finds MTP weights only at the full-size models' layer numbers).
"""

import json

import tokenizers

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, Glm4MoeConfig, Glm4MoeForCausalLM
from transformers.modeling_layers import MtpModel

import mtp_jax
from mtp_jax import cli, pretrained
from mtp_jax.checkpoint import save_tensors

N_LAYERS, K, V = 2, 2, 64


def _init_all(module, seed):
  """Every tensor drawn here (transformers leaves MoE experts uninitialised): norms near 1."""
  gen = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    # The router's e_score_correction_bias is a buffer; RoPE's inv_freq buffers stay as they are.
    biases = [(n, b) for n, b in module.named_buffers() if n.endswith("e_score_correction_bias")]
    for name, p in list(module.named_parameters()) + biases:
      noise = torch.randn(p.shape, generator=gen)
      if name.endswith("norm.weight"):
        p.copy_(1 + 0.2 * noise)
      elif p.ndim == 1:
        p.copy_(0.2 * noise)
      else:
        p.copy_(noise / p.shape[-1] ** 0.5 * (1.0 if "embed" in name else 1.5))


def _released(state_dict):
  """transformers' fused experts (gate_up_proj [E, 2Fe, D], down_proj [E, D, Fe]) -> one torch
  [out, in] tensor per expert, as released checkpoints hold them."""
  out = {}
  for name, t in state_dict.items():
    v = t.detach().numpy()
    if name.endswith("experts.gate_up_proj"):
      f = v.shape[1] // 2
      prefix = name.removesuffix("gate_up_proj")
      for e in range(v.shape[0]):
        out[f"{prefix}{e}.gate_proj.weight"], out[f"{prefix}{e}.up_proj.weight"] = v[e, :f], v[e, f:]
    elif name.endswith("experts.down_proj"):
      out |= {f"{name.removesuffix('down_proj')}{e}.down_proj.weight": v[e] for e in range(v.shape[0])}
    else:
      out[name] = v
  return out


def _write_released(main, mtp, cfg, tmp_path):
  """Writes main and mtp as a released checkpoint would be: MTP layers at
  model.layers.{num_hidden_layers + k}, two safetensors shards and an index; returns config.json's dict."""
  tensors = _released(main.state_dict())
  for n, v in _released(mtp.layers.state_dict()).items():
    i, rest = n.split(".", 1)
    rest = rest.removeprefix("mtp_block.").replace("post_norm.", "shared_head.norm.")
    tensors[f"model.layers.{N_LAYERS + int(i)}.{rest}"] = v
  for i in range(K):  # as released: each MTP layer carries copies of the embedding and head
    tensors[f"model.layers.{N_LAYERS + i}.embed_tokens.weight"] = tensors["model.embed_tokens.weight"]
    tensors[f"model.layers.{N_LAYERS + i}.shared_head.head.weight"] = tensors["lm_head.weight"]
  names = sorted(tensors)
  weight_map = {}
  for s in range(2):
    file = f"model-{s + 1:05d}-of-00002.safetensors"
    save_tensors(tmp_path / file, {n: tensors[n] for n in names[s::2]})
    weight_map |= dict.fromkeys(names[s::2], file)
  (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
  return json.loads(cfg.to_json_string())


def _tiny(cls, cfg, tmp_path):
  """(main, mtp, config.json dict) for a transformers config, every tensor drawn (`_init_all`)."""
  main = cls(cfg).eval()
  _init_all(main, 0)
  mtp = MtpModel(main, K).eval()
  _init_all(mtp.layers, 1)
  return main, mtp, _write_released(main, mtp, cfg, tmp_path)


# Shared by both families: a dense layer then a MoE layer, group-limited routing, a shared expert.
_MOE = dict(vocab_size=V, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
            num_hidden_layers=N_LAYERS, num_attention_heads=4, first_k_dense_replace=1, n_routed_experts=4,
            num_experts_per_tok=2, n_shared_experts=1, n_group=2, topk_group=1, routed_scaling_factor=1.5,
            num_mtp_layers=K, rms_norm_eps=1e-5, tie_word_embeddings=False, max_position_embeddings=256,
            eos_token_id=None, pad_token_id=None, bos_token_id=None)


def tiny_glm(tmp_path):
  """(main, mtp, directory): a GLM-4.5 with attention biases and q / k norms; partial_rotary_factor
  left out of config.json (transformers' default 0.5)."""
  cfg = Glm4MoeConfig(**_MOE, num_key_value_heads=2, head_dim=8, attention_bias=True, use_qk_norm=True,
                      rope_parameters={"rope_type": "default", "rope_theta": 500.0})
  main, mtp, config = _tiny(Glm4MoeForCausalLM, cfg, tmp_path)
  config.pop("partial_rotary_factor", None)
  config["rope_parameters"].pop("partial_rotary_factor", None)
  (tmp_path / "config.json").write_text(json.dumps(config))
  return main, mtp, tmp_path


def tiny_deepseek(tmp_path):
  """(main, mtp, directory): a DeepSeek-V3: MLA with a q LoRA in every layer, YaRN RoPE whose
  mscale_all_dim scales the softmax; rope_interleave left out of config.json (transformers' default True)."""
  cfg = DeepseekV3Config(**_MOE, kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=4,
                         v_head_dim=6, rope_parameters={
                             "rope_type": "yarn", "rope_theta": 500.0, "factor": 4.0,
                             "original_max_position_embeddings": 64, "beta_fast": 32.0, "beta_slow": 1.0,
                             "mscale": 1.0, "mscale_all_dim": 0.8})
  main, mtp, config = _tiny(DeepseekV3ForCausalLM, cfg, tmp_path)
  config.pop("rope_interleave")
  (tmp_path / "config.json").write_text(json.dumps(config))
  return main, mtp, tmp_path


TINY = {"glm4_moe": tiny_glm, "deepseek_v3": tiny_deepseek}


@pytest.fixture(scope="module", params=sorted(TINY))
def released(request, tmp_path_factory):
  main, mtp, path = TINY[request.param](tmp_path_factory.mktemp(request.param))
  target, proposer, config = mtp_jax.from_pretrained(path, dtype="float32", max_depth=3)
  return main, mtp, target, proposer, config, path


def test_config_and_conventions(released):
  _, _, target, proposer, config, _ = released
  if config["model_type"] == "glm4_moe":
    assert target.cfg.output_normed_hidden and target.cfg.attention_bias and target.cfg.qk_norm
    assert target.cfg.partial_rotary_factor == proposer.cfg.partial_rotary_factor == 0.5
  else:
    mla = mtp_jax.MlaConfig(kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6)
    assert target.cfg.mla == proposer.cfg.mla == mla
    assert target.cfg.rope_interleave and proposer.cfg.rope_interleave
    assert target.cfg.rope_scaling.mscale_all_dim == 0.8 and target.cfg.rope_scaling.factor == 4.0
  assert target.cfg.moe.first_k_dense_replace == 1 and proposer.cfg.moe.num_experts == 4
  c = proposer.cfg
  assert (c.num_modules, c.num_depths, c.pass_normed_hidden, c.head_norm, c.mask_first_embedding) == (
      K, 3, True, True, False)


def test_target_logits_and_hidden_equal_transformers(released):
  main, _, target, _, _, _ = released
  toks = np.random.default_rng(0).integers(0, V, (2, 11))
  with torch.no_grad():
    out = main(torch.tensor(toks), output_hidden_states=True)
  rows = jnp.broadcast_to(jnp.arange(11), (2, 11))
  logits, hidden, _ = target(jnp.asarray(toks, jnp.int32), rows, jnp.ones((2, 11), bool), None)
  np.testing.assert_allclose(np.asarray(logits), out.logits.numpy(), rtol=1e-4, atol=1e-4)
  # transformers hands MtpModel hidden_states[-1], the post-final-norm hidden.
  np.testing.assert_allclose(np.asarray(hidden), out.hidden_states[-1].numpy(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("n", [1, 9])
def test_drafts_equal_mtp_model(released, n):
  """From a history t_0..t_n: MtpModel's K drafts (cache-free, each layer over every row) and
  their logits equal the proposer's first propose."""
  main, mtp, target, proposer, _, _ = released
  toks = torch.tensor(np.random.default_rng(n).integers(0, V, (1, n + 1)))
  with torch.no_grad():
    h0 = main(toks[:, :n], output_hidden_states=True).hidden_states[-1]
    ids, want_logits, _ = mtp(input_ids=toks[:, 1:], last_hidden_states=h0, attention_mask=None,
                              position_ids=torch.arange(1, n + 1)[None], mtp_cache=None)
  state = mtp_jax.init_state(proposer.cfg, 1, 32)
  drafts, _ = mtp_jax.propose(proposer, state, h0.numpy(), toks[:, 1:].numpy(), np.array([n], np.int32),
                              num_drafts=K)
  np.testing.assert_array_equal(np.asarray(drafts), ids.numpy())
  ext = np.concatenate([toks[0, 1:].numpy(), ids[0].numpy()])[None]
  got = mtp_jax.forward_chain(proposer, jnp.asarray(h0.numpy()), jnp.asarray(ext, jnp.int32), K)
  np.testing.assert_allclose(np.asarray(got[:, 0, n - 1]), want_logits[0].numpy(), rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_greedy_generate_equals_transformers_for_every_k(released):
  main, _, target, proposer, _, _ = released
  rng = np.random.default_rng(3)
  prompts = [list(rng.integers(0, V, 5)), list(rng.integers(0, V, 12))]
  new = 14
  want = []
  for p in prompts:
    with torch.no_grad():
      out = main.generate(torch.tensor([p]), max_new_tokens=new, do_sample=False, min_new_tokens=new)
    want.append(out[0, len(p):].tolist())
  # k = 3 runs module 1 at depths 2 and 3 (vLLM's cycle); test_drafts_equal_mtp_model checks
  # every depth's drafts, so k = 2 adds nothing here but a compile.
  for k in (1, 3):
    got = mtp_jax.generate(target, proposer, prompts, new, num_drafts=k)
    assert got.tokens == want, k
  single = mtp_jax.generate(target, proposer, prompts[1:], new, num_drafts=3)
  assert single.tokens == want[1:]


def test_tied_head_and_unsupported_tensors_are_named(tmp_path):
  main, _, path = tiny_glm(tmp_path)
  config = json.loads((path / "config.json").read_text())
  with pytest.raises(NotImplementedError, match=r"model_type 'qwen3_next' has no target"):
    pretrained.target_config_from_hf({**config, "model_type": "qwen3_next"})
  with pytest.raises(TypeError, match=r"unknown convention\(s\) \['chain'\]"):
    pretrained.load_mtp(path, chain="residual")
  index = json.loads((path / "model.safetensors.index.json").read_text())
  expert = index["weight_map"].pop("model.layers.1.mlp.experts.2.up_proj.weight")
  (path / "model.safetensors.index.json").write_text(json.dumps(index))
  with pytest.raises(KeyError, match=r"missing expert tensor 'model.layers.1.mlp.experts.2.up_proj.weight'"):
    pretrained.load_target(path)
  index["weight_map"]["model.layers.1.mlp.experts.2.up_proj.weight"] = expert
  # Tied: no lm_head tensor; the head is the embedding.
  del index["weight_map"]["lm_head.weight"]
  (path / "model.safetensors.index.json").write_text(json.dumps(index))
  with pytest.raises(KeyError, match=r"missing target tensor 'lm_head.weight' \(config.json: tie_word"):
    pretrained.load_target(path)
  (path / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
  target = pretrained.load_target(path)
  np.testing.assert_array_equal(np.asarray(target.lm_head.weight[...]),
                                main.model.embed_tokens.weight.detach().numpy())


def test_cli_generate_from_a_model_directory(released, capsys):
  """`mtp-jax generate --model DIR` with the directory's tokenizer.json: the greedy continuation."""
  main, _, _, _, _, path = released
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({f"w{i}": i for i in range(V)}, unk_token="w0"))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
  tok.save(str(path / "tokenizer.json"))
  prompt = "w3 w14 w15 w9 w26"
  with torch.no_grad():
    out = main.generate(torch.tensor([[3, 14, 15, 9, 26]]), max_new_tokens=6, do_sample=False, min_new_tokens=6)
  want = tok.decode(out[0, 5:].tolist())
  assert cli.main(["generate", "--model", str(path), "--prompt", prompt, "--max-new-tokens", "6",
                   "--num-drafts", "3", "--dtype", "float32"]) == 0
  captured = capsys.readouterr()
  assert captured.out == prompt + want + "\n"
  assert "target calls" in captured.err
