"""The model a server runs, with its text side: a demo model or training checkpoint (byte tokenizer) or a
released model directory (tokenizer.json, its chat template), and chat messages rendered through a Jinja template.

Needs jinja2 (the `serve` extra), for the chat templates.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Sequence

import jinja2.sandbox

from mtp_jax import data, grammar as grammar_lib, pretrained, validate
from mtp_jax.demo_models import load_demo
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
