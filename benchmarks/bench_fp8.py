"""A DeepSeek-V3-shaped target's decode step with its weights kept FP8 (`quantized="fp8"`) against the
same checkpoint dequantized at load to bfloat16 and to float32, side by side in one run.

  python benchmarks/bench_fp8.py            # D=1024, 4 layers (1 dense, 3 MoE of 8 experts), 128 x 128 blocks
  python benchmarks/bench_fp8.py --quick    # a tiny smoke run

One block-scaled FP8 directory is written (random weights drawn as benchmarks/bench_sharded_load.py
draws them, the linear layers and experts then quantized with blocks.linear.quantize, as DeepSeek-V3's
release stores them: embeddings, norms, routers and the LM head stay unquantized) and loaded four ways:
float32 and bfloat16 (dequantized at load), and quantized="fp8" computing in bfloat16 and in float32.
Each variant's prefill logits are checked against its dequantized-at-load twin before anything is timed.
Timed: one jitted `target_step` of one token per sequence (B = 1 and 8) after a 32-token prefill, the
variants taking turns rep by rep (medians); weight bytes are the params each variant holds.

A second table times one [4096, 1024] weight times N = 1 and 8 rows by the forms XLA could be
given: the weight in float32 / bfloat16, FP8 dequantized then multiplied (blocks.linear.dequantize,
the library's form), and FP8 as a per-block scaled dot (each 128-column block's partial product
times its scales, then summed), with XLA's own count of the bytes each compiled call accesses.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import safetensors.numpy

import bandwidth
import bench_sharded_load
import variants as V
from variants import mtp_jax
from mtp_jax.blocks import linear

MiB = 2**20
PROMPT, MAX_LEN = 32, 64
SIZES = {"full": dict(vocab=8192, hidden=1024, layers=4, heads=8, ffn=2816, experts=8, expert_ffn=512,
                      q_lora=384, kv_lora=256, nope=64, rope=32, v=64, block=128),
         "quick": dict(vocab=256, hidden=64, layers=2, heads=4, ffn=96, experts=4, expert_ffn=32,
                       q_lora=48, kv_lora=32, nope=16, rope=8, v=16, block=16)}


def deepseek_config(s: dict) -> dict:
  """An HF config.json dict of a DeepSeek-V3-shaped model: layer 0 dense, the rest MoE (top-2, one
  shared expert, sigmoid routing), MLA with a q LoRA, one MTP layer, FP8 blocks of s["block"]."""
  return dict(model_type="deepseek_v3", vocab_size=s["vocab"], hidden_size=s["hidden"],
              intermediate_size=s["ffn"], moe_intermediate_size=s["expert_ffn"], num_hidden_layers=s["layers"],
              num_attention_heads=s["heads"], num_key_value_heads=s["heads"], n_routed_experts=s["experts"],
              num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
              norm_topk_prob=True, routed_scaling_factor=2.5, scoring_func="sigmoid", topk_method="noaux_tc",
              kv_lora_rank=s["kv_lora"], q_lora_rank=s["q_lora"], qk_nope_head_dim=s["nope"],
              qk_rope_head_dim=s["rope"], v_head_dim=s["v"], num_nextn_predict_layers=1, rms_norm_eps=1e-6,
              rope_theta=10000.0, tie_word_embeddings=False, max_position_embeddings=4096,
              quantization_config={"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                   "weight_block_size": [s["block"], s["block"]]})


def write_fp8(path: str, config: dict) -> int:
  """Writes the directory (bench_sharded_load.write_released), then rewrites each 2-D projection weight
  under model.layers. (q_a_proj, kv_a_proj_with_mqa, experts' gate_proj, ...) as float8_e4m3fn plus
  its weight_scale_inv; returns the bytes written."""
  bench_sharded_load.write_released(path, config, dtype="float32")
  block = tuple(config["quantization_config"]["weight_block_size"])
  with open(os.path.join(path, "model.safetensors.index.json")) as f:
    index = json.load(f)
  written, quantize = 0, jax.jit(linear.quantize, static_argnums=1)
  for shard in sorted(set(index["weight_map"].values())):
    file = os.path.join(path, shard)
    tensors = safetensors.numpy.load_file(file)
    out = {}
    for name, w in tensors.items():
      if name.startswith("model.layers.") and "_proj" in name.split(".")[-2] and w.ndim == 2:
        values, scale_inv = quantize(w, block)
        out[name], out[name + "_scale_inv"] = np.asarray(values), np.asarray(scale_inv)
        index["weight_map"][name + "_scale_inv"] = shard
      else:
        out[name] = w.astype(np.float32)
    safetensors.numpy.save_file(out, file)
    written += sum(x.nbytes for x in out.values())
  with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
    json.dump(index, f)
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(config | {"torch_dtype": "bfloat16"}, f)
  return written


def weight_bytes(model) -> tuple[int, int]:
  """(all params, the float8 values and their scales) in bytes."""
  named = mtp_jax.target_state_dict(model)
  kept = sum(v.nbytes + named[n + "_scale_inv"].nbytes for n, v in named.items() if v.dtype == jnp.float8_e4m3fn)
  return sum(v.nbytes for v in named.values()), kept


def decode_cases(model, seed: int = 0):
  """(prefill logits float32[8, PROMPT, V], {B: (compiled step, make_input)}): one token per sequence
  after a PROMPT-token prefill of 8 sequences (B = 1: the first of them)."""
  vocab = model.cfg.vocab_size
  rng = np.random.default_rng(seed)
  prompt = rng.integers(0, vocab, (8, PROMPT)).astype(np.int32)
  logits, _, state = jax.jit(mtp_jax.target_step)(model, mtp_jax.init_target_state(model.cfg, 8, MAX_LEN), prompt,
                                                  np.full((8,), PROMPT, np.int32))
  token = rng.integers(0, vocab, (8, 1)).astype(np.int32)
  step = jax.jit(lambda m, s, t: mtp_jax.target_step(m, s, t, jnp.ones((t.shape[0],), jnp.int32))[0])
  cases = {}
  for b in (1, 8):
    args = (model, jax.tree.map(lambda x, b=b: x[:b], state), token[:b])
    cases[b] = (step.lower(*args).compile(), lambda args=args: args)
  return np.asarray(logits), cases


def xla_bytes(compiled) -> float:
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost
  return cost.get("bytes accessed", float("nan")) if isinstance(cost, dict) else float("nan")


def matmul_forms(rows: int, out: int, inn: int, block: int):
  """{form: (fn, args)}: y float32[N, out] = x[N, in] @ w[out, in].T by each form."""
  key = jax.random.key(0)
  w = jax.random.normal(key, (out, inn), jnp.float32) * inn**-0.5
  values, scale_inv = linear.quantize(w, (block, block))
  x = jax.random.normal(jax.random.fold_in(key, 1), (rows, inn), jnp.float32)
  dot = lambda w, x: jnp.einsum("oi,ni->no", w, x, preferred_element_type=jnp.float32)

  def per_block(values, scale_inv, x):
    nb = inn // block
    part_JxNxO = jnp.einsum("ojc,njc->jno", values.reshape(out, nb, block).astype(x.dtype),
                            x.reshape(rows, nb, block), preferred_element_type=jnp.float32)
    return jnp.einsum("jno,oj->no", part_JxNxO, jnp.repeat(scale_inv, block, axis=0)[:out])

  bf16 = jnp.bfloat16
  return {
      "float32 weight": (dot, (w, x)),
      "bfloat16 weight": (dot, (w.astype(bf16), x.astype(bf16))),
      "FP8, dequantize then dot (bf16)": (lambda v, s, x: dot(linear.dequantize(v, s, (block, block), bf16), x),
                                          (values, scale_inv, x.astype(bf16))),
      "FP8, dequantize then dot (f32)": (lambda v, s, x: dot(linear.dequantize(v, s, (block, block), jnp.float32), x),
                                         (values, scale_inv, x)),
      "FP8, per-block scaled dot (bf16)": (per_block, (values, scale_inv, x.astype(bf16))),
  }


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--quick", action="store_true", help="a tiny model and matmul, 3 reps (a smoke test)")
  ap.add_argument("--reps", type=int, default=None, help="timed reps per case (default 20; --quick 3)")
  args = ap.parse_args(argv)
  size = "quick" if args.quick else "full"
  reps = args.reps or (3 if args.quick else 20)
  s = SIZES[size]
  print(f"Machine: {V.machine(with_torch=False)}\n")
  with tempfile.TemporaryDirectory() as path:
    written = write_fp8(path, deepseek_config(s))
    loads = {"float32 (dequantized at load)": dict(dtype="float32"),
             "bfloat16 (dequantized at load)": dict(dtype="bfloat16"),
             "FP8 kept, bfloat16 compute": dict(dtype="bfloat16", quantized="fp8"),
             "FP8 kept, float32 compute": dict(dtype="float32", quantized="fp8")}
    models = {name: mtp_jax.load_target(path, **kw) for name, kw in loads.items()}
  names = list(models)
  runs = {n: decode_cases(m) for n, m in models.items()}
  logits = {n: r[0] for n, r in runs.items()}
  # Same weights: FP8 kept in float32 is the float32 load's math; in bfloat16 it may skip one rounding.
  np.testing.assert_allclose(logits[names[3]], logits[names[0]], rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(logits[names[2]], logits[names[1]], rtol=0.1, atol=0.1)
  cases = {(n, b): runs[n][1][b] for b in (1, 8) for n in names}
  medians = dict(zip(cases, bandwidth.interleaved_medians(list(cases.values()), reps)))
  print(f"DeepSeek-V3-shaped target: D={s['hidden']}, {s['layers']} layers (1 dense, {s['layers'] - 1} MoE of "
        f"{s['experts']} experts of width {s['expert_ffn']}, top-2, 1 shared), MLA (q LoRA {s['q_lora']}, latent "
        f"{s['kv_lora']}), V={s['vocab']}; FP8 blocks {s['block']} x {s['block']}; directory {written / MiB:.0f} MiB; "
        f"decode step = target_step of 1 token after {PROMPT}, median of {reps} interleaved reps\n")
  base = {b: medians[(names[0], b)] for b in (1, 8)}
  print("| weights | params held (MiB) | of which FP8 values + scales (MiB) | B=1 step ms | B=8 step ms | "
        "vs float32, B=1 | vs float32, B=8 | XLA bytes accessed, B=1 (MiB) |")
  print("|---" * 8 + "|")
  for n, m in models.items():
    held, kept = weight_bytes(m)
    print(f"| {n} | {held / MiB:.1f} | {kept / MiB:.1f} | {medians[(n, 1)] * 1e3:.2f} | {medians[(n, 8)] * 1e3:.2f} "
          f"| {medians[(n, 1)] / base[1]:.2f}x | {medians[(n, 8)] / base[8]:.2f}x | "
          f"{xla_bytes(cases[(n, 1)][0]) / MiB:.1f} |")

  out, inn = (4096, 1024) if size == "full" else (64, 32)
  block = s["block"]
  print(f"\nOne weight [{out}, {inn}] times N rows, each form jitted (FP8 blocks {block} x {block}); median of "
        f"{reps} interleaved reps:\n")
  print("| form | N=1 ms | N=8 ms | XLA bytes accessed, N=1 (MiB) |")
  print("|---|---|---|---|")
  forms = {n: matmul_forms(n, out, inn, block) for n in (1, 8)}
  jitted = {(n, f): (jax.jit(fn).lower(*fargs).compile(), (lambda a=fargs: a))
            for n in (1, 8) for f, (fn, fargs) in forms[n].items()}
  for (n, form), (fn, make) in jitted.items():  # FP8 / bf16 rounding only
    np.testing.assert_allclose(np.asarray(fn(*make()), np.float32), np.asarray(jitted[(n, "float32 weight")][0](
        *jitted[(n, "float32 weight")][1]())), rtol=0.1, atol=0.1, err_msg=form)
  times = dict(zip(jitted, bandwidth.interleaved_medians(list(jitted.values()), reps)))
  for form in forms[1]:
    print(f"| {form} | {times[(1, form)] * 1e3:.3f} | {times[(8, form)] * 1e3:.3f} | "
          f"{xla_bytes(jitted[(1, form)][0]) / MiB:.1f} |")
  print(f"\nload average at the end: {os.getloadavg()[0]:.1f}")
  return 0


if __name__ == "__main__":
  main()
