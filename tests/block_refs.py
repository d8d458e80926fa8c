"""Helpers for tests/test_blocks.py: torch weights into NNX modules, and the cached-decode driver."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch
from flax import nnx

B, T = 2, 7
# Rows each call adds per sequence: prefill chunks (T > 1), ragged, then single-row decode.
SCHEDULE = ((3, 1), (2, 3), (1, 1), (1, 1), (0, 1))


def randomize(module: torch.nn.Module, seed: int = 0) -> None:
  """Every parameter ~ N(0, 0.2^2) (norm weights around their neutral value), sinks included."""
  g = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in module.named_parameters():
      noise = 0.2 * torch.randn(p.shape, generator=g)
      neutral = name.endswith("norm.weight") and p.detach().abs().sum() > 0  # ones-initialised norms
      p.copy_(noise + (1.0 if neutral else 0.0))


def copy_into(nnx_module: nnx.Module, torch_module: torch.nn.Module) -> None:
  """Copies torch parameters into the NNX module's params of the same dotted names (all must match)."""
  theirs = {k: v.detach().numpy() for k, v in torch_module.state_dict().items()}
  flat = dict(nnx.to_flat_state(nnx.state(nnx_module, nnx.Param)))
  ours = {".".join(str(p) for p in path): path for path in flat}
  assert set(ours) == set(theirs), (sorted(set(ours) ^ set(theirs)))
  for name, path in ours.items():
    assert flat[path].shape == theirs[name].shape, name
    flat[path][...] = jnp.asarray(theirs[name])


def torch_mask(t: int, window: int | None = None) -> torch.Tensor:
  """Additive float32[1, 1, T, T] causal (optionally windowed) mask for eager attention."""
  q, k = torch.arange(t)[:, None], torch.arange(t)[None, :]
  allowed = k <= q
  if window is not None:
    allowed &= k > q - window
  return torch.where(allowed, 0.0, torch.finfo(torch.float32).min)[None, None]


def run_cached(step, cache, x_BxTxD: np.ndarray):
  """Feeds x through `step(x, rows, valid, cache) -> (y, cache)` per SCHEDULE, ragged across rows.

  Returns float32[B, T, D]: each sequence's outputs at its rows, gathered from every call.
  """
  b, t, d = x_BxTxD.shape
  done = np.zeros(b, int)
  out = np.full((b, t, d), np.nan, np.float32)
  step = jax.jit(step)
  for counts in SCHEDULE:
    n = max(1, max(counts))
    rows = done[:, None] + np.arange(n)[None, :]
    valid = np.arange(n)[None, :] < np.asarray(counts)[:, None]
    x = x_BxTxD[np.arange(b)[:, None], np.minimum(rows, t - 1)]
    y, cache = step(jnp.asarray(x), jnp.asarray(rows, jnp.int32), jnp.asarray(valid), cache)
    for bi in range(b):
      out[bi, rows[bi, valid[bi]]] = np.asarray(y)[bi, valid[bi]]
    done += np.asarray(counts)
  assert (done == t).all()
  return out


def full_rows(b: int, t: int):
  return jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)), jnp.ones((b, t), bool)
