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
import pathlib
import re

import tokenizers

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, Glm4MoeConfig, Glm4MoeForCausalLM
from transformers.modeling_layers import MtpModel

import mtp_jax
from mtp_jax import cli, pretrained, sharding, validate
from mtp_jax.blocks import linear
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


# --- Block-scaled FP8 directories, quantized here as DeepSeek-V3 / GLM-4.5 releases are ---------------

# Rows x cols per scale; 16 x 12 leaves partial blocks in both directions (hidden 32, 24-wide inputs),
# as DeepSeek-V3's 576-row kv_a_proj_with_mqa does with its released 128 x 128 blocks.
FP8_BLOCK = (16, 12)
FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)


def _quantizable(name, shape):
  # The released recipe quantizes the linear layers of the decoder (MTP layers included), and
  # leaves embeddings, heads, norms and the routers in bf16.
  return name.startswith("model.layers.") and name.endswith("_proj.weight") and len(shape) == 2


def _blocks(w, block):
  """w [R, C] zero-padded to whole blocks, as [R // br, br, C // bc, bc]."""
  (br, bc), (r, c) = block, w.shape
  padded = torch.zeros(-(-r // br) * br, -(-c // bc) * bc)
  padded[:r, :c] = w
  return padded.view(padded.shape[0] // br, br, padded.shape[1] // bc, bc)


def fp8_quantize(w, block=FP8_BLOCK):
  """(float8_e4m3fn[R, C], weight_scale_inv float32[ceil(R / br), ceil(C / bc)]): each block scaled so its
  largest magnitude is the format's max (448), as transformers' Fp8Quantize and DeepSeek's release do."""
  blocks = _blocks(w.float(), block)
  amax = blocks.abs().amax(dim=(1, 3))
  scale_inv = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
  q = torch.clamp(blocks / scale_inv[:, None, :, None], -FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
  r, c = w.shape
  return q.view(q.shape[0] * q.shape[1], -1)[:r, :c].contiguous(), scale_inv.float()


def fp8_dequantize(q, scale_inv, block=FP8_BLOCK):
  """The reference: every element times its block's scale (transformers' _dequantize_fp8_weight)."""
  blocks = _blocks(q.float(), block) * scale_inv[:, None, :, None]
  r, c = q.shape
  return blocks.view(blocks.shape[0] * blocks.shape[1], -1)[:r, :c]


def _fake_quantize(module):
  """Every linear weight of a transformers module replaced by its FP8 round trip, so the torch model holds
  exactly what the FP8 directory dequantizes to (fused experts are quantized per expert and per proj)."""
  with torch.no_grad():
    for name, p in module.named_parameters():
      if name.endswith("experts.gate_up_proj"):
        f = p.shape[1] // 2
        for e in range(p.shape[0]):
          for half in (slice(0, f), slice(f, 2 * f)):
            p[e, half].copy_(fp8_dequantize(*fp8_quantize(p[e, half])))
      elif name.endswith("experts.down_proj"):
        for e in range(p.shape[0]):
          p[e].copy_(fp8_dequantize(*fp8_quantize(p[e])))
      elif name.endswith("_proj.weight") and "embed" not in name and p.ndim == 2:
        p.copy_(fp8_dequantize(*fp8_quantize(p)))


def _quantize_directory(path):
  """Rewrites the shards of a released directory with its linear weights as FP8 plus weight_scale_inv,
  and config.json's quantization_config as DeepSeek-V3's; returns how many weights were quantized."""
  import safetensors.torch
  index_file = path / "model.safetensors.index.json"
  index = json.loads(index_file.read_text())
  quantized = 0
  for shard in sorted(set(index["weight_map"].values())):
    tensors = safetensors.torch.load_file(path / shard)
    out = {}
    for name, t in tensors.items():
      if _quantizable(name, t.shape):
        out[name], out[name + "_scale_inv"] = fp8_quantize(t)
        index["weight_map"][name + "_scale_inv"] = shard
        quantized += 1
      else:
        out[name] = t
    safetensors.torch.save_file(out, path / shard)
  index_file.write_text(json.dumps(index))
  config = json.loads((path / "config.json").read_text())
  config["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                   "weight_block_size": list(FP8_BLOCK)}
  config["torch_dtype"] = "bfloat16"
  (path / "config.json").write_text(json.dumps(config))
  return quantized


@pytest.mark.parametrize("family", sorted(TINY))
def test_fp8_block_scaled_directory_equals_transformers_on_dequantized_weights(tmp_path, family):
  """An FP8 directory (float8_e4m3fn linear weights, a float32 scale per 16 x 12 block, partial blocks at
  the edges, MTP layers included) loads dequantized: target logits equal transformers run on the
  dequantized weights to 1e-4 (float32; what differs is summation order), the drafts equal MtpModel's,
  and greedy speculative decoding equals plain greedy decoding."""
  main_ref, mtp_ref, path = TINY[family](tmp_path)
  _fake_quantize(main_ref)
  _fake_quantize(mtp_ref.layers)
  # Rewritten from the fake-quantized model, the directory quantizes back to the same FP8 values.
  _write_released(main_ref, mtp_ref, main_ref.config, path)
  assert _quantize_directory(path) > 20
  target, proposer, _ = mtp_jax.from_pretrained(path, dtype="float32", max_depth=2)
  toks = np.random.default_rng(0).integers(0, V, (2, 9))
  with torch.no_grad():
    out = main_ref(torch.tensor(toks), output_hidden_states=True)
  rows = jnp.broadcast_to(jnp.arange(9), (2, 9))
  logits, hidden, _ = target(jnp.asarray(toks, jnp.int32), rows, jnp.ones((2, 9), bool), None)
  np.testing.assert_allclose(np.asarray(logits), out.logits.numpy(), rtol=1e-4, atol=1e-4)
  h0 = out.hidden_states[-1][:1, :8]
  with torch.no_grad():
    ids, _, _ = mtp_ref(input_ids=torch.tensor(toks[:1, 1:]), last_hidden_states=h0, attention_mask=None,
                        position_ids=torch.arange(1, 9)[None], mtp_cache=None)
  drafts, _ = mtp_jax.propose(proposer, mtp_jax.init_state(proposer.cfg, 1, 32), h0.numpy(), toks[:1, 1:],
                              np.array([8], np.int32), num_drafts=K)
  np.testing.assert_array_equal(np.asarray(drafts), ids.numpy())
  prompts = [list(toks[0, :5]), list(toks[1])]
  plain = mtp_jax.generate(target, None, prompts, 8)
  assert mtp_jax.generate(target, proposer, prompts, 8, num_drafts=2).tokens == plain.tokens


def test_in_memory_quantize_is_the_released_recipe():
  """blocks.linear.quantize gives the recipe's float8 values and scales (partial blocks included), and
  dequantize inverts it as the reference does (float32, to 1e-6)."""
  w = torch.randn(37, 29, generator=torch.Generator().manual_seed(0))
  values, scale_inv = linear.quantize(jnp.asarray(w.numpy()), FP8_BLOCK)
  ref_values, ref_scale_inv = fp8_quantize(w)
  assert values.dtype == jnp.float8_e4m3fn and scale_inv.shape == (3, 3)
  np.testing.assert_array_equal(np.asarray(values, np.float32), ref_values.float().numpy())
  # XLA divides by 448 as a multiply by its reciprocal: the scales agree to an ulp
  np.testing.assert_allclose(np.asarray(scale_inv), ref_scale_inv.numpy(), rtol=3e-7)
  np.testing.assert_allclose(np.asarray(linear.dequantize(values, scale_inv, FP8_BLOCK, jnp.float32)),
                             fp8_dequantize(ref_values, ref_scale_inv).numpy(), rtol=1e-6)


def _kept_fp8(state):
  """name -> float8 param of a state dict, each checked to have its float32 <name>_scale_inv."""
  kept = {n: v for n, v in state.items() if v.dtype == jnp.float8_e4m3fn}
  for name, v in kept.items():
    assert state[name + "_scale_inv"].dtype == jnp.float32, name
  return kept


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(TINY))
def test_quantized_fp8_keeps_the_stored_weights_and_equals_dequantizing_at_load(tmp_path, family):
  """quantized="fp8": the weights stored FP8 stay float8_e4m3fn with their scales (but MLA's kv_b_proj),
  the rest as loaded before; float32 logits equal the dequantized-at-load model's to 1e-5 (the same
  weight values; XLA's fused dequantization may only reorder), bf16 ones to 2e-2 (XLA:CPU may skip
  rounding the dequantized weight to bf16 before its matmul); drafts equal; greedy speculative decoding
  equals plain greedy decoding; the state dict holds the stored parts, which load_target_state_dict refuses."""
  _, _, path = TINY[family](tmp_path)
  assert _quantize_directory(path) > 20
  target, proposer, _ = mtp_jax.from_pretrained(path, dtype="float32", max_depth=2)
  q_target, q_proposer, _ = mtp_jax.from_pretrained(path, dtype="float32", max_depth=2, quantized="fp8")

  stored = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
  want = {re.sub(r"experts\.\d+\.(\w+)\.weight", r"experts.\1", n.removesuffix("_scale_inv")) for n in stored
          if n.endswith("_scale_inv") and int(n.split(".")[2]) < N_LAYERS and "kv_b_proj" not in n}
  state, q_state = mtp_jax.target_state_dict(target), mtp_jax.target_state_dict(q_target)
  kept = _kept_fp8(q_state)
  assert set(kept) == want and len(want) > 10
  assert all(q_state[n].dtype == jnp.float32 for n in ("model.embed_tokens.weight", "lm_head.weight",
                                                        "model.layers.1.mlp.gate.weight", "model.norm.weight"))
  scale_bytes = sum(q_state[n + "_scale_inv"].nbytes for n in kept)
  fp8_elements = sum(v.size for v in kept.values())
  assert sum(v.nbytes for v in kept.values()) == fp8_elements
  total = lambda state: sum(v.nbytes for v in state.values())
  assert total(q_state) == total(state) - 3 * fp8_elements + scale_bytes
  q_mtp = _kept_fp8(mtp_jax.state_dict(q_proposer))
  assert "mtp.0.eh_proj.weight" in q_mtp and "mtp.1.mlp.experts.down_proj" in q_mtp
  with pytest.raises(KeyError, match="_scale_inv"):
    mtp_jax.load_target_state_dict(q_target.cfg, q_state)

  toks = np.random.default_rng(0).integers(0, V, (2, 9))
  rows, valid = jnp.broadcast_to(jnp.arange(9), (2, 9)), jnp.ones((2, 9), bool)
  logits = lambda t: np.asarray(jax.jit(lambda t: t(jnp.asarray(toks, jnp.int32), rows, valid, None))(t)[0])
  np.testing.assert_allclose(logits(q_target), logits(target), rtol=1e-5, atol=1e-5)
  bf16 = lambda **kw: mtp_jax.load_target(path, dtype="bfloat16", **kw)
  np.testing.assert_allclose(logits(bf16(quantized="fp8")), logits(bf16()), rtol=2e-2, atol=2e-2)
  h0 = jax.jit(lambda t: t(jnp.asarray(toks[:1, :8], jnp.int32), rows[:1, :8], valid[:1, :8], None)[1])(target)
  propose = lambda p: np.asarray(mtp_jax.propose(p, mtp_jax.init_state(p.cfg, 1, 32), h0, toks[:1, 1:],
                                                 np.array([8], np.int32), num_drafts=K)[0])
  np.testing.assert_array_equal(propose(q_proposer), propose(proposer))
  prompts = [list(toks[0, :5]), list(toks[1])]
  plain = mtp_jax.generate(target, None, prompts, 8)
  assert mtp_jax.generate(q_target, q_proposer, prompts, 8, num_drafts=2).tokens == plain.tokens


# --- Model directories that are wrong: one named error each, one CLI line each -------------------------

@pytest.fixture(scope="module")
def glm_dir(tmp_path_factory):
  """A tiny GLM-4.5 directory with a tokenizer.json, written once; tests damage copies of it."""
  main, _, path = tiny_glm(tmp_path_factory.mktemp("glm_dir"))
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({f"w{i}": i for i in range(V)}, unk_token="w0"))
  tok.save(str(path / "tokenizer.json"))
  return main, path


def _copy(path, tmp_path):
  import shutil
  return pathlib.Path(shutil.copytree(path, tmp_path / "model"))


def _edit_json(file, edit):
  value = json.loads(file.read_text())
  file.write_text(json.dumps(edit(value)))


DAMAGE = {
    # name: (damage(dir), error type, .argument ends with, message pattern)
    "invalid JSON": (lambda d: (d / "config.json").write_text("{oops"), validate.InvalidValue, "config.json",
                     "is not valid JSON"),
    "a JSON list": (lambda d: (d / "config.json").write_text("[1, 2]"), validate.InvalidType, "config.json",
                    "must hold a JSON object.*list"),
    "no vocab_size": (lambda d: _edit_json(d / "config.json", lambda c: c.pop("vocab_size") and c),
                      validate.InvalidValue, "config.json: vocab_size", "has no 'vocab_size'"),
    "no num_hidden_layers": (lambda d: _edit_json(d / "config.json", lambda c: c.pop("num_hidden_layers") and c),
                             validate.InvalidValue, "config.json: num_hidden_layers", "has no 'num_hidden_layers'"),
    "no hidden_size": (lambda d: _edit_json(d / "config.json", lambda c: c.pop("hidden_size") and c),
                       validate.InvalidValue, "config.json: hidden_size", "has no 'hidden_size'"),
    "string head_dim": (lambda d: _edit_json(d / "config.json", lambda c: {**c, "head_dim": "8"}),
                        validate.InvalidType, "config.json: head_dim", "head_dim must be an int"),
    "negative rms_norm_eps": (lambda d: _edit_json(d / "config.json", lambda c: {**c, "rms_norm_eps": -1}),
                              validate.InvalidValue, "config.json: rms_norm_eps", "rms_norm_eps must be a finite"),
    "index is a list": (lambda d: (d / "model.safetensors.index.json").write_text("[]"), validate.InvalidType,
                        "model.safetensors.index.json", "must hold a JSON object"),
    "non-string weight_map entry": (
        lambda d: _edit_json(d / "model.safetensors.index.json",
                             lambda i: {"weight_map": {**i["weight_map"], "lm_head.weight": 3}}),
        validate.InvalidType, "weight_map['lm_head.weight']", "must name a shard file"),
    "fp8 compute dtype": (lambda d: _edit_json(d / "config.json", lambda c: {**c, "torch_dtype": "float8_e4m3fn"}),
                          validate.InvalidValue, "config.json: torch_dtype", "cannot be the compute dtype.*bfloat16"),
    "integer compute dtype": (lambda d: _edit_json(d / "config.json", lambda c: {**c, "torch_dtype": "int8"}),
                              validate.InvalidValue, "config.json: torch_dtype", "must be a floating dtype"),
    "corrupt tokenizer.json": (lambda d: (d / "tokenizer.json").write_text('{"model": 1'), validate.InvalidValue,
                               "tokenizer.json", "is not a tokenizers tokenizer.json"),
}


@pytest.mark.parametrize("case", sorted(DAMAGE))
def test_bad_model_directories_are_named_errors_and_one_cli_line(glm_dir, tmp_path, case, capsys):
  damage, error, argument, message = DAMAGE[case]
  path = _copy(glm_dir[1], tmp_path)
  damage(path)
  load = pretrained.load_tokenizer if "tokenizer" in case else pretrained.from_pretrained
  with pytest.raises(error, match=message) as info:
    load(path)
  assert info.value.argument.endswith(argument)
  assert cli.main(["generate", "--model", str(path), "--prompt", "w1 w2", "--max-new-tokens", "1"]) == 2
  err = capsys.readouterr().err
  assert err.startswith("mtp-jax: error: ") and err.count("\n") == 1 and "Traceback" not in err


def test_dangling_shard_and_explicit_bad_dtypes_are_named(glm_dir, tmp_path):
  path = _copy(glm_dir[1], tmp_path)
  (path / "model-00002-of-00002.safetensors").unlink()
  with pytest.raises(FileNotFoundError, match=r"puts tensor '.*' in a missing shard file .*model-00002"):
    pretrained.from_pretrained(path)
  for dtype, pattern in [("float8_e4m3fn", "cannot be the compute dtype"), ("int32", "floating dtype")]:
    with pytest.raises(validate.InvalidValue, match=pattern) as info:
      pretrained.load_mtp(glm_dir[1], dtype=dtype)
    assert info.value.argument == "dtype"


def test_nonfinite_weights_are_refused_naming_the_tensor(glm_dir, tmp_path):
  import safetensors.torch
  path = _copy(glm_dir[1], tmp_path)
  index = json.loads((path / "model.safetensors.index.json").read_text())
  name = "model.layers.1.self_attn.o_proj.weight"
  shard = path / index["weight_map"][name]
  tensors = safetensors.torch.load_file(shard)
  tensors[name][0, 3] = float("nan")
  tensors[name][1, 2] = float("inf")
  safetensors.torch.save_file(tensors, shard)
  with pytest.raises(validate.InvalidValue, match=rf"'{name}' holds 2 NaN / inf value\(s\).*allow_nonfinite=True"):
    pretrained.load_target(path)
  # With mesh=, each block is checked as it is read (one device here: one block, the whole tensor).
  with pytest.raises(validate.InvalidValue, match=rf"'{name}' holds 2 NaN / inf value\(s\) of 1024 in its block"):
    pretrained.load_target(path, mesh=sharding.make_mesh(1, 1, jax.devices()[:1]))
  target = pretrained.load_target(path, allow_nonfinite=True)
  assert np.isnan(np.asarray(target.layers[1].self_attn.o_proj.weight[...])).any()
  with pytest.raises(validate.InvalidType, match="allow_nonfinite must be a bool"):
    pretrained.from_pretrained(path, allow_nonfinite="yes")


def test_tied_embeddings_with_a_stored_mtp_head(glm_dir, tmp_path):
  """tie_word_embeddings with per-module shared_head.head stored (DeepSeek layout): heads equal to the
  embedding load (the head is the embedding); a different one is refused saying why."""
  import safetensors.torch
  main, src = glm_dir
  path = _copy(src, tmp_path)
  _edit_json(path / "config.json", lambda c: {**c, "tie_word_embeddings": True})
  with pytest.raises(ValueError, match=r"tie_word_embeddings.*stored head 'model.layers.2.shared_head.head.weight' "
                                       r"differs"):
    pretrained.load_mtp(path)
  index = json.loads((path / "model.safetensors.index.json").read_text())
  embed = main.model.embed_tokens.weight.detach().clone()
  for i in range(K):
    name = f"model.layers.{N_LAYERS + i}.shared_head.head.weight"
    shard = path / index["weight_map"][name]
    tensors = safetensors.torch.load_file(shard)
    tensors[name] = embed
    safetensors.torch.save_file(tensors, shard)
  proposer = pretrained.load_mtp(path)
  np.testing.assert_array_equal(np.asarray(proposer.lm_head.weight[...]), embed.numpy())


def test_loaders_are_public_at_the_top_level():
  assert (mtp_jax.from_pretrained, mtp_jax.load_target, mtp_jax.load_mtp, mtp_jax.load_tokenizer) == (
      pretrained.from_pretrained, pretrained.load_target, pretrained.load_mtp, pretrained.load_tokenizer)
  assert {"from_pretrained", "load_target", "load_mtp", "load_tokenizer", "families"} <= set(mtp_jax.__all__)


def test_fp8_tensors_without_a_quantization_config_are_named(glm_dir, tmp_path):
  """FP8 weights with scales but no quantization_config: the scales are named as needing one; an FP8
  weight without a scale is refused rather than cast."""
  import safetensors.torch
  path = _copy(glm_dir[1], tmp_path)
  _quantize_directory(path)
  _edit_json(path / "config.json", lambda c: {k: v for k, v in c.items() if k != "quantization_config"})
  with pytest.raises(NotImplementedError, match=r"weight_scale_inv.*quantization_config, quant_method fp8"):
    pretrained.load_target(path)
  index = json.loads((path / "model.safetensors.index.json").read_text())
  scales = [n for n in index["weight_map"] if n.endswith("_scale_inv")]
  for shard in sorted(set(index["weight_map"].values())):
    tensors = safetensors.torch.load_file(path / shard)
    safetensors.torch.save_file({n: t for n, t in tensors.items() if n not in scales}, path / shard)
  index["weight_map"] = {n: f for n, f in index["weight_map"].items() if n not in scales}
  (path / "model.safetensors.index.json").write_text(json.dumps(index))
  with pytest.raises(ValueError, match=r"tensor 'model\.layers\.\d+\..*_proj\.weight' is stored as float8_e4m3fn "
                                       "without scales"):
    pretrained.load_target(path)


@pytest.mark.parametrize("quantized", ["int8", "FP8", True])
def test_quantized_other_than_none_or_fp8_is_refused_by_name(glm_dir, quantized):
  for load in (mtp_jax.from_pretrained, mtp_jax.load_target, mtp_jax.load_mtp):
    with pytest.raises(validate.InvalidValue, match=r"quantized must be None .* \('fp8',\)") as e:
      load(glm_dir[1], quantized=quantized)
    assert e.value.argument == "quantized"


def test_quantized_fp8_without_fp8_weights_is_refused_by_name(glm_dir):
  """A directory whose config.json declares no FP8 weights: quantized="fp8" would keep nothing, so it is
  refused rather than loading bf16 / float32 weights the caller sized as FP8."""
  for load in (mtp_jax.from_pretrained, mtp_jax.load_target, mtp_jax.load_mtp):
    with pytest.raises(validate.InvalidValue, match="no quantization_config") as e:
      load(glm_dir[1], quantized="fp8")
    assert e.value.argument == "quantized"
