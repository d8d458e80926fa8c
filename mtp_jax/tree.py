"""Draft trees: the static shape of a tree (`TreeSpec`) and the tree `propose` returns (`DraftTree`).

A tree of depth k has a root, node 0: the newest verified token. Every node of depth d - 1
gets as children the top-w_d tokens of the chain's depth-d draft distribution after the
node's path, so depth d holds N_d = w_1 * .. * w_d nodes and the whole tree
N = N_1 + .. + N_k draft nodes. Nodes are numbered breadth first (depth by depth, children of
one parent next to each other), so a node's children and a depth's nodes are index ranges and
every shape is static: one compile per TreeSpec.

Fixed widths rather than a budget of nodes picked by cumulative draft probability (EAGLE-2):
the topology is then a compile-time constant (parents, ancestor masks, paths are numpy
arrays baked into the program) and a node's place tells its depth, so the target's and the
modules' tree masks need no on-device bookkeeping.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from mtp_jax import grammar as grammar_lib
from mtp_jax import validate

MAX_NODES = 256  # a verify call runs N + 1 target rows per sequence


@dataclasses.dataclass(frozen=True)
class TreeSpec:
  """widths: (w_1, .., w_k), children per node at each depth; k = len(widths) drafts deep.

  (1, 1, 1) is the chain of three drafts; (3, 2, 1) has 3 + 6 + 6 = 15 draft nodes.
  """

  widths: tuple[int, ...]

  def __post_init__(self):
    if isinstance(self.widths, (str, bytes)) or not isinstance(self.widths, (tuple, list)) or not self.widths:
      raise validate.InvalidType("widths", f"widths must be a non-empty tuple of ints, got {self.widths!r}")
    widths = tuple(validate.positive_int(f"widths[{d}]", w) for d, w in enumerate(self.widths))
    object.__setattr__(self, "widths", widths)
    if self.num_nodes > MAX_NODES:
      raise validate.InvalidValue("widths", f"widths={widths} make {self.num_nodes} draft nodes; at most "
                                            f"{MAX_NODES} are supported")

  @property
  def depth(self) -> int:
    """k: the drafts along one path, the chain's num_drafts."""
    return len(self.widths)

  @property
  def level_sizes(self) -> tuple[int, ...]:
    """(1, N_1, .., N_k): nodes at depth 0 (the root) .. k."""
    return tuple(int(np.prod(self.widths[:d])) for d in range(self.depth + 1))

  @property
  def num_nodes(self) -> int:
    """N: draft nodes (the root excluded)."""
    return sum(self.level_sizes) - 1

  @property
  def starts(self) -> tuple[int, ...]:
    """Index of the first node of depth 0 .. k, and N + 1 after the last."""
    return tuple(int(x) for x in np.cumsum((0,) + self.level_sizes))

  @functools.cached_property
  def parents(self) -> np.ndarray:
    """int32[N + 1]: each node's parent; -1 for the root."""
    parents = [-1]
    for d in range(1, self.depth + 1):
      parents += [p for p in range(self.starts[d - 1], self.starts[d]) for _ in range(self.widths[d - 1])]
    return np.asarray(parents, np.int32)

  @functools.cached_property
  def depths(self) -> np.ndarray:
    """int32[N + 1]: each node's depth (the root 0)."""
    return np.repeat(np.arange(self.depth + 1, dtype=np.int32), self.level_sizes)

  @functools.cached_property
  def paths(self) -> np.ndarray:
    """int32[N + 1, k + 1]: paths[n, d] is n's ancestor at depth d (n itself at its own depth and below)."""
    paths = np.tile(np.arange(self.num_nodes + 1, dtype=np.int32)[:, None], (1, self.depth + 1))
    for n in range(self.num_nodes + 1):
      m = n
      while m > 0:
        m = self.parents[m]
        paths[n, self.depths[m]] = m
    return paths

  @functools.cached_property
  def visible(self) -> np.ndarray:
    """bool[N + 1, N + 1]: visible[n, m] iff m is n or one of its ancestors (the tree attention mask)."""
    n1 = self.num_nodes + 1
    vis = np.zeros((n1, n1), bool)
    for n in range(n1):
      vis[n, self.paths[n, :self.depths[n] + 1]] = True
    return vis


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DraftTree:
  """A tree of drafts for B sequences, nodes numbered as in TreeSpec without the root.

  tokens: int32[B, N], node n's token (node n here is TreeSpec node n + 1);
  parents: int32[N], the parent's index in tokens, -1 for children of the root;
  depths: int32[N], 1..k;
  probs: float32[B, M, V] when sampling, else None: the distribution TreeSpec node m's children
    were drawn from, for the M = starts[k] nodes that have children (the root first).
  """

  tokens: jax.Array
  parents: jax.Array
  depths: jax.Array
  probs: jax.Array | None = None

  @classmethod
  def of(cls, spec: TreeSpec, tokens_BxN, probs_BxMxV=None) -> "DraftTree":
    """The tree of spec's shape with node tokens int32[B, N] and, sampled, the distributions
    float32[B, M, V] the children of its M inner nodes were drawn from."""
    return cls(tokens=tokens_BxN, parents=np.asarray(spec.parents[1:] - 1, np.int32),
               depths=np.asarray(spec.depths[1:], np.int32), probs=probs_BxMxV)


def node_states(grammar, state_B, tokens_BxN1, tree: TreeSpec, upto: int | None = None):
  """Grammar states int32[B, N + 1] after each node's path: the root (column 0) keeps state_B, a
  node the state after its parent's advanced by its own token (tokens_BxN1[:, n]; the root's
  is not read). upto: only depths 1..upto are advanced (the rest stay 0)."""
  states = [state_B[:, None]]
  for d in range(1, (tree.depth if upto is None else upto) + 1):
    nodes = np.arange(tree.starts[d], tree.starts[d + 1])
    parent_states = jnp.concatenate(states, axis=1)[:, tree.parents[nodes]]
    states.append(grammar_lib.advance(grammar, parent_states, tokens_BxN1[:, nodes]))
  states = jnp.concatenate(states, axis=1)
  return jnp.pad(states, [(0, 0), (0, tree.num_nodes + 1 - states.shape[1])])


def check_tree(tree, *, num_drafts: int | None = None, max_depth: int | None = None,
               vocab_size: int | None = None, argument: str = "tree") -> TreeSpec:
  """tree as a TreeSpec, refused by the name `argument` unless it is one, at most max_depth deep
  (the proposer's depths), num_drafts deep and no wider than vocab_size at any depth (when given):
  a node's children are distinct tokens, its top-w."""
  validate.instance(argument, tree, TreeSpec, "a mtp_jax.tree.TreeSpec (e.g. TreeSpec(widths=(3, 2, 1)))")
  if vocab_size is not None and max(tree.widths) > vocab_size:
    d = int(np.argmax(tree.widths))
    raise validate.InvalidValue(argument, f"tree widths={tree.widths}: widths[{d}]={tree.widths[d]} is more "
                                          f"children than the model's vocab_size={vocab_size}; widths must be "
                                          f"<= vocab_size")
  if max_depth is not None and tree.depth > max_depth:
    raise validate.InvalidValue(argument, f"tree widths={tree.widths} is {tree.depth} deep; the proposer drafts "
                                          f"at most {max_depth}")
  if num_drafts is not None and tree.depth != num_drafts:
    raise validate.InvalidValue(argument, f"tree has depth {tree.depth} (widths={tree.widths}) but "
                                          f"num_drafts={num_drafts}; they must be equal")
  return tree
