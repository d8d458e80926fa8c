"""Mean accepted length of JSON-constrained speculative decoding, with and without per-position
draft masks.

    python examples/grammar_acceptance.py                   # the shipped demo models
    python examples/grammar_acceptance.py --checkpoint DIR  # a checkpoint written by mtp_jax.train
    python examples/grammar_acceptance.py --random          # random models of the demo's sizes

A quickly trained checkpoint (about a minute on two CPU cores):

    mtp-jax train --out /tmp/ckpt --steps 400 --warmup-steps 40 --hidden-size 64 --num-layers 2 \
      --intermediate-size 192 --seq-len 128
    python examples/grammar_acceptance.py --checkpoint /tmp/ckpt

Held-out code prompts, each followed by "\\nconfig = ", are continued under a JSON schema (an
object with a name, a version, a flag and up to three tags) by greedy speculative decoding in
three draft-mask modes (`generate(..., draft_masks=...)`):

  per_position  draft i masked with the grammar state after drafts 1..i-1 (mtp_jax's default)
  first         every draft masked with the state after the emitted tokens (the seed proposer)
  none          drafts unmasked

Verification masks each of the k + 1 positions with its own state in all three modes, so every
output is the same constrained greedy text (the "same" column checks it against constrained
decoding without a proposer); only the number of accepted drafts changes. Without the demo
models (mtp_jax/assets/small) the script falls back to random models and says so: their figures show
what the grammar alone makes predictable (forced punctuation and keys), not a trained model's.
"""

from __future__ import annotations

import argparse
import json

import mtp_jax
from mtp_jax import data, grammar
from mtp_jax.serving.options import DRAFT_MASKS

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "version": {"type": "integer", "maxDigits": 3},
        "enabled": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
    },
    "required": ["name", "version", "enabled", "tags"],
}
PROMPT_TAIL = b"\nconfig = "


def load_models(args):
  """(target, proposer, description of where they came from)."""
  if args.checkpoint:
    from mtp_jax.train import load_checkpoint
    target, proposer = load_checkpoint(args.checkpoint)
    return target, proposer, f"checkpoint {args.checkpoint}"
  if not args.random:
    try:
      from mtp_jax.demo import load_demo
      target, proposer, _ = load_demo()
      return target, proposer, "the shipped demo models (mtp_jax.demo.load_demo)"
    except (ImportError, OSError) as e:
      print(f"no shipped demo models ({type(e).__name__}: {e}); using random models")
  block = dict(vocab_size=data.VOCAB_SIZE, hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=32,
               intermediate_size=384)
  target = mtp_jax.init_target(mtp_jax.TargetConfig(num_layers=4, **block), args.seed)
  proposer = mtp_jax.init_mtp(mtp_jax.MtpConfig(num_modules=3, **block), args.seed + 1)
  return target, proposer, f"random models (seed {args.seed}), the demo's sizes"


def finished_json(tokens) -> bool:
  """The output ended with EOS and its text is a JSON object with the schema's keys."""
  if not tokens or tokens[-1] != data.EOS_ID:
    return False
  obj = json.loads(bytes(tokens[:-1]).decode())
  return set(obj) == set(SCHEMA["required"])


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--checkpoint", help="a checkpoint directory written by mtp_jax.train")
  parser.add_argument("--random", action="store_true", help="random models instead of the demo's")
  parser.add_argument("--num-prompts", type=int, default=8)
  parser.add_argument("--prompt-len", type=int, default=64)
  parser.add_argument("--max-new-tokens", type=int, default=160)
  parser.add_argument("--ks", type=int, nargs="+", help="numbers of drafts (default: K)")
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args()

  target, proposer, source = load_models(args)
  g = grammar.from_json_schema(SCHEMA, grammar.byte_vocab(), eos_token_id=data.EOS_ID)
  prompts = [p + list(PROMPT_TAIL)
             for p in data.heldout_prompts(args.num_prompts, prompt_len=args.prompt_len, seed=args.seed)]
  plain = mtp_jax.generate(target, None, prompts, args.max_new_tokens, eos_token_id=data.EOS_ID, grammar=g)
  done = sum(finished_json(t) for t in plain.tokens)
  print(f"models: {source}")
  print(f"{len(prompts)} held-out prompts of {args.prompt_len} bytes + {PROMPT_TAIL!r}, greedy, "
        f"<= {args.max_new_tokens} new tokens; {done}/{len(prompts)} outputs are finished JSON objects, "
        f"{plain.stats['generated_tokens']} tokens in all")
  print(f"first output: {bytes(t for t in plain.tokens[0] if t < 256).decode(errors='replace')}")
  print()
  print("| k | draft masks | mean accepted length | acceptance per draft position | same |")
  print("|---|---|---|---|---|")
  for k in args.ks or [proposer.cfg.num_modules]:
    for mode in DRAFT_MASKS:
      out = mtp_jax.generate(target, proposer, prompts, args.max_new_tokens, num_drafts=k,
                             eos_token_id=data.EOS_ID, grammar=g, draft_masks=mode)
      rates = " ".join(f"{r:.3f}" for r in out.stats["acceptance_per_position"])
      same = "yes" if out.tokens == plain.tokens else "NO"
      print(f"| {k} | {mode} | {out.stats['mean_accepted_length']:.3f} | {rates} | {same} |")


if __name__ == "__main__":
  main()
