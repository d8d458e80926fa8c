"""The grammars of an Engine's running requests as one device grammar (`grammar.union`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from mtp_jax import grammar as grammar_lib


class GrammarUnion:
  """The union of the grammars in use (host side). `union`: the device grammar every call takes
  (None before the first grammar); each grammar's states sit at its offset in it."""

  def __init__(self):
    self.union: grammar_lib.Grammar | None = None
    self.grammars: list[grammar_lib.Grammar] = []  # in the union's order
    self.offsets: list[int] = []

  def _index(self, grammar: grammar_lib.Grammar) -> int:
    return next(i for i, g in enumerate(self.grammars) if g is grammar)

  def start(self, grammar: grammar_lib.Grammar) -> int:
    """The union's state in which `grammar` (held) starts."""
    return self.offsets[self._index(grammar)] + grammar_lib.START

  def holds(self, grammars: list[grammar_lib.Grammar]) -> bool:
    return all(any(g is h for h in self.grammars) for g in grammars)

  def use(self, needed: list[grammar_lib.Grammar], running: list[grammar_lib.Grammar | None],
          gstate_B: jax.Array) -> jax.Array:
    """Makes the union hold `needed`: a new grammar rebuilds it from the `running` requests'
    grammars and the new ones (the others are dropped). Returns gstate_B (int32[B], the slots'
    states in the old union) renumbered into the new one."""
    known = lambda g, gs: any(g is h for h in gs)
    if self.holds(needed):
      return gstate_B
    keep: list[grammar_lib.Grammar] = []
    for g in [*(g for g in self.grammars if known(g, running)), *needed]:
      if not known(g, keep):
        keep.append(g)
    union, offsets = grammar_lib.union(keep)
    if self.union is not None:
      table = np.full((self.union.num_states,), grammar_lib.DONE, np.int32)  # dropped grammars' states: unused
      for g, off in zip(keep, offsets):
        if known(g, self.grammars):
          old = self.offsets[self._index(g)]
          table[old + 1:old + g.num_states] = np.arange(off + 1, off + g.num_states)
      gstate_B = jnp.where(gstate_B < 0, gstate_B, jnp.asarray(table)[jnp.maximum(gstate_B, 0)])
    self.union, self.offsets, self.grammars = union, offsets, keep
    return gstate_B
