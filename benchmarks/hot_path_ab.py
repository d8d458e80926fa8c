"""A/B timing of candidate changes to mtp_jax's hot path, applied in this process by
monkeypatching (no file under mtp_jax/ is edited):

- linear: `Linear` with at most 8 rows computes dot_general(weight, x) (weight as the dot's lhs)
  and moves the output axis last. XLA:CPU runs a [few, in] x [out, in]^T dot well below memory
  bandwidth; with the weight as lhs it streams 1.4-1.7x faster at 2-6 rows (the first table printed).
- layout: KV caches laid out [B, Hkv, L, Dh] instead of [B, L, Hkv, Dh], so both attention dots
  have their batch dims (b, head) leading and XLA does not relayout a cache-sized operand.

  python benchmarks/hot_path_ab.py            # dot speed by row count; D=1024, B in 1, 32, k in 1, 3
  python benchmarks/hot_path_ab.py --quick    # a tiny smoke run

Every patched variant must give the unpatched drafts. Variants take turns rep by rep.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

import variants as V
from mtp_jax import layers, proposer
from variants import mtp_jax

FEW_ROWS = 8


def linear_weight_lhs(self, x_BxTxI):
  rows = int(np.prod(x_BxTxI.shape[:-1]))
  if rows > FEW_ROWS:
    return _ORIGINAL["linear"](self, x_BxTxI)
  y = jax.lax.dot_general(self.weight[...], x_BxTxI, (((1,), (x_BxTxI.ndim - 1,)), ((), ())))
  y = jnp.moveaxis(y, 0, -1)
  return y if self.bias is None else y + self.bias[...]


def heads_major_zeros(cls, cfg, batch_size, max_len, dtype=None):
  shape = (batch_size, cfg.num_kv_heads, max_len, cfg.head_dim)
  dtype = dtype or cfg.jnp_dtype
  return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))


def heads_major_attention(self, x_BxTxD, rows_BxT, valid_BxT, cache, rope_offset=0):
  """Attention.__call__ over a [B, Hkv, L, Dh] cache (the cache-free path is unchanged)."""
  if cache is None:
    return _ORIGINAL["attention"](self, x_BxTxD, rows_BxT, valid_BxT, cache, rope_offset)
  b, t, _ = x_BxTxD.shape
  hkv, dh = self.num_kv_heads, self.head_dim
  g = self.num_heads // hkv
  pos_BxT = rows_BxT + rope_offset
  q = layers.rope(self.q_proj(x_BxTxD).reshape(b, t, hkv * g, dh), pos_BxT, self.rope_theta)
  k = layers.rope(self.k_proj(x_BxTxD).reshape(b, t, hkv, dh), pos_BxT, self.rope_theta)
  v = self.v_proj(x_BxTxD).reshape(b, t, hkv, dh)
  max_len = cache.k.shape[2]
  write_BxT = jnp.where(valid_BxT, rows_BxT, max_len)
  b_idx = jnp.arange(b)[:, None]
  # [b_idx, :, write] indexes [B, T, Hkv, Dh]: the advanced indices' dims come first
  new_cache = layers.KVCache(cache.k.at[b_idx, :, write_BxT].set(k.astype(cache.k.dtype), mode="drop"),
                             cache.v.at[b_idx, :, write_BxT].set(v.astype(cache.v.dtype), mode="drop"))
  q = q.reshape(b, t, hkv, g, dh)
  scores = jnp.einsum("btkgd,bksd->bkgts", q, new_cache.k.astype(q.dtype),
                      preferred_element_type=jnp.float32) * dh**-0.5
  mask_BxTxS = jnp.arange(max_len, dtype=jnp.int32)[None, None, :] <= rows_BxT[:, :, None]
  scores = jnp.where(mask_BxTxS[:, None, None], scores, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(scores, axis=-1).astype(new_cache.v.dtype)
  out = jnp.einsum("bkgts,bksd->btkgd", probs, new_cache.v).reshape(b, t, hkv * g * dh)
  return self.o_proj(out.astype(x_BxTxD.dtype)), new_cache


_ORIGINAL = dict(linear=layers.Linear.__call__, attention=layers.Attention.__call__,
                 zeros=layers.KVCache.__dict__["zeros"], max_len=proposer.ProposerState.__dict__["max_len"])


@contextlib.contextmanager
def patched(names):
  """Applies the named patches ("linear", "layout") for the duration of the block."""
  try:
    if "linear" in names:
      layers.Linear.__call__ = linear_weight_lhs
    if "layout" in names:
      layers.Attention.__call__ = heads_major_attention
      layers.KVCache.zeros = classmethod(heads_major_zeros)
      proposer.ProposerState.max_len = property(lambda s: s.kv[0].k.shape[2])
    yield
  finally:
    layers.Linear.__call__ = _ORIGINAL["linear"]
    layers.Attention.__call__ = _ORIGINAL["attention"]
    layers.KVCache.zeros = _ORIGINAL["zeros"]
    proposer.ProposerState.max_len = _ORIGINAL["max_len"]


def propose_ab(size, batches, drafts, reps):
  variants = [(), ("linear",), ("layout",), ("linear", "layout")]
  names = ["library", "linear", "layout", "linear + layout"]
  rows = ["| size | B | k | " + " | ".join(f"{n} ms" for n in names) + " | scratch MB: library / layout |",
          "|---" * (4 + len(names)) + "|"]
  params = mtp_jax.init_mtp(V.config(size), seed=0)
  for b in batches:
    for k in drafts:
      runs = []
      for patch in variants:
        with patched(patch):
          step = V.warm_step(params, b, k)
          # a fresh jit per patch: a cached trace would hold the unpatched code
          fn = jax.jit(lambda p, s, h, t, n: mtp_jax.propose(p, s, h, t, n, num_drafts=k), donate_argnums=1)
          compiled = fn.lower(params, step.state, step.hiddens, step.tokens, step.num_new).compile()
        call = functools.partial(lambda c, s, st: c(s.params, st, s.hiddens, s.tokens, s.num_new), compiled, step)
        drafts_out, _ = jax.block_until_ready(call(V.copy_tree(step.state)))
        mem = compiled.memory_analysis()
        runs.append(dict(call=call, state=step.state, drafts=np.asarray(drafts_out), times=[],
                         temp=mem.temp_size_in_bytes if mem is not None else float("nan")))
      for r in runs[1:]:
        assert np.array_equal(r["drafts"], runs[0]["drafts"]), "a patch changed the drafts"
      for _ in range(reps):
        for r in runs:
          inp = V.copy_tree(r["state"])
          start = time.perf_counter()
          jax.block_until_ready(r["call"](inp))
          r["times"].append(time.perf_counter() - start)
      base = float(np.median(runs[0]["times"]))
      cells = [f"{base * 1e3:.2f}"] + [f"{np.median(r['times']) * 1e3:.2f} ({np.median(r['times']) / base:.2f}×)"
                                       for r in runs[1:]]
      rows.append(f"| {size} | {b} | {k} | " + " | ".join(cells)
                  + f" | {runs[0]['temp'] / 1e6:.1f} / {runs[2]['temp'] / 1e6:.1f} |")
  return rows


def dot_rows(out_features, in_features, count, row_counts, reps):
  """GB/s at which a [rows, in] x [out, in]^T dot streams `count` weights, einsum vs weight as lhs.

  The minimum over reps: this is a property of the kernel, and the minimum is the least
  disturbed by other jobs on a shared machine.
  """
  rng = np.random.default_rng(0)
  ws = [jnp.asarray(rng.normal(size=(out_features, in_features)).astype(np.float32)) for _ in range(count)]
  nbytes = sum(w.nbytes for w in ws)
  forms = {
      "einsum('ti,oi->to', x, W) (library)": lambda ws, x: sum(jnp.einsum("ti,oi->to", x, w).sum() for w in ws),
      "dot_general(W, x) (weight as lhs)": lambda ws, x: sum(
          jax.lax.dot_general(w, x, (((1,), (1,)), ((), ()))).sum() for w in ws),
  }
  rows = ["| rows | " + " | ".join(forms) + " |", "|---" * (1 + len(forms)) + "|"]
  for n in row_counts:
    x = jnp.ones((n, in_features), jnp.float32)
    cells = []
    for fn in forms.values():
      jitted = jax.jit(fn)
      jax.block_until_ready(jitted(ws, x))
      ts = []
      for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(jitted(ws, x))
        ts.append(time.perf_counter() - start)
      cells.append(f"{nbytes / min(ts) / 1e9:.1f}")
    rows.append(f"| {n} | " + " | ".join(cells) + " |")
  return nbytes, rows


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--quick", action="store_true", help="D=64, B=2, k=1, 3 reps (a smoke test)")
  args = ap.parse_args(argv)
  size, batches, drafts, reps = ("D=64", [2], [1], 3) if args.quick else ("D=1024", [1, 32], [1, 3], 15)
  print(f"Machine: {V.machine(with_torch=False)}\n")
  shape, count = ((128, 64), 2) if args.quick else ((2816, 1024), 14)
  nbytes, rows = dot_rows(*shape, count, [1, 2, 4, 6] if not args.quick else [1, 4], max(reps, 3) + 10)
  print(f"Weight streaming of a few-row dot, GB/s (minimum time of {max(reps, 3) + 10} runs; {count} weights "
        f"{list(shape)}, {nbytes / 1e6:.0f} MB float32):\n")
  print("\n".join(rows) + "\n")
  print(f"Decode-step propose (jit, state donated), median ms, K={V.K}, max_len={V.MAX_LEN}, float32; "
        f"linear: weight as the dot's lhs when x has <= {FEW_ROWS} rows; layout: [B, Hkv, L, Dh] caches.\n")
  print("\n".join(propose_ab(size, batches, drafts, reps)))


if __name__ == "__main__":
  main()
