"""Peak host memory of loading a released directory larger than a stated host budget, side by side:

  to host      checkpoint.load_tensors: every tensor read into host memory at once (what the
               loaders did before placing anything, until sharded loading);
  unsharded    from_pretrained(path): tensor by tensor onto one device;
  sharded      from_pretrained(path, mesh=mesh): each device's block read straight from the file.

  python benchmarks/bench_sharded_load.py              # a ~0.5 GB GLM-4.5-shaped directory, budget 96 MiB
  python benchmarks/bench_sharded_load.py --quick      # a ~60 MB one, budget 16 MiB

Each load runs in a child process with 4 host CPU devices (a 2 x 2 mesh) and reports host arrays
(tracemalloc: numpy and bytes allocations) at their peak and at the end, the bytes the fullest
device holds, and the child's peak RSS. On CPU the devices live in host memory: jax may keep a
host array as a device buffer without copying it, so what tracemalloc still holds at the end is
part of the placed model, and peak - end is what loading staged on top of it (the "to host" dict
is dropped before the end). RSS counts the placed model and the memory-mapped file pages too.
The directory's tensors are random (`write_released`), drawn one at a time.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

MiB = 2**20


def glm_config(*, vocab: int, hidden: int, layers: int, ffn: int, experts: int, expert_ffn: int,
               heads: int = 8, kv_heads: int = 2) -> dict:
  """An HF config.json dict of a GLM-4.5-shaped model: layer 0 dense, the rest and the one MTP
  layer MoE (experts routed two at a time, one shared expert), GQA with q / k norms."""
  return dict(model_type="glm4_moe", vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn,
              moe_intermediate_size=expert_ffn, num_hidden_layers=layers, num_attention_heads=heads,
              num_key_value_heads=kv_heads, head_dim=hidden // heads, n_routed_experts=experts,
              num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
              norm_topk_prob=True, routed_scaling_factor=1.0, num_nextn_predict_layers=1, use_qk_norm=True,
              attention_bias=True, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
              max_position_embeddings=4096, torch_dtype="float32")


def _draw(rng, name: str, shape, dtype) -> np.ndarray:
  if name.endswith("norm.weight"):
    x = 1 + 0.1 * rng.standard_normal(shape, np.float32)
  elif len(shape) == 1:
    x = 0.1 * rng.standard_normal(shape, np.float32)
  else:  # torch [out, in]
    x = rng.standard_normal(shape, np.float32) / np.float32(shape[-1] ** 0.5)
  return x.astype(dtype)


def write_released(path, config: dict, *, dtype: str = "float32", seed: int = 0) -> int:
  """Writes a released-style directory (config.json, one safetensors shard per layer and an index;
  MTP layers at model.layers.{num_hidden_layers + i}, one tensor per routed expert) of random
  tensors for an HF config mtp_jax loads; returns the bytes written."""
  import ml_dtypes  # noqa: F401  (bfloat16 for numpy)
  from flax import nnx

  from mtp_jax import layouts, mtp, pretrained, target
  from mtp_jax.checkpoint import save_tensors

  tcfg = pretrained.target_config_from_hf(config)
  hf_name = lambda p: p if p.startswith("lm_head.") else "model." + p  # as target.target_state_dict names them
  abstract_target = nnx.eval_shape(lambda: target.TargetModel(tcfg, rngs=nnx.Rngs(0)))
  shapes = {n: shape for n, (_, shape) in mtp.param_names(abstract_target, hf_name).items()}
  mcfg = layouts.config_from_hf(config)
  abstract_mtp = nnx.eval_shape(lambda: mtp.MtpModel(mcfg, rngs=nnx.Rngs(0)))
  for n, (_, shape) in mtp.param_names(abstract_mtp, mtp.canonical_name).items():
    if n.startswith("mtp."):  # the MTP layers share the target's embedding and head
      _, i, rest = n.split(".", 2)
      shapes[f"model.layers.{tcfg.num_layers + int(i)}.{rest}"] = shape
  released = {}
  for n, shape in shapes.items():
    if ".mlp.experts." in n and len(shape) == 3:  # stacked [E, in, out] -> one torch [out, in] per expert
      prefix, proj = n.rsplit(".", 1)
      released |= {f"{prefix}.{e}.{proj}.weight": (shape[2], shape[1]) for e in range(shape[0])}
    else:
      released[n] = shape
  files = {}
  for n in released:
    parts = n.split(".")
    files.setdefault(f"layer-{int(parts[2]):03d}" if parts[:2] == ["model", "layers"] else "rest", []).append(n)
  os.makedirs(path, exist_ok=True)
  rng, written, weight_map = np.random.default_rng(seed), 0, {}
  for stem, names in sorted(files.items()):
    tensors = {n: _draw(rng, n, released[n], np.dtype(dtype)) for n in names}
    save_tensors(os.path.join(path, f"{stem}.safetensors"), tensors)
    written += sum(x.nbytes for x in tensors.values())
    weight_map |= dict.fromkeys(names, f"{stem}.safetensors")
  with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
    json.dump({"weight_map": weight_map}, f)
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(config | {"torch_dtype": dtype}, f)
  return written


def _measure(mode: str, path: str) -> dict:
  """One load in this (child) process: staging peak, fullest device, peak RSS, seconds."""
  import tracemalloc

  import jax

  from mtp_jax import checkpoint, pretrained, sharding

  mesh = sharding.make_mesh(2, 2)
  jax.block_until_ready(jax.device_put(np.zeros(1), jax.devices()[0]))  # backend up before measuring
  rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
  tracemalloc.start()
  start = time.perf_counter()
  if mode == "to host":
    tensors = checkpoint.load_tensors(path)  # what a loader would place, then drop
    del tensors
    models = []
  elif mode == "unsharded":
    models = list(pretrained.from_pretrained(path, dtype="float32")[:2])
  else:
    models = list(pretrained.from_pretrained(path, dtype="float32", mesh=mesh)[:2])
  jax.block_until_ready([x for x in jax.tree.leaves(models) if isinstance(x, jax.Array)])
  seconds = time.perf_counter() - start
  held, peak = tracemalloc.get_traced_memory()
  tracemalloc.stop()
  per_device = {}
  for x in jax.tree.leaves(models):
    if isinstance(x, jax.Array):
      for shard in x.addressable_shards:
        per_device[shard.device.id] = per_device.get(shard.device.id, 0) + shard.data.nbytes
  return {"peak": peak, "held": held, "fullest_device": max(per_device.values(), default=0),
          "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "rss_before": rss_before,
          "seconds": seconds}


def _child(mode: str, path: str) -> dict:
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join(
      [root] + [p for p in [os.environ.get("PYTHONPATH")] if p]),
             XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4")
  r = subprocess.run([sys.executable, os.path.abspath(__file__), "--measure", mode, path], env=env,
                     capture_output=True, text=True, timeout=1800)
  if r.returncode != 0:
    raise RuntimeError(f"{mode} load failed:\n{r.stderr[-4000:]}")
  return json.loads(r.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--quick", action="store_true", help="a ~60 MB directory and a 16 MiB budget")
  parser.add_argument("--dir", help="write the directory here (default: a temporary one, removed after)")
  parser.add_argument("--measure", nargs=2, metavar=("MODE", "PATH"), help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.measure:
    print(json.dumps(_measure(*args.measure)))
    return 0
  if args.quick:
    budget, config = 16 * MiB, glm_config(vocab=4096, hidden=256, layers=4, ffn=768, experts=8, expert_ffn=256)
  else:
    budget, config = 96 * MiB, glm_config(vocab=8192, hidden=1024, layers=6, ffn=2816, experts=8, expert_ffn=768)
  with tempfile.TemporaryDirectory() as tmp:
    path = args.dir or tmp
    size = write_released(path, config)
    largest = max(int(np.prod(s)) * 4 for s in _largest_shapes(config))
    print(f"directory: {size / MiB:.0f} MiB (float32, {config['num_hidden_layers']} layers + 1 MTP layer, "
          f"{config['n_routed_experts']} experts); host budget {budget / MiB:.0f} MiB; "
          f"largest tensor {largest / MiB:.0f} MiB; 2 x 2 mesh of 4 host CPU devices")
    print("| load | host arrays: peak | held at end | peak - end | within budget | fullest device "
          "| peak RSS (before load) | s |")
    print("|---|---|---|---|---|---|---|---|")
    for mode in ("to host", "unsharded", "sharded"):
      r = _child(mode, path)
      staged = r["peak"] - r["held"]
      print(f"| {mode} | {r['peak'] / MiB:.1f} MiB | {r['held'] / MiB:.1f} MiB | {staged / MiB:.1f} MiB | "
            f"{'yes' if staged <= budget else 'no'} | {r['fullest_device'] / MiB:.0f} MiB | "
            f"{r['rss'] / MiB:.0f} MiB ({r['rss_before'] / MiB:.0f} MiB) | {r['seconds']:.1f} |")
  return 0


def _largest_shapes(config: dict):
  d = config["hidden_size"]
  return [(config["vocab_size"], d), (config["intermediate_size"], d),
          (config["n_routed_experts"], d, config["moe_intermediate_size"])]


if __name__ == "__main__":
  sys.exit(main())
