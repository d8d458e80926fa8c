"""The docs' key figures, drawn from the JSON the benchmarks write (no number is typed here).

  python benchmarks/scaling.py --json scaling.json
  python benchmarks/demo_report.py --json demo.json --tree 2 --tree 3 --tree 1,2 --tree 2,1,1 --tree 2,2,2
  python benchmarks/serve_bench.py --json serve.json
  python benchmarks/plots.py --scaling scaling.json --demo demo.json --serve serve.json   # -> docs/img/*.png

Figures (each input is optional; only the figures of the inputs given are drawn):
  scaling.png  spec/plain tokens/s against the target's weight MB, one line per k (--scaling)
  chains.png   acceptance per draft depth and speedup vs plain against k, the chain rows (--demo)
  trees.png    mean accepted length against target rows per verify step, chains and trees (--demo;
               only when the report has tree rows)
  serving.png  the Engine's tokens/s against max_batch, one line per width and "auto", a panel per
               model (--serve)
Each figure's title carries the settings and the device read from its JSON.
"""

from __future__ import annotations

import argparse
import json
import os

import matplotlib

matplotlib.use("Agg")  # files only; no display needed
import matplotlib.pyplot as plt  # noqa: E402

DOCS_IMG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "img")


def _load(path: str, benchmark: str) -> dict:
  with open(path) as f:
    result = json.load(f)
  if result.get("benchmark") != benchmark:
    raise ValueError(f"{path}: expected the JSON of the {benchmark!r} benchmark, got {result.get('benchmark')!r}")
  return result


def _device(result: dict) -> str:
  kind = "" if result["device_kind"] == result["backend"] else f" ({result['device_kind']})"
  return f"{result['backend']}{kind}, JAX {result['jax_version']}"


def plot_scaling(result: dict, path: str) -> None:
  """spec/plain against target MB, a line per k, from benchmarks/scaling.py --json."""
  rows, s = result["rows"], result["settings"]
  fig, ax = plt.subplots(figsize=(6, 3.6))
  mb = [r["mb"] for r in rows]
  for k in map(str, s["ks"]):
    ax.plot(mb, [r["spec"][k]["spec_over_plain"] for r in rows], marker="o", label=f"k = {k}")
  ax.axhline(1.0, color="gray", lw=0.8, ls="--")
  for r in rows:  # along the bottom edge, clear of the lines
    ax.annotate(f"{r['layers']} layers", (r["mb"], 0.0), xycoords=("data", "axes fraction"), textcoords="offset points",
                xytext=(0, 4), ha="center", fontsize=7, color="gray")
  ax.margins(x=0.1, y=0.15)
  ax.set_xscale("log", base=2)
  ax.set_xticks(mb, [f"{x:.1f}" for x in mb])
  ax.minorticks_off()
  ax.set_xlabel("target weights (MB, float32)")
  ax.set_ylabel("spec / plain tokens/s")
  ax.set_title(f"small demo target + zero-output layers; {s['num_prompts']} prompts x {s['max_new_tokens']} tokens, "
               f"batch 1\n{_device(result)}", fontsize=8)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def _demo_title(result: dict) -> str:
  s, rep = result["settings"], result["report"]
  return (f"{rep['model']} demo model, {s['num_prompts']} prompts x {s['max_new_tokens']} tokens, greedy, batch 1\n"
          f"{_device(result)}")


def plot_chains(result: dict, path: str) -> None:
  """Acceptance per depth (a line per k) and speedup vs plain against k, the chain rows of a demo report."""
  chains = [r for r in result["report"]["rows"] if r["tree"] is None]
  if not chains:
    raise ValueError("the demo report has no chain rows (run it with --ks)")
  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(8, 3.2))
  for i, r in enumerate(chains):  # larger markers first: the k = 1 point is under the others
    ax1.plot(range(1, r["k"] + 1), r["acceptance"], marker="o", ms=4 + 3 * (len(chains) - i), label=f"k = {r['k']}")
  ax1.set_xticks(range(1, max(r["k"] for r in chains) + 1))
  ax1.set_ylim(0, 1)
  ax1.set_xlabel("draft depth")
  ax1.set_ylabel("P(draft accepted)")
  ax1.legend(fontsize=8)
  ax2.bar([str(r["k"]) for r in chains], [r["speedup"] for r in chains])
  ax2.axhline(1.0, color="gray", lw=0.8, ls="--")
  ax2.set_ylim(0, 1.15 * max([1.0] + [r["speedup"] for r in chains]))  # room for the labels
  for i, r in enumerate(chains):
    ax2.annotate(f"{r['mean_accepted_length']:.2f} tok/step", (i, r["speedup"]), textcoords="offset points",
                 xytext=(0, 3), ha="center", fontsize=7)
  ax2.set_xlabel("k (drafts per step)")
  ax2.set_ylabel(f"speedup vs plain (median of {result['settings']['repeats']})")
  fig.suptitle(_demo_title(result), fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def plot_trees(result: dict, path: str) -> None:
  """Mean accepted length against target rows per verify step, chains as a line, trees as points."""
  rows = result["report"]["rows"]
  chains = sorted((r for r in rows if r["tree"] is None), key=lambda r: r["rows_per_step"])
  trees = [r for r in rows if r["tree"] is not None]
  if not trees:
    raise ValueError("the demo report has no tree rows (run it with --tree)")
  fig, ax = plt.subplots(figsize=(6, 3.6))
  if chains:
    ax.plot([r["rows_per_step"] for r in chains], [r["mean_accepted_length"] for r in chains], marker="o",
            label="chain, k = " + ", ".join(str(r["k"]) for r in chains))
  ax.scatter([r["rows_per_step"] for r in trees], [r["mean_accepted_length"] for r in trees], marker="s",
             color="C1", label="tree (widths per depth)", zorder=3)
  for i, r in enumerate(trees):  # labels alternate below and above: neighbours can coincide
    ax.annotate(",".join(map(str, r["tree"])), (r["rows_per_step"], r["mean_accepted_length"]),
                textcoords="offset points", xytext=(4, -12 if i % 2 else 6), fontsize=7)
  top = max(r["rows_per_step"] for r in rows)
  ticks = [2 ** i for i in range(1, (top - 1).bit_length() + 1)]
  ax.set_xscale("log", base=2)
  ax.set_xticks(ticks, [str(x) for x in ticks])
  ax.minorticks_off()
  ax.set_xlabel("target rows per verify step")
  ax.set_ylabel("mean accepted length (tokens / step)")
  ax.set_title(_demo_title(result), fontsize=8)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def plot_serving(result: dict, path: str) -> None:
  """Engine tokens/s against max_batch, a line per width, a panel per model, from serve_bench.py --json."""
  rows = result["rows"]
  models = list(dict.fromkeys(r["model"] for r in rows))
  fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 3.6), squeeze=False)
  for ax, model in zip(axes[0], models):
    mine = [r for r in rows if r["model"] == model]
    for width in dict.fromkeys(r["width"] for r in mine):
      line = [r for r in mine if r["width"] == width]
      style = dict(ls="--", lw=2) if width.startswith("auto") else {}
      label = width if width.startswith("auto") else f"k = {width}"
      ax.plot([r["max_batch"] for r in line], [r["tokens_per_s"] for r in line], marker="o", label=label, **style)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("max_batch (slots)")
    ax.set_ylabel("tokens / s")
    ax.set_title(model, fontsize=9)
    ax.legend(fontsize=7)
  s = result["settings"]
  fig.suptitle(f"Engine, {s['table_requests']} x max_batch requests of {s['table_output']} tokens; "
               f"{_device(result)}", fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def main(argv=None) -> list[str]:
  """Draws the figures of the inputs given; returns the paths written."""
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--scaling", metavar="JSON", help="benchmarks/scaling.py --json output")
  parser.add_argument("--demo", metavar="JSON", help="benchmarks/demo_report.py --json output")
  parser.add_argument("--serve", metavar="JSON", help="benchmarks/serve_bench.py --json output")
  parser.add_argument("--out", default=DOCS_IMG, help="folder for the PNGs (default docs/img)")
  args = parser.parse_args(argv)
  if not (args.scaling or args.demo or args.serve):
    parser.error("give --scaling, --demo and / or --serve")
  os.makedirs(args.out, exist_ok=True)
  written = []
  if args.scaling:
    written.append(os.path.join(args.out, "scaling.png"))
    plot_scaling(_load(args.scaling, "scaling"), written[-1])
  if args.demo:
    result = _load(args.demo, "demo")
    if any(r["tree"] is None for r in result["report"]["rows"]):
      written.append(os.path.join(args.out, "chains.png"))
      plot_chains(result, written[-1])
    if any(r["tree"] is not None for r in result["report"]["rows"]):
      written.append(os.path.join(args.out, "trees.png"))
      plot_trees(result, written[-1])
  if args.serve:
    written.append(os.path.join(args.out, "serving.png"))
    plot_serving(_load(args.serve, "serve_bench"), written[-1])
  for p in written:
    print("wrote", p)
  return written


if __name__ == "__main__":
  main()
