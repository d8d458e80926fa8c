"""The model a server runs, with its text side: a demo model or training checkpoint (byte tokenizer) or a
released model directory (tokenizer.json, its chat template), and chat messages rendered through a Jinja template.

Needs jinja2 (the `serve` extra), for the chat templates.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import os
import queue
import re
import threading
from collections.abc import Callable, Sequence

import jinja2.sandbox
from outlines_core.json_schema import build_regex_from_schema

from mtp_jax import data, grammar as grammar_lib, pretrained, validate
from mtp_jax.demo_models import load_demo
from mtp_jax.serving.engine_thread import settle
from mtp_jax.mtp import MtpModel
from mtp_jax.target import TargetModel


@dataclasses.dataclass(frozen=True)
class ServedModel:
  """A model with its text side.

  encode(text, special) -> int[len] ids (special: add the tokenizer's special tokens, as for a
  raw prompt; a chat template writes its own); decode(ids) -> text, special tokens skipped and a
  cut multi-byte character as U+FFFD; vocab: token byte strings by id (grammars need them; None
  for tokenizer.json models, whose byte strings are not read yet); chat_template: a Jinja
  template over `messages` (None: no chat endpoint).
  """

  name: str
  target: TargetModel
  proposer: MtpModel | None
  encode: Callable[[str, bool], list[int]]
  decode: Callable[[Sequence[int]], str]
  eos_token_id: int | None
  vocab: list[bytes | None] | None = None
  chat_template: str | None = None
  bos_token: str = ""
  eos_token: str = ""


def load_model(model_dir=None, *, demo_name: str = "small", checkpoint=None, dtype=None,
               max_depth: int | None = None, chat_template: str | None = None) -> ServedModel:
  """The model a server runs: a released model directory (config.json, safetensors, tokenizer.json,
  its chat template from tokenizer_config.json or chat_template.jinja), or else a shipped demo model
  (`demo_name`) or training checkpoint with the byte tokenizer. chat_template: a template text that
  replaces the directory's (or gives the demo model one)."""
  if model_dir is None:
    target, proposer, tok = load_demo(checkpoint, name=demo_name, max_depth=max_depth)
    # Training windows carry no BOS, so neither do prompts.
    return ServedModel(name=f"mtp-jax-demo-{demo_name}" if checkpoint is None else os.path.basename(
        os.path.normpath(checkpoint)), target=target, proposer=proposer, encode=lambda text, special: tok.encode(
        text, bos=False), decode=data.decode, eos_token_id=tok.eos_id, vocab=grammar_lib.byte_vocab(),
        chat_template=chat_template)
  target, proposer, config = pretrained.from_pretrained(model_dir, dtype=dtype, max_depth=max_depth)
  tok = pretrained.load_tokenizer(model_dir)
  eos = config.get("eos_token_id")
  eos = eos[0] if isinstance(eos, list) else eos
  settings = _tokenizer_config(model_dir)
  return ServedModel(
      name=os.path.basename(os.path.normpath(model_dir)), target=target, proposer=proposer,
      encode=lambda text, special: tok.encode(text, add_special_tokens=special).ids,
      decode=lambda ids: tok.decode(list(ids), skip_special_tokens=True), eos_token_id=eos,
      chat_template=chat_template if chat_template is not None else _chat_template(model_dir, settings),
      bos_token=_token_text(settings.get("bos_token")), eos_token=_token_text(settings.get("eos_token")))


def _tokenizer_config(model_dir) -> dict:
  file = os.path.join(os.fspath(model_dir), "tokenizer_config.json")
  if not os.path.isfile(file):
    return {}
  try:
    with open(file, encoding="utf-8") as f:
      settings = json.load(f)
  except (OSError, ValueError) as e:
    raise validate.InvalidValue(file, f"{file} is not a JSON file: {e}") from e
  if not isinstance(settings, dict):
    raise validate.InvalidValue(file, f"{file} must hold a JSON object")
  return settings


def _chat_template(model_dir, settings: dict) -> str | None:
  file = os.path.join(os.fspath(model_dir), "chat_template.jinja")
  if os.path.isfile(file):
    with open(file, encoding="utf-8") as f:
      return f.read()
  template = settings.get("chat_template")
  if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
    template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"), None)
  return template if isinstance(template, str) else None


def _token_text(token) -> str:
  if isinstance(token, dict):  # {"content": "<s>", ...} as tokenizer_config.json writes added tokens
    token = token.get("content")
  return token if isinstance(token, str) else ""


def chat_prompt(template: str, messages: list[dict], *, bos_token: str = "", eos_token: str = "") -> str:
  """The prompt text of chat `messages` ([{"role": str, "content": str}, ...]) under a Jinja chat
  template (rendered sandboxed, with add_generation_prompt=True); a template error raises
  validate.InvalidValue naming "messages"."""
  env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

  def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)

  env.globals["raise_exception"] = raise_exception
  try:
    return env.from_string(template).render(messages=messages, add_generation_prompt=True, bos_token=bos_token,
                                            eos_token=eos_token)
  except jinja2.exceptions.TemplateError as e:
    raise validate.InvalidValue("messages", f"the chat template refused the messages: {e}") from e


# outlines-core's build time for a counted repetition of a wide class (any character but a few, as a
# JSON string's minLength / maxLength become) doubles per count: {10,} took 0.3 s here, {12,} 1.1 s,
# {14,} 3.9 s, {16,} past 20 s, and {100000,} held a core and 2.8 GB for minutes. Counts above
# this bound on such an atom are refused before building.
MAX_WIDE_REPEAT = 10
_COUNT = re.compile(r"\{(\d+)(?:,(\d*))?\}")


def schema_text(model: ServedModel, response_format) -> str | None:
  """The JSON schema text (keys sorted) an OpenAI response_format asks for; None for plain text.
  Raises validate.InvalidValue naming "response_format"."""
  if response_format is None:
    return None
  kind = response_format.get("type") if isinstance(response_format, dict) else None
  if kind == "text":
    return None
  if kind == "json_object":
    schema = {"type": "object"}
  elif kind == "json_schema":
    spec = response_format.get("json_schema")
    schema = spec.get("schema") if isinstance(spec, dict) else None
    if not isinstance(schema, dict):
      raise validate.InvalidValue("response_format", 'response_format json_schema needs {"json_schema": '
                                                     '{"schema": {...}}}')
  else:
    raise validate.InvalidValue("response_format", 'response_format must be {"type": "text"}, {"type": '
                                                   '"json_object"} or {"type": "json_schema", "json_schema": '
                                                   '{"schema": ...}}')
  if model.vocab is None:
    raise validate.InvalidValue("response_format", "response_format needs the token byte strings of the vocabulary, "
                                                   "which are read for the byte tokenizer only (not yet from "
                                                   "tokenizer.json)")
  if model.eos_token_id is None:
    raise validate.InvalidValue("response_format", "response_format ends the text with EOS, and the server runs "
                                                   "without one (--eos none)")
  return json.dumps(schema, sort_keys=True)


def wide_repeats(pattern: str) -> list[str]:
  """The counted repetitions in a regex (`x{n}`, `x{n,}`, `x{n,m}`) over an atom holding a negated
  class or `.` whose count exceeds MAX_WIDE_REPEAT, as their text."""
  found, groups, atom, i = [], [], None, 0
  while i < len(pattern):
    c = pattern[i]
    count = _COUNT.match(pattern, i) if c == "{" else None
    if count is not None and atom is not None:
      n = max(int(count[1]), int(count[2] or 0))
      body = pattern[atom:i]
      if n > MAX_WIDE_REPEAT and ("[^" in body or re.search(r"(?<!\\)\.", body)):
        found.append(body + count[0])
      i = count.end()
      continue
    if c == "(":
      groups.append(i)
      atom, i = None, i + 1
    elif c == ")":
      atom, i = groups.pop() if groups else i, i + 1
    elif c == "[":
      j = i + 1 + (pattern[i + 1:i + 2] == "^")
      j += pattern[j:j + 1] == "]"  # a leading ] is a member
      while j < len(pattern) and pattern[j] != "]":
        j += 2 if pattern[j] == "\\" else 1
      atom, i = i, j + 1
    else:
      atom, i = i, i + (2 if c == "\\" else 1)
  return found


class SchemaGrammars:
  """The grammars of JSON schemas over one model's vocabulary, as a server needs them: built on a
  daemon thread of their own, one at a time (a build holds a core; a build still running at exit
  does not keep the process), cached by schema text (the last `cache_size`), and refused (400,
  validate.InvalidValue naming "response_format") when a schema's regex repeats a wide class
  past MAX_WIDE_REPEAT or its build takes longer than timeout_s."""

  def __init__(self, model: ServedModel, *, timeout_s: float = 60.0, cache_size: int = 32):
    self.model = model
    self.timeout_s = validate.real("timeout_s", timeout_s, 0.0, lo_open=True)
    self._build = functools.lru_cache(maxsize=cache_size)(self._build_uncached)
    self._jobs: queue.SimpleQueue = queue.SimpleQueue()
    self._thread = threading.Thread(target=self._work, name="mtp-jax-grammar", daemon=True)

  async def get(self, schema: str) -> grammar_lib.Grammar:
    """The grammar of `schema` (a JSON text), built on the grammar thread."""
    if not self._thread.is_alive():
      self._thread.start()
    loop = asyncio.get_running_loop()
    future = loop.create_future()
    self._jobs.put((schema, loop, future))
    try:
      return await asyncio.wait_for(future, self.timeout_s)
    except TimeoutError as e:  # the build goes on and is cached: the same schema later comes at once
      raise validate.InvalidValue("response_format", f"response_format: the schema's grammar was not built within "
                                                     f"{self.timeout_s:g} s; a simpler schema builds faster") from e

  def _build_uncached(self, schema: str) -> grammar_lib.Grammar:
    try:
      pattern = build_regex_from_schema(schema, None)
    except Exception:  # outlines-core raises several types: from_json_schema refuses it by name
      return grammar_lib.from_json_schema(schema, self.model.vocab, eos_token_id=self.model.eos_token_id)
    wide = wide_repeats(pattern)
    if wide:
      raise validate.InvalidValue("response_format", f"response_format: the schema repeats a character class "
                                                     f"{len(wide)} time(s) beyond {MAX_WIDE_REPEAT} (e.g. "
                                                     f"{wide[0][-40:]!r}: a string's minLength / maxLength over "
                                                     f"{MAX_WIDE_REPEAT}), whose grammar would take minutes to "
                                                     f"build; use a pattern or enum instead")
    return grammar_lib.from_regex(pattern, self.model.vocab, eos_token_id=self.model.eos_token_id)

  def _work(self) -> None:
    while True:
      schema, loop, future = self._jobs.get()
      try:
        result, error = self._build(schema), None
      except Exception as e:  # handed to the request, which answers with it
        result, error = None, e
      try:
        loop.call_soon_threadsafe(settle, future, result, error)
      except RuntimeError:  # the loop closed at shutdown: nobody waits
        pass
