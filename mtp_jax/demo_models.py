"""The shipped demo models (mtp_jax/assets/<name>): where they are and loading them.

Kept apart from `mtp_jax.demo` (the speculative-vs-plain comparison, which decodes through
`mtp_jax.serving`) so the server can load a demo model without an import back up into it.
"""

from __future__ import annotations

import dataclasses
import os

from mtp_jax import checkpoint_dir, data, validate
from mtp_jax.mtp import MtpModel
from mtp_jax.target import TargetModel

ASSETS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets")
# small: 0.85M-parameter target, 3.4 MB, cache-resident (compute-bound on a CPU).
# large: a target of about 64 MB in float32 (stored as bfloat16), memory-bound on a CPU.
DEMO_MODELS = ("small", "large")
ASSET_FILES = (checkpoint_dir.TARGET_FILE, checkpoint_dir.MTP_FILE, checkpoint_dir.CONFIG_FILE)


def demo_path(name: str) -> str:
  """The directory of the shipped demo model `name` (one of DEMO_MODELS)."""
  if name not in DEMO_MODELS:
    raise ValueError(f"name must be one of {DEMO_MODELS}, got {name!r}")
  return os.path.join(ASSETS, name)


def has_demo(name: str) -> bool:
  """Whether the package holds every file of demo model `name`."""
  return all(os.path.isfile(os.path.join(demo_path(name), f)) for f in ASSET_FILES)


def default_demo() -> str:
  """The model `mtp-jax demo` / `generate` use: the large one when its files are present."""
  return "large" if has_demo("large") else "small"


def load_demo(path=None, *, name: str = "small",
              max_depth: int | None = None) -> tuple[TargetModel, MtpModel, data.ByteTokenizer]:
  """(target, proposer, tokenizer): the trained byte-level models shipped in mtp_jax/assets/<name>
  (or the checkpoint directory `path`, as written by `mtp_jax.train`). Weights stored as bfloat16
  are computed in the config's dtype (float32). max_depth: drafts the proposer may make (default
  its K modules); depths past K cycle through the modules (`MtpConfig.max_depth`)."""
  if path is None and not has_demo(name):
    raise FileNotFoundError(f"the demo model {name!r} is not in this package ({demo_path(name)} lacks "
                            f"{', '.join(ASSET_FILES)}); see docs/demo.md for how it is made")
  target, proposer = checkpoint_dir.load_checkpoint(demo_path(name) if path is None else path)
  if max_depth is not None:
    max_depth = validate.positive_int("max_depth", max_depth)
    # The config is the only place the depth count lives; the fresh model is ours to change.
    proposer.cfg = dataclasses.replace(proposer.cfg, max_depth=max_depth, depth_reuse="cycle")
  return target, proposer, data.ByteTokenizer()
