"""blocks/axes.py: every state array declares its logical axes; the slot axis read from them is
the one its shape says, and take_slots / put_slots move exactly those slots."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtp_jax.blocks.axes import axes, leaf_axes, put_slots, slot_axes, take_slots
from mtp_jax.serving import DecodeStep, Paging, StepSettings
from mtp_jax.tree import TreeSpec

from test_generate import PROPOSER5, TARGET5


def _steps():
  """Loop states of every kind: contiguous and paged, chain and tree, with draft distributions."""
  paging = Paging(page_size=4, num_pages=16)
  return {
      "contiguous chain": DecodeStep(StepSettings(num_drafts=2, max_new_tokens=8, max_len=32)),
      "paged chain, rejection": DecodeStep(StepSettings(num_drafts=2, max_new_tokens=8, max_len=32, sampled=True,
                                                        acceptance="rejection", paging=paging)),
      "paged tree, rejection": DecodeStep(StepSettings(num_drafts=2, max_new_tokens=8, max_len=32, sampled=True,
                                                       acceptance="rejection", tree=TreeSpec((2, 1)),
                                                       paging=paging)),
  }


@pytest.mark.parametrize("kind", list(_steps()))
def test_declared_slot_axes_are_the_axes_the_batch_size_changes(kind):
  """For every array of a loop state: its declared slot axis is the dimension that grows from a
  1-slot to a 2-slot state (None where nothing does: pools, free list, per-position counters)."""
  step = _steps()[kind]
  states = [jax.eval_shape(lambda b=b: step.init(TARGET5, PROPOSER5, None, b)) for b in (1, 2)]
  grown = [next((i for i, (x, y) in enumerate(zip(a.shape, b.shape)) if x != y), None)
           for a, b in zip(*map(jax.tree_util.tree_leaves, states))]
  assert slot_axes(states[1]) == grown
  assert any(a is None for a in grown) and any(a is not None and a > 0 for a in grown)  # pools; lengths [K, B]


def test_take_and_put_slots_move_exactly_those_slots():
  step = _steps()["paged chain, rejection"]
  s = step.init(TARGET5, PROPOSER5, None, 4)
  s = s.set(last=jnp.arange(4, dtype=jnp.int32), proposer=s.proposer.set(lengths=jnp.arange(12).reshape(3, 4)))
  idx = jnp.asarray([2, 0], jnp.int32)
  sub = take_slots(s, idx)
  np.testing.assert_array_equal(sub.last, [2, 0])
  np.testing.assert_array_equal(sub.proposer.lengths, [[2, 0], [6, 4], [10, 8]])
  assert sub.target.kv[0].k.shape == s.target.kv[0].k.shape  # a pool all slots share stays whole
  back = put_slots(s, sub.set(last=sub.last + 10), idx)
  np.testing.assert_array_equal(back.last, [10, 1, 12, 3])
  np.testing.assert_array_equal(back.proposer.lengths, s.proposer.lengths)


def test_an_array_without_declared_axes_is_refused_by_name():
  @jax.tree_util.register_dataclass
  @dataclasses.dataclass(frozen=True)
  class Bad:
    good: jax.Array = axes("batch")
    lost: jax.Array = None

  with pytest.raises(ValueError, match=r"Bad\.lost of shape \(2, 3\) declares logical axes None"):
    leaf_axes(Bad(jnp.zeros(2), jnp.zeros((2, 3))))
  with pytest.raises(ValueError, match=r"Bad\.good of shape \(2, 3\) declares logical axes \('batch',\)"):
    leaf_axes(Bad(jnp.zeros((2, 3)), jnp.zeros((2,))))
