"""Gemma 4 assistants (gemma4_assistant, gemma4_unified_assistant) against transformers 5.25.

Reference: transformers 5.25 models/gemma4_assistant/modeling_gemma4_assistant.py (and
gemma4_unified_assistant/, the same wiring over Gemma4UnifiedTextModel) run as
generation/candidate_generator.py's SinglePositionMultiTokenCandidateGenerator.get_candidates does:
k steps from the target's last token embedding (Gemma4TextScaledWordEmbedding) and last hidden, the
target's shared_kv_states sliced to the verified length, position id length - 1, the target's
attention mask, argmax drafts. Facts about the layer were read in transformers' models/gemma4/
modeling_gemma4.py (Gemma4TextAttention / DecoderLayer, shared K/V) and masking_utils.py, and in vLLM 0.34
model_executor/models/gemma4_mtp.py (the same wiring; its sliding window and masked-head fill differ, see
docs/families_2026.md). A tiny assistant (every tensor set
from a seeded generator) is saved with save_pretrained, loaded with mtp_jax.load_assistant, and its
per-step logits (float32, atol 1e-4) and greedy drafts compared with mtp_jax.assistant_propose for a
batch of two lengths (the reference runs row by row), the sliding window shorter than both lengths,
and K/V rows past a row's length holding NaN.
"""

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from transformers import (Gemma4AssistantConfig, Gemma4AssistantForCausalLM, Gemma4UnifiedAssistantConfig,
                          Gemma4UnifiedAssistantForCausalLM)
from transformers.models.gemma4.configuration_gemma4 import Gemma4TextConfig
from transformers.models.gemma4.modeling_gemma4 import Gemma4TextScaledWordEmbedding
from transformers.models.gemma4_unified.configuration_gemma4_unified import Gemma4UnifiedTextConfig

import mtp_jax
from mtp_jax import validate
from mtp_jax.checkpoint import save_tensors

V, D, H, S, K, WINDOW = 128, 32, 48, 8, 3, 3
LENGTHS = (7, 5)
TYPES = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
KV_SHAPE = {"sliding_attention": (2, 8), "full_attention": (1, 16)}  # (Hkv, Dh) of the target's K/V


def hf_assistant(tmp_path, model_type="gemma4_assistant", ordered=False, seed=0):
  """A tiny assistant with every tensor drawn from a seeded generator, saved to tmp_path; returns the
  copy transformers loads back (eager attention)."""
  text_cls, cfg_cls, model_cls = (
      (Gemma4TextConfig, Gemma4AssistantConfig, Gemma4AssistantForCausalLM) if model_type == "gemma4_assistant"
      else (Gemma4UnifiedTextConfig, Gemma4UnifiedAssistantConfig, Gemma4UnifiedAssistantForCausalLM))
  extra = dict(hidden_size_per_layer_input=0, vocab_size_per_layer_input=0) if text_cls is Gemma4TextConfig else {}
  text = text_cls(vocab_size=V, hidden_size=D, intermediate_size=64, num_hidden_layers=len(TYPES),
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, global_head_dim=16,
                  attention_k_eq_v=True, num_global_key_value_heads=1, sliding_window=WINDOW, layer_types=TYPES,
                  rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                                   "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.5,
                                                      "rope_theta": 1000.0}}, **extra)
  cfg = cfg_cls(text_config=text, backbone_hidden_size=H, use_ordered_embeddings=ordered, num_centroids=8,
                centroid_intermediate_top_k=3)
  model = model_cls(cfg)
  gen = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in list(model.named_parameters()) + list(model.named_buffers()):
      if name.endswith("token_ordering"):
        p.copy_(torch.randperm(V, generator=gen))
      elif "norm" in name or name.endswith("layer_scalar"):
        p.copy_(1 + 0.3 * torch.randn(p.shape, generator=gen))
      elif p.is_floating_point() and "inv_freq" not in name and "embed_scale" not in name:
        p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
  model.save_pretrained(tmp_path)
  return model_cls.from_pretrained(tmp_path, attn_implementation="eager").eval()


def target_outputs(seed=1):
  """The caller's target side: embedding table, last tokens / hiddens, and per-type K/V [B, S, Hkv, Dh]
  with NaN in the rows past each row's length."""
  gen = torch.Generator().manual_seed(seed)
  embed = Gemma4TextScaledWordEmbedding(V, H, 0, embed_scale=H**0.5)
  with torch.no_grad():
    embed.weight.copy_(torch.randn(V, H, generator=gen))
  tokens = torch.tensor([5, 77])
  hidden = torch.randn(len(LENGTHS), H, generator=gen)
  kv = {}
  for t, (hkv, dh) in KV_SHAPE.items():
    pair = [torch.randn(len(LENGTHS), S, hkv, dh, generator=gen) for _ in range(2)]
    for x in pair:
      for b, n in enumerate(LENGTHS):
        x[b, n:] = float("nan")
    kv[t] = tuple(pair)
  return embed, tokens, hidden, kv


def reference(model, embed, tokens, hidden, kv, b):
  """Row b's k draft steps as SinglePositionMultiTokenCandidateGenerator.get_candidates runs them."""
  n = LENGTHS[b]
  shared = {t: (k[b:b + 1, :n].transpose(1, 2), v[b:b + 1, :n].transpose(1, 2)) for t, (k, v) in kv.items()}
  last_token, last_hidden = tokens[b:b + 1, None], hidden[b:b + 1, None]
  position_ids = torch.tensor([[n - 1]])
  mask = torch.ones(1, n, dtype=torch.long)
  logits, drafts = [], []
  with torch.no_grad():
    for _ in range(K):
      inputs_embeds = torch.cat([embed(last_token), last_hidden], dim=-1)
      out = model(inputs_embeds=inputs_embeds, attention_mask=mask, position_ids=position_ids,
                  shared_kv_states=shared, use_cache=False)
      last_token, last_hidden = out.logits.argmax(dim=-1), out.last_hidden_state
      logits.append(out.logits[0, 0].numpy())
      drafts.append(int(last_token[0, 0]))
  return np.stack(logits), np.array(drafts)


def ours(assistant, embed, tokens, hidden, kv, k=K):
  return mtp_jax.assistant_propose(
      assistant, tokens_B=jnp.asarray(tokens.numpy(), jnp.int32), hidden_BxH=jnp.asarray(hidden.numpy()),
      shared_kv={t: (jnp.asarray(a.numpy()), jnp.asarray(b.numpy())) for t, (a, b) in kv.items()},
      lengths_B=jnp.asarray(LENGTHS, jnp.int32), k=k, embed_VxH=jnp.asarray(embed.weight.detach().numpy()),
      embed_scale=H**0.5)


@pytest.mark.parametrize("model_type, ordered", [("gemma4_assistant", False), ("gemma4_assistant", True),
                                                 ("gemma4_unified_assistant", False)])
def test_drafts_and_logits_match_transformers(tmp_path, model_type, ordered):
  model = hf_assistant(tmp_path, model_type, ordered)
  embed, tokens, hidden, kv = target_outputs()
  assistant = mtp_jax.load_assistant(tmp_path)
  assert assistant.cfg.use_ordered_embeddings == ordered and assistant.cfg.full.num_kv_heads == 1
  drafts, logits = ours(assistant, embed, tokens, hidden, kv)
  assert drafts.shape == (2, K) and drafts.dtype == jnp.int32 and logits.shape == (2, K, V)
  for b in range(len(LENGTHS)):
    want_logits, want_drafts = reference(model, embed, tokens, hidden, kv, b)
    np.testing.assert_allclose(np.asarray(logits[b]), want_logits, atol=1e-4, rtol=1e-4)
    np.testing.assert_array_equal(np.asarray(drafts[b]), want_drafts)


def test_the_sliding_window_and_lengths_matter(tmp_path):
  """The window (3, shorter than both lengths) and each row's length change the logits: the
  assistant with a window one wider, or row 0 drafted at row 1's length, differs from the reference."""
  model = hf_assistant(tmp_path)
  embed, tokens, hidden, kv = target_outputs()
  want, _ = reference(model, embed, tokens, hidden, kv, 0)
  assistant = mtp_jax.load_assistant(tmp_path)
  wider = mtp_jax.Gemma4Assistant(dataclasses.replace(assistant.cfg, sliding_window=WINDOW + 1), rngs=nnx.Rngs(0))
  nnx.update(wider, nnx.state(assistant))
  _, logits = ours(wider, embed, tokens, hidden, kv)
  assert np.abs(np.asarray(logits[0]) - want).max() > 1e-3
  _, logits = mtp_jax.assistant_propose(
      assistant, tokens_B=tokens.numpy().astype(np.int32), hidden_BxH=hidden.numpy(),
      shared_kv={t: (a.numpy(), b.numpy()) for t, (a, b) in kv.items()},
      lengths_B=np.array([LENGTHS[1]] * 2, np.int32), k=K, embed_VxH=embed.weight.detach().numpy(), embed_scale=H**0.5)
  assert np.abs(np.asarray(logits[0]) - want).max() > 1e-3


def test_bad_inputs_raise_naming_the_argument(tmp_path):
  hf_assistant(tmp_path)
  embed, tokens, hidden, kv = target_outputs()
  assistant = mtp_jax.load_assistant(tmp_path)
  good = dict(tokens_B=np.array([5, 77], np.int32), hidden_BxH=hidden.numpy(), k=2,
              shared_kv={t: (a.numpy(), b.numpy()) for t, (a, b) in kv.items()},
              lengths_B=np.array(LENGTHS, np.int32), embed_VxH=embed.weight.detach().numpy(), embed_scale=H**0.5)
  cases = [
      (dict(k=0), "k"),
      (dict(hidden_BxH=np.zeros((2, H + 1), np.float32)), "hidden_BxH"),
      (dict(lengths_B=np.array([9, 5], np.int32)), "lengths_B"),
      (dict(lengths_B=np.array([0, 5], np.int32)), "lengths_B"),
      (dict(tokens_B=np.array([5, V], np.int32)), "tokens_B"),
      (dict(tokens_B=np.array([5.0, 1.0], np.float32)), "tokens_B"),
      (dict(shared_kv={"full_attention": good["shared_kv"]["full_attention"]}), "shared_kv['sliding_attention']"),
      (dict(shared_kv={**good["shared_kv"], "full_attention": (np.zeros((2, S, 2, 16), np.float32),) * 2}),
       "shared_kv['full_attention'][0]"),
      (dict(embed_VxH=np.zeros((V, H - 1), np.float32)), "embed_VxH"),
      (dict(embed_VxH=np.zeros((V - 1, H), np.float32), tokens_B=np.array([5, 7], np.int32)), "embed_VxH"),
      (dict(embed_scale=0.0), "embed_scale"),
  ]
  for change, argument in cases:
    with pytest.raises((validate.InvalidValue, validate.InvalidType)) as err:
      mtp_jax.assistant_propose(assistant, **{**good, **change})
    assert err.value.argument == argument, (change, err.value)
  drafts, _ = mtp_jax.assistant_propose(assistant, **good)
  assert drafts.shape == (2, 2)


def test_loader_refusals(tmp_path):
  hf_assistant(tmp_path)
  from safetensors.numpy import load_file
  tensors = load_file(tmp_path / "model.safetensors")
  # A k projection of a layer (transformers drops it on load): refused, never silently unread.
  save_tensors(tmp_path / "model.safetensors", {**tensors, "model.layers.0.self_attn.k_proj.weight":
                                                np.zeros((16, D), np.float32)})
  with pytest.raises(NotImplementedError, match="k_proj.weight.*has no place"):
    mtp_jax.load_assistant(tmp_path)
  save_tensors(tmp_path / "model.safetensors", {**tensors, "lm_head.weight": tensors["model.embed_tokens.weight"] + 1})
  with pytest.raises(NotImplementedError, match="lm_head.weight differs"):
    mtp_jax.load_assistant(tmp_path)
  save_tensors(tmp_path / "model.safetensors", tensors)
  config = json.loads((tmp_path / "config.json").read_text())
  (tmp_path / "config.json").write_text(json.dumps({**config, "text_config": {**config["text_config"],
                                                                              "enable_moe_block": True}}))
  with pytest.raises(NotImplementedError, match="enable_moe_block"):
    mtp_jax.load_assistant(tmp_path)
  (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
  with pytest.raises(validate.InvalidValue, match="not a Gemma 4 assistant"):
    mtp_jax.load_assistant(tmp_path)
  (tmp_path / "config.json").write_text(json.dumps(config))
  with pytest.raises(NotImplementedError, match="load_assistant"):
    mtp_jax.load_mtp(tmp_path)
  with pytest.raises(NotImplementedError, match="has no target"):
    mtp_jax.load_target(tmp_path)
