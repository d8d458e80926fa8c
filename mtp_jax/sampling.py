"""Token distributions from logits: temperature, top-k, top-p; shared by drafting and verification."""

from __future__ import annotations

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
