"""`mtp-jax` (or `python -m mtp_jax.cli`): demo, generate, serve, train."""

from __future__ import annotations

import argparse
import codecs
import dataclasses
import sys

from mtp_jax import demo, demo_models, grammar, pretrained, train, validate
from mtp_jax.serving import generate
from mtp_jax.serving.options import ACCEPTANCES
from mtp_jax.tree import TreeSpec, check_tree

DEFAULT_DRAFTS = 3


def _drafts_arg(text: str) -> int | str:
  return text if text == "auto" else int(text)


def _model_name(args) -> str:
  return "small" if args.small else demo_models.default_demo()


def _tree(text: str) -> TreeSpec:
  """`--tree 3,2,1` as a TreeSpec; argparse reports the error in one line."""
  try:
    return TreeSpec(tuple(int(w) for w in text.split(",")))
  except (ValueError, TypeError) as e:
    raise argparse.ArgumentTypeError(f"widths like 3,2,1 (children per node at each depth): {e}") from e


def _acceptance_flag(p) -> None:
  p.add_argument("--acceptance", choices=ACCEPTANCES, default="gumbel",
                 help="how sampled drafts are verified: gumbel (a seed gives plain sampling's tokens, whatever the "
                      "drafts) or rejection (lossless rejection sampling; tokens follow the draft count)")


def _eos(text: str) -> int | str:
  """`--eos ID` as an int, or "none"."""
  if text == "none":
    return text
  try:
    return int(text)
  except ValueError as e:
    raise argparse.ArgumentTypeError(f"a token id or none, got {text!r}") from e


def _schema_text(value: str) -> str:
  """`--json-schema`: the schema's JSON text, or @FILE for a file that holds it."""
  if not value.startswith("@"):
    return value
  try:
    with open(value[1:], encoding="utf-8") as f:
      return f.read()
  except (OSError, UnicodeDecodeError) as e:
    raise validate.InvalidValue("--json-schema", f"--json-schema {value}: cannot read {value[1:]!r}: {e}") from e


def _demo(args) -> int:
  return demo.main(num_prompts=args.num_prompts, prompt_len=args.prompt_len, max_new_tokens=args.max_new_tokens,
                   seed=args.seed, repeats=args.repeats, ks=args.ks, name=_model_name(args), path=args.checkpoint,
                   trees=args.tree, max_depth=args.max_depth)


def _byte_text():
  """(new ids -> text, flush -> text) for the demo's byte tokenizer."""
  # A multi-byte character may arrive split across steps: the incremental decoder holds the head.
  decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
  return lambda ids: decoder.decode(bytes(t for t in ids if t < 256)), lambda: decoder.decode(b"", final=True)


def _tokenizer_text(tok):
  """(new ids -> text, flush -> text) for a `tokenizers.Tokenizer`: each step gives what decoding the
  whole continuation adds, as tokens may merge with their neighbours when decoded."""
  ids, shown = [], [""]

  def text(new_ids):
    ids.extend(new_ids)
    full = tok.decode(ids)
    if full.endswith("\ufffd"):  # an incomplete multi-byte character: wait for the rest
      return ""
    out, shown[0] = full[len(shown[0]):], full
    return out
  return text, lambda: ""


def _generate(args) -> int:
  num_drafts = args.num_drafts
  if num_drafts is None:
    num_drafts = DEFAULT_DRAFTS if args.tree is None else args.tree.depth
  if args.model:
    if args.checkpoint is not None or args.small:
      raise validate.InvalidValue("--model", "--model names the model; drop --checkpoint / --small")
    if args.regex is not None or args.json_schema is not None:
      raise validate.InvalidValue("--regex" if args.regex is not None else "--json-schema",
                                  "--regex / --json-schema need the token byte strings of the vocabulary, which "
                                  "are read for the demo models' byte tokenizer only (not yet from tokenizer.json)")
    max_depth = args.max_depth if args.max_depth is not None else max(num_drafts, 1)
    target, proposer, config = pretrained.from_pretrained(args.model, dtype=args.dtype, max_depth=max_depth)
    tok = pretrained.load_tokenizer(args.model)
    prompt = tok.encode(args.prompt).ids
    eos = config.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) else eos
    vocab = None
    text, flush = _tokenizer_text(tok)
  else:
    if args.dtype is not None:
      raise validate.InvalidValue("--dtype", "--dtype applies to --model weights only")
    target, proposer, tok = demo_models.load_demo(args.checkpoint, name=_model_name(args), max_depth=args.max_depth)
    # Training windows carry no BOS, so neither does the prompt.
    prompt = tok.encode(args.prompt, bos=False)
    eos = tok.eos_id
    vocab = grammar.byte_vocab()
    text, flush = _byte_text()
  if args.num_drafts is None and args.tree is not None:
    check_tree(args.tree, max_depth=proposer.cfg.num_depths, argument="--tree")
  num_drafts = validate.integer("--num-drafts", num_drafts, 0, proposer.cfg.num_depths)
  if not prompt:
    raise validate.InvalidValue("--prompt", "--prompt must not be empty")
  if args.eos is not None:
    eos = None if args.eos == "none" else args.eos
  constraint = None
  if args.regex is not None or args.json_schema is not None:
    if eos is None:
      raise validate.InvalidValue("--eos", "--regex / --json-schema end the text with EOS: drop --eos none")
    eos = validate.integer("--eos", eos, 0, target.cfg.vocab_size - 1)
    if args.regex is not None:
      constraint = grammar.from_regex(args.regex, vocab, eos_token_id=eos)
    else:
      constraint = grammar.from_json_schema(_schema_text(args.json_schema), vocab, eos_token_id=eos)

  started = []

  def stream(new_tokens):
    if not started:  # the first call comes after generate has checked its arguments
      sys.stdout.write(args.prompt)
      started.append(True)
    sys.stdout.write(text(new_tokens[0]))
    sys.stdout.flush()

  out = generate(target, proposer if num_drafts > 0 else None, [prompt], args.max_new_tokens,
                 num_drafts=num_drafts or None, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                 seed=args.seed, eos_token_id=eos, stream=stream, grammar=constraint, tree=args.tree,
                 acceptance=args.acceptance)
  sys.stdout.write(flush() + "\n")
  print(f"[{out.stats['generated_tokens']} tokens, {out.stats['target_calls']} target calls, "
        f"mean accepted length {out.stats['mean_accepted_length']:.2f}]", file=sys.stderr)
  return 0


def _serve(args) -> int:
  try:
    from mtp_jax.serving import server
    from mtp_jax.serving.model import load_model
  except ImportError as e:
    if e.name not in ("starlette", "uvicorn", "jinja2"):
      raise
    raise validate.InvalidValue("serve", f"mtp-jax serve needs the serve extra (pip install 'mtp_jax[serve]'): "
                                         f"{e.name} is not installed") from e
  from mtp_jax.serving.engine import Engine
  if args.model is not None and (args.checkpoint is not None or args.large):
    raise validate.InvalidValue("--model", "--model names the model; drop --checkpoint / --large")
  if args.model is None and args.dtype is not None:
    raise validate.InvalidValue("--dtype", "--dtype applies to --model weights only")
  template = None
  if args.chat_template is not None:
    try:
      with open(args.chat_template, encoding="utf-8") as f:
        template = f.read()
    except (OSError, UnicodeDecodeError) as e:
      raise validate.InvalidValue("--chat-template", f"--chat-template: cannot read {args.chat_template!r}: {e}") from e
  num_drafts = args.num_drafts
  if num_drafts is None:
    num_drafts = "auto" if args.tree is None else args.tree.depth
  model = load_model(args.model, demo_name="large" if args.large else "small", checkpoint=args.checkpoint,
                     dtype=args.dtype, max_depth=args.max_depth, chat_template=template)
  if num_drafts != "auto":
    num_drafts = validate.integer("--num-drafts", num_drafts, 0, model.proposer.cfg.num_depths)
  if args.eos is not None:
    model = dataclasses.replace(model, eos_token_id=None if args.eos == "none" else args.eos)
  engine = Engine(model.target, model.proposer if num_drafts else None, max_batch=args.max_batch,
                  max_len=args.max_len, page_size=args.page_size, num_pages=args.num_pages,
                  num_drafts=num_drafts or None, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                  eos_token_id=model.eos_token_id, seed=args.seed, tree=args.tree, max_waiting=args.max_waiting,
                  steps_per_call=args.steps_per_call, prefill_chunk=args.prefill_chunk, acceptance=args.acceptance)
  if args.calibrate or args.draft_policy is not None:
    from mtp_jax.serving.calibrate import measured_policy
    measured_policy(engine, args.draft_policy)
  return server.serve(engine, model, host=args.host, port=args.port, warmup=not args.no_warmup,
                      shutdown_timeout=args.shutdown_timeout, log_level=args.log_level)


SMALL_HELP = "the small shipped model (default: the large one when the package holds it)"

_TRAIN_FLAGS = {  # flag -> TrainConfig field
    "recipe": "recipe", "steps": "steps", "batch_size": "batch_size", "seq_len": "seq_len",
    "lr": "learning_rate", "warmup_steps": "warmup_steps", "weight_decay": "weight_decay",
    "mtp_weight": "mtp_weight", "stop_gradient": "stop_gradient", "eval_every": "eval_every",
    "save_every": "save_every", "seed": "seed",
}
_MODEL_FLAGS = {  # flag -> help; model_configs arguments
    "hidden_size": "model width D", "num_layers": "target decoder layers",
    "num_heads": "attention heads (must divide --hidden-size)", "num_kv_heads": "key / value heads (must divide "
    "--num-heads)", "intermediate_size": "MLP hidden width", "num_modules": "MTP modules K",
}
_TRAIN_HELP = {
    "steps": "optimizer steps", "batch_size": "windows per step", "seq_len": "bytes per training window",
    "lr": "peak learning rate (linear warmup, then cosine decay)", "warmup_steps": "linear warmup steps, < --steps",
    "weight_decay": "AdamW weight decay", "mtp_weight": "weight of the MTP modules' loss (DeepSeek-V3's lambda)",
    "eval_every": "steps between held-out evaluations", "save_every": "steps between checkpoints",
    "seed": "initialisation and data order seed",
}


def _train(args) -> int:
  given = {field: getattr(args, flag) for flag, field in _TRAIN_FLAGS.items() if getattr(args, flag) is not None}
  model_given = {flag: getattr(args, flag) for flag in _MODEL_FLAGS if getattr(args, flag) is not None}
  target_cfg = mtp_cfg = None
  if args.resume:
    if model_given:
      raise validate.InvalidValue("--resume", "--resume takes the model sizes from the checkpoint; "
                                              f"drop {sorted(model_given)}")
    saved = train.read_config(args.resume)["train"] or train.TrainConfig()
    cfg = dataclasses.replace(saved, **given)
  else:
    if args.preset is not None:
      preset_model, preset_train = train.PRESETS[args.preset]
      given = {**preset_train, **given}
      model_given = {**preset_model, **model_given}
    cfg = train.TrainConfig(**given)
    if cfg.recipe == "mimo":
      if args.init_from is None:
        raise validate.InvalidValue("--init-from", "--recipe mimo needs --init-from CHECKPOINT")
      extra = set(model_given) - {"num_modules"}
      if extra:
        raise validate.InvalidValue("--recipe", "--recipe mimo keeps the checkpoint's sizes; only --num-modules "
                                                f"may change, got {sorted(extra)}")
      mtp_cfg = train.read_config(args.init_from)["mtp"]
      mtp_cfg = dataclasses.replace(mtp_cfg, num_modules=model_given.get("num_modules", mtp_cfg.num_modules))
    else:
      target_cfg, mtp_cfg = train.model_configs(**model_given)
  out_dir = args.out or args.resume
  result = train.train(cfg, target_cfg, mtp_cfg, out_dir=out_dir, resume_from=args.resume, init_from=args.init_from,
                       stop_at=args.stop_at, overwrite=args.overwrite)
  last = result.history[-1] if result.history else None
  if last is not None:
    print("held-out top-1 accuracy (depth 0..K): " + " ".join(f"{a:.3f}" for a in last["accuracy"]))
  print(f"checkpoint: {out_dir}")
  return 0


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="mtp-jax", description=__doc__)
  sub = parser.add_subparsers(dest="command", required=True)

  p = sub.add_parser("demo", help="speculative vs plain greedy decoding with the shipped models")
  p.add_argument("--num-prompts", type=int, default=8, help="held-out prompts to decode")
  p.add_argument("--prompt-len", type=int, default=64, help="bytes per held-out prompt")
  p.add_argument("--max-new-tokens", type=int, default=128, help="tokens generated per prompt")
  p.add_argument("--seed", type=int, default=0, help="which held-out prompts")
  p.add_argument("--repeats", type=int, default=3, help="timed passes, taken in turns; the median counts")
  p.add_argument("--ks", type=int, nargs="+", default=None, help="numbers of drafts to compare (default 1..K)")
  p.add_argument("--tree", type=_tree, action="append", default=None, metavar="W1,W2,..",
                 help="also a draft tree, e.g. 3,2,1: top-3 children of the root, top-2 of each of those, ... "
                      "(repeatable)")
  p.add_argument("--max-depth", type=int, default=None, metavar="N",
                 help="let --ks and --tree draft N deep, depths past the K modules cycling through them")
  p.add_argument("--checkpoint", default=None, help="a training checkpoint directory instead of the shipped one")
  p.add_argument("--small", action="store_true", help=SMALL_HELP)
  p.set_defaults(func=_demo)

  p = sub.add_parser("generate", help="stream a continuation of one prompt")
  p.add_argument("--prompt", required=True, help="the text to continue (printed first, then the continuation)")
  p.add_argument("--max-new-tokens", type=int, default=200, help="tokens to generate at most (fewer at EOS)")
  p.add_argument("--num-drafts", type=int, default=None,
                 help=f"k drafts per step (default {DEFAULT_DRAFTS}, or the --tree's depth); 0 decodes without "
                      "the MTP modules")
  p.add_argument("--temperature", type=float, default=0.0,
                 help="sampling temperature; 0 decodes greedily (speculative sampling stays lossless)")
  p.add_argument("--top-k", type=int, default=None, metavar="K",
                 help="with --temperature > 0: sample from the K most likely tokens only")
  p.add_argument("--top-p", type=float, default=None, metavar="P",
                 help="with --temperature > 0: sample from the most likely tokens whose probability reaches P "
                      "(0 < P <= 1)")
  p.add_argument("--seed", type=int, default=0, help="random seed of the sampler (0..2**32-1)")
  _acceptance_flag(p)
  p.add_argument("--eos", type=_eos, default=None, metavar="ID",
                 help="token id that ends the continuation (default the model's EOS); none: never stop early")
  constraint = p.add_mutually_exclusive_group()
  constraint.add_argument("--regex", default=None, metavar="PATTERN",
                          help="constrain the continuation to text that fully matches PATTERN (Rust regex syntax)")
  constraint.add_argument("--json-schema", default=None, metavar="SCHEMA",
                          help="constrain the continuation to JSON valid under SCHEMA: its JSON text, or @FILE")
  p.add_argument("--tree", type=_tree, default=None, metavar="W1,W2,..",
                 help="draft a tree instead of a chain, e.g. 3,2,1: top-3 children of the root, top-2 of each "
                      "of those, ...")
  p.add_argument("--max-depth", type=int, default=None, metavar="N",
                 help="let the proposer draft N deep, depths past its K modules cycling through them")
  p.add_argument("--checkpoint", default=None, help="a training checkpoint directory instead of the shipped model")
  p.add_argument("--small", action="store_true", help=SMALL_HELP)
  p.add_argument("--model", default=None,
                 help="a released model directory (config.json, safetensors, tokenizer.json); see docs/checkpoints.md")
  p.add_argument("--dtype", default=None, help="with --model: weights dtype (default the checkpoint's)")
  p.set_defaults(func=_generate)

  p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (needs the serve extra)",
                     description="Serves /v1/completions, /v1/chat/completions (models with a chat template), "
                                 "/v1/models, /health and /metrics; see docs/serving.md. The sampling flags are "
                                 "the defaults of requests that do not set their own.")
  p.add_argument("--model", default=None,
                 help="a released model directory (config.json, safetensors, tokenizer.json); default: the small "
                      "shipped demo model")
  p.add_argument("--large", action="store_true", help="the large shipped demo model instead of the small one")
  p.add_argument("--checkpoint", default=None, help="a training checkpoint directory instead of the shipped model")
  p.add_argument("--dtype", default=None, help="with --model: weights dtype (default the checkpoint's)")
  p.add_argument("--chat-template", default=None, metavar="FILE",
                 help="a Jinja chat template for /v1/chat/completions (default: the model directory's, if any)")
  p.add_argument("--host", default="127.0.0.1", help="address to listen on")
  p.add_argument("--port", type=int, default=8000, help="port to listen on (0: a free one, printed at start)")
  p.add_argument("--max-batch", type=int, default=8, help="requests decoded together (engine slots)")
  p.add_argument("--max-len", type=int, default=512,
                 help="rows per sequence: prompt + max_tokens + the drafts of one step must fit")
  p.add_argument("--page-size", type=int, default=16, help="rows per KV-cache page (must divide --max-len)")
  p.add_argument("--num-pages", type=int, default=None,
                 help="KV-cache pages per layer (default --max-batch x --max-len / --page-size)")
  p.add_argument("--max-waiting", type=int, default=256,
                 help="requests that may wait for a slot; more are answered with HTTP 429")
  p.add_argument("--steps-per-call", type=int, default=4,
                 help="decode steps per device call before the host reads the tokens")
  p.add_argument("--num-drafts", type=_drafts_arg, default=None,
                 help='drafts per step: "auto" (the default; the engine verifies as many as pay at the '
                      "current load), k in 1..K, or 0 to serve without the MTP modules (with --tree: its depth)")
  p.add_argument("--calibrate", action="store_true",
                 help='with --num-drafts "auto": time every width at every batch bucket before listening, '
                      "so the engine picks widths from measured step times, not by trying them on traffic")
  p.add_argument("--draft-policy", default=None, metavar="FILE",
                 help="the measured cost model of --calibrate, read from FILE when it exists, else measured "
                      "and written there (a later start on the same machine and models reuses it)")
  p.add_argument("--prefill-chunk", type=int, default=None, metavar="TOKENS",
                 help="write longer prompts in parts of this many tokens, between the running requests' steps "
                      "(default: whole prompts)")
  p.add_argument("--temperature", type=float, default=0.0, help="default sampling temperature; 0 decodes greedily")
  p.add_argument("--top-k", type=int, default=None, metavar="K", help="default top-k filter (with temperature > 0)")
  p.add_argument("--top-p", type=float, default=None, metavar="P", help="default top-p filter (with temperature > 0)")
  p.add_argument("--seed", type=int, default=0, help="random seed of the engine's sampler (0..2**32-1)")
  _acceptance_flag(p)
  p.add_argument("--eos", type=_eos, default=None, metavar="ID",
                 help="token id that ends a continuation (default the model's EOS); none: never stop early")
  p.add_argument("--tree", type=_tree, default=None, metavar="W1,W2,..",
                 help="draft a tree instead of a chain, e.g. 3,2,1")
  p.add_argument("--max-depth", type=int, default=None, metavar="N",
                 help="let the proposer draft N deep, depths past its K modules cycling through them")
  p.add_argument("--no-warmup", action="store_true",
                 help="skip the warm-up request that compiles the engine before the server listens")
  p.add_argument("--shutdown-timeout", type=float, default=5.0,
                 help="seconds in-flight requests get to finish after SIGTERM before they are cancelled")
  p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"),
                 help="the server's log level")
  p.set_defaults(func=_serve)

  p = sub.add_parser("train", help="train a target and MTP modules on the stdlib byte corpus",
                     description="Unset flags take the defaults of mtp_jax.train.TrainConfig / model_configs "
                                 "(or, with --resume, the checkpoint's settings).")
  p.add_argument("--out", default=None, help="checkpoint directory (default: the --resume directory)")
  p.add_argument("--resume", default=None, help="continue the run saved in this checkpoint directory")
  p.add_argument("--overwrite", action="store_true", help="replace an existing checkpoint at --out")
  p.add_argument("--init-from", default=None, help="starting checkpoint for --recipe mimo")
  p.add_argument("--stop-at", type=int, default=None,
                 help="stop after this step with a checkpoint; --resume continues the same schedule")
  p.add_argument("--recipe", choices=("joint", "mimo"), default=None,
                 help="joint: target and MTP modules from scratch; mimo: new modules on a trained target "
                      "(--init-from)")
  p.add_argument("--preset", choices=sorted(train.PRESETS), default=None,
                 help="the sizes and settings of a shipped demo model (flags given override it)")
  for flag, text in _TRAIN_HELP.items():
    kind = float if flag in ("lr", "weight_decay", "mtp_weight") else int
    p.add_argument("--" + flag.replace("_", "-"), type=kind, default=None, help=text)
  p.add_argument("--stop-gradient", action="store_true", default=None,
                 help="keep the MTP loss out of the target (DeepSeek-V3 does not)")
  for flag, text in _MODEL_FLAGS.items():
    p.add_argument("--" + flag.replace("_", "-"), type=int, default=None, help=text)
  p.set_defaults(func=_train)
  return parser


def main(argv: list[str] | None = None) -> int:
  """Runs a command; a bad argument, file or checkpoint prints one line `mtp-jax: error: ...` and
  returns 2 (argparse's own usage errors exit with 2 as well)."""
  args = build_parser().parse_args(argv)
  try:
    if args.command == "train" and args.out is None and args.resume is None:
      raise validate.InvalidValue("--out", "mtp-jax train: pass --out DIR (or --resume DIR)")
    return args.func(args)
  except (ValueError, TypeError, KeyError, OSError, NotImplementedError) as e:
    message = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
    print("mtp-jax: error: " + " ".join(str(message).split()), file=sys.stderr)
    return 2


if __name__ == "__main__":
  sys.exit(main())
