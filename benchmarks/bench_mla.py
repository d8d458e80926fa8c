"""One attention decode step at B=1: MLA (latent cache, absorbed) against GQA of the same width.

  python benchmarks/bench_mla.py            # D=1024, 8 heads, L=4096 cached rows
  python benchmarks/bench_mla.py --quick    # a tiny smoke run

Each case is one layer's attention for T=1 new row over a full cache of L rows (the caches are
position-addressed, so a step reads every allocated row), jitted with the cache donated. Bytes
read = the layer's weights + the cache rows; GB/s = those bytes / the median call, set against
the machine's read bandwidth timed in the same reps (benchmarks/bandwidth.py).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import variants as V  # first: it finds mtp_jax in a checkout that is not pip-installed
from bandwidth import best, reference_cases, timed_with_references
from mtp_jax.blocks import Attention, MlaAttention, init_cache
from mtp_jax.config import BlockConfig, MlaConfig

SIZES = {  # DeepSeek-V3's per-head shapes (Dn = Dv = 128, Dr = 64, R = 512) at 8 heads
    "D=1024": dict(d=1024, h=8, dh=128, mla=MlaConfig(kv_lora_rank=512, qk_nope_head_dim=128,
                                                      qk_rope_head_dim=64, v_head_dim=128, q_lora_rank=384),
                   max_len=4096),
    "D=64": dict(d=64, h=4, dh=16, mla=MlaConfig(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                                                 v_head_dim=16, q_lora_rank=24), max_len=64),
}


def configs(size: str) -> dict[str, BlockConfig]:
  s = SIZES[size]
  base = dict(hidden_size=s["d"], num_heads=s["h"], head_dim=s["dh"], intermediate_size=8)
  return {"GQA, Hkv = H (MHA)": BlockConfig(**base, num_kv_heads=s["h"]),
          "GQA, Hkv = 2": BlockConfig(**base, num_kv_heads=2),
          "MLA, absorbed (decode path)": BlockConfig(**base, num_kv_heads=s["h"], mla=s["mla"]),
          "MLA, expanded": BlockConfig(**base, num_kv_heads=s["h"], mla=s["mla"])}


def row_bytes(cache) -> int:
  """Bytes one cached row holds, over every array of the cache."""
  return sum(x.dtype.itemsize * int(np.prod(x.shape[2:])) for x in jax.tree.leaves(cache))


def case(name: str, cfg: BlockConfig, max_len: int):
  """(step fn, input maker, bytes read, bytes per cached row) for one attention decode step."""
  attn = (MlaAttention if cfg.mla else Attention)(cfg, rngs=nnx.Rngs(0))
  kwargs = {"absorb": "expanded" not in name} if cfg.mla else {}
  rng = np.random.default_rng(0)
  cache = jax.tree.map(lambda z: jnp.asarray(rng.standard_normal(z.shape), z.dtype),
                       init_cache(cfg, 1, max_len))
  x = jnp.asarray(rng.standard_normal((1, 1, cfg.hidden_size)), cfg.jnp_dtype)
  rows, valid = jnp.full((1, 1), max_len - 1, jnp.int32), jnp.ones((1, 1), bool)

  step = jax.jit(lambda attn, x, cache: attn(x, rows, valid, cache, **kwargs), donate_argnums=2)
  state = [cache]

  def run(attn, x):
    out, state[0] = step(attn, x, state[0])
    return out

  weights = sum(p.nbytes for p in jax.tree.leaves(nnx.state(attn, nnx.Param)))
  per_row = row_bytes(cache)
  return run, lambda: (attn, x), weights + max_len * per_row, per_row, weights


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--quick", action="store_true", help="D=64, L=64 and a 16 MB array (a smoke test)")
  args = ap.parse_args(argv)
  size, mbytes, reps = ("D=64", 16, 3) if args.quick else ("D=1024", 512, 30)
  max_len = SIZES[size]["max_len"]
  print(f"Machine: {V.machine(with_torch=False)}\n")
  cases = {name: case(name, cfg, max_len) for name, cfg in configs(size).items()}
  medians, bw = timed_with_references([(fn, make) for fn, make, *_ in cases.values()],
                                      reference_cases(mbytes), reps)
  _, read_bw = best(bw)
  print(f"Read bandwidth, same reps ({mbytes} MB float32 arrays), GB/s: "
        + ", ".join(f"{n} {v:.1f}" for n, v in bw.items()))
  print(f"\nOne attention decode step, B=1, T=1, {size}, L={max_len} cached rows, float32:\n")
  print("| attention | bytes / cached row | weights (MB) | bytes read (MB) | median ms | GB/s | / read |")
  print("|---|---|---|---|---|---|---|")
  for (name, (_, _, nbytes, per_row, weights)), t in zip(cases.items(), medians):
    gbs = nbytes / t / 1e9
    print(f"| {name} | {per_row} | {weights / 1e6:.1f} | {nbytes / 1e6:.1f} | {t * 1e3:.2f} | "
          f"{gbs:.1f} | {gbs / read_bw:.2f} |")


if __name__ == "__main__":
  main()
