"""Turns a training checkpoint into a shipped demo model: target, MTP modules and config, no
optimizer state, floating tensors stored as bfloat16 (loading computes in the config's float32).

  python benchmarks/export_large.py /work/ckpt_large            # -> mtp_jax/assets/large
  python benchmarks/export_large.py RUN --out DIR --dtype float32
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

from mtp_jax import checkpoint_dir, demo, demo_models  # noqa: E402


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("checkpoint", help="a checkpoint directory written by `mtp-jax train`")
  parser.add_argument("--out", default=demo_models.demo_path("large"), help="default: mtp_jax/assets/large")
  parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
  args = parser.parse_args(argv)
  written = demo.export_demo(args.checkpoint, args.out, dtype=args.dtype)
  meta = checkpoint_dir.read_config(args.out)
  target, _, _ = demo_models.load_demo(args.out)
  params = sum(x.size for x in jax.tree.leaves(target))
  print(f"{args.out}: step {meta['step']}, {written / 1e6:.1f} MB as {args.dtype}; target {params / 1e6:.2f}M "
        f"parameters = {4 * params / 1e6:.1f} MB in float32 ({meta['target'].num_layers} layers, "
        f"D={meta['target'].hidden_size}), {meta['mtp'].num_modules} MTP modules")
  return 0


if __name__ == "__main__":
  sys.exit(main())
