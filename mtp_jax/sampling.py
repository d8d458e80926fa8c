"""Token distributions from logits (temperature, top-k, top-p) and the draws made from them.

One implementation: per-row settings as arrays (`RowSampling`, `row_probs`), so any mix of greedy
and sampled rows runs one compiled program; `filtered_probs` and `sample` are its static-settings
forms for callers with one setting for every row.

Draws are tied to output positions (`Draws`): a row's token at output position n is the argmax of
log p_n + Gumbel noise keyed by (the row's key, n). That is an exact draw from p_n, and it does not
depend on how many tokens were drafted or verified before it, on the row's neighbours or on when it
was admitted: a drafter given the same noise (`NOISE_TARGET`) draws the token the target would draw
whenever their distributions agree enough, and the serving loop's Gumbel acceptance rule
(verify.verify_gumbel) keeps exactly the tokens plain sampling with that key would give.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from mtp_jax import validate
from mtp_jax.blocks.axes import axes

# Independent noise streams of one row key: the target's tokens (and drafts coupled to them), the
# drafts that lossless rejection sampling verifies, and that rule's acceptance tests.
NOISE_TARGET, NOISE_DRAFT, NOISE_ACCEPT = 0, 1, 2


def row_key(seed: int, row: int = 0) -> jax.Array:
  """The key of row `row` of a batch seeded with `seed` (a lone request's: row 0): `generate(seed=s)`
  gives prompt i the key of row i, an Engine request of seed s the key of row 0, and a request
  without one the key of its id under the engine's seed."""
  return jax.random.fold_in(jax.random.key(seed), row)


def row_keys(seed: int, batch_size: int) -> jax.Array:
  """key[B]: `row_key(seed, b)` for b in 0..B-1."""
  return jax.vmap(lambda b: jax.random.fold_in(jax.random.key(seed), b))(jnp.arange(batch_size))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RowSampling:
  """Sampling settings per row, as arrays: temperature float32[B] (0: greedy), top_k int32[B]
  (0: off), top_p float32[B] (1: off). Values are the caller's to check (`validate.sampling`)."""

  temperature: jax.Array = axes("batch")
  top_k: jax.Array = axes("batch")
  top_p: jax.Array = axes("batch")

  @classmethod
  def of(cls, temperature, top_k, top_p) -> "RowSampling":
    """From per-row lists (host values); top_k / top_p entries may be None (off)."""
    return cls(jnp.asarray(temperature, jnp.float32),
               jnp.asarray([0 if k is None else k for k in top_k], jnp.int32),
               jnp.asarray([1.0 if p is None else p for p in top_p], jnp.float32))

  @classmethod
  def uniform(cls, batch_size: int, temperature: float = 0.0, top_k: int | None = None,
              top_p: float | None = None) -> "RowSampling":
    """batch_size rows with the same settings."""
    b = batch_size
    return cls.of([temperature] * b, [top_k] * b, [top_p] * b)

  def where(self, mask_B, other: "RowSampling") -> "RowSampling":
    """Rows of self where mask_B (bool[B]), else other's."""
    return jax.tree.map(lambda a, b: jnp.where(mask_B, a, b), self, other)


def row_probs(logits_BxXxV: jax.Array, rows: RowSampling) -> jax.Array:
  """float32[B, ..., V]: softmax(logits / temperature) restricted to top-k / top-p, with row b's
  settings for logits_BxXxV[b] (any middle dims).

  A temperature-0 row is the one-hot of its argmax (greedy is the limit of sampling), so lossless
  sampling over it is greedy decoding. top_p keeps the smallest set of most likely tokens whose
  mass reaches top_p (at least one).
  """
  logits = logits_BxXxV.astype(jnp.float32)
  b, v = logits.shape[0], logits.shape[-1]
  per_row = lambda x: x.reshape((b,) + (1,) * (logits.ndim - 1))
  t, top_k, top_p = per_row(rows.temperature), per_row(rows.top_k), per_row(rows.top_p)
  greedy = jax.nn.one_hot(jnp.argmax(logits, axis=-1), v, dtype=jnp.float32)
  top = jnp.max(logits, axis=-1, keepdims=True)
  # Shift first so the largest logit is exactly 0: a tiny temperature then sends the others to
  # -inf (greedy in the limit) instead of overflowing them all to +-inf, whose softmax is NaN.
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
    # The smallest logit still inside the nucleus; everything below it goes.
    cutoff = jnp.min(jnp.where(mass_before < top_p, sorted_desc, jnp.inf), axis=-1, keepdims=True)
    return jnp.where((top_p < 1) & (logits < cutoff), -jnp.inf, logits)

  needs_filter = jnp.any((rows.top_k > 0) & (rows.top_k < v) | (rows.top_p < 1))
  logits = jax.lax.cond(needs_filter, filtered, lambda x: x, logits)
  return jnp.where(t > 0, jax.nn.softmax(logits, axis=-1), greedy)


def filtered_probs(logits_BxV: jax.Array, *, temperature: float, top_k: int | None = None,
                   top_p: float | None = None) -> jax.Array:
  """float32[..., V]: `row_probs` with one setting for every row (checked by name)."""
  temperature, top_k, top_p = validate.sampling(temperature, top_k, top_p)
  v = logits_BxV.shape[-1]
  flat = jnp.reshape(logits_BxV, (1, -1, v))
  return row_probs(flat, RowSampling.uniform(1, temperature, top_k, top_p)).reshape(logits_BxV.shape)


def sample(logits_BxV: jax.Array, key: jax.Array | None, *, temperature: float,
           top_k: int | None = None, top_p: float | None = None) -> tuple[jax.Array, jax.Array]:
  """Draws one token per row: (int32[...], its distribution float32[..., V]); greedy when temperature == 0."""
  probs = filtered_probs(logits_BxV, temperature=temperature, top_k=top_k, top_p=top_p)
  if temperature == 0:
    return jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32), probs
  tokens = jax.random.categorical(key, jnp.log(probs), axis=-1).astype(jnp.int32)
  return tokens, probs


def position_keys(keys_B: jax.Array, positions_BxX: jax.Array) -> jax.Array:
  """key[B, X]: row b's key for output position positions_BxX[b, x] (keys_B: a key per row)."""
  return jax.vmap(lambda key, pos_X: jax.vmap(lambda p: jax.random.fold_in(key, p))(pos_X))(keys_B, positions_BxX)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Draws:
  """How each row draws its tokens: its settings `rows`, its key `keys` (key[B], one stream per
  row: a noise stream of the row key, see NOISE_*), and `positions` (int32[B]) the output position
  of its next draw. Column x of a call draws at positions + offsets[x]."""

  rows: RowSampling
  keys: jax.Array
  positions: jax.Array

  @classmethod
  def of(cls, rows: RowSampling, row_keys_B: jax.Array, stream: int, positions_B) -> "Draws":
    """Draws from the `stream` of each row's key."""
    keys = jax.vmap(lambda key: jax.random.fold_in(key, stream))(row_keys_B)
    return cls(rows, keys, jnp.asarray(positions_B, jnp.int32))

  def at(self, offset) -> "Draws":
    """These draws moved `offset` (int or int32[B]) positions on."""
    return dataclasses.replace(self, positions=self.positions + offset)

  def scores(self, logits_BxXxV: jax.Array, offsets_X=None) -> jax.Array:
    """float32[B, X, V] whose argmax over V is each column's token: log p + Gumbel noise at
    position positions + offsets_X[x] (default x) for a sampled row, the logits themselves for a
    greedy one (so its token is the argmax). No noise is drawn when no row samples."""
    b, x, v = logits_BxXxV.shape
    offsets_X = np.arange(x) if offsets_X is None else np.asarray(offsets_X)
    sampled_B = self.rows.temperature > 0

    def perturbed(logits):
      keys_BxX = position_keys(self.keys, self.positions[:, None] + jnp.asarray(offsets_X, jnp.int32)[None])
      noise = jax.vmap(jax.vmap(lambda key: jax.random.gumbel(key, (v,), jnp.float32)))(keys_BxX)
      with_noise = jnp.log(row_probs(logits, self.rows)) + noise
      return jnp.where(sampled_B[:, None, None], with_noise, logits)

    logits = logits_BxXxV.astype(jnp.float32)
    return jax.lax.cond(jnp.any(sampled_B), perturbed, lambda x: x, logits)

  def sample(self, logits_BxV: jax.Array) -> jax.Array:
    """int32[B]: each row's token at its position (Gumbel-max: an exact draw from its distribution)."""
    return jnp.argmax(self.scores(logits_BxV[:, None])[:, 0], axis=-1).astype(jnp.int32)

  def sample_many(self, logits_BxNxV: jax.Array, n: int) -> jax.Array:
    """int32[B, N, n]: n independent draws from each of a row's N distributions (with replacement),
    all at its position (a tree's nodes' children under lossless rejection sampling); a greedy
    row's are its top-n tokens (n distinct candidates: drawing one n times would waste n - 1)."""
    probs_BxNxV = row_probs(logits_BxNxV, self.rows)
    keys_B = position_keys(self.keys, self.positions[:, None])[:, 0]
    m = probs_BxNxV.shape[1]
    drawn = jax.vmap(lambda key, p: jax.random.categorical(key, jnp.log(p)[:, None], shape=(m, n)))(keys_B,
                                                                                                  probs_BxNxV)
    greedy = jax.lax.top_k(logits_BxNxV, n)[1]
    return jnp.where((self.rows.temperature > 0)[:, None, None], drawn, greedy).astype(jnp.int32)
