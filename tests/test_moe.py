"""The MoE FFN against transformers' DeepseekV3MoE, Glm4MoeMoE and Qwen3NextSparseMoeBlock;
its three expert paths against each other; routing details; config validation; Block's choice."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from mtp_jax.blocks import Block, Mlp, Moe
from mtp_jax.blocks.linear import dequantize, keep_fp8
from mtp_jax.blocks.moe import route
from mtp_jax.checkpoint import Fp8Blocks
from mtp_jax.config import BlockConfig, MoeConfig, MtpConfig, TargetConfig
from mtp_jax.mtp import MtpModel

D, E, K, FE = 16, 8, 2, 12
B, T = 2, 5  # 10 rows: grouped path (10 * K > E); the gather path is checked separately
TOL = dict(rtol=2e-5, atol=2e-5)  # float32 on both sides


def block_cfg(**moe) -> BlockConfig:
  moe = {"num_experts": E, "num_experts_per_tok": K, "moe_intermediate_size": FE} | moe
  return BlockConfig(hidden_size=D, num_heads=2, num_kv_heads=1, head_dim=8, intermediate_size=24,
                     moe=MoeConfig(**moe))


def _init_torch(module: torch.nn.Module, seed: int):
  """transformers leaves expert tensors uninitialised: give every tensor a random value."""
  g = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for _, t in list(module.named_parameters()) + list(module.named_buffers()):
      t.copy_(0.3 * torch.randn(t.shape, generator=g))
  for name, t in list(module.named_parameters()) + list(module.named_buffers()):
    assert torch.isfinite(t).all(), name


def _load(moe: Moe, tensors: dict):
  """Copies name -> array (mtp_jax names under mlp.) into moe; every param must be given."""
  flat = dict(nnx.to_flat_state(nnx.state(moe, nnx.Param)))
  names = {".".join(map(str, p)): p for p in flat}
  assert set(names) == set(tensors), set(names) ^ set(tensors)
  for name, value in tensors.items():
    assert flat[names[name]][...].shape == value.shape, name
    flat[names[name]][...] = jnp.asarray(value)


def _from_torch(module: torch.nn.Module) -> dict:
  """transformers' fused experts (gate_up_proj [E, 2Fe, D], down_proj [E, D, Fe]) -> ours."""
  sd = {n: v.detach().numpy() for n, v in module.state_dict().items()}
  gate_up = sd.pop("experts.gate_up_proj")
  f = gate_up.shape[1] // 2
  sd["experts.gate_proj"] = gate_up[:, :f].transpose(0, 2, 1)
  sd["experts.up_proj"] = gate_up[:, f:].transpose(0, 2, 1)
  sd["experts.down_proj"] = sd["experts.down_proj"].transpose(0, 2, 1)
  return sd


def _compare(torch_module, cfg: BlockConfig, seed: int):
  _init_torch(torch_module, seed)
  moe = Moe(cfg, rngs=nnx.Rngs(0))
  _load(moe, _from_torch(torch_module))
  x = np.random.default_rng(seed).standard_normal((B, T, D)).astype(np.float32)
  with torch.no_grad():
    want = torch_module(torch.from_numpy(x)).numpy()
  assert np.isfinite(want).all()
  for path in (None, "gather", "dense"):
    np.testing.assert_allclose(np.asarray(moe(jnp.asarray(x), path=path)), want, **TOL, err_msg=str(path))


def test_equals_deepseek_v3():
  hf = transformers.DeepseekV3Config(hidden_size=D, n_routed_experts=E, num_experts_per_tok=K,
                                     moe_intermediate_size=FE, n_shared_experts=2, n_group=4, topk_group=2,
                                     norm_topk_prob=True, routed_scaling_factor=2.5)
  from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
  _compare(DeepseekV3MoE(hf).eval(), block_cfg(
      scoring="sigmoid", e_score_correction_bias=True, n_group=4, topk_group=2,
      routed_scaling_factor=2.5, n_shared_experts=2), seed=1)


def test_equals_glm4_moe():
  hf = transformers.Glm4MoeConfig(hidden_size=D, n_routed_experts=E, num_experts_per_tok=K,
                                  moe_intermediate_size=FE, n_shared_experts=1, n_group=1, topk_group=1,
                                  norm_topk_prob=False, routed_scaling_factor=1.5)
  from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeMoE
  _compare(Glm4MoeMoE(hf).eval(), block_cfg(
      scoring="sigmoid", e_score_correction_bias=True, norm_topk_prob=False,
      routed_scaling_factor=1.5, n_shared_experts=1), seed=2)


def test_equals_qwen3_next():
  hf = transformers.Qwen3NextConfig(hidden_size=D, num_experts=E, num_experts_per_tok=K,
                                    moe_intermediate_size=FE, shared_expert_intermediate_size=20,
                                    norm_topk_prob=True)
  from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextSparseMoeBlock
  _compare(Qwen3NextSparseMoeBlock(hf).eval(), block_cfg(
      scoring="softmax", n_shared_experts=1, shared_expert_intermediate_size=20, shared_expert_gate=True),
      seed=3)


@pytest.mark.parametrize("rows", [1, 3, 40])
def test_paths_agree(rows):
  cfg = block_cfg(scoring="sigmoid", e_score_correction_bias=True, n_group=2, topk_group=1, n_shared_experts=1)
  moe = Moe(cfg, rngs=nnx.Rngs(4))
  x = jax.random.normal(jax.random.key(5), (1, rows, D))
  want = moe(x, path="dense")
  for path in ("gather", "grouped"):
    np.testing.assert_allclose(np.asarray(moe(x, path=path)), np.asarray(want), **TOL, err_msg=path)


@pytest.mark.parametrize("rows", [1, 40])
def test_fp8_experts_equal_their_dequantized_weights_on_every_path(rows):
  """Experts kept FP8 (blocks.linear.keep_fp8, blocks of 8 x 5: partial in Fe = 12) give, on every path,
  what experts holding the dequantized weights give (float32; gather dequantizes only the chosen experts)."""
  cfg = block_cfg(n_shared_experts=1)
  moe, ref = Moe(cfg, rngs=nnx.Rngs(4)), Moe(cfg, rngs=nnx.Rngs(4))
  for name in ("gate_proj", "up_proj", "down_proj"):
    keep_fp8(moe.experts, name, Fp8Blocks(block=(8, 5), dtype="float32"))
    assert getattr(moe.experts, name)[...].dtype == jnp.float8_e4m3fn
    getattr(ref.experts, name)[...] = dequantize(getattr(moe.experts, name)[...],
                                                 getattr(moe.experts, name + "_scale_inv")[...], (8, 5), jnp.float32)
  x = jax.random.normal(jax.random.key(5), (1, rows, D))
  for path in ("gather", "grouped", "dense"):
    np.testing.assert_allclose(np.asarray(moe(x, path=path)), np.asarray(ref(x, path="dense")), **TOL, err_msg=path)


def test_path_is_chosen_by_row_count(monkeypatch):
  moe = Moe(block_cfg(), rngs=nnx.Rngs(0))
  seen = []
  call = type(moe.experts).__call__
  monkeypatch.setattr(type(moe.experts), "__call__", lambda self, *a: seen.append(a[-1]) or call(self, *a))
  moe(jnp.ones((1, 1, D)))  # 1 row * K=2 <= E=8
  moe(jnp.ones((1, 4, D)))  # 8 <= 8
  moe(jnp.ones((1, 5, D)))  # 10 > 8
  assert seen == ["gather", "gather", "grouped"]


def _route(logits, bias=None, **moe):
  cfg = MoeConfig(**({"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 4} | moe))
  weights, experts = route(cfg, jnp.asarray(logits, jnp.float32), None if bias is None else jnp.asarray(bias))
  order = np.argsort(np.asarray(experts), axis=-1)
  return np.take_along_axis(np.asarray(weights), order, -1), np.take_along_axis(np.asarray(experts), order, -1)


def test_bias_chooses_but_does_not_weigh():
  logits = np.array([[3.0, 2.0, 1.0, 0.0, -1.0, -2.0, -3.0, -4.0]])
  bias = np.array([0, 0, 0, 0, 0, 0, 5.0, 5.0], np.float32)  # pushes experts 6, 7 in
  weights, experts = _route(logits, bias, scoring="sigmoid", e_score_correction_bias=True,
                            norm_topk_prob=False, routed_scaling_factor=2.0)
  np.testing.assert_array_equal(experts, [[6, 7]])
  np.testing.assert_allclose(weights, 2.0 / (1 + np.exp([[3.0, 4.0]])), rtol=1e-6)  # unbiased sigmoid


def test_group_limited_top_k():
  # Groups of 2: {0,1} {2,3} {4,5} {6,7}. Group score = sum of its two: 1.0+0.9, 0.95+0, 0.8+0.8, 0+0.
  # With topk_group=2 the groups {0,1} and {4,5} survive, so expert 2 (0.95, the second best overall)
  # is out and the top 3 are 0, 1 and one of 4 / 5.
  scores = np.array([[1.0, 0.9, 0.95, 0.0, 0.8, 0.79, 0.0, 0.0]])
  logits = np.log(scores + 1e-3)  # softmax keeps the order
  _, experts = _route(logits, scoring="softmax", n_group=4, topk_group=2, num_experts_per_tok=3)
  np.testing.assert_array_equal(experts, [[0, 1, 4]])
  _, ungrouped = _route(logits, scoring="softmax", num_experts_per_tok=3)
  np.testing.assert_array_equal(ungrouped, [[0, 1, 2]])


def test_norm_topk_prob_and_scaling():
  logits = np.random.default_rng(0).standard_normal((4, 8))
  weights, _ = _route(logits, routed_scaling_factor=3.0)
  np.testing.assert_allclose(weights.sum(-1), 3.0, rtol=1e-6)


@pytest.mark.parametrize("field, value", [
    ("num_experts", 0), ("num_experts_per_tok", 9), ("moe_intermediate_size", -1), ("scoring", "relu"),
    ("n_group", 3), ("n_group", 8), ("topk_group", 5), ("routed_scaling_factor", 0.0),
    ("n_shared_experts", -1), ("shared_expert_intermediate_size", 0), ("shared_expert_gate", True),
    ("first_k_dense_replace", -2)])
def test_bad_config_is_refused_by_name(field, value):
  kwargs = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 4, "n_group": 4, "topk_group": 2}
  if field == "shared_expert_intermediate_size":
    kwargs["n_shared_experts"] = 1
  with pytest.raises(ValueError, match=field) as error:
    MoeConfig(**(kwargs | {field: value}))
  assert error.value.argument == f"MoeConfig.{field}"


def test_block_config_moe_round_trips_and_type_checks():
  cfg = block_cfg(n_shared_experts=1)
  assert BlockConfig(**dataclasses.asdict(cfg)) == cfg  # how a config.json reads back
  with pytest.raises(TypeError, match="moe"):
    dataclasses.replace(cfg, moe=3)


def test_first_k_dense_replace_in_targets_mtp_always_moe():
  moe = MoeConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8, first_k_dense_replace=2)
  common = dict(hidden_size=D, num_heads=2, num_kv_heads=1, head_dim=8, intermediate_size=24, vocab_size=32, moe=moe)
  from mtp_jax.target import TargetModel
  target = TargetModel(TargetConfig(num_layers=3, **common), rngs=nnx.Rngs(0))
  assert [type(layer.mlp) for layer in target.layers] == [Mlp, Mlp, Moe]
  mtp = MtpModel(MtpConfig(num_modules=2, **common), rngs=nnx.Rngs(0))
  assert [type(m.block.mlp) for m in mtp.layers] == [Moe, Moe]
  assert type(Block(dataclasses.replace(block_cfg(), moe=None), rngs=nnx.Rngs(0)).mlp) is Mlp


def _mtp_cfg(**moe):
  moe = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 6} | moe
  return MtpConfig(hidden_size=D, num_heads=2, num_kv_heads=1, head_dim=8, intermediate_size=24, vocab_size=32,
                   num_modules=2, moe=MoeConfig(**moe))


@pytest.mark.parametrize("moe", [
    dict(scoring="sigmoid", e_score_correction_bias=True, n_shared_experts=1),  # DeepSeek-V3 / GLM-4.5
    dict(n_shared_experts=1, shared_expert_intermediate_size=10, shared_expert_gate=True)],  # Qwen
    ids=["deepseek", "qwen"])
def test_released_per_expert_tensors_stack_on_load_and_unstack_on_save(tmp_path, moe):
  from mtp_jax import layouts, mtp
  from mtp_jax.checkpoint import CheckpointReader
  cfg = _mtp_cfg(**moe)
  canon = {n: np.asarray(v) for n, v in mtp.state_dict(mtp.init_mtp(cfg, seed=3)).items()}
  assert set(canon) == set(layouts.canonical_shapes(cfg))
  raw = {"model.embed_tokens.weight": canon["embed_tokens.weight"], "lm_head.weight": canon["lm_head.weight"]}
  for name, value in canon.items():
    if name.startswith("mtp."):
      _, i, rest = name.split(".", 2)
      if rest.startswith("mlp.experts."):  # released: one torch [out, in] tensor per expert
        proj = rest.rsplit(".", 1)[1]
        raw |= {f"model.layers.{i}.mlp.experts.{e}.{proj}.weight": value[e].T for e in range(value.shape[0])}
      else:
        raw[f"model.layers.{i}.{rest}"] = value
  got = layouts.to_canonical(raw, "deepseek", cfg)
  assert got.keys() == canon.keys() and all(np.array_equal(got[n], canon[n]) for n in canon)
  layouts.save_canonical(tmp_path, cfg, canon)
  with CheckpointReader(tmp_path / "model.safetensors") as reader:
    assert reader.shape("mtp.1.mlp.experts.3.down_proj.weight") == (D, 6)
    assert "mtp.1.mlp.experts.down_proj" not in set(reader.keys())
  read_cfg, read = layouts.read_mtp_checkpoint(tmp_path)
  assert read_cfg == cfg and all(np.array_equal(read[n], canon[n]) for n in canon)
  del raw["model.layers.1.mlp.experts.2.up_proj.weight"]
  with pytest.raises(ValueError, match=r"'model\.layers\.1\.mlp\.experts\.2\.up_proj\.weight'.*\(6, 16\)"):
    layouts.to_canonical(raw, "deepseek", cfg)


def test_moe_tensors_without_moe_config_are_named():
  from mtp_jax import layouts, mtp
  cfg = dataclasses.replace(_mtp_cfg(), moe=None)
  raw = {}
  for name, value in mtp.state_dict(mtp.init_mtp(cfg)).items():
    if name.startswith("mtp."):
      _, i, rest = name.split(".", 2)
      name = f"model.layers.{i}.{rest}"
    raw[name.replace("embed_tokens", "model.embed_tokens")] = np.asarray(value)
  raw["model.layers.1.mlp.gate.weight"] = np.zeros((4, D), np.float32)
  with pytest.raises(NotImplementedError, match=r"mlp\.gate\.weight.*no moe"):
    layouts.to_canonical(raw, "deepseek", cfg)


def test_bf16_model_keeps_a_float32_router():
  import mtp_jax
  cfg = dataclasses.replace(_mtp_cfg(scoring="sigmoid", e_score_correction_bias=True), dtype="bfloat16")
  tensors = {n: np.asarray(v, np.float32) for n, v in mtp_jax.state_dict(mtp_jax.init_mtp(cfg)).items()}
  tensors["mtp.0.mlp.gate.e_score_correction_bias"] = np.float32([1e-3, 1 + 2**-20, -0.3, 7.0])
  model = mtp_jax.load_state_dict(cfg, tensors)
  gate = model.layers[0].block.mlp.gate
  assert gate.weight[...].dtype == jnp.float32 and model.layers[0].block.mlp.experts.up_proj[...].dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(gate.e_score_correction_bias[...]),
                                tensors["mtp.0.mlp.gate.e_score_correction_bias"])


def test_propose_with_moe_modules_equals_full_recompute():
  """propose's drafts over a ragged batch equal a cache-free recompute of the chain; decode calls
  (6 rows x top-2 <= 16 experts) take the gather path, the prompt and the recompute the grouped one."""
  import mtp_jax
  cfg = _mtp_cfg(num_experts=16, scoring="sigmoid", e_score_correction_bias=True, n_group=4, topk_group=2,
                 n_shared_experts=1, routed_scaling_factor=2.5)
  model = mtp_jax.init_mtp(cfg, seed=2)
  rng = np.random.default_rng(0)
  for m in model.layers:
    m.block.mlp.gate.e_score_correction_bias[...] = jnp.asarray(rng.normal(0, 0.1, 16), jnp.float32)
  b, k, max_len = 2, 2, 24
  hid = [rng.standard_normal((n, D)).astype(np.float32) for n in (6, 3)]
  toks = [list(rng.integers(0, 32, len(h))) for h in hid]
  chain = jax.jit(mtp_jax.forward_chain)

  def check(drafts):
    for i in range(b):
      p = len(toks[i]) - 1
      h = np.zeros((1, max_len, D), np.float32)
      h[0, :p + 1] = hid[i]
      want = []
      for m in range(k):
        ext = np.zeros((1, max_len + cfg.num_modules - 1), np.int32)
        ext[0, :p + 1 + m] = toks[i] + want
        logits = np.asarray(chain(model, jnp.asarray(h), jnp.asarray(ext)))[m, 0, p]
        want.append(int(np.argmax(logits)))
        if want[-1] != drafts[i, m]:
          assert np.diff(np.sort(logits)[-2:])[0] < 1e-4, (i, m, drafts[i], want)  # a float near-tie
          break

  h0, t0 = np.zeros((b, 6, D), np.float32), np.zeros((b, 6), np.int32)
  for i in range(b):
    h0[i, :len(toks[i])], t0[i, :len(toks[i])] = hid[i], toks[i]
  state = mtp_jax.init_state(cfg, b, max_len)
  drafts, state = mtp_jax.propose(model, state, h0, t0, np.array([6, 3], np.int32), num_drafts=k)
  check(np.asarray(drafts))
  for accepted in ([0, 2], [2, 1]):
    state = mtp_jax.after_verify(state, np.array(accepted, np.int32))
    h1, t1 = np.zeros((b, k + 1, D), np.float32), np.zeros((b, k + 1), np.int32)
    for i, a in enumerate(accepted):
      new = [int(x) for x in np.asarray(drafts)[i, :a]] + [int(rng.integers(0, 32))]
      new_h = rng.standard_normal((a + 1, D)).astype(np.float32)
      toks[i] += new
      hid[i] = np.concatenate([hid[i], new_h])
      h1[i, :a + 1], t1[i, :a + 1] = new_h, new
    drafts, state = mtp_jax.propose(model, state, h1, t1, np.array(accepted, np.int32) + 1, num_drafts=k)
    check(np.asarray(drafts))


def _sharded_runs() -> dict:
  """Child process body (4 fake CPU devices): sharded vs single-device MoE MTP chain."""
  import json
  from mtp_jax import mtp, sharding
  cfg = _mtp_cfg(scoring="sigmoid", e_score_correction_bias=True, n_shared_experts=2, n_group=2, topk_group=1)
  model = mtp.init_mtp(cfg, seed=1)
  rng = np.random.default_rng(0)
  inputs = {"gather": (rng.standard_normal((1, 1, D)), rng.integers(0, 32, (1, 2))),  # 1 row: gather
            "grouped": (rng.standard_normal((2, 8, D)), rng.integers(0, 32, (2, 9)))}  # 16 rows
  chain = jax.jit(mtp.forward_chain)
  want = {k: chain(model, jnp.asarray(h, jnp.float32), jnp.asarray(t, jnp.int32)) for k, (h, t) in inputs.items()}
  out = {}
  for data, m in ((1, 4), (2, 2)):
    mesh = sharding.make_mesh(data, m)
    sharded = sharding.shard_params(model, mesh)
    experts = sharded.layers[0].block.mlp.experts
    run = {"spec": list(experts.gate_proj[...].sharding.spec),
           "shard": list(experts.down_proj[...].addressable_shards[0].data.shape),
           "shared_spec": list(sharded.layers[0].block.mlp.shared_experts.down_proj.weight[...].sharding.spec),
           "router_spec": list(sharded.layers[0].block.mlp.gate.weight[...].sharding.spec)}
    for k, (h, t) in inputs.items():
      got = chain(sharded, jnp.asarray(h, jnp.float32), jnp.asarray(t, jnp.int32))
      run[k] = float(jnp.max(jnp.abs(got - want[k])))
    out[f"{data}x{m}"] = run
  print(json.dumps(out))


def test_experts_shard_over_model_axis():
  import os
  import subprocess
  import sys
  import json
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"  # keeps conftest's
  env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu",
             PYTHONPATH=os.pathsep.join([root] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
  r = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=900)
  assert r.returncode == 0, r.stderr[-4000:]
  runs = json.loads(r.stdout.strip().splitlines()[-1])
  for mesh, m in (("1x4", 4), ("2x2", 2)):
    run = runs[mesh]
    assert run["spec"] == ["model", None, None]  # E = 4 experts split by expert
    assert run["shard"] == [4 // m, 6, D]
    assert run["shared_spec"] == [None, "model"] and run["router_spec"] == []
    assert run["gather"] < 1e-5 and run["grouped"] < 1e-5, run


@pytest.mark.slow
def test_bench_moe_quick(capsys):
  import pathlib
  import sys
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
  import bench_moe
  bench_moe.main(["--quick"])  # asserts the three paths agree before timing them
  out = capsys.readouterr().out
  assert "| gather (chosen experts only) | 2 | " in out and "| dense (every expert) | 16 | " in out


if __name__ == "__main__":
  _sharded_runs()
