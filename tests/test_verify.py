"""Acceptance rules: greedy prefix, lossless speculative sampling (with a wrong rule caught), relaxed."""

import jax
import jax.numpy as jnp
import numpy as np

import mtp_jax
from mtp_jax import verify

V, N = 6, 40000


def test_greedy_accepts_matching_prefix_and_corrects():
  logits = jnp.asarray(np.eye(V)[[[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4]]] * 5.0, jnp.float32)
  drafts = jnp.asarray([[1, 2, 3], [1, 0, 3], [5, 2, 3]], jnp.int32)
  a, nxt = mtp_jax.verify_greedy(logits, drafts)
  np.testing.assert_array_equal(a, [3, 1, 0])
  np.testing.assert_array_equal(nxt, [4, 2, 1])


def _chi2_pvalue(counts, probs):
  """Pearson chi-square p-value (Wilson-Hilferty normal approximation; no scipy needed)."""
  keep = probs > 0
  expected = probs[keep] * counts.sum()
  stat = float(np.sum((counts[keep] - expected) ** 2 / expected))
  dof = int(keep.sum()) - 1
  z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / np.sqrt(2 / (9 * dof))
  return 0.5 * float(jax.scipy.special.erfc(z / np.sqrt(2)))


def _first_token_counts(rule, p_logits, q_probs, seed):
  """Draws N drafts from q, verifies with `rule`, returns counts of the first emitted token."""
  key_d, key_v = jax.random.split(jax.random.key(seed))
  drafts = jax.random.categorical(key_d, jnp.log(q_probs), shape=(N, 1)).astype(jnp.int32)
  logits = jnp.broadcast_to(p_logits, (N, 2, V))
  q = jnp.broadcast_to(q_probs, (N, 1, V))
  a, nxt = rule(logits, drafts, q, key_v, temperature=1.0)
  first = jnp.where(a > 0, drafts[:, 0], nxt)
  return np.bincount(np.asarray(first), minlength=V)


def _wrong_rule(logits, drafts, q, key, *, temperature):
  """Accepts like the right rule but resamples rejections from p instead of norm(max(0, p - q))."""
  a, _ = verify.verify_sampling(logits, drafts, q, key, temperature=temperature)
  nxt = jax.random.categorical(jax.random.fold_in(key, 1), logits[:, 0] / temperature).astype(jnp.int32)
  return a, nxt


def test_speculative_sampling_is_lossless_and_a_wrong_rule_is_caught():
  p_logits = jnp.asarray([2.0, 1.0, 0.5, 0.0, -1.0, 1.5])
  q_probs = jax.nn.softmax(jnp.asarray([0.0, 2.0, 0.5, 1.0, 0.0, -1.0]))
  p = np.asarray(jax.nn.softmax(p_logits))
  good = _chi2_pvalue(_first_token_counts(verify.verify_sampling, p_logits, q_probs, 0), p)
  bad = _chi2_pvalue(_first_token_counts(_wrong_rule, p_logits, q_probs, 0), p)
  assert good > 1e-3, good
  assert bad < 1e-6, bad


def test_all_accepted_bonus_comes_from_last_distribution():
  """q == p: every draft is accepted and the bonus is drawn from p_k."""
  p_logits = jnp.asarray([[0.0, 1.0, 2.0, 0.0, 0.0, 0.0], [3.0, 0.0, 0.0, 0.0, 0.0, 1.0]])
  logits = jnp.broadcast_to(p_logits, (N, 2, V))
  q = jnp.broadcast_to(jax.nn.softmax(p_logits[:1]), (N, 1, V))
  drafts = jax.random.categorical(jax.random.key(1), jnp.log(q[:, 0]))[:, None].astype(jnp.int32)
  a, nxt = verify.verify_sampling(logits, drafts, q, jax.random.key(2), temperature=1.0)
  assert np.all(np.asarray(a) == 1)
  p_bonus = np.asarray(jax.nn.softmax(p_logits[1]))
  assert _chi2_pvalue(np.bincount(np.asarray(nxt), minlength=V), p_bonus) > 1e-3


def test_relaxed_accepts_near_top_drafts_only():
  probs = jnp.asarray([[[0.40, 0.35, 0.25], [0.5, 0.3, 0.2]], [[0.40, 0.10, 0.50], [0.6, 0.2, 0.2]]])
  logits = jnp.log(probs)
  drafts = jnp.asarray([[1], [1]], jnp.int32)
  a, nxt = mtp_jax.verify_relaxed(logits, drafts, top_n=2, delta=0.1)
  np.testing.assert_array_equal(a, [1, 0])  # 0.35 is within 0.1 of 0.40; 0.10 is outside the top 2
  np.testing.assert_array_equal(nxt, [0, 2])


def test_verify_rows_greedy_rows_are_verify_greedy_and_sampled_rows_lossless():
  """verify_rows over a batch mixing greedy and sampled rows: the greedy rows give verify_greedy's
  answer; a sampled row's first emitted token follows p (chi-square), under a cap of 0 and 1."""
  from mtp_jax.sampling import RowSampling
  logits = jnp.asarray(np.eye(V)[[[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4]]] * 5.0, jnp.float32)
  drafts = jnp.asarray([[1, 2, 3], [1, 0, 3], [5, 2, 3]], jnp.int32)
  q = jax.nn.one_hot(drafts, V)
  rows = RowSampling.of([0.0] * 3, [None] * 3, [None] * 3)
  keys = jax.random.split(jax.random.key(0), 3)
  a, nxt = verify.verify_rows(logits, drafts, q, keys, rows)
  np.testing.assert_array_equal(a, [3, 1, 0])
  np.testing.assert_array_equal(nxt, [4, 2, 1])
  a, nxt = verify.verify_rows(logits, drafts, q, keys, rows, jnp.asarray([1, 0, 2]))
  np.testing.assert_array_equal(a, [1, 0, 0])  # the cap stops acceptance; the next token is the argmax after it
  np.testing.assert_array_equal(nxt, [2, 1, 1])

  p_logits = jnp.asarray([2.0, 1.0, 0.5, 0.0, -1.0, 1.5])
  q_probs = jax.nn.softmax(jnp.asarray([0.0, 2.0, 0.5, 1.0, 0.0, -1.0]))
  p = np.asarray(jax.nn.softmax(p_logits))
  n_rows = RowSampling.of([1.0] * N, [None] * N, [None] * N)
  for cap in (1, 0):
    def rule(logits, drafts, q, key, *, temperature):
      del temperature
      return verify.verify_rows(logits, drafts, q, jax.random.split(key, N), n_rows, jnp.full((N,), cap))
    assert _chi2_pvalue(_first_token_counts(rule, p_logits, q_probs, 0), p) > 1e-3, cap


def test_gumbel_acceptance_keeps_the_targets_own_draws():
  """verify_gumbel: drafts equal to the target's draws at their positions are all accepted and the
  bonus is the target's next draw; a wrong draft is rejected and the target's draw replaces it;
  the cap stops acceptance without changing the token; no draws is verify_greedy."""
  from mtp_jax.sampling import NOISE_TARGET, Draws, RowSampling
  b, k, v = 4, 3, 6
  logits = jnp.asarray(np.random.default_rng(0).normal(size=(b, k + 1, v)), jnp.float32)
  draws = Draws.of(RowSampling.uniform(b, 1.0), jax.random.split(jax.random.key(1), b), NOISE_TARGET,
                   jnp.asarray([0, 5, 9, 2]))
  target = np.stack([np.asarray(draws.at(i).sample(logits[:, i])) for i in range(k + 1)], axis=1)
  a, nxt = verify.verify_gumbel(logits, target[:, :k], draws)
  assert a.tolist() == [k] * b and nxt.tolist() == target[:, k].tolist()
  wrong = target[:, :k].copy()
  wrong[:, 1] = (wrong[:, 1] + 1) % v
  a, nxt = verify.verify_gumbel(logits, wrong, draws)
  assert a.tolist() == [1] * b and nxt.tolist() == target[:, 1].tolist()
  a, nxt = verify.verify_gumbel(logits, target[:, :k], draws, jnp.asarray([0, 1, 2, 3]))
  assert a.tolist() == [0, 1, 2, 3] and nxt.tolist() == [target[i, i] for i in range(b)]
  greedy = verify.verify_greedy(logits, wrong)
  assert [x.tolist() for x in verify.verify_gumbel(logits, wrong, None)] == [x.tolist() for x in greedy]
