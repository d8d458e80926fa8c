"""The Engine's slot groups: a call computes a power-of-two group of slots; a prefill's group holds no other request."""

from mtp_jax.serving.admission import prefill_groups, slot_group


def _lists(groups):
  return [g.tolist() for g in groups]


def test_a_group_pads_with_free_slots_first_to_a_power_of_two():
  occupied = [True, False, True, False, False, False, False, False]
  assert slot_group([0, 2, 5], occupied).tolist() == [0, 2, 5, 1]
  assert slot_group([5], occupied).tolist() == [5]
  # A group of more than half the slots is all of them (theirs first).
  assert slot_group([0, 2, 5, 6, 7], occupied).tolist() == [0, 2, 5, 6, 7, 1, 3, 4]
  assert slot_group([0, 1], [True] * 4, may_group=False).tolist() == [0, 1, 2, 3]


def test_a_prefill_group_takes_free_slots_only_and_splits_otherwise():
  # 3 admitted into slots 1, 3, 4 of 8; 0 and 2 run other requests, 5..7 are free: one group.
  occupied = [True, True, True, True, True, False, False, False]
  assert _lists(prefill_groups([1, 3, 4], occupied)) == [[1, 3, 4, 5]]
  # No slot free: a group of 4 would take a running slot, so 2 + 1, each exactly its slots.
  assert _lists(prefill_groups([1, 3, 4], [True] * 8)) == [[1, 3], [4]]
  # 7 admitted beside one running request: 4 + 2 + 1 (a group of all 8 would take slot 7).
  assert _lists(prefill_groups(list(range(7)), [True] * 8)) == [[0, 1, 2, 3], [4, 5], [6]]
  assert _lists(prefill_groups([6, 0, 5, 1, 2], [True] * 8)) == [[6, 0, 5, 1], [2]]
  # Every slot admitted at once, or a mesh (a group must divide its data axis): one group.
  assert _lists(prefill_groups(list(range(8)), [True] * 8)) == [list(range(8))]
  assert _lists(prefill_groups([1, 3, 4], [True] * 8, may_group=False)) == [[1, 3, 4, 0, 2, 5, 6, 7]]
