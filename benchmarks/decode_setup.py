"""What the benchmarks share: the sizes, the warm decode step that every variant in `variants.py`
runs from, and the line naming the machine.

A decode step is the call a serving loop makes after each verification: the chain catches up on
the a + 1 newly verified positions (a accepted drafts, ragged over the batch) and drafts k tokens,
with hiddens/tokens padded to T = k + 1.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import platform
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

try:
  import mtp_jax
except ImportError:  # run as `python benchmarks/x.py` from a checkout that is not pip-installed
  sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
  import mtp_jax
from mtp_jax.proposer import ProposerState

K = 3
MAX_LEN = 512
PROMPT_T = 64
SIZES = {
    # demo-like: the byte vocabulary of mtp_jax.data
    "D=256": dict(vocab_size=258, hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=64,
                  intermediate_size=704),
    # weights dominate: 160.5 MB of module weights + a 16.8 MB LM head (float32)
    "D=1024": dict(vocab_size=4096, hidden_size=1024, num_heads=8, num_kv_heads=2, head_dim=128,
                   intermediate_size=2816),
    # for the --quick smoke run
    "D=64": dict(vocab_size=258, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
                 intermediate_size=128),
}


def config(size: str, dtype: str = "float32") -> mtp_jax.MtpConfig:
  # The historical variants chain the pre-norm hidden; the library is compared on the same wiring.
  return mtp_jax.MtpConfig(num_modules=K, dtype=dtype, pass_normed_hidden=False, **SIZES[size])


def check_plain(cfg):
  if cfg.pass_normed_hidden:
    raise ValueError("the benchmark variants implement pass_normed_hidden=False only")


@dataclasses.dataclass
class Step:
  """One decode step: propose(params, state, hiddens, tokens, num_new, num_drafts=k)."""

  params: mtp_jax.MtpModel
  state: ProposerState
  hiddens: jax.Array  # float32[B, k + 1, D]
  tokens: jax.Array   # int32[B, k + 1]
  num_new: jax.Array  # int32[B], a + 1
  k: int


def warm_step(params: mtp_jax.MtpModel, batch_size: int, k: int, *, seed: int = 0,
              max_len: int = MAX_LEN) -> Step:
  """A prompt call of 32..64 positions per sequence, a verification accepting 0..k drafts, and
  the inputs of the decode step that follows. The prompt call drafts K tokens whatever k is, so
  one compile of it serves every k."""
  cfg = params.cfg
  b, d, v = batch_size, cfg.hidden_size, cfg.vocab_size
  rng = np.random.default_rng(seed)
  state = mtp_jax.init_state(cfg, b, max_len)
  lens = rng.integers(PROMPT_T // 2, PROMPT_T + 1, size=b).astype(np.int32)
  hid = rng.normal(size=(b, PROMPT_T, d)).astype(np.float32)
  toks = rng.integers(0, v, size=(b, PROMPT_T)).astype(np.int32)
  _, state = mtp_jax.propose(params, state, hid, toks, lens, num_drafts=K)
  accepted = rng.integers(0, k + 1, size=b).astype(np.int32)
  state = mtp_jax.after_verify(state, accepted)
  return Step(params, state, jnp.asarray(rng.normal(size=(b, k + 1, d)).astype(np.float32)),
              jnp.asarray(rng.integers(0, v, size=(b, k + 1)).astype(np.int32)),
              jnp.asarray(accepted + 1), k)


def copy_tree(tree):
  return jax.block_until_ready(jax.tree.map(jnp.copy, tree))


@functools.cache
def donated_propose(num_drafts: int):
  """`mtp_jax.propose` under jit with the state donated; one function per k, so runs share compiles."""
  return jax.jit(lambda p, s, h, t, n: mtp_jax.propose(p, s, h, t, n, num_drafts=num_drafts), donate_argnums=1)


def torch_available() -> bool:
  try:
    import torch  # noqa: F401
  except ImportError:
    return False
  return True


def machine(with_torch: bool = True) -> str:
  """One line naming the processor, the jax device, torch (optionally) and the load average."""
  cpu = platform.processor() or platform.machine()
  try:
    with open("/proc/cpuinfo") as f:
      cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
  except (OSError, StopIteration):
    pass
  torch_info = ""
  if with_torch and torch_available():
    import torch
    torch_info = f"torch {torch.__version__} ({torch.get_num_threads()} threads); "
  dev = jax.devices()[0]
  return (f"{cpu}, {os.cpu_count()} cores; jax {jax.__version__} on {dev.platform} ({dev.device_kind}); "
          f"{torch_info}load average {os.getloadavg()[0]:.1f}")
