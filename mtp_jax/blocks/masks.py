"""The attention math every cache shares: which rows a query may see and read, the softmax,
and the rows of a draft-tree call (`TreeRows`). Below the caches: they attend with it.

Shape-generic over the leading axis N (a batch slot, or one page of the paged attention):
rows_NxT are the queries' rows, key_rows_NxS the rows of the keys they are scored against.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TreeRows:
  """A call whose rows are nodes of a draft tree (mtp_jax/tree.py) rather than a run of a sequence.

  base_B: int32[B]: every row sees the cached rows < base_B[b] (the sequence's committed
    prefix) and no other cached row;
  visible_TxT: bool[T, T]: row t also sees this call's row u where visible_TxT[t, u] (itself
    and its ancestors), from the keys computed in this call;
  write_BxT: int32[B, T], the cache row each call row is written to, or None: nothing is written.
  The rows_BxT of the call give RoPE positions only (a node at depth d sits at position P + d).
  """

  base_B: jax.Array
  visible_TxT: jax.Array
  write_BxT: jax.Array | None = None


def attention_probs(scores_BxKxGxTxS, mask_BxTxS, *, sinks_KxG: jax.Array | None = None) -> jax.Array:
  """Softmax of float32 scores over the S keys the mask allows.

  sinks_KxG: a learned logit per query head that joins the softmax denominator only, so a
  head may attend to nothing.
  """
  scores = jnp.where(mask_BxTxS[:, None, None], scores_BxKxGxTxS, jnp.finfo(jnp.float32).min)
  if sinks_KxG is None:
    return jax.nn.softmax(scores, axis=-1)
  sink = sinks_KxG.astype(jnp.float32)[None, :, :, None, None]
  top = jnp.maximum(jnp.max(scores, axis=-1, keepdims=True), sink)
  e = jnp.exp(scores - top)
  return e / (jnp.sum(e, axis=-1, keepdims=True) + jnp.exp(sink - top))


def gqa_attention(q_BxTxKxGxDh, k_BxSxKxDh, v_BxSxKxDh, mask_BxTxS, *, sinks_KxG=None) -> jax.Array:
  """Scaled dot-product GQA of queries dtype[B, T, Hkv, G, Dh] over keys dtype[B, S, Hkv, Dh] and values
  dtype[B, S, Hkv, Dv]; returns dtype[B, T, Hkv, G, Dv] (the values' dtype)."""
  dh = q_BxTxKxGxDh.shape[-1]
  scores = jnp.einsum("btkgd,bskd->bkgts", q_BxTxKxGxDh, k_BxSxKxDh.astype(q_BxTxKxGxDh.dtype),
                      preferred_element_type=jnp.float32) * dh**-0.5
  probs = attention_probs(scores, mask_BxTxS, sinks_KxG=sinks_KxG)
  return jnp.einsum("bkgts,bskd->btkgd", probs.astype(v_BxSxKxDh.dtype), v_BxSxKxDh)


def causal_mask(rows_NxT, key_rows_NxS, *, window: int | None = None) -> jax.Array:
  """bool[N, T, S]: a query at row r sees keys at rows r - window < row <= r."""
  q_rows, k_rows = rows_NxT[:, :, None], key_rows_NxS[:, None, :]
  mask_NxTxS = k_rows <= q_rows
  if window is not None:
    mask_NxTxS &= k_rows > q_rows - window
  return mask_NxTxS


def readable_rows(values_NxSx, rows_NxT, valid_NxT, key_rows_NxS) -> jax.Array:
  """values_NxSx with the rows no valid query of this call may read replaced by zeros.

  Those rows get probability 0, but 0 * NaN = NaN: selecting them away keeps NaN / inf left in
  stale rows (a reset slot's earlier request) out of every output.
  """
  newest_N = jnp.max(jnp.where(valid_NxT, rows_NxT, -1), axis=1)
  readable_NxS = key_rows_NxS <= newest_N[:, None]
  readable = readable_NxS.reshape(readable_NxS.shape + (1,) * (values_NxSx.ndim - 2))
  return jnp.where(readable, values_NxSx, jnp.zeros((), values_NxSx.dtype))
