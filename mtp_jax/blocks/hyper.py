"""DeepSeek-V4's manifold-constrained hyper-connections (mHC): the residual as N = hc_mult streams.

A sublayer (attention or FFN) reads one collapsed input, sum_j pre_j * stream_j, and writes back
every stream k as post_k * output + sum_j comb[j, k] * stream_j, where pre, post and comb are read
off the streams themselves (an unweighted RMSNorm of all N * D values, one linear map) and comb is
pushed towards a doubly-stochastic matrix by Sinkhorn-Knopp steps, so the mix cannot grow the
streams' norm. `HyperHead` collapses the streams once more, with pre weights only, before the LM head.
Weights and the mixing arithmetic are float32, as transformers 5.25 keeps them (`attn_hc`, `ffn_hc`,
`hc_head` in its strict float32 list).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from mtp_jax.blocks.linear import normal, param
from mtp_jax.config import HyperConfig


def _mixes(streams_xNxD: jax.Array, fn_MxND: jax.Array, eps: float) -> jax.Array:
  """float32[..., M]: fn applied to the RMS-normed (unweighted) flattened streams dtype[..., N, D]."""
  flat = streams_xNxD.reshape(streams_xNxD.shape[:-2] + (-1,)).astype(jnp.float32)
  flat = flat * jax.lax.rsqrt(jnp.mean(flat * flat, axis=-1, keepdims=True) + eps)
  return jnp.einsum("...k,mk->...m", flat, fn_MxND.astype(jnp.float32))


def _collapse(pre_xN: jax.Array, streams_xNxD: jax.Array) -> jax.Array:
  """sum_j pre_j * stream_j in float32, cast back to the streams' dtype: dtype[..., D]."""
  out = jnp.einsum("...n,...nd->...d", pre_xN, streams_xNxD.astype(jnp.float32))
  return out.astype(streams_xNxD.dtype)


class HyperMixer(nnx.Module):
  """The mHC weights of one sublayer: fn float32[(2 + N) N, N D], base float32[(2 + N) N], scale float32[3]
  (pre, post and comb rows in that order, as the released hc_{attn,ffn}_{fn,base,scale} hold them)."""

  def __init__(self, hyper: HyperConfig, hidden_size: int, rms_norm_eps: float, *, rngs: nnx.Rngs):
    n = hyper.hc_mult
    m = (2 + n) * n
    self.fn = param(normal(rngs, (m, n * hidden_size), (n * hidden_size)**-0.5, jnp.float32), (None, None))
    self.base = param(jnp.zeros((m,), jnp.float32), (None,))
    self.scale = param(jnp.ones((3,), jnp.float32), (None,))
    self.hc_mult, self.iters, self.hc_eps, self.rms_eps = n, hyper.sinkhorn_iters, hyper.hc_eps, rms_norm_eps

  def __call__(self, streams_BxTxNxD: jax.Array):
    """Returns (post float32[B, T, N], comb float32[B, T, N, N], the sublayer's input dtype[B, T, D])."""
    n, eps = self.hc_mult, self.hc_eps
    mixes = _mixes(streams_BxTxNxD, self.fn[...], self.rms_eps)
    base, scale = self.base[...], self.scale[...]
    pre = jax.nn.sigmoid(mixes[..., :n] * scale[0] + base[:n]) + eps
    post = 2 * jax.nn.sigmoid(mixes[..., n:2 * n] * scale[1] + base[n:2 * n])
    logits = (mixes[..., 2 * n:] * scale[2] + base[2 * n:]).reshape(mixes.shape[:-1] + (n, n))
    comb = jax.nn.softmax(logits, axis=-1) + eps
    # Columns first, then rows and columns in turn: transformers' order, so the last step leaves
    # columns summing to 1 (the axis the write-back sums over).
    comb = comb / (comb.sum(-2, keepdims=True) + eps)
    for _ in range(self.iters - 1):
      comb = comb / (comb.sum(-1, keepdims=True) + eps)
      comb = comb / (comb.sum(-2, keepdims=True) + eps)
    return post, comb, _collapse(pre, streams_BxTxNxD)

  @staticmethod
  def expand(out_BxTxD, streams_BxTxNxD, post_BxTxN, comb_BxTxNxN) -> jax.Array:
    """The new streams dtype[B, T, N, D]: stream k = post_k * out + sum_j comb[j, k] * stream_j."""
    dt = streams_BxTxNxD.dtype
    mixed = jnp.einsum("btjk,btjd->btkd", comb_BxTxNxN.astype(dt), streams_BxTxNxD)
    return post_BxTxN.astype(dt)[..., None] * out_BxTxD[:, :, None, :] + mixed


class HyperHead(nnx.Module):
  """The last collapse before the head norm: fn float32[N, N D], base float32[N], scale float32[1]
  (released as hc_head_fn, hc_head_base, hc_head_scale)."""

  def __init__(self, hyper: HyperConfig, hidden_size: int, rms_norm_eps: float, *, rngs: nnx.Rngs):
    n = hyper.hc_mult
    self.fn = param(normal(rngs, (n, n * hidden_size), (n * hidden_size)**-0.5, jnp.float32), (None, None))
    self.base = param(jnp.zeros((n,), jnp.float32), (None,))
    self.scale = param(jnp.ones((1,), jnp.float32), (None,))
    self.hc_eps, self.rms_eps = hyper.hc_eps, rms_norm_eps

  def __call__(self, streams_xNxD: jax.Array) -> jax.Array:
    """dtype[..., N, D] -> dtype[..., D]: sum_j (sigmoid(mix_j * scale + base_j) + hc_eps) * stream_j."""
    mixes = _mixes(streams_xNxD, self.fn[...], self.rms_eps)
    pre = jax.nn.sigmoid(mixes * self.scale[...][0] + self.base[...]) + self.hc_eps
    return _collapse(pre, streams_xNxD)
