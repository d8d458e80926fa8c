"""The serving step's combinations: chain or tree x every verification rule x dense or paged caches x
GQA or MLA x generate or the Engine (x a mesh, in a 4-device child process), each checked against
plain greedy decoding without a proposer; sampled output under paging checked by chi-square."""

import functools
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

import mtp_jax
from mtp_jax import serving, sharding
from mtp_jax.tree import TreeSpec

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from test_generate import _exact_joint  # noqa: E402
from test_grammar_generate import EOS, G, MAX_NEW, PROMPTS as GPROMPTS, PROPOSER as GP, TARGET as GT  # noqa: E402
from test_verify import _chi2_pvalue  # noqa: E402

K = 3
PROMPTS = [[1, 2, 3], [4, 0, 1, 2, 3, 4, 0, 1], [3], [2, 2]]
NEW = 20
TREE = TreeSpec((2, 2, 1))


def _models(v: int, mla: bool, seed: int = 0):
  common = dict(vocab_size=v, hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=64)
  if mla:
    common["mla"] = mtp_jax.MlaConfig(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)
  target = mtp_jax.init_target(mtp_jax.TargetConfig(num_layers=2, **common), seed)
  proposer = mtp_jax.init_mtp(mtp_jax.MtpConfig(num_modules=K, **common), seed + 1)
  return target, proposer


@functools.cache
def models(attention: str):
  # Seeds whose random drafts are accepted now and then, so the comparisons cover accepted drafts.
  return _models(5, attention == "mla", seed=3 if attention == "mla" else 0)


@functools.cache
def plain(attention: str) -> tuple[list[list[int]], int]:
  """Plain greedy tokens of PROMPTS, cut at an eos that ends some sequence early (never at its first
  token: the one that occurs latest), and that eos."""
  target, _ = models(attention)
  full = mtp_jax.generate(target, None, PROMPTS, NEW).tokens
  first = {t: min(seq.index(t) for seq in full if t in seq) for t in range(5) if any(t in seq for seq in full)}
  eos = max(first, key=first.get)
  return mtp_jax.generate(target, None, PROMPTS, NEW, eos_token_id=eos).tokens, eos


DRAFTERS = {"chain": {}, "tree": dict(tree=TREE)}
CACHES = {"dense": {}, "paged": dict(page_size=4)}
# Relaxed acceptance with top_n = 1, delta = 0 accepts exactly the argmax: greedy output, through the relaxed rule.
VERIFIERS = {"greedy": {}, "relaxed": dict(relaxed=(1, 0.0))}


@pytest.mark.parametrize("attention", ["gqa", "mla"])
@pytest.mark.parametrize("caches", list(CACHES))
@pytest.mark.parametrize("drafter", list(DRAFTERS))
def test_generate_combination_equals_plain(drafter, caches, attention):
  target, proposer = models(attention)
  want, eos = plain(attention)
  out = mtp_jax.generate(target, proposer, PROMPTS, NEW, eos_token_id=eos, **DRAFTERS[drafter], **CACHES[caches])
  assert out.tokens == want
  assert out.stats["accepted_tokens"] > 0 and out.stats["out_of_pages"] == []


# Chain x dense relaxed (with a grammar): tests/test_grammar_generate.py; the rest here.
@pytest.mark.parametrize("drafter, caches", [("tree", "dense"), ("tree", "paged"), ("chain", "paged")])
def test_relaxed_combination_equals_plain(drafter, caches):
  target, proposer = models("gqa")
  want, eos = plain("gqa")
  out = mtp_jax.generate(target, proposer, PROMPTS, NEW, eos_token_id=eos, **DRAFTERS[drafter], **CACHES[caches],
                         **VERIFIERS["relaxed"])
  assert out.tokens == want and out.stats["accepted_tokens"] > 0


def test_tree_relaxed_accepts_at_least_the_greedy_tree():
  """A looser relaxed rule (lossy) accepts at least as much per step as exact greedy on the same tree."""
  target, proposer = models("gqa")
  exact = mtp_jax.generate(target, proposer, PROMPTS, NEW, tree=TREE).stats["mean_accepted_length"]
  loose = mtp_jax.generate(target, proposer, PROMPTS, NEW, tree=TREE, relaxed=(3, 0.5)).stats
  assert loose["mean_accepted_length"] >= exact and loose["accepted_tokens"] > 0


# Grammars with dense caches: test_grammar_generate (chain) and test_tree (tree).
@pytest.mark.parametrize("drafter, caches", [("tree", "paged"), ("chain", "paged")])
def test_grammar_combination_equals_constrained_plain(drafter, caches):
  base = mtp_jax.generate(GT, None, GPROMPTS, MAX_NEW, eos_token_id=EOS, grammar=G)
  out = mtp_jax.generate(GT, GP, GPROMPTS, MAX_NEW, eos_token_id=EOS, grammar=G, **DRAFTERS[drafter],
                         **CACHES[caches])
  assert out.tokens == base.tokens


# A chain Engine over GQA: tests/test_engine.py.
@pytest.mark.parametrize("drafter, attention", [("tree", "gqa"), ("tree", "mla"), ("chain", "mla")])
def test_engine_combination_equals_plain(drafter, attention):
  """Requests admitted while others run, in an Engine drafting chains or trees: each equals plain
  greedy decoding of its prompt (cut at the same eos)."""
  target, proposer = models(attention)
  want, eos = plain(attention)
  engine = mtp_jax.Engine(target, proposer, max_batch=2, max_len=64, page_size=4, eos_token_id=eos,
                          **DRAFTERS[drafter])
  ids = [engine.add_request(PROMPTS[0], NEW)]
  engine.step()
  ids += [engine.add_request(p, NEW) for p in PROMPTS[1:]]
  out = engine.run()
  assert [out[i] for i in ids] == want
  assert engine.free_pages() == engine.num_pages


@pytest.mark.slow
@pytest.mark.parametrize("drafter", list(DRAFTERS))
def test_paged_sampling_matches_target_distribution(drafter):
  """Sampled output with paged caches, chain and tree: 3 tokens over 3 token ids follow the target's joint."""
  v, n, copies = 3, 3, 2000
  target, proposer = _models(v, mla=False, seed=2)
  prompt = [0, 1, 2, 1]
  exact = _exact_joint(target, prompt, v, n)
  keys = sorted(exact)
  kwargs = dict(tree=TreeSpec((2, 2))) if drafter == "tree" else dict(num_drafts=2)
  out = mtp_jax.generate(target, proposer, [prompt] * copies, n, temperature=1.0, seed=0, page_size=8, **kwargs)
  counts = {}
  for toks in out.tokens:
    counts[tuple(toks)] = counts.get(tuple(toks), 0) + 1
  assert _chi2_pvalue(np.array([counts.get(c, 0) for c in keys]), np.array([exact[c] for c in keys])) > 1e-3


def test_decode_step_picks_its_parts_once():
  st = serving.StepSettings(num_drafts=3, max_new_tokens=8, max_len=64)
  parts = serving.parts
  picks = {
      "plain": (dict(num_drafts=0), parts.VerifyPlain(False)),
      "greedy": ({}, parts.VerifyChain(False, "gumbel")),
      "gumbel": (dict(sampled=True), parts.VerifyChain(True, "gumbel")),
      "rejection": (dict(sampled=True, acceptance="rejection"), parts.VerifyChain(True, "rejection")),
      "relaxed": (dict(relaxed=serving.Relaxed(2, 0.1)), parts.VerifyRelaxed(2, 0.1)),
      "tree": (dict(tree=TREE), parts.VerifyTree(TREE, False, "gumbel")),
      "tree_rejection": (dict(tree=TREE, sampled=True, acceptance="rejection"),
                         parts.VerifyTree(TREE, True, "rejection")),
      "tree_relaxed": (dict(tree=TREE, relaxed=serving.Relaxed(2, 0.1)), parts.VerifyTreeRelaxed(TREE, 2, 0.1)),
  }
  for name, (changes, want) in picks.items():
    step = serving.DecodeStep(st).replace(**changes)
    assert step.verifier == want, name
    assert (step.drafter is None) == (name == "plain")
  assert hash(serving.DecodeStep(st)) == hash(serving.DecodeStep(st))  # a static jit argument
  with pytest.raises(ValueError, match="relaxed acceptance is a greedy option"):
    serving.StepSettings(num_drafts=3, max_new_tokens=8, max_len=64, sampled=True, relaxed=serving.Relaxed(2, 0.1))
  with pytest.raises(ValueError, match="acceptance must be one of"):
    serving.StepSettings(num_drafts=3, max_new_tokens=8, max_len=64, acceptance="best")


# --- on a mesh: 4 host CPU devices in a child process ------------------------------------------

def _mesh_child() -> dict:
  target, proposer = models("gqa")
  want, eos = plain("gqa")
  mesh = sharding.make_mesh(2, 2)
  t, p = sharding.shard_params(target, mesh), sharding.shard_params(proposer, mesh)
  runs = {name: mtp_jax.generate(t, p, PROMPTS, NEW, eos_token_id=eos, mesh=mesh, **kwargs).tokens
          for name, kwargs in [("paged", dict(page_size=4)), ("tree_paged", dict(tree=TREE, page_size=4))]}
  engine = mtp_jax.Engine(t, p, max_batch=4, max_len=64, page_size=4, eos_token_id=eos, mesh=mesh, tree=TREE)
  ids = [engine.add_request(q, NEW) for q in PROMPTS]
  out = engine.run()
  runs["engine_tree"] = [out[i] for i in ids]
  return {"want": want, "runs": runs}


@pytest.mark.slow
def test_mesh_combinations_equal_plain():
  flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
  env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu",
             PYTHONPATH=os.pathsep.join([str(ROOT)] + [q for q in [os.environ.get("PYTHONPATH")] if q]))
  r = subprocess.run([sys.executable, __file__, "mesh"], env=env, capture_output=True, text=True, timeout=900)
  assert r.returncode == 0, f"child failed:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
  result = json.loads(r.stdout.strip().splitlines()[-1])
  for name, tokens in result["runs"].items():
    assert tokens == result["want"], name


if __name__ == "__main__":
  print(json.dumps({"mesh": _mesh_child}[sys.argv[1]]()))
