"""`mtp-jax demo / generate / train` through cli.main, and `python -m mtp_jax.cli`."""

import os
import subprocess
import sys

import pytest

from mtp_jax import cli, train

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
  assert cli.main(["generate", "--small", "--prompt", prompt, "--max-new-tokens", "24"]) == 0
  captured = capsys.readouterr()
  assert captured.out.startswith(prompt) and len(captured.out) > len(prompt) + 8
  assert "target calls" in captured.err


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
