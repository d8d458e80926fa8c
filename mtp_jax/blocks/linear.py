"""Linear and embedding layers in the torch weight layout, the flat state-dict view of a module, and
the logical axes every param declares where it is created, and block-scaled FP8 weights kept as
stored (`keep_fp8`) and dequantized inside the matmul (`weight_of`).

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

from mtp_jax.checkpoint import SCALE_SUFFIX, Fp8Blocks

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
  fp8, weight_scale_inv: None, or after `keep_fp8(self, "weight", fp8)` the weight is float8_e4m3fn
  with float32 block scales, dequantized to fp8.dtype in each call.
  """

  def __init__(self, in_features: int, out_features: int, *, axes: tuple[str | None, str | None] | None = None,
               bias: bool = False, dtype=jnp.float32, rngs: nnx.Rngs):
    self.weight = param(normal(rngs, (out_features, in_features), in_features**-0.5, dtype), axes)
    self.bias = param(jnp.zeros((out_features,), dtype), None if axes is None else axes[:1]) if bias else None
    self.fp8, self.weight_scale_inv = None, nnx.data(None)  # data: keep_fp8 may put a param there

  def __call__(self, x_BxTxI: jax.Array) -> jax.Array:
    w = weight_of(self, "weight")
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


# --- Block-scaled FP8 weights (from_pretrained(..., quantized="fp8")) --------------------------------

FP8_MAX = 448.0  # the largest float8_e4m3fn magnitude: a block's largest weight is scaled to it


def quantize(w_xRxC: jax.Array, block: tuple[int, int]) -> tuple[jax.Array, jax.Array]:
  """(float8_e4m3fn[..., R, C], scale_inv float32[..., ceil(R / block[0]), ceil(C / block[1])]): each
  block of w's last two dims divided by its largest magnitude / 448, as DeepSeek-V3's FP8 release
  stores its weights (edge blocks cover what is left); `dequantize` is the inverse, to FP8 rounding."""
  (br, bc), (r, c) = block, w_xRxC.shape[-2:]
  sr, sc = -(-r // br), -(-c // bc)
  lead = w_xRxC.shape[:-2]
  padded = jnp.pad(w_xRxC.astype(jnp.float32), [(0, 0)] * len(lead) + [(0, sr * br - r), (0, sc * bc - c)])
  blocks = padded.reshape(*lead, sr, br, sc, bc)
  amax = jnp.abs(blocks).max(axis=(-3, -1))
  scale_inv = jnp.where(amax > 0, amax / FP8_MAX, 1.0)
  values = jnp.clip(blocks / scale_inv[..., :, None, :, None], -FP8_MAX, FP8_MAX).reshape(*lead, sr * br, sc * bc)
  return values[..., :r, :c].astype(jnp.float8_e4m3fn), scale_inv


def dequantize(values_xRxC: jax.Array, scale_inv: jax.Array, block: tuple[int, int], dtype) -> jax.Array:
  """dtype[..., R, C]: each float8 value times the float32 scale of its block (scale_inv as `quantize`
  gives it), multiplied in float32 and then cast, as checkpoint.dequantize_fp8_blocks does at load."""
  r, c = values_xRxC.shape[-2:]
  scale_RxC = jnp.repeat(jnp.repeat(scale_inv, block[0], axis=-2)[..., :r, :], block[1], axis=-1)[..., :c]
  return (values_xRxC.astype(jnp.float32) * scale_RxC).astype(dtype)


def keep_fp8(module: nnx.Module, name: str, fp8: Fp8Blocks) -> None:
  """Makes module.<name> (a float weight [..., R, C]; Linear's weight, an Experts projection) block-scaled
  FP8: float8_e4m3fn values under the same name and logical axes, and <name>_scale_inv float32[...,
  ceil(R / block[0]), ceil(C / block[1])] (`quantize` of the current values; under nnx.eval_shape only
  shapes), which the loaders then fill from a checkpoint. Sets module.fp8 = fp8, so `weight_of` reads
  it back dequantized to fp8.dtype.

  The scales are a block[0] * block[1]-th of the values: their last two dims are never split
  (replicated on a mesh; a device's block of the weight need not start on a scale block), their
  leading ones (experts) split as the weight's do.
  """
  var = getattr(module, name)
  axes = var.get_metadata().get(AXES)
  values, scale_inv = quantize(var[...], fp8.block)
  setattr(module, name, param(values, axes))
  setattr(module, name + SCALE_SUFFIX, param(scale_inv, None if axes is None else tuple(axes[:-2]) + (None, None)))
  module.fp8 = fp8


def weight_of(module: nnx.Module, name: str, rows: jax.Array | None = None) -> jax.Array:
  """module.<name>[...], or its rows [rows] (experts gathered by index), dequantized to module.fp8.dtype
  when `keep_fp8` made it FP8: the dequantization is part of the traced matmul, so only the
  float8 values and their scales are held."""
  w = getattr(module, name)[...]
  w = w if rows is None else w[rows]
  scale_inv = getattr(module, name + SCALE_SUFFIX)
  if scale_inv is None:
    return w
  scale_inv = scale_inv[...] if rows is None else scale_inv[...][rows]
  return dequantize(w, scale_inv, module.fp8.block, module.fp8.dtype)
