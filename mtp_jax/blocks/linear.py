"""Linear and embedding layers in the torch weight layout, and the flat state-dict view of a module."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx


_FEW_ROWS = 8


def normal(rngs: nnx.Rngs, shape, std: float, dtype) -> jax.Array:
  """std * N(0, 1) drawn in float32 (the same numbers for every dtype), cast to dtype."""
  return (std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)


class Linear(nnx.Module):
  """y = x @ weight.T (+ bias); weight float[out, in], the torch layout, so state dicts map 1:1."""

  def __init__(self, in_features: int, out_features: int, *, bias: bool = False,
               dtype=jnp.float32, rngs: nnx.Rngs):
    self.weight = nnx.Param(normal(rngs, (out_features, in_features), in_features**-0.5, dtype))
    self.bias = nnx.Param(jnp.zeros((out_features,), dtype)) if bias else None

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
  """Token embedding; weight float[V, D]."""

  def __init__(self, vocab_size: int, dim: int, *, dtype, rngs: nnx.Rngs):
    self.weight = nnx.Param(normal(rngs, (vocab_size, dim), 1.0, dtype))

  def __call__(self, tokens_BxT: jax.Array) -> jax.Array:
    return jnp.take(self.weight[...], tokens_BxT, axis=0)


def module_state_dict(module: nnx.Module, prefix: str) -> dict[str, jax.Array]:
  """Flattens a module's params to torch-style dotted names under prefix."""
  out = {}
  for path, param in nnx.to_flat_state(nnx.state(module, nnx.Param)):
    out[prefix + ".".join(str(p) for p in path)] = param[...]
  return out
