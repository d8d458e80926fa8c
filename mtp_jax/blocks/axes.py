"""Logical axes of state arrays, declared on the dataclass fields that hold them.

Every array of a state pytree (caches and their allocator, the model states, the serving loop's
state) declares its logical axes where its field is defined, as params declare theirs where they
are created (linear.py):

    k: jax.Array = axes("batch", "cache_rows", "kv_heads", "head_dim")

A field holding a tuple of arrays declares them all; a field holding another state declares
nothing and its own fields do. Two readers use the declarations, so neither guesses from shapes
nor lists fields by hand: the serving loop's slot gather / scatter (`take_slots`, `put_slots`:
the axis named in SLOT_AXES runs over the sequence slots) and `sharding.state_specs` (its RULES
map each name onto a mesh axis). None in a declaration: an axis no rule splits.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

AXES_KEY = "logical_axes"
# The names of a slot axis: "batch" (split over the mesh's data axis) and "table_slots", the page
# table's slots, which every device reads whole (pages are shared by all slots), so no rule splits it.
SLOT_AXES = ("batch", "table_slots")


def axes(*names: str | None, default=dataclasses.MISSING):
  """A dataclass field whose arrays have these logical axes (one name, or None, per dimension)."""
  return dataclasses.field(default=default, metadata={AXES_KEY: names})


def leaf_axes(tree) -> list[tuple[str | None, ...]]:
  """The declared logical axes of every array of `tree`, in `jax.tree_util.tree_leaves` order.

  Raises ValueError naming the leaf when it declares none, or a count that is not its rank."""
  out = []
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    node, names = tree, None
    for key in path:
      if isinstance(key, jax.tree_util.GetAttrKey):
        if names is None and dataclasses.is_dataclass(node):
          field = next(f for f in dataclasses.fields(node) if f.name == key.name)
          names = field.metadata.get(AXES_KEY)
        node = getattr(node, key.name)
      elif isinstance(key, jax.tree_util.SequenceKey):
        node = node[key.idx]
      else:
        node = node[key.key]
    if names is None or len(names) != jnp.ndim(leaf):
      raise ValueError(f"state array {type(tree).__name__}{jax.tree_util.keystr(path)} of shape "
                       f"{tuple(jnp.shape(leaf))} declares logical axes {names}: declare one name per "
                       "dimension on its field (blocks.axes.axes)")
    out.append(names)
  return out


def slot_axes(tree) -> list[int | None]:
  """For each array of `tree` (tree_leaves order): the dimension that runs over the slots, or
  None for an array all slots share (page pools, the free list, counters per draft position)."""
  return [next((i for i, n in enumerate(names) if n in SLOT_AXES), None) for names in leaf_axes(tree)]


def take_slots(tree, idx_A):
  """`tree` with every per-slot array cut to the A slots idx_A (int32[A]), in idx_A's order;
  shared arrays whole."""
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  return treedef.unflatten([x if a is None else jnp.take(x, idx_A, axis=a)
                            for x, a in zip(leaves, slot_axes(tree))])


def put_slots(tree, sub, idx_A):
  """`tree` with slots idx_A (int32[A], distinct) taken from `sub` (an A-slot tree of the same
  structure, as `take_slots` gives and a function of it returns) and its shared arrays
  replaced by sub's (a call over some slots updates the shared pools). The result has sub's
  static fields."""
  sub_leaves, sub_def = jax.tree_util.tree_flatten(sub)
  put = lambda x, y, a: y if a is None else x.at[(slice(None),) * a + (idx_A,)].set(y)
  return sub_def.unflatten([put(x, y, a) for x, y, a in zip(jax.tree_util.tree_leaves(tree), sub_leaves,
                                                            slot_axes(tree))])
