"""B=1 decode of the MoE FFN: reading the chosen experts (gather) against reading all of them.

  python benchmarks/bench_moe.py            # D=1024, E=64 experts of width 512, top-4, 1 shared
  python benchmarks/bench_moe.py --quick    # a tiny smoke run

One token row goes through `Moe` (router, routed experts, shared expert) by each expert path of
blocks/moe.py. Bytes read are counted from the weights each path must touch: the router, the
shared expert, and K experts (gather) or all E (dense, grouped). Achieved GB/s = those bytes /
the median call; the machine's read bandwidth is timed in the same reps (benchmarks/bandwidth.py).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
from flax import nnx

import bandwidth
import variants as V
from mtp_jax.blocks import Moe
from mtp_jax.config import BlockConfig, MoeConfig

SIZES = {"full": dict(hidden_size=1024, num_experts=64, moe_intermediate_size=512, num_experts_per_tok=4),
         "quick": dict(hidden_size=64, num_experts=16, moe_intermediate_size=32, num_experts_per_tok=2)}


def moe_config(size: str, dtype: str) -> BlockConfig:
  s = SIZES[size]
  moe = MoeConfig(num_experts=s["num_experts"], num_experts_per_tok=s["num_experts_per_tok"],
                  moe_intermediate_size=s["moe_intermediate_size"], scoring="sigmoid",
                  e_score_correction_bias=True, n_shared_experts=1, routed_scaling_factor=2.5)
  d = s["hidden_size"]
  return BlockConfig(hidden_size=d, num_heads=8, num_kv_heads=2, head_dim=d // 8, intermediate_size=4 * d,
                     dtype=dtype, moe=moe)


def bytes_read(moe: Moe, experts_touched: int) -> int:
  """Router + shared expert + `experts_touched` routed experts' weights."""
  e = moe.cfg.num_experts
  routed = sum(w[...].nbytes for w in (moe.experts.gate_proj, moe.experts.up_proj, moe.experts.down_proj))
  rest = sum(x.nbytes for x in jax.tree.leaves(nnx.state(moe, nnx.Param))) - routed
  return rest + routed * experts_touched // e


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--quick", action="store_true", help="D=64, 16 experts and a 16 MB array (a smoke test)")
  ap.add_argument("--dtype", default="float32", help="weights and activations (default float32)")
  args = ap.parse_args(argv)
  size, mbytes, reps = ("quick", 16, 3) if args.quick else ("full", 512, 30)
  print(f"Machine: {V.machine(with_torch=False)}\n")
  cfg = moe_config(size, args.dtype)
  moe = Moe(cfg, rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (1, 1, cfg.hidden_size), cfg.jnp_dtype)
  k, e = cfg.moe.num_experts_per_tok, cfg.moe.num_experts
  paths = [("gather (chosen experts only)", "gather", k), ("dense (every expert)", "dense", e),
           ("grouped (ragged_dot)", "grouped", e)]
  compiled = {p: jax.jit(lambda m, x, p=p: m(x, path=p)).lower(moe, x).compile() for _, p, _ in paths}
  want = compiled["dense"](moe, x)
  for _, p, _ in paths:  # every path gives the same output before it is timed
    got = compiled[p](moe, x)
    assert jnp.allclose(got.astype(jnp.float32), want.astype(jnp.float32), rtol=2e-2, atol=2e-2), p
  refs = bandwidth.reference_cases(mbytes)
  medians, bw = bandwidth.timed_with_references([(compiled[p], lambda: (moe, x)) for _, p, _ in paths], refs, reps)
  _, read_bw = bandwidth.best(bw)
  print(f"memory bandwidth ({mbytes} MB float32 arrays, timed in turn with the rows below), GB/s: "
        + ", ".join(f"{name} {v:.1f}" for name, v in bw.items()))
  print(f"\nMoE FFN decode, B=1 (one row), D={cfg.hidden_size}, E={e} experts of width "
        f"{cfg.moe.moe_intermediate_size}, top-{k}, 1 shared expert, {args.dtype}; read bandwidth "
        f"{read_bw:.1f} GB/s (best of the references):\n")
  print("| path | experts read | bytes read (MB) | median ms | GB/s | / read bandwidth | "
        "XLA 'bytes accessed' (MB) |")
  print("|---" * 7 + "|")
  for (what, p, touched), t in zip(paths, medians):
    nbytes = bytes_read(moe, touched)
    cost = compiled[p].cost_analysis()
    xla = cost.get("bytes accessed", float("nan")) if isinstance(cost, dict) else float("nan")
    print(f"| {what} | {touched} | {nbytes / 1e6:.1f} | {t * 1e3:.3f} | {nbytes / t / 1e9:.1f} | "
          f"{nbytes / t / 1e9 / read_bw:.2f} | {xla / 1e6:.1f} |")
  print(f"\ngather vs dense: {medians[1] / medians[0]:.1f}x faster, reading {k}/{e} of the routed experts")


if __name__ == "__main__":
  main()
