"""Draft / target distributions: temperature, top-k, top-p."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtp_jax.sampling import filtered_probs, sample

LOGITS = jnp.log(jnp.asarray([[0.5, 0.2, 0.15, 0.1, 0.05]]))


def test_greedy_is_one_hot_argmax():
  np.testing.assert_array_equal(filtered_probs(LOGITS, temperature=0.0), [[1, 0, 0, 0, 0]])
  tok, _ = sample(LOGITS, None, temperature=0.0)
  assert int(tok[0]) == 0


def test_top_k_and_top_p_keep_the_right_sets():
  np.testing.assert_allclose(filtered_probs(LOGITS, temperature=1.0, top_k=2), [[5 / 7, 2 / 7, 0, 0, 0]], rtol=1e-6)
  # Mass before each token: 0, .5, .7, .85, .95 -> top_p=0.8 keeps the first three.
  np.testing.assert_allclose(filtered_probs(LOGITS, temperature=1.0, top_p=0.8),
                             [[0.5 / 0.85, 0.2 / 0.85, 0.15 / 0.85, 0, 0]], rtol=1e-6)
  np.testing.assert_allclose(filtered_probs(LOGITS, temperature=1.0, top_p=0.3), [[1, 0, 0, 0, 0]], rtol=1e-6)


def test_temperature_sharpens_and_sampling_follows_the_distribution():
  p = filtered_probs(LOGITS, temperature=0.5)
  np.testing.assert_allclose(p, jax.nn.softmax(LOGITS / 0.5), rtol=1e-6)
  toks, _ = sample(jnp.broadcast_to(LOGITS, (20000, 5)), jax.random.key(0), temperature=1.0, top_k=3)
  freq = np.bincount(np.asarray(toks), minlength=5) / 20000
  np.testing.assert_allclose(freq, [0.5 / 0.85, 0.2 / 0.85, 0.15 / 0.85, 0, 0], atol=0.015)


def test_bad_settings():
  with pytest.raises(ValueError, match=r"top_p must be a finite number in \(0\.0, 1\.0\], got 1\.5"):
    filtered_probs(LOGITS, temperature=1.0, top_p=1.5)
  with pytest.raises(ValueError, match=r"top_k must be an int in 1\.\.\d+, got 0"):
    filtered_probs(LOGITS, temperature=1.0, top_k=0)


def test_row_probs_equal_filtered_probs_row_by_row():
  """One program for a mix of settings: each row's distribution is filtered_probs with its own."""
  from mtp_jax.sampling import RowSampling, row_probs
  settings = [(0.0, None, None), (1.0, 2, None), (0.5, None, 0.8), (1.3, 3, 0.9), (1.0, None, None)]
  logits_BxV = jnp.asarray(np.random.default_rng(0).normal(size=(len(settings), 5)), jnp.float32)
  rows = RowSampling.of(*zip(*settings))
  got = row_probs(logits_BxV[:, None], rows)[:, 0]
  for i, (t, k, p) in enumerate(settings):
    np.testing.assert_allclose(got[i], filtered_probs(logits_BxV[i:i + 1], temperature=t, top_k=k, top_p=p)[0],
                               rtol=1e-5, atol=1e-7, err_msg=str(settings[i]))


def test_draws_are_keyed_by_row_key_and_position_and_follow_the_distribution():
  """Draws.sample: a row's token depends on its key, position and logits only (not its neighbours
  or batch position); over many keys at one position it follows row_probs; greedy rows take the argmax."""
  from mtp_jax.sampling import NOISE_TARGET, Draws, RowSampling, row_keys, row_probs
  n = 20000
  logits_BxV = jnp.broadcast_to(LOGITS, (n, 5))
  rows = RowSampling.uniform(n, 1.0, 3)
  toks = np.asarray(Draws.of(rows, row_keys(0, n), NOISE_TARGET, jnp.full((n,), 7)).sample(logits_BxV))
  freq = np.bincount(toks, minlength=5) / n
  np.testing.assert_allclose(freq, np.asarray(row_probs(LOGITS[None], RowSampling.uniform(1, 1.0, 3)))[0, 0],
                             atol=0.015)
  # Row 3's draw alone, in another batch, at another row index: the same token; another position: independent.
  keys = row_keys(0, n)
  alone = Draws.of(RowSampling.uniform(1, 1.0, 3), keys[3:4], NOISE_TARGET, jnp.asarray([7])).sample(LOGITS)
  assert int(alone[0]) == toks[3]
  moved = np.asarray(Draws.of(rows, keys, NOISE_TARGET, jnp.full((n,), 8)).sample(logits_BxV))
  assert 0.3 < np.mean(moved == toks) < 0.6  # sum of p^2 over the top-3 renormalised: about 0.44
  greedy = Draws.of(RowSampling.uniform(2), keys[:2], NOISE_TARGET, jnp.zeros((2,), jnp.int32))
  assert np.asarray(greedy.sample(jnp.broadcast_to(LOGITS, (2, 5)))).tolist() == [0, 0]
