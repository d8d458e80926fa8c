"""serving/jit.py: the models' arrays flattened once (`FlatModel`) serve every entry point alike."""

import jax
import numpy as np

import mtp_jax
from mtp_jax import serving
from mtp_jax.serving.jit import FlatModel, jit_prefill, jit_step
from mtp_jax.serving.state import SlotSettings

K = 2


def _models(seed: int):
  common = dict(vocab_size=7, hidden_size=16, num_heads=2, num_kv_heads=1, head_dim=8, intermediate_size=32)
  return (mtp_jax.init_target(mtp_jax.TargetConfig(num_layers=1, **common), seed),
          mtp_jax.init_mtp(mtp_jax.MtpConfig(num_modules=K, **common), seed + 1))


def _steps(step, target, proposer, as_arg, n: int = 3):
  """The state after a prefill of two prompts and n decode steps, each call given as_arg(model)."""
  s = step.init(target, proposer, None, 2)
  prompts_BxT, lens_B = np.asarray([[1, 2, 3], [4, 5, 0]], np.int32), np.asarray([3, 2], np.int32)
  t, p = as_arg(target), as_arg(proposer)
  s = jit_prefill(step, t, p, None, s, prompts_BxT, lens_B, np.ones(2, bool), np.zeros(2, np.int32),
                  np.full(2, 8, np.int32), SlotSettings.uniform(2, num_drafts=K))
  for _ in range(n):
    s = jit_step(step, t, p, None, s)
  return s


def test_flat_model_holds_the_arrays_and_rebuilds_the_module():
  target, proposer = _models(0)
  flat = FlatModel.of(target)
  assert FlatModel.of(flat) is flat and FlatModel.of(None) is None
  assert len(flat.leaves) == len(jax.tree_util.tree_leaves(target))
  for a, b in zip(jax.tree_util.tree_leaves(flat.module()), jax.tree_util.tree_leaves(target)):
    assert a is b
  assert type(flat.module()) is type(target) and flat.module().cfg == target.cfg
  assert jax.tree_util.tree_leaves(flat) == list(flat.leaves)  # what a jitted call flattens: the arrays alone


def test_entry_points_give_the_same_state_from_modules_or_flat_models():
  target, proposer = _models(0)
  step = serving.DecodeStep(serving.StepSettings(num_drafts=K, max_new_tokens=8, max_len=32))
  want = _steps(step, target, proposer, lambda m: m)
  got = _steps(step, target, proposer, FlatModel.of)
  data = lambda x: jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(want), jax.tree_util.tree_leaves(got)):
    np.testing.assert_array_equal(data(a), data(b), err_msg=jax.tree_util.keystr(path))
  # Another model of the same shapes is another value of the same arguments: no new program.
  before = jit_step._cache_size()
  other = _steps(step, *_models(5), FlatModel.of)
  assert jit_step._cache_size() == before
  assert not np.array_equal(other.out, got.out)
