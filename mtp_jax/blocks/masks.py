"""Which cached rows a query may see and read, shared by the dense and the paged attention.

Shape-generic over the leading axis N (a batch slot, or one page of the paged attention):
rows_NxT are the queries' rows, key_rows_NxS the rows of the keys they are scored against.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


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
