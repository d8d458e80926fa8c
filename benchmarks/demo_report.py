"""`mtp-jax demo`'s measurement written as JSON, for benchmarks/plots.py.

Takes the demo's own flags (`mtp-jax demo --help`: --small, --ks, --tree, --max-depth, --num-prompts,
--max-new-tokens, --repeats, ...), runs the same measurement (`mtp_jax.demo.run_demo`), prints the
demo's table and writes the report (every row: acceptance per depth, accepted length, target rows per
step, target calls, tokens/s, speedup) to --json PATH.

  python benchmarks/demo_report.py --json demo.json --tree 2 --tree 3 --tree 1,2 --tree 2,1,1 --tree 2,2,2
  python benchmarks/demo_report.py --json demo.json --quick   # a smoke run: small model, 2 prompts x 8 tokens
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import jax

try:
  from mtp_jax import cli, demo, demo_models
except ImportError:  # run as `python benchmarks/x.py` from a checkout that is not pip-installed
  sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
  from mtp_jax import cli, demo, demo_models


def main(argv=None) -> int:
  ours = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="Every other flag is the demo's.")
  ours.add_argument("--json", metavar="PATH", required=True, help="where to write the report")
  ours.add_argument("--quick", action="store_true", help="small model, 2 prompts x 8 tokens, 1 pass")
  mine, rest = ours.parse_known_args(argv)
  args = cli.build_parser().parse_args(["demo"] + rest)
  if mine.quick:
    args.small, args.num_prompts, args.max_new_tokens, args.repeats = True, 2, 8, 1
  name = "small" if args.small else demo_models.default_demo()
  report = demo.run_demo(num_prompts=args.num_prompts, prompt_len=args.prompt_len, max_new_tokens=args.max_new_tokens,
                         seed=args.seed, name=name, path=args.checkpoint, ks=args.ks, repeats=args.repeats,
                         trees=args.tree, max_depth=args.max_depth)
  print(demo.format_report(report))
  settings = dict(num_prompts=args.num_prompts, prompt_len=args.prompt_len, max_new_tokens=args.max_new_tokens,
                  seed=args.seed, repeats=args.repeats, max_depth=args.max_depth)
  with open(mine.json, "w") as f:
    json.dump(dict(benchmark="demo", backend=jax.default_backend(), device_kind=jax.devices()[0].device_kind,
                   jax_version=jax.__version__, settings=settings, report=dataclasses.asdict(report)), f, indent=1)
  return 0 if all(r.same_as_plain for r in report.rows) else 1


if __name__ == "__main__":
  sys.exit(main())
