"""The device script's models and prompts, shared by its sections: the demo model and random ones
built once, prompts for each, the `generate` call they time, and the greedy comparison that judges
speculative against plain decoding."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import mtp_jax

K = 3  # MTP modules of the random models; the demo models have 3 too
# Relative logit margin (of max(1, |top logit|)) under which two tokens count as tied: float32 allows
# TF32-level matmul rounding (a GPU's default), bfloat16 its 8-bit mantissa over a few layers.
TIE_TOL = {"float32": 1e-3, "bfloat16": 3e-2}


class Models:
  """The models the sections share, built once: the demo model and random ones by (attention, dtype, layers)."""

  def __init__(self, opts: dict):
    self.opts, self._built = opts, {}

  def demo(self):
    if "demo" not in self._built:
      target, proposer, _ = mtp_jax.load_demo(name="large")
      self._built["demo"] = (target, proposer)
    return self._built["demo"]

  def random(self, attention: str, dtype: str, layers: int):
    key = (attention, dtype, layers)
    if key not in self._built:
      common = dict(self.opts["shape"], dtype=dtype, mla=self.opts["mla"] if attention == "MLA" else None)
      self._built[key] = (mtp_jax.init_target(mtp_jax.TargetConfig(num_layers=layers, **common), 0),
                          mtp_jax.init_mtp(mtp_jax.MtpConfig(num_modules=K, **common), 1))
    return self._built[key]

  def timed_random(self):
    """The random GQA model the timing sections run (the run's dtype and layer count)."""
    return self.random("GQA", self.opts["dtype"], self.opts["layers"])

  def tables(self) -> list[tuple[str, tuple]]:
    """(name, (target, proposer)) of the models the generate / engine / paged tables run."""
    rand = (f"random GQA {self.opts['dtype']} x{self.opts['layers']}", self.timed_random())
    return [("demo large float32", self.demo()), rand] if self.opts["demo_tables"] else [rand]


def prompts_for(target, n: int, length: int, seed: int = 0) -> list[list[int]]:
  """n prompts of `length` tokens: held-out text for the byte-level demo models, random ids otherwise."""
  v = target.cfg.vocab_size
  if v == mtp_jax.data.VOCAB_SIZE:
    return mtp_jax.data.heldout_prompts(n, prompt_len=length, seed=seed)
  return np.random.default_rng(seed).integers(0, v, size=(n, length)).tolist()


def round_up(n: int, m: int) -> int:
  return -(-n // m) * m


def gen_max_len(opts: dict) -> int:
  """One max_len for plain and every k (room for k = K), so no cell's caches grow mid-run."""
  return round_up(opts["prompt_len"] + opts["new_tokens"] + K + 1, 64)


def run_generate(models, prompts, k: int, max_new: int, max_len: int, page_size: int | None = None):
  target, proposer = models
  return lambda: mtp_jax.generate(target, proposer if k else None, prompts, max_new, num_drafts=k or None,
                                  max_len=max_len, page_size=page_size)


@jax.jit
def _last_logits(target, tokens_1xL, valid_1xL):
  """float32[1, L, V] logits of a cache-free forward over the valid rows."""
  rows = jnp.arange(tokens_1xL.shape[1], dtype=jnp.int32)[None]
  return target(tokens_1xL, rows, valid_1xL, None)[0]


def compare(target, prompts, plain: list[list[int]], spec: list[list[int]], pad: int, dtype: str):
  """(verdict, tokens equal / all, worst relative margin or None): "equal", "near-tie" when every
  sequence's first differing token is within TIE_TOL of plain's under the plain target's logits
  (a cache-free forward over the prompt and plain's tokens before it), else "DIFFERS"."""
  equal = sum(int(a == b) for p, s in zip(plain, spec) for a, b in zip(p, s))
  total = sum(len(p) for p in plain)
  worst = None
  for prompt, p, s in zip(prompts, plain, spec):
    at = next((i for i, (a, b) in enumerate(zip(p, s)) if a != b), None)
    if at is None:
      continue
    prefix = list(prompt) + p[:at]
    tokens = np.zeros((1, pad), np.int32)
    tokens[0, :len(prefix)] = prefix
    logits = np.asarray(_last_logits(target, jnp.asarray(tokens), jnp.arange(pad)[None] < len(prefix)))
    row = logits[0, len(prefix) - 1]
    margin = float(row[p[at]] - row[s[at]]) / max(1.0, float(np.abs(row).max()))
    worst = margin if worst is None else max(worst, margin)
  if worst is None and len(plain) == len(spec) and all(len(a) == len(b) for a, b in zip(plain, spec)):
    return "equal", equal / total, None
  return ("near-tie" if worst is not None and worst <= TIE_TOL[dtype] else "DIFFERS"), equal / total, worst
