"""The speculative-vs-plain comparison behind `mtp-jax demo`, and exporting a checkpoint as a demo model
(the shipped models load through `mtp_jax.demo_models`)."""

from __future__ import annotations

import dataclasses
import os
import shutil
import time
from collections.abc import Callable

import ml_dtypes
import numpy as np

from mtp_jax import checkpoint, data, validate
from mtp_jax.checkpoint_dir import CONFIG_FILE, MTP_FILE, TARGET_FILE, read_config
from mtp_jax.demo_models import load_demo
from mtp_jax.serving import generate
from mtp_jax.tree import TreeSpec, check_tree


def export_demo(checkpoint_dir, out_dir, *, dtype: str = "bfloat16") -> int:
  """Writes the inference files of a training checkpoint (target, MTP modules, config; no optimizer
  state) to out_dir, floating tensors stored as `dtype`. Returns the bytes written."""
  read_config(checkpoint_dir)  # a complete checkpoint, or a clear error
  os.makedirs(out_dir, exist_ok=True)
  stored = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
  total = 0
  for name in (TARGET_FILE, MTP_FILE):
    tensors = checkpoint.load_tensors(os.path.join(os.fspath(checkpoint_dir), name))
    tensors = {k: v.astype(stored) if v.dtype.kind == "f" else v for k, v in tensors.items()}
    file = os.path.join(out_dir, name)
    checkpoint.save_tensors(file, tensors)
    os.chmod(file, 0o644)  # package data: safetensors writes owner-only files
    total += os.path.getsize(file)
  # The config keeps the compute dtype (float32): loading casts the stored tensors to it.
  shutil.copyfile(os.path.join(os.fspath(checkpoint_dir), CONFIG_FILE), os.path.join(out_dir, CONFIG_FILE))
  return total


@dataclasses.dataclass
class DemoRow:
  """Speculative decoding with k drafts (a chain, or a tree k deep), on the same prompts as plain
  greedy decoding."""

  k: int
  acceptance: list[float]      # P(draft i accepted) per verify step, i = 1..k
  mean_accepted_length: float  # tokens per verify step (target call after the prefill)
  target_calls: int            # prefill included, summed over prompts
  tokens_per_s: float          # generated tokens / the median pass time
  speedup: float               # median over passes of plain pass time / this pass time
  ms_per_call: float           # median decode time per target call: one verify + one propose step
  compile_s: float
  same_as_plain: bool
  tree: tuple[int, ...] | None  # the tree's widths; None for the chain
  rows_per_step: int            # target rows a verify step runs: k + 1, or the tree's nodes + 1

  @property
  def label(self) -> str:
    return f"k={self.k}" if self.tree is None else "tree " + ",".join(map(str, self.tree))


@dataclasses.dataclass
class DemoReport:
  model: str  # "small", "large" or the checkpoint path
  rows: list[DemoRow]
  plain_tokens_per_s: float
  plain_ms_per_call: float
  plain_target_calls: int
  plain_compile_s: float
  generated_tokens: int
  repeats: int
  sample: tuple[str, str]  # the first prompt and its greedy continuation


def _timed(fn, prompt):
  t0 = time.perf_counter()
  out = fn(prompt)
  return out, time.perf_counter() - t0


def _interleaved(decoders: list, prompts, repeats: int) -> tuple[list, np.ndarray, list[float]]:
  """Runs every decoder on every prompt (batch 1), `repeats` passes, taking turns prompt by prompt
  (the order rotates each pass), so load changes on the machine hit all decoders alike.

  Returns (outputs per decoder (one list over prompts, from the last pass), seconds per pass
  float64[decoders, repeats] summed over prompts, compile seconds per decoder: its first call,
  made before any timing, minus its median time on the same prompt).
  """
  first = [_timed(fn, prompts[0])[1] for fn in decoders]
  n = len(decoders)
  secs = np.zeros((n, repeats, len(prompts)))
  outs = [[None] * len(prompts) for _ in decoders]
  for rep in range(repeats):
    for j, p in enumerate(prompts):
      for shift in range(n):
        i = (rep + j + shift) % n
        outs[i][j], secs[i, rep, j] = _timed(decoders[i], p)
  compile_s = [max(0.0, f - float(np.median(secs[i, :, 0]))) for i, f in enumerate(first)]
  return outs, secs.sum(axis=2), compile_s


def _pooled(outs, key: str) -> np.ndarray:
  """A per-verify-step rate (scalar or per depth) pooled over prompts, each weighted by its verify steps."""
  steps = np.array([o.stats["verify_calls"] for o in outs], np.float64)
  rates = np.array([o.stats[key] for o in outs], np.float64)
  return np.tensordot(steps, rates, axes=1) / steps.sum()


def run_demo(*, num_prompts: int = 8, prompt_len: int = 64, max_new_tokens: int = 128, seed: int = 0,
             name: str = "small", path=None, ks: list[int] | None = None, repeats: int = 3,
             trees: list[TreeSpec] | None = None, max_depth: int | None = None) -> DemoReport:
  """Greedy speculative decoding for each k in `ks` (default 1..K), for each draft tree in `trees`
  (`mtp_jax.tree.TreeSpec`, at most max_depth deep, default K; default none) and plain greedy decoding on
  `num_prompts` held-out prompts of `prompt_len` bytes, one prompt at a time (batch 1, the
  latency setting speculative decoding is for), with the demo model `name` (or the checkpoint
  `path`). The decoders take turns (see `_interleaved`); times are medians over `repeats`
  passes, and compilation is timed apart from decoding.
  """
  num_prompts = validate.positive_int("num_prompts", num_prompts)
  prompt_len = validate.positive_int("prompt_len", prompt_len)
  max_new_tokens = validate.positive_int("max_new_tokens", max_new_tokens)
  seed = validate.integer("seed", seed, 0)
  repeats = validate.positive_int("repeats", repeats)
  target, proposer, tok = load_demo(path, name=name, max_depth=max_depth)
  num_depths = proposer.cfg.num_depths
  ks = list(range(1, proposer.cfg.num_modules + 1)) if ks is None else [
      validate.integer(f"ks[{i}]", k, 1, num_depths) for i, k in enumerate(ks)]
  trees = [] if trees is None else [check_tree(t, max_depth=proposer.cfg.num_depths, argument=f"trees[{i}]")
                                     for i, t in enumerate(trees)]
  prompts = data.heldout_prompts(num_prompts, prompt_len=prompt_len, seed=seed)
  decoders = [lambda p: generate(target, None, [p], max_new_tokens)]
  decoders += [lambda p, k=k: generate(target, proposer, [p], max_new_tokens, num_drafts=k) for k in ks]
  decoders += [lambda p, t=t: generate(target, proposer, [p], max_new_tokens, tree=t) for t in trees]
  outs, secs, compile_s = _interleaved(decoders, prompts, repeats)
  plain, plain_secs = outs[0], secs[0]
  generated = sum(o.stats["generated_tokens"] for o in plain)
  plain_calls = sum(o.stats["target_calls"] for o in plain)
  rows = []
  shapes = [(k, None, k + 1) for k in ks] + [(t.depth, t.widths, t.num_nodes + 1) for t in trees]
  for (k, widths, rows_per_step), spec, spec_secs, spec_compile in zip(shapes, outs[1:], secs[1:], compile_s[1:]):
    calls = sum(o.stats["target_calls"] for o in spec)
    run_s = float(np.median(spec_secs))
    rows.append(DemoRow(k=k, acceptance=_pooled(spec, "acceptance_per_position").tolist(),
                        mean_accepted_length=float(_pooled(spec, "mean_accepted_length")), target_calls=calls,
                        tokens_per_s=sum(o.stats["generated_tokens"] for o in spec) / run_s,
                        speedup=float(np.median(plain_secs / spec_secs)),
                        ms_per_call=1e3 * run_s / calls, compile_s=spec_compile,
                        same_as_plain=[o.tokens for o in spec] == [o.tokens for o in plain],
                        tree=widths, rows_per_step=rows_per_step))
  plain_s = float(np.median(plain_secs))
  return DemoReport(model=name if path is None else os.fspath(path), rows=rows,
                    plain_tokens_per_s=generated / plain_s, plain_ms_per_call=1e3 * plain_s / plain_calls,
                    plain_target_calls=plain_calls, plain_compile_s=compile_s[0], generated_tokens=generated,
                    repeats=repeats, sample=(tok.decode(prompts[0]), tok.decode(plain[0].tokens[0])))


def best_row(report: DemoReport) -> DemoRow:
  """The row (k or tree) with the highest speculative tokens/s."""
  return max(report.rows, key=lambda r: r.tokens_per_s)


def format_report(report: DemoReport) -> str:
  """The demo's table as text, one row per k or tree, then the best one in one line."""
  k_max = max(r.k for r in report.rows)
  width = max(len(r.label) for r in report.rows)
  head = (f"{'drafts':<{width}} | {'rows':>4} | {'acceptance per depth':<{7 * k_max}} | {'accepted len':>12} | "
          f"{'target calls':>12} | "
          f"{'ms/call':>7} | {'spec tok/s':>10} | {'plain tok/s':>11} | {'speedup':>7} | {'same':>4} | "
          f"{'compile s':>9}")
  lines = [head, "-" * len(head)]
  for r in report.rows:
    acc = " ".join(f"{a:6.3f}" for a in r.acceptance)
    lines.append(f"{r.label:<{width}} | {r.rows_per_step:>4} | {acc:<{7 * k_max}} | {r.mean_accepted_length:>12.3f} | "
                 f"{r.target_calls:>12} | "
                 f"{r.ms_per_call:>7.2f} | {r.tokens_per_s:>10.0f} | {report.plain_tokens_per_s:>11.0f} | "
                 f"{r.speedup:>6.2f}x | {'yes' if r.same_as_plain else 'NO':>4} | {r.compile_s:>9.1f}")
  lines.append(f"plain greedy: {report.plain_target_calls} target calls for {report.generated_tokens} tokens, "
               f"{report.plain_ms_per_call:.2f} ms/call, compile {report.plain_compile_s:.1f} s")
  best = best_row(report)
  lines.append(f"best: {best.label}, {best.speedup:.2f}x plain tokens/s ({best.tokens_per_s:.0f} vs "
               f"{report.plain_tokens_per_s:.0f}), mean accepted length {best.mean_accepted_length:.2f}, "
               f"model {report.model}")
  return "\n".join(lines)


def main(*, num_prompts: int, prompt_len: int, max_new_tokens: int, seed: int, repeats: int,
         ks: list[int] | None = None, name: str = "small", path=None, out: Callable[[str], None] = print,
         trees: list[TreeSpec] | None = None, max_depth: int | None = None) -> int:
  """Runs the demo and prints the table; returns 1 if any speculative output differs from plain."""
  report = run_demo(num_prompts=num_prompts, prompt_len=prompt_len, max_new_tokens=max_new_tokens,
                    seed=seed, name=name, path=path, ks=ks, repeats=repeats, trees=trees, max_depth=max_depth)
  prompt, continuation = report.sample
  out(f"demo model: {report.model}; {num_prompts} held-out prompts of {prompt_len} bytes, {max_new_tokens} new "
      f"tokens each, greedy, one prompt at a time; plain and every k take turns, times are medians of "
      f"{repeats} passes, compile apart; speedup: median of per-pass ratios")
  out(f"sample prompt:\n{prompt}\n--- greedy continuation:\n{continuation}\n---")
  out(format_report(report))
  same = all(r.same_as_plain for r in report.rows)
  out("speculative output equals plain greedy output for every k and tree" if same
      else "MISMATCH: speculative output differs from plain greedy output")
  return 0 if same else 1
