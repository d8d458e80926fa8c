"""The device script's sections that time one call against a reference on the same inputs:
`propose` against weight bytes / the read bandwidth measured in the same reps, and one layer's
attention over paged K/V against `jax.nn.dot_product_attention`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import bandwidth  # the reference copies and sums that bandwidth.py times
import mtp_jax
from device_models import K, TIE_TOL, Models
from device_report import Box, Report, error_what, median_call
from mtp_jax.blocks import masks
from mtp_jax.blocks.paged import PagedKVCache
from mtp_jax.blocks.pages import AttentionMetadata


def warm_propose_state(proposer, k: int, prompt_len: int, max_len: int, seed: int = 0):
  """(state, hiddens dtype[1, k + 1, D], tokens int32[1, k + 1], num_new int32[1]): a prompt call of
  prompt_len positions, a verification that accepted a random 0..k drafts, the next step's inputs."""
  cfg = proposer.cfg
  d, v, dt = cfg.hidden_size, cfg.vocab_size, cfg.jnp_dtype
  rng = np.random.default_rng(seed)
  hid = lambda t: jnp.asarray(rng.normal(size=(1, t, d)), dt)
  tok = lambda t: jnp.asarray(rng.integers(0, v, size=(1, t)), jnp.int32)
  state = mtp_jax.init_state(cfg, 1, max_len)
  _, state = mtp_jax.propose(proposer, state, hid(prompt_len), tok(prompt_len), jnp.array([prompt_len]),
                             num_drafts=K)
  accepted = jnp.asarray(rng.integers(0, k + 1, size=1), jnp.int32)
  return mtp_jax.after_verify(state, accepted), hid(k + 1), tok(k + 1), accepted + 1


def section_propose(report: Report, box: Box, models: Models, opts: dict) -> None:
  _, proposer = models.timed_random()
  cfg, reps = proposer.cfg, opts["reps"]
  modules = sum(x.nbytes for x in jax.tree.leaves(nnx.state(proposer.layers, nnx.Param)))
  head = proposer.lm_head.weight.nbytes
  report.table("propose", f"mtp_jax.propose (jit, state donated) at B = 1, random {cfg.dtype} proposer, D = "
               f"{cfg.hidden_size}, V = {cfg.vocab_size}, K = {K} modules (all run: catch_up) after a "
               f"{opts['prompt_len']}-token prompt; bound = weight bytes (the modules + the LM head once per draft) "
               f"/ the read bandwidth of a {opts['bw_mb']} MB array sum timed in turn with it",
               ("k", "weight_mb", "ms", "bound_ms", "share_of_read_bw", "read_gbs", "stream_gbs"))
  if not box.allows():
    report.row("skipped: out of time")
    return
  cases, sizes = [], []
  for k in (1, K):
    state, hid, tok, num_new = warm_propose_state(proposer, k, opts["prompt_len"], 4 * opts["prompt_len"])
    fn = jax.jit(lambda p, s, h, t, n, k=k: mtp_jax.propose(p, s, h, t, n, num_drafts=k), donate_argnums=1)
    cases.append((fn, lambda state=state, hid=hid, tok=tok, num_new=num_new: (
        proposer, jax.block_until_ready(jax.tree.map(jnp.copy, state)), hid, tok, num_new)))
    sizes.append((k, modules + k * head))
  try:
    medians, gbs = box.run(lambda: bandwidth.timed_with_references(cases, bandwidth.reference_cases(opts["bw_mb"]),
                                                                   reps))
  except Exception as e:
    report.row(error_what(e))
    return
  stream, read = bandwidth.best(gbs)
  for (k, nbytes), t in zip(sizes, medians):
    bound = nbytes / (read * 1e9)
    report.row("propose vs weight bytes / read bandwidth", k=k, weight_mb=nbytes / 1e6, ms=1e3 * t,
               bound_ms=1e3 * bound, share_of_read_bw=bound / t, read_gbs=read, stream_gbs=stream)


def attention_case(batch, rows, kv_heads, groups, head_dim, page_size, length, dtype, seed=0):
  """A PagedKVCache view (with its call's AttentionMetadata) of `batch` slots holding `length` rows
  each in scattered pages, every page held (pools dtype[B * length / page_size, page_size, Hkv, Dh]),
  queries dtype[B, rows, Hkv, G, Dh] at the last `rows` rows of every slot (a verify step's k + 1
  rows, already written), their rows int32[B, rows] and valid bool[B, rows]."""
  rng = np.random.default_rng(seed)
  max_pages = length // page_size
  num_pages = batch * max_pages
  pool = lambda: jnp.asarray(rng.normal(size=(num_pages, page_size, kv_heads, head_dim)), dtype)
  table = jnp.asarray(rng.permutation(num_pages).reshape(batch, max_pages), jnp.int32)
  meta = AttentionMetadata(table, jnp.full((batch,), max_pages, jnp.int32), budget=num_pages)
  cache = PagedKVCache(pool(), pool(), max_pages, meta)
  q = jnp.asarray(rng.normal(size=(batch, rows, kv_heads, groups, head_dim)), dtype)
  rows_BxT = jnp.broadcast_to(jnp.arange(length - rows, length, dtype=jnp.int32), (batch, rows))
  return cache, q, rows_BxT, jnp.ones((batch, rows), bool)


def gathered_span(cache: PagedKVCache):
  """(k, v dtype[B, L, Hkv, Dh], key rows int32[B, L]): every slot's pages as one dense block, as
  `PagedRows.update` gathers them for a span (every page held, so no row is NO_ROW)."""
  table = cache.meta.table
  b, cols = table.shape
  gather = lambda pool: jnp.take(pool, table, axis=0).reshape(b, cols * cache.page_size, *pool.shape[2:])
  key_rows = jnp.broadcast_to(jnp.arange(cols * cache.page_size, dtype=jnp.int32), (b, cols * cache.page_size))
  return gather(cache.k), gather(cache.v), key_rows


def attention_paths(on_gpu: bool) -> dict:
  """{name: fn(cache, q, rows, valid) -> float[B, T, Hkv, G, Dh]}, each the same attention of one layer."""
  def page_list(cache, q, rows, valid):
    return cache.attend_pages(q, rows, valid)

  def span(cache, q, rows, valid):
    k, v, key_rows = gathered_span(cache)
    v = masks.readable_rows(v, rows, valid, key_rows)
    return masks.gqa_attention(q, k, v, masks.causal_mask(rows, key_rows))

  def dpa(implementation):
    def fn(cache, q, rows, valid):
      k, v, key_rows = gathered_span(cache)
      b, t, hkv, g, dh = q.shape
      # Every gathered row holds finite values, so masked rows (probability 0) need no zeroing here.
      mask = masks.causal_mask(rows, key_rows)[:, None] & valid[:, None, :, None]
      out = jax.nn.dot_product_attention(q.reshape(b, t, hkv * g, dh), k, v, mask=mask,
                                         implementation=implementation)
      return out.reshape(b, t, hkv, g, dh)
    return fn

  paths = {"library page list (PagedKVCache.attend_pages: generate's path)": page_list,
           "library dense span (gathered pages + masks.gqa_attention: the Engine's path)": span,
           "jax.nn.dot_product_attention, xla, on the gathered span": dpa("xla")}
  if on_gpu:
    paths["jax.nn.dot_product_attention, cudnn, on the gathered span"] = dpa("cudnn")
  return paths


def section_attention(report: Report, box: Box, opts: dict) -> None:
  a, dtype, reps = opts["attn"], opts["dtype"], opts["reps"]
  on_gpu = jax.default_backend() == "gpu"
  report.table("attention", f"one layer's attention over paged K/V ({dtype}, B = {a['batch']}, {a['rows']} query "
               f"rows per slot at its end (a k = {a['rows'] - 1} verify step), Hkv = {a['kv_heads']}, "
               f"G = {a['groups']}, Dh = {a['head_dim']}, page_size = {a['page_size']}, pages scattered); every "
               "output checked against the page list's first (max abs error / max |output|); median of "
               f"{reps} jitted calls", ("context", "path", "ms", "vs_page_list", "rel_err", "agrees"))
  tol = TIE_TOL[dtype]  # of the output's scale: float32 allows TF32-level rounding, bfloat16 its own
  for length in a["lengths"]:
    if not box.allows():
      report.row("skipped: out of time", context=length)
      continue
    case = attention_case(a["batch"], a["rows"], a["kv_heads"], a["groups"], a["head_dim"], a["page_size"],
                          length, dtype)
    ref = None  # (output, ms) of the page list, the first path
    for path, fn in attention_paths(on_gpu).items():
      fields = dict(context=length, path=path)

      def measure(fn=fn):
        jitted = jax.jit(fn)
        out = np.asarray(jitted(*case), np.float32)
        err = 0.0 if ref is None else float(np.abs(out - ref[0]).max() / np.abs(ref[0]).max())
        if err > tol:  # a wrong output is not timed
          return out, err, None
        return out, err, median_call(jitted, reps, lambda: case)[1]

      try:
        out, err, median = box.run(measure)
      except Exception as e:
        report.row(error_what(e), **fields)
        if ref is None:
          break  # nothing to compare the other paths with
        continue
      if median is None:
        report.row(f"outputs disagree (tolerance {tol})", **fields, rel_err=err, agrees=False)
        continue
      ref = (out, 1e3 * median) if ref is None else ref
      report.row("attention call", **fields, ms=1e3 * median, vs_page_list=1e3 * median / ref[1], rel_err=err,
                 agrees=True)
    if not on_gpu:
      report.row("skipped: the cudnn path needs a GPU", context=length,
                 path="jax.nn.dot_product_attention, cudnn, on the gathered span")
