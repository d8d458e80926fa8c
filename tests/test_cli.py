"""`mtp-jax demo / generate / train` through cli.main, and `python -m mtp_jax.cli`."""

import argparse
import json
import os
import re
import subprocess
import sys

import pytest

import mtp_jax
from mtp_jax import cli, demo, grammar, train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_TRAIN = ["--batch-size", "2", "--seq-len", "16", "--hidden-size", "32", "--num-layers", "1",
              "--intermediate-size", "64", "--num-modules", "1", "--warmup-steps", "1", "--eval-every", "2"]


def test_demo_prints_the_table(capsys):
  argv = ["demo", "--small", "--num-prompts", "2", "--max-new-tokens", "16", "--repeats", "1", "--ks", "1", "3",
          "--tree", "2,2,1"]
  assert cli.main(argv) == 0
  out = capsys.readouterr().out
  assert "\nk=1 " in out and "\nk=3 " in out and "\nk=2 " not in out and "\ntree 2,2,1 |   11 | " in out
  assert "speculative output equals plain greedy output for every k and tree" in out
  assert "demo model: small" in out and "\nbest: " in out


def test_demo_refuses_a_bad_tree(capsys):
  with pytest.raises(SystemExit) as e:  # argparse: usage and one error line
    cli.main(["demo", "--small", "--tree", "2,0"])
  assert e.value.code == 2
  assert "argument --tree: widths like 3,2,1 (children per node at each depth): widths[1] must be an int in " \
         "1..2147483647, got 0" in capsys.readouterr().err


def test_generate_streams_the_continuation(capsys):
  prompt = "    def __init__(self, "
  assert cli.main(["generate", "--small", "--prompt", prompt, "--max-new-tokens", "24", "--eos", "none"]) == 0
  captured = capsys.readouterr()
  assert captured.out.startswith(prompt) and len(captured.out) > len(prompt) + 8
  assert captured.err.startswith("[24 tokens, ")  # --eos none: no early stop


def _api_continuation(prompt, max_new_tokens, constraint, **kwargs):
  """What mtp_jax.generate gives for the CLI's settings on the small demo model, as text."""
  target, proposer, tok = demo.load_demo(name="small", max_depth=kwargs.pop("max_depth", None))
  g = constraint(grammar.byte_vocab(), eos_token_id=tok.eos_id)
  out = mtp_jax.generate(target, proposer, [tok.encode(prompt, bos=False)], max_new_tokens, eos_token_id=tok.eos_id,
                         grammar=g, **kwargs)
  return bytes(t for t in out.tokens[0] if t < 256).decode()


def test_generate_regex_tree_and_max_depth_equal_the_api(capsys):
  argv = ["generate", "--small", "--prompt", "x = ", "--max-new-tokens", "8", "--regex", "[0-9]{3}", "--tree",
          "2,1,1,1", "--max-depth", "4"]
  assert cli.main(argv) == 0
  out = capsys.readouterr().out
  assert re.fullmatch(r"x = [0-9]{3}\n", out), out
  expected = _api_continuation("x = ", 8, lambda v, **kw: grammar.from_regex("[0-9]{3}", v, **kw),
                               tree=mtp_jax.TreeSpec((2, 1, 1, 1)), max_depth=4)
  assert out == "x = " + expected + "\n"


def test_generate_json_schema_and_sampling_flags_equal_the_api(tmp_path, capsys):
  schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
  (tmp_path / "schema.json").write_text(json.dumps(schema))
  argv = ["generate", "--small", "--prompt", "x = ", "--max-new-tokens", "16", "--json-schema",
          f"@{tmp_path / 'schema.json'}", "--temperature", "0.8", "--top-k", "5", "--top-p", "0.9", "--seed", "3",
          "--num-drafts", "2"]
  assert cli.main(argv) == 0
  out = capsys.readouterr().out
  expected = _api_continuation("x = ", 16, lambda v, **kw: grammar.from_json_schema(schema, v, **kw),
                               num_drafts=2, temperature=0.8, top_k=5, top_p=0.9, seed=3)
  assert out == "x = " + expected + "\n"
  if len(expected.encode()) < 16:  # ended at EOS: a complete match
    assert isinstance(json.loads(expected)["n"], int)


def test_every_flag_has_a_help_text():
  parser = cli.build_parser()
  commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
  assert sorted(commands) == ["demo", "generate", "serve", "train"]
  for name, sub in commands.items():
    for action in sub._actions:
      if not isinstance(action, argparse._HelpAction):
        assert action.help, (name, action.option_strings)


def test_generate_reports_bad_arguments(capsys):
  assert cli.main(["generate", "--small", "--prompt", "x", "--num-drafts", "5"]) == 2
  assert capsys.readouterr().err == "mtp-jax: error: --num-drafts must be an int in 0..3, got 5\n"
  assert cli.main(["train", "--steps", "2"]) == 2
  assert "pass --out DIR" in capsys.readouterr().err


def test_train_stop_resume_and_mimo(tmp_path, capsys):
  run, mimo = str(tmp_path / "run"), str(tmp_path / "mimo")
  assert cli.main(["train", "--out", run, "--steps", "4", "--stop-at", "2", *TINY_TRAIN]) == 0
  assert train.read_config(run)["step"] == 2
  assert cli.main(["train", "--resume", run]) == 0
  meta = train.read_config(run)
  assert meta["step"] == 4 and meta["train"].steps == 4 and meta["train"].seq_len == 16
  assert meta["mtp"].num_modules == 1 and meta["target"].hidden_size == 32
  assert "held-out top-1 accuracy" in capsys.readouterr().out
  assert cli.main(["train", "--resume", run, "--hidden-size", "64"]) == 2
  assert "model sizes from the checkpoint" in capsys.readouterr().err

  assert cli.main(["train", "--recipe", "mimo", "--init-from", run, "--num-modules", "3", "--out", mimo,
                   "--steps", "2", "--batch-size", "2", "--seq-len", "16", "--warmup-steps", "1"]) == 0
  target, proposer = train.load_checkpoint(mimo)
  assert proposer.cfg.num_modules == 3 and target.cfg.hidden_size == 32
  capsys.readouterr()
  assert cli.main(["train", "--recipe", "mimo", "--init-from", run, "--hidden-size", "64", "--out", mimo]) == 2
  assert "only --num-modules may change" in capsys.readouterr().err


def test_python_dash_m_runs_the_cli():
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  proc = subprocess.run([sys.executable, "-m", "mtp_jax.cli", "demo", "--help"],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr
  assert "usage: mtp-jax demo" in proc.stdout and "--num-prompts" in proc.stdout
