"""Token distributions from logits: temperature, top-k, top-p; shared by drafting and verification.

Two forms: static settings (`filtered_probs`, `sample`: one compile per value, as `generate` uses
them) and per-row settings as arrays (`RowSampling`, `row_probs`, `row_sample`: one compiled program
for any mix of greedy and sampled rows, as the Engine's slots use them).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from mtp_jax import validate


def filtered_probs(logits_BxV: jax.Array, *, temperature: float, top_k: int | None = None,
                   top_p: float | None = None) -> jax.Array:
  """float32[..., V] distribution softmax(logits / temperature) restricted to top-k / top-p.

  temperature == 0 gives the one-hot of the argmax (greedy is the limit of sampling).
  top_p keeps the smallest set of most likely tokens whose mass reaches top_p (at least one).
  """
  logits = logits_BxV.astype(jnp.float32)
  v = logits.shape[-1]
  temperature, top_k, top_p = validate.sampling(temperature, top_k, top_p)
  if temperature == 0:
    return jax.nn.one_hot(jnp.argmax(logits, axis=-1), v, dtype=jnp.float32)
  # Shift first so the largest logit is exactly 0: a tiny temperature then sends the others to
  # -inf (greedy in the limit) instead of overflowing them all to +-inf, whose softmax is NaN.
  top = jnp.max(logits, axis=-1, keepdims=True)
  logits = jnp.where(logits == top, 0.0, (logits - top) / temperature)
  neg_inf = -jnp.inf
  if top_k is not None and top_k < v:
    kth = jax.lax.top_k(logits, top_k)[0][..., -1:]
    logits = jnp.where(logits < kth, neg_inf, logits)
  if top_p is not None and top_p < 1:
    sorted_desc = -jnp.sort(-logits, axis=-1)
    probs_sorted = jax.nn.softmax(sorted_desc, axis=-1)
    mass_before = jnp.cumsum(probs_sorted, axis=-1) - probs_sorted
    # The smallest logit still inside the nucleus; everything below it goes.
    cutoff = jnp.min(jnp.where(mass_before < top_p, sorted_desc, jnp.inf), axis=-1, keepdims=True)
    logits = jnp.where(logits < cutoff, neg_inf, logits)
  return jax.nn.softmax(logits, axis=-1)


def sample(logits_BxV: jax.Array, key: jax.Array | None, *, temperature: float,
           top_k: int | None = None, top_p: float | None = None) -> tuple[jax.Array, jax.Array]:
  """Draws one token per row: (int32[...], its distribution float32[..., V]); greedy when temperature == 0."""
  probs = filtered_probs(logits_BxV, temperature=temperature, top_k=top_k, top_p=top_p)
  if temperature == 0:
    return jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32), probs
  tokens = jax.random.categorical(key, jnp.log(probs), axis=-1).astype(jnp.int32)
  return tokens, probs


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RowSampling:
  """Sampling settings per row, as arrays: temperature float32[B] (0: greedy), top_k int32[B]
  (0: off), top_p float32[B] (1: off). Values are the caller's to check (`validate.sampling`)."""

  temperature: jax.Array
  top_k: jax.Array
  top_p: jax.Array

  @classmethod
  def of(cls, temperature, top_k, top_p) -> "RowSampling":
    """From per-row lists (host values); top_k / top_p entries may be None (off)."""
    return cls(jnp.asarray(temperature, jnp.float32),
               jnp.asarray([0 if k is None else k for k in top_k], jnp.int32),
               jnp.asarray([1.0 if p is None else p for p in top_p], jnp.float32))

  def where(self, mask_B, other: "RowSampling") -> "RowSampling":
    """Rows of self where mask_B (bool[B]), else other's."""
    return jax.tree.map(lambda a, b: jnp.where(mask_B, a, b), self, other)


def row_probs(logits_BxXxV: jax.Array, rows: RowSampling) -> jax.Array:
  """float32[B, ..., V]: `filtered_probs` with row b's settings for logits_BxXxV[b] (any middle dims).

  A temperature-0 row is the one-hot of its argmax, so lossless sampling over it is greedy decoding.
  """
  logits = logits_BxXxV.astype(jnp.float32)
  b, v = logits.shape[0], logits.shape[-1]
  per_row = lambda x: x.reshape((b,) + (1,) * (logits.ndim - 1))
  t, top_k, top_p = per_row(rows.temperature), per_row(rows.top_k), per_row(rows.top_p)
  greedy = jax.nn.one_hot(jnp.argmax(logits, axis=-1), v, dtype=jnp.float32)
  top = jnp.max(logits, axis=-1, keepdims=True)
  # As filtered_probs: the top logit is exactly 0, so a tiny temperature cannot overflow to NaN.
  logits = jnp.where(logits == top, 0.0, (logits - top) / jnp.where(t > 0, t, 1.0))

  def filtered(logits):
    # One sort serves both filters: top-k takes the k-th largest, top-p the nucleus of what is left.
    sorted_desc = -jnp.sort(-logits, axis=-1)
    kth = jnp.take_along_axis(sorted_desc, jnp.clip(top_k - 1, 0, v - 1).astype(jnp.int32), axis=-1)
    kth = jnp.where(top_k > 0, kth, -jnp.inf)
    logits = jnp.where(logits < kth, -jnp.inf, logits)
    sorted_desc = jnp.where(sorted_desc < kth, -jnp.inf, sorted_desc)
    probs_sorted = jax.nn.softmax(sorted_desc, axis=-1)
    mass_before = jnp.cumsum(probs_sorted, axis=-1) - probs_sorted
    cutoff = jnp.min(jnp.where(mass_before < top_p, sorted_desc, jnp.inf), axis=-1, keepdims=True)
    return jnp.where((top_p < 1) & (logits < cutoff), -jnp.inf, logits)

  needs_filter = jnp.any((rows.top_k > 0) & (rows.top_k < v) | (rows.top_p < 1))
  logits = jax.lax.cond(needs_filter, filtered, lambda x: x, logits)
  return jnp.where(t > 0, jax.nn.softmax(logits, axis=-1), greedy)


def row_sample(logits_BxV: jax.Array, rows: RowSampling, keys_B: jax.Array) -> tuple[jax.Array, jax.Array]:
  """One token per row with its own settings and key (keys_B: a key per row): (int32[B], its
  distribution float32[B, V]). A row's draw depends on its own key and logits only."""
  probs_BxV = row_probs(logits_BxV, rows)
  drawn_B = jax.vmap(lambda key, p: jax.random.categorical(key, jnp.log(p)))(keys_B, probs_BxV)
  greedy_B = jnp.argmax(logits_BxV, axis=-1)
  return jnp.where(rows.temperature > 0, drawn_B, greedy_B).astype(jnp.int32), probs_BxV
