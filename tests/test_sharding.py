"""Sharding over a ("data", "model") mesh: sharded propose / generate give the single-device results.

pytest's process has one CPU device, so the sharded runs happen in a child process started with
XLA_FLAGS=--xla_force_host_platform_device_count=4: this file run as a script (`python
tests/test_sharding.py propose|generate|mla|load|fp8 [DIR]`) prints one JSON line that the tests check.
The two-process test launches examples/distributed_loopback.py workers on 127.0.0.1. Sharded loading
reads a tiny GLM-4.5-shaped released directory written by benchmarks/bench_sharded_load.py, and a tiny
block-scaled FP8 DeepSeek-V3 one written by tests/test_pretrained.py.
"""

import json
import os
import pathlib
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

import mtp_jax
from mtp_jax import sharding

ROOT = pathlib.Path(__file__).resolve().parents[1]
MESHES = [(2, 2), (4, 1), (1, 4)]
K, B = 2, 4


def _env(devices: int) -> dict:
  path = os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
  flags = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={devices}"  # keeps conftest's
  return dict(os.environ, XLA_FLAGS=flags, PYTHONPATH=path, JAX_PLATFORMS="cpu")


def _child(what: str, *args: str, timeout_s: float = 300) -> dict:
  r = subprocess.run([sys.executable, __file__, what, *args], env=_env(4), capture_output=True, text=True,
                     timeout=timeout_s)
  assert r.returncode == 0, f"child {what!r} failed:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
  return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def propose_runs():
  return _child("propose")


@pytest.mark.parametrize("mesh", MESHES, ids=lambda m: f"{m[0]}x{m[1]}")
def test_sharded_drafts_equal_single_device(propose_runs, mesh):
  run = propose_runs[f"{mesh[0]}x{mesh[1]}"]
  want = np.array(propose_runs["single"])
  assert want.shape == (4, B, K)
  np.testing.assert_array_equal(np.array(run["drafts"]), want)


@pytest.mark.parametrize("mesh", MESHES, ids=lambda m: f"{m[0]}x{m[1]}")
def test_params_and_output_states_are_sharded(propose_runs, mesh):
  data, model = mesh
  run = propose_runs[f"{data}x{model}"]
  heads_split = 2 % model == 0  # num_kv_heads = 2
  kv_spec = ["data", None, "model" if heads_split else None, None]
  assert run["state_in"]["kv"] == kv_spec
  # After propose / after_verify the caches came out of jit still split, not gathered.
  assert run["state_out"]["kv_equivalent"] is True
  assert run["state_out"]["kv_shard"] == [B // data, 32, 2 // model if heads_split else 2, 8]
  assert run["state_out"]["num_pos_shard"] == [B // data]
  assert run["state_out"]["lengths_shard"] == [K, B // data]
  q, kproj, o, gate, down = (run["params"][n] for n in ("q_proj", "k_proj", "o_proj", "gate_proj", "down_proj"))
  assert q == {"spec": ["model", None], "shard": [32 // model, 32]}  # H * Dh = 32 rows
  assert o == {"spec": [None, "model"], "shard": [32, 32 // model]}
  assert gate == {"spec": ["model", None], "shard": [64 // model, 32]}
  assert down == {"spec": [None, "model"], "shard": [32, 64 // model]}
  assert kproj == ({"spec": ["model", None], "shard": [16 // model, 32]} if heads_split
                   else {"spec": [], "shard": [16, 32]})
  assert run["params"]["embed_tokens"] == {"spec": [], "shard": [48, 32]}
  assert run["params"]["lm_head"] == {"spec": [], "shard": [48, 32]}


def test_shard_state_under_jit_constrains(propose_runs):
  assert propose_runs["jit_state"] == {"kv_equivalent": True, "kv_shard": [2, 32, 1, 8]}


def test_batch_not_divisible_stays_replicated(propose_runs):
  odd = propose_runs["odd_batch"]
  assert odd["kv"] == [None, None, "model", None]
  assert not any(odd["lengths"])  # int32[K, B=3]: nothing split
  assert odd["batch_input"] == [None, None]


@pytest.mark.slow
def test_sharded_generate_equals_unsharded():
  runs = _child("generate")
  assert runs["sharded"] == runs["single"]
  assert runs["accepted"] > 0  # drafts were accepted, so the comparison covered the chain


@pytest.mark.slow
def test_sharded_mla_drafts_equal_single_device():
  run = _child("mla")
  assert run["single"] == run["sharded"]
  assert run["params"] == {"q_a_proj": [], "q_b_proj": ["model", None], "kv_a_proj_with_mqa": [],
                           "kv_b_proj": ["model", None], "o_proj": [None, "model"]}
  # every head reads the whole latent: split by batch only
  assert run["latent_by_batch_only"]


@pytest.mark.slow
def test_sharded_paged_propose_and_target_step_equal_single_device():
  run = _child("paged")
  assert run["single"] == run["sharded"]
  assert run["mla_single"] == run["mla_sharded"]
  assert run["target_equal"]
  # Pools split by KV heads on "model" (never by batch: any slot may hold any page); the
  # allocator replicated; MLA's latent pools replicated.
  assert run["pool_spec"] == [None, None, "model", None]
  assert not any(run["table_spec"]) and not any(run["mla_pool_spec"])


def test_errors():
  with pytest.raises(ValueError, match=r"data \* model must equal the number of devices"):
    sharding.make_mesh(2, jax.device_count())
  with pytest.raises(ValueError, match="model must be a positive int"):
    sharding.make_mesh(1, 0)
  mesh = sharding.make_mesh(1, 1)
  assert mesh.axis_names == ("data", "model")
  cfg = mtp_jax.MtpConfig(vocab_size=8, hidden_size=8, num_heads=2, num_kv_heads=1, head_dim=4,
                          intermediate_size=8, num_modules=1)
  with pytest.raises(TypeError, match="model must be an MtpModel or TargetModel"):
    sharding.param_specs({"w": np.zeros(2)}, mesh)
  with pytest.raises(TypeError, match="state must be a ProposerState or TargetState"):
    sharding.state_specs({"kv": np.zeros(2)}, mesh)
  other = jax.make_mesh((1,), ("batch",))
  with pytest.raises(ValueError, match=r"axes \('data', 'model'\)"):
    sharding.param_specs(mtp_jax.init_mtp(cfg), other)
  with pytest.raises(ValueError, match="leading batch axis"):
    sharding.shard_batch(np.float32(1), mesh)


def test_param_without_logical_axes_is_refused_by_name():
  cfg = mtp_jax.MtpConfig(vocab_size=8, hidden_size=8, num_heads=2, num_kv_heads=1, head_dim=4,
                          intermediate_size=8, num_modules=1)
  mesh = sharding.make_mesh(1, 1, jax.devices()[:1])
  model = mtp_jax.init_mtp(cfg)
  assert sharding.param_specs(model, mesh).layers[0].enorm.weight.get_value() == jax.sharding.PartitionSpec()
  model.layers[0].enorm.weight = nnx.Param(np.ones(8, np.float32))  # created without its logical axes
  with pytest.raises(ValueError, match=r"param layers\.0\.enorm\.weight of MtpModel .*declares no logical axes"):
    sharding.param_specs(model, mesh)
  with pytest.raises(ValueError, match=r"param layers\.0\.enorm\.weight"):
    sharding.shard_params(model, mesh)
  with pytest.raises(ValueError, match="unknown logical axis 'hidden'"):
    sharding.logical_spec(("hidden",), (8,), mesh)


@pytest.fixture(scope="module")
def load_runs():
  return _child("load")


def test_sharded_load_equals_unsharded(load_runs):
  # Every param read block by block equals the whole-tensor read, on both meshes.
  assert load_runs["params_equal"] == {"2x2": True, "1x2x2": True}
  assert load_runs["sharded"] == load_runs["single"]  # greedy speculative decoding, token for token
  assert load_runs["accepted"] > 0


def test_sharded_load_places_experts_on_the_expert_axis(load_runs):
  e, fe, d = 4, 16, 32
  # 2 x 2 mesh: experts over "model"; data x expert x model: over "expert", their width over "model".
  assert load_runs["experts"]["2x2"] == {"spec": ["model", None, None], "shard": [e // 2, d, fe]}
  assert load_runs["experts"]["1x2x2"] == {"spec": ["expert", None, "model"], "shard": [e // 2, d, fe // 2]}
  assert load_runs["q_proj"] == {"spec": ["model", None], "shard": [16, 32]}  # 4 heads x 8 split in 2
  assert load_runs["router"] == []
  assert load_runs["expert_mesh_logits_error"] < 1e-4  # the expert-split target computes the same logits


def test_block_outputs_constrained_under_use_mesh(load_runs):
  # Replicated tokens in: the hidden comes out split by batch only because the blocks say so.
  assert load_runs["hidden_by_batch"] == {"use_mesh": True, "without": False}


def test_sharded_fp8_load_equals_unsharded(tmp_path):
  """An FP8 DeepSeek-V3 directory (16 x 12 scale blocks) loaded with mesh=: each device's block of a
  weight is dequantized with the scale blocks it covers, also where a block starts inside a scale
  block (q_b_proj's 48 rows split at 24, experts' 16 rows at 8), and every param equals the unsharded load.
  With quantized="fp8" too: the float8 values and their scales equal the unsharded FP8-kept load's, and the
  expert-split FP8-kept target's logits the unsharded dequantized one's."""
  from test_pretrained import _quantize_directory, tiny_deepseek

  tiny_deepseek(tmp_path)
  assert _quantize_directory(tmp_path) > 20
  run = _child("fp8", str(tmp_path))
  assert run["params_equal"] == {"2x2": True, "1x2x2": True}
  assert run["q_b_proj"] == {"spec": ["model", None], "shard": [24, 24]}
  assert run["experts"] == {"spec": ["expert", None, "model"], "shard": [2, 32, 8]}
  # quantized="fp8": the float8 weights shard as before; their scales only by expert, else replicated.
  assert run["fp8_params_equal"] == {"2x2": True, "1x2x2": True}
  assert run["fp8_q_b_proj"] == {"spec": ["model", None], "shard": [24, 24], "dtype": "float8_e4m3fn"}
  assert run["fp8_q_b_proj_scales"] == {"spec": [], "shard": [3, 2], "dtype": "float32"}
  assert run["fp8_experts"] == {"spec": ["expert", None, "model"], "shard": [2, 32, 8], "dtype": "float8_e4m3fn"}
  assert run["fp8_experts_scales"] == {"spec": ["expert", None, None], "shard": [2, 3, 1], "dtype": "float32"}
  assert run["fp8_logits_error"] < 1e-5  # the sharded FP8-kept target against the unsharded dequantized one


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_on_loopback():
  script = ROOT / "examples" / "distributed_loopback.py"
  port = _free_port()
  procs = [subprocess.Popen([sys.executable, str(script), "--worker", "--process-id", str(i), "--port", str(port)],
                            env=_env(2), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
           for i in range(2)]
  outs = []
  try:
    for p in procs:
      outs.append(p.communicate(timeout=300))
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
  for i, (p, (out, err)) in enumerate(zip(procs, outs)):
    assert p.returncode == 0, f"process {i} failed:\n{out[-2000:]}\n{err[-4000:]}"
    assert f"process {i}/2: 4 devices (2 local)" in out
    assert "drafts match the single-device run" in out
    assert "local shard (2, 32, 1, 8)" in out  # batch and KV heads both split across the 4 devices


# ---- the child process (4 CPU devices) ----

def _spec(x) -> list:
  return list(x.sharding.spec)


def _shard_shape(x) -> list:
  return list(x.addressable_shards[0].data.shape)


def _laid_out_as(x, mesh, spec) -> bool:
  return x.sharding.is_equivalent_to(jax.sharding.NamedSharding(mesh, spec), x.ndim)


def _propose_child() -> dict:
  sys.path.insert(0, str(ROOT / "examples"))
  from distributed_loopback import BATCH, MAX_LEN, drive

  assert (BATCH, MAX_LEN) == (B, 32)
  cfg = mtp_jax.MtpConfig(vocab_size=48, hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8,
                          intermediate_size=64, num_modules=K)
  params = mtp_jax.init_mtp(cfg, seed=5)
  result = {"single": drive(params, mtp_jax.init_state(cfg, B, MAX_LEN), np.asarray, np.asarray)[0].tolist()}
  for data, model in MESHES:
    mesh = sharding.make_mesh(data, model)
    sparams = sharding.shard_params(params, mesh)
    state = sharding.shard_state(mtp_jax.init_state(cfg, B, MAX_LEN), mesh)
    drafts, out = drive(sparams, state, lambda x: sharding.shard_batch(x, mesh), np.asarray,
                        lambda s: sharding.shard_state(s, mesh))
    attn, mlp = sparams.layers[0].block.self_attn, sparams.layers[0].block.mlp
    weights = dict(q_proj=attn.q_proj, k_proj=attn.k_proj, o_proj=attn.o_proj, gate_proj=mlp.gate_proj,
                   down_proj=mlp.down_proj, embed_tokens=sparams.embed_tokens, lm_head=sparams.lm_head)
    kv = out.kv[-1].k
    result[f"{data}x{model}"] = {
        "drafts": drafts.tolist(),
        "state_in": {"kv": _spec(state.kv[0].k)},
        "state_out": {"kv_equivalent": _laid_out_as(kv, mesh, sharding.state_specs(state, mesh).kv[-1].k),
                      "kv_shard": _shard_shape(kv),
                      "num_pos_shard": _shard_shape(out.num_pos), "lengths_shard": _shard_shape(out.lengths)},
        "params": {n: {"spec": _spec(w.weight[...]), "shard": _shard_shape(w.weight[...])}
                   for n, w in weights.items()},
    }
  mesh = sharding.make_mesh(2, 2)
  state = jax.jit(lambda: sharding.shard_state(mtp_jax.init_state(cfg, B, MAX_LEN), mesh))()
  kv = state.kv[0].k
  result["jit_state"] = {"kv_equivalent": _laid_out_as(kv, mesh, sharding.state_specs(state, mesh).kv[0].k),
                         "kv_shard": _shard_shape(kv)}
  odd = sharding.state_specs(mtp_jax.init_state(cfg, 3, 8), mesh)
  result["odd_batch"] = {"kv": list(odd.kv[0].k), "lengths": list(odd.lengths),
                         "batch_input": _spec(sharding.shard_batch(np.zeros((3, 2)), mesh))}
  return result


def _mla_child() -> dict:
  sys.path.insert(0, str(ROOT / "examples"))
  from distributed_loopback import MAX_LEN, drive

  mla = mtp_jax.MlaConfig(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, q_lora_rank=12)
  cfg = mtp_jax.MtpConfig(vocab_size=48, hidden_size=32, num_heads=4, num_kv_heads=4, head_dim=8,
                          intermediate_size=64, num_modules=K, mla=mla, rope_interleave=True)
  params = mtp_jax.init_mtp(cfg, seed=5)
  single = drive(params, mtp_jax.init_state(cfg, B, MAX_LEN), np.asarray, np.asarray)[0]
  mesh = sharding.make_mesh(2, 2)
  sparams = sharding.shard_params(params, mesh)
  state = sharding.shard_state(mtp_jax.init_state(cfg, B, MAX_LEN), mesh)
  drafts, out = drive(sparams, state, lambda x: sharding.shard_batch(x, mesh), np.asarray,
                      lambda s: sharding.shard_state(s, mesh))
  attn = sparams.layers[0].block.self_attn
  return {"single": single.tolist(), "sharded": drafts.tolist(),
          "params": {n: _spec(getattr(attn, n).weight[...])
                     for n in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")},
          "latent_by_batch_only": all(_laid_out_as(x, mesh, jax.sharding.PartitionSpec("data", None, None))
                                      for x in (out.kv[0].latent, out.kv[0].k_rope))}


def _paged_child() -> dict:
  sys.path.insert(0, str(ROOT / "examples"))
  from distributed_loopback import MAX_LEN, drive

  common = dict(vocab_size=48, hidden_size=32, num_heads=4, head_dim=8, intermediate_size=64)
  mla = mtp_jax.MlaConfig(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, q_lora_rank=12)
  mesh = sharding.make_mesh(2, 2)
  place, settle = (lambda x: sharding.shard_batch(x, mesh)), (lambda s: sharding.shard_state(s, mesh))
  result = {}
  for name, cfg in (("", mtp_jax.MtpConfig(num_kv_heads=2, num_modules=K, **common)),
                    ("mla_", mtp_jax.MtpConfig(num_kv_heads=4, num_modules=K, mla=mla, rope_interleave=True,
                                               **common))):
    params = mtp_jax.init_mtp(cfg, seed=5)
    paged = lambda: mtp_jax.init_state(cfg, B, MAX_LEN, page_size=8, num_pages=3 * B)
    result[name + "single"] = drive(params, paged(), np.asarray, np.asarray)[0].tolist()
    drafts, out = drive(sharding.shard_params(params, mesh), settle(paged()), place, np.asarray, settle)
    result[name + "sharded"] = drafts.tolist()
    placed = settle(out)
    result[name + "pool_spec"] = _spec(placed.kv[0].latent if cfg.mla else placed.kv[0].k)
    result["table_spec"] = _spec(placed.pages.table)
  tcfg = mtp_jax.TargetConfig(num_layers=2, num_kv_heads=2, **common)
  target = mtp_jax.init_target(tcfg, seed=1)
  rng = np.random.default_rng(0)
  chunks = [(rng.integers(0, 48, (B, 6)).astype(np.int32), rng.integers(1, 7, B).astype(np.int32)) for _ in range(3)]
  logits = []
  for model, state, put in ((target, mtp_jax.init_target_state(tcfg, B, 32, page_size=4, num_pages=4 * B), np.asarray),
                            (sharding.shard_params(target, mesh),
                             settle(mtp_jax.init_target_state(tcfg, B, 32, page_size=4, num_pages=4 * B)), place)):
    got = []
    for toks, n in chunks:
      out_logits, _, state = mtp_jax.target_step(model, state, put(toks), put(n))
      got.append(np.where((np.arange(6)[None] < n[:, None])[..., None], np.asarray(out_logits), 0))
    logits.append(got)
  result["target_equal"] = all(np.allclose(a, b, atol=1e-5, rtol=1e-5) for a, b in zip(*logits))
  return result


def _generate_child() -> dict:
  common = dict(vocab_size=16, hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=64)
  target = mtp_jax.init_target(mtp_jax.TargetConfig(num_layers=1, **common), 0)
  proposer = mtp_jax.init_mtp(mtp_jax.MtpConfig(num_modules=K, **common), 1)
  prompts = [[1, 2, 3], [4, 0, 1, 2, 3, 4, 0, 1], [3], [5, 5, 6]]
  single = mtp_jax.generate(target, proposer, prompts, 20, num_drafts=K)
  mesh = sharding.make_mesh(2, 2)
  sharded = mtp_jax.generate(sharding.shard_params(target, mesh), sharding.shard_params(proposer, mesh),
                             prompts, 20, num_drafts=K, mesh=mesh)
  return {"single": single.tokens, "sharded": sharded.tokens, "accepted": sharded.stats["accepted_tokens"]}


def _load_child() -> dict:
  import tempfile

  sys.path.insert(0, str(ROOT / "benchmarks"))
  from bench_sharded_load import glm_config, write_released

  P = jax.sharding.PartitionSpec
  path = tempfile.mkdtemp()
  write_released(path, glm_config(vocab=64, hidden=32, layers=2, ffn=64, experts=4, expert_ffn=16, heads=4,
                                  kv_heads=2), dtype="bfloat16")
  target, proposer, _ = mtp_jax.from_pretrained(path, dtype="float32")
  meshes = {"2x2": sharding.make_mesh(2, 2), "1x2x2": sharding.make_mesh(1, 2, expert=2)}
  loaded = {k: mtp_jax.from_pretrained(path, dtype="float32", mesh=m)[:2] for k, m in meshes.items()}
  leaves = lambda models: [np.asarray(x) for x in jax.tree.leaves(models)]
  equal = {k: all(np.array_equal(a, b) for a, b in zip(leaves((target, proposer)), leaves(v), strict=True))
           for k, v in loaded.items()}
  mesh = meshes["2x2"]
  st, sp = loaded["2x2"]
  prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9], [10, 11, 12, 13]]
  single = mtp_jax.generate(target, proposer, prompts, 12, num_drafts=1)
  sharded = mtp_jax.generate(st, sp, prompts, 12, num_drafts=1, mesh=mesh)
  tokens = np.array([[1, 2, 3], [4, 5, 6], [7, 8, 9], [10, 11, 12]], np.int32)
  rows, valid = np.broadcast_to(np.arange(3, dtype=np.int32), (4, 3)), np.ones((4, 3), bool)
  hidden = lambda m: jax.jit(lambda m: m(tokens, rows, valid, None)[1])(m)
  with sharding.use_mesh(mesh):
    constrained = hidden(st)
  # 12 rows x 2 experts each > 4 experts: the MoE layer takes the grouped (ragged_dot) path.
  logits = lambda m: np.asarray(jax.jit(lambda m: m(tokens, rows, valid, None)[0])(m))
  expert_mesh_error = float(np.max(np.abs(logits(loaded["1x2x2"][0]) - logits(target))))
  by_batch = lambda x: x.sharding.is_equivalent_to(jax.sharding.NamedSharding(mesh, P("data", None, None)), 3)
  w = lambda x: {"spec": _spec(x), "shard": _shard_shape(x)}
  return {"params_equal": equal, "single": single.tokens, "sharded": sharded.tokens,
          "accepted": sharded.stats["accepted_tokens"],
          "experts": {k: w(t.layers[1].mlp.experts.gate_proj[...]) for k, (t, _) in loaded.items()},
          "q_proj": w(st.layers[0].self_attn.q_proj.weight[...]), "router": _spec(st.layers[1].mlp.gate.weight[...]),
          "hidden_by_batch": {"use_mesh": by_batch(constrained), "without": by_batch(hidden(st))},
          "expert_mesh_logits_error": expert_mesh_error}


def _fp8_child(path: str) -> dict:
  target, proposer, _ = mtp_jax.from_pretrained(path, dtype="float32")
  meshes = {"2x2": sharding.make_mesh(2, 2), "1x2x2": sharding.make_mesh(1, 2, expert=2)}
  loaded = {k: mtp_jax.from_pretrained(path, dtype="float32", mesh=m)[:2] for k, m in meshes.items()}
  leaves = lambda models: [np.asarray(x) for x in jax.tree.leaves(models)]
  equal = {k: all(np.array_equal(a, b) for a, b in zip(leaves((target, proposer)), leaves(v), strict=True))
           for k, v in loaded.items()}
  w = lambda x: {"spec": _spec(x), "shard": _shard_shape(x)}
  fp8 = {k: mtp_jax.from_pretrained(path, dtype="float32", mesh=m, quantized="fp8")[:2] for k, m in meshes.items()}
  unsharded = mtp_jax.from_pretrained(path, dtype="float32", quantized="fp8")[:2]
  fp8_equal = {k: all(a.dtype == b.dtype and np.array_equal(a.astype(np.float32), b.astype(np.float32))
                      for a, b in zip(leaves(unsharded), leaves(v), strict=True)) for k, v in fp8.items()}
  wd = lambda x: w(x) | {"dtype": x.dtype.name}
  tokens = np.arange(12, dtype=np.int32).reshape(4, 3) % target.cfg.vocab_size
  rows, valid = np.broadcast_to(np.arange(3, dtype=np.int32), (4, 3)), np.ones((4, 3), bool)
  logits = lambda m: np.asarray(jax.jit(lambda m: m(tokens, rows, valid, None)[0])(m))
  attn, experts = fp8["2x2"][0].layers[0].self_attn, fp8["1x2x2"][0].layers[1].mlp.experts
  return {"params_equal": equal, "q_b_proj": w(loaded["2x2"][0].layers[0].self_attn.q_b_proj.weight[...]),
          "experts": w(loaded["1x2x2"][0].layers[1].mlp.experts.gate_proj[...]),
          "fp8_params_equal": fp8_equal, "fp8_q_b_proj": wd(attn.q_b_proj.weight[...]),
          "fp8_q_b_proj_scales": wd(attn.q_b_proj.weight_scale_inv[...]), "fp8_experts": wd(experts.gate_proj[...]),
          "fp8_experts_scales": wd(experts.gate_proj_scale_inv[...]),
          "fp8_logits_error": float(np.max(np.abs(logits(fp8["1x2x2"][0]) - logits(target))))}


if __name__ == "__main__":
  print(json.dumps({"propose": _propose_child, "generate": _generate_child, "mla": _mla_child,
                    "paged": _paged_child, "load": _load_child, "fp8": _fp8_child}[sys.argv[1]](*sys.argv[2:])))
