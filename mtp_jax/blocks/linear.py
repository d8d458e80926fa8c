"""Linear and embedding layers in the torch weight layout, the flat state-dict view of a module, and
the logical axes every param declares where it is created.

A param's logical axes name what each of its dimensions is ("embed", "heads", "experts", ...; None:
never split), stored as its `logical_axes` metadata. mtp_jax/sharding.py's RULES map them onto a
mesh; nothing here knows the mesh. Activations name theirs with `constrain`, which is a no-op
unless sharding.use_mesh has set the rules that resolve them.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

# Not flax's own `sharding_names`: flax shards a Variable carrying those eagerly, at creation.
AXES = "logical_axes"

_FEW_ROWS = 8
# (logical axes, shape) -> jax.sharding.NamedSharding, set by sharding.use_mesh for `constrain`.
_RESOLVE: contextvars.ContextVar[Callable | None] = contextvars.ContextVar("mtp_jax_resolve_axes", default=None)


def param(value: jax.Array, axes: Sequence[str | None] | None) -> nnx.Param:
  """value as an nnx.Param declaring its logical axes (one name or None per dimension); axes None
  declares nothing, and sharding.param_specs refuses such a param by name."""
  if axes is None:
    return nnx.Param(value)
  axes = tuple(axes)
  if len(axes) != value.ndim:
    raise ValueError(f"logical axes {axes} do not match a param of shape {value.shape}")
  return nnx.Param(value, **{AXES: axes})


@contextlib.contextmanager
def axis_resolver(resolve: Callable):
  """Within it, `constrain(x, axes)` places x by resolve(axes, x.shape) -> NamedSharding."""
  token = _RESOLVE.set(resolve)
  try:
    yield
  finally:
    _RESOLVE.reset(token)


def constrain(x: jax.Array, axes: Sequence[str | None]) -> jax.Array:
  """x with a sharding constraint for its logical axes (e.g. ("batch", None, "embed")) when traced
  under sharding.use_mesh; x itself otherwise."""
  resolve = _RESOLVE.get()
  if resolve is None or not isinstance(x, jax.core.Tracer):
    return x
  return jax.lax.with_sharding_constraint(x, resolve(tuple(axes), x.shape))


def normal(rngs: nnx.Rngs, shape, std: float, dtype) -> jax.Array:
  """std * N(0, 1) drawn in float32 (the same numbers for every dtype), cast to dtype."""
  return (std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)


class Linear(nnx.Module):
  """y = x @ weight.T (+ bias); weight float[out, in], the torch layout, so state dicts map 1:1.

  axes: the weight's logical axes (out axis, in axis); the bias takes the out axis.
  """

  def __init__(self, in_features: int, out_features: int, *, axes: tuple[str | None, str | None] | None = None,
               bias: bool = False, dtype=jnp.float32, rngs: nnx.Rngs):
    self.weight = param(normal(rngs, (out_features, in_features), in_features**-0.5, dtype), axes)
    self.bias = param(jnp.zeros((out_features,), dtype), None if axes is None else axes[:1]) if bias else None

  def __call__(self, x_BxTxI: jax.Array) -> jax.Array:
    w = self.weight[...]
    if math.prod(x_BxTxI.shape[:-1]) <= _FEW_ROWS:
      # Decode steps have a handful of rows; XLA:CPU streams the weight at about twice the
      # speed with it as the left operand (benchmarks/hot_path_ab.py, docs/performance.md).
      y = jnp.moveaxis(jax.lax.dot_general(w, x_BxTxI, (((1,), (x_BxTxI.ndim - 1,)), ((), ()))), 0, -1)
    else:
      y = jnp.einsum("...i,oi->...o", x_BxTxI, w)
    return y if self.bias is None else y + self.bias[...]


class Embed(nnx.Module):
  """Token embedding; weight float[V, D], logical axes ("vocab", "embed")."""

  def __init__(self, vocab_size: int, dim: int, *, dtype, rngs: nnx.Rngs):
    self.weight = param(normal(rngs, (vocab_size, dim), 1.0, dtype), ("vocab", "embed"))

  def __call__(self, tokens_BxT: jax.Array) -> jax.Array:
    return jnp.take(self.weight[...], tokens_BxT, axis=0)


def module_state_dict(module: nnx.Module, prefix: str) -> dict[str, jax.Array]:
  """Flattens a module's params to torch-style dotted names under prefix."""
  out = {}
  for path, param in nnx.to_flat_state(nnx.state(module, nnx.Param)):
    out[prefix + ".".join(str(p) for p in path)] = param[...]
  return out
