"""A training checkpoint directory: its files, saved atomically, its config.json read and checked, its models loaded.

    target.safetensors     the target's state dict (HF Llama names, `target_state_dict`)
    mtp.safetensors        the MTP modules' state dict (canonical names, `state_dict`)
    config.json            both configs, the step and the training settings
    optimizer.safetensors  the optax state by pytree path, for resuming (absent in exported models)

Each .safetensors file carries the step in its metadata, so files of two saves are refused.
Nothing here needs the training code (`mtp_jax.train`): the shipped demo models load through here.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np

from mtp_jax import checkpoint, validate
from mtp_jax.config import MtpConfig, TargetConfig, TrainConfig
from mtp_jax.mtp import MtpModel, load_state_dict, state_dict
from mtp_jax.target import TargetModel, load_target_state_dict, target_state_dict

TARGET_FILE, MTP_FILE, CONFIG_FILE, OPTIMIZER_FILE = (
    "target.safetensors", "mtp.safetensors", "config.json", "optimizer.safetensors")


def _fsync(path: str) -> None:
  fd = os.open(path, os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def _siblings(path: str) -> tuple[str, str]:
  """(.NAME.partial, .NAME.previous) beside path: where a save is written, and where the
  checkpoint it replaces waits until the new one is in place."""
  parent, name = os.path.split(os.path.abspath(path))
  return os.path.join(parent, f".{name}.partial"), os.path.join(parent, f".{name}.previous")


def _recover(path: str) -> None:
  """Finishes a save interrupted between its two renames: puts .NAME.previous back at path."""
  _, previous = _siblings(path)
  if not os.path.exists(path) and os.path.isdir(previous):
    os.rename(previous, path)


def _is_checkpoint_dir(path: str) -> bool:
  """An empty directory, or one holding only checkpoint files: safe for a save to replace."""
  return os.path.isdir(path) and set(os.listdir(path)) <= {TARGET_FILE, MTP_FILE, CONFIG_FILE, OPTIMIZER_FILE}


def save_checkpoint(path, target: TargetModel, mtp: MtpModel, *, step: int = 0,
                    train_config: TrainConfig | None = None, opt_state=None) -> None:
  """Writes target.safetensors, mtp.safetensors, config.json (+ optimizer.safetensors) under path,
  atomically: an interrupt at any point leaves path holding one complete checkpoint.

  The files go to `.NAME.partial` beside path and are fsynced; an existing checkpoint at path
  moves to `.NAME.previous`, the new directory is renamed to path, and the previous one is
  removed (a save interrupted between the two renames is finished by the next read). Each
  .safetensors file carries the step in its metadata, so `load_checkpoint` refuses files from
  different steps. path must not exist, or be a directory holding only checkpoint files.
  """
  path = os.path.abspath(os.fspath(path))
  step = validate.integer("step", step, 0)
  _recover(path)
  if os.path.exists(path) and not _is_checkpoint_dir(path):
    raise validate.InvalidValue("path", f"{path} exists and holds files other than a checkpoint's; "
                                        "pick a new directory")
  partial, previous = _siblings(path)
  for stale in (partial, previous):
    if os.path.isdir(stale):
      shutil.rmtree(stale)
  os.makedirs(partial)
  files = {TARGET_FILE: target_state_dict(target), MTP_FILE: state_dict(mtp)}
  if opt_state is not None:
    files[OPTIMIZER_FILE] = _flat_opt_state(opt_state)
  for name, tensors in files.items():
    checkpoint.save_tensors(os.path.join(partial, name), tensors, metadata={"step": str(step)})
    _fsync(os.path.join(partial, name))
  meta = dict(target=dataclasses.asdict(target.cfg), mtp=dataclasses.asdict(mtp.cfg), step=step,
              train=None if train_config is None else dataclasses.asdict(train_config))
  with open(os.path.join(partial, CONFIG_FILE), "w") as f:
    json.dump(meta, f, indent=2)
    f.flush()
    os.fsync(f.fileno())
  _fsync(partial)
  if os.path.exists(path):
    os.rename(path, previous)
  os.rename(partial, path)
  _fsync(os.path.dirname(path))
  if os.path.isdir(previous):
    shutil.rmtree(previous)


def check_out_dir(out_dir, *, resume_from=None, overwrite: bool = False) -> str:
  """out_dir as an absolute path, checked before any training: writable, and not an existing
  checkpoint unless it is the one being resumed or overwrite is set."""
  path = os.path.abspath(os.fspath(out_dir))
  overwrite = validate.flag("overwrite", overwrite)
  _recover(path)
  resuming = resume_from is not None and os.path.abspath(os.fspath(resume_from)) == path
  if os.path.exists(path):
    if not os.path.isdir(path):
      raise validate.InvalidValue("out_dir", f"out_dir={path} is a file, not a directory")
    if os.listdir(path) and not resuming:
      if not overwrite:
        raise validate.InvalidValue("out_dir", f"out_dir={path} already exists and is not empty; pass "
                                               "overwrite=True (--overwrite) to replace it, or resume from it")
      if not _is_checkpoint_dir(path):
        raise validate.InvalidValue("out_dir", f"out_dir={path} holds files other than a checkpoint's; "
                                               "overwrite replaces only checkpoints")
  partial, _ = _siblings(path)
  try:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    os.makedirs(partial, exist_ok=True)
    os.rmdir(partial)
  except OSError as e:
    raise validate.InvalidValue("out_dir", f"out_dir={path} is not writable: {e}") from e
  return path


def read_config(path) -> dict:
  """config.json of a checkpoint: {"target": TargetConfig, "mtp": MtpConfig, "step": int,
  "train": TrainConfig or None}."""
  _recover(os.fspath(path))
  file = os.path.join(os.fspath(path), CONFIG_FILE)
  if not os.path.isfile(file):
    raise FileNotFoundError(f"{path} is not a checkpoint directory: no {CONFIG_FILE}")
  with open(file) as f:
    try:
      meta = json.load(f)
    except json.JSONDecodeError as e:
      raise validate.InvalidValue(CONFIG_FILE, f"{file}: not valid JSON (truncated?): {e}") from e
  if not isinstance(meta, dict):
    raise validate.InvalidType(CONFIG_FILE, f"{file}: must hold a JSON object, got {type(meta).__name__}")
  missing = [key for key in ("target", "mtp", "step") if key not in meta]
  if missing:
    raise validate.InvalidValue(CONFIG_FILE, f"{file}: malformed checkpoint config, missing {missing}")
  try:
    configs = {}
    for key, cls in (("target", TargetConfig), ("mtp", MtpConfig), ("train", TrainConfig)):
      fields = meta.get(key)
      if fields is None and key == "train":
        configs[key] = None
        continue
      validate.instance(f"{key}", fields, dict, "a JSON object")
      unknown = sorted(set(fields) - {f.name for f in dataclasses.fields(cls)})
      if unknown:
        raise validate.InvalidValue(f"{key}.{unknown[0]}", f"{key}: unknown field(s) {unknown}")
      configs[key] = cls(**fields)
    step = validate.integer("step", meta["step"], 0)
  except (validate.InvalidValue, validate.InvalidType) as e:
    raise validate.renamed(e, file) from e
  except TypeError as e:  # a required field missing
    raise validate.InvalidValue(CONFIG_FILE, f"{file}: malformed checkpoint config ({e})") from e
  return dict(configs, step=step)


def load_checkpoint(path) -> tuple[TargetModel, MtpModel]:
  """(target, mtp) from a checkpoint directory; errors name the file and the offending tensor."""
  meta = read_config(path)
  path = os.fspath(path)
  target_file, mtp_file = os.path.join(path, TARGET_FILE), os.path.join(path, MTP_FILE)
  check_step(target_file, meta["step"])
  check_step(mtp_file, meta["step"])
  target = load_target_state_dict(meta["target"], checkpoint.load_tensors(target_file))
  mtp = load_state_dict(meta["mtp"], checkpoint.load_tensors(mtp_file))
  return target, mtp


def check_step(file: str, step: int) -> None:
  """Refuses a checkpoint file written at another step than config.json says (files of two saves).
  Files from before steps were stored (no "step" metadata) are taken as they are."""
  saved = checkpoint.read_metadata(file).get("step")
  if saved is not None and saved != str(step):
    raise validate.InvalidValue(os.path.basename(file), f"{file} was saved at step {saved} but config.json "
                                                        f"says step {step}: the checkpoint mixes two saves")


def _flat_opt_state(opt_state) -> dict[str, np.ndarray]:
  leaves = jax.tree_util.tree_flatten_with_path(opt_state)[0]
  return {jax.tree_util.keystr(p): np.asarray(x) for p, x in leaves}


def load_optimizer_state(file, template):
  """The optax state saved in `file`, in the structure of `template` (tx.init of the same params)."""
  saved = checkpoint.load_tensors(file)
  leaves, treedef = jax.tree_util.tree_flatten_with_path(template)
  names = [jax.tree_util.keystr(p) for p, _ in leaves]
  missing = [n for n in names if n not in saved]
  if missing or len(saved) != len(names):
    raise KeyError(f"{file}: optimizer state does not match this model and recipe; missing {missing[:3]}, "
                   f"unexpected {sorted(set(saved) - set(names))[:3]}")
  out = []
  for name, (_, like) in zip(names, leaves):
    value = saved[name]
    if like.ndim == 0 and value.shape == (1,):  # safetensors writes a scalar as [1]
      value = value.reshape(())
    if value.shape != like.shape:
      raise ValueError(f"{file}: tensor {name!r} has shape {value.shape}, expected {like.shape}")
    out.append(jnp.asarray(value, like.dtype))
  return jax.tree_util.tree_unflatten(treedef, out)
