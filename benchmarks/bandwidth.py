"""The memory-bandwidth limit of a weight-bound `propose` (D=1024, B=1), and where its time goes.

  python benchmarks/bandwidth.py            # D=1024, B=1, k in 1, 3; 512 MB copies
  python benchmarks/bandwidth.py --quick    # a tiny smoke run

A decode step at B=1 must read every module's weights, the LM head once per draft (drafts are
sequential), the embedding rows of its windows, and the KV rows it attends over. Achieved
bytes/s = those bytes / the median call. The machine's bandwidth (a large array copied and
summed, with jax and with numpy) is timed in the same reps, taking turns with propose, so both
see the same load on a shared machine.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import variants as V
from variants import mtp_jax


def interleaved_medians(cases, reps: int) -> list[float]:
  """Median wall time of each (fn, make_input) case; the cases take turns rep by rep, so a
  change in machine load hits them alike. Inputs are made outside the timer."""
  for fn, make_input in cases:
    jax.block_until_ready(fn(*make_input()))
  times = [[] for _ in cases]
  for _ in range(reps):
    for (fn, make_input), ts in zip(cases, times):
      args = make_input()
      start = time.perf_counter()
      jax.block_until_ready(fn(*args))
      ts.append(time.perf_counter() - start)
  return [float(np.median(ts)) for ts in times]


def reference_cases(mbytes: int) -> dict:
  """{name: (fn, make_input, bytes moved)}: streaming (all bytes read and written counted) and
  summing (read) mbytes float32 arrays, with jax and numpy.

  Copies go into a destination whose pages are already touched (numpy: preallocated; jax: the
  donated previous output), so page faults are not timed.
  """
  n = mbytes * 2**20 // 4
  x = jnp.arange(n, dtype=jnp.float32)
  dst = [jnp.zeros_like(x)]

  def into_dst(fn):
    jitted = jax.jit(fn, donate_argnums=0)

    def run():
      dst[0] = jitted(dst[0], x)
      return dst[0]
    return run

  src = np.arange(n, dtype=np.float32)
  out = np.empty_like(src)
  out[:] = 0
  nbytes = n * 4
  no_input = lambda: ()
  return {
      "jax copy": (into_dst(lambda d, s: jnp.copy(s)), no_input, 2 * nbytes),
      # XLA:CPU streams d + s (two reads, one write) much faster than a plain copy
      "jax d += s (3 streams)": (into_dst(lambda d, s: d + s), no_input, 3 * nbytes),
      "jax sum (read)": (jax.jit(jnp.sum), lambda: (x,), nbytes),
      "numpy copy": (lambda: np.copyto(out, src), no_input, 2 * nbytes),
      "numpy sum (read)": (src.sum, no_input, nbytes),
  }


def timed_with_references(cases, refs: dict, reps: int) -> tuple[list[float], dict]:
  """Medians of cases [(fn, make_input)] and GB/s of the reference cases, all interleaved."""
  medians = interleaved_medians(list(cases) + [(fn, make) for fn, make, _ in refs.values()], reps)
  gbs = {name: nbytes / t / 1e9 for (name, (_, _, nbytes)), t in zip(refs.items(), medians[len(cases):])}
  return medians[:len(cases)], gbs


def best(bw: dict) -> tuple[float, float]:
  """(streaming, read) GB/s of the device's memory: the best of the reference figures.

  On the CPU both libraries measure the same memory; on an accelerator only jax measures its own.
  """
  host = jax.default_backend() == "cpu"
  jax_stream = max(bw["jax copy"], bw["jax d += s (3 streams)"])
  stream = max(jax_stream, bw["numpy copy"]) if host else jax_stream
  read = max(bw["jax sum (read)"], bw["numpy sum (read)"]) if host else bw["jax sum (read)"]
  return stream, read


def propose_bytes(step: V.Step, new_state) -> dict:
  """Bytes one decode step reads, by source (the KV cache both as valid rows and as allocated)."""
  p, cfg, k = step.params, step.params.cfg, step.k
  b, t, d = step.hiddens.shape
  item = cfg.jnp_dtype.itemsize
  kv_row = 2 * cfg.num_kv_heads * cfg.head_dim * item  # k and v
  return {
      "module weights": sum(x.nbytes for x in jax.tree.leaves(nnx.state(p.layers, nnx.Param))),
      "LM head, once per draft": k * p.lm_head.weight.nbytes,
      "embedding rows": b * sum(t + i for i in range(V.K)) * d * item,
      "hiddens, rings": step.hiddens.nbytes + sum(x.nbytes for x in step.state.tail),
      "KV rows valid": int(np.asarray(new_state.lengths).sum()) * kv_row,
      "KV cache allocated": V.K * b * step.state.max_len * kv_row,
  }


def dense_only(params, step):
  """The matmuls of a decode step alone (same weights, same row counts): the dense floor."""
  b, t, _ = step.hiddens.shape
  d = params.cfg.hidden_size

  @jax.jit
  def run(params, x):
    total = jnp.zeros((), jnp.float32)
    for i, m in enumerate(params.layers):
      h = x[:, :t + i]
      a = m.block.self_attn
      h = m.eh_proj(jnp.concatenate([h, h], axis=-1))
      q = a.q_proj(h)
      h = a.o_proj(q) + a.k_proj(h).sum() + a.v_proj(h).sum()
      h = m.block.mlp(h)
      if i < step.k:
        total += params.lm_head(h[:, -1]).sum()
    return total + h.sum()

  x = jnp.ones((b, t + V.K, d), params.cfg.jnp_dtype)
  return lambda: run(params, x)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--quick", action="store_true", help="D=64 and a 16 MB array (a smoke test)")
  args = ap.parse_args(argv)
  size, mbytes, reps, drafts = ("D=64", 16, 3, (1,)) if args.quick else ("D=1024", 512, 20, (1, 3))
  print(f"Machine: {V.machine(with_torch=False)}\n")
  refs = reference_cases(mbytes)
  params = mtp_jax.init_mtp(V.config(size), seed=0)
  short_len = V.PROMPT_T + 8
  rows = ["| k | bytes read, valid KV rows (MB) | with whole KV cache (MB) | median ms | GB/s (valid) | "
          "stream / read GB/s (same reps) | / stream | / read | XLA 'bytes accessed' (MB) |", "|---" * 9 + "|"]
  profile = ["| k | what | median ms | share of propose |", "|---|---|---|---|"]
  for k in drafts:
    step = V.warm_step(params, 1, k)
    args = (step.hiddens, step.tokens, step.num_new)
    compiled = V.donated_propose(k).lower(params, step.state, *args).compile()
    fresh_state = lambda: (params, V.copy_tree(step.state), *args)
    _, new_state = compiled(*fresh_state())
    nbytes = propose_bytes(step, new_state)
    kv_alloc = nbytes.pop("KV cache allocated")
    valid = sum(nbytes.values())
    whole = valid - nbytes["KV rows valid"] + kv_alloc
    short = V.warm_step(params, 1, k, max_len=short_len)
    short_run = V.MtpJax(short)
    direct = V.MtpJaxDirect(step)
    dispatch = jax.jit(lambda p, s, h, t, n: s.num_pos + n)
    weights = [x for x in jax.tree.leaves(nnx.state(params, nnx.Param))]
    read_all = jax.jit(lambda ws: sum(w.sum() for w in ws))
    cases = [
        ("propose, max_len 512 (jit, state donated)", compiled, fresh_state),
        (f"propose, max_len {short_len}", short_run.call, lambda: (V.copy_tree(short.state),)),
        ("propose, direct call (eager checks, no donation)", direct.call, lambda: (step.state,)),
        ("after_verify, direct call", mtp_jax.after_verify, lambda: (new_state, step.num_new - 1)),
        ("dispatch only: a trivial jit of the same arguments", dispatch, lambda: (params, step.state, *args)),
        ("the decode step's matmuls alone", dense_only(params, step), lambda: ()),
        ("sum of every weight once (read floor of the weights)", read_all, lambda: (weights,)),
    ]
    medians, bw = timed_with_references([(fn, make) for _, fn, make in cases], refs, reps)
    stream_bw, read_bw = best(bw)
    t_prop = medians[0]
    gbs = valid / t_prop / 1e9
    cost = compiled.cost_analysis()
    xla_bytes = cost.get("bytes accessed", float("nan")) if isinstance(cost, dict) else float("nan")
    rows.append(f"| {k} | {valid / 1e6:.1f} | {whole / 1e6:.1f} | {t_prop * 1e3:.2f} | {gbs:.1f} | "
                f"{stream_bw:.1f} / {read_bw:.1f} | {gbs / stream_bw:.2f} | {gbs / read_bw:.2f} | "
                f"{xla_bytes / 1e6:.1f} |")
    print(f"k={k}: bytes by source (MB): " + ", ".join(f"{n} {v / 1e6:.2f}" for n, v in nbytes.items())
          + f", KV cache allocated {kv_alloc / 1e6:.2f}")
    print(f"k={k}: memory bandwidth ({mbytes} MB float32 arrays, timed in turn with the rows below), GB/s: "
          + ", ".join(f"{name} {v:.1f}" for name, v in bw.items()))
    for (what, _, _), t in zip(cases, medians):
      profile.append(f"| {k} | {what} | {t * 1e3:.2f} | {t / t_prop:.2f} |")
  print(f"\nDecode-step propose at B=1, {size} (V={V.SIZES[size]['vocab_size']}), float32, K={V.K}; ratios "
        "against the best streaming and read figures measured in the same reps:\n")
  print("\n".join(rows))
  print("\nWhere the time goes (same run; the rows and the bandwidth references take turns rep by rep):\n")
  print("\n".join(profile))


if __name__ == "__main__":
  main()
