"""Byte-level tokenizer and a small corpus cut from the Python standard library's sources.

See docs/corpus.md for why the corpus is the stdlib's own .py files.
"""

from __future__ import annotations

import functools
import os
import sysconfig
from collections.abc import Iterable, Iterator

import numpy as np

BOS_ID = 256
EOS_ID = 257
VOCAB_SIZE = 258

# Files present (with these paths) in CPython 3.10 through 3.13; modules that became packages
# or were removed in that range (re, pathlib, zipfile, asyncore, ...) are left out.
CORPUS_FILES = (
    "abc.py", "argparse.py", "ast.py", "asyncio/locks.py", "asyncio/queues.py", "base64.py",
    "bisect.py", "calendar.py", "cmd.py", "collections/__init__.py", "colorsys.py",
    "concurrent/futures/_base.py", "configparser.py", "contextlib.py", "copy.py", "csv.py",
    "dataclasses.py", "datetime.py", "difflib.py", "email/feedparser.py", "email/header.py",
    "email/utils.py", "enum.py", "fnmatch.py", "fractions.py", "functools.py", "getopt.py",
    "gettext.py", "glob.py", "graphlib.py", "gzip.py", "heapq.py", "html/parser.py",
    "http/client.py", "http/cookies.py", "inspect.py", "ipaddress.py", "json/decoder.py",
    "json/encoder.py", "json/scanner.py", "logging/__init__.py", "numbers.py", "optparse.py",
    "pprint.py", "queue.py", "random.py", "sched.py", "secrets.py", "shlex.py", "shutil.py",
    "statistics.py", "string.py", "tempfile.py", "textwrap.py", "threading.py", "tokenize.py",
    "traceback.py", "typing.py", "unittest/case.py", "urllib/parse.py", "wave.py", "weakref.py",
    "xml/dom/minidom.py", "xml/etree/ElementTree.py",
)
# A fixed mix of sizes and styles (prose-heavy, numeric, parsers) so held-out loss means something.
HELDOUT_FILES = (
    "colorsys.py", "difflib.py", "email/feedparser.py", "fractions.py", "heapq.py",
    "json/decoder.py", "shlex.py", "textwrap.py",
)
TRAIN_FILES = tuple(f for f in CORPUS_FILES if f not in HELDOUT_FILES)


def encode(text: str, *, bos: bool = True) -> list[int]:
  """UTF-8 bytes of `text` as ids 0..255, after BOS_ID when `bos`; int[len] list."""
  return ([BOS_ID] if bos else []) + list(text.encode("utf-8"))


def decode(ids: Iterable[int]) -> str:
  """Inverse of `encode` for int[len] ids: skips BOS, stops at the first EOS.

  Byte runs that are not valid UTF-8 (a cut multi-byte character) decode to U+FFFD.
  """
  out = bytearray()
  for i in ids:
    i = int(i)
    if i == EOS_ID:
      break
    if i == BOS_ID:
      continue
    if not 0 <= i < 256:
      raise ValueError(f"token id {i} is outside the byte vocabulary [0, {VOCAB_SIZE})")
    out.append(i)
  return out.decode("utf-8", errors="replace")


class ByteTokenizer:
  """`encode` / `decode` as an object, for code that expects a tokenizer with ids and a vocab size."""

  vocab_size = VOCAB_SIZE
  bos_id = BOS_ID
  eos_id = EOS_ID

  def encode(self, text: str, *, bos: bool = True) -> list[int]:
    """int[len] ids; see the module-level `encode`."""
    return encode(text, bos=bos)

  def decode(self, ids: Iterable[int]) -> str:
    """Text of int[len] ids; see the module-level `decode`."""
    return decode(ids)


def _stdlib_root() -> str:
  return sysconfig.get_paths()["stdlib"]


@functools.lru_cache(maxsize=None)
def _read_files() -> dict[str, bytes]:
  root = _stdlib_root()
  found = {}
  for name in CORPUS_FILES:
    path = os.path.join(root, *name.split("/"))
    if os.path.isfile(path):
      with open(path, "rb") as f:
        found[name] = f.read()
  # Some distributions trim the stdlib; a few gaps are fine, a gutted one is not.
  if 2 * len(found) < len(CORPUS_FILES):
    raise RuntimeError(
        f"only {len(found)} of {len(CORPUS_FILES)} corpus files found under {root}; "
        "this interpreter's standard library sources look incomplete")
  return found


def load_corpus(split: str) -> bytes:
  """The "train" or "heldout" corpus: its files' bytes joined by newlines, in file-name order.

  Deterministic for a given Python version (the files' contents change between releases).
  """
  names = {"train": TRAIN_FILES, "heldout": HELDOUT_FILES}.get(split)
  if names is None:
    raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
  files = _read_files()
  present = [files[n] for n in names if n in files]
  if not present:
    raise RuntimeError(f"none of the {split} corpus files exist under {_stdlib_root()}")
  return b"\n".join(present)


def batches(data: bytes, *, batch_size: int, seq_len: int, seed: int) -> Iterator[np.ndarray]:
  """Endless random windows of `data`: int32[batch_size, seq_len + 1] per step.

  Windows start anywhere (no BOS), so inputs are [:, :-1] and targets [:, 1:].
  The same seed gives the same sequence of batches.
  """
  tokens = np.frombuffer(data, dtype=np.uint8)
  span = seq_len + 1
  if len(tokens) < span:
    raise ValueError(f"data has {len(tokens)} bytes, fewer than seq_len + 1 = {span}")
  rng = np.random.default_rng(seed)
  offsets = np.arange(span)
  while True:
    starts = rng.integers(0, len(tokens) - span + 1, size=batch_size)
    yield tokens[starts[:, None] + offsets].astype(np.int32)


def heldout_prompts(n: int, *, prompt_len: int, seed: int) -> list[list[int]]:
  """`n` distinct prompts of `prompt_len` byte ids each, cut from held-out text.

  Each starts at the beginning of a non-empty line and carries no BOS, like training windows.
  """
  if prompt_len < 1:
    raise ValueError(f"prompt_len must be positive, got {prompt_len}")
  tokens = np.frombuffer(load_corpus("heldout"), dtype=np.uint8)
  starts = np.concatenate([[0], np.flatnonzero(tokens == ord("\n")) + 1])
  starts = starts[starts + prompt_len <= len(tokens)]
  starts = starts[tokens[starts] != ord("\n")]
  if n > len(starts):
    raise ValueError(
        f"asked for {n} prompts of {prompt_len} bytes; held-out text has {len(starts)}")
  chosen = np.random.default_rng(seed).choice(starts, size=n, replace=False)
  return [tokens[s:s + prompt_len].tolist() for s in chosen]
