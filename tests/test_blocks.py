"""Attention variants against transformers' modules on tiny random configs (float32).

Each case copies a random torch module's weights into the NNX module by name, then checks the
cache-free prefill and a ragged cached run (chunks of T > 1 and single-row decode) row by row
against the torch full-sequence forward.
"""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from block_refs import B, T, copy_into, full_rows, randomize, run_cached, torch_mask
from mtp_jax.blocks import Attention, MlaAttention, RMSNorm, init_cache
from mtp_jax.blocks.rope import inv_frequencies
from mtp_jax.config import BlockConfig, MlaConfig, RopeScaling

D, H, DH = 32, 4, 8
ATOL = 2e-5


def _check(ours_cfg, attn_torch, rotary, window=None, cls=Attention, prefill_kwargs=({},)):
  """Compares cls(ours_cfg) with attn_torch (weights copied) on prefill and cached runs."""
  randomize(attn_torch)
  attn = cls(ours_cfg, rngs=nnx.Rngs(0))
  copy_into(attn, attn_torch)
  x = np.random.default_rng(1).standard_normal((B, T, D)).astype(np.float32)
  with torch.no_grad():
    xt = torch.from_numpy(x)
    pos = torch.arange(T)[None].expand(B, T)
    want = attn_torch(xt, position_embeddings=rotary(xt, pos),
                      attention_mask=torch_mask(T, window))[0].numpy()
  rows, valid = full_rows(B, T)
  for kwargs in prefill_kwargs:
    got, _ = attn(jnp.asarray(x), rows, valid, None, **kwargs)
    np.testing.assert_allclose(np.asarray(got), want, atol=ATOL, rtol=1e-4, err_msg=str(kwargs))
  cached = run_cached(lambda x, r, v, c: attn(x, r, v, c), init_cache(ours_cfg, B, T + 2), x)
  np.testing.assert_allclose(cached, want, atol=ATOL, rtol=1e-4)


def test_glm4_moe_attention_bias_qk_norm_partial_rotary():
  from transformers.models.glm4_moe import modeling_glm4_moe as m
  cfg = m.Glm4MoeConfig(hidden_size=D, num_attention_heads=H, num_key_value_heads=2, head_dim=DH,
                        attention_bias=True, use_qk_norm=True, partial_rotary_factor=0.5)
  cfg._attn_implementation = "eager"
  ours = BlockConfig(hidden_size=D, num_heads=H, num_kv_heads=2, head_dim=DH, intermediate_size=8,
                     rms_norm_eps=cfg.rms_norm_eps, attention_bias=True, qk_norm=True,
                     partial_rotary_factor=0.5)
  _check(ours, m.Glm4MoeAttention(cfg, 0), m.Glm4MoeRotaryEmbedding(cfg))


@pytest.mark.parametrize("bias", [False, True])
def test_qwen3_next_gated_attention(bias):
  from transformers.models.qwen3_next import modeling_qwen3_next as m
  cfg = m.Qwen3NextConfig(hidden_size=D, num_attention_heads=H, num_key_value_heads=1, head_dim=DH,
                          attention_bias=bias)
  cfg._attn_implementation = "eager"
  ours = BlockConfig(hidden_size=D, num_heads=H, num_kv_heads=1, head_dim=DH, intermediate_size=8,
                     rms_norm_eps=cfg.rms_norm_eps, attention_bias=bias, attention_out_bias=bias,
                     qk_norm=True, norm_unit_offset=True, attention_gate=True,
                     partial_rotary_factor=cfg.rope_parameters["partial_rotary_factor"])
  _check(ours, m.Qwen3NextAttention(cfg, 3), m.Qwen3NextRotaryEmbedding(cfg))


@pytest.mark.parametrize("dv, value_scale", [(12, None), (8, 0.707)])
def test_mimo_v2_flash_sliding_window_sinks(dv, value_scale):
  """A sliding layer (kv heads doubled there) with sinks; values of their own width and scaled, as
  released (v_head_dim 128 vs head_dim 192, attention_value_scale 0.707)."""
  from transformers.models.mimo_v2_flash import modeling_mimo_v2_flash as m
  dh, window = 12, 3
  cfg = m.MiMoV2FlashConfig(hidden_size=D, num_attention_heads=H, num_key_value_heads=1, head_dim=dh,
                            v_head_dim=dv, num_hidden_layers=2, sliding_window=window,
                            layer_types=["full_attention", "sliding_attention"],
                            attention_value_scale=value_scale)
  cfg._attn_implementation = "eager"
  rope = cfg.rope_parameters["sliding_attention"]
  ours = BlockConfig(hidden_size=D, num_heads=H, num_kv_heads=2, head_dim=dh, intermediate_size=8,
                     rope_theta=rope["rope_theta"], partial_rotary_factor=rope["partial_rotary_factor"],
                     sliding_window=window, attention_sinks=True, v_head_dim=dv,
                     attention_value_scale=value_scale)
  rotary = m.MiMoV2FlashRotaryEmbedding(cfg)
  _check(ours, m.MiMoV2FlashAttention(cfg, 1), lambda x, p: rotary(x, p, "sliding_attention"),
         window=window)


@pytest.mark.parametrize("q_lora_rank, bias, interleave", [(16, False, True), (None, True, False)])
def test_deepseek_v3_mla_yarn(q_lora_rank, bias, interleave):
  from transformers.models.deepseek_v3 import modeling_deepseek_v3 as m
  yarn = dict(factor=4.0, original_max_position_embeddings=16, mscale=1.0, mscale_all_dim=1.0)
  mla = MlaConfig(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
                  q_lora_rank=q_lora_rank)
  cfg = m.DeepseekV3Config(hidden_size=D, num_attention_heads=H, num_key_value_heads=H,
                           max_position_embeddings=64, attention_bias=bias, rope_interleave=interleave,
                           rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, **yarn),
                           **{f.name: getattr(mla, f.name) for f in dataclasses.fields(mla)})
  cfg._attn_implementation = "eager"
  ours = BlockConfig(hidden_size=D, num_heads=H, num_kv_heads=H, head_dim=4, intermediate_size=8,
                     attention_bias=bias, rope_interleave=interleave, mla=mla,
                     rope_scaling=RopeScaling(**yarn))
  # Both forms on the prefill; the cached run decodes absorbed (T <= 3 here).
  _check(ours, m.DeepseekV3Attention(cfg, 0), m.DeepseekV3RotaryEmbedding(cfg), cls=MlaAttention,
         prefill_kwargs=({"absorb": False}, {"absorb": True}))
  assert MlaAttention(ours, rngs=nnx.Rngs(0)).absorbs(3)


def test_zero_centred_rmsnorm_matches_qwen3_next():
  from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNorm
  ref = Qwen3NextRMSNorm(DH, eps=1e-6)
  randomize(ref)
  ours = RMSNorm(DH, eps=1e-6, unit_offset=True)
  np.testing.assert_array_equal(np.asarray(ours.weight[...]), 0.0)  # fresh: identity scale
  copy_into(ours, ref)
  x = np.random.default_rng(0).standard_normal((2, 3, DH)).astype(np.float32)
  with torch.no_grad():
    want = ref(torch.from_numpy(x)).numpy()
  np.testing.assert_allclose(np.asarray(ours(jnp.asarray(x))), want, atol=1e-6)


@pytest.mark.parametrize("fields", [
    dict(factor=4.0, original_max_position_embeddings=16, mscale=1.0, mscale_all_dim=0.707),
    dict(original_max_position_embeddings=16, max_position_embeddings=64, beta_fast=16.0),
    dict(factor=8.0, original_max_position_embeddings=32, truncate=False, attention_factor=1.3),
])
def test_yarn_frequencies_match_transformers(fields):
  from transformers import DeepseekV3Config
  from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
  hf = {k: v for k, v in fields.items() if k != "max_position_embeddings"}
  cfg = DeepseekV3Config(qk_rope_head_dim=16, max_position_embeddings=fields.get("max_position_embeddings", 64),
                         rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, **hf)
                         | ({"factor": None} if "factor" not in fields else {}))
  want_freq, want_factor = ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")
  got_freq, got_factor = inv_frequencies(16, 10000.0, RopeScaling(**fields))
  np.testing.assert_allclose(got_freq, want_freq.numpy(), rtol=1e-6)
  assert got_factor == pytest.approx(want_factor)


def test_unsupported_settings_fail_at_config_time():
  base = dict(hidden_size=D, num_heads=H, num_kv_heads=2, head_dim=DH, intermediate_size=8)
  with pytest.raises(ValueError, match="rope_scaling.rope_type 'longrope'"):
    BlockConfig(**base, rope_scaling=dict(rope_type="longrope", original_max_position_embeddings=8))
  with pytest.raises(ValueError, match="partial_rotary_factor"):
    BlockConfig(**base, partial_rotary_factor=1.5)
  with pytest.raises(ValueError, match="rotary dims"):
    BlockConfig(**base, partial_rotary_factor=0.2)
  with pytest.raises(ValueError, match="sliding_window"):
    BlockConfig(**base, sliding_window=0)
  for field, bad in [("v_head_dim", 0), ("attention_value_scale", 0.0), ("attention_value_scale", float("inf"))]:
    with pytest.raises(ValueError, match=field) as e:
      BlockConfig(**base, **{field: bad})
    assert e.value.argument == f"BlockConfig.{field}"
  with pytest.raises(ValueError, match="v_head_dim .6. must equal head_dim .8. with attention_gate"):
    BlockConfig(**base, attention_gate=True, v_head_dim=6)
  mla = MlaConfig(kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=2, v_head_dim=4)
  with pytest.raises(ValueError, match="v_head_dim, attention_value_scale cannot be combined with mla"):
    BlockConfig(**base, mla=mla, v_head_dim=6, attention_value_scale=0.5)


def test_mla_config_and_weights_round_trip_through_a_checkpoint(tmp_path):
  import mtp_jax
  cfg = mtp_jax.MtpConfig(hidden_size=D, num_heads=H, num_kv_heads=H, head_dim=4, intermediate_size=8,
                          vocab_size=11, num_modules=1, rope_interleave=True,
                          mla=MlaConfig(kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=2, v_head_dim=4,
                                        q_lora_rank=6),
                          rope_scaling=RopeScaling(factor=2.0, original_max_position_embeddings=8))
  model = mtp_jax.init_mtp(cfg, seed=1)
  tensors = {k: np.asarray(v) for k, v in mtp_jax.state_dict(model).items()}
  assert "mtp.0.self_attn.kv_a_proj_with_mqa.weight" in tensors and "mtp.0.self_attn.q_proj.weight" not in tensors
  mtp_jax.layouts.save_canonical(tmp_path, cfg, tensors)
  cfg2, tensors2 = mtp_jax.layouts.read_mtp_checkpoint(tmp_path)
  assert cfg2 == cfg
  loaded = mtp_jax.state_dict(mtp_jax.load_state_dict(cfg2, tensors2))
  for name, value in tensors.items():
    np.testing.assert_array_equal(np.asarray(loaded[name]), value)
