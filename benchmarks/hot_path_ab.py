"""Why the library's `Linear` treats few-row inputs specially, and an A/B of a candidate change
to its attention, applied in this process by monkeypatching (no file under mtp_jax/ is edited).

- dot rows: how fast XLA:CPU streams the weights of a [rows, in] x [out, in]^T dot, as
  `einsum("ti,oi->to")` and as `dot_general(W, x)` (the weight as the left operand). The second
  form is what `Linear` uses for at most 8 rows since commit 7547f5e.
- layout: KV caches laid out [B, Hkv, L, Dh] instead of [B, L, Hkv, Dh], so both attention dots
  have their batch dims (b, head) leading and XLA does not relayout a cache-sized operand.

  python benchmarks/hot_path_ab.py            # dot rows; D=1024, B in 1, 32, k in 1, 3
  python benchmarks/hot_path_ab.py --quick    # a tiny smoke run

The patched variant must give the unpatched drafts. Variants take turns rep by rep. The last
column divides the bytes a decode step reads (`bandwidth.propose_bytes`, valid KV rows) by the
median time and by the read bandwidth (best of jax and numpy, a 512 MB array) timed in the
same reps.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

import bandwidth
import variants as V
from mtp_jax.blocks import attention, cache as cache_lib
from mtp_jax.blocks.rope import apply_rope
from variants import mtp_jax

def heads_major_zeros(cls, cfg, batch_size, max_len, dtype=None):
  shape = (batch_size, cfg.num_kv_heads, max_len, cfg.head_dim)
  dtype = dtype or cfg.jnp_dtype
  return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))


def heads_major_attention(self, x_BxTxD, rows_BxT, valid_BxT, cache, rope_offset=0, tree=None):
  """Attention.__call__ over a [B, Hkv, L, Dh] cache for chain rows (the cache-free path is
  unchanged; tree rows are not part of this A/B)."""
  if tree is not None:
    raise NotImplementedError("the heads-major A/B covers chain drafts only")
  if cache is None:
    return _ORIGINAL["attention"](self, x_BxTxD, rows_BxT, valid_BxT, cache, rope_offset)
  b, t, _ = x_BxTxD.shape
  hkv, dh = self.num_kv_heads, self.head_dim
  g = self.num_heads // hkv
  pos_BxT = rows_BxT + rope_offset
  rope = functools.partial(apply_rope, inv_freq=self.inv_freq, interleave=self.interleave,
                           attention_factor=self.rope_factor)
  q = rope(self.q_proj(x_BxTxD).reshape(b, t, hkv * g, dh), pos_BxT)
  k = rope(self.k_proj(x_BxTxD).reshape(b, t, hkv, dh), pos_BxT)
  v = self.v_proj(x_BxTxD).reshape(b, t, hkv, dh)
  max_len = cache.k.shape[2]
  write_BxT = jnp.where(valid_BxT, rows_BxT, max_len)
  b_idx = jnp.arange(b)[:, None]
  # [b_idx, :, write] indexes [B, T, Hkv, Dh]: the advanced indices' dims come first
  new_cache = cache_lib.KVCache(cache.k.at[b_idx, :, write_BxT].set(k.astype(cache.k.dtype), mode="drop"),
                                cache.v.at[b_idx, :, write_BxT].set(v.astype(cache.v.dtype), mode="drop"))
  q = q.reshape(b, t, hkv, g, dh)
  scores = jnp.einsum("btkgd,bksd->bkgts", q, new_cache.k.astype(q.dtype),
                      preferred_element_type=jnp.float32) * dh**-0.5
  mask_BxTxS = jnp.arange(max_len, dtype=jnp.int32)[None, None, :] <= rows_BxT[:, :, None]
  scores = jnp.where(mask_BxTxS[:, None, None], scores, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(scores, axis=-1).astype(new_cache.v.dtype)
  out = jnp.einsum("bkgts,bksd->btkgd", probs, new_cache.v).reshape(b, t, hkv * g * dh)
  return self.o_proj(out.astype(x_BxTxD.dtype)), new_cache


_ORIGINAL = dict(attention=attention.Attention.__call__, zeros=cache_lib.KVCache.__dict__["zeros"],
                 max_len=cache_lib.KVCache.__dict__["max_len"])


@contextlib.contextmanager
def heads_major(enabled: bool):
  """[B, Hkv, L, Dh] caches for the duration of the block (when enabled)."""
  try:
    if enabled:
      attention.Attention.__call__ = heads_major_attention
      cache_lib.KVCache.zeros = classmethod(heads_major_zeros)
      cache_lib.KVCache.max_len = property(lambda c: c.k.shape[2])
    yield
  finally:
    attention.Attention.__call__ = _ORIGINAL["attention"]
    cache_lib.KVCache.zeros = _ORIGINAL["zeros"]
    cache_lib.KVCache.max_len = _ORIGINAL["max_len"]


def propose_ab(size, batches, drafts, reps, refs):
  """Rows of the A/B table; the last column is bytes read / time / the read bandwidth, timed in
  turn with the two variants (`refs`: bandwidth.reference_cases)."""
  rows = ["| size | B | k | library ms | layout ms | scratch MB: library / layout | "
          "share of read bandwidth: library / layout |", "|---" * 7 + "|"]
  params = mtp_jax.init_mtp(V.config(size), seed=0)
  for b in batches:
    for k in drafts:
      runs = []
      for patch in (False, True):
        with heads_major(patch):
          step = V.warm_step(params, b, k)
          # a fresh jit per patch: a cached trace would hold the unpatched code
          fn = jax.jit(lambda p, s, h, t, n: mtp_jax.propose(p, s, h, t, n, num_drafts=k), donate_argnums=1)
          compiled = fn.lower(params, step.state, step.hiddens, step.tokens, step.num_new).compile()
        call = functools.partial(lambda c, s, st: c(s.params, st, s.hiddens, s.tokens, s.num_new), compiled, step)
        drafts_out, new_state = jax.block_until_ready(call(V.copy_tree(step.state)))
        mem = compiled.memory_analysis()
        if not patch:  # both read the same bytes; the unpatched state has the library's layout
          nbytes = bandwidth.propose_bytes(step, new_state)
          valid_bytes = sum(nbytes.values()) - nbytes["KV cache allocated"]
        runs.append(dict(call=call, state=step.state, drafts=np.asarray(drafts_out),
                         temp=mem.temp_size_in_bytes if mem is not None else float("nan")))
      assert np.array_equal(runs[1]["drafts"], runs[0]["drafts"]), "the layout changed the drafts"
      cases = [(r["call"], functools.partial(lambda st: (V.copy_tree(st),), r["state"])) for r in runs]
      (library_s, layout_s), bw = bandwidth.timed_with_references(cases, refs, reps)
      read_gbs = bandwidth.best(bw)[1]
      share = [valid_bytes / t / 1e9 / read_gbs for t in (library_s, layout_s)]
      rows.append(f"| {size} | {b} | {k} | {library_s * 1e3:.2f} | {layout_s * 1e3:.2f} "
                  f"({layout_s / library_s:.2f}×) | {runs[0]['temp'] / 1e6:.1f} / {runs[1]['temp'] / 1e6:.1f} | "
                  f"{share[0]:.2f} / {share[1]:.2f} |")
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
  ap.add_argument("--quick", action="store_true", help="tiny sizes, few reps (a smoke test)")
  args = ap.parse_args(argv)
  if args.quick:
    size, batches, drafts, reps, mbytes = "D=64", [2], [1], 3, 16
    dot_shape, dot_count, dot_rows_list = (128, 64), 2, [1, 4]
  else:
    size, batches, drafts, reps, mbytes = "D=1024", [1, 32], [1, 3], 15, 512
    dot_shape, dot_count, dot_rows_list = (2816, 1024), 14, [1, 2, 4, 6]
  print(f"Machine: {V.machine(with_torch=False)}\n")
  refs = bandwidth.reference_cases(mbytes)
  dot_reps = reps + 10
  nbytes, rows = dot_rows(*dot_shape, dot_count, dot_rows_list, dot_reps)
  print(f"Weight streaming of a few-row dot, GB/s (minimum time of {dot_reps} runs; {dot_count} weights "
        f"{list(dot_shape)}, {nbytes / 1e6:.0f} MB float32):\n")
  print("\n".join(rows) + "\n")
  print(f"Decode-step propose (jit, state donated), median ms, K={V.K}, max_len={V.MAX_LEN}, float32; "
        "library caches [B, L, Hkv, Dh], layout: [B, Hkv, L, Dh].\n")
  print("\n".join(propose_ab(size, batches, drafts, reps, refs)))


if __name__ == "__main__":
  main()
