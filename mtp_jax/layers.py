"""Building blocks shared by the target model and the MTP modules.

Shapes are written as suffixes (`x_BxTxD`) and as `dtype[B, T, D]` in docstrings:
B batch, T rows in this call, L cache rows (max_len), D hidden, H query heads,
G = H / Hkv query heads per KV head, Dh head dim, F MLP width, V vocabulary.

Attention runs over a *position-addressed* KV cache: row j of a sequence lives at
index j of its cache, so a write is a scatter at known rows and a stale or
invalid row is excluded by the causal mask alone. Rows to skip are sent to index L,
which `mode="drop"` discards: nothing can wrap around into another row or slot.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from mtp_jax.config import BlockConfig


_FEW_ROWS = 8


def _normal(rngs: nnx.Rngs, shape, std: float, dtype) -> jax.Array:
  return (std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)


class Linear(nnx.Module):
  """y = x @ weight.T (+ bias); weight float[out, in], the torch layout, so state dicts map 1:1."""

  def __init__(self, in_features: int, out_features: int, *, bias: bool = False,
               dtype=jnp.float32, rngs: nnx.Rngs):
    self.weight = nnx.Param(_normal(rngs, (out_features, in_features), in_features**-0.5, dtype))
    self.bias = nnx.Param(jnp.zeros((out_features,), dtype)) if bias else None

  def __call__(self, x_BxTxI: jax.Array) -> jax.Array:
    w = self.weight[...]
    if math.prod(x_BxTxI.shape[:-1]) <= _FEW_ROWS:
      # Decode steps have a handful of rows; XLA:CPU streams the weight at about twice the
      # speed with it as the left operand (benchmarks/hot_path_ab.py, docs/performance.md).
      y = jnp.moveaxis(jax.lax.dot_general(w, x_BxTxI, (((1,), (x_BxTxI.ndim - 1,)), ((), ()))), 0, -1)
    else:
      y = jnp.einsum("...i,oi->...o", x_BxTxI, w)
    return y if self.bias is None else y + self.bias[...]


class RMSNorm(nnx.Module):
  """x * rsqrt(mean(x^2) + eps) * weight, computed in float32."""

  def __init__(self, dim: int, *, eps: float, dtype=jnp.float32):
    self.weight = nnx.Param(jnp.ones((dim,), dtype))
    self.eps = eps

  def __call__(self, x_BxTxD: jax.Array) -> jax.Array:
    x = x_BxTxD.astype(jnp.float32)
    x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps)
    return (x * self.weight[...].astype(jnp.float32)).astype(x_BxTxD.dtype)


def rope(x_BxTxHxDh: jax.Array, pos_BxT: jax.Array, theta: float) -> jax.Array:
  """Rotate-half rotary embedding at integer positions pos_BxT."""
  half = x_BxTxHxDh.shape[-1] // 2
  inv_freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
  angle_BxTxHalf = pos_BxT.astype(jnp.float32)[..., None] * inv_freq
  cos = jnp.cos(angle_BxTxHalf)[:, :, None, :]
  sin = jnp.sin(angle_BxTxHalf)[:, :, None, :]
  x = x_BxTxHxDh.astype(jnp.float32)
  x1, x2 = x[..., :half], x[..., half:]
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_BxTxHxDh.dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
  """One attention layer's cache: k, v dtype[B, L, Hkv, Dh], row j at index j."""

  k: jax.Array
  v: jax.Array

  @classmethod
  def zeros(cls, cfg: BlockConfig, batch_size: int, max_len: int, dtype=None) -> "KVCache":
    shape = (batch_size, max_len, cfg.num_kv_heads, cfg.head_dim)
    dtype = dtype or cfg.jnp_dtype
    return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))


class Attention(nnx.Module):
  """Causal GQA self-attention with RoPE, over a position-addressed KV cache or over its own rows."""

  def __init__(self, cfg: BlockConfig, *, rngs: nnx.Rngs):
    d, h, hkv, dh, dt = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.jnp_dtype
    self.q_proj = Linear(d, h * dh, bias=cfg.attention_bias, dtype=dt, rngs=rngs)
    self.k_proj = Linear(d, hkv * dh, bias=cfg.attention_bias, dtype=dt, rngs=rngs)
    self.v_proj = Linear(d, hkv * dh, bias=cfg.attention_bias, dtype=dt, rngs=rngs)
    self.o_proj = Linear(h * dh, d, dtype=dt, rngs=rngs)
    self.num_heads, self.num_kv_heads, self.head_dim = h, hkv, dh
    self.rope_theta = cfg.rope_theta

  def __call__(self, x_BxTxD, rows_BxT, valid_BxT, cache: KVCache | None, rope_offset: int = 0):
    """Attends row j to rows 0..j of the same sequence.

    Args:
      x_BxTxD: dtype[B, T, D] normed inputs.
      rows_BxT: int32[B, T] row index of each input (RoPE position is row + rope_offset).
      valid_BxT: bool[B, T]; invalid rows are neither written to the cache nor attended to.
      cache: KVCache with L rows, or None to attend within this call's rows only (training).
    Returns:
      (dtype[B, T, D], new KVCache or None).
    """
    b, t, _ = x_BxTxD.shape
    hkv, dh = self.num_kv_heads, self.head_dim
    g = self.num_heads // hkv
    pos_BxT = rows_BxT + rope_offset
    q = rope(self.q_proj(x_BxTxD).reshape(b, t, hkv * g, dh), pos_BxT, self.rope_theta)
    k = rope(self.k_proj(x_BxTxD).reshape(b, t, hkv, dh), pos_BxT, self.rope_theta)
    v = self.v_proj(x_BxTxD).reshape(b, t, hkv, dh)
    if cache is None:
      k_BxSxKxDh, v_BxSxKxDh, key_rows_BxS = k, v, jnp.where(valid_BxT, rows_BxT, jnp.iinfo(jnp.int32).max)
      new_cache = None
    else:
      max_len = cache.k.shape[1]
      write_BxT = jnp.where(valid_BxT, rows_BxT, max_len)  # index L is dropped: no wrap-around
      b_idx = jnp.arange(b)[:, None]
      new_cache = KVCache(
          cache.k.at[b_idx, write_BxT].set(k.astype(cache.k.dtype), mode="drop"),
          cache.v.at[b_idx, write_BxT].set(v.astype(cache.v.dtype), mode="drop"))
      k_BxSxKxDh, v_BxSxKxDh = new_cache.k, new_cache.v
      key_rows_BxS = jnp.broadcast_to(jnp.arange(max_len, dtype=jnp.int32), (b, max_len))
    q = q.reshape(b, t, hkv, g, dh)
    scores = jnp.einsum("btkgd,bskd->bkgts", q, k_BxSxKxDh.astype(q.dtype),
                        preferred_element_type=jnp.float32) * dh**-0.5
    mask_BxTxS = key_rows_BxS[:, None, :] <= rows_BxT[:, :, None]
    scores = jnp.where(mask_BxTxS[:, None, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v_BxSxKxDh.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v_BxSxKxDh).reshape(b, t, hkv * g * dh)
    return self.o_proj(out.astype(x_BxTxD.dtype)), new_cache


class Mlp(nnx.Module):
  """down(silu(gate(x)) * up(x))."""

  def __init__(self, cfg: BlockConfig, *, rngs: nnx.Rngs):
    d, f, dt = cfg.hidden_size, cfg.intermediate_size, cfg.jnp_dtype
    self.gate_proj = Linear(d, f, dtype=dt, rngs=rngs)
    self.up_proj = Linear(d, f, dtype=dt, rngs=rngs)
    self.down_proj = Linear(f, d, dtype=dt, rngs=rngs)

  def __call__(self, x_BxTxD):
    return self.down_proj(jax.nn.silu(self.gate_proj(x_BxTxD)) * self.up_proj(x_BxTxD))


class Block(nnx.Module):
  """Pre-norm transformer block: x + attn(norm(x)), then + mlp(norm(.))."""

  def __init__(self, cfg: BlockConfig, *, rngs: nnx.Rngs):
    dt = cfg.jnp_dtype
    self.input_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dt)
    self.self_attn = Attention(cfg, rngs=rngs)
    self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dt)
    self.mlp = Mlp(cfg, rngs=rngs)

  def __call__(self, x_BxTxD, rows_BxT, valid_BxT, cache: KVCache | None, rope_offset: int = 0):
    """Same arguments as Attention; returns (dtype[B, T, D], new KVCache or None)."""
    attn, cache = self.self_attn(self.input_layernorm(x_BxTxD), rows_BxT, valid_BxT, cache, rope_offset)
    h = x_BxTxD + attn
    return h + self.mlp(self.post_attention_layernorm(h)), cache


def module_state_dict(module: nnx.Module, prefix: str) -> dict[str, jax.Array]:
  """Flattens a module's params to torch-style dotted names under prefix."""
  out = {}
  for path, param in nnx.to_flat_state(nnx.state(module, nnx.Param)):
    out[prefix + ".".join(str(p) for p in path)] = param[...]
  return out
