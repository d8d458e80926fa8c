"""mtp_jax against transformers on one tiny random model: speculative (MTP) and plain greedy
decoding, batch 1, k = 1..2 drafts, tokens/s side by side in one run.

The peer is transformers' `generate(use_mtp=True)` (PyTorch, eager, on the CPU) and its plain
`generate`. Both libraries run the same weights in a layout both can run: a GLM-4.5 model
(`Glm4MoeForCausalLM`) whose blocks are dense SwiGLU blocks with full RoPE, no biases, no QK
norm. transformers builds every MTP block as a mixture of experts, so each MTP block's dense MLP
is written as the one expert the router always picks: 2 routed experts with expert 0's
correction bias far above expert 1's, a zero router (every score 0.5, normalised to weight 1.0
exactly), routed scaling 1, and a shared expert of width 0 (no output). Its output is the dense
MLP's; transformers still pays for the router, as it does on a real GLM-4.5 checkpoint. The MTP
chain feeds the post-norm hidden on both sides (transformers' convention).

transformers drafts as many tokens as the model has MTP layers, so row k uses a model with k MTP
layers (the first k modules of the same weights; mtp_jax runs the same modules with
num_drafts = k, only the drafting modules, as its generate does). With random weights few drafts
are accepted: the rows compare what each library's loop costs per token, not a trained model's
speedup. Greedy outputs are checked equal within each library and compared across them.

  python benchmarks/vs_transformers.py            # prints a markdown table
  python benchmarks/vs_transformers.py --quick
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from unittest import mock

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

import mtp_jax  # noqa: E402

SIZES = dict(vocab_size=512, hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=32, intermediate_size=384)
NUM_LAYERS, NUM_MODULES = 4, 2


def jax_models(seed: int = 0):
  """(target, proposer) in mtp_jax with the MTP chain's shared embedding and head tied to the target's."""
  target = mtp_jax.init_target(mtp_jax.TargetConfig(num_layers=NUM_LAYERS, output_normed_hidden=True, **SIZES), seed)
  cfg = mtp_jax.MtpConfig(num_modules=NUM_MODULES, pass_normed_hidden=True, **SIZES)
  mtp = {k: np.asarray(v) for k, v in mtp_jax.state_dict(mtp_jax.init_mtp(cfg, seed + 1)).items()}
  t = {k: np.asarray(v) for k, v in mtp_jax.target_state_dict(target).items()}
  mtp["embed_tokens.weight"], mtp["lm_head.weight"] = t["model.embed_tokens.weight"], t["lm_head.weight"]
  # Random norm weights (not ones), so a swapped or missing norm shows up as differing output.
  rng = np.random.default_rng(seed)
  for k in mtp:
    if k.endswith("norm.weight"):
      mtp[k] = (1 + 0.2 * rng.standard_normal(mtp[k].shape)).astype(np.float32)
  return target, mtp_jax.load_state_dict(cfg, mtp), t, mtp


def torch_model(target_sd, mtp_sd, num_mtp_layers: int):
  """A transformers Glm4MoeForCausalLM with `num_mtp_layers` MTP layers holding the same weights,
  and the MtpModel its generate(use_mtp=True) will use (every tensor set here)."""
  import torch
  from transformers import Glm4MoeConfig, Glm4MoeForCausalLM
  from transformers.modeling_layers import MtpModel

  s = SIZES
  config = Glm4MoeConfig(
      vocab_size=s["vocab_size"], hidden_size=s["hidden_size"], num_attention_heads=s["num_heads"],
      num_key_value_heads=s["num_kv_heads"], head_dim=s["head_dim"], intermediate_size=s["intermediate_size"],
      num_hidden_layers=NUM_LAYERS, first_k_dense_replace=NUM_LAYERS, num_mtp_layers=num_mtp_layers,
      moe_intermediate_size=s["intermediate_size"], n_routed_experts=2, num_experts_per_tok=1, n_group=1,
      topk_group=1, n_shared_experts=0, routed_scaling_factor=1.0, norm_topk_prob=True,
      partial_rotary_factor=1.0, rope_theta=10000.0, rms_norm_eps=1e-6, attention_bias=False,
      use_qk_norm=False, tie_word_embeddings=False, max_position_embeddings=4096, torch_dtype="float32")
  main = Glm4MoeForCausalLM(config).eval()
  _load_all(main, {k: torch.from_numpy(np.array(v)) for k, v in target_sd.items()}, "target")
  with warnings.catch_warnings():  # the width-0 shared expert: "Initializing zero-element tensors is a no-op"
    warnings.simplefilter("ignore", UserWarning)
    mtp = MtpModel(main, num_mtp_layers).eval()
  tensors = {}
  for i in range(num_mtp_layers):
    get = lambda name: torch.from_numpy(np.array(mtp_sd[f"mtp.{i}.{name}"]))
    pre, blk = f"layers.{i}.", f"layers.{i}.mtp_block."
    for name in ("enorm.weight", "hnorm.weight", "eh_proj.weight"):
      tensors[pre + name] = get(name)
    tensors[pre + "post_norm.weight"] = get("shared_head.norm.weight")
    for name in ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
                 "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight"):
      tensors[blk + name] = get(name)
    gate, up, down = get("mlp.gate_proj.weight"), get("mlp.up_proj.weight"), get("mlp.down_proj.weight")
    tensors[blk + "mlp.experts.gate_up_proj"] = torch.stack([torch.cat([gate, up]), torch.zeros(2 * gate.shape[0],
                                                                                                 gate.shape[1])])
    tensors[blk + "mlp.experts.down_proj"] = torch.stack([down, torch.zeros_like(down)])
    tensors[blk + "mlp.gate.weight"] = torch.zeros(2, s["hidden_size"])
    tensors[blk + "mlp.gate.e_score_correction_bias"] = torch.tensor([10.0, -10.0])
  mine = {k for k in mtp.state_dict() if not k.startswith(("embed_tokens.", "shared_head."))}
  for k in mine - set(tensors):
    value = mtp.state_dict()[k]
    if value.numel():  # the shared expert has width 0: nothing to set
      raise KeyError(f"MTP tensor {k} {tuple(value.shape)} not set")
    tensors[k] = value
  _load_all(mtp, tensors, "mtp", ignore=("embed_tokens.", "shared_head."))
  return main, mtp


def _load_all(module, tensors, what, ignore=()):
  missing, unexpected = module.load_state_dict(tensors, strict=False)
  missing = [k for k in missing if not k.startswith(ignore)]
  if missing or unexpected:
    raise KeyError(f"{what}: tensors not set {missing[:4]}, unknown {unexpected[:4]}")


def decoders(target, proposer, target_sd, mtp_sd, ks, max_new_tokens):
  """name -> fn(prompt list[int]) -> generated token list, every one greedy, batch 1."""
  import torch
  from transformers.modeling_layers import MtpModel

  out = {"mtp_jax plain": lambda p: mtp_jax.generate(target, None, [p], max_new_tokens).tokens[0]}
  for k in ks:
    out[f"mtp_jax k={k}"] = (lambda p, k=k: mtp_jax.generate(target, proposer, [p], max_new_tokens,
                                                             num_drafts=k).tokens[0])
  models = {k: torch_model(target_sd, mtp_sd, k) for k in ks}

  def hf(p, k, use_mtp):
    main, mtp = models[k]
    ids = torch.tensor([p])
    kwargs = dict(max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False,
                  eos_token_id=None, pad_token_id=0)
    # generate(use_mtp=True) loads the MTP layers from the main model's checkpoint files; this model
    # has none on disk, so it gets the MtpModel built above.
    with torch.inference_mode(), mock.patch.object(MtpModel, "from_pretrained", lambda *a, **kw: mtp):
      seq = main.generate(ids, use_mtp=use_mtp, **kwargs) if use_mtp else main.generate(ids, **kwargs)
    return seq[0, len(p):].tolist()

  out["transformers plain"] = lambda p: hf(p, ks[0], False)
  for k in ks:
    out[f"transformers k={k}"] = lambda p, k=k: hf(p, k, True)
  return out


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--ks", type=int, nargs="+", default=[1, 2])
  parser.add_argument("--num-prompts", type=int, default=3)
  parser.add_argument("--prompt-len", type=int, default=32)
  parser.add_argument("--max-new-tokens", type=int, default=64)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--torch-threads", type=int, default=1,
                      help="PyTorch intra-op threads (default 1: on a loaded 2-core machine more threads "
                           "spin against each other; batch-1 decoding of this size gains nothing from them)")
  parser.add_argument("--quick", action="store_true", help="a tiny smoke run (1 prompt, 8 tokens, 1 pass)")
  args = parser.parse_args(argv)
  if args.quick:
    args.num_prompts, args.max_new_tokens, args.repeats = 1, 8, 1
  bad = [k for k in args.ks if not 1 <= k <= NUM_MODULES]
  if bad:
    raise SystemExit(f"--ks must lie in 1..{NUM_MODULES}, got {bad}")
  import torch
  import transformers

  torch.set_num_threads(args.torch_threads)
  target, proposer, target_sd, mtp_sd = jax_models()
  fns = decoders(target, proposer, target_sd, mtp_sd, args.ks, args.max_new_tokens)
  rng = np.random.default_rng(0)
  prompts = [rng.integers(1, SIZES["vocab_size"], size=args.prompt_len).tolist() for _ in range(args.num_prompts)]
  names = list(fns)
  first = {}
  for name in names:  # compiles (jax) and warms up (torch), untimed
    t0 = time.perf_counter()
    fns[name](prompts[0])
    first[name] = time.perf_counter() - t0
  secs = {name: np.zeros(args.repeats) for name in names}
  outs = {}
  for rep in range(args.repeats):
    for j, p in enumerate(prompts):
      for shift in range(len(names)):  # turns rotate, so load changes hit every decoder alike
        name = names[(rep + j + shift) % len(names)]
        t0 = time.perf_counter()
        outs[name, j] = fns[name](p)
        secs[name][rep] += time.perf_counter() - t0
  tokens = args.num_prompts * args.max_new_tokens
  tps = {name: tokens / float(np.median(secs[name])) for name in names}
  same = lambda a, b: all(outs[a, j] == outs[b, j] for j in range(len(prompts)))
  for lib in ("mtp_jax", "transformers"):
    for k in args.ks:
      if not same(f"{lib} k={k}", f"{lib} plain"):
        raise AssertionError(f"{lib}: speculative output at k={k} differs from its plain greedy output")
  print(f"# mtp_jax {jax.__version__} ({jax.default_backend()}) vs transformers {transformers.__version__} "
        f"(torch {torch.__version__}, {torch.get_num_threads()} threads); {NUM_LAYERS}-layer target "
        f"D={SIZES['hidden_size']} V={SIZES['vocab_size']}, random weights; {args.num_prompts} prompts x "
        f"{args.max_new_tokens} tokens, batch 1, greedy; medians of {args.repeats} interleaved passes\n")
  print("| decoding | mtp_jax tok/s | transformers tok/s | mtp_jax / transformers | "
        "mtp_jax compile s | transformers first call s |")
  print("|---|---|---|---|---|---|")
  for row in ["plain"] + [f"k={k}" for k in args.ks]:
    j, h = f"mtp_jax {row}", f"transformers {row}"
    label = "plain generate" if row == "plain" else f"speculative, {row} (use_mtp=True)"
    print(f"| {label} | {tps[j]:.0f} | {tps[h]:.0f} | {tps[j] / tps[h]:.1f}x | "
          f"{max(0.0, first[j] - float(np.median(secs[j])) / args.num_prompts):.1f} | {first[h]:.2f} |")
  cross = same("mtp_jax plain", "transformers plain")
  print(f"\ngreedy output: speculative == plain within each library for every k; "
        f"mtp_jax plain {'==' if cross else '!='} transformers plain"
        + ("" if cross else " (float rounding near ties in a random model)"))
  return 0


if __name__ == "__main__":
  sys.exit(main())
