"""The Gemma 4 text layer as a Gemma 4 assistant runs it: its queries attend to keys and values the
caller hands over (the target's, transformers' `shared_kv_states`), so it holds no k / v projections.

Per layer (transformers 5.25 models/gemma4/modeling_gemma4.py, Gemma4TextDecoderLayer with every
layer "reuse"-ing shared K/V): x + post_attention_layernorm(attn(input_layernorm(x))), then
+ post_feedforward_layernorm(mlp(pre_feedforward_layernorm(x))), the sum times layer_scalar. The
attention: q = RoPE(q_norm(q_proj(x))) per head, scores q . k with scaling 1 (q_norm sets the scale),
softmax, o_proj. The MLP is gated GELU (tanh approximation). Sliding and full layers differ in head
dim, RoPE (`gemma4_inv_freq`) and mask (`shared_kv_mask`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mtp_jax.blocks.linear import Linear, param
from mtp_jax.blocks.masks import attention_probs
from mtp_jax.blocks.mlp import Mlp
from mtp_jax.blocks.norms import RMSNorm
from mtp_jax.blocks.rope import apply_rope, inv_frequencies
from mtp_jax.config import BlockConfig

ROPE_TYPES = ("default", "proportional")


def gemma4_inv_freq(head_dim: int, rope_type: str, theta: float, partial_rotary_factor: float = 1.0,
                    factor: float = 1.0) -> np.ndarray:
  """float32[head_dim / 2] inverse frequencies of rotate-half RoPE over the whole head.

  "default": 1 / theta^(2i / head_dim) (Gemma 4's sliding layers). "proportional" (its full layers,
  transformers' _compute_proportional_rope_parameters): the first int(partial_rotary_factor *
  head_dim // 2) frequencies are the default ones (exponents still over head_dim), the rest 0 (those
  dims pass unrotated), all divided by factor.
  """
  if rope_type == "default":
    return inv_frequencies(head_dim, theta)[0]
  if rope_type != "proportional":
    raise ValueError(f"rope_type {rope_type!r} is not supported, only {ROPE_TYPES}")
  angles = int(partial_rotary_factor * head_dim // 2)
  rotated = 1.0 / theta ** (np.arange(0, 2 * angles, 2, dtype=np.float32) / head_dim)
  inv_freq = np.concatenate([rotated, np.zeros(head_dim // 2 - angles, np.float32)])
  return (inv_freq / factor).astype(np.float32)


def shared_kv_mask(lengths_B: jax.Array, num_keys: int, window: int | None) -> jax.Array:
  """bool[B, S]: the keys (rows 0..S-1 of the caller's K/V) a query at row lengths_B - 1 attends to.

  Full layers: rows < lengths_B. Sliding layers also drop rows before lengths_B - 1 - window:
  transformers 5.25's assistant masks by |q - k| <= window (create_bidirectional_sliding_window_mask,
  flipped to the past side), so window + 1 rows, one more than the target's own sliding layers see.
  """
  rows_S = jnp.arange(num_keys, dtype=jnp.int32)[None, :]
  lengths = lengths_B.astype(jnp.int32)[:, None]
  mask_BxS = rows_S < lengths
  if window is not None:
    mask_BxS &= rows_S >= lengths - 1 - window
  return mask_BxS


class SharedKvAttention(nnx.Module):
  """Queries only: q_proj, q_norm, RoPE, attention over caller-given K/V (GQA), o_proj."""

  def __init__(self, *, hidden_size: int, num_heads: int, head_dim: int, eps: float, inv_freq: np.ndarray,
               dtype, rngs: nnx.Rngs):
    d, h, dh = hidden_size, num_heads, head_dim
    self.q_proj = Linear(d, h * dh, axes=("heads", "embed"), dtype=dtype, rngs=rngs)
    self.q_norm = RMSNorm(dh, eps=eps, dtype=dtype, axis="head_dim")
    self.o_proj = Linear(h * dh, d, axes=("embed", "heads"), dtype=dtype, rngs=rngs)
    self.num_heads, self.head_dim = h, dh
    self.inv_freq = tuple(np.asarray(inv_freq, np.float32).tolist())  # static module data, not a param

  def __call__(self, x_BxD: jax.Array, pos_B: jax.Array, k_BxSxKxDh: jax.Array, v_BxSxKxDh: jax.Array,
               mask_BxS: jax.Array) -> jax.Array:
    """x dtype[B, D] normed inputs at positions int32[B]; keys / values dtype[B, S, Hkv, Dh] (Hkv
    dividing H), mask bool[B, S] (at least one key per row). Returns dtype[B, D]."""
    b, _ = x_BxD.shape
    hkv = k_BxSxKxDh.shape[2]
    g = self.num_heads // hkv
    q = self.q_norm(self.q_proj(x_BxD[:, None]).reshape(b, 1, self.num_heads, self.head_dim))
    q = apply_rope(q, pos_B[:, None], self.inv_freq).reshape(b, 1, hkv, g, self.head_dim)
    # Rows no query may read are zeroed: probability 0 times a stale NaN would still be NaN.
    readable = mask_BxS[:, :, None, None]
    k = jnp.where(readable, k_BxSxKxDh, jnp.zeros((), k_BxSxKxDh.dtype)).astype(q.dtype)
    v = jnp.where(readable, v_BxSxKxDh, jnp.zeros((), v_BxSxKxDh.dtype)).astype(q.dtype)
    scores = jnp.einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=jnp.float32)  # scaling 1
    probs = attention_probs(scores, mask_BxS[:, None, :])
    out = jnp.einsum("bkgts,bskd->btkgd", probs.astype(v.dtype), v)
    return self.o_proj(out.reshape(b, self.num_heads * self.head_dim).astype(x_BxD.dtype))


class SharedKvLayer(nnx.Module):
  """One Gemma 4 decoder layer over shared K/V (module names as transformers' state dict)."""

  def __init__(self, *, hidden_size: int, num_heads: int, head_dim: int, intermediate_size: int, eps: float,
               inv_freq: np.ndarray, window: int | None, dtype: str, rngs: nnx.Rngs):
    d, dt = hidden_size, jnp.dtype(dtype)
    self.self_attn = SharedKvAttention(hidden_size=d, num_heads=num_heads, head_dim=head_dim, eps=eps,
                                       inv_freq=inv_freq, dtype=dt, rngs=rngs)
    mlp_cfg = BlockConfig(hidden_size=d, num_heads=num_heads, num_kv_heads=1, head_dim=head_dim,
                          intermediate_size=intermediate_size, rms_norm_eps=eps, dtype=dtype)
    self.mlp = Mlp(mlp_cfg, rngs=rngs, activation="gelu_tanh")
    norm = lambda: RMSNorm(d, eps=eps, dtype=dt, axis="embed")
    self.input_layernorm, self.post_attention_layernorm = norm(), norm()
    self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norm(), norm()
    self.layer_scalar = param(jnp.ones((1,), dt), (None,))
    self.window = window

  def __call__(self, x_BxD, pos_B, k_BxSxKxDh, v_BxSxKxDh, mask_BxS):
    """dtype[B, D] -> dtype[B, D]; the rest as `SharedKvAttention`."""
    h = self.self_attn(self.input_layernorm(x_BxD), pos_B, k_BxSxKxDh, v_BxSxKxDh, mask_BxS)
    x = x_BxD + self.post_attention_layernorm(h)
    x = x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
    return x * self.layer_scalar[...].astype(x.dtype)
