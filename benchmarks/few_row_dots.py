"""How fast XLA:CPU runs the large demo target's dots at 1, 4 and 6 rows, by how the weights are held.

  python benchmarks/few_row_dots.py            # 30 reps
  python benchmarks/few_row_dots.py --quick     # one layer, 2 reps (a smoke run)

A chain shaped like the large demo target's 10 layers (D = 384, q 384 / k, v 128 / o 384 out, SwiGLU
1024; 63 MB of float32 weights, more than the L3 cache), each dot feeding the next through cheap
elementwise ops as in the model, so that XLA runs them one after another as a decode step does.
Forms:

- f32 [out, in] (library): `Linear`'s few-row form, dot_general(W, x).
- f32 [in, out]: the weight stored transposed, x @ W.
- f32 fused: q, k, v and gate, up concatenated at load time (4 dots a layer instead of 7).
- bf16 [out, in]: weights in bfloat16, x cast to bfloat16, float32 accumulation (activations
  rounded: not the float32 model's numbers).
- bf16, exact split: weights in bfloat16 and x split into three bfloat16 parts (hi + mid + lo ==
  x in float32) stacked as rows, float32 accumulation: float32 activations exactly, half the
  weight bytes, three times the rows. A 1-row input is padded to 2 rows in the bf16 forms (1-row
  bf16 dots take a slow path on XLA:CPU).

The forms take turns rep by rep; medians, the load average printed.
"""

from __future__ import annotations

import argparse
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

LAYERS, D, F = 10, 384, 1024
SHAPES = dict(q=(384, D), k=(128, D), v=(128, D), o=(D, 384), g=(F, D), u=(F, D), d=(D, F))


def weights(rng, dtype, layers, transposed=False, fused=False):
  out = []
  for _ in range(layers):
    w = {n: (rng.normal(size=s) * s[1]**-0.5).astype(np.float32) for n, s in SHAPES.items()}
    if fused:
      w = dict(qkv=np.concatenate([w["q"], w["k"], w["v"]]), o=w["o"], gu=np.concatenate([w["g"], w["u"]]), d=w["d"])
    out.append({n: jnp.asarray(x.T.copy() if transposed else x).astype(dtype) for n, x in w.items()})
  return out


def dot(w, x, *, transposed=False, split=1):
  """x float32[T, in] through weight w (float32 or bfloat16) -> float32[T, out]."""
  t = x.shape[0]
  if w.dtype == jnp.float32:
    parts = [x]
  else:
    parts, rest = [], x
    for _ in range(split):
      p = rest.astype(w.dtype)
      parts.append(p)
      rest = rest - p.astype(jnp.float32)
  xs = jnp.concatenate(parts + ([jnp.zeros_like(parts[0])] if t * len(parts) == 1 and w.dtype != jnp.float32 else []))
  if transposed:
    y = jax.lax.dot_general(xs, w, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
  else:
    y = jax.lax.dot_general(w, xs, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32).T
  return sum(y[i * t:(i + 1) * t] for i in range(len(parts)))


def model(transposed=False, fused=False, split=1):
  lin = lambda w, x: dot(w, x, transposed=transposed, split=split)

  @jax.jit
  def run(ws, x):
    h = x
    for w in ws:
      if fused:
        qkv = lin(w["qkv"], h)
        q, k, v = qkv[:, :384], qkv[:, 384:512], qkv[:, 512:]
      else:
        q, k, v = lin(w["q"], h), lin(w["k"], h), lin(w["v"], h)
      h = h + lin(w["o"], q * (k.sum() + v.sum()))
      h2 = h * jax.lax.rsqrt((h * h).mean(-1, keepdims=True) + 1e-6)
      if fused:
        gu = lin(w["gu"], h2)
        g, u = gu[:, :F], gu[:, F:]
      else:
        g, u = lin(w["g"], h2), lin(w["u"], h2)
      h = h + lin(w["d"], jax.nn.silu(g) * u)
    return h
  return run


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--reps", type=int, default=30)
  ap.add_argument("--quick", action="store_true", help="one layer, 2 reps (a smoke test)")
  args = ap.parse_args(argv)
  layers, reps = (1, 2) if args.quick else (LAYERS, args.reps)
  rng = np.random.default_rng(0)
  forms = {
      "f32 [out, in] (library)": (model(), weights(rng, jnp.float32, layers)),
      "f32 [in, out]": (model(transposed=True), weights(rng, jnp.float32, layers, transposed=True)),
      "f32 fused q+k+v, gate+up": (model(fused=True), weights(rng, jnp.float32, layers, fused=True)),
      "bf16 [out, in], x rounded": (model(), weights(rng, jnp.bfloat16, layers)),
      "bf16 [out, in], x split exactly (3 parts)": (model(split=3), weights(rng, jnp.bfloat16, layers)),
  }
  row_counts = (1, 4, 6)
  cases = {}
  for rows in row_counts:
    x = jnp.asarray(rng.normal(size=(rows, D)).astype(np.float32))
    for name, (fn, ws) in forms.items():
      jax.block_until_ready(fn(ws, x))
      cases[(name, rows)] = (fn, ws, x)
  times = {c: [] for c in cases}
  load = os.getloadavg()
  for _ in range(reps):
    for c, (fn, ws, x) in cases.items():
      start = time.perf_counter()
      jax.block_until_ready(fn(ws, x))
      times[c].append(time.perf_counter() - start)
  load_after = os.getloadavg()
  mbytes = sum(w.nbytes for w in jax.tree.leaves(forms["f32 [out, in] (library)"][1])) / 1e6
  print(f"{layers} layers of the large demo target's dots, {mbytes:.0f} MB float32; {reps} reps interleaved, medians; "
        f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} before, {load_after[0]:.2f} after\n")
  base = float(np.median(times[("f32 [out, in] (library)", 1)]))
  print("| weights | " + " | ".join(f"{r} row{'s' if r > 1 else ''} ms (/ f32 1 row)" for r in row_counts) + " |")
  print("|---" * (len(row_counts) + 1) + "|")
  for name in forms:
    cells = [float(np.median(times[(name, r)])) for r in row_counts]
    print(f"| {name} | " + " | ".join(f"{t * 1e3:.2f} ({t / base:.2f})" for t in cells) + " |")


if __name__ == "__main__":
  main()
