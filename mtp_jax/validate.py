"""The validation layer of every public entry point: types, ranges and finiteness, checked once.

Each helper takes the argument's public name (`"max_new_tokens"`, `"TargetConfig.rms_norm_eps"`,
`"config.json: target.rope_theta"`) and raises `InvalidValue` (a ValueError) or `InvalidType`
(a TypeError) whose message names the argument, the value and what is allowed, and whose
`.argument` attribute holds the name. Integers must fit int32 (the dtype every token, length
and count has on device): a larger Python or int64 value is refused, never wrapped. Floats are
never accepted where an int is expected, nor bools where a number is.
"""

from __future__ import annotations

import functools
import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1


class InvalidValue(ValueError):
  """A value outside what the argument allows; `.argument` names the argument."""

  def __init__(self, argument: str, message: str):
    super().__init__(message)
    self.argument = argument


class InvalidType(TypeError):
  """A value of a type the argument does not take; `.argument` names the argument."""

  def __init__(self, argument: str, message: str):
    super().__init__(message)
    self.argument = argument


def renamed(error: InvalidValue | InvalidType, prefix: str):
  """The same kind of error with `prefix: ` in front of its message (e.g. the file it came from)."""
  return type(error)(error.argument, f"{prefix}: {error}")


def _range_text(lo, hi) -> str:
  if lo is not None and hi is not None:
    return f"in {lo}..{hi}"
  if lo is not None:
    return f">= {lo}"
  return f"<= {hi}"


def integer(name: str, value, lo: int | None = INT32_MIN, hi: int | None = INT32_MAX) -> int:
  """value as a Python int, refused unless an int (Python or numpy scalar, not bool) in lo..hi."""
  if isinstance(value, np.ndarray) and value.ndim == 0:
    value = value[()]
  if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
    raise InvalidType(name, f"{name} must be an int {_range_text(lo, hi)}, got {value!r} "
                            f"({type(value).__name__})")
  value = int(value)
  if (lo is not None and value < lo) or (hi is not None and value > hi):
    raise InvalidValue(name, f"{name} must be an int {_range_text(lo, hi)}, got {value}")
  return value


def positive_int(name: str, value, limit: int = INT32_MAX) -> int:
  """An int in 1..limit."""
  return integer(name, value, 1, limit)


def optional_int(name: str, value, lo: int | None = INT32_MIN, hi: int | None = INT32_MAX) -> int | None:
  return None if value is None else integer(name, value, lo, hi)


def real(name: str, value, lo: float | None = None, hi: float | None = None, *,
         lo_open: bool = False, hi_open: bool = False) -> float:
  """value as a finite Python float (ints accepted, bools and strings not) within the bounds.

  lo_open / hi_open exclude the bound itself: real("top_p", x, 0, 1, lo_open=True) is (0, 1].
  """
  if isinstance(value, np.ndarray) and value.ndim == 0:
    value = value[()]
  allowed = ("(" if lo_open else "[") + f"{'-inf' if lo is None else lo}, {'inf' if hi is None else hi}" + (
      ")" if hi_open or hi is None else "]")
  if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
    raise InvalidType(name, f"{name} must be a finite number in {allowed}, got {value!r} "
                            f"({type(value).__name__})")
  value = float(value)
  if (not math.isfinite(value) or (lo is not None and (value < lo or (lo_open and value == lo)))
      or (hi is not None and (value > hi or (hi_open and value == hi)))):
    raise InvalidValue(name, f"{name} must be a finite number in {allowed}, got {value!r}")
  return value


def flag(name: str, value) -> bool:
  """A bool (Python or numpy); 0, 1 and strings such as "false" are refused."""
  if not isinstance(value, (bool, np.bool_)):
    raise InvalidType(name, f"{name} must be a bool, got {value!r} ({type(value).__name__})")
  return bool(value)


def one_of(name: str, value, choices):
  if not isinstance(value, str) or value not in choices:
    raise InvalidValue(name, f"{name} must be one of {tuple(choices)}, got {value!r}")
  return value


def instance(name: str, value, cls, what: str | None = None):
  if not isinstance(value, cls):
    raise InvalidType(name, f"{name} must be {what or 'a ' + cls.__name__}, got {type(value).__name__}")
  return value


def float_dtype(name: str, value) -> jnp.dtype:
  """A floating dtype (name or dtype object): caches, hiddens and weights are never integers."""
  try:
    dtype = jnp.dtype(value)
  except TypeError as e:
    raise InvalidType(name, f"{name} must name a floating dtype such as 'float32', got {value!r}") from e
  if not jnp.issubdtype(dtype, jnp.floating):
    raise InvalidValue(name, f"{name} must be a floating dtype (float32, bfloat16, ...), got {dtype}")
  return dtype


def is_concrete(*xs) -> bool:
  """True when no leaf is a tracer, i.e. values can be checked on the host now."""
  return not any(isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves(xs))


def jit_when_concrete(**jit_kwargs):
  """Decorator: the function runs jitted (`jax.jit(fn, **jit_kwargs)`, one compile per static
  arguments) when every array argument is concrete, as from an eager caller (a notebook, a test,
  a host loop), instead of dispatching op by op; inside a caller's trace it runs as itself (the
  caller's jit compiles it). The jitted form is the wrapper's `.jitted`."""
  def wrap(fn):
    jitted = jax.jit(fn, **jit_kwargs)

    @functools.wraps(fn)
    def call(*args, **kwargs):
      return (jitted if is_concrete(args, kwargs) else fn)(*args, **kwargs)
    call.jitted = jitted
    return call
  return wrap


def _shape_text(shape) -> str:
  return "[" + ", ".join(str(s) for s in shape) + "]"


def array(name: str, x, shape: tuple, *, kind: str, dims: str | None = None):
  """x as a jax or numpy array of `kind` ("int", "float" or "bool") and shape.

  shape: ints, or None for a dimension of any size >= 1. dims: how the message writes the
  expected shape (e.g. "[B=2, T, D=32]"). Concrete int arrays must hold int32 values: an int64
  value beyond int32 is refused, never wrapped.
  """
  if not hasattr(x, "dtype") or not hasattr(x, "shape"):
    try:
      x = np.asarray(x)
    except (ValueError, TypeError) as e:
      raise InvalidType(name, f"{name} must be an array, got {type(x).__name__} ({e})") from e
  want = {"int": jnp.integer, "float": jnp.floating, "bool": jnp.bool_}[kind]
  expected = dims or _shape_text("?" if s is None else s for s in shape)
  dtype = jnp.dtype(x.dtype)
  if not jnp.issubdtype(dtype, want):
    what = {"int": "int32", "float": "float", "bool": "bool"}[kind]
    raise InvalidType(name, f"{name} must be {what}{expected}, got {dtype}{_shape_text(x.shape)}")
  if len(x.shape) != len(shape) or any(
      (s is None and d < 1) or (s is not None and d != s) for s, d in zip(shape, x.shape)):
    what = {"int": "int32", "float": "float", "bool": "bool"}[kind]
    raise InvalidValue(name, f"{name} must be {what}{expected}, got {dtype}{_shape_text(x.shape)}")
  if kind == "int" and dtype.itemsize > 4 and is_concrete(x) and x.size:
    lo, hi = int(np.min(np.asarray(x))), int(np.max(np.asarray(x)))
    if lo < INT32_MIN or hi > INT32_MAX:
      bad = lo if lo < INT32_MIN else hi
      raise InvalidValue(name, f"{name} holds {bad}, outside int32 ({INT32_MIN}..{INT32_MAX})")
  return x


def raise_failed(checks, **values):
  """Eager value checks: raises InvalidValue for the first (ok, argument, message) of `checks` whose
  ok (a bool or a 0-d array) is False; the message ends with `values` (e.g. the lengths it saw)."""
  for ok, argument, message in checks:
    if not bool(ok):
      detail = ", ".join(f"{k}={np.asarray(v).tolist()}" for k, v in values.items())
      raise InvalidValue(argument, f"{message} ({detail})")


def checkify_checks(checks):
  """The same (ok, argument, message) checks on traced values, as `checkify.check`s: the caller
  runs under `checkify.checkify` and gets an error naming the argument's limit."""
  for ok, _, message in checks:
    checkify.check(ok, message)


def finite_logits(name: str, x):
  """Eager: x (float[..., V] logits) holds no NaN and no +inf (-inf, a masked token, is allowed)."""
  bad = np.asarray(jnp.isnan(x) | jnp.isposinf(x))
  if bad.any():
    at = tuple(int(i) for i in np.argwhere(bad)[0])
    raise InvalidValue(name, f"{name} must not hold NaN or +inf (-inf masks a token); found "
                             f"{np.asarray(x)[at]} at index {list(at)}")


PROB_ATOL = 1e-3  # |sum - 1| allowed for a float32 distribution over V tokens


def distributions(name: str, p):
  """Eager: every row p[..., :] (float[..., V]) is a distribution: finite, >= 0, summing to 1
  within PROB_ATOL (float32, float64), or 4 ulps of 1 for coarser dtypes (bfloat16: 0.03)."""
  atol = max(PROB_ATOL, 4 * float(jnp.finfo(p.dtype).eps))
  p = np.asarray(p, np.float32)
  bad = ~np.isfinite(p) | (p < 0)
  if bad.any():
    at = tuple(int(i) for i in np.argwhere(bad)[0])
    raise InvalidValue(name, f"{name} must be finite and >= 0 (probabilities); found {p[at]} at index {list(at)}")
  off = np.abs(p.sum(-1) - 1)
  if off.size and off.max() > atol:
    at = tuple(int(i) for i in np.unravel_index(np.argmax(off), off.shape))
    raise InvalidValue(name, f"{name} rows must sum to 1 (within {atol}); row {list(at)} sums to "
                             f"{float(p[at].sum())}")


def token_ids(name: str, x, vocab_size: int):
  """Eager: the int array x holds token ids in 0..vocab_size-1."""
  x = np.asarray(x)
  if x.size and (x.min() < 0 or x.max() >= vocab_size):
    bad = int(x.min()) if x.min() < 0 else int(x.max())
    raise InvalidValue(name, f"{name} must be in 0..vocab_size-1={vocab_size - 1}, got {bad}")


def sampling(temperature, top_k, top_p):
  """(temperature, top_k, top_p) checked: temperature finite >= 0, top_k >= 1 (>= V keeps every
  token), top_p in (0, 1]."""
  temperature = real("temperature", temperature, 0.0)
  top_k = None if top_k is None else positive_int("top_k", top_k)
  top_p = None if top_p is None else real("top_p", top_p, 0.0, 1.0, lo_open=True)
  return temperature, top_k, top_p


def dataclass_fields(obj, ints=(), positive=(), reals=(), flags=(), strings=()):
  """Checks a config dataclass's fields by name; `reals` maps a field to (lo, hi, lo_open)."""
  cls = type(obj).__name__
  for f in ints:
    integer(f"{cls}.{f}", getattr(obj, f), 0)
  for f in positive:
    positive_int(f"{cls}.{f}", getattr(obj, f))
  for f, (lo, hi, lo_open) in dict(reals).items():
    real(f"{cls}.{f}", getattr(obj, f), lo, hi, lo_open=lo_open)
  for f in flags:
    flag(f"{cls}.{f}", getattr(obj, f))
  for f in strings:
    instance(f"{cls}.{f}", getattr(obj, f), str, "a str")
